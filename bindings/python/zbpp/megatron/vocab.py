"""Vocabulary Parallelism behind Megatron's function (sail-sg/VocabularyParallelism's flags
--enable-vocab-parallel and --disable-backward-fusion).

What this is: vocab_model_provider(model_provider), which builds Megatron's GPT chunks as usual and,
with --enable-vocab-parallel, moves the word embedding and the output layer out of them: every
pipeline rank gets its rows of both (a zbpp.VocabParallel, sharded over the pipeline ranks; one
shard when they are tied) as parameters of its first chunk, `zbpp_vocab`, which Megatron's DDP and
optimizer then own like any other (their gradients go to main_grad); the first stage's word
embedding becomes a hook that asks every rank for its rows, and the last stage's output layer and
cross entropy a hook that returns the hidden states and hands over the labels. The schedule
(run.py) then runs the passes S, T, IF and IB on every rank, placed in its plan, with
zbpp/pipelining/_vocab.py's lanes in fed mode:

  stage 0's forward: forward_step_func reads the batch; the word-embedding hook hands the token ids
      to the IF lane, which sends them to every rank; every rank adds its rows; the SUM comes back
      into Megatron's embedding (position embeddings, dropout and all);
  the last stage's forward: the decoder's output (after the final norm) and the labels go to every
      rank (lane H); S and its all-reduces give each token's cross entropy on every rank;
  the loss: Megatron's loss_func (pretrain_gpt's, with its loss mask) on those per-token losses, on
      the last stage's rank, with Megatron's rules (run.py's _Call.loss: num_tokens, num_microbatches,
      grad_scale_func); its gradient per token goes to every rank, for T (and, fused, the last
      stage's output gradient);
  stage 0's backward: the embedding output's gradient (through a zero "anchor" input, so zbpp's B
      computes it) goes to every rank in IB.

Forward-only calls (Megatron's evaluate) do the same in Python (evaluate.py): each microbatch's
embedding is one collective inside stage 0's forward, the losses one S a microbatch after the
forwards.

What it needs: megatron-core's GPTModel (pre_process/post_process, embedding.word_embeddings,
output_layer, compute_language_model_loss), tensor- and context-parallel size 1, fp32 parameters;
every rank calls the provider the same number of times (Megatron's get_model does). On CUDA the
shards move with the model (get_model's .cuda()) and the passes compute on the GPU; their
collectives go through host memory over the pipeline's host group (zbpp/vocab.py). Megatron's padded
vocabulary (--make-vocab-size-divisible-by) is the vocabulary here: its padding rows take part in
the softmax as in Megatron's own layer. Refused with a clear error: the rest, and --cpu-offload.
The whole weights for a checkpoint in the unsharded layout: vocab_parallel_of(model).gather().
"""

import datetime
import functools

import torch
import torch.distributed as dist

from .._runtime_transport import _on_device, _through_host
from ..distributed import global_rank
from ..vocab import VocabParallel
from .flags import options
from .placement import _device_of, _parallel_state, _topology, _wrapped_attr, pipeline_cpu_group

_WHERE = "zbpp.megatron.vocab_model_provider"


class _Context:
    """What the hooks in the model and the schedule share: the VocabParallel, and while a call
    runs, its VocabRun (training) or evaluation, the microbatch running and stage 0's anchor."""

    def __init__(self):
        self.vp = None
        self.run = None      # the schedule's VocabRun while it trains
        self.eval = None     # an _Eval while a forward-only call runs
        self.mb = None
        self.anchor = None


class _Shards(torch.nn.Module):
    """This rank's rows of the word embedding and the output layer, as parameters of its first
    model chunk (so Megatron's DDP and optimizer hold them)."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx  # a plain attribute: not a module
        for name, weight in ctx.vp.named_parameters():
            # As Megatron marks the layers they come from (its --decoupled-lr and optimizers read it).
            weight.is_embedding_or_output_parameter = True
            self.register_parameter(name.replace(".", "_"), weight)

    def extra_repr(self):
        vp = self.ctx.vp
        return f"vocab {vp.vocab_size} x {vp.hidden}, rank {vp.rank} of {vp.ranks}, {'tied' if vp.tied else 'untied'}"


class _WordEmbedding(torch.nn.Module):
    """Stage 0's word embedding under Vocabulary Parallelism: the SUM of every rank's rows."""

    def __init__(self, ctx, hidden, dtype):
        super().__init__()
        self.ctx, self.hidden, self.dtype = ctx, hidden, dtype

    def forward(self, input_ids):
        ctx = self.ctx
        if ctx.eval is not None:
            rows = ctx.eval.embed(input_ids)
            return rows.reshape(*input_ids.shape, self.hidden).to(self.dtype)
        if ctx.run is None:
            raise RuntimeError("zbpp.megatron: this model's word embedding is split over the pipeline ranks "
                               "(--enable-vocab-parallel); run it through zbpp.megatron's forward_backward_func")
        rows = ctx.run.embed_for_stage(ctx.mb, input_ids)
        # The anchor (zeros, stage 0's input in zbpp's runner) carries the gradient to IB.
        return ctx.anchor + rows.reshape(ctx.anchor.shape).to(ctx.anchor.dtype)


class _HiddenOutput(torch.nn.Module):
    """The last stage's output layer under Vocabulary Parallelism: the hidden states go on (to
    every rank's S), as its logits would."""

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **_kwargs):
        return hidden_states, None


def _labels_hook(ctx):
    """GPTModel.compute_language_model_loss(labels, logits) under Vocabulary Parallelism: the
    labels to the passes; the model returns the hidden states [s, b, h] ("logits" here)."""

    def compute_language_model_loss(labels, logits):
        if ctx.eval is not None:
            ctx.eval.targets(labels)
        elif ctx.run is not None:
            # The hidden rows are sequence-major ([s, b] flattened); Megatron's labels are [b, s].
            ctx.run.give_targets(ctx.mb, labels.transpose(0, 1))
        return logits

    return compute_language_model_loss


class Feed:
    """The schedule's side of fed mode (_vocab.VocabRun.set_feed): n tokens a microbatch, and the
    loss gradient per token from Megatron's loss_func."""

    def __init__(self, sched, seq, micro_batch):
        self.sched, self.seq, self.b = sched, seq, micro_batch
        self.n = seq * micro_batch

    def loss_grad(self, mb, loss):
        """On the last stage's rank (the S lane's thread): loss [n], each token's cross entropy in
        the hidden rows' order; returns d(the call's loss)/d(loss) in that order."""
        call = self.sched.call
        loss_func = call.loss_funcs.pop(mb, None)
        if loss_func is None:
            raise ValueError(f"zbpp.megatron: forward_step_func returned no loss_func for microbatch {mb} on the last "
                             "stage; it must return (output_tensor, loss_func)")
        # [b, s]: what Megatron's compute_language_model_loss returns, and its loss_func reads.
        per_token = loss.detach().float().reshape(self.seq, self.b).t().contiguous().requires_grad_(True)
        with torch.enable_grad():
            total = call.loss(mb, per_token, loss_func)
            if call.grad_scale_func is not None:
                total = call.grad_scale_func(total)
            grad, = torch.autograd.grad(total, per_token, allow_unused=True)
        if grad is None:
            grad = torch.zeros_like(per_token)
        return grad.t().reshape(-1)


class _DistCollectives:
    """The collectives outside a training step (a forward-only call, gather() between calls):
    torch.distributed's over the pipeline's CPU group, each bounded by `timeout` seconds (the
    shape of zbpp.runtime.Transport's, which the passes take). A rank that fails or never comes
    makes the others fail at the timeout, naming the collective, as forward-only receives do."""

    def __init__(self, group, timeout):
        self.group, self.timeout = group, float(timeout)

    def _wait(self, work, what):
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"zbpp.megatron (--enable-vocab-parallel): {what} over the pipeline failed or did not "
                               f"finish within {self.timeout:g} s (the timeout): {text}") from exc

    def all_reduce(self, x, op="sum", timeout=None, channel=0):
        if _on_device(x):  # the group is gloo: CPU tensors
            return _through_host(x, lambda h: self.all_reduce(h, op), "all_reduce")
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group,
                               async_op=True)
        self._wait(work, "an all-reduce of the vocabulary passes")
        return x

    def broadcast(self, x, root, timeout=None, channel=0):
        if _on_device(x):
            return _through_host(x, lambda h: self.broadcast(h, root), "broadcast")
        work = dist.broadcast(x, src=global_rank(self.group, root), group=self.group, async_op=True)
        self._wait(work, f"a broadcast from pipeline rank {root}")
        return x


class _Eval:
    """A forward-only call's passes (see the module docstring)."""

    def __init__(self, ctx, call, group, rank, first, last, seq, micro_batch, timeout):
        self.ctx, self.call, self.rank, self.first, self.last = ctx, call, rank, first, last
        self.tr = _DistCollectives(pipeline_cpu_group(group), timeout)
        self.seq, self.b, self.n = seq, micro_batch, seq * micro_batch
        self.kept = []  # on the last stage's rank: (hidden rows, targets, loss_func) per microbatch
        self._targets = None

    def embed(self, input_ids):
        """Stage 0's forward (its rank): the tokens to every rank, the SUM of their rows back."""
        tokens = input_ids.detach().reshape(-1).to("cpu", torch.int64).contiguous()
        if tokens.numel() != self.n:
            raise ValueError(f"zbpp.megatron: stage 0 embeds {tokens.numel()} tokens, the call's shape {self.n}")
        return self._round(tokens)

    def join_embeddings(self, m):
        """Every rank but stage 0's: its part in the m embedding collectives."""
        for _ in range(m):
            self._round(torch.empty(self.n, dtype=torch.int64, device="cpu"))

    def _round(self, tokens):
        emb = self.ctx.vp.embedding
        self.tr.broadcast(tokens, self.first)
        with torch.autocast(emb.device.type, enabled=False):
            return self.tr.all_reduce(emb.embed_local(tokens).contiguous(), "sum")

    def targets(self, labels):
        self._targets = labels.detach().transpose(0, 1).reshape(-1).to("cpu", torch.int64).contiguous()

    def keep(self, i, out, loss_func):
        """The last stage's forward of microbatch i (its rank): its output rows and targets."""
        H = self.ctx.vp.hidden
        if not isinstance(out, torch.Tensor) or out.numel() != self.n * H or self._targets is None:
            raise ValueError(f"zbpp.megatron: the last stage must return the hidden states [{self.seq}, {self.b}, {H}] "
                             "and be given labels under --enable-vocab-parallel")
        self.kept.append((out.detach().reshape(self.n, H).float().contiguous(), self._targets, loss_func))
        self._targets = None

    def losses(self, m):
        """Every rank, after its forwards: one S a microbatch; the last stage's rank gives Megatron's
        loss_func each microbatch's per-token losses ([b, s])."""
        out, H = self.ctx.vp.output, self.ctx.vp.hidden
        for i in range(m):
            mine = self.rank == self.last
            h = self.kept[i][0] if mine else torch.empty(self.n, H, device=out.device)
            target = self.kept[i][1] if mine else torch.empty(self.n, dtype=torch.int64, device="cpu")
            self.tr.broadcast(h, self.last)
            self.tr.broadcast(target, self.last)
            with torch.autocast(out.device.type, enabled=False):
                loss = out.reduce(out.s_pass(h, target, need_grad=False), self.tr)
            if mine:
                per_token = loss.reshape(self.seq, self.b).t().contiguous()
                self.call.finish_forward_only(i, per_token, self.kept[i][2])
        self.kept = []


def _no_sharded_state_dict(*_args, **_kwargs):
    raise NotImplementedError(
        "zbpp.megatron: Megatron's distributed checkpoint (sharded_state_dict, --ckpt-format torch_dist) of a model "
        "built with --enable-vocab-parallel is not supported yet: its word embedding and output layer are split over "
        "the pipeline ranks (zbpp_vocab.*). Save zbpp.megatron.vocab_parallel_of(model).gather() (the whole weights, "
        "every rank calls it) with the rest of the model, or train without the flag")


def idle(ctx):
    """Between calls (and before the first): no step's hooks are armed (a forward outside zbpp gets
    the hook's clear error), and gather() runs over torch.distributed (_DistCollectives)."""
    ctx.run = ctx.anchor = ctx.mb = None
    if getattr(ctx, "idle_transport", None) is not None:
        ctx.vp.embedding.transport = ctx.vp.output.transport = ctx.idle_transport


def context_of(chunks):
    """The _Context of a model built by vocab_model_provider with the flag on, else None."""
    for chunk in chunks:
        shards = _wrapped_attr(chunk, "zbpp_vocab")
        if isinstance(shards, _Shards):
            return shards.ctx
    return None


def vocab_parallel_of(model):
    """The zbpp.VocabParallel of a model (a chunk or the list of this rank's chunks) built by
    vocab_model_provider under --enable-vocab-parallel, or None: parameters() are this rank's
    shards; gather() (every rank, between steps) the whole weights in the unsharded layout."""
    ctx = context_of(model if isinstance(model, (list, tuple)) else [model])
    return ctx.vp if ctx is not None else None


def check_call(ctx, config, opts, forward_only, collect_non_loss_data, chunks):
    """Why a call cannot run with Vocabulary Parallelism (raised on every rank alike)."""
    why = None
    ddp = _wrapped_attr(chunks[0], "ddp_config")
    devices = {w.device for w in ctx.vp.parameters()}
    stages = {prm.device for c in chunks for prm in c.parameters()}
    if len(devices | stages) > 1:
        why = (f"the split layers are on {sorted(map(str, devices))} and the model's chunks on "
               f"{sorted(map(str, stages))}; move them together (model.cuda() moves the shards too)")
    elif getattr(ddp, "overlap_param_gather", False):
        why = ("--overlap-param-gather does not go with it yet: the split layers are not called as modules, so the "
               "distributed optimizer's gather hooks would not wait for their parameters")
    elif not opts.enable_vocab_parallel:
        why = ("the model was built with --enable-vocab-parallel (its embedding and output layer are split over the "
               "pipeline ranks) but the flag is off now; give the same flags to every call")
    elif bool(opts.disable_backward_fusion) == ctx.vp.fused:
        why = "--disable-backward-fusion differs from when the model was built; give the same flags to every call"
    elif opts.cpu_offload:
        why = "--cpu-offload does not go with --enable-vocab-parallel yet"
    elif forward_only and collect_non_loss_data:
        why = "collect_non_loss_data reads the logits, which no rank has whole under --enable-vocab-parallel"
    elif getattr(config, "fp16", False) or getattr(config, "bf16", False):
        why = "fp16/bf16 parameters are not supported yet under --enable-vocab-parallel (fp32 only)"
    if why is not None:
        raise ValueError(f"zbpp.megatron: {why}")


def vocab_model_provider(model_provider):
    """Wraps a Megatron model provider (model_provider(pre_process, post_process, ...) -> GPTModel)
    so that, with --enable-vocab-parallel, the model Megatron's get_model builds has its word
    embedding and output layer split over the pipeline ranks (see the module docstring); without
    the flag the model is model_provider's, unchanged. Compose with v_model_provider for a V
    schedule: vocab_model_provider(v_model_provider(model_provider)).

    Every pipeline rank calls it for each of its chunks, in order (Megatron's get_model does): the
    ranks holding the first and last stages send the whole weights to the others there, once."""
    state = {}

    @functools.wraps(model_provider)
    def provide(*args, **kwargs):
        model = model_provider(*args, **kwargs)
        if not options().enable_vocab_parallel:
            return model
        ps = _parallel_state()
        if ps is None:
            raise RuntimeError(f"{_WHERE}: Megatron's parallel state is not initialised; call "
                               "initialize_model_parallel (or initialize_megatron) first")
        rounds = ps.get_virtual_pipeline_model_parallel_world_size() or 1
        if not state or state.get("round", 0) >= rounds:
            state.clear()
            state.update(round=0, first=model, ctx=_Context(), weights={}, built=[])
        _convert(model, state, ps)
        state["round"] += 1
        if state["round"] == rounds:
            _finish(state, ps)
        return model

    return provide


def _gpt_parts(gpt):
    pre, post = getattr(gpt, "pre_process", None), getattr(gpt, "post_process", None)
    if not isinstance(pre, bool) or not isinstance(post, bool):
        raise TypeError(f"{_WHERE}: the model must be megatron-core's GPTModel (with pre_process and post_process), "
                        f"got {type(gpt).__name__}")
    return pre, post


def _convert(gpt, state, ps):
    """One provider call: this chunk's hooks, and the whole weights from the ranks that hold them."""
    pre, post = _gpt_parts(gpt)
    config = gpt.config
    for size, name in ((ps.get_tensor_model_parallel_world_size(), "tensor"),
                       (ps.get_context_parallel_world_size(), "context")):
        if size != 1:
            raise NotImplementedError(f"{_WHERE}: {name}-parallel size {size}: Vocabulary Parallelism splits the "
                                      "vocabulary over the pipeline ranks only (tensor and context parallel size 1)")
    bias = getattr(getattr(gpt, "output_layer", None), "bias", None) if post else None
    if isinstance(bias, torch.Tensor):
        raise NotImplementedError(f"{_WHERE}: the output layer has a bias; the split output layer has none "
                                  "(GPT's has none unless --add-bias-linear reaches it)")
    if getattr(config, "mtp_num_layers", None):
        raise NotImplementedError(f"{_WHERE}: multi-token prediction does not go with --enable-vocab-parallel")
    rank, p, group = _topology(ps, None)
    cpu = pipeline_cpu_group(group) if p > 1 else None
    flags = torch.tensor([int(pre), int(post)], dtype=torch.int64)
    everyone = [torch.zeros_like(flags) for _ in range(p)]
    if p > 1:
        dist.all_gather(everyone, flags, group=cpu)
    else:
        everyone = [flags]
    tied = bool(gpt.share_embeddings_and_output_weights)
    state.setdefault("tied", tied)
    H = int(config.hidden_size)
    for col, name in ((0, "embedding"), (1, "output")):
        holders = [r for r, f in enumerate(everyone) if int(f[col])]
        if not holders or (name == "output" and tied):
            continue
        root = holders[0]
        if rank == root:
            layer = gpt.embedding.word_embeddings if name == "embedding" else gpt.output_layer
            whole = layer.weight.detach().to("cpu", torch.float32).contiguous()
            shape = torch.tensor(whole.shape, dtype=torch.int64)
        else:
            shape = torch.zeros(2, dtype=torch.int64)
        if p > 1:
            dist.broadcast(shape, src=global_rank(cpu, root), group=cpu)
            if rank != root:
                whole = torch.empty(int(shape[0]), int(shape[1]), dtype=torch.float32)
            dist.broadcast(whole, src=global_rank(cpu, root), group=cpu)
        state["weights"][name] = whole
    # The layers are swapped for the hooks once every chunk is built (_finish): until then a
    # provider this one wraps may read them (v_model_provider copies a tied weight across chunks).
    state["built"].append((gpt, pre, post, H, config.params_dtype))


def _finish(state, ps):
    """After this rank's last chunk: the shards, as parameters of its first chunk."""
    weights, ctx = state["weights"], state["ctx"]
    missing = [n for n in ("embedding",) + (() if state["tied"] else ("output",)) if n not in weights]
    if missing:
        raise ValueError(f"{_WHERE}: no chunk of any pipeline rank had the {' and the '.join(missing)} layer "
                         "(pre_process / post_process); build the model with the first and last stages")
    rank, p, group = _topology(ps, None)
    emb = weights["embedding"]
    out = emb if state["tied"] else weights["output"]
    opts = options()
    ctx.vp = VocabParallel(out, emb, fused=not opts.disable_backward_fusion)
    ctx.vp._bind(rank, p, _device_of([state["first"]]))  # where the chunk is (get_model moves both after)
    ctx.idle_transport = _DistCollectives(pipeline_cpu_group(group), opts.timeout) if p > 1 else None
    idle(ctx)  # gather() works from here on, between calls too (a collective of the pipeline)
    state["first"].zbpp_vocab = _Shards(ctx)
    state["weights"] = {}
    for gpt, pre, post, hidden, dtype in state.pop("built"):
        if pre:
            gpt.embedding.word_embeddings = _WordEmbedding(ctx, hidden, dtype)
        if post:
            gpt.output_layer = _HiddenOutput()
            gpt.compute_language_model_loss = _labels_hook(ctx)
        # Megatron would all-reduce the two copies of a tied weight between the first and last
        # stage (finalize_model_grads) and pass one to the output layer: one shard a rank now.
        gpt.share_embeddings_and_output_weights = False
        gpt.sharded_state_dict = _no_sharded_state_dict
