"""The base of the runtime's ctypes wrappers: status codes, _Handle, and Backend (host or CUDA).

What this is: the C runtime's status codes and DTYPES (zb_dtype_t), _Handle (one owned C handle,
freed in close(), also on garbage collection), and Backend, the handle every other runtime object
borrows (the W store, the transports, the runner, the optimizer kernels), with the CUDA queries
cuda_built and cuda_device_count. Backend("cuda") with no device or stream takes torch's current
device and stream when torch is importable and sees a GPU.

Streams: the C API reads a NULL stream as "the backend's own stream", but torch's default stream is
the legacy NULL stream (torch.cuda.default_stream().cuda_stream == 0). So a stream 0 given here is
passed as cudaStreamLegacy (0x1), CUDA's explicit name for that same stream; only None means the
backend's own stream.

What this is not: the W store or the runner (runtime.py), the transports (_runtime_transport.py)
or the optimizer kernels (_runtime_optim.py). Import these names from zbpp.runtime.
"""

import ctypes

from . import _lib

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
# cudaStreamLegacy: the legacy default stream by an explicit, non-NULL handle (see the docstring).
CUDA_STREAM_LEGACY = 1

_c = ctypes
_P = _c.c_void_p
_PP = _c.POINTER(_c.c_void_p)


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
