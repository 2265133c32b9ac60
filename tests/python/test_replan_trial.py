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
