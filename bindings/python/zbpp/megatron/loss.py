"""One forward-backward call's state: Megatron's forward_step_func per chunk and microbatch, and
Megatron's loss rules (forward_step_calc_loss), shared by the runner's callbacks and evaluation."""

import contextlib

import torch

from .placement import _as_pipeline_rank, _virtual_rank, _wrapped_attr

# ---- one call's state, shared by the runner's callbacks and the forward-only pass --------------------

class _Call:
    def __init__(self, forward_step_func, iterators, chunks, ps, config, m, cp_size, collect, loop_ranks=None,
                 first_val_step=None, forward_only=False):
        self.forward_step_func, self.iterators, self.chunks, self.ps = forward_step_func, iterators, chunks, ps
        self.m, self.cp_size, self.collect = m, cp_size, collect
        # Per chunk: the pipeline rank Megatron is told while the chunk runs (V chunk 1), or None.
        self.loop_ranks = loop_ranks or [None] * len(chunks)
        self.autocast = getattr(config, "enable_autocast", False)
        self.autocast_dtype = getattr(config, "autocast_dtype", None)
        # Megatron's check_first_val_step: evaluation may say microbatch 0 is not a first one.
        self.first_flag = not (first_val_step is not None and forward_only and not first_val_step)
        self.per_token = bool(getattr(config, "calculate_per_token_loss", False))
        self.grad_scale_func = getattr(config, "grad_scale_func", None)
        self.next_mb = [0] * len(chunks)
        self.loss_funcs = {}
        self.store = [None] * m
        self.total_tokens = torch.zeros([], dtype=torch.int)

    def forward(self, c, i, x):
        """Runs forward_step_func on chunk c for microbatch i with input x (None on stage 0)."""
        # forward_step_func reads the next item of the chunk's iterator, so the microbatches of a
        # chunk must come in order; zbpp's schedules run them so, and this says it if one did not.
        if i != self.next_mb[c]:
            raise RuntimeError(f"zbpp.megatron: the schedule ran microbatch {i} of model chunk {c} before "
                               f"microbatch {self.next_mb[c]}; Megatron's data iterators need them in order")
        self.next_mb[c] += 1
        chunk = self.chunks[c]
        set_input_tensor = _wrapped_attr(chunk, "set_input_tensor")
        if set_input_tensor is not None:
            set_input_tensor([x])
        elif x is not None:
            raise TypeError(f"zbpp.megatron: model chunk {c} ({type(chunk).__name__}) has no set_input_tensor, "
                            "so it cannot take the previous stage's activation; Megatron's models have it")
        # Megatron's forward_step hooks: TE's first-microbatch caching, the layers' microbatch index.
        if i == 0 and self.first_flag and hasattr(chunk, "set_is_first_microbatch"):
            chunk.set_is_first_microbatch()
        _set_current_microbatch(chunk, i)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_virtual_rank(self.ps, c, len(self.chunks)))
            stack.enter_context(_as_pipeline_rank(self.ps, self.loop_ranks[c]))
            if self.autocast:
                device = next((prm.device.type for prm in chunk.parameters()), "cpu")
                stack.enter_context(torch.autocast(device, dtype=self.autocast_dtype))
            result = self.forward_step_func(self.iterators[c], chunk)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError("zbpp.megatron: forward_step_func must return (output_tensor, loss_func), got "
                            f"{type(result).__name__}")
        return result

    def loss(self, i, out, loss_func):
        """The loss to differentiate for microbatch i (Megatron's forward_step_calc_loss rule); stores
        what the call returns for it."""
        outputs = loss_func(out)
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
            raise TypeError("zbpp.megatron: loss_func must return (loss, reduced_dict) or (loss, num_tokens, "
                            f"reduced_dict), got {type(outputs).__name__}")
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            num_tokens = torch.as_tensor(num_tokens)
            self.total_tokens = self.total_tokens + num_tokens.to(self.total_tokens.dtype).reshape([])
            if not self.per_token:
                loss = loss / torch.clamp(num_tokens, min=1)
                loss = loss / self.m
        else:
            loss, reduced = outputs
            if self.cp_size != 1:
                loss = loss * self.cp_size
            loss = loss / self.m
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"zbpp.megatron: loss_func returned a {type(loss).__name__} loss; it must be a tensor")
        self.store[i] = reduced
        return loss

    def finish_forward_only(self, i, out, loss_func):
        if loss_func is None:
            self.store[i] = out  # Megatron keeps the output when there is no loss function
        elif self.collect:
            self.store[i] = loss_func(out, non_loss_data=True)
        else:
            self.loss(i, out, loss_func)


def _set_current_microbatch(chunk, i):
    """Megatron's set_current_microbatch: every decoder layer learns the microbatch index."""
    decoder = _wrapped_attr(chunk, "decoder")
    for layer in getattr(decoder, "layers", None) or ():
        layer.current_microbatch = i
