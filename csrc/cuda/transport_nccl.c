/* transport_nccl.c - placeholder (being written now). */
#include "internal.h"
zb_status_t zb_nccl_unique_id(uint8_t out[ZB_NCCL_UNIQUE_ID_BYTES]) { return ZB_ERR_UNSUPPORTED; }
zb_status_t zb_transport_create_nccl(zb_transport_t **out, const zb_nccl_transport_config_t *config) {
  return ZB_ERR_UNSUPPORTED;
}
