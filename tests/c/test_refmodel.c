/*
 * test_refmodel.c - the reference model (csrc/runtime/refmodel.h) as the runtime relies on it:
 * its loss and weight gradients agree with an independent double-precision implementation of the
 * same network; B leaves every weight gradient alone (W does that work); any partition of the
 * stages over instances, any op order and any thread give the same bits; W-store lifetimes are
 * counted and a reused slot is refused; bad configurations and unowned stages get clear errors.
 *
 * Expected values come from refmodel.h's formulas, computed here in double with plain loops, never
 * from the code under test. What this is not: a test of the W store or the runner; the W store is
 * driven by hand here (begin, backward, end, pop) as the runner would drive it.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "runtime/refmodel.h"

/* ---- assertions that print both sides -------------------------------------------------------- */

#define ASSERT_I64(actual, expected)                                                               \
  do {                                                                                             \
    long long zb__a = (long long)(actual), zb__e = (long long)(expected);                          \
    if (zb__a != zb__e) fail_msg("%s is %lld, expected %lld", #actual, zb__a, zb__e);             \
  } while (0)

/* ---- the model used throughout: S=3 stages of 2 blocks, d=8, f=16, 4 rows, m=3 -------------- */

#define MAX_STAGES 8

static zb__refmodel_config_t small_config(void) {
  zb__refmodel_config_t c;
  memset(&c, 0, sizeof c);
  c.stages = 3;
  c.layers = 2;
  c.width = 8;
  c.ffn = 16;
  c.rows = 4;
  c.microbatches = 3;
  c.seed = 20240611;
  return c;
}

static int64_t rd_of(const zb__refmodel_config_t *c) { return (int64_t)c->rows * c->width; }
/* Floats of one block's parameters, from refmodel.h: W1 [f, d], b1 [f], W2 [d, f], b2 [d]. */
static int64_t block_n(const zb__refmodel_config_t *c) {
  return 2 * (int64_t)c->ffn * c->width + c->ffn + c->width;
}

/* ---- a model instance with its own host backend and W store ---------------------------------- */

typedef struct {
  zb__refmodel_t *model;
  zb_backend_t *be;
  zb_wstore_t *ws;
} rig_t;

static void rig_open(rig_t *r, const zb__refmodel_config_t *cfg, const int32_t *own, int32_t n) {
  memset(r, 0, sizeof *r);
  ZB_ASSERT_OK(zb__refmodel_create(&r->model, cfg, own, n));
  ZB_ASSERT_OK(zb_backend_create_host(&r->be));
  ZB_ASSERT_OK(zb_wstore_create(&r->ws, r->be, zb__refmodel_release, r->model));
  zb__refmodel_set_wstore(r->model, r->ws);
}

static void rig_open_all(rig_t *r, const zb__refmodel_config_t *cfg) {
  int32_t own[MAX_STAGES];
  for (int32_t s = 0; s < cfg->stages; s++) own[s] = s;
  rig_open(r, cfg, own, cfg->stages);
}

/* The W store goes first: its pending entries point into the model's buffers. */
static void rig_close(rig_t *r) {
  ZB_ASSERT_OK(zb_wstore_destroy(r->ws));
  ASSERT_I64(zb__refmodel_pending_saves(r->model), 0);
  zb__refmodel_destroy(r->model);
  ZB_ASSERT_OK(zb_backend_destroy(r->be));
}

/* B as the runner runs it: inside a W-store group of (stage, mb). */
static void run_b(rig_t *r, int32_t s, int32_t mb, const float *grad_out, float *grad_in) {
  ZB_ASSERT_OK(zb_wstore_begin(r->ws, s, mb));
  ZB_ASSERT_OK(zb__refmodel_backward(r->model, s, mb, grad_out, grad_in));
  ZB_ASSERT_OK(zb_wstore_end(r->ws));
}

/* ---- a pipeline: which instance runs each stage, and the boundary buffers between them ------- */

typedef struct {
  zb__refmodel_config_t cfg;
  rig_t *of[MAX_STAGES]; /* the instance that owns stage s */
  float *act;            /* [S][m][rows*d]: output of stage s for mb */
  float *grad;           /* [S][m][rows*d]: gradient for the input of stage s */
} pipe_t;

static void pipe_init(pipe_t *p, const zb__refmodel_config_t *cfg) {
  memset(p, 0, sizeof *p);
  p->cfg = *cfg;
  size_t n = (size_t)cfg->stages * cfg->microbatches * rd_of(cfg);
  p->act = calloc(n, sizeof(float));
  p->grad = calloc(n, sizeof(float));
  assert_non_null(p->act);
  assert_non_null(p->grad);
}

static void pipe_free(pipe_t *p) {
  free(p->act);
  free(p->grad);
}

static float *act_of(pipe_t *p, int32_t s, int32_t mb) {
  return p->act + ((int64_t)s * p->cfg.microbatches + mb) * rd_of(&p->cfg);
}
static float *grad_of(pipe_t *p, int32_t s, int32_t mb) {
  return p->grad + ((int64_t)s * p->cfg.microbatches + mb) * rd_of(&p->cfg);
}

static void pipe_begin(pipe_t *p, int32_t step, float scale) {
  for (int32_t s = 0; s < p->cfg.stages; s++) zb__refmodel_begin_step(p->of[s]->model, step, scale);
}

static void pipe_f(pipe_t *p, int32_t s, int32_t mb) {
  const int32_t S = p->cfg.stages;
  ZB_ASSERT_OK(zb__refmodel_forward(p->of[s]->model, s, mb, s > 0 ? act_of(p, s - 1, mb) : NULL,
                                    s < S - 1 ? act_of(p, s, mb) : NULL));
}

static void pipe_b(pipe_t *p, int32_t s, int32_t mb) {
  const int32_t S = p->cfg.stages;
  run_b(p->of[s], s, mb, s < S - 1 ? grad_of(p, s + 1, mb) : NULL,
        s > 0 ? grad_of(p, s, mb) : NULL);
}

/* Every F, then every B, in one of two orders that both respect the dependencies: order 0 runs
 * microbatch by microbatch (all stages of mb 0 first), order 1 stage by stage. Either way each
 * stage sees its microbatches in order, as every schedule's B ops do. */
static void pipe_forwards(pipe_t *p, int order) {
  const int32_t S = p->cfg.stages, M = p->cfg.microbatches;
  for (int32_t a = 0; a < (order ? S : M); a++)
    for (int32_t b = 0; b < (order ? M : S); b++) pipe_f(p, order ? a : b, order ? b : a);
}

static void pipe_backwards(pipe_t *p, int order) {
  const int32_t S = p->cfg.stages, M = p->cfg.microbatches;
  for (int32_t a = 0; a < (order ? S : M); a++)
    for (int32_t b = 0; b < (order ? M : S); b++) {
      int32_t s = order ? S - 1 - a : S - 1 - b, mb = order ? b : a;
      pipe_b(p, s, mb);
    }
}

/* Every W: the oldest group of each stage, which must be microbatch 0, 1, ... in turn. */
static void pipe_pops(pipe_t *p) {
  for (int32_t s = 0; s < p->cfg.stages; s++)
    for (int32_t mb = 0; mb < p->cfg.microbatches; mb++) {
      int32_t got = -1;
      ZB_ASSERT_OK(zb_wstore_pop_run(p->of[s]->ws, s, &got));
      if (got != mb) fail_msg("W of stage %d popped microbatch %d, expected %d", s, got, mb);
    }
}

static void pipe_iteration(pipe_t *p, int32_t step, float scale, int order) {
  pipe_begin(p, step, scale);
  pipe_forwards(p, order);
  pipe_backwards(p, order);
  pipe_pops(p);
}

/* ---- the independent reference: the network of refmodel.h in double, with plain loops -------- */

/* GELU, tanh form, and its derivative (torch.nn.GELU(approximate="tanh")). */
#define REF_PI 3.14159265358979323846

static double ref_gelu(double h) {
  const double k = sqrt(2.0 / REF_PI);
  return 0.5 * h * (1.0 + tanh(k * (h + 0.044715 * h * h * h)));
}
static double ref_gelu_grad(double h) {
  const double k = sqrt(2.0 / REF_PI), u = k * (h + 0.044715 * h * h * h), t = tanh(u);
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * h * h);
}

/* Loss and scale * dloss/dparams for all S stages. param[s] are the model's fp32 parameters of
 * stage s, x0[mb] the input and t[mb] the target of microbatch mb ([rows, d] each). grad[s] gets
 * the gradients in the model's flat layout. */
static double reference(const zb__refmodel_config_t *c, float *const *param, const double *x0,
                        const double *t, double scale, double **grad) {
  const int S = c->stages, L = c->layers, d = c->width, f = c->ffn, r = c->rows,
            m = c->microbatches;
  const int64_t rd = (int64_t)r * d, rf = (int64_t)r * f, nb = block_n(c);
  const int NB = S * L; /* blocks in the whole network, indexed by s * L + j */
  /* x, h and a of every block (the backward pass needs them all), then the running y/dy/dx/dh. */
  double *xs = calloc((size_t)NB * rd, sizeof(double)),
         *hs = calloc((size_t)NB * rf, sizeof(double)),
         *as = calloc((size_t)NB * rf, sizeof(double)), *y = calloc((size_t)rd, sizeof(double)),
         *dy = calloc((size_t)rd, sizeof(double)), *dx = calloc((size_t)rd, sizeof(double)),
         *dh = calloc((size_t)rf, sizeof(double));
  assert_true(xs && hs && as && y && dy && dx && dh);
  for (int s = 0; s < S; s++)
    for (int64_t k = 0; k < L * nb; k++) grad[s][k] = 0.0;
  double loss = 0.0;
  for (int mb = 0; mb < m; mb++) {
    /* forward: h = x W1^T + b1, a = gelu(h), y = x + a W2^T + b2 */
    memcpy(y, x0 + mb * rd, (size_t)rd * sizeof(double));
    for (int b = 0; b < NB; b++) {
      const float *w1 = param[b / L] + (b % L) * nb, *b1 = w1 + f * d, *w2 = b1 + f,
                  *b2 = w2 + d * f;
      double *x = xs + b * rd, *h = hs + b * rf, *a = as + b * rf;
      memcpy(x, y, (size_t)rd * sizeof(double));
      for (int i = 0; i < r; i++)
        for (int o = 0; o < f; o++) {
          double acc = b1[o];
          for (int k = 0; k < d; k++) acc += x[i * d + k] * w1[o * d + k];
          h[i * f + o] = acc;
          a[i * f + o] = ref_gelu(acc);
        }
      for (int i = 0; i < r; i++)
        for (int o = 0; o < d; o++) {
          double acc = x[i * d + o] + b2[o];
          for (int k = 0; k < f; k++) acc += a[i * f + k] * w2[o * f + k];
          y[i * d + o] = acc;
        }
    }
    /* loss: L_i = mean((y - t)^2), loss = (1/m) sum L_i; dL/dy = 2 (y - t) / (rows d) / m */
    double li = 0.0;
    for (int64_t k = 0; k < rd; k++) {
      double e = y[k] - t[mb * rd + k];
      li += e * e;
      dy[k] = scale * 2.0 * e / (double)rd / m;
    }
    loss += li / (double)rd / m;
    /* backward through every block, last to first */
    for (int b = NB - 1; b >= 0; b--) {
      const float *w1 = param[b / L] + (b % L) * nb, *w2 = w1 + f * d + f;
      double *g1 = grad[b / L] + (b % L) * nb, *gb1 = g1 + f * d, *g2 = gb1 + f, *gb2 = g2 + d * f;
      const double *x = xs + b * rd, *h = hs + b * rf, *a = as + b * rf;
      for (int i = 0; i < r; i++)
        for (int o = 0; o < d; o++) {
          gb2[o] += dy[i * d + o];
          for (int k = 0; k < f; k++) g2[o * f + k] += dy[i * d + o] * a[i * f + k];
        }
      for (int i = 0; i < r; i++)
        for (int k = 0; k < f; k++) {
          double da = 0.0;
          for (int o = 0; o < d; o++) da += dy[i * d + o] * w2[o * f + k];
          dh[i * f + k] = da * ref_gelu_grad(h[i * f + k]);
        }
      for (int i = 0; i < r; i++)
        for (int o = 0; o < f; o++) {
          gb1[o] += dh[i * f + o];
          for (int k = 0; k < d; k++) g1[o * d + k] += dh[i * f + o] * x[i * d + k];
        }
      for (int i = 0; i < r; i++)
        for (int k = 0; k < d; k++) {
          double acc = dy[i * d + k];
          for (int o = 0; o < f; o++) acc += dh[i * f + o] * w1[o * d + k];
          dx[i * d + k] = acc;
        }
      memcpy(dy, dx, (size_t)rd * sizeof(double));
    }
  }
  free(xs), free(hs), free(as), free(y), free(dy), free(dx), free(dh);
  return loss;
}

/* The model's input and target data, read back through the model itself without knowing its
 * generator: with W2 = 0 and b2 = 0 every block is the identity (y = x + 0 exactly), so stage 0
 * outputs its generated input unchanged; and the last stage fed zeros has y - t = -t, whose
 * gradient -k t passes unchanged to grad_input (da = dy W2 = 0, so dx = dy). With loss scale
 * rows*d*m/2 the factor k = 2/(rows d)/m * scale is 1. Only F and B of the probes run, so a wrong
 * generator or loss definition still shows up as a mismatch below. */
static void read_back_data(const zb__refmodel_config_t *cfg, int32_t step, double *x0, double *t) {
  const int32_t S = cfg->stages, M = cfg->microbatches;
  const int64_t rd = rd_of(cfg), nb = block_n(cfg);
  float *buf = calloc((size_t)rd, sizeof(float)), *zeros = calloc((size_t)rd, sizeof(float));
  assert_true(buf && zeros);
  for (int probe = 0; probe < 2; probe++) {
    int32_t stage = probe == 0 ? 0 : S - 1;
    rig_t r;
    rig_open(&r, cfg, &stage, 1);
    float *p;
    ZB_ASSERT_OK(zb__refmodel_stage_params(r.model, stage, &p, NULL, NULL));
    for (int32_t j = 0; j < cfg->layers; j++) {
      float *w2 = p + j * nb + (int64_t)cfg->ffn * cfg->width + cfg->ffn;
      memset(w2, 0, (size_t)(cfg->width * cfg->ffn + cfg->width) * sizeof(float)); /* W2, b2 */
    }
    const double scale = (double)rd * M / 2.0;
    zb__refmodel_begin_step(r.model, step, (float)scale);
    for (int32_t mb = 0; mb < M; mb++) {
      if (probe == 0) {
        ZB_ASSERT_OK(zb__refmodel_forward(r.model, 0, mb, NULL, buf));
        for (int64_t k = 0; k < rd; k++) x0[mb * rd + k] = buf[k];
      } else {
        ZB_ASSERT_OK(zb__refmodel_forward(r.model, stage, mb, zeros, NULL));
        run_b(&r, stage, mb, NULL, buf);
        for (int64_t k = 0; k < rd; k++) t[mb * rd + k] = -(double)buf[k];
      }
    }
    if (probe == 1) {
      /* The loss of y = 0 is mean(t^2): the loss definition checked on its own. */
      double want = 0.0;
      for (int64_t k = 0; k < M * rd; k++) want += t[k] * t[k] / (double)rd / M;
      double got = zb__refmodel_loss(r.model);
      if (!(fabs(got - want) <= 1e-6 * want)) fail_msg("probe loss %.9g, expected %.9g", got, want);
    }
    rig_close(&r);
  }
  free(buf);
  free(zeros);
}

/* ---- 1. gradients against the reference ------------------------------------------------------ */

/* Tolerance. The model computes in fp32 (unit roundoff u = 6e-8) through 6 blocks whose dot
 * products have at most 16 terms, with double accumulation only in the loss. Forward rounding
 * error relative to the magnitudes involved is about (number of roundings) * u, well below 1e-5
 * here, and backward doubles it at most. Gradient entries can be small through cancellation, so
 * each one is compared against the scale of its tensor: |got - want| <= 1e-4 * (|want| + max|want|
 * of the tensor) - a hundred times the expected error, and far below what any real mistake (a
 * transposed matrix, a missing bias term or factor, a wrong scale) produces, which is O(1). */
#define GRAD_RTOL 1e-4

static void compare_tensor(const char *name, int s, int j, const float *got, const double *want,
                           int64_t n, double *worst) {
  double scale = 0.0;
  for (int64_t k = 0; k < n; k++) scale = fmax(scale, fabs(want[k]));
  if (!(scale > 0.0)) fail_msg("reference %s of stage %d block %d is all zero", name, s, j);
  for (int64_t k = 0; k < n; k++) {
    double err = fabs((double)got[k] - want[k]);
    *worst = fmax(*worst, err / (fabs(want[k]) + scale));
    if (!(err <= GRAD_RTOL * (fabs(want[k]) + scale)))
      fail_msg("%s of stage %d block %d, element %lld: model %.9g, reference %.9g (tensor scale "
               "%.3g)",
               name, s, j, (long long)k, (double)got[k], want[k], scale);
  }
}

static void test_gradients_match_reference(void **state) {
  (void)state;
  const zb__refmodel_config_t cfg = small_config();
  const int32_t S = cfg.stages, M = cfg.microbatches, step = 2;
  const float scale = 8.0f; /* a loss scale other than 1, so forgetting it shows */
  const int64_t rd = rd_of(&cfg), nb = block_n(&cfg), d = cfg.width, f = cfg.ffn;

  const size_t nd = (size_t)(M * rd);
  double *x0 = calloc(nd, sizeof(double)), *t = calloc(nd, sizeof(double));
  double *x0n = calloc(nd, sizeof(double)), *tn = calloc(nd, sizeof(double));
  assert_true(x0 && t && x0n && tn);
  read_back_data(&cfg, step, x0, t);
  /* refmodel.h: input and target of microbatch i at step k come from (seed, k, i). So they differ
   * between microbatches, between steps, and from each other. */
  read_back_data(&cfg, step + 1, x0n, tn);
  const size_t bytes = (size_t)rd * sizeof(double);
  if (!memcmp(x0, x0 + rd, bytes) || !memcmp(t, t + rd, bytes))
    fail_msg("microbatches 0 and 1 got the same input or target");
  if (!memcmp(x0, x0n, bytes * (size_t)M) || !memcmp(t, tn, bytes * (size_t)M))
    fail_msg("steps %d and %d got the same inputs or targets", step, step + 1);
  if (!memcmp(x0, t, bytes)) fail_msg("the input and the target of microbatch 0 are the same");
  for (int64_t k = 0; k < M * rd; k++)
    if (!isfinite(x0[k]) || !isfinite(t[k]))
      fail_msg("data value %lld is not finite: input %g target %g", (long long)k, x0[k], t[k]);
  free(x0n);
  free(tn);

  rig_t r;
  rig_open_all(&r, &cfg);
  pipe_t p;
  pipe_init(&p, &cfg);
  for (int32_t s = 0; s < S; s++) p.of[s] = &r;
  pipe_iteration(&p, step, scale, 0);

  float *param[MAX_STAGES], *grad[MAX_STAGES];
  double *want[MAX_STAGES];
  int64_t n = 0;
  for (int32_t s = 0; s < S; s++) {
    ZB_ASSERT_OK(zb__refmodel_stage_params(r.model, s, &param[s], &grad[s], &n));
    ASSERT_I64(n, cfg.layers * nb);
    want[s] = calloc((size_t)n, sizeof(double));
    assert_non_null(want[s]);
  }
  double want_loss = reference(&cfg, param, x0, t, scale, want);
  double got_loss = zb__refmodel_loss(r.model);
  if (!(fabs(got_loss - want_loss) <= GRAD_RTOL * want_loss))
    fail_msg("loss %.9g, reference %.9g", got_loss, want_loss);

  double worst = 0.0;
  for (int32_t s = 0; s < S; s++)
    for (int32_t j = 0; j < cfg.layers; j++) {
      const float *g = grad[s] + j * nb;
      const double *w = want[s] + j * nb;
      compare_tensor("dW1", s, j, g, w, f * d, &worst);
      compare_tensor("db1", s, j, g + f * d, w + f * d, f, &worst);
      compare_tensor("dW2", s, j, g + f * d + f, w + f * d + f, d * f, &worst);
      compare_tensor("db2", s, j, g + 2 * f * d + f, w + 2 * f * d + f, d, &worst);
    }
  print_message("worst relative gradient error %.3g (bound %.0e), loss %.9g vs %.9g\n", worst,
                GRAD_RTOL, got_loss, want_loss);

  for (int32_t s = 0; s < S; s++) free(want[s]);
  free(x0);
  free(t);
  pipe_free(&p);
  rig_close(&r);
}

/* ---- 2. B touches no weight gradient --------------------------------------------------------- */

static void test_backward_leaves_weight_gradients(void **state) {
  (void)state;
  const zb__refmodel_config_t cfg = small_config();
  const int32_t S = cfg.stages;
  const int64_t nb = block_n(&cfg), d = cfg.width, f = cfg.ffn;
  rig_t r;
  rig_open_all(&r, &cfg);
  pipe_t p;
  pipe_init(&p, &cfg);
  for (int32_t s = 0; s < S; s++) p.of[s] = &r;

  float *param[MAX_STAGES], *grad[MAX_STAGES], *before[MAX_STAGES];
  int64_t n = 0;
  for (int32_t s = 0; s < S; s++) {
    ZB_ASSERT_OK(zb__refmodel_stage_params(r.model, s, &param[s], &grad[s], &n));
    before[s] = malloc((size_t)n * sizeof(float));
    assert_non_null(before[s]);
    memcpy(before[s], param[s], (size_t)n * sizeof(float));
  }
  pipe_begin(&p, 0, 1.0f);
  pipe_forwards(&p, 0);
  pipe_backwards(&p, 0);
  for (int32_t s = 0; s < S; s++)
    for (int64_t k = 0; k < n; k++)
      if (grad[s][k] != 0.0f)
        fail_msg("after all B ops and before any W, gradient %lld of stage %d is %.9g, not 0",
                 (long long)k, s, (double)grad[s][k]);

  pipe_pops(&p);
  /* Every tensor of every block must have received something from W. */
  const int64_t off[4] = {0, f * d, f * d + f, 2 * f * d + f}, len[4] = {f * d, f, d * f, d};
  const char *names[4] = {"dW1", "db1", "dW2", "db2"};
  for (int32_t s = 0; s < S; s++) {
    for (int32_t j = 0; j < cfg.layers; j++)
      for (int q = 0; q < 4; q++) {
        int nonzero = 0;
        for (int64_t k = 0; k < len[q]; k++) nonzero += grad[s][j * nb + off[q] + k] != 0.0f;
        if (!nonzero) fail_msg("%s of stage %d block %d is all zero after W", names[q], s, j);
      }
    if (memcmp(before[s], param[s], (size_t)n * sizeof(float)) != 0)
      fail_msg("the parameters of stage %d changed during F/B/W", s);
    free(before[s]);
  }
  pipe_free(&p);
  rig_close(&r);
}

/* ---- 3. partitions, op orders and threads give the same bits --------------------------------- */

typedef struct {
  zb__refmodel_config_t cfg;
  int32_t step;
  float *grads; /* [S][n] */
  double loss;
  zb_status_t status; /* of the first call that failed */
  char error[512];    /* its message */
} run_result_t;

/* One iteration of an all-stage instance (every F, every B in reverse, every W, microbatch by
 * microbatch), with the results copied out. It checks statuses instead of asserting, because it
 * also runs in a second thread, where a cmocka failure cannot unwind. */
#define RUN_CHECK(expr)                                                                            \
  do {                                                                                             \
    zb_status_t zb__st = (expr);                                                                   \
    if (zb__st != ZB_OK && res->status == ZB_OK) {                                                 \
      res->status = zb__st;                                                                        \
      snprintf(res->error, sizeof res->error, "%s: %s", #expr, zb_last_error());                   \
    }                                                                                              \
    if (zb__st != ZB_OK) goto done;                                                                \
  } while (0)

static void run_single(run_result_t *res) {
  const zb__refmodel_config_t *c = &res->cfg;
  const int32_t S = c->stages, M = c->microbatches;
  const size_t bytes = (size_t)rd_of(c) * sizeof(float);
  int32_t all[MAX_STAGES];
  for (int32_t s = 0; s < S; s++) all[s] = s;
  zb__refmodel_t *model = NULL;
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  float *act[MAX_STAGES] = {NULL}, *grad[MAX_STAGES] = {NULL};
  res->status = ZB_OK;
  res->error[0] = '\0';
  for (int32_t s = 0; s < S; s++) {
    act[s] = malloc(bytes);
    grad[s] = malloc(bytes);
    if (!act[s] || !grad[s]) RUN_CHECK(ZB_ERR_OUT_OF_MEMORY);
  }
  RUN_CHECK(zb__refmodel_create(&model, c, all, S));
  RUN_CHECK(zb_backend_create_host(&be));
  RUN_CHECK(zb_wstore_create(&ws, be, zb__refmodel_release, model));
  zb__refmodel_set_wstore(model, ws);
  zb__refmodel_begin_step(model, res->step, 4.0f);
  for (int32_t mb = 0; mb < M; mb++) {
    for (int32_t s = 0; s < S; s++)
      RUN_CHECK(
          zb__refmodel_forward(model, s, mb, s ? act[s - 1] : NULL, s < S - 1 ? act[s] : NULL));
    for (int32_t s = S - 1; s >= 0; s--) {
      RUN_CHECK(zb_wstore_begin(ws, s, mb));
      RUN_CHECK(zb__refmodel_backward(model, s, mb, s < S - 1 ? grad[s + 1] : NULL,
                                      s ? grad[s] : NULL));
      RUN_CHECK(zb_wstore_end(ws));
    }
  }
  for (int32_t s = 0; s < S; s++)
    for (int32_t mb = 0; mb < M; mb++) RUN_CHECK(zb_wstore_pop_run(ws, s, NULL));
  for (int32_t s = 0; s < S; s++) {
    float *g;
    int64_t n;
    RUN_CHECK(zb__refmodel_stage_params(model, s, NULL, &g, &n));
    memcpy(res->grads + s * n, g, (size_t)n * sizeof(float));
  }
  res->loss = zb__refmodel_loss(model);
done:
  zb_wstore_destroy(ws);
  zb__refmodel_destroy(model);
  zb_backend_destroy(be);
  for (int32_t s = 0; s < S; s++) free(act[s]), free(grad[s]);
}

static void *run_single_thread(void *arg) {
  run_single(arg);
  return NULL;
}

static void check_run(const char *what, const run_result_t *res) {
  if (res->status != ZB_OK)
    fail_msg("%s: %s -> %s", what, res->error, zb_status_string(res->status));
}

static void assert_same_bits(const char *what, const run_result_t *a, const run_result_t *b,
                             int64_t n) {
  if (memcmp(&a->loss, &b->loss, sizeof(double)) != 0)
    fail_msg("%s: loss %.17g vs %.17g", what, a->loss, b->loss);
  for (int32_t s = 0; s < a->cfg.stages; s++)
    for (int64_t k = 0; k < n; k++)
      if (memcmp(&a->grads[s * n + k], &b->grads[s * n + k], sizeof(float)) != 0)
        fail_msg("%s: gradient %lld of stage %d: %.9g vs %.9g", what, (long long)k, s,
                 (double)a->grads[s * n + k], (double)b->grads[s * n + k]);
}

static void test_partition_bit_identical(void **state) {
  (void)state;
  const zb__refmodel_config_t cfg = small_config();
  const int32_t S = cfg.stages;
  const int64_t n = cfg.layers * block_n(&cfg);
  run_result_t single = {cfg, 1, calloc((size_t)(S * n), sizeof(float)), 0.0, ZB_OK, ""};
  run_result_t thread = {cfg, 1, calloc((size_t)(S * n), sizeof(float)), 0.0, ZB_OK, ""};
  run_result_t part = {cfg, 1, calloc((size_t)(S * n), sizeof(float)), 0.0, ZB_OK, ""};
  run_result_t other_step = {cfg, 2, calloc((size_t)(S * n), sizeof(float)), 0.0, ZB_OK, ""};
  assert_true(single.grads && thread.grads && part.grads && other_step.grads);
  /* The same iteration in a second thread, at the same time as this one: nothing is shared
   * between instances, so the two must not disturb each other. */
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, run_single_thread, &thread), 0);
  run_single(&single);
  assert_int_equal(pthread_join(th, NULL), 0);
  check_run("all stages, main thread", &single);
  check_run("all stages, second thread", &thread);
  assert_same_bits("an all-stage instance in another thread", &single, &thread, n);
  run_single(&other_step);
  check_run("all stages, another step", &other_step);

  /* Two instances, {0, 2} and {1}, each with its own W store, run stage by stage (order 1). A
   * step is run first and thrown away, so begin_step's reset is covered too. */
  const int32_t own_a[2] = {2, 0}, own_b[1] = {1};
  rig_t a, b;
  rig_open(&a, &cfg, own_a, 2);
  rig_open(&b, &cfg, own_b, 1);
  pipe_t p;
  pipe_init(&p, &cfg);
  p.of[0] = &a, p.of[1] = &b, p.of[2] = &a;
  pipe_iteration(&p, 0, 1.0f, 1);
  pipe_iteration(&p, part.step, 4.0f, 1);
  for (int32_t s = 0; s < S; s++) {
    float *g, *pa, *ps;
    int64_t nn;
    ZB_ASSERT_OK(zb__refmodel_stage_params(p.of[s]->model, s, &pa, &g, &nn));
    ASSERT_I64(nn, n);
    memcpy(part.grads + s * n, g, (size_t)n * sizeof(float));
    /* The initial parameters depend on (seed, stage) only; compare with a fresh all-stage model. */
    zb__refmodel_t *fresh;
    int32_t all[MAX_STAGES];
    for (int32_t k = 0; k < S; k++) all[k] = k;
    ZB_ASSERT_OK(zb__refmodel_create(&fresh, &cfg, all, S));
    ZB_ASSERT_OK(zb__refmodel_stage_params(fresh, s, &ps, NULL, NULL));
    if (memcmp(pa, ps, (size_t)n * sizeof(float)) != 0)
      fail_msg("stage %d's parameters differ between the partitioned and the all-stage instance",
               s);
    zb__refmodel_destroy(fresh);
  }
  part.loss = zb__refmodel_loss(a.model);
  double loss_b = zb__refmodel_loss(b.model);
  if (!isnan(loss_b))
    fail_msg("the instance without the last stage reports loss %g, not NaN", loss_b);
  assert_same_bits("instances {0, 2} and {1}, stage-major order", &single, &part, n);

  /* The data do depend on the step: the same comparison for another step must fail. */
  if (memcmp(single.grads, other_step.grads, (size_t)(S * n) * sizeof(float)) == 0 ||
      single.loss == other_step.loss)
    fail_msg("steps 1 and 2 gave the same gradients or loss (%.17g): the data ignore the step",
             single.loss);

  pipe_free(&p);
  rig_close(&a);
  rig_close(&b);
  free(single.grads), free(thread.grads), free(part.grads), free(other_step.grads);
}

/* ---- 4. W-store lifetimes -------------------------------------------------------------------- */

static void test_lifetimes(void **state) {
  (void)state;
  const zb__refmodel_config_t cfg = small_config();
  const int32_t S = cfg.stages, M = cfg.microbatches, L = cfg.layers;
  rig_t r;
  rig_open_all(&r, &cfg);
  pipe_t p;
  pipe_init(&p, &cfg);
  for (int32_t s = 0; s < S; s++) p.of[s] = &r;

  pipe_begin(&p, 0, 1.0f);
  ASSERT_I64(zb__refmodel_pending_saves(r.model), 0);
  pipe_forwards(&p, 0);
  ASSERT_I64(zb__refmodel_pending_saves(r.model), 0); /* F pushes nothing */
  pipe_backwards(&p, 0);
  /* refmodel.h: two entries per block per B. */
  ASSERT_I64(zb__refmodel_pending_saves(r.model), (int64_t)S * M * L * 2);

  /* Reusing a slot whose W has not run must fail, naming the stage and the microbatch. */
  ASSERT_STATUS(zb__refmodel_forward(r.model, 1, 0, act_of(&p, 0, 0), act_of(&p, 1, 0)),
                ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage 1");
  ASSERT_CONTAINS(zb_last_error(), "microbatch 0");
  ASSERT_CONTAINS(zb_last_error(), "pending");
  /* So must a second B of the same (stage, mb). */
  ZB_ASSERT_OK(zb_wstore_begin(r.ws, 2, 1));
  ASSERT_STATUS(zb__refmodel_backward(r.model, 2, 1, NULL, grad_of(&p, 2, 1)),
                ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage 2 microbatch 1");
  ZB_ASSERT_OK(zb_wstore_end(r.ws)); /* an empty group; zb_wstore_clear drops it below */

  /* W of (1, 0) releases its slot: F may run there again. */
  int32_t got = -1;
  ZB_ASSERT_OK(zb_wstore_pop_run(r.ws, 1, &got));
  assert_int_equal(got, 0);
  ASSERT_I64(zb__refmodel_pending_saves(r.model), (int64_t)S * M * L * 2 - 2 * L);
  ZB_ASSERT_OK(zb__refmodel_forward(r.model, 1, 0, act_of(&p, 0, 0), act_of(&p, 1, 0)));

  /* A token the model never made is ignored. */
  zb__refmodel_release(r.model, UINT64_MAX, 0);
  ASSERT_I64(zb__refmodel_pending_saves(r.model), (int64_t)S * M * L * 2 - 2 * L);

  /* Dropping everything (release with ran = 0) frees every slot. */
  ZB_ASSERT_OK(zb_wstore_clear(r.ws));
  ASSERT_I64(zb__refmodel_pending_saves(r.model), 0);
  ZB_ASSERT_OK(zb__refmodel_forward(r.model, 2, 1, act_of(&p, 1, 1), NULL));

  /* A new step drops unfinished forwards: B without this step's F is refused. */
  pipe_begin(&p, 1, 1.0f);
  ZB_ASSERT_OK(zb_wstore_begin(r.ws, 2, 1));
  ASSERT_STATUS(zb__refmodel_backward(r.model, 2, 1, NULL, grad_of(&p, 2, 1)),
                ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "forward has not run");
  ZB_ASSERT_OK(zb_wstore_clear(r.ws));

  /* A clean iteration ends with nothing pending, and so does the next one on reused slots. */
  for (int k = 0; k < 2; k++) {
    pipe_iteration(&p, 2 + k, 1.0f, k);
    ASSERT_I64(zb__refmodel_pending_saves(r.model), 0);
  }

  /* Destroying the store with work pending releases it too (rig_close checks pending is 0). */
  pipe_begin(&p, 4, 1.0f);
  pipe_forwards(&p, 0);
  pipe_backwards(&p, 0);
  assert_true(zb__refmodel_pending_saves(r.model) > 0);
  pipe_free(&p);
  rig_close(&r);
}

/* ---- 5. bad configuration and unowned stages ------------------------------------------------- */

static void expect_create_fails(const char *what, const zb__refmodel_config_t *cfg,
                                const int32_t *own, int32_t n_own, const char *needle1,
                                const char *needle2) {
  static char sentinel;
  zb__refmodel_t *m = (zb__refmodel_t *)(void *)&sentinel;
  zb_status_t st = zb__refmodel_create(&m, cfg, own, n_own);
  if (st != ZB_ERR_INVALID_ARGUMENT)
    fail_msg("%s: zb__refmodel_create -> %s, expected invalid argument; last error: %s", what,
             zb_status_string(st), zb_last_error());
  if (m != NULL) fail_msg("%s: *out not set to NULL on failure", what);
  if (needle1) ASSERT_CONTAINS(zb_last_error(), needle1);
  if (needle2) ASSERT_CONTAINS(zb_last_error(), needle2);
}

static void test_bad_config(void **state) {
  (void)state;
  const zb__refmodel_config_t good = small_config();
  const int32_t all[3] = {0, 1, 2};
  zb__refmodel_config_t c;

  expect_create_fails("NULL config", NULL, all, 3, "cfg", NULL);
  ASSERT_STATUS(zb__refmodel_create(NULL, &good, all, 3), ZB_ERR_INVALID_ARGUMENT);

  c = good, c.stages = 0;
  expect_create_fails("stages 0", &c, all, 3, "stages is 0", ">= 1");
  c = good, c.layers = -2;
  expect_create_fails("layers -2", &c, all, 3, "layers is -2", ">= 1");
  c = good, c.width = 0;
  expect_create_fails("width 0", &c, all, 3, "width is 0", ">= 1");
  c = good, c.ffn = 0;
  expect_create_fails("ffn 0", &c, all, 3, "ffn is 0", ">= 1");
  c = good, c.rows = -1;
  expect_create_fails("rows -1", &c, all, 3, "rows is -1", ">= 1");
  c = good, c.microbatches = 0;
  expect_create_fails("microbatches 0", &c, all, 3, "microbatches is 0", ">= 1");
  c = good, c.layers = INT32_MAX, c.width = INT32_MAX, c.ffn = INT32_MAX, c.rows = INT32_MAX;
  expect_create_fails("sizes that overflow", &c, all, 3, "too large", NULL);

  const int32_t out_of_range[2] = {0, 3}, twice[2] = {1, 1};
  expect_create_fails("stage 3 of 3", &good, out_of_range, 2, "stage 3", "0..2");
  expect_create_fails("stage listed twice", &good, twice, 2, "stage 1", "twice");
  expect_create_fails("no stages", &good, all, 0, "owned stages", "1 to 3");
  expect_create_fails("NULL stage list", &good, NULL, 2, "own_stages", NULL);

  ASSERT_I64(zb__refmodel_boundary_bytes(&good), 4 * 8 * 4);
  ASSERT_I64(zb__refmodel_boundary_bytes(NULL), 0);
}

static void test_unowned_stage(void **state) {
  (void)state;
  const zb__refmodel_config_t cfg = small_config();
  const int32_t own[2] = {0, 2};
  const int64_t rd = rd_of(&cfg);
  rig_t r;
  rig_open(&r, &cfg, own, 2);
  float *in = calloc((size_t)rd, sizeof(float)), *out = calloc((size_t)rd, sizeof(float));
  assert_true(in && out);
  zb__refmodel_begin_step(r.model, 0, 1.0f);

  ASSERT_STATUS(zb__refmodel_forward(r.model, 1, 0, in, out), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage 1 is not owned");
  ASSERT_CONTAINS(zb_last_error(), "0, 2");
  ZB_ASSERT_OK(zb_wstore_begin(r.ws, 1, 0));
  ASSERT_STATUS(zb__refmodel_backward(r.model, 1, 0, in, out), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage 1 is not owned");
  ZB_ASSERT_OK(zb_wstore_end(r.ws));
  ZB_ASSERT_OK(zb_wstore_clear(r.ws));
  float *p;
  ASSERT_STATUS(zb__refmodel_stage_params(r.model, 1, &p, NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "0, 2");

  ASSERT_STATUS(zb__refmodel_forward(r.model, 3, 0, in, out), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "outside 0..2");
  ASSERT_STATUS(zb__refmodel_forward(r.model, 0, 3, NULL, out), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "microbatch 3");
  ASSERT_STATUS(zb__refmodel_forward(r.model, 2, 0, NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "input is NULL");
  ASSERT_STATUS(zb__refmodel_forward(r.model, 0, 0, NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "output is NULL");
  ASSERT_STATUS(zb__refmodel_forward(NULL, 0, 0, NULL, out), ZB_ERR_INVALID_ARGUMENT);

  /* The loss exists only where the last stage is, and only once its forwards have run. */
  if (!isnan(zb__refmodel_loss(r.model))) fail_msg("loss before any forward is not NaN");
  ZB_ASSERT_OK(zb__refmodel_forward(r.model, 2, 0, in, NULL));
  if (!isnan(zb__refmodel_loss(r.model))) fail_msg("loss after 1 of 3 forwards is not NaN");

  /* Without a W store B cannot push its W work and says so. */
  zb__refmodel_set_wstore(r.model, NULL);
  ASSERT_STATUS(zb__refmodel_backward(r.model, 2, 0, NULL, out), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "no W store");
  zb__refmodel_set_wstore(r.model, r.ws);
  /* B of stage 2 needs no grad_output, but a non-last stage does. */
  ZB_ASSERT_OK(zb__refmodel_forward(r.model, 0, 1, NULL, out));
  ZB_ASSERT_OK(zb_wstore_begin(r.ws, 0, 1));
  ASSERT_STATUS(zb__refmodel_backward(r.model, 0, 1, NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "grad_output is NULL");
  ZB_ASSERT_OK(zb_wstore_end(r.ws));
  ZB_ASSERT_OK(zb_wstore_clear(r.ws));

  free(in);
  free(out);
  rig_close(&r);
  zb__refmodel_destroy(NULL); /* a no-op */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gradients_match_reference),
      cmocka_unit_test(test_backward_leaves_weight_gradients),
      cmocka_unit_test(test_partition_bit_identical),
      cmocka_unit_test(test_lifetimes),
      cmocka_unit_test(test_bad_config),
      cmocka_unit_test(test_unowned_stage),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
