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


# ---- signatures: every mirrored class and function takes torch's arguments ------------------------

def _mirrored():
    """(zbpp callable, torch callable, what) for every name zbpp mirrors from the installed torch."""
    from torch.distributed.pipelining import schedules as ts, stage as tst
    from zbpp.pipelining import schedules as zs, stage as zst

    pairs = [(zp.PipelineStage.__init__, tst.PipelineStage.__init__, "PipelineStage")]
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "scale_grads",
                 "clear_runtime_states", "set_local_fwd_input", "set_local_bwd_input", "get_local_bwd_output"):
        pairs.append((getattr(zp.PipelineStage, name), getattr(tst.PipelineStage, name), f"PipelineStage.{name}"))
    for name in ("PipelineScheduleSingle", "PipelineScheduleMulti", "Schedule1F1B", "ScheduleGPipe",
                 "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                 "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "_ScheduleForwardOnly"):
        if hasattr(ts, name):
            pairs.append((getattr(zs, name).__init__, getattr(ts, name).__init__, name))
    for name in ("step", "eval", "_step_microbatches"):
        for cls in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
            pairs.append((getattr(getattr(zs, cls), name), getattr(getattr(ts, cls), name), f"{cls}.{name}"))
    pairs.append((zs.get_schedule_class, ts.get_schedule_class, "get_schedule_class"))
    pairs.append((zst.build_stage, tst.build_stage, "build_stage"))
    return pairs


def _signature_problems(ours, theirs):
    """Why a call written for torch's `theirs` would not bind to `ours` the same way."""
    import inspect

    P = inspect.Parameter
    a, b = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
    mine, torch_params = list(a.values()), list(b.values())
    problems = []
    for k, p in enumerate(torch_params):
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if not any(q.kind == p.kind for q in mine):
                problems.append(f"takes no {'*args' if p.kind == P.VAR_POSITIONAL else '**kwargs'}")
            continue
        q = a.get(p.name)
        if q is None:
            problems.append(f"has no parameter {p.name!r}")
            continue
        if p.kind == P.POSITIONAL_OR_KEYWORD and (k >= len(mine) or mine[k].name != p.name):
            problems.append(f"{p.name!r} is not at position {k}")
        if p.default is not P.empty and (q.default is P.empty or q.default != p.default):
            problems.append(f"{p.name!r} defaults to {q.default!r}, torch's to {p.default!r}")
    for q in mine:
        if q.name not in b and q.default is P.empty and q.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            problems.append(f"requires {q.name!r}, which torch's does not take")
    return problems


def test_every_mirrored_signature_takes_torchs_arguments():
    """Each class and function zbpp mirrors binds a call written for the installed torch's the same
    way: every torch parameter by name, positional ones at their position, the same defaults, and
    nothing more required (zbpp's own keywords come after). A torch release that adds or reorders
    a parameter fails here, naming it."""
    problems = [f"{what}: {p}" for ours, theirs, what in _mirrored() for p in _signature_problems(ours, theirs)]
    assert not problems, "\n".join(problems)


def test_stage_reads_the_installed_torchs_order_from_its_source():
    # zbpp.pipelining does not import torch's pipelining to learn PipelineStage's order (it costs
    # a second); what it reads from torch's source must be what Python binds.
    import inspect

    from zbpp.pipelining import _stage

    theirs = [name for name in inspect.signature(tp.PipelineStage.__init__).parameters][1:]
    assert _stage._torch_order() == theirs, (_stage.torch.__file__, inspect.getsourcefile(tp.PipelineStage))


def test_stage_order_comes_from_torchs_class_where_its_source_is_not_there(monkeypatch, tmp_path):
    # A torch installed without its .py files: the order is the imported class's, not a guess.
    import inspect

    from zbpp.pipelining import _stage

    monkeypatch.setattr(_stage.torch, "__file__", str(tmp_path / "no-torch" / "__init__.py"))
    theirs = [name for name in inspect.signature(tp.PipelineStage.__init__).parameters][1:]
    assert _stage._torch_order() == theirs


def test_stage_binds_a_call_written_for_torch_2_11(monkeypatch):
    """torch 2.10 to 2.12 (2.11 is what the lent GPU machine has) take group at position 6 and
    dw_builder at 7, and have no output_grads, input_grads or get_mesh: a positional call written
    for them must give zbpp's stage that group and dw_builder, and torch 2.13's extra names are
    then keyword-only."""
    from zbpp.pipelining import _stage

    order_2_11 = ["submodule", "stage_index", "num_stages", "device", "input_args", "output_args", "group",
                  "dw_builder"]
    monkeypatch.setattr(_stage, "_torch_order", lambda: order_2_11)
    monkeypatch.setattr(_stage, "_SIGNATURE", _stage._signature())
    P = __import__("inspect").Parameter
    params = _stage._SIGNATURE.parameters
    assert [n for n, p in params.items() if p.kind is P.POSITIONAL_OR_KEYWORD] == ["self"] + order_2_11
    assert all(params[n].kind is P.KEYWORD_ONLY for n in ("output_grads", "input_grads", "get_mesh", "split_backward"))

    def builder():
        return lambda: None

    stage = zp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cpu", None, None, None, builder)
    assert stage.dw_builder is builder and stage.group is None
    stage = zp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cpu", get_mesh="mesh", output_grads=None)
    assert stage.get_mesh == "mesh"
    with pytest.raises(TypeError, match="zbpp.PipelineStage: too many positional arguments"):
        zp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cpu", None, None, None, builder, None)
