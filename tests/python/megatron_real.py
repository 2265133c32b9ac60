"""A tiny real Megatron-LM GPT trained on CPU over gloo, to compare Megatron's own pipeline
schedules with zbpp's (zbpp.megatron.patch()) bit for bit.

Only `megatron.core` (the megatron-core package) is imported; megatron.training is not needed.
Everything Megatron's training script would do for this (get_model, the DDP wrapping, the
config.*_func wiring of train(), pretrain_gpt's get_batch / forward_step / loss_func) is written
out here, small.

API (all in the calling process; the work runs in spawned worker processes, so a script using
it needs the `if __name__ == "__main__":` guard):

    run(world, pp, tp=1, vp=None, steps=2, m=4, dtype="fp32", tied=False, per_token=False,
        overlap_grad_reduce=False, use_zbpp=False, zbpp_kind=None, timeout=120, **more)
        -> Result                     one case; raises WorkerError (the workers' tracebacks) or
                                      WorkerTimeout (their Python stacks) on failure
    run_cases(world, cases, timeout=120)
        -> [Result or WorkerError]    several cases (dicts of run()'s keyword arguments) in one
                                      set of workers, one after the other: the workers import
                                      Megatron once (about 6 s). A case that fails gives its
                                      error in its place; the cases after it run in fresh workers.
    differences(a, b) -> [str]        what is not bit for bit equal between two Results

    `more` / a case's other keys: see DEFAULTS (layers_per_stage, loss_form, attention_mask,
    optimizer, loss_scale, zbpp_split, zbpp_argv, zbpp_timeout, collect, eval_no_grad,
    optimizer_call, misuse, seq_length, micro_batch_size, vocab, fail_rank/fail_mode).
    world = pp * tp * dp. `timeout` is per case, in seconds; it is also the gloo and zbpp timeout.

Result (a dict, everything gathered to rank 0, tensors on CPU):
    losses[step]       the list of reduced loss dicts forward_backward_func returned for the
                       training pass (from the last pipeline stage, data parallel rank 0)
    eval_losses[step]  the same for the forward_only=True pass after the optimizer step
    collected[step]    with collect=True: what a further forward_only=True, collect_non_loss_data=True
                       pass returned (loss_func(output, non_loss_data=True): {"token losses": ...});
                       None without
    grads[step]        {global name: main_grad} after forward_backward_func (before the step)
    params[step]       {global name: parameter} after the optimizer step
    init_params        {global name: parameter} before the first step
    ranks[r]           what rank r reported: coords (rank, pp, tp, dp), chunks (vp_stage of each
                       model chunk), its own losses / eval_losses / grads / params / init_params,
                       reads (per call, the (vp_stage, batch id) each get_batch read, in order),
                       ran (the training forward_backward_func(s) called, "module.name", with
                       " [kind]" under zbpp) and split (with zbpp_split: the layers zbpp split
                       and those it did not; gemms_run and w_kernel: the W GEMMs zbpp's store ran
                       and the store's kernel); also its own collected, eval_touched[step] (the
                       names whose main_grad / grad the evaluation passes changed: [] is right),
                       virtual_ranks ({vp_stage: sorted virtual pipeline ranks parallel_state
                       answered while that chunk's forward_step ran, training and evaluation}),
                       schedule_for (zbpp.megatron.schedule_for's (kind, mem_limit) for the model,
                       under zbpp), holds_loss (zbpp's schedule: this rank holds the loss stage),
                       optimizer_calls[step] (with optimizer_call: what the optimizer= call
                       returned, what the optimizer's step() returned, the items it read) and
                       misuse ({name: outcome}, see MISUSE)
    case               the case's settings

A case with fail_mode="exit" (a dead peer): the Result has only "case" and "ranks", None for the
rank that exited; each other rank's entry has "dead_peer": what its first training call raised
({"type", "module", "message", "seconds"}; type None if it returned). The workers end with it; the
cases after it run in fresh workers.

Global names are GPTModel's parameter names with the decoder layer index made global (from
TransformerLayer.layer_number), e.g. "decoder.layers.3.self_attention.linear_qkv.weight",
"embedding.word_embeddings.weight", "output_layer.weight" (with tied embeddings, the last
stage's copy of the word embeddings), "decoder.final_layernorm.weight". With tp > 1, the
tensor-parallel shards are keyed "<name>#tp<rank>".

The weights do not depend on the placement: each parameter is overwritten with values drawn from
a seed derived from its global name (the tensor-parallel shard of the full tensor). The data do not
either: microbatch i of step s is drawn from (s, i, data parallel rank), so every rank and chunk
reads the same batch sequence. So pp=2 with 2 layers per stage and pp=2, vp=2 with 1 layer per
chunk train the same 4-layer model, and Megatron's two schedules agree on it bit for bit.

Megatron 0.16 on CPU, besides cpu_patches(): the interleaved schedule runs with
overlap_p2p_comm=True and batch_p2p_comm=False (as megatron/training sets it; the batched form
swaps tensors with pp=2) and deallocate_pipeline_outputs=False (with overlapped p2p it frees a
tensor while gloo is still sending it); see build_model().
"""

import contextlib
import datetime
import hashlib
import importlib
import inspect
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_SRC = REPO_ROOT / "bindings" / "python"
DEFAULT_LIBRARY = REPO_ROOT / "build" / "libzbpp.so"

VOCAB = 64
SEQ = 8
MICRO_BATCH = 2
HIDDEN = 16
HEADS = 2
LR = 0.05
SEED = 1234

# run()'s settings and their defaults (a case is a dict of some of them).
DEFAULTS = dict(
    pp=1, tp=1, vp=None, steps=2, m=4, dtype="fp32", tied=False, per_token=False,
    overlap_grad_reduce=False, use_zbpp=False, zbpp_kind=None,
    zbpp_split=False,        # zbpp.split_linear() on each chunk (Megatron's linear layers defer
                             # their weight gradients to zbpp's W passes; under Megatron's own
                             # schedule each W runs at once, inside its B, through the same GEMM)
    v_order=False,           # with vp=2: chunks built in V order by zbpp.megatron.v_model_provider,
                             # the embedding group from zbpp.megatron.v_embedding_ranks
    vocab_parallel=False,    # chunks built by zbpp.megatron.vocab_model_provider (with
                             # zbpp_argv=["--enable-vocab-parallel", ...]: the word embedding and
                             # output layer split over the pipeline ranks, zbpp_vocab.* of each rank's
                             # first chunk, set and reported whole under their global names)
    layers_per_stage=1,      # decoder layers per pipeline stage (model chunk)
    loss_form="tokens",      # "tokens": loss_func returns (loss, num_tokens, dict), as
                             # pretrain_gpt does now; "mean": (loss, dict), the older form
    attention_mask=True,     # pass a causal mask (create_attention_mask_in_dataloader) or None
    optimizer="sgd",         # "sgd" (plain, lr LR) or "adamw" (torch.optim.AdamW, lr LR / 10)
    loss_scale=None,         # a number: config.grad_scale_func multiplies the loss by it (as
                             # train() sets optimizer.scale_loss) and the optimizer divides the
                             # gradients by it; the recorded grads are the scaled main_grads
    seq_length=SEQ, micro_batch_size=MICRO_BATCH, vocab=VOCAB,
    zbpp_argv=None,          # a list: the zero-bubble flags zbpp reads, parsed by an argparse
                             # parser extended by zbpp.megatron.add_arguments and passed as
                             # configure(args=...); the schedule comes from them (with zbpp_kind None)
    zbpp_timeout=None,       # zbpp's transfer timeout in seconds (default: the case's timeout)
    collect=False,           # after each evaluation, a collect_non_loss_data=True pass (collected)
    eval_no_grad=True,       # evaluate under torch.no_grad(), as Megatron's evaluate does; False:
                             # with autograd on (forward_only must still leave the gradients alone)
    optimizer_call=False,    # under zbpp: step the optimizer through the reference fork's second
                             # call, forward_backward_func(..., optimizer=optimizer), not step()
    misuse=(),               # under zbpp: calls that must fail, made before step 0 (see MISUSE);
                             # the case then trains as usual: each failure leaves zbpp usable
    fail_rank=None,          # testing the harness: this global rank fails in its first
    fail_mode="raise",       # forward_step: raises ("raise") or never returns ("hang"); or ("exit")
                             # it exits before its first training call, after a barrier with the
                             # others, whose call must then fail (see "A case with fail_mode")
)

# The misuse calls a case can make (its `misuse`), each a training call of forward_backward_func
# (fresh iterators of phase "misuse", counted) that must raise; ranks[r]["misuse"][name] holds
# {"type", "message", "cause_type", "cause", "pulled"} (pulled: items read from each iterator), or
# {"type": None, "returned": ...} when the call did not raise.
MISUSE = {
    "v-one-chunk": "configure(args=--zero-bubble-v-schedule) with the case's model (one chunk)",
    "collect-training": "collect_non_loss_data=True without forward_only",
    "no-loss-func": "forward_step_func returns (output_tensor, None); needs pp=1 (over gloo a peer of "
                    "the failed rank learns of it only at its timeout, and the pairs are closed then)",
    "few-microbatches": "num_microbatches = pp + 1, not a multiple of pp (for interleaved-1f1b)",
    "v-loop-chunks": "configure(args=--zero-bubble-v-schedule) with the case's two chunks built in loop "
                     "order by Megatron's stock get_model (no v_model_provider)",
}


def megatron_core_installed():
    """Whether megatron.core can be imported, found on sys.path without importing it: importing
    takes seconds, and sys.modules may already hold a Megatron (or None, where a test hid it)."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return False
    return importlib.machinery.PathFinder.find_spec("megatron.core", spec.submodule_search_locations) is not None


class WorkerError(RuntimeError):
    """A worker raised; the message holds every failed worker's traceback."""


class WorkerTimeout(WorkerError):
    """The workers did not finish in time; the message holds their Python stacks."""


# =====================================================================================================
# CPU patches
# =====================================================================================================

def cpu_patches():
    """Makes megatron.core 0.16 run on a CPU-only torch with gloo. Applied once in each worker,
    before anything of Megatron runs. Each patch and why it is needed:

    1. torch.cuda.current_device() -> "cpu". Megatron allocates with
       device=torch.cuda.current_device() everywhere that matters here: the DDP grad buffers
       (param_and_grad_buffer), the p2p receive buffers (p2p_communication), GPTModel's and the
       attention's helper tensors. On a CPU-only torch the call raises ("Torch not compiled with
       CUDA enabled"); returning "cpu" turns all of those into CPU tensors.
    2. torch.cuda.synchronize() -> a no-op. p2p_communication calls it after every batched
       send/receive (batch_p2p_sync, on by default); it raises on a CPU-only torch.
    3. A torch function mode that maps the device "cuda" to "cpu" and makes Tensor.cuda() a
       no-op. A few calls name the device literally: the schedules allocate
       `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")` in every
       forward-backward call, and LanguageModule moves the last stage's copy of tied word
       embeddings with `weight.data.cuda()` before its embedding-group all-reduce. (The mode
       is entered for the rest of the worker's life, in its main thread, where Megatron's
       schedules and zbpp's runner callbacks run.)
    4. The CUDA RNG tracker -> Megatron's own inference tracker (fork() is a nullcontext). The
       attention runs its dropout inside get_cuda_rng_tracker().fork() whatever the dropout
       probability, which needs the tracker seeded (model_parallel_cuda_manual_seed: CUDA
       generators only) and saves / restores the CUDA generator's state. Dropout is 0 here and
       every parameter is overwritten after construction, so no random state needs tracking.

    Each of the four is needed: without any one of them the first training step fails.
    Not needed on these paths: torch.cuda.Stream / Event / stream() (Megatron uses them with
    several distributed-optimizer instances or CUDA graphs only), any process-group change
    (initialize_model_parallel's groups use the default backend, gloo here; batch_isend_irecv
    and the DDP all-reduces work on gloo).
    """
    import torch
    from torch.overrides import TorchFunctionMode

    # 1, 2
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None

    # 3
    def _is_cuda(device):
        if isinstance(device, torch.device):
            return device.type == "cuda"
        return isinstance(device, str) and device.split(":")[0] == "cuda"

    class _CudaIsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = dict(kwargs, device="cpu")
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu") + tuple(args[2:])
            return func(*args, **kwargs)

    _CudaIsCpu().__enter__()

    # 4
    no_fork_rng_tracker()


def no_fork_rng_tracker():
    """Makes Megatron's CUDA RNG tracker one whose fork() does nothing (cpu_patches, 4): Megatron's
    inference tracker, or the same by hand where megatron-core (before 0.10) has none."""
    from megatron.core.tensor_parallel import random as mp_random

    if "inference_rng_tracker" in inspect.signature(mp_random.initialize_rng_tracker).parameters:
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        return

    class _NoForkTracker(mp_random.CudaRNGStatesTracker):
        def fork(self, name=None):
            return contextlib.nullcontext()

    mp_random._CUDA_RNG_STATE_TRACKER = _NoForkTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# =====================================================================================================
# Deterministic weights, keyed by global name
# =====================================================================================================

def _seed_of(name):
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _unwrap(chunk):
    """The GPTModel inside DDP / Float16Module."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_names(gpt):
    """{local parameter name: global name} for a GPTModel chunk."""
    names = {}
    layers = getattr(getattr(gpt, "decoder", None), "layers", None) or []
    offsets = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}." for i, layer in enumerate(layers)}
    for local, param in gpt.named_parameters():
        name = local
        for prefix, new in offsets.items():
            if local.startswith(prefix):
                name = new + local[len(prefix):]
                break
        names[local] = name
    return names


def _weight_for(name, param, tp, tp_rank):
    """The deterministic value of parameter `name` (its shard on tensor-parallel rank tp_rank)."""
    import torch

    # With tied embeddings the last stage's output layer is a copy of the word embeddings: draw
    # it from the same seed, as Megatron's embedding-group all-reduce makes it equal at init.
    seed_name = name
    if getattr(param, "shared_embedding", False) and name == "output_layer.weight":
        seed_name = "embedding.word_embeddings.weight"
    shape = list(param.shape)
    parallel = getattr(param, "tensor_model_parallel", False) and tp > 1
    if parallel:
        shape[param.partition_dim] *= tp
    gen = torch.Generator().manual_seed(_seed_of(seed_name))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if seed_name.endswith("layernorm.weight") or seed_name.endswith("layer_norm_weight"):
        values = 1.0 + 0.1 * values
    elif seed_name.endswith("bias"):
        values = 0.05 * values
    else:
        values = 0.2 * values
    if parallel:
        values = values.chunk(tp, dim=param.partition_dim)[tp_rank]
    return values.to(param.dtype)


# zbpp.megatron.vocab_model_provider's shards (each rank's rows of the split layers) and the global
# names of the whole weights they are rows of.
_VOCAB_PREFIX = "zbpp_vocab."
_VOCAB_NAMES = {"embedding.weight": "embedding.word_embeddings.weight", "output.weight": "output_layer.weight"}


def _vocab_parallel(model):
    for chunk in model:
        shards = getattr(_unwrap(chunk), "zbpp_vocab", None)
        if shards is not None:
            return shards.ctx.vp
    return None


def _outside_batch(case):
    """A batch for a forward outside any schedule: (input_ids, position_ids, attention_mask)."""
    import torch

    b, seq = case["micro_batch_size"], case["seq_length"]
    ids = torch.zeros(b, seq, dtype=torch.long)
    return ids, torch.arange(seq).expand(b, seq), None


def set_weights(model, tp, tp_rank):
    """Overwrites every parameter of this rank's chunks from its global name (the rows of a split
    layer from its whole weight's)."""
    import torch

    with torch.no_grad():
        for chunk in model:
            gpt = _unwrap(chunk)
            names = global_names(gpt)
            for local, param in gpt.named_parameters():
                if not local.startswith(_VOCAB_PREFIX):
                    param.copy_(_weight_for(names[local], param, tp, tp_rank))
        vp = _vocab_parallel(model)
        for name, shard in (vp._shards() if vp is not None else ()):
            whole = _weight_for(_VOCAB_NAMES[name], torch.empty(vp.vocab_size, vp.hidden), 1, 0)
            shard.weight[:shard.real].copy_(whole[shard.start:shard.start + shard.real])


def _key(name, param, tp, tp_rank):
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        return f"{name}#tp{tp_rank}"
    return name


def named_tensors(model, what, tp=1, tp_rank=0):
    """{global name: tensor (a CPU clone)} of this rank's chunks; what: "param" or "grad" (the
    fp32 main_grad the DDP wrapper accumulates into)."""
    out = {}
    for chunk in model:
        gpt = _unwrap(chunk)
        names = global_names(gpt)
        for local, param in gpt.named_parameters():
            key = _key(names[local], param, tp, tp_rank)
            if key in out:
                raise AssertionError(f"two parameters of this rank map to the global name {key}")
            if what == "param":
                tensor = param.detach()
            else:
                tensor = getattr(param, "main_grad", None)
                if tensor is None:
                    tensor = param.grad
                if tensor is None:
                    continue
            out[key] = tensor.detach().clone()
    vp = _vocab_parallel(model)
    return _gather_vocab(out, vp, what) if vp is not None else out


def _gather_vocab(out, vp, what):
    """The split layers whole (a collective of the pipeline), under their global names on pipeline
    rank 0 (both names when tied, as Megatron's two copies); their rows left out."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {k: v for k, v in out.items() if not k.startswith(_VOCAB_PREFIX)}
    for name, w in vp.named_parameters():
        t = w.detach() if what == "param" else getattr(w, "main_grad", None)
        if t is None:
            t = w.grad if w.grad is not None else torch.zeros_like(w)
        parts = [torch.empty_like(t) for _ in range(vp.ranks)]
        dist.all_gather(parts, t.contiguous(), group=ps.get_pipeline_model_parallel_group())
        if ps.get_pipeline_model_parallel_rank() == 0:
            whole = torch.cat(parts)[:vp.vocab_size]
            for n in (_VOCAB_NAMES.values() if vp.tied else [_VOCAB_NAMES[name]]):
                out[n] = whole.clone()
    return out


# =====================================================================================================
# Data, forward_step, loss_func (after pretrain_gpt.py)
# =====================================================================================================

def make_batch(step, microbatch, dp_rank, phase, case):
    """The batch of (step, microbatch) on data parallel rank dp_rank; phase "train" or "eval"."""
    import torch

    seq, mbs, vocab = case["seq_length"], case["micro_batch_size"], case["vocab"]
    seed = _seed_of(f"{phase}/{step}/{microbatch}/{dp_rank}")
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
    loss_mask = (torch.rand(mbs, seq, generator=gen) > 0.25).float()
    loss_mask[:, 0] = 1.0  # never all masked
    attention_mask = None
    if case["attention_mask"]:
        # Megatron's convention: True where attention is masked out; [1, 1, s, s].
        attention_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous(),
        "id": (phase, step, microbatch),
    }


class batches:
    """The data iterator of one forward_backward_func call (one per model chunk); .pulled counts the
    items read."""

    def __init__(self, step, m, dp_rank, phase, case):
        self.step, self.m, self.dp_rank, self.phase, self.case = step, m, dp_rank, phase, case
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pulled >= self.m:
            raise StopIteration
        self.pulled += 1
        return make_batch(self.step, self.pulled - 1, self.dp_rank, self.phase, self.case)


class _Log:
    """What the worker's forward_step saw (checked after each call)."""

    def __init__(self):
        self.reads = []
        self.virtual = {}  # vp_stage -> the virtual pipeline ranks seen while it ran


def get_batch(data_iterator, vp_stage, log=None):
    """pretrain_gpt's get_batch: the first and last stage read the iterator, the others get Nones.

    Megatron 0.16 decides the stage with is_pipeline_first_stage/last_stage(ignore_virtual=False,
    vp_stage=...), the vp_stage being the model chunk's attribute (get_model sets it); the global
    virtual pipeline rank is deprecated and Megatron's schedules no longer set it. Before 0.13 they
    take no vp_stage and read that global rank, which the schedules (and zbpp) set per chunk."""
    from megatron.core import parallel_state as ps

    if "vp_stage" in inspect.signature(ps.is_pipeline_first_stage).parameters:
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    else:
        first = ps.is_pipeline_first_stage(ignore_virtual=False)
        last = ps.is_pipeline_last_stage(ignore_virtual=False)
    if not (first or last):
        return None, None, None, None, None
    batch = next(data_iterator)
    if log is not None:
        log.reads.append((vp_stage, batch["id"]))
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def loss_func(loss_mask, output_tensor, form="tokens", non_loss_data=False):
    """pretrain_gpt's loss_func: (loss, num_tokens, {'lm loss': [sum, tokens]}), or the older
    (mean loss, {'lm loss': mean}) with form="mean". With non_loss_data (Megatron's
    collect_non_loss_data passes): {"token losses": the per-token losses, "loss mask": the mask}."""
    import torch

    if non_loss_data:
        return {"token losses": output_tensor.detach().clone(), "loss mask": loss_mask.clone()}
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    if form == "mean":
        loss = loss / mask.sum()
        return loss, {"lm loss": loss.clone().detach()}
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def make_forward_step(case, log=None):
    """pretrain_gpt's forward_step(data_iterator, model) -> (output_tensor, loss_func)."""
    from functools import partial

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    def forward_step(data_iterator, model):
        if (case["fail_rank"] is not None and case["fail_mode"] != "exit"
                and case["fail_rank"] == torch.distributed.get_rank()):
            if case["fail_mode"] == "hang":
                time.sleep(24 * 3600)
            raise RuntimeError(f"failure injected on rank {case['fail_rank']} (fail_rank)")
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        if log is not None:
            log.virtual.setdefault(vp_stage, set()).add(ps.get_virtual_pipeline_model_parallel_rank())
        # zbpp sets the (deprecated) global virtual pipeline rank to the chunk it runs, as older
        # Megatron's interleaved schedule did; Megatron 0.16's schedules leave it at the 0 that
        # initialize_model_parallel set. Under zbpp it must name the chunk being run.
        if case["use_zbpp"] and vp_stage is not None:
            virtual = ps.get_virtual_pipeline_model_parallel_rank()
            if virtual != vp_stage:
                raise AssertionError(f"zbpp: the virtual pipeline rank is {virtual} while model chunk "
                                     f"{vp_stage} runs")
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage, log)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
        return output_tensor, partial(loss_func, loss_mask, form=case["loss_form"])

    return forward_step


# =====================================================================================================
# Model (after megatron/training's get_model and gpt_builders) and optimizer
# =====================================================================================================

def build_model(case):
    """This rank's model chunks: GPTModel per virtual stage, Float16Module for bf16, DDP; and the
    config with the *_func hooks train() sets."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    pp, tp, vp = case["pp"], case["tp"], case["vp"]
    # megatron-core before 0.13 (no vp_stage anywhere): its interleaved schedule's overlapped p2p
    # hangs on gloo in forward-only runs (two irecvs from one peer in flight); there it sends and
    # receives one op at a time instead, which is Megatron's third p2p form and the same numbers.
    old_core = "vp_stage" not in inspect.signature(GPTModel.__init__).parameters
    bf16 = case["dtype"] == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=case["layers_per_stage"] * pp * (vp or 1),
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=case["per_token"],
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # What megatron/training sets: the interleaved schedule overlaps its p2p communication
        # (--overlap-p2p-communication is on by default, and the arguments check refuses the
        # batched form for pp == 2, where one batch holds two sends between the same two ranks
        # and gloo, matching them in order, swaps them); the other schedules batch it.
        overlap_p2p_comm=vp is not None and not old_core,
        batch_p2p_comm=vp is None,
        # training sets this True. Not with the overlapped p2p on CPU: the interleaved schedule
        # frees an output's storage (`out.data = torch.empty(1)`) while its isend is still in
        # flight (it waits for the send one step later); on CUDA the NCCL stream orders that,
        # on gloo the send thread then reads freed memory and the next stage gets garbage.
        deallocate_pipeline_outputs=vp is None,
    )
    spec = get_gpt_layer_local_spec()

    # megatron-core before 0.13 takes no vp_stage: a chunk's stage is the global virtual rank.
    takes_vp_stage = not old_core

    def provider(pre_process, post_process, vp_stage=None):
        extra = {"vp_stage": vp_stage} if takes_vp_stage else {}
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=case["vocab"],
            max_sequence_length=case["seq_length"],
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=case["tied"],
            position_embedding_type="learned_absolute",
            **extra,
        )
        return gpt

    chunks = []
    if case["v_order"]:
        provider = _zbpp_module().v_model_provider(provider)
    if case["vocab_parallel"]:
        provider = _zbpp_module().vocab_model_provider(provider)
    if pp > 1 and vp is not None:
        for i in range(vp):
            if takes_vp_stage:
                pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i)
                post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i)
            else:
                ps.set_virtual_pipeline_model_parallel_rank(i)
                pre = ps.is_pipeline_first_stage(ignore_virtual=False)
                post = ps.is_pipeline_last_stage(ignore_virtual=False)
            gpt = provider(pre, post, vp_stage=i)
            gpt.vp_stage = i
            chunks.append(gpt)
        if not takes_vp_stage:
            ps.set_virtual_pipeline_model_parallel_rank(0)
    else:
        gpt = provider(ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        gpt.vp_stage = None  # as get_model leaves it (before 0.13 GPTModel has no such attribute)
        chunks.append(gpt)

    from megatron.core import tensor_parallel
    for gpt in chunks:
        for param in gpt.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    # Placement-independent weights (before the wrappers: Float16Module casts, DDP maps the
    # parameters into its buffers and keeps them there).
    set_weights(chunks, tp, ps.get_tensor_model_parallel_rank())

    if bf16:
        chunks = [Float16Module(config, gpt) for gpt in chunks]

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=case["overlap_grad_reduce"],
        use_distributed_optimizer=False,
        check_for_nan_in_grad=False,
        bucket_size=(40000000 if case["overlap_grad_reduce"] else None),
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]

    # train()'s hooks (megatron/training/training.py): no_sync / grad_sync with overlapped
    # gradient reduction (align_grad_reduce is Megatron's default), finalize_model_grads always.
    if case["overlap_grad_reduce"]:
        config.no_sync_func = [chunk.no_sync for chunk in model]
        if len(model) == 1:
            config.no_sync_func = config.no_sync_func[0]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
        if len(model) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    if case["loss_scale"] is not None:
        scale = torch.tensor(float(case["loss_scale"]))
        config.grad_scale_func = lambda loss: scale * loss  # MegatronOptimizer.scale_loss
    return model, config


class _Optimizer:
    """SGD or AdamW on fp32 master copies of the parameters, fed with main_grad (what Megatron's
    mixed precision optimizer does, without loss scaling or clipping). Deterministic."""

    def __init__(self, model, kind, loss_scale=None):
        import torch

        self.params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.kind = kind
        self.steps, self.last = 0, None  # step() calls so far, what the last one returned
        self.inv_scale = None if loss_scale is None else 1.0 / float(loss_scale)
        if kind == "adamw":
            self.inner = torch.optim.AdamW(self.master, lr=LR / 10, weight_decay=0.01, foreach=False)
        elif kind != "sgd":
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {kind!r}")

    def step(self):
        """Steps; returns (True, the gradients' norm, None), the shape of Megatron's optimizer
        step()'s (update_successful, grad_norm, num_zeros_in_grad)."""
        import torch

        norm_sq = 0.0
        with torch.no_grad():
            for p, master in zip(self.params, self.master):
                grad = getattr(p, "main_grad", None)
                if grad is None:
                    grad = p.grad
                if grad is None:
                    continue
                grad = grad.float()
                if self.inv_scale is not None:
                    grad = grad * self.inv_scale
                norm_sq += float(grad.double().square().sum())
                if self.kind == "sgd":
                    master.add_(grad, alpha=-LR)
                else:
                    master.grad = grad.clone()
            if self.kind == "adamw":
                self.inner.step()
            for p, master in zip(self.params, self.master):
                p.copy_(master.to(p.dtype))
        self.steps += 1
        self.last = (True, norm_sq ** 0.5, None)
        return self.last


# =====================================================================================================
# One case in one worker
# =====================================================================================================

def _zbpp_module():
    if str(PYTHON_SRC) not in sys.path:
        sys.path.insert(0, str(PYTHON_SRC))
    import zbpp.megatron
    return zbpp.megatron


def _parse_flags(argv):
    """The zero-bubble flags as Megatron's parse_args(extra_args_provider=zbpp.megatron.add_arguments)
    would give them (megatron.training, which has parse_args, is not part of megatron-core)."""
    import argparse

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return _zbpp_module().add_arguments(parser).parse_args(list(argv))


def _configure(zb, case, timeout):
    args = _parse_flags(case["zbpp_argv"]) if case["zbpp_argv"] is not None else None
    zb.configure(args, kind=case["zbpp_kind"], timeout=float(case["zbpp_timeout"] or timeout))


def _outcome(exc, pulled):
    """What a call that had to fail raised."""
    cause = exc.__cause__
    return {"type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc),
            "cause_type": None if cause is None else type(cause).__name__,
            "cause": None if cause is None else str(cause), "pulled": pulled}


def _grad_state(model):
    """{parameter name: (main_grad, grad)} (clones or None), to see what a pass changed."""
    out = {}
    for c, chunk in enumerate(model):
        for name, param in _unwrap(chunk).named_parameters():
            main = getattr(param, "main_grad", None)
            out[f"chunk{c}.{name}"] = (None if main is None else main.detach().clone(),
                                       None if param.grad is None else param.grad.detach().clone())
    return out


def _changed(before, after):
    import torch

    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return sorted(n for n in before if not (same(before[n][0], after[n][0]) and same(before[n][1], after[n][1])))


class _Stop(Exception):
    """Ends a case early (fail_mode="exit": nothing more can run with a dead peer)."""


def _run_case(case, timeout, progress):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import pipeline_parallel

    progress("initialize_model_parallel")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=case["tp"],
        pipeline_model_parallel_size=case["pp"],
        virtual_pipeline_model_parallel_size=case["vp"],
        distributed_timeout_minutes=max(1, int(timeout // 60) + 1),
        **({"get_embedding_ranks": _zbpp_module().v_embedding_ranks} if case["v_order"] else {}),
    )
    zb = None
    try:
        if case["use_zbpp"]:
            zb = _zbpp_module()
            zb.patch()
            _configure(zb, case, timeout)
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank()
        tp = case["tp"]
        progress("build_model")
        model, config = build_model(case)
        split = None
        if case["zbpp_split"]:
            _zbpp_module()
            import zbpp
            for chunk in model:
                zbpp.split_linear(chunk, warn=False)
            reports = [zbpp.split_report(chunk) for chunk in model]
            split = {"split": [e.name for r in reports for e in r.split],
                     "not_split": [(e.name, e.reason) for r in reports for e in r.not_split]}
        optimizer = _Optimizer(model, case["optimizer"], case["loss_scale"])
        log = _Log()
        forward_step = make_forward_step(case, log)
        m, v = case["m"], len(model)
        result = {
            "coords": {"rank": dist.get_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                       "tp": tp_rank, "dp": dp_rank},
            "chunks": [getattr(_unwrap(c), "vp_stage", None) for c in model],
            "split": split,
            "init_params": named_tensors(model, "param", tp, tp_rank),
            "local_names": sorted(n for c in model for n, _ in _unwrap(c).named_parameters()),
            "losses": [], "eval_losses": [], "grads": [], "params": [], "reads": [], "ran": set(),
            "collected": [] if case["collect"] else None, "eval_touched": [], "optimizer_calls": [],
            "misuse": {}, "holds_loss": None,
            "schedule_for": list(zb.schedule_for(v, case["pp"])) if zb is not None else None,
        }

        def iterators_for(step, phase, count=m):
            its = [batches(step, count, dp_rank, phase, case) for _ in range(v)]
            return its, (its if v > 1 else its[0])

        def fbf_call(data_iterator, forward_step_func=forward_step, num_microbatches=m, **kwargs):
            forward_backward_func = pipeline_parallel.get_forward_backward_func()  # looked up now: patch() applies
            return forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=case["seq_length"],
                micro_batch_size=case["micro_batch_size"],
                **kwargs,
            ), forward_backward_func

        def call(step, phase, forward_only, **kwargs):
            its, data_iterator = iterators_for(step, phase)
            log.reads = []
            if case["fail_mode"] == "exit" and phase == "train" and step == 0:
                # Every rank has built its model; then the failing rank dies and the others call.
                dist.barrier()
                if dist.get_rank() == case["fail_rank"]:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
                start = time.monotonic()
                try:
                    fbf_call(data_iterator, forward_only=forward_only)
                except Exception as exc:  # noqa: BLE001 - what it is is the result
                    result["dead_peer"] = dict(_outcome(exc, [it.pulled for it in its]),
                                               seconds=time.monotonic() - start)
                else:
                    result["dead_peer"] = {"type": None, "seconds": time.monotonic() - start}
                raise _Stop()
            out, forward_backward_func = fbf_call(data_iterator, forward_only=forward_only, **kwargs)
            result["reads"].append((phase, step, list(log.reads)))
            if not forward_only:
                # Which function ran (proof that patch() took effect, or did not) and, under zbpp,
                # which schedule kind.
                ran = f"{forward_backward_func.__module__}.{forward_backward_func.__name__}"
                if zb is not None:
                    sched = zb.current_schedule()
                    ran += f" [{getattr(getattr(sched, 'schedule', None), 'kind', None)}]"
                    result["holds_loss"] = getattr(sched, "holds_loss", None)
                result["ran"].add(ran)
            return [{k: (t.detach().clone() if torch.is_tensor(t) else t) for k, t in d.items()}
                    for d in (out or [])]

        def misuse(name):
            kwargs, step_func, count = {}, forward_step, m
            if name in ("v-one-chunk", "v-loop-chunks"):
                zb.configure(_parse_flags(["--zero-bubble-v-schedule"]), timeout=float(case["zbpp_timeout"] or timeout))
            elif name == "collect-training":
                kwargs = dict(collect_non_loss_data=True, forward_only=False)
            elif name == "no-loss-func":
                def no_loss_func(data_iterator, chunk):
                    return forward_step(data_iterator, chunk)[0], None
                step_func = no_loss_func
            elif name == "few-microbatches":
                count = case["pp"] + 1
            else:
                raise ValueError(f"unknown misuse {name!r}; see MISUSE")
            its, data_iterator = iterators_for(0, "misuse", count)
            try:
                returned, _ = fbf_call(data_iterator, forward_step_func=step_func, num_microbatches=count, **kwargs)
            except Exception as exc:  # noqa: BLE001 - what it is is the result
                return _outcome(exc, [it.pulled for it in its])
            finally:
                if name in ("v-one-chunk", "v-loop-chunks"):
                    _configure(zb, case, timeout)
            return {"type": None, "returned": returned, "pulled": [it.pulled for it in its]}

        if case["misuse"] and zb is None:
            raise ValueError("misuse calls are made under zbpp (use_zbpp=True)")
        for name in case["misuse"]:
            progress(f"misuse {name}")
            result["misuse"][name] = misuse(name)

        store = None
        if case["zbpp_split"]:
            from zbpp.split import default_store
            store = default_store()
            store.gemms_run = 0
        try:
            for step in range(case["steps"]):
                progress(f"step {step}: train")
                for chunk in model:
                    chunk.zero_grad_buffer()
                result["losses"].append(call(step, "train", False))
                result["grads"].append(named_tensors(model, "grad", tp, tp_rank))
                if case["optimizer_call"]:
                    # The reference fork's train_step: the optimizer steps inside a second call.
                    its, data_iterator = iterators_for(step, "optimizer")
                    returned, _ = fbf_call(data_iterator, optimizer=optimizer)
                    result["optimizer_calls"].append({"returned": returned, "step_returned": optimizer.last,
                                                      "steps": optimizer.steps,
                                                      "pulled": [it.pulled for it in its]})
                else:
                    optimizer.step()
                result["params"].append(named_tensors(model, "param", tp, tp_rank))
                progress(f"step {step}: eval")
                before = _grad_state(model)
                for chunk in model:
                    chunk.eval()
                with (torch.no_grad() if case["eval_no_grad"] else contextlib.nullcontext()):
                    result["eval_losses"].append(call(step, "eval", True))
                    if case["collect"]:
                        result["collected"].append(call(step, "collect", True, collect_non_loss_data=True))
                for chunk in model:
                    chunk.train()
                result["eval_touched"].append(_changed(before, _grad_state(model)))
        except _Stop:
            pass
        result["virtual_ranks"] = {k: sorted(vs, key=str) for k, vs in log.virtual.items()}
        if case["vocab_parallel"] and zb is not None:
            # What a user does with the split layers after training, outside zbpp's calls: the
            # whole weights (every rank), a forward of its own, a distributed checkpoint.
            vp = zb.vocab_parallel_of(model)
            result["vocab_gathered"] = {k: t.clone() for k, t in vp.gather().items()}
            outside = {}
            for what, fn in (("forward", lambda: model[0](*_outside_batch(case))),
                             ("sharded_state_dict", lambda: _unwrap(model[-1]).sharded_state_dict())):
                try:
                    fn()
                    outside[what] = None
                except Exception as exc:  # noqa: BLE001 - the error is what is recorded
                    outside[what] = f"{type(exc).__name__}: {exc}"
            result["vocab_outside"] = outside
        # The W GEMMs zbpp's store ran (training only: evaluation has no backward).
        result["gemms_run"] = store.gemms_run if store is not None else None
        # Which kernel ran them: "torch" (torch's own ops, Megatron's bits) or the library's GEMM.
        result["w_kernel"] = store.kernel if store is not None else None
        progress("done")
    except BaseException:
        with contextlib.suppress(Exception):  # the case's own error is the one to report
            _cleanup(zb)
        raise
    _cleanup(zb)
    return result


def _cleanup(zb):
    """Undoes a case: zbpp unpatched and unconfigured, Megatron's parallel state destroyed (its
    process groups stay; gloo keeps them cheaply)."""
    from megatron.core import parallel_state as ps

    if zb is not None:
        zb.reset()
        zb.unpatch()
        zb.configure()
    ps.destroy_model_parallel()
    # megatron-core 0.9 leaves these behind, and a rank outside the next case's embedding group
    # would still answer "in it" (a process normally initializes once).
    for name in ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS"):
        if hasattr(ps, name):
            setattr(ps, name, None)


def _worker(rank, world, init_file, out_dir, cases, timeout, library):
    """One process: gloo over a file:// rendezvous, cpu_patches(), the cases in order. Rank 0
    writes case<i>.pkl with every rank's result; a rank that raises writes error<rank>.txt."""
    import faulthandler
    import warnings

    out = Path(out_dir)
    stacks = open(out / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    progress_file = out / f"progress{rank}.txt"
    where = {"case": None}

    def progress(text):
        progress_file.write_text(f"case {where['case']}: {text}\n")

    try:
        os.environ["ZBPP_LIBRARY"] = library
        if str(PYTHON_SRC) not in sys.path:
            sys.path.insert(0, str(PYTHON_SRC))
        warnings.filterwarnings("ignore")
        import logging
        logging.disable(logging.WARNING)
        progress("import torch")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        progress("import megatron.core")
        importlib.import_module("megatron.core")
        cpu_patches()
        progress("init_process_group")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        for index, case in cases:
            where["case"] = index
            result = _run_case(case, timeout, progress)
            if case["fail_mode"] == "exit":
                # A peer is dead: no gather; each survivor writes its own result, and the workers
                # end here (the process group cannot be torn down cleanly without the peer).
                _write(out / f"case{index}.rank{rank}.pkl", result)
                progress("finished (a peer exited)")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            deliver(out, index, rank, world, result)
        progress("finished")
        dist.destroy_process_group()
    except BaseException:
        fail(out, rank, where["case"])


def _write(path, obj):
    """Pickles obj to path atomically (the supervisor polls for the file)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    tmp.rename(path)


def deliver(out, index, rank, world, result):
    """A worker's end of a case: every rank's result gathered to rank 0, which writes case<index>.pkl."""
    import torch.distributed as dist

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        _write(out / f"case{index}.pkl", gathered)


def fail(out, rank, case):
    """A worker's end after an exception: its traceback in error<rank>.txt, then exit at once."""
    (out / f"error{rank}.txt").write_text(f"{case}\n{traceback.format_exc()}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# =====================================================================================================
# The calling side
# =====================================================================================================

def _merge(per_rank, field, step=None):
    """One {name: tensor} from all ranks (data parallel rank 0 of each name)."""
    merged = {}
    for res in sorted(per_rank, key=lambda r: r["coords"]["dp"]):
        d = res[field] if step is None else res[field][step]
        for name, t in d.items():
            merged.setdefault(name, t)
    return merged


def _assemble(per_rank, case):
    if case["fail_mode"] == "exit":
        return {"case": case, "ranks": per_rank}
    last = [r for r in per_rank if r["coords"]["dp"] == 0 and r["coords"]["tp"] == 0
            and r["coords"]["pp"] == case["pp"] - 1]
    holder = last[0]
    steps = case["steps"]
    return {
        "case": case,
        "losses": holder["losses"],
        "eval_losses": holder["eval_losses"],
        "collected": holder["collected"],
        "grads": [_merge(per_rank, "grads", s) for s in range(steps)],
        "params": [_merge(per_rank, "params", s) for s in range(steps)],
        "init_params": _merge(per_rank, "init_params"),
        "ranks": per_rank,
    }


def _full_case(kwargs):
    unknown = set(kwargs) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown case settings: {sorted(unknown)}")
    case = dict(DEFAULTS)
    case.update(kwargs)
    case["misuse"] = tuple(case["misuse"])
    unknown = set(case["misuse"]) - set(MISUSE)
    if unknown:
        raise ValueError(f"unknown misuse calls {sorted(unknown)}; see MISUSE")
    if (case["misuse"] or case["optimizer_call"]) and not case["use_zbpp"]:
        raise ValueError("misuse and optimizer_call are calls of zbpp's forward_backward_func (use_zbpp=True)")
    if case["fail_mode"] not in ("raise", "hang", "exit"):
        raise ValueError(f"fail_mode must be 'raise', 'hang' or 'exit', got {case['fail_mode']!r}")
    if case["fail_mode"] == "exit" and case["fail_rank"] is None:
        raise ValueError("fail_mode='exit' needs a fail_rank")
    return case


def _read(path):
    try:
        return Path(path).read_text()
    except OSError:
        return ""


STARTUP_S = 90   # a worker's import of torch and Megatron and the gloo start-up (about 10 s here)
GRACE_S = 3      # after a worker fails, how long the others get to fail too (and say why)


def _progress_of(tmp, rank):
    """(case index or None, text) from a worker's progress file."""
    text = _read(Path(tmp) / f"progress{rank}.txt").strip()
    head = text.split(":", 1)[0].split()
    index = int(head[1]) if len(head) == 2 and head[0] == "case" and head[1].isdigit() else None
    return index, text


def _stacks(tmp, procs):
    """Asks the live workers for their Python stacks (faulthandler on SIGUSR1); returns the text."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    if alive:
        time.sleep(0.5)
    return {r: _read(Path(tmp) / f"stack{r}.txt") for r in alive}


def _spawn(world, indexed_cases, timeout, target=None, extra=()):
    """Runs the cases in one set of workers. Returns ({index: per-rank results}, failure or None,
    index of the failed case or None). target: the worker function (default: _worker), called as
    target(rank, world, init_file, out_dir, indexed_cases, timeout, library, *extra); it follows
    _worker's protocol (progress, error and result files in out_dir)."""
    import multiprocessing as mp

    library = os.environ.get("ZBPP_LIBRARY") or str(DEFAULT_LIBRARY)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zbpp-megatron-real-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=target or _worker,
                             args=(r, world, init_file, tmp, indexed_cases, timeout, library, *extra),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        started = time.monotonic()
        # The limit of each worker's current case: STARTUP_S until it starts its first case, then
        # `timeout` (plus a little, so that the workers' own gloo / zbpp timeouts, which give
        # tracebacks, fire first) from the start of each case.
        current = {r: (None, started) for r in range(world)}
        failure, failed_case = None, None
        try:
            while True:
                now = time.monotonic()
                for r in range(world):
                    index, _text = _progress_of(tmp, r)
                    if index != current[r][0]:
                        current[r] = (index, now)
                errors = sorted(Path(tmp).glob("error*.txt"))
                if errors:
                    grace = time.monotonic() + GRACE_S
                    while time.monotonic() < grace and any(p.is_alive() for p in procs):
                        time.sleep(0.1)
                    stacks = _stacks(tmp, procs)
                    parts, indices = [], []
                    # The first worker to fail first: the others usually fail because it did.
                    def first_failed(r):
                        path = Path(tmp) / f"error{r}.txt"
                        return path.stat().st_mtime_ns if path.exists() else float("inf")
                    for r in sorted(range(world), key=first_failed):
                        text = _read(Path(tmp) / f"error{r}.txt")
                        if text:
                            case_line, _, tb = text.partition("\n")
                            if case_line.isdigit():
                                indices.append(int(case_line))
                            parts.append(f"--- worker {r} (case {case_line}) ---\n{tb}")
                        elif r in stacks:
                            parts.append(f"--- worker {r}: still running, killed; it was at "
                                         f"{_progress_of(tmp, r)[1]!r}; its stack: ---\n{stacks[r]}")
                    failed_case = min(indices) if indices else None
                    failure = WorkerError("Megatron worker failed:\n" + "\n".join(parts))
                    break
                if all(not p.is_alive() for p in procs):
                    codes = [p.exitcode for p in procs]
                    if any(c != 0 for c in codes):
                        failure = WorkerError(f"Megatron workers exited with codes {codes} and no traceback")
                    break
                late = [r for r in range(world) if procs[r].is_alive() and
                        now - current[r][1] > (STARTUP_S if current[r][0] is None else timeout + 10)]
                if late:
                    stacks = _stacks(tmp, procs)
                    parts = [f"--- worker {r}: at {_progress_of(tmp, r)[1]!r} ---\n{stacks.get(r, '(exited)')}"
                             for r in range(world)]
                    failure = WorkerTimeout(
                        f"Megatron workers {late} did not finish their case in {timeout} s "
                        f"(or start in {STARTUP_S} s); their stacks:\n" + "\n".join(parts))
                    indices = [current[r][0] for r in late if current[r][0] is not None]
                    failed_case = min(indices) if indices else None
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
        done = {}
        for index, _case in indexed_cases:
            path = Path(tmp) / f"case{index}.pkl"
            if path.exists():
                with open(path, "rb") as f:
                    done[index] = pickle.load(f)
                continue
            # fail_mode="exit": each surviving rank's own file.
            per_rank = [Path(tmp) / f"case{index}.rank{r}.pkl" for r in range(world)]
            if any(path.exists() for path in per_rank):
                gathered = []
                for path in per_rank:
                    if path.exists():
                        with open(path, "rb") as f:
                            gathered.append(pickle.load(f))
                    else:
                        gathered.append(None)
                done[index] = gathered
        return done, failure, failed_case


def run_cases(world, cases, timeout=120):
    """Runs each case (a dict of run()'s keyword arguments) on `world` workers; returns a list with,
    per case, its Result or the WorkerError it failed with. Cases share workers until one fails."""
    full = [_full_case(c) for c in cases]
    for case in full:
        if world % (case["pp"] * case["tp"]) != 0:
            raise ValueError(f"world {world} is not a multiple of pp*tp = {case['pp'] * case['tp']}")
    results = [None] * len(full)
    pending = list(enumerate(full))
    while pending:
        done, failure, failed = _spawn(world, pending, timeout)
        for index, gathered in done.items():
            results[index] = _assemble(gathered, full[index])
        if failure is None:
            missing = [(i, c) for i, c in pending if i not in done]
            if missing and done and any(full[i]["fail_mode"] == "exit" for i in done):
                pending = missing  # the workers ended with a dead-peer case: fresh ones go on
                continue
            for i, _c in missing:
                results[i] = WorkerError(f"case {i} produced no result")
            break
        if failed is None or failed not in dict(pending):
            failed = next(i for i, _ in pending if i not in done)
        results[failed] = failure
        pending = [(i, c) for i, c in pending if i not in done and i != failed]
    return results


def run(world, pp, tp=1, vp=None, steps=2, m=4, dtype="fp32", tied=False, per_token=False,
        overlap_grad_reduce=False, use_zbpp=False, zbpp_kind=None, timeout=120, **more):
    """Trains the tiny GPT for `steps` steps on `world` CPU workers; returns the Result (see the
    module docstring). Raises WorkerError with the workers' tracebacks if one fails, WorkerTimeout
    with their stacks if they hang."""
    case = dict(pp=pp, tp=tp, vp=vp, steps=steps, m=m, dtype=dtype, tied=tied, per_token=per_token,
                overlap_grad_reduce=overlap_grad_reduce, use_zbpp=use_zbpp, zbpp_kind=zbpp_kind, **more)
    result, = run_cases(world, [case], timeout=timeout)
    if isinstance(result, BaseException):
        raise result
    return result


# =====================================================================================================
# Comparison helpers
# =====================================================================================================

def differences(a, b):
    """A list of what differs (not bit for bit) between two Results; [] when they are equal.
    collected is compared where both Results have it (both ran with collect=True)."""
    import torch

    diffs = []

    def cmp_tensor(where, x, y):
        if not (torch.is_tensor(x) and torch.is_tensor(y)):
            if x != y:
                diffs.append(f"{where}: {x!r} != {y!r}")
            return
        if x.dtype != y.dtype or x.shape != y.shape:
            diffs.append(f"{where}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(x, y):
            delta = (x.double() - y.double()).abs().max().item()
            diffs.append(f"{where}: differs (max |diff| {delta:.3g})")

    for field in ("losses", "eval_losses", "collected"):
        if a.get(field) is None or b.get(field) is None:
            continue  # collected: only with collect=True
        for step, (la, lb) in enumerate(zip(a[field], b[field])):
            if len(la) != len(lb):
                diffs.append(f"{field}[{step}]: {len(la)} vs {len(lb)} microbatch dicts")
                continue
            for i, (da, db) in enumerate(zip(la, lb)):
                if set(da) != set(db):
                    diffs.append(f"{field}[{step}][{i}]: keys {sorted(da)} vs {sorted(db)}")
                    continue
                for k in da:
                    cmp_tensor(f"{field}[{step}][{i}][{k!r}]", da[k], db[k])
        if len(a[field]) != len(b[field]):
            diffs.append(f"{field}: {len(a[field])} vs {len(b[field])} steps")
    for field in ("init_params", "grads", "params"):
        xs, ys = a[field], b[field]
        if field == "init_params":
            xs, ys = [xs], [ys]
        for step, (da, db) in enumerate(zip(xs, ys)):
            if set(da) != set(db):
                diffs.append(f"{field}[{step}]: names differ: {sorted(set(da) ^ set(db))}")
            for name in sorted(set(da) & set(db)):
                cmp_tensor(f"{field}[{step}][{name}]", da[name], db[name])
    return diffs
