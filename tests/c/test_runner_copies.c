/*
 * test_runner_copies.c - the runner runs PipeOffload's copies: every kind, offloaded by
 * zb_schedule_plan_offload, trains the reference model bit for bit like the sequential loop while
 * the copies really move its activations out and back (a backward that read them early would see
 * NaN, or fail); the activation memory measured on each rank is the plan's; the copy lane keeps the
 * model's rules (list order, OFFLOAD after its F, a backward after its RELOAD, a modelled copy time);
 * a failing copy fails the iteration naming it; callers built before copy_cb are refused.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
  c.model = (zb__refmodel_config_t){S, 1, 8, 16, 4, m, 99};
  c.steps = steps;
  zb_optimizer_config_t oc = ZB_OPTIMIZER_CONFIG_INIT;
  oc.kind = ZB_OPTIM_ADAMW;
  oc.lr = 1e-2;
  c.optim = oc;
  c.inject_nan_step = -1;
  c.timeout_s = 30;
  c.fail_rank = c.fail_op = c.silent_rank = -1;
  return c;
}

static int count_copies(const zb_schedule_t *s, int32_t p) {
  int n = 0;
  for (int32_t r = 0; r < p; r++) {
    const zb_op_t *ops;
    int32_t k;
    zb_schedule_rank_ops(s, r, &ops, &k);
    for (int32_t j = 0; j < k; j++) n += ops[j].type == ZB_OP_OFFLOAD;
  }
  return n;
}

/* The same op lists with every copy a millionth of a unit long: what copies that take no time of
 * their own (copy_inline, run on the rank's thread) make of the plan. */
static zb_schedule_t *with_instant_copies(const zb_schedule_t *s, const zb_schedule_spec_t *spec) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  const zb_op_t *lists[64];
  int32_t counts[64];
  for (int32_t r = 0; r < info.ranks; r++) ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &lists[r], &counts[r]));
  zb_schedule_spec_t sp = *spec;
  sp.kind = ZB_KIND_CUSTOM, sp.chunks = info.chunks;
  sp.time_offload = sp.time_reload = 1e-6;
  zb_schedule_t *out = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&out, &sp, info.placement, lists, counts));
  zb_sim_result_t sim;
  ZB_ASSERT_OK(zb_schedule_simulate(out, &sim));
  return out;
}

/* Every kind at p = 2 and 4 (and 3 outside quick mode), offloaded as far as the pass goes with
 * copies half a forward each way, trained for 2 AdamW steps twice, while the copies really move
 * the reference model's activations out and back (a backward that read them early would see NaN,
 * or fail): the parameters equal the sequential loop's bit for bit both times.
 *  - Copies on the rank's own thread (copy_inline): the memory then moves only at the rank's compute
 *    op boundaries, in list order, so each rank's measured activation memory (slot buffers in use
 *    at once) is exactly the plan's for copies of no duration, whatever the timing.
 *  - Copies on the copy thread, each lasting its modelled time, with F and B padded to theirs so the
 *    run follows the plan's timing: how many ranks held exactly the plan's device peak is printed,
 *    not checked, since it depends on the timing (on an idle machine all of them; a busy one can
 *    delay a copy past the next forward).
 * Some rank holds less than the plan without offload, on average one per schedule and mode. */
static void test_offload_trains_bitwise_at_the_planned_memory(void **state) {
  (void)state;
  const int ps[] = {2, 4, 3};
  int runs = 0, lowered = 0, exact = 0, ranks = 0;
  for (int ip = 0; ip < (quick() ? 2 : 3); ip++) {
    const int p = ps[ip];
    for (int kind = 0; kind < ZB_KIND_COUNT; kind++) {
      if (kind == ZB_KIND_CUSTOM) continue; /* imported, not generated */
      const int m = 2 * p + 2;
      zb_schedule_spec_t spec = zb_test_spec((zb_kind_t)kind, p, m, 0);
      spec.w_share = 1.0; /* the reference model frees a microbatch's activations at its W */
      spec.time_offload = spec.time_reload = 0.5;
      spec.time_w = 0.25; /* W is not padded (compute_time_scale): the model's own is short */
      zb_schedule_t *plain = NULL, *off = NULL;
      if (zb_schedule_create(&plain, &spec) != ZB_OK) continue;
      zb_sim_result_t sim;
      ZB_ASSERT_OK(zb_schedule_simulate(plain, &sim));
      zb_offload_config_t oc = ZB_OFFLOAD_CONFIG_INIT;
      oc.slowdown = 0.25;
      ZB_ASSERT_OK(zb_schedule_plan_offload(&off, plain, &oc));
      ZB_ASSERT_OK(zb_schedule_simulate(off, &sim));
      zb_schedule_info_t info;
      ZB_ASSERT_OK(zb_schedule_get_info(off, &info));
      if (count_copies(off, p) == 0) { /* nothing paid: nothing to test here */
        zb_schedule_destroy(off), zb_schedule_destroy(plain);
        continue;
      }
      zb_schedule_t *instant = with_instant_copies(off, &spec);
      zb__train_result_t b;
      zb__train_config_t cfg = train_config(info.stages, m, 2);
      ZB_ASSERT_OK(zb__train_sequential(&cfg, &b));
      for (int inline_copies = 1; inline_copies >= 0; inline_copies--) {
        char what[128];
        snprintf(what, sizeof what, "%s p=%d m=%d (%d offloads, copies %s)", zb_kind_name((zb_kind_t)kind), p, m,
                 count_copies(off, p), inline_copies ? "inline" : "on the copy thread");
        cfg.copy_inline = inline_copies;
        cfg.copy_time_scale = cfg.compute_time_scale = inline_copies ? 0.0 : 0.004;
        zb__train_result_t a;
        if (zb__train_pipeline(off, &cfg, &a) != ZB_OK) fail_msg("%s: %s", what, zb_last_error());
        int equal;
        double diff;
        zb__train_compare(&a, &b, &equal, &diff);
        if (!equal) fail_msg("%s: parameters differ from the sequential loop (max |diff| %g)", what, diff);
        for (int k = 0; k < cfg.steps; k++)
          if (memcmp(&a.losses[k], &b.losses[k], sizeof(double)) != 0) fail_msg("%s: step %d loss differs", what, k);
        for (int32_t r = 0; r < p; r++) {
          double dev, host, dev0, host0;
          ZB_ASSERT_OK(zb_schedule_rank_memory(inline_copies ? instant : off, r, &dev, &host));
          ZB_ASSERT_OK(zb_schedule_rank_memory(plain, r, &dev0, &host0));
          /* Plan units are a microbatch through all of a rank's layers: one stage's slot is 1/v. */
          const double v = info.chunks, got = (double)a.resident_slots[r], hosted = (double)a.hosted_slots[r];
          if (inline_copies && (fabs(got - dev * v) > 1e-9 || fabs(hosted - host * v) > 1e-9))
            fail_msg("%s: rank %d held %g slots on the device and %g on the host at once; the plan for copies "
                     "of no duration says %g and %g", what, (int)r, got, hosted, dev * v, host * v);
          if (!inline_copies) exact += fabs(got - dev * v) < 1e-9, ranks++;
          lowered += got < dev0 * v - 1e-9 && (inline_copies || !quick());
        }
        zb__train_result_free(&a);
      }
      zb__train_result_free(&b);
      zb_schedule_destroy(instant), zb_schedule_destroy(off), zb_schedule_destroy(plain);
      runs++;
    }
  }
  assert_true(runs >= (quick() ? 8 : 14));
  assert_true(lowered >= runs); /* on average a rank per schedule and mode holds less */
  printf("  %d offloaded schedules trained bit for bit, copies inline and on the copy thread; inline, every rank "
         "held the plan's memory exactly; on the thread, %d of %d ranks the plan's device peak exactly\n",
         runs, exact, ranks);
}

/* ---- the lane's rules, on one rank with logging callbacks ------------------------------------- */

#define F(s, i) {ZB_OP_F, s, i}
#define X(s, i) {ZB_OP_BW, s, i}
#define O(s, i) {ZB_OP_OFFLOAD, s, i}
#define R(s, i) {ZB_OP_RELOAD, s, i}

/* The schedule of test_copies.c's hand-worked case: T_F = 2, T_BW = 3, copies 1 each way. */
static const zb_op_t offloaded[] = {F(0, 0), O(0, 0), F(0, 1), O(0, 1), F(0, 2),
                                    X(0, 2), R(0, 1), X(0, 1), R(0, 0), X(0, 0)};

static zb_schedule_t *one_rank(void) {
  const zb_op_t *lists[] = {offloaded};
  int32_t n = 10;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 3, 1);
  spec.time_f = 2, spec.time_b = 1, spec.time_w = 1, spec.time_bw = 3;
  spec.time_offload = 1, spec.time_reload = 1;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, &n));
  return s;
}

/* The one-rank schedule above with a host backend and a W store, and their teardown. */
typedef struct {
  zb_schedule_t *s;
  zb_backend_t *be;
  zb_wstore_t *ws;
} rig_t;

static rig_t rig_open(void) {
  rig_t g = {one_rank(), NULL, NULL};
  ZB_ASSERT_OK(zb_backend_create_host(&g.be));
  ZB_ASSERT_OK(zb_wstore_create(&g.ws, g.be, NULL, NULL));
  return g;
}

static void rig_close(rig_t *g) {
  zb_wstore_destroy(g->ws);
  zb_backend_destroy(g->be);
  zb_schedule_destroy(g->s);
}

typedef struct {
  int f_done[3], on_host[3]; /* what the copies and the computes saw */
  int fail_type, fail_mb;    /* the copy that fails, or -1 */
  int copies;
  double scale;              /* seconds per schedule time unit of the compute's sleep */
} lane_user_t;

static void nap(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

static zb_status_t lane_fwd(void *u, int32_t s, int32_t mb, const void *in, void *out) {
  (void)s, (void)in, (void)out;
  lane_user_t *l = u;
  nap(2 * l->scale);
  __atomic_store_n(&l->f_done[mb], 1, __ATOMIC_SEQ_CST);
  return ZB_OK;
}

static zb_status_t lane_bwd(void *u, int32_t s, int32_t mb, const void *in, void *out) {
  (void)s, (void)in, (void)out;
  lane_user_t *l = u;
  if (__atomic_load_n(&l->on_host[mb], __ATOMIC_SEQ_CST))
    return ZB_FAIL(ZB_ERR_INTERNAL, "the backward of mb %d ran while its activations were on the host", (int)mb);
  nap(3 * l->scale);
  return ZB_OK;
}

static zb_status_t lane_copy(void *u, int32_t type, int32_t s, int32_t mb) {
  (void)s;
  lane_user_t *l = u;
  l->copies++;
  if (type == l->fail_type && mb == l->fail_mb)
    return ZB_FAIL(ZB_ERR_IO, "the host pool is full (test)");
  if (type == ZB_OP_OFFLOAD && !__atomic_load_n(&l->f_done[mb], __ATOMIC_SEQ_CST))
    return ZB_FAIL(ZB_ERR_INTERNAL, "OFFLOAD of mb %d before its forward returned", (int)mb);
  __atomic_store_n(&l->on_host[mb], type == ZB_OP_OFFLOAD, __ATOMIC_SEQ_CST);
  return ZB_OK;
}

static zb_runner_t *lane_runner(zb_schedule_t *s, zb_backend_t *be, zb_wstore_t *ws, lane_user_t *u, double scale) {
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = 0, rc.schedule = s, rc.backend = be, rc.wstore = ws, rc.user = u;
  rc.forward_cb = lane_fwd, rc.backward_cb = lane_bwd, rc.copy_cb = lane_copy;
  rc.copy_time_scale = scale, rc.timeout_s = 10;
  zb_runner_t *run = NULL;
  ZB_ASSERT_OK(zb_runner_create(&run, &rc));
  return run;
}

/* With a modelled link (copies last their schedule time) the measured timeline keeps the model's
 * rules: copies one at a time in list order, each at least its modelled time, an OFFLOAD after its
 * F returned, a backward after its RELOAD ended, and the copies where the plan puts them: R(1) with
 * BW(2) (issued with the compute op before it), R(0) with BW(1). */
static void test_the_lane_keeps_the_model_rules(void **state) {
  (void)state;
  rig_t g = rig_open();
  zb_schedule_t *s = g.s;
  zb_backend_t *be = g.be;
  zb_wstore_t *ws = g.ws;
  const double unit = 0.01;
  lane_user_t u = {{0}, {0}, -1, -1, 0, unit};
  zb_runner_t *run = lane_runner(s, be, ws, &u, unit);
  ZB_ASSERT_OK(zb_runner_run(run));
  assert_int_equal(u.copies, 4);
  const double *st, *en;
  int32_t n;
  ZB_ASSERT_OK(zb_runner_times(run, &st, &en, &n));
  assert_int_equal(n, 10);
  double prev_end = 0;
  for (int k = 0; k < n; k++) {
    if (offloaded[k].type != ZB_OP_OFFLOAD && offloaded[k].type != ZB_OP_RELOAD) continue;
    if (en[k] - st[k] < unit * 0.999) fail_msg("copy at position %d lasted %g s, modelled %g s", k, en[k] - st[k], unit);
    if (st[k] < prev_end) fail_msg("copy at position %d started before the lane's previous copy ended", k);
    prev_end = en[k];
  }
  /* OFFLOAD(mb) after F(mb): positions 1 after 0, 3 after 2. */
  assert_true(st[1] >= en[0]), assert_true(st[3] >= en[2]);
  /* Backwards after their RELOADs: BW(1) at 7 after R(1) at 6; BW(0) at 9 after R(0) at 8. */
  assert_true(st[7] >= en[6]), assert_true(st[9] >= en[8]);
  /* Issued with the compute op before them: R(1) starts with BW(2), R(0) with BW(1). */
  if (fabs(st[6] - st[5]) > 0.5 * unit) fail_msg("R(1) started %g s after BW(2)", st[6] - st[5]);
  if (fabs(st[8] - st[7]) > 0.5 * unit) fail_msg("R(0) started %g s after BW(1)", st[8] - st[7]);
  zb_runner_destroy(run);
  rig_close(&g);
}

/* A copy that fails fails the iteration with the copy named and the callback's words; the next
 * iteration runs cleanly once the cause is gone. Without a modelled link and with a compute that
 * does not wait, a backward still never runs while its activations are on the host. */
static void test_a_failing_copy_is_named(void **state) {
  (void)state;
  rig_t g = rig_open();
  zb_schedule_t *s = g.s;
  zb_backend_t *be = g.be;
  zb_wstore_t *ws = g.ws;
  lane_user_t u = {{0}, {0}, ZB_OP_RELOAD, 1, 0, 0.0};
  zb_runner_t *run = lane_runner(s, be, ws, &u, 0.0);
  ASSERT_STATUS(zb_runner_run(run), ZB_ERR_IO);
  ASSERT_CONTAINS(zb_last_error(), "RELOAD(stage 0, mb 1)");
  ASSERT_CONTAINS(zb_last_error(), "the host pool is full (test)");
  ASSERT_CONTAINS(zb_last_error(), "rank 0");
  memset(&u, 0, sizeof u);
  u.fail_type = u.fail_mb = -1;
  for (int k = 0; k < 20; k++) { /* no modelled time: the lane races the compute, which must wait */
    memset(u.f_done, 0, sizeof u.f_done);
    ZB_ASSERT_OK(zb_runner_run(run));
  }
  assert_int_equal(u.copies, 80);
  zb_runner_destroy(run);
  rig_close(&g);
}

/* A caller compiled before copy_cb existed cannot run copies: refused at creation, with the reason. */
static void test_old_callers_are_refused(void **state) {
  (void)state;
  rig_t g = rig_open();
  zb_schedule_t *s = g.s;
  zb_backend_t *be = g.be;
  zb_wstore_t *ws = g.ws;
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.struct_size = (uint32_t)offsetof(zb_runner_config_t, copy_cb);
  rc.rank = 0, rc.schedule = s, rc.backend = be, rc.wstore = ws;
  rc.forward_cb = lane_fwd, rc.backward_cb = lane_bwd;
  zb_runner_t *run = NULL;
  ASSERT_STATUS(zb_runner_create(&run, &rc), ZB_ERR_UNSUPPORTED);
  ASSERT_CONTAINS(zb_last_error(), "position 1: the schedule has OFFLOAD ops");
  ASSERT_CONTAINS(zb_last_error(), "predates copy_cb");
  assert_null(run);
  rc.struct_size = sizeof rc;
  rc.copy_time_scale = -1;
  ASSERT_STATUS(zb_runner_create(&run, &rc), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "copy_time_scale is -1");
  rig_close(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_offload_trains_bitwise_at_the_planned_memory),
      cmocka_unit_test(test_the_lane_keeps_the_model_rules),
      cmocka_unit_test(test_a_failing_copy_is_named),
      cmocka_unit_test(test_old_callers_are_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
