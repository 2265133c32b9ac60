"""Megatron-LM drop-in: zbpp's schedules behind Megatron's `get_forward_backward_func()`.

What this is: `forward_backward_func`, a function with the keyword-only signature of the one
`megatron.core.pipeline_parallel.get_forward_backward_func()` returns, whose training pass is
run by the C runner with a zbpp schedule (1F1B, interleaved 1F1B, ZB-H1/H2, ZB-V, V-Half, V-Min
or the automatic zero-bubble scheduler); `patch()` installs it where Megatron looks the function
up, so `train_step` and `evaluate` use it unchanged:

    import zbpp.megatron
    zbpp.megatron.patch()                                   # after Megatron is importable
    pretrain(..., extra_args_provider=zbpp.megatron.add_arguments)  # the reference fork's flags

Semantics follow Megatron's schedules.py: `forward_step_func(data_iterator, model_chunk)` returns
`(output_tensor, loss_func)`; the loss stage's `loss_func(output_tensor)` returns `(loss,
reduced_dict)`, whose loss is divided by num_microbatches before backward, or `(loss, num_tokens,
reduced_dict)`, whose loss is divided by max(num_tokens, 1) and then by num_microbatches unless
`config.calculate_per_token_loss` is set (then it is left as is and the summed num_tokens go to
`config.finalize_model_grads_func`, which divides the gradients). `config.grad_scale_func` scales
the loss before backward. Non-first stages receive their input through
`model_chunk.set_input_tensor([tensor])` (a one-element list, as Megatron passes it; the first
stage gets `[None]`). The call returns the per-microbatch reduced dicts on the rank holding the
last stage and `[]` elsewhere. Gradients are not scaled by zbpp.

Placement: pipeline rank r of p holds its model chunks as stages. Loop schedules: chunk c is stage
c*p + r (Megatron's virtual pipeline layout). V schedules (zb-v, v-half, v-min, and zb-auto with
two chunks): chunk 0 is stage r, chunk 1 is stage 2p-1-r, so rank 0 holds the first and the last
stage; the model chunks must be built in that order.

Schedule from the flags (read from `megatron.training.get_args()`, or from `configure(args=...)`):
    --zero-bubble-v-schedule                  zb-v; with --zero-bubble-v-schedule-mem-setup
                                              half / min: v-half / v-min (memory p/2, p/3)
    --enable-zero-bubble                      zb-auto (the automatic scheduler; at 1F1B's memory its
                                              schedules simulate no longer than ZB-H1's) with memory
                                              limit --zero-bubble-max-pending-backward N microbatches
                                              ("auto": p, the peak of 1F1B and ZB-H1)
    none                                      1f1b (one chunk per rank) or interleaved-1f1b
`configure(kind=...)` overrides the choice with any zbpp kind name.

Forward only (evaluation): the C runner always runs backwards, so forward_only=True runs in Python:
each rank goes through its stages in stage order and, for each, through the microbatches in order,
receiving a stage's input from the rank holding the stage before it (torch.distributed irecv) and
sending its output on (isend). No gradients are touched, nothing waits for a backward, and the
pipeline still overlaps (stage s+1 starts as soon as microbatch 0 arrives); it reuses the
forward_step_func path of training, so both see the same inputs.

What this is not: Megatron. It does not build models, split layers, reduce gradients across data
parallel ranks (`config.finalize_model_grads_func` does that, as in Megatron) or step optimizers
(--enable-optimizer-post-validation is only read here and exposed as `options()`' value; the
optimizer wrapper lives in zbpp.optim). Split the backward of a chunk's Linear layers with
`zbpp.split_linear(chunk)` to get zero-bubble W passes; unsplit layers run their weight gradients
in B. Not supported (a clear error, not a silent difference): variable_seq_lengths, MoE auxiliary
and MTP loss scaling, adjust_tensor_shapes_fn, a caller's p2p_communicator. Ignored:
decoder_seq_length, first_val_step, config.timers, overlap of gradient reduction with backward
(grad_sync_func / param_sync_func are not called; finalize_model_grads_func reduces at the end).

One module per concern: flags (the zero-bubble flags and the schedule they choose), placement
(Megatron's pipeline state, stage placement), loss (Megatron's loss rules for one call), run (the
forward-backward function and its schedule), evaluate (forward-only passes), patching (installing it
in Megatron).
"""

from .flags import Options, add_arguments, configure, options, schedule_for
from .patching import patch, unpatch
from .run import current_schedule, forward_backward_func, get_forward_backward_func, reset
from .vmodel import v_embedding_ranks, v_model_provider

__all__ = ["Options", "add_arguments", "configure", "current_schedule", "forward_backward_func",
           "get_forward_backward_func", "options", "patch", "reset", "schedule_for", "unpatch",
           "v_embedding_ranks", "v_model_provider"]
