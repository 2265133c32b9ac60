/*
 * test_vocab_schedule.c - Vocabulary Parallelism's passes in the schedule model (S, T, IF, IB;
 * zbpp.h): the simulator's barriers timed by hand, the validator's rules, a deadlock across the
 * barrier named, every export drawing them (CSV refusing with the reason), callers built against
 * the version 2 spec still served, and the runner refusing what it does not run yet.
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

#define OP(t, s, i) {ZB_OP_##t, s, i}

static void assert_near(double got, double want) {
  if (fabs(got - want) > 1e-12) fail_msg("got %.15g, want %.15g", got, want);
}

/* p = 2, one stage each, one microbatch: T_F = 1, T_BW = 2, S = T = 0.5, IF = IB = 0.25, a
 * barrier 0.1, no T_comm. */
static double comm = 0; /* T_comm of the schedules two_ranks makes */

static zb_schedule_t *two_ranks(int vocab, const zb_op_t *r0, int32_t n0, const zb_op_t *r1, int32_t n1) {
  const zb_op_t *lists[] = {r0, r1};
  int32_t counts[] = {n0, n1};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 1, 1);
  spec.time_comm = comm;
  spec.time_f = 1, spec.time_b = 1, spec.time_w = 1, spec.time_bw = 2;
  spec.vocab = vocab;
  spec.time_s = 0.5, spec.time_t = 0.5, spec.time_if = 0.25, spec.time_ib = 0.25, spec.time_vocab_comm = 0.1;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, counts));
  return s;
}

static const zb_op_t rank0[] = {OP(IF, 0, 0), OP(F, 0, 0), OP(S, 0, 0), OP(T, 0, 0), OP(BW, 0, 0), OP(IB, 0, 0)};
static const zb_op_t rank1[] = {OP(IF, 1, 0), OP(F, 1, 0), OP(S, 1, 0), OP(T, 1, 0), OP(BW, 1, 0), OP(IB, 1, 0)};

static void rank_times(zb_schedule_t *s, int r, const double **st, const double **en) {
  ZB_ASSERT_OK(zb_schedule_rank_times(s, r, st, en));
}

/* By the rules in zbpp.h (vocab 2, one barrier):
 *   IF on both [0, .25]; IF barrier ends .35; F(0) [.35, 1.35]; F(1) [1.35, 2.35];
 *   S on both after F(1): [2.35, 2.85]; S barrier ends 2.95; T on both [2.95, 3.45];
 *   BW(1) waits for the S barrier and rank 1's T: [3.45, 5.45]; BW(0) [5.45, 7.45];
 *   IB on both after BW(0): [7.45, 7.7].
 * vocab 1 (two barriers): BW(1) waits for the T barrier, 3.45 + .1: [3.55, 5.55], BW(0) [5.55,
 * 7.55], IB [7.55, 7.8]. */
static void test_barriers_timed_by_hand(void **state) {
  (void)state;
  for (int vocab = 1; vocab <= 2; vocab++) {
    zb_schedule_t *s = two_ranks(vocab, rank0, 6, rank1, 6);
    ZB_ASSERT_OK(zb_schedule_validate(s));
    zb_sim_result_t r;
    ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
    const double *st0, *en0, *st1, *en1;
    rank_times(s, 0, &st0, &en0);
    rank_times(s, 1, &st1, &en1);
    double late = vocab == 1 ? 0.1 : 0; /* the second barrier */
    assert_near(st0[1], 0.35);
    assert_near(st1[1], 1.35);
    assert_near(st0[2], 2.35), assert_near(st1[2], 2.35);
    assert_near(st0[3], 2.95), assert_near(st1[3], 2.95);
    assert_near(st1[4], 3.45 + late);
    assert_near(st0[4], 5.45 + late);
    assert_near(en0[5], 7.7 + late), assert_near(en1[5], 7.7 + late);
    /* Busy counts the passes: rank 0 runs .25 + 1 + .5 + .5 + 2 + .25 = 4.5. */
    double span, busy, peak;
    ZB_ASSERT_OK(zb_schedule_rank_stats(s, 0, &span, &busy, &peak));
    assert_near(busy, 4.5);
    assert_near(peak, 1); /* the passes hold no activations of their own */
    zb_schedule_destroy(s);
  }
}

/* With T_comm = 0.5 the ranks' S end apart, and the barrier waits for the later one:
 *   F(0) [.35, 1.35]; F(1) [1.85, 2.85]; S on rank 1 [2.85, 3.35], on rank 0 (its input crosses)
 *   [3.35, 3.85]; barrier to 3.95: T on both [3.95, 4.45]; BW(1) [4.45, 6.45]; BW(0) [6.95, 8.95];
 *   IB on rank 0 [8.95, 9.2], on rank 1 (its input crosses) [9.45, 9.7]. */
static void test_a_barrier_waits_for_the_last_rank(void **state) {
  (void)state;
  comm = 0.5;
  zb_schedule_t *s = two_ranks(2, rank0, 6, rank1, 6);
  comm = 0;
  ZB_ASSERT_OK(zb_schedule_simulate(s, NULL));
  const double *st0, *en0, *st1, *en1;
  rank_times(s, 0, &st0, &en0);
  rank_times(s, 1, &st1, &en1);
  assert_near(st1[2], 2.85), assert_near(st0[2], 3.35);
  assert_near(st1[3], 3.95), assert_near(st0[3], 3.95);
  assert_near(st1[4], 4.45), assert_near(st0[4], 6.95);
  assert_near(st0[5], 8.95), assert_near(en1[5], 9.7);
  zb_schedule_destroy(s);
}

static void expect_invalid(int vocab, const zb_op_t *r0, int32_t n0, const zb_op_t *r1, int32_t n1,
                           const char *needle) {
  zb_schedule_t *s = two_ranks(vocab, r0, n0, r1, n1);
  ASSERT_STATUS(zb_schedule_validate(s), ZB_ERR_INVALID_SCHEDULE);
  ASSERT_CONTAINS(zb_last_error(), needle);
  zb_schedule_destroy(s);
}

static void test_the_validator_names_the_rule(void **state) {
  (void)state;
  /* Vocabulary passes in a schedule without vocab. */
  expect_invalid(0, rank0, 6, rank1, 6, "the schedule's vocab is 0");
  /* A pass naming another rank. */
  const zb_op_t wrong_rank[] = {OP(IF, 0, 0), OP(F, 0, 0), OP(S, 1, 0), OP(T, 0, 0), OP(BW, 0, 0), OP(IB, 0, 0)};
  expect_invalid(2, wrong_rank, 6, rank1, 6, "names the rank that runs it");
  /* T before S on one rank. */
  const zb_op_t t_first[] = {OP(IF, 0, 0), OP(F, 0, 0), OP(T, 0, 0), OP(S, 0, 0), OP(BW, 0, 0), OP(IB, 0, 0)};
  expect_invalid(2, t_first, 6, rank1, 6, "T mb 0 comes before the S of mb 0");
  /* A rank without its T. */
  const zb_op_t no_t[] = {OP(IF, 0, 0), OP(F, 0, 0), OP(S, 0, 0), OP(BW, 0, 0), OP(IB, 0, 0)};
  expect_invalid(2, no_t, 5, rank1, 6, "rank 0: mb 0 has no T");
  /* Input passes on one rank only. */
  const zb_op_t no_if[] = {OP(F, 1, 0), OP(S, 1, 0), OP(T, 1, 0), OP(BW, 1, 0)};
  expect_invalid(2, rank0, 6, no_if, 4, "rank 1: mb 0 has no IF");
  const zb_op_t ib_alone[] = {OP(F, 1, 0), OP(S, 1, 0), OP(T, 1, 0), OP(BW, 1, 0), OP(IB, 1, 0)};
  expect_invalid(2, rank0, 6, ib_alone, 5, "IB mb 0 comes before the IF");
  /* Stage 0's F before its rank's IF. */
  const zb_op_t f_first[] = {OP(F, 0, 0), OP(IF, 0, 0), OP(S, 0, 0), OP(T, 0, 0), OP(BW, 0, 0), OP(IB, 0, 0)};
  expect_invalid(2, f_first, 6, rank1, 6, "comes before the IF");
  /* The last stage's backward before its rank's S (vocab 2) or T (vocab 1). */
  const zb_op_t bw_first[] = {OP(IF, 1, 0), OP(F, 1, 0), OP(BW, 1, 0), OP(S, 1, 0), OP(T, 1, 0), OP(IB, 1, 0)};
  expect_invalid(2, rank0, 6, bw_first, 6, "comes before the S");
  const zb_op_t bw_before_t[] = {OP(IF, 1, 0), OP(F, 1, 0), OP(S, 1, 0), OP(BW, 1, 0), OP(T, 1, 0), OP(IB, 1, 0)};
  expect_invalid(1, rank0, 6, bw_before_t, 6, "comes before the T");
  /* Across ranks: rank 1 runs F(1) before its IF, so F(0) never gets the IF barrier. */
  const zb_op_t s_first[] = {OP(F, 1, 0), OP(IF, 1, 0), OP(S, 1, 0), OP(T, 1, 0), OP(BW, 1, 0), OP(IB, 1, 0)};
  expect_invalid(2, rank0, 6, s_first, 6, "waits for IF mb 0 on every rank (a barrier)");
}

static void test_every_export_draws_the_passes(void **state) {
  (void)state;
  zb_schedule_t *s = two_ranks(2, rank0, 6, rank1, 6);
  char *out = NULL;
  size_t len = 0;
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_TEXT, &out, &len));
  ASSERT_CONTAINS(out, "S output layer forward");
  ASSERT_CONTAINS(out, "S0");
  ASSERT_CONTAINS(out, "T0");
  zb_free(out);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_JSON, &out, &len));
  ASSERT_CONTAINS(out, "{\"op\": \"IF\", \"stage\": 1, \"mb\": 0");
  zb_free(out);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_CHROME, &out, &len));
  ASSERT_CONTAINS(out, "\"name\": \"IB0\"");
  zb_free(out);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_SVG, &out, &len));
  ASSERT_CONTAINS(out, "S vocabulary forward");
  ASSERT_CONTAINS(out, "IF embedding forward");
  zb_free(out);
  ASSERT_STATUS(zb_schedule_export(s, ZB_FORMAT_CSV, &out, &len), ZB_ERR_INVALID_SCHEDULE);
  ASSERT_CONTAINS(zb_last_error(), "Vocabulary Parallelism's passes have no CSV cells");
  /* (zb_schedule_refine takes these passes: tests/python/test_vocab_schedule.py, at native speed;
   * its fixed work budget would take half a minute under valgrind here.)
   * The offload pass does not know the passes yet: refused, not ignored. */
  zb_schedule_t *t = NULL;
  ASSERT_STATUS(zb_schedule_plan_offload(&t, s, NULL), ZB_ERR_UNSUPPORTED);
  ASSERT_CONTAINS(zb_last_error(), "Vocabulary Parallelism");
  zb_schedule_destroy(s);
}

/* A caller built with the version 2 header (before Vocabulary Parallelism) still gets schedules. */
static void test_version_2_callers_still_work(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 0);
  spec.struct_size = (uint32_t)offsetof(zb_schedule_spec_t, vocab), spec.version = 2;
  spec.vocab = 5; /* past a version 2 caller's struct: must not be read */
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  double t;
  ZB_ASSERT_OK(zb_schedule_op_time(s, ZB_OP_S, 0, &t));
  assert_near(t, 0);
  zb_schedule_destroy(s);
  spec = zb_test_spec(ZB_KIND_1F1B, 2, 4, 1);
  spec.vocab = 3;
  ASSERT_STATUS(zb_schedule_create(&s, &spec), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "vocab is 3");
}

/* ---- the runner runs the passes ------------------------------------------------------------- */

#define VP 3
#define VM 6

typedef struct {
  const zb_schedule_t *s;
  zb_transport_t *tr;
  int rank, vocab;
  int s_done[VM], if_done[VM], bad;
  int seq_type[64], seq_mb[64], n_seq;
  char why[256];
} vrank_t;

static void vbad(vrank_t *v, const char *what, int mb) {
  if (!v->bad++) snprintf(v->why, sizeof v->why, "rank %d: %s (mb %d)", v->rank, what, mb);
}

static void note_op(vrank_t *v, int type, int mb) {
  if (v->n_seq < 64) v->seq_type[v->n_seq] = type, v->seq_mb[v->n_seq++] = mb;
}

/* Forward: the activation counts the stages it went through; stage 0 needs its IF's all-reduce. */
static zb_status_t v_forward(void *u, int32_t st, int32_t mb, const void *in, void *out) {
  vrank_t *v = u;
  note_op(v, ZB_OP_F, mb);
  if (st == 0 && !v->if_done[mb]) vbad(v, "F of stage 0 before the embedding's all-reduce", mb);
  if (out) ((float *)out)[0] = (in ? ((const float *)in)[0] : 0.0f) + 1.0f, ((float *)out)[1] = (float)mb;
  return ZB_OK;
}

/* Backward: the last stage's gradient is the output layer's (vocab 2: S's all-reduce made it). */
static zb_status_t v_backward(void *u, int32_t st, int32_t mb, const void *gout, void *gin) {
  vrank_t *v = u;
  note_op(v, ZB_OP_BW, mb);
  if (!gout && !v->s_done[mb]) vbad(v, "the last stage's backward before the output layer's all-reduce", mb);
  if (gin) ((float *)gin)[0] = 1.0f, ((float *)gin)[1] = (float)mb;
  (void)st;
  return ZB_OK;
}

/* Each pass does its collectives on its own channel, as zbpp.vocab does, and checks the result. */
static zb_status_t v_pass(void *u, int32_t type, int32_t mb) {
  vrank_t *v = u;
  note_op(v, type, mb);
  float x[2] = {(float)(v->rank * 10 + mb), (float)mb};
  zb_status_t st = ZB_OK;
  if (type == ZB_OP_S || type == ZB_OP_IF || (type == ZB_OP_T && v->vocab == 1)) {
    int channel = type == ZB_OP_S ? 0 : type == ZB_OP_T ? 1 : 2;
    st = zb_transport_all_reduce(v->tr, channel, x, 2, ZB_DTYPE_F32, ZB_REDUCE_SUM, 10);
    if (st == ZB_OK && (x[0] != (float)(10 * VP * (VP - 1) / 2 + VP * mb) || x[1] != (float)(VP * mb)))
      vbad(v, "a pass's all-reduce paired with another microbatch's", mb);
    if (type == ZB_OP_S && v->vocab == 2) v->s_done[mb] = 1;
    if (type == ZB_OP_T) v->s_done[mb] = 1;
    if (type == ZB_OP_IF) v->if_done[mb] = 1;
  } else if (type == ZB_OP_IB) {
    float g = v->rank == 0 ? (float)(7 * mb) : -1.0f;
    st = zb_transport_broadcast(v->tr, 3, &g, sizeof g, 0, 10);
    if (st == ZB_OK && g != (float)(7 * mb)) vbad(v, "IB got another microbatch's gradient", mb);
  }
  return st;
}

typedef struct {
  vrank_t v;
  zb_inproc_group_t *g;
  zb_status_t st;
  char err[1024];
} vthread_t;

static void *v_main(void *arg) {
  vthread_t *t = arg;
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  zb_runner_t *run = NULL;
  zb_backend_create_host(&be);
  zb_wstore_create(&ws, be, NULL, NULL);
  t->st = zb_transport_create_inproc(&t->v.tr, t->g, t->v.rank);
  if (t->st == ZB_OK) {
    zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
    rc.rank = t->v.rank, rc.schedule = t->v.s, rc.backend = be, rc.transport = t->v.tr, rc.wstore = ws;
    rc.boundary_bytes_all = 2 * sizeof(float);
    rc.forward_cb = v_forward, rc.backward_cb = v_backward, rc.vocab_cb = v_pass, rc.user = &t->v;
    rc.timeout_s = 10;
    t->st = zb_runner_create(&run, &rc);
    for (int it = 0; it < 2 && t->st == ZB_OK; it++) {
      memset(t->v.s_done, 0, sizeof t->v.s_done), memset(t->v.if_done, 0, sizeof t->v.if_done);
      t->v.n_seq = 0;
      t->st = zb_runner_run(run);
    }
  }
  snprintf(t->err, sizeof t->err, "%s", t->st == ZB_OK ? "" : zb_last_error());
  zb_runner_destroy(run);
  zb_transport_destroy(t->v.tr);
  zb_wstore_destroy(ws);
  zb_backend_destroy(be);
  return NULL;
}

/* 1F1B with the passes on 3 ranks, both variants, two iterations: every rank runs them in its
 * list's order, each pass's collectives pair with the same microbatch's on every rank (a channel
 * per kind of pass), stage 0's F runs after the embedding's all-reduce and the last stage's
 * backward after the output layer's. */
static void test_the_runner_runs_the_passes(void **state) {
  (void)state;
  for (int vocab = 1; vocab <= 2; vocab++) {
    zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, VP, VM, 1);
    spec.vocab = vocab;
    spec.time_s = spec.time_t = 0.5, spec.time_if = spec.time_ib = 0.1, spec.time_vocab_comm = 0.05;
    zb_schedule_t *s = NULL;
    ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
    zb_inproc_group_t *g = NULL;
    ZB_ASSERT_OK(zb_inproc_group_create(&g, VP));
    vthread_t t[VP];
    pthread_t th[VP];
    for (int r = 0; r < VP; r++) {
      memset(&t[r], 0, sizeof t[r]);
      t[r].v.s = s, t[r].v.rank = r, t[r].v.vocab = vocab, t[r].g = g;
      assert_int_equal(pthread_create(&th[r], NULL, v_main, &t[r]), 0);
    }
    for (int r = 0; r < VP; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < VP; r++) {
      if (t[r].st != ZB_OK) fail_msg("vocab %d rank %d: %s", vocab, r, t[r].err);
      if (t[r].v.bad) fail_msg("vocab %d: %s", vocab, t[r].v.why);
      const zb_op_t *ops;
      int32_t n;
      ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &ops, &n));
      assert_int_equal(t[r].v.n_seq, n);
      for (int k = 0; k < n; k++)
        if (t[r].v.seq_type[k] != ops[k].type || t[r].v.seq_mb[k] != ops[k].mb)
          fail_msg("vocab %d rank %d: op %d ran %d/%d, the list has %d/%d", vocab, r, k, t[r].v.seq_type[k],
                   t[r].v.seq_mb[k], ops[k].type, ops[k].mb);
    }
    ZB_ASSERT_OK(zb_inproc_group_destroy(g));
    zb_schedule_destroy(s);
  }
}

static zb_status_t no_forward(void *u, int32_t st, int32_t mb, const void *in, void *out) {
  (void)u, (void)st, (void)mb, (void)in, (void)out;
  return ZB_OK;
}
static zb_status_t no_backward(void *u, int32_t st, int32_t mb, const void *g, void *gi) {
  (void)u, (void)st, (void)mb, (void)g, (void)gi;
  return ZB_OK;
}

/* Without vocab_cb the runner refuses the schedule, saying what it needs. */
static void test_the_runner_needs_vocab_cb(void **state) {
  (void)state;
  const zb_op_t ops[] = {OP(F, 0, 0), OP(S, 0, 0), OP(T, 0, 0), OP(BW, 0, 0)};
  const zb_op_t *lists[] = {ops};
  int32_t n = 4;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 1, 1);
  spec.vocab = 2;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, &n));
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_backend_t *be = NULL;
  zb_wstore_t *ws = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  ZB_ASSERT_OK(zb_wstore_create(&ws, be, NULL, NULL));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.schedule = s, rc.backend = be, rc.wstore = ws, rc.forward_cb = no_forward, rc.backward_cb = no_backward;
  zb_runner_t *runner = NULL;
  ASSERT_STATUS(zb_runner_create(&runner, &rc), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "vocab_cb; set it");
  rc.struct_size = (uint32_t)offsetof(zb_runner_config_t, vocab_cb); /* built before vocab_cb */
  rc.vocab_cb = NULL;
  ASSERT_STATUS(zb_runner_create(&runner, &rc), ZB_ERR_UNSUPPORTED);
  ASSERT_CONTAINS(zb_last_error(), "predates it");
  zb_wstore_destroy(ws);
  zb_backend_destroy(be);
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_barriers_timed_by_hand),
      cmocka_unit_test(test_a_barrier_waits_for_the_last_rank),
      cmocka_unit_test(test_the_validator_names_the_rule),
      cmocka_unit_test(test_every_export_draws_the_passes),
      cmocka_unit_test(test_version_2_callers_still_work),
      cmocka_unit_test(test_the_runner_runs_the_passes),
      cmocka_unit_test(test_the_runner_needs_vocab_cb),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
