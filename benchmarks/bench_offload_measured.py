#!/usr/bin/env python3
"""bench_offload_measured.py - PipeOffload measured: every kind run with and without offload on
stages whose F, B and W take fixed times and whose forward saves a real activation, over gloo, one
process per rank, through zbpp.pipelining (offload="auto", offload_modelled=True).

What this is: each stage sleeps F in its forward (saving an activation of --act-kb KiB for its
backward, which reads it), B in its input-gradient backward and W in its weight-gradient backward,
as benchmarks/bench_synthetic.py's stages do. With offload the plan (Schedule.plan_offload on the
given times) moves activations to host memory after their F and back before their backward; each
copy runs on the runner's copy thread and lasts its planned time (offload_modelled: a modelled
PCIe link, k x (F + B) each way, the reference fork's --offload-time k), while the bytes really move
to a separate host pool and back. Sleeping leaves the cores free, so p ranks fit on a 2-core machine.

Correctness first: the first step of each configuration is compared with the same schedule without
offload (losses and every parameter's gradient, torch.equal); a difference stops the run.

Timing: --reps repetitions, each running both configurations for --steps steps, the order swapped
every repetition; a step is timed from a barrier to the end of step() on its slowest rank. Columns:
  step         median step (ms) without and with offload, and their ratio
  planned      the plan's step ratio (makespan with copies over without)
  peak         the largest saved-activation peak of any rank (KiB): planned without offload (the
               plan's peak x the measured bytes per microbatch) -> measured with (offload_report)
               and planned with
  host         the largest host-memory peak (KiB), measured
  k            copy time each way over F + B, the fork's --offload-time
Then rank 0's median op times without and with offload (the torch layer's own cost per op).

Usage: python3 benchmarks/bench_offload_measured.py [--p 4] [--m 8] [--k 0.5,1] [--kinds ...]
       [--offload auto|first-chunk]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import zbpp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(_REPO, "bindings", "python"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_synthetic import wait_until  # noqa: E402 - the same sleep-then-spin wait as its stages
from bench_synthetic_timing import set_timer_slack  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

KINDS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half")


class SleepSave(torch.autograd.Function):
    """F: waits f seconds and saves `act` (an activation its backward reads); B: waits b seconds
    and passes the gradient through, times act's last value (1, unless it came back wrong)."""

    @staticmethod
    def forward(ctx, x, act, f, b):
        wait_until(time.perf_counter() + f)
        ctx.save_for_backward(act)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (act,) = ctx.saved_tensors
        wait_until(time.perf_counter() + ctx.b)
        return grad * act[-1], None, None, None


class SleepW(torch.autograd.Function):
    """Zeros from the parameter w alone; its backward (a W) waits w_s seconds."""

    @staticmethod
    def forward(ctx, w, shape, w_s):
        ctx.w_s = w_s
        return w.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        wait_until(time.perf_counter() + ctx.w_s)
        return grad.sum().reshape(1), None, None


class Stage(torch.nn.Module):
    def __init__(self, f, b, w, act_floats):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.f, self.b, self.w_s, self.act_floats = f, b, w, act_floats

    def forward(self, x):
        act = torch.ones(self.act_floats)  # what this microbatch's forward keeps for its backward
        return SleepSave.apply(x * self.scale, act, self.f, self.b) + SleepW.apply(self.w, x.shape, self.w_s)


def loss_fn(out, target):
    return ((out - target) ** 2).sum()


def make(kind, rank, p, m, args, k, offload):
    import zbpp

    v = 2 if kind in ("interleaved-1f1b", "zb-v", "v-half", "v-min") else 1
    f, b, w = (args.ms / 1e3 / v,) * 3
    with zbpp.Schedule.generate(kind, p=p, m=m, v=v) as probe:
        mine = probe.rank_stages(rank)
    stages = [zbpp.PipelineStage(Stage(f, b, w, args.act_kb * 256), s, p * v, "cpu") for s in mine]
    S, t, copy = p * v, args.ms / v, k * 2 * args.ms / v
    # w_share 1: these stages are split by autograd (zbpp._autograd_split), whose B keeps the graph,
    # and so every saved tensor, until the W.
    costs = zbpp.StageCosts(p, v, "v" if kind in ("zb-v", "v-half", "v-min") else "loop", [t] * S, [t] * S, [t] * S,
                            w_share=1.0, time_offload=[copy] * S, time_reload=[copy] * S)
    chosen = "auto" if args.offload == "auto" else list(range(p))  # first-chunk: stages 0..p-1, half of them
    extra = dict(offload=chosen, offload_modelled=True) if offload else {}
    sched = zbpp.get_schedule_class(kind)(stages, m, loss_fn=loss_fn, costs=costs, timeout=120.0, **extra)
    return sched, stages


def run_step(sched, m, x, y):
    losses = []
    args = (x,) if sched.holds_first else ()
    kw = {"target": y, "losses": losses} if sched.holds_loss else {}
    sched.step(*args, **kw)
    return losses


def worker(rank, p, key, cells, args, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store-' + key)}", rank=rank,
                            world_size=p)
    torch.set_num_threads(1)
    # The copy thread's callback needs the interpreter lock, which a stage spinning out the end of
    # its wait holds for up to the switch interval (5 ms by default): a device's copy engine would
    # not wait for it. A short interval lets the copy in at once.
    sys.setswitchinterval(args.switch_us * 1e-6)
    set_timer_slack(1)  # sleeps (the stages' and the modelled copies') wake on time (bench_synthetic_timing)
    results = []
    for kind, m, k in cells:
        x = torch.arange(m * 4, dtype=torch.float32).reshape(m * 4, 1) % 7
        y = torch.zeros(m * 4, 1)
        built = {off: make(kind, rank, p, m, args, k, off) for off in (False, True)}
        # Correctness first: step 1 with offload equals step 1 without, losses and gradients.
        first = {}
        for off, (sched, stages) in built.items():
            losses = run_step(sched, m, x, y)
            first[off] = ([float(v) for v in losses], [prm.grad.clone() for st in stages for prm in st.submod.parameters()])
            for st in stages:
                st.submod.zero_grad(set_to_none=True)
        same = first[False][0] == first[True][0] and all(torch.equal(a, b) for a, b in zip(first[False][1], first[True][1]))
        times = {False: [], True: []}
        op_ms = {False: {}, True: {}}  # per op type: this rank's durations over the timed steps (ms)
        replays = {False: [], True: []}  # rank 0: per timed step, _replay's figures
        for rep in range(args.reps):
            for off in ((False, True) if rep % 2 == 0 else (True, False)):
                sched, stages = built[off]
                for _ in range(args.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    run_step(sched, m, x, y)
                    t1 = time.perf_counter()
                    for st in stages:
                        st.submod.zero_grad(set_to_none=True)
                    spans = [None] * p
                    dist.all_gather_object(spans, t1 - t0)
                    times[off].append(max(spans))
                    with sched.timeline() as tl:  # a collective: every rank, every step
                        st, en = tl.rank_times(rank)
                        for op, a, b in zip(tl.rank_ops(rank), st, en):
                            op_ms[off].setdefault(op.type, []).append(b - a)
                        if rank == 0:
                            replays[off].append(_replay(tl, sched.schedule))
        sched_on = built[True][0]
        report = sched_on.offload_report()
        plain = built[False][0].schedule
        plain.simulate()
        copies = sum(op.type == "OFFLOAD" for op in sched_on.schedule.rank_ops(rank))
        results.append(dict(kind=kind, m=m, k=k, same=same, times=times, report=report, copies=copies, replays=replays,
                            op_ms={off: {t: statistics.median(v) for t, v in d.items()} for off, d in op_ms.items()},
                            planned0=plain.rank_memory(rank)[0], step_ratio=sched_on.schedule.makespan() / plain.makespan()))
        for sched, _ in built.values():
            sched.close()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _replay(tl, plan):
    """One measured step replayed through its plan: (the plan's makespan with every op's measured
    duration, with the measured compute and the planned copies, the copies that ran over their
    planned time by more than 2%). Where the first grows with offload as the step does, the step
    grew because ops took longer than planned, not because the runner waited on its own."""
    p = tl.ranks
    ops = [tl.rank_ops(r) for r in range(p)]
    measured = [[b - a for a, b in zip(*tl.rank_times(r))] for r in range(p)]
    planned = [[plan.op_time(o.type, o.stage) for o in ops[r]] for r in range(p)]
    copy = [[o.type in ("OFFLOAD", "RELOAD") for o in ops[r]] for r in range(p)]
    compute_only = [[planned[r][j] if copy[r][j] else measured[r][j] for j in range(len(ops[r]))] for r in range(p)]
    late = sum(copy[r][j] and measured[r][j] > 1.02 * planned[r][j] for r in range(p) for j in range(len(ops[r])))
    return tl.makespan_durations(measured), tl.makespan_durations(compute_only), late


def _list(text, cast):
    return [cast(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4, help="pipeline ranks, one process each (default 4)")
    ap.add_argument("--m", default="8", help="microbatches (default 8)")
    ap.add_argument("--k", default="0.5,1", help="copy time each way over F + B (default 0.5,1)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="schedule kinds (default %(default)s)")
    ap.add_argument("--ms", type=float, default=4.0, help="F = B = W of a rank's layers, ms (default 4)")
    ap.add_argument("--act-kb", type=int, default=256, help="activation one stage saves per microbatch, KiB")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per repetition (default 3)")
    ap.add_argument("--reps", type=int, default=4, help="repetitions (default 4)")
    ap.add_argument("--offload", choices=("auto", "first-chunk"), default="auto",
                    help="what may move: every stage's activations (auto) or only the first chunk's, stages "
                         "0..p-1, half of them with v = 2 (selective offload)")
    ap.add_argument("--switch-us", type=float, default=100.0,
                    help="the interpreter's switch interval in the ranks, us (default 100; Python's is 5000)")
    args = ap.parse_args(argv)
    cells = [(kind, m, k) for kind in _list(args.kinds, str) for m in _list(args.m, int) for k in _list(args.k, float)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.p, "bench", cells, args, tmp), nprocs=args.p, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.p)]
    print(f"p = {args.p}, F = B = W = {args.ms:g} ms per rank, {args.act_kb} KiB saved per stage and microbatch; "
          f"{args.reps} x {args.steps} timed steps per configuration; offload={args.offload}")
    print("| kind | m | k | copies | step without -> with (ms) | ratio | planned ratio | peak KiB: planned without "
          "-> measured with (planned with) | host KiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    bad = 0
    for c, (kind, m, k) in enumerate(cells):
        rows = [r[c] for r in ranks]
        if not all(r["same"] for r in rows):
            bad += 1
            print(f"| {kind} | {m} | {k:g} | WRONG: offload changed the losses or gradients | | | | | |")
            continue
        t_off = statistics.median(rows[0]["times"][True]) * 1e3
        t_none = statistics.median(rows[0]["times"][False]) * 1e3
        reports = [(r["report"], r["planned0"]) for r in rows if r["report"] is not None]
        unit = max((rep["bytes_per_microbatch"] for rep, _ in reports), default=0)
        peak0 = max(p0 for _, p0 in ((None, r["planned0"]) for r in rows)) * unit / 1024
        got = max((rep["device_peak_bytes"] for rep, _ in reports), default=0) / 1024
        plan = max((rep["planned_device_peak_bytes"] for rep, _ in reports), default=0) / 1024
        host = max((rep["host_peak_bytes"] for rep, _ in reports), default=0) / 1024
        copies = sum(r["copies"] for r in rows)
        if not copies:
            print(f"| {kind} | {m} | {k:g} | 0 | {t_none:.1f} -> {t_off:.1f} | {t_off / t_none:.3f} | "
                  f"{rows[0]['step_ratio']:.3f} | no copy fits (the plan is the schedule without) | |")
            continue
        print(f"| {kind} | {m} | {k:g} | {copies} | {t_none:.1f} -> {t_off:.1f} | {t_off / t_none:.3f} | "
              f"{rows[0]['step_ratio']:.3f} | {peak0:.0f} -> {got:.0f} ({plan:.0f}) | {host:.0f} |")
    print("\nRank 0's median op times (ms), without -> with offload:")
    for c, (kind, m, k) in enumerate(cells):
        ops = ranks[0][c]["op_ms"]
        text = ", ".join(f"{t} {ops[False][t]:.2f} -> {ops[True][t]:.2f}" for t in ("F", "B", "W", "BW")
                         if t in ops[False] and t in ops[True])
        copies = ", ".join(f"{t} {ops[True][t]:.2f}" for t in ("OFFLOAD", "RELOAD") if t in ops[True])
        print(f"  {kind} m={m} k={k:g}: {text}" + (f"; {copies}" if copies else ""))
    print("\nThe plans replayed with each timed step's measured op times (the median step, ms, without -> with "
          "offload): every op as measured; the compute as measured and the copies as planned; copies per step "
          "that ran more than 2% over their planned time:")
    for c, (kind, m, k) in enumerate(cells):
        rep = ranks[0][c]["replays"]
        if not rep[True] or not ranks[0][c]["copies"] and not any(r[c]["copies"] for r in ranks):
            continue
        med = lambda off, i: statistics.median(x[i] for x in rep[off])  # noqa: E731
        print(f"  {kind} m={m} k={k:g}: all {med(False, 0):.1f} -> {med(True, 0):.1f} ({med(True, 0) / med(False, 0):.3f}), "
              f"compute {med(False, 1):.1f} -> {med(True, 1):.1f} ({med(True, 1) / med(False, 1):.3f}), "
              f"late copies {med(True, 2):.0f}")
    print(f"\n{time.perf_counter() - t0:.0f} s. The peak columns are over the ranks that moved something.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
