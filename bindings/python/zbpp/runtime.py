"""ctypes wrappers over the C runtime: backends, the W store, transports and the runner.

What this is: the thin layer between the torch integration (split.py, distributed.py,
pipelining.py, cuda.py) and include/zbpp.h's runtime section. Each class owns one C handle, frees
it in close() (idempotent, also on garbage collection) and raises ZbError for every non-OK status.
Python callbacks handed to C are kept referenced by the object that handed them over, because C
keeps the function pointer for the handle's lifetime. The optimizer kernels (zb_sq_norm,
zb_optim_step, ...) are wrapped here too, over raw addresses.

What this is not: torch-aware. Buffers cross as addresses; the torch modules turn tensors into
addresses and back. The one exception is a default: Backend("cuda") with no device or stream asks
torch (when it is importable and sees a GPU) for its current device and stream, so the backend
works on the stream torch is using. Callbacks never let a Python exception escape into C (ctypes
would print and drop it): they store it, return a non-OK status, and the caller re-raises it after
the C call.

Streams: the C API reads a NULL stream as "the backend's own stream", but torch's default stream is
the legacy NULL stream (torch.cuda.default_stream().cuda_stream == 0). So a stream 0 given here is
passed as cudaStreamLegacy (0x1), CUDA's explicit name for that same stream; only None means the
backend's own stream.
"""

import ctypes
import os as _os

from . import _lib

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

ZB_OK = 0
ZB_ERR_INVALID_ARGUMENT = 1
ZB_ERR_OUT_OF_MEMORY = 2
ZB_ERR_UNSUPPORTED = 6
ZB_ERR_BUSY = 8
ZB_ERR_TIMEOUT = 9
ZB_ERR_REMOTE = 10
ZB_ERR_CUDA = 11
ZB_ERR_NCCL = 12
ZB_ERR_INTERNAL = 14

# zb_dtype_t by torch-style name.
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
# zb_optim_kind_t by torch-style name.
OPTIMIZERS = {"sgd": 0, "adamw": 1}
NCCL_UNIQUE_ID_BYTES = 128
# cudaStreamLegacy: the legacy default stream by an explicit, non-NULL handle (see the docstring).
CUDA_STREAM_LEGACY = 1

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
        """Frees the handle. A handle the library reports busy (ZB_ERR_BUSY: a backend still used
        by a store or runner) stays open, so closing it again once those are gone frees it; any
        other failure still frees it (the library frees what it can) and is raised."""
        h = self._h
        if not h:
            return
        try:
            _lib.call(self._destroy, [_P], h)
        except _lib.ZbError as err:
            if err.code != ZB_ERR_BUSY:
                self._h = _P()
            raise
        self._h = _P()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing sensible to do during garbage collection
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _CudaBackendConfig(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("device", _c.c_int32),
        ("stream", _P),
        ("workspace_bytes", _c.c_size_t),
    ]


ZB_CUDA_BACKEND_CONFIG_VERSION = 1


def _torch_cuda():
    """torch, when it is importable and sees a GPU; None otherwise. Only defaults use it."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _device_index(device, torch=None):
    """A CUDA device ordinal from an int, "cuda", "cuda:N" or a torch.device; None: the current one."""
    if device is None:
        return torch.cuda.current_device() if torch is not None else 0
    if isinstance(device, bool):
        raise TypeError("zbpp: a CUDA device is an int ordinal, 'cuda:N' or a torch.device, got a bool")
    if isinstance(device, int):
        index = device
    else:
        text = str(device)
        kind, _, num = text.partition(":")
        if kind != "cuda" or (num and not num.isdigit()):
            raise ValueError(f"zbpp: the CUDA backend needs a CUDA device (an int, 'cuda', 'cuda:N' or a "
                             f"torch.device of type cuda); got {device!r}")
        if not num:
            return torch.cuda.current_device() if torch is not None else 0
        index = int(num)
    if index < 0:
        raise ValueError(f"zbpp: CUDA device ordinal {index} is negative; devices are 0, 1, ...")
    return index


def _stream_arg(stream):
    """The cudaStream_t to pass for a stream given as None, an int handle or an object with
    .cuda_stream (torch.cuda.Stream): None stays NULL (the backend's own stream), 0 (torch's default
    stream) becomes cudaStreamLegacy."""
    if stream is None:
        return None
    raw = getattr(stream, "cuda_stream", stream)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise TypeError(f"zbpp: a stream is None (the backend's own), a cudaStream_t handle (int >= 0) or "
                        f"an object with .cuda_stream such as torch.cuda.Stream; got {stream!r}")
    return raw or CUDA_STREAM_LEGACY


class Backend(_Handle):
    """A rank's backend: Backend("host"), or Backend("cuda", device=None, stream=None).

    CUDA: device is an ordinal, "cuda:N" or a torch.device (default: torch's current device, or 0
    without torch). stream is the compute stream to borrow: a torch.cuda.Stream, a cudaStream_t
    handle as an int (0: the legacy default stream), or None: torch's current stream of that device
    when torch sees a GPU, else a stream the backend makes (set_stream(None) also goes back to that
    one). Without a GPU, creation raises ZbError (ZB_ERR_CUDA, "no CUDA device ..."); a library
    built without CUDA raises ZB_ERR_UNSUPPORTED.
    """

    _destroy = "zb_backend_destroy"

    def __init__(self, kind="host", device=None, stream=None, workspace_bytes=0):
        super().__init__()
        if kind == "host":
            if device is not None or stream is not None or workspace_bytes:
                raise ValueError("zbpp: the host backend takes no device, stream or workspace_bytes; "
                                 "those are for Backend('cuda', ...)")
            self.kind, self.device, self.stream = "host", None, None
            _lib.call("zb_backend_create_host", [_PP], _c.byref(self._h))
            return
        if kind != "cuda":
            raise ValueError(f"zbpp: unknown backend {kind!r}; allowed: 'host', 'cuda'")
        if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) or workspace_bytes < 0:
            raise ValueError(f"zbpp: workspace_bytes must be an int >= 0 (0: 32 MiB), got {workspace_bytes!r}")
        # Import torch (if there is one) before the library binds cuBLASLt and NCCL, so both use
        # torch's copies (DESIGN.md section 5); and take torch's current device and stream as the
        # defaults, so GEMMs land on the stream torch's own work is on.
        torch = _torch_cuda()
        index = _device_index(device, torch)
        if stream is None and torch is not None and index < torch.cuda.device_count():
            stream = torch.cuda.current_stream(index)  # (a device that does not exist: C says so)
        cfg = _CudaBackendConfig()
        cfg.struct_size, cfg.version = _c.sizeof(_CudaBackendConfig), ZB_CUDA_BACKEND_CONFIG_VERSION
        cfg.device, cfg.stream, cfg.workspace_bytes = index, _stream_arg(stream), workspace_bytes
        _lib.call("zb_backend_create_cuda", [_PP, _c.POINTER(_CudaBackendConfig)], _c.byref(self._h),
                  _c.byref(cfg))
        self.kind, self.device = "cuda", index
        self.stream = cfg.stream  # the handle in use (None: the backend's own), as last set

    @property
    def name(self):
        return _lib.function("zb_backend_name", [_P], _c.c_char_p)(self.handle).decode()

    def set_stream(self, stream):
        """Makes `stream` the compute stream from now on (borrowed; see _stream_arg for the forms).
        Work issued before stays ordered before later work (an event, on the device). The host
        backend accepts only None."""
        handle = _stream_arg(stream)
        _lib.call("zb_backend_set_stream", [_P, _P], self.handle, handle)
        if self.kind == "cuda":
            self.stream = handle

    def synchronize(self):
        """Blocks until everything issued on the compute stream has finished."""
        _lib.call("zb_backend_synchronize", [_P], self.handle)

    def alloc(self, nbytes):
        """nbytes of backend memory (device memory on CUDA); an int address. Free with free()."""
        out = _P()
        _lib.call("zb_backend_alloc", [_P, _c.c_size_t, _PP], self.handle, nbytes, _c.byref(out))
        return out.value or 0

    def free(self, addr):
        _lib.call("zb_backend_free", [_P, _P], self.handle, addr or None)

    def copy(self, dst, src, nbytes):
        """Copies nbytes between backend buffers (or host memory on CUDA) on the compute stream."""
        _lib.call("zb_backend_copy", [_P, _P, _P, _c.c_size_t], self.handle, dst or None, src or None, nbytes)


def cuda_built():
    """True when the loaded library was built with CUDA (its CUDA functions can work)."""
    return bool(_lib.function("zb_cuda_built", [], _c.c_int)())


def cuda_device_count():
    """CUDA devices this process sees (0 without a GPU or driver, or in a build without CUDA)."""
    n = _c.c_int32()
    _lib.call("zb_cuda_device_count", [_c.POINTER(_c.c_int32)], _c.byref(n))
    return n.value


def nccl_unique_id():
    """A fresh ncclUniqueId as NCCL_UNIQUE_ID_BYTES bytes: make it on one rank, send it to all."""
    buf = (_c.c_uint8 * NCCL_UNIQUE_ID_BYTES)()
    _lib.call("zb_nccl_unique_id", [_c.POINTER(_c.c_uint8)], buf)
    return bytes(buf)


# ---- optimizer kernels (include/zbpp.h "optimizer kernels"): lists of addresses --------------------

class _TensorList(_c.Structure):
    _fields_ = [("count", _c.c_int32), ("ptrs", _PP), ("numels", _c.POINTER(_c.c_int64))]


def _tensor_list(items, what):
    """A zb_tensor_list_t over [(addr, numel), ...]; the arrays hang off the struct (kept alive)."""
    items = list(items)
    for addr, numel in items:
        if not isinstance(addr, int) or not isinstance(numel, int) or numel < 0 or (numel and not addr):
            raise ValueError(f"zbpp: {what} must be (address, numel) pairs of ints with numel >= 0 and a "
                             f"non-zero address; got {(addr, numel)!r}")
    tl = _TensorList()
    tl.count = len(items)
    ptrs = (_P * max(1, len(items)))(*[a for a, _ in items])
    numels = (_c.c_int64 * max(1, len(items)))(*[n for _, n in items])
    tl.ptrs = _c.cast(ptrs, _PP)
    tl.numels = _c.cast(numels, _c.POINTER(_c.c_int64))
    tl._keep = (ptrs, numels)
    return tl


def _dtype_code(dtype):
    if dtype not in DTYPES:
        raise ValueError(f"zbpp: dtype {dtype!r} is not one of " + ", ".join(DTYPES))
    return DTYPES[dtype]


def sq_norm(backend, dtype, tensors, sq_out, nonfinite_out):
    """zb_sq_norm: *sq_out (a double in backend memory) += the sum of squares of every element of
    tensors ([(addr, numel)] of `dtype`), and *nonfinite_out (an int32) = 1 if any is inf/NaN.
    Enqueued on the backend's compute stream."""
    tl = _tensor_list(tensors, "sq_norm's tensors")
    _lib.call("zb_sq_norm", [_P, _c.c_int, _c.POINTER(_TensorList), _P, _P], backend.handle,
              _dtype_code(dtype), _c.byref(tl), sq_out, nonfinite_out)


def unscale(backend, dtype, tensors, factor, nonfinite_out):
    """zb_unscale: every element *= factor (in fp32), *nonfinite_out = 1 if a result is inf/NaN."""
    tl = _tensor_list(tensors, "unscale's tensors")
    _lib.call("zb_unscale", [_P, _c.c_int, _c.POINTER(_TensorList), _c.c_float, _P], backend.handle,
              _dtype_code(dtype), _c.byref(tl), factor, nonfinite_out)


def loss_scale_update(backend, scale, growth_tracker, nonfinite, growth, backoff, growth_interval):
    """zb_loss_scale_update over a float scale, an int32 tracker and an int32 flag (addresses)."""
    _lib.call("zb_loss_scale_update", [_P, _P, _P, _P, _c.c_double, _c.c_double, _c.c_int32], backend.handle,
              scale, growth_tracker, nonfinite, growth, backoff, growth_interval)


class _OptimStepC(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("kind", _c.c_int),
        ("lr", _c.c_double),
        ("momentum", _c.c_double),
        ("beta1", _c.c_double),
        ("beta2", _c.c_double),
        ("eps", _c.c_double),
        ("weight_decay", _c.c_double),
        ("step", _c.c_int64),
        ("factor", _c.c_float),
        ("grad_dtype", _c.c_int),
        ("params", _TensorList),
        ("grads", _TensorList),
        ("state1", _TensorList),
        ("state2", _TensorList),
        ("undo", _P),
    ]


ZB_OPTIM_STEP_VERSION = 1


class OptimStep:
    """zb_optim_step over fixed lists: params, grads, state1, state2 as [(addr, numel)] (state1:
    AdamW's exp_avg or SGD's momentum buffer; state2: exp_avg_sq; empty where the kind has none).
    The lists are built once, so a step costs one C call. run(backend, step, factor, undo) steps
    (t = step, counting from 1), undo(backend, undo) restores what run saved into `undo` (an address
    of undo_bytes() bytes of backend memory)."""

    def __init__(self, kind, params, grads, state1=(), state2=(), grad_dtype="float32", lr=1e-3,
                 momentum=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        if kind not in OPTIMIZERS:
            raise ValueError(f"zbpp: optimizer kind {kind!r} is not one of " + ", ".join(OPTIMIZERS))
        c = self._c = _OptimStepC()
        c.struct_size, c.version = _c.sizeof(_OptimStepC), ZB_OPTIM_STEP_VERSION
        c.kind, c.grad_dtype = OPTIMIZERS[kind], _dtype_code(grad_dtype)
        c.lr, c.momentum, c.beta1, c.beta2, c.eps, c.weight_decay = lr, momentum, beta1, beta2, eps, weight_decay
        self._lists = [_tensor_list(params, "params"), _tensor_list(grads, "grads"),
                       _tensor_list(state1, "state1"), _tensor_list(state2, "state2")]
        c.params, c.grads, c.state1, c.state2 = self._lists

    def _set(self, step, factor, undo):
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"zbpp: the step number counts from 1, got {step!r}")
        self._c.step, self._c.factor, self._c.undo = step, factor, undo or None
        return _c.byref(self._c)

    def undo_bytes(self):
        out = _c.c_size_t()
        _lib.call("zb_optim_undo_bytes", [_c.POINTER(_OptimStepC), _c.POINTER(_c.c_size_t)], _c.byref(self._c),
                  _c.byref(out))
        return out.value

    def run(self, backend, step, factor=1.0, undo=None):
        _lib.call("zb_optim_step", [_P, _c.POINTER(_OptimStepC)], backend.handle, self._set(step, factor, undo))

    def undo(self, backend, undo, step=1):
        """Restores params and state from `undo` (saved by run with the same lists)."""
        _lib.call("zb_optim_undo", [_P, _c.POINTER(_OptimStepC)], backend.handle, self._set(step, 1.0, undo))


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


class InprocGroup(_Handle):
    """Ranks as threads of this process (tests, single-process runs)."""

    _destroy = "zb_inproc_group_destroy"

    def __init__(self, ranks):
        super().__init__()
        _lib.call("zb_inproc_group_create", [_PP, _c.c_int32], _c.byref(self._h), ranks)


class Transport(_Handle):
    """A rank's transport: in-process (`Transport.inproc(group, rank)`), over connected sockets
    (`Transport.socket(rank, ranks, fds)`), with Python callbacks (`Transport.callbacks(impl, rank,
    ranks)`, impl having isend/irecv/wait/cancel/abort) or NCCL (`Transport.nccl(...)`)."""

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
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"zbpp: Transport.nccl: ranks must be an int >= 1, got {ranks!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
            raise ValueError(f"zbpp: Transport.nccl: rank must be an int in [0, {ranks - 1}] for ranks={ranks}, "
                             f"got {rank!r}")
        if not isinstance(unique_id, (bytes, bytearray, memoryview)):
            raise TypeError(f"zbpp: Transport.nccl: unique_id must be the {NCCL_UNIQUE_ID_BYTES} bytes of "
                            f"nccl_unique_id(), got {type(unique_id).__name__}")
        unique_id = bytes(unique_id)
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"zbpp: Transport.nccl: unique_id must be exactly {NCCL_UNIQUE_ID_BYTES} bytes "
                             f"(nccl_unique_id() of one rank, broadcast to all), got {len(unique_id)}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"zbpp: Transport.nccl: timeout must be a number of seconds > 0, got {timeout!r}")
        sched_ranks = getattr(schedule, "ranks", None)
        if sched_ranks is None or not hasattr(schedule, "handle"):
            raise TypeError(f"zbpp: Transport.nccl: schedule must be a zbpp.Schedule, got {type(schedule).__name__}")
        if sched_ranks != ranks:
            raise ValueError(f"zbpp: Transport.nccl: the schedule has {sched_ranks} ranks but ranks={ranks}; "
                             "every rank passes the pipeline's schedule")
        if not isinstance(backend, Backend) or backend.kind != "cuda":
            got = backend.kind if isinstance(backend, Backend) else type(backend).__name__
            raise ValueError(f"zbpp: Transport.nccl moves device buffers, so it needs a CUDA backend "
                             f"(Backend('cuda', device)); got {got!r}")
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
        t._backend = backend  # borrowed by the transport: must outlive it
        _lib.call("zb_transport_create_nccl", [_PP, _c.POINTER(_NcclConfig)], _c.byref(t._h), _c.byref(cfg))
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


class Runner(_Handle):
    """One rank's runner over a Schedule. forward(stage, mb, in_addr, out_addr) and
    backward(stage, mb, grad_out_addr, grad_in_addr) are Python callables (addresses are ints, 0 for
    NULL); an exception they raise is re-raised by run(), chained to the runner's message."""

    _destroy = "zb_runner_destroy"

    def __init__(self, schedule, rank, backend, wstore, transport, boundary_bytes, forward, backward,
                 timeout_s=300.0, recv_depth=0, pairs=(), allocator=None, release=None):
        """pairs: indices k into this rank's op list where ops k and k+1 run as one unit (both
        inputs first, both callbacks back to back, both outputs after; zb_runner_config_t).
        allocator: (alloc(nbytes) -> address, free(address)) for the runner's message buffers, all
        taken at creation and given back at close (zb_runner_config_t.alloc_cb); None: the
        backend's. release: release(token), for zero-copy stages (zb_runner_config_t.release_cb):
        the callbacks get out_addr 0 and hand their own output with lend_output(addr, token), and
        each input stays valid until its microbatch's W; the runner calls release(token) when it is
        done with a lent buffer."""
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
