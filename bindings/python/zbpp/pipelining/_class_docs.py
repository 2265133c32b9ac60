"""What help() shows for the schedule classes: their real signature and a docstring with an example.

What this is: document(cls, summary, example), which gives a schedule class a __signature__ that
lists torch's arguments (its __init__'s, in torch's order) and then zbpp's keywords (PipelineSchedule's
keyword-only ones), instead of torch's arguments and a bare **kwargs; and a __doc__ made of the
class's summary, an example, and one line per argument. _classes.py calls it for every public class.
What this is not: the arguments' checking (PipelineSchedule.__init__ does that) or a change of what
the classes take: only inspect.signature(cls) and help() change; __init__ stays torch's shape, so
test_torch_names.py's comparison with torch's signatures still holds.
"""

import inspect

# One line per argument: torch's, then zbpp's keywords.
TORCH_ARGS = (
    ("stage / stages", "this rank's zbpp.PipelineStage, or a list of them (V and interleaved kinds: one per chunk)"),
    ("n_microbatches", "microbatches per step(); the batch is split along dim 0 as torch splits it"),
    ("loss_fn", "loss_fn(output, target) on the rank holding the last stage (not with vocab_parallel)"),
    ("args_chunk_spec, kwargs_chunk_spec, output_merge_spec", "torch's specs for splitting the batch and "
     "merging the outputs"),
    ("scale_grads", "divide the gradients by n_microbatches after the step, as torch does (True)"),
)
ZBPP_KEYWORDS = {
    "csv": "the schedule in torch's CSV action grammar: a file's path or the text",
    "mem_limit": "activation memory limit per rank (zb-auto's target): microbatches, \"2p\", or bytes such as \"8GB\"",
    "times": "per-stage costs to plan with ({'f': ..., 'b': ..., 'w': ...}, see zbpp.Schedule.generate)",
    "timeout": "seconds a transfer may take before the step fails on every rank, naming the peer (300)",
    "cpu_group": "CUDA stages in a bigger NCCL world: a gloo group over the pipeline's ranks",
    "plan_from_measured": "plan again from the costs steps profile_steps measured (default: on for zero-bubble "
                          "kinds; one line on stderr says so)",
    "profile_steps": "the steps timed for that, (first, last) counted from 1; default (2, 3)",
    "costs": "a zbpp.StageCosts or a zbpp-costs JSON path: plan from it at once",
    "save_plan_dir": "where rank 0 writes the measured costs and the plan (CSV, SVG) when it replans",
    "use_full_backward": "torch's; ignored, as in torch",
    "backward_requires_autograd": "torch's: the backward goes through autograd (True)",
    "defer_pp_recv": "torch's; accepted",
    "split_backward": "True/False: split every stage's backward into B and W (None: each stage's own setting)",
    "offload": "PipeOffload: \"none\", \"auto\" (activations to host memory where the copies hide), or stage "
               "indices",
    "offload_modelled": "CPU stages: copies take their planned time (benchmarks, tests)",
    "offload_paired": "ranks 2k and 2k+1 share one link to host memory",
    "vocab_parallel": "a zbpp.VocabParallel: the output layer and embedding split over every rank (no loss_fn)",
}
# PipelineSchedule's keyword-only arguments that the classes fix or take otherwise.
_HIDDEN = {"kind", "csv", "stages", "stage"}


def _signature(cls, base_init):
    own = [p for p in inspect.signature(cls.__init__).parameters.values()
           if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in own}
    extra = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(base_init).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in names and p.name not in _HIDDEN]
    sig = inspect.Signature(own + extra)
    return sig, [p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def document(cls, base_init, summary, example):
    """Sets cls.__signature__ and cls.__doc__ (see the module docstring)."""
    sig, keywords = _signature(cls, base_init)
    cls.__signature__ = sig
    width = max(len(k) for k in keywords) if keywords else 0
    lines = [inspect.cleandoc(summary), "", "Example::", ""]
    lines += ["    " + line for line in example.strip("\n").split("\n")]
    lines += ["", "Arguments (torch's, in torch's order):"]
    lines += [f"    {name}: {text}" for name, text in TORCH_ARGS]
    if keywords:
        lines += ["", "zbpp's keywords:"]
        lines += [f"    {k:<{width}}  {ZBPP_KEYWORDS.get(k, '')}" for k in keywords]
    lines += ["", "step(*args, target=None, losses=None, **kwargs) runs one training step, as torch's; "
                  "timeline() gives the last step as measured; plan_info says what a replan did. The "
                  "documentation: docs/torch.md."]
    cls.__doc__ = "\n".join(lines)
