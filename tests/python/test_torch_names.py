"""The names a torch.distributed.pipelining script imports, from zbpp.pipelining and its
submodules (schedules, stage, microbatch, _utils), and what each is: zbpp's stages and schedules,
torch's own data types (chunk specs, actions, stage maps), torch's tracer with zbpp's build_stage."""

import pytest

torch = pytest.importorskip("torch")
tp = pytest.importorskip("torch.distributed.pipelining")

import zbpp  # noqa: E402
import zbpp.pipelining as zp  # noqa: E402


def test_the_imports_a_torch_script_writes_work_with_zbpp():
    from zbpp.pipelining import (  # noqa: F401
        Pipe, PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble, SplitPoint, build_stage, pipe_split, pipeline,
    )
    from zbpp.pipelining._utils import PipeliningMetadataError, generate_stage_to_rank_mapping  # noqa: F401
    from zbpp.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks  # noqa: F401
    from zbpp.pipelining.schedules import (  # noqa: F401
        RECV_F, SEND_B, _Action, _ComputationType, _PipelineSchedule, get_schedule_class, B, F, I, W,
    )
    from zbpp.pipelining.stage import _PipelineStageBase  # noqa: F401
    assert PipelineStage is zp.PipelineStage and issubclass(Schedule1F1B, _PipelineSchedule)
    assert get_schedule_class("1F1B") is Schedule1F1B


def test_data_types_are_torchs_own_objects():
    # A spec, an action or a stage map built with torch's classes is what zbpp reads, and back.
    from torch.distributed.pipelining import microbatch as tm, schedules as ts
    from zbpp.pipelining import microbatch as zm, schedules as zs

    assert zm.TensorChunkSpec is tm.TensorChunkSpec and zm.merge_chunks is tm.merge_chunks
    assert zs._Action is ts._Action and zs.F is ts.F and zs.SEND_F is ts.SEND_F
    assert zs._Action.from_str("2I5") == ts._Action(2, ts.I, 5)
    assert zp.TensorChunkSpec is tm.TensorChunkSpec
    assert zp.generate_stage_to_rank_mapping(2, 4, style="v") == {0: 0, 1: 1, 2: 1, 3: 0}


def test_split_and_merge_through_zbpp_names():
    x, mask = torch.arange(24.0).reshape(6, 4), torch.ones(4, 6)
    args, kwargs = zp.split_args_kwargs_into_chunks(
        (x,), {"mask": mask, "scale": 2.0}, 3, kwargs_chunk_spec={"mask": zp.TensorChunkSpec(1),
                                                                  "scale": zp.microbatch._Replicate()})
    assert len(args) == len(kwargs) == 3
    assert torch.equal(args[1][0], x[2:4]) and torch.equal(kwargs[2]["mask"], mask[:, 4:6])
    assert all(k["scale"] == 2.0 for k in kwargs)
    assert torch.equal(zp.merge_chunks([a[0] for a in args], zp.TensorChunkSpec(0)), x)


class _TwoStages(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        zp.pipe_split()
        return self.b(h)


class _Skip(_TwoStages):
    def forward(self, x):
        h = torch.relu(self.a(x))
        zp.pipe_split()
        return self.b(h) + x[:, :4]  # stage 1 reads the model's input: not a stage-to-stage flow


def test_build_stage_makes_zbpp_stages_from_torchs_tracer():
    torch.manual_seed(0)
    model, x = _TwoStages(), torch.randn(4, 8)
    pipe = zp.pipeline(model, mb_args=(x,))
    assert pipe.num_stages == 2
    stages = [zp.build_stage(pipe.get_stage_module(i), i, pipe.info(), "cpu") for i in range(2)]
    assert all(isinstance(s, zp.PipelineStage) for s in stages)
    assert [s.stage_index for s in stages] == [0, 1] and all(s.num_stages == 2 for s in stages)
    # The traced stage modules chained compute the model.
    h = stages[0].submod(x)
    out = stages[1].submod(*h) if isinstance(h, tuple) else stages[1].submod(h)
    out = out[0] if isinstance(out, tuple) else out
    assert torch.allclose(out, model(x))


def test_build_stage_refuses_activations_that_skip_a_stage():
    x = torch.randn(4, 8)
    pipe = zp.pipeline(_Skip(), mb_args=(x,))
    with pytest.raises(NotImplementedError, match="reads the model's input"):
        zp.build_stage(pipe.get_stage_module(1), 1, pipe.info(), "cpu")
