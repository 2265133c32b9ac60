"""The C runtime's transports: InprocGroup, Transport (in-process, sockets, Python callbacks,
NCCL), nccl_unique_id, and the abort signal over a torch.distributed Store (_store_signal).

What this is: ctypes wrappers over include/zbpp.h's transports, each owning one C handle (_Handle).
Python callbacks handed to C (a callback transport's isend/irecv/wait/cancel/abort, the abort
signal's poll and publish) stay referenced by the Transport for its life, and never let an
exception escape into C: they note it and return a non-OK status.
What this is not: the transport over torch.distributed (distributed.py's TorchTransport, which makes
a callback Transport) or the runner that uses one (runtime.py). Import these names from
zbpp.runtime.
"""

import ctypes
import os as _os

from . import _lib
from ._runtime_backend import ZB_ERR_REMOTE, ZB_OK, Backend, _Handle, _P, _PP

_c = ctypes

NCCL_UNIQUE_ID_BYTES = 128

_IsendFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _c.c_size_t, _PP)
_IrecvFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _c.c_size_t, _PP)
_WaitFn = _c.CFUNCTYPE(_c.c_int, _P, _P, _c.c_double)
_CancelFn = _c.CFUNCTYPE(None, _P, _P)
_AbortFn = _c.CFUNCTYPE(None, _P, _c.c_char_p)
_SignalPollFn = _c.CFUNCTYPE(_c.c_int, _P, _P, _c.c_size_t)
_SignalPublishFn = _c.CFUNCTYPE(None, _P, _c.c_char_p)


class _TransportCallbacks(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("user", _P),
        ("isend_cb", _IsendFn),
        ("irecv_cb", _IrecvFn),
        ("wait_cb", _WaitFn),
        ("cancel_cb", _CancelFn),
        ("abort_cb", _AbortFn),
    ]


class _NcclGroupConfig(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("rank", _c.c_int32),
        ("ranks", _c.c_int32),
        ("unique_id", _c.POINTER(_c.c_uint8)),
        ("backend", _P),
        ("timeout_s", _c.c_double),
        ("signal_poll", _SignalPollFn),
        ("signal_publish", _SignalPublishFn),
        ("signal_user", _P),
    ]


ZB_NCCL_GROUP_CONFIG_VERSION = 1


class _NcclConfig(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("rank", _c.c_int32),
        ("ranks", _c.c_int32),
        ("unique_id", _c.POINTER(_c.c_uint8)),
        ("comm", _P),
        ("backend", _P),
        ("schedule", _P),
        ("timeout_s", _c.c_double),
        ("signal_poll", _SignalPollFn),
        ("signal_publish", _SignalPublishFn),
        ("signal_user", _P),
    ]


ZB_NCCL_TRANSPORT_CONFIG_VERSION = 1


class _SocketConfig(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("rank", _c.c_int32),
        ("ranks", _c.c_int32),
        ("fds", _c.POINTER(_c.c_int32)),
        ("signal_poll", _SignalPollFn),
        ("signal_publish", _SignalPublishFn),
        ("signal_user", _P),
    ]


ZB_SOCKET_TRANSPORT_CONFIG_VERSION = 1


def nccl_unique_id():
    """A fresh ncclUniqueId as NCCL_UNIQUE_ID_BYTES bytes: make it on one rank, send it to all."""
    buf = (_c.c_uint8 * NCCL_UNIQUE_ID_BYTES)()
    _lib.call("zb_nccl_unique_id", [_c.POINTER(_c.c_uint8)], buf)
    return bytes(buf)


class InprocGroup(_Handle):
    """Ranks as threads of this process (tests, single-process runs)."""

    _destroy = "zb_inproc_group_destroy"

    def __init__(self, ranks):
        super().__init__()
        _lib.call("zb_inproc_group_create", [_PP, _c.c_int32], _c.byref(self._h), ranks)


class Transport(_Handle):
    """A rank's transport: in-process (`Transport.inproc(group, rank)`), over connected sockets
    (`Transport.socket(rank, ranks, fds)`), with Python callbacks (`Transport.callbacks(impl, rank,
    ranks)`, impl having isend/irecv/wait/cancel/abort), NCCL (`Transport.nccl(...)`), or device
    buffers staged through host memory over a host one (`Transport.staged(inner)`); collectives on
    device memory over NCCL (`Transport.nccl_group(...)`). `rank`: this rank of the group."""

    _destroy = "zb_transport_destroy"
    rank = None
    device_collectives = False  # all_reduce / broadcast take device tensors as they are (nccl_group)

    @classmethod
    def inproc(cls, group, rank):
        t = cls()
        t._group, t.rank = group, rank
        _lib.call("zb_transport_create_inproc", [_PP, _P, _c.c_int32], _c.byref(t._h), group.handle, rank)
        return t

    @classmethod
    def callbacks(cls, impl, rank, ranks):
        """impl.isend(peer, tag, addr, nbytes) -> request id (int > 0), impl.irecv(...) likewise,
        impl.wait(request, timeout_s) -> a status code (ZB_OK, ZB_ERR_TIMEOUT, ZB_ERR_REMOTE),
        impl.cancel(request), impl.abort(reason: str). A callback that raises gives ZB_ERR_REMOTE;
        impl.last_error should then say why (the binding adds it to the runner's message)."""
        t = cls()
        t._impl, t.rank = impl, rank
        cb = _TransportCallbacks()
        cb.struct_size = _c.sizeof(_TransportCallbacks)

        def start(fn):
            def cb_start(_user, peer, tag, buf, nbytes, request):
                try:
                    request[0] = fn(int(peer), int(tag), buf or 0, int(nbytes))
                    return ZB_OK
                except BaseException as exc:  # noqa: BLE001
                    impl.note_error(exc)
                    return ZB_ERR_REMOTE
            return cb_start

        def wait(_user, request, timeout_s):
            try:
                return int(impl.wait(int(request or 0), float(timeout_s)))
            except BaseException as exc:  # noqa: BLE001
                impl.note_error(exc)
                return ZB_ERR_REMOTE

        def cancel(_user, request):
            try:
                impl.cancel(int(request or 0))
            except BaseException as exc:  # noqa: BLE001
                impl.note_error(exc)

        def abort(_user, reason):
            try:
                impl.abort(reason.decode("utf-8", "replace") if reason else "")
            except BaseException as exc:  # noqa: BLE001
                impl.note_error(exc)

        cb.isend_cb = _IsendFn(start(impl.isend))
        cb.irecv_cb = _IrecvFn(start(impl.irecv))
        cb.wait_cb = _WaitFn(wait)
        cb.cancel_cb = _CancelFn(cancel)
        cb.abort_cb = _AbortFn(abort)
        t._cb = cb  # C copies the struct, but the function pointers must stay alive
        _lib.call("zb_transport_create_callback", [_PP, _c.POINTER(_TransportCallbacks), _c.c_int32, _c.c_int32],
                  _c.byref(t._h), _c.byref(cb), rank, ranks)
        return t

    @classmethod
    def socket(cls, rank, ranks, fds, abort_store=None, abort_key=None, published_prefix=""):
        """The socket transport of rank `rank` of `ranks` (zb_transport_create_socket): fds[r] is a
        connected stream socket's file descriptor to rank r (-1 for this rank and ranks it never
        talks to); None: none yet (attach() gives them). The transport owns the descriptors from
        this call on, also when it raises (detach them from their Python socket objects first).
        abort_store and abort_key as for nccl(): a wait that blocks looks for a published failure
        every 0.2 s, and this rank's own first failure is published there, after
        `published_prefix`."""
        fds = [-1] * ranks if fds is None else [int(f) for f in fds]
        if len(fds) != ranks:
            for f in fds:
                if f >= 0:
                    _os.close(f)
            raise ValueError(f"zbpp: Transport.socket: {len(fds)} descriptors for {ranks} ranks; give one per rank "
                             "(-1 for this rank)")
        cfg = _SocketConfig()
        cfg.struct_size, cfg.version = _c.sizeof(_SocketConfig), ZB_SOCKET_TRANSPORT_CONFIG_VERSION
        cfg.rank, cfg.ranks = rank, ranks
        arr = (_c.c_int32 * max(ranks, 1))(*fds)
        cfg.fds = _c.cast(arr, _c.POINTER(_c.c_int32))
        t = cls()
        t.rank = rank
        if abort_store is not None and abort_key is not None:
            cfg.signal_poll, cfg.signal_publish = _store_signal(abort_store, str(abort_key), published_prefix)
            t._signal = (cfg.signal_poll, cfg.signal_publish)  # called from C for the transport's life
        _lib.call("zb_transport_create_socket", [_PP, _c.POINTER(_SocketConfig)], _c.byref(t._h), _c.byref(cfg))
        return t

    @classmethod
    def nccl(cls, rank, ranks, unique_id, backend, schedule, timeout=300.0, abort_store=None, abort_key=None):
        """The NCCL transport of pipeline rank `rank` of `ranks`: device buffers of `backend` (a
        CUDA Backend, borrowed) between one GPU per process, one communicator and stream per pair
        of neighbouring ranks of `schedule` (the same schedule on every rank). unique_id:
        nccl_unique_id() of one rank, the same bytes everywhere. Blocks until every rank has called
        it, at most `timeout` seconds. It carries the runner's channels only: give the optimizer and
        post-validation a host transport. abort_store and abort_key (a torch.distributed Store, such
        as the job's c10d store, and a key every rank of the pipeline gives): the first rank that
        fails writes its message there, and every rank's watchdog looks for it every 0.2 s and fails
        with it, so a failure reaches every rank within a second instead of at its timeout."""
        unique_id = _nccl_args("Transport.nccl", rank, ranks, unique_id, timeout)
        sched_ranks = getattr(schedule, "ranks", None)
        if sched_ranks is None or not hasattr(schedule, "handle"):
            raise TypeError(f"zbpp: Transport.nccl: schedule must be a zbpp.Schedule, got {type(schedule).__name__}")
        if sched_ranks != ranks:
            raise ValueError(f"zbpp: Transport.nccl: the schedule has {sched_ranks} ranks but ranks={ranks}; "
                             "every rank passes the pipeline's schedule")
        _cuda_backend("Transport.nccl", backend)
        cfg = _NcclConfig()
        cfg.struct_size, cfg.version = _c.sizeof(_NcclConfig), ZB_NCCL_TRANSPORT_CONFIG_VERSION
        cfg.rank, cfg.ranks = rank, ranks
        uid = (_c.c_uint8 * NCCL_UNIQUE_ID_BYTES).from_buffer_copy(unique_id)
        cfg.unique_id = _c.cast(uid, _c.POINTER(_c.c_uint8))
        cfg.comm, cfg.backend, cfg.schedule = None, backend.handle, schedule.handle
        cfg.timeout_s = float(timeout)
        t = cls()
        if abort_store is not None and abort_key is not None:
            cfg.signal_poll, cfg.signal_publish = _store_signal(abort_store, str(abort_key))
            t._signal = (cfg.signal_poll, cfg.signal_publish)  # called from C's watchdog: keep alive
        t._backend, t.rank = backend, rank  # the backend is borrowed by the transport: must outlive it
        _lib.call("zb_transport_create_nccl", [_PP, _c.POINTER(_NcclConfig)], _c.byref(t._h), _c.byref(cfg))
        return t

    @classmethod
    def nccl_group(cls, rank, ranks, unique_id, backend, timeout=300.0, abort_store=None, abort_key=None):
        """Collectives over every rank of a group on device memory (zb_transport_create_nccl_group):
        all_reduce and broadcast of CUDA tensors on `backend`'s GPU with NCCL's own collectives, in
        place, on a communicator and stream of their own, after the work `backend`'s stream was
        given before each call, and finished when the call returns. A sum is the host transports'
        within floating-point rounding (NCCL's order), the same on every rank; max and broadcast
        are exact. Every rank calls this transport's collectives in one order, whatever their
        channels: give each independent kind of collective its own (a fresh unique_id each). No
        point-to-point messages. Blocks until every rank has called it, at most `timeout` seconds,
        which also bounds each collective; abort_store and abort_key as for nccl()."""
        unique_id = _nccl_args("Transport.nccl_group", rank, ranks, unique_id, timeout)
        _cuda_backend("Transport.nccl_group", backend)
        cfg = _NcclGroupConfig()
        cfg.struct_size, cfg.version = _c.sizeof(_NcclGroupConfig), ZB_NCCL_GROUP_CONFIG_VERSION
        cfg.rank, cfg.ranks = rank, ranks
        uid = (_c.c_uint8 * NCCL_UNIQUE_ID_BYTES).from_buffer_copy(unique_id)
        cfg.unique_id = _c.cast(uid, _c.POINTER(_c.c_uint8))
        cfg.backend, cfg.timeout_s = backend.handle, float(timeout)
        t = cls()
        if abort_store is not None and abort_key is not None:
            cfg.signal_poll, cfg.signal_publish = _store_signal(abort_store, str(abort_key))
            t._signal = (cfg.signal_poll, cfg.signal_publish)  # called from C while a collective waits
        t._backend, t.rank, t.device_collectives = backend, rank, True
        _lib.call("zb_transport_create_nccl_group", [_PP, _c.POINTER(_NcclGroupConfig)], _c.byref(t._h),
                  _c.byref(cfg))
        return t

    @classmethod
    def staged(cls, inner):
        """Any backend's buffers over `inner`, a host-memory transport (socket() or callbacks()), by
        way of host copies (zb_transport_create_staged): for pipeline ranks that share a GPU, which
        NCCL refuses. Each message costs a device-to-host copy, a stream synchronisation and a
        host-to-device copy; one GPU per rank with nccl() is the fast path. `inner` stays open at
        least as long (this object holds it) and may keep carrying other channels."""
        if not isinstance(inner, Transport):
            raise TypeError(f"zbpp: Transport.staged wraps a zbpp Transport (socket or callbacks), got "
                            f"{type(inner).__name__}")
        t = cls()
        t._inner, t.rank = inner, inner.rank  # the C transport holds it too: it must outlive this one
        _lib.call("zb_transport_create_staged", [_PP, _P], _c.byref(t._h), inner.handle)
        return t

    def attach(self, fds):
        """Gives a socket transport made without them its peers' sockets (zb_transport_socket_attach):
        fds as for socket(), owned by the transport from this call on."""
        fds = [int(f) for f in fds]
        arr = (_c.c_int32 * max(len(fds), 1))(*fds)
        _lib.call("zb_transport_socket_attach", [_P, _c.POINTER(_c.c_int32)], self.handle,
                  _c.cast(arr, _c.POINTER(_c.c_int32)))

    def abort(self, reason):
        _lib.call("zb_transport_abort", [_P, _c.c_char_p], self.handle, reason.encode())

    def all_reduce(self, x, op="sum", timeout=300.0, channel=0):
        """x (a contiguous torch tensor or numpy array of float32, float16 or bfloat16) becomes
        the sum (op="sum") or the elementwise max (op="max") of every rank's x, the same bits on
        every rank: rank 0 reduces in rank order, ((x0 + x1) + x2) ... (zb_transport_all_reduce).
        Every rank calls it, in the same order as its other collectives on that channel (0 .. 1023;
        channels do not wait for each other's order). Returns x. A CUDA tensor goes through host
        memory (_through_host), on the calling thread's current stream."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        _check_channel(channel, "all_reduce")
        if _on_device(x) and not self.device_collectives:
            return _through_host(x, lambda h: self.all_reduce(h, op, timeout, channel), "all_reduce")
        addr, count, nbytes, name = self._buffer(x, "all_reduce")
        if name not in _REDUCE_DTYPES:
            raise ValueError(f"all_reduce: dtype {name} is not reduced here; use float32, float16 or bfloat16")
        try:
            _lib.call("zb_transport_all_reduce", [_P, _c.c_int32, _P, _c.c_size_t, _c.c_int, _c.c_int, _c.c_double],
                      self.handle, int(channel), addr, count, _REDUCE_DTYPES[name], _REDUCE_OPS[op], float(timeout))
        except BaseException:
            self._park(x)
            raise
        return x

    def broadcast(self, x, root, timeout=300.0, channel=0):
        """x (a contiguous torch tensor or numpy array, any dtype) becomes root's x on every rank
        (zb_transport_broadcast). Every rank calls it, in the same order on that channel. Returns x.
        A CUDA tensor goes through host memory (_through_host)."""
        _check_channel(channel, "broadcast")
        if _on_device(x) and not self.device_collectives:
            # Only what moves: the root's data out, the others' result in.
            return _through_host(x, lambda h: self.broadcast(h, root, timeout, channel), "broadcast",
                                 out=self.rank is None or self.rank == root,
                                 back=self.rank is None or self.rank != root)
        addr, _, nbytes, _ = self._buffer(x, "broadcast")
        try:
            _lib.call("zb_transport_broadcast", [_P, _c.c_int32, _P, _c.c_size_t, _c.c_int32, _c.c_double],
                      self.handle, int(channel), addr, nbytes, int(root), float(timeout))
        except BaseException:
            self._park(x)
            raise
        return x

    def _buffer(self, x, what):
        """(address, elements, bytes, dtype name) of x: host memory, or a CUDA tensor on the
        transport's device for nccl_group()."""
        if not self.device_collectives:
            return _host_buffer(x, what)
        if not _on_device(x) or not x.is_contiguous():
            raise ValueError(f"{what}: the NCCL group transport takes contiguous CUDA tensors, got "
                             f"{'a non-contiguous tensor' if _on_device(x) else 'host memory'} "
                             f"({getattr(x, 'device', type(x).__name__)})")
        if x.device.index != self._backend.device:
            raise ValueError(f"{what}: the tensor is on {x.device}, the transport's backend on cuda:{self._backend.device}")
        return x.data_ptr(), x.numel(), x.numel() * x.element_size(), str(x.dtype).replace("torch.", "")

    def _park(self, x):
        """After a failed collective (the transport is aborted), x stays alive with the transport: a
        receive gloo cannot withdraw may still write into it (collective.c)."""
        owner = getattr(self, "_inner", None) or self  # a staged transport's collectives ran on its inner one
        owner.__dict__.setdefault("_parked", []).append(x)


_REDUCE_OPS = {"sum": 0, "max": 1}


def _on_device(x):
    """Whether x is a torch tensor in device memory (the host collectives stage it)."""
    return hasattr(x, "is_cuda") and getattr(x, "device", None) is not None and x.device.type != "cpu"


def _nccl_args(what, rank, ranks, unique_id, timeout):
    """Checks the NCCL transports' common arguments; returns the unique id as bytes."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"zbpp: {what}: ranks must be an int >= 1, got {ranks!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"zbpp: {what}: rank must be an int in [0, {ranks - 1}] for ranks={ranks}, got {rank!r}")
    if not isinstance(unique_id, (bytes, bytearray, memoryview)):
        raise TypeError(f"zbpp: {what}: unique_id must be the {NCCL_UNIQUE_ID_BYTES} bytes of "
                        f"nccl_unique_id(), got {type(unique_id).__name__}")
    unique_id = bytes(unique_id)
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"zbpp: {what}: unique_id must be exactly {NCCL_UNIQUE_ID_BYTES} bytes "
                         f"(nccl_unique_id() of one rank, broadcast to all), got {len(unique_id)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"zbpp: {what}: timeout must be a number of seconds > 0, got {timeout!r}")
    return unique_id


def _cuda_backend(what, backend):
    if not isinstance(backend, Backend) or backend.kind != "cuda":
        got = backend.kind if isinstance(backend, Backend) else type(backend).__name__
        raise ValueError(f"zbpp: {what} moves device buffers, so it needs a CUDA backend "
                         f"(Backend('cuda', device)); got {got!r}")


def _through_host(x, run, what, out=True, back=True):
    """A collective on a device tensor x over a host transport: x copied to pinned host memory
    (on the calling thread's current stream, which is synchronised, so whatever that stream
    enqueued before is in the copy), run(host copy), and the result copied back into x, the copy
    finished when this returns (a non-blocking=False copy synchronises its stream). Costs two
    copies and two stream synchronisations: meant for per-token statistics and a hidden-sized
    tensor a microbatch (Vocabulary Parallelism's passes), not for a model's gradients. A failed
    collective leaves x as it was; its host copy is kept with the transport (_park). out=False: x
    holds nothing to send (a broadcast's receivers); back=False: x keeps its value (its root)."""
    import torch

    if not x.is_contiguous():
        raise ValueError(f"{what}: x must be contiguous, got a tensor of strides {tuple(x.stride())} on {x.device}")
    pin = x.device.type == "cuda" and torch.cuda.is_available()
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=pin)
    if out:
        host.copy_(x)
    run(host)
    if back:
        x.copy_(host)
    return x


def _check_channel(channel, what):
    if not isinstance(channel, int) or isinstance(channel, bool) or not 0 <= channel < 1024:
        raise ValueError(f"{what}: channel must be an integer in 0..1023, got {channel!r}")
_REDUCE_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def _host_buffer(x, what):
    """(address, elements, bytes, dtype name) of a contiguous CPU torch tensor or numpy array."""
    if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):  # a torch tensor
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"{what}: x must be a contiguous CPU tensor (host memory), got one on {x.device} "
                             f"{'' if x.is_contiguous() else '(not contiguous)'}")
        return x.data_ptr(), x.numel(), x.numel() * x.element_size(), str(x.dtype).replace("torch.", "")
    iface = getattr(x, "__array_interface__", None)
    if iface is None or not x.flags["C_CONTIGUOUS"] or not x.flags["WRITEABLE"]:
        raise ValueError(f"{what}: x must be a contiguous, writeable CPU torch tensor or numpy array, got {type(x).__name__}")
    return iface["data"][0], x.size, x.nbytes, x.dtype.name


def _store_signal(store, key, prefix=""):
    """The C abort signal (zb_abort_signal_t) over a torch.distributed Store: poll reads `key`,
    publish writes prefix + the message if nobody has (compare_set: the first failure wins). Both
    run on a library thread (the NCCL watchdog's, or the socket transport's waiting caller); a
    store that cannot be reached reads as no failure."""
    def poll(_user, buf, cap):
        try:
            if not store.check([key]):
                return 0
            text = store.get(key)[: max(int(cap) - 1, 0)]
        except Exception:  # noqa: BLE001 - the store going away is no failure of the pipeline
            return 0
        _c.memmove(buf, text + b"\0", len(text) + 1)
        return 1

    def publish(_user, msg):
        try:
            store.compare_set(key, "", prefix + (msg or b"").decode("utf-8", errors="replace"))
        except Exception:  # noqa: BLE001 - best effort: the peers still fail at their timeout
            pass

    return _SignalPollFn(poll), _SignalPublishFn(publish)
