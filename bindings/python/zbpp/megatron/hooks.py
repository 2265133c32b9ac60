"""Megatron's hooks around a training pass: no_sync / grad_sync / param_sync, finalize_model_grads,
loss dicts where train_step reads them, and the reference fork's optimizer= call.

Gradient reduction. Megatron's DDP adds each microbatch's gradient into main_grad from a backward
hook and, with --overlap-grad-reduce, starts a bucket's reduction once every parameter of the bucket
is ready in the last microbatch. Under zbpp a split layer's gradient arrives at its W, after its B
(and so after the hook), so hooks must not start reductions: no_sync_func stays entered for the whole
pass, and a chunk's reduction is started with grad_sync_func (or the DDP chunk's start_grad_sync when
overlap is on and no grad_sync_func was given) after the chunk's last W has run. finalize_model_grads
then waits for it (finish_grad_sync), as in Megatron.
"""

import contextlib
import inspect

import torch.distributed as dist

from ..distributed import global_rank
from .placement import _device_of, _wrapped_attr
from .vmodel import sum_tied_grads, tied_pair


def _per_chunk(fn, n):
    if fn is None:
        return [None] * n
    if isinstance(fn, (list, tuple)):
        if len(fn) != n:
            raise ValueError(f"zbpp.megatron: {len(fn)} functions in a per-chunk config hook for {n} model chunks")
        return list(fn)
    return [fn] * n


def _overlapped(chunk):
    ddp_config = _wrapped_attr(chunk, "ddp_config")
    return bool(getattr(ddp_config, "overlap_grad_reduce", False))


class GradSync:
    """Holds Megatron's no_sync for a pass and starts each chunk's gradient reduction once (see the
    module docstring). Use as a context manager around the pass; call start(c) when chunk c's last
    weight gradient is in main_grad; leaving starts the chunks not started yet."""

    def __init__(self, config, chunks):
        self.chunks = chunks
        self.no_sync = getattr(config, "no_sync_func", None)
        self.grad_sync = _per_chunk(getattr(config, "grad_sync_func", None), len(chunks))
        self.started = set()
        self._stack = None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        fns = self.no_sync if isinstance(self.no_sync, (list, tuple)) else ([self.no_sync] if self.no_sync else [])
        for f in fns:
            self._stack.enter_context(f())
        return self

    def start(self, c):
        """Starts chunk c's reduction (asynchronous with overlap_grad_reduce)."""
        if c in self.started:
            return
        self.started.add(c)
        fn = self.grad_sync[c]
        if fn is not None:
            fn(self.chunks[c].parameters())
        elif _overlapped(self.chunks[c]) and hasattr(self.chunks[c], "start_grad_sync"):
            # Megatron would have started it from the hooks of the last microbatch; they ran under
            # no_sync here, so nothing was started, and finish_grad_sync insists something was.
            self.chunks[c].start_grad_sync()

    def __exit__(self, exc_type, exc, tb):
        stack, self._stack = self._stack, None
        stack.close()  # leave no_sync first: Megatron enables grad sync before its grad_sync_func
        if exc_type is None:
            for c in range(len(self.chunks)):
                self.start(c)
        return False


def param_sync(config, chunks):
    """config.param_sync_func for every chunk before the first forward, when there are several
    chunks (Megatron's interleaved schedule calls it; its one-chunk schedule leaves it to the DDP
    forward pre-hooks)."""
    fns = _per_chunk(getattr(config, "param_sync_func", None), len(chunks))
    if len(chunks) < 2:
        return
    for fn, chunk in zip(fns, chunks):
        if fn is not None:
            fn(chunk.parameters())


def finalize(config, chunks, call, kwargs, layout):
    """config.finalize_model_grads_func(model, num_tokens, ...) as Megatron calls it after the
    backwards, with what a V placement changes:
    - num_tokens: Megatron broadcasts the total from the last pipeline rank, but under V the loss
      stage is on the first; zbpp broadcasts it from the loss stage's rank first, so every rank
      passes the true total;
    - tied embeddings with both ends on this rank: the two copies' gradients are summed here, where
      Megatron's embedding all-reduce (a group of this rank alone under V) sums nothing; the sum
      comes after the data-parallel reduction and before the per-token scaling, Megatron's order.
    """
    num_tokens = call.total_tokens if call.per_token else None
    if num_tokens is not None and layout.p > 1 and layout.loss_rank != layout.p - 1:
        device = _device_of(chunks)
        t = num_tokens.to(device)
        dist.broadcast(t, src=global_rank(layout.group, layout.loss_rank), group=layout.group)
        num_tokens = t
    pair = tied_pair(chunks, layout.stage_of, layout.S)
    fn = getattr(config, "finalize_model_grads_func", None)
    if fn is None:
        if pair is not None:
            sum_tied_grads(pair)
        return
    restore = []
    done = []
    if pair is not None and num_tokens is not None:
        # Megatron scales by 1/num_tokens at the end of finalize_model_grads: sum just before.
        for chunk in chunks:
            original = getattr(chunk, "scale_gradients", None)
            if original is None:
                continue

            def scale(factor, _original=original):
                if not done:
                    sum_tied_grads(pair)
                    done.append(True)
                return _original(factor)

            chunk.scale_gradients = scale
            restore.append(chunk)
    try:
        _call_finalize(fn, chunks, num_tokens, kwargs)
    finally:
        for chunk in restore:
            del chunk.scale_gradients  # the instance attribute; the method shows through again
    if pair is not None and not done:
        sum_tied_grads(pair)


def _call_finalize(fn, chunks, num_tokens, kwargs):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        fn(chunks, num_tokens)
        return
    kinds = [prm.kind for prm in params.values()]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                     for k in kinds)
    var_kw = inspect.Parameter.VAR_KEYWORD in kinds
    args = [chunks]
    if positional >= 2 or inspect.Parameter.VAR_POSITIONAL in kinds:
        args.append(num_tokens)
    extra = {}
    for name in ("pg_collection", "force_all_reduce"):
        if kwargs.get(name) is not None and (name in params or var_kw):
            extra[name] = kwargs[name]
    fn(*args, **extra)


def forward_losses(store, layout):
    """The loss dicts for this rank to return. Megatron's train_step and evaluate read them on the
    last pipeline rank (is_pipeline_last_stage()); under V the loss stage is on the first, so its
    rank sends them there. Both ranks return them; the others get []."""
    p, rank, loss_rank = layout.p, layout.rank, layout.loss_rank
    last = p - 1
    if p == 1 or loss_rank == last:
        return store if rank == loss_rank else []
    if rank == loss_rank:
        dist.send_object_list([store], dst=global_rank(layout.group, last), group=layout.group)
        return store
    if rank == last:
        box = [None]
        dist.recv_object_list(box, src=global_rank(layout.group, loss_rank), group=layout.group)
        return box[0]
    return []


def optimizer_step(optimizer, pipeline_rank, pipeline_size):
    """The reference fork's second call of a step, forward_backward_func(..., optimizer=optimizer),
    which replaces optimizer.step() and returns (update_successful, grad_norm, rolled_back).

    - The fork's optimizer with post-validation on (its train_step called optimizer.pre_step(), which
      stepped speculatively and sent the partial inf flag and norm down the pipeline): zbpp finishes
      the fork's protocol in its order: each rank but the last receives the fully reduced state from
      the next rank, each rank but the first sends it on to the previous one, then every rank calls
      post_validation(), which keeps, redoes or rolls back its step. The fork overlaps this with the
      next iteration's first forwards; zbpp runs it at once, with the same results.
    - zbpp.PostValidatedOptimizer (a torch optimizer under zbpp's post-validation; build it with
      PostValidatedOptimizer.for_schedule(opt, zbpp.megatron.current_schedule())): its step(), as
      (not skipped, grad_norm, rolled_back).
    - Any other optimizer (stock Megatron's MegatronOptimizer.step() -> (update_successful, grad_norm,
      num_zeros_in_grad)): the step runs here, synchronously; its inf check and norm are Megatron's
      global reductions, so nothing is rolled back (the third value is False)."""
    if hasattr(optimizer, "post_validation") and getattr(optimizer, "post_validation_enabled", False):
        if pipeline_rank != pipeline_size - 1:
            optimizer.recv_post_validation()
        if pipeline_rank != 0:
            optimizer.send_post_validation()
        result = optimizer.post_validation(lambda: None)
        return result[0], result[1], result[2]
    from ..optim import PostValidatedOptimizer
    if isinstance(optimizer, PostValidatedOptimizer):
        # zbpp's own post-validation (torch optimizers): speculative step, exact rollback.
        r = optimizer.step()
        return not r.skipped, r.grad_norm, r.rolled_back
    step = getattr(optimizer, "step", None)
    if step is None:
        raise TypeError(f"zbpp.megatron: optimizer= must be an optimizer with step(), got {type(optimizer).__name__}")
    result = step()
    if isinstance(result, tuple) and len(result) >= 2:
        return bool(result[0]), result[1], False
    return True, None, False
