/*
 * test_optimizer.c - the optimizer and post-validation (zbpp.h, "the optimizer and
 * post-validation"; DESIGN.md section 4) as a user sees them:
 *  - AdamW and SGD on one rank agree with a double-precision implementation written here;
 *  - clipping equals stepping with gradients pre-scaled by clip / (norm + 1e-6);
 *  - inf/NaN skips the step without touching anything, and the loss scale backs off and grows;
 *  - over 2 and 3 ranks (threads on the in-process transport, both placements, several stages per
 *    rank), post-validation, the synchronous exchange and one rank holding every stage end with
 *    bit-for-bit equal parameters and results, and exactly the expected ranks roll back;
 *  - a silent or failed peer makes a step fail within the timeout, naming the peer, and leaves the
 *    parameters as they were;
 *  - bad configurations and registrations get clear errors.
 *
 * Expected values come from the header's rules and from the reference written here, never from
 * running the code under test. What this is not: a test of the transports (their own tests).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "helpers.h"

/* ---- assertions that print both sides --------------------------------------------------------- */

#define ASSERT_DOUBLE_EQ(actual, expected)                                                         \
  do {                                                                                             \
    double zb__a = (actual), zb__e = (expected);                                                   \
    if (!(zb__a == zb__e)) fail_msg("%s is %.17g, expected %.17g", #actual, zb__a, zb__e);        \
  } while (0)

#define ASSERT_REL(actual, expected, rel)                                                          \
  do {                                                                                             \
    double zb__a = (actual), zb__e = (expected);                                                   \
    if (!(fabs(zb__a - zb__e) <= (rel) * fabs(zb__e)))                                             \
      fail_msg("%s is %.17g, expected %.17g (relative bound %g)", #actual, zb__a, zb__e,          \
               (double)(rel));                                                                     \
  } while (0)


/* ---- a double-precision reference optimizer --------------------------------------------------- */

typedef struct {
  int64_t n, t;
  double *p, *m, *v;
} ref_t;

static void ref_init(ref_t *r, const float *p0, int64_t n) {
  r->n = n;
  r->t = 0;
  r->p = calloc((size_t)n, sizeof(double));
  r->m = calloc((size_t)n, sizeof(double));
  r->v = calloc((size_t)n, sizeof(double));
  assert_non_null(r->p);
  assert_non_null(r->m);
  assert_non_null(r->v);
  for (int64_t i = 0; i < n; i++) r->p[i] = p0[i];
}

static void ref_free(ref_t *r) {
  free(r->p);
  free(r->m);
  free(r->v);
}

/* torch.optim.AdamW's update on unscaled gradients g (decoupled decay, bias-corrected moments). */
static void ref_adamw(ref_t *r, const zb_optimizer_config_t *c, const double *g) {
  r->t++;
  const double bc1 = 1 - pow(c->beta1, (double)r->t), bc2 = 1 - pow(c->beta2, (double)r->t);
  for (int64_t i = 0; i < r->n; i++) {
    r->p[i] *= 1 - c->lr * c->weight_decay;
    r->m[i] = c->beta1 * r->m[i] + (1 - c->beta1) * g[i];
    r->v[i] = c->beta2 * r->v[i] + (1 - c->beta2) * g[i] * g[i];
    r->p[i] -= c->lr / bc1 * r->m[i] / (sqrt(r->v[i]) / sqrt(bc2) + c->eps);
  }
}

/* torch.optim.SGD's update (dampening 0, no Nesterov); m is the momentum buffer. */
static void ref_sgd(ref_t *r, const zb_optimizer_config_t *c, const double *g) {
  r->t++;
  for (int64_t i = 0; i < r->n; i++) {
    double d = g[i] + c->weight_decay * r->p[i];
    if (c->momentum != 0) {
      r->m[i] = r->t == 1 ? d : c->momentum * r->m[i] + d;
      d = r->m[i];
    }
    r->p[i] -= c->lr * d;
  }
}

/* The bound for float against double after a few steps: |p - ref| <= REL_BOUND * (1 + |ref|).
 * Parameters are O(1) and each step moves them by about lr = 1e-2, so an error of 1e-3 relative to
 * the updates already breaks it, while float rounding over 5 steps stays near 1e-7. */
#define REL_BOUND 1e-6

static void expect_close(const float *p, const ref_t *r, const char *what, int step) {
  for (int64_t i = 0; i < r->n; i++)
    if (!(fabs((double)p[i] - r->p[i]) <= REL_BOUND * (1 + fabs(r->p[i]))))
      fail_msg("%s, step %d: param[%lld] is %.9g, the double reference %.9g (bound %g*(1+|ref|))",
               what, step, (long long)i, (double)p[i], r->p[i], REL_BOUND);
}

/* ---- one rank against the reference ----------------------------------------------------------- */

#define N0 33
#define N1 17
#define NT (N0 + N1)

/* Runs `steps` steps of cfg over two arrays (stage 0 and stage 1 of a 2-stage model on one rank)
 * and the reference over the same unscaled gradients. When the norm is above cfg.clip_grad the
 * reference gets them pre-scaled by clip / (norm + 1e-6) (torch's clip_grad_norm_), and the
 * optimizer must report clipped; clip_check says the test means every step to clip. */
static void run_single(zb_optimizer_config_t cfg, int steps, int clip_check, const char *what) {
  float param[NT], grad[NT];
  double g[NT];
  for (int i = 0; i < NT; i++) param[i] = urand(1, 0, 0, (uint64_t)i);
  ref_t ref;
  ref_init(&ref, param, NT);
  zb_optimizer_t *opt = NULL;
  ZB_ASSERT_OK(zb_optimizer_create(&opt, &cfg));
  ZB_ASSERT_OK(zb_optimizer_add(opt, 0, param, grad, N0));
  ZB_ASSERT_OK(zb_optimizer_add(opt, 1, param + N0, grad + N0, N1));
  for (int k = 0; k < steps; k++) {
    double scale;
    ZB_ASSERT_OK(zb_optimizer_loss_scale(opt, &scale));
    double sq = 0;
    for (int i = 0; i < NT; i++) {
      const float u = urand(2, (uint64_t)k, 0, (uint64_t)i) * 0.5f;
      grad[i] = (float)(u * scale); /* scale is a power of two: exact */
      g[i] = u;
      sq += g[i] * g[i];
    }
    const double norm = sqrt(sq);
    const int want_clip = cfg.clip_grad > 0 && norm > cfg.clip_grad;
    if (want_clip)
      for (int i = 0; i < NT; i++) g[i] *= cfg.clip_grad / (norm + 1e-6);
    if (clip_check && !want_clip) fail_msg("%s: the test meant to clip but norm %g <= %g", what, norm, cfg.clip_grad);
    float grad_before[NT];
    memcpy(grad_before, grad, sizeof grad);
    zb_step_result_t res;
    ZB_ASSERT_OK(zb_optimizer_step(opt, &res));
    if (memcmp(grad_before, grad, sizeof grad) != 0) fail_msg("%s: the step changed the gradients", what);
    if (cfg.kind == ZB_OPTIM_ADAMW) ref_adamw(&ref, &cfg, g);
    else ref_sgd(&ref, &cfg, g);
    expect_close(param, &ref, what, k);
    assert_int_equal(res.skipped, 0);
    assert_int_equal(res.rolled_back, 0);
    assert_int_equal(res.clipped, want_clip);
    ASSERT_REL(res.grad_norm, norm, 1e-12);
    ASSERT_DOUBLE_EQ(res.loss_scale, scale);
  }
  ZB_ASSERT_OK(zb_optimizer_destroy(opt));
  ref_free(&ref);
}

static zb_optimizer_config_t single_config(zb_optim_kind_t kind) {
  zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
  cfg.kind = kind;
  cfg.lr = 1e-2;
  cfg.stages = 2;
  cfg.loss_scale = 256; /* the gradients arrive scaled; no growth (interval 0) */
  return cfg;
}

static void test_adamw_matches_reference(void **state) {
  (void)state;
  zb_optimizer_config_t cfg = single_config(ZB_OPTIM_ADAMW);
  cfg.weight_decay = 0.1;
  run_single(cfg, 5, 0, "AdamW, wd 0.1");
  cfg.beta1 = 0.5, cfg.beta2 = 0.9, cfg.eps = 1e-3, cfg.weight_decay = 0;
  run_single(cfg, 5, 0, "AdamW, betas 0.5/0.9, eps 1e-3");
}

static void test_sgd_matches_reference(void **state) {
  (void)state;
  zb_optimizer_config_t cfg = single_config(ZB_OPTIM_SGD);
  cfg.momentum = 0.9;
  cfg.weight_decay = 0.01;
  run_single(cfg, 5, 0, "SGD, momentum 0.9, wd 0.01");
  cfg.momentum = 0;
  cfg.weight_decay = 0;
  run_single(cfg, 5, 0, "SGD, no momentum");
}

/* The reference sees the gradients pre-scaled by clip / (norm + 1e-6); the optimizer clips. */
static void test_clipping(void **state) {
  (void)state;
  zb_optimizer_config_t cfg = single_config(ZB_OPTIM_SGD);
  cfg.momentum = 0.9;
  cfg.clip_grad = 1e-3;
  run_single(cfg, 3, 1, "SGD, clip 1e-3");
  /* AdamW divides most of a gradient's scale away; a large eps keeps the clip visible. */
  cfg = single_config(ZB_OPTIM_ADAMW);
  cfg.eps = 1e-3;
  cfg.clip_grad = 1e-2;
  run_single(cfg, 3, 1, "AdamW, eps 1e-3, clip 1e-2");
  /* A clip above the norm changes nothing (run_single checks clipped == 0 then). */
  cfg.clip_grad = 1e6;
  run_single(cfg, 3, 0, "AdamW, clip 1e6");
}

/* ---- inf/NaN and the loss scale --------------------------------------------------------------- */

static void fill_grads(float *grad, int n, int step, double scale) {
  for (int i = 0; i < n; i++) grad[i] = (float)(urand(3, (uint64_t)step, 0, (uint64_t)i) * scale);
}

static void test_nan_skips_and_scale_moves(void **state) {
  (void)state;
  zb_optimizer_config_t cfg = single_config(ZB_OPTIM_ADAMW);
  cfg.stages = 1;
  cfg.loss_scale = 1024, cfg.backoff = 0.5, cfg.growth = 2, cfg.growth_interval = 2;
  float param[NT], grad[NT], before[NT];
  for (int i = 0; i < NT; i++) param[i] = urand(4, 0, 0, (uint64_t)i);
  zb_optimizer_t *opt = NULL;
  ZB_ASSERT_OK(zb_optimizer_create(&opt, &cfg));
  ZB_ASSERT_OK(zb_optimizer_add(opt, 0, param, grad, NT));

  /* Good, NaN, good, good (the second good step in a row grows it), inf. From the header's rules:
   * skip halves and resets the count; growth_interval good steps in a row double it. */
  const float bad[] = {0, NAN, 0, 0, INFINITY};
  const double want_scale[] = {1024, 512, 512, 1024, 512};
  for (int k = 0; k < 5; k++) {
    double scale;
    ZB_ASSERT_OK(zb_optimizer_loss_scale(opt, &scale));
    fill_grads(grad, NT, k, scale);
    if (bad[k] != 0) grad[7] = bad[k];
    memcpy(before, param, sizeof param);
    zb_step_result_t res;
    ZB_ASSERT_OK(zb_optimizer_step(opt, &res));
    double now;
    ZB_ASSERT_OK(zb_optimizer_loss_scale(opt, &now));
    ASSERT_DOUBLE_EQ(res.loss_scale, want_scale[k]);
    ASSERT_DOUBLE_EQ(now, want_scale[k]);
    assert_int_equal(res.skipped, bad[k] != 0);
    if (bad[k] != 0) {
      if (memcmp(before, param, sizeof param) != 0) fail_msg("step %d had inf/NaN but changed a parameter", k);
      if (!isinf(res.grad_norm)) fail_msg("step %d skipped, grad_norm %g, expected inf", k, res.grad_norm);
    } else if (memcmp(before, param, sizeof param) == 0) {
      fail_msg("step %d was good but changed no parameter", k);
    }
  }
  ZB_ASSERT_OK(zb_optimizer_destroy(opt));
}

/* A skipped step leaves no trace in the optimizer state either: good, NaN, good must equal good,
 * good bit for bit (AdamW's step count and moments untouched by the skip). */
static void test_skip_leaves_state_untouched(void **state) {
  (void)state;
  zb_optimizer_config_t cfg = single_config(ZB_OPTIM_ADAMW);
  cfg.stages = 1;
  cfg.loss_scale = 1024, cfg.backoff = 0.5, cfg.growth_interval = 0;
  float pa[NT], pb[NT], ga[NT], gb[NT];
  for (int i = 0; i < NT; i++) pa[i] = pb[i] = urand(5, 0, 0, (uint64_t)i);
  zb_optimizer_t *a = NULL, *b = NULL;
  ZB_ASSERT_OK(zb_optimizer_create(&a, &cfg));
  ZB_ASSERT_OK(zb_optimizer_create(&b, &cfg));
  ZB_ASSERT_OK(zb_optimizer_add(a, 0, pa, ga, NT));
  ZB_ASSERT_OK(zb_optimizer_add(b, 0, pb, gb, NT));
  const int a_data[] = {0, -1, 1}, b_data[] = {0, 1};
  zb_step_result_t res;
  for (int k = 0; k < 3; k++) {
    double scale;
    ZB_ASSERT_OK(zb_optimizer_loss_scale(a, &scale));
    fill_grads(ga, NT, a_data[k] < 0 ? 0 : a_data[k], scale); /* powers of two: unscaled exactly */
    if (a_data[k] < 0) ga[3] = NAN;
    ZB_ASSERT_OK(zb_optimizer_step(a, &res));
    assert_int_equal(res.skipped, a_data[k] < 0);
  }
  for (int k = 0; k < 2; k++) {
    double scale;
    ZB_ASSERT_OK(zb_optimizer_loss_scale(b, &scale));
    fill_grads(gb, NT, b_data[k], scale);
    ZB_ASSERT_OK(zb_optimizer_step(b, &res));
  }
  for (int i = 0; i < NT; i++)
    if (memcmp(&pa[i], &pb[i], sizeof(float)) != 0)
      fail_msg("param[%d]: %.9g after good/NaN/good, %.9g after good/good", i, (double)pa[i], (double)pb[i]);
  ZB_ASSERT_OK(zb_optimizer_destroy(a));
  ZB_ASSERT_OK(zb_optimizer_destroy(b));
}

/* ---- several ranks: post-validation == synchronous == one rank -------------------------------- */

#define MAXS 8
#define STEPS 4
#define NAN_STEP 1

enum { SCEN_NONE, SCEN_CLIP, SCEN_NAN };
static const char *const scen_name[] = {"no nan, no clip", "clipping", "NaN in the last stage"};

typedef struct {
  int S;
  int n[MAXS][2];
  float *param[MAXS][2], *grad[MAXS][2];
} model_t;

static void model_init(model_t *m, int S) {
  memset(m, 0, sizeof *m);
  m->S = S;
  for (int s = 0; s < S; s++)
    for (int a = 0; a < 2; a++) {
      m->n[s][a] = a == 0 ? 3 + s : 7 + 2 * s;
      m->param[s][a] = malloc((size_t)m->n[s][a] * sizeof(float));
      m->grad[s][a] = malloc((size_t)m->n[s][a] * sizeof(float));
      assert_non_null(m->param[s][a]);
      assert_non_null(m->grad[s][a]);
      for (int i = 0; i < m->n[s][a]; i++) m->param[s][a][i] = urand(6, (uint64_t)s, (uint64_t)a, (uint64_t)i);
    }
}

static void model_free(model_t *m) {
  for (int s = 0; s < m->S; s++)
    for (int a = 0; a < 2; a++) free(m->param[s][a]), free(m->grad[s][a]);
}

/* Stage s's gradients at a step, already multiplied by the loss scale (a power of two here). */
static void model_grads(model_t *m, int s, int step, double scale, int scen) {
  for (int a = 0; a < 2; a++)
    for (int i = 0; i < m->n[s][a]; i++)
      m->grad[s][a][i] = (float)(urand(7, (uint64_t)(s * 16 + a), (uint64_t)step, (uint64_t)i) * scale);
  if (scen == SCEN_NAN && step == NAN_STEP && s == m->S - 1) m->grad[s][0][0] = NAN;
}

/* The placements as zbpp.h defines them, written here independently of the library. */
static int owner(int s, int p, zb_placement_t pl) {
  if (pl == ZB_PLACEMENT_V) return s < p ? s : 2 * p - 1 - s;
  return s % p;
}

typedef struct {
  zb_optimizer_config_t cfg;
  zb_inproc_group_t *group; /* NULL: one rank */
  model_t *model;
  int scen;
  zb_step_result_t res[STEPS];
  zb_status_t st;
  char msg[1024];
} worker_t;

/* One rank's loop. No cmocka assertions here: they cannot fail from another thread. A failing rank
 * aborts its transport so the others stop at once instead of waiting for their timeout. */
static void *worker(void *arg) {
  worker_t *w = arg;
  zb_transport_t *tr = NULL;
  zb_optimizer_t *opt = NULL;
  zb_status_t st = ZB_OK;
  const int p = w->cfg.ranks, r = w->cfg.rank;
  if (w->group && (st = zb_transport_create_inproc(&tr, w->group, r)) != ZB_OK) goto done;
  w->cfg.transport = tr;
  if ((st = zb_optimizer_create(&opt, &w->cfg)) != ZB_OK) goto done;
  for (int s = 0; s < w->model->S; s++) {
    if (p > 1 && owner(s, p, w->cfg.placement) != r) continue;
    for (int a = 0; a < 2; a++)
      if ((st = zb_optimizer_add(opt, s, w->model->param[s][a], w->model->grad[s][a], w->model->n[s][a])) != ZB_OK)
        goto done;
  }
  for (int k = 0; k < STEPS; k++) {
    double scale;
    if ((st = zb_optimizer_loss_scale(opt, &scale)) != ZB_OK) goto done;
    for (int s = 0; s < w->model->S; s++)
      if (p == 1 || owner(s, p, w->cfg.placement) == r) model_grads(w->model, s, k, scale, w->scen);
    if ((st = zb_optimizer_step(opt, &w->res[k])) != ZB_OK) goto done;
  }
done:
  w->st = st;
  if (st != ZB_OK) {
    snprintf(w->msg, sizeof w->msg, "%s", zb_last_error());
    if (tr) zb_transport_abort(tr, "a test rank failed");
  }
  zb_optimizer_destroy(opt);
  zb_transport_destroy(tr);
  return NULL;
}

static zb_optimizer_config_t pipeline_config(zb_optim_kind_t kind, int scen) {
  zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
  cfg.kind = kind;
  cfg.lr = 1e-2;
  cfg.momentum = 0.9;
  cfg.weight_decay = 0.01;
  cfg.loss_scale = 8, cfg.backoff = 0.5, cfg.growth = 2, cfg.growth_interval = 2;
  /* The unscaled norm is a few units (about 30..60 elements in [-1, 1)): 0.1 always clips, 1e9
   * never does (but still runs the comparison). */
  cfg.clip_grad = scen == SCEN_CLIP ? 0.1 : scen == SCEN_NONE ? 1e9 : 0;
  cfg.timeout_s = 60;
  return cfg;
}

/* Runs the optimizer over a fresh model: p ranks as threads (p > 1) or one rank holding every
 * stage, and returns each rank's results in res[rank][step]. */
static void run_pipeline(model_t *m, zb_optimizer_config_t cfg, int p, int S, int scen,
                         zb_step_result_t res[][STEPS]) {
  model_init(m, S);
  cfg.ranks = p;
  cfg.stages = S;
  worker_t w[3];
  pthread_t th[3];
  zb_inproc_group_t *group = NULL;
  if (p > 1) ZB_ASSERT_OK(zb_inproc_group_create(&group, p));
  for (int r = 0; r < p; r++) {
    memset(&w[r], 0, sizeof w[r]);
    w[r].cfg = cfg;
    w[r].cfg.rank = r;
    w[r].group = group;
    w[r].model = m;
    w[r].scen = scen;
  }
  if (p == 1) {
    worker(&w[0]);
  } else {
    for (int r = 0; r < p; r++) assert_int_equal(pthread_create(&th[r], NULL, worker, &w[r]), 0);
    for (int r = 0; r < p; r++) assert_int_equal(pthread_join(th[r], NULL), 0);
  }
  ZB_ASSERT_OK(zb_inproc_group_destroy(group));
  for (int r = 0; r < p; r++) {
    if (w[r].st != ZB_OK)
      fail_msg("rank %d of %d (post_validation %d): %s: %s", r, p, cfg.post_validation,
               zb_status_string(w[r].st), w[r].msg);
    memcpy(res[r], w[r].res, sizeof w[r].res);
  }
}

static void compare_pipeline(zb_optim_kind_t kind, int p, zb_placement_t pl, int scen) {
  const int S = pl == ZB_PLACEMENT_V ? 2 * p : p == 2 ? 6 : 2 * p;
  const char *kname = kind == ZB_OPTIM_ADAMW ? "adamw" : "sgd";
  const char *pname = pl == ZB_PLACEMENT_V ? "v" : "loop";
  zb_optimizer_config_t cfg = pipeline_config(kind, scen);
  cfg.placement = pl;

  model_t ref, sync, post;
  zb_step_result_t ref_res[1][STEPS], sync_res[3][STEPS], post_res[3][STEPS];
  run_pipeline(&ref, cfg, 1, S, scen, ref_res);
  cfg.post_validation = 0;
  run_pipeline(&sync, cfg, p, S, scen, sync_res);
  cfg.post_validation = 1;
  run_pipeline(&post, cfg, p, S, scen, post_res);

  /* The scenario happened as meant, on the one-rank run. */
  for (int k = 0; k < STEPS; k++) {
    const zb_step_result_t *q = &ref_res[0][k];
    if (q->skipped != (scen == SCEN_NAN && k == NAN_STEP) || q->clipped != (scen == SCEN_CLIP))
      fail_msg("%s p=%d %s, %s, step %d: one rank gave skipped %d clipped %d", kname, p, pname,
               scen_name[scen], k, q->skipped, q->clipped);
  }

  const model_t *runs[2] = {&sync, &post};
  zb_step_result_t (*rres[2])[STEPS] = {sync_res, post_res};
  for (int v = 0; v < 2; v++) {
    for (int s = 0; s < S; s++)
      for (int a = 0; a < 2; a++)
        for (int i = 0; i < ref.n[s][a]; i++)
          if (memcmp(&runs[v]->param[s][a][i], &ref.param[s][a][i], sizeof(float)) != 0)
            fail_msg("%s p=%d %s, %s: post_validation %d gives stage %d array %d [%d] = %.9g, one "
                     "rank %.9g",
                     kname, p, pname, scen_name[scen], v, s, a, i, (double)runs[v]->param[s][a][i],
                     (double)ref.param[s][a][i]);
    for (int r = 0; r < p; r++)
      for (int k = 0; k < STEPS; k++) {
        const zb_step_result_t *q = &rres[v][r][k], *e = &ref_res[0][k];
        if (q->skipped != e->skipped || q->clipped != e->clipped ||
            memcmp(&q->grad_norm, &e->grad_norm, sizeof(double)) != 0 ||
            memcmp(&q->loss_scale, &e->loss_scale, sizeof(double)) != 0)
          fail_msg("%s p=%d %s, %s, post_validation %d, rank %d, step %d: skipped %d clipped %d "
                   "norm %.17g scale %g; one rank: %d %d %.17g %g",
                   kname, p, pname, scen_name[scen], v, r, k, q->skipped, q->clipped, q->grad_norm,
                   q->loss_scale, e->skipped, e->clipped, e->grad_norm, e->loss_scale);
        /* Who rolls back: only with post-validation, only ranks before the chain's end (rank
         * p-1 in a loop, rank 0 in a V), and only when the partial state misled them. */
        const int chain_end = pl == ZB_PLACEMENT_V ? 0 : p - 1;
        const int misled = scen == SCEN_CLIP || (scen == SCEN_NAN && k == NAN_STEP);
        const int want = v == 1 && r != chain_end && misled;
        if (q->rolled_back != want)
          fail_msg("%s p=%d %s, %s, post_validation %d, rank %d, step %d: rolled_back %d, expected %d",
                   kname, p, pname, scen_name[scen], v, r, k, q->rolled_back, want);
      }
  }
  assert_int_equal(ref_res[0][0].rolled_back, 0);
  model_free(&ref);
  model_free(&sync);
  model_free(&post);
}

static void test_pipeline_bit_equal(void **state) {
  (void)state;
  const zb_optim_kind_t kinds[] = {ZB_OPTIM_ADAMW, ZB_OPTIM_SGD};
  const zb_placement_t pls[] = {ZB_PLACEMENT_LOOP, ZB_PLACEMENT_V};
  for (int ki = 0; ki < 2; ki++)
    for (int p = 2; p <= 3; p++)
      for (int pi = 0; pi < 2; pi++)
        for (int scen = SCEN_NONE; scen <= SCEN_NAN; scen++) compare_pipeline(kinds[ki], p, pls[pi], scen);
}

/* ---- a silent or failed peer ------------------------------------------------------------------ */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Ranks `p` in a group; only rank `active` steps (on this thread), `aborted` (or -1) aborts first.
 * The step must fail within the timeout with one of the peer statuses, name `peer_text`, and leave
 * the parameters and the loss scale as they were. */
static void expect_peer_failure(int p, zb_placement_t pl, int post_validation, int active,
                                int aborted, const char *peer_text) {
  zb_inproc_group_t *group = NULL;
  zb_transport_t *tr[3] = {NULL, NULL, NULL};
  ZB_ASSERT_OK(zb_inproc_group_create(&group, p));
  for (int r = 0; r < p; r++) ZB_ASSERT_OK(zb_transport_create_inproc(&tr[r], group, r));
  if (aborted >= 0) ZB_ASSERT_OK(zb_transport_abort(tr[aborted], "model blew up"));

  zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
  cfg.kind = ZB_OPTIM_SGD;
  cfg.momentum = 0.9;
  cfg.stages = 2 * p, cfg.ranks = p, cfg.rank = active, cfg.placement = pl;
  cfg.post_validation = post_validation;
  cfg.transport = tr[active];
  cfg.timeout_s = 0.2;
  float param[4] = {1, 2, 3, 4}, grad[4] = {0.5f, -0.5f, 0.25f, 1}, before[4];
  memcpy(before, param, sizeof param);
  zb_optimizer_t *opt = NULL;
  ZB_ASSERT_OK(zb_optimizer_create(&opt, &cfg));
  ZB_ASSERT_OK(zb_optimizer_add(opt, active, param, grad, 4)); /* stage `active` is on rank `active` */

  zb_step_result_t res;
  const double t0 = now_s();
  const zb_status_t st = zb_optimizer_step(opt, &res);
  const double elapsed = now_s() - t0;
  if (st != ZB_ERR_TIMEOUT && st != ZB_ERR_REMOTE)
    fail_msg("p=%d rank %d: step -> %s (%s), expected a timeout or a remote failure", p, active,
             zb_status_string(st), zb_last_error());
  ASSERT_CONTAINS(zb_last_error(), peer_text);
  if (aborted >= 0) ASSERT_CONTAINS(zb_last_error(), "model blew up");
  if (elapsed > 5.0) fail_msg("the step took %.3g s to fail with a 0.2 s timeout", elapsed);
  if (memcmp(before, param, sizeof param) != 0)
    fail_msg("a failed step changed the parameters (%g %g %g %g, were %g %g %g %g)", (double)param[0],
             (double)param[1], (double)param[2], (double)param[3], (double)before[0],
             (double)before[1], (double)before[2], (double)before[3]);
  double scale;
  ZB_ASSERT_OK(zb_optimizer_loss_scale(opt, &scale));
  ASSERT_DOUBLE_EQ(scale, cfg.loss_scale);

  ZB_ASSERT_OK(zb_optimizer_destroy(opt));
  for (int r = 0; r < p; r++) ZB_ASSERT_OK(zb_transport_destroy(tr[r]));
  ZB_ASSERT_OK(zb_inproc_group_destroy(group));
}

static void test_silent_peer_times_out(void **state) {
  (void)state;
  /* Loop over 2 ranks: rank 0 sends its partial, steps speculatively, and waits for rank 1. */
  expect_peer_failure(2, ZB_PLACEMENT_LOOP, 1, 0, -1, "from rank 1");
  /* Rank 1 (the chain's end) waits for the partial from rank 0. */
  expect_peer_failure(2, ZB_PLACEMENT_LOOP, 1, 1, -1, "from rank 0");
  /* A V over 3 ranks runs 2 -> 1 -> 0; rank 1 silent: both neighbours name it. */
  expect_peer_failure(3, ZB_PLACEMENT_V, 0, 2, -1, "from rank 1");
  expect_peer_failure(3, ZB_PLACEMENT_V, 1, 0, -1, "from rank 1");
}

static void test_aborted_peer_fails_step(void **state) {
  (void)state;
  expect_peer_failure(2, ZB_PLACEMENT_LOOP, 1, 0, 1, "rank 1");
  expect_peer_failure(2, ZB_PLACEMENT_LOOP, 0, 1, 0, "rank 0");
}

/* ---- bad configurations and registrations ----------------------------------------------------- */

typedef struct {
  const char *field;
  void (*edit)(zb_optimizer_config_t *c);
  const char *text; /* in the message */
} bad_case_t;

#define BAD(name, body)                                                                            \
  static void bad_##name(zb_optimizer_config_t *c) { body; }
BAD(size, c->struct_size = 8)
BAD(version, c->version = 99)
BAD(kind, c->kind = (zb_optim_kind_t)7)
BAD(lr, c->lr = -1)
BAD(lr_nan, c->lr = NAN)
BAD(beta1, c->beta1 = 1)
BAD(beta2, c->beta2 = -0.1)
BAD(eps, c->eps = 0)
BAD(momentum, (c->kind = ZB_OPTIM_SGD, c->momentum = -0.5))
BAD(wd, c->weight_decay = -1)
BAD(scale, c->loss_scale = 0)
BAD(backoff0, c->backoff = 0)
BAD(backoff2, c->backoff = 2)
BAD(growth, c->growth = 0.5)
BAD(interval, c->growth_interval = -1)
BAD(postval, c->post_validation = 2)
BAD(stages, c->stages = 0)
BAD(rank, (c->ranks = 2, c->rank = 2, c->stages = 2))
BAD(rank_neg, c->rank = -1)
BAD(transport, (c->ranks = 2, c->stages = 4))
BAD(v_stages, (c->ranks = 2, c->stages = 6, c->placement = ZB_PLACEMENT_V))
BAD(loop_stages, (c->ranks = 2, c->stages = 3))
BAD(placement, c->placement = (zb_placement_t)5)
#undef BAD

static void test_bad_config(void **state) {
  (void)state;
  static const bad_case_t cases[] = {
      {"struct_size", bad_size, "ZB_OPTIMIZER_CONFIG_INIT"},
      {"version", bad_version, "ZB_OPTIMIZER_CONFIG_INIT"},
      {"kind", bad_kind, "ZB_OPTIM_ADAMW"},
      {"lr", bad_lr, "lr is -1; allowed"},
      {"lr NaN", bad_lr_nan, "lr is nan"},
      {"beta1", bad_beta1, "beta1 is 1; allowed: [0, 1)"},
      {"beta2", bad_beta2, "beta2 is -0.1; allowed: [0, 1)"},
      {"eps", bad_eps, "eps is 0; allowed"},
      {"momentum", bad_momentum, "momentum is -0.5"},
      {"weight_decay", bad_wd, "weight_decay is -1"},
      {"loss_scale", bad_scale, "loss_scale is 0; allowed"},
      {"backoff 0", bad_backoff0, "backoff is 0; allowed: (0, 1]"},
      {"backoff 2", bad_backoff2, "backoff is 2; allowed: (0, 1]"},
      {"growth", bad_growth, "growth is 0.5; allowed"},
      {"growth_interval", bad_interval, "growth_interval is -1"},
      {"post_validation", bad_postval, "post_validation is 2"},
      {"stages", bad_stages, "stages is 0; allowed: >= 1"},
      {"rank", bad_rank, "rank is 2; allowed: 0..1"},
      {"rank < 0", bad_rank_neg, "rank is -1"},
      {"transport", bad_transport, "transport is NULL"},
      {"v stages", bad_v_stages, "stages = 2 * ranks = 4"},
      {"loop stages", bad_loop_stages, "multiple of ranks"},
      {"placement", bad_placement, "placement is 5"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
    cases[i].edit(&cfg);
    zb_optimizer_t *opt = (zb_optimizer_t *)&cfg; /* must come back NULL */
    zb_status_t st = zb_optimizer_create(&opt, &cfg);
    if (st != ZB_ERR_INVALID_ARGUMENT)
      fail_msg("bad %s: create -> %s (%s), expected invalid argument", cases[i].field,
               zb_status_string(st), zb_last_error());
    if (opt != NULL) fail_msg("bad %s: *out not NULL after a failure", cases[i].field);
    if (!strstr(zb_last_error(), cases[i].text))
      fail_msg("bad %s: expected \"%s\" in \"%s\"", cases[i].field, cases[i].text, zb_last_error());
  }
  ASSERT_STATUS(zb_optimizer_create(NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
  zb_optimizer_t *opt = NULL;
  ASSERT_STATUS(zb_optimizer_create(&opt, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "config");

  /* SGD ignores AdamW's betas and eps. */
  zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
  cfg.kind = ZB_OPTIM_SGD, cfg.beta1 = 5, cfg.eps = 0;
  ZB_ASSERT_OK(zb_optimizer_create(&opt, &cfg));
  ZB_ASSERT_OK(zb_optimizer_destroy(opt));
  ZB_ASSERT_OK(zb_optimizer_destroy(NULL));
}

static void test_bad_transport_rank(void **state) {
  (void)state;
  zb_inproc_group_t *group = NULL;
  zb_transport_t *tr = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&group, 2));
  ZB_ASSERT_OK(zb_transport_create_inproc(&tr, group, 1));
  zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
  cfg.ranks = 2, cfg.rank = 0, cfg.stages = 2, cfg.transport = tr;
  zb_optimizer_t *opt = NULL;
  ASSERT_STATUS(zb_optimizer_create(&opt, &cfg), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "transport is rank 1 of 2 but the optimizer config says rank 0 of 2");
  assert_null(opt);
  ZB_ASSERT_OK(zb_transport_destroy(tr));
  ZB_ASSERT_OK(zb_inproc_group_destroy(group));
}

static void test_bad_add(void **state) {
  (void)state;
  zb_inproc_group_t *group = NULL;
  zb_transport_t *tr = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&group, 2));
  ZB_ASSERT_OK(zb_transport_create_inproc(&tr, group, 1));
  zb_optimizer_config_t cfg = ZB_OPTIMIZER_CONFIG_INIT;
  cfg.ranks = 2, cfg.rank = 1, cfg.stages = 4, cfg.transport = tr, cfg.placement = ZB_PLACEMENT_V;
  zb_optimizer_t *opt = NULL;
  ZB_ASSERT_OK(zb_optimizer_create(&opt, &cfg));
  float p[2] = {0, 0}, g[2] = {0, 0};
  ASSERT_STATUS(zb_optimizer_add(opt, 4, p, g, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage 4; allowed: 0..3");
  ASSERT_STATUS(zb_optimizer_add(opt, -1, p, g, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage -1; allowed: 0..3");
  /* V over 2 ranks: stages 1 and 2 are rank 1's, 0 and 3 rank 0's. */
  ASSERT_STATUS(zb_optimizer_add(opt, 3, p, g, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "stage 3 is on rank 0 under the v placement");
  ASSERT_STATUS(zb_optimizer_add(opt, 1, NULL, g, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "param");
  ASSERT_STATUS(zb_optimizer_add(opt, 1, p, NULL, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "grad");
  ASSERT_STATUS(zb_optimizer_add(opt, 2, p, g, -1), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "numel is -1; allowed: >= 0");
  ZB_ASSERT_OK(zb_optimizer_add(opt, 2, p, g, 2));
  ASSERT_STATUS(zb_optimizer_add(NULL, 2, p, g, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_optimizer_step(opt, NULL), ZB_ERR_INVALID_ARGUMENT);
  double scale;
  ASSERT_STATUS(zb_optimizer_loss_scale(opt, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_optimizer_loss_scale(NULL, &scale), ZB_ERR_INVALID_ARGUMENT);
  ZB_ASSERT_OK(zb_optimizer_destroy(opt));

  /* Registration closes with the first step. */
  zb_optimizer_config_t one = ZB_OPTIMIZER_CONFIG_INIT;
  ZB_ASSERT_OK(zb_optimizer_create(&opt, &one));
  ZB_ASSERT_OK(zb_optimizer_add(opt, 0, p, g, 2));
  zb_step_result_t res;
  ZB_ASSERT_OK(zb_optimizer_step(opt, &res));
  ASSERT_STATUS(zb_optimizer_add(opt, 0, p, g, 2), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "after the first zb_optimizer_step");
  ZB_ASSERT_OK(zb_optimizer_destroy(opt));
  ZB_ASSERT_OK(zb_transport_destroy(tr));
  ZB_ASSERT_OK(zb_inproc_group_destroy(group));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_adamw_matches_reference),
      cmocka_unit_test(test_sgd_matches_reference),
      cmocka_unit_test(test_clipping),
      cmocka_unit_test(test_nan_skips_and_scale_moves),
      cmocka_unit_test(test_skip_leaves_state_untouched),
      cmocka_unit_test(test_pipeline_bit_equal),
      cmocka_unit_test(test_silent_peer_times_out),
      cmocka_unit_test(test_aborted_peer_fails_step),
      cmocka_unit_test(test_bad_config),
      cmocka_unit_test(test_bad_transport_rank),
      cmocka_unit_test(test_bad_add),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
