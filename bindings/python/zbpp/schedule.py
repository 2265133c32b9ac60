"""Pipeline schedules from Python: generate, import, inspect, check, simulate and export them.

What this is: the Pythonic layer over the schedule part of include/zbpp.h (DESIGN.md section 3).
A `Schedule` owns one zb_schedule_t handle. It is made by `Schedule.generate` (a kind such as
"zb-v" or torch's "ZBVZeroBubble"), `Schedule.from_csv` (torch.distributed.pipelining's
compute_only action CSV) or `Schedule.from_ops` (explicit per-rank op lists), and it answers
questions about itself: per-rank op lists, placement, simulated times, memory, and exports in the
text, CSV, JSON, Chrome-trace and SVG formats. Two private modules hold parts of it:
_schedule_args.py checks the constructors' arguments, _schedule_exports.py has the export methods
(a mixin of Schedule) and stack_svgs; both are used through this module.

What this is not: a scheduler written in Python, or torch-aware. Every rule, generator and number
comes from the C library, so the CLI, the runtime and this module can never disagree about a
schedule. This module uses only ctypes and the standard library, so schedule-only work runs
without torch installed; running a schedule on devices is the runner module's job.

Units: op times are in whatever unit the caller gives (the defaults are 1, 1, 1: F = B = W);
`set_times` takes seconds and the library stores them in milliseconds (include/zbpp.h), so after it
every time this module reports is in milliseconds. Memory is in units of one microbatch's
activations through all of a rank's layers (1F1B peaks at p).
"""

import ctypes
import os
from typing import NamedTuple, Optional

from . import _lib
from ._schedule_args import _TIME_KEYS, _count, _index, _is_number, _mem_limit, _number, _parse_times
from ._schedule_exports import _ScheduleExports, stack_svgs

__all__ = ["Op", "Schedule", "SimResult", "kinds", "stack_svgs"]

# ---- constants mirrored from include/zbpp.h ------------------------------------------------------

ZB_SCHEDULE_SPEC_VERSION = 3
ZB_KIND_COUNT = 11
ZB_KIND_CUSTOM = 9

# zb_op_type_t: the index is the C value.
_OP_NAMES = ("F", "B", "W", "BW", "OFFLOAD", "RELOAD", "S", "T", "IF", "IB")
_OP_CODES = {name: code for code, name in enumerate(_OP_NAMES)}

# zb_format_t: the one format zb_schedule_import reads.
ZB_FORMAT_CSV = 1

# zb_placement_t
_PLACEMENT_NAMES = ("loop", "v", "custom")

# Kinds whose default chunk count (spec.chunks = 0) is 2; every other kind defaults to 1. The C
# library keeps this in a static helper, so it is mirrored here by name: per-stage time lists need
# S = p * v before the schedule exists. A wrong entry would only make the length check stricter
# than the library, and the C side checks the shape again.
_TWO_CHUNK_KINDS = frozenset({"interleaved-1f1b", "group-interleaved-1f1b", "zb-v", "v-half", "v-min"})

# ---- ctypes records, laid out exactly as in include/zbpp.h --------------------------------------

_c_double_p = ctypes.POINTER(ctypes.c_double)


_PLACEMENT_VALUES = {"loop": 0, "v": 1}  # zb_placement_t


class _Spec(ctypes.Structure):
    """zb_schedule_spec_t. Build it with _Spec.init(), the equivalent of ZB_SCHEDULE_SPEC_INIT."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("kind", ctypes.c_int),  # zb_kind_t (a C enum: int-sized)
        ("ranks", ctypes.c_int32),
        ("chunks", ctypes.c_int32),
        ("microbatches", ctypes.c_int32),
        ("time_f", ctypes.c_double),
        ("time_b", ctypes.c_double),
        ("time_w", ctypes.c_double),
        ("time_bw", ctypes.c_double),
        ("stage_time_f", _c_double_p),
        ("stage_time_b", _c_double_p),
        ("stage_time_w", _c_double_p),
        ("stage_time_bw", _c_double_p),
        ("time_comm", ctypes.c_double),
        ("w_share", ctypes.c_double),
        ("mem_limit", ctypes.c_double),
        ("placement_set", ctypes.c_int32),
        ("placement", ctypes.c_int),  # zb_placement_t
        ("time_offload", ctypes.c_double),  # version 2: PipeOffload's copy times
        ("time_reload", ctypes.c_double),
        ("stage_time_offload", _c_double_p),
        ("stage_time_reload", _c_double_p),
        ("vocab", ctypes.c_int32),  # version 3: Vocabulary Parallelism (0 none, 1 two barriers, 2 one)
        ("time_s", ctypes.c_double),
        ("time_t", ctypes.c_double),
        ("time_if", ctypes.c_double),
        ("time_ib", ctypes.c_double),
        ("time_vocab_comm", ctypes.c_double),
    ]

    @classmethod
    def init(cls):
        # The same values as ZB_SCHEDULE_SPEC_INIT: kind 1F1B, p = 1, v = 0 (the kind's default),
        # m = 1, times 1/1/1 with bw = b + w, no comm, w_share 0.5, no memory limit, free copies.
        return cls(ctypes.sizeof(cls), ZB_SCHEDULE_SPEC_VERSION, 1, 1, 0, 1,
                   1.0, 1.0, 1.0, 0.0, None, None, None, None, 0.0, 0.5, 0.0, 0, 0, 0.0, 0.0, None, None,
                   0, 0.0, 0.0, 0.0, 0.0, 0.0)


ZB_OFFLOAD_CONFIG_VERSION = 1


class _OffloadConfig(ctypes.Structure):
    """zb_offload_config_t."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("device_limit", ctypes.c_double),
        ("slowdown", ctypes.c_double),
        ("host_limit", ctypes.c_double),
        ("stages", ctypes.POINTER(ctypes.c_uint8)),
        ("paired_lanes", ctypes.c_int32),
    ]


def _offload_config(S, device_limit=None, slowdown=0.0, host_limit=None, stages=None, paired_lanes=False):
    """(zb_offload_config_t, the stage mask it points at, to keep alive through the call)."""
    limits = {}
    for name, value in (("device_limit", device_limit), ("host_limit", host_limit)):
        limits[name] = 0.0 if value is None else _number(value, name)
        if value is not None and not limits[name] > 0:
            raise ValueError(f"plan_offload: {name} must be a number of microbatches > 0 (None for no limit), "
                             f"got {value!r}")
    mask = None
    if stages is not None:
        chosen = list(stages)
        bad = [x for x in chosen if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < S]
        if bad:
            raise ValueError(f"plan_offload: stages must be stage indices in 0..{S - 1}, got {bad[0]!r}")
        mask = (ctypes.c_uint8 * S)(*[1 if x in chosen else 0 for x in range(S)])
    cfg = _OffloadConfig(ctypes.sizeof(_OffloadConfig), ZB_OFFLOAD_CONFIG_VERSION, limits["device_limit"],
                         _number(slowdown, "slowdown"), limits["host_limit"], mask, 1 if paired_lanes else 0)
    return cfg, mask


class _Info(ctypes.Structure):
    """zb_schedule_info_t."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("ranks", ctypes.c_int32),
        ("chunks", ctypes.c_int32),
        ("stages", ctypes.c_int32),
        ("microbatches", ctypes.c_int32),
        ("placement", ctypes.c_int),
        ("w_share", ctypes.c_double),
        ("mem_limit", ctypes.c_double),
        ("time_comm", ctypes.c_double),
    ]


class _SimResult(ctypes.Structure):
    """zb_sim_result_t."""

    _fields_ = [
        ("cost", ctypes.c_double),
        ("bubble_rate", ctypes.c_double),
        ("busy", ctypes.c_double),
        ("max_peak_memory", ctypes.c_double),
    ]


class _Op(ctypes.Structure):
    """zb_op_t."""

    _fields_ = [("type", ctypes.c_int32), ("stage", ctypes.c_int32), ("mb", ctypes.c_int32)]


# ---- public records -------------------------------------------------------------------------------


class Op(NamedTuple):
    """One op of a rank's list: type 'F', 'B' (input gradient), 'W' (weight gradient) or 'BW'
    (fused backward, as 1F1B runs it); stage 0..S-1; mb the microbatch 0..m-1."""

    type: str
    stage: int
    mb: int


class SimResult(NamedTuple):
    """A schedule's figures (zb_sim_result_t). cost: the largest span of any rank; busy: the
    largest total compute of any rank; bubble_rate: (cost - busy) / cost, the paper's bubble rate
    (the busiest rank's idle share of its own span); max_peak_memory: the largest activation peak
    of any rank, in microbatches through a rank's layers. makespan: the step from the first op's
    start on any rank to the last op's end; idle_rate: the share of all ranks' time
    over the makespan that no compute op fills (zb_schedule_step_idle). The two rates differ where
    the busiest rank never waits but the others do, at the step's fill and drain: ZB-V at m = 2p
    has bubble_rate 0 and an idle_rate above 0."""

    cost: float
    bubble_rate: float
    busy: float
    max_peak_memory: float
    makespan: Optional[float] = None
    idle_rate: Optional[float] = None


def _sim_result(raw, handle=None):
    """SimResult from zb_sim_result_t; with the schedule's handle, its step figures too."""
    makespan = idle = None
    if handle is not None:
        m, i = ctypes.c_double(), ctypes.c_double()
        _lib.call("zb_schedule_step_idle", [ctypes.c_void_p] + [ctypes.POINTER(ctypes.c_double)] * 2,
                  handle, ctypes.byref(m), ctypes.byref(i))
        makespan, idle = m.value, i.value
    return SimResult(raw.cost, raw.bubble_rate, raw.busy, raw.max_peak_memory, makespan, idle)


# ---- small helpers --------------------------------------------------------------------------------


def _decode(raw):
    return raw.decode("utf-8", errors="replace") if raw is not None else None


def _kind_name(kind):
    return _decode(_lib.function("zb_kind_name", [ctypes.c_int], ctypes.c_char_p)(int(kind)))


def _kind_help(kind):
    return _decode(_lib.function("zb_kind_help", [ctypes.c_int], ctypes.c_char_p)(int(kind)))


def kinds():
    """Every schedule kind the library knows, as (name, one-line help) pairs in enum order.

    The last one, "custom", is what from_csv/from_ops produce; it cannot be generated.
    """
    return [(_kind_name(k), _kind_help(k)) for k in range(ZB_KIND_COUNT)]


def _resolve_kind(kind):
    """(zb_kind_t value, memory-limit factor) for a kind name, through zb_kind_from_name, so the
    accepted names (aliases, torch's class names, any case, '-' or '_') are the library's."""
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a schedule kind name (str) such as 'zb-v', got {type(kind).__name__}")
    out_kind = ctypes.c_int(0)
    factor = ctypes.c_double(0.0)
    _lib.call("zb_kind_from_name", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_double)],
              kind.encode("utf-8"), ctypes.byref(out_kind), ctypes.byref(factor))
    return out_kind.value, factor.value


_VOCAB_TIME_KEYS = {"s": "time_s", "t": "time_t", "if": "time_if", "ib": "time_ib", "comm": "time_vocab_comm"}


def _vocab_spec(spec, vocab, vocab_times):
    """Vocabulary Parallelism's part of a spec: vocab (0, 1 or 2) and its pass times."""
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab not in (0, 1, 2):
        raise ValueError(f"vocab must be 0 (none), 1 (two barriers a microbatch) or 2 (one, the backward fused into S), "
                         f"got {vocab!r}")
    spec.vocab = vocab
    unknown = set(vocab_times or {}) - set(_VOCAB_TIME_KEYS)
    if unknown:
        raise ValueError(f"vocab_times keys are {sorted(_VOCAB_TIME_KEYS)}, got {sorted(unknown)}")
    if vocab_times and not vocab:
        raise ValueError("vocab_times times Vocabulary Parallelism's passes; it goes with vocab=1 or vocab=2")
    for key, value in (vocab_times or {}).items():
        setattr(spec, _VOCAB_TIME_KEYS[key], _number(value, f"vocab_times[{key!r}]"))


def _op_code(type_, what):
    """zb_op_type_t for 'F', 'B', 'W', 'BW', 'OFFLOAD' or 'RELOAD' (any case)."""
    if isinstance(type_, str):
        code = _OP_CODES.get(type_.upper())
        if code is not None:
            return code
    raise ValueError(f"{what}: op type {type_!r} is not one of {', '.join(repr(n) for n in _OP_NAMES)}")


def _build_spec(kind, p, v, m, times_parts, comm, w_share, mem_limit):
    """A filled _Spec plus the ctypes arrays it points at; keep the second alive for the call."""
    scalars, arrays = times_parts
    spec = _Spec.init()
    spec.kind = kind
    spec.ranks = p
    spec.chunks = v
    spec.microbatches = m
    spec.time_f, spec.time_b, spec.time_w, spec.time_bw, spec.time_offload, spec.time_reload = (
        scalars[k] for k in _TIME_KEYS)
    keep = []
    for key in _TIME_KEYS:
        if arrays[key] is not None:
            buf = (ctypes.c_double * len(arrays[key]))(*arrays[key])
            keep.append(buf)
            setattr(spec, "stage_time_" + key, ctypes.cast(buf, _c_double_p))
    spec.time_comm = _number(comm, "comm")
    spec.w_share = _number(w_share, "w_share")
    spec.mem_limit = mem_limit
    return spec, keep


def _import_csv(cls, text, spec):
    """zb_schedule_import of CSV text into a new cls; spec None for the library's defaults."""
    raw = text.encode("utf-8")
    handle = ctypes.c_void_p()
    _lib.call("zb_schedule_import",
              [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
               ctypes.POINTER(_Spec)],
              ctypes.byref(handle), ZB_FORMAT_CSV, raw, len(raw), ctypes.byref(spec) if spec is not None else None)
    return cls(handle)


# ---- the schedule ---------------------------------------------------------------------------------


class Schedule(_ScheduleExports):
    """One pipeline schedule (an owned zb_schedule_t handle).

    Make one with `generate`, `from_csv` or `from_ops`. Close it with `close()` or a `with` block;
    it is also closed when garbage-collected. Not thread-safe: use one Schedule from one thread
    at a time (the handle is not locked).
    """

    def __init__(self, handle):
        """Takes ownership of a zb_schedule_t* (a ctypes.c_void_p or int). Internal: use the
        classmethods to make one."""
        self._handle = None
        value = handle.value if isinstance(handle, ctypes.c_void_p) else handle
        if not value:
            raise ValueError("Schedule needs a non-NULL zb_schedule_t handle; "
                             "use Schedule.generate, from_csv or from_ops")
        self._handle = ctypes.c_void_p(value)

    # -- construction --

    @classmethod
    def generate(cls, kind, p, m, v=None, times=None, comm=0.0, w_share=0.5, mem_limit=None, placement=None,
                 offload=None, vocab=0, vocab_times=None):
        """Generates a schedule of a kind for p ranks and m microbatches.

        kind: any name the library accepts (see kinds()), any case, '-' or '_', torch's class
        names ("ZBVZeroBubble", "Interleaved1F1B") and the aliases "zb-1p"/"zb-2p" (zb-auto at a
        memory limit of p or 2p, used when mem_limit is None).
        v: chunks per rank; None for the kind's default (2 for V kinds and interleaved-1f1b).
        times: None (F = B = W = 1); a tuple (f, b, w) or (f, b, w, bw) of per-rank times (one
        microbatch through all of a rank's layers; each op takes 1/v of it); or a dict with keys
        among 'f', 'b', 'w', 'bw' whose values are such numbers or lists of S = p*v per-stage times.
        A missing bw means b + w.
        comm: time added to every dependency that crosses ranks.
        w_share: the share of activations only W needs, in [0, 1].
        mem_limit: None (no limit), a number of microbatches, or a multiple of p: "p", "2p", "1.5p".
        placement: None (the kind's own: V for zb-v, v-half, v-min and zb-auto with v = 2, loop
        otherwise), "loop" or "v". zb-auto takes "loop" with any v (stage s on rank s mod p, as
        torch's interleaved schedules place stages) and "v" with v = 2.
        offload: None, or a dict of plan_offload's keywords (device_limit, slowdown, host_limit,
        stages) to generate with PipeOffload's copies, timed on times' 'offload' and 'reload'
        (zb_schedule_create_offloaded): a fixed order gets plan_offload's copies; zb-auto plans its
        order and the copies together, trying orders planned for more memory than device_limit
        (default: mem_limit, else p) and keeping the shortest step the copies bring within it.
        vocab: Vocabulary Parallelism's passes (S, T, IF, IB on every rank; 1f1b in the reference's
        order, other kinds placed by simulation): 2 for one all-reduce barrier a microbatch
        (Vocab-2, backward fused into S), 1 for two (Vocab-1); vocab_times: one rank's pass times 's', 't', 'if', 'ib' and
        a barrier's 'comm' (see from_ops).

        Raises TypeError/ValueError for malformed arguments and ZbError for what the library
        rejects (its message says what is allowed, e.g. the smallest m for a kind).
        """
        kind_value, factor = _resolve_kind(kind)
        p = _count(p, "p (ranks)")
        m = _count(m, "m (microbatches)")
        if v is None:
            v_spec = 0  # the kind's default, chosen by the library
            name = _kind_name(kind_value)
            v_eff = 2 if name in _TWO_CHUNK_KINDS else 1
            where = f"p * v = {p} * {v_eff}, {name}'s default v"
        else:
            v_spec = v_eff = _count(v, "v (chunks per rank)")
            where = f"p * v = {p} * {v_eff}"
        parts = _parse_times(times, p * v_eff, where)
        if mem_limit is None and factor > 0:
            limit = factor * p  # an alias such as "zb-2p" carries its limit as a factor of p
        else:
            limit = _mem_limit(mem_limit, p)
        spec, keep = _build_spec(kind_value, p, v_spec, m, parts, comm, w_share, limit)
        _vocab_spec(spec, vocab, vocab_times)
        if placement is not None:
            if placement not in _PLACEMENT_VALUES:
                raise ValueError(f"placement is {placement!r}; it is None (the kind's own), 'loop' or 'v'")
            spec.placement_set, spec.placement = 1, _PLACEMENT_VALUES[placement]
        handle = ctypes.c_void_p()
        if offload is not None:
            if not isinstance(offload, dict):
                raise TypeError(f"offload must be None or a dict of plan_offload's keywords, got {offload!r}")
            unknown = set(offload) - {"device_limit", "slowdown", "host_limit", "stages", "paired_lanes"}
            if unknown:
                raise ValueError(f"offload has {sorted(unknown)[0]!r}; its keys are device_limit, slowdown, "
                                 "host_limit, stages and paired_lanes (as plan_offload's)")
            cfg, mask = _offload_config(p * v_eff, **offload)
            _lib.call("zb_schedule_create_offloaded", [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Spec),
                                                       ctypes.POINTER(_OffloadConfig)],
                      ctypes.byref(handle), ctypes.byref(spec), ctypes.byref(cfg))
            del mask
        else:
            _lib.call("zb_schedule_create", [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Spec)],
                      ctypes.byref(handle), ctypes.byref(spec))
        del keep  # the library copied the per-stage arrays during the call
        return cls(handle)

    @classmethod
    def from_csv(cls, text_or_path, times=None, comm=0.0, w_share=0.5, mem_limit=None):
        """Reads torch.distributed.pipelining's compute_only action CSV: one row per rank, cells
        like "0F3" (stage, type, microbatch) with types F, I (our B), W and B (our BW).

        text_or_path: the CSV text (a str holding a newline or a comma), bytes, or a path (str or
        os.PathLike). p is the number of rows, S the largest stage + 1, v = S / p, m the largest
        microbatch + 1; placement is inferred. times/comm/w_share/mem_limit as for generate (lists
        of per-stage times need S values). The schedule is NOT validated: call .validate().
        """
        if isinstance(text_or_path, bytes):
            text = text_or_path.decode("utf-8")
        elif isinstance(text_or_path, str) and ("\n" in text_or_path or "," in text_or_path):
            text = text_or_path
        elif isinstance(text_or_path, (str, os.PathLike)):
            with open(text_or_path, "r", encoding="utf-8") as f:
                text = f.read()
        else:
            raise TypeError(
                f"from_csv takes CSV text (str or bytes) or a path, got {type(text_or_path).__name__}")

        # Per-stage lists and "2p" limits need the file's p and S. Read it once for its shape, then
        # again with the full spec: the library checks ranks * chunks against the file's stages, but
        # a length mismatch deserves a message in this API's terms (times['f'], not stage_time_f).
        p, v = 1, 0  # import ignores ranks/chunks when no per-stage arrays are given
        needs_shape = isinstance(mem_limit, str) or (
            isinstance(times, dict) and any(not _is_number(value) for value in times.values()))
        if needs_shape:
            with _import_csv(cls, text, None) as probe:
                p, v = probe.ranks, probe.chunks
        parts = _parse_times(times, p * v, f"the CSV's stage count, {p} rows x {v} chunks")
        # spec.kind and spec.microbatches are ignored by import (the file says custom and m).
        spec, keep = _build_spec(ZB_KIND_CUSTOM, p, v, 1, parts, comm, w_share, _mem_limit(mem_limit, p))
        schedule = _import_csv(cls, text, spec)
        del keep  # copied during the call
        return schedule

    @classmethod
    def from_ops(cls, rank_ops, m, placement="loop", v=None, times=None, comm=0.0, w_share=0.5,
                 mem_limit=None, vocab=0, vocab_times=None):
        """Builds a schedule (kind "custom") from explicit op lists.

        rank_ops: one list per rank of Op or (type, stage, mb) tuples in execution order, type
        'F', 'B', 'W', 'BW', the copies 'OFFLOAD' and 'RELOAD', or Vocabulary Parallelism's passes
        'S', 'T', 'IF', 'IB' (their stage is the rank that runs them; vocab=1 for two barriers a
        microbatch, 2 for one, and vocab_times a dict of one rank's pass times 's', 't', 'if',
        'ib' and a barrier's all-reduces 'comm'; zbpp.h, ZB_OP_S). m: microbatches. placement: 'loop' (stage s on rank s mod p), 'v'
        (v = 2; stage s on rank s for s < p, else 2p-1-s), or a list giving each stage's rank
        (any map where every rank holds a stage; ranks may hold different numbers of stages; per-
        rank scalar times are split among each rank's stages, per-stage lists have one entry per
        stage). v: chunks per rank (loop and v); None for ceil(S / p) with S the largest stage used
        + 1. The schedule is NOT validated: call .validate().
        """
        if isinstance(rank_ops, (str, bytes)) or not hasattr(rank_ops, "__len__"):
            raise TypeError("rank_ops must be a list with one list of ops per rank")
        p = len(rank_ops)
        if p < 1:
            raise ValueError("rank_ops is empty; it needs one list of ops per rank (p >= 1)")
        m = _count(m, "m (microbatches)")
        stage_map = None
        if isinstance(placement, (list, tuple)):
            stage_map = [_count(r, f"placement[{k}] (the rank of stage {k})", minimum=0) for k, r in enumerate(placement)]
            if not stage_map:
                raise ValueError("placement is an empty stage map; it needs the rank of every stage")
            placement_value = 2
        elif not isinstance(placement, str) or placement.lower() not in _PLACEMENT_NAMES[:2]:
            raise ValueError(f"placement must be 'loop', 'v' or a list with each stage's rank, got {placement!r}")
        else:
            placement_value = _PLACEMENT_NAMES.index(placement.lower())

        arrays = []
        largest_stage = -1
        for r, ops in enumerate(rank_ops):
            if isinstance(ops, (str, bytes)) or not hasattr(ops, "__len__"):
                raise TypeError(
                    f"rank_ops[{r}] must be a list of ops (Op or (type, stage, mb) tuples), got {ops!r}")
            buf = (_Op * max(len(ops), 1))()
            for k, op in enumerate(ops):
                where = f"rank_ops[{r}][{k}]"
                try:
                    type_, stage, mb = op
                except (TypeError, ValueError):
                    raise ValueError(
                        f"{where} is {op!r}; an op is Op(type, stage, mb) or a (type, stage, mb) tuple") from None
                stage = _count(stage, f"{where} stage", minimum=0)
                mb = _count(mb, f"{where} microbatch", minimum=0)
                buf[k] = _Op(_op_code(type_, where), stage, mb)
                largest_stage = max(largest_stage, stage)
            arrays.append((buf, len(ops)))
        if stage_map is not None:
            v = 1
        elif v is None:
            v = max(1, -(-(largest_stage + 1) // p))  # ceil(S / p): every stage used has a rank
        else:
            v = _count(v, "v (chunks per rank)")

        S = len(stage_map) if stage_map is not None else p * v
        parts = _parse_times(times, S, f"{S} stages" if stage_map is not None else f"p * v = {p} * {v}")
        spec, keep = _build_spec(ZB_KIND_CUSTOM, p, v, m, parts, comm, w_share, _mem_limit(mem_limit, p))
        _vocab_spec(spec, vocab, vocab_times)
        ops_ptrs = (ctypes.POINTER(_Op) * p)(*(ctypes.cast(buf, ctypes.POINTER(_Op)) for buf, _ in arrays))
        counts = (ctypes.c_int32 * p)(*(n for _, n in arrays))
        handle = ctypes.c_void_p()
        if stage_map is not None:
            cmap = (ctypes.c_int32 * S)(*stage_map)
            _lib.call("zb_schedule_create_from_ops_mapped",
                      [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Spec), ctypes.POINTER(ctypes.c_int32),
                       ctypes.c_int32, ctypes.POINTER(ctypes.POINTER(_Op)), ctypes.POINTER(ctypes.c_int32)],
                      ctypes.byref(handle), ctypes.byref(spec), cmap, S, ops_ptrs, counts)
        else:
            _lib.call("zb_schedule_create_from_ops",
                      [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Spec), ctypes.c_int,
                       ctypes.POINTER(ctypes.POINTER(_Op)), ctypes.POINTER(ctypes.c_int32)],
                      ctypes.byref(handle), ctypes.byref(spec), placement_value, ops_ptrs, counts)
        del keep, arrays  # everything was copied during the call
        return cls(handle)

    # -- the handle --

    @property
    def handle(self):
        """The zb_schedule_t* as a ctypes.c_void_p, for other binding modules. Still owned by this
        object: do not destroy it, and do not use it after close()."""
        if self._handle is None:
            raise ValueError("this zbpp.Schedule is closed; its handle was destroyed by close()")
        return self._handle

    def close(self):
        """Destroys the handle. Safe to call more than once; the schedule is unusable afterwards."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            _lib.call("zb_schedule_destroy", [ctypes.c_void_p], handle)

    def __del__(self):
        try:
            self.close()
        except Exception:
            # At interpreter exit the library or this module may already be torn down; nothing
            # useful can be done with an error from a finaliser.
            pass

    def __enter__(self):
        self.handle  # refuse a closed schedule at the door
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        if self._handle is None:
            return "<zbpp.Schedule (closed)>"
        info = self._info()
        return f"<zbpp.Schedule {_kind_name(info.kind)} p={info.ranks} v={info.chunks} m={info.microbatches}>"

    # -- shape --

    def _info(self):
        info = _Info()
        _lib.call("zb_schedule_get_info", [ctypes.c_void_p, ctypes.POINTER(_Info)], self.handle, ctypes.byref(info))
        return info

    @property
    def kind(self):
        """The kind's name ("zb-v", ...; "custom" for from_csv/from_ops)."""
        return _kind_name(self._info().kind)

    @property
    def ranks(self):
        return self._info().ranks

    @property
    def chunks(self):
        return self._info().chunks

    @property
    def stages(self):
        return self._info().stages

    @property
    def microbatches(self):
        return self._info().microbatches

    @property
    def placement(self):
        """'loop' (stage s on rank s mod p), 'v' (s on rank s for s < p, else 2p-1-s) or 'custom'
        (an explicit map, from_ops(placement=[...]): stage_rank() says where each stage is)."""
        return _PLACEMENT_NAMES[self._info().placement]

    @property
    def w_share(self):
        return self._info().w_share

    @property
    def mem_limit(self):
        """The memory limit in microbatches, or None when there is none."""
        limit = self._info().mem_limit
        return limit if limit > 0 else None

    @property
    def time_comm(self):
        return self._info().time_comm

    # -- ops --

    def rank_ops(self, rank):
        """Rank `rank`'s ops in execution order, as a list of Op."""
        ops = ctypes.POINTER(_Op)()
        count = ctypes.c_int32(0)
        _lib.call("zb_schedule_rank_ops",
                  [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.POINTER(_Op)),
                   ctypes.POINTER(ctypes.c_int32)],
                  self.handle, _index(rank, "rank"), ctypes.byref(ops), ctypes.byref(count))
        # Copy out now: the array belongs to the handle and dies with it.
        return [Op(_OP_NAMES[o.type] if 0 <= o.type < len(_OP_NAMES) else str(o.type), o.stage, o.mb)
                for o in ops[: count.value]]

    def stage_rank(self, stage):
        """The rank that holds `stage` under the schedule's placement."""
        rank = ctypes.c_int32(0)
        _lib.call("zb_schedule_stage_rank", [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)],
                  self.handle, _index(stage, "stage"), ctypes.byref(rank))
        return rank.value

    def rank_stages(self, rank):
        """The stages `rank` holds, ascending."""
        rank = _index(rank, "rank")
        p = self.ranks
        if not 0 <= rank < p:
            raise ValueError(f"rank {rank} is out of range; the schedule has ranks 0..{p - 1}")
        return [s for s in range(self.stages) if self.stage_rank(s) == rank]

    def op_time(self, type, stage):
        """The time of one op of a type ('F', 'B', 'W', 'BW', 'OFFLOAD', 'RELOAD') at a stage, as
        the model uses it (a per-rank time already divided by v)."""
        out = ctypes.c_double(0.0)
        _lib.call("zb_schedule_op_time",
                  [ctypes.c_void_p, ctypes.c_int, ctypes.c_int32, ctypes.POINTER(ctypes.c_double)],
                  self.handle, _op_code(type, "op_time"), _index(stage, "stage"), ctypes.byref(out))
        return out.value

    # -- checking and simulating --

    def plan_offload(self, device_limit=None, slowdown=0.0, host_limit=None, stages=None, paired_lanes=False):
        """A new Schedule: this one's compute ops in the same order, with PipeOffload's copies
        (OFFLOAD after an F, RELOAD before its backward) where they pay, timed on this schedule's
        times['offload'] and times['reload'] (zb_schedule_plan_offload; csrc/schedule/offload.c
        states the rule). Longest-lived activations go first; a copy is kept only when the step
        grows by at most `slowdown` (a fraction), the rank's device peak does not grow, and the host
        holds at most `host_limit` microbatches (None: no limit). With `device_limit` (microbatches
        through all of a rank's layers) the pass stops once every rank's device peak is at most
        that; with None it offloads all it can. stages: the stage indices whose activations may
        move (None: every stage). paired_lanes: ranks 2k and 2k+1 share one link to host memory (two
        GPUs under one PCIe switch), so no two of their copies may overlap in time. A copy that does
        not fit is left out, never an error: check rank_memory() of the result."""
        cfg, mask = _offload_config(self.stages, device_limit, slowdown, host_limit, stages, paired_lanes)
        out = ctypes.c_void_p()
        _lib.call("zb_schedule_plan_offload", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                               ctypes.POINTER(_OffloadConfig)],
                  ctypes.byref(out), self.handle, ctypes.byref(cfg))
        return Schedule(out)

    def refine(self, device_limit=None):
        """A new Schedule: this one's ops (without copies) reordered by a local search the simulator
        judges (zb_schedule_refine): swaps of neighbouring ops of a rank that share no channel and no
        (stage, microbatch), kept while the step gets no longer and the rank's device peak stays
        within device_limit (microbatches; None: this schedule's own largest peak). The shortest
        order found, or this one when none is strictly shorter. Deterministic, about 100 ms."""
        limit = 0.0 if device_limit is None else _number(device_limit, "device_limit")
        if device_limit is not None and not limit > 0:
            raise ValueError(f"refine: device_limit must be a number of microbatches > 0 (None: the schedule's "
                             f"own peak), got {device_limit!r}")
        out = ctypes.c_void_p()
        _lib.call("zb_schedule_refine", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_double],
                  ctypes.byref(out), self.handle, limit)
        return Schedule(out)

    def validate(self):
        """Checks every rule of DESIGN.md section 3; returns self, or raises ZbError
        (ZB_ERR_INVALID_SCHEDULE) whose message names the rank, the position and the rule."""
        _lib.call("zb_schedule_validate", [ctypes.c_void_p], self.handle)
        return self

    def simulate(self):
        """The schedule's figures. Simulates once; after set_times, the measured figures."""
        raw = _SimResult()
        _lib.call("zb_schedule_simulate", [ctypes.c_void_p, ctypes.POINTER(_SimResult)],
                  self.handle, ctypes.byref(raw))
        return _sim_result(raw, self.handle)

    def cost_bound(self):
        """A cost no schedule of this shape, costs and memory limit can go below, whatever its op
        order (zb_schedule_cost_bound): simulate().cost equal to it means shortest, proven; the gap
        is the most any scheduler could still win. bubble_bound() is the same as a bubble rate."""
        out = ctypes.c_double()
        _lib.call("zb_schedule_cost_bound", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)],
                  self.handle, ctypes.byref(out))
        return out.value

    def bubble_bound(self):
        """The lowest bubble rate any schedule of this shape, costs and limit could show: the
        bubble of a schedule that met cost_bound() (over the simulated busiest rank's work)."""
        bound, busy = self.cost_bound(), self.simulate().busy
        return max(0.0, (bound - busy) / bound) if bound > 0 else 0.0

    def rank_times(self, rank):
        """(starts, ends) of rank `rank`'s ops, aligned with rank_ops(rank); simulates first if
        needed. Measured times (after set_times) are in milliseconds from the earliest start."""
        n = len(self.rank_ops(rank))  # also checks the rank
        self.simulate()
        start, end = _c_double_p(), _c_double_p()
        _lib.call("zb_schedule_rank_times",
                  [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(_c_double_p), ctypes.POINTER(_c_double_p)],
                  self.handle, _index(rank, "rank"), ctypes.byref(start), ctypes.byref(end))
        return list(start[:n]), list(end[:n])

    def rank_stats(self, rank):
        """(span, busy, peak memory) of rank `rank`; simulates first if needed."""
        rank = _index(rank, "rank")
        self.simulate()
        span, busy, peak = ctypes.c_double(), ctypes.c_double(), ctypes.c_double()
        _lib.call("zb_schedule_rank_stats",
                  [ctypes.c_void_p, ctypes.c_int32] + [ctypes.POINTER(ctypes.c_double)] * 3,
                  self.handle, rank, ctypes.byref(span), ctypes.byref(busy), ctypes.byref(peak))
        return span.value, busy.value, peak.value

    def rank_memory(self, rank):
        """(device peak, host peak) of rank `rank` in microbatches through all of its layers;
        simulates first if needed. The device peak is rank_stats' peak memory; the host peak is
        what its OFFLOAD ops hold in host memory at once (0 without them). Both are counted in
        time over the compute and the copy lane (zb_schedule_rank_memory)."""
        rank = _index(rank, "rank")
        self.simulate()
        dev, host = ctypes.c_double(), ctypes.c_double()
        _lib.call("zb_schedule_rank_memory", [ctypes.c_void_p, ctypes.c_int32] + [ctypes.POINTER(ctypes.c_double)] * 2,
                  self.handle, rank, ctypes.byref(dev), ctypes.byref(host))
        return dev.value, host.value

    def set_times(self, starts, ends):
        """Replaces the simulated times with measured ones and returns the new figures.

        starts/ends: one list per rank of seconds on any common clock, aligned with rank_ops(r).
        The library shifts them so the earliest start is 0 and stores milliseconds, so cost,
        rank_times, stage_costs and the exports read in milliseconds afterwards.
        """
        keep = []
        start_ptrs = self._per_rank(starts, "set_times: starts", "time", keep)
        end_ptrs = self._per_rank(ends, "set_times: ends", "time", keep)
        raw = _SimResult()
        _lib.call("zb_schedule_set_times",
                  [ctypes.c_void_p, ctypes.POINTER(_c_double_p), ctypes.POINTER(_c_double_p),
                   ctypes.POINTER(_SimResult)],
                  self.handle, start_ptrs, end_ptrs, ctypes.byref(raw))
        del keep  # copied during the call
        return _sim_result(raw, self.handle)

    def _per_rank(self, lists, what, per_op, keep):
        """One C array of numbers per rank, each aligned with rank_ops(r), from a list of lists:
        a pointer array for the C calls that take `const double *const *`. The buffers go into
        `keep`, which the caller holds until the call returns."""
        p = self.ranks
        if isinstance(lists, (str, bytes)) or not hasattr(lists, "__len__") or len(lists) != p:
            raise ValueError(f"{what} must hold one list of {per_op}s per rank ({p} lists), got {lists!r:.80}")
        ptrs = (_c_double_p * p)()
        for r in range(p):
            n, values = len(self.rank_ops(r)), lists[r]
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != n:
                got = len(values) if hasattr(values, "__len__") else repr(values)
                raise ValueError(f"{what}[{r}] has {got} values; rank {r} has {n} ops and needs one {per_op} per op")
            buf = (ctypes.c_double * max(n, 1))(*(_number(t, f"{what}[{r}]") for t in values))
            keep.append(buf)
            ptrs[r] = ctypes.cast(buf, _c_double_p)
        return ptrs

    def simulate_durations(self, durations):
        """The figures of this op order run with the given op durations instead of the per-stage
        costs (zb_schedule_simulate_durations): durations holds one list per rank, aligned with
        rank_ops(r). The schedule's own simulation is left as it was, so this can be called many
        times, e.g. with op times drawn from a measured spread."""
        keep = []
        ptrs = self._per_rank(durations, "simulate_durations: durations", "duration", keep)
        raw = _SimResult()
        _lib.call("zb_schedule_simulate_durations",
                  [ctypes.c_void_p, ctypes.POINTER(_c_double_p), ctypes.POINTER(_SimResult)],
                  self.handle, ptrs, ctypes.byref(raw))
        del keep
        res = _sim_result(raw)
        # The step's figures of these durations (zb_schedule_step_idle's, on them).
        makespan = self.makespan_durations(durations)
        work = sum(d for r in range(self.ranks) for op, d in zip(self.rank_ops(r), durations[r])
                   if op.type not in ("OFFLOAD", "RELOAD"))
        idle = 1.0 - work / (self.ranks * makespan) if makespan > 0 else 0.0
        return res._replace(makespan=makespan, idle_rate=max(idle, 0.0))

    def makespan_durations(self, durations):
        """The end-to-end time (ms) of this op order run with the given op durations (as in
        simulate_durations): the last op's end less the first op's start over every rank, which a
        wall clock timing the whole step sees. simulate_durations' cost is the largest single
        rank's span, the paper's measure; the two differ by the ranks' staggered starts."""
        keep = []
        ptrs = self._per_rank(durations, "makespan_durations: durations", "duration", keep)
        out = ctypes.c_double()
        _lib.call("zb_schedule_makespan_durations",
                  [ctypes.c_void_p, ctypes.POINTER(_c_double_p), ctypes.POINTER(ctypes.c_double)],
                  self.handle, ptrs, ctypes.byref(out))
        del keep
        return out.value

    def makespan(self):
        """The end-to-end time of this schedule's own simulation: the last op's end less the first
        op's start over every rank (simulate().cost is the largest single rank's span)."""
        return self.simulate().makespan

    def stage_costs(self):
        """Per-stage mean op durations of the current times: {'f': [S], 'b': [S], 'w': [S],
        'bw': [S]} (simulated: the spec's units; after set_times: milliseconds). A stage with no op
        of a type gets 0. Feed them back as generate(times=...) to plan for measured costs."""
        self.simulate()
        S = self.stages
        keys = _TIME_KEYS[:4]  # the compute ops' (zb_schedule_stage_costs)
        bufs = {key: (ctypes.c_double * S)() for key in keys}
        _lib.call("zb_schedule_stage_costs", [ctypes.c_void_p] + [_c_double_p] * 4,
                  self.handle, *(ctypes.cast(bufs[key], _c_double_p) for key in keys))
        return {key: list(bufs[key]) for key in keys}
