#!/usr/bin/env python3
"""bench_vocab_gpt.py - Vocabulary Parallelism on the GPT example with a large vocabulary: tokens/s
and each rank's peak resident memory with the output layer and token embedding on the end stages
(as torch's pipelining and Megatron place them) against the same split over every rank
(--vocab-parallel), for several vocabulary sizes.

What this is: `python3 -m zbpp.examples.train_gpt` run as a user runs it, once per cell and
repetition (a fresh set of processes each, so each rank's peak resident memory, getrusage's
ru_maxrss, is that run's), the cells interleaved (even repetitions forward, odd ones backward),
and its own summary lines read: the loss (first -> last step), the tokens/s over the steps after
the first, and every rank's peak resident memory. Correctness first: both placements must report
the same losses (to the printed 3 decimals), else the table says so.

Columns: vocabulary, placement, median tokens/s, the speed-up of the split (vp / last), and each
rank's median peak resident memory (MiB), model, optimizer and activations together. The machine's
cores are shared by the ranks, so the absolute figures are this machine's, not a GPU's.

Usage: python3 benchmarks/bench_vocab_gpt.py [--ranks 2] [--vocab 8192,32768,65536] [--reps 2]
       [--steps 8] [--layers 8] [--d-model 128] [--schedule 1f1b]
"""

import argparse
import re
import statistics
import sys
import time

from gpt_runs import train_gpt


def run_once(args, vocab, vp):
    """One train_gpt run: (loss line, tokens/s, [peak MiB per rank])."""
    stdout = train_gpt(["--schedule", args.schedule, "--ranks", str(args.ranks), "--steps", str(args.steps),
                        "--layers", str(args.layers), "--d-model", str(args.d_model), "--vocab-size", str(vocab),
                        "--quiet", "--out", ""] + (["--vocab-parallel"] if vp else []), args.timeout)
    done = re.search(r"loss ([\d.]+) -> ([\d.]+).*?([\d,]+) tokens/s over those steps", stdout)
    rss = [float(x.replace(",", "")) for x in re.findall(r"rank \d+ ([\d,]+) MiB", stdout)]
    if not done or len(rss) != args.ranks:
        raise RuntimeError(f"unexpected train_gpt output:\n{stdout[-2000:]}")
    return f"{done.group(1)} -> {done.group(2)}", float(done.group(3).replace(",", "")), rss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--vocab", default="8192,32768,65536", help="vocabulary sizes (default 8192,32768,65536)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every cell (default 2)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    args = ap.parse_args(argv)
    vocabs = [int(v) for v in args.vocab.split(",") if v.strip()]
    cells = [(v, vp) for v in vocabs for vp in (False, True)]
    got = {c: [] for c in cells}
    t0 = time.perf_counter()
    for rep in range(args.reps):
        for cell in (cells if rep % 2 == 0 else cells[::-1]):
            got[cell].append(run_once(args, *cell))
            print(f"  rep {rep + 1}: vocab {cell[0]}, {'vp' if cell[1] else 'last'}: {got[cell][-1][1]:,.0f} tokens/s",
                  file=sys.stderr, flush=True)
    print(f"{args.schedule}, {args.ranks} ranks, {args.layers} layers, d_model {args.d_model}, {args.steps} steps "
          f"(tokens/s over steps 2-{args.steps}); median of {args.reps} runs each")
    print("| vocab | placement | loss | tokens/s | vp / last | " + " | ".join(
        f"rank {r} peak (MiB)" for r in range(args.ranks)) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in range(args.ranks)) + " |")
    for v in vocabs:
        rates = {vp: statistics.median(x[1] for x in got[(v, vp)]) for vp in (False, True)}
        losses = {vp: {x[0] for x in got[(v, vp)]} for vp in (False, True)}
        same = losses[False] == losses[True] and len(losses[False]) == 1
        for vp in (False, True):
            peaks = [statistics.median(x[2][r] for x in got[(v, vp)]) for r in range(args.ranks)]
            ratio = f"{rates[True] / rates[False]:.2f}" if vp else ""
            loss = ", ".join(sorted(losses[vp])) + ("" if same else " (DIFFERS)")
            print(f"| {v} | {'split (vp)' if vp else 'last stage'} | {loss} | {rates[vp]:,.0f} | {ratio} | "
                  + " | ".join(f"{p:,.0f}" for p in peaks) + " |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
