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

What this is not: the libtorch stable-ABI registration that would let the C library register its
entry points itself, without Python (not built yet).
"""

from typing import Optional

import torch

_OP = []


def op():
    """torch.ops.zbpp.defer_wgrad, registered on first use (split.py makes that its import, since
    torch.compile cannot trace a registration); None where this torch cannot."""
    if not _OP:
        _OP.append(_register())
    return _OP[0]


def _register():
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        custom_op = torch.library.custom_op
    except (ImportError, AttributeError):
        return None

    existing = getattr(getattr(torch.ops, "zbpp", None), "defer_wgrad", None) if _has_op() else None
    if existing is not None:  # a second copy of this module in the process (e.g. reloaded)
        return existing

    @custom_op("zbpp::defer_wgrad", mutates_args=())
    def defer_wgrad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        from .split import default_store, defer_weight_grad

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

    _register_effectful_op(torch.ops.zbpp.defer_wgrad.default, _EffectType.ORDERED)
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
