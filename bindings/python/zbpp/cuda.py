"""torch-CUDA helpers for the binding: device memory as tensors, streams, one backend per device.

What this is: the small amount of torch-and-CUDA glue that split.py, pipelining.py, optim.py and
the GPU benchmark share:

  - `device_buffer(addr, nbytes, device)`: a uint8 CUDA tensor over memory the C library owns (the
    runner's boundary buffers), made through __cuda_array_interface__ (version 2, so no "stream"
    key and no synchronisation: the caller orders work by using the backend's compute stream).
    `DeviceViews` caches them per address, because the runner recycles its buffers.
  - `backend_for(device)`: the process's one zbpp backend per device (host backend for "cpu"), so
    the W store, the runner and the optimizer kernels of a device share one compute stream.
  - `use_current_stream(backend, device)`: points a CUDA backend at torch's current stream of the
    device before work is issued, so zbpp's kernels run where torch's own work runs and torch's
    caching-allocator rule (a tensor used only on its allocation stream may be freed at once) holds.
  - `OptimKernel` and `sq_norm`: the library's fused optimizer and norm kernels over tensors.
  - `torch_allocator(device)`: torch's caching allocator as the runner's allocator, so the runner's
    message buffers are torch's memory (counted in torch.cuda.memory_allocated, reused from its
    cache) instead of cudaMalloc's beside it.

What this is not: a memory manager. Tensors made by device_buffer do not own their memory; they
are valid only while the C object that owns it says so (for the runner: during the callback).
Nothing here runs at import; torch's CUDA is touched only when a CUDA device is used.
"""

import atexit
import threading

import torch

from . import runtime

__all__ = [
    "DeviceViews",
    "OptimKernel",
    "backend_for",
    "device_buffer",
    "device_of",
    "gpu_identity",
    "shared_gpus",
    "sq_norm",
    "stream_handle",
    "tensor_pairs",
    "torch_allocator",
    "use_current_stream",
]

_TORCH_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def device_of(device):
    """A torch.device with an index for CUDA ("cuda" -> the current device); ValueError for a CUDA
    device this process cannot use or a device type zbpp has no backend for."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"zbpp: device {dev} has no zbpp backend; allowed: cpu, cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"zbpp: device {dev} needs CUDA, but torch.cuda.is_available() is false on this "
                         "machine; use device='cpu'")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"zbpp: CUDA device {index} does not exist; this process sees {count} (0..{count - 1})")
    return torch.device("cuda", index)


def gpu_identity(device):
    """(host name, the GPU's UUID) of a CUDA device: what tells two processes' devices apart (device
    indices do not: CUDA_VISIBLE_DEVICES renumbers them per process)."""
    import socket

    props = torch.cuda.get_device_properties(device_of(device))
    return socket.gethostname(), str(getattr(props, "uuid", f"index {device_of(device).index}"))


def shared_gpus(identities):
    """A phrase naming the ranks that share a GPU ("pipeline ranks 0, 2 share one GPU (<uuid> on
    <host>)"), or None. identities: gpu_identity() per rank, indexed by rank. NCCL refuses two
    ranks of one communicator on one GPU (ncclInvalidUsage, "Duplicate GPU detected", since NCCL
    2.5), so such ranks need another transport; every rank computes this from the same list, so
    every rank decides alike."""
    seen = {}
    for rank, ident in enumerate(identities):
        seen.setdefault(tuple(ident), []).append(rank)
    shared = [(k, v) for k, v in seen.items() if len(v) > 1]
    if not shared:
        return None
    (host, uuid), ranks = shared[0]
    more = f" (and {len(shared) - 1} more GPU(s) likewise)" if len(shared) > 1 else ""
    return f"pipeline ranks {', '.join(map(str, ranks))} share one GPU ({uuid} on {host}){more}"


def stream_handle(stream):
    """The cudaStream_t zbpp is given for a torch stream (or int): torch's default stream, whose
    handle is 0, becomes cudaStreamLegacy, because NULL means "the backend's own stream" in zbpp."""
    return runtime._stream_arg(stream)


class _DeviceMemory:
    """Just enough of the CUDA array interface for torch.as_tensor: a flat byte range."""

    def __init__(self, addr, nbytes):
        # Version 2 has no "stream" key: the consumer must not synchronise with any stream, since
        # the runner orders the buffer's producers and consumers on its compute stream itself.
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 2, "strides": None}


def device_buffer(addr, nbytes, device):
    """A uint8 tensor of nbytes at device address addr (no copy, no ownership)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    t = torch.as_tensor(_DeviceMemory(addr, nbytes), device=device)
    if t.data_ptr() != addr:  # as_tensor copies when the device does not match the pointer's
        raise ValueError(f"zbpp: device address {addr:#x} is not memory of {device}")
    return t


class DeviceViews:
    """Typed views of runner buffers, cached per (address, layout key): the runner's free lists hand
    out the same few buffers over and over, and wrapping one costs more than a kernel launch."""

    _LIMIT = 4096  # entries; a runner has a few buffers per boundary, so this is only a safety net

    def __init__(self, device):
        self.device = device
        self._cache = {}

    def get(self, addr, key, make):
        """make(addr) -> views (see buffer()), cached under (addr, key); key names the layout, e.g.
        the pipeline boundary the buffer belongs to."""
        hit = self._cache.get((addr, key))
        if hit is None:
            if len(self._cache) >= self._LIMIT:
                self._cache.clear()
            hit = make(addr)
            self._cache[(addr, key)] = hit
        return hit

    def buffer(self, addr, nbytes):
        """A uint8 tensor of nbytes at addr on this device (device_buffer)."""
        return device_buffer(addr, nbytes, self.device)

    def clear(self):
        """Forget every view (call when the memory's owner, e.g. a runner, is destroyed)."""
        self._cache.clear()


# ---- one backend per device ------------------------------------------------------------------------

_lock = threading.Lock()
_backends = {}
_exit_hooks = []
_atexit_done = False


def at_exit(fn):
    """Runs fn() at interpreter exit before the backends are closed (W stores must go first: a
    backend with stores on it refuses to be destroyed)."""
    with _lock:
        _register_atexit()
        _exit_hooks.append(fn)


def _register_atexit():
    global _atexit_done
    if not _atexit_done:
        atexit.register(_close_all)
        _atexit_done = True


def _close_all():
    # At exit, while torch and CUDA are still fully alive (module teardown and the CUDA runtime's
    # own destructors come later), so destroying a backend can still synchronise its stream.
    for fn in reversed(_exit_hooks):
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    for backend in list(_backends.values()):
        try:
            backend.close()
        except Exception:  # noqa: BLE001
            pass
    _backends.clear()


def backend_for(device):
    """This process's backend for a device: the host backend for cpu, a CUDA backend (on torch's
    current stream when made; see use_current_stream) for a CUDA device."""
    dev = device_of(device)
    key = str(dev)
    with _lock:
        backend = _backends.get(key)
        if backend is None:
            if dev.type == "cpu":
                backend = runtime.Backend("host")
            else:
                backend = runtime.Backend("cuda", device=dev.index, stream=torch.cuda.current_stream(dev))
            _register_atexit()
            _backends[key] = backend
        return backend


def torch_allocator(device):
    """(alloc, free) over torch's caching allocator on `device`, for runtime.Runner(allocator=...):
    blocks on torch's current stream of the device, the stream the runner runs on."""
    index = device_of(device).index

    def alloc(nbytes):
        return torch.cuda.caching_allocator_alloc(max(int(nbytes), 1), index, torch.cuda.current_stream(index))

    def free(ptr):
        torch.cuda.caching_allocator_delete(ptr)

    return alloc, free


def use_current_stream(backend, device):
    """Points a CUDA backend at torch's current stream of `device` and returns that stream (None for
    the host backend). Cheap when it already is: the library returns at once for the same stream."""
    if backend.kind != "cuda":
        return None
    stream = torch.cuda.current_stream(device)
    handle = stream_handle(stream)
    if backend.stream != handle:
        backend.set_stream(handle)
    return stream


# ---- the library's kernels over tensors --------------------------------------------------------------

def tensor_pairs(tensors, what, device=None, dtype=None):
    """[(data_ptr, numel)] for contiguous tensors on one device (and of one dtype when given)."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise ValueError(f"zbpp: {what} must be contiguous tensors")
        if device is not None and t.device != device:
            raise ValueError(f"zbpp: {what} must all be on {device}; one is on {t.device}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"zbpp: {what} must all be {dtype}; one is {t.dtype}")
        out.append((t.data_ptr(), t.numel()))
    return out


def _dtype_name(dtype, what):
    name = _TORCH_DTYPE.get(dtype)
    if name is None:
        raise ValueError(f"zbpp: {what} must be float32, float16 or bfloat16, got {dtype}")
    return name


def sq_norm(tensors):
    """(sum of squares as a float64 tensor [1], inf/NaN flag as an int32 tensor [1]) of tensors of
    one dtype on one device, by zb_sq_norm on that device's backend (torch's current stream). The
    results stay on the device: read them when you need them (that synchronises)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("zbpp: sq_norm needs at least one tensor")
    dev = device_of(tensors[0].device)
    dtype = tensors[0].dtype
    pairs = tensor_pairs(tensors, "sq_norm's tensors", dev, dtype)
    sq = torch.zeros(1, dtype=torch.float64, device=dev)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    backend = backend_for(dev)
    use_current_stream(backend, dev)
    runtime.sq_norm(backend, _dtype_name(dtype, "sq_norm's tensors"), pairs, sq.data_ptr(), bad.data_ptr())
    return sq, bad


class OptimKernel:
    """The library's fused AdamW/SGD step (zb_optim_step) over fixed parameter and gradient tensors.

    params: fp32 contiguous tensors on one device; grads: tensors of the same shapes, all fp32, all
    bf16 or all fp16 (e.g. persistent main_grad buffers: the addresses are taken once). The state
    (exp_avg/exp_avg_sq, or SGD's momentum buffer) is allocated here, zeroed. step(factor, undo)
    multiplies every gradient by factor (1/loss scale times the clipping coefficient) and steps on
    torch's current stream; with undo (a tensor from undo_buffer()) it first saves what it changes,
    and undo(buffer) restores it bit for bit. The formulas are zb_optimizer's (torch.optim.AdamW,
    SGD without dampening or Nesterov)."""

    def __init__(self, params, grads, kind="adamw", lr=1e-3, momentum=0.0, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        params, grads = list(params), list(grads)
        if not params or len(params) != len(grads):
            raise ValueError(f"zbpp: OptimKernel needs one gradient per parameter ({len(params)} parameters, "
                             f"{len(grads)} gradients)")
        for p, g in zip(params, grads):
            if p.shape != g.shape:
                raise ValueError(f"zbpp: a gradient {tuple(g.shape)} does not match its parameter {tuple(p.shape)}")
        self.device = device_of(params[0].device)
        self.params, self.grads = params, grads
        with torch.no_grad():
            n1 = 1 if kind == "adamw" or momentum != 0 else 0
            self.state1 = [torch.zeros_like(p) for p in params] if n1 else []
            self.state2 = [torch.zeros_like(p) for p in params] if kind == "adamw" else []
        dev = self.device
        self._op = runtime.OptimStep(
            kind, tensor_pairs(params, "params", dev, torch.float32),
            tensor_pairs(grads, "grads", dev, grads[0].dtype), tensor_pairs(self.state1, "state", dev),
            tensor_pairs(self.state2, "state", dev), grad_dtype=_dtype_name(grads[0].dtype, "grads"), lr=lr,
            momentum=momentum, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.backend = backend_for(dev)
        self.steps = 0

    def undo_bytes(self):
        return self._op.undo_bytes()

    def undo_buffer(self):
        """A uint8 tensor of undo_bytes() on the device (torch's allocator: 512-byte aligned)."""
        return torch.empty(self.undo_bytes(), dtype=torch.uint8, device=self.device)

    def step(self, factor=1.0, undo=None):
        use_current_stream(self.backend, self.device)
        self._op.run(self.backend, self.steps + 1, factor, undo.data_ptr() if undo is not None else None)
        self.steps += 1

    def undo(self, undo):
        """Restores params and state from `undo` as the last step(undo=undo) saved them."""
        if self.steps < 1:
            raise ValueError("zbpp: OptimKernel.undo before any step")
        use_current_stream(self.backend, self.device)
        self._op.undo(self.backend, undo.data_ptr(), step=self.steps)
        self.steps -= 1
