/*
 * gpu_wgrad.c - the W store's GEMMs on the CUDA backend (cuBLASLt + the bias kernel) against a
 * float64 product of the same rounded inputs: every input dtype (fp32, bf16, f16), dw in fp32 or in
 * the input dtype, accumulate and overwrite, with and without bias, odd sizes, leading dimensions
 * above the row length, buffers that start off cuBLASLt's preferred alignment, rows = 0, and one
 * large GEMM. Then: the same entry twice accumulates, the same shape again gives the same bits (the
 * cached algorithm), and more distinct shapes than the plan cache holds still all come out right.
 *
 * Error bounds (per element, measured against mag = |old value| + sum over rows of |dy * x|, or of
 * |dy| for the bias):
 *   - fp32 inputs: true fp32 products and sums (CUBLAS_COMPUTE_32F, TF32 not allowed); summation
 *     in whatever blocked order the algorithm uses stays within 1e-5 * sqrt(rows + 1) of mag (the
 *     worst case (rows + 1) 2^-24 is reached only by adversarial inputs; the bound is still ~10x
 *     below what TF32's 2^-11 input rounding gives at the small row counts tested).
 *   - bf16/f16 inputs with fp32 dw: a product of two 8- or 11-bit significands is exact in fp32, so
 *     only the fp32 summation errs: the same bound.
 *   - dw in bf16/f16: the same, then one rounding to nearest of the result: plus u * |want| with
 *     u = 2^-8 (bf16) or 2^-11 (f16), and 2^-25 absolute for f16 results in the subnormal range.
 *
 * Exits 77 (skipped) without a CUDA build or a GPU; it cannot pass or fail anywhere else.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/internal.h"
#include "helpers.h"

typedef struct {
  zb_backend_t *be;
  zb_wstore_t *ws;
} gpu_t;

static int setup(void **state) {
  gpu_t *g = calloc(1, sizeof *g);
  zb_cuda_backend_config_t cfg = ZB_CUDA_BACKEND_CONFIG_INIT;
  if (!g || zb_backend_create_cuda(&g->be, &cfg) != ZB_OK) {
    fprintf(stderr, "CUDA backend: %s\n", zb_last_error());
    free(g);
    return -1;
  }
  if (zb_wstore_create(&g->ws, g->be, NULL, NULL) != ZB_OK) {
    fprintf(stderr, "W store: %s\n", zb_last_error());
    zb_backend_destroy(g->be);
    free(g);
    return -1;
  }
  *state = g;
  return 0;
}

static int teardown(void **state) {
  gpu_t *g = *state;
  int bad = zb_wstore_destroy(g->ws) != ZB_OK || zb_backend_destroy(g->be) != ZB_OK;
  free(g);
  return bad ? -1 : 0;
}

static size_t dsize(zb_dtype_t t) { return t == ZB_DTYPE_F32 ? 4 : 2; }
static const char *dname(zb_dtype_t t) { return t == ZB_DTYPE_F32 ? "fp32" : t == ZB_DTYPE_F16 ? "f16" : "bf16"; }

static void *dev_alloc(gpu_t *g, size_t bytes) {
  void *p = NULL;
  ZB_ASSERT_OK(zb_backend_alloc(g->be, bytes, &p));
  return p;
}
static void upload(gpu_t *g, void *dev, const void *host, size_t bytes) {
  ZB_ASSERT_OK(zb_backend_copy(g->be, dev, host, bytes));
}
static void download(gpu_t *g, void *host, const void *dev, size_t bytes) {
  ZB_ASSERT_OK(zb_backend_copy(g->be, host, dev, bytes));
  ZB_ASSERT_OK(zb_backend_synchronize(g->be));
}
static void run_entry(gpu_t *g, const zb_wgrad_t *e) {
  ZB_ASSERT_OK(zb_wstore_begin(g->ws, 0, 0));
  ZB_ASSERT_OK(zb_wstore_push(g->ws, e));
  ZB_ASSERT_OK(zb_wstore_end(g->ws));
  ZB_ASSERT_OK(zb_wstore_pop_run(g->ws, 0, NULL));
}

/* The bound of the header comment. */
static double bound(int64_t rows, double mag, double want, zb_dtype_t out) {
  double acc = 1e-5 * sqrt((double)rows + 1) * mag;
  if (out == ZB_DTYPE_F32) return acc;
  double u = out == ZB_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
  return acc * (1 + u) + u * fabs(want) + (out == ZB_DTYPE_F16 ? 0x1p-25 : 0);
}

typedef struct {
  int64_t rows, in, out, ldx, ldy; /* ld 0: dense */
  int offset;                      /* x and dy start this many elements into their allocations */
} shape_t;

/* One (shape, input dtype): the inputs, host and device, shared by every output mode. */
typedef struct {
  shape_t s;
  zb_dtype_t dt;
  int64_t ldx, ldy;
  void *xh, *dyh;  /* host, in dt, [rows, ld] */
  void *xd, *dyd;  /* device allocations; the entry points `offset` elements in */
} inputs_t;

static void inputs_make(gpu_t *g, inputs_t *in, shape_t s, zb_dtype_t dt) {
  memset(in, 0, sizeof *in);
  in->s = s, in->dt = dt;
  in->ldx = s.ldx ? s.ldx : s.in, in->ldy = s.ldy ? s.ldy : s.out;
  if (s.rows == 0) return; /* x and dy stay NULL, as the contract allows */
  size_t nx = (size_t)(s.rows * in->ldx), ny = (size_t)(s.rows * in->ldy), es = dsize(dt);
  in->xh = malloc(nx * es), in->dyh = malloc(ny * es);
  assert_non_null(in->xh), assert_non_null(in->dyh);
  for (size_t k = 0; k < nx; k++) elem_put(in->xh, dt, (int64_t)k, urand(11, (uint64_t)s.rows, dt, k));
  for (size_t k = 0; k < ny; k++) elem_put(in->dyh, dt, (int64_t)k, urand(12, (uint64_t)s.rows, dt, k));
  in->xd = dev_alloc(g, (nx + (size_t)s.offset) * es), in->dyd = dev_alloc(g, (ny + (size_t)s.offset) * es);
  upload(g, (char *)in->xd + (size_t)s.offset * es, in->xh, nx * es);
  upload(g, (char *)in->dyd + (size_t)s.offset * es, in->dyh, ny * es);
}

static void inputs_free(gpu_t *g, inputs_t *in) {
  ZB_ASSERT_OK(zb_backend_free(g->be, in->xd));
  ZB_ASSERT_OK(zb_backend_free(g->be, in->dyd));
  free(in->xh), free(in->dyh);
}

static zb_wgrad_t entry_of(const inputs_t *in, void *dw, void *db, zb_dtype_t dwt, int overwrite) {
  size_t es = dsize(in->dt);
  zb_wgrad_t e = {sizeof(zb_wgrad_t), in->dt, in->s.rows, in->s.in, in->s.out,
                  in->xd ? (char *)in->xd + (size_t)in->s.offset * es : NULL, in->s.ldx,
                  in->dyd ? (char *)in->dyd + (size_t)in->s.offset * es : NULL, in->s.ldy,
                  dw, db, 0, dwt, overwrite};
  return e;
}

/* sum_r dy[r, o] x[r, i] in double, and sum_r |dy[r, o] x[r, i]| (the error's scale). */
static double ref_dw(const inputs_t *in, int64_t o, int64_t i, double *mag) {
  double s = 0, m = 0;
  for (int64_t r = 0; r < in->s.rows; r++) {
    double t = elem_get(in->dyh, in->dt, r * in->ldy + o) * elem_get(in->xh, in->dt, r * in->ldx + i);
    s += t, m += fabs(t);
  }
  *mag = m;
  return s;
}
static double ref_db(const inputs_t *in, int64_t o, double *mag) {
  double s = 0, m = 0;
  for (int64_t r = 0; r < in->s.rows; r++) {
    double t = elem_get(in->dyh, in->dt, r * in->ldy + o);
    s += t, m += fabs(t);
  }
  *mag = m;
  return s;
}

/* Which dw elements to check: all of a small one, else the corners and 509 spread pseudo-randomly. */
static int64_t pick(int64_t k, int64_t total) {
  if (total <= 65536) return k;
  if (k < 2) return k * (total - 1);
  return (int64_t)(mix((uint64_t)k) % (uint64_t)total);
}

static void check_mode(gpu_t *g, const inputs_t *in, zb_dtype_t dwt, int overwrite, int bias) {
  const shape_t s = in->s;
  const int64_t n = s.out * s.in, es = (int64_t)dsize(dwt);
  void *dwh = malloc((size_t)(n * es)), *dbh = malloc((size_t)(s.out * es));
  void *dw0 = malloc((size_t)(n * es)), *db0 = malloc((size_t)(s.out * es));
  assert_true(dwh && dbh && dw0 && db0);
  for (int64_t k = 0; k < n; k++) elem_put(dw0, dwt, k, overwrite ? NAN : urand(13, (uint64_t)n, dwt, (uint64_t)k));
  for (int64_t k = 0; k < s.out; k++) elem_put(db0, dwt, k, overwrite ? NAN : urand(14, (uint64_t)n, dwt, (uint64_t)k));
  void *dwd = dev_alloc(g, (size_t)(n * es)), *dbd = dev_alloc(g, (size_t)(s.out * es));
  upload(g, dwd, dw0, (size_t)(n * es));
  upload(g, dbd, db0, (size_t)(s.out * es));
  zb_wgrad_t e = entry_of(in, dwd, bias ? dbd : NULL, dwt, overwrite);
  run_entry(g, &e);
  download(g, dwh, dwd, (size_t)(n * es));
  download(g, dbh, dbd, (size_t)(s.out * es));

  const int64_t checks = n <= 65536 ? n : 511;
  for (int64_t k = 0; k < checks; k++) {
    int64_t idx = pick(k, n), o = idx / s.in, i = idx % s.in;
    double mag, want = ref_dw(in, o, i, &mag), old = overwrite ? 0 : elem_get(dw0, dwt, idx);
    want += old, mag += fabs(old);
    double got = elem_get(dwh, dwt, idx), b = bound(s.rows, mag, want, dwt);
    if (!(fabs(got - want) <= b)) /* NaN fails too: an overwrite that read the old NaN */
      fail_msg("%s x/dy, %s dw, %s, bias %d, rows %lld in %lld out %lld ldx %lld ldy %lld offset %d: "
               "dw[%lld, %lld] = %.9g, want %.9g (error %.3g > bound %.3g; mag %.3g)",
               dname(in->dt), dname(dwt), overwrite ? "overwrite" : "accumulate", bias, (long long)s.rows,
               (long long)s.in, (long long)s.out, (long long)s.ldx, (long long)s.ldy, s.offset, (long long)o,
               (long long)i, got, want, fabs(got - want), b, mag);
  }
  for (int64_t o = 0; o < s.out; o++) {
    double mag, want = ref_db(in, o, &mag), old = elem_get(db0, dwt, o), got = elem_get(dbh, dwt, o);
    if (!bias) {
      /* No bias in the entry: the buffer is untouched, NaN included. */
      if (memcmp((char *)dbh + o * es, (char *)db0 + o * es, (size_t)es) != 0)
        fail_msg("db was NULL in the entry but db[%lld] changed to %.9g", (long long)o, got);
      continue;
    }
    if (!overwrite) want += old, mag += fabs(old);
    if (!(fabs(got - want) <= bound(s.rows, mag, want, dwt)))
      fail_msg("%s x/dy, %s db, %s, rows %lld out %lld: db[%lld] = %.9g, want %.9g", dname(in->dt), dname(dwt),
               overwrite ? "overwrite" : "accumulate", (long long)s.rows, (long long)s.out, (long long)o, got, want);
  }
  ZB_ASSERT_OK(zb_backend_free(g->be, dwd));
  ZB_ASSERT_OK(zb_backend_free(g->be, dbd));
  free(dwh), free(dbh), free(dw0), free(db0);
}

static void test_every_mode_against_float64(void **state) {
  gpu_t *g = *state;
  const shape_t shapes[] = {
      {1, 1, 1, 0, 0, 0},          /* one product: TF32 would show as a 2^-11 relative error */
      {3, 5, 7, 0, 0, 0},
      {37, 19, 23, 0, 0, 0},       /* odd sizes */
      {60, 19, 23, 0, 0, 0},       /* the same bucket of rows (64): the plan resized, its algorithm checked */
      {5000, 16, 40, 0, 0, 0},     /* few columns, many rows: the bias sums split over row ranges */
      {33, 17, 9, 24, 13, 0},      /* leading dimensions above the row lengths */
      {45, 31, 29, 33, 35, 1},     /* odd leading dimensions, x and dy one element off alignment */
      {0, 5, 7, 0, 0, 0},          /* an empty sum */
      {4096, 1024, 1024, 0, 0, 0}, /* large: sampled elements */
  };
  const zb_dtype_t dts[3] = {ZB_DTYPE_F32, ZB_DTYPE_BF16, ZB_DTYPE_F16};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int t = 0; t < 3; t++) {
      inputs_t in;
      inputs_make(g, &in, shapes[si], dts[t]);
      for (int w = 0; w < (dts[t] == ZB_DTYPE_F32 ? 1 : 2); w++)
        for (int overwrite = 0; overwrite < 2; overwrite++)
          for (int bias = 0; bias < 2; bias++) check_mode(g, &in, w ? dts[t] : ZB_DTYPE_F32, overwrite, bias);
      inputs_free(g, &in);
    }
}

/* Runs `e` `times` times (accumulating) and checks dw and db against old + times * the product. */
static void check_repeated(gpu_t *g, const inputs_t *in, const float *dw, const float *db, const float *dw0,
                           const float *db0, int times) {
  const shape_t s = in->s;
  for (int64_t o = 0; o < s.out; o++) {
    for (int64_t i = 0; i < s.in; i++) {
      double mag, want = times * ref_dw(in, o, i, &mag) + dw0[o * s.in + i];
      mag = times * mag + fabs(dw0[o * s.in + i]);
      /* times GEMMs, whose bounds add up to the bound of the total magnitude, plus the rounding of
       * each beta = 1 addition (at most 2^-24 of the total magnitude each). */
      double b = bound(s.rows, mag, want, ZB_DTYPE_F32) + times * 0x1p-24 * mag;
      if (!(fabs(dw[o * s.in + i] - want) <= b))
        fail_msg("%s, after %d accumulating runs: dw[%lld, %lld] = %.9g, want %.9g (bound %.3g)", dname(in->dt),
                 times, (long long)o, (long long)i, dw[o * s.in + i], want, b);
    }
    double mag, want = times * ref_db(in, o, &mag) + db0[o];
    mag = times * mag + fabs(db0[o]);
    double b = bound(s.rows, mag, want, ZB_DTYPE_F32) + times * 0x1p-24 * mag;
    if (!(fabs(db[o] - want) <= b))
      fail_msg("%s, after %d runs: db[%lld] = %.9g, want %.9g", dname(in->dt), times, (long long)o, db[o], want);
  }
}

/* beta = 1 really accumulates across runs; a cached plan gives the same bits again, also after other
 * shapes ran in between; and more shapes than the cache holds (64) all still compute right. */
static void test_repeats_and_cache(void **state) {
  gpu_t *g = *state;
  const zb_dtype_t dts[3] = {ZB_DTYPE_F32, ZB_DTYPE_BF16, ZB_DTYPE_F16};
  for (int t = 0; t < 3; t++) {
    inputs_t a, b;
    inputs_make(g, &a, (shape_t){64, 48, 40, 0, 0, 0}, dts[t]);
    inputs_make(g, &b, (shape_t){33, 20, 12, 0, 0, 0}, dts[t]);
    enum { NA = 48 * 40, NB = 20 * 12 };
    float dw0[NA], db0[40], dw[NA], db[40], first[NA], again[NA], zero_b[NB + 12];
    for (int k = 0; k < NA; k++) dw0[k] = urand(21, (uint64_t)t, (uint64_t)k, 0);
    for (int k = 0; k < 40; k++) db0[k] = urand(22, (uint64_t)t, (uint64_t)k, 0);
    memset(zero_b, 0, sizeof zero_b);
    float *dwd = dev_alloc(g, sizeof dw), *dbd = dev_alloc(g, sizeof db), *other = dev_alloc(g, sizeof zero_b);
    upload(g, dwd, dw0, sizeof dw0);
    upload(g, dbd, db0, sizeof db0);
    upload(g, other, zero_b, sizeof zero_b);
    zb_wgrad_t ea = entry_of(&a, dwd, dbd, ZB_DTYPE_F32, 0), eb = entry_of(&b, other, other + NB, ZB_DTYPE_F32, 0);
    run_entry(g, &ea);
    run_entry(g, &ea);
    download(g, dw, dwd, sizeof dw);
    download(g, db, dbd, sizeof db);
    check_repeated(g, &a, dw, db, dw0, db0, 2);
    for (int k = 0; k < 30; k++) run_entry(g, &eb), run_entry(g, &ea);
    download(g, dw, dwd, sizeof dw);
    download(g, db, dbd, sizeof db);
    check_repeated(g, &a, dw, db, dw0, db0, 32);
    download(g, dw, other, sizeof(float) * NB);
    download(g, db, other + NB, sizeof(float) * 12);
    check_repeated(g, &b, dw, db, zero_b, zero_b + NB, 30);
    /* Overwrite twice with another shape in between: the same plan, so the same bits. */
    ea.overwrite = 1;
    run_entry(g, &ea);
    download(g, first, dwd, sizeof first);
    run_entry(g, &eb);
    run_entry(g, &ea);
    download(g, again, dwd, sizeof again);
    if (memcmp(first, again, sizeof first) != 0)
      fail_msg("%s: the same overwrite GEMM gave different bits", dname(dts[t]));
    ZB_ASSERT_OK(zb_backend_free(g->be, dwd));
    ZB_ASSERT_OK(zb_backend_free(g->be, dbd));
    ZB_ASSERT_OK(zb_backend_free(g->be, other));
    inputs_free(g, &a), inputs_free(g, &b);
  }
  /* 70 distinct row counts (more than the 64 cached plans), then the first ones again (evicted). */
  for (int pass = 0; pass < 2; pass++)
    for (int rows = 1; rows <= (pass ? 8 : 70); rows++) {
      inputs_t in;
      inputs_make(g, &in, (shape_t){rows, 6, 5, 0, 0, 0}, ZB_DTYPE_BF16);
      check_mode(g, &in, ZB_DTYPE_F32, 1, 1);
      inputs_free(g, &in);
    }
}

int main(void) {
  int32_t devices = 0;
  zb_cuda_device_count(&devices);
  if (!zb_cuda_built() || devices < 1) {
    printf("gpu_wgrad: skipped (%s)\n", zb_cuda_built() ? "no CUDA device" : "built without CUDA");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_every_mode_against_float64, setup, teardown),
      cmocka_unit_test_setup_teardown(test_repeats_and_cache, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
