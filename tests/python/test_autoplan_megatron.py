"""Plans from measured costs behind Megatron's forward_backward_func: the reference fork's timer flags
(--zero-bubble-pipeline-timers-start-iter / -end-iter) choose the training calls whose costs the
zero-bubble schedule is planned from, and the replanned run still trains bit for bit like
Megatron's own schedule (real megatron-core, two pipeline ranks over gloo; megatron_real.py's
harness). That the plan really changed is seen from outside the workers: with ZBPP_PLAN_DIR set,
rank 0 writes the costs and the plan when it replans.
"""

import argparse

import pytest

import megatron_real as mr  # noqa: E402 - imports no Megatron

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
import zbpp.megatron as zm  # noqa: E402


def _parse(argv):
    return zm.add_arguments(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture
def fresh_config():
    yield
    zm.configure()


def test_timer_flags_choose_the_profiled_calls(fresh_config):
    assert zm.flags.profile_steps(zm.Options()) == (2, 3)  # zbpp's default: calls 2 and 3
    zm.configure(_parse(["--enable-zero-bubble", "--zero-bubble-pipeline-timers-start-iter", "100",
                         "--zero-bubble-pipeline-timers-end-iter", "110"]))
    assert zm.flags.profile_steps() == (100, 110)  # the fork's defaults, when given
    zm.configure(_parse(["--zero-bubble-pipeline-timers-start-iter", "5"]))
    assert zm.flags.profile_steps() == (5, 5)
    with pytest.raises(ValueError, match="start-iter 9 is after --zero-bubble-pipeline-timers-end-iter 4"):
        zm.configure(_parse(["--zero-bubble-pipeline-timers-start-iter", "9",
                             "--zero-bubble-pipeline-timers-end-iter", "4"]))
    with pytest.raises(ValueError, match="end-iter must be an iteration number >= 1"):
        zm.configure(_parse(["--zero-bubble-pipeline-timers-end-iter", "0"]))
    zm.configure(plan_from_measured=False)
    assert zm.options().plan_from_measured is False


# Timers on the first call only, so that two calls cover the profile, the replan and a step on the
# new plan (the default would need four).
PLAIN = dict(pp=2, layers_per_stage=2, steps=2)
V_LAYOUT = dict(pp=2, vp=2, layers_per_stage=1, v_order=True, steps=2)
TIMERS = ["--zero-bubble-pipeline-timers-start-iter", "1", "--zero-bubble-pipeline-timers-end-iter", "1"]


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory):
    if not mr.megatron_core_installed():
        pytest.skip("megatron-core is not installed")
    plan_dir = tmp_path_factory.mktemp("plans")
    cases = {
        "megatron-split": dict(PLAIN, zbpp_split=True),
        "zbpp-zb-auto": dict(PLAIN, use_zbpp=True, zbpp_split=True, zbpp_argv=["--enable-zero-bubble", *TIMERS]),
        "zbpp-zb-v": dict(V_LAYOUT, use_zbpp=True, zbpp_split=True, zbpp_argv=["--zero-bubble-v-schedule", *TIMERS]),
    }
    mp = pytest.MonkeyPatch()
    mp.setenv("ZBPP_PLAN_DIR", str(plan_dir))  # the spawned workers inherit it
    try:
        out = mr.run_cases(2, list(cases.values()), timeout=60)
    finally:
        mp.undo()
    results = dict(zip(cases, out))
    for name, res in results.items():
        if isinstance(res, BaseException):
            pytest.fail(f"case {name} failed:\n{res}", pytrace=False)
    return results, plan_dir


@pytest.mark.parametrize("name, kind", [("zbpp-zb-auto", "zb-auto"), ("zbpp-zb-v", "zb-v")])
def test_megatron_replans_from_the_timer_iterations_and_matches_megatron(megatron_results, name, kind):
    results, plan_dir = megatron_results
    res = results[name]
    for rank in res["ranks"]:
        assert rank["ran"] == {f"zbpp.megatron.run.forward_backward_func [{kind}]"}
    plan = plan_dir / f"zbpp-plan-{kind}.csv"
    assert plan.is_file(), f"rank 0 did not replan {kind} after the timer iterations (no {plan.name})"
    with zbpp.Schedule.from_csv(plan.read_text()) as s:
        s.validate()
        assert (s.ranks, s.chunks) == (2, 2 if kind == "zb-v" else 1)
    costs = zbpp.StageCosts.load(plan_dir / "zbpp-costs.json")  # the last case's
    assert costs.ranks == 2 and all(t > 0 for t in costs.time_f)
    diffs = mr.differences(results["megatron-split"], res)
    assert not diffs, f"{name} differs from Megatron's schedule in {len(diffs)} places:\n" + "\n".join(diffs[:20])
