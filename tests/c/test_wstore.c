/*
 * test_wstore.c - the W store and the host backend's weight-gradient GEMM: FIFO per stage, one
 * release per entry, the accumulation against a naive double-precision product, half types, and
 * misuse errors.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "backend/internal.h"
#include "helpers.h"

typedef struct {
  uint64_t tokens[64];
  int32_t ran[64];
  int n;
} releases_t;

static zb_status_t on_release(void *user, uint64_t token, int32_t ran) {
  releases_t *r = user;
  if (r->n < 64) r->tokens[r->n] = token, r->ran[r->n] = ran;
  r->n++;
  return ZB_OK;
}

/* A one-row entry whose GEMM adds x*dy to dw[0]: lets the test see the order entries ran in. */
static zb_wgrad_t tiny(float *x, float *dy, float *dw, uint64_t token) {
  zb_wgrad_t e = {sizeof(zb_wgrad_t), ZB_DTYPE_F32, 1, 1, 1, x, 0, dy, 0, dw, NULL, token, ZB_DTYPE_F32, 0};
  return e;
}

/* Records like on_release, and fails for token 2 (what a caller's post-GEMM work failing looks like). */
static zb_status_t failing_release(void *user, uint64_t token, int32_t ran) {
  on_release(user, token, ran);
  return token == 2 ? ZB_ERR_INVALID_ARGUMENT : ZB_OK;
}

/* A release callback that fails fails the pop (the W) with its status and the token; the entries
 * after it are dropped unrun, every entry is handed back once, and clear/destroy report it too. */
static void test_failing_release_fails_the_w(void **state) {
  (void)state;
  zb_backend_t *be;
  zb_wstore_t *ws;
  releases_t rel = {0};
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, failing_release, &rel));
  float one = 1, dw[3] = {0, 0, 0};
  ZB_ASSERT_OK(zb_wstore_begin(ws, 0, 0));
  for (int k = 0; k < 3; k++) {
    zb_wgrad_t e = tiny(&one, &one, &dw[k], (uint64_t)k + 1);
    ZB_ASSERT_OK(zb_wstore_push(ws, &e));
  }
  ZB_ASSERT_OK(zb_wstore_end(ws));
  ASSERT_STATUS(zb_wstore_pop_run(ws, 0, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "release callback");
  ASSERT_CONTAINS(zb_last_error(), "token 2");
  assert_int_equal(rel.n, 3);
  assert_int_equal(rel.ran[0], 1), assert_int_equal(rel.ran[1], 1), assert_int_equal(rel.ran[2], 0);
  assert_true(dw[0] == 1 && dw[1] == 1 && dw[2] == 0); /* the third never ran */

  /* Dropped entries: clear reports the failure after handing every entry back. */
  ZB_ASSERT_OK(zb_wstore_begin(ws, 0, 1));
  for (int k = 0; k < 3; k++) {
    zb_wgrad_t e = tiny(&one, &one, &dw[k], (uint64_t)k + 1);
    ZB_ASSERT_OK(zb_wstore_push(ws, &e));
  }
  ZB_ASSERT_OK(zb_wstore_end(ws));
  ASSERT_STATUS(zb_wstore_clear(ws), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "dropped unrun");
  assert_int_equal(rel.n, 6);
  int32_t pending = -1;
  ZB_ASSERT_OK(zb_wstore_pending(ws, -1, &pending));
  assert_int_equal(pending, 0);
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_fifo_per_stage_and_releases(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  releases_t rel = {0};
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, on_release, &rel));
  float one = 1, dw[2] = {0, 0};
  /* dw[0] = 3*dw[0]-style order detection: x differs per microbatch, dy = 1. We record order by
   * the release tokens instead, which the store hands back right after each entry ran. */
  for (int mb = 0; mb < 3; mb++)
    for (int stage = 0; stage < 2; stage++) {
      ZB_ASSERT_OK(zb_wstore_begin(ws, stage, mb));
      zb_wgrad_t e = tiny(&one, &one, &dw[stage], (uint64_t)(stage * 100 + mb));
      ZB_ASSERT_OK(zb_wstore_push(ws, &e));
      ZB_ASSERT_OK(zb_wstore_end(ws));
    }
  int32_t pending;
  ZB_ASSERT_OK(zb_wstore_pending(ws, -1, &pending));
  assert_int_equal(pending, 6);
  ZB_ASSERT_OK(zb_wstore_pending(ws, 1, &pending));
  assert_int_equal(pending, 3);
  int32_t mb;
  ZB_ASSERT_OK(zb_wstore_pop_run(ws, 1, &mb));
  assert_int_equal(mb, 0);
  ZB_ASSERT_OK(zb_wstore_pop_run(ws, 1, &mb));
  assert_int_equal(mb, 1);
  ZB_ASSERT_OK(zb_wstore_pop_run(ws, 0, &mb));
  assert_int_equal(mb, 0);
  assert_int_equal(rel.n, 3);
  assert_int_equal(rel.tokens[0], 100);
  assert_int_equal(rel.tokens[1], 101);
  assert_int_equal(rel.tokens[2], 0);
  for (int k = 0; k < 3; k++) assert_int_equal(rel.ran[k], 1);
  assert_true(dw[1] == 2.0f && dw[0] == 1.0f);
  /* What is left is released unrun, exactly once each, when the store is cleared. */
  ZB_ASSERT_OK(zb_wstore_clear(ws));
  assert_int_equal(rel.n, 6);
  for (int k = 3; k < 6; k++) assert_int_equal(rel.ran[k], 0);
  ZB_ASSERT_OK(zb_wstore_pending(ws, -1, &pending));
  assert_int_equal(pending, 0);
  /* Destroying the backend while the store lives is refused. */
  assert_int_equal(zb_backend_destroy(be), ZB_ERR_BUSY);
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_destroy_releases_pending(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  releases_t rel = {0};
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, on_release, &rel));
  float one = 1, dw = 0;
  ZB_ASSERT_OK(zb_wstore_begin(ws, 4, 0));
  zb_wgrad_t e = tiny(&one, &one, &dw, 7);
  ZB_ASSERT_OK(zb_wstore_push(ws, &e));
  ZB_ASSERT_OK(zb_wstore_push(ws, &e));
  /* Left open on purpose: destroy must release an open group too. */
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  assert_int_equal(rel.n, 2);
  assert_int_equal(rel.ran[0], 0);
  assert_true(dw == 0.0f);
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static double frand(unsigned *s) {
  *s = *s * 1103515245u + 12345u;
  return ((*s >> 8) & 0xffff) / 32768.0 - 1.0;
}

static uint16_t to_bf16(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return (uint16_t)(b >> 16); /* truncation: the test only needs exactly representable inputs */
}

/* binary16 bits of a normal value with at most 10 mantissa bits (the test's k/8 values). */
static uint16_t to_f16(float v) {
  if (v == 0) return 0;
  int e;
  float mnt = frexpf(fabsf(v), &e); /* v = mnt * 2^e with mnt in [0.5, 1) */
  uint16_t h = (uint16_t)(((e - 1 + 15) << 10) | ((uint16_t)((mnt * 2 - 1) * 1024) & 0x3ff));
  return v < 0 ? (uint16_t)(h | 0x8000) : h;
}

/* dw += dy^T x with strides, bias, and beta = 1 accumulation, for every dtype. The inputs are
 * multiples of 1/8 in [-1, 1], exact in fp32, bf16 and fp16, so every dtype must give the fp32
 * answer, which is checked against a double product: the bound is fp32 rounding of sums of
 * rows <= 7 products, 1e-5 relative to the magnitude. */
static void test_gemm_against_naive(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  enum { ROWS = 7, IN = 5, OUT = 3, LDX = 6, LDY = 4 };
  unsigned seed = 1;
  float x[ROWS * LDX], dy[ROWS * LDY];
  for (int k = 0; k < ROWS * LDX; k++) x[k] = (float)(round(frand(&seed) * 8) / 8);
  for (int k = 0; k < ROWS * LDY; k++) dy[k] = (float)(round(frand(&seed) * 8) / 8);
  zb_dtype_t dtypes[3] = {ZB_DTYPE_F32, ZB_DTYPE_BF16, ZB_DTYPE_F16};
  for (int t = 0; t < 3; t++) {
    uint16_t xh[ROWS * LDX], dyh[ROWS * LDY];
    for (int k = 0; k < ROWS * LDX; k++) {
      xh[k] = dtypes[t] == ZB_DTYPE_F16 ? to_f16(x[k]) : to_bf16(x[k]);
    }
    for (int k = 0; k < ROWS * LDY; k++) {
      dyh[k] = dtypes[t] == ZB_DTYPE_F16 ? to_f16(dy[k]) : to_bf16(dy[k]);
    }
    float dw[OUT * IN], db[OUT];
    for (int k = 0; k < OUT * IN; k++) dw[k] = 0.5f; /* beta = 1: the old value must stay in */
    for (int k = 0; k < OUT; k++) db[k] = -0.25f;
    zb_wgrad_t e = {sizeof(zb_wgrad_t), dtypes[t], ROWS, IN, OUT,
                    dtypes[t] == ZB_DTYPE_F32 ? (const void *)x : (const void *)xh, LDX,
                    dtypes[t] == ZB_DTYPE_F32 ? (const void *)dy : (const void *)dyh, LDY, dw, db, 0, ZB_DTYPE_F32, 0};
    ZB_ASSERT_OK(zb_wstore_begin(ws, 0, t));
    ZB_ASSERT_OK(zb_wstore_push(ws, &e));
    ZB_ASSERT_OK(zb_wstore_end(ws));
    ZB_ASSERT_OK(zb_wstore_pop_run(ws, 0, NULL));
    for (int o = 0; o < OUT; o++) {
      double want_b = -0.25;
      for (int r = 0; r < ROWS; r++) want_b += dy[r * LDY + o];
      if (fabs(db[o] - want_b) > 1e-5 * (1 + fabs(want_b)))
        fail_msg("dtype %d db[%d] = %.9g, want %.9g", t, o, db[o], want_b);
      for (int i = 0; i < IN; i++) {
        double want = 0.5;
        for (int r = 0; r < ROWS; r++) want += (double)dy[r * LDY + o] * x[r * LDX + i];
        if (fabs(dw[o * IN + i] - want) > 1e-5 * (1 + fabs(want)))
          fail_msg("dtype %d dw[%d,%d] = %.9g, want %.9g", t, o, i, dw[o * IN + i], want);
      }
    }
  }
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_half_conversions(void **state) {
  /* A few values whose bit patterns are fixed by IEEE 754 binary16 and bfloat16. */
  assert_true(zb__half_to_float(0x3c00) == 1.0f);
  assert_true(zb__half_to_float(0xc000) == -2.0f);
  assert_true(zb__half_to_float(0x0001) == ldexpf(1.0f, -24)); /* smallest subnormal */
  assert_true(zb__half_to_float(0x7bff) == 65504.0f);          /* largest finite */
  assert_true(isinf(zb__half_to_float(0x7c00)));
  assert_true(isnan(zb__half_to_float(0x7e00)));
  assert_true(zb__bf16_to_float(0x3f80) == 1.0f);
  assert_true(zb__bf16_to_float(0xc040) == -3.0f);
}

/* ---- dw_dtype, overwrite, rows = 0, old struct sizes, and the fp32 -> half conversions ---------- */

static void run_one(zb_wstore_t *ws, const zb_wgrad_t *e) {
  ZB_ASSERT_OK(zb_wstore_begin(ws, 0, 0));
  ZB_ASSERT_OK(zb_wstore_push(ws, e));
  ZB_ASSERT_OK(zb_wstore_end(ws));
  ZB_ASSERT_OK(zb_wstore_pop_run(ws, 0, NULL));
}

/* Unit roundoff of storing a result in dtype t (half an ulp, relative). */
static double unit_roundoff(zb_dtype_t t) {
  return t == ZB_DTYPE_F32 ? 0x1p-24 : t == ZB_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
}

/* The error bound of one output element: fp32 summation of n terms (the products or dy values) and
 * the old value has the classical bound gamma_{n+1} ~ (n + 1) 2^-24 times the sum of the terms'
 * magnitudes (we allow twice that), and a half dw_dtype then adds one rounding to nearest: u of the
 * result (2^-11 f16, 2^-8 bf16), plus half the smallest f16 subnormal for results that land there. */
static double bound(int n, double mag, double want, zb_dtype_t out) {
  double fp32 = 2.0 * (n + 1) * 0x1p-24 * mag, u = unit_roundoff(out);
  return out == ZB_DTYPE_F32 ? fp32 : fp32 * (1 + u) + u * fabs(want) + 0x1p-25;
}

/* Every mode of an entry against a double product of the same (rounded) inputs: dw_dtype fp32 or
 * the input dtype, accumulate (the old dw and db must stay in) or overwrite (old values are NaN and
 * must not be read), with and without bias, odd sizes and leading dimensions above the row length. */
static void check_mode(zb_wstore_t *ws, zb_dtype_t dt, zb_dtype_t dwt, int overwrite, int bias) {
  enum { ROWS = 9, IN = 7, OUT = 5, LDX = 8, LDY = 6 };
  float x[ROWS * LDX], dy[ROWS * LDY], dw[OUT * IN], db[OUT]; /* big enough for every dtype */
  double dw0[OUT * IN], db0[OUT];
  for (int k = 0; k < ROWS * LDX; k++) elem_put(x, dt, k, urand(1, dt, k, 0));
  for (int k = 0; k < ROWS * LDY; k++) elem_put(dy, dt, k, urand(2, dt, k, 0));
  for (int k = 0; k < OUT * IN; k++) {
    elem_put(dw, dwt, k, overwrite ? NAN : urand(3, dwt, k, 0));
    dw0[k] = overwrite ? 0 : elem_get(dw, dwt, k);
  }
  for (int k = 0; k < OUT; k++) {
    elem_put(db, dwt, k, overwrite ? NAN : urand(4, dwt, k, 0));
    db0[k] = overwrite ? 0 : elem_get(db, dwt, k);
  }
  zb_wgrad_t e = {sizeof(zb_wgrad_t), dt, ROWS, IN, OUT, x, LDX, dy, LDY, dw, bias ? db : NULL, 0, dwt, overwrite};
  run_one(ws, &e);
  for (int o = 0; o < OUT; o++) {
    for (int i = 0; i < IN; i++) {
      double want = dw0[o * IN + i], mag = fabs(want);
      for (int r = 0; r < ROWS; r++) {
        double t = elem_get(dy, dt, r * LDY + o) * elem_get(x, dt, r * LDX + i);
        want += t, mag += fabs(t);
      }
      double got = elem_get(dw, dwt, o * IN + i), err = fabs(got - want), b = bound(ROWS, mag, want, dwt);
      if (!(err <= b)) /* NaN fails too */
        fail_msg("dtype %d dw_dtype %d overwrite %d bias %d: dw[%d,%d] = %.9g, want %.9g (error %.3g > %.3g)",
                 dt, dwt, overwrite, bias, o, i, got, want, err, b);
    }
    double want = db0[o], mag = fabs(want);
    for (int r = 0; r < ROWS; r++) want += elem_get(dy, dt, r * LDY + o), mag += fabs(elem_get(dy, dt, r * LDY + o));
    double got = elem_get(db, dwt, o);
    if (bias && !(fabs(got - want) <= bound(ROWS, mag, want, dwt)))
      fail_msg("dtype %d dw_dtype %d overwrite %d: db[%d] = %.9g, want %.9g", dt, dwt, overwrite, o, got, want);
    if (!bias && !(overwrite ? isnan(got) : got == db0[o]))
      fail_msg("db is NULL in the entry, yet the buffer changed: db[%d] = %.9g", o, got);
  }
}

static void test_dw_dtype_and_overwrite(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  const zb_dtype_t pairs[5][2] = {{ZB_DTYPE_F32, ZB_DTYPE_F32},   {ZB_DTYPE_BF16, ZB_DTYPE_F32},
                                  {ZB_DTYPE_BF16, ZB_DTYPE_BF16}, {ZB_DTYPE_F16, ZB_DTYPE_F32},
                                  {ZB_DTYPE_F16, ZB_DTYPE_F16}};
  for (int p = 0; p < 5; p++)
    for (int overwrite = 0; overwrite < 2; overwrite++)
      for (int bias = 0; bias < 2; bias++) check_mode(ws, pairs[p][0], pairs[p][1], overwrite, bias);
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* rows = 0 is an empty sum: overwrite makes dw and db zero, accumulate leaves them as they were. */
static void test_rows_zero(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  const zb_dtype_t pairs[2][2] = {{ZB_DTYPE_F32, ZB_DTYPE_F32}, {ZB_DTYPE_BF16, ZB_DTYPE_BF16}};
  for (int p = 0; p < 2; p++)
    for (int overwrite = 0; overwrite < 2; overwrite++) {
      unsigned char dw[3 * 4 * 4], db[3 * 4], dw_before[sizeof dw], db_before[sizeof db];
      memset(dw, 0x7e, sizeof dw), memset(db, 0x7e, sizeof db); /* NaN-ish garbage in every dtype */
      memcpy(dw_before, dw, sizeof dw), memcpy(db_before, db, sizeof db);
      zb_wgrad_t e = {sizeof(zb_wgrad_t), pairs[p][0], 0, 4, 3, NULL, 0, NULL, 0, dw, db, 0, pairs[p][1], overwrite};
      run_one(ws, &e);
      for (int k = 0; k < 12; k++) {
        double got = elem_get(dw, pairs[p][1], k);
        if (overwrite ? got != 0.0 : memcmp(dw, dw_before, sizeof dw) != 0)
          fail_msg("rows 0, dw_dtype %d, overwrite %d: dw[%d] = %g", pairs[p][1], overwrite, k, got);
      }
      for (int k = 0; k < 3; k++) {
        double got = elem_get(db, pairs[p][1], k);
        if (overwrite ? got != 0.0 : memcmp(db, db_before, sizeof db) != 0)
          fail_msg("rows 0, dw_dtype %d, overwrite %d: db[%d] = %g", pairs[p][1], overwrite, k, got);
      }
    }
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* An entry from a caller built against the zbpp.h before dw_dtype and overwrite: its struct_size
 * ends where dw_dtype starts, and whatever lies in those bytes must be ignored (fp32, accumulate). */
static void test_old_struct_size_defaults(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  float x = 2, dy = 3, dw = 1, db = 0.5f;
  zb_wgrad_t e = {offsetof(zb_wgrad_t, dw_dtype), ZB_DTYPE_F32, 1, 1, 1, &x, 0, &dy, 0, &dw, &db, 0,
                  (zb_dtype_t)7, 1};
  run_one(ws, &e);
  if (dw != 7.0f || db != 3.5f) fail_msg("old-size entry: dw = %g (want 1 + 3*2 = 7), db = %g (want 3.5)", dw, db);
  /* One that has dw_dtype but ends before overwrite keeps its dw_dtype and accumulates. */
  e.struct_size = offsetof(zb_wgrad_t, overwrite);
  e.dw_dtype = ZB_DTYPE_F32;
  run_one(ws, &e);
  if (dw != 13.0f || db != 6.5f) fail_msg("entry without overwrite: dw = %g (want 13), db = %g (want 6.5)", dw, db);
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_rejected_dw_dtype(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  ZB_ASSERT_OK(zb_wstore_begin(ws, 0, 0));
  uint16_t x = 0, dy = 0, dw = 0;
  const zb_dtype_t bad[3][2] = {{ZB_DTYPE_F16, ZB_DTYPE_BF16}, {ZB_DTYPE_F32, ZB_DTYPE_F16}, {ZB_DTYPE_BF16, 9}};
  for (int k = 0; k < 3; k++) {
    zb_wgrad_t e = {sizeof(zb_wgrad_t), bad[k][0], 1, 1, 1, &x, 0, &dy, 0, &dw, NULL, 0, bad[k][1], 0};
    ASSERT_STATUS(zb_wstore_push(ws, &e), ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "dw_dtype");
    ASSERT_CONTAINS(zb_last_error(), "ZB_DTYPE_F32");
  }
  zb_wgrad_t e = {sizeof(zb_wgrad_t), ZB_DTYPE_F32, 1, 1, 1, &x, 0, &dy, 0, &dw, NULL, 0, ZB_DTYPE_F32, 2};
  ASSERT_STATUS(zb_wstore_push(ws, &e), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "overwrite is 2");
  e.overwrite = 0;
  e.struct_size = offsetof(zb_wgrad_t, dw_dtype) - 8; /* shorter than any zb_wgrad_t ever was */
  ASSERT_STATUS(zb_wstore_push(ws, &e), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "struct_size");
  int32_t pending;
  ZB_ASSERT_OK(zb_wstore_end(ws));
  ZB_ASSERT_OK(zb_wstore_pending(ws, 0, &pending));
  assert_int_equal(pending, 1); /* the group exists, with nothing in it */
  ZB_ASSERT_OK(zb_wstore_pop_run(ws, 0, NULL));
  assert_true(dw == 0);
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* One narrowing, float_to (zb__float_to_half or _bf16) against its widening to_float. Every bit
 * pattern round-trips exactly (NaN to a NaN); the midpoint of every two neighbouring finite values
 * (exact in fp32: both formats have far fewer significant bits) goes to the one with the even
 * pattern, one fp32 ulp off the midpoint goes to the nearer neighbour, and the sign is symmetric. The
 * midpoint above the largest finite value rounds to inf. */
static void check_narrowing(const char *name, uint16_t (*float_to)(float), float (*to_float)(uint16_t),
                            uint16_t max_finite) {
  for (uint32_t h = 0; h <= 0xffff; h++) {
    float f = to_float((uint16_t)h);
    uint16_t back = float_to(f);
    if (isnan(f) ? !isnan(to_float(back)) : back != h)
      fail_msg("%s: 0x%04x (%g) came back as 0x%04x", name, (unsigned)h, f, (unsigned)back);
  }
  for (uint32_t h = 0; h <= max_finite; h++) {
    /* Above the largest finite value the next step would be 2^(emax + 1): extrapolate it. */
    double lo = to_float((uint16_t)h);
    double hi = h < max_finite ? to_float((uint16_t)(h + 1)) : 2 * lo - to_float((uint16_t)(h - 1));
    float mid = (float)((lo + hi) / 2);
    uint16_t even = h < max_finite ? (uint16_t)((h & 1) ? h + 1 : h) : (uint16_t)(h + 1); /* h + 1: inf */
    uint16_t got = float_to(mid), got_neg = float_to(-mid);
    uint16_t up = float_to(nextafterf(mid, INFINITY)), down = float_to(nextafterf(mid, 0));
    if (got != even || got_neg != (even | 0x8000) || up != h + 1 || down != h)
      fail_msg("%s: midpoint %.9g of 0x%04x and its neighbour: got 0x%04x (-: 0x%04x), up 0x%04x, down 0x%04x; "
               "want 0x%04x, 0x%04x, 0x%04x",
               name, mid, (unsigned)h, got, got_neg, up, down, even, (unsigned)(h + 1), (unsigned)h);
  }
  uint32_t quiet_low = 0x7f800001u; /* a NaN whose payload lies only in bits both formats drop */
  float nan_low;
  memcpy(&nan_low, &quiet_low, 4);
  assert_true(isnan(to_float(float_to(nan_low))) && isnan(to_float(float_to(NAN))));
  assert_int_equal(float_to(INFINITY), max_finite + 1);
  assert_int_equal(float_to(-INFINITY), (max_finite + 1) | 0x8000);
  assert_int_equal(float_to(FLT_MAX), max_finite + 1);
  assert_int_equal(float_to(-0.0f), 0x8000);
}

static void test_float_to_half_bf16(void **state) {
  check_narrowing("float_to_half", zb__float_to_half, zb__half_to_float, 0x7bff);
  check_narrowing("float_to_bf16", zb__float_to_bf16, zb__bf16_to_float, 0x7f7f);
  /* Values fixed by the formats: 65520 is the tie between 65504 and 2^16, and 2^-25 the tie between
   * 0 and the smallest f16 subnormal; 1 + 2^-8 is the tie between bf16's 1 and 1 + 2^-7. */
  assert_int_equal(zb__float_to_half(65520.0f), 0x7c00);
  assert_int_equal(zb__float_to_half(65519.0f), 0x7bff);
  assert_int_equal(zb__float_to_half(0x1p-25f), 0x0000);
  assert_int_equal(zb__float_to_half(0x1.000002p-25f), 0x0001);
  assert_int_equal(zb__float_to_half(0x1p-24f), 0x0001);
  assert_int_equal(zb__float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  assert_int_equal(zb__float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  assert_int_equal(zb__float_to_bf16(FLT_TRUE_MIN), 0x0000);
}

static void test_misuse(void **state) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  float one = 1, dw = 0;
  zb_wgrad_t e = tiny(&one, &one, &dw, 0);
  assert_int_equal(zb_wstore_push(ws, &e), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "outside a backward op"));
  assert_int_equal(zb_wstore_pop_run(ws, 3, NULL), ZB_ERR_INVALID_SCHEDULE);
  assert_non_null(strstr(zb_last_error(), "no pending group for that stage"));
  assert_int_equal(zb_wstore_end(ws), ZB_ERR_INVALID_ARGUMENT);
  ZB_ASSERT_OK(zb_wstore_begin(ws, 0, 0));
  assert_int_equal(zb_wstore_begin(ws, 1, 0), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "still open"));
  zb_wgrad_t bad = e;
  bad.dtype = (zb_dtype_t)9;
  assert_int_equal(zb_wstore_push(ws, &bad), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "ZB_DTYPE_BF16"));
  bad = e;
  bad.in_features = 4;
  bad.ldx = 2;
  assert_int_equal(zb_wstore_push(ws, &bad), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "leading dimensions"));
  bad = e;
  bad.dw = NULL;
  assert_int_equal(zb_wstore_push(ws, &bad), ZB_ERR_INVALID_ARGUMENT);
  bad = e;
  bad.struct_size = 8;
  assert_int_equal(zb_wstore_push(ws, &bad), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "struct_size"));
  ZB_ASSERT_OK(zb_wstore_end(ws));
  assert_int_equal(zb_wstore_begin(ws, -1, 0), ZB_ERR_INVALID_ARGUMENT);
  ZB_ASSERT_OK(zb_wstore_destroy(NULL));
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  ZB_ASSERT_OK(zb_backend_destroy(be));
  ZB_ASSERT_OK(zb_backend_destroy(NULL));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_failing_release_fails_the_w),
      cmocka_unit_test(test_fifo_per_stage_and_releases),
      cmocka_unit_test(test_destroy_releases_pending),
      cmocka_unit_test(test_gemm_against_naive),
      cmocka_unit_test(test_half_conversions),
      cmocka_unit_test(test_misuse),
      cmocka_unit_test(test_dw_dtype_and_overwrite),
      cmocka_unit_test(test_rows_zero),
      cmocka_unit_test(test_old_struct_size_defaults),
      cmocka_unit_test(test_rejected_dw_dtype),
      cmocka_unit_test(test_float_to_half_bf16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
