/* gemm.c - placeholder until the cuBLASLt W GEMMs land (being written now). */
#include "internal.h"
zb_status_t zb__wgemm_run(zb__cuda_t *cu, const zb_wgrad_t *e) {
  return ZB_FAIL(ZB_ERR_UNSUPPORTED, "cuBLASLt GEMMs not written yet");
}
void zb__wgemm_destroy(zb__cuda_t *cu) {}
