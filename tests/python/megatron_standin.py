"""A stand-in for Megatron-LM, for testing zbpp.megatron: Megatron cannot be installed here (it is
not on PyPI and this machine has no network), so this builds a tiny fake `megatron` package in
sys.modules with just what the adapter touches, written against Megatron's documented interfaces:

    megatron                                   (package)
    megatron.core                              (package; .parallel_state)
    megatron.core.parallel_state               pipeline rank / size / group, virtual rank, cp/tp size 1
    megatron.core.pipeline_parallel            re-exports get_forward_backward_func, as Megatron's does
    megatron.core.pipeline_parallel.schedules  get_forward_backward_func -> Megatron's own (absent here)
    megatron.training                          get_args / set_args / parse_args(extra_args_provider)
    megatron.training.training                 train_step / evaluate, which look the function up as a
                                               module global at call time, as Megatron's do

The modules' code is executed in the modules' own namespaces, so `from ... import
get_forward_backward_func` binds the name in megatron.training.training as Megatron's import does,
and patching has to reach it there.

Also here: a small Megatron-style model (chunks with set_input_tensor and a TransformerConfig-like
.config, activations laid out (seq, batch, hidden), per-token losses on the last stage), a DDP-like
wrapper with fp32 main_grad buffers, forward_step / loss_func in the shape of pretrain_gpt.py's, and
data iterators that yield a deterministic stream and fail if a call reads more than
num_microbatches items.

What this is not: Megatron. No tensor/data parallelism, no fused kernels, no optimizer wrappers.
"""

import functools
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["install", "uninstall", "Config", "Chunk", "build_stages", "rank_chunks", "MainGradDDP",
           "forward_step", "forward_step_tokens", "loss_func", "loss_func_tokens", "StepIterator", "batch_item",
           "parse"]

_NAMES = ("megatron", "megatron.core", "megatron.core.parallel_state", "megatron.core.pipeline_parallel",
          "megatron.core.pipeline_parallel.schedules", "megatron.training", "megatron.training.training")

_PARALLEL_STATE = '''
_STATE = {"initialized": False, "rank": 0, "size": 1, "group": None, "vp_rank": None, "vp_size": None}

def initialize_model_parallel(pipeline_rank, pipeline_size, group=None, virtual_size=None):
    _STATE.update(initialized=True, rank=pipeline_rank, size=pipeline_size, group=group,
                  vp_size=virtual_size, vp_rank=None)

def destroy_model_parallel():
    _STATE.update(initialized=False, rank=0, size=1, group=None, vp_rank=None, vp_size=None)

def model_parallel_is_initialized():
    return _STATE["initialized"]

def get_pipeline_model_parallel_rank():
    return _STATE["rank"]

def get_pipeline_model_parallel_world_size():
    return _STATE["size"]

def get_pipeline_model_parallel_group():
    return _STATE["group"]

def get_virtual_pipeline_model_parallel_rank():
    return _STATE["vp_rank"]

def set_virtual_pipeline_model_parallel_rank(rank):
    _STATE["vp_rank"] = rank

def get_virtual_pipeline_model_parallel_world_size():
    return _STATE["vp_size"]

def get_context_parallel_world_size():
    return 1

def get_tensor_model_parallel_world_size():
    return 1
'''

_SCHEDULES = '''
def forward_backward_no_pipelining(**kwargs):
    raise RuntimeError("megatron stand-in: Megatron's own schedules are not part of the stand-in; "
                       "call zbpp.megatron.patch() first")

def get_forward_backward_func(pp_size=None, vp_size=None):
    return forward_backward_no_pipelining
'''

_PIPELINE_PARALLEL = '''
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
'''

_TRAINING_PKG = '''
import argparse

_GLOBAL_ARGS = None

def get_args():
    assert _GLOBAL_ARGS is not None, "args is not initialized."
    return _GLOBAL_ARGS

def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args

def parse_args(extra_args_provider=None, argv=()):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)", allow_abbrev=False)
    group = parser.add_argument_group(title="training")
    group.add_argument("--seq-length", type=int, default=8)
    group.add_argument("--micro-batch-size", type=int, default=2)
    group.add_argument("--decoder-seq-length", type=int, default=None)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args(list(argv))
'''

# train_step and evaluate as Megatron's megatron/training/training.py shape them: the schedule is
# looked up through this module's global get_forward_backward_func at each call. The stand-in's
# extra: it arms the data iterators with num_microbatches before the call and checks afterwards
# that exactly that many items were read (Megatron's iterators would silently run ahead).
_TRAINING = '''
import torch

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training import get_args


def _arm(data_iterator, m):
    its = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    for it in its:
        if it is not None:
            it.arm(m)
    return its


def _check(its, m):
    for it in its:
        if it is not None:
            it.check(m)


def train_step(forward_step_func, data_iterator, model, optimizer, num_microbatches):
    args = get_args()
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    its = _arm(data_iterator, num_microbatches)
    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.decoder_seq_length,
        forward_only=False)
    _check(its, num_microbatches)
    for chunk in model:  # what Megatron's optimizer does with main_grad: the fp32 grad it steps on
        for p in chunk.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
    optimizer.step()
    loss_reduced = {}
    if losses_reduced:
        for key in losses_reduced[0]:
            loss_reduced[key] = sum(x[key] for x in losses_reduced) / len(losses_reduced)
    return loss_reduced, losses_reduced


def evaluate(forward_step_func, data_iterator, model, num_microbatches, collect_non_loss_data=False):
    args = get_args()
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        its = _arm(data_iterator, num_microbatches)
        forward_backward_func = get_forward_backward_func()
        loss_dicts = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
            forward_only=True)
        _check(its, num_microbatches)
        collected = None
        if collect_non_loss_data:
            its = _arm(data_iterator, num_microbatches)
            collected = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
                collect_non_loss_data=True)
            _check(its, num_microbatches)
    for chunk in model:
        chunk.train()
    return loss_dicts, collected
'''


def install():
    """Puts the fake megatron modules into sys.modules (replacing any earlier stand-in); returns the
    megatron.core.parallel_state module. Raises if a real Megatron is already imported."""
    real = sys.modules.get("megatron")
    if real is not None and not getattr(real, "__zbpp_standin__", False):
        raise RuntimeError("a real megatron package is imported; the stand-in would shadow it")
    uninstall()
    modules = {}
    for name in _NAMES:
        module = types.ModuleType(name)
        module.__zbpp_standin__ = True
        if name in ("megatron", "megatron.core", "megatron.core.pipeline_parallel", "megatron.training"):
            module.__path__ = []  # a package, so submodule imports resolve through sys.modules
        modules[name] = module
        sys.modules[name] = module
    # Parents get their children as attributes, as the import system would set them.
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    for name, source in (("megatron.core.parallel_state", _PARALLEL_STATE),
                         ("megatron.core.pipeline_parallel.schedules", _SCHEDULES),
                         ("megatron.core.pipeline_parallel", _PIPELINE_PARALLEL),
                         ("megatron.training", _TRAINING_PKG),
                         ("megatron.training.training", _TRAINING)):
        exec(compile(source, f"<megatron stand-in: {name}>", "exec"), modules[name].__dict__)
    return modules["megatron.core.parallel_state"]


def uninstall():
    for name in _NAMES:
        sys.modules.pop(name, None)


# ---- the model ------------------------------------------------------------------------------------------

class Config:
    """The TransformerConfig fields the adapter reads (and a few a real one has)."""

    def __init__(self, hidden_size=16, vocab=13, num_layers=4, pipeline_dtype=None, params_dtype=torch.float32,
                 sequence_parallel=False, calculate_per_token_loss=False, grad_scale_func=None,
                 finalize_model_grads_func=None, no_sync_func=None, variable_seq_lengths=False):
        self.hidden_size = hidden_size
        self.vocab = vocab
        self.num_layers = num_layers
        self.pipeline_dtype = pipeline_dtype
        self.params_dtype = params_dtype
        self.sequence_parallel = sequence_parallel
        self.calculate_per_token_loss = calculate_per_token_loss
        self.grad_scale_func = grad_scale_func
        self.finalize_model_grads_func = finalize_model_grads_func
        self.no_sync_func = no_sync_func
        self.variable_seq_lengths = variable_seq_lengths
        self.timers = None


class Layer(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): Linear layers for split_linear, a LayerNorm whose gradient
    arrives in B."""

    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Chunk(nn.Module):
    """One pipeline stage of a GPT-like model, Megatron style: the first stage embeds tokens, the
    others take their input through set_input_tensor; activations are (seq, batch, hidden); the
    last stage returns per-token losses (batch, seq) when given labels, logits otherwise. It records
    the virtual pipeline rank it runs under (parallel_state's, None without one)."""

    def __init__(self, config, layers, pre_process, post_process):
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        h = config.hidden_size
        self.embedding = nn.Embedding(config.vocab, h) if pre_process else None
        self.layers = nn.ModuleList(Layer(h) for _ in range(layers))
        if post_process:
            self.final_norm = nn.LayerNorm(h)
            self.output_layer = nn.Linear(h, config.vocab, bias=False)
        self.input_tensor = None
        self.seen_vp_ranks = []

    def set_input_tensor(self, input_tensor):
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        assert len(input_tensor) == 1, "input_tensor should only be length 1 for this model"
        self.input_tensor = input_tensor[0]

    def forward(self, tokens, labels=None):
        ps = sys.modules.get("megatron.core.parallel_state")
        self.seen_vp_ranks.append(ps.get_virtual_pipeline_model_parallel_rank() if ps else None)
        if self.pre_process:
            x = self.embedding(tokens).transpose(0, 1).contiguous()
        else:
            x = self.input_tensor
        for layer in self.layers:
            x = layer(x)
        if not self.post_process:
            return x
        logits = self.output_layer(self.final_norm(x))  # (s, b, vocab)
        if labels is None:
            return logits.transpose(0, 1)
        s, b, vocab = logits.shape
        loss = F.cross_entropy(logits.reshape(s * b, vocab), labels.transpose(0, 1).reshape(s * b),
                               reduction="none")
        return loss.view(s, b).transpose(0, 1).contiguous()


def build_stages(config, num_stages, seed=0):
    """All S stages of the model, built from `seed` (every rank and the reference build the same
    parameters); config.num_layers are spread evenly."""
    if config.num_layers % num_stages:
        raise ValueError(f"{config.num_layers} layers do not split into {num_stages} stages")
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        per = config.num_layers // num_stages
        return [Chunk(config, per, s == 0, s == num_stages - 1) for s in range(num_stages)]
    finally:
        torch.set_rng_state(state)


def rank_chunks(stages, rank, p, placement):
    """This rank's chunks in chunk order: loop (chunk c = stage c*p + rank) or v (chunk 0 = stage
    rank, chunk 1 = stage 2p-1-rank)."""
    S = len(stages)
    if placement == "v":
        return [stages[rank], stages[2 * p - 1 - rank]]
    return [stages[c * p + rank] for c in range(S // p)]


class MainGradDDP(nn.Module):
    """Megatron's DDP in miniature: wraps a chunk (.module), gives every parameter an fp32
    main_grad buffer, zero_grad_buffer() clears them. Split Linears write main_grad directly;
    finalize() (as config.finalize_model_grads_func) moves what autograd left in .grad into it."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self):
        for p in self.module.parameters():
            p.main_grad.zero_()

    @staticmethod
    def finalize(model, num_tokens=None, **kwargs):
        for chunk in model:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.main_grad.add_(p.grad)
                    p.grad = None


# ---- data, forward_step and loss_func (pretrain_gpt.py's shape) ------------------------------------------

def batch_item(seed, index, micro_batch_size, seq_length, vocab):
    """Microbatch `index` of a deterministic stream: tokens, labels (batch, seq) and a loss mask with
    some zeros."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    tokens = torch.randint(0, vocab, (micro_batch_size, seq_length), generator=g)
    labels = torch.randint(0, vocab, (micro_batch_size, seq_length), generator=g)
    loss_mask = (torch.rand(micro_batch_size, seq_length, generator=g) > 0.2).float()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


class StepIterator:
    """An endless stream of batch_item()s. arm(m) allows m reads; a further read raises, and
    check(m) raises unless exactly m were read since arm."""

    def __init__(self, seed, micro_batch_size, seq_length, vocab):
        self.seed, self.mbs, self.seq, self.vocab = seed, micro_batch_size, seq_length, vocab
        self.index = 0
        self.budget = None
        self.read = 0

    def arm(self, m):
        self.budget, self.read = m, 0

    def check(self, m):
        if self.read != m:
            raise AssertionError(f"the data iterator was read {self.read} times in a call with "
                                 f"num_microbatches={m}")

    def __iter__(self):
        return self

    def __next__(self):
        if self.budget is not None and self.read >= self.budget:
            raise AssertionError(f"the data iterator was read more than num_microbatches={self.budget} "
                                 "times in one call")
        self.read += 1
        item = batch_item(self.seed, self.index, self.mbs, self.seq, self.vocab)
        self.index += 1
        return item


def loss_func(loss_mask, output_tensor, non_loss_data=False):
    """Masked mean of the per-token losses, and {'lm loss': it} for logging (pretrain_gpt's rule)."""
    if non_loss_data:
        return {"token losses": output_tensor.detach().clone()}
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def loss_func_tokens(loss_mask, output_tensor):
    """Newer Megatron's 3-tuple: the summed masked loss, the token count, the logging dict."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return total, num_tokens, {"lm loss": (total.detach() / mask.sum()).clone()}


def forward_step(data_iterator, model):
    # Every chunk reads its microbatch (a real pretrain_gpt reads tokens on the first stage and
    # labels on the last only), so each chunk's iterator is read exactly num_microbatches times.
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def forward_step_tokens(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"])
    return output, functools.partial(loss_func_tokens, batch["loss_mask"])


def parse(argv):
    """Megatron's parse_args with zbpp.megatron.add_arguments as the extra args provider."""
    import zbpp.megatron

    return sys.modules["megatron.training"].parse_args(zbpp.megatron.add_arguments, argv)

