"""forward_backward_func: Megatron's training pass run by zbpp's C runner."""

import contextlib
import warnings
from typing import NamedTuple

import torch

from .. import _lib
from ..pipelining import PLANNED_KINDS, PipelineSchedule, PipelineStage
from .evaluate import _forward_only
from .flags import offload, options, profile_steps, schedule_for
from .hooks import GradSync, finalize, forward_losses, optimizer_step, param_sync
from .loss import _Call
from .memory import Meter
from .vocab import Feed, check_call, context_of
from .vocab import idle as vocab_idle
from .placement import (_device_of, _holder, _is_v, _loop_rank, _parallel_size, _parallel_state, _stage_of, _topology,
                        _wrapped_attr, pipeline_cpu_group)


# Keyword arguments of Megatron's forward-backward functions this adapter knows; zbpp's own are
# hidden_size and pipeline_dtype (for a model chunk without a .config).
_KNOWN_KWARGS = frozenset({"adjust_tensor_shapes_fn", "p2p_communicator", "pg_collection",
                           "force_all_reduce", "hidden_size", "pipeline_dtype", "optimizer"})


class _MegatronSchedule(PipelineSchedule):
    """A zbpp schedule whose stages run Megatron's forward_step_func (the pipelining hooks)."""

    def __init__(self, stages, m, kind, mem_limit, timeout, meta, chunk_of, cpu_group=None, plan_from_measured=None,
                 profile_steps=None, offload=None, times=None, vocab=None):
        super().__init__(stages, m, kind=kind, mem_limit=mem_limit, timeout=timeout, cpu_group=cpu_group,
                         plan_from_measured=plan_from_measured, profile_steps=profile_steps, offload=offload,
                         times=times, vocab_parallel=vocab.vp if vocab is not None else None)
        # --enable-vocab-parallel (vocab.py): the passes run in fed mode, the hooks in the model
        # reach this schedule's VocabRun through the context.
        self._vocab_ctx, self._call_meta = vocab, meta
        if vocab is not None:
            (_dtype, (seq, micro_batch, _hidden)), = meta
            self._vp.set_feed(Feed(self, seq, micro_batch))
        S = stages[0].num_stages
        # Megatron's activations are (seq, micro batch, hidden) everywhere; no inference pass, which
        # would read from the data iterators.
        self._meta = {b: list(meta) for b in range(S - 1)}
        self._meta_given = True
        self._chunk_of = chunk_of
        self.call = None
        self.grad_sync = None  # the pass's GradSync (hooks.py) while it runs
        self.meter = None  # a memory.Meter while a call measures for --zero-bubble-max-pending-backward auto

    def _first_inputs(self, i):
        if self._vocab_ctx is not None:
            # Stage 0's word embedding comes from every rank (vocab.py's hook); this zero input is
            # added to it, so zbpp's B computes the embedding output's gradient (for IB) as an
            # input gradient. [micro batch, seq, hidden]: the word embedding's layout.
            (dtype, (seq, micro_batch, hidden)), = self._call_meta
            anchor = torch.zeros(micro_batch, seq, hidden, dtype=dtype, device=self.device, requires_grad=True)
            return (anchor,), {}
        return (), {}

    def _run_stage(self, s, i, inputs, kwargs):
        c = self._chunk_of[s]
        if self._vocab_ctx is not None:
            self._vocab_ctx.mb = i
            self._vocab_ctx.anchor = inputs[0] if s == 0 else None
        run = lambda: self.call.forward(c, i, inputs[0] if s > 0 else None)  # noqa: E731
        out, loss_func = self.meter.forward(run) if self.meter is not None else run()
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

    def _backward(self, s, i, gout_addr, gin_addr):
        """The runner's B, plus: once a chunk's last B has run and every W it pushed has run, its
        gradients are complete, so its reduction starts then (overlapping the rest of the pass)."""
        store = self._store
        before = store.live_tokens()
        super()._backward(s, i, gout_addr, gin_addr)
        if self.meter is not None:
            self.meter.backward_done()
        pending = self._pending.setdefault(s, set())
        pending |= store.live_tokens() - before
        if i == self.n_microbatches - 1:
            self._done_b.add(s)
            self._maybe_sync(s)

    def _on_release(self, token):
        for s, pending in self._pending.items():
            if token in pending:
                pending.discard(token)
                self._maybe_sync(s)
                return

    def _maybe_sync(self, s):
        if self._vocab_ctx is not None and self._chunk_of[s] == 0:
            return  # the vocabulary shards' gradients come from the lanes until the step ends (GradSync's exit)
        if s in self._done_b and not self._pending.get(s) and self.grad_sync is not None:
            self.grad_sync.start(self._chunk_of[s])

    def _run_iteration(self):
        self._pending, self._done_b = {}, set()
        self._store.release_hooks.append(self._on_release)
        try:
            super()._run_iteration()
        finally:
            self._store.release_hooks.remove(self._on_release)

    def _loss_backward(self, loss):
        if self.call.grad_scale_func is not None:
            loss = self.call.grad_scale_func(loss)  # as Megatron's backward_step does on the last stage
        loss.backward()


_cache = {"key": None, "schedule": None}
# --zero-bubble-max-pending-backward auto: the limit measured by the first call (memory.py), per model.
_auto_limits = {}


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


# TransformerConfig fields Megatron's schedules act on that zbpp does not: refused by name, never
# ignored. (enable_autocast/autocast_dtype, set_is_first_microbatch and set_current_microbatch are
# honoured in loss.py; microbatch_group_size_per_vp_stage only orders Megatron's own interleaving.)
_REFUSED_FIELDS = (
    ("num_microbatches_with_partial_activation_checkpoints", lambda v: v is None,
     "Megatron passes checkpoint_activations_microbatch to forward_step_func by its own 1F1B window"),
    ("defer_embedding_wgrad_compute", lambda v: not v,
     "the output layer's deferred weight gradient is Megatron's own W store; split the layer with "
     "zbpp.split_linear instead"),
    ("overlap_moe_expert_parallel_comm", lambda v: not v, "MoE expert-parallel overlap needs Megatron's "
     "combined 1F1B schedule"),
    ("cuda_graph_impl", lambda v: v in (None, "none"), "CUDA graphs capture Megatron's own schedule"),
    ("fine_grained_activation_offloading", lambda v: not v, "activation offloading is driven by Megatron's "
     "schedule"),
)


def _check_config(config, kwargs):
    if getattr(config, "variable_seq_lengths", False):
        raise NotImplementedError("zbpp.megatron: variable_seq_lengths is not supported; every microbatch "
                                  "of a call has the shape (seq_length, micro_batch_size, hidden_size)")
    if getattr(config, "num_moe_experts", None) is not None or getattr(config, "mtp_num_layers", None) is not None:
        raise NotImplementedError("zbpp.megatron: MoE auxiliary-loss and MTP loss scaling are not supported")
    for field, ok, what in _REFUSED_FIELDS:
        value = getattr(config, field, None)
        if not ok(value):
            raise NotImplementedError(f"zbpp.megatron: config.{field} = {value!r} is not supported ({what}); "
                                      "unset it or use Megatron's own schedule")
    if kwargs.get("adjust_tensor_shapes_fn") is not None:
        raise NotImplementedError("zbpp.megatron: adjust_tensor_shapes_fn is not supported")
    if kwargs.get("p2p_communicator") is not None:
        raise NotImplementedError("zbpp.megatron: a p2p_communicator is not used; zbpp's runner does the "
                                  "transfers over the pipeline group (pass pg_collection or configure())")
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        warnings.warn(f"zbpp.megatron: ignoring forward_backward_func arguments {unknown}", stacklevel=3)


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
    ps = _parallel_state()
    rank, p, group = _topology(ps, kwargs.get("pg_collection"))
    if "optimizer" in kwargs:
        # The reference fork's train_step calls a second time with optimizer= after the pass; that call
        # steps the optimizer and reads no data.
        return optimizer_step(kwargs["optimizer"], rank, p)
    _check_config(config, kwargs)
    opts = options()
    vocab = context_of(chunks)  # --enable-vocab-parallel: built by vocab_model_provider (vocab.py)
    if vocab is not None:
        check_call(vocab, config, opts, forward_only, collect_non_loss_data, chunks)
    v = len(chunks)
    kind, mem_limit = schedule_for(v, p, opts)
    group_size_vp = getattr(config, "microbatch_group_size_per_vp_stage", None)
    if v > 1 and not _is_v(kind, v) and group_size_vp not in (None, p):
        raise NotImplementedError(f"zbpp.megatron: config.microbatch_group_size_per_vp_stage = {group_size_vp} is "
                                  f"not supported; zbpp's interleaved schedule groups p = {p} microbatches per chunk")
    m = num_microbatches
    if v > 1 and not _is_v(kind, v) and m % p:
        # Megatron's interleaved schedule groups p microbatches per chunk and refuses the rest (a
        # ValueError below p, a RuntimeError for a remainder); zbpp's kind would take torch's rounds.
        error = ValueError if m < p else RuntimeError
        raise error(f"zbpp.megatron: interleaved 1F1B needs num_microbatches ({m}) to be a multiple of the "
                    f"pipeline-parallel size ({p}), as Megatron's interleaved schedule does (p microbatches per "
                    f"virtual stage group)")
    S = p * v
    meta = _pipeline_meta(config, seq_length, micro_batch_size, ps, kwargs)
    stage_of = [_stage_of(kind, v, p, rank, c) for c in range(v)]
    # Under V, chunk 1 is stage 2p-1-rank: Megatron is told the loop rank of that stage while it runs.
    loop_ranks = [(_loop_rank(s, p) if _is_v(kind, v) and _loop_rank(s, p) != rank else None) for s in stage_of]
    call = _Call(forward_step_func, iterators, chunks, ps, config, m,
                 _parallel_size(ps, "get_context_parallel_world_size"), collect_non_loss_data, loop_ranks,
                 first_val_step, forward_only)
    layout = _Layout(p, rank, group, _holder(kind, v, p, S - 1), stage_of, S)

    if forward_only:
        problem = _v_order_problem(chunks, stage_of, S, kind) if _is_v(kind, v) and p > 1 else None
        if problem is not None:  # (training publishes it; an evaluation-only run fails where it sees it)
            raise ValueError(problem)
        try:
            _forward_only(call, kind, v, p, rank, group, stage_of, S, meta, opts.timeout, vocab)
        finally:
            if vocab is not None:
                vocab_idle(vocab)
        return forward_losses(call.store, layout)

    def build():
        stages = [PipelineStage(chunks[c], stage_of[c], S, device, group=group) for c in range(v)]
        # CUDA: Megatron's pipeline group is NCCL and a subgroup; zbpp's host messages need gloo.
        cpu = pipeline_cpu_group(group) if device.type == "cuda" and p > 1 else None
        # Zero-bubble kinds are planned again from the costs measured in the timer iterations
        # (--zero-bubble-pipeline-timers-start-iter/-end-iter; PipelineSchedule does it).
        measured = opts.plan_from_measured if kind in PLANNED_KINDS else None
        chosen, times = offload(opts, p, v)
        if chosen is not None and kind in PLANNED_KINDS and measured is not False:
            times = None  # timed in the profiled calls, with the other costs
        return _MegatronSchedule(stages, m, kind, mem_limit, opts.timeout, meta,
                                 {s: c for c, s in enumerate(stage_of)}, cpu_group=cpu,
                                 plan_from_measured=measured, profile_steps=profile_steps(opts),
                                 offload=chosen, times=times, vocab=vocab)

    device = _device_of(chunks)
    auto = (opts.kind is None and kind == "zb-auto" and opts.zero_bubble_max_pending_backward == "auto"
            and device.type == "cuda")
    auto_key = (p, rank, tuple(id(c) for c in chunks), m)
    if auto and auto_key in _auto_limits:
        mem_limit = _auto_limits[auto_key]
    # Under "auto" the measured limit is not part of the key: the schedule that measured it plans
    # again for it (replan below), keeping what it has profiled so far.
    key = (kind, "auto" if auto else mem_limit, p, rank, m, tuple(id(c) for c in chunks), id(group),
           tuple((str(d), s) for d, s in meta), opts.timeout, opts.plan_from_measured, profile_steps(opts),
           str(offload(opts, p, v)[0]) if opts.cpu_offload else None, opts.offload_time if opts.cpu_offload else None)
    sched = _schedule(key, build)
    sched.call = call
    if vocab is not None:
        vocab.run = sched._vp  # the hooks in the model reach this call's passes
    if auto and auto_key not in _auto_limits:
        sched.meter = Meter(device)
    try:
        if _is_v(kind, v) and p > 1:
            problem = _v_order_problem(chunks, stage_of, S, kind)
            if problem is not None:
                with sched._failing():  # published: the ranks that cannot see it fail at their handshake
                    raise ValueError(problem)
        param_sync(config, chunks)
        with GradSync(config, chunks) as sync:
            sched.grad_sync = sync
            sched._run_iteration()
    except BaseException as exc:
        # After a failure the runner and the transport's pairs are in an unknown state: the next
        # call starts from a fresh schedule.
        sched.call = sched.grad_sync = sched.meter = None
        if vocab is not None:
            vocab_idle(vocab)
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
    sched.call = sched.grad_sync = None
    if vocab is not None:
        vocab_idle(vocab)
    if sched.meter is not None:
        meter, sched.meter = sched.meter, None
        _auto_limits[auto_key] = meter.limit(opts.zero_bubble_adaptive_memory_limit_percentile, p, group)
        # Every pipeline rank measured and got the same limit (the smallest): plan for it, from the
        # measured costs once there are some (a collective over the pipeline, like the limit).
        sched.replan(mem_limit=_auto_limits[auto_key])
    finalize(config, chunks, call, kwargs, layout)
    return forward_losses(call.store, layout)


class _Layout(NamedTuple):
    """This rank's place: p ranks, its rank and group, the loss stage's rank, its stages, S stages."""

    p: int
    rank: int
    group: object
    loss_rank: int
    stage_of: list
    S: int


def _v_order_problem(chunks, stage_of, S, kind):
    """Why this rank's chunks were not built for the V the kind runs (None: they were, or it cannot
    tell): stock Megatron builds virtual chunks in loop order, so chunk 1 of rank 0 comes without
    the output layer that stage 2p-1 needs (and chunk 1 of the last rank with it), and the run
    would fail deep inside a forward. Megatron's models say what they were built for in
    pre_process and post_process."""
    for c, chunk in enumerate(chunks):
        pre, post = _wrapped_attr(chunk, "pre_process"), _wrapped_attr(chunk, "post_process")
        if not isinstance(pre, bool) or not isinstance(post, bool):
            continue
        s = stage_of[c]
        if pre != (s == 0) or post != (s == S - 1):
            def has(flag):
                return "with" if flag else "without"

            return (f"zbpp.megatron: {kind} is a V schedule, in which this rank's model chunk {c} runs stage {s} of "
                    f"{S}, but the chunk was built {has(pre)} the embedding (pre_process) and {has(post)} the output "
                    "layer (post_process), as Megatron's get_model builds chunks in loop order. Build them in V "
                    "order: get_model(zbpp.megatron.v_model_provider(model_provider), ...), with "
                    "get_embedding_ranks=zbpp.megatron.v_embedding_ranks passed to initialize_model_parallel "
                    "(or pretrain); or choose a loop schedule (interleaved 1F1B, without --zero-bubble-v-schedule)")
    return None


def get_forward_backward_func(*args, **kwargs):
    """Replacement for megatron.core.pipeline_parallel.get_forward_backward_func: returns
    forward_backward_func whatever the sizes given (pp_size/vp_size are ignored; the schedule comes
    from the zero-bubble flags and the number of model chunks)."""
    return forward_backward_func
