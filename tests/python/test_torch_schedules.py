"""zbpp's zb-auto on torch's interleaved placement against torch's own ScheduleInterleavedZeroBubble:
torch's op order for each rank (its pipeline_order, built with stand-in stages the way PyTorch's own
test_schedule.py builds them) simulated by zbpp on the same costs, and zb-auto planned for those
costs within torch's peak memory. zb-auto must never be longer, and is shorter where the costs are
unequal (torch's order does not look at costs)."""

import random

import pytest

torch = pytest.importorskip("torch")
ts = pytest.importorskip("torch.distributed.pipelining.schedules")
tstage = pytest.importorskip("torch.distributed.pipelining.stage")

import zbpp  # noqa: E402

_TYPES = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}


from stand_ins import stand_in_class  # noqa: E402

_StandIn = stand_in_class(tstage._PipelineStageBase)


def torch_order(p, v, m):
    """torch's ScheduleInterleavedZeroBubble op lists for every rank, as zbpp ops."""
    stages = [_StandIn(p * v, p, 0, stage_index=c * p) for c in range(v)]
    sched = ts.ScheduleInterleavedZeroBubble(stages, n_microbatches=m)
    order = sched.pipeline_order
    return [[(_TYPES[a.computation_type.name], a.stage_index, a.microbatch_index) for a in order[r] if a is not None]
            for r in range(p)]


def test_zb_auto_never_longer_than_torchs_interleaved_zero_bubble():
    rng = random.Random(0)
    cases = [(2, 2, 4, (1, 1, 1), 0.0), (4, 2, 8, (1, 1, 1), 0.0), (4, 4, 8, (1, 1, 1), 0.0)]
    for _ in range(24):
        p, v = rng.choice((2, 3, 4, 6)), rng.choice((2, 3))
        m = rng.choice((p, 2 * p, 3 * p, p + 1, 2 * p - 1))
        cases.append((p, v, m, tuple(round(rng.uniform(0.5, 2), 3) for _ in range(3)), round(rng.uniform(0, 0.3), 3)))
    shorter = checked = 0
    for p, v, m, times, comm in cases:
        try:
            ops = torch_order(p, v, m)
        except (ValueError, AssertionError):
            continue  # a shape torch's schedule refuses (its rounds must divide m)
        with zbpp.Schedule.from_ops(ops, m, placement="loop", times=times, comm=comm) as theirs:
            theirs.validate()
            t = theirs.simulate()
        with zbpp.Schedule.generate("zb-auto", p, m, v=v, placement="loop", times=times, comm=comm,
                                    mem_limit=t.max_peak_memory) as ours:
            ours.validate()
            z = ours.simulate()
        case = f"p={p} v={v} m={m} times={times} comm={comm}"
        assert z.cost <= t.cost * (1 + 1e-9), f"{case}: zb-auto {z.cost:.6g} longer than torch's {t.cost:.6g}"
        assert z.max_peak_memory <= t.max_peak_memory + 1e-9, case
        checked += 1
        shorter += z.cost < t.cost * (1 - 1e-9)
    assert checked >= 15 and shorter >= 5, (checked, shorter)
