#!/usr/bin/env python3
"""Run the V-Half + Vocabulary Parallelism scheduler of the reference (branch `v-half-vocab` of
sail-sg/zero-bubble-pipeline-parallelism, 92895b9a) from a checkout of that branch, and convert its
per-rank order into zbpp op lists; for test_vocab_vhalf_reference.py.

Nothing of the reference is copied here. Its scheduler files (megatron/core/pipeline_parallel/
zerobubble/scheduler/{graph,communication,passes,zbv_greedy}.py) are loaded from the checkout under
their own module names, byte for byte, with empty packages standing in for megatron, megatron.core...
(whose __init__ pulls in most of Megatron) and a stub `megatron.training` whose get_args() returns
the few flags the scheduler reads (enable_vocab_parallel, disable_backward_fusion,
enable_optimizer_post_validation). sys.modules is restored afterwards, so a real megatron imported
later is not shadowed.

What the branch's training runs (megatron/core/pipeline_parallel/zerobubble/runtime.py,
get_zero_bubble_forward_backward_func): --enable-vocab-parallel asserts --zero-bubble-v-schedule
with --zero-bubble-v-schedule-mem-setup half (megatron/training/arguments.py ~L327), which takes the
branch `zero_bubble_v_schedule_mem_setup != 'zb'` of the V scheduler:

    config = GraphConfig(cost_f=[1000.0]*p, cost_b=[1000.0]*p, cost_w=[1000.0]*p, cost_comm=1.0,
                         mem_f/b/w=..., max_chunks=2, n_stages=p, n_micro=m)
    local_order = zbv_greedy.PipelineGraph(p, m, 'half', 1000, 1000, 1000, 1).create_schedule(config)
    run_schedule_passes(config, local_order)

i.e. FIXED costs, whatever was profiled (the profiled f/b/w/c are ignored on this path), and no
vocabulary pass cost at all: zbv_greedy.stable_pattern_v_half widens the V-Half pattern by 6 slots
(12 with --disable-backward-fusion), schedule_from_pattern(do_reorder=False) orders F/B/W by pattern
slot (independent of the costs), add_time times that order with the config's costs, and
passes.add_embedding_passes puts S(i) at rank 0's end of F(last stage, i) plus one B, T(i) at S(i+1),
IF(i) at S(i - p/2 - 1) (the first p/2 + 1 at the start), IB(i) at S(i + p/2 + 3) (the last ones at
the end), the same times on every rank; communication.reorder_communication then sorts every rank's
list by time (ties: communication first, then the list's own order: F/B/W, IF, T, S, IB). So the
reference's order is a function of (p, m, fused) only. run_reference(costs=None) runs exactly that;
run_reference(costs=(f, b, w, comm)) feeds those costs into GraphConfig instead (a variant the branch
does not run: it moves the S/T/IF/IB slots against the F/B/W timeline).

Chunk and stage numbering: ScheduledNode.chunk is the model chunk (create_schedule already flips
zbv_greedy's pattern index for B/W: pattern type 'B' = model chunk 1), and layer_group_idx is
p*chunk + (rank if chunk == 0 else p-1-rank): chunk 0 on rank r is layer group r, chunk 1 is 2p-1-r,
which is zbpp's V placement (stage r and 2p-1-r on rank r), so zbpp's stage = layer_group_idx. S, T,
IF and IB nodes have `stage` = the rank, which is zbpp's (stage field = rank). The conversion is
checked by the test: the F/B/W part re-simulated by zbpp gives exactly add_time's times.

Usage:
  python vhalf_vocab_reference.py --reference PATH --show P M [--unfused] [--costs F B W COMM]
"""
import argparse
import contextlib
import importlib.util
import io
import os
import sys
import types

SCHEDULER_DIR = os.path.join("megatron", "core", "pipeline_parallel", "zerobubble", "scheduler")
_PKG = "megatron.core.pipeline_parallel.zerobubble.scheduler"
_FILES = ("graph", "communication", "passes", "zbv_greedy")
COMPUTE = ("F", "B", "W", "BW", "S", "T", "IF", "IB")
VOCAB_PASSES = ("S", "T", "IF", "IB")
# What the branch's training passes to the V-Half scheduler (runtime.py, mem_setup 'half').
TRAINING_COSTS = (1000.0, 1000.0, 1000.0, 1.0)


class ReferenceError(Exception):
    """The checkout is missing, not the v-half-vocab branch, or its scheduler cannot be loaded."""


def reference_path(path):
    """The checkout's absolute path; raises ReferenceError unless it has the branch's scheduler."""
    if not path:
        raise ReferenceError("no checkout given")
    sched = os.path.join(path, SCHEDULER_DIR)
    missing = [f + ".py" for f in _FILES if not os.path.isfile(os.path.join(sched, f + ".py"))]
    if missing:
        raise ReferenceError(f"{path}: {SCHEDULER_DIR}/ lacks {', '.join(missing)}")
    with open(os.path.join(sched, "passes.py"), encoding="utf-8") as fh:
        if "def add_embedding_passes" not in fh.read():
            raise ReferenceError(f"{path}: passes.py has no add_embedding_passes; not the v-half-vocab branch")
    return os.path.abspath(path)


def load(path):
    """Loads the branch's scheduler modules from the checkout. Returns a namespace with .graph,
    .communication, .passes, .zbv_greedy, .args (the namespace get_args() returns) and .path."""
    path = reference_path(path)
    sched = os.path.join(path, SCHEDULER_DIR)
    parts = _PKG.split(".")
    packages = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    names = packages + ["megatron.training"] + [f"{_PKG}.{f}" for f in _FILES]
    saved = {name: sys.modules.get(name) for name in names}
    args = types.SimpleNamespace(enable_vocab_parallel=True, disable_backward_fusion=False,
                                 enable_optimizer_post_validation=False)
    mods = {}
    try:
        for name in packages:
            pkg = types.ModuleType(name)
            pkg.__path__ = []
            sys.modules[name] = pkg
        training = types.ModuleType("megatron.training")
        training.get_args = lambda: args
        sys.modules["megatron.training"] = training
        for f in _FILES:  # graph first: the others import it by absolute name
            name = f"{_PKG}.{f}"
            spec = importlib.util.spec_from_file_location(name, os.path.join(sched, f + ".py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            mods[f] = mod
    except Exception as exc:
        raise ReferenceError(f"cannot load the branch's scheduler from {sched}: {type(exc).__name__}: {exc}") from exc
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return types.SimpleNamespace(path=path, args=args, **mods)


def run_reference(ref, p, m, fused=True, costs=None):
    """The branch's V-Half + vocab schedule for p ranks, m microbatches: its per-rank node lists as
    run_schedule_passes returns them (communication nodes included). costs None: the training's
    fixed GraphConfig (1000, 1000, 1000, comm 1); else (f, b, w, comm) per chunk op."""
    f, b, w, c = TRAINING_COSTS if costs is None else tuple(float(x) for x in costs)
    ref.args.enable_vocab_parallel = True
    ref.args.disable_backward_fusion = not fused
    ref.args.enable_optimizer_post_validation = False
    config = ref.graph.GraphConfig(
        cost_f=[f] * p, cost_b=[b] * p, cost_w=[w] * p, cost_comm=c,
        mem_f=[2] * p, mem_b=[-1] * p, mem_w=[-1] * p, max_mem=None,
        print_scaling=1000, max_chunks=2, n_stages=p, n_micro=m)
    with contextlib.redirect_stdout(io.StringIO()):  # both print their schedules
        graph = ref.zbv_greedy.PipelineGraph(p, m, "half", 1000, 1000, 1000, 1)
        local_order = graph.create_schedule(config)
        return ref.passes.run_schedule_passes(config, local_order)


def to_ops(nodes, p):
    """zbpp op lists (type, stage, mb) from the branch's node lists: compute nodes only, in list
    order; F/B/W stage = layer_group_idx (zbpp's V stage), S/T/IF/IB stage = the rank."""
    out = []
    for r, rank_nodes in enumerate(nodes):
        ops = []
        for n in rank_nodes:
            t = n.type.value
            if t not in COMPUTE:
                continue
            if n.stage != r:
                raise ValueError(f"rank {r} holds a node of rank {n.stage}: {n}")
            if t in VOCAB_PASSES:
                ops.append((t, r, n.microbatch))
            else:
                want = r if n.chunk == 0 else 2 * p - 1 - r
                if n.layer_group_idx != want:
                    raise ValueError(f"rank {r} chunk {n.chunk}: layer group {n.layer_group_idx}, "
                                     f"the V placement says {want}")
                ops.append((t, n.layer_group_idx, n.microbatch))
        out.append(ops)
    return out


def fbw_times(nodes):
    """{(type, stage, mb): (start, end)} of the F/B/W nodes as add_time timed them."""
    return {(n.type.value, n.layer_group_idx, n.microbatch): (n.start_time, n.completion_time)
            for rank_nodes in nodes for n in rank_nodes if n.type.value in ("F", "B", "W", "BW")}


def collectives(nodes):
    """Per rank, the order of the branch's collective nodes (type, mb): must be one order on every
    rank (they are collectives over the whole group)."""
    kinds = {"REDUCE_INPUT_EMBD_FORWARD", "BROADCAST_INPUT_EMBD_BACKWARD", "BROADCAST_OUTPUT_EMBD_S",
             "BROADCAST_OUTPUT_EMBD_T", "REDUCE_OUTPUT_EMBD_S", "REDUCE_OUTPUT_EMBD_T"}
    return [[(n.type.value, n.microbatch) for n in rank_nodes if n.type.value in kinds] for rank_nodes in nodes]


def _show(ref, p, m, fused, costs):
    nodes = run_reference(ref, p, m, fused, costs)
    for r, ops in enumerate(to_ops(nodes, p)):
        print(f"rank {r}: " + " ".join(f"{t}{s if t in ('F', 'B', 'W') else ''}.{i}" for t, s, i in ops))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", default=os.environ.get("ZBPP_ZB_FORK_VHV"),
                    help="checkout of the v-half-vocab branch (default $ZBPP_ZB_FORK_VHV)")
    ap.add_argument("--show", nargs=2, type=int, metavar=("P", "M"), required=True)
    ap.add_argument("--unfused", action="store_true", help="--disable-backward-fusion (Vocab-1)")
    ap.add_argument("--costs", nargs=4, type=float, metavar=("F", "B", "W", "COMM"),
                    help="GraphConfig costs instead of the training's fixed 1000/1000/1000/1")
    a = ap.parse_args()
    _show(load(a.reference), a.show[0], a.show[1], not a.unfused, a.costs)


if __name__ == "__main__":
    main()
