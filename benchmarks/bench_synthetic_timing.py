"""bench_synthetic_timing.py - bench_synthetic.py's measured timelines, plans and replays.

What this is: the part of benchmarks/bench_synthetic.py that records what a configuration's ops
took (zbpp's runner keeps its own op times; torch's stage calls are wrapped) and simulates, with
zbpp's simulator, what its op order takes on the nominal stage costs (the plan) and on the
measured op durations (the replay), and the timer-slack setting of its processes. The difference
between a step and its replay is the runtime's own cost between ops; between the replay and the
plan, the ops' own lateness (a sleep that wakes late, the stage's per-op Python work).
What this is not: a runtime or a scheduler; nothing here changes what runs.
"""

import ctypes
import statistics
import sys
import time

PR_SET_TIMERSLACK = 29  # linux/prctl.h


def set_timer_slack(ns=1):
    """Sets this process's timer slack to `ns` nanoseconds (prctl PR_SET_TIMERSLACK): the kernel
    may otherwise wake a sleeping thread up to 50 us late to batch wake-ups, and every op here is a
    sleep (a profile measured time.sleep's median lateness 0.092 ms at the default, 0.046 ms at 1
    ns). Returns a line saying what was done; Linux only, elsewhere it does nothing and says so."""
    if not sys.platform.startswith("linux"):
        return f"timer slack left as it is ({sys.platform} has no PR_SET_TIMERSLACK)"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
            return f"timer slack left as it is (prctl failed: errno {ctypes.get_errno()})"
    except (OSError, AttributeError) as exc:
        return f"timer slack left as it is (no prctl: {exc})"
    return f"timer slack {ns} ns (prctl PR_SET_TIMERSLACK) in every process, both imports alike"


def nominal_times(times_ms):
    """Per-stage (F, B, W) in ms as the stages really cost under both runtimes: the first stage's
    input needs no gradient, so torch (and zbpp, as torch) runs its whole backward, B's sleep
    included, at its W: stage 0 has B = 0 and W = B + W. A schedule without W ops runs B + W in
    one BW op either way, so its plan is unchanged."""
    out = list(times_ms)
    f, b, w = out[0]
    out[0] = (f, 0.0, b + w)
    return out


class _Recorder:
    """(type, stage, mb, start, end) of every op a torch stage runs: wraps its public
    forward_one_chunk / backward_one_chunk / backward_weight_one_chunk for one step."""

    def __init__(self, stages):
        self.ops, self.saved = [], []
        for st in stages:
            for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", None),
                               ("backward_weight_one_chunk", "W")):
                fn = getattr(st, name)
                self.saved.append((st, name))
                setattr(st, name, self._wrap(fn, kind, st.stage_index))

    def _wrap(self, fn, kind, stage):
        def timed(mb, *a, **k):
            full = k.get("full_backward", a[1] if len(a) > 1 else True)
            t0 = time.perf_counter()
            try:
                return fn(mb, *a, **k)
            finally:
                self.ops.append((kind or ("BW" if full else "B"), stage, mb, t0, time.perf_counter()))
        return timed

    def remove(self):
        for st, name in self.saved:
            del st.__dict__[name]


def _placement(cfg):
    return "loop" if cfg.placement in ("one", "loop") else "v"


def _one_recorded_step(cfg):
    """One more step of cfg, recorded: (zbpp.Schedule with the measured times, per-rank op
    durations in ms aligned with its rank_ops) on rank 0, None elsewhere."""
    import torch.distributed as dist
    import zbpp

    if cfg.impl == "zbpp":
        cfg.timed_step()
        timeline = cfg.sched.timeline()  # a collective
        if cfg.rank != 0:
            timeline.close()
            return None
        durations = []
        for r in range(timeline.ranks):
            starts, ends = timeline.rank_times(r)
            durations.append([e - a for a, e in zip(starts, ends)])
        return timeline, durations
    rec = _Recorder(cfg.stages)
    try:
        cfg.timed_step()
    finally:
        rec.remove()
    got = [None] * cfg.p
    dist.all_gather_object(got, rec.ops, group=cfg.group)
    if cfg.rank != 0:
        return None
    ops = [[(t, s, mb) for t, s, mb, _, _ in rank_ops] for rank_ops in got]
    timeline = zbpp.Schedule.from_ops(ops, cfg.m, placement=_placement(cfg), v=cfg.v)
    timeline.measured = timeline.set_times([[a for *_, a, _ in r] for r in got], [[e for *_, e in r] for r in got])
    return timeline, [[1e3 * (e - a) for *_, a, e in r] for r in got]


def measured_timeline(cfg, steps):
    """`steps` more steps of cfg, recorded: on rank 0 (timeline, durations), the last step's
    zbpp.Schedule with its measured times and, per rank, each op's median duration (ms) over the
    steps, aligned with the timeline's rank_ops; None elsewhere. The order must be the same in
    every recorded step (zbpp replans only at the end of its profile window, before these)."""
    runs = [_one_recorded_step(cfg) for _ in range(steps)]
    if cfg.rank != 0:
        return None
    last = runs[-1][0]
    orders = [[list(t.rank_ops(r)) for r in range(t.ranks)] for t, _ in runs]
    if any(o != orders[-1] for o in orders):
        raise RuntimeError(f"{cfg.label}: the op order changed between the recorded steps; the replay "
                           "needs one order (did a replan happen after the warm-up?)")
    for t, _ in runs[:-1]:
        t.close()
    durations = [[statistics.median(d[r][k] for _, d in runs) for k in range(len(runs[-1][1][r]))]
                 for r in range(len(runs[-1][1]))]
    return last, durations


def op_means(timeline):
    """Mean measured duration (ms) of each op type over every rank's ops."""
    durations = {}
    for r in range(timeline.ranks):
        starts, ends = timeline.rank_times(r)
        for op, a, e in zip(timeline.rank_ops(r), starts, ends):
            durations.setdefault(op.type, []).append(e - a)
    return {t: statistics.fmean(d) for t, d in durations.items()}


def stage_op_means(timeline, durations):
    """{stage: {type: mean duration ms}} of the recorded ops: shows where each stage's backward
    really ran (stage 0's at W under a split)."""
    seen = {}
    for r in range(timeline.ranks):
        for op, d in zip(timeline.rank_ops(r), durations[r]):
            seen.setdefault(op.stage, {}).setdefault(op.type, []).append(d)
    return {s: {t: statistics.fmean(v) for t, v in by.items()} for s, by in sorted(seen.items())}


def replay(cfg, timeline, durations):
    """The makespan (ms, end to end over all ranks) of the order run (the timeline's ops) simulated
    with each op's measured duration, transfers free: the step a runtime with no cost of its own
    between ops would take with these ops. Against the measured step it isolates the runtime's
    own cost."""
    import zbpp

    ops = [timeline.rank_ops(r) for r in range(timeline.ranks)]
    sched = zbpp.Schedule.from_ops(ops, cfg.m, placement=_placement(cfg), v=cfg.v)
    try:
        sched.validate()
        return sched.makespan_durations(durations)
    finally:
        sched.close()


def simulated_plan(cfg, timeline):
    """The cfg's op order simulated on the nominal stage costs (nominal_times): (zbpp.Schedule,
    where the order came from). The order is its pipeline_order (torch's classes expose it;
    zbpp's after its replan); where zbpp cannot run that order (torch's Schedule1F1B IR lacks the
    last rank's first forward: its _get_pipeline_order starts that rank's forwards at microbatch
    1), the order the runtime ran, as recorded in `timeline`, with the reason."""
    import zbpp
    from zbpp.pipelining._order import schedule_from_actions

    nominal = nominal_times(cfg.times_ms)
    times = {k: [t[i] for t in nominal] for i, k in enumerate("fbw")}
    order = getattr(cfg.sched, "pipeline_order", None)
    why = "it has no pipeline_order"
    if order:
        try:
            return schedule_from_actions(order, cfg.p, cfg.S, cfg.m, times=times), "pipeline_order"
        except Exception as exc:  # noqa: BLE001 - an order zbpp refuses: use the order run instead
            why = f"its pipeline_order is refused: {str(exc).splitlines()[0]}"
    ops = [timeline.rank_ops(r) for r in range(timeline.ranks)]
    plan = zbpp.Schedule.from_ops(ops, cfg.m, placement=_placement(cfg), v=cfg.v, times=times)
    plan.validate()
    return plan, f"the order run ({why})"
