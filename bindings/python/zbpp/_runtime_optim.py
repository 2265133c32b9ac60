"""The optimizer kernels of the C runtime over raw addresses: zb_sq_norm, zb_unscale,
zb_loss_scale_update and zb_optim_step (OptimStep).

What this is: ctypes wrappers over include/zbpp.h's "optimizer kernels": tensors cross as lists of
(address, numel), enqueued on a Backend's compute stream. OPTIMIZERS names the kinds OptimStep runs.
What this is not: the optimizer itself (zbpp.optim and _fused_optim.py turn parameters, gradients
and their state into these lists) or torch-aware. Import these names from zbpp.runtime.
"""

import ctypes

from . import _lib
from ._runtime_backend import DTYPES, _P, _PP

_c = ctypes

# zb_optim_kind_t by torch-style name.
OPTIMIZERS = {"sgd": 0, "adamw": 1}


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
