"""Installing zbpp's forward-backward function where Megatron looks it up."""

import importlib

from .run import get_forward_backward_func

# Where Megatron looks get_forward_backward_func up. training.py imported the name at its own
# import, so patching the package alone would not reach it. "megatron.training" is the module of
# older Megatron (megatron/training.py); it is patched only where it has the name.
_TARGETS = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules",
            "megatron.training.training", "megatron.training")

# ---- patching Megatron ---------------------------------------------------------------------------------

_saved = {}


def patch():
    """Installs get_forward_backward_func (returning forward_backward_func) where Megatron looks it up:
    megatron.core.pipeline_parallel, its schedules module and megatron.training.training (which
    imported the name), whichever are importable. Idempotent. Returns the patched module names;
    raises ImportError when none is importable."""
    patched = []
    for name in _TARGETS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "get_forward_backward_func", None)
        if current is None:
            continue
        if current is not get_forward_backward_func:
            _saved[name] = (module, current)
            module.get_forward_backward_func = get_forward_backward_func
        patched.append(name)
    if not patched:
        raise ImportError("zbpp.megatron.patch: Megatron-LM was not found (none of "
                          + ", ".join(_TARGETS[:3]) + " is importable); install Megatron-LM or put it "
                          "on PYTHONPATH before calling patch()")
    return patched


def unpatch():
    """Restores what patch() replaced; returns the restored module names ([] if nothing was patched)."""
    restored = []
    for name, (module, original) in list(_saved.items()):
        if getattr(module, "get_forward_backward_func", None) is get_forward_backward_func:
            module.get_forward_backward_func = original
            restored.append(name)
        del _saved[name]
    return restored
