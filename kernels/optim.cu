/*
 * optim.cu - one fused AdamW or SGD step over a list of fp32 master weights (zb_optim_step), with
 * the undo copy post-validation needs, and the restore from that copy (zb_optim_undo).
 *
 * Bit for bit with the host: the per-element arithmetic below is the host reference's
 * (csrc/backend/reference.c, adamw_elems and sgd_elems), operation for operation and in the same
 * order, written with the _rn intrinsics, which nvcc never contracts into fused multiply-adds (it
 * would by default for a*b + c) and which never flush subnormals. sqrt and division are IEEE
 * correctly rounded on both sides (__fsqrt_rn, __fdiv_rn; sqrtf and / on the host). The scalars are
 * the host's zb__optim_scalars, rounded to float once there. A bf16/f16 gradient is widened exactly.
 * So the same inputs give the same bits here and on the host backend, and the GPU test checks it.
 *
 * Each element is read once, saved to the undo buffer (launch.h gives the layout) before anything
 * is written when p.undo is set, updated, and written once: one pass over the memory.
 *
 * What it is not: an optimizer object. The step count, the hyperparameters and the loss-scale
 * decision are the caller's (zb_postval on the host); this is only the arithmetic.
 */
#include "launch.h"

namespace {

constexpr int kThreads = ZB__KERNEL_THREADS;

template <typename G> __device__ __forceinline__ void optim_step_body(const zb__optim_step_params_t &p) {
  const int32_t b = (int32_t)blockIdx.x;
  const int k = zb__piece_of(p.t.first_block, p.t.count, b);
  int64_t lo, hi;
  zb__chunk_of(p.t.numel[k], p.t.first_block[k], b, &lo, &hi);
  float *param = p.t.param[k];
  const void *grad = p.t.grad[k];
  float *m = p.t.state1[k], *v = p.t.state2[k];
  const int64_t total = p.total;
  float *u = p.undo ? p.undo + p.t.offset[k] : nullptr;

  if (p.kind == ZB_OPTIM_ADAMW) {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float p0 = param[i], m0 = m[i], v0 = v[i];
      if (u) {
        u[i] = p0;
        u[total + i] = m0;
        u[2 * total + i] = v0;
      }
      const float g = __fmul_rn(zb__load<G>(grad, i), p.factor);
      const float m1 = __fadd_rn(__fmul_rn(p.b1, m0), __fmul_rn(p.omb1, g));
      const float v1 = __fadd_rn(__fmul_rn(p.b2, v0), __fmul_rn(__fmul_rn(p.omb2, g), g));
      const float pd = __fmul_rn(p0, p.decay);
      const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(v1), p.bc2_sqrt), p.eps);
      param[i] = __fsub_rn(pd, __fdiv_rn(__fmul_rn(p.step_size, m1), den));
      m[i] = m1;
      v[i] = v1;
    }
  } else {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float p0 = param[i];
      if (u) u[i] = p0;
      const float g = __fadd_rn(__fmul_rn(zb__load<G>(grad, i), p.factor), __fmul_rn(p.wd, p0));
      float d = g;
      if (p.nstate >= 1) {
        const float b0 = m[i];
        if (u) u[total + i] = b0;
        if (!p.first) d = __fadd_rn(__fmul_rn(p.momentum, b0), g);
        m[i] = d;
      }
      param[i] = __fsub_rn(p0, __fmul_rn(p.lr, d));
    }
  }
}

/* The inverse of the saves above: every block of the undo buffer back where it came from. */
__device__ __forceinline__ void optim_undo_body(const zb__optim_undo_params_t &p) {
  const int32_t b = (int32_t)blockIdx.x;
  const int k = zb__piece_of(p.t.first_block, p.t.count, b);
  int64_t lo, hi;
  zb__chunk_of(p.t.numel[k], p.t.first_block[k], b, &lo, &hi);
  const float *u = p.undo + p.t.offset[k];
  const int64_t total = p.total;
  float *param = p.t.param[k], *m = p.t.state1[k], *v = p.t.state2[k];
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    param[i] = u[i];
    if (p.nstate >= 1) m[i] = u[total + i];
    if (p.nstate >= 2) v[i] = u[2 * total + i];
  }
}

}  // namespace

/* The kernels the C side launches by name (csrc/cuda/launch.c), one step per gradient dtype. */
extern "C" __global__ void __launch_bounds__(kThreads)
    optim_step_f32_kernel(const __grid_constant__ zb__optim_step_params_t p) {
  optim_step_body<float>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads)
    optim_step_f16_kernel(const __grid_constant__ zb__optim_step_params_t p) {
  optim_step_body<__half>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads)
    optim_step_bf16_kernel(const __grid_constant__ zb__optim_step_params_t p) {
  optim_step_body<__nv_bfloat16>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads)
    optim_undo_kernel(const __grid_constant__ zb__optim_undo_params_t p) {
  optim_undo_body(p);
}
