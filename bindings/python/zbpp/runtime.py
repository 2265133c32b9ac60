"""ctypes wrappers over the C runtime: backends, the W store, transports and the runner.

What this is: the thin layer between the torch integration (split.py, distributed.py,
pipelining.py, cuda.py) and include/zbpp.h's runtime section. Each class owns one C handle, frees
it in close() (idempotent, also on garbage collection) and raises ZbError for every non-OK status.
Python callbacks handed to C are kept referenced by the object that handed them over, because C
keeps the function pointer for the handle's lifetime. The optimizer kernels (zb_sq_norm,
zb_optim_step, ...) are wrapped too, over raw addresses.

What this is not: torch-aware. Buffers cross as addresses; the torch modules turn tensors into
addresses and back. The one exception is a default: Backend("cuda") with no device or stream asks
torch (when it is importable and sees a GPU) for its current device and stream, so the backend
works on the stream torch is using. Callbacks never let a Python exception escape into C (ctypes
would print and drop it): they store it, return a non-OK status, and the caller re-raises it after
the C call.

Where the parts are: this module holds the W store (WStore) and the runner (Runner) and is where
every name is imported from; the status codes, _Handle and Backend (with the streams it takes) are
in _runtime_backend.py, the transports in _runtime_transport.py, the optimizer kernels in
_runtime_optim.py.
"""

import ctypes

from . import _lib
from ._runtime_backend import (  # noqa: F401 - the names of zbpp.runtime, as before the split
    CUDA_STREAM_LEGACY,
    DTYPES,
    ZB_CUDA_BACKEND_CONFIG_VERSION,
    ZB_ERR_BUSY,
    ZB_ERR_CUDA,
    ZB_ERR_INTERNAL,
    ZB_ERR_INVALID_ARGUMENT,
    ZB_ERR_NCCL,
    ZB_ERR_OUT_OF_MEMORY,
    ZB_ERR_REMOTE,
    ZB_ERR_TIMEOUT,
    ZB_ERR_UNSUPPORTED,
    ZB_OK,
    Backend,
    cuda_built,
    cuda_device_count,
    _Handle,
    _P,
    _PP,
    _stream_arg,
)
from ._runtime_optim import (  # noqa: F401
    OPTIMIZERS,
    ZB_OPTIM_STEP_VERSION,
    OptimStep,
    loss_scale_update,
    sq_norm,
    unscale,
)
from ._runtime_transport import (  # noqa: F401
    NCCL_UNIQUE_ID_BYTES,
    ZB_NCCL_TRANSPORT_CONFIG_VERSION,
    ZB_SOCKET_TRANSPORT_CONFIG_VERSION,
    InprocGroup,
    Transport,
    nccl_unique_id,
    _store_signal,
)

__all__ = [
    "DTYPES",
    "OPTIMIZERS",
    "NCCL_UNIQUE_ID_BYTES",
    "CUDA_STREAM_LEGACY",
    "Backend",
    "OptimStep",
    "WStore",
    "InprocGroup",
    "Transport",
    "Runner",
    "ForwardFn",
    "BackwardFn",
    "cuda_built",
    "cuda_device_count",
    "nccl_unique_id",
    "sq_norm",
    "unscale",
    "loss_scale_update",
    "ZB_OK",
    "ZB_ERR_INVALID_ARGUMENT",
    "ZB_ERR_TIMEOUT",
    "ZB_ERR_REMOTE",
    "ZB_ERR_INTERNAL",
]

_c = ctypes


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
        # Where the gradient goes (zb_wgrad_t's second part): 0/0 is Megatron's fp32 main_grad,
        # accumulated; the input dtype with overwrite=1 is a fresh half-precision product.
        ("dw_dtype", _c.c_int),
        ("overwrite", _c.c_int32),
    ]


ReleaseFn = _c.CFUNCTYPE(_c.c_int32, _P, _c.c_uint64, _c.c_int32)
ForwardFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _P)
BackwardFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _P, _P)
AllocFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_size_t, _PP)
FreeFn = _c.CFUNCTYPE(None, _P, _P)
LendReleaseFn = _c.CFUNCTYPE(None, _P, _c.c_uint64)
CopyFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32, _c.c_int32)
VocabFn = _c.CFUNCTYPE(_c.c_int, _P, _c.c_int32, _c.c_int32)


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
        ("pair_first", _c.POINTER(_c.c_int32)),
        ("n_pairs", _c.c_int32),
        ("alloc_cb", AllocFn),
        ("free_cb", FreeFn),
        ("alloc_user", _P),
        ("release_cb", LendReleaseFn),
        ("copy_cb", CopyFn),
        ("copy_time_scale", _c.c_double),
        ("copy_inline", _c.c_int32),
        ("vocab_cb", VocabFn),
    ]


ZB_RUNNER_CONFIG_VERSION = 1


class WStore(_Handle):
    """The C W store. `release(token, ran)` is called once per pushed entry, from the thread that
    runs or drops it (pop_run, clear, close). before_run(), when given, is called at the start of
    every pop_run made from Python (the CUDA store points the backend at torch's current stream
    there); pops the runner makes in C do not call it, so a runner's owner does that before run."""

    _destroy = "zb_wstore_destroy"

    def __init__(self, backend, release, before_run=None):
        super().__init__()
        self._backend = backend  # the store borrows it: keep it alive as long as the store
        self._before_run = before_run
        self._release_py = release
        self._release_c = ReleaseFn(self._on_release)
        _lib.call("zb_wstore_create", [_PP, _P, ReleaseFn, _P], _c.byref(self._h), backend.handle,
                  self._release_c, None)
        self._entry = _WGrad()
        self._entry.struct_size = _c.sizeof(_WGrad)

    def _on_release(self, _user, token, ran):
        try:
            self._release_py(int(token), bool(ran))
            return ZB_OK
        except BaseException as exc:  # noqa: BLE001 - must not unwind into C
            # The C call that released it fails (pop_run: the W op and the runner's iteration);
            # whoever made that call raises this exception, chained to the library's message.
            if self.release_error is None:
                self.release_error = exc
            return ZB_ERR_INVALID_ARGUMENT

    release_error = None

    def begin(self, stage, mb):
        _lib.call("zb_wstore_begin", [_P, _c.c_int32, _c.c_int32], self.handle, stage, mb)

    def end(self):
        _lib.call("zb_wstore_end", [_P], self.handle)

    def push(self, dtype, rows, in_features, out_features, x, ldx, dy, ldy, dw, db, token, dw_dtype=0,
             overwrite=False):
        """dw_dtype 0 (fp32) with overwrite False: accumulate into fp32 dw/db (main_grad); dw_dtype
        = dtype with overwrite True: write the product, rounded once, into half-precision dw/db."""
        e = self._entry
        e.dtype, e.rows, e.in_features, e.out_features = dtype, rows, in_features, out_features
        e.x, e.ldx, e.dy, e.ldy, e.dw, e.db, e.token = x, ldx, dy, ldy, dw, db, token
        e.dw_dtype, e.overwrite = dw_dtype, int(bool(overwrite))
        _lib.call("zb_wstore_push", [_P, _c.POINTER(_WGrad)], self.handle, _c.byref(e))

    def pop_run(self, stage):
        if self._before_run is not None:
            self._before_run()
        mb = _c.c_int32()
        self._call_releasing("zb_wstore_pop_run", [_P, _c.c_int32, _c.POINTER(_c.c_int32)], self.handle, stage,
                             _c.byref(mb))
        return mb.value

    def pending(self, stage=-1):
        n = _c.c_int32()
        _lib.call("zb_wstore_pending", [_P, _c.c_int32, _c.POINTER(_c.c_int32)], self.handle, stage,
                  _c.byref(n))
        return n.value

    def clear(self):
        self._call_releasing("zb_wstore_clear", [_P], self.handle)

    def _call_releasing(self, name, argtypes, *args):
        """A call that may release entries: a release callback that raised makes it fail, and its
        exception is what the caller sees (chained to the library's message)."""
        self.release_error = None
        try:
            _lib.call(name, argtypes, *args)
        except _lib.ZbError as err:
            exc, self.release_error = self.release_error, None
            if exc is not None:
                raise exc from err
            raise
        self.release_error = None

    def take_release_error(self):
        """The exception a release callback raised during a call made in C (the runner's W ops), once."""
        exc, self.release_error = self.release_error, None
        return exc

    def close(self):
        super().close()
        self._backend = None


class Runner(_Handle):
    """One rank's runner over a Schedule. forward(stage, mb, in_addr, out_addr) and
    backward(stage, mb, grad_out_addr, grad_in_addr) are Python callables (addresses are ints, 0 for
    NULL); an exception they raise is re-raised by run(), chained to the runner's message."""

    _destroy = "zb_runner_destroy"

    def _guarded(self, fn, *args):
        """fn(*args) from a C callback: ZB_OK, or ZB_ERR_INVALID_ARGUMENT with the exception kept
        for run() to re-raise (nothing may unwind into C)."""
        try:
            fn(*args)
            return ZB_OK
        except BaseException as exc:  # noqa: BLE001 - must not unwind into C
            if self._error is None:
                self._error = exc
            code = getattr(exc, "code", None) if isinstance(exc, _lib.ZbError) else None
            return code if isinstance(code, int) and code != ZB_OK else ZB_ERR_INVALID_ARGUMENT

    def __init__(self, schedule, rank, backend, wstore, transport, boundary_bytes, forward, backward,
                 timeout_s=300.0, recv_depth=0, pairs=(), allocator=None, release=None, copy=None,
                 copy_time_scale=0.0, copy_inline=False, vocab=None):
        """pairs: indices k into this rank's op list where ops k and k+1 run as one unit (both
        inputs first, both callbacks back to back, both outputs after; zb_runner_config_t).
        allocator: (alloc(nbytes) -> address, free(address)) for the runner's message buffers, all
        taken at creation and given back at close (zb_runner_config_t.alloc_cb); None: the
        backend's. release: release(token), for zero-copy stages (zb_runner_config_t.release_cb):
        the callbacks get out_addr 0 and hand their own output with lend_output(addr, token), and
        each input stays valid until its microbatch's W; the runner calls release(token) when it is
        done with a lent buffer. copy: copy(kind, stage, mb) with kind 'OFFLOAD' or 'RELOAD', for a
        schedule with PipeOffload's copies (zb_runner_config_t.copy_cb): on the host backend it
        runs on the runner's copy thread, on CUDA on the runner's thread where the copy is issued
        (it only enqueues). copy_time_scale: seconds per schedule time unit a host copy lasts at
        least (a modelled link; 0: none). copy_inline: on the host too, call copy on the runner's
        thread after the op before the copy (zb_runner_config_t.copy_inline). vocab(kind, mb): a
        schedule's Vocabulary Parallelism passes, kind 'S', 'T', 'IF' or 'IB' (zb_runner_config_t.
        vocab_cb: the caller runs the pass and its collectives, e.g. with zbpp.vocab)."""
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
        pairs = [int(k) for k in pairs]
        self._pairs = (_c.c_int32 * max(1, len(pairs)))(*pairs)
        cfg.pair_first = self._pairs
        cfg.n_pairs = len(pairs)
        if allocator is not None:
            alloc, free = allocator
            self._alloc_error = None

            def on_alloc(_user, nbytes, out):
                try:
                    out[0] = int(alloc(int(nbytes)))
                    return ZB_OK
                except BaseException as exc:  # noqa: BLE001 - must not unwind into C
                    self._alloc_error = exc
                    return ZB_ERR_OUT_OF_MEMORY

            def on_free(_user, ptr):
                try:
                    free(int(ptr))
                except BaseException:  # noqa: BLE001 - must not unwind into C; nothing to report it to
                    pass

            self._alloc_fns = (AllocFn(on_alloc), FreeFn(on_free))  # alive as long as the runner
            cfg.alloc_cb, cfg.free_cb = self._alloc_fns
        if release is not None:
            def on_release(_user, token):
                try:
                    release(int(token))
                except BaseException:  # noqa: BLE001 - must not unwind into C; a leak at worst
                    pass

            self._release_fn = LendReleaseFn(on_release)
            cfg.release_cb = self._release_fn
        if copy is not None:
            def on_copy(_user, kind, stage, mb):
                return self._guarded(copy, "OFFLOAD" if kind == 4 else "RELOAD", int(stage), int(mb))

            self._copy_fn = CopyFn(on_copy)
            cfg.copy_cb = self._copy_fn
        if vocab is not None:
            def on_vocab(_user, kind, mb):
                return self._guarded(vocab, ("S", "T", "IF", "IB")[kind - 6], int(mb))

            self._vocab_fn = VocabFn(on_vocab)
            cfg.vocab_cb = self._vocab_fn
        cfg.copy_time_scale = float(copy_time_scale)
        cfg.copy_inline = 1 if copy_inline else 0
        try:
            _lib.call("zb_runner_create", [_PP, _c.POINTER(_RunnerConfig)], _c.byref(self._h), _c.byref(cfg))
        except _lib.ZbError as err:
            if getattr(self, "_alloc_error", None) is not None:
                raise err from self._alloc_error  # the allocator's own exception, as the cause
            raise
        self._count = len(schedule.rank_ops(rank))

    def lend_output(self, addr, token):
        """From inside a forward or backward callback of a runner made with release=: this op's
        output is at addr (the caller's memory, kept alive and unchanged until release(token))."""
        _lib.call("zb_runner_lend_output", [_P, _P, _c.c_uint64], self.handle, addr or None, int(token))

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
        wstore = self._keep[2]
        wstore.release_error = None
        status = _lib.function("zb_runner_run", [_P])(self.handle)
        if status != ZB_OK:
            cause, self._error = self._error, None
            released = wstore.take_release_error()
            cause = cause if cause is not None else released
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
