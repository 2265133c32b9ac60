/*
 * test_wstore.c - the W store and the host backend's weight-gradient GEMM: FIFO per stage, one
 * release per entry, the accumulation against a naive double-precision product, half types, and
 * misuse errors.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/internal.h"
#include "helpers.h"

typedef struct {
  uint64_t tokens[64];
  int32_t ran[64];
  int n;
} releases_t;

static void on_release(void *user, uint64_t token, int32_t ran) {
  releases_t *r = user;
  if (r->n < 64) r->tokens[r->n] = token, r->ran[r->n] = ran;
  r->n++;
}

/* A one-row entry whose GEMM adds x*dy to dw[0]: lets the test see the order entries ran in. */
static zb_wgrad_t tiny(float *x, float *dy, float *dw, uint64_t token) {
  zb_wgrad_t e = {sizeof(zb_wgrad_t), ZB_DTYPE_F32, 1, 1, 1, x, 0, dy, 0, dw, NULL, token, ZB_DTYPE_F32, 0};
  return e;
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
      cmocka_unit_test(test_fifo_per_stage_and_releases),
      cmocka_unit_test(test_destroy_releases_pending),
      cmocka_unit_test(test_gemm_against_naive),
      cmocka_unit_test(test_half_conversions),
      cmocka_unit_test(test_misuse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
