/*
 * launch.h - the optimizer kernels' params structs and names, includable from C11 (csrc/cuda/kernels.c
 * builds the structs, csrc/cuda/launch.c launches the kernels by name) and from the .cu files that
 * define the kernels (sq_norm.cu, loss_scale.cu, optim.cu).
 *
 * What it is: the one contract between the C core and the device code of zb_sq_norm, zb_unscale,
 * zb_loss_scale_update, zb_optim_step and zb_optim_undo. What it is not: a general multi-tensor
 * framework; every table below is sized for one kernel.
 *
 * Tensor tables. A launch gets its list of tensors by value, as a kernel parameter (CUDA 12.1+
 * allows 32764 bytes of parameters on sm_70+), so one call is one launch and nothing is copied or
 * allocated for the list. The host cuts the list into "pieces" (a tensor, or a range of one when a
 * tensor would not fit the rest of a launch's block budget) and gives each piece ceil(numel /
 * ZB__KERNEL_CHUNK) blocks; block b works on the piece whose first_block is the largest <= b, on
 * elements [c * ZB__KERNEL_CHUNK, (c + 1) * ZB__KERNEL_CHUNK) of it, c = b - first_block. Only a
 * list longer than a table (ZB__LIST_MAX_PIECES, ZB__OPTIM_MAX_PIECES) takes several launches, in
 * list order on the same stream. Empty tensors get no piece.
 *
 * The kernels are compiled into fatbins only (no host code, no CUDA runtime), embedded in the
 * library and loaded per device with the driver API, so libzbpp.so links no cudart.
 */
#ifndef ZB_KERNELS_LAUNCH_H
#define ZB_KERNELS_LAUNCH_H

#include <stdint.h>


#include "zbpp.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  ZB__KERNEL_THREADS = 256,        /* threads per block of every table-driven kernel */
  ZB__KERNEL_CHUNK = 4096,         /* elements per block: 16 per thread */
  ZB__LIST_MAX_PIECES = 1024,      /* pieces per launch of sq_norm and unscale (20 B each) */
  ZB__OPTIM_MAX_PIECES = 512,      /* pieces per launch of optim_step and optim_undo (52 B each) */
  ZB__KERNEL_MAX_BLOCKS = 1 << 30, /* blocks per launch (gridDim.x allows 2^31 - 1) */
  ZB__KERNEL_PARAM_LIMIT = 32764   /* bytes of kernel parameters, CUDA 12.1+ on sm_70+ */
};

/* ---- sq_norm and unscale: one dtype array per piece -------------------------------------------- */

typedef struct {
  int32_t count;                            /* pieces in this launch, >= 1 */
  int32_t first_block[ZB__LIST_MAX_PIECES]; /* increasing; first_block[0] = 0 */
  int64_t numel[ZB__LIST_MAX_PIECES];       /* >= 1 */
  void *ptr[ZB__LIST_MAX_PIECES];           /* the piece's first element (device memory) */
} zb__list_table_t;

/* sq[0] += the sum of squares (double) of every element; nonfinite[0] = 1 if any is inf or NaN.
 * Deterministic: block b sums its chunk in a fixed order (per thread in index order, then a fixed
 * shared-memory tree) into partials[b], a plain store; the block that finishes last (a counter in
 * `done`, the only atomic, on an integer) adds partials[0 .. blocks) in a fixed order and adds that
 * to sq[0], then resets *done to 0 so the scratch serves the next launch. So the bits depend only on
 * the inputs and the piece layout, never on which block ran when. partials holds one double per
 * block of the launch and *done must be 0 before the first launch (device memory, the caller's). */
typedef struct {
  zb_dtype_t dtype;
  double *sq;
  int32_t *nonfinite;
  double *partials;
  unsigned int *done;
  zb__list_table_t t;
} zb__sq_norm_params_t;

/* In place: x = round_to_dtype(x * factor) in fp32 (round to nearest even), nonfinite[0] = 1 if any
 * result (after rounding) is inf or NaN. */
typedef struct {
  zb_dtype_t dtype;
  float factor;
  int32_t *nonfinite;
  zb__list_table_t t;
} zb__unscale_params_t;

/* GradScaler's _amp_update_scale_, one thread: see zb_loss_scale_update in zbpp.h. */
typedef struct {
  float *scale;
  int32_t *tracker;
  const int32_t *nonfinite;
  double growth, backoff;
  int32_t interval;
} zb__scale_update_params_t;

/* ---- optim_step and optim_undo: the parameter, its gradient and its state per piece ------------
 *
 * The undo buffer (zb_optim_step_t.undo) is three (AdamW), two (SGD with momentum) or one (plain
 * SGD) blocks of `total` floats, total = the elements of the whole list: block 0 the parameters,
 * block 1 state1, block 2 state2, each the tensors' elements concatenated in list order. Element j
 * of a piece whose first element is element `offset` of that concatenation is saved at
 * undo[k * total + offset + j] (k the block). zb_optim_undo_bytes = blocks * total * 4 bytes. */
typedef struct {
  int32_t count;
  int32_t first_block[ZB__OPTIM_MAX_PIECES];
  int64_t numel[ZB__OPTIM_MAX_PIECES];
  int64_t offset[ZB__OPTIM_MAX_PIECES]; /* index of the piece's first element in the whole list */
  float *param[ZB__OPTIM_MAX_PIECES];
  const void *grad[ZB__OPTIM_MAX_PIECES]; /* grad_dtype; unused by optim_undo */
  float *state1[ZB__OPTIM_MAX_PIECES];    /* NULL when nstate < 1 */
  float *state2[ZB__OPTIM_MAX_PIECES];    /* NULL when nstate < 2 */
} zb__optim_table_t;

/* The per-step scalars are zb__optim_scalars' (csrc/backend/reference.h): computed once on the host
 * in double from the step count and rounded to float, so the kernel and the host reference start
 * from the same floats and run the same IEEE operations on them. */
typedef struct {
  zb_optim_kind_t kind;
  zb_dtype_t grad_dtype;
  int32_t nstate; /* 2 AdamW, 1 SGD with momentum, 0 plain SGD */
  int32_t first;  /* step == 1: SGD's momentum buffer starts as the gradient */
  float factor, lr, decay, b1, omb1, b2, omb2, step_size, bc2_sqrt, eps, wd, momentum;
  float *undo;   /* NULL: no undo copy */
  int64_t total; /* elements of the whole list (the undo blocks' length) */
  zb__optim_table_t t;
} zb__optim_step_params_t;

typedef struct {
  int32_t nstate;
  const float *undo;
  int64_t total;
  zb__optim_table_t t;
} zb__optim_undo_params_t;

#ifdef __cplusplus
#define ZB__LAUNCH_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define ZB__LAUNCH_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
ZB__LAUNCH_ASSERT(sizeof(zb__sq_norm_params_t) <= ZB__KERNEL_PARAM_LIMIT, "sq_norm params too big");
ZB__LAUNCH_ASSERT(sizeof(zb__unscale_params_t) <= ZB__KERNEL_PARAM_LIMIT, "unscale params too big");
ZB__LAUNCH_ASSERT(sizeof(zb__optim_step_params_t) <= ZB__KERNEL_PARAM_LIMIT, "step params too big");
ZB__LAUNCH_ASSERT(sizeof(zb__optim_undo_params_t) <= ZB__KERNEL_PARAM_LIMIT, "undo params too big");
#undef ZB__LAUNCH_ASSERT

/* The kernels, by name, as csrc/cuda/launch.c launches them through the driver (grid: the blocks
 * of the table's pieces, ZB__KERNEL_THREADS threads, the params by value):
 *   sq_norm_<dtype>_kernel, unscale_<dtype>_kernel (dtype f32, f16, bf16), scale_update_kernel (one
 *   thread), optim_step_<grad dtype>_kernel, optim_undo_kernel. */

#ifdef __cplusplus
}
#endif

/* ---- device helpers the .cu files share (nvcc only) --------------------------------------------- */
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

/* The piece block b works on: the largest k with first[k] <= b (first[0] = 0, increasing). Every
 * thread of a block computes the same k from the same parameter words (broadcast reads). */
static __device__ __forceinline__ int zb__piece_of(const int32_t *first, int32_t count, int32_t b) {
  int32_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (first[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* The element range [*lo, *hi) of a piece that block b covers. */
static __device__ __forceinline__ void zb__chunk_of(int64_t numel, int32_t first, int32_t b, int64_t *lo,
                                                    int64_t *hi) {
  *lo = (int64_t)(b - first) * ZB__KERNEL_CHUNK;
  *hi = *lo + ZB__KERNEL_CHUNK < numel ? *lo + ZB__KERNEL_CHUNK : numel;
}

/* inf or NaN: an all-ones exponent (independent of fast-math flags). */
static __device__ __forceinline__ bool zb__nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

/* Element i of an array of T, widened to float (exact for every T). */
template <typename T> __device__ __forceinline__ float zb__load(const void *base, int64_t i);
template <> __device__ __forceinline__ float zb__load<float>(const void *base, int64_t i) {
  return static_cast<const float *>(base)[i];
}
template <> __device__ __forceinline__ float zb__load<__half>(const void *base, int64_t i) {
  return __half2float(static_cast<const __half *>(base)[i]);
}
template <> __device__ __forceinline__ float zb__load<__nv_bfloat16>(const void *base, int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16 *>(base)[i]);
}

/* Stores v rounded to T (nearest even) as element i and returns what was stored, widened back. */
template <typename T> __device__ __forceinline__ float zb__store(void *base, int64_t i, float v);
template <> __device__ __forceinline__ float zb__store<float>(void *base, int64_t i, float v) {
  static_cast<float *>(base)[i] = v;
  return v;
}
template <> __device__ __forceinline__ float zb__store<__half>(void *base, int64_t i, float v) {
  const __half h = __float2half_rn(v);
  static_cast<__half *>(base)[i] = h;
  return __half2float(h);
}
template <> __device__ __forceinline__ float zb__store<__nv_bfloat16>(void *base, int64_t i, float v) {
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  static_cast<__nv_bfloat16 *>(base)[i] = h;
  return __bfloat162float(h);
}
#endif /* __CUDACC__ */

#endif /* ZB_KERNELS_LAUNCH_H */
