/*
 * internal.h - the backend interface the runtime is written against, and the host helpers the
 * reference model shares with the host backend. Private to the library.
 *
 * A backend owns one rank's memory and its compute stream, and runs the W store's GEMMs and the
 * optimizer kernels there. On the host the "stream" is synchronous: work runs when it is issued.
 * On CUDA it is a cudaStream_t. Communication streams are not the backend's: a transport that
 * moves device memory orders itself against the compute stream (the NCCL transport has a stream per
 * channel and events of its own), so the runner never needs to know which backend it drives.
 */
#ifndef ZB_BACKEND_INTERNAL_H
#define ZB_BACKEND_INTERNAL_H

#include <stddef.h>

#include "../common/error.h"
#include "zbpp.h"

typedef struct zb__event zb__event_t;

typedef struct {
  const char *name;
  int device_memory; /* 1: alloc gives device memory that host code must not touch (CUDA) */
  /* Memory the backend's GEMMs and transports can use (host: malloc; CUDA: device memory). */
  zb_status_t (*alloc)(zb_backend_t *be, size_t bytes, void **out);
  void (*release)(zb_backend_t *be, void *ptr);
  /* dw += dy^T x (and db += column sums of dy) on the compute stream. */
  zb_status_t (*wgrad)(zb_backend_t *be, const zb_wgrad_t *e);
  /* Blocks the host until the compute stream has finished what was issued. */
  zb_status_t (*sync)(zb_backend_t *be);
  void (*destroy)(zb_backend_t *be);
  /* zb_backend_set_stream (arguments checked by the caller only for NULL-ness of be). */
  zb_status_t (*set_stream)(zb_backend_t *be, void *stream);
  /* Copies bytes on the compute stream (host: memcpy). */
  zb_status_t (*copy)(zb_backend_t *be, void *dst, const void *src, size_t bytes);
  /* The optimizer kernels of zbpp.h; arguments are checked before these are called (ops.c), so
   * implementations only run them: the host backend calls the references in reference.h, the CUDA
   * backend launches the kernels/ code on the compute stream. */
  zb_status_t (*sq_norm)(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq,
                         int32_t *nonfinite);
  zb_status_t (*unscale)(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t, float factor,
                         int32_t *nonfinite);
  zb_status_t (*scale_update)(zb_backend_t *be, float *scale, int32_t *tracker, const int32_t *nonfinite,
                              double growth, double backoff, int32_t interval);
  zb_status_t (*optim_step)(zb_backend_t *be, const zb_optim_step_t *s);
  zb_status_t (*optim_undo)(zb_backend_t *be, const zb_optim_step_t *s);
  /* Optional, all four NULL on the host (where the runner stamps ops with the host clock): events
   * that take a device timestamp where they are recorded on the compute stream, and the seconds
   * between two of them once both completed. The runner times each op on the device this way,
   * since its host stamps only say when the work was issued. */
  zb_status_t (*timing_event_create)(zb_backend_t *be, zb__event_t **out);
  void (*event_destroy)(zb_backend_t *be, zb__event_t *ev);
  zb_status_t (*event_record)(zb_backend_t *be, zb__event_t *ev);
  zb_status_t (*elapsed)(zb_backend_t *be, zb__event_t *from, zb__event_t *to, double *seconds);
} zb__backend_ops_t;

struct zb_backend {
  const zb__backend_ops_t *ops;
  int users; /* runners and W stores created on it; destroy is refused while > 0 */
  void *impl;
};

/* Every user of a backend takes a reference so destroying it early gets ZB_ERR_BUSY. */
static inline void zb__backend_ref(zb_backend_t *be) { be->users++; }
static inline void zb__backend_unref(zb_backend_t *be) { be->users--; }

/* Bytes per element of a dtype (0 for an unknown value). */
size_t zb__dtype_size(zb_dtype_t dtype);
/* Checks a W-store entry's fields (shapes, pointers, leading dimensions); the message names the
 * field and the allowed values. */
zb_status_t zb__wgrad_check(const zb_wgrad_t *e);

/* Host fp32 GEMM through CBLAS, row-major: C = alpha * op(A) op(B) + beta * C with op(A) [m, k] and
 * op(B) [k, n]. Used by the host backend and by the reference model. */
void zb__host_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                    int lda, const float *b, int ldb, float beta, float *c, int ldc);
/* Which BLAS the process uses, e.g. "OpenBLAS 0.3.21 ... Haswell" (for benchmark reports). */
const char *zb__host_blas_name(void);
/* Widens bf16/f16 values to fp32 (the host reference for half types). */
float zb__half_to_float(uint16_t h);
float zb__bf16_to_float(uint16_t h);
/* fp32 -> binary16 / bfloat16, round to nearest even (as CUDA's __float2half_rn and
 * __float2bfloat16_rn); inf kept, NaN stays a NaN. */
uint16_t zb__float_to_half(float f);
uint16_t zb__float_to_bf16(float f);

#endif /* ZB_BACKEND_INTERNAL_H */
