/*
 * gpu_kernels.c - the optimizer kernels on the CUDA backend (kernels/sq_norm.cu, loss_scale.cu,
 * optim.cu) against the host backend, their oracle, on the same inputs:
 *  - zb_optim_step, AdamW and SGD with and without momentum, several steps, fp32/bf16/f16
 *    gradients: parameters and state equal bit for bit (the kernels run the host reference's IEEE
 *    operations in its order, without fused multiply-adds, and widening a half is exact); the same
 *    with an undo copy, and zb_optim_undo restores the step's inputs bit for bit;
 *  - zb_unscale: values and flag bit for bit; zb_loss_scale_update: the same scale and tracker;
 *  - zb_sq_norm: the same inf/NaN flag as the host; a sum within 1e-13 relative of the exact sum
 *    of squares (a compensated sum here, good to about 2^-52), and the host's within its own bound.
 *    The device adds per thread (16 terms), a block's 256 in a tree, then the blocks' partials the
 *    same way: about 40 roundings deep, each at most 2^-53 of a partial sum, so within 5e-15. The
 *    host adds the N squares one by one to its start value, and there the rounding is not a random
 *    walk: once the running sum is large, every square below half its ulp is lost outright, so the
 *    host is low by 2.5e-12 (300 tensors, 3.3 million elements) to 3.6e-12 (1100 tensors, 5.1
 *    million) with the 2^24 range of magnitudes used here (measured on the fake device; the bound
 *    is N 2^-53, N additions). The device sum is also the same bits on a second run.
 * Lists have 300 tensors (one launch) and 1100 (more pieces than one launch's table: several
 * launches), of odd sizes including 0, 1 and more than 2^20 elements (several blocks per tensor).
 * Values are random, with subnormal gradients sprinkled in; never NaN where bits are compared (NaN
 * payloads are not specified).
 *
 * Exits 77 (skipped) without a CUDA build or a GPU.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

static zb_backend_t *g_host, *g_cuda;

static int setup(void **state) {
  zb_cuda_backend_config_t cfg = ZB_CUDA_BACKEND_CONFIG_INIT;
  if (zb_backend_create_cuda(&g_cuda, &cfg) != ZB_OK || zb_backend_create_host(&g_host) != ZB_OK) {
    fprintf(stderr, "backends: %s\n", zb_last_error());
    return -1;
  }
  return 0;
}

static int teardown(void **state) {
  return zb_backend_destroy(g_cuda) != ZB_OK || zb_backend_destroy(g_host) != ZB_OK ? -1 : 0;
}

static size_t dsize(zb_dtype_t t) { return t == ZB_DTYPE_F32 ? 4 : 2; }

/* ---- one list twice: in host-backend memory (h) and in device memory (d) ----------------------- */

typedef struct {
  int count;
  zb_dtype_t dtype;
  int64_t *numels;
  void **h, **d;
  zb_tensor_list_t hl, dl;
} mirror_t;

/* 0 and 1 elements, two tensors above 2^20, the rest odd sizes below 5000 (some empty). */
static int64_t size_of(int k, int count) {
  if (k == 0) return 0;
  if (k == 1) return 1;
  if (k == 2) return ((int64_t)1 << 20) + 3;
  if (k == count - 1) return ((int64_t)3 << 19) + 1;
  return k % 11 == 0 ? 0 : (int64_t)(mix((uint64_t)k) % 5000) | 1;
}

static void mirror_make(mirror_t *m, int count, zb_dtype_t dtype) {
  m->count = count, m->dtype = dtype;
  m->numels = calloc((size_t)count + 1, sizeof(int64_t));
  m->h = calloc((size_t)count + 1, sizeof(void *));
  m->d = calloc((size_t)count + 1, sizeof(void *));
  assert_non_null(m->numels), assert_non_null(m->h), assert_non_null(m->d);
  for (int k = 0; k < count; k++) {
    m->numels[k] = size_of(k, count);
    ZB_ASSERT_OK(zb_backend_alloc(g_host, (size_t)m->numels[k] * dsize(dtype), &m->h[k]));
    ZB_ASSERT_OK(zb_backend_alloc(g_cuda, (size_t)m->numels[k] * dsize(dtype), &m->d[k]));
  }
  m->hl = (zb_tensor_list_t){count, m->h, m->numels};
  m->dl = (zb_tensor_list_t){count, m->d, m->numels};
}

static void mirror_free(mirror_t *m) {
  for (int k = 0; k < m->count; k++) {
    ZB_ASSERT_OK(zb_backend_free(g_host, m->h[k]));
    ZB_ASSERT_OK(zb_backend_free(g_cuda, m->d[k]));
  }
  free(m->numels), free(m->h), free(m->d);
}

static void mirror_upload(mirror_t *m) {
  for (int k = 0; k < m->count; k++)
    ZB_ASSERT_OK(zb_backend_copy(g_cuda, m->d[k], m->h[k], (size_t)m->numels[k] * dsize(m->dtype)));
  ZB_ASSERT_OK(zb_backend_synchronize(g_cuda));
}

/* Fails, naming the first differing element, unless device and host hold the same bytes. */
static void mirror_expect_equal(const mirror_t *m, const char *what) {
  ZB_ASSERT_OK(zb_backend_synchronize(g_cuda));
  for (int k = 0; k < m->count; k++) {
    const size_t bytes = (size_t)m->numels[k] * dsize(m->dtype);
    if (!bytes) continue;
    unsigned char *got = malloc(bytes);
    assert_non_null(got);
    ZB_ASSERT_OK(zb_backend_copy(g_cuda, got, m->d[k], bytes));
    ZB_ASSERT_OK(zb_backend_synchronize(g_cuda));
    if (memcmp(got, m->h[k], bytes) != 0) {
      size_t i = 0;
      while (got[i] == ((unsigned char *)m->h[k])[i]) i++;
      const size_t e = i / dsize(m->dtype);
      uint32_t gb = 0, hb = 0;
      memcpy(&gb, got + e * dsize(m->dtype), dsize(m->dtype));
      memcpy(&hb, (unsigned char *)m->h[k] + e * dsize(m->dtype), dsize(m->dtype));
      free(got);
      fail_msg("%s: tensor %d of %d, element %zu: device bits 0x%08x, host 0x%08x", what, k,
               m->count, e, gb, hb);
    }
    free(got);
  }
}

/* Random finite values: fp32 of many magnitudes with a subnormal every 97th element; bf16 the top
 * half of such a float; f16 random bits, the all-ones exponent cleared (or, with infs, kept as
 * an infinity). */
static void fill(mirror_t *m, uint64_t seed, int with_inf) {
  for (int k = 0; k < m->count; k++)
    for (int64_t i = 0; i < m->numels[k]; i++) {
      const uint64_t r = mix(mix(seed ^ (uint64_t)k << 32) ^ (uint64_t)i);
      float f = urand(seed, (uint64_t)k, (uint64_t)i, 1) * ldexpf(1.0f, (int)(r % 24) - 12);
      if (i % 97 == 5) f = 1e-40f * (f < 0 ? -1.0f : 1.0f);
      if (with_inf && i == m->numels[k] / 2 && k % 3 == 1) f = INFINITY;
      uint32_t fb;
      memcpy(&fb, &f, 4);
      uint16_t hb = (uint16_t)(r >> 20);
      if ((hb & 0x7c00u) == 0x7c00u) hb = with_inf ? (uint16_t)(hb & 0xfc00u) : (uint16_t)(hb & ~0x4000u);
      if (m->dtype == ZB_DTYPE_F32) ((float *)m->h[k])[i] = f;
      else ((uint16_t *)m->h[k])[i] = m->dtype == ZB_DTYPE_BF16 ? (uint16_t)(fb >> 16) : hb;
    }
  mirror_upload(m);
}

static const zb_dtype_t kDtypes[] = {ZB_DTYPE_F32, ZB_DTYPE_BF16, ZB_DTYPE_F16};
static const int kCounts[] = {300, 1100};

/* ---- zb_sq_norm ------------------------------------------------------------------------------- */

static void *dev_alloc(size_t bytes, const void *init) {
  void *p = NULL;
  ZB_ASSERT_OK(zb_backend_alloc(g_cuda, bytes, &p));
  ZB_ASSERT_OK(zb_backend_copy(g_cuda, p, init, bytes));
  return p;
}

static void dev_read(void *dst, const void *src, size_t bytes) {
  ZB_ASSERT_OK(zb_backend_copy(g_cuda, dst, src, bytes));
  ZB_ASSERT_OK(zb_backend_synchronize(g_cuda));
}

/* The elements of a list as floats (widening a half or bf16 is exact). */
static float element(const mirror_t *m, int k, int64_t i) {
  if (m->dtype == ZB_DTYPE_F32) return ((const float *)m->h[k])[i];
  const uint16_t b = ((const uint16_t *)m->h[k])[i];
  return m->dtype == ZB_DTYPE_BF16 ? zb__bf16_to_float(b) : zb__half_to_float(b);
}

static int64_t total_numel(const mirror_t *m) {
  int64_t n = 0;
  for (int k = 0; k < m->count; k++) n += m->numels[k];
  return n;
}

/* start + the sum of squares, Neumaier's compensated sum: every square is exact in double, and the
 * result is within about 2^-52 of the exact sum whatever N is, the reference both backends are held
 * to. */
static double exact_sq(const mirror_t *m, double start) {
  double s = start, comp = 0.0;
  for (int k = 0; k < m->count; k++)
    for (int64_t i = 0; i < m->numels[k]; i++) {
      const double x = (double)element(m, k, i), sq = x * x, t = s + sq;
      comp += fabs(s) >= fabs(sq) ? (s - t) + sq : (sq - t) + s;
      s = t;
    }
  return s + comp;
}

static void test_sq_norm(void **state) {
  for (int c = 0; c < 2; c++)
    for (int d = 0; d < 3; d++)
      for (int with_inf = 0; with_inf < 2; with_inf++) {
        mirror_t m;
        mirror_make(&m, kCounts[c], kDtypes[d]);
        fill(&m, 10 + (uint64_t)d, with_inf);
        double hsq = 0.5, dsq[2] = {0, 0}, start = 0.5;
        int32_t hbad = 0, dbad = 0, zero = 0;
        ZB_ASSERT_OK(zb_sq_norm(g_host, kDtypes[d], &m.hl, &hsq, &hbad));
        for (int run = 0; run < 2; run++) {
          double *sq = dev_alloc(sizeof(double), &start);
          int32_t *bad = dev_alloc(sizeof(int32_t), &zero);
          ZB_ASSERT_OK(zb_sq_norm(g_cuda, kDtypes[d], &m.dl, sq, bad));
          dev_read(&dsq[run], sq, sizeof(double));
          dev_read(&dbad, bad, sizeof(int32_t));
          ZB_ASSERT_OK(zb_backend_free(g_cuda, sq));
          ZB_ASSERT_OK(zb_backend_free(g_cuda, bad));
        }
        if (dbad != hbad || hbad != with_inf)
          fail_msg("%d tensors, dtype %d: nonfinite device %d host %d", kCounts[c], (int)kDtypes[d],
                   dbad, hbad);
        if (memcmp(&dsq[0], &dsq[1], sizeof(double)) != 0)
          fail_msg("sq_norm is not deterministic: %.17g then %.17g", dsq[0], dsq[1]);
        if (with_inf) {
          if (!isinf(dsq[0]) || !isinf(hsq))
            fail_msg("%d tensors, dtype %d: device sq %g, host %g, both should be inf", kCounts[c],
                     (int)kDtypes[d], dsq[0], hsq);
        } else {
          const double exact = exact_sq(&m, start);
          const double n = (double)total_numel(&m);
          if (!(fabs(dsq[0] - exact) <= 1e-13 * exact) || !(fabs(hsq - exact) <= n * 0x1p-53 * exact))
            fail_msg("%d tensors, dtype %d: device sq %.17g (bound 1e-13 relative), host %.17g (bound "
                     "%.2g relative), the compensated sum %.17g",
                     kCounts[c], (int)kDtypes[d], dsq[0], n * 0x1p-53, hsq, exact);
        }
        mirror_free(&m);
      }
  /* An empty list, and one of empty tensors, leave the outputs alone. */
  mirror_t e;
  mirror_make(&e, 1, ZB_DTYPE_F32);
  double start = 0.5, got = 0;
  int32_t zero = 0;
  double *sq = dev_alloc(sizeof(double), &start);
  int32_t *bad = dev_alloc(sizeof(int32_t), &zero);
  ZB_ASSERT_OK(zb_sq_norm(g_cuda, ZB_DTYPE_F32, &e.dl, sq, bad));
  e.dl.count = 0;
  ZB_ASSERT_OK(zb_sq_norm(g_cuda, ZB_DTYPE_F32, &e.dl, sq, bad));
  dev_read(&got, sq, sizeof got);
  assert_true(got == 0.5);
  ZB_ASSERT_OK(zb_backend_free(g_cuda, sq));
  ZB_ASSERT_OK(zb_backend_free(g_cuda, bad));
  mirror_free(&e);
}

/* ---- zb_unscale and zb_loss_scale_update ------------------------------------------------------ */

static void test_unscale(void **state) {
  static const float factors[] = {1.0f / 1024, 0.37f, 3.0f};
  for (int d = 0; d < 3; d++)
    for (int f = 0; f < 3; f++)
      for (int with_inf = 0; with_inf < 2; with_inf++) {
        mirror_t m;
        mirror_make(&m, kCounts[f == 1], kDtypes[d]);
        fill(&m, 20 + (uint64_t)d, with_inf);
        int32_t hbad = 0, dbad = 0, zero = 0;
        int32_t *bad = dev_alloc(sizeof(int32_t), &zero);
        ZB_ASSERT_OK(zb_unscale(g_host, kDtypes[d], &m.hl, factors[f], &hbad));
        ZB_ASSERT_OK(zb_unscale(g_cuda, kDtypes[d], &m.dl, factors[f], bad));
        dev_read(&dbad, bad, sizeof dbad);
        char what[64];
        snprintf(what, sizeof what, "unscale dtype %d factor %g", (int)kDtypes[d], (double)factors[f]);
        mirror_expect_equal(&m, what);
        if (dbad != hbad) fail_msg("%s: nonfinite device %d host %d", what, dbad, hbad);
        if (with_inf) assert_int_equal(hbad, 1);
        ZB_ASSERT_OK(zb_backend_free(g_cuda, bad));
        mirror_free(&m);
      }
}

static void test_scale_update(void **state) {
  static const int32_t flags[] = {0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  static const struct {
    double growth, backoff;
    int32_t interval;
    float start;
  } runs[] = {{2.0, 0.5, 3, 65536.0f}, {1.37, 0.3, 1, 1000.0f}, {2.0, 0.5, 2, 2e38f}};
  for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
    float hs = runs[r].start, ds = 0;
    int32_t ht = 0, dt = 0, zero = 0;
    float *scale = dev_alloc(sizeof(float), &hs);
    int32_t *tracker = dev_alloc(sizeof(int32_t), &zero), *inf = dev_alloc(sizeof(int32_t), &zero);
    for (size_t s = 0; s < sizeof flags / sizeof flags[0]; s++) {
      ZB_ASSERT_OK(zb_backend_copy(g_cuda, inf, &flags[s], sizeof(int32_t)));
      ZB_ASSERT_OK(zb_loss_scale_update(g_cuda, scale, tracker, inf, runs[r].growth, runs[r].backoff,
                                        runs[r].interval));
      ZB_ASSERT_OK(zb_loss_scale_update(g_host, &hs, &ht, &flags[s], runs[r].growth, runs[r].backoff,
                                        runs[r].interval));
      dev_read(&ds, scale, sizeof ds);
      dev_read(&dt, tracker, sizeof dt);
      if (memcmp(&ds, &hs, 4) != 0 || dt != ht)
        fail_msg("run %zu step %zu: device scale %.9g tracker %d, host %.9g %d", r, s, (double)ds, dt,
                 (double)hs, ht);
    }
    ZB_ASSERT_OK(zb_backend_free(g_cuda, scale));
    ZB_ASSERT_OK(zb_backend_free(g_cuda, tracker));
    ZB_ASSERT_OK(zb_backend_free(g_cuda, inf));
  }
}

/* ---- zb_optim_step and zb_optim_undo ---------------------------------------------------------- */

typedef struct {
  mirror_t p, g, s1, s2;
  zb_optim_step_t hs, ds; /* the same step on the host lists and on the device lists */
  float *hundo, *dundo;
} optim_case_t;

static void optim_make(optim_case_t *o, zb_optim_kind_t kind, double momentum, zb_dtype_t gd, int count) {
  const int nstate = kind == ZB_OPTIM_ADAMW ? 2 : momentum != 0 ? 1 : 0;
  mirror_make(&o->p, count, ZB_DTYPE_F32);
  mirror_make(&o->g, count, gd);
  mirror_make(&o->s1, nstate >= 1 ? count : 0, ZB_DTYPE_F32);
  mirror_make(&o->s2, nstate >= 2 ? count : 0, ZB_DTYPE_F32);
  fill(&o->p, 1, 0);
  for (int k = 0; k < o->s1.count; k++) memset(o->s1.h[k], 0, (size_t)o->s1.numels[k] * 4);
  for (int k = 0; k < o->s2.count; k++) memset(o->s2.h[k], 0, (size_t)o->s2.numels[k] * 4);
  mirror_upload(&o->s1), mirror_upload(&o->s2);
  zb_optim_step_t s = {sizeof(zb_optim_step_t), ZB_OPTIM_STEP_VERSION, kind, 1e-2, momentum, 0.9, 0.999,
                       1e-8, 0.01, 1, 0.37f, gd, o->p.hl, o->g.hl, o->s1.hl, o->s2.hl, NULL};
  o->hs = s;
  s.params = o->p.dl, s.grads = o->g.dl, s.state1 = o->s1.dl, s.state2 = o->s2.dl;
  o->ds = s;
  size_t bytes = 0;
  ZB_ASSERT_OK(zb_optim_undo_bytes(&o->hs, &bytes));
  ZB_ASSERT_OK(zb_backend_alloc(g_host, bytes, (void **)&o->hundo));
  ZB_ASSERT_OK(zb_backend_alloc(g_cuda, bytes, (void **)&o->dundo));
}

static void optim_free(optim_case_t *o) {
  mirror_free(&o->p), mirror_free(&o->g), mirror_free(&o->s1), mirror_free(&o->s2);
  ZB_ASSERT_OK(zb_backend_free(g_host, o->hundo));
  ZB_ASSERT_OK(zb_backend_free(g_cuda, o->dundo));
}

static void optim_expect_equal(optim_case_t *o, const char *what) {
  mirror_expect_equal(&o->p, what);
  mirror_expect_equal(&o->s1, what);
  mirror_expect_equal(&o->s2, what);
}

/* Steps 1-3 plainly, step 4 with an undo copy, the undo, then step 4 again: after each, device and
 * host agree bit for bit; after the undo both hold what step 3 left. */
static void run_optim(zb_optim_kind_t kind, double momentum, zb_dtype_t gd, int count) {
  optim_case_t o;
  optim_make(&o, kind, momentum, gd, count);
  char what[96];
  for (int t = 1; t <= 4; t++) {
    fill(&o.g, 100 + (uint64_t)t, 0);
    o.hs.step = o.ds.step = t;
    o.hs.factor = o.ds.factor = t == 2 ? 1.0f : 0.37f;
    o.hs.undo = t == 4 ? o.hundo : NULL;
    o.ds.undo = t == 4 ? o.dundo : NULL;
    ZB_ASSERT_OK(zb_optim_step(g_host, &o.hs));
    ZB_ASSERT_OK(zb_optim_step(g_cuda, &o.ds));
    snprintf(what, sizeof what, "kind %d momentum %g grads %d, %d tensors, step %d", (int)kind,
             momentum, (int)gd, count, t);
    optim_expect_equal(&o, what);
  }
  /* The host's undo restores step 3's result bit for bit (test_kernels_ref.c), and step 3 was
   * equal on both sides: so equal sides after the undo mean the device restored it too. */
  ZB_ASSERT_OK(zb_optim_undo(g_host, &o.hs));
  ZB_ASSERT_OK(zb_optim_undo(g_cuda, &o.ds));
  strncat(what, ", undone", sizeof what - strlen(what) - 1);
  optim_expect_equal(&o, what);
  ZB_ASSERT_OK(zb_optim_step(g_host, &o.hs));
  ZB_ASSERT_OK(zb_optim_step(g_cuda, &o.ds));
  strncat(what, ", redone", sizeof what - strlen(what) - 1);
  optim_expect_equal(&o, what);
  optim_free(&o);
}

static void test_optim_adamw(void **state) {
  for (int d = 0; d < 3; d++) run_optim(ZB_OPTIM_ADAMW, 0.0, kDtypes[d], kCounts[0]);
  run_optim(ZB_OPTIM_ADAMW, 0.0, ZB_DTYPE_F32, kCounts[1]);
}

static void test_optim_sgd(void **state) {
  for (int d = 0; d < 3; d++) {
    run_optim(ZB_OPTIM_SGD, 0.9, kDtypes[d], kCounts[0]);
    run_optim(ZB_OPTIM_SGD, 0.0, kDtypes[d], kCounts[0]);
  }
  run_optim(ZB_OPTIM_SGD, 0.9, ZB_DTYPE_BF16, kCounts[1]);
}

int main(void) {
  if (!zb_cuda_built()) {
    printf("gpu_kernels: skipped: this libzbpp was built without CUDA\n");
    return 77;
  }
  int32_t devices = 0;
  if (zb_cuda_device_count(&devices) != ZB_OK || devices == 0) {
    printf("gpu_kernels: skipped: no CUDA device is visible\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sq_norm),     cmocka_unit_test(test_unscale),
      cmocka_unit_test(test_scale_update), cmocka_unit_test(test_optim_adamw),
      cmocka_unit_test(test_optim_sgd),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
