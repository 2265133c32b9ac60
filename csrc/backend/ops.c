/* ops.c - placeholder until the public optimizer-kernel entry points land (being written now). */
#include "internal.h"
zb_status_t zb_sq_norm(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq,
                       int32_t *nonfinite) { return ZB_ERR_UNSUPPORTED; }
zb_status_t zb_unscale(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t, float factor,
                       int32_t *nonfinite) { return ZB_ERR_UNSUPPORTED; }
zb_status_t zb_loss_scale_update(zb_backend_t *be, float *scale, int32_t *tracker, const int32_t *nonfinite,
                                 double growth, double backoff, int32_t interval) { return ZB_ERR_UNSUPPORTED; }
zb_status_t zb_optim_undo_bytes(const zb_optim_step_t *s, size_t *out) { return ZB_ERR_UNSUPPORTED; }
zb_status_t zb_optim_step(zb_backend_t *be, const zb_optim_step_t *s) { return ZB_ERR_UNSUPPORTED; }
zb_status_t zb_optim_undo(zb_backend_t *be, const zb_optim_step_t *s) { return ZB_ERR_UNSUPPORTED; }
