/*
 * refmodel.h - the reference model: a stack of Linear-GELU-Linear blocks with residuals and a
 * mean-squared-error loss, split into S stages, with real F, B and W on the host backend.
 *
 * What it is for: testing and benchmarking the runtime without Python (zbpp verify, zbpp bench, the
 * C tests). One instance holds the parameters of the stages one rank owns; every stage's parameters
 * are initialised from (seed, stage) only, so any partition of the stages over ranks starts from
 * the same weights as a single instance holding them all.
 *
 * Per block, with x [rows, d], W1 [f, d], b1 [f], W2 [d, f], b2 [d] (row-major, y = x W^T + b as
 * torch.nn.Linear computes it):
 *   h = x W1^T + b1,  a = gelu(h) (tanh form),  y = x + a W2^T + b2
 * B (input gradient only; never touches a weight gradient), given dy:
 *   da = dy W2,  dh = da * gelu'(h),  dx = dy + dh W1
 * and pushes to the W store, in this order: {x = a, dy = dy -> dW2, db2} then {x = x, dy = dh -> dW1,
 * db1}; blocks of a stage are visited last to first. The loss on the last stage is
 *   L_i = mean((y - t)^2) over rows*d elements,  loss = (1/m) sum_i L_i
 * and its gradient, times the loss scale, is what the last stage's B starts from. The input and the
 * target of microbatch i at step k are pseudo-random from (seed, k, i).
 *
 * Lifetimes: the tensors a W-store entry points at (a, dy, x, dh of one block, stage, microbatch)
 * live in the model's own slots; they are handed back through the store's release callback
 * (zb__refmodel_release, with the model as user). F refuses to reuse a slot whose entries are still
 * pending, so a lifetime bug shows up as an error, not as silently wrong gradients.
 */
#ifndef ZB_RUNTIME_REFMODEL_H
#define ZB_RUNTIME_REFMODEL_H

#include <stddef.h>
#include <stdint.h>

#include "zbpp.h"

typedef struct {
  int32_t stages;       /* S, all stages of the model */
  int32_t layers;       /* blocks per stage, >= 1 */
  int32_t width;        /* d */
  int32_t ffn;          /* f, the hidden size of a block */
  int32_t rows;         /* tokens per microbatch */
  int32_t microbatches; /* m */
  uint64_t seed;
} zb__refmodel_config_t;

typedef struct zb__refmodel zb__refmodel_t;

/* A model instance for the stages in own_stages[0..n_own) (any order, each in 0..S-1). W-store
 * entries go to `wstore`, which must have been created with zb__refmodel_release as release
 * callback and this model as its user: call zb__refmodel_create with wstore = NULL first, create
 * the store with the model as user, then zb__refmodel_set_wstore. */
zb_status_t zb__refmodel_create(zb__refmodel_t **out, const zb__refmodel_config_t *cfg,
                                const int32_t *own_stages, int32_t n_own);
void zb__refmodel_set_wstore(zb__refmodel_t *model, zb_wstore_t *wstore);
/* Destroy (or clear) the W store first: its pending entries point into the model's buffers and its
 * release callback calls into the model. One thread drives an instance, and the store must release
 * on that thread. */
void zb__refmodel_destroy(zb__refmodel_t *model);

/* Bytes of the activation between two stages (rows * width * 4). */
int64_t zb__refmodel_boundary_bytes(const zb__refmodel_config_t *cfg);

/* Starts step `step`: zeroes the owned stages' gradients and the loss sums; B of the last stage
 * multiplies the loss gradient by loss_scale. */
void zb__refmodel_begin_step(zb__refmodel_t *model, int32_t step, float loss_scale);

/* zb_forward_cb / zb_backward_cb with the model as user. */
zb_status_t zb__refmodel_forward(void *model, int32_t stage, int32_t mb, const void *input,
                                 void *output);
zb_status_t zb__refmodel_backward(void *model, int32_t stage, int32_t mb, const void *grad_output,
                                  void *grad_input);
/* zb_wgrad_release_cb with the model as user. */
zb_status_t zb__refmodel_release(void *model, uint64_t token, int32_t ran);

/* PipeOffload on the model (a zb_copy_cb with the model as user; the runner's copy thread may call
 * it while the rank's thread computes): OFFLOAD copies (stage, mb)'s activations out to a host
 * buffer of the slot's own, poisons the slot buffer with NaN and gives it back to the pool; RELOAD
 * takes a pool buffer and copies them back. A backward of an offloaded slot fails. */
zb_status_t zb__refmodel_copy(void *model, int32_t type, int32_t stage, int32_t mb);
/* Slot buffers allocated on the device side and host copies allocated, since creation: both are
 * recycled through pools, so these are the most resident and the most offloaded at once. */
void zb__refmodel_memory(zb__refmodel_t *model, int64_t *resident, int64_t *hosted);

/* The mean loss of the current step, (1/m) sum_i L_i summed in microbatch order; valid on the
 * instance owning the last stage after all its forwards ran (NaN elsewhere). */
double zb__refmodel_loss(const zb__refmodel_t *model);
/* A stage's parameters and gradients as one flat fp32 array each (n values); the stage must be
 * owned. The layout is the same in every instance. */
zb_status_t zb__refmodel_stage_params(zb__refmodel_t *model, int32_t stage, float **param,
                                      float **grad, int64_t *n);
/* Entries pushed to the W store whose release has not come back yet (0 after a clean iteration). */
int64_t zb__refmodel_pending_saves(const zb__refmodel_t *model);

#endif /* ZB_RUNTIME_REFMODEL_H */
