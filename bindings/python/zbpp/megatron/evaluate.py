"""Forward-only passes (Megatron's evaluate): the forwards along the stages in Python."""

import datetime

import torch
import torch.distributed as dist

from .. import _lib, runtime
from ..distributed import global_rank
from .placement import _device_of, _holder

# Forward-only transfers: tags above the runner's channels and the shape inference tag (1 << 20).
_EVAL_TAG = 1 << 21

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


def _forward_only(call, kind, v, p, rank, group, stage_of, S, meta, timeout, vocab=None):
    """Every microbatch forward through the pipeline, stage by stage, no backward (see the module
    docstring). Sends are non-blocking and each rank walks its stages in increasing order, so a
    receive only waits for a stage that its holder runs before any later one: no deadlock.

    vocab (--enable-vocab-parallel, vocab.py): stage 0's forwards embed with every rank, which
    join those m collectives before their own stages (so no rank waits for another's stage
    first); after every rank's forwards, the losses are m S passes of every rank."""
    (dtype, shape), = meta
    m = call.m
    if vocab is not None:
        from .vocab import _Eval

        vocab.eval = _Eval(vocab, call, group, rank, _holder(kind, v, p, 0), _holder(kind, v, p, S - 1),
                           shape[0], shape[1], timeout)
        try:
            if 0 not in stage_of:
                vocab.eval.join_embeddings(m)
            _forward_stages(call, kind, v, p, rank, group, stage_of, S, dtype, shape, timeout, vocab.eval)
            vocab.eval.losses(m)
        finally:
            vocab.eval = None
        return
    _forward_stages(call, kind, v, p, rank, group, stage_of, S, dtype, shape, timeout, None)


def _forward_stages(call, kind, v, p, rank, group, stage_of, S, dtype, shape, timeout, vocab_eval):
    m = call.m
    device = _device_of(call.chunks)
    sends, carry = [], {}
    for s, c in sorted((s, c) for c, s in enumerate(stage_of)):
        for i in range(m):
            x = None
            if s > 0:
                prev = _holder(kind, v, p, s - 1)
                if prev == rank:
                    x = carry.pop((s - 1, i))
                else:
                    # On the chunk's device: a CUDA pipeline's group is NCCL, which takes device tensors.
                    x = torch.empty(shape, dtype=dtype, device=device)
                    work = dist.irecv(x, src=global_rank(group, prev), group=group, tag=_EVAL_TAG + (s - 1) * m + i)
                    _wait(work, prev, "receive from", timeout)
            out, loss_func = call.forward(c, i, x)
            if s == S - 1:
                if vocab_eval is not None:
                    vocab_eval.keep(i, out, loss_func)
                else:
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
