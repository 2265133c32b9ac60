"""Why a run's measured bubble differs from its plan's: re-simulate what ran on what it cost.

    python3 benchmarks/replay_trace.py zbpp-out/train_gpt-zb-auto-trace.json

Reads a measured step as zbpp writes it (the Chrome trace of `Schedule.to_chrome()` after
set_times, e.g. the main job's `train_gpt-<kind>-trace.json`: one event per op, pid/tid = rank,
args = stage and microbatch), and prints:
  - the bubble the runner measured in that step;
  - that step's own per-stage costs (StageCosts.from_timelines: median op times, T_comm from the
    waits, the runtime's own time after each op by stage and type) and the spread of each op
    type's times;
  - the same op order simulated on those costs: the bubble a plan would promise if it knew the
    step's costs exactly (simulated; as the runner measures it, overhead idle, on the medians and
    with op times drawn from the step's own, as StageCosts.expected_bubble does).
If the last figure is still far below the measured one, the rest is in how op times vary within
the step beyond what independent draws show (on a shared machine, ops slow down together when
the other ranks compute), which no plan made from measured costs can follow.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bindings", "python"))

import zbpp  # noqa: E402


def read_trace(path):
    """(rank_ops, starts, ends) in seconds, ranks in (pid, tid) order, ops in start order."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    if not events:
        raise SystemExit(f"{path}: no op events (ph 'X') in this trace")
    ranks = sorted({(e["pid"], e["tid"]) for e in events})
    rank_ops, starts, ends = [], [], []
    for key in ranks:
        ops = sorted((e for e in events if (e["pid"], e["tid"]) == key), key=lambda e: e["ts"])
        rank_ops.append([(e["cat"], e["args"]["stage"], e["args"]["mb"]) for e in ops])
        starts.append([e["ts"] / 1e6 for e in ops])
        ends.append([(e["ts"] + e["dur"]) / 1e6 for e in ops])
    return rank_ops, starts, ends


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a measured step's Chrome trace written by zbpp")
    args = ap.parse_args(argv)
    rank_ops, starts, ends = read_trace(args.trace)
    m = 1 + max(mb for ops in rank_ops for _, _, mb in ops)
    S = 1 + max(st for ops in rank_ops for _, st, _ in ops)
    placement = "v" if S == 2 * len(rank_ops) and any(st == S - 1 for _, st, _ in rank_ops[0]) else "loop"
    with zbpp.Schedule.from_ops(rank_ops, m, placement=placement) as ran:
        measured = ran.set_times(starts, ends)
        costs = zbpp.StageCosts.from_timelines([ran])
    print(f"measured: bubble {100 * measured.bubble_rate:.1f}% over {measured.cost:.1f} ms "
          f"({len(rank_ops)} ranks, {S} stages, {m} microbatches)")
    print("this step's own costs (medians):")
    print("  " + costs.table().replace("\n", "\n  "))
    print(f"  the runtime's own time after each op (ms; median {costs.op_overhead:.3f}): " + ", ".join(
        f"{k.upper()} " + " / ".join(f"{x:.3f}" for x in costs.overheads[k]) for k in ("f", "b", "w")) + " by stage")
    for r, ops in enumerate(rank_ops):
        spread = {}
        for (kind, _, _), a, b in zip(ops, starts[r], ends[r]):
            spread.setdefault(kind, []).append(1000 * (b - a))
        print(f"  rank {r} op times (ms, min / median / max): " + ", ".join(
            f"{k} {min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}" for k, v in sorted(spread.items())))
    with zbpp.Schedule.from_ops(rank_ops, m, placement=placement, times=costs.times(), comm=costs.time_comm,
                                w_share=costs.w_share) as again:
        sim = again.simulate()
        print(f"the same op order simulated on these costs: bubble {100 * sim.bubble_rate:.1f}%; as the runner "
              f"would measure it {100 * costs.expected_bubble(again, draws=0):.1f}% on the medians, "
              f"{100 * costs.expected_bubble(again):.1f}% with op times drawn from this step's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
