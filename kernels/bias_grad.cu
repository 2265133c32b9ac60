/*
 * bias_grad.cu - db[c] (+)= sum over rows of dy[r, c], the bias gradient of a linear layer.
 *
 * Layout of the work: a block owns 32 adjacent columns (one per lane of a warp, so each row's loads
 * are one coalesced segment) of one range of rows, and LANES row lanes; row lane t sums the range's
 * rows t, t + LANES, ... in increasing order, then row lane 0 adds the LANES partial sums in lane
 * order. With one range that is the column's sum; with several (few columns and many rows: the host
 * splits the rows so the grid fills the device), each range's sum goes to a scratch row and a
 * second kernel adds the ranges in order. Every column's sum has one fixed order that depends only
 * on rows, cols and the split, never on scheduling: no atomics, so the result is bit-for-bit
 * reproducible. Accumulation is in fp32 for every input type (the GEMM's compute type).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bias_grad.h"

namespace {

constexpr int kCols = ZB__BIAS_GRAD_COLS;
constexpr int kLanes = ZB__BIAS_GRAD_LANES;

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

template <typename TY, typename TB> __device__ __forceinline__ void bias_grad_body(const zb__bias_grad_params_t &p) {
  __shared__ float part[kLanes][kCols + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = (int64_t)blockIdx.x * kCols + tx;
  const int64_t r0 = (int64_t)blockIdx.y * p.chunk;
  const int64_t r1 = r0 + p.chunk < p.rows ? r0 + p.chunk : p.rows;
  const TY *dy = static_cast<const TY *>(p.dy);
  float s = 0.0f;
  if (c < p.cols)
    for (int64_t r = r0 + ty; r < r1; r += kLanes) s += to_f32<TY>(dy[r * p.ldy + c]);
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < p.cols) {
    float t = part[0][tx];
    for (int k = 1; k < kLanes; k++) t += part[k][tx];
    if (p.splits > 1) {
      p.partial[(int64_t)blockIdx.y * p.cols + c] = t;
      return;
    }
    TB *db = static_cast<TB *>(p.db);
    if (p.accumulate) t = to_f32<TB>(db[c]) + t;
    db[c] = from_f32<TB>(t);
  }
}

/* The ranges' sums of one column, in range order, into db. */
template <typename TB> __device__ __forceinline__ void bias_combine_body(const zb__bias_grad_params_t &p) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.cols) return;
  float t = p.partial[c];
  for (int32_t z = 1; z < p.splits; z++) t += p.partial[(int64_t)z * p.cols + c];
  TB *db = static_cast<TB *>(p.db);
  if (p.accumulate) t = to_f32<TB>(db[c]) + t;
  db[c] = from_f32<TB>(t);
}

}  // namespace

/* The kernels the C side launches by name (csrc/cuda/launch.c): per dy dtype, db in fp32 or in
 * dy's dtype. Blocks of ZB__BIAS_GRAD_COLS x ZB__BIAS_GRAD_LANES threads, one per ZB__BIAS_GRAD_COLS columns. */
#define ZB__BIAS_GRAD_KERNEL(name, TY, TB)                                                          \
  extern "C" __global__ void __launch_bounds__(kCols * kLanes) name(const zb__bias_grad_params_t p) { \
    bias_grad_body<TY, TB>(p);                                                                      \
  }
ZB__BIAS_GRAD_KERNEL(bias_grad_f32_f32_kernel, float, float)
ZB__BIAS_GRAD_KERNEL(bias_grad_f16_f32_kernel, __half, float)
ZB__BIAS_GRAD_KERNEL(bias_grad_f16_f16_kernel, __half, __half)
ZB__BIAS_GRAD_KERNEL(bias_grad_bf16_f32_kernel, __nv_bfloat16, float)
ZB__BIAS_GRAD_KERNEL(bias_grad_bf16_bf16_kernel, __nv_bfloat16, __nv_bfloat16)

#define ZB__BIAS_COMBINE_KERNEL(name, TB)                                                           \
  extern "C" __global__ void __launch_bounds__(ZB__BIAS_COMBINE_THREADS) name(const zb__bias_grad_params_t p) { \
    bias_combine_body<TB>(p);                                                                       \
  }
ZB__BIAS_COMBINE_KERNEL(bias_combine_f32_kernel, float)
ZB__BIAS_COMBINE_KERNEL(bias_combine_f16_kernel, __half)
ZB__BIAS_COMBINE_KERNEL(bias_combine_bf16_kernel, __nv_bfloat16)
