"""Plans from measured costs: zbpp.StageCosts (the zbpp-costs file, costs from measured timelines,
activation memory, memory limits in bytes) and the torch API replanning after its profiled steps.

The two-process run trains a deliberately unequal model whose costs are what the feature is for:
F and B made slow by sleeping layers (3 ms on stage 0, 4.5 ms on stage 1; sleeping needs no CPU, so
the figures hold on a busy machine) and W a fraction of them (the split GEMMs). The costs measured
in steps 2-3 must show that, every rank must switch to the same plan after step 3, that plan must
differ from (and simulate shorter than) the one made for equal costs, and the parameters after 5
steps must equal those of test_pipeline's one-process sequential loop bit for bit (the sleeping
layers pass their input through unchanged, so the model is the same). A fixed order (1F1B) in the
same processes is never replanned.
"""

import json
import math
import os
import time
import traceback

import pytest

torch = pytest.importorskip("torch")

import pipeline_worker  # noqa: E402
import test_pipeline  # noqa: E402 - its reference loop and spawn helper

import zbpp  # noqa: E402
from zbpp.costs import ActivationMeter, StageCosts, parse_mem_limit  # noqa: E402
from zbpp.examples import gpt  # noqa: E402

M, BATCH, SEED, STEPS = 4, 8, 3, 5
DELAYS = (0.003, 0.0045)  # seconds each F and each B of stage 0 and stage 1 sleep


def _costs(**over):
    args = dict(ranks=2, chunks=1, placement="loop", time_f=[1.0, 1.25], time_b=[1.5, 2.0], time_w=[0.5, 0.75],
                time_bw=None, time_comm=0.125, w_share=0.375, mem_f_bytes=[4000, 2000])
    args.update(over)
    return StageCosts(**args)


# ---- the file --------------------------------------------------------------------------------------

def test_costs_json_round_trip(tmp_path):
    c = _costs()
    obj = json.loads(c.to_json())
    assert list(obj) == ["format", "version", "unit", "ranks", "chunks", "placement", "time_f", "time_b", "time_w",
                         "time_bw", "time_comm", "w_share", "mem_f_bytes", "op_overhead",
                         "overhead_f", "overhead_b", "overhead_w", "overhead_bw", "time_offload", "time_reload"]
    assert obj["overhead_f"] == [c.op_overhead] * 2 and obj["overhead_bw"] is None
    assert obj["format"] == "zbpp-costs" and obj["version"] == 1 and obj["unit"] == "ms"
    assert obj["time_bw"] is None and obj["mem_f_bytes"] == [4000, 2000]
    assert StageCosts.from_json(c.to_json()) == c
    path = c.save(tmp_path / "costs.json")
    back = StageCosts.load(path)
    assert back == c and back.time_f == [1.0, 1.25] and back.time_comm == 0.125
    v = _costs(chunks=2, placement="v", time_f=[1, 2, 3, 4], time_b=[1, 2, 3, 4], time_w=[1, 1, 1, 1],
               time_bw=[2, 3, 4, 5], mem_f_bytes=None)
    assert StageCosts.from_json(v.to_json()) == v
    assert json.loads(v.to_json())["mem_f_bytes"] is None


def test_costs_file_skips_unknown_keys_and_reads_null_as_missing():
    obj = json.loads(_costs().to_json())
    obj["from_the_future"] = {"nested": [1, 2]}
    obj["time_comm"] = None
    obj["w_share"] = None
    c = StageCosts.from_json(json.dumps(obj))
    assert c.time_comm == 0.0 and c.w_share == 0.5 and c.time_f == [1.0, 1.25]


GOOD = json.loads(_costs().to_json())


def _with(**over):
    obj = dict(GOOD)
    for k, v in over.items():
        if v is ...:
            del obj[k]
        else:
            obj[k] = v
    return json.dumps(obj)


BAD = [
    ("[1, 2]", "one JSON object"),
    ("{", "not JSON"),
    (_with(format="zbpp-schedule"), '"format" is \'zbpp-schedule\''),
    (_with(format=...), '"format" is missing'),
    (_with(version=2), "version 1"),
    (_with(version=True), "version 1"),
    (_with(unit="s"), '"unit" is \'s\''),
    (_with(time_w=...), '"time_w" is missing'),
    (_with(time_b=[1.0]), "time_b has 1 values; it needs one per stage, S = ranks * chunks = 2"),
    (_with(time_f=[1.0, -2.0]), "time_f[1] is -2.0; it must be finite and >= 0"),
    (_with(time_f=[1.0, "fast"]), "time_f[1] must be a number"),
    (_with(ranks=0), "ranks must be a whole number >= 1"),
    (_with(ranks=1.5), "ranks must be a whole number >= 1"),
    (_with(placement="ring"), "placement is 'ring'"),
    (_with(placement="v"), "a 'v' placement has 2 chunks per rank"),
    (_with(w_share=1.5), "w_share is 1.5"),
    (_with(mem_f_bytes=[1, 2, 3]), "mem_f_bytes has 3 values"),
    (_with(time_comm=float("nan")), "NaN is not a number JSON allows"),
    ('{"format": "zbpp-costs", "format": "zbpp-costs"}', '"format" appears twice'),
]


@pytest.mark.parametrize("text,expect", BAD, ids=[e for _, e in BAD])
def test_costs_file_rejects_bad_files(tmp_path, text, expect):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        StageCosts.load(path)
    assert expect in str(err.value) and str(path) in str(err.value), str(err.value)


@pytest.mark.parametrize("kind, over", [
    ("zb-auto", dict(mem_f_bytes=[4000, 2000])),
    ("zb-v", dict(chunks=2, placement="v", time_f=[1, 2, 3, 4], time_b=[2, 2, 3, 3], time_w=[0.5, 1, 0.25, 1],
                  time_bw=[2.5, 2.5, 3.25, 3.5], mem_f_bytes=None)),
])
def test_the_tool_reads_the_file_and_plans_the_same_schedule(tmp_path, build_dir, kind, over):
    import subprocess

    c = _costs(**over)
    path = c.save(tmp_path / "costs.json")
    mem = ["--mem-limit", "2p"] if kind == "zb-auto" else []
    proc = subprocess.run([str(build_dir / "zbpp"), "schedule", kind, "-p", "2", "-m", "8", "--stage-times", str(path),
                           "--format", "csv", *mem], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with c.plan(kind, 8, "2p" if mem else None) as s:
        assert proc.stdout == s.to_csv()


# ---- costs from measured timelines -----------------------------------------------------------------

def _measured(kind, p, m, times, comm, scale=1.0):
    """A timeline as the runner would measure it: the schedule's simulated times (ms), given to
    set_times in seconds, with every op's duration multiplied by `scale` (a slow step)."""
    planned = zbpp.Schedule.generate(kind, p=p, m=m, times=times, comm=comm)
    planned.simulate()
    starts, ends = [], []
    for r in range(p):
        s, e = planned.rank_times(r)
        starts.append([x / 1000 for x in s])
        ends.append([(a + (b - a) * scale) / 1000 for a, b in zip(s, e)])
    copy = zbpp.Schedule.from_csv(planned.to_csv())
    copy.set_times(starts, ends)
    planned.close()
    return copy


def test_from_timelines_recovers_stage_costs_and_comm():
    times = {"f": [1.0, 1.5, 2.0], "b": [2.0, 2.5, 3.0], "w": [0.25, 0.5, 4.0]}
    # Two steps as simulated and one with every op 60% slower: the medians are the true costs.
    timelines = [_measured("zb-h1", 3, 6, times, 0.375), _measured("zb-h1", 3, 6, times, 0.375),
                 _measured("zb-h1", 3, 6, times, 0.375, scale=1.6)]
    c = StageCosts.from_timelines(timelines, mem_f_bytes=[10, 20, 30], w_share=0.25)
    for key, got in (("f", c.time_f), ("b", c.time_b), ("w", c.time_w)):
        assert got == pytest.approx(times[key], rel=1e-9), (key, got, times[key])
    assert c.time_bw is None
    assert c.time_comm == pytest.approx(0.375, rel=1e-9)
    assert (c.ranks, c.chunks, c.placement, c.mem_f_bytes, c.w_share) == (3, 1, "loop", [10, 20, 30], 0.25)
    for t in timelines:
        t.close()


def test_overhead_after_sending_ops_is_theirs_and_predicted():
    # The runtime's gap after an op depends on the op: posting a send to another rank takes time,
    # an op whose output stays on its rank is followed by almost nothing. A run where every F and B
    # that sends is followed by `send` ms and every other op by `local` ms: each stage and type gets
    # its own overhead, T_comm is the transfer alone, and the plan's bubble as the runner measures
    # it is predicted (a single overhead for all ops would not: it is off by about a point here).
    times = {"f": [1.0, 1.5, 2.0], "b": [2.0, 2.5, 3.0], "w": [0.25, 0.5, 1.0]}
    send, local, comm = 0.5, 0.03125, 0.375
    over = {"f": [send, send, local], "b": [local, send, send], "w": [local] * 3}
    slotted = {k: [x + over[k][s] for s, x in enumerate(v)] for k, v in times.items()}
    planned = zbpp.Schedule.generate("zb-h1", p=3, m=6, times=slotted, comm=comm)
    planned.simulate()
    starts, ends = [], []
    for r in range(3):
        s, e = planned.rank_times(r)
        ops = planned.rank_ops(r)
        starts.append([x / 1000 for x in s])
        ends.append([(e[k] - over[op.type.lower()][op.stage]) / 1000 for k, op in enumerate(ops)])
    with zbpp.Schedule.from_csv(planned.to_csv()) as t:
        measured = t.set_times(starts, ends)
        c = StageCosts.from_timelines([t])
    for key in ("f", "b", "w"):
        assert c.overheads[key] == pytest.approx(over[key], rel=1e-9), key
        assert getattr(c, "time_" + key) == pytest.approx(slotted[key], rel=1e-9), key
    assert c.time_comm == pytest.approx(comm, rel=1e-9)
    assert StageCosts.from_json(c.to_json()) == c
    with c.plan("zb-h1", 6) as again:
        assert again.to_csv() == planned.to_csv()
        assert c.expected_bubble(again) == pytest.approx(measured.bubble_rate, abs=0.002)
        one = StageCosts(3, 1, "loop", c.time_f, c.time_b, c.time_w, time_comm=c.time_comm, op_overhead=c.op_overhead)
        assert abs(one.expected_bubble(again) - measured.bubble_rate) > 0.005


def test_expected_bubble_counts_the_measured_spread_of_op_times():
    # Steps whose ops take their time or 1.5 times it: the medians alone plan for a steady pipeline,
    # but an op that runs long delays the rank waiting for it. Drawn from the measured durations,
    # the expected bubble is higher, the same every time, and equal to the plain figure when the
    # steps did not vary.
    times = {"f": [1.0, 1.5, 2.0], "b": [2.0, 2.5, 3.0], "w": [0.5, 0.5, 1.0]}
    steady = [_measured("zb-h1", 3, 6, times, 0.25) for _ in range(2)]
    noisy = steady + [_measured("zb-h1", 3, 6, times, 0.25, scale=1.5)]
    c_steady, c_noisy = StageCosts.from_timelines(steady), StageCosts.from_timelines(noisy)
    with c_steady.plan("zb-h1", 6) as plan:
        plain = c_steady.expected_bubble(plan, draws=0)
        assert c_steady.expected_bubble(plan) == pytest.approx(plain, abs=1e-12)
    with c_noisy.plan("zb-h1", 6) as plan:
        plain, spread = c_noisy.expected_bubble(plan, draws=0), c_noisy.expected_bubble(plan)
        assert spread > plain + 0.005, (spread, plain)
        assert c_noisy.expected_bubble(plan) == spread
        # Costs read back from a file carry no durations: the plain figure.
        assert StageCosts.from_json(c_noisy.to_json()).expected_bubble(plan) == pytest.approx(plain)
    for t in noisy:
        t.close()


def test_runtime_overhead_is_measured_and_a_plans_bubble_predicted_as_the_runner_measures_it():
    # A run where the runtime spends `gap` ms before every op: simulated with each op `gap` longer,
    # measured with each op starting `gap` into its slot (the runner's timestamps see only compute).
    times = {"f": [1.0, 1.5, 2.0], "b": [2.0, 2.5, 3.0], "w": [0.25, 0.5, 1.0]}
    gap, comm = 0.125, 0.375
    slotted = {k: [x + gap for x in v] for k, v in times.items()}
    planned = zbpp.Schedule.generate("zb-h1", p=3, m=6, times=slotted, comm=comm)
    planned.simulate()
    starts, ends = [], []
    for r in range(3):
        s, e = planned.rank_times(r)
        starts.append([(x + gap) / 1000 for x in s])
        ends.append([x / 1000 for x in e])
    with zbpp.Schedule.from_csv(planned.to_csv()) as t:
        measured = t.set_times(starts, ends)
        c = StageCosts.from_timelines([t])
    assert c.op_overhead == pytest.approx(gap, rel=1e-9)
    # The times a plan uses include the overhead (so the plan is made for the real slots); T_comm
    # does not (the overhead after an arrival is the op's, not the transfer's).
    for key, got in (("f", c.time_f), ("b", c.time_b), ("w", c.time_w)):
        assert got == pytest.approx(slotted[key], rel=1e-9), (key, got)
    assert c.time_comm == pytest.approx(comm, rel=1e-9)
    assert StageCosts.from_json(c.to_json()).op_overhead == pytest.approx(gap)
    # What the runner measured for this very plan is what expected_bubble predicts (up to the
    # first op's overhead, which falls outside the measured span), while the plain simulated bubble
    # counts the overhead as work and is lower.
    with c.plan("zb-h1", 6) as again:
        assert again.to_csv() == planned.to_csv()
        expected = c.expected_bubble(again)
        assert expected == pytest.approx(measured.bubble_rate, abs=0.005)
        assert again.simulate().bubble_rate < measured.bubble_rate - 0.02
    planned.close()


def test_from_timelines_of_a_v_schedule_and_of_fused_backwards():
    times = {"f": [1.0, 1.5, 2.0, 2.5], "b": [2.0, 2.5, 3.0, 3.5], "w": [0.5, 0.5, 1.0, 1.0]}
    with _measured("zb-v", 2, 4, times, 0.25) as t:
        c = StageCosts.from_timelines([t])
    assert (c.chunks, c.placement) == (2, "v")
    assert c.time_f == pytest.approx(times["f"]) and c.time_w == pytest.approx(times["w"])
    assert c.time_comm == pytest.approx(0.25)
    # 1F1B runs fused backwards: BW is measured, B and W are half of it each.
    with _measured("1f1b", 2, 4, {"f": [1.0, 2.0], "b": [2.0, 3.0], "w": [1.0, 1.0]}, 0.0) as t:
        c = StageCosts.from_timelines([t])
    assert c.time_bw == pytest.approx([3.0, 4.0]) and c.time_b == pytest.approx([1.5, 2.0])
    assert c.time_comm == 0.0


def test_activation_meter_counts_saved_bytes_and_the_w_only_share():
    rows, d_in, d_hid = 6, 8, 16
    mod = zbpp.split_linear(torch.nn.Sequential(torch.nn.Linear(d_in, d_hid), torch.nn.GELU(),
                                                torch.nn.Linear(d_hid, 4)))
    x = torch.randn(rows, d_in)
    with ActivationMeter(mod) as meter:
        y = mod(x)
        meter.roots = [y]
    # Saved: x by the first linear (only W reads it), the first linear's output by GELU, and GELU's
    # output by the second linear (only W reads it). The weights are parameters: not counted.
    assert meter.saved_bytes == 4 * rows * (d_in + d_hid + d_hid)
    assert meter.w_only_bytes == 4 * rows * (d_in + d_hid)
    y.sum().backward()  # the hooks left the graph as it was
    assert mod[0].weight.grad is not None


# ---- memory limits ---------------------------------------------------------------------------------

def test_mem_limit_forms():
    assert parse_mem_limit("8GB") == ("bytes", 8 * 10 ** 9)
    assert parse_mem_limit("512 MiB") == ("bytes", 512 << 20)
    assert parse_mem_limit("2p") == ("microbatches", "2p")
    assert parse_mem_limit(6) == ("microbatches", 6)
    assert parse_mem_limit(None) == (None, None)
    for bad in ("lots", "8 GBs", "-3", "p2", "", "0GB", True):
        with pytest.raises(ValueError, match="not understood|no memory|> 0"):
            parse_mem_limit(bad)


def test_plan_turns_bytes_into_microbatches_of_the_heaviest_rank():
    c = _costs(mem_f_bytes=[4000, 2000])  # rank 0 keeps 4000 bytes per microbatch
    with c.plan("zb-auto", 8, "12kB") as s:
        assert s.mem_limit == pytest.approx(3.0)
    with c.plan("zb-auto", 8, "2p") as s:
        assert s.mem_limit == 4.0
    with pytest.raises(zbpp.ZbError, match="microbatches of the heaviest rank"):
        c.plan("zb-auto", 8, "1kB")
    with pytest.raises(ValueError, match="needs the activation memory"):
        _costs(mem_f_bytes=None).plan("zb-auto", 8, "8GB")


def _one_process_stages():
    mods = gpt.build_stages(pipeline_worker.model_config(), 2, seed=SEED)
    return [zbpp.PipelineStage(zbpp.split_linear(mods[s]), s, 2, "cpu") for s in range(2)]


def test_bad_mem_limit_is_a_clear_error():
    with pytest.raises(ValueError, match=r"ScheduleZBAuto: mem_limit 'lots' is not understood; .*'8GB'"):
        zbpp.ScheduleZBAuto(_one_process_stages(), M, loss_fn=gpt.loss_fn, mem_limit="lots")
    with pytest.raises(ValueError, match="in bytes, which needs the activation memory"):
        zbpp.ScheduleZBAuto(_one_process_stages(), M, loss_fn=gpt.loss_fn, mem_limit="8GB", plan_from_measured=False)
    with pytest.raises(ValueError, match="1f1b is a fixed order"):
        zbpp.Schedule1F1B(_one_process_stages()[:1], M, loss_fn=gpt.loss_fn, plan_from_measured=True)
    with pytest.raises(ValueError, match="profile_steps"):
        zbpp.ScheduleZBAuto(_one_process_stages(), M, loss_fn=gpt.loss_fn, profile_steps=(3, 2))


def test_a_plan_no_faster_on_the_measured_costs_is_not_swapped_in():
    # One process, two stages: every plan runs without a bubble, so the plan for the measured
    # costs cannot be faster than the one in force, which stays. (One profiled step: no fused
    # step, so no fused backward measured to weigh; see the test below for that.)
    stages = _one_process_stages()
    sched = zbpp.ScheduleZBAuto(stages, M, loss_fn=gpt.loss_fn, profile_steps=(3, 3))
    first = sched.schedule.to_csv()
    data = gpt.Batches(8, BATCH, seed=SEED)
    for _ in range(4):
        x, y = data.next()
        sched.step(x, target=y)
    info = sched.plan_info
    assert info is not None and info.step == 3 and info.profile_steps == (3, 3)
    assert info.costs.time_bw is None
    assert not info.switched and sched.schedule.to_csv() == first
    assert info.simulated == info.before and info.candidate.cost >= 0.99 * info.before.cost
    assert "kept the plan in force" in info.summary()
    assert info.costs.ranks == 1 and info.costs.chunks == 2 and all(t > 0 for t in info.costs.time_f)
    sched.close()


def test_zb_auto_measures_a_fused_backward():
    # The first profiled step runs the plan with every backward fused, the second the plan itself:
    # the costs then hold a fused backward next to B and W apart, for the replan to weigh. (Which
    # backwards the replan then fuses depends on the measured times; csrc/schedule/fuse.c's rule is
    # tested in test_generators.c. That the fused step and the replanned ones train bit for bit as
    # one process: test_replanned_run_trains_bit_for_bit_like_one_process.)
    stages = _one_process_stages()
    sched = zbpp.ScheduleZBAuto(stages, M, loss_fn=gpt.loss_fn)
    assert any(o.type == "W" for o in sched.schedule.rank_ops(0))
    data = gpt.Batches(8, BATCH, seed=SEED)
    kinds = []
    for _ in range(4):
        x, y = data.next()
        sched.step(x, target=y)
        kinds.append(sorted({o.type for o in sched._last_schedule.rank_ops(0)}))
    assert kinds[1] == ["BW", "F"] and "W" in kinds[2]  # step 2 fused, step 3 the plan in force
    info = sched.plan_info
    assert info.fused_steps == (2,)
    assert info.costs.time_bw is not None and all(t > 0 for t in info.costs.time_bw)
    assert "/BW per stage" in info.summary()
    sched.close()


def test_costs_given_plan_at_once_and_profiling_stays_off(tmp_path):
    c = StageCosts(1, 2, "v", [1.0, 1.0], [1.0, 1.0], [0.1, 3.0], time_comm=0.0, mem_f_bytes=[1000, 1000])
    path = c.save(tmp_path / "c.json")
    sched = zbpp.ScheduleZBAuto(_one_process_stages(), M, loss_fn=gpt.loss_fn, costs=str(path), mem_limit="4kB")
    with zbpp.Schedule.generate("zb-auto", p=1, m=M, v=2, times=c.times(), mem_limit=2.0) as want:
        assert sched.schedule.to_csv() == want.to_csv()
    assert sched._profile is None and sched.costs == c
    sched.close()


# ---- two processes: the replan -----------------------------------------------------------------------

class _SlowFn(torch.autograd.Function):
    """Passes x through (a copy: bit for bit the same values), sleeping in its forward and in its
    backward (B)."""

    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        time.sleep(delay)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        time.sleep(ctx.delay)
        return dy, None


class Slow(torch.nn.Module):
    def __init__(self, delay):
        super().__init__()
        self.delay = delay

    def forward(self, x):
        return _SlowFn.apply(x, self.delay)


def _train(rank, world, kind, out_dir):
    mods = gpt.build_stages(pipeline_worker.model_config(), world, seed=SEED)
    mods[0] = torch.nn.Sequential(mods[0][0], Slow(DELAYS[0]), *mods[0][1:])  # after the embedding
    mods[1] = torch.nn.Sequential(Slow(DELAYS[1]), *mods[1])
    stage = zbpp.PipelineStage(zbpp.split_linear(mods[rank]), rank, world, "cpu")
    sched = zbpp.get_schedule_class(kind)(stage, M, loss_fn=gpt.loss_fn, timeout=60.0,
                                          save_plan_dir=os.path.join(out_dir, kind))
    first = sched.schedule.to_csv()
    opt = torch.optim.AdamW(list(mods[rank].parameters()), lr=1e-2, foreach=False)
    data = gpt.Batches(8, BATCH, seed=SEED)
    losses, switched_at = [], None
    for step in range(STEPS):
        x, y = data.next()
        got = []
        sched.step(*((x,) if sched.holds_first else ()), **({"target": y, "losses": got} if sched.holds_loss else {}))
        if switched_at is None and sched.schedule.to_csv() != first:
            switched_at = step + 1
        opt.step()
        opt.zero_grad(set_to_none=True)
        if got:
            losses.append([float(v) for v in got])
    info = sched.plan_info
    out = {"first": first, "last": sched.schedule.to_csv(), "switched_at": switched_at, "losses": losses,
           "params": [p.detach().clone() for p in mods[rank].parameters()],
           "info": None if info is None else {
               "step": info.step, "kind": info.kind, "digest": info.digest, "files": info.files,
               "switched": info.switched,
               "costs": info.costs.to_dict(), "simulated": tuple(info.simulated),
               "measured": info.measured_bubble, "before": tuple(info.before), "summary": info.summary()}}
    sched.close()
    return out


def run_autoplan(rank, world, port, out_dir):
    pipeline_worker._init(rank, world, port)
    try:
        results = {kind: _train(rank, world, kind, out_dir) for kind in ("zb-auto", "1f1b")}
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        results = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def autoplan(tmp_path_factory):
    out = tmp_path_factory.mktemp("autoplan")
    test_pipeline.spawn(run_autoplan, 2, str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        if "error" in r:
            pytest.fail("a rank failed:\n" + r["error"], pytrace=False)
    return ranks, out


def test_replans_after_the_profile_steps_to_one_plan_on_every_rank(autoplan):
    ranks, _ = autoplan
    infos = [r["zb-auto"]["info"] for r in ranks]
    assert all(i is not None for i in infos), "no replan happened"
    assert [i["step"] for i in infos] == [3, 3]
    assert [r["zb-auto"]["switched_at"] for r in ranks] == [3, 3], "the plan must change after step 3"
    assert infos[0]["digest"] == infos[1]["digest"]
    assert ranks[0]["zb-auto"]["last"] == ranks[1]["zb-auto"]["last"]
    assert infos[0]["costs"] == infos[1]["costs"], "every rank must plan from the same costs"


def test_measured_costs_show_the_model_and_the_plan_differs_from_the_equal_cost_one(autoplan):
    ranks, _ = autoplan
    run = ranks[0]["zb-auto"]
    costs = run["info"]["costs"]
    for s, delay in enumerate(DELAYS):
        # The delay is in the backward of the stage's input path: B's, except on the first stage,
        # whose input needs no gradient, so its whole backward runs at W (as torch's split does).
        back = "time_w" if s == 0 else "time_b"
        for key in ("time_f", back):
            assert costs[key][s] >= 0.9 * delay * 1000, f"stage {s}'s {key} should be at least {delay * 1000} ms: {costs}"
        if s > 0:
            assert costs["time_w"][s] < costs["time_b"][s] / 2, costs
        else:
            assert costs["time_b"][s] < costs["time_w"][s] / 2, costs
    assert costs["mem_f_bytes"] and all(b > 0 for b in costs["mem_f_bytes"])
    assert 0 < costs["w_share"] < 1
    with zbpp.Schedule.generate("zb-auto", p=2, m=M) as equal:
        assert run["first"] == equal.to_csv()
        assert run["last"] != equal.to_csv(), "the plan for the measured costs is the equal-cost plan"
    # It switched because on the measured costs the new plan is shorter than the old one.
    assert run["info"]["switched"]
    assert run["info"]["simulated"][0] < 0.99 * run["info"]["before"][0], run["info"]["summary"]


def test_replanned_run_trains_bit_for_bit_like_one_process(autoplan):
    ranks, _ = autoplan
    ref_losses, ref_params = test_pipeline.reference(steps=STEPS, m=M, batch=BATCH, seed=SEED)
    for kind in ("zb-auto", "1f1b"):
        params = ranks[0][kind]["params"] + ranks[1][kind]["params"]
        assert len(params) == len(ref_params)
        for k, (got, want) in enumerate(zip(params, ref_params)):
            assert torch.equal(got, want), (f"{kind}: parameter {k} differs from the sequential loop by up to "
                                            f"{(got - want).abs().max().item():.3g}")
        assert ranks[1][kind]["losses"] == ref_losses, kind


def test_fixed_kind_is_never_replanned(autoplan):
    ranks, out = autoplan
    for r in ranks:
        assert r["1f1b"]["info"] is None
        assert r["1f1b"]["switched_at"] is None and r["1f1b"]["first"] == r["1f1b"]["last"]
    assert not (out / "1f1b").exists()


def test_rank0_saves_the_costs_and_the_plan(autoplan):
    ranks, out = autoplan
    info = ranks[0]["zb-auto"]["info"]
    names = sorted(os.path.basename(f) for f in info["files"])
    assert names == ["zbpp-costs.json", "zbpp-plan-zb-auto.csv", "zbpp-plan-zb-auto.svg"]
    assert ranks[1]["zb-auto"]["info"]["files"] == []
    saved = StageCosts.load(out / "zb-auto" / "zbpp-costs.json")
    assert saved.to_dict() == info["costs"]
    assert (out / "zb-auto" / "zbpp-plan-zb-auto.csv").read_text() == ranks[0]["zb-auto"]["last"]
    assert math.isfinite(info["measured"]) and "simulated bubble" in info["summary"]
