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

/* dw_dtype and overwrite as the entry means them: an entry whose struct_size ends before a field
 * (built against an older zbpp.h, without these two) gets that field's default, fp32 and accumulate. */
static zb_dtype_t entry_dw_dtype(const zb_wgrad_t *e) {
  return e->struct_size >= offsetof(zb_wgrad_t, dw_dtype) + sizeof e->dw_dtype ? e->dw_dtype : ZB_DTYPE_F32;
}
static int entry_overwrite(const zb_wgrad_t *e) {
  return e->struct_size >= offsetof(zb_wgrad_t, overwrite) + sizeof e->overwrite ? e->overwrite != 0 : 0;
}

zb_status_t zb__wgrad_check(const zb_wgrad_t *e) {
  ZB_ARG_NOT_NULL(e);
  /* The first zb_wgrad_t ended at dw_dtype; anything shorter was never a valid entry. */
  if (e->struct_size < offsetof(zb_wgrad_t, dw_dtype))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t.struct_size is %u; set it to sizeof(zb_wgrad_t) (%zu)",
                   (unsigned)e->struct_size, sizeof(zb_wgrad_t));
  if (zb__dtype_size(e->dtype) == 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t.dtype is %d; allowed: ZB_DTYPE_F32, ZB_DTYPE_F16, ZB_DTYPE_BF16",
                   (int)e->dtype);
  zb_dtype_t dw_dtype = entry_dw_dtype(e);
  if (dw_dtype != ZB_DTYPE_F32 && dw_dtype != e->dtype)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t.dw_dtype is %d but dtype is %d; dw and db must be ZB_DTYPE_F32 (0) or "
                   "the input dtype",
                   (int)dw_dtype, (int)e->dtype);
  if (e->struct_size >= offsetof(zb_wgrad_t, overwrite) + sizeof e->overwrite && e->overwrite != 0 &&
      e->overwrite != 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t.overwrite is %d; use 0 (accumulate: beta = 1) or 1 (overwrite: beta = 0)",
                   (int)e->overwrite);
  if (e->rows < 0 || e->in_features < 1 || e->out_features < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t shape rows=%lld in=%lld out=%lld; rows must be >= 0 and the feature "
                   "counts >= 1",
                   (long long)e->rows, (long long)e->in_features, (long long)e->out_features);
  if (e->rows > INT32_MAX || e->in_features > INT32_MAX || e->out_features > INT32_MAX)
    return ZB_FAIL(ZB_ERR_UNSUPPORTED, "zb_wgrad_t dimensions above 2^31-1 are not supported");
  if (!e->dw || (e->rows > 0 && (!e->x || !e->dy)))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_wgrad_t: x, dy and dw must not be NULL");
  if ((e->ldx != ZB_LD_DENSE && e->ldx < e->in_features) || (e->ldy != ZB_LD_DENSE && e->ldy < e->out_features))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wgrad_t leading dimensions ldx=%lld ldy=%lld are below the row lengths "
                   "(%lld, %lld); pass the distance between rows (at least a row), or ZB_LD_DENSE "
                   "for rows back to back (a broadcast input must be copied first)",
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

/* A dense fp32 copy of a [rows, cols] half (f16 or bf16) matrix with leading dimension ld. */
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

/* Rounds n fp32 values back into a dense half (f16 or bf16) buffer, once each, to nearest even. */
static void narrow(void *dst, zb_dtype_t dtype, const float *src, int64_t n) {
  uint16_t *d = dst;
  for (int64_t i = 0; i < n; i++)
    d[i] = dtype == ZB_DTYPE_F16 ? zb__float_to_half(src[i]) : zb__float_to_bf16(src[i]);
}

/* dw[out, in] (+)= dy[rows, out]^T x[rows, in]; db[out] (+)= sum over rows of dy.
 *
 * Everything is computed in fp32: half inputs are widened (exactly), a half dw or db is widened
 * too, the GEMM runs with beta = 1 (accumulate) or beta = 0 (overwrite: the old dw is never read,
 * so NaN garbage in it does not leak), and a half result is rounded back once. The bias sum runs row
 * by row in a fixed order, so it is as deterministic as the GEMM. */
static zb_status_t host_wgrad(zb_backend_t *be, const zb_wgrad_t *e) {
  int64_t rows = e->rows, in = e->in_features, out = e->out_features;
  int64_t ldx = e->ldx != ZB_LD_DENSE ? e->ldx : in, ldy = e->ldy != ZB_LD_DENSE ? e->ldy : out;
  zb_dtype_t dw_dtype = entry_dw_dtype(e);
  int overwrite = entry_overwrite(e);
  if (rows == 0) {
    /* An empty sum: overwrite writes zeros (all-zero bits are +0 in every dtype), else no change. */
    if (overwrite) {
      memset(e->dw, 0, (size_t)(out * in) * zb__dtype_size(dw_dtype));
      if (e->db) memset(e->db, 0, (size_t)out * zb__dtype_size(dw_dtype));
    }
    return ZB_OK;
  }
  const float *x = e->x, *dy = e->dy;
  float *xw = NULL, *dyw = NULL, *dww = NULL, *dbw = NULL;
  float *dw = e->dw, *db = e->db;
  zb_status_t st = ZB_OK;
  if (e->dtype != ZB_DTYPE_F32) {
    xw = widen(e->x, e->dtype, rows, in, ldx);
    dyw = widen(e->dy, e->dtype, rows, out, ldy);
    if (!xw || !dyw) goto oom;
    x = xw, dy = dyw, ldx = in, ldy = out;
  }
  if (dw_dtype != ZB_DTYPE_F32) {
    /* With overwrite the old values are not needed (beta = 0); zeros, not garbage, for a BLAS that
     * would still scale C by beta. */
    dww = overwrite ? calloc((size_t)(out * in), sizeof(float)) : widen(e->dw, dw_dtype, out, in, in);
    if (!dww) goto oom;
    if (e->db) {
      dbw = overwrite ? calloc((size_t)out, sizeof(float)) : widen(e->db, dw_dtype, 1, out, out);
      if (!dbw) goto oom;
    }
    dw = dww, db = dbw;
  }
  zb__host_sgemm(1, 0, (int)out, (int)in, (int)rows, 1.0f, dy, (int)ldy, x, (int)ldx, overwrite ? 0.0f : 1.0f,
                 dw, (int)in);
  if (db) {
    if (overwrite)
      for (int64_t c = 0; c < out; c++) db[c] = 0.0f;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < out; c++) db[c] += dy[r * ldy + c];
  }
  if (dw_dtype != ZB_DTYPE_F32) {
    narrow(e->dw, dw_dtype, dww, out * in);
    if (e->db) narrow(e->db, dw_dtype, dbw, out);
  }
  goto done;
oom:
  st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory widening a W-store entry (rows %lld, in %lld, out %lld)",
               (long long)rows, (long long)in, (long long)out);
done:
  free(xw), free(dyw), free(dww), free(dbw);
  return st;
}

static zb_status_t host_alloc(zb_backend_t *be, size_t bytes, void **out) {
  *out = malloc(bytes ? bytes : 1);
  if (!*out) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "host backend: out of memory allocating %zu bytes", bytes);
  return ZB_OK;
}
static void host_release(zb_backend_t *be, void *ptr) { free(ptr); }

/* Work runs when it is issued, so there is never anything to wait for. */
static zb_status_t host_sync(zb_backend_t *be) { return ZB_OK; }
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
    .sync = host_sync,
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
  return be->ops->sync(be);
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

/* fp32 -> IEEE binary16, round to nearest even; overflow goes to inf, NaN stays a (quiet) NaN, and
 * results below 2^-14 become subnormals rounded at their own (coarser) precision. */
uint16_t zb__float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff)); /* NaN: quiet, top payload */
  /* 65520 = 0x477ff000 is halfway between 65504 (largest half, odd mantissa) and 2^16: ties-to-even
   * goes up, so it and everything above (inf included) is inf. */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);
  if (a >= 0x38800000u) { /* >= 2^-14: a normal half. Rebias the exponent (127 - 15 = 112). */
    uint32_t h = (a - 0x38000000u) >> 13, rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
  }
  /* At most 2^-25 (half the smallest subnormal; the tie goes to even, 0): a signed zero. */
  if (a <= 0x33000000u) return sign;
  /* Subnormal: the result is round(|f| * 2^24) units of 2^-24, |f| = m * 2^(e - 150) with the
   * implicit bit in m, so the shift is 126 - e, between 14 and 24 here. 1024 = the smallest normal. */
  uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
  uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

/* fp32 -> bfloat16 (the top half of a binary32), round to nearest even; adding 0x7fff plus the
 * kept lowest bit rounds ties to even and carries into the exponent, overflowing to inf exactly when
 * it should. NaN is kept quiet so the carry cannot turn it into inf. */
uint16_t zb__float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040);
  x += 0x7fffu + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}
