"""ctypes wrappers over the C runtime: backends, the W store, transports and the runner.

What this is: the thin layer between the torch integration (split.py, distributed.py,
pipelining.py) and include/zbpp.h's runtime section. Each class owns one C handle, frees it in
close() (idempotent, also on garbage collection) and raises ZbError for every non-OK status.
Python callbacks handed to C are kept referenced by the object that handed them over, because C
keeps the function pointer for the handle's lifetime.

What this is not: torch-aware. Buffers cross as addresses; the torch modules turn tensors into
addresses and back. Callbacks never let a Python exception escape into C (ctypes would print and
drop it): they store it, return a non-OK status, and the caller re-raises it after the C call.
"""

import ctypes

from . import _lib

__all__ = [
    "DTYPES",
    "Backend",
    "WStore",
    "InprocGroup",
    "Transport",
    "Runner",
    "ForwardFn",
    "BackwardFn",
    "ZB_OK",
    "ZB_ERR_INVALID_ARGUMENT",
    "ZB_ERR_TIMEOUT",
    "ZB_ERR_REMOTE",
    "ZB_ERR_INTERNAL",
]

ZB_OK = 0
ZB_ERR_INVALID_ARGUMENT = 1
ZB_ERR_TIMEOUT = 9
ZB_ERR_REMOTE = 10
ZB_ERR_INTERNAL = 14

# zb_dtype_t by torch-style name.
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}

_c = ctypes
_P = _c.c_void_p
_PP = _c.POINTER(_c.c_void_p)


class _WGrad(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("dtype", _c.c_int),
        ("rows", _c.c_int64),
        ("in_features", _c.c_int64),
        ("out_features", _c.c_int64),
        ("x", _P),
        ("ldx", _c.c_int64),
        ("dy", _P),
        ("ldy", _c.c_int64),
        ("dw", _P),
        ("db", _P),
        ("token", _c.c_uint64),
    ]


ReleaseFn = _c.CFUNCTYPE(None, _P, _c.c_uint64, _c.c_int32)
ForwardFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _P)
BackwardFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _P)

_IsendFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _c.c_size_t, _PP)
_IrecvFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _c.c_size_t, _PP)
_WaitFn = _c.CFUNCTYPE(_c.c_int, _P, _P, _c.c_double)
_CancelFn = _c.CFUNCTYPE(None, _P, _P)
_AbortFn = _c.CFUNCTYPE(None, _P, _c.c_char_p)


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


class _RunnerConfig(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("rank", _c.c_int32),
        ("schedule", _P),
        ("backend", _P),
        ("transport", _P),
        ("wstore", _P),
        ("boundary_bytes", _c.POINTER(_c.c_int64)),
        ("boundary_bytes_all", _c.c_int64),
        ("forward_cb", ForwardFn),
        ("backward_cb", BackwardFn),
        ("user", _P),
        ("timeout_s", _c.c_double),
        ("recv_depth", _c.c_int32),
    ]


ZB_RUNNER_CONFIG_VERSION = 1


class _Handle:
    """Owns one C handle; subclasses name their destroy call."""

    _destroy = None  # (name, argtypes)

    def __init__(self):
        self._h = _P()

    @property
    def handle(self):
        if not self._h:
            raise ValueError(f"zbpp: this {type(self).__name__} was closed")
        return self._h

    def close(self):
        h, self._h = self._h, _P()
        if h:
            name = self._destroy
            _lib.call(name, [_P], h)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing sensible to do during garbage collection
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Backend(_Handle):
    """A rank's backend; only the host backend exists so far (the CUDA one comes with issue 5)."""

    _destroy = "zb_backend_destroy"

    def __init__(self, kind="host"):
        super().__init__()
        if kind != "host":
            raise ValueError(f"zbpp: backend {kind!r} is not available in this build; allowed: 'host'")
        _lib.call("zb_backend_create_host", [_PP], _c.byref(self._h))

    @property
    def name(self):
        return _lib.function("zb_backend_name", [_P], _c.c_char_p)(self.handle).decode()


class WStore(_Handle):
    """The C W store. `release(token, ran)` is called once per pushed entry, from the thread that
    runs or drops it (pop_run, clear, close)."""

    _destroy = "zb_wstore_destroy"

    def __init__(self, backend, release):
        super().__init__()
        self._backend = backend  # the store borrows it: keep it alive as long as the store
        self._release_py = release
        self._release_c = ReleaseFn(self._on_release)
        _lib.call("zb_wstore_create", [_PP, _P, ReleaseFn, _P], _c.byref(self._h), backend.handle,
                  self._release_c, None)
        self._entry = _WGrad()
        self._entry.struct_size = _c.sizeof(_WGrad)

    def _on_release(self, _user, token, ran):
        try:
            self._release_py(int(token), bool(ran))
        except BaseException as exc:  # noqa: BLE001 - must not unwind into C
            self.release_error = exc

    release_error = None

    def begin(self, stage, mb):
        _lib.call("zb_wstore_begin", [_P, _c.c_int32, _c.c_int32], self.handle, stage, mb)

    def end(self):
        _lib.call("zb_wstore_end", [_P], self.handle)

    def push(self, dtype, rows, in_features, out_features, x, ldx, dy, ldy, dw, db, token):
        e = self._entry
        e.dtype, e.rows, e.in_features, e.out_features = dtype, rows, in_features, out_features
        e.x, e.ldx, e.dy, e.ldy, e.dw, e.db, e.token = x, ldx, dy, ldy, dw, db, token
        _lib.call("zb_wstore_push", [_P, _c.POINTER(_WGrad)], self.handle, _c.byref(e))

    def pop_run(self, stage):
        mb = _c.c_int32()
        _lib.call("zb_wstore_pop_run", [_P, _c.c_int32, _c.POINTER(_c.c_int32)], self.handle, stage,
                  _c.byref(mb))
        self._raise_release_error()
        return mb.value

    def pending(self, stage=-1):
        n = _c.c_int32()
        _lib.call("zb_wstore_pending", [_P, _c.c_int32, _c.POINTER(_c.c_int32)], self.handle, stage,
                  _c.byref(n))
        return n.value

    def clear(self):
        _lib.call("zb_wstore_clear", [_P], self.handle)
        self._raise_release_error()

    def _raise_release_error(self):
        exc, self.release_error = self.release_error, None
        if exc is not None:
            raise exc

    def close(self):
        super().close()
        self._backend = None


class InprocGroup(_Handle):
    """Ranks as threads of this process (tests, single-process runs)."""

    _destroy = "zb_inproc_group_destroy"

    def __init__(self, ranks):
        super().__init__()
        _lib.call("zb_inproc_group_create", [_PP, _c.c_int32], _c.byref(self._h), ranks)


class Transport(_Handle):
    """A rank's transport: in-process (`Transport.inproc(group, rank)`) or with Python callbacks
    (`Transport.callbacks(impl, rank, ranks)`, impl having isend/irecv/wait/cancel/abort)."""

    _destroy = "zb_transport_destroy"

    @classmethod
    def inproc(cls, group, rank):
        t = cls()
        t._group = group
        _lib.call("zb_transport_create_inproc", [_PP, _P, _c.c_int32], _c.byref(t._h), group.handle, rank)
        return t

    @classmethod
    def callbacks(cls, impl, rank, ranks):
        """impl.isend(peer, tag, addr, nbytes) -> request id (int > 0), impl.irecv(...) likewise,
        impl.wait(request, timeout_s) -> a status code (ZB_OK, ZB_ERR_TIMEOUT, ZB_ERR_REMOTE),
        impl.cancel(request), impl.abort(reason: str). A callback that raises gives ZB_ERR_REMOTE;
        impl.last_error should then say why (the binding adds it to the runner's message)."""
        t = cls()
        t._impl = impl
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

    def abort(self, reason):
        _lib.call("zb_transport_abort", [_P, _c.c_char_p], self.handle, reason.encode())


class Runner(_Handle):
    """One rank's runner over a Schedule. forward(stage, mb, in_addr, out_addr) and
    backward(stage, mb, grad_out_addr, grad_in_addr) are Python callables (addresses are ints, 0 for
    NULL); an exception they raise is re-raised by run(), chained to the runner's message."""

    _destroy = "zb_runner_destroy"

    def __init__(self, schedule, rank, backend, wstore, transport, boundary_bytes, forward, backward,
                 timeout_s=300.0, recv_depth=0):
        super().__init__()
        self._keep = (schedule, backend, wstore, transport)
        self._error = None
        self._forward_py, self._backward_py = forward, backward
        self._fwd = ForwardFn(self._on_forward)
        self._bwd = BackwardFn(self._on_backward)
        cfg = _RunnerConfig()
        cfg.struct_size = _c.sizeof(_RunnerConfig)
        cfg.version = ZB_RUNNER_CONFIG_VERSION
        cfg.rank = rank
        cfg.schedule = schedule.handle
        cfg.backend = backend.handle
        cfg.transport = transport.handle if transport is not None else None
        cfg.wstore = wstore.handle
        sizes = list(boundary_bytes)
        self._sizes = (_c.c_int64 * max(1, len(sizes)))(*sizes)
        cfg.boundary_bytes = self._sizes
        cfg.forward_cb = self._fwd
        cfg.backward_cb = self._bwd
        cfg.timeout_s = timeout_s
        cfg.recv_depth = recv_depth
        _lib.call("zb_runner_create", [_PP, _c.POINTER(_RunnerConfig)], _c.byref(self._h), _c.byref(cfg))
        self._count = len(schedule.rank_ops(rank))

    def _on_forward(self, _user, stage, mb, inp, out):
        try:
            self._forward_py(int(stage), int(mb), inp or 0, out or 0)
            return ZB_OK
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            return ZB_ERR_INVALID_ARGUMENT

    def _on_backward(self, _user, stage, mb, gout, gin):
        try:
            self._backward_py(int(stage), int(mb), gout or 0, gin or 0)
            return ZB_OK
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            return ZB_ERR_INVALID_ARGUMENT

    def run(self, extra_error=None):
        """One iteration. extra_error(): more text for a failure (e.g. the transport's last error)."""
        self._error = None
        status = _lib.function("zb_runner_run", [_P])(self.handle)
        if status != ZB_OK:
            cause, self._error = self._error, None
            try:
                _lib.check(status)
            except _lib.ZbError as err:
                extra = extra_error() if extra_error else None
                if extra:
                    err = _lib.ZbError(err.code, f"{err.message} ({extra})", err.name)
                if isinstance(cause, KeyboardInterrupt):
                    raise cause from err
                raise err from cause

    def times(self):
        """The last iteration's (starts, ends) in seconds (CLOCK_MONOTONIC), aligned with rank_ops."""
        start, end = _c.POINTER(_c.c_double)(), _c.POINTER(_c.c_double)()
        n = _c.c_int32()
        _lib.call("zb_runner_times", [_P, _c.POINTER(_c.POINTER(_c.c_double)), _c.POINTER(_c.POINTER(_c.c_double)),
                                      _c.POINTER(_c.c_int32)], self.handle, _c.byref(start), _c.byref(end), _c.byref(n))
        return [start[i] for i in range(n.value)], [end[i] for i in range(n.value)]
