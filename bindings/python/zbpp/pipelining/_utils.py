"""torch.distributed.pipelining._utils's names that scripts and tests use, for imports from zbpp:
torch's own (see zbpp/pipelining/_torch.py): the error type a stage raises for mismatched
metadata, and the stage-to-rank maps."""

from ._torch import need

_u = need("_utils")

# torch 2.13 names the error a stage raises for mismatched metadata PipeliningMetadataError; torch
# up to 2.11 (the GPU machine's) named it PipeliningShapeError. Both names here, one class: this
# torch's.
PipeliningMetadataError = getattr(_u, "PipeliningMetadataError", None) or _u.PipeliningShapeError
PipeliningShapeError = getattr(_u, "PipeliningShapeError", PipeliningMetadataError)
generate_stage_to_rank_mapping = _u.generate_stage_to_rank_mapping
generate_rank_to_stage_mapping = _u.generate_rank_to_stage_mapping
PipeInfo = _u.PipeInfo
flatten_args = _u.flatten_args
