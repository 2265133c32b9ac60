#!/usr/bin/env python3
"""bench_torch.py - zbpp's schedules against torch.distributed.pipelining's, on one model and batch.

What this is: one run, over N processes joined by gloo (torch.multiprocessing, as the main job
train_gpt.py starts them), that trains the GPT of zbpp/examples/gpt.py (train_gpt's defaults: 8
blocks, d_model 128, 4 heads, sequences of 32 characters, 4 sequences per microbatch) with

  zbpp   1F1B, ZB-H1, ZB-V, zb-auto at memory limit p and at 2p: the model cut as train_gpt cuts
         it (one stage per rank, two for ZB-V), every Linear split by zbpp.split_linear, the C
         runner. ZB-H1, ZB-V and zb-auto are planned from measured costs: zbpp's own "plans from
         measured costs" (steps 2-3 timed, replanned after step 3) where the installed zbpp has
         it, else this script's profile of the same steps (Schedule.stage_costs() of the
         measured timelines, averaged, fed to the schedule as per-stage times=).
  torch  torch.distributed.pipelining's Schedule1F1B (one stage per rank),
         ScheduleInterleavedZeroBubble (two stages per rank, loop placement: rank r holds r and
         r+p) and ScheduleZBVZeroBubble (two stages per rank, V placement: r and 2p-1-r), with
         torch's PipelineStage on the unsplit model (torch splits B and W itself).

With --classes the configurations are instead each of torch's schedule classes (Schedule1F1B,
ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) twice: once from torch.distributed.pipelining and once
from zbpp.pipelining, with the same stages (the unsplit model, placed as torch users place them)
and the same calls, as a torch script whose import was changed runs. zbpp's step 1 is then held to
torch's tolerances against the unsplit sequential loop (an order such as LoopedBFS's sums the
microbatches' gradients last one first), "bitwise" where it is equal. The ratio column is against
torch's Schedule1F1B.

Every configuration trains its own copy of the model, built from the same seed, on the same
stream of batches, with the same loss (gpt.loss_fn, gradients averaged over the microbatches) and
a plain torch AdamW step after each pipeline step (no clipping, no post-validation: the optimizer
work is the same for every configuration, so the comparison is of the pipelines).

Correctness first. Step 1 of every configuration is checked against a sequential loop in one
process (the same stages, each microbatch forward and backward in order, gradients divided by m):
zbpp's losses and every gradient must be equal bit for bit (torch.equal; the reference splits its
Linear layers too, so W runs through the same C GEMM), torch's must be close within
torch.testing.assert_close's float32 tolerances (rtol 1.3e-6, atol 1e-5). Any miss stops the run
before a single step is timed, naming the configuration, the stage and the parameter.

Timing. After the warm-up steps (step 1 checked, steps 2-3 profiled, the replanned order run at
least once) come R repetitions; each runs every configuration for K steps in turn, starting one
configuration later each repetition, so the noise of a shared machine hits all alike. A step is
timed from a barrier of the configuration's ranks to the end of its optimizer step, on every
rank; its time is the slowest rank's. Per configuration the table gives the median over the
repetitions of tokens/s (K steps of batch x seq tokens over their summed time), its lowest and
highest repetition, the median over the repetitions of its tokens/s divided by zbpp 1F1B's in the
same repetition (paired: a slow spell of the machine longer than a repetition cancels out), the
median bubble over all timed steps and its difference from zbpp 1F1B's in percentage points.

Bubble, defined for both as zbpp defines it (zb_schedule_simulate on measured times): with each
rank's span (its first op's start to its last op's end) and busy time (the sum of its ops'
durations), bubble = (max span - max busy) / max span. zbpp's comes from the runner's own op
timestamps (PipelineSchedule.timeline().measured). torch exposes no per-op times, so this script
wraps each torch stage's forward_one_chunk, backward_one_chunk and backward_weight_one_chunk and
the schedule's _maybe_compute_loss with timers (waits for receives happen outside them, in the
schedule). The figures are comparable, not identical: zbpp's ops also include copying activations
into and out of the runner's buffers, and torch's own bookkeeping between ops (making and waiting
on its send/recv requests, in Python) counts as idle where zbpp's runner does it in C.

Threads: every process runs torch with one thread and OpenBLAS (zbpp's W GEMMs) with one thread
(OPENBLAS_NUM_THREADS=1 unless set), one process per core as the default run has it.

What this is not: a GPU benchmark, or a test (the suite has its own; this only refuses to time
wrong training). Two processes on two shared cores are noisy: compare the medians, read the
spread.

Usage:
  ZBPP_BUILD_DIR=build python3 benchmarks/bench_torch.py [--ranks 2] [--microbatches 8]
      [--batch B] [--steps K] [--reps R] [--warmup W] [--quick] [--own-profile] [--classes] [--json FILE]
Defaults: K = 2 steps, R = 14 repetitions, W = 5 (about two minutes on 2 cores); --quick: K = 2,
R = 2, W = 4 (under a minute). The table goes to stdout, progress to stderr.
Exit status: 0 done, 1 a configuration failed its check or a process failed, 2 a usage error.
"""

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYTHON_SRC = os.path.join(_REPO, "bindings", "python")
if _PYTHON_SRC not in sys.path:
    sys.path.insert(0, _PYTHON_SRC)
# One BLAS thread per process, as torch.set_num_threads(1) gives torch: zbpp's W GEMMs go through
# OpenBLAS, whose pthread build otherwise starts a thread per core in every rank's process; with
# one process per core those threads oversubscribe the cores and spin between GEMMs (in a pair of
# quick runs on the 2-core VM zbpp 1F1B made 2,920 tokens/s with them, 4,160 without). Set
# OPENBLAS_NUM_THREADS to override.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if os.environ.get("ZBPP_BUILD_DIR") and not os.environ.get("ZBPP_LIBRARY"):
    os.environ["ZBPP_LIBRARY"] = os.path.join(os.path.abspath(os.environ["ZBPP_BUILD_DIR"]), "libzbpp.so")

import torch  # noqa: E402  - before zbpp loads its library (DESIGN.md section 5)

# (label, library, kind or torch class, stages per rank, memory limit). The first is the baseline.
CONFIGS = [
    ("zbpp 1F1B", "zbpp", "1f1b", 1, None),
    ("zbpp ZB-H1", "zbpp", "zb-h1", 1, None),
    ("zbpp ZB-V", "zbpp", "zb-v", 2, None),
    ("zbpp zb-auto (limit p)", "zbpp", "zb-auto", 1, "p"),
    ("zbpp zb-auto (limit 2p)", "zbpp", "zb-auto", 1, "2p"),
    ("torch Schedule1F1B", "torch", "Schedule1F1B", 1, None),
    ("torch ScheduleInterleavedZeroBubble", "torch", "ScheduleInterleavedZeroBubble", 2, None),
    ("torch ScheduleZBVZeroBubble", "torch", "ScheduleZBVZeroBubble", 2, None),
]
# --classes: each of torch's schedule classes twice, on the same unsplit model and the same script,
# once from torch.distributed.pipelining and once from zbpp.pipelining (only the import differs).
TORCH_CLASSES = [("Schedule1F1B", 1), ("ScheduleGPipe", 1), ("ScheduleInterleaved1F1B", 2), ("ScheduleLoopedBFS", 2),
                 ("ScheduleInterleavedZeroBubble", 2), ("ScheduleZBVZeroBubble", 2), ("ScheduleDualPipeV", 2)]
CLASS_CONFIGS = [c for name, v in TORCH_CLASSES
                 for c in ((f"torch {name}", "torch", name, v, None), (f"zbpp {name}", "zbpp-import", name, v, None))]
V_CLASSES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
PLANNED = ("zb-h1", "zb-v", "zb-auto")  # the zbpp kinds planned from measured costs here
PROFILE_STEPS = (2, 3)  # steps timed for the plan (counted from 1), as zbpp's default
SEED = 0
# Model: train_gpt.py's defaults.
SEQ, D_MODEL, LAYERS, HEADS, LR = 32, 128, 8, 4, 3e-3
RTOL, ATOL = 1.3e-6, 1e-5  # torch.testing.assert_close's defaults for float32


def log(msg):
    print(f"[bench_torch] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="bench_torch.py",
        description="zbpp's pipeline schedules against torch.distributed.pipelining's on the example "
                    "GPT, CPU processes over gloo; the first step of each is checked against a "
                    "sequential loop before anything is timed.")
    ap.add_argument("--ranks", type=int, default=2, help="pipeline ranks = processes (default 2)")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per step (default 4 per microbatch: 32 at m = 8)")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration per repetition (default 2)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 14)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first, the checked step 1 included; at least 4 (default 5)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run of about a minute: 2 repetitions of 2 steps after 4 warm-up steps")
    ap.add_argument("--own-profile", action="store_true",
                    help="plan ZB-H1, ZB-V and zb-auto from this script's profile even when zbpp plans "
                         "from measured costs itself")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a collective or transfer may take before the run fails (default 120)")
    ap.add_argument("--classes", action="store_true",
                    help="instead of zbpp's kinds: each of torch's schedule classes from torch and from zbpp "
                         "(the same script on the unsplit model, only the import changed)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure as JSON there")
    args = ap.parse_args(argv)
    quick = args.quick
    for name, default, quick_value in (("steps", 2, 2), ("reps", 14, 2), ("warmup", 5, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick_value if quick else default)
    if args.batch is None:
        args.batch = 4 * args.microbatches
    for name in ("ranks", "microbatches", "batch", "steps", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.ranks < 2:
        ap.error("--ranks must be >= 2 (a pipeline)")
    if args.warmup < PROFILE_STEPS[1] + 1:
        ap.error(f"--warmup must be >= {PROFILE_STEPS[1] + 1}: step 1 is checked, steps "
                 f"{PROFILE_STEPS[0]}-{PROFILE_STEPS[1]} are profiled, and the replanned order must run "
                 "once before timing")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    if 2 * args.ranks > LAYERS:
        ap.error(f"--ranks {args.ranks}: two stages per rank need {2 * args.ranks} of the model's {LAYERS} blocks")
    return args


def configs(args):
    return CLASS_CONFIGS if args.classes else CONFIGS


def torch_placement(kind, chunks, rank, p):
    """The stages a torch user builds on `rank` for a torch class: one (rank), two in a V (r and
    2p-1-r) for the V classes, else two in a loop (r and r+p)."""
    if chunks == 1:
        return [rank]
    return [rank, 2 * p - 1 - rank] if kind in V_CLASSES else [rank, rank + p]


def measured_plans_available():
    """True when zbpp's PipelineSchedule plans from measured costs itself (plan_from_measured=)."""
    from zbpp import pipelining

    return "plan_from_measured" in inspect.signature(pipelining.PipelineSchedule.__init__).parameters


# ---- the sequential reference ---------------------------------------------------------------------

def model_config():
    from zbpp.examples import gpt

    return gpt.GPTConfig(seq=SEQ, d_model=D_MODEL, n_head=HEADS, n_layer=LAYERS)


def reference(num_stages, split, x, y, m):
    """One step of the whole model in this process, microbatch after microbatch: (losses [m],
    gradients [stage][parameter]) with the gradients divided by m as the pipelines' scale_grads do."""
    import zbpp
    from zbpp.examples import gpt

    modules = gpt.build_stages(model_config(), num_stages, seed=SEED)
    if split:
        modules = [zbpp.split_linear(mod) for mod in modules]
    losses = []
    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        h = xi
        for mod in modules:
            h = mod(h)
        loss = gpt.loss_fn(h, yi)
        loss.backward()
        losses.append(loss.detach())
    grads = []
    for mod in modules:
        for p in mod.parameters():
            p.grad.div_(m)
        grads.append([p.grad for p in mod.parameters()])
    return torch.stack(losses), grads


def compare(label, exact, losses, ref_losses, stages, ref_grads):
    """(ok, message, max |difference|): this rank's losses (None when it does not hold the loss) and gradients of
    `stages` ({stage index: module}) against the reference."""
    worst = 0.0

    def same(a, b):
        nonlocal worst
        if a is None or b is None or a.shape != b.shape:
            return False
        worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=RTOL, atol=ATOL)

    if losses is not None:
        got = torch.stack([t.detach().reshape(()) for t in losses])
        if not same(got, ref_losses):
            return False, (f"{label}: the step-1 losses {got.tolist()} differ from the sequential loop's "
                           f"{ref_losses.tolist()}"), worst
    for s, mod in stages.items():
        for j, ((name, p), ref) in enumerate(zip(mod.named_parameters(), ref_grads[s])):
            if not same(p.grad, ref):
                diff = "no gradient" if p.grad is None else f"max |difference| {float((p.grad - ref).abs().max()):.3g}"
                return False, (f"{label}: stage {s} parameter {name} has a step-1 gradient that differs from the "
                               f"sequential loop's ({diff}; required: "
                               f"{'bit for bit' if exact else f'rtol {RTOL}, atol {ATOL}'})"), worst
    return True, "", worst


# ---- one configuration on this rank -----------------------------------------------------------------

class _Timers:
    """(start, end) of every wrapped call since the last reset: the per-op times torch does not keep."""

    def __init__(self):
        self.spans = []

    def wrap(self, obj, name):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spans.append((t0, time.perf_counter()))

        setattr(obj, name, timed)

    def take(self):
        """(span, busy) in seconds of the calls since the last take, and reset."""
        spans, self.spans = self.spans, []
        if not spans:
            return 0.0, 0.0
        return max(e for _, e in spans) - min(s for s, _ in spans), sum(e - s for s, e in spans)


class Pipeline:
    """One configuration on this rank: its model copy, stages, schedule, optimizer and batches, over a
    process group of its own (so no two configurations' messages can meet)."""

    def __init__(self, config, rank, ranks, args, own_profile):
        import torch.distributed as dist
        import zbpp
        from zbpp.examples import gpt

        self.label, self.lib, self.kind, self.chunks, self.mem_limit = config
        self.rank, self.ranks, self.args = rank, ranks, args
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
        S = self.num_stages = ranks * self.chunks
        modules = gpt.build_stages(model_config(), S, seed=SEED)
        m = args.microbatches
        self.own_profile = own_profile and self.kind in PLANNED
        self.profiles = []  # per-stage costs of the profiled steps (own profile only)
        self.plan = None
        if self.lib == "zbpp":
            probe = zbpp.Schedule.generate(self.kind, p=ranks, m=m, v=self.chunks, mem_limit=self.mem_limit)
            mine = probe.rank_stages(rank)
            probe.close()
            self.stages = {s: zbpp.split_linear(modules[s]) for s in mine}
            self.pstages = [zbpp.PipelineStage(self.stages[s], s, S, "cpu", group=self.group) for s in mine]
            self.sched = self._zbpp_schedule()
            self.holds_first, self.holds_loss = self.sched.holds_first, self.sched.holds_loss
        elif self.lib == "zbpp-import":
            # A torch script with its import changed: torch's class names, zbpp's classes, the model unsplit.
            from zbpp import pipelining as zp

            mine = torch_placement(self.kind, self.chunks, rank, ranks)
            self.stages = {s: modules[s] for s in mine}
            self.pstages = [zp.PipelineStage(modules[s], s, S, torch.device("cpu"), group=self.group) for s in mine]
            cls = getattr(zp, self.kind)
            self.sched = cls(self.pstages[0] if self.chunks == 1 else self.pstages, m, loss_fn=gpt.loss_fn)
            self.holds_first, self.holds_loss = self.sched.holds_first, self.sched.holds_loss
        else:
            from torch.distributed import pipelining as tp

            mine = torch_placement(self.kind, self.chunks, rank, ranks)
            self.stages = {s: modules[s] for s in mine}
            self.pstages = [tp.PipelineStage(modules[s], s, S, torch.device("cpu"), group=self.group)
                            for s in mine]
            cls = getattr(tp, self.kind)
            self.sched = cls(self.pstages[0] if self.chunks == 1 else self.pstages, m, loss_fn=gpt.loss_fn)
            self.timers = _Timers()
            for st in self.pstages:
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    self.timers.wrap(st, name)
            self.timers.wrap(self.sched, "_maybe_compute_loss")
            self.holds_first, self.holds_loss = 0 in mine, S - 1 in mine
        self.params = [p for mod in self.stages.values() for p in mod.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=LR, foreach=False)
        self.data = gpt.Batches(SEQ, args.batch, seed=SEED)
        self.steps = 0

    def _zbpp_schedule(self, times=None):
        import zbpp
        from zbpp.examples import gpt

        cls = zbpp.get_schedule_class(self.kind)
        kwargs = {"timeout": self.args.timeout}
        if self.mem_limit:
            kwargs["mem_limit"] = self.mem_limit
        if times is not None:
            kwargs["times"] = times
        if measured_plans_available():
            if self.kind in PLANNED and not self.own_profile and times is None:
                kwargs.update(plan_from_measured=True, profile_steps=PROFILE_STEPS)
            else:
                kwargs["plan_from_measured"] = False
        return cls(self.pstages, self.args.microbatches, loss_fn=gpt.loss_fn, **kwargs)

    def _pipeline_step(self, x, y):
        """The pipeline's step on this rank (inputs where stage 0 is, target where the loss is):
        the microbatch losses on the loss stage's rank, else None."""
        losses = [] if self.holds_loss else None
        args = (x,) if self.holds_first else ()
        kwargs = {"target": y, "losses": losses} if self.holds_loss else {}
        self.sched.step(*args, **kwargs)
        return losses

    def _after_step(self):
        """The measured figures of the step just run: zbpp's from its timeline (a collective of the
        pipeline's ranks), torch's span and busy time of this rank from the timers. Also where this
        script's own profile is taken and its plan made (--own-profile)."""
        self.steps += 1
        if self.lib == "torch":
            span, busy = self.timers.take()
            return {"span_ms": 1e3 * span, "busy_ms": 1e3 * busy}
        timeline = self.sched.timeline()
        meas = timeline.measured
        if self.own_profile and PROFILE_STEPS[0] <= self.steps <= PROFILE_STEPS[1]:
            self.profiles.append(timeline.stage_costs())
        timeline.close()
        if self.own_profile and self.steps == PROFILE_STEPS[1]:
            self._replan_own()
        return {"bubble": meas.bubble_rate, "span_ms": meas.cost, "busy_ms": meas.busy}

    def step(self):
        """One training step: (seconds from a barrier of the pipeline's ranks to the end of this
        rank's optimizer step, the measured figures)."""
        import torch.distributed as dist

        x, y = self.data.next()  # every rank draws the batch so the streams stay in step
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        self._pipeline_step(x, y)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        return seconds, self._after_step()

    def checked_step(self, ref):
        """Step 1, its losses and gradients compared with the sequential reference before the
        optimizer steps: (ok, message, max |difference|, mean loss or None)."""
        import torch.distributed as dist

        x, y = self.data.next()
        ref_losses, ref_grads = ref(self.num_stages, self.lib == "zbpp", x, y, self.args.microbatches)
        dist.barrier(group=self.group)
        losses = self._pipeline_step(x, y)
        # zbpp's own kinds split W into the C GEMM, as the reference does: equal bit for bit. A torch
        # script's classes may sum the microbatches' gradients in another order (LoopedBFS runs
        # the backwards last microbatch first): within float32 tolerances, as torch's.
        ok, text, worst = compare(self.label, self.lib == "zbpp", losses, ref_losses, self.stages, ref_grads)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._after_step()
        loss = float(torch.stack([t.detach().reshape(()) for t in losses]).mean()) if losses else None
        return ok, text, worst, loss

    def _replan_own(self):
        """This script's plan from measured costs (zbpp without plan_from_measured, or
        --own-profile): the mean per-stage F/B/W of the profiled steps as per-stage times=."""
        keys = ("f", "b", "w")
        times = {k: [statistics.fmean(c[k][s] for c in self.profiles) for s in range(self.num_stages)]
                 for k in keys}
        self.sched.close()
        self.sched = self._zbpp_schedule(times=times)
        self.plan = {"source": "bench_torch profile", "times_ms": times}

    def plan_summary(self):
        """What the schedule was planned from, for the report (zbpp planned kinds)."""
        if self.lib == "torch" or (self.lib == "zbpp" and self.kind not in PLANNED):
            return None
        if self.plan is not None:
            import zbpp

            with zbpp.Schedule.generate(self.kind, p=self.ranks, m=self.args.microbatches, v=self.chunks,
                                        times=self.plan["times_ms"], mem_limit=self.mem_limit) as s:
                sim = s.simulate()
            return dict(self.plan, simulated_bubble=sim.bubble_rate, text=(
                f"planned from this script's profile of steps {PROFILE_STEPS[0]}-{PROFILE_STEPS[1]}: "
                f"simulated bubble {100 * sim.bubble_rate:.1f}%"))
        info = getattr(self.sched, "plan_info", None)
        if info is None:
            return {"source": "none", "text": "not replanned (planned for equal F/B/W)"}
        return {"source": "zbpp plan_from_measured", "simulated_bubble": info.simulated.bubble_rate,
                "previous_plan_bubble": info.before.bubble_rate if info.before is not None else None,
                "measured_bubble_before": info.measured_bubble, "text": info.summary()}

    def close(self):
        if self.lib != "torch":
            self.sched.close()


# ---- the process body --------------------------------------------------------------------------------

def worker(rank, ranks, args, tmp, own_profile):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=rank,
                            world_size=ranks, timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)  # the ranks share the cores; also keeps results independent of threads
    say = log if rank == 0 else (lambda msg: None)
    pipes = []
    try:
        refs = {}  # every configuration's step 1 sees the same batch: one reference per cut

        def ref(S, split, x, y, m):
            if (S, split) not in refs:
                refs[(S, split)] = reference(S, split, x, y, m)
            return refs[(S, split)]

        for config in configs(args):
            pipes.append(Pipeline(config, rank, ranks, args, own_profile))
        say(f"built {len(pipes)} configurations on {ranks} processes")

        # 1. Correctness: step 1 of every configuration against the sequential loop.
        checks = []
        for pipe in pipes:
            ok, text, worst, loss = pipe.checked_step(ref)
            got = [None] * ranks
            dist.all_gather_object(got, (ok, text, worst, loss))
            bad = [t for o, t, _, _ in got if not o]
            if bad:
                if rank == 0:
                    with open(os.path.join(tmp, "check-failed.txt"), "w") as f:
                        f.write("\n".join(bad))
                say("CHECK FAILED: " + bad[0])
                return
            worst = max(w for _, _, w, _ in got)
            loss = next(v for _, _, _, v in got if v is not None)
            checks.append("bitwise" if pipe.lib == "zbpp" or worst == 0 else f"allclose (max diff {worst:.1g})")
            say(f"check {pipe.label}: step-1 loss {loss:.6f}, {checks[-1]}")

        # 2. Warm-up (steps 2..W: the profile and the replan happen here).
        for pipe in pipes:
            for _ in range(args.warmup - 1):
                pipe.step()
            summary = pipe.plan_summary()
            if summary:
                say(f"{pipe.label}: {summary['text']}")
        say(f"warm-up done ({args.warmup} steps per configuration); timing {args.reps} repetitions x "
            f"{len(pipes)} configurations x {args.steps} steps")

        # 3. Timing: every repetition runs each configuration for K steps in turn.
        records = [[] for _ in pipes]  # per configuration: (rep, seconds, figures)
        n = len(pipes)
        for rep in range(args.reps):
            t_rep = time.perf_counter()
            for j in range(n):
                c = (rep + j) % n
                for _ in range(args.steps):
                    dt, figures = pipes[c].step()
                    records[c].append((rep, dt, figures))
            say(f"repetition {rep + 1}/{args.reps} done in {time.perf_counter() - t_rep:.1f} s")

        gathered = [None] * ranks
        dist.all_gather_object(gathered, records)
        if rank == 0:
            result = summarise(args, pipes, checks, gathered)
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(result, f)
        dist.barrier()
    except BaseException:
        with open(os.path.join(tmp, f"error-rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        for pipe in pipes:
            pipe.close()
        dist.destroy_process_group()


def summarise(args, pipes, checks, gathered):
    """Per configuration: tokens/s per repetition (slowest rank per step), bubbles per step."""
    tokens = args.batch * SEQ
    out = []
    for c, pipe in enumerate(pipes):
        per_rank = [g[c] for g in gathered]
        steps = len(per_rank[0])
        times, bubbles, reps, busy_ms = [], [], {}, []
        for k in range(steps):
            rep = per_rank[0][k][0]
            dt = max(r[k][1] for r in per_rank)
            times.append(dt)
            reps.setdefault(rep, []).append(dt)
            busy_ms.append(max(r[k][2]["busy_ms"] for r in per_rank))
            if pipe.lib != "torch":
                bubbles.append(per_rank[0][k][2]["bubble"])
            else:
                span = max(r[k][2]["span_ms"] for r in per_rank)
                busy = max(r[k][2]["busy_ms"] for r in per_rank)
                bubbles.append((span - busy) / span if span > 0 else 0.0)
        tps = [len(v) * tokens / sum(v) for _, v in sorted(reps.items())]
        out.append({
            "label": pipe.label, "library": pipe.lib, "kind": pipe.kind, "stages_per_rank": pipe.chunks,
            "mem_limit": pipe.mem_limit, "check": checks[c], "tokens_per_s": tps,
            "tokens_per_s_median": statistics.median(tps), "step_seconds": times,
            "bubbles": bubbles, "bubble_median": statistics.median(bubbles),
            "busy_ms_median": statistics.median(busy_ms),  # the busiest rank's compute per step
            "plan": {k: v for k, v in (pipe.plan_summary() or {}).items() if k != "times_ms"} or None,
        })
    return {"configs": out}


# ---- the report --------------------------------------------------------------------------------------

def paired_ratios(result):
    """Per configuration: the median over the repetitions of its tokens/s over the first
    configuration's (zbpp 1F1B; torch Schedule1F1B with --classes) in the same repetition. Both ran within seconds of each other, so a slow spell of the machine that
    lasts longer than a repetition cancels out of the ratio (it would not out of a ratio of medians)."""
    base = result["configs"][0]["tokens_per_s"]
    return [statistics.median(t / b for t, b in zip(c["tokens_per_s"], base)) for c in result["configs"]]


def table(result):
    base = result["configs"][0]
    ratios = paired_ratios(result)
    name = base["label"]
    lines = ["| configuration | stages per rank | step-1 check | tokens/s (median) | min-max over reps "
             f"| vs {name} (paired) | bubble (median) | vs {name} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c, ratio in zip(result["configs"], ratios):
        tps = c["tokens_per_s"]
        bubble = f"{100 * c['bubble_median']:.1f}%"
        diff = 100 * (c["bubble_median"] - base["bubble_median"])
        bdiff = "-" if c is base else f"{diff:+.1f} pts"
        lines.append(f"| {c['label']} | {c['stages_per_rank']} | {c['check']} | {c['tokens_per_s_median']:,.0f} | "
                     f"{min(tps):,.0f}-{max(tps):,.0f} | {'1.00' if c is base else f'{ratio:.2f}x'} | "
                     f"{bubble} | {bdiff} |")
    return "\n".join(lines)


def _git_describe():
    try:
        head = subprocess.run(["git", "-C", _REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", _REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None):
    args = parse_args(argv)
    import torch.multiprocessing as mp

    own = args.own_profile or not measured_plans_available()
    log(f"{args.ranks} processes (gloo), GPT {LAYERS} blocks d_model {D_MODEL}, {args.microbatches} "
        f"microbatches of {args.batch // args.microbatches} x {SEQ} tokens; {len(configs(args))} configurations; "
        f"{args.warmup} warm-up steps, {args.reps} repetitions x {args.steps} steps; ZB-H1/ZB-V/zb-auto "
        f"planned from {'this script' if own else 'zbpp'}'s measured costs (steps "
        f"{PROFILE_STEPS[0]}-{PROFILE_STEPS[1]})")
    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_torch-") as tmp:
        try:
            mp.spawn(worker, args=(args.ranks, args, tmp, own), nprocs=args.ranks, join=True)
        except Exception as exc:  # noqa: BLE001 - a process failed; say which and why
            for r in range(args.ranks):
                path = os.path.join(tmp, f"error-rank{r}.txt")
                if os.path.exists(path):
                    with open(path) as f:
                        log(f"rank {r} failed:\n{f.read()}")
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            log(f"aborted: {type(exc).__name__}: {lines[-1].strip() if lines else ''}")
            return 1
        failed = os.path.join(tmp, "check-failed.txt")
        if os.path.exists(failed):
            with open(failed) as f:
                log("aborted before timing; a configuration does not train like the sequential loop:\n"
                    + f.read())
            return 1
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
    elapsed, load1 = time.time() - t0, os.getloadavg()
    log(f"done in {elapsed:.0f} s; load average (1 min) {load0[0]:.1f} at the start, {load1[0]:.1f} at the end "
        f"on {os.cpu_count()} cores")
    print(table(result))
    for c in result["configs"]:
        if c["plan"]:
            print(f"\n{c['label']}: {c['plan']['text']}", end="")
    print()
    if args.json:
        result.update(
            args={k: v for k, v in vars(args).items() if k != "json"},
            model={"layers": LAYERS, "d_model": D_MODEL, "heads": HEADS, "seq": SEQ, "lr": LR, "seed": SEED},
            planned_by="bench_torch profile" if own else "zbpp plan_from_measured",
            machine={"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            torch=torch.__version__, zbpp_commit=_git_describe(), seconds=elapsed,
            load_average={"start": load0, "end": load1},
            date=time.strftime("%Y-%m-%d"))
        for c, ratio in zip(result["configs"], paired_ratios(result)):
            c["tokens_per_s_ratio_to_zbpp_1f1b"] = ratio
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
