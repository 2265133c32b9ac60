"""Per-stage costs measured from a run, the zbpp-costs file that holds them, and plans made from them.

What this is: `StageCosts`, the costs the schedule generators take (DESIGN.md section 3): for each
stage s of S = ranks * chunks, the time of one microbatch's F, B, W (and fused BW) through that
stage, the time a transfer between ranks adds (T_comm), the share of activations only W needs
(w_share) and, when measured, the activation bytes one microbatch's forward leaves on that stage.
It is saved and read as one JSON object, the "zbpp-costs" format version 1, which the `zbpp` tool
reads too (`zbpp schedule KIND --stage-times FILE`):

    {"format": "zbpp-costs", "version": 1, "unit": "ms", "ranks": 2, "chunks": 2, "placement": "v",
     "time_f": [S], "time_b": [S], "time_w": [S], "time_bw": [S] or null,
     "time_comm": 0.05, "w_share": 0.41, "mem_f_bytes": [S], "op_overhead": 0.2,
     "overhead_f": [S], "overhead_b": [S], "overhead_w": [S], "overhead_bw": [S] or null}

Times are absolute per stage, in milliseconds (zb_schedule_spec_t.stage_time_*, not a per-rank
time divided by v). time_bw null means B + W. Reading follows the tool's rules: time_f, time_b and
time_w are required, null is the same as a missing optional key, a key given twice is an error and
keys this version does not know are skipped. This module also requires format, version, ranks,
chunks and placement, which it needs to plan.

Where the numbers come from (`StageCosts.from_timelines`): a run's measured timelines (a
zbpp.Schedule after set_times, as PipelineSchedule.timeline() returns, one per step). Op durations
are the runner's own timestamps, which start once an op's input has arrived, so waiting is not
counted; each stage's cost is the median over every op of that type and stage in all the steps
given (robust to a slow microbatch or a pause). T_comm is the median gap between a producer's end
and its consumer's start over the cross-rank dependencies whose consumer was idle, waiting for that
input: its rank's previous op had ended before the producer did (so the gap is transfer time, not
queueing behind other work), less the runtime's per-op overhead; 0 when there is no such
dependency. That overhead (op_overhead) is the median gap between two consecutive ops of a rank
where the second's inputs had all arrived when the first ended: only the runtime (callbacks,
posting transfers) kept the rank from starting it. That gap belongs to the first op, and it is not
the same for all: an op whose output goes to another rank is followed by posting the send (a few
tenths of a millisecond over gloo), one that stays on its rank by almost nothing. So each stage and
op type gets its own overhead (overhead_f/b/w/bw: the median gap after its ops; op_overhead, the
median over all, where a type has no sample), T_comm is the wait-gap less the producer's overhead,
and each overhead is added to its op's time, so plans are made for the slots ops really take. They
are kept apart so expected_bubble can predict the bubble as the runner's timestamps measure it (the
overhead idle). Clocks must be comparable across ranks (one host, CLOCK_MONOTONIC), as for
timeline().

Activation memory (`ActivationMeter`): the bytes autograd has saved for the backward of a stage's
forward of one microbatch, read from the graph (each storage once, parameters and buffers left
out); the W-only part is what split layers save as their input and nothing else
saves (zbpp.split_linear's layers keep x for W's dW = dY^T X; B needs dY and the weight only), so
w_share = W-only bytes / saved bytes over all stages.

`StageCosts.plan(kind, microbatches, mem_limit)` generates a schedule of a kind from the costs. A
memory limit may be microbatches (a number, or "2p"), as everywhere, or bytes ("8GB", "512 MiB";
kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024): bytes are turned into microbatches of
the heaviest rank, the one whose stages keep the most activation bytes per microbatch.

What this is not: a profiler of its own. The torch integration (pipelining.py) records the
timelines and the memory during its first steps and calls this; the C scheduler does the planning.
Importing this module does not import torch.
"""

import json
import math
import numbers
import os
import random
import re
import statistics
import time

from ._files import write_text
from .schedule import Schedule, _resolve_kind

__all__ = ["StageCosts", "ActivationMeter", "FORMAT", "VERSION", "parse_mem_limit", "parse_bytes"]

FORMAT = "zbpp-costs"
VERSION = 1
_PLACEMENTS = ("loop", "v")
_OP_KEYS = ("f", "b", "w", "bw")
_V_KINDS = ("zb-v", "v-half", "v-min")

_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_bytes(text):
    """Bytes from a size such as "8GB", "8 GiB", "512MB", "1e9B"; None when `text` is not one."""
    if not isinstance(text, str):
        return None
    match = _BYTES_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_LIMIT_HELP = ("give microbatches of a rank's activations (a number such as 6, or a multiple of p: "
               "'p', '2p', '1.5p') or bytes of activation memory per rank ('8GB', '512MiB'; kB/MB/GB are "
               "powers of 1000, KiB/MiB/GiB of 1024)")


def parse_mem_limit(mem_limit):
    """What a memory limit means: (None, None) for none, ("microbatches", value) for a number or a
    multiple of p (the value as given: Schedule.generate reads it), ("bytes", n) for a size.
    Raises ValueError for anything else."""
    if mem_limit is None:
        return None, None
    if isinstance(mem_limit, bool):
        raise ValueError(f"mem_limit {mem_limit!r} is not understood; {_LIMIT_HELP}")
    if isinstance(mem_limit, numbers.Real):
        if not math.isfinite(mem_limit) or mem_limit <= 0:
            raise ValueError(f"mem_limit must be > 0, got {mem_limit!r}; {_LIMIT_HELP}")
        return "microbatches", mem_limit
    if not isinstance(mem_limit, str):
        raise ValueError(f"mem_limit {mem_limit!r} is not understood; {_LIMIT_HELP}")
    n = parse_bytes(mem_limit)
    if n is not None:
        if n <= 0:
            raise ValueError(f"mem_limit {mem_limit!r} is no memory at all; {_LIMIT_HELP}")
        return "bytes", n
    text = mem_limit.strip().lower().replace("*", "")
    number = text[:-1].strip() if text.endswith("p") else text
    try:
        value = float(number) if number else 1.0
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0 or (not number and not text.endswith("p")):
        raise ValueError(f"mem_limit {mem_limit!r} is not understood; {_LIMIT_HELP}")
    return "microbatches", mem_limit


def _format_bytes(n):
    for unit, size in (("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


# ---- reading and checking values ------------------------------------------------------------------

def _bad(where, what):
    return ValueError(f"{where}: {what}")


def _finite(x, where, key):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise _bad(where, f"{key} must be a number, got {x!r}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise _bad(where, f"{key} is {x!r}; it must be finite and >= 0")
    return x


def _count(x, where, key):
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or x != int(x) or x < 1:
        raise _bad(where, f"{key} must be a whole number >= 1, got {x!r}")
    return int(x)


def _stage_list(values, S, where, key):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise _bad(where, f"{key} must be a list of {S} numbers (one per stage), got {values!r}")
    values = list(values)
    if len(values) != S:
        raise _bad(where, f"{key} has {len(values)} values; it needs one per stage, S = ranks * chunks = {S}")
    return [_finite(x, where, f"{key}[{i}]") for i, x in enumerate(values)]


# StageCosts.smoothed: per-stage times of one op type within this share of each other (or this
# many ms, near zero) are taken as one cost.
SMOOTH_TOL = 0.2
SMOOTH_FLOOR_MS = 0.05
# StageCosts.snapped: grid points per doubling of a time.
SNAP_STEPS_PER_OCTAVE = 12


class StageCosts:
    """Measured (or given) costs of every stage of a pipeline; see the module docstring.

    ranks, chunks, placement ('loop' or 'v'): the pipeline's shape, S = ranks * chunks stages.
    time_f, time_b, time_w: S times in ms (one microbatch through that stage); time_bw: S times of
    the fused backward or None (B + W); time_comm: ms a transfer between ranks adds; w_share: the
    share of activations only W needs, in [0, 1]; mem_f_bytes: S activation sizes in bytes (what
    one microbatch's forward keeps until its backward) or None; time_offload, time_reload: S times
    in ms to copy those activations to host memory and back (PipeOffload; measure_copy_time) or
    None.
    """

    def __init__(self, ranks, chunks, placement, time_f, time_b, time_w, time_bw=None, time_comm=0.0,
                 w_share=0.5, mem_f_bytes=None, op_overhead=0.0, overheads=None, where="StageCosts",
                 time_offload=None, time_reload=None):
        self.ranks = _count(ranks, where, "ranks")
        self.chunks = _count(chunks, where, "chunks")
        if placement not in _PLACEMENTS:
            raise _bad(where, f"placement is {placement!r}; it is 'loop' or 'v'")
        if placement == "v" and self.chunks != 2:
            raise _bad(where, f"a 'v' placement has 2 chunks per rank, not {self.chunks}")
        self.placement = placement
        S = self.ranks * self.chunks
        self.time_f = _stage_list(time_f, S, where, "time_f")
        self.time_b = _stage_list(time_b, S, where, "time_b")
        self.time_w = _stage_list(time_w, S, where, "time_w")
        self.time_bw = None if time_bw is None else _stage_list(time_bw, S, where, "time_bw")
        self.time_comm = _finite(time_comm, where, "time_comm")
        self.w_share = _finite(w_share, where, "w_share")
        if self.w_share > 1:
            raise _bad(where, f"w_share is {self.w_share}; it is the share of activations only W needs, in [0, 1]")
        self.mem_f_bytes = None if mem_f_bytes is None else _stage_list(mem_f_bytes, S, where, "mem_f_bytes")
        if (time_offload is None) != (time_reload is None):
            raise _bad(where, "time_offload and time_reload go together (the copy to host memory and back)")
        self.time_offload = None if time_offload is None else _stage_list(time_offload, S, where, "time_offload")
        self.time_reload = None if time_reload is None else _stage_list(time_reload, S, where, "time_reload")
        # The part of every op's time that is the runtime's own (the gap between two ops of a rank
        # when the second could have started at once): already in time_f/b/w/bw, so plans account
        # for it; kept apart so a plan's bubble can be predicted as the runner measures it, where
        # that gap is idle time.
        self.op_overhead = _finite(op_overhead, where, "op_overhead")
        self.samples = None  # from_timelines: the measured op durations per type and stage
        # Per stage and op type (a dict of "f", "b", "w", "bw" lists; missing or None: op_overhead).
        given = overheads or {}
        self.overheads = {}
        for key in _OP_KEYS:
            values = given.get(key)
            self.overheads[key] = ([self.op_overhead] * S if values is None
                                   else _stage_list(values, S, where, "overhead_" + key))

    @property
    def stages(self):
        return self.ranks * self.chunks

    # ---- the file format -------------------------------------------------------------------------

    def to_dict(self):
        return {"format": FORMAT, "version": VERSION, "unit": "ms", "ranks": self.ranks, "chunks": self.chunks,
                "placement": self.placement, "time_f": list(self.time_f), "time_b": list(self.time_b),
                "time_w": list(self.time_w), "time_bw": None if self.time_bw is None else list(self.time_bw),
                "time_comm": self.time_comm, "w_share": self.w_share,
                "mem_f_bytes": None if self.mem_f_bytes is None else [int(round(x)) for x in self.mem_f_bytes],
                "op_overhead": self.op_overhead,
                **{"overhead_" + k: list(self.overheads[k]) for k in ("f", "b", "w")},
                "overhead_bw": None if self.time_bw is None else list(self.overheads["bw"]),
                "time_offload": None if self.time_offload is None else list(self.time_offload),
                "time_reload": None if self.time_reload is None else list(self.time_reload)}

    def to_json(self):
        """The zbpp-costs JSON text (one object, a newline at the end)."""
        return json.dumps(self.to_dict(), allow_nan=False) + "\n"

    def save(self, path):
        """Writes the costs as a zbpp-costs JSON file, whole or not at all (_files.py)."""
        return write_text(path, self.to_json())

    @classmethod
    def from_dict(cls, obj, where="zbpp-costs"):
        if not isinstance(obj, dict):
            raise _bad(where, f"a cost file is one JSON object, got {type(obj).__name__}")
        if "format" not in obj or obj["format"] is None:
            raise _bad(where, f'"format" is missing; a cost file says "format": "{FORMAT}"')
        if obj["format"] != FORMAT:
            raise _bad(where, f'"format" is {obj["format"]!r}; a cost file says "{FORMAT}"')
        version = obj.get("version")
        if version is None:
            raise _bad(where, '"version" is missing; this zbpp reads version 1 cost files')
        if isinstance(version, bool) or version != VERSION:
            raise _bad(where, f'"version" is {version!r}; this zbpp reads version {VERSION} cost files')
        unit = obj.get("unit")
        if unit is not None and unit != "ms":
            raise _bad(where, f'"unit" is {unit!r}; version 1 cost files give times in "ms"')
        for key in ("ranks", "chunks", "placement", "time_f", "time_b", "time_w"):
            if obj.get(key) is None:
                raise _bad(where, f'"{key}" is missing')

        def opt(key, default):
            value = obj.get(key)
            return default if value is None else value

        return cls(obj["ranks"], obj["chunks"], obj["placement"], obj["time_f"], obj["time_b"], obj["time_w"],
                   time_bw=obj.get("time_bw"), time_comm=opt("time_comm", 0.0), w_share=opt("w_share", 0.5),
                   mem_f_bytes=obj.get("mem_f_bytes"), op_overhead=opt("op_overhead", 0.0),
                   overheads={k: obj.get("overhead_" + k) for k in _OP_KEYS}, where=where,
                   time_offload=obj.get("time_offload"), time_reload=obj.get("time_reload"))

    @classmethod
    def from_json(cls, text, where="zbpp-costs"):
        def pairs(items):
            seen = {}
            for key, value in items:
                if key in seen:
                    raise _bad(where, f'"{key}" appears twice')
                seen[key] = value
            return seen

        def constant(name):
            raise _bad(where, f"{name} is not a number JSON allows; times must be finite")

        try:
            obj = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
        except json.JSONDecodeError as exc:
            raise _bad(where, f"not JSON: {exc}") from None
        return cls.from_dict(obj, where)

    @classmethod
    def load(cls, path):
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
        return cls.from_json(text, where=os.fspath(path))

    def __eq__(self, other):
        return isinstance(other, StageCosts) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return (f"<zbpp.StageCosts ranks={self.ranks} chunks={self.chunks} placement={self.placement} "
                f"comm={self.time_comm:.3g} ms w_share={self.w_share:.3g}>")

    # ---- measuring -------------------------------------------------------------------------------

    @classmethod
    def from_timelines(cls, timelines, mem_f_bytes=None, w_share=None):
        """Costs from measured timelines: zbpp.Schedule objects after set_times (one per step, all
        of one pipeline), as PipelineSchedule.timeline() returns them. Each stage's F/B/W/BW time is
        the median of its ops' durations over all the timelines; T_comm the median wait-gap of the
        cross-rank dependencies (see the module docstring). A stage that ran only fused BW gets B
        and W of half its BW each; time_bw is None unless some timeline has BW ops.
        mem_f_bytes (S values) and w_share are stored as given (w_share None: 0.5)."""
        timelines = list(timelines)
        if not timelines:
            raise ValueError("StageCosts.from_timelines: no timelines given")
        first = timelines[0]
        p, S, placement = first.ranks, first.stages, first.placement
        v = S // p
        samples = {key: [[] for _ in range(S)] for key in ("F", "B", "W", "BW")}
        gaps, runs = [], []
        for t in timelines:
            if (t.ranks, t.stages, t.placement) != (p, S, placement):
                raise ValueError(f"StageCosts.from_timelines: the timelines are of different pipelines "
                                 f"({p} ranks, {S} stages, {placement} and {t.ranks}, {t.stages}, {t.placement})")
            ops = [t.rank_ops(r) for r in range(p)]
            times = [t.rank_times(r) for r in range(p)]
            where = {}
            for r in range(p):
                for k, op in enumerate(ops[r]):
                    if op.type not in samples:  # a copy (OFFLOAD/RELOAD) runs beside the compute
                        continue
                    where[(op.type, op.stage, op.mb)] = (r, k)
                    samples[op.type][op.stage].append(times[r][1][k] - times[r][0][k])
            gaps += _wait_gaps(ops, times, where, S)
            runs.append((ops, times, where))
        medians = {key: [statistics.median(x) if x else None for x in per] for key, per in samples.items()}
        time_f, time_b, time_w = [], [], []
        for s in range(S):
            f, b, w, bw = (medians[key][s] for key in ("F", "B", "W", "BW"))
            if f is None:
                raise ValueError(f"StageCosts.from_timelines: stage {s} ran no F in the timelines")
            if b is None and w is None:
                if bw is None:
                    raise ValueError(f"StageCosts.from_timelines: stage {s} ran no backward in the timelines")
                b = w = bw / 2
            time_f.append(f)
            time_b.append(b if b is not None else 0.0)
            time_w.append(w if w is not None else 0.0)
        has_bw = any(x is not None for x in medians["BW"])
        time_bw = None
        if has_bw:
            time_bw = [medians["BW"][s] if medians["BW"][s] is not None else time_b[s] + time_w[s] for s in range(S)]
        # The runtime's own gap after each op (see the module docstring): per stage and type where
        # there are samples, else the median over all. It is in the op's time, so plans count it;
        # a wait for another rank includes the producer's gap, which is the producer's, not the
        # transfer's. Which gaps are the runtime's depends on T_comm (an input still in flight is
        # not overhead), and T_comm on the producers' overheads: two rounds settle both.
        comm = 0.0
        for _ in range(2):
            after = {key: [[] for _ in range(S)] for key in ("f", "b", "w", "bw")}
            for ops, times, where in runs:
                for op, gap in _ready_gaps(ops, times, where, S, comm):
                    after[op.type.lower()][op.stage].append(gap)
            everything = [g for per in after.values() for x in per for g in x]
            over = max(0.0, statistics.median(everything)) if everything else 0.0
            overheads = {key: [max(0.0, statistics.median(x)) if x else over for x in per]
                         for key, per in after.items()}
            comm_samples = [gap - overheads[producer.type.lower()][producer.stage] for producer, gap in gaps]
            comm = max(0.0, statistics.median(comm_samples)) if comm_samples else 0.0
        time_f = [x + overheads["f"][s] for s, x in enumerate(time_f)]
        time_b = [x + overheads["b"][s] for s, x in enumerate(time_b)]
        time_w = [x + overheads["w"][s] for s, x in enumerate(time_w)]
        if time_bw is not None:
            time_bw = [x + overheads["bw"][s] for s, x in enumerate(time_bw)]
        out = cls(p, v, placement, time_f, time_b, time_w, time_bw=time_bw, time_comm=comm,
                  w_share=0.5 if w_share is None else w_share, mem_f_bytes=mem_f_bytes, op_overhead=over,
                  overheads=overheads)
        # Every measured duration (without the overhead), for expected_bubble's spread; not saved.
        out.samples = {key.lower(): [list(x) for x in per] for key, per in samples.items()}
        return out

    def expected_bubble(self, schedule, draws=64):
        """The bubble rate the runner should measure for `schedule` on these costs (the paper's
        definition: span minus the busiest rank's work, over the span). Two things the plain
        simulation misses: the runner's timestamps count each op's overhead as idle, where the
        simulator counts it as work; and op times vary (on a shared CPU by tens of percent within a
        step), which mostly adds bubble: an op late on one rank delays the ranks waiting on it. With
        the measured durations at hand (costs from from_timelines), the op order is simulated
        `draws` times with every op's duration drawn from those measured for its stage and type,
        and the median bubble is returned (the main job reports the median over steps too; fewer
        draws on pipelines of more than 30,000 ops); without them (costs loaded from a file), the
        simulation on the medians."""
        sim = schedule.simulate()
        if sim.cost <= 0:
            return 0.0
        ops = [schedule.rank_ops(r) for r in range(schedule.ranks)]
        if any(op.type in ("OFFLOAD", "RELOAD") for rank in ops for op in rank):
            raise ValueError("StageCosts.expected_bubble: the schedule has OFFLOAD/RELOAD copies, which the "
                             "measured costs do not time; give the schedule without them")
        if any(op.type in _VOCAB_OPS for rank in ops for op in rank):
            raise ValueError("StageCosts.expected_bubble: the schedule has Vocabulary Parallelism's passes (S, T, "
                             "IF, IB), which the measured costs do not time yet; give the schedule without them")
        over = [[self.overheads[op.type.lower()][op.stage] for op in rank] for rank in ops]
        pools = None
        if self.samples is not None and draws > 0 and (schedule.ranks, schedule.stages) == (self.ranks, self.stages):
            pools = [[self.samples[op.type.lower()][op.stage] for op in rank] for rank in ops]
            if any(not pool for rank in pools for pool in rank):
                pools = None
        if pools is None:
            busy = 0.0
            for r in range(schedule.ranks):
                _span, rank_busy, _peak = schedule.rank_stats(r)
                busy = max(busy, rank_busy - sum(over[r]))
            return max(0.0, (sim.cost - busy) / sim.cost)
        rng = random.Random(0)  # the same plan gets the same figure
        results = []
        n_ops = sum(len(rank) for rank in ops)
        for _ in range(max(4, min(draws, 2_000_000 // max(n_ops, 1)))):  # a second or two on big pipelines
            work = [[rng.choice(pool) for pool in rank] for rank in pools]
            res = schedule.simulate_durations([[w + o for w, o in zip(wr, orr)] for wr, orr in zip(work, over)])
            busy = max(sum(wr) for wr in work)
            results.append(max(0.0, (res.cost - busy) / res.cost) if res.cost > 0 else 0.0)
        return statistics.median(results)

    # ---- planning --------------------------------------------------------------------------------

    def smoothed(self, tol=SMOOTH_TOL, floor_ms=SMOOTH_FLOOR_MS):
        """These costs with each op type's per-stage times that lie within `tol` of each other (or
        within floor_ms, for times near zero) replaced by their median: stages that cost the same
        measure a little apart on every run (a busier process, a late wake-up), and a plan that
        follows that noise differs from run to run (bench_synthetic: four launches of one
        configuration replanned to four different orders). Real differences (an LM head twice a
        layer, a first stage whose backward is all W) are far larger than tol and stay."""
        def smooth(values):
            if values is None:
                return None
            order = sorted(range(len(values)), key=lambda s: values[s])
            out = list(values)
            group = [order[0]]
            for s in order[1:] + [None]:
                low = values[group[0]]
                if s is not None and values[s] - low <= max(tol * low, floor_ms):
                    group.append(s)
                    continue
                mid = statistics.median(values[g] for g in group)
                for g in group:
                    out[g] = mid
                if s is not None:
                    group = [s]
            return out

        copy = StageCosts(self.ranks, self.chunks, self.placement, smooth(self.time_f), smooth(self.time_b),
                          smooth(self.time_w), smooth(self.time_bw), self.time_comm, self.w_share,
                          self.mem_f_bytes, self.op_overhead, self.overheads, time_offload=smooth(self.time_offload),
                          time_reload=smooth(self.time_reload))
        copy.samples = self.samples
        return copy

    def snapped(self, steps_per_octave=SNAP_STEPS_PER_OCTAVE):
        """These costs with every time (F, B, W, BW per stage, and T_comm) moved to the nearest
        point of a geometric grid anchored at the median forward time: steps_per_octave points
        per doubling (12: points 6% apart, each time moved by at most 3%, the ratios 1/2, 1 and 2
        on the grid). A plan depends on the ratios of the costs, and where two plans tie on
        them, on which side of the tie the measured noise falls: F = 10.3 or 10.4 ms against
        W = 5.1 or 5.2 picked one of two orders per launch (bench_synthetic --stability, zb-v at
        10/10/5 ms), and the two ran 4% apart. Snapped, every launch plans from the same ratios
        unless a cost really moved by a grid step."""
        positive = [t for t in self.time_f if t > 0]
        if not positive or steps_per_octave <= 0:
            return self
        ref = statistics.median(positive)
        # The anchor on a 1/64 ms grid and every result on a 1/1024 ms grid: sums of such times are
        # exact in floating point, so the generator's ties are exact ties, broken by its rules, not
        # by rounding (at F = 4.85 ms and W = F/2 the rounding of a sum picked another order than
        # at F = 5 ms; at exact binary scales the orders agree).
        anchor = max(round(ref * 64.0), 1) / 64.0
        k = float(steps_per_octave)

        def snap(t):
            if t is None or t <= 0:
                return t
            return max(round(anchor * 2.0 ** (round(k * math.log2(t / ref)) / k) * 1024.0), 1) / 1024.0

        def snap_all(values):
            return None if values is None else [snap(t) for t in values]

        copy = StageCosts(self.ranks, self.chunks, self.placement, snap_all(self.time_f), snap_all(self.time_b),
                          snap_all(self.time_w), snap_all(self.time_bw), snap(self.time_comm), self.w_share,
                          self.mem_f_bytes, self.op_overhead, self.overheads,
                          time_offload=snap_all(self.time_offload), time_reload=snap_all(self.time_reload))
        copy.samples = self.samples
        return copy

    def times(self):
        """The costs as Schedule.generate's per-stage `times` dict."""
        out = {"f": list(self.time_f), "b": list(self.time_b), "w": list(self.time_w)}
        if self.time_bw is not None:
            out["bw"] = list(self.time_bw)
        if self.time_offload is not None:
            out["offload"], out["reload"] = list(self.time_offload), list(self.time_reload)
        return out

    def stage_rank(self, s):
        p = self.ranks
        if self.placement == "v":
            return s if s < p else 2 * p - 1 - s
        return s % p

    def rank_bytes(self):
        """Activation bytes one microbatch leaves on each rank (the sum over its stages); None when
        no memory was measured."""
        if self.mem_f_bytes is None:
            return None
        out = [0.0] * self.ranks
        for s, b in enumerate(self.mem_f_bytes):
            out[self.stage_rank(s)] += b
        return out

    def microbatches_for(self, limit_bytes):
        """How many microbatches of the heaviest rank's activations fit in limit_bytes (a float)."""
        per_rank = self.rank_bytes()
        if per_rank is None or max(per_rank) <= 0:
            raise ValueError(f"a memory limit in bytes ({_format_bytes(limit_bytes)}) needs the activation memory "
                             "per microbatch, and these costs have none (mem_f_bytes); measure it "
                             "(plan_from_measured) or give the limit in microbatches")
        return limit_bytes / max(per_rank)

    def mem_limit(self, mem_limit):
        """A limit in the form Schedule.generate takes: bytes turned into microbatches of the
        heaviest rank (see microbatches_for), anything else as given."""
        what, value = parse_mem_limit(mem_limit)
        return self.microbatches_for(value) if what == "bytes" else value

    def _same_placement(self, placement):
        """Whether `placement` puts the stages where self.placement does: on one rank with at most
        two chunks a loop and a V are the same map (every stage on rank 0)."""
        return placement == self.placement or (self.ranks == 1 and self.chunks <= 2
                                               and {placement, self.placement} <= {"loop", "v"})

    def check_shape(self, p, v, placement=None, what="this pipeline"):
        if (self.ranks, self.chunks) != (p, v) or (placement is not None and not self._same_placement(placement)):
            raise ValueError(f"the costs are for {self.ranks} ranks x {self.chunks} chunks ({self.placement}), but "
                             f"{what} has {p} ranks x {v} chunks" + (f" ({placement})" if placement else ""))

    def plan(self, kind, microbatches, mem_limit=None):
        """A zbpp.Schedule of `kind` for these costs: Schedule.generate with the per-stage times,
        T_comm and w_share, under mem_limit (microbatches, "2p", or bytes such as "8GB")."""
        name = _kind_name_of(kind)
        if name in _V_KINDS and not self._same_placement("v"):
            raise ValueError(f"{name} places stages in a V, but the costs are for a {self.placement} placement")
        if name not in _V_KINDS and name != "zb-auto" and not self._same_placement("loop"):
            raise ValueError(f"{name} places stages in a loop, but the costs are for a V placement")
        limit = self.mem_limit(mem_limit)
        try:
            # zb-auto plans for the placement the costs were measured on (loop with any v, or V).
            placement = self.placement if name == "zb-auto" else None
            return Schedule.generate(kind, p=self.ranks, m=microbatches, v=self.chunks, times=self.times(),
                                     comm=self.time_comm, w_share=self.w_share, mem_limit=limit,
                                     placement=placement)
        except Exception as exc:
            if parse_mem_limit(mem_limit)[0] == "bytes" and hasattr(exc, "message"):
                per = max(self.rank_bytes())
                exc.message += (f" (mem_limit {mem_limit!r} is {limit:.3g} microbatches of the heaviest rank's "
                                f"{_format_bytes(per)} of activations each)")
                exc.args = (exc.code, exc.message, exc.name)
            raise

    def table(self):
        """A few lines for a log: the costs of every stage."""
        lines = [f"stage  rank   F (ms)   B (ms)   W (ms)" + ("  BW (ms)" if self.time_bw else "")
                 + ("  act./mb" if self.mem_f_bytes else "") + (" off (ms) rel (ms)" if self.time_offload else "")]
        for s in range(self.stages):
            line = f"{s:5d} {self.stage_rank(s):5d} {self.time_f[s]:8.3f} {self.time_b[s]:8.3f} {self.time_w[s]:8.3f}"
            if self.time_bw:
                line += f" {self.time_bw[s]:8.3f}"
            if self.mem_f_bytes:
                line += f"  {_format_bytes(self.mem_f_bytes[s]):>8}"
            if self.time_offload:
                line += f" {self.time_offload[s]:8.3f} {self.time_reload[s]:8.3f}"
            lines.append(line)
        lines.append(f"T_comm {self.time_comm:.3f} ms, w_share {self.w_share:.3f}")
        return "\n".join(lines)


def _kind_name_of(kind):
    from .schedule import _kind_name
    return _kind_name(_resolve_kind(kind)[0])


def _wait_gaps(ops, times, where, S):
    """T_comm samples of one timeline, as (producer op, gap): for each cross-rank dependency whose
    consumer's rank was idle when the producer ended, consumer start - producer end."""
    gaps = []
    for r, rank_ops in enumerate(ops):
        starts, ends = times[r]
        for k, op in enumerate(rank_ops):
            if op.type == "F":
                dep = None if op.stage == 0 else [("F", op.stage - 1, op.mb)]
            elif op.type in ("B", "BW"):
                dep = None if op.stage == S - 1 else [("B", op.stage + 1, op.mb), ("BW", op.stage + 1, op.mb)]
            else:
                dep = None
            if dep is None:
                continue
            found = next((where[d] for d in dep if d in where), None)
            if found is None or found[0] == r:
                continue
            pr, pk = found
            produced = times[pr][1][pk]
            previous_end = ends[k - 1] if k > 0 else -math.inf
            if previous_end <= produced:
                gaps.append((ops[pr][pk], starts[k] - produced))
    return gaps


_STAGE_OPS = ("F", "B", "W", "BW")
_VOCAB_OPS = ("S", "T", "IF", "IB")


def _ready_gaps(ops, times, where, S, comm=0.0):
    """Per-op overhead samples of one timeline, as (op, gap): for each op (not a rank's first) whose
    inputs from other ranks had all arrived (producer end + comm) by the time the rank's previous
    op ended, the gap between the two, which belongs to the previous op: nothing but the runtime
    (its callbacks, posting the previous op's sends) kept the rank from starting at once."""
    gaps = []
    for r, rank_ops in enumerate(ops):
        starts, ends = times[r]
        for k in range(1, len(rank_ops)):
            op = rank_ops[k]
            if op.type not in _STAGE_OPS or rank_ops[k - 1].type not in _STAGE_OPS:
                continue  # a copy or a vocabulary pass: not a stage's op, no stage's overhead
            if op.type == "F":
                deps = [] if op.stage == 0 else [("F", op.stage - 1, op.mb)]
            elif op.type in ("B", "BW"):
                deps = [] if op.stage == S - 1 else [("B", op.stage + 1, op.mb), ("BW", op.stage + 1, op.mb)]
            else:
                deps = []
            found = next((where[d] for d in deps if d in where), None)
            if found is not None and found[0] != r and times[found[0]][1][found[1]] + comm > ends[k - 1]:
                continue  # it waited for another rank: that gap is T_comm or bubble, not overhead
            gaps.append((rank_ops[k - 1], starts[k] - ends[k - 1]))
    return gaps


# ---- activation memory (torch) ---------------------------------------------------------------------

class ActivationMeter:
    """Measures what one stage's forward of one microbatch keeps for its backward.

        with ActivationMeter(module, device) as meter:
            out = module(x)
            meter.roots = [out]          # the tensors backward will start from (the loss, or outputs)

    Afterwards `saved_bytes` is what the autograd graph behind the roots has saved (each storage
    once; the module's parameters and buffers, which are not per microbatch, left out) and
    `w_only_bytes` the part saved only as the input of split layers of `module` (zbpp.split_linear
    and Megatron's split linears keep x for W's dW = dY^T X; B reads dY and the weight only). On a
    CUDA device also `cuda_bytes`, the growth of torch.cuda.memory_allocated over the block.
    `done(meter)`, if given, is called at the end of the block.

    The graph is walked after the forward (each node's saved tensors: a custom Function's
    saved_tensors, a built-in node's _saved_* fields) rather than watched with
    torch.autograd.graph.saved_tensors_hooks: with those hooks a saved parameter comes back from
    ctx.saved_tensors as a new tensor object, so a split layer's W would write `.grad` to that
    object instead of the parameter. Walking the graph changes nothing in it."""

    def __init__(self, module=None, device=None, done=None):
        self.module = module
        self.device = device
        self.done = done
        self.roots = []
        self.saved_bytes = 0
        self.w_only_bytes = 0
        self.cuda_bytes = None

    def __enter__(self):
        import torch

        self._torch = torch
        self._inputs = {}
        self._handles = [m.register_forward_pre_hook(self._pre) for m in _split_modules(self.module)]
        cuda = self.device is not None and torch.device(self.device).type == "cuda"
        self._before = torch.cuda.memory_allocated(self.device) if cuda else None
        return self

    def _pre(self, _module, args):
        if args and isinstance(args[0], self._torch.Tensor):
            key = _storage(args[0])
            if key is not None:
                self._inputs[key[0]] = self._inputs.get(key[0], 0) + 1

    def __exit__(self, exc_type, *exc):
        for h in self._handles:
            h.remove()
        self._handles = None
        if exc_type is None:
            if self._before is not None:
                self.cuda_bytes = max(0, self._torch.cuda.memory_allocated(self.device) - self._before)
            skip = set()
            if self.module is not None:
                # nn.Module's own methods: a wrapper may shadow them (Megatron's DDP has a `buffers` list).
                nn = self._torch.nn.Module
                for t in list(nn.parameters(self.module)) + list(nn.buffers(self.module)):
                    key = _storage(t)
                    if key is not None:
                        skip.add(key[0])
            saves = _graph_saves(self.roots, skip, self._torch.Tensor)
            self.saved_bytes = sum(n for n, _ in saves.values())
            self.w_only_bytes = sum(n for key, (n, count) in saves.items() if self._inputs.get(key, 0) >= count)
            if self.done is not None:
                self.done(self)
        self.roots, self._inputs = [], None
        return False


def _graph_saves(roots, skip, tensor_type):
    """{storage pointer: [bytes, times saved]} over the autograd graph behind `roots`."""
    saves, seen = {}, set()
    stack = [getattr(r, "grad_fn", None) for r in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in _node_saved(node, tensor_type):
            key = _storage(t)
            if key is not None and key[0] not in skip:
                entry = saves.setdefault(key[0], [key[1], 0])
                entry[1] += 1
        stack.extend(fn for fn, _ in node.next_functions)
    return saves


def _node_saved(node, tensor_type):
    out = []
    if hasattr(node, "saved_tensors"):  # a custom autograd.Function's node
        try:
            out += [t for t in node.saved_tensors if isinstance(t, tensor_type)]
        except RuntimeError:  # already freed by a backward
            pass
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError):
            continue
        if isinstance(value, tensor_type):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out += [t for t in value if isinstance(t, tensor_type)]
    return out


def _storage(t):
    """(data pointer, bytes) of a tensor's storage, None where it has none."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return (ptr, st.nbytes()) if ptr else None


def _split_modules(module):
    if module is None:
        return []
    from .split import split_report

    names = {e.name for e in split_report(module).split}
    return [m for name, m in module.named_modules() if name in names]


def measure_copy_time(nbytes, device="cpu", repeats=5):
    """(offload_ms, reload_ms): the median time to copy nbytes of activations from `device` to
    host memory and back, measured here (pinned host memory and a stream of its own on CUDA, as the
    torch layer's copies run; a memory copy on the CPU). What PipeOffload's plan needs for
    times['offload'] and ['reload'] per stage (its activation bytes per microbatch), from this
    machine rather than from a table of GPU names. The first of repeats + 1 copies is a warm-up."""
    import torch

    nbytes, device = max(int(nbytes), 1), torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    back = torch.empty_like(src)
    out, back_times = [], []
    if cuda:
        stream = torch.cuda.Stream(device)
        for _ in range(repeats + 1):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.stream(stream):
                a.record(stream)
                host.copy_(src, non_blocking=True)
                b.record(stream)
                back.copy_(host, non_blocking=True)
                c.record(stream)
            c.synchronize()
            out.append(a.elapsed_time(b))
            back_times.append(b.elapsed_time(c))
    else:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            host.copy_(src)
            t1 = time.perf_counter()
            back.copy_(host)
            t2 = time.perf_counter()
            out.append((t1 - t0) * 1e3)
            back_times.append((t2 - t1) * 1e3)
    return statistics.median(out[1:]), statistics.median(back_times[1:])
