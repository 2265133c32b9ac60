/*
 * test_kernels_ref.c - the optimizer kernels of zbpp.h (zb_sq_norm, zb_unscale,
 * zb_loss_scale_update, zb_optim_step, zb_optim_undo, zb_optim_undo_bytes) on the host backend,
 * through the public API, as a user sees them:
 *  - the squared norm is the sequential double sum the header promises, and inf/NaN is flagged
 *    in every dtype;
 *  - unscale multiplies in fp32 and rounds to the dtype to nearest even, flagging results that
 *    overflow;
 *  - the loss scale follows GradScaler's rule, written here again;
 *  - AdamW and SGD (with and without momentum, weight decay, a factor, half gradients) agree with a
 *    double-precision implementation written here, and bit for bit with zb_optimizer on the same
 *    data, and half gradients give the bits of their fp32 widening;
 *  - zb_optim_undo restores parameters and state bit for bit; the undo sizes are as documented.
 * Values are chosen exactly representable in every dtype (multiples of 1/64 up to 4), so expected
 * results come from the rules, never from running the code under test. The GPU kernels are
 * compared against this backend in gpu_kernels.c; the argument checks (ops.c) are test_ops.c's.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

static const zb_dtype_t kDtypes[] = {ZB_DTYPE_F32, ZB_DTYPE_BF16, ZB_DTYPE_F16};
static const char *const kDtypeNames[] = {"f32", "f16", "bf16"}; /* indexed by zb_dtype_t */

/* ---- exact encodings (the test's own, for values that need no rounding) ------------------------ */

static uint16_t bf16_exact(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  if (b & 0xffffu) fail_msg("%g is not a bfloat16 value", (double)f);
  return (uint16_t)(b >> 16);
}

static uint16_t f16_exact(float f) {
  const uint16_t sign = signbit(f) ? 0x8000u : 0;
  const float a = fabsf(f);
  if (a == 0) return sign;
  int e;
  frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1): the binary16 exponent field is e - 1 + 15 */
  const int field = e + 14;
  const double man = field >= 1 ? ldexp(a, 11 - e) - 1024 : ldexp(a, 24);
  if (field > 30 || man != floor(man)) fail_msg("%g is not a binary16 value", (double)f);
  return (uint16_t)(sign | (field >= 1 ? field << 10 : 0) | (uint16_t)man);
}

/* A value every dtype holds exactly: k/64 with |k| <= 256. */
static float qval(uint64_t a, uint64_t b, uint64_t c) { return roundf(urand(a, b, c, 7) * 256) / 64; }

/* ---- tensor lists in host-backend memory ------------------------------------------------------ */

enum { MAXT = 8 };
typedef struct {
  zb_backend_t *be;
  zb_dtype_t dtype;
  void *ptrs[MAXT];
  int64_t numels[MAXT];
  zb_tensor_list_t list;
} tl_t;

static void tl_make(tl_t *t, zb_backend_t *be, zb_dtype_t dtype, int count, const int64_t *numels) {
  memset(t, 0, sizeof *t);
  t->be = be, t->dtype = dtype;
  const size_t esize = dtype == ZB_DTYPE_F32 ? 4 : 2;
  for (int k = 0; k < count; k++) {
    t->numels[k] = numels[k];
    ZB_ASSERT_OK(zb_backend_alloc(be, (size_t)numels[k] * esize, &t->ptrs[k]));
  }
  t->list = (zb_tensor_list_t){count, t->ptrs, t->numels};
}

static void tl_free(tl_t *t) {
  for (int k = 0; k < t->list.count; k++) ZB_ASSERT_OK(zb_backend_free(t->be, t->ptrs[k]));
}

static void tl_set(tl_t *t, int k, int64_t i, float v) {
  if (t->dtype == ZB_DTYPE_F32) ((float *)t->ptrs[k])[i] = v;
  else if (t->dtype == ZB_DTYPE_BF16) ((uint16_t *)t->ptrs[k])[i] = bf16_exact(v);
  else ((uint16_t *)t->ptrs[k])[i] = f16_exact(v);
}

static void tl_set_bits(tl_t *t, int k, int64_t i, uint32_t f32, uint16_t f16, uint16_t bf16) {
  if (t->dtype == ZB_DTYPE_F32) memcpy((float *)t->ptrs[k] + i, &f32, 4);
  else ((uint16_t *)t->ptrs[k])[i] = t->dtype == ZB_DTYPE_F16 ? f16 : bf16;
}

static const int64_t kSizes[] = {0, 1, 7, 4097, 300};

/* ---- zb_sq_norm -------------------------------------------------------------------------------- */

static void test_sq_norm_is_the_sequential_double_sum(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  for (size_t d = 0; d < 3; d++) {
    tl_t t;
    tl_make(&t, be, kDtypes[d], 5, kSizes);
    double want = 0.25; /* sq_out accumulates: it starts at what the caller had */
    for (int k = 0; k < 5; k++)
      for (int64_t i = 0; i < kSizes[k]; i++) {
        const float v = qval(d, (uint64_t)k, (uint64_t)i);
        tl_set(&t, k, i, v);
        want += (double)v * (double)v;
      }
    double sq = 0.25;
    int32_t bad = 0;
    ZB_ASSERT_OK(zb_sq_norm(be, kDtypes[d], &t.list, &sq, &bad));
    if (sq != want) fail_msg("%s: sq is %.17g, the sum is %.17g", kDtypeNames[kDtypes[d]], sq, want);
    assert_int_equal(bad, 0);
    tl_free(&t);
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_sq_norm_flags_inf_and_nan(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  /* +inf, -inf, NaN; then the largest finite value, which must not count. */
  static const uint32_t f32[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f7fffffu};
  static const uint16_t f16[] = {0x7c00u, 0xfc00u, 0x7e00u, 0x7bffu};
  static const uint16_t bf16[] = {0x7f80u, 0xff80u, 0x7fc0u, 0x7f7fu};
  for (size_t d = 0; d < 3; d++)
    for (int c = 0; c < 4; c++) {
      tl_t t;
      tl_make(&t, be, kDtypes[d], 5, kSizes);
      for (int k = 0; k < 5; k++)
        for (int64_t i = 0; i < kSizes[k]; i++) tl_set(&t, k, i, qval(d, (uint64_t)k, (uint64_t)i));
      tl_set_bits(&t, 3, 2000, f32[c], f16[c], bf16[c]);
      double sq = 0;
      int32_t bad = 0;
      ZB_ASSERT_OK(zb_sq_norm(be, kDtypes[d], &t.list, &sq, &bad));
      if (bad != (c < 3))
        fail_msg("%s case %d: nonfinite is %d, expected %d", kDtypeNames[kDtypes[d]], c, bad, c < 3);
      if (c < 2 && !isinf(sq)) fail_msg("an inf element gives sq %g, expected inf", sq);
      if (c == 2 && !isnan(sq)) fail_msg("a NaN element gives sq %g, expected NaN", sq);
      if (c == 3) { /* a flag already set stays set: the call only ever writes 1 */
        bad = 1;
        ZB_ASSERT_OK(zb_sq_norm(be, kDtypes[d], &t.list, &sq, &bad));
        assert_int_equal(bad, 1);
      }
      tl_free(&t);
    }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* ---- zb_unscale -------------------------------------------------------------------------------- */

static void test_unscale_values_and_flag(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  for (size_t d = 0; d < 3; d++) {
    const zb_dtype_t dt = kDtypes[d];
    tl_t t, want;
    tl_make(&t, be, dt, 5, kSizes);
    tl_make(&want, be, dt, 5, kSizes);
    for (int k = 0; k < 5; k++)
      for (int64_t i = 0; i < kSizes[k]; i++) {
        const float v = qval(d + 10, (uint64_t)k, (uint64_t)i);
        tl_set(&t, k, i, v);
        tl_set(&want, k, i, v / 4); /* exact: a power of two, far from the dtypes' limits */
      }
    int32_t bad = 0;
    ZB_ASSERT_OK(zb_unscale(be, dt, &t.list, 0.25f, &bad));
    assert_int_equal(bad, 0);
    for (int k = 0; k < 5; k++)
      if (memcmp(t.ptrs[k], want.ptrs[k], (size_t)kSizes[k] * (dt == ZB_DTYPE_F32 ? 4 : 2)) != 0)
        fail_msg("%s: tensor %d is not x * 0.25", kDtypeNames[dt], k);
    tl_free(&t);
    tl_free(&want);
  }

  /* Rounding to nearest even, and overflow that only the rounding to the half type causes. Rows:
   * input bits, factor, expected bits, expected flag. f16: (1 + 2^-10) * 0.75 = 0.75 + 1.5 ulp, a
   * tie, goes to the even 0x3a02; 65504 * (1 + 2^-11) rounds past the largest half to inf. bf16:
   * the same with 2^-7 and 0x3f42; 0x7f7f * (1 + 2^-8) is finite in fp32 and inf in bf16. */
  static const struct {
    zb_dtype_t dt;
    uint16_t in;
    float factor;
    uint16_t out;
    int32_t bad;
  } rows[] = {
      {ZB_DTYPE_F16, 0x3c01u, 0.75f, 0x3a02u, 0},
      {ZB_DTYPE_F16, 0x7bffu, 1.00048828125f, 0x7c00u, 1},
      {ZB_DTYPE_BF16, 0x3f81u, 0.75f, 0x3f42u, 0},
      {ZB_DTYPE_BF16, 0x7f7fu, 1.00390625f, 0x7f80u, 1},
  };
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    uint16_t x = rows[r].in;
    void *ptr = &x;
    int64_t n = 1;
    const zb_tensor_list_t one = {1, &ptr, &n};
    int32_t bad = 0;
    ZB_ASSERT_OK(zb_unscale(be, rows[r].dt, &one, rows[r].factor, &bad));
    if (x != rows[r].out || bad != rows[r].bad)
      fail_msg("%s 0x%04x * %.9g: got 0x%04x flag %d, expected 0x%04x flag %d",
               kDtypeNames[rows[r].dt], rows[r].in, (double)rows[r].factor, x, bad, rows[r].out,
               rows[r].bad);
  }
  float big = 3e38f; /* fp32 overflow */
  void *ptr = &big;
  int64_t n = 1;
  const zb_tensor_list_t one = {1, &ptr, &n};
  int32_t bad = 0;
  ZB_ASSERT_OK(zb_unscale(be, ZB_DTYPE_F32, &one, 4.0f, &bad));
  assert_true(isinf(big));
  assert_int_equal(bad, 1);
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* ---- zb_loss_scale_update --------------------------------------------------------------------- */

/* GradScaler's update (torch/amp/grad_scaler.py, _amp_update_scale_), written from its rule. */
static void gradscaler_rule(float *scale, int32_t *tracker, int inf, double growth, double backoff,
                            int32_t interval) {
  if (inf) {
    *scale = (float)((double)*scale * backoff);
    *tracker = 0;
  } else if (*tracker + 1 == interval) {
    const float grown = (float)((double)*scale * growth);
    if (isfinite(grown)) *scale = grown;
    *tracker = 0;
  } else {
    *tracker += 1;
  }
}

static void test_loss_scale_update_follows_gradscaler(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  static const int flags[] = {0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0};
  static const struct {
    double growth, backoff;
    int32_t interval;
    float start;
  } runs[] = {{2.0, 0.5, 3, 65536.0f}, {1.5, 0.3, 1, 1000.0f}, {2.0, 0.5, 2, 2e38f}, {1.0, 1.0, 4, 7.0f}};
  for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
    float scale = runs[r].start, want = runs[r].start;
    int32_t tracker = 0, want_tracker = 0;
    for (size_t s = 0; s < sizeof flags / sizeof flags[0]; s++) {
      const int32_t inf = flags[s];
      ZB_ASSERT_OK(zb_loss_scale_update(be, &scale, &tracker, &inf, runs[r].growth, runs[r].backoff,
                                        runs[r].interval));
      gradscaler_rule(&want, &want_tracker, inf, runs[r].growth, runs[r].backoff, runs[r].interval);
      if (memcmp(&scale, &want, 4) != 0 || tracker != want_tracker)
        fail_msg("run %zu step %zu: scale %.9g tracker %d, GradScaler gives %.9g and %d", r, s,
                 (double)scale, tracker, (double)want, want_tracker);
    }
    assert_true(isfinite(scale)); /* run 2 starts near FLT_MAX: growing to inf is refused */
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* ---- zb_optim_step ----------------------------------------------------------------------------- */

typedef struct {
  zb_optim_kind_t kind;
  double lr, momentum, wd;
} hp_t;

static const hp_t kAdamW = {ZB_OPTIM_ADAMW, 1e-2, 0.0, 0.01};
static const hp_t kSgdMomentum = {ZB_OPTIM_SGD, 1e-2, 0.9, 0.01};
static const hp_t kSgdPlain = {ZB_OPTIM_SGD, 1e-2, 0.0, 0.01};
#define BETA1 0.9
#define BETA2 0.999
#define EPS 1e-8

/* torch.optim.AdamW / SGD (dampening 0, no Nesterov) on one element in double, from the papers'
 * formulas; g is the gradient already multiplied by the factor. */
static void ref_elem(const hp_t *h, int64_t t, double g, double *p, double *m, double *v) {
  if (h->kind == ZB_OPTIM_ADAMW) {
    const double bc1 = 1 - pow(BETA1, (double)t), bc2 = 1 - pow(BETA2, (double)t);
    *p *= 1 - h->lr * h->wd;
    *m = BETA1 * *m + (1 - BETA1) * g;
    *v = BETA2 * *v + (1 - BETA2) * g * g;
    *p -= h->lr / bc1 * *m / (sqrt(*v) / sqrt(bc2) + EPS);
  } else {
    double d = g + h->wd * *p;
    if (h->momentum != 0) {
      *m = t == 1 ? d : h->momentum * *m + d;
      d = *m;
    }
    *p -= h->lr * d;
  }
}

/* Four parameters of odd sizes (one empty), their gradients in one dtype and the state the kind
 * keeps (zeroed, as torch starts it); q->s is ready for zb_optim_step but for step and undo. */
static const int64_t kParamSizes[] = {1, 3, 1000, 0};
#define NPARAM 4
#define NTOTAL 1004
typedef struct {
  tl_t p, g, s1, s2;
  zb_optim_step_t s;
} prob_t;

static void prob_make(prob_t *q, zb_backend_t *be, const hp_t *h, zb_dtype_t gd, float factor) {
  memset(q, 0, sizeof *q);
  const int nstate = h->kind == ZB_OPTIM_ADAMW ? 2 : h->momentum != 0 ? 1 : 0;
  tl_make(&q->p, be, ZB_DTYPE_F32, NPARAM, kParamSizes);
  tl_make(&q->g, be, gd, NPARAM, kParamSizes);
  tl_make(&q->s1, be, ZB_DTYPE_F32, nstate >= 1 ? NPARAM : 0, kParamSizes);
  tl_make(&q->s2, be, ZB_DTYPE_F32, nstate >= 2 ? NPARAM : 0, kParamSizes);
  for (int k = 0; k < NPARAM; k++)
    for (int64_t i = 0; i < kParamSizes[k]; i++) {
      ((float *)q->p.ptrs[k])[i] = urand(3, (uint64_t)k, (uint64_t)i, 0);
      if (nstate >= 1) ((float *)q->s1.ptrs[k])[i] = 0;
      if (nstate >= 2) ((float *)q->s2.ptrs[k])[i] = 0;
    }
  zb_optim_step_t s = {sizeof(zb_optim_step_t), ZB_OPTIM_STEP_VERSION, h->kind, h->lr, h->momentum,
                       BETA1, BETA2, EPS, h->wd, 1, factor, gd, q->p.list, q->g.list, q->s1.list,
                       q->s2.list, NULL};
  q->s = s;
}

static void prob_grads(prob_t *q, int step) {
  for (int k = 0; k < NPARAM; k++)
    for (int64_t i = 0; i < kParamSizes[k]; i++)
      tl_set(&q->g, k, i, qval(100 + (uint64_t)step, (uint64_t)k, (uint64_t)i));
}

static void prob_free(prob_t *q) {
  tl_free(&q->p), tl_free(&q->g), tl_free(&q->s1), tl_free(&q->s2);
}

/* Element i of the concatenated fp32 list (NULL-safe for absent state). */
static float *elem(tl_t *t, int64_t flat) {
  for (int k = 0; k < t->list.count; k++) {
    if (flat < t->numels[k]) return (float *)t->ptrs[k] + flat;
    flat -= t->numels[k];
  }
  return NULL;
}

/* After three steps every value is within 1e-7 + 1e-5 |reference| of the double computation: the
 * float path rounds a handful of times per step (about 1e-7 relative each), while a wrong formula
 * (a missing bias correction, decay or factor) is off by far more than that. */
static void expect_near_double(const hp_t *h, const char *what) {
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  for (size_t d = 0; d < 3; d++) {
    prob_t q;
    const float factor = 0.37f;
    prob_make(&q, be, h, kDtypes[d], factor);
    double p[NTOTAL], m[NTOTAL] = {0}, v[NTOTAL] = {0};
    for (int64_t i = 0; i < NTOTAL; i++) p[i] = *elem(&q.p, i);
    for (int t = 1; t <= 3; t++) {
      prob_grads(&q, t);
      q.s.step = t;
      ZB_ASSERT_OK(zb_optim_step(be, &q.s));
      for (int64_t i = 0, k = 0, j = 0; i < NTOTAL; i++, j++) {
        while (j >= kParamSizes[k]) k++, j = 0;
        const double g = (double)qval(100 + (uint64_t)t, (uint64_t)k, (uint64_t)j) * (double)factor;
        ref_elem(h, t, g, &p[i], &m[i], &v[i]);
      }
    }
    for (int64_t i = 0; i < NTOTAL; i++) {
      const double got[3] = {*elem(&q.p, i), q.s1.list.count ? *elem(&q.s1, i) : 0,
                             q.s2.list.count ? *elem(&q.s2, i) : 0};
      const double want[3] = {p[i], q.s1.list.count ? m[i] : 0, q.s2.list.count ? v[i] : 0};
      for (int w = 0; w < 3; w++)
        if (!(fabs(got[w] - want[w]) <= 1e-7 + 1e-5 * fabs(want[w])))
          fail_msg("%s, %s grads: %s[%lld] is %.9g, the double formula %.9g", what,
                   kDtypeNames[kDtypes[d]], w == 0 ? "param" : w == 1 ? "state1" : "state2",
                   (long long)i, got[w], want[w]);
    }
    prob_free(&q);
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_adamw_matches_double_formula(void **state) {
  (void)state;
  expect_near_double(&kAdamW, "AdamW");
}

static void test_sgd_matches_double_formula(void **state) {
  (void)state;
  expect_near_double(&kSgdMomentum, "SGD with momentum");
  expect_near_double(&kSgdPlain, "plain SGD");
}

static int lists_equal(const tl_t *a, const tl_t *b) {
  for (int k = 0; k < a->list.count; k++)
    if (memcmp(a->ptrs[k], b->ptrs[k], (size_t)a->numels[k] * 4) != 0) return 0;
  return 1;
}

/* Widening bf16/f16 to fp32 is exact, so half gradients step exactly like fp32 ones of the same
 * values. */
static void test_half_grads_step_like_their_widening(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  const hp_t *kinds[] = {&kAdamW, &kSgdMomentum};
  for (int h = 0; h < 2; h++) {
    prob_t q[3];
    for (size_t d = 0; d < 3; d++) {
      prob_make(&q[d], be, kinds[h], kDtypes[d], 0.37f);
      for (int t = 1; t <= 3; t++) {
        prob_grads(&q[d], t);
        q[d].s.step = t;
        ZB_ASSERT_OK(zb_optim_step(be, &q[d].s));
      }
    }
    for (size_t d = 1; d < 3; d++)
      if (!lists_equal(&q[0].p, &q[d].p) || !lists_equal(&q[0].s1, &q[d].s1) ||
          !lists_equal(&q[0].s2, &q[d].s2))
        fail_msg("kind %d: %s gradients step differently from fp32 ones of the same values", h,
                 kDtypeNames[kDtypes[d]]);
    for (size_t d = 0; d < 3; d++) prob_free(&q[d]);
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* zb_optimizer (loss scale 4, so its factor is 0.25) and zb_optim_step on the same gradients end
 * with the same parameter bits after every step. */
static void test_step_equals_zb_optimizer_bitwise(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  const hp_t *kinds[] = {&kAdamW, &kSgdMomentum, &kSgdPlain};
  for (int h = 0; h < 3; h++) {
    prob_t q, twin;
    prob_make(&q, be, kinds[h], ZB_DTYPE_F32, 0.25f);
    prob_make(&twin, be, kinds[h], ZB_DTYPE_F32, 0.25f); /* its params go to zb_optimizer */
    zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
    cfg.kind = kinds[h]->kind, cfg.lr = kinds[h]->lr, cfg.momentum = kinds[h]->momentum;
    cfg.weight_decay = kinds[h]->wd, cfg.beta1 = BETA1, cfg.beta2 = BETA2, cfg.eps = EPS;
    cfg.loss_scale = 4.0, cfg.growth_interval = 0;
    zb_optimizer_t *opt = NULL;
    ZB_ASSERT_OK(zb_optimizer_create(&opt, &cfg));
    for (int k = 0; k < NPARAM; k++)
      ZB_ASSERT_OK(zb_optimizer_add(opt, 0, twin.p.ptrs[k], q.g.ptrs[k], kParamSizes[k]));
    for (int t = 1; t <= 4; t++) {
      prob_grads(&q, t);
      zb_step_result_t res;
      ZB_ASSERT_OK(zb_optimizer_step(opt, &res));
      assert_int_equal(res.skipped, 0);
      q.s.step = t;
      ZB_ASSERT_OK(zb_optim_step(be, &q.s));
      if (!lists_equal(&q.p, &twin.p))
        fail_msg("kind %d step %d: zb_optim_step and zb_optimizer differ", h, t);
    }
    ZB_ASSERT_OK(zb_optimizer_destroy(opt));
    prob_free(&q), prob_free(&twin);
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

/* ---- zb_optim_undo and zb_optim_undo_bytes ------------------------------------------------------ */

static void copy_list(tl_t *dst, zb_backend_t *be, const tl_t *src) {
  tl_make(dst, be, ZB_DTYPE_F32, src->list.count, src->numels);
  for (int k = 0; k < src->list.count; k++)
    memcpy(dst->ptrs[k], src->ptrs[k], (size_t)src->numels[k] * 4);
}

static void test_undo_restores_bit_for_bit(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  const hp_t *kinds[] = {&kAdamW, &kSgdMomentum, &kSgdPlain};
  for (int h = 0; h < 3; h++) {
    prob_t q;
    prob_make(&q, be, kinds[h], ZB_DTYPE_BF16, 0.5f);
    prob_grads(&q, 1);
    ZB_ASSERT_OK(zb_optim_step(be, &q.s)); /* step 1: the state is no longer zero */
    tl_t before[3], after[3];
    copy_list(&before[0], be, &q.p), copy_list(&before[1], be, &q.s1), copy_list(&before[2], be, &q.s2);
    size_t bytes = 0;
    ZB_ASSERT_OK(zb_optim_undo_bytes(&q.s, &bytes));
    ZB_ASSERT_OK(zb_backend_alloc(be, bytes, (void **)&q.s.undo));
    prob_grads(&q, 2);
    q.s.step = 2;
    ZB_ASSERT_OK(zb_optim_step(be, &q.s));
    assert_false(lists_equal(&q.p, &before[0]));
    copy_list(&after[0], be, &q.p), copy_list(&after[1], be, &q.s1), copy_list(&after[2], be, &q.s2);
    ZB_ASSERT_OK(zb_optim_undo(be, &q.s));
    if (!lists_equal(&q.p, &before[0]) || !lists_equal(&q.s1, &before[1]) ||
        !lists_equal(&q.s2, &before[2]))
      fail_msg("kind %d: zb_optim_undo did not restore the parameters and state bit for bit", h);
    /* Redoing the step from the restored state gives the same bits again. */
    ZB_ASSERT_OK(zb_optim_step(be, &q.s));
    if (!lists_equal(&q.p, &after[0]) || !lists_equal(&q.s1, &after[1]) || !lists_equal(&q.s2, &after[2]))
      fail_msg("kind %d: the step after an undo differs from the first", h);
    ZB_ASSERT_OK(zb_backend_free(be, q.s.undo));
    for (int i = 0; i < 3; i++) tl_free(&before[i]), tl_free(&after[i]);
    prob_free(&q);
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_undo_bytes(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  const hp_t *kinds[] = {&kAdamW, &kSgdMomentum, &kSgdPlain};
  const size_t per_elem[] = {12, 8, 4}; /* zbpp.h: param + exp_avg + exp_avg_sq, param + buffer, param */
  for (int h = 0; h < 3; h++) {
    prob_t q;
    prob_make(&q, be, kinds[h], ZB_DTYPE_F32, 1.0f);
    size_t bytes = 1;
    ZB_ASSERT_OK(zb_optim_undo_bytes(&q.s, &bytes));
    if (bytes != per_elem[h] * NTOTAL)
      fail_msg("kind %d: %zu undo bytes, expected %zu", h, bytes, per_elem[h] * NTOTAL);
    q.s.params.count = q.s.grads.count = 0;
    q.s.state1.count = q.s.state2.count = 0;
    ZB_ASSERT_OK(zb_optim_undo_bytes(&q.s, &bytes));
    assert_int_equal(bytes, 0);
    ZB_ASSERT_OK(zb_optim_step(be, &q.s)); /* an empty list is a valid no-op */
    prob_free(&q);
  }
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sq_norm_is_the_sequential_double_sum),
      cmocka_unit_test(test_sq_norm_flags_inf_and_nan),
      cmocka_unit_test(test_unscale_values_and_flag),
      cmocka_unit_test(test_loss_scale_update_follows_gradscaler),
      cmocka_unit_test(test_adamw_matches_double_formula),
      cmocka_unit_test(test_sgd_matches_double_formula),
      cmocka_unit_test(test_half_grads_step_like_their_widening),
      cmocka_unit_test(test_step_equals_zb_optimizer_bitwise),
      cmocka_unit_test(test_undo_restores_bit_for_bit),
      cmocka_unit_test(test_undo_bytes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
