"""Plans from measured costs: replanning a schedule's kind between steps.

What this is: the mixin that turns the costs the profiled steps measured (every rank's op times and
activation memory, exchanged between the ranks) into zbpp.StageCosts, plans the schedule's kind
again for them, and switches to the new plan when it is faster (replan); PlanInfo, what a replan
did; and the profile window's parsing. The module docstring of zbpp.pipelining says when it runs.
What this is not: the scheduler (the C library's generators) or the cost model (costs.py).
"""

import hashlib
import logging
import os
import statistics
from typing import NamedTuple, Optional

from ..costs import StageCosts, parse_mem_limit
from ..schedule import Schedule, SimResult
from ._offload import _copy_times_in, _has_copies

# Kinds whose plan depends on the costs: replanned from measured costs (fixed orders never are).
PLANNED_KINDS = ("zb-auto", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min")
DEFAULT_PROFILE_STEPS = (2, 3)
# A plan from measured costs replaces the one in force only if it is shorter by this share of its
# simulated time on those costs: measured costs are noisy, and a swap that buys nothing is a risk.
REPLAN_MIN_GAIN = 0.01
# A plan from measured costs is a forecast: after a replan that switched, the new plan's first
# TRIAL_STEPS steps are measured against the profiled steps of the plan it replaced, and the old
# plan comes back when the new one measured slower by more than REVERT_MARGIN (a replan is never
# clearly slower than the plan it replaced, as measured, not only as simulated). The margin is
# the noise of a few steps' medians on a shared machine (a 1% margin undid good replans there).
TRIAL_STEPS = 3
REVERT_MARGIN = 0.05
_log = logging.getLogger("zbpp")
_KEEP = object()


def fused_variant(schedule):
    """`schedule` with every backward fused: each B becomes a BW at its place and its W goes (the
    same order otherwise), a valid plan for the same pipeline (a BW waits for what its B waited
    for). zb-auto's first profiled step runs it, so that the profile measures what a fused backward
    costs next to B and W apart, which differ where the split costs something (zb-auto then splits
    only where that pays: csrc/schedule/fuse.c). Its stages' W work still runs in microbatch
    order, so the step's gradients are the sequential loop's, as the plan's are."""
    p = schedule.ranks
    ops = [[("BW" if o.type == "B" else o.type, o.stage, o.mb) for o in schedule.rank_ops(r) if o.type != "W"]
           for r in range(p)]
    fused = Schedule.from_ops(ops, schedule.microbatches, placement=schedule.placement, v=schedule.chunks)
    try:
        fused.validate()
    except BaseException:
        fused.close()
        raise
    return fused


def _keeps_in_force(old, new):
    """Whether the plan in force stays: `new` (a Schedule simulated on the measured costs, as `old`,
    the plan in force, is) is not shorter end to end (Schedule.makespan: the first op's start to the
    last op's end over all ranks, what a step takes) by REPLAN_MIN_GAIN. Not by the largest single
    rank's span (Schedule cost), by which a plan can look shorter and step longer
    (test_replan_trial has such a case)."""
    return old.makespan() <= new.makespan() / (1.0 - REPLAN_MIN_GAIN)


class _Planning:
    """PipelineSchedule's replanning (a mixin: it uses the schedule's state and _exchange)."""

    def _profiles_fused(self):
        """Whether the first profiled step runs the plan fused (fused_variant): zb-auto only (the
        kind that weighs a fused backward against B + W), with two or more profiled steps (the
        rest run the plan itself), a loop or V placement, and some W apart to fuse. The same on
        every rank (the plan and the window are)."""
        window = self._profile
        if self._plan_kind != "zb-auto" or window is None or window[1] <= window[0]:
            return False
        s = self.schedule
        if s is None or s.placement not in ("loop", "v"):
            return False
        return any(o.type == "W" for r in range(s.ranks) for o in s.rank_ops(r))

    def _plan_from_profile(self):
        """After the last profiled step: every rank's op times and activation memory go to every
        rank, which turns them into the same StageCosts and plans again (replan)."""
        runs, self._profile_runs = self._profile_runs, []
        copy = {}
        if self._offload_arg is not None:
            # PipeOffload's copy times from this machine: each rank times the copy of its own
            # stages' activations (one microbatch's) to host memory and back.
            from ..costs import measure_copy_time

            for s, (saved, _, cuda_bytes) in self._profile_mem.items():
                copy[s] = measure_copy_time(cuda_bytes if cuda_bytes > 0 else saved, self.device)
        gathered = self._exchange({"runs": [(a, b) for _, a, b, _ in runs], "mem": dict(self._profile_mem),
                                   "copy": copy})
        # The plan in force as measured: its own steps, not a fused one (fused_variant).
        own = [k for k, run in enumerate(runs) if not run[3]]
        before = [max(_rank_span(*g["runs"][k]) for g in gathered) for k in own]
        old_csv = self.schedule.to_csv()
        # offload= asked for copies and the plan in force has none (the profiled steps run without):
        # a run that needs the copies to fit in memory must not lose them to timing noise, so what
        # the trial can bring back is the plan in force with copies placed into it (a fixed order's
        # new plan is just that: no trial).
        forced = self._offload_arg is not None and not _has_copies(self.schedule)
        timelines, bubbles = [], []
        try:
            for k, (text, _, _, _) in enumerate(runs):
                t = Schedule.from_csv(text)
                timelines.append(t)
                bubble = t.set_times([g["runs"][k][0] for g in gathered], [g["runs"][k][1] for g in gathered]).bubble_rate
                if k in own:
                    bubbles.append(bubble)
            S = self.stages[0].num_stages
            mem = {}
            for g in gathered:
                mem.update(g["mem"])
            saved = [mem.get(s, (0, 0, 0)) for s in range(S)]
            mem_f = [c if c > 0 else b for b, _, c in saved]
            total = sum(b for b, _, _ in saved)
            costs = StageCosts.from_timelines(
                timelines, mem_f_bytes=mem_f if any(mem_f) else None,
                w_share=(sum(w for _, w, _ in saved) / total) if total > 0 else None)
            copies = {}
            for g in gathered:
                copies.update(g["copy"])
            if len(copies) == S:
                costs.time_offload = [copies[s][0] for s in range(S)]
                costs.time_reload = [copies[s][1] for s in range(S)]
        finally:
            for t in timelines:
                t.close()
        # Planned on smoothed, snapped costs: stages that cost the same are planned alike, and
        # every run plans from the same cost ratios (StageCosts.snapped).
        info = self.replan(costs.smoothed().snapped(), only_if_faster=True, _measured=statistics.median(bubbles) if bubbles else None)
        if len(own) < len(runs):
            info = self.plan_info = info._replace(
                fused_steps=tuple(self._profile[0] + k for k in range(len(runs)) if k not in own))
        on_trial = bool(info.switched and before and not (forced and info.offloaded and self._plan_kind is None))
        if on_trial and forced and info.offloaded:
            old_csv = self._with_copies(old_csv)
        if on_trial:
            self._trial = (old_csv, statistics.median(before), [])
        if info.switched and self.rank == 0:
            _announce(info, type(self).__name__, trial=on_trial, fixed=self._plan_kind is None)

    def _with_copies(self, csv):
        """The plan `csv` (no copies) timed with the measured costs and with PipeOffload's copies
        placed into it as offload= asks (the fallback of a trial whose new plan brought them)."""
        c = self.costs
        limit = self._mem_limit_arg
        with Schedule.from_csv(csv, times=c.times(), comm=c.time_comm, w_share=c.w_share) as plain:
            placed = self._with_offload(plain, type(self).__name__, limit if not isinstance(limit, str) else None,
                                        close=False)
            try:
                return placed.to_csv()
            finally:
                if placed is not plain:
                    placed.close()

    def _trial_step(self):
        """After each step: while a replan is on trial, every rank's span of this step goes to
        every rank (a collective, TRIAL_STEPS times after a replan); at the end of the trial the
        plan it replaced comes back if the new one measured slower (see TRIAL_STEPS)."""
        trial = getattr(self, "_trial", None)
        if trial is None or self._last_times is None:
            return
        old_csv, before, spans = trial
        spans.append(max(self._exchange(_rank_span(*self._last_times), "the replanned schedule's trial")))
        if len(spans) < TRIAL_STEPS:
            return
        self._trial = None
        after = statistics.median(spans)
        info = self.plan_info
        if after <= before * (1.0 + REVERT_MARGIN):
            self.plan_info = info._replace(measured_before=before, measured_after=after)
            return
        c = self.costs
        old = (Schedule.from_csv(old_csv, times=c.times(), comm=c.time_comm, w_share=c.w_share) if c is not None
               else Schedule.from_csv(old_csv))
        self._switch_schedule(old)
        moved = sum(op.type == "OFFLOAD" for r in range(old.ranks) for op in old.rank_ops(r))
        self.plan_info = info._replace(switched=False, reverted=True, measured_before=before, measured_after=after,
                                       step=self.steps, simulated=info.before or info.simulated,
                                       digest=hashlib.sha256(old_csv.encode()).hexdigest(), offloaded=moved,
                                       device_peak=max(old.rank_memory(r)[0] for r in range(old.ranks))
                                       if moved else None)
        if self.rank == 0:
            _log.info("%s", self.plan_info.summary())

    def replan(self, costs=None, mem_limit=_KEEP, *, only_if_faster=False, _measured=None):
        """Plans this schedule's kind again and runs the new plan from the next step on.

        costs: a zbpp.StageCosts (default: the last ones measured or given; without any, the
        times= of the constructor); mem_limit: a new memory limit (microbatches, "2p", or bytes;
        default: the one in force). only_if_faster: keep the plan in force unless the new one is
        shorter on `costs` by REPLAN_MIN_GAIN of its simulated time (and the plan in force needs no
        more memory than the new one or the limit); what follows the profiled steps does this, so
        that a plan is never swapped for one that measured costs say is no better. A collective:
        every rank of the pipeline calls it between two steps, with the same arguments. Every rank
        plans on its own and the ranks compare digests of the op lists; a difference raises
        RuntimeError on every rank, and, as any failure after the arguments were checked, closes
        the pipeline (_agree.py). Returns plan_info."""
        if self._vp is not None:
            raise ValueError(f"zbpp.{type(self).__name__}: replan() plans without Vocabulary Parallelism's passes; "
                             "a schedule with vocab_parallel= plans again from its own measured times (step 2), "
                             "or from VocabParallel(times=...) and times= given when it is made")
        self._check_open()
        # Arguments every rank gets wrong alike fail before anything is exchanged, and leave the
        # pipeline as it was; what fails after is a failure of the pipeline (_agree.py).
        name = type(self).__name__
        if self._plan_kind is None and not self._offload_profile:
            raise ValueError(f"zbpp.{name}: {self.schedule.kind} is a fixed order; only "
                             + ", ".join(PLANNED_KINDS) + " are planned from costs (and a fixed order's "
                             "copies, with offload=)")
        if mem_limit is not _KEEP:
            try:
                parse_mem_limit(mem_limit)
            except ValueError as exc:
                raise ValueError(f"zbpp.{name}: {exc}") from None
        with self._failing():
            self._trial = None  # a replan asked for ends the trial of the one before
            if mem_limit is not _KEEP:
                self._mem_limit_arg = mem_limit
            return self._replan(costs, only_if_faster, _measured)

    def _replan(self, costs, only_if_faster, _measured):
        keeps = False
        name = type(self).__name__
        costs = costs if costs is not None else self.costs
        limit = self._mem_limit_arg
        p, m = self.ranks, self.n_microbatches
        v = self.stages[0].num_stages // p
        if self._plan_kind is None:
            # A fixed order (offload= profiled it for its copy times): the same compute order, timed
            # with the measured costs, gets its copies below.
            if costs is not None:
                costs.check_shape(p, v, self.schedule.placement, what=f"this pipeline ({name})")
            timed = dict(times=costs.times(), comm=costs.time_comm, w_share=costs.w_share) if costs else {}
            old = self.schedule
            placement = (old.placement if old.placement != "custom" else
                         [old.stage_rank(st) for st in range(old.stages)])
            new = Schedule.from_ops([[(o.type, o.stage, o.mb) for o in old.rank_ops(r)
                                      if o.type not in ("OFFLOAD", "RELOAD")] for r in range(p)], m,
                                    placement=placement, v=v, **timed)
        elif costs is not None:
            costs.check_shape(p, v, self.schedule.placement, what=f"this pipeline ({name})")
            new = refined(costs.plan(self._kind_arg, m, limit))
        else:
            if parse_mem_limit(limit)[0] == "bytes":
                raise ValueError(f"zbpp.{name}: mem_limit={limit!r} is in bytes, which needs measured costs "
                                 "(mem_f_bytes) to plan")
            new = refined(Schedule.generate(self._kind_arg, p=p, m=m, v=v, times=self._times_arg, mem_limit=limit,
                                            placement=self._placement_arg))
        label = new.kind if self._plan_kind is not None else self._kind_arg or "csv"
        plain = new  # without copies: what the measured costs time (expected_bubble)
        device_limit = limit if not isinstance(limit, str) else None
        if self._plan_kind is None and limit is not None:
            # "2p" and bytes too: on a fixed order only the copies can reach the limit.
            device_limit = costs.mem_limit(limit) if costs is not None else limit
            if isinstance(device_limit, str):  # a multiple of p
                text = device_limit.strip().lower().replace("*", "")[:-1].strip()
                device_limit = (float(text) if text else 1.0) * p
            elif parse_mem_limit(device_limit)[0] == "bytes":
                device_limit = None  # bytes without measured costs: nothing to convert them with
        if self._offload_arg is not None and _copy_times_in(new):
            new = self._with_offload(plain, name, device_limit, close=False)
            if self._plan_kind is None and device_limit and self.rank == 0:
                peak = max(new.rank_memory(r)[0] for r in range(new.ranks))
                if peak > device_limit + 1e-9:
                    _log.warning("zbpp: %s: the copies bring %s's device peak to %g microbatches, above "
                                 "mem_limit=%r (%g microbatches): no more of its activations can move and come "
                                 "back in time", name, label, peak, limit, device_limit)
        try:
            text = new.to_csv()
            digest = hashlib.sha256(text.encode()).hexdigest()
            digests = self._exchange(digest)
            if len(set(digests)) != 1:
                detail = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
                raise RuntimeError(f"zbpp.{name}: the ranks planned different {new.kind} schedules from the same "
                                   f"costs ({detail}); every rank must load the same zbpp library")
            mine = [s.stage_index for s in self.stages]
            if new.rank_stages(self.rank) != mine:
                raise RuntimeError(f"zbpp.{name}: the new plan puts stages {new.rank_stages(self.rank)} on rank "
                                   f"{self.rank}, which holds {mine}")
            sim = new.simulate()
            before = expected_new = expected_old = None
            if costs is not None:
                expected_new = costs.expected_bubble(plain)
                with Schedule.from_csv(self.schedule.to_csv(), times=costs.times(), comm=costs.time_comm,
                                       w_share=costs.w_share) as old:
                    before = old.simulate()
                    keeps = _keeps_in_force(old, new)
                    if self._offload_arg is not None and not _has_copies(old) and _has_copies(new):
                        keeps = False  # offload= asked for the copies; the plan in force has none
                    # (Of a plan with copies the measured op samples time the compute only.)
                    expected_old = None if _has_copies(old) else costs.expected_bubble(old)
        except BaseException:
            new.close()
            if plain is not new:
                plain.close()
            raise
        if plain is not new:
            plain.close()
        if only_if_faster and before is not None:
            room = max(sim.max_peak_memory, new.mem_limit or 0.0) + 1e-9
            if keeps and before.max_peak_memory <= room:
                # The plan in force is as good on the measured costs (within the margin): keep it.
                self.costs = costs
                self.plan_info = PlanInfo(step=self.steps, kind=label, mem_limit=new.mem_limit, costs=costs,
                                          simulated=before, before=before, measured_bubble=_measured,
                                          profile_steps=self._profile if _measured is not None else None,
                                          digest=hashlib.sha256(self.schedule.to_csv().encode()).hexdigest(),
                                          files=self._save_plan(costs, self.schedule), switched=False,
                                          candidate=sim, expected_bubble=expected_old)
                new.close()
                if self.rank == 0:
                    _log.info("%s", self.plan_info.summary())
                return self.plan_info
        self._switch_schedule(new)
        self.costs = costs
        moved = sum(op.type == "OFFLOAD" for r in range(new.ranks) for op in new.rank_ops(r))
        self.plan_info = PlanInfo(step=self.steps, kind=label, mem_limit=new.mem_limit, costs=costs,
                                  simulated=sim, before=before, measured_bubble=_measured,
                                  profile_steps=self._profile if _measured is not None else None,
                                  digest=digest, files=self._save_plan(costs, new), switched=True, candidate=sim,
                                  expected_bubble=expected_new, offloaded=moved,
                                  device_peak=max(new.rank_memory(r)[0] for r in range(new.ranks)) if moved else None)
        if self.rank == 0:
            _log.info("%s", self.plan_info.summary())
        return self.plan_info

    def _save_plan(self, costs, new):
        if not self._save_dir or self.rank != 0:
            return []
        os.makedirs(self._save_dir, exist_ok=True)
        files = []
        if costs is not None:
            files.append(costs.save(os.path.join(self._save_dir, "zbpp-costs.json")))
        for ext in ("csv", "svg"):
            path = os.path.join(self._save_dir, f"zbpp-plan-{new.kind}.{ext}")
            new.save(path)
            files.append(path)
        return files



def _announce(info, name, trial, fixed=False):
    """The first plan from measured costs this process switches to, in one line on stderr
    (_notice.py): what was planned, why, and the gain the simulation expects on those costs (for
    a fixed order with offload=, the copies placed into it)."""
    from .._notice import notice

    why = "its measured costs"
    if info.profile_steps:
        a, b = info.profile_steps
        why = f"the costs measured in steps {a}-{b}" if a != b else f"step {a}'s measured costs"
    moved = (f"; {info.offloaded} microbatch activations go to host memory a step, device peak "
             f"{info.device_peak:g} microbatches" if info.offloaded else "")
    if fixed:
        notice("replan", f"zbpp: {name} placed PipeOffload's copies into its {info.kind} order after step "
                         f"{info.step}, from the op and copy times measured in steps "
                         f"{info.profile_steps[0]}-{info.profile_steps[1]}{moved}; they run from the next step "
                         "(plan_info has the details; zbpp.quiet() or ZBPP_QUIET=1 silences this line)")
        return
    gain = ""
    if info.before is not None and info.before.cost > 0:
        gain = (f": the simulated step goes from {info.before.cost:.4g} to {info.simulated.cost:.4g} "
                f"({100 * (1 - info.simulated.cost / info.before.cost):.1f}% shorter)")
    then = (f"; it runs from the next step, and the old plan comes back if the next {TRIAL_STEPS} steps measure "
            f"more than {100 * REVERT_MARGIN:g}% slower" if trial else "; it runs from the next step")
    notice("replan", f"zbpp: {name} planned {info.kind} again after step {info.step} from {why}{gain}{moved}{then} "
                     "(plan_from_measured=False keeps the first plan; plan_info has the details; zbpp.quiet() or "
                     "ZBPP_QUIET=1 silences this line)")


class PlanInfo(NamedTuple):
    """What the last replan did: after `step` steps, `kind` was planned under mem_limit (microbatches,
    None for the kind's default) for `costs` (a StageCosts; None when planned without measured
    costs). `switched`: whether the schedule changed to the new plan (False: the plan in force was
    as fast on the measured costs, see replan's only_if_faster, and stays). `simulated` is the
    SimResult on those costs of the plan that runs from now on, `candidate` the new plan's,
    `before` the previous plan's; `measured_bubble` the median bubble rate measured over
    `profile_steps`; `digest` the SHA-256 of the op lists that run now (equal on every rank),
    `files` what save_plan_dir received. `expected_bubble`: the bubble the runner should measure
    for the plan that runs now (StageCosts.expected_bubble: the simulation with each op's measured
    runtime overhead counted as idle, as the runner's timestamps count it, and op times drawn from
    the measured ones); None without measured costs. `fused_steps`: the profiled steps that ran
    the plan in force with every backward fused (zb-auto's first, to measure a fused backward)."""

    step: int
    kind: str
    mem_limit: Optional[float]
    costs: Optional[StageCosts]
    simulated: SimResult
    before: Optional[SimResult]
    measured_bubble: Optional[float]
    profile_steps: Optional[tuple]
    digest: str
    files: list
    switched: bool = True
    candidate: Optional[SimResult] = None
    expected_bubble: Optional[float] = None
    reverted: bool = False
    measured_before: Optional[float] = None
    measured_after: Optional[float] = None
    fused_steps: tuple = ()  # profiled steps that ran the plan with every backward fused (fused_variant)
    # PipeOffload (offload=): microbatch activations the plan moves to host memory per step (all
    # ranks), and its largest device peak in microbatches (None without copies).
    offloaded: int = 0
    device_peak: Optional[float] = None

    def summary(self):
        text = f"zbpp: planned {self.kind} after step {self.step}"
        if self.profile_steps:
            a, b = self.profile_steps
            text += f" from the costs measured in steps {a}-{b}" if a != b else f" from step {a}'s measured costs"
        if self.mem_limit:
            text += f" (memory limit {self.mem_limit:g} microbatches)"
        if self.reverted:
            text += (f": went back to the plan in force before, since the new plan measured slower "
                     f"({self.measured_after:.1f} ms a step against {self.measured_before:.1f} ms)")
        elif not self.switched:
            text += (f": kept the plan in force, simulated bubble {100 * self.simulated.bubble_rate:.1f}% on these "
                     f"costs; the new plan would not be faster ({100 * self.candidate.bubble_rate:.1f}%)")
        else:
            text += f": simulated bubble {100 * self.simulated.bubble_rate:.1f}%"
            if self.simulated.idle_rate is not None:
                text += f" (idle {100 * self.simulated.idle_rate:.1f}% of all ranks' time over the step)"
        if self.expected_bubble is not None:
            text += f", {100 * self.expected_bubble:.1f}% expected as measured (runtime overhead idle, measured op-time spread)"
        if self.before is not None and self.switched:
            text += f" (the previous plan: {100 * self.before.bubble_rate:.1f}% on the same costs"
            text += (f", measured {100 * self.measured_bubble:.1f}%)" if self.measured_bubble is not None else ")")
        if self.offloaded:
            text += (f"; {self.offloaded} microbatch activations offloaded a step, device peak "
                     f"{self.device_peak:g} microbatches")
        if self.costs is not None:
            c = self.costs
            bw = c.time_bw
            text += ("; F/B/W" + ("/BW" if bw else "") + " per stage (ms): " + ", ".join(
                f"{c.time_f[s]:.2f}/{c.time_b[s]:.2f}/{c.time_w[s]:.2f}" + (f"/{bw[s]:.2f}" if bw else "")
                for s in range(c.stages)) + f"; T_comm {c.time_comm:.3f} ms, w_share {c.w_share:.2f}")
        return text


def refined(plan):
    """The plan, refined (Schedule.refine, ~100 ms once) where its kind is a memory-tight V kind: a
    run's plan is worth a search that a schedule drawn on the command line skips."""
    if plan.kind not in ("v-half", "v-min"):
        return plan
    try:
        return plan.refine()
    finally:
        plan.close()


def _rank_span(starts, ends):
    """A rank's span in one step (its first op's start to its last op's end, ms; its own clock)."""
    return (max(ends) - min(starts)) if starts else 0.0


def _profile_window(name, plan_kind, kind, plan_from_measured, profile_steps, times, costs):
    """(first, last) profiled step, or None when the schedule is not planned from measured costs."""
    if plan_from_measured is None:
        env = os.environ.get("ZBPP_PLAN_FROM_MEASURED", "").strip().lower()
        on = env not in ("0", "false", "no", "off") if env else (times is None and costs is None)
        on = on and plan_kind is not None
    else:
        on = bool(plan_from_measured)
        if on and plan_kind is None:
            raise ValueError(f"zbpp.{name}: plan_from_measured=True, but {kind} is a fixed order that measured costs "
                             "do not change; it applies to " + ", ".join(PLANNED_KINDS) + ", and to a fixed order "
                             "with offload= and neither times= nor costs= (its copies are placed from them)")
    if profile_steps is None:
        window = DEFAULT_PROFILE_STEPS
    elif profile_steps is False or (isinstance(profile_steps, int) and profile_steps == 0):
        return None
    elif isinstance(profile_steps, int) and not isinstance(profile_steps, bool) and profile_steps > 0:
        window = (2, 1 + profile_steps)
    elif (isinstance(profile_steps, (tuple, list)) and len(profile_steps) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in profile_steps)
          and 1 <= profile_steps[0] <= profile_steps[1]):
        window = tuple(profile_steps)
    else:
        raise ValueError(f"zbpp.{name}: profile_steps must be (first, last) steps counted from 1 with "
                         f"1 <= first <= last, a number n of steps (2..n+1), or 0 for none; got {profile_steps!r}")
    return window if on else None
