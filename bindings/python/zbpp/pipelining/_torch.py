"""Where zbpp.pipelining takes torch.distributed.pipelining's own data types from.

Why: a script written for torch builds chunk specs, reducers, `_Action`s and stage-to-rank maps
with torch's classes. zbpp's schedules read those very objects, so they are torch's (imported from
the installed torch, not copied): a spec made for torch is a spec zbpp understands, and the two
can never drift apart. What zbpp implements itself is what runs: the stages, the schedules, the
runner underneath.

What this is not: a fallback for an old torch. torch.distributed.pipelining arrived in torch 2.4;
on an older torch, importing these names fails with an error that says so.
"""

import torch


def need(module):
    """torch.distributed.pipelining.<module>, or an ImportError that names the torch needed."""
    import importlib

    try:
        return importlib.import_module(f"torch.distributed.pipelining.{module}")
    except ImportError as exc:
        raise ImportError(f"zbpp.pipelining's torch-compatible names come from torch.distributed.pipelining."
                          f"{module}, which this torch ({torch.__version__}) does not have: it needs torch >= 2.4 "
                          f"({exc})") from exc
