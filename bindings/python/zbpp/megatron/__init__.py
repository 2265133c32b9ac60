"""Megatron-LM drop-in: zbpp's schedules behind Megatron's `get_forward_backward_func()`.

What this is: `forward_backward_func`, a function with the keyword-only signature of the one
`megatron.core.pipeline_parallel.get_forward_backward_func()` returns, whose training pass is
run by the C runner with a zbpp schedule (1F1B, interleaved 1F1B, ZB-H1/H2, ZB-V, V-Half, V-Min
or the automatic zero-bubble scheduler); `patch()` installs it where Megatron looks the function
up, so `train_step` and `evaluate` use it unchanged. docs/megatron.md has the
recipes for Megatron's training script (core >= 0.18: `parse_and_validate_args`; older:
`pretrain(extra_args_provider=...)`).

Zero bubble needs the weight gradients split off: `zbpp.split_linear(chunk)` splits Megatron's
ColumnParallelLinear / RowParallelLinear (and torch's Linear); `zbpp.split_report(chunk)` says
what was split and why the rest was not. Unsplit layers run their weight gradients inside B.

Semantics follow Megatron's schedules.py: `forward_step_func(data_iterator, model_chunk)` returns
`(output_tensor, loss_func)`; the loss stage's `loss_func(output_tensor)` returns `(loss,
reduced_dict)`, whose loss is multiplied by the context-parallel size and divided by
num_microbatches (megatron-core 0.16's rule), or `(loss, num_tokens, reduced_dict)`, whose loss
is divided by max(num_tokens, 1) and then by num_microbatches unless
`config.calculate_per_token_loss` is set (then the summed num_tokens go to
`config.finalize_model_grads_func`, which divides the gradients). `config.grad_scale_func` scales
the loss before backward; `enable_autocast`/`autocast_dtype`, `set_is_first_microbatch` and the
layers' `current_microbatch` are honoured as in Megatron's forward_step. Non-first stages receive
their input through `model_chunk.set_input_tensor([tensor])`. The call returns the per-microbatch
reduced dicts on the rank holding the loss stage and on the last pipeline rank (where train_step
and evaluate read them; under V they differ), `[]` elsewhere.

Placement: pipeline rank r of p holds its model chunks as stages. Loop schedules: chunk c is stage
c*p + r (Megatron's virtual pipeline layout). V schedules (zb-v, v-half, v-min, and zb-auto with
two chunks): chunk 0 is stage r, chunk 1 is stage 2p-1-r, so rank 0 holds the first and the last
stage. Build the chunks with `v_model_provider(model_provider)` and the embedding group with
`get_embedding_ranks=v_embedding_ranks` (vmodel.py); while a V chunk runs, Megatron's
parallel_state answers as the stage it is, so get_batch gives the loss stage its labels.

Gradient reduction (hooks.py): no_sync_func is held for the whole pass; each chunk's reduction
starts (grad_sync_func, or start_grad_sync with --overlap-grad-reduce) once its last B and all its
W passes have run, overlapping the rest of the pass; param_sync_func runs for every chunk before
the first forward when there are several; finalize_model_grads_func follows, with the per-token
count and tied embeddings right under V.

Schedule from the flags (read from `megatron.training.get_args()`, or from `configure(args=...)`):
    --zero-bubble-v-schedule                  zb-v; with --zero-bubble-v-schedule-mem-setup
                                              half / min: v-half / v-min (memory p/2, p/3)
    --enable-zero-bubble                      zb-auto (the automatic scheduler) with memory limit
                                              --zero-bubble-max-pending-backward N microbatches
                                              ("auto": measured on GPUs by the first step, between
                                              p and 2p, and planned for in place; p on CPUs)
    none                                      1f1b (one chunk per rank) or interleaved-1f1b
`configure(kind=...)` overrides the choice with any zbpp kind name. The zero-bubble kinds are
planned again from the costs measured in the training iterations
--zero-bubble-pipeline-timers-start-iter to -end-iter (default 2 to 3; the reference fork's 100 to
110) and run the new plan from the next one (zbpp.pipelining's plans from measured costs;
`configure(plan_from_measured=False)` or ZBPP_PLAN_FROM_MEASURED=0 turns it off). The reference
fork's other flags are accepted where they change nothing and refused by name where they select
something zbpp does not run (1F1B-V, seq1F1B, grouped interleaving). PipeOffload's flags
(--cpu-offload, --offload-chunk-num, --offload-time, --auto-offload-time, --offload-overlap-sr) turn
on zbpp's offload under any schedule (flags.offload says how each maps).

Vocabulary Parallelism (--enable-vocab-parallel, --disable-backward-fusion; vocab.py): build the
model with `vocab_model_provider(model_provider)` (outside v_model_provider for V); the word
embedding and output layer are then split over every pipeline rank, their passes placed in the
schedule, and the caller's loss_func runs on the per-token losses. `vocab_parallel_of(model)`
gives the split layers (gather() for the whole weights).

The reference fork's train_step calls `forward_backward_func(..., optimizer=optimizer)` after the
pass with --enable-optimizer-post-validation: zbpp finishes the fork's post-validation protocol
with the fork's optimizer, or steps a stock optimizer, and returns (update_successful, grad_norm,
rolled_back).

Forward only (evaluation) runs in Python: each rank goes through its stages in stage order and,
for each, through the microbatches in order, receiving a stage's input from the rank holding the
stage before it and sending its output on. No gradients are touched.

Not supported (a clear error, not a silent difference): variable_seq_lengths, MoE auxiliary and MTP
loss scaling, adjust_tensor_shapes_fn, a caller's p2p_communicator, and the config fields in
run.py's _REFUSED_FIELDS (partial activation checkpointing, defer_embedding_wgrad_compute, MoE
expert-parallel overlap, CUDA graphs, activation offloading). Ignored: decoder_seq_length,
config.timers.

One module per concern: flags (the flags and the schedule they choose), placement (Megatron's
pipeline state, stage placement, the gloo side group), vmodel (V chunks on stock Megatron), loss
(Megatron's loss rules for one call), hooks (grad/param sync, finalize, loss dicts, optimizer=),
memory (the measured memory limit), run (the forward-backward function and its schedule), evaluate
(forward-only passes), layers (split backward for Megatron's linears), patching (installing it in
Megatron), vocab (Vocabulary Parallelism: the model's split layers and the hooks into them).
"""

from .flags import Options, add_arguments, configure, options, schedule_for
from .patching import patch, unpatch
from .run import current_schedule, forward_backward_func, get_forward_backward_func, reset
from .vmodel import v_embedding_ranks, v_model_provider
from .vocab import vocab_model_provider, vocab_parallel_of

__all__ = ["Options", "add_arguments", "configure", "current_schedule", "forward_backward_func",
           "get_forward_backward_func", "options", "patch", "reset", "schedule_for", "unpatch",
           "v_embedding_ranks", "v_model_provider", "vocab_model_provider", "vocab_parallel_of"]
