/*
 * sq_norm.cu - sq[0] += the sum of squares of every element of a list of tensors, in double, and an
 * inf/NaN flag: zb_sq_norm on the CUDA backend (the global-norm half of gradient clipping and the
 * first step of post-validation).
 *
 * Determinism without floating atomics ("last block done", as CUDA's threadFenceReduction sample):
 *  1. block b sums the squares of its chunk: thread t takes elements t, t + 256, ... in increasing
 *     order into a double, then the 256 values are added pairwise in a fixed shared-memory tree;
 *  2. thread 0 stores that in partials[b] (a slot of its own), fences, and takes a ticket from an
 *     integer counter; the block with the last ticket sums partials[0 .. gridDim.x) with the same
 *     fixed pattern and adds the total to sq[0] (then resets the counter for the next launch).
 * Which block finishes last changes nothing: it sums every slot in the same order. So the result is
 * a function of the inputs and of the piece layout (launch.h), which depends only on the numels.
 * The squares are exact in double (a float has 24 significant bits), so a fused multiply-add of the
 * square into the accumulator rounds exactly as a separate multiply and add would.
 *
 * What it is not: a match for the host's bits. The host adds the squares one by one in list order,
 * which loses every square below half an ulp of the running sum: 2.5e-12 to 3.6e-12 relative low on
 * a few million elements of mixed magnitudes, where this tree's sum measured within 1.2e-16 of the
 * exact one (its bound: about 40 roundings deep, 40 x 2^-53 ~ 4.4e-15). tests/c/gpu_kernels.c holds
 * both to a compensated sum; the fake device (tests/fake_cuda) runs this file on the host.
 */
#include "launch.h"

namespace {

constexpr int kThreads = ZB__KERNEL_THREADS;

/* The sum of one double per thread in a fixed order (a tree over shared memory); every thread gets
 * it. sh must not be in use by the block (the last __syncthreads leaves it free to reuse only after
 * the caller's next barrier). */
__device__ double block_sum(double v, double *sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) sh[threadIdx.x] = sh[threadIdx.x] + sh[threadIdx.x + s];
    __syncthreads();
  }
  return sh[0];
}

template <typename T> __device__ __forceinline__ void sq_norm_body(const zb__sq_norm_params_t &p) {
  __shared__ double sh[kThreads];
  __shared__ bool last;
  const int32_t b = (int32_t)blockIdx.x;
  const int k = zb__piece_of(p.t.first_block, p.t.count, b);
  int64_t lo, hi;
  zb__chunk_of(p.t.numel[k], p.t.first_block[k], b, &lo, &hi);
  const void *base = p.t.ptr[k];

  double acc = 0.0;
  int bad = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float x = zb__load<T>(base, i);
    bad |= zb__nonfinite(x);
    const double d = (double)x;
    acc += d * d;
  }
  bad = __syncthreads_or(bad);
  const double part = block_sum(acc, sh);
  if (threadIdx.x == 0) {
    if (bad) *p.nonfinite = 1;
    p.partials[b] = part;
    __threadfence(); /* the slot is visible device-wide before the ticket says so */
    const unsigned int ticket = atomicAdd(p.done, 1u);
    last = ticket == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;

  /* The last block: every other block's slot was fenced before its ticket. __ldcg reads at L2,
   * never a stale L1 line. */
  __threadfence();
  double a = 0.0;
  for (int64_t i = threadIdx.x; i < (int64_t)gridDim.x; i += kThreads) a += __ldcg(&p.partials[i]);
  const double total = block_sum(a, sh);
  if (threadIdx.x == 0) {
    *p.sq = *p.sq + total;
    *p.done = 0;
  }
}

}  // namespace

/* The kernels the C side launches by name (csrc/cuda/launch.c), one per gradient dtype. */
extern "C" __global__ void __launch_bounds__(kThreads) sq_norm_f32_kernel(const __grid_constant__ zb__sq_norm_params_t p) {
  sq_norm_body<float>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads) sq_norm_f16_kernel(const __grid_constant__ zb__sq_norm_params_t p) {
  sq_norm_body<__half>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads) sq_norm_bf16_kernel(const __grid_constant__ zb__sq_norm_params_t p) {
  sq_norm_body<__nv_bfloat16>(p);
}
