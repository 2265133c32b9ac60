/*
 * elements.cpp - fake_load and fake_store (fake_cuda.h): elements of fp32, f16 and bf16 arrays for
 * the fake cuBLASLt's products and the fake NCCL's reductions, converted by the CUDA toolkit's own
 * host conversions (cuda_fp16.h, cuda_bf16.h: round to nearest even), not by hand.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <library_types.h>

#include <cstring>

#include "fake_cuda.h"

extern "C" float fake_load(const void *p, int t, uint64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float *>(p)[i];
  if (t == CUDA_R_16F) return __half2float(static_cast<const __half *>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
}

extern "C" void fake_store(void *p, int t, uint64_t i, float v) {
  if (t == CUDA_R_32F) static_cast<float *>(p)[i] = v;
  else if (t == CUDA_R_16F) static_cast<__half *>(p)[i] = __float2half_rn(v);
  else static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
}
