"""torch.distributed.pipelining's schedule API on zbpp, as PyTorch's own tests use it.

Written after PyTorch's test_schedule.py and test_stage.py (what they call and check), against
zbpp's classes and, where the same question can be put to torch's own classes, against those as
the baseline: the orders torch's Interleaved1F1B and LoopedBFS make, torch's schedule validator
and simulator on zbpp's pipeline_order, eval() then step(), forward-only runs, a user's
PipelineScheduleMulti subclass with its own pipeline_order, _load_csv/_dump_csv in both of
torch's forms, dw_builder, output_chunks, stages torch built, and shape inference that leaves
BatchNorm statistics alone. Single-process cases run in this process; the multi-rank cases are
in test_torch_script.py and test_pipeline.py.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
tp = pytest.importorskip("torch.distributed.pipelining")

import zbpp  # noqa: E402
import zbpp.pipelining as zp  # noqa: E402

import torch_release  # noqa: E402
from zbpp import ZbError  # noqa: E402
from zbpp.pipelining import schedules as zs  # noqa: E402

ts = tp.schedules


from stand_ins import stand_in_class  # noqa: E402

ZMock = stand_in_class(zp.stage._PipelineStageBase)
TMock = stand_in_class(tp.stage._PipelineStageBase)

# (stages per rank, microbatches, ranks): PyTorch's TestSchedulePlan cases, m not a multiple of p too.
PLAN_CASES = [(2, 2, 2), (2, 4, 4), (2, 8, 2), (2, 8, 4), (4, 8, 4), (4, 16, 4), (3, 8, 2), (3, 12, 4),
              (4, 6, 3), (4, 10, 5), (2, 3, 4), (2, 10, 4), (2, 15, 4), (1, 4, 2), (1, 6, 4)]


def compute_only(order):
    return {r: [a for a in acts if a is not None] for r, acts in order.items()}


@pytest.mark.parametrize("v, m, p", PLAN_CASES)
def test_every_torch_class_plans_an_order_torchs_validator_and_simulator_accept(v, m, p):
    S = v * p
    classes = [zp.ScheduleInterleaved1F1B, zp.ScheduleLoopedBFS, zp.ScheduleInterleavedZeroBubble]
    if v == 2:
        classes.append(zp.ScheduleZBVZeroBubble)
    for cls in classes:
        sched = cls([ZMock(S, p) for _ in range(v)], m)
        order = sched.pipeline_order
        # torch's own checks, on copies (its lowering consumes the lists it is given)
        mapping = ts._validate_schedule(compute_only(order), p, S, m)
        assert mapping == {s: sched.schedule.stage_rank(s) for s in range(S)}
        comms = ts._add_send_recv(compute_only(order), stage_to_rank=mapping.__getitem__, num_stages=S)
        ts._simulate_comms_compute(comms, stage_to_rank=mapping.__getitem__, num_stages=S)
        assert sched.pipeline_order == order  # a view of the plan, untouched by the lowering


@pytest.mark.parametrize("cls_name", ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS"])
@pytest.mark.parametrize("v, m, p", PLAN_CASES)
def test_fixed_orders_are_torchs_orders(cls_name, v, m, p):
    S = v * p
    ours = getattr(zp, cls_name)([ZMock(S, p) for _ in range(v)], m).pipeline_order
    theirs = getattr(tp, cls_name)([TMock(S, p) for _ in range(v)], m).pipeline_order
    assert ours == compute_only(theirs)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_dualpipev_is_torchs_order_with_its_overlapped_pairs(p):
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        sched = zp.ScheduleDualPipeV([ZMock(2 * p, p) for _ in range(2)], m)
        theirs = tp.ScheduleDualPipeV([TMock(2 * p, p) for _ in range(2)], m).pipeline_order
        assert sched.pipeline_order == compute_only(theirs)
        pairs = [a for a in sched.pipeline_order[0] if a.computation_type == ts.OVERLAP_F_B]
        assert pairs and all(len(a.sub_actions) == 2 for a in pairs)
        # the runner runs each pair's forward, then its backward
        ops = sched.schedule.rank_ops(0)
        assert len(ops) == sum(len(a.sub_actions or (a,)) for a in sched.pipeline_order[0])
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        zp.ScheduleDualPipeV([ZMock(2 * p, p) for _ in range(2)], 2 * p - 1)


def test_torchs_own_stand_in_stages_plan_too():
    sched = zp.ScheduleInterleaved1F1B([TMock(8, 4) for _ in range(2)], 8)
    theirs = tp.ScheduleInterleaved1F1B([TMock(8, 4) for _ in range(2)], 8).pipeline_order
    assert sched.pipeline_order == compute_only(theirs)


def test_v_schedules_need_two_stages_per_rank():
    for cls in (zp.ScheduleZBVZeroBubble, zp.ScheduleDualPipeV):
        with pytest.raises(ValueError, match="2 stages"):
            cls([ZMock(12, 4) for _ in range(3)], 8)


def test_get_schedule_class_resolves_torchs_names():
    for name in ["1F1B", "1f1b", "Interleaved1F1B", "INTERLEAVED1F1B", "GPipe", "LoopedBFS",
                 "PipelineScheduleSingle", "PipelineScheduleMulti", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV"]:
        cls = zp.get_schedule_class(name)
        assert issubclass(cls, zs._PipelineSchedule), name
        assert cls.__name__.lower().endswith(name.lower()), (name, cls)
    with pytest.raises(ValueError, match="ScheduleThatDoesNotExist"):
        zp.get_schedule_class("ScheduleThatDoesNotExist")
    assert issubclass(zp.ScheduleGPipe, zs.PipelineScheduleSingle)
    assert issubclass(zp.ScheduleLoopedBFS, zs._PipelineScheduleRuntime)
    assert issubclass(zs._PipelineScheduleRuntime, zs.PipelineScheduleMulti)


# ---- running, one process ------------------------------------------------------------------------

D, BATCH, M = 16, 8, 2


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def reference(mod, x, y, loss_fn):
    """Per-microbatch losses and the mean gradient, microbatch by microbatch."""
    ref = copy.deepcopy(mod)
    losses = []
    for xi, yi in zip(x.chunk(M), y.chunk(M)):
        loss = loss_fn(ref(xi), yi)
        loss.backward()
        losses.append(loss.detach())
    return ref(x).detach(), losses, [p.grad / M for p in ref.parameters()]


SINGLE = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
          "ScheduleInterleavedZeroBubble"]


@pytest.mark.parametrize("cls_name", SINGLE)
def test_eval_then_step_on_one_stage(cls_name):
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    ref_out, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    stage = zp.PipelineStage(mod, 0, 1, "cpu")
    assert stage.output_chunks == []
    cls = getattr(zp, cls_name)
    sched = cls(stage if issubclass(cls, zs.PipelineScheduleSingle) else [stage], M, loss_fn=loss_fn)
    for _ in range(2):
        losses = []
        out = sched.eval(x, target=y, losses=losses)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
        assert all(p.grad is None for p in mod.parameters())  # no backward in eval
    losses = []
    out = sched.step(x, target=y, losses=losses)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)
    assert len(stage.output_chunks) == M
    stage.clear_runtime_states()
    assert stage.output_chunks == []


def test_step_without_a_loss_fn_runs_forward_only_and_refuses_no_grad_with_one():
    mod, (x, y) = model(), data()
    stage = zp.PipelineStage(mod, 0, 1, "cpu")
    out = zp.ScheduleGPipe(stage, M).step(x)
    torch.testing.assert_close(out, mod(x).detach())
    assert all(p.grad is None for p in mod.parameters())
    sched = zp.Schedule1F1B(stage, M, loss_fn=torch.nn.MSELoss())
    with torch.no_grad(), pytest.raises(RuntimeError, match="eval"):
        sched.step(x, target=y)


def test_forward_only_schedule():
    mod, (x, y) = model(), data()
    sched = zs._ScheduleForwardOnly(zp.PipelineStage(mod, 0, 1, "cpu"), M)
    torch.testing.assert_close(sched.step(x), mod(x).detach())
    with pytest.raises(RuntimeError, match="does not support loss"):
        sched.step(x, target=y, losses=[])


def test_step_microbatches_checks_presplit_inputs_as_torch_does():
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    _, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    sched = zp.Schedule1F1B(zp.PipelineStage(mod, 0, 1, "cpu"), M, loss_fn=loss_fn)
    with pytest.raises(TypeError, match="arg_mbs must be a list"):
        sched._step_microbatches(arg_mbs=(x,))
    with pytest.raises(ValueError, match=f"Expecting {M} target_mbs but got 1"):
        sched._step_microbatches(arg_mbs=[(xi,) for xi in x.chunk(M)], target_mbs=[y])
    losses = []
    sched._step_microbatches(arg_mbs=[(xi,) for xi in x.chunk(M)], target_mbs=list(y.chunk(M)), losses=losses)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


class SplitOrder(zs.PipelineScheduleMulti):
    """A user's schedule as torch's docs describe one: pipeline_order set after the base's __init__."""

    def __init__(self, stages, n_microbatches, loss_fn=None):
        super().__init__(stages, n_microbatches, loss_fn=loss_fn)
        F, I, W = zs.F, zs.I, zs.W
        A = zs._Action
        self.pipeline_order = {0: [A(0, F, 0), A(0, F, 1), A(0, I, 1), A(0, I, 0), A(0, W, 1), A(0, W, 0)]}
        assert self._validate_and_set_stage_mapping(self.pipeline_order) == {0: 0}  # torch's own check


def test_a_user_order_is_validated_and_run_by_the_c_runner():
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    _, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    sched = SplitOrder([zp.PipelineStage(mod, 0, 1, "cpu")], M, loss_fn=loss_fn)
    losses = []
    sched.step(x, target=y, losses=losses)
    assert sched.schedule.kind == "custom"
    assert [(o.type, o.mb) for o in sched.schedule.rank_ops(0)] == [
        ("F", 0), ("F", 1), ("B", 1), ("B", 0), ("W", 1), ("W", 0)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


class WithComms(zs._PipelineScheduleRuntime):
    """A user's order in torch's compute_comms form, set as pipeline_order_with_comms, with the
    base built through torch's keyword names (as PyTorch's schedule_registry does)."""

    def __init__(self, stages, n_microbatches, loss_fn=None):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        self.pipeline_order_with_comms = {0: [zs._Action.from_str(c) for c in (
            "0F0 0SEND_F0 1RECV_F0 1F0 0F1 0SEND_F1 1RECV_F1 1F1 1B0 1SEND_B0 0RECV_B0 0B0 1B1 1SEND_B1 "
            "0RECV_B1 0B1").split()]}


def test_an_order_with_its_transfers_runs_without_them():
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    _, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    stages = [zp.PipelineStage(mod[:2], 0, 2, "cpu"), zp.PipelineStage(mod[2:], 1, 2, "cpu")]
    sched = WithComms(stages, M, loss_fn=loss_fn)
    losses = []
    sched.step(x, target=y, losses=losses)
    assert [(o.type, o.stage, o.mb) for o in sched.schedule.rank_ops(0)] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("BW", 1, 0), ("BW", 0, 0), ("BW", 1, 1), ("BW", 0, 1)]
    assert any(a.computation_type == ts.SEND_F for a in sched.pipeline_order_with_comms[0])
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(TypeError, match="multiple values for argument 'stage'"):  # as torch's class says
        zp.Schedule1F1B(stages[0], M, stage=stages[0])
    with pytest.raises(TypeError, match="once"):
        zp.Schedule1F1B(stages[0], M, stages=[stages[0]])


def test_a_broken_user_order_fails_with_the_rank_and_rule():
    A, F, I, W = zs._Action, zs.F, zs.I, zs.W
    sched = zs.PipelineScheduleMulti([zp.PipelineStage(model(), 0, 1, "cpu")], M, loss_fn=torch.nn.MSELoss())
    x, y = data()
    with pytest.raises(RuntimeError, match="pipeline_order"):
        sched.step(x, target=y)  # nothing to run yet
    sched.pipeline_order = {0: [A(0, F, 0), A(0, W, 0), A(0, I, 0), A(0, F, 1), A(0, I, 1), A(0, W, 1)]}
    with pytest.raises(ZbError, match="rank 0"):
        sched.step(x, target=y)
    sched.pipeline_order = {0: [A(0, ts.UNSHARD, None), A(0, F, 0), A(0, F, 1), A(0, ts.B, 0), A(0, ts.B, 1)]}
    with pytest.raises(NotImplementedError, match="FSDP"):
        sched.step(x, target=y)
    sched.pipeline_order = {1: []}
    with pytest.raises(ValueError, match="rank"):
        sched.step(x, target=y)


def test_a_rank_given_the_wrong_stages_fails_every_step_not_only_the_first():
    A = zs._Action
    sched = zs.PipelineScheduleMulti([zp.PipelineStage(torch.nn.Linear(D, D), 0, 2, "cpu")], M,
                                     loss_fn=torch.nn.MSELoss())
    sched.pipeline_order = {0: [A.from_str(c) for c in "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1".split()]}
    x, y = data()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"was given stage\(s\) \[0\]"):
            sched.step(x, target=y)


def test_the_order_with_transfers_follows_the_order():
    A = zs._Action
    mods = model()
    stages = [zp.PipelineStage(mods[:2], 0, 2, "cpu"), zp.PipelineStage(mods[2:], 1, 2, "cpu")]
    sched = zs._PipelineScheduleRuntime(stages, M, loss_fn=torch.nn.MSELoss())
    sched.pipeline_order = {0: [A.from_str(c) for c in "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1".split()]}
    first = [a for a in sched.pipeline_order_with_comms[0] if a.is_compute_op]
    sched.pipeline_order[0][4:] = [A.from_str(c) for c in "1B1 0B1 1B0 0B0".split()]  # changed in place
    again = [a for a in sched.pipeline_order_with_comms[0] if a.is_compute_op]
    assert again != first and again == sched.pipeline_order[0]


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_load_and_dump_csv_in_both_of_torchs_forms(tmp_path, fmt):
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    _, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    # Two stages on one rank: stage 0 -> 1 without a transfer.
    mods = [mod[:2], mod[2:]]
    stages = [zp.PipelineStage(mods[i], i, 2, "cpu") for i in range(2)]
    planned = zs._PipelineScheduleRuntime(stages, M, loss_fn=loss_fn)
    order = {0: [zs._Action.from_str(c) for c in "0F0 0F1 1F0 1F1 1I0 1I1 1W0 1W1 0B0 0B1".split()]}
    planned._prepare_schedule_with_comms(order)
    path = tmp_path / "order.csv"
    planned._dump_csv(str(path), format=fmt)
    # one rank: torch's lowering adds no transfers; the compute_comms form has torch's REDUCE_GRAD
    # after each stage's last backward (where torch >= 2.10 scales the gradients)
    cells = path.read_text().split()[0].split(",")
    assert [c for c in cells if "REDUCE_GRAD" not in c] == "0F0 0F1 1F0 1F1 1I0 1I1 1W0 1W1 0B0 0B1".split()
    if fmt == "compute_comms" and hasattr(ts, "REDUCE_GRAD"):
        assert cells[cells.index("1W1") + 1] == "1REDUCE_GRAD" and cells[-1] == "0REDUCE_GRAD"
    loaded = zs._PipelineScheduleRuntime(stages, M, loss_fn=loss_fn)
    loaded._load_csv(str(path), format=fmt)
    assert [a for a in loaded.pipeline_order[0] if a.is_compute_op] == order[0]
    losses = []
    loaded.step(x, target=y, losses=losses)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


def test_dw_builder_runs_once_per_microbatch_at_its_w():
    calls = []

    def dw_builder():
        calls.append("built")
        return lambda: calls.append("ran")

    mod, (x, y) = model(), data()
    stage = zp.PipelineStage(mod, 0, 1, "cpu", dw_builder=dw_builder)
    zp.ScheduleGPipe(stage, M, loss_fn=torch.nn.MSELoss()).step(x, target=y)
    assert calls == ["built", "ran"] * M  # a fused backward runs it at once
    calls.clear()
    sched = SplitOrder([zp.PipelineStage(mod, 0, 1, "cpu", dw_builder=dw_builder)], M, loss_fn=torch.nn.MSELoss())
    sched.step(x, target=y)
    assert calls == ["built", "built", "ran", "ran"]  # built at each I, run at each W
    with pytest.raises(TypeError, match="dw_builder"):
        zp.PipelineStage(mod, 0, 1, "cpu", dw_builder=3)

    def failing():
        raise ValueError("the weight gradient could not be made")

    sched = SplitOrder([zp.PipelineStage(mod, 0, 1, "cpu", dw_builder=lambda: failing)], M, loss_fn=torch.nn.MSELoss())
    with pytest.raises(ValueError, match="could not be made"):  # the user's own exception, as torch raises it
        sched.step(x, target=y)


def test_dualpipev_trains_two_stages_on_one_rank():
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    ref_out, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    stages = [zp.PipelineStage(mod[:2], 0, 2, "cpu"), zp.PipelineStage(mod[2:], 1, 2, "cpu")]
    losses = []
    out = zp.ScheduleDualPipeV(stages, M, loss_fn=loss_fn).step(x, target=y, losses=losses)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


def test_shape_inference_leaves_batchnorm_statistics_as_they_were():
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.BatchNorm1d(D), torch.nn.Linear(D, D))
    ref = copy.deepcopy(full)
    x, y = data()
    for xi in x.chunk(M):
        ref(xi)  # what training the microbatches does to the statistics
    stages = [zp.PipelineStage(full[:2], 0, 2, "cpu"), zp.PipelineStage(full[2:], 1, 2, "cpu")]
    zp.ScheduleInterleaved1F1B(stages, M, loss_fn=torch.nn.MSELoss()).step(x, target=y)
    bn, ref_bn = full[1], ref[1]
    assert int(bn.num_batches_tracked) == M
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)


def test_a_boundary_that_changes_dtype_is_torchs_metadata_error():
    """A dtype change is torch's PipeliningShapeError (its PipeliningMetadataError on torch 2.13), a
    ValueError too. (A shape change between two stages of one rank is no error: the next stage
    takes the tensors as they are, as torch's schedules hand them on; test_torch_behaviours.py.)"""
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    stages = [zp.PipelineStage(mod[:2], 0, 2, "cpu"), zp.PipelineStage(mod[2:], 1, 2, "cpu")]
    sched = zp.ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    sched.step(x, target=y)
    handle = mod[1].register_forward_hook(lambda m, i, o: o.double())
    with pytest.raises(zp._utils.PipeliningShapeError, match="dtype mismatch") as info:
        sched.step(x, target=y)
    metadata_error = getattr(tp._utils, "PipeliningMetadataError", None) or tp._utils.PipeliningShapeError
    assert isinstance(info.value, metadata_error) and isinstance(info.value, ValueError)
    handle.remove()


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_stages_torch_built_run_on_zbpp(one_process_group):
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    ref_out, ref_losses, ref_grads = reference(mod, x, y, loss_fn)
    stage = tp.PipelineStage(mod, 0, 1, torch.device("cpu"))
    losses = []
    out = zp.Schedule1F1B(stage, M, loss_fn=loss_fn).step(x, target=y, losses=losses)
    torch.testing.assert_close(out, ref_out)
    assert len(stage.output_chunks) == M  # on the object the script holds
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


def _reference_chain(S, m):
    """Gradients and losses of the workers' chain of S layers run microbatch by microbatch
    (gradients / m), and its output."""
    import pipeline_worker

    mods, x, y = pipeline_worker.chain(S)
    losses = []
    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        h = xi
        for mod in mods:
            h = mod(h)
        loss = torch.nn.functional.mse_loss(h, yi)
        loss.backward()
        losses.append(float(loss))
    with torch.no_grad():
        out = x
        for mod in mods:
            out = mod(out)
    return [[p.grad / m for p in mod.parameters()] for mod in mods], losses, out


def test_user_orders_over_a_v_and_an_unbalanced_stage_map_train_like_the_loop(tmp_path):
    """PyTorch's CustomSchedulesTest shapes on 2 ranks: the V (0, 3 | 1, 2) and an unbalanced map
    (0, 1, 4 | 2, 3): the C library keeps the map, validates the order and the C runner runs it.
    Also a 1F1B whose loss_fn only the loss rank has."""
    import pipeline_worker
    from test_pipeline import spawn

    spawn(pipeline_worker.run_torch_orders, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"orders{r}.pt") for r in range(2)]
    for r in ranks:
        assert "error" not in r, r.get("error")
    for name, S, m, placement in (("v", 4, 1, "v"), ("unbalanced", 5, 2, "custom")):
        grads, losses, out = _reference_chain(S, m)
        assert ranks[0][name]["placement"] == placement
        holder = ranks[0][name]["stage_ranks"]
        assert holder == ([0, 1, 1, 0] if name == "v" else [0, 0, 1, 1, 0])
        for s in range(S):
            for got, want in zip(ranks[holder[s]][name]["grads"][s], grads[s]):
                torch.testing.assert_close(got, want)
        assert ranks[0][name]["losses"] == pytest.approx(losses, rel=1e-6)
        assert ranks[0][name]["eval_losses"] == pytest.approx(losses, rel=1e-6)
        torch.testing.assert_close(ranks[0][name]["eval_out"], out)
    # a loss_fn on the loss rank only: still a training step on both ranks
    grads, losses, _ = _reference_chain(2, 2)
    for r in range(2):
        for got, want in zip(ranks[r]["loss-on-last-only"]["grads"][r], grads[r]):
            torch.testing.assert_close(got, want)
    assert ranks[1]["loss-on-last-only"]["losses"] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("kind", [
    # torch 2.12 and older send between the V's two stages of one rank through gloo, which refuses.
    pytest.param("zb-v", marks=torch_release.needs(2, 13, "stages of one process handing over in memory")),
    "zb-h1"])
def test_torchs_own_runtime_runs_a_plan_zbpp_wrote_with_its_transfers(tmp_path, kind):
    """zbpp's plan in torch's compute_comms CSV (Schedule.to_csv(comms=True)) is run by torch's
    _PipelineScheduleRuntime on 2 ranks (its own stages, sends and receives) and trains like the
    loop: the receives zbpp places match the sends torch posts."""
    import pipeline_worker
    from test_pipeline import spawn

    from zbpp.schedule import Schedule

    S, m = (4, 2) if kind == "zb-v" else (2, 2)
    with Schedule.generate(kind, p=2, m=m) as plan:
        path = tmp_path / "plan.csv"
        path.write_text(plan.to_csv(comms=True))
        # torch's own simulator accepts the transfers too (it knows no REDUCE_GRAD: left out)
        order = {r: [ts._Action.from_str(c) for c in row.split(",") if "REDUCE_GRAD" not in c]
                 for r, row in enumerate(path.read_text().strip().split("\n"))}
        ts._simulate_comms_compute(order, stage_to_rank=plan.stage_rank, num_stages=S)
    spawn(pipeline_worker.run_torch_runtime_on_zbpp_plan, 2, str(path), S, m, str(tmp_path))
    ranks = [torch.load(tmp_path / f"runtime{r}.pt") for r in range(2)]
    for r in ranks:
        assert "error" not in r, r.get("error")
    grads, losses, _ = _reference_chain(S, m)
    holder = {s: r for r in range(2) for s in ranks[r]["grads"]}
    for s in range(S):
        for got, want in zip(ranks[holder[s]]["grads"][s], grads[s]):
            torch.testing.assert_close(got, want)
    assert ranks[holder[S - 1]]["losses"] == pytest.approx(losses, rel=1e-6)


# ---- torch's custom functions (register_custom_function) -----------------------------------------

@pytest.mark.parametrize("backward_first", [False, True], ids=["forward-first", "backward-first"])
def test_custom_functions_run_every_forward_and_pair_and_train_like_the_loop(tmp_path, backward_first):
    """DualPipeV on 2 ranks with torch-style FORWARD and OVERLAP_F_B functions (as PyTorch's
    test_custom_function_callback writes them): every forward and every pair goes through them,
    the pair's halves in either order (a pair is one unit: both inputs before, both outputs
    after), and outputs, losses and gradients are the loop's."""
    import pipeline_worker
    from test_pipeline import spawn

    S, m = 4, 4
    spawn(pipeline_worker.run_custom_functions, 2, str(tmp_path), backward_first)
    ranks = [torch.load(tmp_path / f"custom{r}.pt") for r in range(2)]
    for r in ranks:
        assert "error" not in r, r.get("error")
    grads, losses, out = _reference_chain(S, m)
    holder = [0, 1, 1, 0]
    for s in range(S):
        for got, want in zip(ranks[holder[s]]["grads"][s], grads[s]):
            torch.testing.assert_close(got, want * m)  # scale_grads=False: the sum over microbatches
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-6)
    torch.testing.assert_close(ranks[0]["out"], out)
    from zbpp.pipelining._order import dualpipe_v

    order = dualpipe_v(2, m)
    for r, mine in ((0, (0, 3)), (1, (1, 2))):
        # every forward of the rank's stages ran through the function, each pair too, in both steps
        assert sorted(ranks[r]["forward"]) == sorted([(s, i) for s in mine for i in range(m)] * 2)
        assert ranks[r]["overlap"], "no OVERLAP_F_B pair went through the function"
    pairs0 = [a for a in order[0] if a.computation_type == zs.OVERLAP_F_B]
    assert len(ranks[0]["overlap"]) == 2 * len(pairs0)


def test_custom_function_errors_say_what_was_wrong():
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    stages = [zp.PipelineStage(mod[:2], 0, 2, "cpu"), zp.PipelineStage(mod[2:], 1, 2, "cpu")]
    sched = zp.ScheduleDualPipeV(stages, M, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="Invalid computation type"):
        sched.register_custom_function(zs.SEND_F, lambda a, c: None)
    with pytest.raises(NotImplementedError, match="FSDP"):
        sched.register_custom_function(zs.UNSHARD, lambda a, c: None)
    with pytest.raises(RuntimeError, match="inside a custom function"):
        stages[0].backward_weight_one_chunk(0)
    with pytest.raises(RuntimeError, match="inside a custom function"):
        stages[0].forward_one_chunk(0)
    sched.register_custom_function(zs.FORWARD, lambda action, ctx: None)  # forgets the work
    with pytest.raises(RuntimeError, match=r"returned without calling forward_one_chunk\(0\) of stage 0"):
        sched.step(x, target=y)

    def wrong_microbatch(action, ctx):
        stage = {s.stage_index: s for s in ctx.schedule_ref._stages}[action.stage_index]
        stage.forward_one_chunk(action.microbatch_index + 1)

    sched.register_custom_function(zs.FORWARD, wrong_microbatch)
    with pytest.raises(RuntimeError, match="not the work of the action being run"):
        sched.step(x, target=y)


def test_a_full_backward_function_scales_its_stage_once():
    """A FULL_BACKWARD function that scales its stage itself (stage.scale_grads at the last
    backward, as torch's runtime does) is not scaled again by the schedule."""
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    _, _, ref_grads = reference(mod, x, y, loss_fn)
    stages = [zp.PipelineStage(mod[:2], 0, 2, "cpu"), zp.PipelineStage(mod[2:], 1, 2, "cpu")]
    sched = zp.ScheduleLoopedBFS(stages, M, loss_fn=loss_fn)
    seen = []

    def full_backward(action, ctx):
        schedule = ctx.schedule_ref
        stage = {s.stage_index: s for s in schedule._stages}[action.stage_index]
        seen.append(action.microbatch_index)
        stage.backward_one_chunk(action.microbatch_index, loss=schedule._maybe_get_loss(stage, action.microbatch_index))
        schedule.backward_counter[stage.stage_index] += 1
        if schedule.backward_counter[stage.stage_index] == schedule._n_microbatches:
            stage.scale_grads(schedule._n_microbatches)

    sched.register_custom_function(zs.FULL_BACKWARD, full_backward)
    sched.step(x, target=y)
    assert sorted(seen) == sorted(list(range(M)) * 2)
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


def test_a_backward_input_function_leaves_w_to_its_w_op():
    """ZB-V splits each backward: a BACKWARD_INPUT function runs the I part, and the W that part
    deferred still runs at its W op (gradients equal the loop's)."""
    mod, (x, y), loss_fn = model(), data(), torch.nn.MSELoss()
    zbpp.split_linear(mod)
    _, _, ref_grads = reference(mod, x, y, loss_fn)
    stages = [zp.PipelineStage(mod[:2], 0, 2, "cpu"), zp.PipelineStage(mod[2:], 1, 2, "cpu")]
    sched = zp.ScheduleZBVZeroBubble(stages, M, loss_fn=loss_fn)
    kinds = {a.computation_type for a in sched.pipeline_order[0]}
    assert zs.BACKWARD_INPUT in kinds and zs.BACKWARD_WEIGHT in kinds
    seen = []

    def backward_input(action, ctx):
        schedule = ctx.schedule_ref
        stage = {s.stage_index: s for s in schedule._stages}[action.stage_index]
        seen.append((action.stage_index, action.microbatch_index))
        stage.backward_one_chunk(action.microbatch_index, full_backward=False,
                                 loss=schedule._maybe_get_loss(stage, action.microbatch_index))

    sched.register_custom_function(zs.BACKWARD_INPUT, backward_input)
    sched.step(x, target=y)
    assert seen and all(a.computation_type != zs.BACKWARD_INPUT or (a.stage_index, a.microbatch_index) in seen
                        for a in sched.pipeline_order[0])
    for p, g in zip(mod.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)
