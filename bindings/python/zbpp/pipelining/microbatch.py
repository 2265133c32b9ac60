"""torch.distributed.pipelining.microbatch's names, for scripts that import them from zbpp.

`TensorChunkSpec`, `split_args_kwargs_into_chunks`, `merge_chunks`, `sum_reducer` and the rest are
torch's own (see zbpp/pipelining/_torch.py for why), so a spec or a reducer made for torch works
with zbpp's schedules and the other way round.
"""

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
