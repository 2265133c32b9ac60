/*
 * ops.c - the public entry points of the optimizer kernels (zbpp.h, "optimizer kernels"): every
 * argument is checked here, once, with a message that says what was wrong and what is allowed; then
 * the backend runs the work (host: reference.c, CUDA: csrc/cuda/kernels.c), which checks nothing.
 *
 * What this is not: a check of the memory itself. Whether a pointer is backend memory of the right
 * size cannot be seen from here; a host pointer handed to the CUDA backend fails in the kernel, as
 * an asynchronous CUDA error.
 */
#include <math.h>
#include <stdint.h>

#include "internal.h"
#include "reference.h"

/* The most elements one list may hold: the undo buffer (at most 12 bytes per element) and every
 * element index must fit their types with room to spare. */
static int64_t max_elems(void) {
  const uint64_t by_size = (uint64_t)(SIZE_MAX / 16), by_index = (uint64_t)(INT64_MAX / 16);
  return (int64_t)(by_size < by_index ? by_size : by_index);
}

static zb_status_t check_dtype(const char *fn, const char *what, zb_dtype_t dtype) {
  if (zb__dtype_size(dtype) == 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: %s is %d; allowed: ZB_DTYPE_F32 (0), ZB_DTYPE_F16 (1) or ZB_DTYPE_BF16 (2)",
                   fn, what, (int)dtype);
  return ZB_OK;
}

/* A list's own fields: count >= 0, the arrays present, numels >= 0, a pointer for every non-empty
 * tensor, and a total that fits. *total (may be NULL) gets the element count. */
static zb_status_t check_list(const char *fn, const char *name, const zb_tensor_list_t *l,
                              int64_t *total) {
  if (!l)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: %s is NULL; pass a zb_tensor_list_t (count 0 for none)",
                   fn, name);
  if (l->count < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: %s.count is %d; allowed: >= 0", fn, name,
                   (int)l->count);
  if (l->count > 0 && (!l->ptrs || !l->numels))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: %s.%s is NULL with count %d; ptrs and numels must each point at count values",
                   fn, name, l->ptrs ? "numels" : "ptrs", (int)l->count);
  const int64_t limit = max_elems();
  int64_t sum = 0;
  for (int32_t i = 0; i < l->count; i++) {
    const int64_t n = l->numels[i];
    if (n < 0)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: %s.numels[%d] is %lld; allowed: >= 0", fn, name,
                     (int)i, (long long)n);
    if (n > 0 && !l->ptrs[i])
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "%s: %s.ptrs[%d] is NULL with numels[%d] = %lld; only empty tensors may be NULL",
                     fn, name, (int)i, (int)i, (long long)n);
    if (n > limit - sum)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: %s holds more than %lld elements in all", fn,
                     name, (long long)limit);
    sum += n;
  }
  if (total) *total = sum;
  return ZB_OK;
}

/* A list the parameters pair with: one tensor per parameter, of the same length. */
static zb_status_t check_paired(const char *fn, const char *name, const zb_tensor_list_t *l,
                                const zb_tensor_list_t *params, const char *why) {
  ZB_CHECK(check_list(fn, name, l, NULL));
  if (l->count != params->count)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: %s.count is %d but params.count is %d; %s", fn,
                   name, (int)l->count, (int)params->count, why);
  for (int32_t i = 0; i < l->count; i++)
    if (l->numels[i] != params->numels[i])
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "%s: %s.numels[%d] is %lld but params.numels[%d] is %lld; each must match its "
                     "parameter",
                     fn, name, (int)i, (long long)l->numels[i], (int)i, (long long)params->numels[i]);
  return ZB_OK;
}

/* An unused state list must be empty, so that a list meant for another kind is not silently
 * ignored (and the undo buffer's size is what the caller expects). */
static zb_status_t check_unused(const char *fn, const char *name, const zb_tensor_list_t *l,
                                const char *kind) {
  ZB_CHECK(check_list(fn, name, l, NULL));
  if (l->count != 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: %s.count is %d but %s keeps no %s; set its count to 0",
                   fn, name, (int)l->count, kind, name);
  return ZB_OK;
}

/* What zb_optim_step, zb_optim_undo and zb_optim_undo_bytes all read: the struct's header, the
 * kind (and SGD's momentum, which decides whether state1 exists), params and the state lists.
 * *total gets the parameter elements. */
static zb_status_t check_optim_common(const char *fn, const zb_optim_step_t *s, int64_t *total) {
  if (!s) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: argument 'step' is NULL", fn);
  if (s->struct_size < sizeof(zb_optim_step_t) || s->version != ZB_OPTIM_STEP_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: zb_optim_step_t has struct_size %u and version %u; this library needs %zu and "
                   "%d (set struct_size = sizeof(zb_optim_step_t), version = ZB_OPTIM_STEP_VERSION)",
                   fn, (unsigned)s->struct_size, (unsigned)s->version, sizeof(zb_optim_step_t),
                   ZB_OPTIM_STEP_VERSION);
  if (s->kind != ZB_OPTIM_SGD && s->kind != ZB_OPTIM_ADAMW)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: kind is %d; allowed: ZB_OPTIM_SGD (0) or ZB_OPTIM_ADAMW (1)", fn, (int)s->kind);
  /* Comparisons are written so that NaN fails them. */
  if (s->kind == ZB_OPTIM_SGD && !(s->momentum >= 0 && s->momentum < 1))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: SGD momentum is %g; allowed: [0, 1)", fn, s->momentum);
  ZB_CHECK(check_list(fn, "params", &s->params, total));
  if (s->kind == ZB_OPTIM_ADAMW) {
    ZB_CHECK(check_paired(fn, "state1", &s->state1, &s->params,
                          "AdamW needs one exp_avg tensor (state1) per parameter"));
    return check_paired(fn, "state2", &s->state2, &s->params,
                        "AdamW needs one exp_avg_sq tensor (state2) per parameter");
  }
  if (s->momentum != 0) {
    ZB_CHECK(check_paired(fn, "state1", &s->state1, &s->params,
                          "SGD with momentum needs one momentum buffer (state1) per parameter"));
    return check_unused(fn, "state2", &s->state2, "SGD");
  }
  ZB_CHECK(check_unused(fn, "state1", &s->state1, "plain SGD (momentum 0)"));
  return check_unused(fn, "state2", &s->state2, "SGD");
}

/* The hyperparameters, with the same rules and words as zb_optimizer_create's, and what only a step
 * reads: the step number, the factor and the gradients. */
static zb_status_t check_optim_step(const char *fn, const zb_optim_step_t *s) {
  if (!(s->lr >= 0) || isinf(s->lr))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: lr is %g; allowed: a finite value >= 0", fn, s->lr);
  if (!(s->weight_decay >= 0) || isinf(s->weight_decay))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: weight_decay is %g; allowed: a finite value >= 0", fn,
                   s->weight_decay);
  if (s->kind == ZB_OPTIM_ADAMW) {
    if (!(s->beta1 >= 0 && s->beta1 < 1))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: AdamW beta1 is %g; allowed: [0, 1)", fn, s->beta1);
    if (!(s->beta2 >= 0 && s->beta2 < 1))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: AdamW beta2 is %g; allowed: [0, 1)", fn, s->beta2);
    if (!(s->eps > 0) || isinf(s->eps))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: AdamW eps is %g; allowed: a finite value > 0", fn,
                     s->eps);
  }
  if (s->step < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: step is %lld; allowed: >= 1 (the number of this step, 1 for the first)", fn,
                   (long long)s->step);
  if (!isfinite(s->factor))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: factor is %g; allowed: a finite value (1/loss_scale times the clipping "
                   "coefficient)",
                   fn, (double)s->factor);
  ZB_CHECK(check_dtype(fn, "grad_dtype", s->grad_dtype));
  return check_paired(fn, "grads", &s->grads, &s->params, "every parameter needs one gradient");
}

/* ---- the entry points ------------------------------------------------------------------------- */

zb_status_t zb_sq_norm(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *tensors,
                       double *sq_out, int32_t *nonfinite_out) {
  static const char fn[] = "zb_sq_norm";
  ZB_ARG_NOT_NULL(be);
  ZB_ARG_NOT_NULL(sq_out);
  ZB_ARG_NOT_NULL(nonfinite_out);
  ZB_CHECK(check_dtype(fn, "dtype", dtype));
  ZB_CHECK(check_list(fn, "tensors", tensors, NULL));
  return be->ops->sq_norm(be, dtype, tensors, sq_out, nonfinite_out);
}

zb_status_t zb_unscale(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *tensors,
                       float factor, int32_t *nonfinite_out) {
  static const char fn[] = "zb_unscale";
  ZB_ARG_NOT_NULL(be);
  ZB_ARG_NOT_NULL(nonfinite_out);
  ZB_CHECK(check_dtype(fn, "dtype", dtype));
  ZB_CHECK(check_list(fn, "tensors", tensors, NULL));
  if (!isfinite(factor))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: factor is %g; allowed: a finite value (1/loss_scale)",
                   fn, (double)factor);
  return be->ops->unscale(be, dtype, tensors, factor, nonfinite_out);
}

zb_status_t zb_loss_scale_update(zb_backend_t *be, float *scale, int32_t *growth_tracker,
                                 const int32_t *nonfinite, double growth, double backoff,
                                 int32_t growth_interval) {
  static const char fn[] = "zb_loss_scale_update";
  ZB_ARG_NOT_NULL(be);
  ZB_ARG_NOT_NULL(scale);
  ZB_ARG_NOT_NULL(growth_tracker);
  ZB_ARG_NOT_NULL(nonfinite);
  /* The same ranges as the loss scale of zb_optimizer_create and zb_postval_create, except that
   * the interval cannot be 0 here (there is no "never grow" without a caller to skip the call). */
  if (!(backoff > 0 && backoff <= 1))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: loss-scale backoff is %g; allowed: (0, 1]", fn, backoff);
  if (!(growth >= 1) || isinf(growth))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: loss-scale growth is %g; allowed: a finite value >= 1",
                   fn, growth);
  if (growth_interval < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: growth_interval is %d; allowed: >= 1", fn,
                   (int)growth_interval);
  return be->ops->scale_update(be, scale, growth_tracker, nonfinite, growth, backoff, growth_interval);
}

zb_status_t zb_optim_undo_bytes(const zb_optim_step_t *step, size_t *out) {
  static const char fn[] = "zb_optim_undo_bytes";
  ZB_ARG_NOT_NULL(out);
  *out = 0;
  int64_t total = 0;
  ZB_CHECK(check_optim_common(fn, step, &total));
  *out = (size_t)(1 + zb__optim_nstate(step)) * (size_t)total * sizeof(float);
  return ZB_OK;
}

zb_status_t zb_optim_step(zb_backend_t *be, const zb_optim_step_t *step) {
  static const char fn[] = "zb_optim_step";
  ZB_ARG_NOT_NULL(be);
  ZB_CHECK(check_optim_common(fn, step, NULL));
  ZB_CHECK(check_optim_step(fn, step));
  return be->ops->optim_step(be, step);
}

/* Only what the restore reads is checked: the gradients, the hyperparameters and the step number
 * may have changed since the step (the step's struct need not be kept unchanged). */
zb_status_t zb_optim_undo(zb_backend_t *be, const zb_optim_step_t *step) {
  static const char fn[] = "zb_optim_undo";
  ZB_ARG_NOT_NULL(be);
  int64_t total = 0;
  ZB_CHECK(check_optim_common(fn, step, &total));
  if (!step->undo && total > 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: step->undo is NULL; pass the buffer zb_optim_step saved into (of "
                   "zb_optim_undo_bytes bytes)",
                   fn);
  return be->ops->optim_undo(be, step);
}
