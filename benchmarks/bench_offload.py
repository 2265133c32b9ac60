#!/usr/bin/env python3
"""bench_offload.py - what the offload pass (PipeOffload) plans for every schedule kind: each rank's
device-resident activation peak and the step, without copies and with them, at the copy speeds the
reference fork's users give (--offload-time k: each copy takes k x (F + B) of a rank).

What this is: the schedule model only (zbpp.Schedule.plan_offload, simulated). Every row is first
checked: the schedule with copies validates, keeps every rank's compute ops in their order, and
steps no longer than without copies; a failed check is reported and exits 1.
What this is not: a measurement; benchmarks/bench_offload_measured.py runs the copies.

Columns: kind, p, m, k; peak = the largest device-resident peak of any rank, in microbatches through
all of a rank's layers (without -> with copies, and the ratio); step = the makespan (without ->
with); copies = microbatches moved to host memory; host = the largest host peak of any rank.

Usage: python3 benchmarks/bench_offload.py [--p 4,8] [--m 2p,4p] [--k 0.5,1,1.5] [--kinds ...]
"""

import argparse
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import zbpp
except ImportError:
    sys.path.insert(0, os.path.join(_REPO, "bindings", "python"))
    import zbpp

KINDS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "zb-auto")


def _list(text, cast):
    return [cast(x) for x in text.split(",") if x.strip()]


def row(kind, p, m, k, f=1.0, b=1.0, w=1.0):
    copy = k * (f + b)  # the fork's --offload-time: (D2H + H2D) / 2 over F + B
    times = {"f": f, "b": b, "w": w, "offload": copy, "reload": copy}
    with zbpp.Schedule.generate(kind, p=p, m=m, times=times) as base, base.plan_offload() as off:
        off.validate()
        compute = [[op for op in off.rank_ops(r) if op.type not in ("OFFLOAD", "RELOAD")] for r in range(p)]
        if compute != [base.rank_ops(r) for r in range(p)]:
            raise AssertionError("the pass changed the compute ops")
        step0, step1 = base.makespan(), off.makespan()
        if step1 > step0 * (1 + 1e-12):
            raise AssertionError(f"the step grew from {step0} to {step1}")
        peak0 = max(base.rank_memory(r)[0] for r in range(p))
        peak1 = max(off.rank_memory(r)[0] for r in range(p))
        host = max(off.rank_memory(r)[1] for r in range(p))
        copies = sum(op.type == "OFFLOAD" for r in range(p) for op in off.rank_ops(r))
        return {"kind": kind, "p": p, "m": m, "k": k, "peak0": peak0, "peak1": peak1, "step0": step0,
                "step1": step1, "copies": copies, "host": host}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", default="4,8", help="pipeline ranks (default 4,8)")
    ap.add_argument("--m", default="2p,4p", help="microbatches, numbers or multiples of p (default 2p,4p)")
    ap.add_argument("--k", default="0.25,0.5,1", help="copy time over F + B (default 0.25,0.5,1)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="schedule kinds (default all with W ops and 1F1B)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print("| kind | p | m | k | peak without -> with | ratio | step without -> with | copies | host peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = 0
    for p in _list(args.p, int):
        ms = [int(x[:-1]) * p if x.endswith("p") else int(x) for x in _list(args.m, str)]
        for m in ms:
            for kind in _list(args.kinds, str):
                for k in _list(args.k, float):
                    try:
                        r = row(kind, p, m, k)
                    except Exception as exc:  # noqa: BLE001 - every row is reported
                        failed += 1
                        print(f"| {kind} | {p} | {m} | {k:g} | CHECK FAILED: {exc} | | | | |")
                        continue
                    print(f"| {kind} | {p} | {m} | {k:g} | {r['peak0']:.3g} -> {r['peak1']:.3g} | "
                          f"{r['peak1'] / r['peak0']:.2f} | {r['step0']:.4g} -> {r['step1']:.4g} | {r['copies']} | "
                          f"{r['host']:.3g} |")
    print(f"\n{time.perf_counter() - t0:.1f} s; planned and simulated (bench_offload_measured.py measures)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
