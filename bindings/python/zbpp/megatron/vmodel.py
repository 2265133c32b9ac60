"""V schedules on stock Megatron-LM: model chunks built in V order, and the embedding group for it.

Under ZB-V, V-Half and V-Min each pipeline rank r of p holds two model chunks: chunk 0 is stage r,
chunk 1 is stage 2p-1-r, so rank 0 holds both the embedding and the loss. Stock Megatron's get_model
builds virtual chunks in loop order (chunk c of rank r is stage c*p + r), so:

    import zbpp.megatron as zm
    initialize_model_parallel(..., virtual_pipeline_model_parallel_size=2,
                              get_embedding_ranks=zm.v_embedding_ranks)   # or pretrain(get_embedding_ranks=...)
    model = get_model(zm.v_model_provider(model_provider), ...)

v_model_provider wraps the user's provider: for each chunk it passes pre_process / post_process of the
chunk's V stage and builds it while Megatron answers as the pipeline rank that holds that stage in
loop numbering, so the chunk gets that stage's layers (layer numbers, offsets). With tied embeddings
(Megatron's default) the output layer on rank 0 starts as a copy of rank 0's word embeddings: both
ends are on one rank, so the embedding group is that rank alone (v_embedding_ranks), and zbpp sums
the two copies' gradients on it after each step where Megatron would all-reduce them across ranks.
"""

import functools
import inspect

import torch.distributed as dist

from .placement import _as_pipeline_rank, _loop_rank, _parallel_state, _wrapped_attr


def v_embedding_ranks(pp_ranks, *_):
    """get_embedding_ranks for initialize_model_parallel / pretrain under a V schedule: the first
    pipeline rank alone, which holds both the word embeddings and the output layer."""
    return [pp_ranks[0]]


def _embedding_ranks_error(ps, p):
    """A message when Megatron's embedding group spans several ranks (loop placement), else None.
    The ranks in that group (the first and the last pipeline rank, the ones that would wait in its
    all-reduce) both see it and raise before any collective; the others are not in it."""
    if p < 2:
        return None
    getter = getattr(ps, "get_embedding_group", None)
    try:
        group = getter(check_initialized=False) if getter is not None else None
    except TypeError:  # older Megatron: no check_initialized
        try:
            group = getter()
        except (AssertionError, RuntimeError):
            group = None
    if group is None:
        return None
    ranks = dist.get_process_group_ranks(group)
    if len(set(ranks)) <= 1:
        return None
    return (f"zbpp.megatron.v_model_provider: Megatron's embedding group is ranks {list(ranks)} (the first "
            "and the last pipeline rank, for loop placement), but under a V schedule the first pipeline "
            "rank holds both ends of the model; building tied embeddings would wait forever in the "
            "embedding all-reduce. Pass get_embedding_ranks=zbpp.megatron.v_embedding_ranks to "
            "initialize_model_parallel (or to pretrain)")


def _accepts(fn, name):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def v_model_provider(model_provider):
    """Wraps a Megatron model provider (model_provider(pre_process, post_process, vp_stage=..., ...))
    so Megatron's get_model builds this rank's two chunks in V order (see the module docstring).

    Needs virtual_pipeline_model_parallel_size == 2. Raises ValueError, on every rank before anything
    is built, when the embedding group is the loop one (see v_embedding_ranks)."""
    built = {}

    @functools.wraps(model_provider)
    def provide(pre_process=True, post_process=True, vp_stage=None, **kwargs):
        ps = _parallel_state()
        if ps is None:
            raise RuntimeError("zbpp.megatron.v_model_provider: Megatron's parallel state is not initialised; "
                               "call initialize_model_parallel (or initialize_megatron) first")
        p = ps.get_pipeline_model_parallel_world_size()
        r = ps.get_pipeline_model_parallel_rank()
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
        if vp_stage is None:
            vp_stage = ps.get_virtual_pipeline_model_parallel_rank()
        if vp_size != 2 or vp_stage not in (0, 1):
            raise ValueError(f"zbpp.megatron.v_model_provider: a V schedule builds 2 model chunks per pipeline "
                             f"rank, but Megatron's virtual pipeline size is {vp_size} (virtual stage "
                             f"{vp_stage}); set --virtual-pipeline-model-parallel-size 2 (or "
                             "--num-layers-per-virtual-pipeline-stage num_layers/(2p))")
        problem = _embedding_ranks_error(ps, p)
        if problem is not None:
            raise ValueError(problem)
        stage = r if vp_stage == 0 else 2 * p - 1 - r
        args = dict(kwargs)
        if _accepts(model_provider, "vp_stage"):
            args["vp_stage"] = vp_stage
        with _as_pipeline_rank(ps, _loop_rank(stage, p) if _loop_rank(stage, p) != r else None):
            model = model_provider(pre_process=stage == 0, post_process=stage == 2 * p - 1, **args)
        if vp_stage == 0:
            built.clear()
            built["first"] = model
        elif stage == 2 * p - 1 and p > 1 and _tied(model):
            # Megatron zeroed this copy and expected the all-reduce with the first stage to fill it;
            # the first stage is chunk 0 of this rank.
            first = built.get("first")
            if first is None or not _tied(first):
                raise RuntimeError("zbpp.megatron.v_model_provider: the output layer's tied weight needs the "
                                   "first chunk's word embeddings, but chunk 0 was not built through this "
                                   "provider first")
            _shared_weight(model).data.copy_(_shared_weight(first).data)
        return model

    return provide


def _tied(model):
    return bool(_wrapped_attr(model, "share_embeddings_and_output_weights"))


def _shared_weight(model):
    fn = _wrapped_attr(model, "shared_embedding_or_output_weight")
    return fn() if fn is not None else None


def tied_pair(chunks, stage_of, S):
    """(first, last): the two copies of the tied embedding weight when this rank holds both the first
    and the last stage with tied embeddings, else None."""
    if 0 not in stage_of or (S - 1) not in stage_of or len(chunks) < 2:
        return None
    first, last = chunks[stage_of.index(0)], chunks[stage_of.index(S - 1)]
    if not (_tied(first) and _tied(last)):
        return None
    a, b = _shared_weight(first), _shared_weight(last)
    if a is None or b is None or a is b:
        return None
    return a, b


def sum_tied_grads(pair):
    """Adds the two copies' gradients, as Megatron's embedding all-reduce does between ranks, so the
    copies step alike."""
    a, b = pair
    ga, gb = (getattr(a, "main_grad", None), getattr(b, "main_grad", None))
    if ga is None or gb is None:
        ga, gb = a.grad, b.grad
    if ga is None or gb is None:
        return
    total = ga + gb
    ga.copy_(total)
    gb.copy_(total)
