/*
 * host.c - the host backend: malloc'd memory, synchronous "streams", and the W store's GEMMs
 * through the system's CBLAS.
 *
 * What this is: the backend the CPU runtime, the C tests and `zbpp verify` run on, and the oracle
 * the CUDA backend is checked against. Every stream runs work as it is issued, so events are
 * complete the moment they are recorded. What it is not: fast for half types; bf16/f16 inputs are
 * widened to fp32 copies before the GEMM.
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <cblas.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "reference.h"

size_t zb__dtype_size(zb_dtype_t dtype) {
  switch (dtype) {
    case ZB_DTYPE_F32: return 4;
    case ZB_DTYPE_F16:
    case ZB_DTYPE_BF16: return 2;
  }
  return 0;
}

zb_status_t zb__wgrad_check(const zb_wgrad_t *e) {
  ZB_ARG_NOT_NULL(e);
  if (e->struct_size < sizeof(zb_wgrad_t))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t.struct_size is %u; set it to sizeof(zb_wgrad_t) (%zu)",
                   (unsigned)e->struct_size, sizeof(zb_wgrad_t));
  if (zb__dtype_size(e->dtype) == 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t.dtype is %d; allowed: ZB_DTYPE_F32, ZB_DTYPE_F16, ZB_DTYPE_BF16",
                   (int)e->dtype);
  if (e->rows < 0 || e->in_features < 1 || e->out_features < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t shape rows=%lld in=%lld out=%lld; rows must be >= 0 and the feature "
                   "counts >= 1",
                   (long long)e->rows, (long long)e->in_features, (long long)e->out_features);
  if (e->rows > INT32_MAX || e->in_features > INT32_MAX || e->out_features > INT32_MAX)
    return ZB_FAIL(ZB_ERR_UNSUPPORTED, "zb_wgrad_t dimensions above 2^31-1 are not supported");
  if (!e->dw || (e->rows > 0 && (!e->x || !e->dy)))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_wgrad_t: x, dy and dw must not be NULL");
  if ((e->ldx != 0 && e->ldx < e->in_features) || (e->ldy != 0 && e->ldy < e->out_features))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t leading dimensions ldx=%lld ldy=%lld are below the row lengths "
                   "(%lld, %lld); use 0 for dense rows",
                   (long long)e->ldx, (long long)e->ldy, (long long)e->in_features,
                   (long long)e->out_features);
  return ZB_OK;
}

/* OpenBLAS built without threads and without USE_LOCKING (Debian's libopenblas0-serial) shares
 * its work buffers between calls, so two ranks' threads in sgemm at once corrupt each other's
 * results (seen as rare, wrong gradients). Such a build says so through openblas_get_parallel() ==
 * 0; then, and only then, GEMMs take one process-wide lock. This lock, and the probe's result, are
 * the only global state of the host backend: they describe the process's BLAS, not a handle. */
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static int blas_serialize;
static pthread_mutex_t blas_mu = PTHREAD_MUTEX_INITIALIZER;
static char blas_name[160] = "CBLAS";

static void blas_probe(void) {
  int (*get_parallel)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "openblas_get_parallel");
  char *(*get_config)(void) = (char *(*)(void))dlsym(RTLD_DEFAULT, "openblas_get_config");
  if (get_config) snprintf(blas_name, sizeof blas_name, "%s", get_config());
  blas_serialize = get_parallel && get_parallel() == 0;
  if (blas_serialize) snprintf(blas_name + strlen(blas_name), sizeof blas_name - strlen(blas_name),
                               " (not thread-safe: GEMMs serialised)");
}

const char *zb__host_blas_name(void) {
  pthread_once(&blas_once, blas_probe);
  return blas_name;
}

void zb__host_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                    int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  pthread_once(&blas_once, blas_probe);
  if (blas_serialize) pthread_mutex_lock(&blas_mu);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (blas_serialize) pthread_mutex_unlock(&blas_mu);
}

/* IEEE binary16 -> binary32, subnormals and inf/NaN included. */
float zb__half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = ldexpf((float)man, -24); /* zero or subnormal: man * 2^-24 */
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = ldexpf((float)(man | 0x400), (int)exp - 25);
  }
  uint32_t bits;
  memcpy(&bits, &f, 4);
  bits |= sign;
  memcpy(&f, &bits, 4);
  return f;
}

/* bfloat16 is the top half of a binary32. */
float zb__bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* A dense fp32 copy of a [rows, cols] matrix with leading dimension ld. */
static float *widen(const void *src, zb_dtype_t dtype, int64_t rows, int64_t cols, int64_t ld) {
  float *dst = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof(float));
  if (!dst) return NULL;
  const uint16_t *s = src;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      uint16_t v = s[r * ld + c];
      dst[r * cols + c] = dtype == ZB_DTYPE_F16 ? zb__half_to_float(v) : zb__bf16_to_float(v);
    }
  return dst;
}

/* dw[out, in] += dy[rows, out]^T x[rows, in]; db[out] += sum over rows of dy. The bias sum runs
 * row by row in a fixed order, so it is as deterministic as the GEMM. */
static zb_status_t host_wgrad(zb_backend_t *be, const zb_wgrad_t *e) {
  int64_t rows = e->rows, in = e->in_features, out = e->out_features;
  int64_t ldx = e->ldx ? e->ldx : in, ldy = e->ldy ? e->ldy : out;
  if (rows == 0) return ZB_OK;
  const float *x = e->x, *dy = e->dy;
  float *xw = NULL, *dyw = NULL;
  if (e->dtype != ZB_DTYPE_F32) {
    xw = widen(e->x, e->dtype, rows, in, ldx);
    dyw = widen(e->dy, e->dtype, rows, out, ldy);
    if (!xw || !dyw) {
      free(xw), free(dyw);
      return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory widening a %lldx%lld W-store entry",
                     (long long)rows, (long long)(in > out ? in : out));
    }
    x = xw, dy = dyw, ldx = in, ldy = out;
  }
  zb__host_sgemm(1, 0, (int)out, (int)in, (int)rows, 1.0f, dy, (int)ldy, x, (int)ldx, 1.0f, e->dw,
                 (int)in);
  if (e->db)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < out; c++) ((float *)e->db)[c] += dy[r * ldy + c];
  free(xw), free(dyw);
  return ZB_OK;
}

static zb_status_t host_alloc(zb_backend_t *be, size_t bytes, void **out) {
  *out = malloc(bytes ? bytes : 1);
  if (!*out) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "host backend: out of memory allocating %zu bytes", bytes);
  return ZB_OK;
}
static void host_release(zb_backend_t *be, void *ptr) { free(ptr); }

/* Host streams are synchronous: an event is complete when recorded, and nothing ever waits. The
 * event objects still exist so that a runner leaks them exactly when it would leak CUDA events. */
struct zb__event {
  int recorded;
};
static zb_status_t host_event_create(zb_backend_t *be, zb__event_t **out) {
  *out = calloc(1, sizeof(zb__event_t));
  if (!*out) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "host backend: out of memory for an event");
  return ZB_OK;
}
static void host_event_destroy(zb_backend_t *be, zb__event_t *ev) { free(ev); }
static zb_status_t host_event_record(zb_backend_t *be, int stream, zb__event_t *ev) {
  ev->recorded = 1;
  return ZB_OK;
}
static zb_status_t host_stream_wait(zb_backend_t *be, int stream, zb__event_t *ev) { return ZB_OK; }
static zb_status_t host_stream_sync(zb_backend_t *be, int stream) { return ZB_OK; }
static void host_destroy(zb_backend_t *be) { free(be); }

static zb_status_t host_set_stream(zb_backend_t *be, void *stream) {
  if (stream)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the host backend has no streams; zb_backend_set_stream accepts only NULL here");
  return ZB_OK;
}
static zb_status_t host_copy(zb_backend_t *be, void *dst, const void *src, size_t bytes) {
  if (bytes) memmove(dst, src, bytes);
  return ZB_OK;
}

/* The optimizer kernels' host side is their reference (reference.c), run as issued. */
static zb_status_t host_sq_norm(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t,
                                double *sq, int32_t *nonfinite) {
  zb__ref_sq_norm(dtype, t, sq, nonfinite);
  return ZB_OK;
}
static zb_status_t host_unscale(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t,
                                float factor, int32_t *nonfinite) {
  zb__ref_unscale(dtype, t, factor, nonfinite);
  return ZB_OK;
}
static zb_status_t host_scale_update(zb_backend_t *be, float *scale, int32_t *tracker,
                                     const int32_t *nonfinite, double growth, double backoff,
                                     int32_t interval) {
  zb__ref_scale_update(scale, tracker, nonfinite, growth, backoff, interval);
  return ZB_OK;
}
static zb_status_t host_optim_step(zb_backend_t *be, const zb_optim_step_t *s) {
  zb__ref_optim_step(s);
  return ZB_OK;
}
static zb_status_t host_optim_undo(zb_backend_t *be, const zb_optim_step_t *s) {
  zb__ref_optim_undo(s);
  return ZB_OK;
}

static const zb__backend_ops_t host_ops = {
    .name = "host",
    .alloc = host_alloc,
    .release = host_release,
    .wgrad = host_wgrad,
    .event_create = host_event_create,
    .event_destroy = host_event_destroy,
    .event_record = host_event_record,
    .stream_wait = host_stream_wait,
    .stream_sync = host_stream_sync,
    .destroy = host_destroy,
    .set_stream = host_set_stream,
    .copy = host_copy,
    .sq_norm = host_sq_norm,
    .unscale = host_unscale,
    .scale_update = host_scale_update,
    .optim_step = host_optim_step,
    .optim_undo = host_optim_undo,
};

zb_status_t zb_backend_create_host(zb_backend_t **out) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  zb_backend_t *be = calloc(1, sizeof(*be));
  if (!be) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the host backend");
  be->ops = &host_ops;
  *out = be;
  return ZB_OK;
}

zb_status_t zb_backend_destroy(zb_backend_t *be) {
  if (!be) return ZB_OK;
  if (be->users > 0)
    return ZB_FAIL(ZB_ERR_BUSY,
                   "the %s backend still has %d runner(s) or W store(s) created on it; destroy "
                   "them first",
                   be->ops->name, be->users);
  be->ops->destroy(be);
  return ZB_OK;
}

const char *zb_backend_name(const zb_backend_t *be) { return be ? be->ops->name : "none"; }

/* ---- the backend-generic public calls ---------------------------------------------------------- */

zb_status_t zb_backend_set_stream(zb_backend_t *be, void *stream) {
  ZB_ARG_NOT_NULL(be);
  return be->ops->set_stream(be, stream);
}

zb_status_t zb_backend_synchronize(zb_backend_t *be) {
  ZB_ARG_NOT_NULL(be);
  return be->ops->stream_sync(be, ZB__STREAM_COMPUTE);
}

zb_status_t zb_backend_alloc(zb_backend_t *be, size_t bytes, void **out) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(be);
  return be->ops->alloc(be, bytes, out);
}

zb_status_t zb_backend_free(zb_backend_t *be, void *ptr) {
  ZB_ARG_NOT_NULL(be);
  if (ptr) be->ops->release(be, ptr);
  return ZB_OK;
}

zb_status_t zb_backend_copy(zb_backend_t *be, void *dst, const void *src, size_t bytes) {
  ZB_ARG_NOT_NULL(be);
  if (bytes == 0) return ZB_OK;
  ZB_ARG_NOT_NULL(dst);
  ZB_ARG_NOT_NULL(src);
  return be->ops->copy(be, dst, src, bytes);
}

/* Placeholders until the W GEMM work lands (being written now). */
uint16_t zb__float_to_half(float f) { return 0; }
uint16_t zb__float_to_bf16(float f) { return 0; }
