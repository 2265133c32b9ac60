/*
 * shim.h - the part of CUDA's device language that kernels/ *.cu use, for a host C++ compiler, so
 * the fake device (fake_cuda.h) runs the kernels' own source. Included before each .cu file
 * (-include); kernels.cpp runs what it compiles.
 *
 * Each kernel function becomes a plain function that runs one thread; kernels.cpp calls it once per
 * thread, each thread a fiber, with threadIdx and friends set to that thread's values. __shared__
 * variables become statics: one block runs at a time (kernels.cpp holds a lock for a whole grid),
 * so a block's threads share them and the next block finds them as a GPU leaves them (unspecified).
 * __syncthreads switches to the next thread of the block; the block's threads pass it together.
 * The _rn intrinsics are plain IEEE operations (the fake is built with -ffp-contract=off, so none
 * becomes a fused multiply-add, as nvcc never contracts an _rn intrinsic); fences are no-ops (one
 * host thread runs the grid); atomics are plain reads and writes for the same reason.
 *
 * What it is not: CUDA. Warp-level primitives (shuffles, votes other than __syncthreads_or) and
 * cooperative groups are not here; a kernel that uses them does not compile against it, which is
 * the signal to add them.
 */
#ifndef ZB_FAKE_CUDA_SHIM_H
#define ZB_FAKE_CUDA_SHIM_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

/* From here on the kernels' sources see "nvcc" (launch.h's device helpers are under __CUDACC__). */
#define __CUDACC__ 1

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __grid_constant__

struct fake_uint3 {
  unsigned x, y, z;
};

namespace fakecuda {
extern fake_uint3 thread_idx, block_idx, block_dim, grid_dim;
/* The calling thread waits until every thread of its block has called it; returns the OR of their
 * `vote`s (0 for a plain __syncthreads). */
int barrier(int vote);
}  // namespace fakecuda

#define threadIdx (::fakecuda::thread_idx)
#define blockIdx (::fakecuda::block_idx)
#define blockDim (::fakecuda::block_dim)
#define gridDim (::fakecuda::grid_dim)

static inline void __syncthreads() { (void)::fakecuda::barrier(0); }
static inline int __syncthreads_or(int v) { return ::fakecuda::barrier(v != 0); }
static inline void __threadfence() {}
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
template <typename T> static inline T __ldcg(const T *p) { return *p; }

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __double2float_rn(double a) { return (float)a; }
static inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

#endif /* ZB_FAKE_CUDA_SHIM_H */
