/*
 * loss_scale.cu - the dynamic loss scale on the device: zb_unscale (every gradient element times
 * 1/scale, with an inf/NaN flag; torch's _amp_foreach_non_finite_check_and_unscale_) and
 * zb_loss_scale_update (GradScaler's _amp_update_scale_), on the CUDA backend.
 *
 * Both are bit-for-bit equal to the host references in csrc/backend/reference.c: one fp32 multiply
 * (__fmul_rn, never fused) rounded to the tensor's type to nearest even, and for the scale a double
 * multiply rounded to float once. Neither reduces anything but a flag, which every block that sees
 * an inf/NaN sets to 1 (an idempotent integer store, so the order of the stores does not matter).
 *
 * What it is not: a skip of the multiply when factor is 1 (torch skips it; x * 1 is x bit for bit
 * anyway, NaN payloads aside).
 */
#include "launch.h"

namespace {

constexpr int kThreads = ZB__KERNEL_THREADS;

template <typename T> __device__ __forceinline__ void unscale_body(const zb__unscale_params_t &p) {
  const int32_t b = (int32_t)blockIdx.x;
  const int k = zb__piece_of(p.t.first_block, p.t.count, b);
  int64_t lo, hi;
  zb__chunk_of(p.t.numel[k], p.t.first_block[k], b, &lo, &hi);
  void *base = p.t.ptr[k];
  int bad = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float x = zb__load<T>(base, i);
    bad |= zb__nonfinite(zb__store<T>(base, i, __fmul_rn(x, p.factor)));
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *p.nonfinite = 1;
}

/* One thread: the scale and the tracker are single values in device memory. The tracker test is
 * >= (torch: ==), as in the reference; the same for every tracker GradScaler produces. */
__device__ __forceinline__ void scale_update_body(const zb__scale_update_params_t &p) {
  if (*p.nonfinite) {
    *p.scale = __double2float_rn(__dmul_rn((double)*p.scale, p.backoff));
    *p.tracker = 0;
    return;
  }
  const int32_t good = *p.tracker + 1;
  if (good >= p.interval) {
    const float grown = __double2float_rn(__dmul_rn((double)*p.scale, p.growth));
    if (!zb__nonfinite(grown)) *p.scale = grown;
    *p.tracker = 0;
  } else {
    *p.tracker = good;
  }
}

}  // namespace

/* The kernels the C side launches by name (csrc/cuda/launch.c). */
extern "C" __global__ void __launch_bounds__(kThreads) unscale_f32_kernel(const __grid_constant__ zb__unscale_params_t p) {
  unscale_body<float>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads) unscale_f16_kernel(const __grid_constant__ zb__unscale_params_t p) {
  unscale_body<__half>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads) unscale_bf16_kernel(const __grid_constant__ zb__unscale_params_t p) {
  unscale_body<__nv_bfloat16>(p);
}
extern "C" __global__ void scale_update_kernel(const zb__scale_update_params_t p) { scale_update_body(p); }
