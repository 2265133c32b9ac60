/*
 * bias_grad.h - the bias gradient of the W store's entries: db[c] (+)= sum over rows r of dy[r, c].
 *
 * What it is: the kernel's params struct and launch shape, includable from C11 (the CUDA backend's
 * launch.c) and from the .cu that defines the kernels. What it is not: a GEMM epilogue; it is a
 * separate launch after the weight GEMM on the same stream, so its sums are deterministic and do
 * not depend on which cuBLASLt algorithm was picked.
 */
#ifndef ZB_KERNELS_BIAS_GRAD_H
#define ZB_KERNELS_BIAS_GRAD_H

#include <stdint.h>


#include "zbpp.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void *dy;      /* [rows, cols] row-major, leading dimension ldy, in dy_dtype (device memory) */
  int64_t rows, cols;  /* rows >= 1, 1 <= cols <= 2^31 - 1 */
  int64_t ldy;         /* >= cols */
  zb_dtype_t dy_dtype; /* ZB_DTYPE_F32, ZB_DTYPE_F16 or ZB_DTYPE_BF16 */
  void *db;            /* [cols], dense, in db_dtype (device memory) */
  zb_dtype_t db_dtype; /* ZB_DTYPE_F32 or dy_dtype */
  int32_t accumulate;  /* 1: db += sums (the old value is widened, added in fp32, rounded once); 0: db = sums */
  /* Rows in `splits` ranges of `chunk` rows (the last may be shorter), one grid row of blocks each,
   * so few columns still fill the device. splits = 1: the blocks write db. splits > 1: they write
   * fp32 partial sums, partial[z * cols + c] for range z (device scratch of splits * cols floats),
   * and bias_combine_<db>_kernel adds them in range order into db. */
  int32_t splits;
  int64_t chunk;
  float *partial;
} zb__bias_grad_params_t;

/* The kernels, by name (bias_grad_<dy>_<db>_kernel: f32_f32, f16_f32, f16_f16, bf16_f32, bf16_bf16;
 * bias_combine_<db>_kernel: f32, f16, bf16), take these params by value. Every column is summed in
 * fp32 in one fixed order (within a range of rows: row lanes in a fixed interleave, then the lanes
 * in index order; then the ranges in order), which depends only on rows, cols and the split the
 * host chose from them, so the same inputs give the same bits on every run. A bias_grad block is
 * ZB__BIAS_GRAD_COLS x ZB__BIAS_GRAD_LANES threads and owns ZB__BIAS_GRAD_COLS columns of one
 * range (grid: column blocks x splits); a combine block is ZB__BIAS_COMBINE_THREADS columns. */
enum { ZB__BIAS_GRAD_COLS = 32, ZB__BIAS_GRAD_LANES = 16, ZB__BIAS_COMBINE_THREADS = 256 };

#ifdef __cplusplus
}
#endif

#endif /* ZB_KERNELS_BIAS_GRAD_H */
