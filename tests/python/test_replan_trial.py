"""A replan is on trial for its first steps: the plan it replaced comes back when the new one
measures slower than the profiled steps of the old one (pipelining/_plan.py, TRIAL_STEPS)."""

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp.pipelining import _plan  # noqa: E402


def _schedule():
    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    stages = [zbpp.PipelineStage(m, s, 2, "cpu") for s, m in enumerate(mods)]
    sched = zbpp.ScheduleZBVZeroBubble(stages, 4, loss_fn=lambda out, y: (out - y).square().mean(),
                                       plan_from_measured=False)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    sched.step(x, target=y)
    return sched, x, y


def _on_trial(sched, before):
    sim = sched.schedule.simulate()
    sched.plan_info = _plan.PlanInfo(step=sched.steps, kind="zb-v", mem_limit=None, costs=None, simulated=sim,
                                     before=sim, measured_bubble=None, profile_steps=None, digest="new",
                                     files=[], switched=True)
    sched._trial = (sched.schedule.to_csv(), before, [])


@pytest.mark.parametrize("span,kept", [(100.5, True), (130.0, False)], ids=["as-fast", "slower"])
def test_a_replan_that_measures_slower_is_undone(span, kept):
    sched, x, y = _schedule()
    _on_trial(sched, before=100.0)
    new = sched.schedule
    for k in range(_plan.TRIAL_STEPS):
        assert sched._trial is not None
        sched._last_times = ([0.0, 10.0], [5.0, span])  # this step's span on the one rank: `span` ms
        sched._trial_step()
    assert sched._trial is None
    info = sched.plan_info
    assert (info.measured_before, info.measured_after) == (100.0, span)
    if kept:
        assert sched.schedule is new and info.switched and not info.reverted
    else:
        assert sched.schedule is not new and info.reverted and not info.switched
        assert sched.schedule.to_csv() == new.to_csv()  # here the "old" plan had the same order
        assert "went back to the plan in force before" in info.summary()
    sched.step(x, target=y)  # and the pipeline runs on
    sched.close()


def test_smoothed_costs_merge_stages_within_the_tolerance_only():
    c = zbpp.StageCosts(4, 1, "loop", [5.4, 6.1, 5.8, 11.0], [0.02, 6.0, 6.3, 12.0], [11.5, 3.0, 3.1, 3.05])
    s = c.smoothed()
    assert s.time_f[:3] == [5.8, 5.8, 5.8] and s.time_f[3] == 11.0  # an LM head twice a layer stays
    assert s.time_b[0] == 0.02 and s.time_b[1] == s.time_b[2] == 6.15 and s.time_b[3] == 12.0
    assert s.time_w[0] == 11.5 and s.time_w[1:] == [3.05, 3.05, 3.05]
    assert c.time_f == [5.4, 6.1, 5.8, 11.0], "smoothed() returns a copy"


def test_noisy_measurements_of_equal_stages_plan_as_well_as_the_true_costs():
    """Launches of one configuration measure equal stages a few percent apart; planned on the raw
    measurements the plans follow that noise and some are longer on the true costs; planned on
    smoothed costs every one is as short as the plan for the true costs."""
    import random

    rng = random.Random(7)
    true = dict(f=5.0, b=5.0, w=2.5)
    with zbpp.Schedule.generate("zb-v", p=4, m=8, times=true) as best:
        best_cost = best.simulate().cost
    smoothed, raw = [], []
    for _ in range(8):
        jitter = lambda base: [base * rng.uniform(0.96, 1.04) for _ in range(8)]  # noqa: E731
        c = zbpp.StageCosts(4, 2, "v", jitter(5.0), jitter(5.0), jitter(2.5))
        for costs, out in ((c.smoothed(), smoothed), (c, raw)):
            with costs.plan("zb-v", 8) as sched, zbpp.Schedule.from_csv(sched.to_csv(), times=true) as again:
                out.append(again.simulate().cost)
    assert max(smoothed) <= best_cost * 1.001, (smoothed, best_cost)
    assert max(raw) > best_cost * 1.02, "the raw measurements happened to plan well: the test shows nothing"


def test_snapped_costs_give_launches_with_a_little_noise_one_plan():
    """Where plans tie on the cost ratios (W = F/2 here), measured noise picks a side per launch:
    planned on the smoothed costs, launches of one configuration got different orders (which then
    ran 4% apart); snapped to the cost grid, they get one."""
    import hashlib
    import random

    rng = random.Random(3)
    digests = {"smoothed": set(), "snapped": set()}
    for _ in range(12):
        scale = rng.uniform(0.97, 1.03)  # one launch's stages all a little slower or faster
        jitter = lambda base: [base * scale * rng.uniform(0.99, 1.01) for _ in range(8)]  # noqa: E731
        c = zbpp.StageCosts(4, 2, "v", jitter(5.0), jitter(5.0), [t * rng.uniform(0.97, 1.03) for t in jitter(2.5)])
        for name, costs in (("smoothed", c.smoothed()), ("snapped", c.smoothed().snapped())):
            with costs.plan("zb-v", 8) as sched:
                digests[name].add(hashlib.sha256(sched.to_csv().encode()).hexdigest())
    assert len(digests["smoothed"]) > 1, "the noise happened to plan one order: the test shows nothing"
    assert len(digests["snapped"]) == 1, f"{len(digests['snapped'])} orders from snapped costs"


def test_snapping_moves_a_cost_by_at_most_half_a_grid_step():
    c = zbpp.StageCosts(2, 1, "loop", [4.0, 9.0], [0.0, 7.3], [3.1, 2.05], time_comm=0.05)
    s = c.snapped()
    step = 2 ** (1 / 12)
    for got, want in zip(s.time_f + s.time_b + s.time_w + [s.time_comm], c.time_f + c.time_b + c.time_w + [c.time_comm]):
        if want == 0:
            assert got == 0
        else:  # half a grid step, plus the anchor's and the result's rounding (1/128 + 1/2048 ms)
            assert want / step ** 0.5 - 0.01 <= got <= want * step ** 0.5 + 0.01, (got, want)
            assert got * 1024 == int(got * 1024), "not on the 1/1024 ms grid"
    # the ratios 1/2 and 2 of the reference (the median forward time, 6.5) are grid points
    half = zbpp.StageCosts(1, 1, "loop", [6.0], [12.02], [2.99]).snapped()
    assert half.time_b == [12.0] and half.time_w == [3.0]


def test_a_plan_with_the_shorter_rank_span_but_the_longer_step_is_not_swapped_in():
    """The replan keeps the plan in force unless the new one is shorter end to end (what a step
    takes). Here ZB-H1's plan for these costs has a rank span 3% shorter than the equal-cost plan
    in force, but it runs 2% longer from the first op to the last: it must not replace it. (zb-auto
    itself now chooses end to end, so it no longer makes such a plan.)"""
    f, b, w = [14.3, 14.63, 10.73, 12.92], [0.1, 11.02, 12.57, 9.79], [5.9, 7.93, 14.8, 11.21]
    times = {"f": f, "b": b, "w": w}
    with zbpp.Schedule.generate("zb-auto", p=4, m=8) as equal:
        in_force = equal.to_csv()
    with zbpp.Schedule.from_csv(in_force, times=times, comm=0.17) as old, \
            zbpp.Schedule.generate("zb-h1", p=4, m=8, times=times, comm=0.17) as new:
        assert new.simulate().cost < 0.97 * old.simulate().cost  # shorter by the paper's measure
        assert new.makespan() > 1.01 * old.makespan()  # longer end to end
        assert _plan._keeps_in_force(old, new)
        assert not _plan._keeps_in_force(new, old)


def _replanning_schedule(monkeypatch):
    """A zb-v pipeline on one rank planned again from its measured costs after step 3 (the
    default window), whose replan is made to report a switch (on one rank no order is faster, so
    a real one keeps the plan; the announcement is what is tested here)."""
    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    stages = [zbpp.PipelineStage(m, s, 2, "cpu") for s, m in enumerate(mods)]
    sched = zbpp.ScheduleZBVZeroBubble(stages, 4, loss_fn=lambda out, y: (out - y).square().mean())
    real = sched.replan

    def switching(*args, **kwargs):
        info = real(*args, **kwargs)
        sched.plan_info = info._replace(switched=True)
        return sched.plan_info

    monkeypatch.setattr(sched, "replan", switching)
    return sched


def test_a_replan_from_measured_costs_says_so_once_on_stderr(monkeypatch, capsys):
    """Plans from measured costs change a user's schedule after step 3: the first time, one line on
    standard error says what was planned, from what, and how to keep the first plan or silence it;
    not again in that process, and not with zbpp.quiet()."""
    from zbpp import _notice

    monkeypatch.setattr(_notice, "_said", set())
    monkeypatch.setattr(_notice, "_quiet", False)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for round_ in range(2):
        sched = _replanning_schedule(monkeypatch)
        for _ in range(3):
            sched.step(x, target=y)
        sched.close()
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("zbpp:")]
        if round_ == 0:
            assert len(err) == 1, err
            assert "ScheduleZBVZeroBubble planned zb-v again after step 3 from the costs measured in steps 2-3" \
                in err[0], err
            assert "plan_from_measured=False" in err[0] and "zbpp.quiet()" in err[0], err
        else:
            assert err == [], "a second replan in the process said it again"
    monkeypatch.setattr(_notice, "_said", set())
    zbpp.quiet()
    try:
        sched = _replanning_schedule(monkeypatch)
        for _ in range(3):
            sched.step(x, target=y)
        sched.close()
    finally:
        zbpp.quiet(False)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("zbpp:")]
