/*
 * test_runner.c - the runner end to end on the host: every generated schedule trains the reference
 * model to the same bits as a sequential loop; a failing or silent rank makes every other rank
 * return an error naming it, within the timeout; the callback transport carries the same data as
 * the in-process one; measured timelines export and feed zb-auto.
 *
 * ZBPP_TEST_QUICK=1 (set for the valgrind run) trims the sweep to p <= 3 and fewer microbatch
 * counts; the properties checked are the same.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "runtime/internal.h"
#include "runtime/trainer.h"

static int quick(void) {
  const char *q = getenv("ZBPP_TEST_QUICK");
  return q && q[0] == '1';
}

static zb__train_config_t train_config(int S, int m, int steps) {
  zb__train_config_t c;
  memset(&c, 0, sizeof c);
  c.model = (zb__refmodel_config_t){S, 1, 8, 16, 4, m, 1234};
  c.steps = steps;
  zb_optimizer_config_t oc = ZB_OPTIMIZER_CONFIG_INIT;
  oc.kind = ZB_OPTIM_ADAMW;
  oc.lr = 1e-2;
  oc.weight_decay = 0.01;
  c.optim = oc;
  c.inject_nan_step = -1;
  c.timeout_s = 30;
  c.fail_rank = c.fail_op = c.silent_rank = -1;
  return c;
}

/* Trains with `schedule` and sequentially; asserts bit equality and equal losses. */
static void check_bitwise(zb_schedule_t *schedule, zb__train_config_t *cfg, const char *what) {
  zb__train_result_t a, b;
  zb_status_t st = zb__train_pipeline(schedule, cfg, &a);
  if (st != ZB_OK) fail_msg("%s: pipeline run failed: %s", what, zb_last_error());
  ZB_ASSERT_OK(zb__train_sequential(cfg, &b));
  int equal;
  double diff;
  zb__train_compare(&a, &b, &equal, &diff);
  if (!equal) fail_msg("%s: parameters differ from the sequential loop (max |diff| %g)", what, diff);
  for (int k = 0; k < cfg->steps; k++)
    if (memcmp(&a.losses[k], &b.losses[k], sizeof(double)) != 0)
      fail_msg("%s: step %d loss %.17g, sequential %.17g", what, k, a.losses[k], b.losses[k]);
  zb__train_result_free(&a);
  zb__train_result_free(&b);
}

/* Every kind the engine generates, p in {1,2,3,4,8}, v where the kind takes it, m from the smallest
 * it accepts to 3p: parameters after 2 AdamW steps equal the sequential loop's bit for bit. */
static void test_every_kind_bitwise(void **state) {
  int ps[] = {1, 2, 3, 4, 8};
  int np = quick() ? 3 : 5, runs = 0;
  for (int ip = 0; ip < np; ip++) {
    int p = ps[ip];
    for (int kind = 0; kind < ZB_KIND_COUNT; kind++) {
      if (kind == ZB_KIND_CUSTOM) continue; /* imported, not generated */
      int vs[2] = {0, 0}, nv = 1;
      if (kind == ZB_KIND_INTERLEAVED_1F1B) vs[0] = 2, vs[1] = 3, nv = 2;
      for (int iv = 0; iv < nv; iv++) {
        int first = 0;
        for (int m = 1; m <= 3 * p; m++) {
          zb_schedule_spec_t spec = zb_test_spec((zb_kind_t)kind, p, m, vs[iv]);
          zb_schedule_t *s;
          if (zb_schedule_create(&s, &spec) != ZB_OK) continue; /* below the kind's smallest m */
          if (!first) first = m;
          /* Quick mode: the smallest m, one in the middle and 3p. */
          if (quick() && m != first && m != 3 * p && m != (first + 3 * p) / 2) {
            zb_schedule_destroy(s);
            continue;
          }
          zb_schedule_info_t info;
          ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
          zb__train_config_t cfg = train_config(info.stages, m, 2);
          char what[96];
          snprintf(what, sizeof what, "%s p=%d v=%d m=%d", zb_kind_name((zb_kind_t)kind), p,
                   info.chunks, m);
          check_bitwise(s, &cfg, what);
          runs++;
          zb_schedule_destroy(s);
        }
      }
    }
  }
  /* Guards against a sweep that silently ran nothing. */
  assert_true(runs > (quick() ? 40 : 200));
  printf("  %d schedules trained bit-for-bit equal to the sequential loop\n", runs);
}

/* Several blocks per stage, SGD with momentum, more steps: still bit for bit. */
static void test_deeper_model_sgd(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 2, 6, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  zb__train_config_t cfg = train_config(4, 6, 4);
  cfg.model.layers = 3;
  cfg.model.rows = 5;
  cfg.optim.kind = ZB_OPTIM_SGD;
  cfg.optim.momentum = 0.9;
  cfg.optim.lr = 0.05;
  check_bitwise(s, &cfg, "zb-v p=2 m=6, 3 blocks per stage, SGD");
  zb_schedule_destroy(s);
}

/* Post-validation against the synchronous path, with neither NaN nor clipping, with clipping on
 * every step, and with a NaN injected into the last stage at step 1. The expected number of
 * rolled-back iterations comes from the synchronous run's own clip/skip counts: with p > 1, every
 * clipped or skipped step is one that the ranks before the end of the chain took speculatively. */
static void test_post_validation(void **state) {
  zb_kind_t kinds[2] = {ZB_KIND_ZB_H1, ZB_KIND_ZB_V};
  for (int kk = 0; kk < 2; kk++) {
    for (int scenario = 0; scenario < 3; scenario++) {
      zb_schedule_spec_t spec = zb_test_spec(kinds[kk], 3, 6, 0);
      zb_schedule_t *s;
      ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
      zb_schedule_info_t info;
      ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
      zb__train_config_t cfg = train_config(info.stages, 6, 4);
      if (scenario == 1) cfg.optim.clip_grad = 1e-3; /* far below any gradient norm here */
      if (scenario == 2) cfg.inject_nan_step = 1;
      cfg.optim.loss_scale = 1024;
      zb__train_config_t sync_cfg = cfg;
      cfg.optim.post_validation = 1;
      zb__train_result_t pv, sync;
      ZB_ASSERT_OK(zb__train_pipeline(s, &cfg, &pv));
      ZB_ASSERT_OK(zb__train_pipeline(s, &sync_cfg, &sync));
      int equal;
      double diff;
      zb__train_compare(&pv, &sync, &equal, &diff);
      if (!equal)
        fail_msg("%s scenario %d: post-validation differs from the synchronous path (max %g)",
                 zb_kind_name(kinds[kk]), scenario, diff);
      int expected = sync.clipped_steps + sync.skipped_steps;
      if (scenario == 0) assert_int_equal(expected, 0);
      if (scenario == 1) assert_int_equal(sync.clipped_steps, 4);
      if (scenario == 2) assert_int_equal(sync.skipped_steps, 1);
      if (pv.rolled_back_steps != expected)
        fail_msg("%s scenario %d: %d rolled-back steps, expected %d", zb_kind_name(kinds[kk]),
                 scenario, pv.rolled_back_steps, expected);
      assert_int_equal(sync.rolled_back_steps, 0);
      /* And the synchronous pipeline equals the sequential loop too. */
      zb__train_result_t seq;
      ZB_ASSERT_OK(zb__train_sequential(&sync_cfg, &seq));
      zb__train_compare(&seq, &sync, &equal, &diff);
      if (!equal) fail_msg("scenario %d: sequential differs (max %g)", scenario, diff);
      zb__train_result_free(&seq);
      zb__train_result_free(&pv);
      zb__train_result_free(&sync);
      zb_schedule_destroy(s);
    }
  }
}

/* Rank 1 fails in its third forward: every rank returns an error, well within the timeout, and
 * each message names rank 1, the op and the microbatch. */
static void test_rank_failure_propagates(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_H1, 3, 6, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  zb__train_config_t cfg = train_config(3, 6, 2);
  cfg.fail_rank = 1;
  cfg.fail_op = 2;
  cfg.timeout_s = 5;
  zb__train_result_t res;
  double t0 = zb__now();
  zb_status_t st = zb__train_pipeline(s, &cfg, &res);
  double took = zb__now() - t0;
  assert_int_equal(st, ZB_ERR_INTERNAL);
  assert_non_null(strstr(zb_last_error(), "injected failure"));
  for (int r = 0; r < 3; r++) {
    if (res.rank_status[r] == ZB_OK) fail_msg("rank %d returned success after rank 1 failed", r);
    const char *msg = res.rank_error[r];
    if (!strstr(msg, "rank 1") || !strstr(msg, "F(stage 1, mb 2)"))
      fail_msg("rank %d's message does not name rank 1's op F(stage 1, mb 2): %s", r, msg);
  }
  assert_int_equal(res.rank_status[0], ZB_ERR_REMOTE);
  assert_int_equal(res.rank_status[2], ZB_ERR_REMOTE);
  /* Failures travel by abort, not by timeout. */
  if (took > cfg.timeout_s) fail_msg("the failure took %.2f s to reach every rank", took);
  zb__train_result_free(&res);
  zb_schedule_destroy(s);
}

/* Rank 2 never starts: the others fail within about one timeout, naming rank 2. */
static void test_silent_rank_times_out(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 3, 4, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  zb__train_config_t cfg = train_config(3, 4, 1);
  cfg.silent_rank = 2;
  cfg.timeout_s = 0.3;
  zb__train_result_t res;
  double t0 = zb__now();
  zb_status_t st = zb__train_pipeline(s, &cfg, &res);
  double took = zb__now() - t0;
  assert_int_equal(st, ZB_ERR_TIMEOUT);
  for (int r = 0; r < 2; r++) {
    if (res.rank_status[r] == ZB_OK) fail_msg("rank %d returned success with rank 2 silent", r);
    if (!strstr(res.rank_error[r], "rank 2")) fail_msg("rank %d's message does not name rank 2: %s", r, res.rank_error[r]);
    if (!strstr(res.rank_error[r], "mb 0")) fail_msg("rank %d's message does not name the microbatch: %s", r, res.rank_error[r]);
  }
  /* Rank 1 waits on rank 2 and times out; rank 0 hears of it by abort (or its own timeout). */
  /* valgrind slows threads down by an order of magnitude: allow more there. */
  if (took > 4 * cfg.timeout_s + (quick() ? 20.0 : 1.0)) fail_msg("the silent rank took %.2f s to detect", took);
  zb__train_result_free(&res);
  zb_schedule_destroy(s);
}

/* ---- callback transport: a tiny mailbox transport written against the callbacks ------------- */

/* The callbacks forward to an in-process transport, so the test checks the adapter (handles,
 * polling, errors), not a second mailbox implementation. */
typedef struct {
  zb_transport_t *inner;
  int waits, cancels, fail_waits;
} cb_user_t;

static zb_status_t cb_isend(void *user, int32_t peer, int32_t tag, const void *buf, size_t bytes, void **req) {
  cb_user_t *u = user;
  zb__request_t *r = calloc(1, sizeof *r);
  zb_status_t st = zb__transport_isend(u->inner, r, peer, tag, buf, bytes);
  /* A start that fails hands no request back (the library never sees it): free it here. */
  if (st != ZB_OK) free(r), r = NULL;
  *req = r;
  return st;
}
static zb_status_t cb_irecv(void *user, int32_t peer, int32_t tag, void *buf, size_t bytes, void **req) {
  cb_user_t *u = user;
  zb__request_t *r = calloc(1, sizeof *r);
  zb_status_t st = zb__transport_irecv(u->inner, r, peer, tag, buf, bytes);
  if (st != ZB_OK) free(r), r = NULL;
  *req = r;
  return st;
}
static zb_status_t cb_wait(void *user, void *req, double timeout) {
  cb_user_t *u = user;
  zb__request_t *r = req;
  if (u->fail_waits && !r->is_send) {
    free(r);
    return ZB_ERR_TIMEOUT;
  }
  zb_status_t st = zb__transport_wait(u->inner, r, timeout);
  if (st == ZB_ERR_TIMEOUT && timeout == 0) return st; /* still pending: keep the handle */
  u->waits++;
  free(r);
  return st;
}
static void cb_cancel(void *user, void *req) {
  cb_user_t *u = user;
  u->cancels++;
  free(req);
}

/* A model whose activations carry (stage, mb) so the test can see every value arrive in order. */
typedef struct {
  int S, m;
  float got[64][2]; /* last stage: what arrived for each mb (forward), stage 0: the gradient */
  int bad;
} probe_t;

static zb_status_t probe_fwd(void *user, int32_t stage, int32_t mb, const void *in, void *out) {
  probe_t *p = user;
  float v = in ? ((const float *)in)[0] : 0.0f;
  if (in && ((const float *)in)[1] != (float)mb) p->bad++;
  if (out) ((float *)out)[0] = v + (float)(stage + 1), ((float *)out)[1] = (float)mb;
  else p->got[mb][0] = v;
  return ZB_OK;
}
static zb_status_t probe_bwd(void *user, int32_t stage, int32_t mb, const void *gout, void *gin) {
  probe_t *p = user;
  float v = gout ? ((const float *)gout)[0] : 1000.0f * (float)mb;
  if (gout && ((const float *)gout)[1] != (float)mb) p->bad++;
  if (gin) ((float *)gin)[0] = v + 1.0f, ((float *)gin)[1] = (float)mb;
  else p->got[mb][1] = v;
  return ZB_OK;
}

typedef struct {
  zb_schedule_t *s;
  int rank, fail, staged; /* staged: the runner gets zb_transport_create_staged over the callbacks */
  zb_inproc_group_t *g;
  probe_t probe;
  cb_user_t user;
  zb_status_t st;
  char err[2048];
} cb_rank_t;

#include <pthread.h>
#include <stddef.h>
static void *cb_rank_main(void *arg) {
  cb_rank_t *c = arg;
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  zb_transport_t *inner = NULL, *tr = NULL, *staged = NULL;
  zb_runner_t *run = NULL;
  zb_backend_create_host(&be);
  zb_wstore_create(&ws, be, NULL, NULL);
  zb_transport_create_inproc(&inner, c->g, c->rank);
  c->user.inner = inner;
  c->user.fail_waits = c->fail;
  zb_transport_callbacks_t cb = {sizeof cb, &c->user, cb_isend, cb_irecv, cb_wait, cb_cancel, NULL};
  c->st = zb_transport_create_callback(&tr, &cb, c->rank, 2);
  if (c->st == ZB_OK && c->staged) c->st = zb_transport_create_staged(&staged, tr);
  if (c->st == ZB_OK) {
    zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
    rc.rank = c->rank, rc.schedule = c->s, rc.backend = be, rc.transport = staged ? staged : tr, rc.wstore = ws;
    rc.boundary_bytes_all = 2 * sizeof(float);
    rc.forward_cb = probe_fwd, rc.backward_cb = probe_bwd, rc.user = &c->probe;
    rc.timeout_s = 2;
    rc.recv_depth = 1;
    c->st = zb_runner_create(&run, &rc);
    for (int it = 0; it < 2 && c->st == ZB_OK; it++) c->st = zb_runner_run(run);
  }
  snprintf(c->err, sizeof c->err, "%s", zb_last_error());
  /* A failing rank does not abort through the callbacks (abort_cb is NULL): release the other
   * rank the way a real peer's timeout would. */
  if (c->st != ZB_OK) zb_transport_abort(inner, "callback test rank failed");
  zb_runner_destroy(run);
  zb_transport_destroy(staged);
  zb_transport_destroy(tr);
  zb_transport_destroy(inner);
  zb_wstore_destroy(ws);
  zb_backend_destroy(be);
  return NULL;
}

static void run_two_ranks(zb_schedule_t *s, cb_rank_t c[2], int fail_rank, int staged) {
  zb_inproc_group_t *g;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 2));
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    memset(&c[r], 0, sizeof c[r]);
    c[r].s = s, c[r].rank = r, c[r].g = g, c[r].fail = r == fail_rank, c[r].staged = staged;
    c[r].probe.S = 4, c[r].probe.m = 4;
    pthread_create(&th[r], NULL, cb_rank_main, &c[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
}

static void check_callback_transport(int staged) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 0); /* S = 4, V: stage 3 on rank 0 */
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  cb_rank_t c[2];
  run_two_ranks(s, c, -1, staged);
  for (int r = 0; r < 2; r++)
    if (c[r].st != ZB_OK) fail_msg("rank %d: %s", r, c[r].err);
  /* Rank 0 holds the first and the last stage: forward adds 1+2+3 over stages 0..2; backward
   * adds 1 for each of stages 3..1. */
  for (int mb = 0; mb < 4; mb++) {
    assert_true(c[0].probe.got[mb][0] == 6.0f);
    assert_true(c[0].probe.got[mb][1] == 1000.0f * mb + 3.0f);
  }
  assert_int_equal(c[0].probe.bad + c[1].probe.bad, 0);
  /* Every receive and send handle went back through wait_cb exactly once: 2 iterations, 4 mbs,
   * and per mb rank 0 sends F(0), B(3)... two sends and two receives per rank per mb. */
  assert_int_equal(c[0].user.waits, 2 * 4 * 4);
  assert_int_equal(c[1].user.waits, 2 * 4 * 4);
  assert_int_equal(c[0].user.cancels + c[1].user.cancels, 0);

  /* A wait that times out in the callback: the runner fails naming the peer and cancels what is
   * still posted; the other rank fails too. */
  run_two_ranks(s, c, 1, staged);
  assert_int_equal(c[1].st, ZB_ERR_TIMEOUT);
  assert_non_null(strstr(c[1].err, "nothing from rank 0"));
  assert_int_not_equal(c[0].st, ZB_OK);
  zb_schedule_destroy(s);
}

static void test_callback_transport(void **state) { check_callback_transport(0); }

/* The staged transport (host copies around a host-memory transport, for ranks sharing a GPU) over
 * the callback transport, on the host backend: every value arrives in order both ways, each
 * message goes through the inner transport once, and a failing wait fails both ranks as before.
 * It wraps host-memory transports only, and holds its inner transport until it is destroyed. */
static void test_staged_transport(void **state) {
  check_callback_transport(1);
  zb_inproc_group_t *g;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 1));
  zb_transport_t *in = NULL, *st = NULL;
  ZB_ASSERT_OK(zb_transport_create_inproc(&in, g, 0));
  ASSERT_STATUS(zb_transport_create_staged(&st, in), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "not a host-memory transport");
  assert_null(st);
  ZB_ASSERT_OK(zb_transport_destroy(in));
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
  cb_user_t u = {0};
  zb_transport_callbacks_t cb = {sizeof cb, &u, cb_isend, cb_irecv, cb_wait, cb_cancel, NULL};
  ZB_ASSERT_OK(zb_transport_create_callback(&in, &cb, 0, 2));
  ZB_ASSERT_OK(zb_transport_create_staged(&st, in));
  ASSERT_STATUS(zb_transport_destroy(in), ZB_ERR_BUSY);
  ZB_ASSERT_OK(zb_transport_destroy(st));
  ZB_ASSERT_OK(zb_transport_destroy(in));
  ASSERT_STATUS(zb_transport_create_staged(NULL, NULL), ZB_ERR_INVALID_ARGUMENT);
}

/* A measured timeline goes into the schedule, exports as Chrome trace and SVG, and its per-stage
 * costs drive zb-auto. */
static void test_measured_timeline(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_H1, 2, 4, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  zb__train_config_t cfg = train_config(2, 4, 2);
  cfg.model.width = 32, cfg.model.ffn = 64, cfg.model.rows = 16;
  zb__train_result_t res;
  ZB_ASSERT_OK(zb__train_pipeline(s, &cfg, &res));
  zb_sim_result_t meas;
  const double *st0[2], *en0[2];
  zb__train_step_times(s, &res, 1, st0, en0);
  ZB_ASSERT_OK(zb_schedule_set_times(s, st0, en0, &meas));
  assert_true(meas.cost > 0 && meas.busy > 0 && meas.busy <= meas.cost * (1 + 1e-9));
  assert_true(meas.bubble_rate >= 0 && meas.bubble_rate < 1);
  /* The measured span can't be longer than the step's wall time (ms). */
  assert_true(meas.cost <= res.last_step_seconds * 1e3 * 1.01 + 1e-3);
  char *text;
  size_t len;
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_CHROME, &text, &len));
  assert_non_null(strstr(text, "\"traceEvents\""));
  assert_non_null(strstr(text, "\"W3\""));
  zb_free(text);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_SVG, &text, &len));
  assert_non_null(strstr(text, "<svg"));
  zb_free(text);
  double tf[2], tb[2], tw[2];
  ZB_ASSERT_OK(zb_schedule_stage_costs(s, tf, tb, tw, NULL));
  for (int st = 0; st < 2; st++) assert_true(tf[st] > 0 && tb[st] > 0 && tw[st] > 0);
  zb_schedule_spec_t auto_spec = zb_test_spec(ZB_KIND_ZB_AUTO, 2, 4, 0);
  auto_spec.stage_time_f = tf, auto_spec.stage_time_b = tb, auto_spec.stage_time_w = tw;
  zb_schedule_t *planned;
  ZB_ASSERT_OK(zb_schedule_create(&planned, &auto_spec));
  ZB_ASSERT_OK(zb_schedule_validate(planned));
  zb_schedule_destroy(planned);
  zb__train_result_free(&res);
  zb_schedule_destroy(s);
}

static zb_status_t noop_fwd(void *u, int32_t s, int32_t m, const void *i, void *o) { return ZB_OK; }
static zb_status_t noop_bwd(void *u, int32_t s, int32_t m, const void *i, void *o) { return ZB_OK; }

static void test_runner_misuse(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 2, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  zb_runner_t *r = NULL;
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "schedule"));
  rc.schedule = s, rc.backend = be, rc.wstore = ws, rc.forward_cb = noop_fwd, rc.backward_cb = noop_bwd;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "needs a transport"));
  rc.rank = 5;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "outside the schedule's ranks"));
  rc.struct_size = 4;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "ZB_RUNNER_CONFIG_INIT"));
  /* An invalid custom schedule is refused before anything runs. */
  zb_op_t r0[] = {{ZB_OP_F, 0, 0}, {ZB_OP_BW, 0, 0}};
  const zb_op_t *lists[1] = {r0};
  int32_t counts[1] = {1};
  zb_schedule_spec_t one = zb_test_spec(ZB_KIND_1F1B, 1, 1, 0);
  zb_schedule_t *bad;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&bad, &one, ZB_PLACEMENT_LOOP, lists, counts));
  zb_runner_config_t rc1 = ZB_RUNNER_CONFIG_INIT;
  rc1.schedule = bad, rc1.backend = be, rc1.wstore = ws, rc1.forward_cb = noop_fwd, rc1.backward_cb = noop_bwd;
  assert_int_equal(zb_runner_create(&r, &rc1), ZB_ERR_INVALID_SCHEDULE);
  /* A W store that already holds work is refused by run. */
  counts[0] = 2;
  zb_schedule_t *good;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&good, &one, ZB_PLACEMENT_LOOP, lists, counts));
  rc1.schedule = good;
  ZB_ASSERT_OK(zb_runner_create(&r, &rc1));
  ZB_ASSERT_OK(zb_runner_run(r));
  ZB_ASSERT_OK(zb_wstore_begin(ws, 0, 0));
  ZB_ASSERT_OK(zb_wstore_end(ws));
  assert_int_equal(zb_runner_run(r), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "already holds"));
  assert_int_equal(zb_backend_destroy(be), ZB_ERR_BUSY);
  ZB_ASSERT_OK(zb_runner_destroy(r));
  ZB_ASSERT_OK(zb_runner_destroy(NULL));
  zb_schedule_destroy(good);
  zb_schedule_destroy(bad);
  zb_wstore_destroy(ws);
  ZB_ASSERT_OK(zb_backend_destroy(be));
  zb_schedule_destroy(s);
}

/* ---- pairs: two ops run as one unit (torch's OVERLAP_F_B) ------------------------------------- */

/* Every callback of both ranks, in the order they started: (rank, type, mb). */
typedef struct {
  pthread_mutex_t mu;
  int n;
  int rank[64], type[64], mb[64];
  int fail_rank, fail_type, fail_mb;
} pair_log_t;

typedef struct {
  pair_log_t *log;
  int rank;
} pair_user_t;

static zb_status_t pair_note(pair_user_t *u, int type, int32_t mb) {
  pair_log_t *l = u->log;
  pthread_mutex_lock(&l->mu);
  if (l->n < 64) l->rank[l->n] = u->rank, l->type[l->n] = type, l->mb[l->n] = mb, l->n++;
  pthread_mutex_unlock(&l->mu);
  if (u->rank == l->fail_rank && type == l->fail_type && mb == l->fail_mb) {
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "callback failed on purpose");
  }
  return ZB_OK;
}
static zb_status_t pair_fwd(void *u, int32_t s, int32_t mb, const void *in, void *out) {
  if (out) memcpy(out, &mb, sizeof mb);
  return pair_note(u, ZB_OP_F, mb);
}
static zb_status_t pair_bwd(void *u, int32_t s, int32_t mb, const void *in, void *out) {
  if (out) memcpy(out, &mb, sizeof mb);
  return pair_note(u, ZB_OP_BW, mb);
}

typedef struct {
  zb_schedule_t *s;
  zb_inproc_group_t *g;
  pair_user_t user;
  const int32_t *pairs;
  int32_t n_pairs;
  zb_status_t st;
  char err[2048];
} pair_rank_t;

static void *pair_rank_main(void *arg) {
  pair_rank_t *c = arg;
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  zb_transport_t *tr = NULL;
  zb_runner_t *run = NULL;
  zb_backend_create_host(&be);
  zb_wstore_create(&ws, be, NULL, NULL);
  zb_transport_create_inproc(&tr, c->g, c->user.rank);
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = c->user.rank, rc.schedule = c->s, rc.backend = be, rc.transport = tr, rc.wstore = ws;
  rc.boundary_bytes_all = sizeof(int32_t);
  rc.forward_cb = pair_fwd, rc.backward_cb = pair_bwd, rc.user = &c->user;
  rc.timeout_s = 5;
  rc.pair_first = c->pairs, rc.n_pairs = c->n_pairs;
  c->st = zb_runner_create(&run, &rc);
  if (c->st == ZB_OK) c->st = zb_runner_run(run);
  snprintf(c->err, sizeof c->err, "%s", zb_last_error());
  zb_runner_destroy(run);
  zb_transport_destroy(tr);
  zb_wstore_destroy(ws);
  zb_backend_destroy(be);
  return NULL;
}

/* 1F1B on 2 ranks, 4 microbatches, fused backwards; rank 0 runs (F2, B1) as a pair when asked. */
static void run_pair_case(pair_log_t *log, int paired, pair_rank_t c[2]) {
  static const zb_op_t r0[] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 0, 1}, {ZB_OP_BW, 0, 0}, {ZB_OP_F, 0, 2},
                               {ZB_OP_BW, 0, 1}, {ZB_OP_F, 0, 3}, {ZB_OP_BW, 0, 2}, {ZB_OP_BW, 0, 3}};
  static const zb_op_t r1[] = {{ZB_OP_F, 1, 0}, {ZB_OP_BW, 1, 0}, {ZB_OP_F, 1, 1}, {ZB_OP_BW, 1, 1},
                               {ZB_OP_F, 1, 2}, {ZB_OP_BW, 1, 2}, {ZB_OP_F, 1, 3}, {ZB_OP_BW, 1, 3}};
  const zb_op_t *lists[2] = {r0, r1};
  int32_t counts[2] = {8, 8};
  static const int32_t pair[1] = {3};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 4, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, counts));
  zb_inproc_group_t *g;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 2));
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    memset(&c[r], 0, sizeof c[r]);
    c[r].s = s, c[r].g = g, c[r].user.log = log, c[r].user.rank = r;
    if (r == 0 && paired) c[r].pairs = pair, c[r].n_pairs = 1;
    pthread_create(&th[r], NULL, pair_rank_main, &c[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
  zb_schedule_destroy(s);
}

static int log_find(const pair_log_t *l, int rank, int type, int mb) {
  for (int k = 0; k < l->n; k++)
    if (l->rank[k] == rank && l->type[k] == type && l->mb[k] == mb) return k;
  return -1;
}

static void test_runner_pairs(void **state) {
  pair_log_t log;
  pair_rank_t c[2];
  /* Paired, F2's callback comes only once B1's gradient is there, so after rank 1's B1 (unpaired,
   * rank 0 is free to run F2 first: it does not wait for rank 1 there). Both callbacks of the pair
   * are back to back on rank 0. */
  memset(&log, 0, sizeof log);
  pthread_mutex_init(&log.mu, NULL);
  log.fail_rank = -1;
  run_pair_case(&log, 1, c);
  for (int r = 0; r < 2; r++)
    if (c[r].st != ZB_OK) fail_msg("rank %d: %s", r, c[r].err);
  assert_int_equal(log.n, 16);
  int f2 = log_find(&log, 0, ZB_OP_F, 2), b1 = log_find(&log, 0, ZB_OP_BW, 1);
  assert_true(f2 > log_find(&log, 1, ZB_OP_BW, 1));
  int between = 0;
  for (int k = f2 + 1; k < b1; k++) between += log.rank[k] == 0;
  assert_true(b1 > f2 && between == 0);

  /* A callback that fails inside a pair is named as itself: the second op, then the first. */
  log.n = 0, log.fail_rank = 0, log.fail_type = ZB_OP_BW, log.fail_mb = 1;
  run_pair_case(&log, 1, c);
  assert_int_not_equal(c[0].st, ZB_OK);
  assert_non_null(strstr(c[0].err, "op 5 of 8, BW(stage 0, mb 1)"));
  assert_int_not_equal(c[1].st, ZB_OK); /* the peer fails too, not waiting out its timeout */
  log.n = 0, log.fail_type = ZB_OP_F, log.fail_mb = 2;
  run_pair_case(&log, 1, c);
  assert_non_null(strstr(c[0].err, "op 4 of 8, F(stage 0, mb 2)"));
  pthread_mutex_destroy(&log.mu);

  /* Bad pairs are refused at create, saying why. */
  zb_op_t one[] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 1, 0}, {ZB_OP_BW, 1, 0}, {ZB_OP_BW, 0, 0}};
  const zb_op_t *lists[1] = {one};
  int32_t counts[1] = {4};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 1, 1, 0);
  spec.chunks = 2;
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, counts));
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.schedule = s, rc.backend = be, rc.wstore = ws, rc.forward_cb = noop_fwd, rc.backward_cb = noop_bwd;
  rc.boundary_bytes_all = 4;
  zb_runner_t *r = NULL;
  int32_t dependent[] = {0}, outside[] = {3}, overlapping[] = {1, 2};
  rc.pair_first = dependent, rc.n_pairs = 1;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "takes its input from op 0 F(stage 0, mb 0)"));
  rc.pair_first = outside;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "has ops 0..3"));
  rc.pair_first = overlapping, rc.n_pairs = 2;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "overlaps another pair"));
  rc.pair_first = NULL, rc.n_pairs = 1;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  /* A caller built before the pair fields existed still creates and runs (no pairs). */
  rc.struct_size = (uint32_t)offsetof(zb_runner_config_t, pair_first);
  rc.pair_first = dependent; /* beyond its struct_size: not read */
  ZB_ASSERT_OK(zb_runner_create(&r, &rc));
  ZB_ASSERT_OK(zb_runner_run(r));
  ZB_ASSERT_OK(zb_runner_destroy(r));
  zb_wstore_destroy(ws);
  ZB_ASSERT_OK(zb_backend_destroy(be));
  zb_schedule_destroy(s);
}

/* Objects that use a backend or a transport hold a reference: destroying one in use is refused
 * (ZB_ERR_BUSY) and frees nothing, so nothing is used after it is freed. */
static void test_lifetimes_by_reference(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 2, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  zb_inproc_group_t *g;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 2));
  zb_backend_t *be;
  zb_wstore_t *ws;
  zb_transport_t *tr;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  ZB_ASSERT_OK(zb_transport_create_inproc(&tr, g, 0));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = 0, rc.schedule = s, rc.backend = be, rc.transport = tr, rc.wstore = ws;
  rc.boundary_bytes_all = 4, rc.forward_cb = noop_fwd, rc.backward_cb = noop_bwd;
  zb_runner_t *r;
  ZB_ASSERT_OK(zb_runner_create(&r, &rc));
  zb_postval_config_t pc = ZB_POSTVAL_CONFIG_INIT;
  pc.stages = 2, pc.rank = 0, pc.ranks = 2, pc.placement = ZB_PLACEMENT_LOOP, pc.transport = tr;
  zb_postval_t *pv;
  ZB_ASSERT_OK(zb_postval_create(&pv, &pc));

  assert_int_equal(zb_transport_destroy(tr), ZB_ERR_BUSY);
  assert_non_null(strstr(zb_last_error(), "still used by 2 runner(s) or post-validation handle(s)"));
  ZB_ASSERT_OK(zb_runner_destroy(r));
  assert_int_equal(zb_transport_destroy(tr), ZB_ERR_BUSY); /* the post-validation handle still uses it */
  ZB_ASSERT_OK(zb_postval_destroy(pv));
  ZB_ASSERT_OK(zb_wstore_destroy(ws));
  /* The runner tied the transport to the backend: the backend stays busy while the transport lives. */
  assert_int_equal(zb_backend_destroy(be), ZB_ERR_BUSY);
  ZB_ASSERT_OK(zb_transport_destroy(tr));
  ZB_ASSERT_OK(zb_backend_destroy(be));
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
  zb_schedule_destroy(s);
}

/* ---- the buffer plan --------------------------------------------------------------------------- */

/* A rendezvous transport over the callbacks: a send completes only once the receiver has received
 * it (what NCCL does; the in-process transport copies, so its sends complete at once). The plan
 * must then hold: no buffer allocated inside an iteration, and no deadlock. */
typedef struct {
  pthread_mutex_t mu;
  int32_t sent[8][8][32], received[8][8][32]; /* per channel (src, dst, tag) */
} rdv_group_t;

typedef struct {
  zb_transport_t *inner;
  rdv_group_t *g;
  int32_t rank;
} rdv_user_t;

typedef struct {
  zb__request_t inner;
  int is_send;
  int32_t src, dst, tag, seq;
} rdv_req_t;

static zb_status_t rdv_isend(void *user, int32_t peer, int32_t tag, const void *buf, size_t bytes, void **req) {
  rdv_user_t *u = user;
  rdv_req_t *r = calloc(1, sizeof *r);
  r->is_send = 1, r->src = u->rank, r->dst = peer, r->tag = tag;
  pthread_mutex_lock(&u->g->mu);
  r->seq = ++u->g->sent[u->rank][peer][tag];
  pthread_mutex_unlock(&u->g->mu);
  zb_status_t st = zb__transport_isend(u->inner, &r->inner, peer, tag, buf, bytes);
  if (st != ZB_OK) free(r), r = NULL;
  *req = r;
  return st;
}
static zb_status_t rdv_irecv(void *user, int32_t peer, int32_t tag, void *buf, size_t bytes, void **req) {
  rdv_user_t *u = user;
  rdv_req_t *r = calloc(1, sizeof *r);
  r->src = peer, r->dst = u->rank, r->tag = tag;
  zb_status_t st = zb__transport_irecv(u->inner, &r->inner, peer, tag, buf, bytes);
  if (st != ZB_OK) free(r), r = NULL;
  *req = r;
  return st;
}
static zb_status_t rdv_wait(void *user, void *req, double timeout) {
  rdv_user_t *u = user;
  rdv_req_t *r = req;
  if (!r->is_send) {
    zb_status_t st = zb__transport_wait(u->inner, &r->inner, timeout);
    if (st == ZB_ERR_TIMEOUT && timeout == 0) return st;
    if (st == ZB_OK) {
      pthread_mutex_lock(&u->g->mu);
      u->g->received[r->src][r->dst][r->tag]++;
      pthread_mutex_unlock(&u->g->mu);
    }
    free(r);
    return st;
  }
  double until = zb__now() + timeout;
  for (;;) {
    pthread_mutex_lock(&u->g->mu);
    int done = u->g->received[r->src][r->dst][r->tag] >= r->seq;
    pthread_mutex_unlock(&u->g->mu);
    if (done) break;
    if (timeout == 0) return ZB_ERR_TIMEOUT;
    if (zb__now() > until) {
      free(r);
      return ZB_ERR_TIMEOUT;
    }
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
  }
  zb__transport_wait(u->inner, &r->inner, 0); /* the in-process copy finished long ago */
  free(r);
  return ZB_OK;
}
static void rdv_cancel(void *user, void *req) {
  rdv_user_t *u = user;
  rdv_req_t *r = req;
  zb__transport_cancel(u->inner, &r->inner);
  free(r);
}

/* A caller's allocator that counts: what the runner takes and gives back, and when. */
typedef struct {
  int64_t allocs, frees, allocs_at_create;
  size_t bytes;
} counting_alloc_t;

static zb_status_t count_alloc(void *user, size_t bytes, void **out) {
  counting_alloc_t *a = user;
  a->allocs++, a->bytes += bytes;
  *out = malloc(bytes ? bytes : 1);
  return *out ? ZB_OK : ZB_ERR_OUT_OF_MEMORY;
}
static void count_free(void *user, void *ptr) {
  counting_alloc_t *a = user;
  a->frees++;
  free(ptr);
}

typedef struct {
  zb_schedule_t *s;
  zb_inproc_group_t *ig;
  rdv_group_t *g;
  rdv_user_t user;
  probe_t probe;
  int32_t ranks;
  counting_alloc_t *alloc; /* NULL: the backend's */
  int64_t late;
  zb_status_t st;
  char err[2048];
} rdv_rank_t;

static void *rdv_rank_main(void *arg) {
  rdv_rank_t *c = arg;
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  zb_transport_t *inner = NULL, *tr = NULL;
  zb_runner_t *run = NULL;
  zb_backend_create_host(&be);
  zb_wstore_create(&ws, be, NULL, NULL);
  zb_transport_create_inproc(&inner, c->ig, c->user.rank);
  c->user.inner = inner, c->user.g = c->g;
  zb_transport_callbacks_t cb = {sizeof cb, &c->user, rdv_isend, rdv_irecv, rdv_wait, rdv_cancel, NULL};
  c->st = zb_transport_create_callback(&tr, &cb, c->user.rank, c->ranks);
  if (c->st == ZB_OK) {
    zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
    rc.rank = c->user.rank, rc.schedule = c->s, rc.backend = be, rc.transport = tr, rc.wstore = ws;
    rc.boundary_bytes_all = 2 * sizeof(float);
    rc.forward_cb = probe_fwd, rc.backward_cb = probe_bwd, rc.user = &c->probe;
    rc.timeout_s = 10;
    if (c->alloc) rc.alloc_cb = count_alloc, rc.free_cb = count_free, rc.alloc_user = c->alloc;
    c->st = zb_runner_create(&run, &rc);
    if (c->alloc) c->alloc->allocs_at_create = c->alloc->allocs;
    for (int it = 0; it < 3 && c->st == ZB_OK; it++) c->st = zb_runner_run(run);
    if (c->st == ZB_OK) zb__runner_late_allocs(run, &c->late);
  }
  snprintf(c->err, sizeof c->err, "%s", zb_last_error());
  if (c->st != ZB_OK) zb_transport_abort(inner, "rendezvous test rank failed");
  zb_runner_destroy(run);
  zb_transport_destroy(tr);
  zb_transport_destroy(inner);
  zb_wstore_destroy(ws);
  zb_backend_destroy(be);
  return NULL;
}

static void run_rendezvous(zb_schedule_t *s, int p, rdv_rank_t *c, counting_alloc_t *alloc) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  static rdv_group_t g;
  memset(&g, 0, sizeof g);
  pthread_mutex_init(&g.mu, NULL);
  zb_inproc_group_t *ig;
  ZB_ASSERT_OK(zb_inproc_group_create(&ig, p));
  pthread_t th[4];
  for (int r = 0; r < p; r++) {
    memset(&c[r], 0, sizeof c[r]);
    c[r].s = s, c[r].ig = ig, c[r].g = &g, c[r].user.rank = r, c[r].ranks = p;
    c[r].probe.S = info.stages, c[r].probe.m = info.microbatches;
    c[r].alloc = alloc ? &alloc[r] : NULL;
    pthread_create(&th[r], NULL, rdv_rank_main, &c[r]);
  }
  for (int r = 0; r < p; r++) pthread_join(th[r], NULL);
  ZB_ASSERT_OK(zb_inproc_group_destroy(ig));
  pthread_mutex_destroy(&g.mu);
}

static void test_buffer_plan(void **state) {
  /* The counts themselves, for schedules whose in-flight sends are known: GPipe sends every
   * microbatch forward before any comes back (m), 1F1B's first rank holds at most p of them. */
  struct { zb_kind_t kind; int p, m, want; } known[] = {{ZB_KIND_GPIPE, 2, 6, 6}, {ZB_KIND_1F1B, 2, 8, 2},
                                                        {ZB_KIND_1F1B, 4, 8, 4}};
  for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
    zb_schedule_spec_t spec = zb_test_spec(known[k].kind, known[k].p, known[k].m, 0);
    zb_schedule_t *s;
    ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
    int32_t sends[32], recvs[32], locals[32];
    ZB_ASSERT_OK(zb__runner_buffer_plan(s, 0, 4, NULL, sends, recvs, locals));
    if (sends[0] != known[k].want)
      fail_msg("%s p=%d m=%d: rank 0 plans %d forward sends in flight, expected %d", zb_kind_name(known[k].kind),
               known[k].p, known[k].m, (int)sends[0], known[k].want);
    assert_true(recvs[1] >= 1 && recvs[1] <= 4 + 2); /* the gradients back: at most depth + 2 */
    zb_schedule_destroy(s);
  }
  /* Every kind over a rendezvous transport on 2..4 ranks: right values, nothing allocated inside
   * an iteration, no deadlock. */
  const zb_kind_t kinds[] = {ZB_KIND_GPIPE, ZB_KIND_1F1B, ZB_KIND_INTERLEAVED_1F1B, ZB_KIND_ZB_H1, ZB_KIND_ZB_H2,
                             ZB_KIND_ZB_V, ZB_KIND_V_HALF, ZB_KIND_V_MIN, ZB_KIND_ZB_AUTO};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
    for (int p = 2; p <= 4; p++) {
      zb_schedule_spec_t spec = zb_test_spec(kinds[k], p, 2 * p, 0);
      zb_schedule_t *s;
      if (zb_schedule_create(&s, &spec) != ZB_OK) continue; /* a kind that does not take this shape */
      rdv_rank_t c[4];
      run_rendezvous(s, p, c, NULL);
      for (int r = 0; r < p; r++) {
        if (c[r].st != ZB_OK) fail_msg("%s p=%d rank %d: %s", zb_kind_name(kinds[k]), p, r, c[r].err);
        if (c[r].late != 0)
          fail_msg("%s p=%d rank %d: %lld buffers allocated inside iterations", zb_kind_name(kinds[k]), p, r,
                   (long long)c[r].late);
        assert_int_equal(c[r].probe.bad, 0);
      }
      zb_schedule_destroy(s);
    }

  /* A caller's allocator gets every buffer at create and each back at destroy, none in between. */
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  rdv_rank_t c[2];
  counting_alloc_t alloc[2];
  memset(alloc, 0, sizeof alloc);
  run_rendezvous(s, 2, c, alloc);
  for (int r = 0; r < 2; r++) {
    if (c[r].st != ZB_OK) fail_msg("rank %d: %s", r, c[r].err);
    assert_true(alloc[r].allocs_at_create > 0);
    assert_int_equal(alloc[r].allocs, alloc[r].allocs_at_create);
    assert_int_equal(alloc[r].frees, alloc[r].allocs);
    assert_int_equal(c[r].probe.bad, 0);
  }
  /* One without the other is refused. */
  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  zb_schedule_spec_t one = zb_test_spec(ZB_KIND_1F1B, 1, 2, 0);
  zb_schedule_t *single;
  ZB_ASSERT_OK(zb_schedule_create(&single, &one));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.schedule = single, rc.backend = be, rc.wstore = ws, rc.forward_cb = noop_fwd, rc.backward_cb = noop_bwd;
  rc.alloc_cb = count_alloc;
  zb_runner_t *r = NULL;
  assert_int_equal(zb_runner_create(&r, &rc), ZB_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(zb_last_error(), "alloc_cb and free_cb go together"));
  zb_schedule_destroy(single);
  zb_wstore_destroy(ws);
  ZB_ASSERT_OK(zb_backend_destroy(be));
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_kind_bitwise),
      cmocka_unit_test(test_deeper_model_sgd),
      cmocka_unit_test(test_post_validation),
      cmocka_unit_test(test_rank_failure_propagates),
      cmocka_unit_test(test_silent_rank_times_out),
      cmocka_unit_test(test_callback_transport),
      cmocka_unit_test(test_staged_transport),
      cmocka_unit_test(test_measured_timeline),
      cmocka_unit_test(test_runner_misuse),
      cmocka_unit_test(test_runner_pairs),
      cmocka_unit_test(test_lifetimes_by_reference),
      cmocka_unit_test(test_buffer_plan),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
