"""Split backward for Transformer Engine's linear modules, through TE's own deferred weight gradient.

Transformer Engine (2.3 and later) can keep a linear module's weight-gradient GEMM out of its
backward: a module built with `delay_wgrad_compute=True` puts the GEMM's inputs and function into
its `wgrad_store` (a FIFO) during backward, and `module.backward_dw()` later pops the oldest and
runs it, writing `main_grad` (fused accumulation) or `.grad`, and calls the module's
wgrad-accumulation hooks. That is B and W already; what TE leaves to the caller is *when* W runs.
zbpp makes that a W op of its schedule:

- `split_layer(module)` turns the delay on for a module built without it (its `wgrad_store` is
  replaced by a delaying store of TE's own class, the zbpp subclass below) and keeps one that has
  it (Megatron's `config.delay_wgrad_compute`).
- During a B, the store notes each put. At the end of that autograd pass (torch's engine
  callback, the hook DDP uses; a module may put several times per backward, LayerNormMLP twice)
  one W entry goes to zbpp's W store, in the group of the B the runner opened; popping it runs
  TE's `backward_dw()` as often as needed to consume exactly that B's puts, oldest first. zbpp's
  W groups pop per stage in B order, TE's store per module in put order: the same order.
  Outside a pipeline (no runner capturing) W runs at the end of the same backward, so plain
  `loss.backward()` fills every gradient.
- TE's `backward_dw` is called through the Transformer Engine class that defines it: Megatron's
  TE wrappers (TELinear, TELayerNormColumnParallelLinear, ...) skip it unless Megatron's own
  `config.delay_wgrad_compute` is set.
- After W, a gradient TE left in `.grad` (biases; weights without fused accumulation) is added to
  `main_grad` and cleared, which is what Megatron's DDP hook does for a module whose backward_dw
  it is registered on; otherwise the next W's bias gradient would be dropped (TE sets a bias
  .grad only when it is None).

Split only where W's result has one place to go across microbatches: modules with
`fuse_wgrad_accumulation` (Megatron's --gradient-accumulation-fusion, its default with TE), whose
parameters get Megatron's `main_grad`. Refused, with the reason in zbpp.split_report: a TE without
delay_wgrad_compute, modules without fused accumulation, TE's userbuffers overlap (ub_bulk_wgrad;
TE itself refuses delayed wgrad there), and TE modules without a wgrad_store.

Verified against the TE protocol as written in TE's sources (transformer_engine/pytorch/module:
base.py backward_dw, _common.py WeightGradStore, linear.py); not yet run against a real TE, which
needs a GPU (tests/python/test_te_layers.py has the gpu test for it).
"""

import sys
import weakref

import torch

from . import wgrad_store as _store
from .splitters._base import FROZEN, NOT_SPLIT, SPLIT

__all__ = ["is_te_linear", "is_transformer_engine", "classify", "split_layer", "unsplit_layer", "is_split"]


def _te_class(cls):
    mod = getattr(cls, "__module__", "") or ""
    return mod.split(".")[0] == "transformer_engine"


def is_transformer_engine(m):
    """A module of Transformer Engine, or one of Megatron's wrappers of TE's modules."""
    for cls in type(m).__mro__:
        if _te_class(cls) or getattr(cls, "__module__", "") == "megatron.core.extensions.transformer_engine":
            return True
    return False


def is_te_linear(m):
    """Whether `m` is a Transformer Engine module with a weight-gradient store (TE's Linear,
    LayerNormLinear, LayerNormMLP, GroupedLinear, and Megatron's wrappers of them)."""
    return is_transformer_engine(m) and hasattr(m, "wgrad_store")


def _te_backward_dw(m):
    """TE's own backward_dw for m's class (the first Transformer Engine class in the MRO that
    defines it), or None."""
    for cls in type(m).__mro__:
        if _te_class(cls) and "backward_dw" in cls.__dict__:
            return cls.__dict__["backward_dw"]
    return None


def is_split(m):
    return isinstance(getattr(m, "wgrad_store", None), _DeferringStore)


def classify(m):
    """(status, reason) of a TE module: SPLIT, FROZEN or NOT_SPLIT."""
    params = [p for p in m.parameters() if p.requires_grad]
    if not params:
        return FROZEN, "no trainable parameters: no weight gradient to defer"
    reason = _refusal(m)
    if reason is not None:
        return NOT_SPLIT, reason
    if not is_split(m):
        return NOT_SPLIT, "not converted (zbpp.split_linear converts it)"
    return SPLIT, "Transformer Engine's delayed weight gradient, run by zbpp's W"


def _refusal(m):
    store = getattr(m, "wgrad_store", None)
    if store is None or _te_backward_dw(m) is None:
        return ("Transformer Engine layer without a deferred weight gradient (TE 2.3 and later have "
                "delay_wgrad_compute / backward_dw); upgrade TE, or use Megatron's local layers")
    if is_split(m):
        return None
    if not all(callable(getattr(store, n, None)) for n in ("put", "pop", "delay_wgrad_compute")):
        return "this Transformer Engine's WeightGradStore has no put/pop/delay_wgrad_compute"
    if getattr(m, "ub_bulk_wgrad", False):
        return ("TE's userbuffers overlap (ub_bulk_wgrad, --tp-comm-overlap) cannot delay the weight "
                "gradient (TE refuses delay_wgrad_compute with it)")
    if not getattr(m, "fuse_wgrad_accumulation", False):
        return ("fuse_wgrad_accumulation is off: zbpp splits TE layers whose W accumulates into Megatron's "
                "main_grad (--gradient-accumulation-fusion, Megatron's default with TE)")
    return None


def split_layer(m):
    """Makes a TE module's weight gradient a zbpp W; returns whether it is split now."""
    if is_split(m):
        return True
    if _refusal(m) is not None:
        return False
    old = m.wgrad_store
    store = _deferring_class(type(old))(True)
    store._zbpp_init(m, old)
    m.wgrad_store = store
    return True


def unsplit_layer(m):
    """Gives a split TE module its own store back (a W still pending is dropped: call between steps)."""
    store = getattr(m, "wgrad_store", None)
    if isinstance(store, _DeferringStore):
        m.wgrad_store = store._zbpp_previous


class _DeferringStore:
    """Mixed into TE's WeightGradStore class (see _deferring_class)."""

    def _zbpp_init(self, module, previous):
        self._zbpp_module = weakref.ref(module)
        self._zbpp_previous = previous
        self._zbpp_new = 0        # puts of the backward now running
        self._zbpp_popped = 0     # pops so far
        self._zbpp_goal = 0       # pops that the W entries queued so far will have made
        self._zbpp_flush_queued = False
        self._zbpp_backward_dw = _te_backward_dw(module)

    def put(self, tensor_list, func):
        super().put(tensor_list, func)
        self._zbpp_new += 1
        if not self._zbpp_flush_queued:
            self._zbpp_flush_queued = True
            # At the end of the autograd pass this B is part of: all of this backward's puts are in.
            torch.autograd.Variable._execution_engine.queue_callback(self._zbpp_flush)

    def pop(self):
        out = super().pop()
        self._zbpp_popped += 1
        return out

    def _zbpp_flush(self):
        n, self._zbpp_new, self._zbpp_flush_queued = self._zbpp_new, 0, False
        module = self._zbpp_module()
        if module is None or n == 0:
            return
        self._zbpp_goal += n
        goal = self._zbpp_goal
        device = next((p.device for p in module.parameters()), None)
        _store.defer_action(lambda: self._zbpp_run(goal), device)

    def _zbpp_run(self, goal):
        """W: TE's backward_dw until this B's puts are consumed (the older ones went before)."""
        module = self._zbpp_module()
        if module is None:
            return
        while self._zbpp_popped < goal:
            before = self._zbpp_popped
            self._zbpp_backward_dw(module)
            if self._zbpp_popped == before:
                raise RuntimeError(f"zbpp: {type(module).__name__}.backward_dw() ran no deferred weight gradient "
                                   "(its store is not delaying)")
        for p in module.parameters():
            main = getattr(p, "main_grad", None)
            if p.grad is not None and main is not None and not getattr(p, "grad_added_to_main_grad", False):
                main.add_(p.grad)
                p.grad = None
            elif p.grad is not None and main is not None:
                p.grad = None


_classes = {}


def _deferring_class(cls):
    made = _classes.get(cls)
    if made is None:
        made = type(f"ZbppDeferring{cls.__name__}", (_DeferringStore, cls), {"__module__": __name__})
        setattr(sys.modules[__name__], made.__name__, made)
        _classes[cls] = made
    return made
