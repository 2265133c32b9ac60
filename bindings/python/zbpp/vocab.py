"""Vocabulary Parallelism's passes (Yeung, Qi, Lin, Wan, MLSys 2025): the output layer with its
cross entropy, and the input embedding, split over the vocabulary across every pipeline rank.

What this is: `VocabParallelOutput` and `VocabParallelEmbedding`, one per rank, each holding this
rank's rows of a weight the user hands over whole ([V, H], the same on every rank), and the passes
the schedule runs on every rank for every microbatch, with the collectives between them over the
pipeline group (zbpp.runtime.Transport.all_reduce / broadcast: rank 0 reduces in rank order, so
every rank gets the same bits):

  output layer, on the last transformer stage's hidden state h [T, H] (broadcast to every rank)
  and the targets [T]:
    S   s_pass(h, target): this shard's logits, their max m_r, sum of exp(l - m_r), the target's
        logit where it falls in the shard; with fused=True (the reference's Vocab-2, its default,
        "backward fusion") also exp(l - m_r) @ W_r and W_r[target], the input gradient's parts.
    C0  reduce(state): all-reduce MAX of the maxima M, then one SUM of the sums rescaled by
        exp(m_r - M), the target logits and, fused, the input gradient's parts: the per-token
        loss log(sum) + M - target logit on every rank, and (fused) the input gradient per unit
        of loss gradient.
    T   t_pass(state, grad_loss): the softmax from the global max and sum, its gradient times the
        per-token loss gradient, the shard's weight gradient (into weight.grad); unfused (Vocab-1)
        also this shard's part of the input gradient,
    C1  reduce_grad(state) (unfused only): SUM of those parts.
  input embedding, on the tokens [T]:
    IF  embed(tokens): the shard's rows for tokens in the shard, zeros elsewhere, SUM over ranks:
        every rank gets the embedding (exact: one nonzero term per element).
    IB  embed_backward(tokens, grad): the embedding output's gradient, broadcast from the rank
        that holds stage 0, accumulated into the shard's rows of weight.grad.

Numbers: the loss and gradients are the unsharded layer's within float32 rounding (the softmax's
sum is merged from the shards' sums, exp(l - m_r) exp(m_r - M) where an unsharded one takes
exp(l - M)); the embedding forward is exact. Label smoothing is torch's (F.cross_entropy's
label_smoothing). A vocabulary not divisible by the ranks is padded as Megatron pads it (to a
multiple of pad_multiple x ranks); padded rows take no part in the softmax (their logits are
-inf), so the result is the unpadded layer's. Tied embeddings: VocabParallelOutput(..., tied=emb)
uses the embedding's shard, and both passes' gradients add into it. gather() gives the whole
weight back, in the unsharded layout, for a checkpoint.

VocabParallel is what a user hands a schedule class (vocab_parallel=): the whole output layer and
input embedding; the schedule shards them over its ranks and runs the passes at the ops its plan
places (zbpp/pipelining/_vocab.py).

Devices: the shards live on the device the schedule's stages are on (CUDA stages: on their GPU),
and the passes compute there. Their collectives take whatever transport they are given: a host
one takes a CUDA tensor through host memory (zbpp.runtime.Transport.all_reduce: the current stream
synchronised, a copy to pinned host memory, the collective, a copy back: the host reduction's
bits), an NCCL group transport reduces on the GPUs (NCCL's order: within rounding). A schedule
chooses (zbpp/pipelining/_vocab.py).

What this is not: the schedule's placement of these passes (the schedule model's S/T/IF/IB ops).
"""

import threading

import torch

__all__ = ["VocabParallel", "VocabParallelOutput", "VocabParallelEmbedding", "vocab_shard_range"]

# The collectives' channels (zbpp.runtime.Transport.all_reduce's channel=): one per kind of pass, so
# that each kind only has to run in microbatch order on every rank (as the schedule model's
# validator requires), whatever the order of the kinds among themselves.
CHANNEL_S, CHANNEL_T, CHANNEL_IF, CHANNEL_IB, CHANNEL_GATHER = 0, 1, 2, 3, 4
# A schedule's own messages: the batch's tokens and targets to every rank, the last stage's hidden
# state to every rank (zbpp/pipelining/_vocab.py).
CHANNEL_DATA, CHANNEL_HIDDEN = 5, 6


def vocab_shard_range(vocab_size, rank, ranks, pad_multiple=1):
    """(start, end, padded vocabulary) of rank's rows: the vocabulary padded up to a multiple of
    pad_multiple x ranks (Megatron's make_vocab_size_divisible_by x its split), split evenly.
    end may pass vocab_size: those rows are padding."""
    if vocab_size < 1 or ranks < 1 or not 0 <= rank < ranks or pad_multiple < 1:
        raise ValueError(f"vocab_shard_range: vocab_size {vocab_size} and ranks {ranks} must be >= 1, rank {rank} "
                         f"in 0..{ranks - 1}, pad_multiple {pad_multiple} >= 1")
    multiple = pad_multiple * ranks
    padded = -(-vocab_size // multiple) * multiple
    per = padded // ranks
    return rank * per, (rank + 1) * per, padded


def _check_weight(name, weight, rank, ranks):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"zbpp.{name}: weight must be the whole [vocab, hidden] weight (a 2-D tensor), got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if not 0 <= rank < ranks:
        raise ValueError(f"zbpp.{name}: rank {rank} is not in 0..{ranks - 1}")


class _Alone:
    """The collectives of a pipeline of one rank: nothing to combine."""

    @staticmethod
    def all_reduce(x, op="sum", timeout=300.0, channel=0):
        return x

    @staticmethod
    def broadcast(x, root, timeout=300.0, channel=0):
        return x


class _Unbound:
    """The collectives of shards a schedule made and has not run yet (VocabParallel)."""

    @staticmethod
    def _refuse(*_args, **_kwargs):
        raise RuntimeError("zbpp.VocabParallel: its collectives run over its schedule's ranks; call this after "
                           "the schedule's first step, on every rank")

    all_reduce = broadcast = _refuse


class _Shard:
    """This rank's rows of a [V, H] weight, padded: a Parameter of [end - start, H] (padding zeros)
    on `device` (default: the CPU). Every tensor the passes make is made there; ids and hidden
    states may come from anywhere and are moved there."""

    def __init__(self, name, weight, rank, ranks, transport, pad_multiple, device=None):
        _check_weight(name, weight, rank, ranks)
        # The output layer's T (the runner's thread) and the embedding's IB (its own lane) may add
        # into one tied weight's gradient at once.
        self._lock = threading.Lock()
        self.timeout = 300.0  # seconds each collective may take (a schedule sets its own timeout=)
        self._ib_grad = None  # IB's gradient of a tied shard, added to .grad in a fixed order (flush_ib)
        if transport is None and ranks > 1:
            raise ValueError(f"zbpp.{name}: {ranks} ranks need their transport (zbpp.runtime.Transport, e.g. "
                             "zbpp.distributed.TorchTransport(group).transport) for the collectives")
        self.rank, self.ranks, self.transport = rank, ranks, transport if transport is not None else _Alone()
        self.vocab_size, self.hidden = weight.shape
        self.start, self.end, self.padded = vocab_shard_range(self.vocab_size, rank, ranks, pad_multiple)
        device = torch.device(device if device is not None else "cpu")
        rows = torch.zeros(self.end - self.start, self.hidden, dtype=weight.dtype, device=device)
        real = max(0, min(self.end, self.vocab_size) - self.start)
        if real:
            rows[:real] = weight.detach()[self.start:self.start + real].to(device)
        self.real = real  # rows of this shard that are vocabulary, not padding
        self.weight = torch.nn.Parameter(rows)

    @property
    def device(self):
        """Where the shard is, and the passes compute: its weight's device (a module holding the
        weight may move it, as Megatron's get_model moves the model to its GPU)."""
        return self.weight.device

    def gather(self):
        """The whole [V, H] weight on every rank, in host memory (a collective: one broadcast per
        rank, exact): for a checkpoint, without a second copy of the vocabulary on the GPU."""
        per = self.end - self.start
        out = torch.empty(self.padded, self.hidden, dtype=self.weight.dtype, device="cpu")
        for r in range(self.ranks):
            part = out[r * per:(r + 1) * per]
            if r == self.rank:
                part.copy_(self.weight.detach())
            self.transport.broadcast(part, r, timeout=self.timeout, channel=CHANNEL_GATHER)
        return out[:self.vocab_size].clone() if self.padded > self.vocab_size else out  # (no padding saved)

    def _grad_sink(self, make=False):
        """The tensor the passes add the weight's gradient into, or None (make: zeros made).
        Megatron's DDP gives each parameter a main_grad (fp32) that its optimizer reads and its
        backward hooks add autograd's gradient into; these passes bypass autograd, so they add
        there themselves (as Megatron's fused weight-gradient accumulation does). Under the lock."""
        main = getattr(self.weight, "main_grad", None)
        if main is not None:
            return main
        if self.weight.grad is None and make:
            self.weight.grad = torch.zeros_like(self.weight)
        return self.weight.grad

    def _add_grad(self, g):
        with self._lock:
            sink = self._grad_sink()
            if sink is None:
                self.weight.grad = g
            else:
                sink += g.to(sink.dtype)

    def _add_product(self, a, b):
        """weight.grad += a^T b, into the gradient itself where it is float32 (no shard-sized
        temporary)."""
        with self._lock:
            grad = self._grad_sink()
            if grad is not None and grad.dtype == torch.float32:
                grad.addmm_(a.t(), b)
                return
        self._add_grad((a.t() @ b).to(self.weight.dtype))

    def load(self, weight):
        """Takes this rank's rows of the whole [V, H] weight (a checkpoint in the unsharded
        layout), in place: the Parameter an optimizer holds stays the same object."""
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (self.vocab_size, self.hidden):
            raise ValueError(f"zbpp: the weight to load must be [{self.vocab_size}, {self.hidden}] (the whole "
                             f"vocabulary), got {tuple(getattr(weight, 'shape', ()))}")
        with torch.no_grad():
            self.weight.zero_()
            if self.real:
                self.weight[:self.real].copy_(weight.detach()[self.start:self.start + self.real])


class _OutputState:
    """One microbatch's S pass results and what C0 adds to them."""

    __slots__ = ("h", "logits", "in_shard", "valid", "local_target", "m", "s", "t", "sum_logits", "soft_w",
                 "target_w", "M", "sum", "loss", "grad_unit", "grad_part")


class VocabParallelOutput(_Shard):
    """The output layer (logits = h @ W^T over the vocabulary) and its cross entropy on this rank's
    rows; see the module docstring for the passes. weight: the whole [V, H] weight (every rank
    passes the same), or tied=a VocabParallelEmbedding whose shard this layer shares."""

    def __init__(self, weight=None, rank=0, ranks=1, transport=None, pad_multiple=1, fused=True,
                 label_smoothing=0.0, tied=None, ignore_index=-100, device=None):
        if tied is not None:
            self.__dict__.update({k: getattr(tied, k) for k in ("rank", "ranks", "transport", "vocab_size", "hidden",
                                                              "start", "end", "padded", "real", "weight",
                                                              "_lock", "timeout", "_ib_grad")})
        else:
            super().__init__("VocabParallelOutput", weight, rank, ranks, transport, pad_multiple, device)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"zbpp.VocabParallelOutput: label_smoothing must be in [0, 1), got {label_smoothing}")
        self.fused, self.label_smoothing = bool(fused), float(label_smoothing)
        self.ignore_index = ignore_index  # targets equal to it count for nothing, as F.cross_entropy's

    def valid(self, target):
        """Which targets count (not ignore_index)."""
        return target != self.ignore_index if self.ignore_index is not None else torch.ones_like(target, dtype=torch.bool)

    def grad_of_mean(self, target):
        """d(mean loss)/d(per-token loss) of a microbatch: 1 / (targets that count) each, 0 for
        the ignored (all ignored: 0, as torch's gradient; the mean is then NaN, as torch's)."""
        valid = self.valid(target).float()
        return valid / valid.sum().clamp(min=1.0)

    def mean(self, loss, target):
        """The microbatch's loss: the mean over the targets that count (F.cross_entropy's)."""
        valid = self.valid(target)
        return (loss * valid).sum() / valid.sum()

    # ---- S ----------------------------------------------------------------------------------------

    def check_targets(self, target):
        """Raises unless every target is a vocabulary id or ignore_index (on a GPU this waits for
        the device: check host copies where there are some, and pass check=False)."""
        counted = target[self.valid(target)]
        if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= self.vocab_size):
            raise ValueError(f"zbpp.VocabParallelOutput: targets must be vocabulary ids in 0..{self.vocab_size - 1} "
                             f"or ignore_index ({self.ignore_index}), got {int(counted.min())}..{int(counted.max())}")

    def s_pass(self, h, target, need_grad=True, check=True):
        """S on one microbatch: h [T, H] (float), target [T] (vocabulary ids, or ignore_index).
        Returns its state. need_grad=False (forward only): without the fused input gradient's parts.
        check=False: the targets were checked already (check_targets)."""
        if check:
            self.check_targets(target)
        target = target.to(self.device)
        valid = self.valid(target)
        st = _OutputState()
        w = self.weight.detach()
        st.h = h.detach().to(self.device).float()
        logits = st.h @ w.float().t()
        if self.real < logits.shape[1]:
            logits[:, self.real:] = float("-inf")  # padding takes no part in the softmax
        st.logits = logits
        st.in_shard = valid & (target >= self.start) & (target < self.start + self.real)
        st.valid = valid
        st.local_target = torch.where(st.in_shard, target - self.start, torch.zeros_like(target))
        st.m = logits.max(dim=1).values if self.real else torch.full((logits.shape[0],), float("-inf"),
                                                                                 device=self.device)
        finite = torch.isfinite(st.m)
        shifted = logits - torch.where(finite, st.m, torch.zeros_like(st.m)).unsqueeze(1)
        e = torch.exp(shifted)
        st.s = e.sum(dim=1)
        picked = logits.gather(1, st.local_target.unsqueeze(1)).squeeze(1)
        st.t = torch.where(st.in_shard, picked, torch.zeros_like(picked))
        if self.label_smoothing:
            st.sum_logits = logits[:, :self.real].sum(dim=1)
        st.soft_w = st.target_w = None
        if self.fused and need_grad:
            st.soft_w = e @ w.float()
            st.target_w = torch.where(st.in_shard.unsqueeze(1), w.float()[st.local_target],
                                       torch.zeros(1, device=self.device))
        return st

    # ---- C0 ---------------------------------------------------------------------------------------

    def reduce(self, st, transport=None):
        """C0: the global max and sum (and, fused, the input gradient per unit of loss gradient);
        fills st.loss [T], the per-token cross entropy, the same on every rank. transport: where
        the collectives go (default the layer's; a schedule gives each kind of pass its own)."""
        tr = transport or self.transport
        ch = dict(channel=CHANNEL_S, timeout=self.timeout)
        fused = st.soft_w is not None  # (not in a forward-only S)
        # Two all-reduces: the maxima, then every sum at once in one buffer (each collective on a
        # lane beside the compute waits for its thread's turn at Python's interpreter lock, so
        # fewer is faster). The input gradient's parts are summed rescaled and divided by the
        # global sum after, which is the same sum over the shards.
        st.M = tr.all_reduce(st.m.clone(), "max", **ch)
        scale = torch.where(torch.isfinite(st.m), torch.exp(st.m - st.M), torch.zeros_like(st.m))
        a, V = self.label_smoothing, self.vocab_size
        parts = [st.s * scale, st.t]
        if a:
            parts.append(st.sum_logits)
        if fused:
            parts += [st.soft_w * scale.unsqueeze(1), st.target_w]
            if a:
                parts.append(self.weight.detach().float()[:self.real].sum(dim=0))
        packed = tr.all_reduce(torch.cat([x.reshape(-1) for x in parts]), "sum", **ch)
        n, H = st.m.shape[0], self.hidden
        st.sum, target_logit = packed[:n], packed[n:2 * n]
        at = 2 * n
        if a:
            total, at = packed[at:at + n], at + n
        log_z = torch.log(st.sum) + st.M
        st.loss = log_z - target_logit
        if a:
            st.loss = (1 - a) * st.loss + a * (log_z - total / V)
        st.loss = torch.where(st.valid, st.loss, torch.zeros_like(st.loss))  # ignored targets: 0, as torch
        if fused:
            soft = packed[at:at + n * H].view(n, H)
            target_w = packed[at + n * H:at + 2 * n * H].view(n, H)
            st.grad_unit = soft / st.sum.unsqueeze(1) - (1 - a) * target_w
            if a:
                st.grad_unit -= (a / V) * packed[at + 2 * n * H:]
        return st.loss

    # ---- T (and C1) -------------------------------------------------------------------------------

    def t_pass(self, st, grad_loss):
        """T: grad_loss [T] is d(loss)/d(per-token loss); the shard's weight gradient goes into
        weight.grad. Fused: returns the input gradient [T, H] (C0 made it); unfused: returns None
        and reduce_grad gives it."""
        # ignored targets: no gradient
        g = torch.where(st.valid, grad_loss.detach().to(self.device).float(), torch.zeros((), device=self.device))
        soft = torch.exp(st.logits - st.M.unsqueeze(1)) / st.sum.unsqueeze(1)
        a = self.label_smoothing
        grad_logits = soft
        rows = torch.arange(grad_logits.shape[0], device=self.device)
        hit = st.in_shard.float() * (1 - a)
        grad_logits[rows, st.local_target] -= hit
        if a:
            grad_logits[:, :self.real] -= a / self.vocab_size
        grad_logits[:, self.real:] = 0.0
        grad_logits *= g.unsqueeze(1)
        self._add_product(grad_logits, st.h)
        if self.fused:
            return st.grad_unit * g.unsqueeze(1)
        st.grad_part = grad_logits @ self.weight.detach().float()
        return None

    def reduce_grad(self, st, transport=None):
        """C1 (unfused only): the input gradient [T, H], summed over the shards."""
        if self.fused:
            raise RuntimeError("zbpp.VocabParallelOutput.reduce_grad is the unfused variant's C1 (fused=False); "
                               "with fused=True t_pass returns the input gradient")
        return (transport or self.transport).all_reduce(st.grad_part.contiguous(), "sum", timeout=self.timeout,
                                                        channel=CHANNEL_T)

    def forward_backward(self, h, target, grad_loss=None):
        """S, C0, T (and C1) for one microbatch: (per-token loss [T], input gradient [T, H]).
        grad_loss: d(loss)/d(per-token loss); None: the mean over tokens (1 / T each)."""
        st = self.s_pass(h, target)
        loss = self.reduce(st)
        if grad_loss is None:
            grad_loss = self.grad_of_mean(target)
        grad = self.t_pass(st, grad_loss)
        return loss, grad if grad is not None else self.reduce_grad(st)


class VocabParallelEmbedding(_Shard):
    """The input embedding on this rank's rows; see the module docstring (IF: embed, IB:
    embed_backward). weight: the whole [V, H] weight, the same on every rank."""

    def __init__(self, weight, rank, ranks, transport, pad_multiple=1, device=None):
        super().__init__("VocabParallelEmbedding", weight, rank, ranks, transport, pad_multiple, device)

    def check_tokens(self, tokens):
        """Raises unless every token is a vocabulary id (on a GPU this waits for the device: check
        host copies where there are some, and pass check=False)."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"zbpp.VocabParallelEmbedding: tokens must be vocabulary ids in 0..{self.vocab_size - 1}, "
                             f"got {int(tokens.min())}..{int(tokens.max())}")

    def embed_local(self, tokens, check=True):
        """IF on this shard: the rows of tokens [T] that fall in it, zeros elsewhere ([T, H]).
        check=False: the tokens were checked already (check_tokens)."""
        if check:
            self.check_tokens(tokens)
        tokens = tokens.to(self.device)
        in_shard = (tokens >= self.start) & (tokens < self.start + self.real)
        local = torch.where(in_shard, tokens - self.start, torch.zeros_like(tokens))
        return torch.where(in_shard.unsqueeze(1), self.weight.detach()[local],
                           torch.zeros((), dtype=self.weight.dtype, device=self.device))

    def embed(self, tokens, transport=None):
        """IF and its SUM: the embedding of tokens [T] ([T, H]) on every rank."""
        return (transport or self.transport).all_reduce(self.embed_local(tokens).contiguous(), "sum",
                                                        timeout=self.timeout, channel=CHANNEL_IF)

    def embed_backward(self, tokens, grad, root=0, transport=None, tied=False):
        """IB: grad [T, H], the embedding output's gradient, from rank `root` (the others pass a
        tensor of that shape to receive it); the shard's rows of weight.grad gain their part.
        tied=True (a weight the output layer's T adds into too, from another thread): into a
        buffer of IB's own, which flush_ib adds to .grad, so the sum's order is the same each run."""
        grad = (transport or self.transport).broadcast(grad.detach().contiguous().to(self.weight.dtype), root,
                                                       timeout=self.timeout, channel=CHANNEL_IB)
        tokens, grad = tokens.to(self.device), grad.to(self.device)
        in_shard = (tokens >= self.start) & (tokens < self.start + self.real)
        # Every token a row (row 0 and a zero for those of other shards): no boolean indexing,
        # which would wait for the device to learn how many there are.
        rows = torch.where(in_shard, tokens - self.start, torch.zeros_like(tokens))
        values = torch.where(in_shard.unsqueeze(1), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        if tied:
            self.prepare_ib(tied)
            self._ib_grad.index_add_(0, rows, values)
            return
        with self._lock:
            sink = self._grad_sink(make=True)
            sink.index_add_(0, rows, values.to(sink.dtype))

    def prepare_ib(self, tied):
        """Makes the buffer IB adds into (tied: IB's own; else the gradient), so a caller on
        another stream can make it on the stream that reads it later."""
        if tied:
            if self._ib_grad is None:
                self._ib_grad = torch.zeros_like(self.weight)
            return
        with self._lock:
            self._grad_sink(make=True)

    def flush_ib(self):
        """Adds what tied IB passes gathered (embed_backward(tied=True)) to .grad."""
        if self._ib_grad is not None:
            self._add_grad(self._ib_grad)
            self._ib_grad = None


# One rank's pass times, in the unit of the schedule's times (a stage's F is 1 by default): the
# placement of the passes in kinds other than 1F1B, and the plan's figures, use them.
DEFAULT_TIMES = {"s": 1.0, "t": 1.0, "if": 0.1, "ib": 0.1, "comm": 0.0}


def _whole_weight(what, layer, kind):
    """The [V, H] weight of the layer a user hands VocabParallel (the module, or its weight)."""
    if isinstance(layer, torch.Tensor):
        weight = layer
    elif isinstance(layer, kind):
        if kind is torch.nn.Embedding:
            odd = [f"{k}={getattr(layer, k)!r}" for k, off in (("padding_idx", None), ("max_norm", None),
                                                                ("scale_grad_by_freq", False), ("sparse", False))
                   if getattr(layer, k, off) != off]
            if odd:
                raise ValueError(f"zbpp.VocabParallel: the embedding has {', '.join(odd)}; the split embedding is a plain "
                                 "lookup (no padding_idx, max_norm, scale_grad_by_freq or sparse gradients)")
        if getattr(layer, "bias", None) is not None:
            raise ValueError(f"zbpp.VocabParallel: the {what} layer has a bias; the output layer over the vocabulary is "
                             "split without one (nn.Linear(hidden, vocab, bias=False), as GPT-style models have it)")
        weight = layer.weight
    else:
        raise TypeError(f"zbpp.VocabParallel: {what} must be a torch.nn.{kind.__name__} or its [vocab, hidden] weight, "
                        f"got {type(layer).__name__}")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(f"zbpp.VocabParallel: the {what} weight must be [vocab, hidden], got {tuple(weight.shape)}")
    if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"zbpp.VocabParallel: the {what} weight is {weight.dtype}; its collectives reduce float32, "
                         "float16 or bfloat16")
    return weight


class VocabParallel:
    """Vocabulary Parallelism for a pipeline schedule: the output layer (with its cross entropy)
    and the input embedding split over the vocabulary across every rank of the pipeline. Hand it
    to a schedule class or PipelineSchedule as vocab_parallel=...; the schedule shards the layers
    over its ranks and places their passes in its plan (S and T for the output layer, IF and IB
    for the embedding, on every rank for every microbatch).

    output: the output layer, a torch.nn.Linear(hidden, vocab, bias=False) or its [vocab, hidden]
    weight; embedding: the input embedding, a torch.nn.Embedding(vocab, hidden) or its weight.
    Every rank passes the same layers (built from one seed, or loaded from one checkpoint). When
    both are one Parameter (tied), the shard is shared and gets both gradients.
    fused: True (the reference's Vocab-2, its default) computes the output layer's input gradient
    in S, one barrier a microbatch and p+1 microbatches of activation memory in 1F1B; False
    (Vocab-1, Megatron's --disable-backward-fusion) in T, two barriers, p+2. label_smoothing: as
    torch's F.cross_entropy; ignore_index (-100, as F.cross_entropy's): targets equal to it count
    for nothing (no loss, no gradient; the mean is over the others). pad_multiple: the vocabulary is padded to a multiple of pad_multiple x
    ranks (Megatron's make_vocab_size_divisible_by); padded rows take no part. times: one rank's
    pass times {'s', 't', 'if', 'ib', 'comm'} in the unit of the schedule's times (defaults in
    DEFAULT_TIMES), which place the passes; without them (and without the schedule's times= or
    plan_from_measured=False) the schedule measures them, with its stages', in its second step
    and plans again on them (zbpp/pipelining/_vocab.py).

    What the model changes: stage 0's module takes the embedding's output (hidden states) as its
    first argument where it took the tokens; the last stage's module returns the hidden states
    the output layer reads ([..., hidden], one row per target); the loss is the cross entropy of
    the output layer, mean over each microbatch's tokens (no loss_fn). The schedule takes the
    batch and the target where torch's does (stage 0's rank, the last stage's rank) and sends
    them to every rank. After the schedule is made: parameters() are this rank's shards (give
    them to the optimizer), gather() the whole weights for a checkpoint, load() takes them back.
    """

    def __init__(self, output, embedding, *, fused=True, label_smoothing=0.0, pad_multiple=1, times=None,
                 ignore_index=-100):
        self._whole = (_whole_weight("output", output, torch.nn.Linear),
                       _whole_weight("embedding", embedding, torch.nn.Embedding))
        if self._whole[0].shape != self._whole[1].shape:
            raise ValueError(f"zbpp.VocabParallel: the output weight is {tuple(self._whole[0].shape)} and the "
                             f"embedding's {tuple(self._whole[1].shape)}; both are [vocab, hidden]")
        self.tied = self._whole[0] is self._whole[1]
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"zbpp.VocabParallel: label_smoothing must be in [0, 1), got {label_smoothing}")
        if not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"zbpp.VocabParallel: pad_multiple must be an int >= 1, got {pad_multiple!r}")
        unknown = set(times or {}) - set(DEFAULT_TIMES)
        if unknown:
            raise ValueError(f"zbpp.VocabParallel: times keys are {sorted(DEFAULT_TIMES)}, got {sorted(unknown)}")
        self.times = dict(DEFAULT_TIMES, **{k: float(v) for k, v in (times or {}).items()})
        self.times_given = bool(times)  # else the schedule plans again on the times it measures
        if any(v < 0 for v in self.times.values()):
            raise ValueError(f"zbpp.VocabParallel: times must be >= 0, got {self.times}")
        self.fused, self.label_smoothing, self.pad_multiple = bool(fused), float(label_smoothing), pad_multiple
        self.ignore_index = ignore_index
        self.vocab_size, self.hidden = self._whole[0].shape
        self.output = self.embedding = None  # this rank's shards, once a schedule made them
        self.rank = self.ranks = None
        # What the schedule's plan from measured times found (zbpp/pipelining/_vocab.py): the
        # measured stage and pass times, the simulated step before and after, whether it switched.
        self.replanned = None

    def describe(self):
        """What every rank of a pipeline must agree on (the schedule's handshake compares it)."""
        return (f"vocab {self.vocab_size} x {self.hidden}, {'fused' if self.fused else 'unfused'}, label_smoothing "
                f"{self.label_smoothing:g}, pad_multiple {self.pad_multiple}, {'tied' if self.tied else 'untied'}, "
                f"ignore_index {self.ignore_index}")

    def _bind(self, rank, ranks, device=None):
        """Shards the layers for `rank` of `ranks`, on `device` (the rank's stages'; the schedule
        does, once)."""
        device = torch.device(device if device is not None else "cpu")
        if self.ranks is not None:
            if (self.rank, self.ranks, self.embedding.device) != (rank, ranks, device):
                raise ValueError(f"zbpp.VocabParallel: already sharded for rank {self.rank} of {self.ranks} on "
                                 f"{self.embedding.device}; make one per schedule")
            return
        out_w, emb_w = self._whole
        tr = _Alone() if ranks == 1 else _Unbound  # the schedule gives its transport at its first step
        self.embedding = VocabParallelEmbedding(emb_w, rank, ranks, tr, self.pad_multiple, device)
        if self.tied:
            self.output = VocabParallelOutput(tied=self.embedding, fused=self.fused,
                                              label_smoothing=self.label_smoothing, ignore_index=self.ignore_index)
        else:
            self.output = VocabParallelOutput(out_w, rank, ranks, tr, self.pad_multiple, self.fused,
                                              self.label_smoothing, ignore_index=self.ignore_index, device=device)
        self.rank, self.ranks = rank, ranks
        self._whole = None  # the user's whole layers are not used again: delete them to free their memory

    def _shards(self):
        if self.output is None:
            raise RuntimeError("zbpp.VocabParallel: it is sharded when a schedule is made with it "
                               "(vocab_parallel=...); make the schedule first")
        return [("embedding.weight", self.embedding)] + ([] if self.tied else [("output.weight", self.output)])

    def named_parameters(self):
        """This rank's shards as (name, Parameter): 'embedding.weight' and, untied, 'output.weight'."""
        return [(name, shard.weight) for name, shard in self._shards()]

    def parameters(self):
        """This rank's shards (Parameters of [padded vocab / ranks, hidden]): give them to the optimizer."""
        return [w for _, w in self.named_parameters()]

    def gather(self):
        """{'embedding.weight': [V, H], 'output.weight': [V, H]} (one tensor twice when tied), the
        whole weights in the unsharded layout for a checkpoint. A collective: every rank calls it,
        between steps; every rank gets them."""
        got = {name: shard.gather() for name, shard in self._shards()}
        if self.tied:
            got["output.weight"] = got["embedding.weight"]
        return got

    def load(self, state):
        """Takes the whole weights back (gather()'s dict, or a model's 'embedding.weight' and
        'output.weight' in the unsharded layout): each rank keeps its rows, in place."""
        for name, shard in self._shards():
            if name not in state:
                raise KeyError(f"zbpp.VocabParallel.load: {name!r} is missing (has {sorted(state)})")
            shard.load(state[name])
