"""Where zbpp.pipelining takes torch.distributed.pipelining's own data types from.

Why: a script written for torch builds chunk specs, reducers, `_Action`s and stage-to-rank maps
with torch's classes. zbpp's schedules read those very objects, so they are torch's (imported from
the installed torch, not copied): a spec made for torch is a spec zbpp understands, and the two
can never drift apart. What zbpp implements itself is what runs: the stages, the schedules, the
runner underneath.

Aliasing: a script may put zbpp in torch's place before it imports anything, e.g.

    import zbpp.pipelining
    from zbpp.pipelining import schedules, stage, microbatch, _utils
    sys.modules["torch.distributed.pipelining"] = zbpp.pipelining
    sys.modules["torch.distributed.pipelining.schedules"] = schedules   # and stage, ...

so that unchanged code (torchtitan's) imports zbpp; aliasing the package alone works too (Python
then loads zbpp's submodules a second time under torch's names). `need` still finds torch's own
modules: it remembers each one it loaded, and loads one it has not seen with every name of the
package that is not torch's file taken out of sys.modules for the moment (else the name would lead
back to zbpp).

What this is not: a fallback for an old torch. torch.distributed.pipelining arrived in torch 2.4;
on an older torch, importing these names fails with an error that says so.
"""

import importlib
import os
import sys

import torch

_PACKAGE = "torch.distributed.pipelining"
_REAL = {}  # module name under the package -> torch's own module


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _is_torchs(module):
    """Whether `module` is torch's own, by where its file is: aliasing one name can make Python
    load zbpp's files a second time under torch's names."""
    path = getattr(module, "__file__", None)
    return path is not None and os.path.abspath(path).startswith(_TORCH_DIR)


def need(module):
    """torch.distributed.pipelining.<module> (torch's own, also where zbpp is aliased in its
    place), or an ImportError that names the torch needed."""
    got = _REAL.get(module)
    if got is not None:
        return got
    # Names of the package that point at something else (zbpp, aliased in): out of the way while
    # torch's module loads, back afterwards.
    aliased = {name: mod for name, mod in list(sys.modules.items())
               if (name == _PACKAGE or name.startswith(_PACKAGE + ".")) and not _is_torchs(mod)}
    for name in aliased:
        del sys.modules[name]
    # torch's package itself, when it was loaded before the alias: found again, not run twice.
    real = getattr(sys.modules.get("torch.distributed"), "pipelining", None)
    if _PACKAGE in aliased and _is_torchs(real):
        sys.modules[_PACKAGE] = real
    try:
        got = importlib.import_module(f"{_PACKAGE}.{module}")
    except ImportError as exc:
        raise ImportError(f"zbpp.pipelining's torch-compatible names come from torch.distributed.pipelining."
                          f"{module}, which this torch ({torch.__version__}) does not have: it needs torch >= 2.4 "
                          f"({exc})") from exc
    finally:
        sys.modules.update(aliased)
    _REAL[module] = got
    return got
