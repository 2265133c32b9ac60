#!/usr/bin/env python3
"""bench_offload_gpt.py - PipeOffload on the GPT example: per schedule kind, tokens/s and the peak of
saved activations on the device, without and with offload (--offload: offload="auto", the copy
times measured in the profiled steps and the copies placed after them).

What this is: `python3 -m zbpp.examples.train_gpt` run as a user runs it, once per cell and
repetition (a fresh set of processes each), the cells interleaved (even repetitions forward, odd
ones backward), and its own summary lines read: the loss (first -> last step), the tokens/s over
the steady steps (after the plan with the copies took over), the activations moved a step, the
plan's device peak of saved activations per rank (in microbatches through the rank's layers), and,
with offload, each copying rank's measured peak in bytes beside the plan's. Correctness first: both
runs of a kind must report the same losses (to the printed 3 decimals), else the table says so.

Memory: on a CPU, "device" and "host" are the same RAM, so the process's resident memory does not
move; what is compared is the saved-activation bytes the stages hold at once (zbpp/pipelining/
_offload.py counts them as the plan's model does; tests/python/test_offload.py holds the two within
5%). Time: a CPU has no copy engine, so the copies here are synchronous memory copies on the
stages' own cores; the planned "copies hide" is a GPU's promise, which this machine cannot show.

Usage: python3 benchmarks/bench_offload_gpt.py [--ranks 4] [--kinds 1f1b,zb-v,...] [--reps 2]
       [--steps 8] [--layers 8] [--d-model 128]
"""

import argparse
import re
import statistics
import sys
import time

from gpt_runs import train_gpt
KINDS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half", "zb-auto")


def parse(stdout, ranks):
    """The summary lines of one train_gpt run (see the module docstring)."""
    done = re.search(r"loss ([\d.]+) -> ([\d.]+).*?([\d,]+) tokens/s over those steps", stdout)
    peaks = re.search(r"the plan's peak of saved activations on the device per rank \(microbatches through the "
                      r"rank's layers\): (.*)", stdout)
    if not done or not peaks:
        raise RuntimeError(f"unexpected train_gpt output:\n{stdout[-2000:]}")
    plan = [float(x) for x in re.findall(r"rank \d+ ([\d.]+)", peaks.group(1))]
    if len(plan) != ranks:
        raise RuntimeError(f"unexpected train_gpt output (plan peaks of {len(plan)} ranks):\n{stdout[-2000:]}")
    moved = re.search(r"offload: (\d+) activations moved", stdout)
    measured = {int(q): (float(a.replace(",", "")), float(b.replace(",", ""))) for q, a, b in re.findall(
        r"rank (\d+): saved activations at once ([\d,]+) KiB on the device \(plan: [\d.]+ microbatches, ([\d,]+) KiB\)",
        stdout)}
    return {"loss": f"{done.group(1)} -> {done.group(2)}", "rate": float(done.group(3).replace(",", "")),
            "plan": plan, "moved": int(moved.group(1)) if moved else 0, "measured": measured}


def run_once(args, kind, offload):
    out = train_gpt(["--schedule", kind, "--ranks", str(args.ranks), "--steps", str(args.steps), "--layers",
                     str(args.layers), "--d-model", str(args.d_model), "--quiet", "--out", ""]
                    + (["--offload"] if offload else []), args.timeout)
    return parse(out, args.ranks)


def table(args, kinds, got):
    lines = [f"{args.ranks} ranks, {args.layers} layers, d_model {args.d_model}, {args.steps} steps "
             f"(tokens/s over the steady steps); median of {args.reps} runs each",
             "| kind | losses equal | tokens/s without -> with | with / without | copies a step | "
             "plan's peak, largest rank (microbatches): without -> with | measured with (KiB), largest copying "
             "rank: measured / planned |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind in kinds:
        runs = {off: got[(kind, off)] for off in (False, True)}
        losses = {off: {r["loss"] for r in runs[off]} for off in (False, True)}
        same = "yes" if len(losses[False] | losses[True]) == 1 else f"NO: {sorted(losses[False] | losses[True])}"
        rate = {off: statistics.median(r["rate"] for r in runs[off]) for off in (False, True)}
        peak = {off: statistics.median(max(r["plan"]) for r in runs[off]) for off in (False, True)}
        moved = statistics.median(r["moved"] for r in runs[True])
        sizes = [max(r["measured"].values(), key=lambda mp: mp[1]) for r in runs[True] if r["measured"]]
        size = (f"{statistics.median(m for m, _ in sizes):,.0f} / {statistics.median(p for _, p in sizes):,.0f}"
                if sizes else "no copies")
        lines.append(f"| {kind} | {same} | {rate[False]:,.0f} -> {rate[True]:,.0f} | {rate[True] / rate[False]:.3f} | "
                     f"{moved:g} | {peak[False]:g} -> {peak[True]:g} | {size} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kinds", default=",".join(KINDS), help="schedule kinds (default %(default)s)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every cell (default 2)")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (default 8: 3 profiled, 5 with the copies)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k.strip()]
    if args.steps < 4:
        ap.error("--steps must be at least 4: steps 2-3 are profiled, the copies run from step 4")
    cells = [(k, off) for k in kinds for off in (False, True)]
    got = {c: [] for c in cells}
    t0 = time.perf_counter()
    for rep in range(args.reps):
        for cell in (cells if rep % 2 == 0 else cells[::-1]):
            got[cell].append(run_once(args, *cell))
            print(f"  rep {rep + 1}: {cell[0]}, {'offload' if cell[1] else 'no offload'}: "
                  f"{got[cell][-1]['rate']:,.0f} tokens/s, {got[cell][-1]['moved']} copies",
                  file=sys.stderr, flush=True)
    print(table(args, kinds, got))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
