"""Where this rank sits in the pipeline: Megatron's parallel state, the pipeline group, and which
stage each model chunk is under a schedule."""

import contextlib
import importlib
import sys
import warnings

import torch
import torch.distributed as dist

from ..distributed import group_rank, group_size, takes_cpu
from .flags import V_KINDS, _config


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


def _device_of(chunks):
    """The device of the model chunks' parameters (the CPU when they have none)."""
    return next((prm.device for c in chunks for prm in c.parameters()), torch.device("cpu"))


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


# ---- answering as the stage a V chunk is ----------------------------------------------------------------
#
# Megatron numbers stages in loop order: with 2 virtual stages, (pipeline rank q, virtual stage c) is
# stage c*p + q. Under a V schedule chunk 1 of rank r is stage 2p-1-r, which in loop order belongs to
# pipeline rank p-1-r. So while a V chunk is built or runs, Megatron is told that pipeline rank: its
# first/last-stage answers (get_batch's labels, pre_process/post_process) and its layer offsets then
# describe the stage the chunk really is. Chunk 0 (stage r) needs no change.

def _loop_rank(stage, p):
    """The pipeline rank that holds `stage` in Megatron's loop numbering."""
    return stage % p


def _pp_group(ps):
    getter = getattr(ps, "get_pipeline_model_parallel_group", None)
    try:
        return getter() if getter is not None else None
    except (AssertionError, RuntimeError):
        return None


_pg_rank_cache = {"count": -1, "modules": []}


def _pg_rank_modules():
    """The megatron.core modules that imported get_pg_rank (looked up again when modules were added)."""
    if _pg_rank_cache["count"] != len(sys.modules):
        _pg_rank_cache["modules"] = [m for n, m in list(sys.modules.items())
                                     if n.startswith("megatron.core") and m is not None
                                     and "get_pg_rank" in getattr(m, "__dict__", {})]
        _pg_rank_cache["count"] = len(sys.modules)
    return _pg_rank_cache["modules"]


@contextlib.contextmanager
def _as_pipeline_rank(ps, rank):
    """Megatron's parallel_state (and megatron.core's get_pg_rank of the pipeline group) answer
    `rank` as this process's pipeline rank inside the block; rank None changes nothing."""
    if ps is None or rank is None or not hasattr(ps, "set_pipeline_model_parallel_rank"):
        yield
        return
    previous = getattr(ps, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", None)
    group = _pp_group(ps)
    patched = []
    # Newer megatron.core asks the process group itself (get_pg_rank(pg_collection.pp)); each module
    # imported the function by name, so each module's reference is swapped.
    for module in _pg_rank_modules():
        original = module.__dict__.get("get_pg_rank")
        if original is None or getattr(original, "__zbpp_original__", None) is not None:
            continue

        def get_pg_rank(pg, _original=original):
            if group is not None and pg is group:
                return rank
            return _original(pg)

        get_pg_rank.__zbpp_original__ = original
        module.get_pg_rank = get_pg_rank
        patched.append((module, original))
    ps.set_pipeline_model_parallel_rank(rank)
    try:
        yield
    finally:
        ps.set_pipeline_model_parallel_rank(previous)
        for module, original in patched:
            module.get_pg_rank = original


# ---- a gloo group over the pipeline, for host-memory messages ------------------------------------------

_gloo = {}


def pipeline_cpu_group(group):
    """A group over the pipeline's ranks that takes CPU tensors (zbpp's host messages: the NCCL id,
    post-validation's norms): `group` itself when it does (gloo), else a gloo group made once.

    In a real Megatron job the pipeline group is a subgroup of the world (any TP or DP > 1), and
    torch.distributed.new_group is a collective of every process. So every rank first learns every
    pipeline group's ranks (one all_gather_object over the world), then all of them make a gloo group
    for each, in the same order, and each keeps its own. Every rank calls this at the same point: the
    first training call of forward_backward_func."""
    if group is None or takes_cpu(group):
        return group
    key = tuple(dist.get_process_group_ranks(group))
    made = _gloo.get(key)
    if made is not None:
        return made
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, key)
    for ranks in sorted(set(everyone)):
        g = dist.new_group(list(ranks), backend="gloo")
        if ranks == key:
            _gloo[key] = g
    return _gloo[key]
