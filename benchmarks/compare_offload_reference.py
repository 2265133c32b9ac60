#!/usr/bin/env python3
"""compare_offload_reference.py - zbpp's offload pass against the reference's (PipeOffload's
`add_offload` in sail-sg/zero-bubble-pipeline-parallelism), on the reference's own schedule.

What it does, per case (p in {4, 8}, m in {16, 32}, offload-chunk-num k in {1, 2}, the reference's
--offload-time in {0.5, 1, 1.5}; equal costs F = B = W = 1 per chunk, two chunks per rank):
  1. builds the reference's group-interleaved 1F1B (its `create_schedule`, interleave group
     ceil(p/2)) and runs its passes with offload (`run_schedule_passes`): a placement, or its
     failure ("Unable to schedule offload", or an exception);
  2. re-simulates in zbpp the reference's compute order without copies, the reference's placement
     (its D2H start as OFFLOAD, its H2D start as RELOAD, in its list positions), and zbpp's own
     pass on the same compute order (Schedule.plan_offload), with every copy taking
     offload_time x (F + B) (docs/megatron.md's definition of --offload-time);
  3. checks that zbpp's pass validates, keeps the step and, where the reference placed copies,
     leaves no rank holding more than the reference's placement does. zbpp's pass picks the
     microbatches and chunks itself: the reference's offload-chunk-num k does not bind it.
Memory is in chunk-activations (zbpp's microbatches through a rank's two chunks, times 2), with
w_share = 1 (the reference frees a chunk's activations at its W).

What this is not: a copy of the reference. Its scheduler is imported from a checkout at run time
(`--reference DIR`, or $ZBPP_REFERENCE_DIR: the repository's root, or any folder holding
megatron/core/pipeline_parallel/zerobubble/); megatron's package __init__s and get_args are stubbed,
so neither torch nor megatron is needed. The two models differ: zbpp gives each rank its own copy
lane, the reference lets ranks 2k and 2k+1 take turns on one; zbpp times copies from the start of
the compute op before them in the list. The figures are zbpp's simulation of both placements.

Usage: python3 benchmarks/compare_offload_reference.py --reference PATH   (exit 1 when a check fails)
"""

import argparse
import contextlib
import io
import math
import os
import sys
import types

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import zbpp
except ImportError:
    sys.path.insert(0, os.path.join(_REPO, "bindings", "python"))
    import zbpp

V = 2


def load_reference(root):
    """The reference's scheduler modules, with megatron's heavy __init__s bypassed."""
    for base in (root, os.path.join(root, "megatron", "..")):
        if os.path.isdir(os.path.join(base, "megatron", "core", "pipeline_parallel", "zerobubble")):
            root = os.path.abspath(base)
            break
    else:
        raise SystemExit(f"compare_offload_reference: {root} holds no megatron/core/pipeline_parallel/zerobubble/; "
                         "give a checkout of sail-sg/zero-bubble-pipeline-parallelism")
    for name in ("megatron", "megatron.core", "megatron.core.pipeline_parallel",
                 "megatron.core.pipeline_parallel.zerobubble"):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = mod
    training = types.ModuleType("megatron.training")
    args = types.SimpleNamespace(offload_overlap_sr=False)
    training.get_args = lambda: args
    sys.modules["megatron.training"] = training
    from megatron.core.pipeline_parallel.zerobubble.scheduler import graph, group_interleaved_1f1b, passes
    return graph, group_interleaved_1f1b, passes


def cells(graph, order, with_copies):
    """The reference's per-rank node lists as zbpp CSV rows."""
    names = {graph.F: "F", graph.B: "I", graph.W: "W", graph.BW: "B",
             graph.FuncType.OFFLOAD_SEND_START: "OFFLOAD", graph.FuncType.OFFLOAD_RECV_START: "RELOAD"}
    rows = []
    for nodes in order:
        row = []
        for n in nodes:
            t = names.get(n.type)
            if t is None or (not with_copies and t in ("OFFLOAD", "RELOAD")):
                continue
            if n.layer_group_idx != n.chunk * len(order) + n.stage:
                raise AssertionError("the reference's stage numbering is not zbpp's loop placement")
            row.append(f"{n.layer_group_idx}{t}{n.microbatch}")
        rows.append(",".join(row))
    return "\n".join(rows) + "\n"


def figures(csv, p, copy):
    times = {"f": [1.0] * (V * p), "b": [1.0] * (V * p), "w": [1.0] * (V * p), "offload": [copy] * (V * p),
             "reload": [copy] * (V * p)}
    return zbpp.Schedule.from_csv(csv, times=times, w_share=1.0)


def peaks(s):
    s.validate()
    return [V * s.rank_memory(r)[0] for r in range(s.ranks)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", default=os.environ.get("ZBPP_REFERENCE_DIR"),
                    help="a checkout of sail-sg/zero-bubble-pipeline-parallelism (or $ZBPP_REFERENCE_DIR)")
    args = ap.parse_args(argv)
    if not args.reference:
        ap.error("give --reference PATH (or set ZBPP_REFERENCE_DIR)")
    graph, gis, passes = load_reference(args.reference)
    print("| case | reference | peak without copies | ref peak (zbpp sim) | zbpp pass peak | step: plain / ref / zbpp "
          "| zbpp <= ref |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed = 0
    for p in (4, 8):
        for m in (16, 32):
            group = math.ceil(p / 2)
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet):
                cfg = graph.GraphConfig.basic_config(f=1.0, b=1.0, w=1.0, n_stages=p, n_micro=m, max_chunks=V)
                order = gis.create_schedule(cfg, cpu_offload=False, recompute_granularity=None, recompute_method=None,
                                            recompute_num_layers=None, interleave_group_size=group,
                                            offload_chunk_num=0)
                plain_csv = cells(graph, passes.run_schedule_passes(cfg, order, offload_time=None), False)
            for k in (1, 2):
                for ot in (0.5, 1.0, 1.5):
                    copy = ot * 2.0  # (D2H + H2D) / 2 = ot x (F + B), F = B = 1
                    name = f"p={p} m={m} k={k} ot={ot:g}"
                    try:
                        with contextlib.redirect_stdout(quiet):
                            cfg = graph.GraphConfig.basic_config(f=1.0, b=1.0, w=1.0, n_stages=p, n_micro=m,
                                                                 max_chunks=V)
                            order = gis.create_schedule(cfg, cpu_offload=True, recompute_granularity=None,
                                                        recompute_method=None, recompute_num_layers=None,
                                                        interleave_group_size=group, offload_chunk_num=k)
                            ref_csv = cells(graph, passes.run_schedule_passes(cfg, order, offload_time=ot), True)
                        ref_note = "placed"
                    except Exception as exc:  # noqa: BLE001 - the reference's failure is a result here
                        ref_csv, ref_note = None, f"fails: {type(exc).__name__}: {str(exc)[:40]}"
                    plain = figures(plain_csv, p, copy)
                    ours = plain.plan_offload()
                    our_peaks = peaks(ours)
                    ok = ours.makespan() <= plain.makespan() + 1e-9
                    ref_peaks, ref_step, verdict = "-", "-", "-"
                    if ref_csv is not None:
                        ref = figures(ref_csv, p, copy)
                        rp = peaks(ref)
                        ref_peaks, ref_step = " ".join(f"{x:g}" for x in rp), f"{ref.makespan():g}"
                        better = all(a <= b + 1e-9 for a, b in zip(our_peaks, rp))
                        verdict = "yes" if better else "NO"
                        ok = ok and better
                    failed += not ok
                    print(f"| {name} | {ref_note} | {' '.join(f'{x:g}' for x in peaks(plain))} | {ref_peaks} | "
                          f"{' '.join(f'{x:g}' for x in our_peaks)} | "
                          f"{plain.makespan():g} / {ref_step} / {ours.makespan():g} | {verdict} |")
    print("\nPeaks per rank in chunk-activations, from zbpp's simulation of each placement; the reference's "
          "compute order in every row.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
