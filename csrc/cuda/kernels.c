/* kernels.c - placeholder until the optimizer kernels land (being written now). */
#include "internal.h"
#define NOT_YET return ZB_FAIL(ZB_ERR_UNSUPPORTED, "kernel not written yet")
zb_status_t zb__cuda_sq_norm(zb__cuda_t *cu, zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq,
                             int32_t *nonfinite) { NOT_YET; }
zb_status_t zb__cuda_unscale(zb__cuda_t *cu, zb_dtype_t dtype, const zb_tensor_list_t *t, float factor,
                             int32_t *nonfinite) { NOT_YET; }
zb_status_t zb__cuda_scale_update(zb__cuda_t *cu, float *scale, int32_t *tracker, const int32_t *nonfinite,
                                  double growth, double backoff, int32_t interval) { NOT_YET; }
zb_status_t zb__cuda_optim_step(zb__cuda_t *cu, const zb_optim_step_t *s) { NOT_YET; }
zb_status_t zb__cuda_optim_undo(zb__cuda_t *cu, const zb_optim_step_t *s) { NOT_YET; }
