/*
 * trainer.c - the reference model trained two ways: pipelined (ranks as threads, in-process
 * transport, one runner and one optimizer per rank) and as a plain sequential loop on one rank.
 * See trainer.h. Both paths use the same model code, the same W store and the same optimizer, so
 * any difference in the final parameters comes from the order the runtime ran things in.
 */
#define _POSIX_C_SOURCE 200809L
#include "trainer.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

typedef struct {
  const zb_schedule_t *schedule;
  const zb__train_config_t *cfg;
  zb_inproc_group_t *group;
  zb__train_result_t *res;
  int32_t rank, p, S;
  zb_placement_t placement;
  int32_t *rolled; /* steps per rank */
  zb_step_result_t *steps_out; /* steps; written by rank 0 */
  double last_step, steady_from, steady_to;
  /* failure injection */
  zb__refmodel_t *model;
  uint8_t *fused; /* compute_time_scale: per (stage * m + mb), 1 where its backward is a BW here */
  int32_t forwards;
  int32_t step;
} rank_ctx_t;

/* compute_time_scale: sleeps until the op has lasted its schedule time times the scale. */
static void pad_to(const rank_ctx_t *c, double t0, zb_op_type_t type, int32_t stage) {
  double t = 0;
  if (c->cfg->compute_time_scale <= 0 || zb_schedule_op_time(c->schedule, type, stage, &t) != ZB_OK) return;
  for (double left; (left = t0 + t * c->cfg->compute_time_scale - zb__now()) > 0;) {
    struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
    nanosleep(&ts, NULL);
  }
}

static zb_status_t fwd_hook(void *user, int32_t stage, int32_t mb, const void *in, void *out) {
  rank_ctx_t *c = user;
  if (c->cfg->fail_rank == c->rank && c->step == 0 && c->forwards++ == c->cfg->fail_op)
    return ZB_FAIL(ZB_ERR_INTERNAL, "injected failure in the forward of stage %d microbatch %d",
                   (int)stage, (int)mb);
  if (c->cfg->empty_compute) return ZB_OK;
  const double t0 = zb__now();
  zb_status_t st = zb__refmodel_forward(c->model, stage, mb, in, out);
  pad_to(c, t0, ZB_OP_F, stage);
  return st;
}

static zb_status_t bwd_hook(void *user, int32_t stage, int32_t mb, const void *gout, void *gin) {
  rank_ctx_t *c = user;
  if (c->cfg->empty_compute) return ZB_OK;
  const double t0 = zb__now();
  zb_status_t st = zb__refmodel_backward(c->model, stage, mb, gout, gin);
  pad_to(c, t0, c->fused && c->fused[(size_t)stage * (size_t)c->cfg->model.microbatches + (size_t)mb] ? ZB_OP_BW : ZB_OP_B,
         stage);
  return st;
}

static zb_status_t copy_hook(void *user, int32_t type, int32_t stage, int32_t mb) {
  rank_ctx_t *c = user;
  return zb__refmodel_copy(c->model, type, stage, mb);
}

static void *rank_main(void *arg) {
  rank_ctx_t *c = arg;
  const zb__train_config_t *cfg = c->cfg;
  zb__train_result_t *res = c->res;
  zb_status_t st = ZB_OK;
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  zb_transport_t *tr = NULL;
  zb_runner_t *runner = NULL;
  zb_optimizer_t *opt = NULL;
  int32_t own[4096], n_own = 0;
  if (cfg->silent_rank == c->rank) return NULL; /* a rank that hangs before it starts */

  for (int32_t s = 0; s < c->S && n_own < 4096; s++) {
    int32_t r;
    zb_schedule_stage_rank(c->schedule, s, &r);
    if (r == c->rank) own[n_own++] = s;
  }
  if (cfg->compute_time_scale > 0) {
    const zb_op_t *ops;
    int32_t n = 0;
    ZB_CHECK_GOTO(zb_schedule_rank_ops(c->schedule, c->rank, &ops, &n), st, done);
    c->fused = calloc((size_t)c->S * (size_t)cfg->model.microbatches, 1);
    if (!c->fused) {
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for rank %d", (int)c->rank);
      goto done;
    }
    for (int32_t k = 0; k < n; k++)
      if (ops[k].type == ZB_OP_BW) c->fused[(size_t)ops[k].stage * (size_t)cfg->model.microbatches + (size_t)ops[k].mb] = 1;
  }
  ZB_CHECK_GOTO(zb_backend_create_host(&be), st, done);
  ZB_CHECK_GOTO(zb__refmodel_create(&c->model, &cfg->model, own, n_own), st, done);
  ZB_CHECK_GOTO(zb_wstore_create(&ws, be, zb__refmodel_release, c->model), st, done);
  zb__refmodel_set_wstore(c->model, ws);
  if (c->p > 1) ZB_CHECK_GOTO(zb_transport_create_inproc(&tr, c->group, c->rank), st, done);

  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = c->rank, rc.schedule = c->schedule, rc.backend = be, rc.transport = tr, rc.wstore = ws;
  rc.boundary_bytes_all = zb__refmodel_boundary_bytes(&cfg->model);
  rc.forward_cb = fwd_hook, rc.backward_cb = bwd_hook, rc.user = c;
  rc.timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : 60.0;
  rc.copy_cb = cfg->empty_compute ? NULL : copy_hook, rc.copy_time_scale = cfg->copy_time_scale;
  rc.copy_inline = cfg->copy_inline;
  ZB_CHECK_GOTO(zb_runner_create(&runner, &rc), st, done);

  if (!cfg->empty_compute) {
    zb_optimizer_config_t oc = cfg->optim;
    oc.stages = c->S, oc.rank = c->rank, oc.ranks = c->p, oc.placement = c->placement;
    oc.transport = tr, oc.timeout_s = rc.timeout_s;
    ZB_CHECK_GOTO(zb_optimizer_create(&opt, &oc), st, done);
    for (int32_t k = 0; k < n_own; k++) {
      float *param, *grad;
      int64_t n;
      ZB_CHECK_GOTO(zb__refmodel_stage_params(c->model, own[k], &param, &grad, &n), st, done);
      ZB_CHECK_GOTO(zb_optimizer_add(opt, own[k], param, grad, n), st, done);
    }
  }

  for (c->step = 0; c->step < cfg->steps; c->step++) {
    double t0 = zb__now(), scale = 1.0;
    if (c->step == 1) c->steady_from = t0;
    if (opt) ZB_CHECK_GOTO(zb_optimizer_loss_scale(opt, &scale), st, done);
    zb__refmodel_begin_step(c->model, c->step, (float)scale);
    ZB_CHECK_GOTO(zb_runner_run(runner), st, done);
    int owns_last = n_own > 0 && own[n_own - 1] == c->S - 1;
    if (owns_last) res->losses[c->step] = zb__refmodel_loss(c->model);
    if (opt) {
      if (owns_last && cfg->inject_nan_step == c->step) {
        float *param, *grad;
        int64_t n;
        ZB_CHECK_GOTO(zb__refmodel_stage_params(c->model, c->S - 1, &param, &grad, &n), st, done);
        grad[n - 1] = NAN;
      }
      zb_step_result_t sr;
      ZB_CHECK_GOTO(zb_optimizer_step(opt, &sr), st, done);
      c->rolled[c->step] = sr.rolled_back;
      if (c->rank == 0) c->steps_out[c->step] = sr;
    }
    c->steady_to = zb__now();
    c->last_step = c->steady_to - t0;
    const double *a, *b;
    int32_t n;
    zb_runner_times(runner, &a, &b, &n);
    memcpy(res->op_start[c->rank] + (size_t)c->step * n, a, (size_t)n * sizeof(double));
    memcpy(res->op_end[c->rank] + (size_t)c->step * n, b, (size_t)n * sizeof(double));
  }
  for (int32_t k = 0; k < n_own; k++) {
    float *param, *grad;
    int64_t cnt;
    ZB_CHECK_GOTO(zb__refmodel_stage_params(c->model, own[k], &param, &grad, &cnt), st, done);
    res->params[own[k]] = malloc((size_t)(cnt ? cnt : 1) * sizeof(float));
    if (!res->params[own[k]]) {
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory copying parameters");
      goto done;
    }
    memcpy(res->params[own[k]], param, (size_t)cnt * sizeof(float));
    res->param_count[own[k]] = cnt;
  }
  zb__refmodel_memory(c->model, &res->resident_slots[c->rank], &res->hosted_slots[c->rank]);

done:
  if (st != ZB_OK) {
    res->rank_status[c->rank] = st;
    res->rank_error[c->rank] = strdup(zb_last_error());
    /* Failures before the runner exists (or in the optimizer) must still release the peers. */
    if (tr) zb_transport_abort(tr, zb__error_body());
  }
  zb_runner_destroy(runner);
  zb_optimizer_destroy(opt);
  zb_transport_destroy(tr);
  zb_wstore_destroy(ws);
  zb__refmodel_destroy(c->model);
  c->model = NULL;
  free(c->fused);
  c->fused = NULL;
  zb_backend_destroy(be);
  return NULL;
}

static zb_status_t alloc_result(zb__train_result_t *res, int32_t steps, int32_t S, int32_t p) {
  memset(res, 0, sizeof(*res));
  res->S = S, res->p = p;
  res->losses = malloc((size_t)(steps > 0 ? steps : 1) * sizeof(double));
  res->params = calloc((size_t)S, sizeof(float *));
  res->param_count = calloc((size_t)S, sizeof(int64_t));
  res->rank_status = calloc((size_t)p, sizeof(zb_status_t));
  res->rank_error = calloc((size_t)p, sizeof(char *));
  res->resident_slots = calloc((size_t)p, sizeof(int64_t));
  res->hosted_slots = calloc((size_t)p, sizeof(int64_t));
  if (!res->losses || !res->params || !res->param_count || !res->rank_status || !res->rank_error ||
      !res->resident_slots || !res->hosted_slots)
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for training results");
  for (int32_t k = 0; k < steps; k++) res->losses[k] = NAN;
  return ZB_OK;
}

void zb__train_result_free(zb__train_result_t *res) {
  if (!res) return;
  for (int32_t s = 0; s < res->S && res->params; s++) free(res->params[s]);
  for (int32_t r = 0; r < res->p; r++) {
    if (res->op_start) free(res->op_start[r]);
    if (res->op_end) free(res->op_end[r]);
    if (res->rank_error) free(res->rank_error[r]);
  }
  free(res->op_start), free(res->op_end), free(res->rank_error), free(res->rank_status);
  free(res->params), free(res->param_count), free(res->losses);
  free(res->resident_slots), free(res->hosted_slots);
  memset(res, 0, sizeof(*res));
}

void zb__train_step_times(const zb_schedule_t *schedule, const zb__train_result_t *res, int32_t step,
                          const double **start, const double **end) {
  for (int32_t r = 0; r < res->p; r++) {
    const zb_op_t *ops;
    int32_t n = 0;
    zb_schedule_rank_ops(schedule, r, &ops, &n);
    start[r] = res->op_start[r] + (size_t)step * n;
    end[r] = res->op_end[r] + (size_t)step * n;
  }
}

static zb_status_t check_config(const zb__train_config_t *cfg, int32_t S, int32_t m) {
  if (cfg->steps < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "steps is %d; it must be >= 1", (int)cfg->steps);
  if (cfg->model.stages != S || cfg->model.microbatches != m)
    return ZB_FAIL(ZB_ERR_INTERNAL, "the model has %d stages and %d microbatches, the schedule %d and %d",
                   (int)cfg->model.stages, (int)cfg->model.microbatches, (int)S, (int)m);
  return ZB_OK;
}

zb_status_t zb__train_pipeline(const zb_schedule_t *schedule, const zb__train_config_t *cfg,
                               zb__train_result_t *res) {
  ZB_ARG_NOT_NULL(schedule);
  ZB_ARG_NOT_NULL(cfg);
  ZB_ARG_NOT_NULL(res);
  memset(res, 0, sizeof(*res));
  zb_schedule_info_t info;
  ZB_CHECK(zb_schedule_get_info(schedule, &info));
  int32_t p = info.ranks, S = info.stages, steps = cfg->steps;
  ZB_CHECK(check_config(cfg, S, info.microbatches));
  zb_status_t st = alloc_result(res, steps, S, p);
  zb_inproc_group_t *group = NULL;
  rank_ctx_t *ctx = calloc((size_t)p, sizeof(rank_ctx_t));
  pthread_t *th = calloc((size_t)p, sizeof(pthread_t));
  int32_t *rolled = calloc((size_t)p * (size_t)steps, sizeof(int32_t));
  zb_step_result_t *steps_out = calloc((size_t)steps, sizeof(zb_step_result_t));
  res->op_start = calloc((size_t)p, sizeof(double *));
  res->op_end = calloc((size_t)p, sizeof(double *));
  if (st == ZB_OK && (!ctx || !th || !rolled || !steps_out || !res->op_start || !res->op_end))
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory starting %d ranks", (int)p);
  for (int32_t r = 0; st == ZB_OK && r < p; r++) {
    const zb_op_t *ops;
    int32_t n;
    ZB_CHECK_GOTO(zb_schedule_rank_ops(schedule, r, &ops, &n), st, out);
    res->op_start[r] = calloc((size_t)(n ? n : 1) * (size_t)steps, sizeof(double));
    res->op_end[r] = calloc((size_t)(n ? n : 1) * (size_t)steps, sizeof(double));
    if (!res->op_start[r] || !res->op_end[r]) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for op times");
  }
  if (st == ZB_OK && p > 1) st = zb_inproc_group_create(&group, p);
  if (st != ZB_OK) goto out;

  double t0 = zb__now();
  int32_t started = 0;
  for (int32_t r = 0; r < p; r++) {
    ctx[r] = (rank_ctx_t){schedule, cfg, group, res, r, p, S, info.placement, rolled + (size_t)r * steps,
                          steps_out, 0, 0, 0, NULL, NULL, 0, 0};
    if (pthread_create(&th[r], NULL, rank_main, &ctx[r]) != 0) {
      st = ZB_FAIL(ZB_ERR_INTERNAL, "could not start the thread of rank %d", (int)r);
      break;
    }
    started++;
  }
  for (int32_t r = 0; r < started; r++) pthread_join(th[r], NULL);
  res->seconds = zb__now() - t0;
  if (st != ZB_OK) goto out; /* a thread that did not start leaves the others to time out */

  /* The root cause is a rank's own failure; ZB_ERR_REMOTE only echoes someone else's. */
  int32_t root = -1;
  for (int32_t r = 0; r < p; r++)
    if (res->rank_status[r] != ZB_OK && (root < 0 || (res->rank_status[root] == ZB_ERR_REMOTE &&
                                                      res->rank_status[r] != ZB_ERR_REMOTE)))
      root = r;
  if (root >= 0) {
    st = res->rank_status[root];
    zb__error_restore(res->rank_error[root]);
    goto out;
  }
  double from = INFINITY, to = 0;
  for (int32_t r = 0; r < p; r++) {
    if (cfg->silent_rank == r) continue;
    if (ctx[r].last_step > res->last_step_seconds) res->last_step_seconds = ctx[r].last_step;
    if (ctx[r].steady_from < from) from = ctx[r].steady_from;
    if (ctx[r].steady_to > to) to = ctx[r].steady_to;
  }
  if (steps >= 2) res->steady_seconds = to - from;
  for (int32_t k = 0; k < steps && !cfg->empty_compute; k++) {
    int any = 0;
    for (int32_t r = 0; r < p; r++) any |= rolled[(size_t)r * steps + k];
    res->rolled_back_steps += any;
    res->skipped_steps += steps_out[k].skipped;
    res->clipped_steps += steps_out[k].clipped;
  }

out:
  if (group) {
    zb_status_t keep = st;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", zb_last_error());
    zb_inproc_group_destroy(group);
    st = keep;
    zb__error_restore(msg);
  }
  free(ctx), free(th), free(rolled), free(steps_out);
  return st;
}

zb_status_t zb__train_sequential(const zb__train_config_t *cfg, zb__train_result_t *res) {
  ZB_ARG_NOT_NULL(cfg);
  ZB_ARG_NOT_NULL(res);
  memset(res, 0, sizeof(*res));
  int32_t S = cfg->model.stages, m = cfg->model.microbatches;
  ZB_CHECK(check_config(cfg, S, m));
  zb_status_t st = alloc_result(res, cfg->steps, S, 1);
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  zb_optimizer_t *opt = NULL;
  zb__refmodel_t *model = NULL;
  int32_t *own = malloc((size_t)S * sizeof(int32_t));
  size_t bytes = (size_t)zb__refmodel_boundary_bytes(&cfg->model);
  void *act[2] = {malloc(bytes ? bytes : 1), malloc(bytes ? bytes : 1)};
  if (st == ZB_OK && (!own || !act[0] || !act[1])) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory");
  if (st != ZB_OK) goto done;
  for (int32_t s = 0; s < S; s++) own[s] = s;
  ZB_CHECK_GOTO(zb_backend_create_host(&be), st, done);
  ZB_CHECK_GOTO(zb__refmodel_create(&model, &cfg->model, own, S), st, done);
  ZB_CHECK_GOTO(zb_wstore_create(&ws, be, zb__refmodel_release, model), st, done);
  zb__refmodel_set_wstore(model, ws);
  zb_optimizer_config_t oc = cfg->optim;
  oc.stages = S, oc.rank = 0, oc.ranks = 1, oc.transport = NULL, oc.post_validation = 0;
  ZB_CHECK_GOTO(zb_optimizer_create(&opt, &oc), st, done);
  for (int32_t s = 0; s < S; s++) {
    float *param, *grad;
    int64_t n;
    ZB_CHECK_GOTO(zb__refmodel_stage_params(model, s, &param, &grad, &n), st, done);
    ZB_CHECK_GOTO(zb_optimizer_add(opt, s, param, grad, n), st, done);
  }
  double t0 = zb__now();
  for (int32_t step = 0; step < cfg->steps; step++) {
    double scale;
    ZB_CHECK_GOTO(zb_optimizer_loss_scale(opt, &scale), st, done);
    zb__refmodel_begin_step(model, step, (float)scale);
    for (int32_t i = 0; i < m; i++) {
      /* Forward through every stage, then backward through every stage: one microbatch at a time. */
      for (int32_t s = 0; s < S; s++)
        ZB_CHECK_GOTO(zb__refmodel_forward(model, s, i, s ? act[(s - 1) & 1] : NULL,
                                           s < S - 1 ? act[s & 1] : NULL),
                      st, done);
      for (int32_t s = S - 1; s >= 0; s--) {
        ZB_CHECK_GOTO(zb_wstore_begin(ws, s, i), st, done);
        st = zb__refmodel_backward(model, s, i, s < S - 1 ? act[(s + 1) & 1] : NULL, s ? act[s & 1] : NULL);
        zb_wstore_end(ws);
        if (st != ZB_OK) goto done;
      }
    }
    for (int32_t s = 0; s < S; s++)
      for (int32_t i = 0; i < m; i++) ZB_CHECK_GOTO(zb_wstore_pop_run(ws, s, NULL), st, done);
    res->losses[step] = zb__refmodel_loss(model);
    if (cfg->inject_nan_step == step) {
      float *param, *grad;
      int64_t n;
      ZB_CHECK_GOTO(zb__refmodel_stage_params(model, S - 1, &param, &grad, &n), st, done);
      grad[n - 1] = NAN;
    }
    zb_step_result_t sr;
    ZB_CHECK_GOTO(zb_optimizer_step(opt, &sr), st, done);
    res->skipped_steps += sr.skipped;
    res->clipped_steps += sr.clipped;
  }
  res->seconds = zb__now() - t0;
  for (int32_t s = 0; s < S; s++) {
    float *param, *grad;
    int64_t n;
    ZB_CHECK_GOTO(zb__refmodel_stage_params(model, s, &param, &grad, &n), st, done);
    res->params[s] = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!res->params[s]) {
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory copying parameters");
      goto done;
    }
    memcpy(res->params[s], param, (size_t)n * sizeof(float));
    res->param_count[s] = n;
  }
done:
  zb_optimizer_destroy(opt);
  zb_wstore_destroy(ws);
  zb__refmodel_destroy(model);
  zb_backend_destroy(be);
  free(own), free(act[0]), free(act[1]);
  return st;
}

void zb__train_compare(const zb__train_result_t *a, const zb__train_result_t *b, int *equal,
                       double *max_abs_diff) {
  int eq = a->S == b->S;
  double mx = 0;
  for (int32_t s = 0; eq && s < a->S; s++) {
    if (!a->params[s] || !b->params[s] || a->param_count[s] != b->param_count[s]) {
      eq = 0;
      mx = INFINITY;
      break;
    }
    if (memcmp(a->params[s], b->params[s], (size_t)a->param_count[s] * sizeof(float)) != 0) eq = 0;
    for (int64_t k = 0; k < a->param_count[s]; k++) {
      double d = fabs((double)a->params[s][k] - (double)b->params[s][k]);
      if (d > mx || isnan(d)) mx = isnan(d) ? INFINITY : d;
    }
  }
  if (!eq && mx == 0 && a->S != b->S) mx = INFINITY;
  *equal = eq;
  *max_abs_diff = mx;
}
