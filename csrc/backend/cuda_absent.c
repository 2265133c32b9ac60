/*
 * cuda_absent.c - the CUDA entry points of zbpp.h in a build without nvcc.
 *
 * The ABI is the same with and without CUDA (the binding and the exported-symbol test rely on it),
 * so these exist everywhere and say why they cannot work. Builds with CUDA compile csrc/cuda/
 * instead and leave this file empty.
 */
#ifndef ZB_HAVE_CUDA
#include "internal.h"

#define ZB__NO_CUDA(what)                                                                          \
  ZB_FAIL(ZB_ERR_UNSUPPORTED,                                                                      \
          "%s: this libzbpp was built without CUDA (CMake found no nvcc); rebuild with "           \
          "CMAKE_CUDA_COMPILER set, e.g. /usr/local/cuda/bin/nvcc",                                \
          what)

int zb_cuda_built(void) { return 0; }

zb_status_t zb_cuda_device_count(int32_t *out) {
  ZB_ARG_NOT_NULL(out);
  *out = 0;
  return ZB_OK;
}

zb_status_t zb_backend_create_cuda(zb_backend_t **out, const zb_cuda_backend_config_t *config) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  return ZB__NO_CUDA("zb_backend_create_cuda");
}

zb_status_t zb_nccl_unique_id(uint8_t out[ZB_NCCL_UNIQUE_ID_BYTES]) {
  return ZB__NO_CUDA("zb_nccl_unique_id");
}

zb_status_t zb_transport_create_nccl(zb_transport_t **out, const zb_nccl_transport_config_t *config) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  return ZB__NO_CUDA("zb_transport_create_nccl");
}

zb_status_t zb_transport_create_nccl_group(zb_transport_t **out, const zb_nccl_group_config_t *config) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  (void)config;
  return ZB__NO_CUDA("zb_transport_create_nccl_group");
}
#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int zb__cuda_absent_unused_t;
#endif
