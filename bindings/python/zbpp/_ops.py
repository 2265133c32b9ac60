"""zbpp's W push as a torch custom op, `zbpp::defer_wgrad`, so torch.compile traces split layers.

Why: SplitLinear's backward hands W to the C store through ctypes, a call torch.compile's tracer
cannot follow: it broke the graph at every split layer. As a custom op the push is one opaque node
of the compiled backward, which calls it with the real tensors (the parameter itself, so its .grad
or main_grad gets the gradient) when the backward runs: inside a pipeline's B it goes into the W
store as in eager mode; outside, it runs at once. The op returns nothing, so it is registered as an
ordered side effect (torch's effect tokens): without that the compiler drops it as dead code and
the weight gradients are lost without a word (tests/python/test_split.py checks both). A deferred
push copies x and dy first, since the compiled graph reuses their memory once the op returns; the
eager path keeps them without a copy.

Where: a torch with torch.library.custom_op and effect registration (2.4 and later); elsewhere
op() is None and the backward calls the store directly (eager, or a graph break under
torch.compile, as before). Eager backwards never go through the op: the dispatcher's cost per call
would be paid on every split layer of every microbatch for nothing.

The stable-ABI ops. On torch 2.10 and newer the build also makes libzbpp_torch.so
(csrc/torch/ops.cpp), which registers `zbpp::wgrad` (W now: dw += dy^T x, db += sum of dy) and
`zbpp::wgrad_deferred` (the same W pushed into the W store bound to the device, run now when none
is) through libtorch's stable ABI: dispatcher ops with C++ kernels, which torch.compile and
torch.export record as graph nodes and which run without Python (a C++ program or an AOTInductor
package that loads the library). `stable()` loads it and returns torch.ops.zbpp, or None where it
cannot (older torch, a build without it: the reason is in `stable_unavailable()`). The library
also registers `zbpp::linear_wgrad` (csrc/torch/linear_wgrad.cpp): nn.Linear's weight and bias
gradients by torch's own ops, in autograd's order, run now or pushed into a given store and run
from C++ when the store releases the entry; it is the W of split layers wherever it loads (the W
store's "torch" kernel, wgrad_store.py). Under torch.compile SplitLinear still goes through the Python op
above: where its gradient goes (main_grad, a .grad made on first use) is decided from Python
attributes at run time.
"""

import ctypes
import importlib.util
import os
from typing import Optional

import torch

from . import _lib

_OP = []


def op():
    """torch.ops.zbpp.defer_wgrad, registered on first use (splitters/linear.py makes that its import, since
    torch.compile cannot trace a registration); None where this torch cannot."""
    if not _OP:
        _OP.append(_register())
    return _OP[0]


def _ordered_effect(overload):
    """Registers an op that returns nothing as an ordered side effect (torch's effect tokens), so a
    compiler keeps it, in order, instead of dropping it as dead code; False where this torch has no
    such registration (a private torch API)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    _register_effectful_op(overload, _EffectType.ORDERED)
    return True


def _register():
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None or importlib.util.find_spec("torch._higher_order_ops.effects") is None:
        return None  # without effect registration the compiler would drop the op (_ordered_effect)

    existing = getattr(getattr(torch.ops, "zbpp", None), "defer_wgrad", None) if _has_op() else None
    if existing is not None:  # a second copy of this module in the process (e.g. reloaded)
        return existing

    @custom_op("zbpp::defer_wgrad", mutates_args=())
    def defer_wgrad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        from .wgrad_store import default_store, defer_weight_grad

        if default_store(None if x.device.type == "cpu" else x.device).capturing:
            # Deferred: W reads x and dy after this op has returned, but a compiled graph treats
            # them as dead once its last op has used them and reuses their memory (inductor's
            # buffer reuse; a reference does not stop it). So W gets copies of its own (measured:
            # without them the gradients were wrong).
            x, dy = x.clone(), dy.clone()
        defer_weight_grad(x, dy, weight, bias)

    @defer_wgrad.register_fake
    def _(x, dy, weight, bias):
        return None

    _ordered_effect(torch.ops.zbpp.defer_wgrad.default)
    return torch.ops.zbpp.defer_wgrad


def _has_op():
    try:
        return torch._C._dispatch_has_kernel("zbpp::defer_wgrad")
    except (AttributeError, RuntimeError):
        return False


def compiling():
    """Whether torch.compile is tracing this call (its backward included)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


# ---- the stable-ABI library (libzbpp_torch.so) ---------------------------------------------------
ENV_TORCH_LIBRARY = "ZBPP_TORCH_LIBRARY"
MISSING = " (this build has none)"  # the end of stable_unavailable() when the file is not there
TORCH_LIB_NAME = "libzbpp_torch.so"
TOKEN_BIT = 1 << 63  # tokens of entries zbpp::wgrad_deferred pushed (csrc/torch/ops.cpp)
CPU_KEY = -1  # the CPU's device key in zbpp_torch_bind

_STABLE = []  # [torch.ops.zbpp or None, ctypes handle or None, reason when None]


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def stable_library_path():
    """Where libzbpp_torch.so is looked for: $ZBPP_TORCH_LIBRARY, else beside libzbpp.so."""
    env = os.environ.get(ENV_TORCH_LIBRARY)
    if env:
        return env
    return os.path.join(os.path.dirname(_lib.library_path()), TORCH_LIB_NAME)


def stable():
    """torch.ops.zbpp with the stable-ABI ops loaded (wgrad, wgrad_deferred), or None where this
    torch or this build has none (stable_unavailable() says why)."""
    if not _STABLE:
        _STABLE.extend(_load_stable())
    return _STABLE[0]


def stable_unavailable():
    """Why stable() is None ("" when it is not)."""
    stable()
    return _STABLE[2]


def _load_stable():
    if _torch_version() < (2, 10):
        return None, None, f"torch {torch.__version__} has no stable ABI for custom ops (2.10 or newer needed)"
    _lib.lib()  # libzbpp.so first: the ops library then binds to this very copy (its soname)
    path = stable_library_path()
    if not os.path.isfile(path):
        return None, None, (f"{path} not found: it is built by CMake when ZB_PYTHON's torch is 2.10 or newer "
                            f"(cmake -DZB_PYTHON=$(which python) ...), or set {ENV_TORCH_LIBRARY}{MISSING}")
    torch.ops.load_library(path)
    handle = ctypes.CDLL(path)  # the same object torch loaded: dlopen of one path gives one copy
    handle.zbpp_torch_bind.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    handle.zbpp_torch_bind.restype = ctypes.c_int
    handle.zbpp_torch_release.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32]
    handle.zbpp_torch_release.restype = ctypes.c_int
    handle.zbpp_torch_live.argtypes = [ctypes.c_void_p]
    handle.zbpp_torch_live.restype = ctypes.c_int64
    last_error = getattr(handle, "zbpp_torch_last_error", None)
    if last_error is None or not hasattr(torch.ops.zbpp, "linear_wgrad"):
        return None, None, (f"{path} predates zbpp::linear_wgrad (torch's own weight-gradient ops); rebuild "
                            "it from this checkout")
    last_error.argtypes = []
    last_error.restype = ctypes.c_char_p
    # They mutate nothing their schemas name (the write comes later, at W, or not visibly to a graph).
    _ordered_effect(torch.ops.zbpp.wgrad_deferred.default)
    _ordered_effect(torch.ops.zbpp.linear_wgrad.default)
    return torch.ops.zbpp, handle, ""


def _handle():
    stable()
    return _STABLE[1]


def bind(device_key, store_handle, stream=None):
    """Points zbpp::wgrad_deferred on a device (CPU_KEY or a CUDA ordinal) at a C W store (None
    unbinds). A no-op while the stable library is not loaded."""
    h = _STABLE[1] if _STABLE else None
    if h is not None and h.zbpp_torch_bind(device_key, store_handle, stream) != 0:
        raise ValueError(f"zbpp: cannot bind a W store to device key {device_key} (-1 is the CPU, "
                         "0 and up a CUDA ordinal)")


ZB_ERR_INVALID_ARGUMENT = 1
ZB_ERR_INTERNAL = 14


def release(token, ran):
    """Hands an entry the stable-ABI ops pushed back to the library: when it ran, its work runs now
    (zbpp::linear_wgrad's torch ops; a RuntimeError with torch's message when they fail), then the
    tensors it kept are dropped."""
    h = _handle()
    status = h.zbpp_torch_release(None, token, int(bool(ran)))
    if status == ZB_ERR_INTERNAL:
        raise RuntimeError(f"zbpp: the weight gradient (W) failed in torch: {h.zbpp_torch_last_error().decode()}")
    if status != 0:
        raise RuntimeError(f"zbpp: the stable-ABI library has no live W entry with token {token:#x}")


def live(store_handle):
    """Entries zbpp::wgrad_deferred pushed into this store that are not yet released."""
    h = _STABLE[1] if _STABLE else None
    return 0 if h is None else int(h.zbpp_torch_live(store_handle))
