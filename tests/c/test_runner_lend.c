/*
 * test_runner_lend.c - zero-copy stages (zb_runner_config_t.release_cb) on the host backend: the
 * callbacks hand the runner their own output buffers, the runner sends from them and releases each
 * exactly once when done, and a stage's input and output gradient stay valid until its W, so a W
 * that reads them in place (as autograd's saved tensors are read) gets the right weight gradient.
 * Nothing is allocated inside an iteration. The misuses get clear errors.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "runtime/internal.h"

enum { MAXS = 16, MAXM = 16, ARENA = 4 * MAXS * MAXM };

/* One rank's model: outputs carry (value, mb) as in test_runner.c's probe; every F and B output is
 * a buffer of this arena, lent to the runner; B pushes W work that reads its F input and its
 * gradient input in place: dw[s] += dy (x) x. */
typedef struct {
  int S, m;
  zb_runner_t *run;
  zb_wstore_t *ws;
  float arena[ARENA][2];
  int lent[ARENA]; /* 1 while the runner holds it */
  int next, lends, releases, double_release, bad;
  const float *fin[MAXS][MAXM];   /* F's input, as the callback saw it (NULL on stage 0) */
  float x0[MAXM][2], dylast[MAXM][2]; /* the model's own "input" on stage 0 and "loss gradient" */
  float dw[MAXS][4];
  int ran_mb[MAXM * 4], n_ran; /* the microbatch of each W entry run, in order (wstore's release) */
  int no_lend_at_stage; /* a callback that forgets to lend (misuse test); -1: none */
} model_t;

static float *take(model_t *mo, uint64_t *token) {
  for (int k = 0; k < ARENA; k++) {
    int j = (mo->next + k) % ARENA;
    if (!mo->lent[j]) {
      mo->lent[j] = 1, mo->next = j + 1, mo->lends++;
      *token = (uint64_t)j + 1;
      return mo->arena[j];
    }
  }
  return NULL;
}

static void on_release(void *user, uint64_t token) {
  model_t *mo = user;
  int j = (int)token - 1;
  if (j < 0 || j >= ARENA || !mo->lent[j]) {
    mo->double_release++;
    return;
  }
  mo->lent[j] = 0, mo->releases++;
  mo->arena[j][0] = mo->arena[j][1] = NAN; /* a use after release shows as NaN in dw */
}

static zb_status_t on_w_done(void *user, uint64_t token, int32_t ran) {
  model_t *mo = user;
  if (ran && mo->n_ran < MAXM * 4) mo->ran_mb[mo->n_ran++] = (int)token - 1;
  return ZB_OK;
}

static zb_status_t lend_fwd(void *user, int32_t s, int32_t mb, const void *in, void *out) {
  model_t *mo = user;
  if (out) mo->bad++; /* with release_cb the runner hands no output buffer */
  const float *x = in;
  if (x && x[1] != (float)mb) mo->bad++;
  mo->fin[s][mb] = x;
  if (s == mo->S - 1 || s == mo->no_lend_at_stage) return ZB_OK;
  uint64_t token = 0;
  float *o = take(mo, &token);
  if (!o) return ZB_ERR_OUT_OF_MEMORY;
  o[0] = (x ? x[0] : 0.0f) + (float)(s + 1), o[1] = (float)mb;
  return zb_runner_lend_output(mo->run, o, token);
}

static zb_status_t lend_bwd(void *user, int32_t s, int32_t mb, const void *gout, void *gin) {
  model_t *mo = user;
  if (gin) mo->bad++;
  const float *dy = gout ? (const float *)gout : mo->dylast[mb];
  if (dy[1] != (float)mb) mo->bad++;
  const float *x = mo->fin[s][mb] ? mo->fin[s][mb] : mo->x0[mb];
  zb_wgrad_t e = {sizeof e, ZB_DTYPE_F32, 1, 2, 2, x, ZB_LD_DENSE, dy, ZB_LD_DENSE, mo->dw[s], NULL,
                  (uint64_t)mb + 1, ZB_DTYPE_F32, 0};
  ZB_CHECK(zb_wstore_push(mo->ws, &e));
  if (s == 0) return ZB_OK;
  uint64_t token = 0;
  float *o = take(mo, &token);
  if (!o) return ZB_ERR_OUT_OF_MEMORY;
  o[0] = dy[0] + 1.0f, o[1] = (float)mb;
  return zb_runner_lend_output(mo->run, o, token);
}

typedef struct {
  zb_schedule_t *s;
  zb_inproc_group_t *g;
  int rank, iters;
  model_t mo;
  int64_t late;
  zb_status_t st;
  char err[1024];
} rank_t;

static void *rank_main(void *arg) {
  rank_t *c = arg;
  zb_backend_t *be = NULL;
  zb_transport_t *tr = NULL;
  zb_schedule_info_t info;
  zb_schedule_get_info(c->s, &info);
  zb_backend_create_host(&be);
  zb_wstore_create(&c->mo.ws, be, on_w_done, &c->mo);
  if (info.ranks > 1) zb_transport_create_inproc(&tr, c->g, c->rank);
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = c->rank, rc.schedule = c->s, rc.backend = be, rc.transport = tr, rc.wstore = c->mo.ws;
  rc.boundary_bytes_all = 2 * sizeof(float);
  rc.forward_cb = lend_fwd, rc.backward_cb = lend_bwd, rc.user = &c->mo, rc.release_cb = on_release;
  rc.timeout_s = 10, rc.recv_depth = 1;
  c->st = zb_runner_create(&c->mo.run, &rc);
  for (int it = 0; it < c->iters && c->st == ZB_OK; it++) {
    c->st = zb_runner_run(c->mo.run);
    if (c->st == ZB_OK && c->mo.lends != c->mo.releases) {
      snprintf(c->err, sizeof c->err, "after iteration %d: %d buffers lent, %d released", it, c->mo.lends,
               c->mo.releases);
      c->st = ZB_ERR_INTERNAL;
    }
  }
  if (c->st != ZB_OK && !c->err[0]) snprintf(c->err, sizeof c->err, "%s", zb_last_error());
  if (c->st == ZB_OK) zb__runner_late_allocs(c->mo.run, &c->late);
  if (c->st != ZB_OK && tr) zb_transport_abort(tr, "lend test rank failed");
  zb_runner_destroy(c->mo.run);
  zb_transport_destroy(tr);
  zb_wstore_destroy(c->mo.ws);
  zb_backend_destroy(be);
  return NULL;
}

static void run_ranks(zb_schedule_t *s, rank_t *c, int iters, int no_lend_at_stage) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  zb_inproc_group_t *g;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, info.ranks));
  pthread_t th[8];
  for (int r = 0; r < info.ranks; r++) {
    memset(&c[r], 0, sizeof c[r]);
    c[r].s = s, c[r].g = g, c[r].rank = r, c[r].iters = iters;
    c[r].mo.S = info.stages, c[r].mo.m = info.microbatches, c[r].mo.no_lend_at_stage = no_lend_at_stage;
    for (int mb = 0; mb < info.microbatches; mb++) {
      c[r].mo.x0[mb][0] = 0.0f, c[r].mo.x0[mb][1] = (float)mb;
      c[r].mo.dylast[mb][0] = 1000.0f * (float)mb, c[r].mo.dylast[mb][1] = (float)mb;
    }
    pthread_create(&th[r], NULL, rank_main, &c[r]);
  }
  for (int r = 0; r < info.ranks; r++) pthread_join(th[r], NULL);
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
}

/* Every kind on 1 to 4 ranks, two iterations: the values arrive, every lent buffer comes back once,
 * W reads each stage's input and gradient in place and gets dw = sum over microbatches of dy (x) x,
 * and no buffer is allocated inside an iteration. */
static void test_zero_copy_stages(void **state) {
  (void)state;
  const zb_kind_t kinds[] = {ZB_KIND_GPIPE, ZB_KIND_1F1B, ZB_KIND_INTERLEAVED_1F1B, ZB_KIND_ZB_H1, ZB_KIND_ZB_H2,
                             ZB_KIND_ZB_V, ZB_KIND_V_HALF, ZB_KIND_V_MIN, ZB_KIND_ZB_AUTO};
  int ran = 0;
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
    for (int p = 1; p <= 4; p++) {
      zb_schedule_spec_t spec = zb_test_spec(kinds[k], p, 2 * p + 1, 0);
      zb_schedule_t *s;
      if (zb_schedule_create(&s, &spec) != ZB_OK) continue; /* a kind that does not take this shape */
      zb_schedule_info_t info;
      ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
      rank_t c[4];
      const int iters = 2;
      run_ranks(s, c, iters, -1);
      for (int r = 0; r < p; r++) {
        if (c[r].st != ZB_OK) fail_msg("%s p=%d rank %d: %s", zb_kind_name(kinds[k]), p, r, c[r].err);
        assert_int_equal(c[r].mo.bad, 0);
        assert_int_equal(c[r].mo.double_release, 0);
        if (c[r].late) fail_msg("%s p=%d rank %d: %lld buffers allocated inside iterations", zb_kind_name(kinds[k]), p,
                                r, (long long)c[r].late);
      }
      /* dw of stage s: x = (s(s+1)/2, mb), dy = (1000 mb + S-1-s, mb), summed over mb and iterations. */
      const int S = info.stages, m = info.microbatches;
      for (int st = 0; st < S; st++) {
        int32_t owner;
        ZB_ASSERT_OK(zb_schedule_stage_rank(s, st, &owner));
        double want[4] = {0, 0, 0, 0};
        for (int mb = 0; mb < m; mb++) {
          double x[2] = {st * (st + 1) / 2.0, mb}, dy[2] = {1000.0 * mb + (S - 1 - st), mb};
          for (int o = 0; o < 2; o++)
            for (int i = 0; i < 2; i++) want[o * 2 + i] += iters * dy[o] * x[i];
        }
        for (int e = 0; e < 4; e++)
          if (c[owner].mo.dw[st][e] != (float)want[e])
            fail_msg("%s p=%d stage %d: dw[%d] = %g, expected %g (a W read an input the runner had let go)",
                     zb_kind_name(kinds[k]), p, st, e, (double)c[owner].mo.dw[st][e], want[e]);
      }
      zb_schedule_destroy(s);
      ran++;
    }
  assert_true(ran >= 25);
}

/* A fused backward between a B and its W (F0 F1 B0 BW1 W0, as a torch order may run it): the BW runs
 * its own microbatch's W work and W0 microbatch 0's, each while its inputs are still held. */
static void test_fused_between_split(void **state) {
  (void)state;
  const zb_op_t ops[] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 0, 1}, {ZB_OP_B, 0, 0}, {ZB_OP_BW, 0, 1}, {ZB_OP_W, 0, 0}};
  const zb_op_t *lists[1] = {ops};
  int32_t counts[1] = {5};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 1, 2, 1);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, counts));
  ZB_ASSERT_OK(zb_schedule_validate(s));
  rank_t c[1];
  run_ranks(s, c, 1, -1);
  if (c[0].st != ZB_OK) fail_msg("%s", c[0].err);
  /* One stage: x = (0, mb) (the model's own input), dy = (1000 mb, mb) (its own loss gradient). */
  double want[4] = {0, 0, 0, 0};
  for (int mb = 0; mb < 2; mb++) {
    double x[2] = {0, mb}, dy[2] = {1000.0 * mb, mb};
    for (int o = 0; o < 2; o++)
      for (int i = 0; i < 2; i++) want[o * 2 + i] += dy[o] * x[i];
  }
  for (int e = 0; e < 4; e++)
    if (c[0].mo.dw[0][e] != (float)want[e])
      fail_msg("dw[%d] = %g, expected %g", e, (double)c[0].mo.dw[0][e], want[e]);
  /* BW1 ran microbatch 1's W work, then W0 microbatch 0's: each op its own. */
  assert_int_equal(c[0].mo.n_ran, 2);
  if (c[0].mo.ran_mb[0] != 1 || c[0].mo.ran_mb[1] != 0)
    fail_msg("W work ran for microbatches %d then %d; the ops were BW1 then W0", c[0].mo.ran_mb[0], c[0].mo.ran_mb[1]);
  zb_schedule_destroy(s);
}

/* The held inputs are counted in the plan: 1F1B's rank 0 keeps each gradient from B to W (none:
 * BW lets go at once) and each forward input until its BW; the last rank of ZB-H1 keeps as many
 * forward inputs as microbatches it has started and not yet W'ed. */
static void test_held_input_counts(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 6, 0);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  int32_t held[2];
  ZB_ASSERT_OK(zb__runner_held_inputs(s, 1, held)); /* rank 1 receives forward (tag 0) only */
  assert_int_equal(held[1], 0);
  assert_int_equal(held[0], 1); /* 1F1B's last stage runs F then BW at once */
  ZB_ASSERT_OK(zb__runner_held_inputs(s, 0, held)); /* rank 0 receives gradients (tag 1), BW frees */
  assert_int_equal(held[0], 0);
  assert_int_equal(held[1], 1);
  zb_schedule_destroy(s);
  spec = zb_test_spec(ZB_KIND_ZB_H1, 2, 6, 0);
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  ZB_ASSERT_OK(zb__runner_held_inputs(s, 0, held));
  assert_true(held[1] >= 1 && held[1] <= 2); /* B's gradient until its W, which ZB-H1 delays */
  zb_schedule_destroy(s);
}

static zb_status_t noop_fwd(void *u, int32_t s, int32_t m, const void *i, void *o) { return ZB_OK; }
static zb_status_t noop_bwd(void *u, int32_t s, int32_t m, const void *i, void *o) { return ZB_OK; }
static void noop_release(void *u, uint64_t t) {}

static model_t *twice_model;
static zb_status_t lend_twice(void *user, int32_t s, int32_t mb, const void *in, void *out) {
  static float a[2], b[2];
  ZB_CHECK(zb_runner_lend_output(twice_model->run, a, 1));
  return zb_runner_lend_output(twice_model->run, b, 2);
}

static void test_lend_misuse(void **state) {
  (void)state;
  /* A callback that does not lend fails the iteration, naming the op. */
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_INTERLEAVED_1F1B, 1, 2, 2);
  zb_schedule_t *s;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  rank_t c[1];
  run_ranks(s, c, 1, 0);
  assert_int_equal(c[0].st, ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(c[0].err, "forward callback of stage 0, mb 0 returned without zb_runner_lend_output");
  assert_int_equal(c[0].mo.lends, c[0].mo.releases);

  zb_backend_t *be;
  zb_wstore_t *ws;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.schedule = s, rc.backend = be, rc.wstore = ws, rc.forward_cb = noop_fwd, rc.backward_cb = noop_bwd;
  rc.boundary_bytes_all = 8;
  zb_runner_t *r = NULL;
  /* Without release_cb there is nothing to lend to; outside a callback neither. */
  ZB_ASSERT_OK(zb_runner_create(&r, &rc));
  float buf[2];
  ASSERT_STATUS(zb_runner_lend_output(r, buf, 1), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "made without release_cb");
  ZB_ASSERT_OK(zb_runner_destroy(r));
  rc.release_cb = noop_release;
  ZB_ASSERT_OK(zb_runner_create(&r, &rc));
  ASSERT_STATUS(zb_runner_lend_output(r, buf, 1), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "called from a forward or backward callback");
  ZB_ASSERT_OK(zb_runner_destroy(r));
  /* Twice for one op. */
  model_t mo;
  memset(&mo, 0, sizeof mo);
  twice_model = &mo;
  rc.forward_cb = lend_twice;
  ZB_ASSERT_OK(zb_runner_create(&mo.run, &rc));
  ASSERT_STATUS(zb_runner_run(mo.run), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "called twice for F(stage 0, mb 0)");
  ZB_ASSERT_OK(zb_runner_destroy(mo.run));
  /* Not with pairs. */
  zb_schedule_spec_t two = zb_test_spec(ZB_KIND_1F1B, 1, 2, 1);
  zb_schedule_t *s1;
  ZB_ASSERT_OK(zb_schedule_create(&s1, &two));
  rc.schedule = s1;
  int32_t first = 0;
  rc.pair_first = &first, rc.n_pairs = 1;
  ASSERT_STATUS(zb_runner_create(&r, &rc), ZB_ERR_UNSUPPORTED);
  ASSERT_CONTAINS(zb_last_error(), "does not go with pair_first");
  zb_schedule_destroy(s1);
  zb_wstore_destroy(ws);
  ZB_ASSERT_OK(zb_backend_destroy(be));
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_zero_copy_stages),
      cmocka_unit_test(test_held_input_counts),
      cmocka_unit_test(test_fused_between_split),
      cmocka_unit_test(test_lend_misuse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
