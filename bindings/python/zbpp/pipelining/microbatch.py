"""torch.distributed.pipelining.microbatch's names, for scripts that import them from zbpp, and
how zbpp's schedules split a step's batch into microbatches.

`TensorChunkSpec`, `split_args_kwargs_into_chunks`, `merge_chunks`, `sum_reducer` and the rest are
torch's own (see zbpp/pipelining/_torch.py for why), so a spec or a reducer made for torch works
with zbpp's schedules and the other way round.

Splitting a step's batch (the private helpers below): as torch's schedules split it. Tensors go
along dim 0 with torch.tensor_split, so a batch of 64 in 3 microbatches is 22, 21 and 21 rows;
other values go to every microbatch as they are; with chunk specs, torch's own
split_args_kwargs_into_chunks does it. Microbatches of different sizes run where every stage of the
pipeline is on this process (one rank: no boundary leaves it, each stage takes the tensors the one
before produced). Across ranks the runner's buffers have one size per boundary, so there the batch
must split evenly, and the split says so before anything runs (torch's own schedules accept such
a batch and fail at the first transfer that does not fit). Pre-split microbatches
(step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)) are checked here too.
"""

import torch

from ._boundary import _metadata_error
from ._torch import need

_m = need("microbatch")

TensorChunkSpec = _m.TensorChunkSpec
split_args_kwargs_into_chunks = _m.split_args_kwargs_into_chunks
merge_chunks = _m.merge_chunks
sum_reducer = _m.sum_reducer
DEFAULT_CHUNK_DIM = _m.DEFAULT_CHUNK_DIM
_CustomReducer = _m._CustomReducer
_LossReducer = _m._LossReducer
_Replicate = _m._Replicate

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]

_ACROSS_RANKS = ("microbatches of different sizes run only when every stage is on one rank: between ranks the "
                 "runner's buffers have one size per boundary (torch's own schedules fail on such a batch there "
                 "too, at the first transfer that does not fit)")


def _sizes(rows, m):
    """The microbatch sizes torch.tensor_split makes of `rows` rows."""
    q, r = divmod(rows, m)
    return [q + 1] * r + [q] * (m - r)


def _split_batch(value, m, what, even):
    """`value` as m microbatches: a tensor along dim 0 (torch.tensor_split, as torch's schedules
    split), a tuple, list or dict of them element by element, anything else handed to every
    microbatch unchanged. even: the pipeline spans ranks, so every microbatch must be the same size."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"zbpp: {what} is a scalar tensor, which does not split into n_microbatches={m} "
                             "along dim 0; give it a batch dimension")
        rows = value.shape[0]
        if rows < m:
            raise ValueError(f"zbpp: {what} has batch size {rows}, which does not split into n_microbatches={m}: "
                             "every microbatch needs at least one row along dim 0")
        if even and rows % m:
            raise _metadata_error(ValueError)(
                f"zbpp: {what} has batch size {rows}, which does not split into n_microbatches={m} equal "
                f"microbatches along dim 0 (torch's split gives {_sizes(rows, m)}); {_ACROSS_RANKS}. Make the "
                f"batch a multiple of {m}")
        parts = list(torch.tensor_split(value, m))
        if value.requires_grad and value.is_leaf:
            for part in parts:  # as torch's split: the microbatches' .grad can be read after the step
                part.retain_grad()
        return parts
    if isinstance(value, (tuple, list)):
        parts = [_split_batch(v, m, f"{what}[{i}]", even) for i, v in enumerate(value)]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    if isinstance(value, dict):
        parts = {k: _split_batch(v, m, f"{what}[{k!r}]", even) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    return [value] * m


def _split_inputs(args, kwargs, m, args_chunk_spec=None, kwargs_chunk_spec=None, even=False):
    """A step's batch as m (args, kwargs) pairs: without chunk specs along dim 0 (_split_batch);
    with them by torch's split_args_kwargs_into_chunks, which must give m microbatches, all of one
    size when `even`."""
    if args_chunk_spec is None and kwargs_chunk_spec is None:
        return [tuple(a) for a in _split_batch(tuple(args), m, "the input", even)], \
            _split_batch(dict(kwargs), m, "the keyword input", even)
    mb_args, mb_kwargs = split_args_kwargs_into_chunks(tuple(args), dict(kwargs), m, args_chunk_spec,
                                                       kwargs_chunk_spec)
    if len(mb_args) != m:
        raise ValueError(f"zbpp: the batch splits into {len(mb_args)} microbatches along the chunk specs, "
                         f"not n_microbatches={m}; give each split dimension at least {m} entries")
    if even:
        shapes = [[tuple(t.shape) for t in torch.utils._pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor)]
                  for a, k in zip(mb_args, mb_kwargs)]
        if any(sh != shapes[0] for sh in shapes):
            odd = next(sh for sh in shapes if sh != shapes[0])
            raise _metadata_error(ValueError)(
                f"zbpp: the chunk specs split the batch into microbatches of different sizes ({shapes[0]} and "
                f"{odd}); {_ACROSS_RANKS}. Make each split dimension a multiple of n_microbatches={m}")
    return [tuple(a) for a in mb_args], [dict(k) for k in mb_kwargs]


def _check_presplit(args, kwargs, target, arg_mbs, kwarg_mbs):
    """step(arg_mbs=..., kwarg_mbs=..., target_mbs=...): microbatches the caller split, as torch
    takes them since pytorch/pytorch#188500 (after torch 2.13; torchtitan's trainer calls step so).
    Giving any of the three (an empty list too) selects them; the whole-batch arguments may not
    come with them. The lists' lengths are checked where torch checks them (_step_microbatches)."""
    mixed = [what for what, given in (("positional inputs", args), ("model keyword arguments", kwargs),
                                      ("target=", target is not None)) if given]
    if mixed:
        extra = f" (got {', '.join(sorted(kwargs))})" if kwargs else ""
        raise ValueError(f"zbpp: step() got pre-split microbatches (arg_mbs, kwarg_mbs or target_mbs) and "
                         f"{' and '.join(mixed)}{extra}; pass the batch either whole or split, not both")
    for i, entry in enumerate(arg_mbs if isinstance(arg_mbs, list) else ()):
        if not isinstance(entry, (tuple, list)):
            raise TypeError(f"arg_mbs[{i}] must be a tuple of the microbatch's positional arguments, got a "
                            f"{type(entry).__name__}")
    for i, entry in enumerate(kwarg_mbs if isinstance(kwarg_mbs, list) else ()):
        if not isinstance(entry, dict):
            raise TypeError(f"kwarg_mbs[{i}] must be a dict of the microbatch's keyword arguments, got a "
                            f"{type(entry).__name__}")
