#!/usr/bin/env python3
"""bench_vocab.py - Vocabulary Parallelism measured on fixed-time stages: the step of a 1F1B pipeline
whose output layer (and input embedding) sits on the last (and first) stage, against the same with
the vocabulary split over every rank (zbpp's 1f1b with vocab=2, the reference's order), and against
a pipeline whose output layer costs nothing. One process per rank over gloo and sockets, through
zbpp.runtime's C runner (no torch model: the point is the placement).

What this is: each rank's stage sleeps its F and fused backward (BW) per microbatch, F = 1 and
BW = 2 time units per transformer layer, --layers layers per rank. The output layer costs --vocab
layers (F: v, backward: 2v) and the embedding --embed layers. Without Vocabulary Parallelism they
sit on the last and first stage; with it every rank runs, per microbatch, S (the output layer's
forward and its input-gradient part on its shard: 2v/p), T (its weight gradient: v/p), IF and IB
(the embedding's: e/p each), and the runner calls zbpp's vocab callback at each, which sleeps the
pass and runs its real collective (an all-reduce or broadcast over the pipeline group, a channel
per kind of pass), so the barriers are the ones a real run has. Sleeping leaves the cores free, so
p ranks fit on a small machine.

Columns: vocab (layers), then the median step (ms) of: free (an output layer of no cost), last
(on the last stage), vp (split); vp/free and last/free; the planned (simulated) ratios beside. The
even-spread reference is free plus the vocabulary's own work, which has to run somewhere, spread
evenly over the ranks: m microbatches x (3v + 2e) / p layers on every rank. It is not a lower bound
(passes can fill 1F1B's warm-up and cool-down bubbles; the plan itself comes in a little under it),
but vp near it means the split adds no bubble of its own.

Usage: python3 benchmarks/bench_vocab.py [--p 4] [--m 16] [--layers 4] [--unit-ms 1] [--vocab 1,2,4,6]
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


def plan(p, m, layers, vocab, embed, mode):
    """(Schedule, per-stage F and BW times in ms units) of one configuration."""
    from zbpp import Schedule

    f = [float(layers)] * p
    bw = [2.0 * layers] * p
    if mode == "last":
        f[-1] += vocab
        bw[-1] += 2 * vocab
        f[0] += embed
        bw[0] += embed
    times = {"f": f, "b": [x / 2 for x in bw], "w": [x / 2 for x in bw], "bw": bw}
    if mode == "vp":
        vt = {"s": 2.0 * vocab / p, "t": 1.0 * vocab / p, "if": embed / p, "ib": embed / p, "comm": 0.05}
        return Schedule.generate("1f1b", p, m, times=times, vocab=2, vocab_times=vt), f, bw
    return Schedule.generate("1f1b", p, m, times=times), f, bw


def worker(rank, p, key, args, cells, out_dir):
    from zbpp import distributed, runtime
    from zbpp.vocab import CHANNEL_IB, CHANNEL_IF, CHANNEL_S

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store-' + key)}", rank=rank,
                            world_size=p)
    set_timer_slack(1)
    tr = distributed.TorchTransport(None, timeout=60.0, name=f"vocab-bench-{key}").transport
    # The passes' collectives run beside the compute, as the reference runs them on a stream of
    # their own: one thread per kind of pass, each with a transport of its own, in microbatch order;
    # what needs a result waits for it (T for S's barrier, stage 0's F for IF's, the last stage's
    # backward for S's input gradient).
    from zbpp.pipelining._vocab import _Lane  # the schedule classes' lanes (vocab_parallel=)

    lanes = {name: _Lane(name, distributed.TorchTransport(None, timeout=60.0, name=f"vocab-{name}-{key}").transport,
                         60.0, lambda: None)
             for name in ("S", "IF", "IB")}
    unit = args.unit_ms / 1e3
    built = {}
    backend = runtime.Backend("host")  # one per rank: the transport carries one backend's buffers
    store = runtime.WStore(backend, lambda token, ran: None)
    for cell in cells:
        vocab, mode = cell
        sched, f, bw = plan(p, args.m, args.layers, vocab if mode != "free" else 0.0, args.embed, mode)
        pass_s = {"S": 2.0 * vocab / p, "T": 1.0 * vocab / p, "IF": args.embed / p, "IB": args.embed / p}

        vp = mode == "vp"

        lanes_on = vp and not args.blocking

        def forward(stage, mb, inp, out, f=f, vp=lanes_on):
            if vp and stage == 0:
                lanes["IF"].wait(mb, "the embedding's all-reduce")
            wait_until(time.perf_counter() + f[stage] * unit)

        def backward(stage, mb, gout, gin, bw=bw, vp=lanes_on):
            if vp and stage == p - 1:
                lanes["S"].wait(mb, "the output layer's input gradient (Vocab-2: S's all-reduce)")
            wait_until(time.perf_counter() + bw[stage] * unit)

        def vocab_pass(kind, mb, pass_s=pass_s):
            if args.blocking:  # the collective inside the pass, on the runner's transport
                wait_until(time.perf_counter() + pass_s[kind] * unit)
                if kind == "IB":
                    tr.broadcast(torch.zeros(4), 0, channel=CHANNEL_IB)
                elif kind != "T":
                    tr.all_reduce(torch.zeros(4), "sum", channel=CHANNEL_S if kind == "S" else CHANNEL_IF)
                return
            if kind == "T":
                lanes["S"].wait(mb, "the global max and sum")
            wait_until(time.perf_counter() + pass_s[kind] * unit)
            ch = {"S": CHANNEL_S, "IF": CHANNEL_IF, "IB": CHANNEL_IB}
            if kind == "IB":
                lanes["IB"].start(mb, lambda t: t.broadcast(torch.zeros(4), 0, channel=ch["IB"]))
            elif kind != "T":  # Vocab-2: T has no collective of its own
                lanes[kind].start(mb, lambda t, c=ch[kind]: t.all_reduce(torch.zeros(4), "sum", channel=c))

        run = runtime.Runner(sched, rank, backend, store, tr, [16] * (p - 1), forward, backward, timeout_s=60.0,
                             vocab=vocab_pass if mode == "vp" else None)
        built[cell] = (run, sched, backend, store)
    times = {cell: [] for cell in cells}
    for rep in range(args.reps):
        order = cells if rep % 2 == 0 else list(reversed(cells))
        for cell in order:
            run = built[cell][0]
            for _ in range(args.steps):
                dist.barrier()
                for lane in lanes.values():
                    lane.reset()
                t0 = time.perf_counter()
                run.run()
                for lane in lanes.values():
                    lane.drain("the step's collectives")  # the step ends when its last collective has
                t1 = time.perf_counter()
                spans = [None] * p
                dist.all_gather_object(spans, t1 - t0)
                times[cell].append(max(spans))
    planned = {cell: built[cell][1].simulate().cost for cell in cells}
    if rank == 0:
        torch.save({"times": times, "planned": planned}, os.path.join(out_dir, "result.pt"))
    for run, sched, _, _ in built.values():
        run.close(), sched.close()
    store.close()  # the backend stays with the transport, which holds it until the process ends
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4, help="ranks, one process each (default 4)")
    ap.add_argument("--m", type=int, default=16, help="microbatches (default 16)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers per rank (default 4)")
    ap.add_argument("--vocab", default="1,2,4,6", help="the output layer's cost in layers (default 1,2,4,6)")
    ap.add_argument("--embed", type=float, default=0.25, help="the embedding's cost in layers (default 0.25)")
    ap.add_argument("--unit-ms", type=float, default=1.0, help="ms of one layer's forward (default 1)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per repetition (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--blocking", action="store_true",
                    help="run each pass's collective inside the pass, blocking the rank (for comparison: the "
                         "reference and zbpp's model run them beside the compute)")
    args = ap.parse_args(argv)
    vocabs = [float(x) for x in args.vocab.split(",") if x.strip()]
    cells = [(0.0, "free")] + [(v, mode) for v in vocabs for mode in ("last", "vp")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.p, "b", args, cells, tmp), nprocs=args.p, join=True)
        res = torch.load(os.path.join(tmp, "result.pt"))
    med = {cell: statistics.median(v) * 1e3 for cell, v in res["times"].items()}
    plan_ = res["planned"]
    free, pfree = med[(0.0, "free")], plan_[(0.0, "free")]
    print(f"p = {args.p}, m = {args.m}, {args.layers} layers per rank (F {args.unit_ms:g} ms, BW "
          f"{2 * args.unit_ms:g} ms a layer), embedding {args.embed:g} layers; median of {args.reps} x {args.steps} "
          f"steps; free (an output layer of no cost): {free:.1f} ms (planned {pfree * args.unit_ms:.1f})")
    print("| vocab (layers) | last stage (ms) | split, vp (ms) | last / free | vp / free | vp / even spread "
          "| planned: last / free, vp / free |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in vocabs:
        last, vp = med[(v, "last")], med[(v, "vp")]
        bound = free + args.m * (3 * v + 2 * args.embed) / args.p * args.unit_ms
        print(f"| {v:g} | {last:.1f} | {vp:.1f} | {last / free:.3f} | {vp / free:.3f} | {vp / bound:.3f} | "
              f"{plan_[(v, 'last')] / pfree:.3f}, {plan_[(v, 'vp')] / pfree:.3f} |")
    print(f"\n{time.perf_counter() - t0:.0f} s. Even spread: free + m (3 vocab + 2 embed) / p layers, the "
          "vocabulary's work spread evenly over the ranks (not a lower bound: passes can fill bubbles).")


if __name__ == "__main__":
    sys.exit(main())
