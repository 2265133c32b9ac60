#!/usr/bin/env python3
"""bench_synthetic.py - pipeline schedules on stages whose F, B and W take given times, run through
torch.distributed.pipelining and through zbpp.pipelining by the same code, only the import differing.

What this is: every stage sleeps a fixed time in its forward (F), its input-gradient backward (B)
and its weight-gradient backward (W). Sleeping leaves the GIL and the cores free, so 2 to 8 ranks
fit on a 2-core machine and a step's time shows only the schedule and the runtime's own cost. Each
stage is

    out = SleepFB(x * scale) + SleepW(w)

SleepFB is an autograd Function that sleeps F in its forward and B in its backward and passes its
input and gradient through; SleepW is a Function of the parameter w alone whose forward returns
zeros (no sleep) and whose backward sleeps W and gives w the sum of the output gradient. SleepW's
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

Correctness first: step 1 of every configuration is compared with a sequential loop over the same
stages in one process (each microbatch forward and backward in turn, gradients divided by m): the
losses and the gradients of scale and w of every stage must be equal (torch.equal; inputs, targets
and scales are small integers and powers of two, so every sum is exact in any order and a W that
ran twice, never, or into the wrong stage shows). A mismatch stops the run before anything is timed.

Timing: after --warmup steps (step 1 checked; zbpp's replan after step 3), --reps repetitions; each
runs every configuration of the cell for --steps steps, one configuration later each repetition,
so the noise of a shared machine hits all alike. A step is timed from a barrier of its ranks to the
end of step() and counts as its slowest rank's time. Per configuration the table gives:
  step     the median step over all timed steps (ms), and the fastest and slowest repetition's mean
  plan     the simulated makespan of the configuration's own op order (its pipeline_order, after
           zbpp's replan, as torch exposes it for every class) on the cell's costs, by zbpp's
           simulator: what the order takes with no runtime cost at all (transfers free)
  eff      plan / step: the share of the step the order explains; the rest is runtime
  vs 1F1B  torch Schedule1F1B's step / this one's, median over the repetitions of the ratio within
           each (above 1: faster)
  vs torch for zbpp's import of a torch class: torch's same class / zbpp's, as above
  W/op     the measured mean time of a W op in one extra step (0: W ran inside B, or none)
One configuration's measured timeline (the extra step) is written as SVG, above it the plan.

What this is not: a test (the suite checks correctness; this refuses only to time wrong training),
or a measure of compute kernels (nothing computes).

Usage:
  ZBPP_BUILD_DIR=build .venv/bin/python benchmarks/bench_synthetic.py [--p 2,4,8] [--m 2p,4p]
      [--costs equal,paper,lm-head] [--classes NAMES] [--impl both|torch|zbpp] [--reps R] [--steps K]
      [--warmup W] [--quick] [--check-only] [--out DIR] [--json FILE] [--svg-config LABEL]
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

IMPORTS = {"torch": "torch.distributed.pipelining", "zbpp": "zbpp.pipelining"}
# torch's classes: name -> placement (one stage per rank, two in a loop, two in a V).
TORCH_CLASSES = {"Schedule1F1B": "one", "ScheduleGPipe": "one", "ScheduleInterleaved1F1B": "loop",
                 "ScheduleLoopedBFS": "loop", "ScheduleInterleavedZeroBubble": "loop",
                 "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}
# zbpp's own kinds (zbpp import only): name -> (kind for get_schedule_class, placement, mem_limit).
ZBPP_KINDS = {"zb-h1": ("zb-h1", "one", None), "zb-h2": ("zb-h2", "one", None), "zb-v": ("zb-v", "v", None),
              "v-half": ("v-half", "v", None), "v-min": ("v-min", "v", None),
              "zb-auto@p": ("zb-auto", "one", "p"), "zb-auto@2p": ("zb-auto", "one", "2p")}
BASELINE = ("torch", "Schedule1F1B")
# The Zero Bubble paper's profiled T_F, T_B, T_W (ms per microbatch through a rank's layers).
PAPER = {"1.5B": (18.522, 18.086, 9.337), "6.2B": (29.718, 29.468, 19.927),
         "14.6B": (11.347, 11.248, 8.132), "28.3B": (10.419, 10.207, 7.715)}
COSTS = ("equal", *PAPER, "lm-head")
MB_ROWS, WIDTH = 2, 4  # a microbatch is MB_ROWS x WIDTH small integers


def log(msg):
    print(f"[bench_synthetic] {msg}", file=sys.stderr, flush=True)


# ---- the sleeping stage ------------------------------------------------------------------------------

class SleepFB(torch.autograd.Function):
    """Identity that sleeps f seconds in its forward and b in its backward (the input's side)."""

    @staticmethod
    def forward(ctx, x, f, b):
        time.sleep(f)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        return grad, None, None


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
        time.sleep(ctx.w_s)
        return grad.sum().reshape(ctx.w_shape), None, None


class SleepStage(torch.nn.Module):
    """One stage: out = SleepFB(x * scale) + SleepW(w), times in seconds. scale is a power of two
    (2 on even stages, 1/2 on odd ones) so every product and sum stays exact."""

    def __init__(self, index, f, b, w):
        super().__init__()
        self.f, self.b, self.w_s = f, b, w
        self.scale = torch.nn.Parameter(torch.tensor(2.0 if index % 2 == 0 else 0.5))
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        h = SleepFB.apply(x * self.scale, self.f, self.b)
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


def stage_times(cost, p, v, args):
    """Per-stage (F, B, W) in ms for S = p * v stages: the rank's costs divided by v."""
    if cost in PAPER:
        f, b, w = (t * args.paper_scale for t in PAPER[cost])
    else:
        f = b = w = args.equal_ms
    times = [(f / v, b / v, w / v)] * (p * v)
    if cost == "lm-head":
        times[-1] = tuple(2 * t for t in times[-1])
    return times


def label(impl, name):
    return f"{impl} {name}"


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


# ---- measured timelines and plans (zbpp's simulator) ------------------------------------------------

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


def measured_timeline(cfg):
    """One more step of cfg, recorded: a zbpp.Schedule with the measured times on rank 0 (None
    elsewhere). zbpp's runner keeps its own op times (timeline(), a collective); torch's ops are
    recorded around its stages' calls."""
    import torch.distributed as dist
    import zbpp

    if cfg.impl == "zbpp":
        cfg.timed_step()
        timeline = cfg.sched.timeline()
        return timeline if cfg.rank == 0 else (timeline.close() or None)
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
    placement = "loop" if cfg.placement in ("one", "loop") else "v"
    timeline = zbpp.Schedule.from_ops(ops, cfg.m, placement=placement, v=cfg.v)
    timeline.measured = timeline.set_times([[a for *_, a, _ in r] for r in got], [[e for *_, e in r] for r in got])
    return timeline


def op_means(timeline):
    """Mean measured duration (ms) of each op type over every rank's ops."""
    durations = {}
    for r in range(timeline.ranks):
        starts, ends = timeline.rank_times(r)
        for op, a, e in zip(timeline.rank_ops(r), starts, ends):
            durations.setdefault(op.type, []).append(e - a)
    return {t: statistics.fmean(d) for t, d in durations.items()}


def simulated_plan(cfg, timeline):
    """The cfg's op order simulated on the cell's costs: (zbpp.Schedule, where the order came
    from). The order is its pipeline_order (torch's classes expose it; zbpp's after its replan);
    where zbpp cannot run that order (torch's Schedule1F1B IR lacks the last rank's first forward:
    its _get_pipeline_order starts that rank's forwards at microbatch 1), the order the runtime ran,
    as recorded in `timeline`, with the reason."""
    import zbpp
    from zbpp.pipelining._order import schedule_from_actions

    times = {k: [t[i] for t in cfg.times_ms] for i, k in enumerate("fbw")}
    order = getattr(cfg.sched, "pipeline_order", None)
    why = "it has no pipeline_order"
    if order:
        try:
            return schedule_from_actions(order, cfg.p, cfg.S, cfg.m, times=times), "pipeline_order"
        except Exception as exc:  # noqa: BLE001 - an order zbpp refuses: use the order run instead
            why = f"its pipeline_order is refused: {str(exc).splitlines()[0]}"
    ops = [timeline.rank_ops(r) for r in range(timeline.ranks)]
    placement = "loop" if cfg.placement in ("one", "loop") else "v"
    plan = zbpp.Schedule.from_ops(ops, cfg.m, placement=placement, v=cfg.v, times=times)
    plan.validate()
    return plan, f"the order run ({why})"


# ---- one process: every cell of its p ----------------------------------------------------------------

def worker(rank, p, cells, names, args, tmp):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, f"store-p{p}"), rank=rank,
                            world_size=p, timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)
    say = log if rank == 0 else (lambda msg: None)
    try:
        for m, cost in cells:
            t_cell = time.perf_counter()
            cfgs = [Config(impl, name, rank, p, m, cost, args) for impl, name in names]
            try:
                result = run_cell(cfgs, rank, p, m, cost, args, say)
            finally:
                for cfg in cfgs:
                    cfg.close()
            if rank == 0:
                with open(os.path.join(tmp, f"cell-p{p}-m{m}-{cost}.json"), "w") as f:
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
    # 2. Warm-up: zbpp profiles steps 2-3 and replans after step 3.
    for c in live:
        for _ in range(args.warmup - 1):
            c.timed_step()
    # 3. Timing, interleaved.
    records = {c.label: [] for c in live}
    n = len(live)
    for rep in range(args.reps):
        for j in range(n):
            c = live[(rep + j) % n]
            for _ in range(args.steps):
                records[c.label].append((rep, c.timed_step()))
    gathered = [None] * p
    dist.all_gather_object(gathered, records)
    # 4. One recorded step each: the measured timeline; the plan of each order.
    timelines = {c.label: measured_timeline(c) for c in live}
    if rank != 0:
        return cell
    for c in live:
        steps = [max(g[c.label][k][1] for g in gathered) * 1e3 for k in range(len(records[c.label]))]
        reps = {}
        for (rep, _), ms in zip(records[c.label], steps):
            reps.setdefault(rep, []).append(ms)
        tl = timelines[c.label]
        plan, source = simulated_plan(c, tl)
        entry = {"label": c.label, "impl": c.impl, "name": c.name, "stages_per_rank": c.v,
                 "step_ms": steps, "rep_ms": [statistics.fmean(v) for _, v in sorted(reps.items())],
                 "median_ms": statistics.median(steps), "plan_ms": plan.simulate().cost,
                 "plan_source": source, "op_means_ms": op_means(tl), "measured_span_ms": tl.measured.cost,
                 "plan_svg": plan.to_svg(), "timeline_svg": tl.to_svg()}
        info = getattr(c.sched, "plan_info", None)
        if info is not None:
            entry["replan"] = info.summary()
        cell["configs"].append(entry)
        tl.close()
        plan.close()
    return cell


# ---- the report ----------------------------------------------------------------------------------

def paired(cfg, other):
    """Median over the repetitions of other's mean step / cfg's mean step in the same repetition."""
    return statistics.median(o / c for c, o in zip(cfg["rep_ms"], other["rep_ms"]))


def table(cells):
    """The markdown table; plans not simulated from pipeline_order are marked and explained below."""
    lines = ["| p | m | costs | configuration | step (ms, median) | reps min-max | plan (ms) | eff | vs torch 1F1B "
             "| vs torch same class | W/op (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = {}
    for cell in cells:
        by = {c["label"]: c for c in cell["configs"] if "median_ms" in c}
        base = by.get(label(*BASELINE))
        for c in cell["configs"]:
            head = f"| {cell['p']} | {cell['m']} | {cell['cost']} | {c['label']} |"
            if "skipped" in c:
                lines.append(f"{head} not run: {c['skipped']} | | | | | | |")
                continue
            mark = ""
            if c["plan_source"] != "pipeline_order":
                mark = "*" * (list(notes).index(c["plan_source"]) + 1 if c["plan_source"] in notes else len(notes) + 1)
                notes.setdefault(c["plan_source"], (mark, c["label"]))
            vs = f"{paired(c, base):.2f}x" if base else "-"
            twin = by.get(label("torch", c["name"])) if c["impl"] == "zbpp" else None
            same = f"{paired(c, twin):.2f}x" if twin else "-"
            w = c["op_means_ms"].get("W")
            lines.append(f"{head} {c['median_ms']:.1f} | {min(c['rep_ms']):.1f}-{max(c['rep_ms']):.1f} | "
                         f"{c['plan_ms']:.1f}{mark} | {c['plan_ms'] / c['median_ms']:.2f} | {vs} | {same} | "
                         f"{'-' if w is None else f'{w:.1f}'} |")
    for source, (mark, who) in notes.items():
        lines.append(f"\n{mark} {who}: plan simulated from {source}")
    return "\n".join(lines)


def timeline_svg(cells, want):
    """The measured timeline of configuration `want` in the first cell that ran it, under its plan,
    with torch Schedule1F1B's measured timeline of the same cell for comparison."""
    from zbpp.schedule import stack_svgs

    for cell in cells:
        by = {c["label"]: c for c in cell["configs"] if "median_ms" in c}
        if want not in by:
            continue
        where = f"p={cell['p']} m={cell['m']} {cell['cost']}"
        c, parts = by[want], []
        parts.append((f"{want}: plan ({c['plan_ms']:.1f} ms simulated), {where}", c["plan_svg"]))
        parts.append((f"{want}: measured ({c['measured_span_ms']:.1f} ms)", c["timeline_svg"]))
        base = by.get(label(*BASELINE))
        if base is not None and base is not c:
            parts.append((f"{base['label']}: measured ({base['measured_span_ms']:.1f} ms)", base["timeline_svg"]))
        return stack_svgs(parts)
    return None


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
                    help=f"cost settings among {', '.join(COSTS)} and 'paper' for the four paper ones (default all)")
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
        else:
            ap.error(f"--costs: unknown setting {item!r}; choose among {', '.join(COSTS)} and paper")
    args.cost_list = list(dict.fromkeys(costs))
    names = list(TORCH_CLASSES) + list(ZBPP_KINDS) if args.classes is None else _list(args.classes)
    for n in names:
        if n not in TORCH_CLASSES and n not in ZBPP_KINDS:
            ap.error(f"--classes: unknown {n!r}; torch classes: {', '.join(TORCH_CLASSES)}; zbpp kinds: "
                     f"{', '.join(ZBPP_KINDS)}")
    impls = ("torch", "zbpp") if args.impl == "both" else (args.impl,)
    if args.classes is not None and "zbpp" not in impls and any(n in ZBPP_KINDS for n in names):
        ap.error("--classes names zbpp kinds, which run through zbpp only; use --impl zbpp or both")
    configs = [BASELINE] if "torch" in impls else []
    for n in names:
        for impl in (impls if n in TORCH_CLASSES else ("zbpp",) if "zbpp" in impls else ()):
            if (impl, n) not in configs:
                configs.append((impl, n))
    if not configs:
        ap.error("no configuration to run: zbpp's kinds need --impl zbpp or both")
    args.configs = configs
    for x in (args.reps, args.steps, args.warmup):
        if x < 1:
            ap.error("--reps, --steps and --warmup must be >= 1")
    if args.warmup < 4 and not args.check_only:
        log("note: zbpp replans after step 3; with --warmup < 4 the first timed steps run the plan before it")
    return args


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


def main(argv=None):
    args = parse_args(argv)
    import torch.multiprocessing as mp

    preflight(args)
    out = args.out or tempfile.mkdtemp(prefix="bench_synthetic-")
    os.makedirs(out, exist_ok=True)
    names = args.configs
    log(f"p {args.ps}, m {args.m}, costs {args.cost_list}; {len(names)} configurations per cell; "
        f"warm-up {args.warmup}, {args.reps} repetitions x {args.steps} steps; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    t0 = time.time()
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench_synthetic-") as tmp:
        for p in args.ps:
            todo = [(m, cost) for m in m_values(args.m, p) for cost in args.cost_list]
            ctx = mp.start_processes(worker, args=(p, todo, names, args, tmp), nprocs=p, join=False,
                                     start_method="spawn")
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
            for m, cost in todo:
                path = os.path.join(tmp, f"cell-p{p}-m{m}-{cost}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        cells.append(json.load(f))
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
        text = table(timed)
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
