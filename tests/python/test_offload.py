"""PipeOffload in the torch layer (offload= on the schedule classes): training with the copies
equals training without them bit for bit (losses and parameters, the sequential loop's), on 2 and
4 ranks over gloo, for every kind whose plan places copies there; bad arguments fail with the
reason; the measured saved-activation memory is the plan's within 5% where the plan's memory model
holds (test_runner_copies.c checks the C runner's against the plan exactly)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import pipeline_worker  # noqa: E402
from test_pipeline import reference, spawn  # noqa: E402

import zbpp  # noqa: E402

TIMES = dict(f=1, b=1, w=1, offload=0.25, reload=0.25)
M, BATCH, STEPS, SEED = 8, 16, 2, 3


def _train(world, cases, tmp_path, layers):
    cases = [dict(c, m=M, batch=BATCH, steps=STEPS, seed=SEED, layers=layers, offload="auto", times=TIMES)
             for c in cases]
    spawn(pipeline_worker.run_kinds, world, cases, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r in ranks:
        if r and "error" in r[-1]:
            pytest.fail("a rank failed:\n" + r[-1]["error"], pytrace=False)
    return cases, ranks


def _check_bitwise(cases, ranks, layers):
    ref_losses, ref_params = reference(m=M, batch=BATCH, layers=layers)
    for index, case in enumerate(cases):
        what = f"{case['kind']} on {len(ranks)} ranks"
        assert sum(r[index]["offloads"] for r in ranks) > 0, f"{what}: the plan placed no copies; nothing was tested"
        per_stage = {}
        for r in ranks:
            per_stage.update(r[index]["params"])
        params = [p for s in sorted(per_stage) for p in per_stage[s]]
        assert len(params) == len(ref_params)
        for k, (got, want) in enumerate(zip(params, ref_params)):
            assert torch.equal(got, want), f"{what}: parameter {k} differs by {(got - want).abs().max().item():.3g}"
        losses = [r[index]["losses"] for r in ranks if r[index]["losses"]]
        assert losses == [ref_losses], f"{what}: losses {losses} != {ref_losses}"
        assert all(r[index]["store_empty"] for r in ranks)


def test_offloaded_training_is_bit_for_bit_on_two_ranks(tmp_path):
    cases = [dict(kind="gpipe", chunks=1), dict(kind="zb-v", chunks=2), dict(kind="interleaved-1f1b", chunks=2),
             dict(kind="v-half", chunks=2), dict(kind="v-min", chunks=2),
             dict(kind="group-interleaved-1f1b", chunks=2)]
    cases, ranks = _train(2, cases, tmp_path, layers=4)
    _check_bitwise(cases, ranks, layers=4)


def test_offloaded_training_is_bit_for_bit_on_four_ranks(tmp_path):
    # zb-auto held to 3 microbatches plans its order and the copies together (shorter than without);
    # so does v-min under a limit (test_copies.c: test_v_min_under_a_limit_takes_a_faster_order).
    cases = [dict(kind="1f1b", chunks=1), dict(kind="zb-h1", chunks=1), dict(kind="zb-v", chunks=2),
             dict(kind="v-min", chunks=2), dict(kind="zb-auto", chunks=1, mem_limit=3),
             dict(kind="v-min", chunks=2, mem_limit=2),  # v-half's order held to v-min's 2 by copies
             dict(kind="interleaved-1f1b", chunks=2, offload_paired=True)]  # pairs of ranks share a link
    cases, ranks = _train(4, cases, tmp_path, layers=8)
    _check_bitwise(cases, ranks, layers=8)


@pytest.mark.parametrize("kind,chunks", [("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1), ("zb-v", 2),
                                         ("v-half", 2)])
def test_measured_memory_is_the_plans_within_5_percent(tmp_path, kind, chunks):
    """Equal stages, where the plan's memory model holds (every stage's F adds 1/v, its BW frees it;
    a split backward frees 1 - w_share at B and the rest, the split layers' inputs, at W;
    offload_report says where it does not). Saved-activation bytes are counted as the model counts
    them (zbpp/pipelining/_offload.py), the W store's inputs until their W; the CPU's copies are
    synchronous, so the prediction is the plan's for copies of no duration (sync_*), and the plan
    with its copy times never promises less. The rank holding the loss stage saves the loss's
    tensors too, which the model does not count, and the first stage's B, with no input gradient to
    make, frees nothing (its W does): their ranks are left out. The stages' W-only share is the
    second Linear's input, half of what they save: the plan's default w_share, 0.5."""
    world = 4
    spawn(pipeline_worker.run_offload_memory, world, kind, chunks, M, TIMES, str(tmp_path))
    checked = lowered = 0
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        if "error" in res:
            pytest.fail(f"rank {r} failed:\n{res['error']}", pytrace=False)
        split = kind in ("zb-v", "v-half")  # B and W apart
        if not res["offloads"] or world * chunks - 1 in res["stages"] or (split and 0 in res["stages"]):
            continue
        rep = res["report"]
        for what in ("device", "host"):
            got, sync, plan = (rep[f"{what}_peak_bytes"], rep[f"sync_{what}_peak_bytes"],
                               rep[f"planned_{what}_peak_bytes"])
            assert abs(got - sync) <= 0.05 * sync, f"{kind} rank {r}: measured {what} peak {got} B, predicted {sync:.0f} B"
            assert got <= 1.05 * plan, f"{kind} rank {r}: measured {what} peak {got} B, planned {plan:.0f} B"
        lowered += rep["device_peak_bytes"] < rep["bytes_per_microbatch"] * min(world - r, M)  # 1F1B's p - r
        checked += 1
    assert checked >= 2, f"{kind}: only {checked} ranks offloaded"
    assert lowered >= 1, f"{kind}: no rank holds less than 1F1B keeps there"


def test_bad_offload_arguments_say_what_is_allowed():
    import torch.nn as nn

    stage = zbpp.PipelineStage(nn.Linear(4, 4), 0, 1, "cpu")
    with pytest.raises(ValueError, match="offload must be None or 'none', 'auto'"):
        zbpp.Schedule1F1B(stage, 4, loss_fn=lambda y, t: y.sum(), offload="yes")
    with pytest.raises(ValueError, match=r"offload= takes stage indices in 0\.\.0"):
        zbpp.Schedule1F1B(stage, 4, loss_fn=lambda y, t: y.sum(), offload=[3])
    with pytest.raises(ValueError, match="needs the copy times, 'offload' and 'reload'.*leave plan_from_measured on"):
        zbpp.ScheduleGPipe(stage, 4, loss_fn=lambda y, t: y.sum(), offload="auto", plan_from_measured=False)
    with pytest.raises(ValueError, match="times= has none: add them to it, or leave times= and costs= out"):
        zbpp.ScheduleGPipe(stage, 4, loss_fn=lambda y, t: y.sum(), offload="auto", times={"f": 1, "b": 1, "w": 1})
    with pytest.raises(ValueError, match="leave plan_from_measured on"):
        zbpp.ScheduleZBVZeroBubble([zbpp.PipelineStage(nn.Linear(4, 4), s, 2, "cpu") for s in (0, 1)], 4,
                                   offload="auto", plan_from_measured=False)


def test_one_rank_runs_its_copies_and_matches_no_offload():
    """One process, GPipe (every microbatch's activations live until the backwards): the
    copies move them out and back on the runner's copy thread, and the gradients are the bits of
    the same schedule without offload."""
    torch.manual_seed(0)
    net = nn_model()
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    grads = []
    for offload in (None, "auto"):
        model, sched = _one_rank_gpipe(net, offload)
        sched.step(x, target=y)
        if offload:
            assert sum(op.type == "OFFLOAD" for op in sched.schedule.rank_ops(0)) > 0
            rep = sched.offload_report()
            assert rep["host_peak_bytes"] > 0 and rep["device_peak_bytes"] < 8 * rep["bytes_per_microbatch"]
        grads.append([p.grad.clone() for p in model.parameters()])
        sched.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_host_memory_is_reserved_once_from_the_plan():
    """The host pool: reserved at the first OFFLOAD, as many slots as the plan ever holds on the
    host at once, each one microbatch's saved bytes; later steps take no new host memory, and
    microbatches larger than the first (a longer batch) get memory of their own and still train
    as without offload."""
    torch.manual_seed(0)
    net = nn_model()
    batches = [(torch.randn(64, 32), torch.randn(64, 32)) for _ in range(2)] + [(torch.randn(128, 32),
                                                                               torch.randn(128, 32))] * 2
    grads, reports = {}, []
    for offload in (None, "auto"):
        model, sched = _one_rank_gpipe(net, offload)
        grads[offload] = []
        for x, y in batches:
            sched.step(x, target=y)
            grads[offload].append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            if offload:
                reports.append(dict(sched.offload_report(), slot=dict(sched._offloader.pool.size)))
        sched.close()
    for a, b in zip(grads[None], grads["auto"]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    first, second, longer, grown = reports
    held = first["planned_host_peak"]
    assert held >= 2, "GPipe holds several microbatches on the host at once; the plan says so"
    slot = first["slot"][0]
    assert first["bytes_per_microbatch"] <= slot <= first["bytes_per_microbatch"] + 512 * 8  # aligned copies
    assert first["host_pool_bytes"] == held * slot >= first["host_peak_bytes"] > 0
    assert first["host_pool_misses"] == second["host_pool_misses"] == 0
    assert second["host_pool_bytes"] == first["host_pool_bytes"]  # nothing taken again
    assert longer["host_pool_misses"] > 0 and longer["host_pool_bytes"] == first["host_pool_bytes"]
    # The next step's slots are the longer microbatches' size: nothing misses any more.
    assert grown["host_pool_misses"] == 0 and grown["host_pool_bytes"] >= 2 * held * first["bytes_per_microbatch"]


def _one_rank_gpipe(net, offload):
    """A copy of net as one stage under GPipe (8 microbatches), with or without offload."""
    model = nn_model()
    model.load_state_dict(net.state_dict())
    stage = zbpp.PipelineStage(model, 0, 1, "cpu")
    return model, zbpp.ScheduleGPipe(stage, 8, loss_fn=lambda out, t: ((out - t) ** 2).mean(), offload=offload,
                                     times=TIMES if offload else None)


def nn_model():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))


def test_copy_times_are_measured_when_not_given(tmp_path):
    """A planned kind, and a fixed order, with offload="auto" and no copy times: the profiled steps
    run without copies, each rank times the copy of its stages' activations
    (zbpp.costs.measure_copy_time), and the plan after the profile has copies (the fixed order its
    own compute order), with training still bit for bit."""
    steps = 5
    cases = [dict(kind=kind, chunks=2, m=M, batch=BATCH, steps=steps, seed=SEED, offload="auto", times=None)
             for kind in ("zb-v", "interleaved-1f1b")]
    # The replanned zb-v's trial made to fail (every step "slower"): the plan that comes back after
    # steps 4-6 is the one in force before with copies placed into it, not the one without.
    cases.append(dict(cases[0], steps=8, revert_margin=-1.0))
    spawn(pipeline_worker.run_kinds, 2, cases, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        if r and "error" in r[-1]:
            pytest.fail("a rank failed:\n" + r[-1]["error"], pytrace=False)
    refs = {n: reference(steps=n, m=M, batch=BATCH) for n in {c["steps"] for c in cases}}
    assert all(r[2]["reverted"] for r in ranks), "the trial did not revert"
    for index, case in enumerate(cases):
        what = case["kind"] + (" after a reverted trial" if "revert_margin" in case else "")
        ref_losses, ref_params = refs[case["steps"]]
        assert all(r[index]["offloads"] > 0 for r in ranks), f"{what}: the plan that runs last has no copies"
        assert all(r[index]["copy_times"] for r in ranks), f"{what}: the plan after the profile has no copy times"
        assert all(r[index]["plan_offloaded"] > 0 for r in ranks), f"{what}: plan_info does not say what was offloaded"
        per_stage = {}
        for r in ranks:
            per_stage.update(r[index]["params"])
        params = [p for s in sorted(per_stage) for p in per_stage[s]]
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), what
        assert [r[index]["losses"] for r in ranks if r[index]["losses"]] == [ref_losses], what


def test_a_fixed_order_measures_its_copy_times_and_keeps_its_copies(monkeypatch):
    """GPipe (a fixed order) with offload="auto" and no times: steps 2-3 are profiled, the copies
    are placed into the same compute order after step 3, and they stay, even where the new plan's
    first steps measure slower than the profiled ones (every trial made to fail here): a run that
    asked for the copies to fit in memory does not lose them to timing noise. Gradients are the
    bits of the same schedule without offload in every step."""
    from zbpp.pipelining import _plan

    monkeypatch.setattr(_plan, "REVERT_MARGIN", -1.0)  # any trial would undo the plan
    torch.manual_seed(0)
    net = nn_model()
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    grads, orders = {}, {}
    for offload in (None, "auto"):
        model = nn_model()
        model.load_state_dict(net.state_dict())
        sched = zbpp.ScheduleGPipe(zbpp.PipelineStage(model, 0, 1, "cpu"), 8,
                                   loss_fn=lambda out, t: ((out - t) ** 2).mean(), offload=offload)
        grads[offload], copies = [], []
        for _ in range(8):
            copies.append(sum(op.type == "OFFLOAD" for op in sched.schedule.rank_ops(0)))  # what this step runs
            sched.step(x, target=y)
            grads[offload].append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        orders[offload] = [(op.type, op.mb) for op in sched.schedule.rank_ops(0) if op.type in ("F", "BW")]
        if offload:
            info = sched.plan_info
            assert copies[:3] == [0, 0, 0] and min(copies[3:]) > 0, copies
            assert info.kind == "gpipe" and info.offloaded == copies[-1] and not info.reverted
            assert sched.offload_report()["host_peak_bytes"] > 0
        sched.close()
    assert orders["auto"] == orders[None], "the copies changed GPipe's compute order"
    for a, b in zip(grads[None], grads["auto"]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_measure_copy_time_and_cost_files_keep_copy_times(tmp_path):
    off, rel = zbpp.costs.measure_copy_time(1 << 20)
    assert off > 0 and rel > 0
    costs = zbpp.StageCosts(2, 1, "loop", [1, 1], [1, 1], [1, 1], time_offload=[off, off], time_reload=[rel, rel])
    path = tmp_path / "costs.json"
    costs.save(path)
    again = zbpp.StageCosts.load(path)
    assert again == costs and again.times()["offload"] == [off, off]
    plan = again.plan("1f1b", 8)
    assert plan.op_time("RELOAD", 1) == rel
    with pytest.raises(ValueError, match="time_offload and time_reload go together"):
        zbpp.StageCosts(2, 1, "loop", [1, 1], [1, 1], [1, 1], time_offload=[1, 1])


def test_a_csv_schedule_with_copies_runs_them():
    """A schedule from CSV that carries zbpp's OFFLOAD/RELOAD cells runs its copies (the activations
    go to host memory) and trains like the same order without them."""
    times = {"f": 1, "b": 1, "w": 1, "offload": 0.25, "reload": 0.25}
    with zbpp.Schedule.generate("gpipe", p=1, m=8, times=times) as base, base.plan_offload() as off:
        csv, plain = off.to_csv(), base.to_csv()
    assert "OFFLOAD" in csv
    torch.manual_seed(1)
    net = nn_model()
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    grads = []
    for text in (plain, csv):
        model = nn_model()
        model.load_state_dict(net.state_dict())
        sched = zbpp.ScheduleFromCSV(zbpp.PipelineStage(model, 0, 1, "cpu"), 8,
                                     loss_fn=lambda o, t: ((o - t) ** 2).mean(), csv=text)
        sched.step(x, target=y)
        if text is csv:
            assert sched.offload_report()["host_peak_bytes"] > 0
        grads.append([p.grad.clone() for p in model.parameters()])
        sched.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("name", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                                  "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_every_class_takes_offload_auto_without_times(name):
    """torch's schedule classes from zbpp on one rank (two stages where the class takes several),
    offload="auto" and nothing else: five steps train bit for bit like the same class without
    offload. Orders that run several forwards before their backwards (GPipe, LoopedBFS's
    breadth-first, DualPipeV's warm-up) get copies; on one rank a loop and a V are the same
    placement, so costs measured under one plan the other (that raised before)."""
    torch.manual_seed(0)
    nets = [nn_model(), nn_model()]
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    import zbpp.pipelining as pipelining

    cls = getattr(pipelining, name)
    grads, moved = {}, 0
    for offload in (None, "auto"):
        mods = [nn_model(), nn_model()]
        for m, n in zip(mods, nets):
            m.load_state_dict(n.state_dict())
        if issubclass(cls, pipelining.PipelineScheduleSingle):
            stages = zbpp.PipelineStage(torch.nn.Sequential(*mods), 0, 1, "cpu")
        else:
            stages = [zbpp.PipelineStage(m, s, 2, "cpu") for s, m in enumerate(mods)]
        sched = cls(stages, 8, loss_fn=lambda out, t: ((out - t) ** 2).mean(), offload=offload)
        for _ in range(5):
            sched.step(x, target=y)
        grads[offload] = [p.grad for m in mods for p in m.parameters()]
        if offload:
            moved = sum(op.type == "OFFLOAD" for op in sched.schedule.rank_ops(0))
        sched.close()
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads["auto"]))
    if name in ("ScheduleGPipe", "ScheduleLoopedBFS", "ScheduleDualPipeV"):
        assert moved > 0, f"{name}: no copies placed"


@pytest.mark.parametrize("limit", [2, "2p"])
def test_a_fixed_order_reaches_mem_limit_with_its_measured_copies(limit):
    """GPipe holds all 8 microbatches; offload="auto" with mem_limit and no times: the profiled
    steps run without copies and without the limit (only copies can reach it on a fixed order),
    and the plan after them holds at most the limit (a multiple of p too)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    sched = zbpp.ScheduleGPipe(zbpp.PipelineStage(nn_model(), 0, 1, "cpu"), 8,
                               loss_fn=lambda out, t: ((out - t) ** 2).mean(), offload="auto", mem_limit=limit)
    for _ in range(5):
        sched.step(x, target=y)
    plan = sched.schedule
    plan.simulate()
    assert sched.plan_info.offloaded > 0 and plan.rank_memory(0)[0] <= 2
    sched.close()


def test_the_cpu_prediction_lets_an_offload_finish_before_the_next_forward(tmp_path):
    """On a CPU an OFFLOAD runs inline, right after its F: its bytes are off the device before the
    next F allocates (a GPU's copy engine would still hold them then, as the plan with copy times
    says). Rank 1 below reaches its peak at W5 (four split-layer inputs waiting for W, F5's, and F4
    reloaded early), not at F5 (F4's copy still running): offload_report's CPU prediction
    (sync_device_peak_bytes) is the measured peak, where a copy with a duration of its own put the
    peak at F5 half a microbatch higher (as on a ZB-V rank of the GPT example)."""
    stage1 = [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
              ("F", 1, 4), ("OFFLOAD", 1, 4), ("F", 1, 5), ("B", 1, 5), ("W", 1, 5), ("RELOAD", 1, 4), ("B", 1, 4)]
    stage1 += [("W", 1, i) for i in range(5)]
    stage0 = [("F", 0, i) for i in range(6)] + [("B", 0, i) for i in (0, 1, 2, 3, 5, 4)] + [("W", 0, i) for i in range(6)]
    # The loss stage last, on a rank of its own (the model does not count the loss's tensors).
    stage2 = [op for i in range(4) for op in (("F", 2, i), ("B", 2, i))] + [("F", 2, 4), ("F", 2, 5), ("B", 2, 5),
                                                                            ("B", 2, 4)]
    stage2 += [("W", 2, i) for i in range(6)]
    with zbpp.Schedule.from_ops([stage0, stage1, stage2], 6, times=TIMES) as plan:
        plan.validate()
        csv = plan.to_csv()
    spawn(pipeline_worker.run_offload_memory, 3, None, 1, 6, None, str(tmp_path), csv)
    res = torch.load(tmp_path / "rank1.pt")
    if "error" in res:
        pytest.fail(res["error"], pytrace=False)
    rep = res["report"]
    got, sync = rep["device_peak_bytes"], rep["sync_device_peak_bytes"]
    assert abs(got - sync) <= 0.05 * sync, f"measured {got} B, predicted {sync:.0f} B"
