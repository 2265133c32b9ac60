"""The splitters: which layer family splits which layer's backward into B and W, behind one interface.

What this is: the registry a stage (or a user, through zbpp.split_linear and zbpp.split_report)
asks about a module. Each layer family is a small module with the same functions:

    NAME                 the family, for messages
    active()             whether to ask it at all (Megatron's only once Megatron's layers are imported)
    claims(m)            whether module m is a linear layer of this family, split or not
    classify(m)          (status, reason): SPLIT, FROZEN or NOT_SPLIT (zbpp.splitters._base), and why
    split(m)             splits m in place when it can; returns whether it is split now
    deferred(m)          the parameters whose gradient m, split, pushes to the W store itself
    deferring_functions()  the autograd.Function classes whose backward pushes that W (so a graph
                         splitter does not compute those gradients a second time)

The families, asked in this order (the first that claims a module owns it): megatron.py (Megatron-
LM's ColumnParallelLinear / RowParallelLinear, through zbpp.megatron.layers), te.py (Transformer
Engine's linear modules, through zbpp.te_layers), linear.py (torch.nn.Linear: SplitLinear; also
reports nn.Linear subclasses and other "Linear" modules it does not know). Their W goes through the
W store, zbpp.wgrad_store, which none of them owns.

Every other trainable parameter is the generic splitter's: zbpp._autograd_split splits any module's
backward through its autograd graph. partition(module) splits the layers and says which parameters
are whose; autograd_splitter() returns the generic splitter (imported on first use, None where
this zbpp has none) with the families' deferring functions registered with it.

Import order: the families import the W store and _base, never this registry; the registry imports
the families lazily. So nothing imports in a circle.
"""

import importlib
import warnings
from typing import NamedTuple

import torch

from ._base import FROZEN, NOT_SPLIT, SPLIT, SplitEntry, SplitReport

__all__ = ["families", "family_of", "split", "report", "partition", "Partition", "autograd_splitter",
           "SPLIT", "FROZEN", "NOT_SPLIT", "SplitEntry", "SplitReport"]

FAMILIES = ("megatron", "te", "linear")


def families():
    """The family modules to ask now, in order."""
    found = []
    for name in FAMILIES:
        module = importlib.import_module(f"{__name__}.{name}")
        if module.active():
            found.append(module)
    return found


def family_of(m, _active=None):
    """The family module that claims `m`, or None (not a linear layer of any family)."""
    for family in _active if _active is not None else families():
        if family.claims(m):
            return family
    return None


def _check(module, who):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"zbpp.{who} expects a torch.nn.Module, got {type(module).__name__}")


def split(module, warn=True):
    """Splits the backward of every linear layer in `module` (itself included) it can, in place;
    returns `module` (zbpp.split_linear).

    - torch.nn.Linear (exactly that class) becomes a SplitLinear: the class is swapped, so
      parameters, buffers, state dict keys, hooks and requires_grad are unchanged. Subclasses of
      nn.Linear are left alone (their forward may not be a plain linear map).
    - Megatron-LM's ColumnParallelLinear / RowParallelLinear (megatron.core.tensor_parallel) get a
      split `_forward_impl` of their own (an instance attribute; see zbpp.megatron.layers). Looked
      for only when Megatron's tensor_parallel.layers is already imported (a model holding such a
      layer has imported it); zbpp never imports Megatron itself here.
    - Transformer Engine's linear modules defer their weight gradient through TE's own store, run
      by zbpp's W (zbpp.te_layers).

    Layers that look like linear layers but cannot be split (nn.Linear subclasses, TE modules
    without a weight-gradient store, Megatron layers in a mode zbpp does not split, ...) keep their
    fused backward, so their weight gradients run inside B; with warn=True one warning lists them
    and why. Calling it again is harmless. `report(module)` tells, for every linear layer, whether
    it is split.
    """
    _check(module, "split_linear")
    active = families()
    for m in module.modules():
        family = family_of(m, active)
        if family is not None:
            family.split(m)
    if warn:
        found = report(module)
        if found.not_split:
            warnings.warn(found.warning_text(), stacklevel=2)
    return module


def report(module):
    """For every linear layer of `module` (torch.nn.Linear and its subclasses, Megatron's and
    Transformer Engine's linear layers, and any other module with parameters of its own whose class
    name contains "Linear"): whether its backward defers W to the W store now. Changes nothing.
    Returns a SplitReport (zbpp.split_report)."""
    _check(module, "split_report")
    active = families()
    entries = []
    for name, m in module.named_modules():
        family = family_of(m, active)
        if family is not None:
            entries.append(SplitEntry(name, type(m).__name__, *family.classify(m)))
    return SplitReport(entries)


class Partition(NamedTuple):
    deferred: list     # trainable parameters whose W a split layer pushes itself
    remaining: list    # every other trainable parameter: the generic (autograd graph) splitter's
    report: SplitReport


def partition(module, warn=False):
    """Splits `module`'s layers in place (as split()) and divides its trainable parameters (each
    once, in module order) between the layers that now defer their gradients themselves and the
    rest, for the generic splitter. A parameter registered in more than one module (a weight tied
    between a split linear layer and an embedding) stays in `remaining`: its other uses' gradients
    are the generic splitter's (which leaves the split layer's own to the W store). A parameter
    used by a split layer without being registered in another module that uses it (passed to a
    functional call) cannot be seen here: keep such a layer unsplit."""
    split(module, warn=warn)
    owners = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    active = families()
    deferred_ids = set()
    for m in module.modules():
        family = family_of(m, active)
        if family is not None:
            deferred_ids.update(id(p) for p in family.deferred(m) if owners.get(id(p), 0) == 1)
    deferred, remaining = [], []
    for p in module.parameters():
        if p.requires_grad:
            (deferred if id(p) in deferred_ids else remaining).append(p)
    return Partition(deferred, remaining, report(module))


_GENERIC = "zbpp._autograd_split"


def autograd_splitter():
    """The generic splitter, zbpp._autograd_split (backward_input(outputs, grads, inputs, params):
    B now, the rest of the backward returned as W), imported on first use with every active
    family's deferring functions registered with it; None where this zbpp has none."""
    try:
        generic = importlib.import_module(_GENERIC)
    except ModuleNotFoundError as exc:
        if exc.name != _GENERIC:
            raise
        return None
    register = getattr(generic, "register_deferring", None)
    if register is not None:
        for family in families():
            for fn in family.deferring_functions():
                register(fn)
    return generic
