/*
 * test_postval.c - post-validation for an optimizer the caller runs (zbpp.h, "post-validation for
 * an optimizer the caller runs") as such a caller sees it. Here the caller is the test: it computes
 * its stages' squared norms, keeps its own undo copy and runs a plain SGD step
 * (p = p - lr * (g * factor), in fp32) when the handle says so.
 *  - over 1 to 4 ranks (threads on the in-process transport; loop and V placements, one or two
 *    stages per rank), post-validation and the synchronous path end with parameters bit-for-bit
 *    equal to SGD driven by a global state computed here in one place, and to zb_optimizer's SGD on
 *    the same data; every rank's decisions at begin and end are the ones the header's rules give;
 *  - clipping that only the full state shows makes every speculating rank undo and redo with the
 *    clipped factor;
 *  - a NaN in the last stage makes every rank skip (the speculating ones undo) and the loss scale
 *    back off; growth_interval good steps in a row grow it;
 *  - calls out of order, bad arguments and bad configs get clear errors; a silent peer makes begin
 *    or end fail within the timeout, naming the peer and the phase, with undo set when the caller
 *    had stepped;
 *  - every rank's zb_postval_get_state counts the iterations as it was told them, and ranks that
 *    checkpoint mid-run (get_state, destroy, a new handle, set_state) are told what the
 *    uninterrupted run is told, the loss scale's growth and backoff included.
 *
 * Expected values come from the header's rules, written here: the total squared norm is the sum of
 * the per-stage sums in stage order, the factor (float)(1/scale * coef) with torch's clip_grad_norm_
 * coefficient clip / (norm + 1e-6), the scale GradScaler's rule. What this is not: a test of
 * zb_optimizer's AdamW (test_optimizer.c) or of the transports.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "helpers.h"

#define ASSERT_DOUBLE_EQ(actual, expected)                                                         \
  do {                                                                                             \
    double zb__a = (actual), zb__e = (expected);                                                   \
    if (memcmp(&zb__a, &zb__e, sizeof(double)) != 0)                                               \
      fail_msg("%s is %.17g, expected %.17g", #actual, zb__a, zb__e);                              \
  } while (0)


/* ---- the pipeline and the gradients ----------------------------------------------------------- */

#define MAXR 4
#define MAXS 8
#define MAXSTEPS 8
#define LR 0.01f

/* The unscaled gradient of element i of stage s at step k (S stages); the caller multiplies it by
 * the loss scale. Each test picks a pattern. */
typedef float (*grad_fn)(int s, int S, int k, int i);

/* The placements as zbpp.h defines them, written here independently of the library. */
static int owner(int s, int p, zb_placement_t pl) {
  if (p == 1) return 0;
  if (pl == ZB_PLACEMENT_V) return s < p ? s : 2 * p - 1 - s;
  return s % p;
}

/* A rank's position in the chain the partial state travels along: toward the last stage's rank. */
static int chain_pos(int r, int p, zb_placement_t pl) { return pl == ZB_PLACEMENT_V ? p - 1 - r : r; }

static int nelems(int s) { return 4 + s; }

typedef struct {
  int S;
  float *param[MAXS], *grad[MAXS];
} model_t;

static void model_init(model_t *m, int S) {
  memset(m, 0, sizeof *m);
  m->S = S;
  for (int s = 0; s < S; s++) {
    m->param[s] = malloc((size_t)nelems(s) * sizeof(float));
    m->grad[s] = malloc((size_t)nelems(s) * sizeof(float));
    assert_non_null(m->param[s]);
    assert_non_null(m->grad[s]);
    for (int i = 0; i < nelems(s); i++) m->param[s][i] = urand(1, (uint64_t)s, 0, (uint64_t)i);
  }
}

static void model_free(model_t *m) {
  for (int s = 0; s < m->S; s++) free(m->param[s]), free(m->grad[s]);
}

/* Writes stage s's gradients for step k, multiplied by the scale (a power of two: exact). */
static void write_grads(model_t *m, grad_fn g, int s, int k, double scale) {
  for (int i = 0; i < nelems(s); i++) m->grad[s][i] = (float)((double)g(s, m->S, k, i) * scale);
}

/* What a caller computes for one stage: the sum of squares in double, and whether any is inf/NaN. */
static void stage_state(const model_t *m, int s, double *sq, int32_t *bad) {
  double acc = 0;
  int32_t b = 0;
  for (int i = 0; i < nelems(s); i++) {
    const float x = m->grad[s][i];
    if (!isfinite(x)) b = 1;
    acc += (double)x * (double)x;
  }
  *sq = acc;
  *bad = b;
}

static void sgd(model_t *m, int s, float factor) {
  for (int i = 0; i < nelems(s); i++) m->param[s][i] = m->param[s][i] - LR * (m->grad[s][i] * factor);
}

/* ---- the reference: the header's rules over the global state ----------------------------------- */

typedef struct {
  int nan, clipped;
  double norm;
  float factor;
} ref_decision_t;

/* The decision from the stages in `seen` (all of them for the full state): their squared norms
 * summed in stage order, any inf/NaN skips, torch's clipping coefficient. */
static ref_decision_t ref_decide(const double *sq, const int32_t *bad, const int *seen, int S,
                                 double scale, double clip) {
  ref_decision_t d = {0, 0, 0.0, 0.0f};
  double sum = 0;
  for (int s = 0; s < S; s++)
    if (seen[s]) {
      sum += sq[s];
      if (bad[s]) d.nan = 1;
    }
  if (d.nan) {
    d.norm = INFINITY;
    return d;
  }
  const double inv = 1.0 / scale;
  d.norm = sqrt(sum) * inv;
  double coef = 1.0;
  if (clip > 0 && d.norm > clip) {
    coef = clip / (d.norm + 1e-6);
    d.clipped = 1;
  }
  d.factor = (float)(inv * coef);
  return d;
}

/* What one rank should be told in one step. */
typedef struct {
  int32_t begin_step;
  float begin_factor;
  zb_postval_decision_t end;
} told_t;

typedef struct {
  int p, S, steps;
  zb_placement_t pl;
  grad_fn g;
  zb_postval_config_t cfg; /* clip, scale rules, post_validation; the pipeline fields are set here */
  int resume_at; /* > 0: every rank moves to a new handle from a checkpoint before this step */
} setup_t;

/* Runs the steps in one thread with the global state, and says what every rank must be told. */
static void reference(const setup_t *su, model_t *m, told_t want[MAXR][MAXSTEPS]) {
  model_init(m, su->S);
  const zb_postval_config_t *c = &su->cfg;
  double scale = c->loss_scale;
  int good = 0;
  for (int k = 0; k < su->steps; k++) {
    double sq[MAXS];
    int32_t bad[MAXS];
    int all[MAXS];
    for (int s = 0; s < su->S; s++) {
      write_grads(m, su->g, s, k, scale);
      stage_state(m, s, &sq[s], &bad[s]);
      all[s] = 1;
    }
    const ref_decision_t fd = ref_decide(sq, bad, all, su->S, scale, c->clip_grad);
    /* GradScaler: back off on inf/NaN, grow after growth_interval good steps in a row. */
    double next_scale = scale;
    if (fd.nan) {
      next_scale = scale * c->backoff;
      good = 0;
    } else if (++good == c->growth_interval) {
      next_scale = scale * c->growth;
      good = 0;
    }
    for (int r = 0; r < su->p; r++) {
      /* A rank speculates with post-validation unless it is the chain's last; it has seen the
       * stages of the ranks up to itself in the chain. */
      int seen[MAXS];
      for (int s = 0; s < su->S; s++)
        seen[s] = chain_pos(owner(s, su->p, su->pl), su->p, su->pl) <= chain_pos(r, su->p, su->pl);
      const ref_decision_t pd = ref_decide(sq, bad, seen, su->S, scale, c->clip_grad);
      const int spec = c->post_validation && chain_pos(r, su->p, su->pl) < su->p - 1 && !pd.nan;
      told_t *t = &want[r][k];
      t->begin_step = spec;
      t->begin_factor = spec ? pd.factor : 0.0f;
      t->end.undo = spec && (fd.nan || fd.factor != pd.factor);
      t->end.step = (!spec || t->end.undo) && !fd.nan;
      t->end.factor = fd.factor;
      t->end.skipped = fd.nan;
      t->end.clipped = fd.clipped;
      t->end.grad_norm = fd.norm;
      t->end.loss_scale = next_scale;
    }
    if (!fd.nan)
      for (int s = 0; s < su->S; s++) sgd(m, s, fd.factor);
    scale = next_scale;
  }
}

/* ---- the ranks as threads --------------------------------------------------------------------- */

typedef struct {
  const setup_t *su;
  int rank;
  int use_optimizer; /* 1: zb_optimizer's SGD instead of the test's own loop */
  zb_inproc_group_t *group;
  model_t *m;
  told_t told[MAXSTEPS];
  zb_postval_state_t at_resume, at_end; /* zb_postval_get_state before resume_at and at the end */
  zb_step_result_t res[MAXSTEPS];
  zb_status_t st;
  char msg[1024];
} worker_t;

/* The caller's loop through the protocol: begin, snapshot and step if told, end, undo and step if
 * told. No cmocka assertions here: they cannot fail from another thread. */
static zb_status_t caller_loop(worker_t *w, zb_postval_t *pv, int k0, int k1) {
  const setup_t *su = w->su;
  model_t *m = w->m;
  float *snap[MAXS] = {NULL};
  zb_status_t st = ZB_OK;
  for (int s = 0; s < su->S; s++)
    if (owner(s, su->p, su->pl) == w->rank &&
        !(snap[s] = malloc((size_t)nelems(s) * sizeof(float)))) {
      st = ZB_ERR_OUT_OF_MEMORY;
      goto done;
    }
  for (int k = k0; k < k1; k++) {
    double scale, sq[MAXS] = {0};
    int32_t bad[MAXS] = {0};
    if ((st = zb_postval_loss_scale(pv, &scale)) != ZB_OK) goto done;
    for (int s = 0; s < su->S; s++)
      if (snap[s]) {
        write_grads(m, su->g, s, k, scale);
        stage_state(m, s, &sq[s], &bad[s]);
      }
    zb_postval_decision_t d;
    if ((st = zb_postval_begin(pv, sq, bad, &d)) != ZB_OK) goto done;
    w->told[k].begin_step = d.step;
    w->told[k].begin_factor = d.factor;
    if (d.step)
      for (int s = 0; s < su->S; s++)
        if (snap[s]) {
          memcpy(snap[s], m->param[s], (size_t)nelems(s) * sizeof(float));
          sgd(m, s, d.factor);
        }
    if ((st = zb_postval_end(pv, &d)) != ZB_OK) goto done;
    w->told[k].end = d;
    for (int s = 0; s < su->S; s++)
      if (snap[s]) {
        if (d.undo) memcpy(m->param[s], snap[s], (size_t)nelems(s) * sizeof(float));
        if (d.step) sgd(m, s, d.factor);
      }
  }
done:
  for (int s = 0; s < su->S; s++) free(snap[s]);
  return st;
}

/* The same steps through zb_optimizer (SGD, no momentum, no weight decay: the test's own update). */
static zb_status_t optimizer_loop(worker_t *w, zb_transport_t *tr) {
  const setup_t *su = w->su;
  zb_optimizer_config_t oc = ZB_OPTIMIZER_CONFIG_INIT;
  oc.kind = ZB_OPTIM_SGD;
  oc.lr = LR;
  oc.clip_grad = su->cfg.clip_grad;
  oc.loss_scale = su->cfg.loss_scale, oc.backoff = su->cfg.backoff, oc.growth = su->cfg.growth;
  oc.growth_interval = su->cfg.growth_interval;
  oc.post_validation = su->cfg.post_validation;
  oc.stages = su->S, oc.rank = w->rank, oc.ranks = su->p, oc.placement = su->pl;
  oc.transport = tr;
  oc.timeout_s = 60;
  zb_optimizer_t *opt = NULL;
  zb_status_t st = zb_optimizer_create(&opt, &oc);
  for (int s = 0; s < su->S && st == ZB_OK; s++)
    if (owner(s, su->p, su->pl) == w->rank)
      st = zb_optimizer_add(opt, s, w->m->param[s], w->m->grad[s], nelems(s));
  for (int k = 0; k < su->steps && st == ZB_OK; k++) {
    double scale;
    if ((st = zb_optimizer_loss_scale(opt, &scale)) != ZB_OK) break;
    for (int s = 0; s < su->S; s++)
      if (owner(s, su->p, su->pl) == w->rank) write_grads(w->m, su->g, s, k, scale);
    st = zb_optimizer_step(opt, &w->res[k]);
  }
  zb_optimizer_destroy(opt);
  return st;
}

static void *worker(void *arg) {
  worker_t *w = arg;
  zb_transport_t *tr = NULL;
  zb_postval_t *pv = NULL;
  zb_status_t st = ZB_OK;
  if (w->group && (st = zb_transport_create_inproc(&tr, w->group, w->rank)) != ZB_OK) goto done;
  if (w->use_optimizer) {
    st = optimizer_loop(w, tr);
  } else {
    zb_postval_config_t cfg = w->su->cfg;
    cfg.stages = w->su->S, cfg.rank = w->rank, cfg.ranks = w->su->p, cfg.placement = w->su->pl;
    cfg.transport = tr;
    cfg.timeout_s = 60;
    const int k = w->su->resume_at;
    if ((st = zb_postval_create(&pv, &cfg)) != ZB_OK) goto done;
    if (k > 0) {
      /* A checkpoint: the state goes to a new handle; the old one goes away first, as in a job
       * that restarts. */
      w->at_resume = (zb_postval_state_t)ZB_POSTVAL_STATE_INIT;
      if ((st = caller_loop(w, pv, 0, k)) != ZB_OK ||
          (st = zb_postval_get_state(pv, &w->at_resume)) != ZB_OK ||
          (st = zb_postval_destroy(pv)) != ZB_OK)
        goto done;
      pv = NULL;
      if ((st = zb_postval_create(&pv, &cfg)) != ZB_OK ||
          (st = zb_postval_set_state(pv, &w->at_resume)) != ZB_OK)
        goto done;
    }
    w->at_end = (zb_postval_state_t)ZB_POSTVAL_STATE_INIT;
    if ((st = caller_loop(w, pv, k, w->su->steps)) == ZB_OK)
      st = zb_postval_get_state(pv, &w->at_end);
  }
done:
  w->st = st;
  if (st != ZB_OK) {
    snprintf(w->msg, sizeof w->msg, "%s", zb_last_error());
    if (tr) zb_transport_abort(tr, "a test rank failed");
  }
  zb_postval_destroy(pv);
  zb_transport_destroy(tr);
  return NULL;
}

/* Runs every rank of the setup on a fresh model; w[r] keeps what rank r was told. */
static void run_ranks(const setup_t *su, int use_optimizer, model_t *m, worker_t w[MAXR]) {
  model_init(m, su->S);
  zb_inproc_group_t *group = NULL;
  pthread_t th[MAXR];
  if (su->p > 1) ZB_ASSERT_OK(zb_inproc_group_create(&group, su->p));
  for (int r = 0; r < su->p; r++) {
    memset(&w[r], 0, sizeof w[r]);
    w[r].su = su, w[r].rank = r, w[r].use_optimizer = use_optimizer, w[r].group = group, w[r].m = m;
  }
  for (int r = 0; r < su->p; r++) assert_int_equal(pthread_create(&th[r], NULL, worker, &w[r]), 0);
  for (int r = 0; r < su->p; r++) assert_int_equal(pthread_join(th[r], NULL), 0);
  ZB_ASSERT_OK(zb_inproc_group_destroy(group));
  for (int r = 0; r < su->p; r++)
    if (w[r].st != ZB_OK)
      fail_msg("rank %d of %d (%s): %s: %s", r, su->p, use_optimizer ? "zb_optimizer" : "postval",
               zb_status_string(w[r].st), w[r].msg);
}

static const char *pl_name(zb_placement_t pl) { return pl == ZB_PLACEMENT_V ? "v" : "loop"; }

static void expect_same_params(const model_t *got, const model_t *want, const setup_t *su,
                               const char *what) {
  for (int s = 0; s < su->S; s++)
    for (int i = 0; i < nelems(s); i++)
      if (memcmp(&got->param[s][i], &want->param[s][i], sizeof(float)) != 0)
        fail_msg("p=%d %s S=%d post_validation %d, %s: stage %d [%d] = %.9g, the global reference "
                 "%.9g",
                 su->p, pl_name(su->pl), su->S, su->cfg.post_validation, what, s, i,
                 (double)got->param[s][i], (double)want->param[s][i]);
}

static void expect_told(const worker_t *w, told_t want[MAXR][MAXSTEPS], const setup_t *su) {
  for (int r = 0; r < su->p; r++)
    for (int k = 0; k < su->steps; k++) {
      const told_t *g = &w[r].told[k], *e = &want[r][k];
      if (g->begin_step != e->begin_step ||
          memcmp(&g->begin_factor, &e->begin_factor, sizeof(float)) != 0 ||
          g->end.undo != e->end.undo || g->end.step != e->end.step ||
          memcmp(&g->end.factor, &e->end.factor, sizeof(float)) != 0 ||
          g->end.skipped != e->end.skipped || g->end.clipped != e->end.clipped ||
          memcmp(&g->end.grad_norm, &e->end.grad_norm, sizeof(double)) != 0 ||
          memcmp(&g->end.loss_scale, &e->end.loss_scale, sizeof(double)) != 0)
        fail_msg("p=%d %s S=%d post_validation %d, rank %d, step %d: told begin step %d factor %a, "
                 "end undo %d step %d factor %a skipped %d clipped %d norm %.17g scale %g; "
                 "expected %d %a, %d %d %a %d %d %.17g %g",
                 su->p, pl_name(su->pl), su->S, su->cfg.post_validation, r, k, g->begin_step,
                 (double)g->begin_factor, g->end.undo, g->end.step, (double)g->end.factor,
                 g->end.skipped, g->end.clipped, g->end.grad_norm, g->end.loss_scale, e->begin_step,
                 (double)e->begin_factor, e->end.undo, e->end.step, (double)e->end.factor,
                 e->end.skipped, e->end.clipped, e->end.grad_norm, e->end.loss_scale);
    }
}

/* Each rank's final zb_postval_get_state: the iterations it was told, counted here, and the growth
 * tracker by GradScaler's rule over them. */
static void expect_counts(const worker_t *w, told_t want[MAXR][MAXSTEPS], const setup_t *su) {
  for (int r = 0; r < su->p; r++) {
    int64_t skipped = 0, clipped = 0, undone = 0, good = 0;
    for (int k = 0; k < su->steps; k++) {
      const zb_postval_decision_t *e = &want[r][k].end;
      skipped += e->skipped, clipped += e->clipped, undone += e->undo;
      good = e->skipped ? 0 : good + 1;
      if (good == su->cfg.growth_interval) good = 0;
    }
    const zb_postval_state_t *g = &w[r].at_end;
    if (g->steps != su->steps || g->skipped != skipped || g->clipped != clipped ||
        g->undone != undone || g->good_steps != good ||
        memcmp(&g->loss_scale, &want[r][su->steps - 1].end.loss_scale, sizeof(double)) != 0)
      fail_msg("p=%d %s resume_at %d, rank %d's state: steps %lld skipped %lld clipped %lld "
               "undone %lld good_steps %lld scale %g; expected %d %lld %lld %lld %lld %g",
               su->p, pl_name(su->pl), su->resume_at, r, (long long)g->steps,
               (long long)g->skipped, (long long)g->clipped, (long long)g->undone,
               (long long)g->good_steps, g->loss_scale, su->steps, (long long)skipped,
               (long long)clipped, (long long)undone, (long long)good,
               want[r][su->steps - 1].end.loss_scale);
  }
}

/* Runs the setup through postval (every rank told as the rules say, parameters equal to the
 * reference's) and, when with_optimizer, through zb_optimizer (same parameters, same results).
 * Returns the reference's parameters and decisions for the caller's own checks. */
static void check_setup(const setup_t *su, int with_optimizer, model_t *ref,
                        told_t want[MAXR][MAXSTEPS], worker_t w[MAXR]) {
  reference(su, ref, want);
  model_t got;
  run_ranks(su, 0, &got, w);
  expect_told(w, want, su);
  expect_same_params(&got, ref, su, "postval");
  expect_counts(w, want, su);
  model_free(&got);
  if (!with_optimizer) return;
  worker_t wo[MAXR];
  run_ranks(su, 1, &got, wo);
  expect_same_params(&got, ref, su, "zb_optimizer");
  for (int r = 0; r < su->p; r++)
    for (int k = 0; k < su->steps; k++) {
      const zb_step_result_t *q = &wo[r].res[k];
      const zb_postval_decision_t *e = &want[r][k].end;
      if (q->skipped != e->skipped || q->clipped != e->clipped || q->rolled_back != e->undo ||
          memcmp(&q->grad_norm, &e->grad_norm, sizeof(double)) != 0 ||
          memcmp(&q->loss_scale, &e->loss_scale, sizeof(double)) != 0)
        fail_msg("p=%d %s post_validation %d, zb_optimizer rank %d step %d: skipped %d clipped %d "
                 "rolled_back %d norm %.17g scale %g; expected %d %d %d %.17g %g",
                 su->p, pl_name(su->pl), su->cfg.post_validation, r, k, q->skipped, q->clipped,
                 q->rolled_back, q->grad_norm, q->loss_scale, e->skipped, e->clipped, e->undo,
                 e->grad_norm, e->loss_scale);
    }
  model_free(&got);
}

static zb_postval_config_t base_config(void) {
  zb_postval_config_t cfg = ZB_POSTVAL_CONFIG_INIT;
  cfg.clip_grad = 1.0;
  cfg.loss_scale = 8, cfg.backoff = 0.5, cfg.growth = 2, cfg.growth_interval = 2;
  return cfg;
}

/* ---- caller-run SGD equals the global computation and zb_optimizer ------------------------------ */

/* Steps that exercise every branch (about 4..12 elements per stage in [-1, 1): a norm of about 0.05
 * times sqrt(S * 8 / 3) when small, several units when a stage is large; clip 1):
 *  0: small, no clipping;
 *  1: the last stage large: only the full state clips;
 *  2: stage 0 large: the partial state may clip, with another factor than the full one;
 *  3: NaN in the last stage;
 *  4: only stage 0 nonzero and large: a partial state that has stage 0 is already right;
 *  5: inf in stage 0;
 *  6: small again. */
static float mixed_grads(int s, int S, int k, int i) {
  const float u = urand(2, (uint64_t)s, (uint64_t)k, (uint64_t)i);
  switch (k) {
    case 1: return s == S - 1 ? 2 * u : u / 16;
    case 2: return s == 0 ? 2 * u : u / 16;
    case 3: return s == S - 1 && i == 1 ? NAN : u / 16;
    case 4: return s == 0 ? 2 * u : 0.0f;
    case 5: return s == 0 && i == 2 ? INFINITY : u / 16;
    default: return u / 16;
  }
}

static void test_matches_global_reference(void **state) {
  (void)state;
  static const struct {
    int p, S;
    zb_placement_t pl;
  } shapes[] = {
      {1, 3, ZB_PLACEMENT_LOOP}, {2, 4, ZB_PLACEMENT_LOOP}, {3, 6, ZB_PLACEMENT_LOOP},
      {4, 4, ZB_PLACEMENT_LOOP}, {4, 8, ZB_PLACEMENT_LOOP}, {2, 4, ZB_PLACEMENT_V},
      {3, 6, ZB_PLACEMENT_V},    {4, 8, ZB_PLACEMENT_V},
  };
  int undos = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    for (int pv = 0; pv <= 1; pv++) {
      setup_t su = {shapes[i].p, shapes[i].S, 7, shapes[i].pl, mixed_grads, base_config(), 0};
      su.cfg.post_validation = pv;
      model_t ref;
      told_t want[MAXR][MAXSTEPS];
      worker_t w[MAXR];
      check_setup(&su, 1, &ref, want, w);
      for (int r = 0; r < su.p; r++)
        for (int k = 0; k < su.steps; k++) undos += want[r][k].end.undo;
      model_free(&ref);
    }
  /* The data made the speculating ranks undo somewhere; without it the sweep would only show the
   * easy path. */
  if (undos < 20)
    fail_msg("only %d undos over the sweep; the gradients miss the rollback path", undos);
}

/* ---- the behaviours one by one, in words ------------------------------------------------------- */

static float late_clip_grads(int s, int S, int k, int i) {
  const float u = urand(3, (uint64_t)s, (uint64_t)k, (uint64_t)i);
  return s == S - 1 ? 2 * u : u / 64;
}

/* Clipping that only the full state shows: every rank but the chain's last stepped with 1/scale,
 * must undo and step again with the clipped factor. */
static void test_clip_only_in_full_state(void **state) {
  (void)state;
  const zb_placement_t pls[] = {ZB_PLACEMENT_LOOP, ZB_PLACEMENT_V};
  for (int pi = 0; pi < 2; pi++)
    for (int p = 2; p <= 4; p++) {
      setup_t su = {p, 2 * p, 1, pls[pi], late_clip_grads, base_config(), 0};
      su.cfg.post_validation = 1;
      model_t ref;
      told_t want[MAXR][MAXSTEPS];
      worker_t w[MAXR];
      check_setup(&su, 0, &ref, want, w);
      /* The norm from the gradients written out here, as torch's clip_grad_norm_ would see them. */
      double sum = 0;
      for (int s = 0; s < su.S; s++)
        for (int i = 0; i < nelems(s); i++) {
          const double x = (double)late_clip_grads(s, su.S, 0, i);
          sum += x * x;
        }
      const double norm = sqrt(sum);
      if (!(norm > su.cfg.clip_grad)) fail_msg("the test meant to clip, norm %g", norm);
      const float clipped = (float)(1.0 / su.cfg.loss_scale * (su.cfg.clip_grad / (norm + 1e-6)));
      const int last = pls[pi] == ZB_PLACEMENT_V ? 0 : p - 1;
      for (int r = 0; r < p; r++) {
        const told_t *t = &w[r].told[0];
        assert_int_equal(t->begin_step, r != last);
        if (r != last && t->begin_factor != (float)(1.0 / su.cfg.loss_scale))
          fail_msg("p=%d rank %d: speculated with %a, expected 1/scale", p, r,
                   (double)t->begin_factor);
        assert_int_equal(t->end.undo, r != last);
        assert_int_equal(t->end.step, 1);
        assert_int_equal(t->end.clipped, 1);
        /* Summed here in element order, not stage order: equal up to a rounding. */
        if (!(fabsf(t->end.factor - clipped) <= 1e-6f * clipped))
          fail_msg("p=%d rank %d: factor %.9g, expected %.9g", p, r, (double)t->end.factor,
                   (double)clipped);
        if (!(fabs(t->end.grad_norm - norm) <= 1e-12 * norm))
          fail_msg("p=%d rank %d: grad_norm %.17g, expected %.17g", p, r, t->end.grad_norm, norm);
      }
      model_free(&ref);
    }
}

static float nan_last_grads(int s, int S, int k, int i) {
  const float u = urand(4, (uint64_t)s, (uint64_t)k, (uint64_t)i);
  return k == 0 && s == S - 1 && i == 0 ? NAN : u / 8;
}

/* A NaN in the last stage: every rank skips, the speculating ones undo, nothing changes, and the
 * scale backs off by `backoff` on every rank. */
static void test_nan_in_last_stage_skips_everywhere(void **state) {
  (void)state;
  const zb_placement_t pls[] = {ZB_PLACEMENT_LOOP, ZB_PLACEMENT_V};
  for (int pi = 0; pi < 2; pi++)
    for (int p = 2; p <= 4; p++) {
      setup_t su = {p, 2 * p, 2, pls[pi], nan_last_grads, base_config(), 0};
      su.cfg.post_validation = 1;
      su.cfg.backoff = 0.25;
      model_t ref, init;
      told_t want[MAXR][MAXSTEPS];
      worker_t w[MAXR];
      check_setup(&su, 1, &ref, want, w);
      model_free(&ref);
      /* Run the NaN step alone: the parameters must be the initial ones after it. */
      su.steps = 1;
      model_t got;
      run_ranks(&su, 0, &got, w);
      model_init(&init, su.S);
      expect_same_params(&got, &init, &su, "after the NaN step");
      const int last = pls[pi] == ZB_PLACEMENT_V ? 0 : p - 1;
      for (int r = 0; r < p; r++) {
        const told_t *t = &w[r].told[0];
        assert_int_equal(t->begin_step, r != last);
        assert_int_equal(t->end.skipped, 1);
        assert_int_equal(t->end.undo, r != last);
        assert_int_equal(t->end.step, 0);
        if (!isinf(t->end.grad_norm))
          fail_msg("rank %d: grad_norm %g on a skip, expected inf", r, t->end.grad_norm);
        ASSERT_DOUBLE_EQ(t->end.loss_scale, su.cfg.loss_scale * 0.25);
      }
      model_free(&got);
      model_free(&init);
    }
}

static float growth_grads(int s, int S, int k, int i) {
  const float u = urand(5, (uint64_t)s, (uint64_t)k, (uint64_t)i);
  return k == 4 && s == 1 && i == 0 ? INFINITY : u / 8;
}

/* growth_interval = 3: three good steps in a row double the scale; the inf at step 4 halves it and
 * restarts the count. Every rank reports the same scale, zb_postval_loss_scale agrees, and the
 * norm stays that of the unscaled gradients while the scale moves. */
static void test_loss_scale_grows(void **state) {
  (void)state;
  setup_t su = {2, 4, 8, ZB_PLACEMENT_V, growth_grads, base_config(), 0};
  su.cfg.post_validation = 1;
  su.cfg.growth_interval = 3;
  su.cfg.clip_grad = 0;
  const double want_scale[8] = {8, 8, 16, 16, 8, 8, 8, 16};
  model_t ref;
  told_t want[MAXR][MAXSTEPS];
  worker_t w[MAXR];
  check_setup(&su, 1, &ref, want, w);
  for (int k = 0; k < 8; k++) {
    double sum = 0;
    for (int s = 0; s < su.S; s++)
      for (int i = 0; i < nelems(s); i++) {
        const double x = (double)growth_grads(s, su.S, k, i);
        sum += x * x;
      }
    for (int r = 0; r < 2; r++) {
      ASSERT_DOUBLE_EQ(w[r].told[k].end.loss_scale, want_scale[k]);
      assert_int_equal(w[r].told[k].end.skipped, k == 4);
      if (k != 4 && !(fabs(w[r].told[k].end.grad_norm - sqrt(sum)) <= 1e-12 * sqrt(sum)))
        fail_msg("step %d rank %d: grad_norm %.17g, expected %.17g", k, r, w[r].told[k].end.grad_norm,
                 sqrt(sum));
    }
  }
  model_free(&ref);

  /* Resumed from a checkpoint before step 4 (scale 16, where a new handle would start at 8) and
   * before step 6 (one good step counted: the growth at step 7 needs it): told the same, same
   * parameters, same counts. */
  for (int resume_at = 4; resume_at <= 6; resume_at += 2) {
    su.resume_at = resume_at;
    check_setup(&su, 0, &ref, want, w);
    model_free(&ref);
    for (int r = 0; r < 2; r++) {
      ASSERT_DOUBLE_EQ(w[r].at_resume.loss_scale, want_scale[resume_at - 1]);
      assert_int_equal(w[r].at_resume.good_steps, 1);
      assert_int_equal(w[r].at_resume.steps, resume_at);
    }
  }
  su.resume_at = 0;

  /* One rank, no transport: begin never speculates, the scale moves the same way. */
  zb_postval_config_t cfg = su.cfg;
  cfg.stages = 2;
  zb_postval_t *pv = NULL;
  ZB_ASSERT_OK(zb_postval_create(&pv, &cfg));
  for (int k = 0; k < 8; k++) {
    const double sq[2] = {1.0, 2.0};
    const int32_t bad[2] = {0, k == 4};
    zb_postval_decision_t d;
    ZB_ASSERT_OK(zb_postval_begin(pv, sq, bad, &d));
    assert_int_equal(d.step, 0);
    ZB_ASSERT_OK(zb_postval_end(pv, &d));
    assert_int_equal(d.undo, 0);
    assert_int_equal(d.step, k != 4);
    double now;
    ZB_ASSERT_OK(zb_postval_loss_scale(pv, &now));
    ASSERT_DOUBLE_EQ(now, want_scale[k]);
    ASSERT_DOUBLE_EQ(d.loss_scale, want_scale[k]);
  }
  ZB_ASSERT_OK(zb_postval_destroy(pv));
}

/* ---- misuse --------------------------------------------------------------------------------- */

typedef struct {
  const char *field;
  void (*edit)(zb_postval_config_t *c);
  const char *text; /* in the message */
} bad_case_t;

#define BAD(name, body)                                                                            \
  static void bad_##name(zb_postval_config_t *c) { body; }
BAD(size, c->struct_size = 8)
BAD(version, c->version = 99)
BAD(clip, c->clip_grad = NAN)
BAD(scale, c->loss_scale = 0)
BAD(backoff, c->backoff = 2)
BAD(growth, c->growth = 0.5)
BAD(interval, c->growth_interval = -1)
BAD(postval, c->post_validation = 2)
BAD(stages, c->stages = 0)
BAD(rank, (c->ranks = 2, c->rank = 2, c->stages = 2))
BAD(transport, (c->ranks = 2, c->stages = 4))
BAD(v_stages, (c->ranks = 2, c->stages = 6, c->placement = ZB_PLACEMENT_V))
BAD(loop_stages, (c->ranks = 2, c->stages = 3))
BAD(placement, c->placement = (zb_placement_t)5)
BAD(timeout, c->timeout_s = NAN)
#undef BAD

static void test_bad_config(void **state) {
  (void)state;
  static const bad_case_t cases[] = {
      {"struct_size", bad_size, "ZB_POSTVAL_CONFIG_INIT"},
      {"version", bad_version, "version 99"},
      {"clip_grad", bad_clip, "clip_grad is nan"},
      {"loss_scale", bad_scale, "loss_scale is 0; allowed"},
      {"backoff", bad_backoff, "backoff is 2; allowed: (0, 1]"},
      {"growth", bad_growth, "growth is 0.5; allowed"},
      {"growth_interval", bad_interval, "growth_interval is -1"},
      {"post_validation", bad_postval, "post_validation is 2"},
      {"stages", bad_stages, "stages is 0; allowed: >= 1"},
      {"rank", bad_rank, "rank is 2; allowed: 0..1"},
      {"transport", bad_transport, "transport is NULL with ranks = 2"},
      {"v stages", bad_v_stages, "stages = 2 * ranks = 4"},
      {"loop stages", bad_loop_stages, "multiple of ranks"},
      {"placement", bad_placement, "placement is 5"},
      {"timeout", bad_timeout, "timeout_s is NaN"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    zb_postval_config_t cfg = ZB_POSTVAL_CONFIG_INIT;
    cases[i].edit(&cfg);
    zb_postval_t *pv = (zb_postval_t *)&cfg; /* must come back NULL */
    zb_status_t st = zb_postval_create(&pv, &cfg);
    if (st != ZB_ERR_INVALID_ARGUMENT)
      fail_msg("bad %s: create -> %s (%s), expected invalid argument", cases[i].field,
               zb_status_string(st), zb_last_error());
    if (pv != NULL) fail_msg("bad %s: *out not NULL after a failure", cases[i].field);
    ASSERT_CONTAINS(zb_last_error(), cases[i].text);
  }
  zb_postval_t *pv = NULL;
  ASSERT_STATUS(zb_postval_create(NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_postval_create(&pv, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "argument 'config' is NULL");

  /* A transport of another rank. */
  zb_inproc_group_t *group = NULL;
  zb_transport_t *tr = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&group, 2));
  ZB_ASSERT_OK(zb_transport_create_inproc(&tr, group, 1));
  zb_postval_config_t cfg = ZB_POSTVAL_CONFIG_INIT;
  cfg.ranks = 2, cfg.rank = 0, cfg.stages = 2, cfg.transport = tr;
  ASSERT_STATUS(zb_postval_create(&pv, &cfg), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(),
                  "transport is rank 1 of 2 but the post-validation config says rank 0 of 2");
  assert_null(pv);
  ZB_ASSERT_OK(zb_transport_destroy(tr));
  ZB_ASSERT_OK(zb_inproc_group_destroy(group));
  ZB_ASSERT_OK(zb_postval_destroy(NULL));
}

/* Calls out of order and bad arguments fail with a message saying what was wrong, and leave the
 * handle usable. */
static void test_misuse(void **state) {
  (void)state;
  zb_postval_config_t cfg = base_config();
  cfg.stages = 2;
  cfg.loss_scale = 4;
  zb_postval_t *pv = NULL;
  ZB_ASSERT_OK(zb_postval_create(&pv, &cfg));
  const double sq[2] = {1, 4};
  const int32_t bad[2] = {0, 0};
  zb_postval_decision_t d;

  memset(&d, 0x5a, sizeof d);
  ASSERT_STATUS(zb_postval_end(pv, &d), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "zb_postval_end on rank 0 without a zb_postval_begin before it");
  assert_int_equal(d.undo, 0);
  assert_int_equal(d.step, 0);
  ASSERT_DOUBLE_EQ(d.loss_scale, 4);

  ASSERT_STATUS(zb_postval_begin(pv, NULL, bad, &d), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "zb_postval_begin: argument 'sq_norms' is NULL");
  ASSERT_STATUS(zb_postval_begin(pv, sq, NULL, &d), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "zb_postval_begin: argument 'nonfinite' is NULL");
  ASSERT_STATUS(zb_postval_begin(pv, sq, bad, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "argument 'out' is NULL");
  ASSERT_STATUS(zb_postval_begin(NULL, sq, bad, &d), ZB_ERR_INVALID_ARGUMENT);
  const double negative[2] = {1, -1};
  ASSERT_STATUS(zb_postval_begin(pv, negative, bad, &d), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "sq_norms[1] is -1; allowed: a sum of squares >= 0");

  /* None of that began a step: end still refuses. */
  ASSERT_STATUS(zb_postval_end(pv, &d), ZB_ERR_INVALID_ARGUMENT);

  ZB_ASSERT_OK(zb_postval_begin(pv, sq, bad, &d));
  ASSERT_STATUS(zb_postval_begin(pv, sq, bad, &d), ZB_ERR_BUSY);
  ASSERT_CONTAINS(zb_last_error(), "the previous zb_postval_begin has not been ended");
  ASSERT_STATUS(zb_postval_destroy(pv), ZB_ERR_BUSY);
  ASSERT_CONTAINS(zb_last_error(), "call zb_postval_end first");
  /* end without somewhere to write the decision fails and keeps the step begun. */
  ASSERT_STATUS(zb_postval_end(pv, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "argument 'out' is NULL");
  ZB_ASSERT_OK(zb_postval_end(pv, &d));
  /* sqrt(1 + 4) / 4 = 0.559 < clip 1: step with 1/scale. */
  assert_int_equal(d.step, 1);
  assert_int_equal(d.undo, 0);
  assert_int_equal(d.clipped, 0);
  assert_true(d.factor == 0.25f);
  ASSERT_DOUBLE_EQ(d.grad_norm, sqrt(5.0) / 4);

  /* An inf or NaN sum of squares counts as inf/NaN even when the flag is 0. */
  const double inf_sq[2] = {1, INFINITY};
  ZB_ASSERT_OK(zb_postval_begin(pv, inf_sq, bad, &d));
  ZB_ASSERT_OK(zb_postval_end(pv, &d));
  assert_int_equal(d.skipped, 1);
  assert_int_equal(d.step, 0);
  const double nan_sq[2] = {NAN, 1};
  ZB_ASSERT_OK(zb_postval_begin(pv, nan_sq, bad, &d));
  ZB_ASSERT_OK(zb_postval_end(pv, &d));
  assert_int_equal(d.skipped, 1);

  double scale;
  ASSERT_STATUS(zb_postval_loss_scale(pv, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_postval_loss_scale(NULL, &scale), ZB_ERR_INVALID_ARGUMENT);
  ZB_ASSERT_OK(zb_postval_loss_scale(pv, &scale));
  ASSERT_DOUBLE_EQ(scale, 4 * 0.5 * 0.5);

  /* Checkpoints: a struct of another size or version, a state no run can reach, or a set between
   * begin and end fail with the handle unchanged. */
  zb_postval_state_t ps = ZB_POSTVAL_STATE_INIT, bad_ps;
  ZB_ASSERT_OK(zb_postval_get_state(pv, &ps));
  assert_int_equal(ps.steps, 3);
  assert_int_equal(ps.skipped, 2);
  ASSERT_STATUS(zb_postval_get_state(pv, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_postval_set_state(NULL, &ps), ZB_ERR_INVALID_ARGUMENT);
  static const struct {
    int field;
    double value;
    const char *text;
  } bad_states[] = {
      {0, 8, "struct_size 8 and version 1; this library needs"},
      {1, 2, "version 2; this library needs"},
      {2, NAN, "loss_scale is nan; allowed"},
      {2, INFINITY, "loss_scale is inf; allowed"},
      {3, -1, "good_steps is -1 and steps 3"},
      {4, 4, "skipped is 4; allowed: 0..steps (3)"},
      {5, -1, "undone is -1"},
  };
  for (size_t i = 0; i < sizeof bad_states / sizeof bad_states[0]; i++) {
    bad_ps = ps;
    const double v = bad_states[i].value;
    switch (bad_states[i].field) {
      case 0: bad_ps.struct_size = (uint32_t)v; break;
      case 1: bad_ps.version = (uint32_t)v; break;
      case 2: bad_ps.loss_scale = v; break;
      case 3: bad_ps.good_steps = (int64_t)v; break;
      case 4: bad_ps.skipped = (int64_t)v; break;
      default: bad_ps.undone = (int64_t)v; break;
    }
    ASSERT_STATUS(zb_postval_set_state(pv, &bad_ps), ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), bad_states[i].text);
    if (bad_states[i].field < 2) {
      ASSERT_STATUS(zb_postval_get_state(pv, &bad_ps), ZB_ERR_INVALID_ARGUMENT);
      ASSERT_CONTAINS(zb_last_error(), "ZB_POSTVAL_STATE_INIT");
    }
  }
  bad_ps = ps;
  bad_ps.loss_scale = 64;
  ZB_ASSERT_OK(zb_postval_begin(pv, sq, bad, &d));
  ASSERT_STATUS(zb_postval_set_state(pv, &bad_ps), ZB_ERR_BUSY);
  ASSERT_CONTAINS(zb_last_error(), "between zb_postval_begin and zb_postval_end");
  ZB_ASSERT_OK(zb_postval_end(pv, &d));
  ASSERT_DOUBLE_EQ(d.loss_scale, 1); /* still 4 * 0.5 * 0.5 */
  bad_ps = (zb_postval_state_t)ZB_POSTVAL_STATE_INIT;
  ZB_ASSERT_OK(zb_postval_get_state(pv, &bad_ps));
  assert_int_equal(bad_ps.steps, 4);
  assert_int_equal(bad_ps.skipped, 2);
  assert_int_equal(bad_ps.good_steps, 1);
  /* A good one takes: the next iteration's decision uses the restored scale and tracker. */
  ps.loss_scale = 64, ps.good_steps = 1;
  ZB_ASSERT_OK(zb_postval_set_state(pv, &ps));
  ZB_ASSERT_OK(zb_postval_begin(pv, sq, bad, &d));
  ZB_ASSERT_OK(zb_postval_end(pv, &d));
  assert_true(d.factor == 1.0f / 64);
  ASSERT_DOUBLE_EQ(d.loss_scale, 128); /* growth_interval 2: the restored good step counted */
  ZB_ASSERT_OK(zb_postval_destroy(pv));
}

/* ---- a silent peer ---------------------------------------------------------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
  zb_inproc_group_t *group;
  zb_transport_t *tr[2];
  zb_postval_t *pv;
} pair_t;

/* Two ranks in a group; a handle for rank `me` only (the other rank stays silent). */
static void pair_open(pair_t *x, zb_placement_t pl, int me, int post_validation) {
  memset(x, 0, sizeof *x);
  ZB_ASSERT_OK(zb_inproc_group_create(&x->group, 2));
  for (int r = 0; r < 2; r++) ZB_ASSERT_OK(zb_transport_create_inproc(&x->tr[r], x->group, r));
  zb_postval_config_t cfg = base_config();
  cfg.stages = 4, cfg.ranks = 2, cfg.rank = me, cfg.placement = pl;
  cfg.post_validation = post_validation;
  cfg.transport = x->tr[me];
  cfg.timeout_s = 0.2;
  ZB_ASSERT_OK(zb_postval_create(&x->pv, &cfg));
}

static void pair_close(pair_t *x) {
  ZB_ASSERT_OK(zb_postval_destroy(x->pv));
  for (int r = 0; r < 2; r++) ZB_ASSERT_OK(zb_transport_destroy(x->tr[r]));
  ZB_ASSERT_OK(zb_inproc_group_destroy(x->group));
}

static void expect_timeout(zb_status_t st, double elapsed, const char *call, const char *phase) {
  if (st != ZB_ERR_TIMEOUT)
    fail_msg("%s -> %s (%s), expected a timeout", call, zb_status_string(st), zb_last_error());
  ASSERT_CONTAINS(zb_last_error(), call);
  ASSERT_CONTAINS(zb_last_error(), phase);
  if (elapsed > 5.0) fail_msg("%s took %.3g s to fail with a 0.2 s timeout", call, elapsed);
}

static void test_silent_peer_times_out(void **state) {
  (void)state;
  /* Loop over 2 ranks, rank 0 first in the chain: begin does not wait, says to speculate; end
   * waits for rank 1's full state and times out, telling the caller to undo. */
  pair_t x;
  pair_open(&x, ZB_PLACEMENT_LOOP, 0, 1);
  const double sq[4] = {0.25, 0, 0.25, 0};
  const int32_t bad[4] = {0, 0, 0, 0};
  zb_postval_decision_t d;
  for (int attempt = 0; attempt < 2; attempt++) {
    ZB_ASSERT_OK(zb_postval_begin(x.pv, sq, bad, &d));
    assert_int_equal(d.step, 1);
    const double t0 = now_s();
    const zb_status_t st = zb_postval_end(x.pv, &d);
    expect_timeout(st, now_s() - t0, "zb_postval_end on rank 0",
                   "receiving the full state from rank 1 failed (timed out)");
    assert_int_equal(d.undo, 1);
    assert_int_equal(d.step, 0);
    ASSERT_DOUBLE_EQ(d.loss_scale, 8);
    /* The handle is ready for the next iteration (the second attempt), and free of pending work. */
  }
  double scale;
  ZB_ASSERT_OK(zb_postval_loss_scale(x.pv, &scale));
  ASSERT_DOUBLE_EQ(scale, 8);
  pair_close(&x);

  /* The synchronous path: nothing was stepped, so nothing to undo. */
  pair_open(&x, ZB_PLACEMENT_LOOP, 0, 0);
  ZB_ASSERT_OK(zb_postval_begin(x.pv, sq, bad, &d));
  assert_int_equal(d.step, 0);
  const double t1 = now_s();
  zb_status_t st = zb_postval_end(x.pv, &d);
  expect_timeout(st, now_s() - t1, "zb_postval_end on rank 0", "from rank 1");
  assert_int_equal(d.undo, 0);
  pair_close(&x);

  /* Loop, rank 1 (the chain's last) waits in begin for rank 0's partial state. */
  pair_open(&x, ZB_PLACEMENT_LOOP, 1, 1);
  const double t2 = now_s();
  st = zb_postval_begin(x.pv, sq, bad, &d);
  expect_timeout(st, now_s() - t2, "zb_postval_begin on rank 1",
                 "receiving the partial state from rank 0 failed (timed out)");
  assert_int_equal(d.step, 0);
  ASSERT_STATUS(zb_postval_end(x.pv, &d), ZB_ERR_INVALID_ARGUMENT); /* nothing was begun */
  pair_close(&x);

  /* A V runs 1 -> 0: rank 1 begins at once. Only its own stages (1 and 2) are read: the others
   * hold garbage that must not matter, so it is told to speculate. */
  pair_open(&x, ZB_PLACEMENT_V, 1, 1);
  const double mixed_sq[4] = {-5, 0.25, 0.25, NAN};
  const int32_t mixed_bad[4] = {1, 0, 0, 1};
  ZB_ASSERT_OK(zb_postval_begin(x.pv, mixed_sq, mixed_bad, &d));
  assert_int_equal(d.step, 1);
  assert_true(d.factor == 0.125f);
  const double t3 = now_s();
  st = zb_postval_end(x.pv, &d);
  expect_timeout(st, now_s() - t3, "zb_postval_end on rank 1", "from rank 0");
  assert_int_equal(d.undo, 1);
  pair_close(&x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_global_reference),
      cmocka_unit_test(test_clip_only_in_full_state),
      cmocka_unit_test(test_nan_in_last_stage_skips_everywhere),
      cmocka_unit_test(test_loss_scale_grows),
      cmocka_unit_test(test_bad_config),
      cmocka_unit_test(test_misuse),
      cmocka_unit_test(test_silent_peer_times_out),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
