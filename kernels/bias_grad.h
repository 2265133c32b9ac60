/*
 * bias_grad.h - the bias gradient of the W store's entries: db[c] (+)= sum over rows r of dy[r, c].
 *
 * What it is: the launcher's params struct and its extern "C" prototype, includable from C11 (the
 * CUDA backend's gemm.c) and from the .cu that defines it. What it is not: a GEMM epilogue; it is a
 * separate launch after the weight GEMM on the same stream, so its sums are deterministic and do
 * not depend on which cuBLASLt algorithm was picked.
 */
#ifndef ZB_KERNELS_BIAS_GRAD_H
#define ZB_KERNELS_BIAS_GRAD_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "zbpp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Hidden even in builds without CMake's visibility preset (the same definition as launch.h's). */
#ifndef ZB__LAUNCH_API
#if defined(__GNUC__)
#define ZB__LAUNCH_API __attribute__((visibility("hidden")))
#else
#define ZB__LAUNCH_API
#endif
#endif

typedef struct {
  const void *dy;      /* [rows, cols] row-major, leading dimension ldy, in dy_dtype (device memory) */
  int64_t rows, cols;  /* rows >= 1, 1 <= cols <= 2^31 - 1 */
  int64_t ldy;         /* >= cols */
  zb_dtype_t dy_dtype; /* ZB_DTYPE_F32, ZB_DTYPE_F16 or ZB_DTYPE_BF16 */
  void *db;            /* [cols], dense, in db_dtype (device memory) */
  zb_dtype_t db_dtype; /* ZB_DTYPE_F32 or dy_dtype */
  int32_t accumulate;  /* 1: db += sums (the old value is widened, added in fp32, rounded once); 0: db = sums */
} zb__bias_grad_params_t;

/* Enqueues the bias gradient on `stream`. Every column is summed in fp32 in one fixed order (row
 * lanes in a fixed interleave, then the lanes in index order), so the same inputs give the same bits
 * on every run. Returns the cudaError_t of the launch as an int (0: cudaSuccess); does not block. */
ZB__LAUNCH_API int zb_launch_bias_grad(const zb__bias_grad_params_t *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* ZB_KERNELS_BIAS_GRAD_H */
