"""Megatron-LM drop-in: zbpp's schedules behind Megatron's `get_forward_backward_func()`.

What this is: `forward_backward_func`, a function with the keyword-only signature of the one
`megatron.core.pipeline_parallel.get_forward_backward_func()` returns, whose training pass is
run by the C runner with a zbpp schedule (1F1B, interleaved 1F1B, ZB-H1/H2, ZB-V, V-Half, V-Min
or the automatic zero-bubble scheduler); `patch()` installs it where Megatron looks the function
up, so `train_step` and `evaluate` use it unchanged:

    import zbpp.megatron
    zbpp.megatron.patch()                                   # after Megatron is importable
    pretrain(..., extra_args_provider=zbpp.megatron.add_arguments)  # the reference fork's flags

Semantics follow Megatron's schedules.py: `forward_step_func(data_iterator, model_chunk)` returns
`(output_tensor, loss_func)`; the loss stage's `loss_func(output_tensor)` returns `(loss,
reduced_dict)`, whose loss is divided by num_microbatches before backward, or `(loss, num_tokens,
reduced_dict)`, whose loss is divided by max(num_tokens, 1) and then by num_microbatches unless
`config.calculate_per_token_loss` is set (then it is left as is and the summed num_tokens go to
`config.finalize_model_grads_func`, which divides the gradients). `config.grad_scale_func` scales
the loss before backward. Non-first stages receive their input through
`model_chunk.set_input_tensor([tensor])` (a one-element list, as Megatron passes it; the first
stage gets `[None]`). The call returns the per-microbatch reduced dicts on the rank holding the
last stage and `[]` elsewhere. Gradients are not scaled by zbpp.

Placement: pipeline rank r of p holds its model chunks as stages. Loop schedules: chunk c is stage
c*p + r (Megatron's virtual pipeline layout). V schedules (zb-v, v-half, v-min, and zb-auto with
two chunks): chunk 0 is stage r, chunk 1 is stage 2p-1-r, so rank 0 holds the first and the last
stage; the model chunks must be built in that order.

Schedule from the flags (read from `megatron.training.get_args()`, or from `configure(args=...)`):
    --zero-bubble-v-schedule                  zb-v; with --zero-bubble-v-schedule-mem-setup
                                              half / min: v-half / v-min (memory p/2, p/3)
    --enable-zero-bubble                      zb-auto (the automatic scheduler; at 1F1B's memory its
                                              schedules simulate no longer than ZB-H1's) with memory
                                              limit --zero-bubble-max-pending-backward N microbatches
                                              ("auto": p, the peak of 1F1B and ZB-H1)
    none                                      1f1b (one chunk per rank) or interleaved-1f1b
`configure(kind=...)` overrides the choice with any zbpp kind name.

Forward only (evaluation): the C runner always runs backwards, so forward_only=True runs in Python:
each rank goes through its stages in stage order and, for each, through the microbatches in order,
receiving a stage's input from the rank holding the stage before it (torch.distributed irecv) and
sending its output on (isend). No gradients are touched, nothing waits for a backward, and the
pipeline still overlaps (stage s+1 starts as soon as microbatch 0 arrives); it reuses the
forward_step_func path of training, so both see the same inputs.

What this is not: Megatron. It does not build models, split layers, reduce gradients across data
parallel ranks (`config.finalize_model_grads_func` does that, as in Megatron) or step optimizers
(--enable-optimizer-post-validation is only read here and exposed as `options()`' value; the
optimizer wrapper lives in zbpp.optim). Split the backward of a chunk's Linear layers with
`zbpp.split_linear(chunk)` to get zero-bubble W passes; unsplit layers run their weight gradients
in B. Not supported (a clear error, not a silent difference): variable_seq_lengths, MoE auxiliary
and MTP loss scaling, adjust_tensor_shapes_fn, a caller's p2p_communicator. Ignored:
decoder_seq_length, first_val_step, config.timers, overlap of gradient reduction with backward
(grad_sync_func / param_sync_func are not called; finalize_model_grads_func reduces at the end).
"""

import argparse
import contextlib
import datetime
import importlib
import inspect
import warnings
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import _lib, runtime
from .distributed import global_rank, group_rank, group_size
from .pipelining import PipelineSchedule, PipelineStage, get_schedule_class

__all__ = ["Options", "add_arguments", "configure", "current_schedule", "forward_backward_func",
           "get_forward_backward_func", "options", "patch", "reset", "schedule_for", "unpatch"]

V_KINDS = ("zb-v", "v-half", "v-min")
_ONE_CHUNK_KINDS = ("gpipe", "1f1b", "zb-h1", "zb-h2")
_MEM_SETUPS = {"zb": "zb-v", "half": "v-half", "min": "v-min"}

# Forward-only transfers: tags above the runner's channels and the shape inference tag (1 << 20).
_EVAL_TAG = 1 << 21

# Where Megatron looks get_forward_backward_func up. training.py imported the name at its own
# import, so patching the package alone would not reach it. "megatron.training" is the module of
# older Megatron (megatron/training.py); it is patched only where it has the name.
_TARGETS = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules",
            "megatron.training.training", "megatron.training")

# Keyword arguments of Megatron's forward-backward functions this adapter knows; zbpp's own are
# hidden_size and pipeline_dtype (for a model chunk without a .config).
_KNOWN_KWARGS = frozenset({"adjust_tensor_shapes_fn", "p2p_communicator", "pg_collection",
                           "force_all_reduce", "hidden_size", "pipeline_dtype"})


# ---- options: the zero-bubble flags ----------------------------------------------------------------

class Options(NamedTuple):
    """The zero-bubble settings in effect (see options()).

    enable_zero_bubble, zero_bubble_v_schedule, zero_bubble_v_schedule_mem_setup ('zb', 'half' or
    'min'), zero_bubble_max_pending_backward ('auto' or an int, in microbatches),
    enable_optimizer_post_validation: the flags. kind, mem_limit: configure()'s override of the
    schedule (None: from the flags). timeout: seconds one transfer may take.
    """

    enable_zero_bubble: bool = False
    zero_bubble_v_schedule: bool = False
    zero_bubble_v_schedule_mem_setup: str = "zb"
    zero_bubble_max_pending_backward: Union[str, int] = "auto"
    enable_optimizer_post_validation: bool = False
    kind: Optional[str] = None
    mem_limit: Union[None, float, str] = None
    timeout: float = 300.0


_config = {}


def configure(args=None, *, pipeline_rank=None, pipeline_world_size=None, pipeline_group=None,
              kind=None, mem_limit=None, timeout=None):
    """Settings for runs without Megatron's globals (tests, custom loops), or to override them.

    args: a namespace with the zero-bubble flags (what add_arguments' parser returns); used
    instead of megatron.training.get_args(). pipeline_rank / pipeline_world_size / pipeline_group:
    this rank's place in the pipeline, used instead of megatron.core.parallel_state (the group
    defaults to torch.distributed's default group; rank and size to the group's). kind: a zbpp
    schedule kind name that overrides the flags (e.g. "zb-h1"); mem_limit: its memory limit (for
    zb-auto). timeout: seconds a transfer may take before the step fails naming the peer.

    Each call replaces the previous configuration (configure() clears it) and drops the cached
    schedule.
    """
    global _config
    if args is not None:
        _read_args(args)  # fail now, not at the first step
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"zbpp.megatron.configure: timeout must be a number > 0, got {timeout!r}")
    reset()
    _config = {"args": args, "rank": pipeline_rank, "size": pipeline_world_size,
               "group": pipeline_group, "kind": kind, "mem_limit": mem_limit, "timeout": timeout}


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


def _read_args(args):
    setup = getattr(args, "zero_bubble_v_schedule_mem_setup", None) or "zb"
    pending = getattr(args, "zero_bubble_max_pending_backward", None)
    if setup not in _MEM_SETUPS:
        raise ValueError(f"--zero-bubble-v-schedule-mem-setup must be one of zb, half, min; got {setup!r}")
    return dict(
        enable_zero_bubble=bool(getattr(args, "enable_zero_bubble", False)),
        zero_bubble_v_schedule=bool(getattr(args, "zero_bubble_v_schedule", False)),
        zero_bubble_v_schedule_mem_setup=setup,
        zero_bubble_max_pending_backward=_pending("auto" if pending is None else pending),
        enable_optimizer_post_validation=bool(getattr(args, "enable_optimizer_post_validation", False)),
    )


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
    return Options(**values)


def schedule_for(num_chunks, p, opts=None):
    """(kind, mem_limit): the zbpp schedule for num_chunks model chunks per rank on p ranks under
    `opts` (default: options()). Raises ValueError when the chunk count does not fit the kind."""
    opts = options() if opts is None else opts
    mem = None
    if opts.kind is not None:
        kind = get_schedule_class(opts.kind).kind
        mem = opts.mem_limit
        if mem is None and kind == "zb-auto":
            from .schedule import _resolve_kind
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


def _is_v(kind, v):
    return kind in V_KINDS or (kind == "zb-auto" and v == 2)


def _stage_of(kind, v, p, rank, c):
    """The stage index of chunk c on pipeline rank `rank`."""
    if _is_v(kind, v):
        return rank if c == 0 else 2 * p - 1 - rank
    return c * p + rank


def _holder(kind, v, p, s):
    """The pipeline rank holding stage s."""
    if _is_v(kind, v):
        return s if s < p else 2 * p - 1 - s
    return s % p


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
             "auto, which means p.")
    add("--enable-optimizer-post-validation", action="store_true", dest="enable_optimizer_post_validation",
        help="Step the optimizer with post-validation (no global synchronisation before the step; a "
             "step that turns out invalid is rolled back). Read by the optimizer wrapper.")
    return parser


# ---- where Megatron keeps its pipeline state ----------------------------------------------------------

def _parallel_state():
    """megatron.core.parallel_state when importable and initialised, else None."""
    try:
        ps = importlib.import_module("megatron.core.parallel_state")
    except ImportError:
        return None
    initialized = getattr(ps, "model_parallel_is_initialized", None)
    if initialized is not None and not initialized():
        return None
    return ps


def _topology(ps, pg_collection):
    """(rank, p, group) of this process in the pipeline."""
    group, rank, size = _config.get("group"), _config.get("rank"), _config.get("size")
    if group is None and pg_collection is not None:
        group = getattr(pg_collection, "pp", None)
    if ps is not None:
        if group is None and hasattr(ps, "get_pipeline_model_parallel_group"):
            group = ps.get_pipeline_model_parallel_group()
        if rank is None:
            rank = ps.get_pipeline_model_parallel_rank()
        if size is None:
            size = ps.get_pipeline_model_parallel_world_size()
    if isinstance(group, (list, tuple)):
        raise NotImplementedError("zbpp.megatron: several pipeline groups per rank (heterogeneous "
                                  "pipelines) are not supported")
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        actual_rank, actual_size = group_rank(group), group_size(group)
        if (rank is not None and rank != actual_rank) or (size is not None and size != actual_size):
            raise ValueError(f"zbpp.megatron: the pipeline says rank {rank} of {size}, but this process is "
                             f"rank {actual_rank} of {actual_size} in the pipeline's process group; pass "
                             "the pipeline group (configure(pipeline_group=...))")
        return actual_rank, actual_size, group
    if size not in (None, 1) or rank not in (None, 0):
        raise RuntimeError(f"zbpp.megatron: a pipeline of {size} ranks needs torch.distributed; call "
                           "torch.distributed.init_process_group first")
    return 0, 1, group


def _parallel_size(ps, name):
    fn = getattr(ps, name, None) if ps is not None else None
    return int(fn()) if fn is not None else 1


@contextlib.contextmanager
def _virtual_rank(ps, chunk_index, chunks):
    """Sets Megatron's virtual pipeline rank to the chunk while it runs (as its interleaved schedule
    does), so is_pipeline_first_stage()/is_pipeline_last_stage() answer for that chunk."""
    setter = getattr(ps, "set_virtual_pipeline_model_parallel_rank", None) if ps is not None else None
    if setter is None or chunks < 2:
        yield
        return
    getter = getattr(ps, "get_virtual_pipeline_model_parallel_rank", None)
    previous = getter() if getter is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # newest Megatron deprecates the setter
        setter(chunk_index)
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            setter(previous)


def _wrapped_attr(model, name):
    """An attribute of a model chunk or of the module it wraps (DDP, Float16Module: .module), as
    Megatron's get_attr_wrapped_model finds it; None if no layer has it."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, name):
            return getattr(model, name)
        model = getattr(model, "module", None)
    return None


# ---- one call's state, shared by the runner's callbacks and the forward-only pass --------------------

class _Call:
    def __init__(self, forward_step_func, iterators, chunks, ps, config, m, cp_size, collect):
        self.forward_step_func, self.iterators, self.chunks, self.ps = forward_step_func, iterators, chunks, ps
        self.m, self.cp_size, self.collect = m, cp_size, collect
        self.per_token = bool(getattr(config, "calculate_per_token_loss", False))
        self.grad_scale_func = getattr(config, "grad_scale_func", None)
        self.next_mb = [0] * len(chunks)
        self.loss_funcs = {}
        self.store = [None] * m
        self.total_tokens = torch.zeros([], dtype=torch.int)

    def forward(self, c, i, x):
        """Runs forward_step_func on chunk c for microbatch i with input x (None on stage 0)."""
        # forward_step_func reads the next item of the chunk's iterator, so the microbatches of a
        # chunk must come in order; zbpp's schedules run them so, and this says it if one did not.
        if i != self.next_mb[c]:
            raise RuntimeError(f"zbpp.megatron: the schedule ran microbatch {i} of model chunk {c} before "
                               f"microbatch {self.next_mb[c]}; Megatron's data iterators need them in order")
        self.next_mb[c] += 1
        chunk = self.chunks[c]
        set_input_tensor = _wrapped_attr(chunk, "set_input_tensor")
        if set_input_tensor is not None:
            set_input_tensor([x])
        elif x is not None:
            raise TypeError(f"zbpp.megatron: model chunk {c} ({type(chunk).__name__}) has no set_input_tensor, "
                            "so it cannot take the previous stage's activation; Megatron's models have it")
        with _virtual_rank(self.ps, c, len(self.chunks)):
            result = self.forward_step_func(self.iterators[c], chunk)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError("zbpp.megatron: forward_step_func must return (output_tensor, loss_func), got "
                            f"{type(result).__name__}")
        return result

    def loss(self, i, out, loss_func):
        """The loss to differentiate for microbatch i (Megatron's forward_step_calc_loss rule); stores
        what the call returns for it."""
        outputs = loss_func(out)
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
            raise TypeError("zbpp.megatron: loss_func must return (loss, reduced_dict) or (loss, num_tokens, "
                            f"reduced_dict), got {type(outputs).__name__}")
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            num_tokens = torch.as_tensor(num_tokens)
            self.total_tokens = self.total_tokens + num_tokens.to(self.total_tokens.dtype).reshape([])
            if not self.per_token:
                loss = loss / torch.clamp(num_tokens, min=1)
                loss = loss / self.m
        else:
            loss, reduced = outputs
            if self.cp_size != 1:
                loss = loss * self.cp_size
            loss = loss / self.m
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"zbpp.megatron: loss_func returned a {type(loss).__name__} loss; it must be a tensor")
        self.store[i] = reduced
        return loss

    def finish_forward_only(self, i, out, loss_func):
        if loss_func is None:
            self.store[i] = out  # Megatron keeps the output when there is no loss function
        elif self.collect:
            self.store[i] = loss_func(out, non_loss_data=True)
        else:
            self.loss(i, out, loss_func)


class _MegatronSchedule(PipelineSchedule):
    """A zbpp schedule whose stages run Megatron's forward_step_func (the pipelining hooks)."""

    def __init__(self, stages, m, kind, mem_limit, timeout, meta, chunk_of):
        super().__init__(stages, m, kind=kind, mem_limit=mem_limit, timeout=timeout)
        S = stages[0].num_stages
        # Megatron's activations are (seq, micro batch, hidden) everywhere; no inference pass, which
        # would read from the data iterators.
        self._meta = {b: list(meta) for b in range(S - 1)}
        self._meta_given = True
        self._chunk_of = chunk_of
        self.call = None

    def _first_inputs(self, i):
        return (), {}

    def _run_stage(self, s, i, inputs, kwargs):
        c = self._chunk_of[s]
        out, loss_func = self.call.forward(c, i, inputs[0] if s > 0 else None)
        if s == self.loss_stage:
            self.call.loss_funcs[i] = loss_func
        return out

    def _compute_loss(self, i, out):
        loss_func = self.call.loss_funcs.pop(i, None)
        if loss_func is None:
            raise ValueError(
                f"zbpp.megatron: forward_step_func returned no loss_func (None) for microbatch {i} on the "
                f"loss stage (stage {self.loss_stage}, model chunk {self._chunk_of[self.loss_stage]}); on the "
                "last stage it must return (output_tensor, loss_func) with loss_func(output_tensor) -> "
                "(loss, reduced_dict)")
        return self.call.loss(i, out, loss_func)

    def _loss_backward(self, loss):
        if self.call.grad_scale_func is not None:
            loss = self.call.grad_scale_func(loss)  # as Megatron's backward_step does on the last stage
        loss.backward()


_cache = {"key": None, "schedule": None}


def current_schedule():
    """The zbpp PipelineSchedule of the last training call (for .schedule.kind, .timeline()), or None."""
    return _cache["schedule"]


def reset():
    """Closes the cached schedule (its runner and transport); the next call builds a new one."""
    sched = _cache["schedule"]
    _cache["key"] = _cache["schedule"] = None
    if sched is not None:
        sched.close()


def _schedule(key, build):
    if _cache["key"] != key or _cache["schedule"] is None:
        reset()
        _cache["schedule"] = build()
        _cache["key"] = key
    return _cache["schedule"]


# ---- the forward-backward function -------------------------------------------------------------------

def _pipeline_meta(config, seq_length, micro_batch_size, ps, kwargs):
    hidden = kwargs.get("hidden_size", getattr(config, "hidden_size", None))
    if hidden is None:
        raise ValueError("zbpp.megatron: the activation shape needs hidden_size: give the model chunks a "
                         ".config with hidden_size (Megatron's TransformerConfig) or pass hidden_size=...")
    dtype = (kwargs.get("pipeline_dtype") or getattr(config, "pipeline_dtype", None)
             or getattr(config, "params_dtype", None) or torch.float32)
    seq = int(seq_length) // _parallel_size(ps, "get_context_parallel_world_size")
    if getattr(config, "sequence_parallel", False):
        seq //= _parallel_size(ps, "get_tensor_model_parallel_world_size")
    return [(dtype, (seq, int(micro_batch_size), int(hidden)))]


def _check_config(config, kwargs):
    if getattr(config, "variable_seq_lengths", False):
        raise NotImplementedError("zbpp.megatron: variable_seq_lengths is not supported; every microbatch "
                                  "of a call has the shape (seq_length, micro_batch_size, hidden_size)")
    if getattr(config, "num_moe_experts", None) is not None or getattr(config, "mtp_num_layers", None) is not None:
        raise NotImplementedError("zbpp.megatron: MoE auxiliary-loss and MTP loss scaling are not supported")
    if kwargs.get("adjust_tensor_shapes_fn") is not None:
        raise NotImplementedError("zbpp.megatron: adjust_tensor_shapes_fn is not supported")
    if kwargs.get("p2p_communicator") is not None:
        raise NotImplementedError("zbpp.megatron: a p2p_communicator is not used; zbpp's runner does the "
                                  "transfers over the pipeline group (pass pg_collection or configure())")
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        warnings.warn(f"zbpp.megatron: ignoring forward_backward_func arguments {unknown}", stacklevel=3)


def _no_sync(config):
    fn = getattr(config, "no_sync_func", None)
    if fn is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for f in (fn if isinstance(fn, (list, tuple)) else [fn]):
        stack.enter_context(f())
    return stack


def _finalize(config, chunks, call, kwargs):
    """config.finalize_model_grads_func(model, num_tokens, ...) as Megatron calls it after the
    backwards (data-parallel reduction); older Megatron's take the model list only."""
    fn = getattr(config, "finalize_model_grads_func", None)
    if fn is None:
        return
    num_tokens = call.total_tokens if call.per_token else None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        fn(chunks, num_tokens)
        return
    kinds = [prm.kind for prm in params.values()]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                     for k in kinds)
    var_kw = inspect.Parameter.VAR_KEYWORD in kinds
    args = [chunks]
    if positional >= 2 or inspect.Parameter.VAR_POSITIONAL in kinds:
        args.append(num_tokens)
    extra = {}
    for name in ("pg_collection", "force_all_reduce"):
        if kwargs.get(name) is not None and (name in params or var_kw):
            extra[name] = kwargs[name]
    fn(*args, **extra)


def forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                          micro_batch_size, decoder_seq_length=None, forward_only=False,
                          collect_non_loss_data=False, first_val_step=None, **kwargs):
    """Megatron's forward-backward function, run by zbpp (see the module docstring).

    model: a module or a list of this rank's model chunks; data_iterator: an iterator or a list,
    one per chunk (each is read num_microbatches times: once per forward_step_func call).
    Returns the loss stage's per-microbatch reduced dicts (or, with collect_non_loss_data and
    forward_only, loss_func(output, non_loss_data=True)) on the rank holding the last stage, [] on
    the others. decoder_seq_length and first_val_step are accepted and ignored.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("zbpp.megatron: model must be a torch.nn.Module or a non-empty list of them (the "
                        "model chunks of this pipeline rank)")
    if isinstance(data_iterator, (list, tuple)):
        iterators = list(data_iterator)
        if len(iterators) != len(chunks):
            raise ValueError(f"zbpp.megatron: {len(iterators)} data iterators for {len(chunks)} model chunks; "
                             "pass one per chunk")
    elif len(chunks) == 1:
        iterators = [data_iterator]
    else:
        raise ValueError(f"zbpp.megatron: the model has {len(chunks)} chunks, so data_iterator must be a list "
                         "with one iterator per chunk (as for Megatron's interleaved schedule)")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"zbpp.megatron: num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if collect_non_loss_data and not forward_only:
        raise ValueError("zbpp.megatron: collect_non_loss_data needs forward_only=True (there is no loss to "
                         "differentiate)")
    config = _wrapped_attr(chunks[0], "config")
    _check_config(config, kwargs)
    ps = _parallel_state()
    rank, p, group = _topology(ps, kwargs.get("pg_collection"))
    opts = options()
    v = len(chunks)
    kind, mem_limit = schedule_for(v, p, opts)
    S = p * v
    meta = _pipeline_meta(config, seq_length, micro_batch_size, ps, kwargs)
    m = num_microbatches
    call = _Call(forward_step_func, iterators, chunks, ps, config, m,
                 _parallel_size(ps, "get_context_parallel_world_size"), collect_non_loss_data)
    stage_of = [_stage_of(kind, v, p, rank, c) for c in range(v)]
    holds_loss = (S - 1) in stage_of

    if forward_only:
        _forward_only(call, kind, v, p, rank, group, stage_of, S, meta, opts.timeout)
        return call.store if holds_loss else []

    def build():
        device = next((prm.device for c in chunks for prm in c.parameters()), torch.device("cpu"))
        stages = [PipelineStage(chunks[c], stage_of[c], S, device, group=group) for c in range(v)]
        return _MegatronSchedule(stages, m, kind, mem_limit, opts.timeout, meta,
                                 {s: c for c, s in enumerate(stage_of)})

    key = (kind, mem_limit, p, rank, m, tuple(id(c) for c in chunks), id(group),
           tuple((str(d), s) for d, s in meta), opts.timeout)
    sched = _schedule(key, build)
    sched.call = call
    try:
        with _no_sync(config):
            sched._run_iteration()
    except BaseException as exc:
        # After a failure the runner and the transport's pairs are in an unknown state: the next
        # call starts from a fresh schedule.
        sched.call = None
        with contextlib.suppress(Exception):
            reset()
        cause = exc.__cause__
        if isinstance(exc, _lib.ZbError) and cause is not None and not isinstance(cause, _lib.ZbError):
            # An exception raised in forward_step_func, loss_func or the model: a Megatron caller
            # expects it as itself (e.g. StopIteration from an exhausted data iterator); the
            # runner's error, which names the op, stays attached as its cause.
            exc.__cause__ = None
            raise cause from exc
        raise
    sched.call = None
    _finalize(config, chunks, call, kwargs)
    return call.store if holds_loss else []


def get_forward_backward_func(*args, **kwargs):
    """Replacement for megatron.core.pipeline_parallel.get_forward_backward_func: returns
    forward_backward_func whatever the sizes given (pp_size/vp_size are ignored; the schedule comes
    from the zero-bubble flags and the number of model chunks)."""
    return forward_backward_func


# ---- forward only ------------------------------------------------------------------------------------

def _wait(work, peer, what, timeout):
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        code = runtime.ZB_ERR_TIMEOUT if timed_out else runtime.ZB_ERR_REMOTE
        raise _lib.ZbError(code, f"zbpp.megatron forward-only pass: {what} pipeline rank {peer} "
                                 f"{'timed out' if timed_out else 'failed'}: {text}") from exc


def _single_tensor(out, stage):
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"zbpp.megatron: stage {stage} must return one tensor to pass to the next stage, got "
                        f"{type(out).__name__}")
    return out


def _forward_only(call, kind, v, p, rank, group, stage_of, S, meta, timeout):
    """Every microbatch forward through the pipeline, stage by stage, no backward (see the module
    docstring). Sends are non-blocking and each rank walks its stages in increasing order, so a
    receive only waits for a stage that its holder runs before any later one: no deadlock."""
    (dtype, shape), = meta
    m = call.m
    sends, carry = [], {}
    for s, c in sorted((s, c) for c, s in enumerate(stage_of)):
        for i in range(m):
            x = None
            if s > 0:
                prev = _holder(kind, v, p, s - 1)
                if prev == rank:
                    x = carry.pop((s - 1, i))
                else:
                    x = torch.empty(shape, dtype=dtype)
                    work = dist.irecv(x, src=global_rank(group, prev), group=group, tag=_EVAL_TAG + (s - 1) * m + i)
                    _wait(work, prev, "receive from", timeout)
            out, loss_func = call.forward(c, i, x)
            if s == S - 1:
                call.finish_forward_only(i, out, loss_func)
                continue
            out = _single_tensor(out, s)
            if out.dtype != dtype or tuple(out.shape) != shape:
                raise ValueError(f"zbpp.megatron: stage {s} returned a {out.dtype} tensor of shape "
                                 f"{tuple(out.shape)} for microbatch {i}, but the pipeline passes {dtype} "
                                 f"{shape} (seq_length, micro_batch_size, hidden_size)")
            nxt = _holder(kind, v, p, s + 1)
            t = out.detach()
            if nxt == rank:
                carry[(s, i)] = t
            else:
                t = t.contiguous()
                sends.append((dist.isend(t, dst=global_rank(group, nxt), group=group, tag=_EVAL_TAG + s * m + i),
                              t, nxt))
    for work, _t, peer in sends:
        _wait(work, peer, "send to", timeout)


# ---- patching Megatron ---------------------------------------------------------------------------------

_saved = {}


def patch():
    """Installs get_forward_backward_func (returning forward_backward_func) where Megatron looks it up:
    megatron.core.pipeline_parallel, its schedules module and megatron.training.training (which
    imported the name), whichever are importable. Idempotent. Returns the patched module names;
    raises ImportError when none is importable."""
    patched = []
    for name in _TARGETS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "get_forward_backward_func", None)
        if current is None:
            continue
        if current is not get_forward_backward_func:
            _saved[name] = (module, current)
            module.get_forward_backward_func = get_forward_backward_func
        patched.append(name)
    if not patched:
        raise ImportError("zbpp.megatron.patch: Megatron-LM was not found (none of "
                          + ", ".join(_TARGETS[:3]) + " is importable); install Megatron-LM or put it "
                          "on PYTHONPATH before calling patch()")
    return patched


def unpatch():
    """Restores what patch() replaced; returns the restored module names ([] if nothing was patched)."""
    restored = []
    for name, (module, original) in list(_saved.items()):
        if getattr(module, "get_forward_backward_func", None) is get_forward_backward_func:
            module.get_forward_backward_func = original
            restored.append(name)
        del _saved[name]
    return restored
