#!/usr/bin/env python3
"""bench_synthetic.py - pipeline schedules on stages whose F, B and W take given times, run through
torch.distributed.pipelining and through zbpp.pipelining by the same code, only the import differing.

What this is: every stage sleeps a fixed time in its forward (F), its input-gradient backward (B)
and its weight-gradient backward (W). Sleeping leaves the GIL and the cores free, so 2 to 8 ranks
fit on a 2-core machine and a step's time shows only the schedule and the runtime's own cost. Each
stage is

    out = SleepFB(x * scale) + SleepW(w)

SleepFB is an autograd Function that takes F in its forward and B in its backward and passes its
input and gradient through; SleepW is a Function of the parameter w alone whose forward returns
zeros (no sleep) and whose backward takes W and gives w the sum of the output gradient. "Takes"
means: the wait ends F after the stage's forward began (B and W after their Functions' backward
began), sleeping until 0.3 ms before and spinning the rest (wait_until), so the kernel's wake-up
latency (50-150 us per sleep here, 2-4% of a 4 ms op) is not counted as the op's; both imports
alike. SleepW's
node lies only on the parameters' side of the graph, so a backward split as torch's zero-bubble
classes split it (torch/distributed/pipelining/_backward.py: stage_backward_input differentiates
w.r.t. the stage's inputs only, stage_backward_weight finishes the parameters from the saved
intermediates) runs it in W, and a full backward runs it in B. `x * scale` is a real computation
with a parameter, so gradients can be checked. As torch does, a first stage (whose input needs no
gradient) gets no B: torch runs its whole backward, B's sleep included, at its W. The preflight
(printed first) measures one stage's F, B and W through torch's own split functions.

The script side is written against torch's public API only (PipelineStage, the schedule classes,
get_schedule_class for zbpp's kinds, step); `pp` is `torch.distributed.pipelining` or
`zbpp.pipelining`, nothing else differs. Configurations, per (p, m, costs) cell:
  - every torch class from both imports: Schedule1F1B, ScheduleGPipe (one stage per rank),
    ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble (two per rank in a
    loop: r and r+p), ScheduleZBVZeroBubble, ScheduleDualPipeV (two per rank in a V: r and 2p-1-r);
  - zbpp's own kinds: zb-h1, zb-h2 (one stage per rank), zb-v, v-half, v-min (V), zb-auto at memory
    limits p and 2p (one stage per rank; the paper's ZB-1p and ZB-2p).
zbpp plans its zero-bubble kinds again from the costs it measures in steps 2-3 (its default);
nothing here tells it the costs.

Costs, per microbatch through one rank's layers (a stage of a rank with v stages takes 1/v):
  equal     F = B = W = --equal-ms (8 ms)
  1.5B, 6.2B, 14.6B, 28.3B   the Zero Bubble paper's profiled T_F/T_B/T_W in ms (Qi et al., ICLR
            2024; the numbers benchmarks/compare_reference.py carries), times --paper-scale. T_comm
            is not emulated: transfers are the runtimes' real ones (tiny tensors over gloo).
  lm-head   equal, with the last stage twice as heavy (F, B and W), as a language model's head.
  custom:F/B/W   the given ms, such as custom:10/10/5.

Correctness first: step 1 of every configuration is compared with a sequential loop over the same
stages in one process (each microbatch forward and backward in turn, gradients divided by m): the
losses and the gradients of scale and w of every stage must be equal (torch.equal; inputs, targets
and scales are small integers and powers of two, so every sum is exact in any order and a W that
ran twice, never, or into the wrong stage shows). A mismatch stops the run before anything is timed.

Every process sets its timer slack to 1 ns (prctl PR_SET_TIMERSLACK, Linux; --timer-slack-ns,
0 leaves the default 50 us) before anything is timed, both imports alike: every op is a sleep,
and the default slack lets the kernel wake it up to 50 us late.

Timing: after --warmup steps (step 1 checked; zbpp's replan after step 3), --reps repetitions; each
runs every configuration of the cell for --steps steps, one configuration later each repetition,
so the noise of a shared machine hits all alike. A step is timed from a barrier of its ranks to the
end of step() and counts as its slowest rank's time. Per configuration the table gives:
  step     the median step over all timed steps (ms), and the fastest and slowest repetition's mean
  plan     the simulated makespan of the configuration's own op order (its pipeline_order, after
           zbpp's replan, as torch exposes it for every class) on the cell's costs as the stages
           really have them (the first stage's B runs at its W: B = 0, W = B + W), by zbpp's
           simulator: what the order takes with no runtime cost at all (transfers free), end to
           end (the first op's start to the last op's end over all ranks, as the step is timed;
           not zbpp's schedule cost, the largest single rank's span, which leaves out the later
           ranks' staggered starts: p - 1 forwards)
  eff      plan / step: the share of the step the order explains
  replay   the same op order simulated with each op's measured duration instead (median of each
           op over --record-steps extra recorded steps; zbpp's from schedule.timeline(), torch's
           from its stages' *_one_chunk calls, wrapped), transfers free
  runtime eff   replay / step: the share left after the runtime's own cost between ops (waiting
           on transfers, scheduling, bookkeeping outside the ops); plan / replay is what the ops
           themselves lost (sleeps waking late, per-op work inside the stage calls)
  vs 1F1B  torch Schedule1F1B's step / this one's, median over the repetitions of the ratio within
           each (above 1: faster)
  vs torch for zbpp's import of a torch class: torch's same class / zbpp's, as above
  W/op     the measured mean time of a W op in the recorded steps (-: W ran inside B, or none)
One configuration's measured timeline (the last recorded step) is written as SVG, above it the plan.
A second table covers the configurations that replanned from measured costs (zbpp's planned kinds,
and its ScheduleZBVZeroBubble / ScheduleInterleavedZeroBubble): the median step before the replan
(the profiled steps, less the last one, at whose end the replan runs; its time is shown apart),
the median after (the timed steps), and whether the replan switched plans.

--stability N runs one configuration (one p, m and costs; --classes one name) N times, each a
separate launch of its processes, and reports each launch's steps before and after its replan
and the spread of the post-replan medians (issue 25's target: within 3% of each other).

What this is not: a test (the suite checks correctness; this refuses only to time wrong training),
or a measure of compute kernels (nothing computes).

Usage:
  ZBPP_BUILD_DIR=build .venv/bin/python benchmarks/bench_synthetic.py [--p 2,4,8] [--m 2p,4p]
      [--costs equal,paper,lm-head] [--classes NAMES] [--impl both|torch|zbpp] [--reps R] [--steps K]
      [--warmup W] [--quick] [--check-only] [--out DIR] [--json FILE] [--svg-config LABEL]
      [--stability N] [--record-steps K] [--timer-slack-ns NS]
Defaults: every p, m, cost and class (hours on 2 cores: pick subsets); --quick: p 4, m 8, equal
costs, every class, 3 repetitions of 1 step (a couple of minutes). The table goes to stdout and to
DIR/table.md, the timeline to DIR/timeline.svg; progress to stderr.
Exit status: 0 done, 1 a check failed or a process failed or timed out, 2 a usage error.
"""

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYTHON_SRC = os.path.join(_REPO, "bindings", "python")
if _PYTHON_SRC not in sys.path:
    sys.path.insert(0, _PYTHON_SRC)
if os.environ.get("ZBPP_BUILD_DIR") and not os.environ.get("ZBPP_LIBRARY"):
    os.environ["ZBPP_LIBRARY"] = os.path.join(os.path.abspath(os.environ["ZBPP_BUILD_DIR"]), "libzbpp.so")

import torch  # noqa: E402  - before zbpp loads its library (DESIGN.md section 5)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its helper modules, when imported
from bench_synthetic_report import (  # noqa: E402
    BASELINE, label, replan_table, stability_table, table, timeline_svg)
from bench_synthetic_timing import (  # noqa: E402
    measured_timeline, op_means, replay, set_timer_slack, simulated_plan, stage_op_means)

IMPORTS = {"torch": "torch.distributed.pipelining", "zbpp": "zbpp.pipelining"}
# torch's classes: name -> placement (one stage per rank, two in a loop, two in a V).
TORCH_CLASSES = {"Schedule1F1B": "one", "ScheduleGPipe": "one", "ScheduleInterleaved1F1B": "loop",
                 "ScheduleLoopedBFS": "loop", "ScheduleInterleavedZeroBubble": "loop",
                 "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}
# zbpp's own kinds (zbpp import only): name -> (kind for get_schedule_class, placement, mem_limit).
ZBPP_KINDS = {"zb-h1": ("zb-h1", "one", None), "zb-h2": ("zb-h2", "one", None), "zb-v": ("zb-v", "v", None),
              "v-half": ("v-half", "v", None), "v-min": ("v-min", "v", None),
              "zb-auto@p": ("zb-auto", "one", "p"), "zb-auto@2p": ("zb-auto", "one", "2p")}
# The Zero Bubble paper's profiled T_F, T_B, T_W (ms per microbatch through a rank's layers).
PAPER = {"1.5B": (18.522, 18.086, 9.337), "6.2B": (29.718, 29.468, 19.927),
         "14.6B": (11.347, 11.248, 8.132), "28.3B": (10.419, 10.207, 7.715)}
COSTS = ("equal", *PAPER, "lm-head")
MB_ROWS, WIDTH = 2, 4  # a microbatch is MB_ROWS x WIDTH small integers


def log(msg):
    print(f"[bench_synthetic] {msg}", file=sys.stderr, flush=True)


# ---- the sleeping stage ------------------------------------------------------------------------------

SPIN_S = 3e-4  # the end of every wait is spun, not slept: a sleep wakes 50-150 us late here


def wait_until(deadline):
    """Returns at `deadline` (time.perf_counter), sleeping until shortly before it and spinning the
    rest: an op's own time is then what the configuration says, not that plus the kernel's
    wake-up latency (which, at 4 ms ops, was 2-4% of every op)."""
    left = deadline - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class SleepFB(torch.autograd.Function):
    """Identity that takes f seconds in its forward (counted from `start`, the stage's entry) and b
    in its backward (the input's side)."""

    @staticmethod
    def forward(ctx, x, f, b, start):
        ctx.b = b
        out = x.clone()
        wait_until(start + f)
        return out

    @staticmethod
    def backward(ctx, grad):
        wait_until(time.perf_counter() + ctx.b)
        return grad, None, None, None


class SleepW(torch.autograd.Function):
    """Zeros of `shape` from the parameter w alone (no sleep); its backward sleeps w_s seconds and
    gives w the sum of the output gradient. Its node hangs off the parameter only, so a split
    backward runs it at W and a full backward at B."""

    @staticmethod
    def forward(ctx, w, shape, w_s):
        ctx.w_s, ctx.w_shape = w_s, w.shape
        return w.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        out = grad.sum().reshape(ctx.w_shape)
        wait_until(start + ctx.w_s)
        return out, None, None


class SleepStage(torch.nn.Module):
    """One stage: out = SleepFB(x * scale) + SleepW(w), times in seconds. scale is a power of two
    (2 on even stages, 1/2 on odd ones) so every product and sum stays exact."""

    def __init__(self, index, f, b, w):
        super().__init__()
        self.f, self.b, self.w_s = f, b, w
        self.scale = torch.nn.Parameter(torch.tensor(2.0 if index % 2 == 0 else 0.5))
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        start = time.perf_counter()
        h = SleepFB.apply(x * self.scale, self.f, self.b, start)
        return h + SleepW.apply(self.w, h.shape, self.w_s)


def loss_fn(out, target):
    return (out * target).sum()


def batch(m):
    """The step's input and target: small integers, the same every step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (m * MB_ROWS, WIDTH), generator=g).float()
    y = torch.randint(-2, 3, (m * MB_ROWS, WIDTH), generator=g).float()
    return x, y


# ---- configurations and costs ------------------------------------------------------------------------

def placement_of(impl, name):
    return TORCH_CLASSES[name] if name in TORCH_CLASSES else ZBPP_KINDS[name][1]


def stage_ids(placement, rank, p):
    if placement == "one":
        return [rank]
    return [rank, rank + p] if placement == "loop" else [rank, 2 * p - 1 - rank]


def parse_custom(cost):
    """(F, B, W) in ms of a 'custom:F/B/W' setting; ValueError saying what is allowed."""
    parts = cost[len("custom:"):].split("/")
    try:
        vals = tuple(float(x) for x in parts)
    except ValueError:
        vals = ()
    if len(vals) != 3 or any(not v > 0 for v in vals):
        raise ValueError(f"{cost!r}: a custom setting is custom:F/B/W with three positive times in ms, "
                         "such as custom:10/10/5")
    return vals


def stage_times(cost, p, v, args):
    """Per-stage (F, B, W) in ms for S = p * v stages: the rank's costs divided by v."""
    if cost in PAPER:
        f, b, w = (t * args.paper_scale for t in PAPER[cost])
    elif cost.startswith("custom:"):
        f, b, w = parse_custom(cost)
    else:
        f = b = w = args.equal_ms
    times = [(f / v, b / v, w / v)] * (p * v)
    if cost == "lm-head":
        times[-1] = tuple(2 * t for t in times[-1])
    return times


class Config:
    """One configuration on this rank: its stages, schedule and process group, built with pp's
    public API only (pp: torch.distributed.pipelining or zbpp.pipelining)."""

    def __init__(self, impl, name, rank, p, m, cost, args):
        import torch.distributed as dist

        self.impl, self.name, self.label = impl, name, label(impl, name)
        self.rank, self.p, self.m = rank, p, m
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
        placement = self.placement = placement_of(impl, name)
        v = self.v = 1 if placement == "one" else 2
        S = self.S = p * v
        self.times_ms = stage_times(cost, p, v, args)
        self.ids = stage_ids(placement, rank, p)
        self.modules = {s: SleepStage(s, *(t / 1e3 for t in self.times_ms[s])) for s in self.ids}
        self.holds_first, self.holds_loss = 0 in self.ids, S - 1 in self.ids
        self.sched, self.error = None, None
        # ---- the script: only pp differs ----
        pp = importlib.import_module(IMPORTS[impl])
        stages = [pp.PipelineStage(self.modules[s], s, S, torch.device("cpu"), group=self.group) for s in self.ids]
        if name in TORCH_CLASSES:
            cls, extra = getattr(pp, name), {}
        else:
            kind, _, limit = ZBPP_KINDS[name]
            cls, extra = pp.get_schedule_class(kind), ({"mem_limit": limit} if limit else {})
        single = name in ("Schedule1F1B", "ScheduleGPipe")
        refusals = (ValueError, RuntimeError, NotImplementedError)
        if impl == "zbpp":
            from zbpp import ZbError

            refusals += (ZbError,)
        try:
            self.sched = cls(stages[0] if single else stages, m, loss_fn=loss_fn, **extra)
        except refusals as exc:  # a class that refuses this p and m: reported, not run
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        self.stages = stages
        self.x, self.y = batch(m)
        self.recorder = None

    def step(self):
        """One pipeline step on this rank; the losses on the loss stage's rank."""
        losses = [] if self.holds_loss else None
        args = (self.x,) if self.holds_first else ()
        kwargs = {"target": self.y, "losses": losses} if self.holds_loss else {}
        self.sched.step(*args, **kwargs)
        return losses

    def zero_grad(self):
        for mod in self.modules.values():
            for prm in mod.parameters():
                prm.grad = None

    def timed_step(self):
        import torch.distributed as dist

        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        self.step()
        dt = time.perf_counter() - t0
        self.zero_grad()
        return dt

    def close(self):
        import torch.distributed as dist

        close = getattr(self.sched, "close", None)
        if close is not None:
            close()
        dist.destroy_process_group(self.group)


# ---- the sequential loop and the step-1 check -------------------------------------------------------

def reference(S, m):
    """Losses and gradients ({stage: {name: tensor}}) of one step of the S stages in this process,
    microbatch after microbatch, gradients divided by m as the schedules' scale_grads does."""
    mods = [SleepStage(s, 0.0, 0.0, 0.0) for s in range(S)]
    x, y = batch(m)
    losses = []
    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        h = xi
        for mod in mods:
            h = mod(h)
        loss = loss_fn(h, yi)
        loss.backward()
        losses.append(loss.detach())
    grads = {s: {n: prm.grad / m for n, prm in mod.named_parameters()} for s, mod in enumerate(mods)}
    return torch.stack(losses), grads


def check(cfg, losses, ref):
    """(ok, message, {what: [got, want]}) of this rank's step 1 against the loop."""
    ref_losses, ref_grads = ref
    seen, bad = {}, None
    if losses is not None:
        got = torch.stack([t.detach().reshape(()) for t in losses])
        seen["losses"] = [got.tolist(), ref_losses.tolist()]
        if not torch.equal(got, ref_losses):
            bad = f"{cfg.label}: step-1 losses {got.tolist()} differ from the loop's {ref_losses.tolist()}"
    for s, mod in cfg.modules.items():
        for n, prm in mod.named_parameters():
            want = ref_grads[s][n]
            seen[f"stage {s} {n}"] = [None if prm.grad is None else prm.grad.item(), want.item()]
            if bad is None and (prm.grad is None or not torch.equal(prm.grad, want)):
                bad = (f"{cfg.label}: stage {s} gradient of {n} is "
                       f"{None if prm.grad is None else prm.grad.item()} after step 1; the loop's is {want.item()}")
    return bad is None, bad, seen


# ---- one process: every cell of its p ----------------------------------------------------------------

def worker(rank, p, cells, names, args, tmp):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, f"store-p{p}"), rank=rank,
                            world_size=p, timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)
    slack = set_timer_slack(args.timer_slack_ns) if args.timer_slack_ns > 0 else "timer slack left at the default"
    say = log if rank == 0 else (lambda msg: None)
    say(f"p={p}: {slack}")
    try:
        for k, (m, cost) in enumerate(cells):
            t_cell = time.perf_counter()
            cfgs = [Config(impl, name, rank, p, m, cost, args) for impl, name in names]
            try:
                result = run_cell(cfgs, rank, p, m, cost, args, say)
            finally:
                for cfg in cfgs:
                    cfg.close()
            if rank == 0:
                result["timer_slack"] = slack
                with open(os.path.join(tmp, f"cell-p{p}-{k}.json"), "w") as f:
                    json.dump(result, f)
            if result.get("failed"):
                return
            say(f"p={p} m={m} {cost}: done in {time.perf_counter() - t_cell:.0f} s")
        dist.barrier()
    except BaseException:
        with open(os.path.join(tmp, f"error-p{p}-rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_cell(cfgs, rank, p, m, cost, args, say):
    import torch.distributed as dist

    cell = {"p": p, "m": m, "cost": cost, "configs": []}
    refused = [None] * p
    dist.all_gather_object(refused, [c.error for c in cfgs])
    live = [c for c, *errs in zip(cfgs, *refused) if not any(errs)]
    for c, *errs in zip(cfgs, *refused):
        if any(errs):
            say(f"p={p} m={m} {cost}: {c.label} not run: {next(e for e in errs if e)}")
            cell["configs"].append({"label": c.label, "impl": c.impl, "name": c.name,
                                    "skipped": next(e for e in errs if e)})
    # 1. Step 1 of every configuration against the sequential loop.
    refs, checks = {}, {}
    for c in live:
        ref = refs.setdefault(c.S, reference(c.S, m))
        dist.barrier(group=c.group)
        losses = c.step()
        ok, text, seen = check(c, losses, ref)
        got = [None] * p
        dist.all_gather_object(got, (ok, text, seen), group=c.group)
        merged = {k: v for _, _, s in got for k, v in s.items()}
        checks[c.label] = merged
        c.zero_grad()
        bad = [t for o, t, _ in got if not o]
        if bad:
            say("CHECK FAILED: " + bad[0])
            cell.update(failed=bad[0], checks=checks)
            return cell
        say(f"check {c.label} (p={p} m={m} {cost}): step 1 equals the loop")
    cell["checks"] = checks
    if args.check_only:
        return cell
    # 2. Warm-up, steps 2..warmup, timed for the replan table: zbpp profiles steps 2-3 and
    # replans at the end of step 3.
    warm = {c.label: [c.timed_step() for _ in range(args.warmup - 1)] for c in live}
    # 3. Timing, interleaved.
    records = {c.label: [] for c in live}
    n = len(live)
    for rep in range(args.reps):
        for j in range(n):
            c = live[(rep + j) % n]
            for _ in range(args.steps):
                records[c.label].append((rep, c.timed_step()))
    gathered = [None] * p
    dist.all_gather_object(gathered, (records, warm))
    # 4. Recorded steps: the measured timeline and op times; the plan and the replay of each order.
    timelines = {c.label: measured_timeline(c, args.record_steps) for c in live}
    if rank != 0:
        return cell
    for c in live:
        steps = [max(g[c.label][k][1] for g, _ in gathered) * 1e3 for k in range(len(records[c.label]))]
        warm_ms = [max(w[c.label][k] for _, w in gathered) * 1e3 for k in range(args.warmup - 1)]
        reps = {}
        for (rep, _), ms in zip(records[c.label], steps):
            reps.setdefault(rep, []).append(ms)
        tl, durations = timelines[c.label]
        plan, source = simulated_plan(c, tl)
        entry = {"label": c.label, "impl": c.impl, "name": c.name, "stages_per_rank": c.v,
                 "step_ms": steps, "rep_ms": [statistics.fmean(v) for _, v in sorted(reps.items())],
                 "median_ms": statistics.median(steps), "warmup_ms": warm_ms, "plan_ms": plan.makespan(),
                 "replay_ms": replay(c, tl, durations), "plan_source": source, "op_means_ms": op_means(tl),
                 "stage_op_ms": stage_op_means(tl, durations), "measured_span_ms": tl.measured.cost,
                 "plan_svg": plan.to_svg(), "timeline_svg": tl.to_svg()}
        info = getattr(c.sched, "plan_info", None)
        if info is not None:
            entry["replan"] = replan_figures(info, warm_ms, entry["median_ms"])
        cell["configs"].append(entry)
        tl.close()
        plan.close()
    return cell


def replan_figures(info, warm_ms, after_ms):
    """The replan table's figures from zbpp's PlanInfo and the warm-up steps (warm_ms[k] is step
    k + 2): the median of the profiled steps before the one the replan ran at the end of (not a
    step that ran the plan fused: None when no other is left), that step, and the median step
    after (the timed steps)."""
    a, b = info.profile_steps or (info.step, info.step)
    step_ms = {k + 2: ms for k, ms in enumerate(warm_ms)}
    # A step that ran the plan fused (zb-auto's first profiled step) is not the plan in force.
    fused = set(getattr(info, "fused_steps", ()) or ())
    before = [step_ms[k] for k in range(a, b) if k in step_ms and k not in fused]
    return {"summary": info.summary(), "profile_steps": [a, b], "step": info.step, "switched": bool(info.switched),
            "digest": info.digest,
            "before_ms": statistics.median(before) if before else None, "replan_step_ms": step_ms.get(info.step),
            "after_ms": after_ms, "simulated_ms": info.simulated.cost,
            "simulated_before_ms": (info.before.cost if info.before is not None
                                    else None if info.switched else info.simulated.cost)}


# ---- the command line --------------------------------------------------------------------------------

def _list(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="bench_synthetic.py",
        description="Schedules on stages that sleep fixed F, B and W times, through torch.distributed.pipelining "
                    "and zbpp.pipelining (same script, only the import differs); step 1 of each is checked "
                    "against a sequential loop before anything is timed.")
    ap.add_argument("--p", default="2,4,8", help="pipeline ranks (processes), comma-separated (default 2,4,8)")
    ap.add_argument("--m", default="2p,4p", help="microbatches: numbers or multiples of p such as 2p (default 2p,4p)")
    ap.add_argument("--costs", default=",".join(COSTS),
                    help=f"cost settings among {', '.join(COSTS)}, 'paper' for the four paper ones and custom:F/B/W "
                         "in ms such as custom:10/10/5 (default all but custom)")
    ap.add_argument("--classes", default=None,
                    help="configurations: torch class names (" + ", ".join(TORCH_CLASSES) + ") and zbpp kinds ("
                    + ", ".join(ZBPP_KINDS) + "); default all. torch Schedule1F1B always runs as the baseline.")
    ap.add_argument("--impl", default="both", choices=("both", "torch", "zbpp"),
                    help="which import runs torch's classes (default both); zbpp's kinds run through zbpp")
    ap.add_argument("--equal-ms", type=float, default=8.0, help="F = B = W of the equal costs, ms (default 8)")
    ap.add_argument("--paper-scale", type=float, default=1.0, help="factor on the paper's ms (default 1)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7; --quick 3)")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration per repetition (default 2; "
                    "--quick 1)")
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing, step 1 included (default 5)")
    ap.add_argument("--quick", action="store_true", help="p 4, m 8, equal costs, 3 repetitions of 1 step")
    ap.add_argument("--check-only", action="store_true", help="step 1 against the loop only, no timing")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may take (default 120)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds the whole run may take before its processes are killed (default 4 h; --quick "
                         "and --check-only 10 min)")
    ap.add_argument("--out", default=None, help="folder for table.md and timeline.svg (default a new temporary one)")
    ap.add_argument("--json", default=None, help="also write every figure as JSON there")
    ap.add_argument("--stability", type=int, default=None, metavar="N",
                    help="run the one configuration given (one --p, --m, --costs; --classes one name, without the "
                         "torch Schedule1F1B baseline) N times as separate launches and report the spread of the "
                         "post-replan medians")
    ap.add_argument("--record-steps", type=int, default=3,
                    help="recorded steps after the timing, for the timeline, W/op and the replay (default 3)")
    ap.add_argument("--timer-slack-ns", type=int, default=1,
                    help="timer slack of every process, ns (prctl PR_SET_TIMERSLACK; default 1; 0 leaves the "
                         "kernel's default, 50 us)")
    ap.add_argument("--svg-config", default=None,
                    help="the configuration whose measured timeline is drawn (default 'zbpp zb-v', else the first)")
    args = ap.parse_args(argv)
    if args.quick:
        args.p, args.m, args.costs = "4", "8", "equal"
        args.reps = 3 if args.reps is None else args.reps
        args.steps = 1 if args.steps is None else args.steps
    args.reps = 7 if args.reps is None else args.reps
    args.steps = 2 if args.steps is None else args.steps
    if args.deadline is None:
        args.deadline = 600.0 if args.quick or args.check_only else 4 * 3600.0
    try:
        args.ps = [int(x) for x in _list(args.p)]
    except ValueError:
        ap.error(f"--p takes whole numbers such as 2,4,8, got {args.p!r}")
    if not args.ps or any(x < 2 for x in args.ps):
        ap.error(f"--p needs numbers of ranks >= 2, got {args.p!r}")
    for item in _list(args.m):
        text = item[:-1] if item.endswith("p") else item
        if not text.isdigit() and text != "":
            ap.error(f"--m takes numbers or multiples of p such as 2p or 16, got {item!r}")
    costs = []
    for item in _list(args.costs):
        if item == "paper":
            costs.extend(PAPER)
        elif item in COSTS:
            costs.append(item)
        elif item.startswith("custom:"):
            try:
                parse_custom(item)
            except ValueError as exc:
                ap.error(f"--costs: {exc}")
            costs.append(item)
        else:
            ap.error(f"--costs: unknown setting {item!r}; choose among {', '.join(COSTS)}, paper and custom:F/B/W "
                     "(ms, such as custom:10/10/5)")
    args.cost_list = list(dict.fromkeys(costs))
    names = list(TORCH_CLASSES) + list(ZBPP_KINDS) if args.classes is None else _list(args.classes)
    for n in names:
        if n not in TORCH_CLASSES and n not in ZBPP_KINDS:
            ap.error(f"--classes: unknown {n!r}; torch classes: {', '.join(TORCH_CLASSES)}; zbpp kinds: "
                     f"{', '.join(ZBPP_KINDS)}")
    impls = ("torch", "zbpp") if args.impl == "both" else (args.impl,)
    if args.classes is not None and "zbpp" not in impls and any(n in ZBPP_KINDS for n in names):
        ap.error("--classes names zbpp kinds, which run through zbpp only; use --impl zbpp or both")
    configs = [BASELINE] if "torch" in impls and args.stability is None else []
    args.not_run = []
    for n in names:
        for impl in (impls if n in TORCH_CLASSES else ("zbpp",) if "zbpp" in impls else ()):
            why = torch_cannot_run(impl, n)
            if why:
                if why not in args.not_run:
                    args.not_run.append(why)
                    log(f"not run: {why}")
            elif (impl, n) not in configs:
                configs.append((impl, n))
    if not configs:
        ap.error("no configuration to run: zbpp's kinds need --impl zbpp or both")
    args.configs = configs
    for x in (args.reps, args.steps, args.warmup, args.record_steps):
        if x < 1:
            ap.error("--reps, --steps, --warmup and --record-steps must be >= 1")
    if args.timer_slack_ns < 0:
        ap.error(f"--timer-slack-ns must be >= 0 (0: the kernel's default), got {args.timer_slack_ns}")
    if args.stability is not None:
        if args.stability < 2:
            ap.error(f"--stability needs at least 2 launches to compare, got {args.stability}")
        if args.check_only:
            ap.error("--stability times launches; it does not go with --check-only")
        n_m = len(_list(args.m))
        if len(args.ps) != 1 or n_m != 1 or len(args.cost_list) != 1 or len(configs) != 1:
            ap.error(f"--stability runs one configuration: give one --p, one --m, one --costs and --classes one "
                     f"name (got p {args.p!r}, m {args.m!r}, costs {args.costs!r}, "
                     f"{len(configs)} configurations: {', '.join(label(*c) for c in configs)})")
    if args.warmup < 4 and not args.check_only:
        log("note: zbpp replans after step 3; with --warmup < 4 the first timed steps run the plan before it")
    return args


def torch_cannot_run(impl, name):
    """Why torch's own `name` cannot run here, or None. torch 2.12 and older (2.11 is the lent GPU
    machine's) send between two neighbouring stages of one rank through the process group, and
    gloo refuses to send to itself: every V placement has such a pair at its bottom, so the whole
    launch would fail. torch 2.13 hands them over in memory."""
    from zbpp._ops import _torch_version

    if impl == "torch" and placement_of(impl, name) == "v" and _torch_version() < (2, 13):
        return (f"torch {name}: torch {torch.__version__}'s own V classes send between a rank's two "
                "neighbouring stages through gloo, which refuses (torch 2.13 hands them over in memory)")
    return None


def m_values(spec, p):
    return list(dict.fromkeys(int(x[:-1] or 1) * p if x.endswith("p") else int(x) for x in _list(spec)))


def preflight(args):
    """One stage (index 1 of 3, so its input needs a gradient) through torch's own split backward:
    the measured F, B and W against the intended ones."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    f = b = w = args.equal_ms
    mod = SleepStage(1, f / 1e3, 2 * b / 1e3, 3 * w / 1e3)
    got = {"F": [], "B": [], "W": []}
    for _ in range(3):
        x = torch.ones(MB_ROWS, WIDTH, requires_grad=True)
        t0 = time.perf_counter()
        out = mod(x)
        t1 = time.perf_counter()
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], mod.parameters())
        t2 = time.perf_counter()
        stage_backward_weight(mod.parameters(), groups)
        t3 = time.perf_counter()
        for k, a, e in (("F", t0, t1), ("B", t1, t2), ("W", t2, t3)):
            got[k].append(1e3 * (e - a))
    text = ", ".join(f"{k} {statistics.median(v):.2f} ms (intended {want:g})"
                     for (k, v), want in zip(got.items(), (f, 2 * b, 3 * w)))
    log(f"preflight, one stage through torch's stage_backward_input/stage_backward_weight: {text}")
    return got


def launch(p, todo, names, args, t0):
    """One launch of p processes over the cells `todo` ([(m, cost)]): (cells, failure text or
    None). Each launch gets its own folder, so its rendezvous file is new."""
    import torch.multiprocessing as mp

    cells = []
    with tempfile.TemporaryDirectory(prefix="bench_synthetic-") as tmp:
        ctx = mp.start_processes(worker, args=(p, todo, names, args, tmp), nprocs=p, join=False, start_method="spawn")
        failure = None
        try:
            while not ctx.join(timeout=2):
                if time.time() - t0 > args.deadline:
                    failure = f"the run passed --deadline {args.deadline:g} s"
                    break
        except Exception as exc:  # noqa: BLE001 - a process failed: say which and why below
            failure = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if failure:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
            for r in range(p):
                path = os.path.join(tmp, f"error-p{p}-rank{r}.txt")
                if os.path.exists(path):
                    with open(path) as f:
                        log(f"p={p} rank {r} failed:\n{f.read()}")
        for k in range(len(todo)):
            path = os.path.join(tmp, f"cell-p{p}-{k}.json")
            if os.path.exists(path):
                with open(path) as f:
                    cells.append(json.load(f))
    return cells, failure


def main(argv=None):
    args = parse_args(argv)
    slack = set_timer_slack(args.timer_slack_ns) if args.timer_slack_ns > 0 else "timer slack left at the default"
    preflight(args)
    out = args.out or tempfile.mkdtemp(prefix="bench_synthetic-")
    os.makedirs(out, exist_ok=True)
    names = args.configs
    log(f"p {args.ps}, m {args.m}, costs {args.cost_list}; {len(names)} configurations per cell; "
        f"warm-up {args.warmup}, {args.reps} repetitions x {args.steps} steps"
        + (f"; {args.stability} separate launches" if args.stability else "")
        + f"; {slack}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    t0 = time.time()
    cells = []
    runs = [(p, None) for p in args.ps] if args.stability is None else [(args.ps[0], k) for k in range(args.stability)]
    for p, k in runs:
        if k is not None:
            log(f"launch {k + 1} of {args.stability}; load average {os.getloadavg()[0]:.1f}")
        todo = [(m, cost) for m in m_values(args.m, p) for cost in args.cost_list]
        got, failure = launch(p, todo, names, args, t0)
        for cell in got:
            cell["load_average"] = os.getloadavg()
            if k is not None:
                cell["launch"] = k + 1
        cells.extend(got)
        failed = [c["failed"] for c in cells if c.get("failed")]
        if failure or failed:
            log("aborted: " + (failed[0] if failed else failure))
            write_results(args, cells, out, time.time() - t0)
            return 1
    write_results(args, cells, out, time.time() - t0)
    return 0


def _tree_state():
    """The commit run and the files of zbpp's Python package changed from it (other work in the
    tree changes what zbpp does), for the JSON."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", "-C", _REPO, *cmd], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "bindings", "csrc", "include").splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "changed": changed} if commit else None  # None: not a git checkout


def write_results(args, cells, out, seconds):
    timed = [c for c in cells if not c.get("failed") and not args.check_only]
    if timed:
        slack = sorted({c.get("timer_slack", "?") for c in timed})
        parts = [table(timed) if args.stability is None else stability_table(timed),
                 "".join(f"Not run: {why}.\n" for why in getattr(args, "not_run", [])).strip() or None,
                 replan_table(timed) if args.stability is None else None,
                 f"Processes: {'; '.join(slack)}. Load average (1, 5, 15 min) after the run: "
                 + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores."]
        text = "\n\n".join(t for t in parts if t)
        print(text)
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write(text + "\n")
        labels = [c["label"] for cell in timed for c in cell["configs"] if "median_ms" in c]
        want = args.svg_config or ("zbpp zb-v" if "zbpp zb-v" in labels else labels[0] if labels else None)
        svg = timeline_svg(timed, want) if want else None
        if svg:
            with open(os.path.join(out, "timeline.svg"), "w") as f:
                f.write(svg)
        log(f"wrote {out}/table.md" + (f" and {out}/timeline.svg ({want})" if svg else ""))
    if args.json:
        keep = [{**cell, "configs": [{k: v for k, v in c.items() if not k.endswith("_svg")} for c in cell["configs"]]}
                for cell in cells]
        with open(args.json, "w") as f:
            json.dump({"cells": keep, "seconds": seconds, "torch": torch.__version__, "tree": _tree_state(),
                       "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(),
                       "args": {k: v for k, v in vars(args).items() if k != "configs"}}, f, indent=1)
        log(f"wrote {args.json}")
    log(f"done in {seconds:.0f} s; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
