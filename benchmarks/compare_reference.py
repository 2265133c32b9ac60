#!/usr/bin/env python3
"""compare_reference.py - zbpp's schedule generators against the reference implementation's own
heuristics, both re-simulated under one cost model: zbpp's simulator.

The reference is sail-sg/zero-bubble-pipeline-parallelism (the Zero Bubble authors' Megatron fork).
Its heuristics live in megatron/core/pipeline_parallel/zerobubble/scheduler/:

  zb.py          the paper's greedy start for loop placement (one stage per rank):
                 Graph.build_graph + initial_solution, the best of 8 rule sets;
  zbv.py         ZB-V: PipelineGraph.try_v_schedule, the best of its 4 (fill_f, fill_b) combinations;
  zbv_greedy.py  V-Half and V-Min (the controllable-memory paper): schedule_from_pattern.

Each reference result is turned into zbpp op lists, built with zbpp.Schedule.from_ops, validated
(dependencies, FIFO channels, no deadlock, memory under the limit) and simulated. zbpp's own
generator runs on the same inputs. Both figures come from the same simulator, so the comparison is
of op orders, not of two cost models. The reference's own time estimate is recorded next to the
re-simulation: when the conversion is right they agree.

What this is not: a copy of the reference. Its files are loaded at run time from a checkout given
by --reference PATH or $ZBPP_ZB_FORK; nothing of it is in this repository.

Conversion (read from the reference's code, not from its docs):
  loop   reference stage i = zbpp stage i = rank i; each stage's ops in completion-time order (what
         create_scheduled_nodes does).
  V      zbpp stage s sits on rank s for s < p and on rank 2p-1-s otherwise. The reference's
         forward chunk c on rank i is zbpp stage i (c = 0) or 2p-1-i (c = 1). Its backward and
         weight ops number the chunks the other way round: raw B/W chunk 0 on rank i is the backward
         of the *second* model chunk (zbpp stage 2p-1-i; it needs no gradient from another rank on
         rank 0 and waits for raw B chunk 0 of rank i-1 elsewhere), raw chunk 1 is zbpp stage i.
         zbv.py's create_schedule flips them for the same reason. zbv_greedy's stage_order types
         0..5 are F chunk 0, F chunk 1, B of chunk 1, B of chunk 0, W of chunk 1, W of chunk 0.
         Taking the raw chunk as the model chunk deadlocks under zbpp's validator (the tests check
         that).

Cost model: T_F, T_B, T_W are the time of one microbatch through all of a rank's layers (zbpp's
convention). In a V each chunk op costs T/2 on both sides (the reference is given T/2 per op). Every
dependency between ranks adds T_comm, on both sides. A schedule's cost is the largest span of any
rank (first op start to last op end), its bubble (cost - busy) / cost.

Memory: zbpp counts one microbatch's activations through all of a rank's layers as 1 (a V chunk's F
is 1/2); B frees (1 - w) of it and W the remaining w (w_share). The reference gets integer units so
its arithmetic is exact: mem_f = 2, mem_b = mem_w = -1 (w_share 0.5), or for the paper's models
mem_f = 34h + 5as, mem_w = -32h, mem_b = -(2h + 5as) (the paper's Table 1, s = 1024, w_share =
32h / (34h + 5as)). A zbpp limit L is max_mem = L * mem_f per stage for zb.py and 2L * mem_f for
zbv.py (two chunks per rank). zbv_greedy takes no limit; both sides' peaks are reported and a case
where zbpp peaks higher is flagged.

Outcome per case: a tie when |zbpp - reference| <= 1e-9 * reference, else a win or a loss for zbpp.
A reference result that zbpp's validator rejects, or a reference heuristic that fails, is reported
as such and not counted as a win.

Usage:
  ZBPP_BUILD_DIR=build python3 benchmarks/compare_reference.py --reference /path/to/zb-fork
      [--quick] [--verbose] [--json FILE] [--seed N] [--no-timing]
Exit status: 0 done, 2 the reference checkout is missing or unusable.
"""

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time
import types

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYTHON_SRC = os.path.join(_REPO, "bindings", "python")
if _PYTHON_SRC not in sys.path:
    sys.path.insert(0, _PYTHON_SRC)
if os.environ.get("ZBPP_BUILD_DIR") and not os.environ.get("ZBPP_LIBRARY"):
    os.environ["ZBPP_LIBRARY"] = os.path.join(os.path.abspath(os.environ["ZBPP_BUILD_DIR"]), "libzbpp.so")

import zbpp  # noqa: E402  (after the path set-up above)

ENV_REFERENCE = "ZBPP_ZB_FORK"
SCHEDULER_DIR = os.path.join("megatron", "core", "pipeline_parallel", "zerobubble", "scheduler")
_REF_PACKAGE = "megatron.core.pipeline_parallel.zerobubble.scheduler"
TIE_RTOL = 1e-9

# The Zero Bubble paper's four profiled GPT settings (Table 3 and its profiled T_F/T_B/T_W/T_comm,
# in ms): name, p, T_F, T_B, T_W, T_comm, hidden size h, heads a, and the m values the paper ran.
# benchmarks/bench_schedules.c carries the same numbers rounded to one decimal.
PAPER_SETTINGS = (
    ("1.5B", 8, 18.522, 18.086, 9.337, 0.601, 2304, 24, (24, 32, 64)),
    ("6.2B", 8, 29.718, 29.468, 19.927, 0.527, 4096, 32, (24, 32, 64)),
    ("14.6B", 16, 11.347, 11.248, 8.132, 0.377, 5120, 40, (48, 64, 128)),
    ("28.3B", 32, 10.419, 10.207, 7.715, 0.408, 6144, 48, (96, 128, 256)),
)
PAPER_SEQ = 1024
EQUAL_MEM = (2, -1, -1)  # mem_f, mem_b, mem_w for w_share 0.5, exact in integers


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- loading the reference -----------------------------------------------------------------------


class ReferenceError(Exception):
    """The reference checkout is missing or its scheduler files cannot be loaded."""


def reference_path(arg=None):
    """The checkout from --reference or $ZBPP_ZB_FORK; raises ReferenceError with what to set."""
    path = arg or os.environ.get(ENV_REFERENCE)
    if not path:
        raise ReferenceError(
            f"no reference checkout: pass --reference PATH or set {ENV_REFERENCE} to a checkout of "
            "https://github.com/sail-sg/zero-bubble-pipeline-parallelism")
    missing = [f for f in ("graph.py", "zb.py", "zbv.py", "zbv_greedy.py")
               if not os.path.isfile(os.path.join(path, SCHEDULER_DIR, f))]
    if missing:
        raise ReferenceError(
            f"{path} is not a checkout of sail-sg/zero-bubble-pipeline-parallelism: "
            f"{SCHEDULER_DIR}/ lacks {', '.join(missing)}")
    return os.path.abspath(path)


def load_reference(path):
    """Loads graph.py, zb.py, zbv.py and zbv_greedy.py from the checkout without importing the fork's
    megatron package (its __init__ pulls in most of Megatron). The modules import their siblings by
    absolute name, so empty packages stand in for megatron.core... while they load; sys.modules is
    restored afterwards, so a real megatron imported later (other tests) is not shadowed.

    zb.py imports torch (for a type annotation) and pulp (for pulp.value in create_scheduled_nodes,
    which this script does not call): the real ones are used when installed, else small stand-ins.
    Returns a namespace with .graph, .zb, .zbv, .zbv_greedy and .path.
    """
    sched = os.path.join(path, SCHEDULER_DIR)
    parts = _REF_PACKAGE.split(".")
    packages = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    # Only what this function puts in sys.modules is taken out again; a real torch imported here
    # stays (importing torch twice in one process fails).
    saved = {name: sys.modules.get(name) for name in packages + [_REF_PACKAGE + ".graph", "torch", "pulp"]}
    stand_ins = []
    try:
        for name in packages:
            pkg = types.ModuleType(name)
            pkg.__path__ = []
            sys.modules[name] = pkg
        for name, fill in (("torch", {"Tensor": object}), ("pulp", {"value": lambda x: x})):
            try:
                importlib.import_module(name)
            except ImportError:
                stub = types.ModuleType(name)
                stub.__dict__.update(fill)
                sys.modules[name] = stub
                stand_ins.append(name)

        def load(name, filename):
            spec = importlib.util.spec_from_file_location(name, os.path.join(sched, filename))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            return mod

        graph = load(_REF_PACKAGE + ".graph", "graph.py")
        zb = load("_zbpp_reference_zb", "zb.py")
        zbv = load("_zbpp_reference_zbv", "zbv.py")
        zbv_greedy = load("_zbpp_reference_zbv_greedy", "zbv_greedy.py")
    except Exception as exc:
        raise ReferenceError(f"cannot load the reference's schedulers from {sched}: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        for name, mod in saved.items():
            if name in ("torch", "pulp") and name not in stand_ins:
                continue
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        for name in ("_zbpp_reference_zb", "_zbpp_reference_zbv", "_zbpp_reference_zbv_greedy"):
            sys.modules.pop(name, None)
    return types.SimpleNamespace(graph=graph, zb=zb, zbv=zbv, zbv_greedy=zbv_greedy, path=path,
                                 stand_ins=stand_ins)


# ---- cases ---------------------------------------------------------------------------------------


def make_case(family, placement, ref, p, m, f, b, w, comm=0.0, limit=None, mem=EQUAL_MEM, label=""):
    """One input. f/b/w: per-rank times (numbers) or, for loop placement, per-stage lists of p.
    ref: 'zb', 'zbv', 'v-half' or 'v-min'. limit: zbpp memory limit in microbatches (None: none).
    mem: the reference's integer (mem_f, mem_b, mem_w), which fixes w_share = -mem_w / mem_f."""
    def per_stage(x):
        return [float(t) for t in x] if isinstance(x, (list, tuple)) else [float(x)] * p
    if placement == "loop":
        f, b, w = per_stage(f), per_stage(b), per_stage(w)
    else:
        f, b, w = float(f), float(b), float(w)
    assert mem[0] + mem[1] + mem[2] == 0 and mem[0] > 0
    limit_text = "" if limit is None else (
        f" limit {'p' if limit == p else '2p' if limit == 2 * p else f'{limit:g}'}")
    name = f"{label + ' ' if label else ''}p={p} m={m}{limit_text}"
    return {
        "family": family, "placement": placement, "ref": ref, "p": p, "m": m,
        "f": f, "b": b, "w": w, "comm": float(comm), "limit": limit, "mem": list(mem),
        "w_share": -mem[2] / mem[0], "name": name,
    }


def paper_mem(h, a, s=PAPER_SEQ):
    """The paper's activation memory per layer (Table 1) in integer units of b*s (microbatch size
    times sequence length): M_F = 34h + 5as, M_W = 32h, so B frees 2h + 5as."""
    mf, mw = 34 * h + 5 * a * s, 32 * h
    return (mf, -(mf - mw), -mw)


def _rt(rng, lo, hi, digits=3):
    return round(rng.uniform(lo, hi), digits)


def build_cases(seed=0, quick=False):
    """Every case, in family order. quick keeps a few per family (first, middle, last)."""
    rng = random.Random(seed)
    fams = {}

    def add(case):
        fams.setdefault(case["family"], []).append(case)

    for p in (2, 4, 8, 16):
        for mult in (1, 2, 4, 8):
            for lim in (1, 2):
                add(make_case("loop equal", "loop", "zb", p, mult * p, 1, 1, 1, 0, lim * p))
    for name, p, tf, tb, tw, tc, h, a, ms in PAPER_SETTINGS:
        for m in ms:
            for lim in (1, 2):
                add(make_case("loop paper", "loop", "zb", p, m, tf, tb, tw, tc, lim * p, paper_mem(h, a), name))
    for k in range(80):
        p = rng.choice((2, 3, 4, 6, 8, 12, 16))
        m = max(1, int(round(p * rng.choice((1, 1.5, 2, 3, 4, 6)))))
        t = (_rt(rng, 0.5, 2), _rt(rng, 0.5, 2), _rt(rng, 0.5, 2), _rt(rng, 0, 0.3))
        for lim in (1, 2):
            add(make_case("loop random", "loop", "zb", p, m, *t, lim * p, label=f"#{k}"))
    for k in range(32):
        p = rng.choice((4, 8, 16))
        m = p * rng.choice((2, 3, 4))
        which = rng.choice(("first", "last", "both"))
        base = [_rt(rng, 0.5, 2) for _ in range(3)]
        comm = _rt(rng, 0, 0.3)
        heavy = {0: _rt(rng, 1.2, 2.5, 2)} if which in ("first", "both") else {}
        if which in ("last", "both"):
            heavy[p - 1] = _rt(rng, 1.2, 2.5, 2)
        times = [[round(base[k] * heavy.get(s, 1.0), 4) for s in range(p)] for k in range(3)]
        label = f"#{k} " + "+".join(f"{'first' if s == 0 else 'last'}x{x:g}" for s, x in sorted(heavy.items()))
        for lim in (1, 2):
            add(make_case("loop per-stage", "loop", "zb", p, m, *times, comm, lim * p, label=label))
    for p in (2, 4, 8, 16):
        for mult in (1, 2, 4, 8):
            add(make_case("zb-v equal", "v", "zbv", p, mult * p, 1, 1, 1, 0, p))
    for name, p, tf, tb, tw, tc, h, a, ms in PAPER_SETTINGS:
        for m in ms:
            add(make_case("zb-v paper", "v", "zbv", p, m, tf, tb, tw, tc, p, paper_mem(h, a), name))
    for k in range(16):
        p = rng.choice((2, 3, 4, 6, 8, 12))
        m = p * rng.choice((1, 2, 3, 4, 6))
        add(make_case("zb-v random", "v", "zbv", p, m, _rt(rng, 0.5, 2), _rt(rng, 0.5, 2), _rt(rng, 0.5, 2),
                      _rt(rng, 0, 0.3), p, label=f"#{k}"))
    for kind in ("v-half", "v-min"):
        fam = kind
        for p in (2, 3, 4, 6, 8, 12):
            for mult in (2, 4):
                add(make_case(fam, "v", kind, p, mult * p, 1, 1, 1, 0, None, label="equal"))
        for k in range(18):
            p = rng.choice((2, 3, 4, 5, 6, 8))
            m = p * rng.choice((2, 3, 4, 6))
            add(make_case(fam, "v", kind, p, m, _rt(rng, 0.5, 2), _rt(rng, 0.5, 2), _rt(rng, 0.5, 2),
                          _rt(rng, 0, 0.3), None, label=f"random #{k}"))
    out = []
    for cases in fams.values():
        if quick:
            picks = sorted({0, len(cases) // 2, len(cases) - 1})
            cases = [cases[i] for i in picks]
        out.extend(cases)
    return out


# ---- the reference's schedules as zbpp op lists --------------------------------------------------


def reference_loop(ref, case):
    """zb.py's initial_solution -> (rank_ops, the reference's own cost estimate)."""
    p, m = case["p"], case["m"]
    mf, mb, mw = case["mem"]
    cfg = ref.graph.GraphConfig(
        mem_f=[mf] * p, mem_b=[mb] * p, mem_w=[mw] * p, max_mem=[case["limit"] * mf] * p,
        cost_f=list(case["f"]), cost_b=list(case["b"]), cost_w=list(case["w"]),
        cost_comm=case["comm"], n_stages=p, n_micro=m)
    graph = ref.zb.Graph.build_graph(p, m, cfg)
    best_time, order, completion = ref.zb.initial_solution(graph, print_result=False)
    # manual_order can finish without placing every op: with a heavy first stage it sometimes never
    # puts the last forwards of stage 0 (their completion time stays at its initial 0, and its own
    # estimate counts them as done). Every placed op ends after a positive cost, so 0 means unplaced.
    missing = [f"stage {s} {'FBW'[t]} mb {mb_}" for t in range(3) for s in range(p) for mb_ in range(m)
               if completion[graph.get_id(t, s, mb_)] <= 0]
    if missing:
        raise RuntimeError(f"zb.py's initial_solution left {len(missing)} ops unplaced ({', '.join(missing[:4])}"
                           f"{', ...' if len(missing) > 4 else ''}) while reporting a time of {best_time:.6g}")
    rank_ops = []
    for stage in range(p):
        nodes = sorted((completion[graph.get_id(t, stage, mb_)], order[graph.get_id(t, stage, mb_)], t, mb_)
                       for t in range(3) for mb_ in range(m))
        rank_ops.append([("FBW"[t], stage, mb_) for _, _, t, mb_ in nodes])
    return rank_ops, float(best_time)


def _v_stage(p, rank, model_chunk):
    return rank if model_chunk == 0 else 2 * p - 1 - rank


def reference_zbv(ref, case, literal_chunks=False):
    """zbv.py's best try_v_schedule -> (rank_ops, own estimate). literal_chunks=True takes the raw
    B/W chunk index as the model chunk (wrong; kept to show that the validator rejects it)."""
    p, m = case["p"], case["m"]
    mf, mb, mw = case["mem"]
    costs = (case["f"] / 2, case["b"] / 2, case["w"] / 2)
    graph = ref.zbv.PipelineGraph(p, m, *costs, case["comm"], mf, mb, mw, max_mem=2 * case["limit"] * mf)
    best = None
    for fill_b in (True, False):  # create_schedule's grid, in its order
        for fill_f in (True, False):
            schedule, _, max_bubble = graph.try_v_schedule(fill_f=fill_f, fill_b=fill_b)
            if best is None or max_bubble < best[1]:
                best = (schedule, max_bubble)
    schedule, max_bubble = best
    rank_ops = []
    for rank in range(p):
        ops = []
        for cat, chunk, mb_ in schedule[rank]:
            model_chunk = chunk if (cat == 0 or literal_chunks) else 1 - chunk
            ops.append(("FBW"[cat], _v_stage(p, rank, model_chunk), mb_))
        rank_ops.append(ops)
    # try_v_schedule counts idle time after a rank's first F; every rank is busy 2m(f + b + w).
    estimate = 2 * m * sum(costs) + max_bubble
    return rank_ops, float(estimate)


# zbv_greedy's stage_order types: (op, model chunk).
GREEDY_TYPES = {0: ("F", 0), 1: ("F", 1), 2: ("B", 1), 3: ("B", 0), 4: ("W", 1), 5: ("W", 0)}


def reference_greedy(ref, case):
    """zbv_greedy's schedule_from_pattern for 'half' or 'min' -> (rank_ops, own estimate)."""
    p, m = case["p"], case["m"]
    mode = {"v-half": "half", "v-min": "min"}[case["ref"]]
    costs = (case["f"] / 2, case["b"] / 2, case["w"] / 2)
    graph = ref.zbv_greedy.PipelineGraph(p, m, mode, *costs, case["comm"])
    pattern = {"half": graph.stable_pattern_v_half, "min": graph.stable_pattern_v_min}[mode](p)
    max_time, _, stage_order = graph.schedule_from_pattern(pattern, m, [costs[x // 2] for x in range(6)])
    rank_ops = [[(GREEDY_TYPES[t][0], _v_stage(p, rank, GREEDY_TYPES[t][1]), mb_) for t, mb_ in stage_order[rank]]
                for rank in range(p)]
    return rank_ops, float(max_time)


def reference_ops(ref, case):
    fn = {"zb": reference_loop, "zbv": reference_zbv, "v-half": reference_greedy, "v-min": reference_greedy}
    return fn[case["ref"]](ref, case)


# ---- zbpp ----------------------------------------------------------------------------------------


def zbpp_times(case):
    if case["placement"] == "loop":
        return {"f": case["f"], "b": case["b"], "w": case["w"]}
    return (case["f"], case["b"], case["w"])


def zbpp_generators(case):
    """(label, kind, v, mem_limit) of the zbpp generators compared on this case. zb-auto with v = 2
    schedules a V (the library picks V placement for zb-auto when v = 2)."""
    if case["ref"] == "zb":
        return [("zb-auto", "zb-auto", 1, case["limit"])]
    if case["ref"] == "zbv":
        return [("zb-v", "zb-v", 2, case["limit"]), ("zb-auto v=2", "zb-auto", 2, case["limit"])]
    # v-half / v-min: the handcrafted kind, and zb-auto held to the reference's own peak (filled in
    # by run_case once that peak is known).
    return [(case["ref"], case["ref"], 2, None), ("zb-auto v=2 @ref peak", "zb-auto", 2, "ref-peak")]


def _figures(schedule):
    r = schedule.simulate()
    return {"cost": r.cost, "bubble": r.bubble_rate, "busy": r.busy, "peak": r.max_peak_memory,
            "makespan": schedule.makespan()}


def _bound_figures(schedule):
    """zbpp's lower bound for the schedule's shape, costs and memory limit (zb_schedule_cost_bound):
    no order, the reference's included, can be shorter."""
    bound = schedule.cost_bound()
    return {"bound": bound, "bubble_bound": schedule.bubble_bound()}


def evaluate_ops(rank_ops, case):
    """Builds, validates (under the case's limit) and simulates op lists; returns figures or error."""
    try:
        with zbpp.Schedule.from_ops(rank_ops, case["m"], placement=case["placement"], times=zbpp_times(case),
                                    comm=case["comm"], w_share=case["w_share"], mem_limit=case["limit"]) as s:
            s.validate()
            return _figures(s)
    except (zbpp.ZbError, ValueError, TypeError) as exc:
        return {"error": f"zbpp rejects it: {exc}"}


def run_zbpp(case, kind, v, limit):
    try:
        t0 = time.perf_counter()
        s = zbpp.Schedule.generate(kind, case["p"], case["m"], v=v, times=zbpp_times(case), comm=case["comm"],
                                   w_share=case["w_share"], mem_limit=limit)
        gen_ms = (time.perf_counter() - t0) * 1e3
        with s:
            if s.placement != case["placement"]:
                return {"error": f"zbpp's {kind} gave placement {s.placement}, expected {case['placement']}"}
            s.validate()
            out = _figures(s)
            out.update(_bound_figures(s))
            out["gen_ms"] = gen_ms
            return out
    except (zbpp.ZbError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def classify(zbpp_cost, ref_cost):
    diff = zbpp_cost - ref_cost
    if abs(diff) <= TIE_RTOL * max(abs(ref_cost), 1e-300):
        return "tie"
    return "win" if diff < 0 else "loss"


def run_case(ref, case):
    """The reference once, then every zbpp generator for the case: a list of result rows."""
    t0 = time.perf_counter()
    try:
        rank_ops, estimate = reference_ops(ref, case)
        ref_ms = (time.perf_counter() - t0) * 1e3
        ref_res = evaluate_ops(rank_ops, case)
        ref_res["ref_ms"] = ref_ms
        ref_res["own_estimate"] = estimate
    except Exception as exc:  # the reference's heuristics assert and raise on shapes they cannot do
        ref_res = {"error": f"reference heuristic failed: {type(exc).__name__}: {exc}"}
    rows = []
    for label, kind, v, limit in zbpp_generators(case):
        if limit == "ref-peak":
            if "error" in ref_res:
                z = {"error": "not run: the reference has no valid schedule to take the peak from"}
            else:
                limit = ref_res["peak"]
                z = run_zbpp(case, kind, v, limit)
        else:
            z = run_zbpp(case, kind, v, limit)
        row = {
            "family": case["family"], "zbpp_generator": label, "group": f"{case['family']} [{label}]",
            "case": case["name"], "p": case["p"], "m": case["m"], "placement": case["placement"],
            "times": {k: case[k] for k in ("f", "b", "w")}, "comm": case["comm"], "w_share": case["w_share"],
            "limit": case["limit"], "zbpp_limit": limit,
            "zbpp": z, "reference": ref_res,
        }
        if "error" in z and "error" in ref_res:
            row["outcome"] = "both failed"
        elif "error" in ref_res:
            row["outcome"] = "reference invalid"
        elif "error" in z:
            row["outcome"] = "zbpp failed"
        else:
            row["outcome"] = classify(z["cost"], ref_res["cost"])
            row["rel_diff"] = (z["cost"] - ref_res["cost"]) / ref_res["cost"]
            row["zbpp_more_memory"] = z["peak"] > ref_res["peak"] + 1e-9
        if "error" not in ref_res:
            est, sim = ref_res["own_estimate"], ref_res["cost"]
            row["estimate_matches"] = abs(est - sim) <= TIE_RTOL * max(abs(sim), 1.0)
        rows.append(row)
    return rows


# ---- the report ----------------------------------------------------------------------------------


def summarize(rows):
    """One summary per group (family x zbpp generator), in first-seen order."""
    groups = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    out = []
    for group, rs in groups.items():
        cmp_rows = [r for r in rs if r["outcome"] in ("win", "tie", "loss")]
        count = {k: sum(r["outcome"] == k for r in rs)
                 for k in ("win", "tie", "loss", "reference invalid", "zbpp failed", "both failed")}
        losses = [r for r in cmp_rows if r["outcome"] == "loss"]
        worst = max(losses, key=lambda r: r["rel_diff"]) if losses else None
        est_rows = [r for r in rs if "estimate_matches" in r]
        bound_rows = [r for r in cmp_rows if "bound" in r["zbpp"]]
        out.append({
            "group": group, "cases": len(rs), **count,
            "mean_bubble_zbpp": _mean(r["zbpp"]["bubble"] for r in cmp_rows),
            "mean_bubble_reference": _mean(r["reference"]["bubble"] for r in cmp_rows),
            "mean_rel_diff": _mean(r["rel_diff"] for r in cmp_rows),
            "mean_bubble_bound": _mean(r["zbpp"]["bubble_bound"] for r in bound_rows),
            "zbpp_at_bound": sum(r["zbpp"]["cost"] <= r["zbpp"]["bound"] * (1 + TIE_RTOL) for r in bound_rows),
            "reference_at_bound": sum(r["reference"]["cost"] <= r["zbpp"]["bound"] * (1 + TIE_RTOL) for r in bound_rows),
            "reference_below_bound": [r["case"] for r in bound_rows
                                      if r["reference"]["cost"] < r["zbpp"]["bound"] * (1 - 1e-9)],
            "worst_loss": None if worst is None else {"rel_diff": worst["rel_diff"], "case": worst["case"]},
            "best_win": _best_win(cmp_rows),
            "zbpp_more_memory": [r["case"] for r in cmp_rows if r.get("zbpp_more_memory")],
            "mean_peak_zbpp": _mean(r["zbpp"]["peak"] for r in cmp_rows),
            "mean_peak_reference": _mean(r["reference"]["peak"] for r in cmp_rows),
            "estimate_matches": sum(r["estimate_matches"] for r in est_rows),
            "estimate_checked": len(est_rows),
            "reference_errors": sorted({_short(r["reference"]["error"]) for r in rs if "error" in r["reference"]}),
            "zbpp_errors": sorted({_short(r["zbpp"]["error"]) for r in rs if "error" in r["zbpp"]}),
        })
    return out


def _best_win(rows):
    wins = [r for r in rows if r["outcome"] == "win"]
    if not wins:
        return None
    best = min(wins, key=lambda r: r["rel_diff"])
    return {"rel_diff": best["rel_diff"], "case": best["case"]}


def _short(text, n=150):
    return text if len(text) <= n else text[: n - 3] + "..."


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def _pct(x, signed=False):
    if x is None:
        return "n/a"
    return f"{x * 100:+.2f}%" if signed else f"{x * 100:.2f}%"


def format_table(summary):
    header = ["family", "cases", "zbpp wins / ties / losses", "mean bubble zbpp vs reference", "worst loss",
              "lower bound: mean bubble, zbpp / reference at it"]
    lines = []
    for s in summary:
        wtl = f"{s['win']} / {s['tie']} / {s['loss']}"
        extra = [f"{s[k]} {k}" for k in ("reference invalid", "zbpp failed", "both failed") if s[k]]
        if extra:
            wtl += " (" + ", ".join(extra) + ")"
        bubble = f"{_pct(s['mean_bubble_zbpp'])} vs {_pct(s['mean_bubble_reference'])}"
        worst = s["worst_loss"]
        worst = "none" if worst is None else f"{_pct(worst['rel_diff'], True)} ({worst['case']})"
        bound = (f"{_pct(s['mean_bubble_bound'])}, {s['zbpp_at_bound']} / {s['reference_at_bound']}"
                 if s["mean_bubble_bound"] is not None else "n/a")
        lines.append([s["group"], str(s["cases"]), wtl, bubble, worst, bound])
    widths = [max(len(r[i]) for r in lines + [header]) for i in range(len(header))]

    def fmt(r):
        return "| " + " | ".join(c.ljust(wd) for c, wd in zip(r, widths)) + " |"
    return "\n".join([fmt(header), "|" + "|".join("-" * (wd + 2) for wd in widths) + "|"] + [fmt(r) for r in lines])


def format_notes(summary):
    notes = []
    for s in summary:
        parts = []
        if s["estimate_checked"]:
            parts.append(f"reference's own estimate = zbpp re-simulation in "
                         f"{s['estimate_matches']}/{s['estimate_checked']}")
        if s["best_win"]:
            parts.append(f"best win {_pct(s['best_win']['rel_diff'], True)} ({s['best_win']['case']})")
        if s["mean_rel_diff"] is not None:
            parts.append(f"mean zbpp-vs-reference {_pct(s['mean_rel_diff'], True)}")
            parts.append(f"mean peak zbpp {s['mean_peak_zbpp']:.3g} vs reference {s['mean_peak_reference']:.3g}")
        if s["mean_bubble_bound"] is not None and s["mean_bubble_reference"]:
            target = 0.9 * s["mean_bubble_reference"]
            parts.append(f"10% below the reference would be a mean bubble of {_pct(target)}; the lower bound's mean is "
                         f"{_pct(s['mean_bubble_bound'])}"
                         + (" (out of reach for any scheduler)" if s["mean_bubble_bound"] > target else ""))
        if s["reference_below_bound"]:
            parts.append(f"BOUND BROKEN: the reference is shorter than the lower bound in {len(s['reference_below_bound'])} "
                         f"cases ({', '.join(s['reference_below_bound'][:4])})")
        if s["zbpp_more_memory"]:
            shown = ", ".join(s["zbpp_more_memory"][:4]) + (", ..." if len(s["zbpp_more_memory"]) > 4 else "")
            parts.append(f"ZBPP PEAKS HIGHER in {len(s['zbpp_more_memory'])} cases ({shown})")
        notes.append(f"- {s['group']}: " + "; ".join(parts))
        for who in ("reference", "zbpp"):
            errors = s[who + "_errors"]
            for e in errors[:3]:
                notes.append(f"    {who}: {e}")
            if len(errors) > 3:
                notes.append(f"    {who}: ... and {len(errors) - 3} more (--verbose or --json for each)")
    return "\n".join(notes)


def format_row(row):
    z, r = row["zbpp"], row["reference"]

    def side(x):
        if "error" in x:
            return "ERROR"
        return f"{x['cost']:.6g} ({_pct(x['bubble'])}, peak {x['peak']:.4g})"
    est = ""
    if "own_estimate" in r:
        est = f" own-est {r['own_estimate']:.6g}" + ("" if row.get("estimate_matches") else " MISMATCH")
    diff = f" {_pct(row['rel_diff'], True)}" if "rel_diff" in row else ""
    mem = " MORE MEMORY" if row.get("zbpp_more_memory") else ""
    line = (f"  {row['group']:<34} {row['case']:<32} zbpp {side(z):<34} ref {side(r):<34}{est} "
            f"-> {row['outcome']}{diff}{mem}")
    for who, x in (("zbpp", z), ("ref", r)):
        if "error" in x:
            line += f"\n      {who}: {_short(x['error'], 300)}"
    return line


# ---- generation time at scale --------------------------------------------------------------------


def time_at_scale(ref, p, m, repeats):
    """zb-auto (limit p, equal costs) against zb.py's initial_solution on the same input."""
    case = make_case("timing", "loop", "zb", p, m, 1, 1, 1, 0, p)
    zb_ms, ref_ms = [], []
    z = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        s = zbpp.Schedule.generate("zb-auto", p, m, times=zbpp_times(case), mem_limit=p)
        zb_ms.append((time.perf_counter() - t0) * 1e3)
        with s:
            z = s.validate().simulate()
    for _ in range(repeats):
        t0 = time.perf_counter()
        rank_ops, estimate = reference_loop(ref, case)
        ref_ms.append((time.perf_counter() - t0) * 1e3)
    r = evaluate_ops(rank_ops, case)
    return {"p": p, "m": m, "repeats": repeats, "zbpp_ms": min(zb_ms), "reference_ms": min(ref_ms),
            "zbpp_cost": z.cost, "reference_cost": r.get("cost"), "reference_error": r.get("error")}


# ---- main ----------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", metavar="PATH",
                    help=f"checkout of sail-sg/zero-bubble-pipeline-parallelism (default: ${ENV_REFERENCE})")
    ap.add_argument("--quick", action="store_true", help="three cases per family and a small timing run")
    ap.add_argument("--verbose", action="store_true", help="a line per case")
    ap.add_argument("--json", metavar="FILE", help="write every row, the summaries and the timing as JSON")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random families (default 0)")
    ap.add_argument("--no-timing", action="store_true", help="skip the p=64, m=1024 generation-time comparison")
    args = ap.parse_args(argv)

    try:
        ref = load_reference(reference_path(args.reference))
    except ReferenceError as exc:
        print(f"compare_reference: {exc}", file=sys.stderr)
        return 2

    started = time.perf_counter()
    cases = build_cases(args.seed, args.quick)
    log(f"compare_reference: {len(cases)} cases against {ref.path}; library {zbpp._lib.library_path()}")
    rows = []
    last_log = time.perf_counter()
    for i, case in enumerate(cases):
        rows.extend(run_case(ref, case))
        if time.perf_counter() - last_log > 5 or i == len(cases) - 1:
            log(f"  {i + 1}/{len(cases)} cases ({case['family']}, {time.perf_counter() - started:.0f} s)")
            last_log = time.perf_counter()

    summary = summarize(rows)
    print(f"zbpp against the reference heuristics, both simulated by zbpp "
          f"(seed {args.seed}{', quick' if args.quick else ''}; tie = within {TIE_RTOL:g} relative)\n")
    print(format_table(summary))
    print()
    print(format_notes(summary))
    if args.verbose:
        print("\nper case (cost, bubble, peak memory in microbatches through a rank's layers):")
        for row in rows:
            print(format_row(row))

    timing = None
    if not args.no_timing:
        p, m, reps = 64, 1024, (1 if args.quick else 3)
        log(f"timing zb-auto against zb.py's initial_solution at p={p} m={m} (best of {reps})")
        timing = time_at_scale(ref, p, m, reps)
        ref_cost = timing["reference_cost"]
        ref_cost = f"{ref_cost:g}" if ref_cost is not None else timing["reference_error"]
        print(f"\ngeneration time at p={p}, m={m} (equal costs, limit p, best of {reps}): zbpp zb-auto "
              f"{timing['zbpp_ms']:.1f} ms (cost {timing['zbpp_cost']:g}); reference zb.py initial_solution "
              f"{timing['reference_ms']:.1f} ms (cost {ref_cost})")
    elapsed = time.perf_counter() - started
    print(f"\n{len(cases)} cases, {len(rows)} comparisons in {elapsed:.1f} s")

    if args.json:
        doc = {
            "meta": {"reference": ref.path, "library": zbpp._lib.library_path(), "seed": args.seed,
                     "quick": args.quick, "python": platform.python_version(), "stand_ins": ref.stand_ins,
                     "seconds": elapsed, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
            "summary": summary, "timing": timing, "rows": rows,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, default=float)
        log(f"wrote {args.json}")
    broken = [c for s in summary for c in s["reference_below_bound"]]
    if broken:
        print(f"compare_reference: the reference is shorter than zbpp's lower bound in {len(broken)} case(s): "
              "zb_schedule_cost_bound is wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
