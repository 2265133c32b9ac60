"""torch.distributed.pipelining.stage's names for scripts that import them from zbpp:
`PipelineStage` (zbpp's, run by the C runner) and `build_stage`, which turns a stage of a model
split by torch's tracer (`zbpp.pipelining.pipeline(...)`, which is torch's `pipeline`) into one.

Why torch's tracer: it already splits a model at `pipe_split()` calls or a split spec into one
GraphModule per stage (torch.export underneath); zbpp reuses it and only runs the stages.

What zbpp does not take from a traced pipeline: activations that skip a stage. zbpp's stages
pass one set of tensors from each stage to the next; a graph where stage i reads an output of a
stage other than i-1 is refused with a message naming both.
"""

import torch

from . import PipelineStage

__all__ = ["PipelineStage", "build_stage"]

# torch's base class of its stages; zbpp has one stage class, which scripts may subclass the same way.
_PipelineStageBase = PipelineStage


def _submodule_nodes(pipe_info):
    return [n for n in pipe_info.graph.nodes if n.op == "call_module"]


def _check_adjacent(nodes):
    """Each stage may read only the model's inputs and the previous stage's outputs."""
    owner = {}
    for i, node in enumerate(nodes):
        owner[node.name] = i
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            src = arg
            while src.op == "call_function" and src.all_input_nodes:  # getitem on a stage's outputs
                src = src.all_input_nodes[0]
            j = owner.get(src.name)
            if j is not None and j != i - 1:
                raise NotImplementedError(
                    f"zbpp.build_stage: stage {i} ({node.name}) reads an output of stage {j} ({nodes[j].name}); "
                    f"zbpp passes tensors only from each stage to the next. Move the split points so no "
                    f"activation skips a stage, or carry it through the stages in between")
            if j is None and src.op == "placeholder" and i > 0:
                raise NotImplementedError(
                    f"zbpp.build_stage: stage {i} ({node.name}) reads the model's input {src.name!r} directly; "
                    f"zbpp feeds inputs to stage 0 only. Carry it through the stages in between")


def from_torch_stage(stage):
    """A zbpp PipelineStage for a stage torch made (its PipelineStage, or a traced stage from
    torch's Pipe.build_stage): the same module, index, device, group and dw_builder. A traced
    stage's graph is checked as build_stage checks it."""
    info = getattr(stage, "pipe_info", None)
    if info is not None:
        _check_adjacent(_submodule_nodes(info))
    ours = PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group,
                         dw_builder=getattr(stage, "dw_builder", None))
    ours.torch_stage = stage  # the last stage's output_chunks are mirrored there after each step
    return ours


def build_stage(stage_module, stage_index, pipe_info, device, group=None):
    """A zbpp PipelineStage for stage `stage_index` of a pipeline torch's tracer made
    (`pipe.get_stage_module(i)` and `pipe.info()`), as torch's build_stage does for its own."""
    nodes = _submodule_nodes(pipe_info)
    if len(nodes) != pipe_info.num_stages:
        from ._utils import PipeliningMetadataError

        raise PipeliningMetadataError(f"Number of submodules in pipe graph {len(nodes)} does not match number of "
                                      f"stages {pipe_info.num_stages}")
    _check_adjacent(nodes)
    device = torch.device(device) if device is not None else None
    if device is not None:
        stage_module = stage_module.to(device)
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device, group=group)
