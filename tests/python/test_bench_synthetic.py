"""benchmarks/bench_synthetic.py's correctness check: step 1 equals the sequential loop.

The benchmark times schedules on stages that sleep fixed F, B and W times; before it times anything
it compares step 1 of every configuration with a sequential loop over the same stages. This runs
that check alone (--check-only) for 2 processes with torch's Schedule1F1B from both imports and
zbpp's zb-v kind (whose W ops run apart from B), with 1 ms sleeps, and asserts every loss and
every parameter's gradient (each stage's scale and its W-only weight) equals the loop's; and that
the replay (an op order simulated on measured op durations) and the nominal stage costs the plan
uses say what the benchmark's table claims. No time is asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_synthetic.py"
sys.path.insert(0, str(BENCH.parent))


def test_step_one_equals_the_loop(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(BENCH), "--p", "2", "--m", "4", "--costs", "custom:1/1/0.5",
           "--classes", "Schedule1F1B,zb-v", "--check-only", "--timeout", "60", "--deadline", "150",
           "--out", str(tmp_path), "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert run.returncode == 0, f"bench_synthetic --check-only exited {run.returncode}:\n{run.stderr[-4000:]}"
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1 and not cells[0].get("failed"), cells
    assert cells[0]["cost"] == "custom:1/1/0.5", cells[0]["cost"]
    checks = cells[0]["checks"]
    assert sorted(checks) == ["torch Schedule1F1B", "zbpp Schedule1F1B", "zbpp zb-v"], sorted(checks)
    for config, seen in checks.items():
        # 2 ranks: the losses, and scale and w of each stage (2 stages for 1F1B, 4 for zb-v's V)
        stages = 4 if config.endswith("zb-v") else 2
        assert sorted(seen) == sorted(["losses"] + [f"stage {s} {n}" for s in range(stages) for n in ("scale", "w")])
        for what, (got, want) in seen.items():
            assert got == want, f"{config}: {what} after step 1 is {got}, the sequential loop's is {want}"
        # the gradient of w comes only from W (SleepW's backward): a W that never ran leaves it None
        assert all(seen[f"stage {s} w"][1] != 0 for s in range(stages)), seen


def _plan(kind, p, m, times):
    import zbpp

    sched = zbpp.Schedule.generate(kind, p, m, times=times)
    sched.simulate()
    durations = []
    for r in range(p):
        starts, ends = sched.rank_times(r)
        durations.append([e - a for a, e in zip(starts, ends)])
    return sched, durations


@pytest.mark.parametrize("kind", ["zb-v", "1f1b"])
def test_replay_of_the_plans_own_durations_is_the_plan(kind):
    """The replay re-simulates an op order with given per-op durations: fed the plan's own op
    durations it must give the plan's makespan, and with every duration doubled, twice that (a
    replay that misaligned durations and ops, or kept the nominal costs, fails one of them)."""
    from types import SimpleNamespace

    from bench_synthetic_timing import replay

    sched, durations = _plan(kind, 2, 4, (3.0, 2.0, 1.0))
    cfg = SimpleNamespace(m=4, placement="v" if kind == "zb-v" else "one", v=2 if kind == "zb-v" else 1)
    try:
        want = sched.simulate().cost
        assert replay(cfg, sched, durations) == pytest.approx(want)
        assert replay(cfg, sched, [[2 * d for d in r] for r in durations]) == pytest.approx(2 * want)
        slower = [list(r) for r in durations]
        slower[0][0] += 5.0  # rank 0's first forward starts every chain: the step is 5 later
        assert replay(cfg, sched, slower) == pytest.approx(want + 5.0)
    finally:
        sched.close()


def test_nominal_costs_move_the_first_stages_backward_to_w():
    """torch and zbpp run the first stage's whole backward at W (its input needs no gradient):
    the plan's costs say so, and only for stage 0."""
    from bench_synthetic_timing import nominal_times

    got = nominal_times([(1.0, 2.0, 3.0)] * 3)
    assert got == [(1.0, 0.0, 5.0), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0)], got


@pytest.mark.parametrize("argv, says", [
    (["--costs", "custom:10/10"], "custom:F/B/W"),
    (["--stability", "3", "--p", "4", "--m", "8", "--costs", "equal"], "--stability runs one configuration"),
    (["--stability", "1", "--p", "4", "--m", "8", "--costs", "equal", "--classes", "zb-v"], "at least 2"),
])
def test_usage_errors_say_what_is_allowed(argv, says):
    run = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert run.returncode == 2 and says in run.stderr, (run.returncode, run.stderr[-2000:])


def test_torch_classes_an_older_torch_cannot_run_are_named_not_launched(monkeypatch):
    """On torch 2.12 and older (the lent GPU machine's 2.11), torch's own V classes fail the whole
    launch (a rank's two neighbouring stages send through gloo to itself): the benchmark leaves
    them out, says why, and runs the rest; from torch 2.13 they run."""
    import bench_synthetic as bs

    argv = ["--p", "4", "--classes", "Schedule1F1B,ScheduleZBVZeroBubble,ScheduleDualPipeV,zb-v"]
    monkeypatch.setattr(bs.torch, "__version__", "2.11.0+cu130")
    args = bs.parse_args(argv)
    assert ("torch", "ScheduleZBVZeroBubble") not in args.configs and ("torch", "ScheduleDualPipeV") not in args.configs
    assert ("zbpp", "ScheduleZBVZeroBubble") in args.configs and ("torch", "Schedule1F1B") in args.configs
    assert [why.split(":")[0] for why in args.not_run] == ["torch ScheduleZBVZeroBubble", "torch ScheduleDualPipeV"]
    monkeypatch.setattr(bs.torch, "__version__", "2.13.0+cpu")
    args = bs.parse_args(argv)
    assert ("torch", "ScheduleZBVZeroBubble") in args.configs and not args.not_run
