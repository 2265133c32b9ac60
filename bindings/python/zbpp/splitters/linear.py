"""The torch.nn.Linear family: SplitLinear, nn.Linear with its weight gradient split off into a W.

What this is: an autograd Function whose backward, inside a pipeline, returns only the input
gradient and pushes the weight and bias gradients to the W store (zbpp.wgrad_store) as this B's W
work, with x and dy kept alive until W has run. `split(module)` makes an nn.Linear (exactly that
class) a SplitLinear in place: a class swap, so parameters, state dict, hooks and requires_grad are
untouched and isinstance(m, nn.Linear) stays true. Subclasses of nn.Linear, and other modules whose
class name says "Linear", are reported as not split with the reason (their forward may not be a
plain linear map).

Where a pipeline's W puts the gradient: `param.main_grad` when the parameter has one (main_grad +=
g, as Megatron's DDP hook adds .grad), else `param.grad` as autograd's AccumulateGrad would (the
store's "torch" kernel: bit for bit nn.Linear's; see zbpp.wgrad_store for the library's GEMM).
Inside a pipeline autograd gets no weight or bias gradient from the layer.

Outside a pipeline (no W store capturing on the tensors' device, and not torch.compile's backward,
whose op writes .grad as above) a split layer keeps nn.Linear's contract with autograd: its backward
returns the weight and bias gradients. So torch.autograd.grad returns them (inputs= any of weight,
bias and input; allow_unused and materialize_grads as with nn.Linear) and leaves .grad alone;
loss.backward() adds them to .grad through autograd's accumulation (tensor hooks, post-accumulate-
grad hooks and DDP see them); retain_graph=True backwards accumulate; a weight computed from
parameters (torch.func.functional_call, MAML's W - lr*g) passes its gradient on. With grad mode off
in the backward (a plain backward) the gradients come from the same kernel as a pipeline's W, into
new tensors that autograd adds to .grad: with the "torch" kernel nn.Linear's own bits; with the
library's GEMM (new fp32 tensors, rounded by autograd to the parameter's dtype), the pipeline's
bits always for the bias (summed apart in both) and the first backward, and for the weight while a
backward's rows fit the BLAS's K block (a few hundred with OpenBLAS; beyond it the BLAS adds its
block sums to .grad one at a time, and the last bits may differ). With create_graph=True they are
differentiable torch ops, nn.Linear's own, so gradient penalties and second-order MAML work. A
gradient autograd will not use (torch.autograd.grad(loss, x)) is not computed. Parameters with
main_grad keep Megatron's accumulation: W adds to main_grad at once and autograd gets None for them
(torch.autograd.grad then needs allow_unused=True).

The input gradient, and with the "torch" kernel the weight and bias gradients, are computed by the
ops autograd runs for nn.Linear on the same tensors (zbpp._wlayout), so a split model trains
bit for bit as the unsplit one, except where a weight is used more than once in one backward (tied
weights within a stage: autograd sums the uses' gradients before adding them to .grad, W adds its
own apart) and for a frozen-weight layer's inputs that torch's matmul would not fold into rows.
"""

import contextlib
import threading

import torch
import torch.nn.functional as F

from .. import _ops
from .. import wgrad_store as _store
from .._wlayout import autograd_layout
from ._base import NOT_SPLIT, SPLIT, frozen_or

__all__ = ["SplitLinear", "NAME", "active", "claims", "classify", "split", "deferred", "deferring_functions",
           "fused_forward"]

NAME = "torch.nn.Linear"


def _autocast_dtype(device_type):
    """The dtype torch.autocast casts a linear's inputs to on this device, or None when it is off."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch before 2.4 takes no device type
        on = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not on:
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        # Under torch.autocast, nn.Linear computes in the autocast dtype with its inputs cast; so
        # does this, and its backward then works with the same cast tensors (dx in that dtype,
        # which autograd turns into x's; dW = dy^T x in that dtype, converted into the fp32
        # parameter's gradient). The parameters themselves (not the casts) are where the gradients go.
        cast = _autocast_dtype(x.device.type) if x.is_floating_point() else None
        wc, bc = weight, bias
        if cast is not None:
            x, wc = x.to(cast), weight.to(cast)
            bc = bias.to(cast) if bias is not None else None
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(x, wc, bc)
        else:
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, wc)
        ctx.weight = weight
        ctx.bias = bias
        return out

    @staticmethod
    def backward(ctx, dy):
        x, wc = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        if dy.dtype != x.dtype:
            dy = dy.to(x.dtype)
        # The tensors as nn.Linear's backward reads them: dx, dW and db then come from the same ops.
        layout = autograd_layout(x, dy, wc, bias)
        compiling = _ops.compiling()
        if compiling or _store.store_of(x).capturing:
            # A pipeline's B, or torch.compile's backward: W goes to the store (run later, or at once
            # by the op when nothing captures), which writes main_grad or .grad; autograd gets None.
            dx = _input_grad(x, layout, wc) if ctx.needs_input_grad[0] else None
            if weight.requires_grad or (bias is not None and bias.requires_grad):
                push = _ops.op() if compiling else None
                if push is not None:
                    push(x, dy, weight, bias)  # torch.compile: one opaque node, no graph break (_ops.py)
                else:
                    _store.defer_linear(x, dy, weight, bias, layout)
            return dx, None, None
        # Outside a pipeline: nn.Linear's contract, the gradients go back to autograd (module docstring).
        if torch.is_grad_enabled() and wc is not weight:
            # create_graph under autocast: the weight's cast, made inside forward, is no part of the
            # graph; made again here it is, so second-order terms reach the weight.
            wc = weight.to(wc.dtype)
        dx = _input_grad(x, layout, wc) if _engine_wants(ctx, 0) else None
        dw, db = _store.linear_grads(layout, weight if _engine_wants(ctx, 1, weight) else None,
                                     bias if bias is not None and _engine_wants(ctx, 2, bias) else None)
        return dx, dw, db


def _engine_wants(ctx, i, param=None):
    """Whether this backward must compute the gradient of its input i: autograd will use it (as
    nn.Linear's backward, which skips the weight GEMM under torch.autograd.grad(loss, x)), or it
    goes to main_grad, which Megatron's fused accumulation always fills. True when unsure."""
    if not ctx.needs_input_grad[i]:
        return False
    if param is not None and getattr(param, "main_grad", None) is not None:
        return True
    will = getattr(torch._C, "_will_engine_execute_node", None)  # torch's own multi-grad hooks use it
    node = ctx.next_functions[i][0]
    if will is None or node is None:
        return True
    try:
        return bool(will(node))
    except RuntimeError:  # a leaf torch.autograd.grad returns (torch does not say for those): wanted
        return True


def _input_grad(x, layout, wc):
    """The input gradient as autograd's mm_mat1_backward forms it for mat1 = x2, mat2 = wc^T:
    (wc^T dy2^T)^T for a column-major x2, dy2 wc otherwise; back in x's shape."""
    x2, dy2 = layout.x2, layout.dy2
    if x2.stride(0) == 1 and x2.stride(1) == x2.shape[0]:
        dx2 = wc.t().mm(dy2.t()).t()
    else:
        dx2 = dy2.mm(wc)
    return dx2 if x.dim() == 2 else dx2.reshape(x.shape)


class _Fused(threading.local):
    on = False


_FUSED = _Fused()


@contextlib.contextmanager
def fused_forward(on=True):
    """Within it, on this thread, split layers run nn.Linear's own forward (F.linear, torch's
    autograd node): a pipeline's forward of a microbatch whose backward is fused (no W op of its
    own, as in 1F1B) has nothing to defer, and the split's autograd Function would only cost time
    (an op in Python per layer and backward). The gradients are the same bits either way (the
    split's W runs nn.Linear's ops). Layers whose parameters have main_grad keep the split, whose
    W adds there, as Megatron's accumulation does."""
    was, _FUSED.on = _FUSED.on, bool(on)
    try:
        yield
    finally:
        _FUSED.on = was


class SplitLinear(torch.nn.Linear):
    """nn.Linear whose backward defers the weight gradient to the W store (see module docstring)."""

    def forward(self, x):
        if (_FUSED.on or not torch.is_grad_enabled()) and not _has_main_grad(self):
            # Nothing to defer (a fused backward, or no backward at all): nn.Linear itself.
            return F.linear(x, self.weight, self.bias)
        cast = _autocast_dtype(x.device.type) if x.is_floating_point() else None
        if cast is not None and x.dtype != cast:
            # The input's cast is autograd's own op (it saves nothing), so a double backward
            # (create_graph) reaches x through it, as through nn.Linear's autocast cast.
            x = x.to(cast)
        return _SplitLinearFn.apply(x, self.weight, self.bias)


def _has_main_grad(m):
    return getattr(m.weight, "main_grad", None) is not None or (
        m.bias is not None and getattr(m.bias, "main_grad", None) is not None)


# ---- the family's interface (zbpp.splitters) --------------------------------------------------------

def active():
    return True


def claims(m):
    """torch.nn.Linear and its subclasses, and any other module with parameters of its own whose
    class name contains "Linear" (reported, not split: zbpp does not know its forward). Asked after
    the Megatron and Transformer Engine families, which claim their own first."""
    if isinstance(m, torch.nn.Linear):
        return True
    return "linear" in type(m).__name__.lower() and any(True for _ in m.parameters(recurse=False))


def classify(m):
    if type(m) is SplitLinear:
        found = (SPLIT, "")
    elif type(m) is torch.nn.Linear:
        found = (NOT_SPLIT, "not converted (zbpp.split_linear converts it)")
    elif isinstance(m, torch.nn.Linear):
        found = (NOT_SPLIT, "a subclass of torch.nn.Linear: zbpp converts torch.nn.Linear itself only "
                            "(a subclass's forward may not be a plain linear map)")
    else:
        found = (NOT_SPLIT, "a linear-like layer zbpp does not know (it splits torch.nn.Linear, Megatron's "
                            "ColumnParallelLinear / RowParallelLinear and Transformer Engine's linear modules)")
    return frozen_or(m, found)


def split(m):
    """nn.Linear (exactly that class) becomes a SplitLinear; returns whether `m` is split now."""
    if type(m) is torch.nn.Linear:
        m.__class__ = SplitLinear
    return type(m) is SplitLinear


def deferred(m):
    """The parameters whose gradient a split layer pushes to the W store: weight and bias."""
    if type(m) is not SplitLinear:
        return []
    return [p for p in (m.weight, m.bias) if p is not None and p.requires_grad]


def deferring_functions():
    return [_SplitLinearFn]


# Registered now, not inside a traced backward: torch.compile cannot trace a registration.
_ops.op()
