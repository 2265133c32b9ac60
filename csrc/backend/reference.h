/*
 * reference.h - the host references of the optimizer kernels (kernels/, one .cu per kernel). Private to the library.
 *
 * What this is: plain C, written once, that the host backend runs for zb_sq_norm, zb_unscale,
 * zb_loss_scale_update, zb_optim_step and zb_optim_undo, that zb_optimizer's update formulas call,
 * and that the GPU tests use as their oracle (fp32 results must match the kernels bit for bit, so
 * the per-element arithmetic here and in the kernels is the same sequence of IEEE operations, with
 * no contraction into fused multiply-adds). What it is not: fast.
 *
 * Arguments are checked by the public entry points (ops.c) before these run.
 */
#ifndef ZB_BACKEND_REFERENCE_H
#define ZB_BACKEND_REFERENCE_H

#include <stdint.h>

#include "zbpp.h"

/* Element i of a dtype array, widened to float. */
float zb__load_elem(const void *base, zb_dtype_t dtype, int64_t i);

void zb__ref_sq_norm(zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq, int32_t *nonfinite);
void zb__ref_unscale(zb_dtype_t dtype, const zb_tensor_list_t *t, float factor, int32_t *nonfinite);
void zb__ref_scale_update(float *scale, int32_t *tracker, const int32_t *nonfinite, double growth,
                          double backoff, int32_t interval);
void zb__ref_optim_step(const zb_optim_step_t *s);
void zb__ref_optim_undo(const zb_optim_step_t *s);

/* The per-step scalars of AdamW and SGD, computed on the host in double from the step count (as
 * torch computes them in Python) and rounded to float once; the kernels receive these. */
typedef struct {
  float lr, decay;           /* decay = 1 - lr * weight_decay (AdamW) */
  float b1, omb1, b2, omb2;  /* beta1, 1 - beta1, beta2, 1 - beta2 */
  float step_size, bc2_sqrt; /* lr / (1 - beta1^t), sqrt(1 - beta2^t) */
  float eps, wd, momentum;
  int32_t first;             /* t == 1 (SGD's momentum buffer starts as the gradient) */
} zb__optim_scalars_t;
zb__optim_scalars_t zb__optim_scalars(const zb_optim_step_t *s);
/* Blocks of state per parameter element: 2 for AdamW, 1 for SGD with momentum, 0 for plain SGD.
 * The undo buffer holds 1 + this many blocks (launch.h describes its layout). */
int zb__optim_nstate(const zb_optim_step_t *s);

#endif /* ZB_BACKEND_REFERENCE_H */
