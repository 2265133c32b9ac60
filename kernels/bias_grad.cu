/*
 * bias_grad.cu - db[c] (+)= sum over rows of dy[r, c], the bias gradient of a linear layer.
 *
 * Layout of the work: a block owns 32 adjacent columns (one per lane of a warp, so each row's loads
 * are one coalesced segment) and LANES row lanes; row lane t sums rows t, t + LANES, t + 2 LANES, ...
 * in increasing order, then row lane 0 adds the LANES partial sums in lane order. Every column's
 * sum therefore has one fixed order that depends only on `rows` and the compile-time LANES, never on
 * scheduling: no atomics, so the result is bit-for-bit reproducible. Accumulation is in fp32 for
 * every input type (the same as the weight GEMM's compute type).
 *
 * What it is not: fast for very few columns (cols / 32 blocks); bias gradients are a small part of
 * the W work next to the GEMM they follow.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bias_grad.h"

namespace {

constexpr int kCols = 32;  /* columns per block: one warp's width */
constexpr int kLanes = 16; /* row lanes per block */

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename TY, typename TB>
__global__ void __launch_bounds__(kCols * kLanes) bias_grad_kernel(zb__bias_grad_params_t p) {
  __shared__ float part[kLanes][kCols + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = (int64_t)blockIdx.x * kCols + tx;
  const TY *dy = static_cast<const TY *>(p.dy);
  float s = 0.0f;
  if (c < p.cols)
    for (int64_t r = ty; r < p.rows; r += kLanes) s += to_f32<TY>(dy[r * p.ldy + c]);
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < p.cols) {
    float t = part[0][tx];
    for (int k = 1; k < kLanes; k++) t += part[k][tx];
    TB *db = static_cast<TB *>(p.db);
    if (p.accumulate) t = to_f32<TB>(db[c]) + t;
    db[c] = from_f32<TB>(t);
  }
}

template <typename TY, typename TB> cudaError_t launch(const zb__bias_grad_params_t *p, cudaStream_t s) {
  const dim3 block(kCols, kLanes);
  const dim3 grid((unsigned)((p->cols + kCols - 1) / kCols));
  bias_grad_kernel<TY, TB><<<grid, block, 0, s>>>(*p);
  return cudaGetLastError();
}

template <typename TY> cudaError_t launch_for(const zb__bias_grad_params_t *p, cudaStream_t s) {
  /* db is fp32 (Megatron's main_grad) or the input type; the caller has checked which. */
  return p->db_dtype == ZB_DTYPE_F32 ? launch<TY, float>(p, s) : launch<TY, TY>(p, s);
}

}  // namespace

extern "C" int zb_launch_bias_grad(const zb__bias_grad_params_t *p, cudaStream_t stream) {
  if (p->cols < 1) return (int)cudaSuccess;
  if (p->db_dtype != ZB_DTYPE_F32 && p->db_dtype != p->dy_dtype) return (int)cudaErrorInvalidValue;
  switch (p->dy_dtype) {
    case ZB_DTYPE_F32: return (int)launch_for<float>(p, stream);
    case ZB_DTYPE_F16: return (int)launch_for<__half>(p, stream);
    case ZB_DTYPE_BF16: return (int)launch_for<__nv_bfloat16>(p, stream);
  }
  return (int)cudaErrorInvalidValue;
}
