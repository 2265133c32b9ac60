"""The Transformer Engine family: TE's linear modules (Linear, LayerNormLinear, LayerNormMLP,
GroupedLinear) and Megatron's wrappers of them.

What this is: the registry's view of zbpp.te_layers, which makes TE's own delayed weight gradient
(its wgrad_store and backward_dw, TE 2.3 and later) a zbpp W. Recognised by their classes' modules,
so nothing of TE is imported here. A TE module whose class says "Linear" but that has no weight-
gradient store is claimed and reported as not split, with the reason.
"""

from .. import te_layers
from ._base import NOT_SPLIT, frozen_or

__all__ = ["NAME", "active", "claims", "classify", "split", "deferred", "deferring_functions"]

NAME = "Transformer Engine"

_NO_STORE = ("Transformer Engine module without a weight-gradient store (TE 2.3 and later give Linear, "
             "LayerNormLinear, LayerNormMLP and GroupedLinear one, which zbpp drives; or use Megatron's "
             "local layers, transformer_impl='local')")


def active():
    return True


def claims(m):
    if te_layers.is_te_linear(m):
        return True
    return (te_layers.is_transformer_engine(m) and "linear" in type(m).__name__.lower()
            and any(True for _ in m.parameters(recurse=False)))


def classify(m):
    if te_layers.is_te_linear(m):
        return te_layers.classify(m)
    return frozen_or(m, (NOT_SPLIT, _NO_STORE))


def split(m):
    return te_layers.is_te_linear(m) and te_layers.split_layer(m)


def deferred(m):
    """What TE's backward_dw computes: every trainable parameter but a fused layer norm's
    (layer_norm_weight / layer_norm_bias, whose gradients TE's backward returns in B)."""
    if not te_layers.is_split(m):
        return []
    return [p for name, p in m.named_parameters() if p.requires_grad and not name.startswith("layer_norm")]


def deferring_functions():
    return []  # TE's backward keeps its W in TE's own store; autograd sees no weight gradient from it
