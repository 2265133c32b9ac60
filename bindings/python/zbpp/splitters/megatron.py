"""The Megatron-LM family: ColumnParallelLinear and RowParallelLinear (and their subclasses).

What this is: the registry's view of zbpp.megatron.layers, which splits a layer by giving it a
`_forward_impl` of zbpp's (W: grad_output^T @ total_input, Megatron's own ops, into main_grad; see
that module). Asked only once Megatron's tensor_parallel.layers is imported (a model holding such a
layer has imported it): zbpp never imports Megatron itself here. A Megatron that lacks what
zbpp.megatron.layers needs still has its layers claimed, and reported as not split with the reason.
"""

import sys

from ._base import NOT_SPLIT, SPLIT, frozen_or

__all__ = ["NAME", "active", "claims", "classify", "split", "deferred", "deferring_functions"]

NAME = "Megatron-LM"
_MODULE = "megatron.core.tensor_parallel.layers"
_CLASSES = ("ColumnParallelLinear", "RowParallelLinear")


def active():
    return sys.modules.get(_MODULE) is not None


def _layers():
    """zbpp.megatron.layers, or the ImportError saying what this Megatron lacks."""
    try:
        from ..megatron import layers
    except ImportError as exc:
        return exc
    return layers


def claims(m):
    return any(getattr(c, "__module__", "") == _MODULE and c.__name__ in _CLASSES for c in type(m).__mro__)


def classify(m):
    layers = _layers()
    if isinstance(layers, Exception):
        return frozen_or(m, (NOT_SPLIT, f"zbpp cannot split this Megatron's layers: {layers}"))
    return layers.classify(m)


def split(m):
    layers = _layers()
    return not isinstance(layers, Exception) and layers.split_layer(m)


def deferred(m):
    """The weight of a split layer (its bias gradient comes back to autograd in B, as Megatron's);
    none for a layer whose weight is passed to forward (tied: that weight is another module's)."""
    layers = _layers()
    if isinstance(layers, Exception) or not layers.is_split(m) or layers.classify(m)[0] != SPLIT:
        return []
    weight = getattr(m, "weight", None)
    return [weight] if weight is not None and weight.requires_grad else []


def deferring_functions():
    layers = _layers()
    return [] if isinstance(layers, Exception) else [layers._SplitLinearWithAsyncCommunication]
