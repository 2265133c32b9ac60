"""The zero-bubble flags (the reference fork's names), configure(), and the schedule they choose."""

import argparse
import importlib
from typing import NamedTuple, Optional, Union

from ..pipelining import get_schedule_class

V_KINDS = ("zb-v", "v-half", "v-min")
_ONE_CHUNK_KINDS = ("gpipe", "1f1b", "zb-h1", "zb-h2")
_MEM_SETUPS = {"zb": "zb-v", "half": "v-half", "min": "v-min"}


# ---- options: the zero-bubble flags ----------------------------------------------------------------

class Options(NamedTuple):
    """The zero-bubble settings in effect (see options()).

    enable_zero_bubble, zero_bubble_v_schedule, zero_bubble_v_schedule_mem_setup ('zb', 'half' or
    'min'), zero_bubble_max_pending_backward ('auto' or an int, in microbatches),
    enable_optimizer_post_validation, zero_bubble_pipeline_timers_start_iter /
    zero_bubble_pipeline_timers_end_iter (the training calls, counted from 1, whose measured costs
    the zero-bubble schedules are planned from; None: zbpp's default, calls 2-3): the flags. kind,
    mem_limit: configure()'s override of the schedule (None: from the flags). plan_from_measured:
    configure()'s switch for plans from measured costs (None: on for the zero-bubble kinds unless
    ZBPP_PLAN_FROM_MEASURED=0). timeout: seconds one transfer may take. cpu_offload,
    offload_chunk_num, offload_time: the reference fork's PipeOffload flags (offload()).
    enable_vocab_parallel, disable_backward_fusion: sail-sg/VocabularyParallelism's flags (vocab.py).
    """

    enable_zero_bubble: bool = False
    zero_bubble_v_schedule: bool = False
    zero_bubble_v_schedule_mem_setup: str = "zb"
    zero_bubble_max_pending_backward: Union[str, int] = "auto"
    enable_optimizer_post_validation: bool = False
    zero_bubble_adaptive_memory_limit_percentile: int = 85
    zero_bubble_pipeline_timers_start_iter: Optional[int] = None
    zero_bubble_pipeline_timers_end_iter: Optional[int] = None
    kind: Optional[str] = None
    mem_limit: Union[None, float, str] = None
    plan_from_measured: Optional[bool] = None
    timeout: float = 300.0
    cpu_offload: bool = False
    offload_chunk_num: int = 0
    offload_time: float = 1.0
    enable_vocab_parallel: bool = False
    disable_backward_fusion: bool = False


_config = {}


def configure(args=None, *, pipeline_rank=None, pipeline_world_size=None, pipeline_group=None,
              kind=None, mem_limit=None, timeout=None, plan_from_measured=None):
    """Settings for runs without Megatron's globals (tests, custom loops), or to override them.

    args: a namespace with the zero-bubble flags (what add_arguments' parser returns); used
    instead of megatron.training.get_args(). pipeline_rank / pipeline_world_size / pipeline_group:
    this rank's place in the pipeline, used instead of megatron.core.parallel_state (the group
    defaults to torch.distributed's default group; rank and size to the group's). kind: a zbpp
    schedule kind name that overrides the flags (e.g. "zb-h1"); mem_limit: its memory limit (for
    zb-auto). timeout: seconds a transfer may take before the step fails naming the peer.
    plan_from_measured: False keeps the plan made for equal costs (the schedule is not planned again
    from the costs measured in the timer iterations); None: the default (on for zero-bubble kinds).

    Each call replaces the previous configuration (configure() clears it) and drops the cached
    schedule.
    """
    global _config
    if args is not None:
        _read_args(args)  # fail now, not at the first step
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"zbpp.megatron.configure: timeout must be a number > 0, got {timeout!r}")
    from .run import reset  # run imports this module
    reset()
    _config = {"args": args, "rank": pipeline_rank, "size": pipeline_world_size,
               "group": pipeline_group, "kind": kind, "mem_limit": mem_limit, "timeout": timeout,
               "plan_from_measured": plan_from_measured}


def _megatron_args():
    """Megatron's global args, or None when Megatron is absent or has not parsed them yet."""
    for name in ("megatron.training", "megatron"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        get_args = getattr(module, "get_args", None)
        if get_args is None:
            continue
        try:
            return get_args()
        except (AssertionError, RuntimeError):  # Megatron asserts its args are initialised
            return None
    return None


def _pending(value):
    """--zero-bubble-max-pending-backward's value: 'auto' or an int >= 1."""
    if isinstance(value, bool):
        raise ValueError(f"--zero-bubble-max-pending-backward must be 'auto' or an integer >= 1, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"--zero-bubble-max-pending-backward must be 'auto' or an integer >= 1 "
                             f"(microbatches), got {value!r}") from None
    if number < 1:
        raise ValueError(f"--zero-bubble-max-pending-backward must be 'auto' or an integer >= 1 "
                         f"(microbatches), got {value!r}")
    return number


# The reference fork's flags that select something zbpp does not run: (flag, attribute, its unset
# value, why). Given with another value they are an error, never ignored. Its other flags
# (--enable-zb-runtime: zbpp is the runtime; --no-pre-communication-optimization,
# --enable-exactly-numeric-match: zbpp's runs are exact) are accepted and change nothing;
# --zero-bubble-pipeline-timers-start-iter/-end-iter choose the calls profiled (profile_steps()).
_UNSUPPORTED = (
    ("--enable-1f1b-v", "enable_1f1b_v", False,
     "1F1B in a V placement; --zero-bubble-v-schedule runs ZB-V at 1F1B's memory with less bubble"),
    ("--num-seq-splits", "num_seq_splits", 1, "sequence-split microbatches (seq1F1B) are not scheduled; "
     "use more microbatches instead"),
    ("--interleave-group-size", "interleave_group_size", 0, "grouped interleaving is not scheduled; zbpp's "
     "interleaved 1F1B groups p microbatches"),
)


def _read_args(args):
    setup = getattr(args, "zero_bubble_v_schedule_mem_setup", None) or "zb"
    pending = getattr(args, "zero_bubble_max_pending_backward", None)
    if setup not in _MEM_SETUPS:
        raise ValueError(f"--zero-bubble-v-schedule-mem-setup must be one of zb, half, min; got {setup!r}")
    for flag, attr, unset, why in _UNSUPPORTED:
        value = getattr(args, attr, unset)
        if value not in (unset, None):
            raise ValueError(f"zbpp.megatron: {flag} ({value!r}) is the reference fork's and zbpp does not run it: "
                             f"{why}")
    percentile = getattr(args, "zero_bubble_adaptive_memory_limit_percentile", 85)
    if not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise ValueError(f"--zero-bubble-adaptive-memory-limit-percentile must be in (0, 100], got {percentile!r}")
    timers = []
    for flag, attr in (("--zero-bubble-pipeline-timers-start-iter", "zero_bubble_pipeline_timers_start_iter"),
                       ("--zero-bubble-pipeline-timers-end-iter", "zero_bubble_pipeline_timers_end_iter")):
        value = getattr(args, attr, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{flag} must be an iteration number >= 1 (training calls counted from 1), got {value!r}")
        timers.append(value)
    if None not in timers and timers[0] > timers[1]:
        raise ValueError(f"--zero-bubble-pipeline-timers-start-iter {timers[0]} is after "
                         f"--zero-bubble-pipeline-timers-end-iter {timers[1]}; the costs are measured from the "
                         "start iteration to the end iteration, both included")
    return dict(
        zero_bubble_adaptive_memory_limit_percentile=int(percentile),
        zero_bubble_pipeline_timers_start_iter=timers[0],
        zero_bubble_pipeline_timers_end_iter=timers[1],
        enable_zero_bubble=bool(getattr(args, "enable_zero_bubble", False)),
        zero_bubble_v_schedule=bool(getattr(args, "zero_bubble_v_schedule", False)),
        zero_bubble_v_schedule_mem_setup=setup,
        zero_bubble_max_pending_backward=_pending("auto" if pending is None else pending),
        enable_optimizer_post_validation=bool(getattr(args, "enable_optimizer_post_validation", False)),
        enable_vocab_parallel=bool(getattr(args, "enable_vocab_parallel", False)),
        disable_backward_fusion=bool(getattr(args, "disable_backward_fusion", False)),
        **_offload_args(args),
    )


def _offload_args(args):
    """The reference fork's PipeOffload flags, checked (--auto-offload-time and --offload-overlap-sr
    are accepted: zbpp measures the copy times, and runs one copy lane per rank)."""
    chunks = getattr(args, "offload_chunk_num", 0) or 0
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
        raise ValueError(f"--offload-chunk-num must be an integer >= 0 (0: every chunk), got {chunks!r}")
    seconds = getattr(args, "offload_time", 1.0)
    seconds = 1.0 if seconds is None else seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"--offload-time must be a number > 0 (the copy of a chunk's activations each way, as a "
                         f"multiple of its forward plus backward), got {seconds!r}")
    return dict(cpu_offload=bool(getattr(args, "cpu_offload", False)), offload_chunk_num=chunks,
                offload_time=float(seconds))


def offload(opts, p, v):
    """(offload=, times=) for the schedule under the fork's flags: None and None without
    --cpu-offload. The stages whose activations may move: those of the first --offload-chunk-num
    chunks of every rank (stages below that many times p, in a loop and in a V alike; 0: every
    stage, where the fork would move none). times: None, so the copies are timed in the profiled
    calls (--auto-offload-time is what zbpp always does, from this machine, not a table of GPUs);
    or, where nothing is profiled (a fixed order, or plan_from_measured off), F = B = W = 1 with
    each copy --offload-time times F + B, as the fork reads that flag."""
    if not opts.cpu_offload:
        return None, None
    n = opts.offload_chunk_num
    chosen = "auto" if n == 0 or n >= v else list(range(n * p))
    return chosen, {"f": 1.0, "b": 1.0, "w": 1.0, "offload": 2.0 * opts.offload_time,
                    "reload": 2.0 * opts.offload_time}


def options():
    """The settings in effect now: configure(args=...) if given, else Megatron's get_args(), else
    the defaults (no flag: 1F1B); configure()'s kind, mem_limit and timeout on top."""
    args = _config.get("args")
    if args is None:
        args = _megatron_args()
    values = _read_args(args) if args is not None else {}
    if _config.get("kind") is not None:
        values["kind"] = _config["kind"]
    if _config.get("mem_limit") is not None:
        values["mem_limit"] = _config["mem_limit"]
    if _config.get("timeout") is not None:
        values["timeout"] = float(_config["timeout"])
    if _config.get("plan_from_measured") is not None:
        values["plan_from_measured"] = bool(_config["plan_from_measured"])
    return Options(**values)


def profile_steps(opts=None):
    """(first, last) training call whose measured costs the zero-bubble schedule is planned from,
    both included and counted from 1, as the reference fork's timers: from
    --zero-bubble-pipeline-timers-start-iter / -end-iter (one given alone: that call only), else
    zbpp's default (2, 3): the first call carries one-off costs, and zbpp times every op anyway."""
    from ..pipelining import DEFAULT_PROFILE_STEPS

    opts = options() if opts is None else opts
    start, end = opts.zero_bubble_pipeline_timers_start_iter, opts.zero_bubble_pipeline_timers_end_iter
    if start is None and end is None:
        return DEFAULT_PROFILE_STEPS
    return (start if start is not None else end, end if end is not None else start)


def schedule_for(num_chunks, p, opts=None):
    """(kind, mem_limit): the zbpp schedule for num_chunks model chunks per rank on p ranks under
    `opts` (default: options()). Raises ValueError when the chunk count does not fit the kind."""
    opts = options() if opts is None else opts
    mem = None
    if opts.kind is not None:
        kind = get_schedule_class(opts.kind).kind
        mem = opts.mem_limit
        if mem is None and kind == "zb-auto":
            from ..schedule import _resolve_kind
            factor = _resolve_kind(opts.kind)[1]  # "zb-2p" carries its limit as a factor of p
            mem = factor * p if factor > 0 else None
        source = f"configure(kind={opts.kind!r})"
    elif opts.zero_bubble_v_schedule:
        kind = _MEM_SETUPS[opts.zero_bubble_v_schedule_mem_setup]
        source = "--zero-bubble-v-schedule"
    else:
        if opts.zero_bubble_v_schedule_mem_setup != "zb":
            raise ValueError(f"zbpp.megatron: --zero-bubble-v-schedule-mem-setup "
                             f"{opts.zero_bubble_v_schedule_mem_setup} selects a V schedule's memory "
                             "and needs --zero-bubble-v-schedule")
        if opts.enable_zero_bubble:
            if num_chunks != 1:
                raise ValueError(
                    f"zbpp.megatron: --enable-zero-bubble schedules one model chunk per pipeline rank "
                    f"(zb-auto), but the model has {num_chunks} chunks on this rank; for two chunks use "
                    "--zero-bubble-v-schedule (chunks built in V order: chunk 0 is stage r, chunk 1 is "
                    "stage 2p-1-r), or drop --enable-zero-bubble for interleaved 1F1B")
            pending = opts.zero_bubble_max_pending_backward
            kind, mem = "zb-auto", (p if pending == "auto" else pending)
            source = "--enable-zero-bubble"
        else:
            kind = "1f1b" if num_chunks == 1 else "interleaved-1f1b"
            source = "no zero-bubble flag"
    _check_chunks(kind, num_chunks, source)
    return kind, mem


def _check_chunks(kind, v, source):
    if kind in V_KINDS and v != 2:
        raise ValueError(
            f"zbpp.megatron: {kind} ({source}) needs 2 model chunks per pipeline rank, placed in a V "
            f"(chunk 0 is stage r, chunk 1 is stage 2p-1-r), but the model has {v} chunk(s) on this "
            "rank; pass model=[chunk0, chunk1] with one data iterator per chunk")
    if kind in _ONE_CHUNK_KINDS and v != 1:
        raise ValueError(f"zbpp.megatron: {kind} ({source}) takes 1 model chunk per pipeline rank, but the "
                         f"model has {v}; use interleaved-1f1b or a V schedule for several chunks")
    if kind == "interleaved-1f1b" and v < 2:
        raise ValueError(f"zbpp.megatron: interleaved-1f1b ({source}) needs at least 2 model chunks per "
                         f"pipeline rank, but the model has {v}")
    if kind == "zb-auto" and v not in (1, 2):
        raise ValueError(f"zbpp.megatron: zb-auto ({source}) schedules 1 model chunk per rank (loop) or 2 "
                         f"(V), but the model has {v}")



# ---- argument parser extension -----------------------------------------------------------------------

def _pending_arg(text):
    try:
        return _pending(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser):
    """Adds the zero-bubble flags to an argparse parser and returns it (Megatron's
    extra_args_provider shape: `pretrain(..., extra_args_provider=zbpp.megatron.add_arguments)`).
    Flags the parser already has (a Megatron built from the reference fork defines them) are left
    as they are."""
    existing = getattr(parser, "_option_string_actions", {})
    group = parser.add_argument_group(
        title="zero bubble",
        description="zbpp's schedules behind Megatron's get_forward_backward_func "
                    "(zbpp.megatron.patch()); without a flag: 1F1B, or interleaved 1F1B with several "
                    "model chunks")

    def add(flag, **kwargs):
        if flag not in existing:
            group.add_argument(flag, **kwargs)

    add("--enable-zero-bubble", action="store_true", dest="enable_zero_bubble",
        help="Use a zero-bubble schedule: zbpp's automatic scheduler (zb-auto) under the memory limit "
             "of --zero-bubble-max-pending-backward, one model chunk per pipeline rank.")
    add("--zero-bubble-v-schedule", action="store_true", dest="zero_bubble_v_schedule",
        help="Use the ZB-V schedule: two model chunks per pipeline rank in a V (chunk 0 is stage r, "
             "chunk 1 is stage 2p-1-r), 1F1B's memory and no bubble once there are >= 2p microbatches.")
    add("--zero-bubble-v-schedule-mem-setup", default="zb", choices=sorted(_MEM_SETUPS),
        dest="zero_bubble_v_schedule_mem_setup",
        help="Memory of the V schedule: zb (ZB-V, 1F1B's activation memory), half (V-Half, about half "
             "of it) or min (V-Min, about a third). Default: zb.")
    add("--zero-bubble-max-pending-backward", type=_pending_arg, default="auto",
        dest="zero_bubble_max_pending_backward",
        help="Memory limit of --enable-zero-bubble's schedule, in microbatches whose activations a "
             "rank may hold (p ranks: p is 1F1B's peak, 2p allows ZB-H2-like schedules). Default: "
             "auto: on GPUs, measured by the first step (the activations of one microbatch and what "
             "else the step allocates, against --zero-bubble-adaptive-memory-limit-percentile of the "
             "device's memory), between p and 2p; p until then, and on CPUs.")
    add("--zero-bubble-adaptive-memory-limit-percentile", type=int, default=85,
        dest="zero_bubble_adaptive_memory_limit_percentile",
        help="With --zero-bubble-max-pending-backward auto on GPUs: the share of the device's memory (in "
             "percent) the pipeline's activations may fill, from which the memory limit is measured.")
    for flag, dest in (("--enable-zb-runtime", "enable_zb_runtime"),
                       ("--enable-exactly-numeric-match", "enable_exactly_numeric_match")):
        add(flag, action="store_true", dest=dest, help="The reference fork's flag; accepted, changes nothing in zbpp.")
    add("--no-pre-communication-optimization", action="store_false", dest="pre_communication_optimization",
        help="The reference fork's flag; accepted, changes nothing in zbpp.")
    add("--zero-bubble-pipeline-timers-start-iter", type=int, default=None,
        dest="zero_bubble_pipeline_timers_start_iter",
        help="First training iteration (counted from 1) whose measured op times, transfer times and "
             "activation memory the zero-bubble schedule is planned from; the new plan runs from the "
             "iteration after --zero-bubble-pipeline-timers-end-iter. Default: 2 (the reference fork's: 100).")
    add("--zero-bubble-pipeline-timers-end-iter", type=int, default=None,
        dest="zero_bubble_pipeline_timers_end_iter",
        help="Last training iteration measured for the plan (see the start flag). Default: 3 (the "
             "reference fork's: 110).")
    add("--cpu-offload", action="store_true", dest="cpu_offload",
        help="PipeOffload: move activations to host memory after their forward and back before their backward, "
             "where the copies hide behind the compute (the step may grow by 2%% at most). Any schedule.")
    add("--offload-chunk-num", type=int, default=0, dest="offload_chunk_num",
        help="With --cpu-offload: only the first N model chunks of every rank offload (0: every chunk).")
    add("--offload-time", type=float, default=1.0, dest="offload_time",
        help="With --cpu-offload, where no costs are measured (a fixed order such as 1F1B, or plans from "
             "measured costs off): each copy's time as a multiple of a chunk's forward plus backward. "
             "Zero-bubble schedules measure it instead.")
    add("--auto-offload-time", action="store_true", dest="auto_offload_time",
        help="The reference fork's flag; zbpp always measures the copy times (accepted).")
    add("--offload-overlap-sr", action="store_true", dest="offload_overlap_sr",
        help="The reference fork's flag; zbpp runs one copy lane per rank (accepted, changes nothing).")
    for flag, dest, unset, why in _UNSUPPORTED:
        if unset is False:
            add(flag, action="store_true", dest=dest, help=f"The reference fork's flag; refused by zbpp: {why}.")
        else:
            add(flag, type=int, default=unset, dest=dest,
                help=f"The reference fork's flag; zbpp accepts only {unset}: {why}.")
    add("--enable-vocab-parallel", action="store_true", dest="enable_vocab_parallel",
        help="Vocabulary Parallelism: the output layer (with its cross entropy) and the word embedding split "
             "over the vocabulary across every pipeline rank, their passes placed in the schedule. Build the "
             "model with zbpp.megatron.vocab_model_provider(model_provider). CPU (gloo) pipelines for now.")
    add("--disable-backward-fusion", action="store_true", dest="disable_backward_fusion",
        help="With --enable-vocab-parallel: the output layer's input gradient in its T pass (two barriers a "
             "microbatch, p+2 microbatches of activations in 1F1B) instead of fused into S (one barrier, p+1).")
    add("--enable-optimizer-post-validation", action="store_true", dest="enable_optimizer_post_validation",
        help="Step the optimizer with post-validation (no global synchronisation before the step; a "
             "step that turns out invalid is rolled back). Read by the optimizer wrapper.")
    return parser
