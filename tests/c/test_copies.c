/*
 * test_copies.c - PipeOffload's copies in the schedule model: OFFLOAD and RELOAD ops on a rank's
 * copy lane, checked by the validator, timed by the simulator, counted in device and host memory,
 * written by every export and read back from CSV (test_runner_copies.c runs them). Expected times
 * and memory are worked out by hand in the comments from the rules in zbpp.h.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

#define F(s, i) {ZB_OP_F, s, i}
#define X(s, i) {ZB_OP_BW, s, i}
#define O(s, i) {ZB_OP_OFFLOAD, s, i}
#define R(s, i) {ZB_OP_RELOAD, s, i}

static void assert_near(double got, double want) {
  if (fabs(got - want) > 1e-12) fail_msg("got %.15g, want %.15g", got, want);
}

/* One rank, one stage, three microbatches, T_F = 2, T_BW = 3, copies 1 each way. */
static zb_schedule_t *one_rank(const zb_op_t *ops, int32_t n, double mem_limit) {
  const zb_op_t *lists[] = {ops};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 3, 1);
  spec.time_f = 2, spec.time_b = 1, spec.time_w = 1, spec.time_bw = 3;
  spec.time_offload = 1, spec.time_reload = 1, spec.mem_limit = mem_limit;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, &n));
  return s;
}

/* F0 O0 F1 O1 F2 X2 R1 X1 R0 X0, by the rules (a copy starts at the latest of the start of the
 * compute op before it in the list, the lane's previous copy's end and its dependency):
 *   compute: F0 [0,2]  F1 [2,4]  F2 [4,6]  X2 [6,9]  X1 [9,12]  X0 [12,15]
 *   copies:  O0 [2,3] (after F0)  O1 [4,5] (after F1)  R1 [6,7] (issued at X2's start)
 *            R0 [9,10] (issued at X1's start)
 * Device memory: +1 at 0 and 2 (2), -1 at 3 (1), +1 at 4 (2), -1 at 5 (1), +1 at 6 (2), at 9 X2
 * frees before R0 takes (1, 2), -1 at 12 and 15: peak 2, where the same order without copies
 * holds all three microbatches (3). Host: +1 at 2, +1 at 4 (2), -1 at 7 and 10: peak 2. The
 * copies run beside the compute: span 15, busy 15, no bubble. */
static const zb_op_t offloaded[] = {F(0, 0), O(0, 0), F(0, 1), O(0, 1), F(0, 2),
                                    X(0, 2), R(0, 1), X(0, 1), R(0, 0), X(0, 0)};

static void test_copy_lane_by_hand(void **state) {
  (void)state;
  zb_schedule_t *s = one_rank(offloaded, 10, 0);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  const double want_start[] = {0, 2, 2, 4, 4, 6, 6, 9, 9, 12}, want_end[] = {2, 3, 4, 5, 6, 9, 7, 12, 10, 15};
  const double *st, *en;
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 0, &st, &en));
  for (int k = 0; k < 10; k++) assert_near(st[k], want_start[k]), assert_near(en[k], want_end[k]);
  double dev, host, span, busy, peak;
  ZB_ASSERT_OK(zb_schedule_rank_memory(s, 0, &dev, &host));
  assert_near(dev, 2), assert_near(host, 2);
  ZB_ASSERT_OK(zb_schedule_rank_stats(s, 0, &span, &busy, &peak));
  assert_near(span, 15), assert_near(busy, 15), assert_near(peak, 2);
  assert_near(r.cost, 15), assert_near(r.bubble_rate, 0), assert_near(r.max_peak_memory, 2);
  double t;
  ZB_ASSERT_OK(zb_schedule_op_time(s, ZB_OP_RELOAD, 0, &t));
  assert_near(t, 1);
  zb_schedule_destroy(s);

  /* The same compute order without the copies keeps every microbatch resident. */
  const zb_op_t plain[] = {F(0, 0), F(0, 1), F(0, 2), X(0, 2), X(0, 1), X(0, 0)};
  s = one_rank(plain, 6, 0);
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  ZB_ASSERT_OK(zb_schedule_rank_memory(s, 0, &dev, &host));
  assert_near(dev, 3), assert_near(host, 0), assert_near(r.cost, 15);
  zb_schedule_destroy(s);
}

/* A reload issued late holds its backward back. F0 O0 F1 F2 X2 X1 R0 X0 with T_RELOAD 5: R0 is
 * issued at the start of X1, the compute op before it (9), and runs [9,14]; X0 waits for it,
 * [14,17] instead of [12,15]: span 17, busy 15, bubble 2/17. */
static void test_a_late_reload_delays_its_backward(void **state) {
  (void)state;
  const zb_op_t ops[] = {F(0, 0), O(0, 0), F(0, 1), F(0, 2), X(0, 2), X(0, 1), R(0, 0), X(0, 0)};
  const zb_op_t *lists[] = {ops};
  int32_t n = 8;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 3, 1);
  spec.time_f = 2, spec.time_bw = 3, spec.time_offload = 1, spec.time_reload = 5;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, &n));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  const double *st, *en;
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 0, &st, &en));
  assert_near(st[6], 9), assert_near(en[6], 14), assert_near(st[7], 14), assert_near(en[7], 17);
  assert_near(r.cost, 17), assert_near(r.bubble_rate, 2.0 / 17.0);
  zb_schedule_destroy(s);
}

/* The limit bounds device-resident memory: 2 passes with the copies and fails without them. */
static void test_memory_limit_counts_the_device(void **state) {
  (void)state;
  zb_schedule_t *s = one_rank(offloaded, 10, 2);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_schedule_destroy(s);
  const zb_op_t plain[] = {F(0, 0), F(0, 1), F(0, 2), X(0, 2), X(0, 1), X(0, 0)};
  s = one_rank(plain, 6, 2);
  ASSERT_STATUS(zb_schedule_validate(s), ZB_ERR_INVALID_SCHEDULE);
  ASSERT_CONTAINS(zb_last_error(), "above the limit 2");
  zb_schedule_destroy(s);
}

/* Every copy rule, each with a message naming the rank, the position and the rule. */
static void test_copy_rules(void **state) {
  (void)state;
  const struct {
    zb_op_t ops[8];
    int32_t n;
    const char *want;
  } cases[] = {
      {{O(0, 0), F(0, 0), F(0, 1), F(0, 2), X(0, 0), X(0, 1), X(0, 2)}, 7, "position 0: OFFLOAD of stage 0 mb 0 comes before its F"},
      {{F(0, 0), R(0, 0), F(0, 1), F(0, 2), X(0, 0), X(0, 1), X(0, 2)}, 7, "RELOAD of stage 0 mb 0 with no OFFLOAD"},
      {{F(0, 0), O(0, 0), F(0, 1), F(0, 2), X(0, 0), R(0, 0), X(0, 1), X(0, 2)}, 8, "reads the activations offloaded at position 1"},
      {{F(0, 0), O(0, 0), F(0, 1), F(0, 2), X(0, 1), X(0, 2), O(0, 1)}, 7, "comes after its backward"},
      {{F(0, 0), O(0, 0), O(0, 0), F(0, 1), F(0, 2), X(0, 1), X(0, 2)}, 7, "a second OFFLOAD for stage 0 mb 0"},
      {{F(0, 0), O(0, 0), F(0, 1), F(0, 2), X(0, 1), X(0, 2)}, 6, "has no B or BW"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    zb_schedule_t *s = one_rank(cases[c].ops, cases[c].n, 0);
    ASSERT_STATUS(zb_schedule_validate(s), ZB_ERR_INVALID_SCHEDULE);
    ASSERT_CONTAINS(zb_last_error(), cases[c].want);
    ASSERT_CONTAINS(zb_last_error(), "rank 0");
    zb_schedule_destroy(s);
  }
}

/* Every export shows the copies, and the CSV reads back to the same ops and times. */
static void test_exports_show_the_copy_lane(void **state) {
  (void)state;
  zb_schedule_t *s = one_rank(offloaded, 10, 0);
  char *text = NULL;
  size_t len = 0;
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_TEXT, &text, &len));
  ASSERT_CONTAINS(text, " copy |");
  ASSERT_CONTAINS(text, "O0");
  ASSERT_CONTAINS(text, "host 2");
  zb_free(text);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_JSON, &text, &len));
  ASSERT_CONTAINS(text, "\"op\": \"OFFLOAD\", \"stage\": 0, \"mb\": 0, \"start\": 2, \"end\": 3");
  ASSERT_CONTAINS(text, "\"host_peak_memory\": [2]");
  zb_free(text);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_CHROME, &text, &len));
  ASSERT_CONTAINS(text, "\"name\": \"rank 0 copy\"");
  ASSERT_CONTAINS(text, "\"name\": \"RELOAD1\", \"cat\": \"RELOAD\", \"ph\": \"X\", \"ts\": 6000, \"dur\": 1000, "
                        "\"pid\": 0, \"tid\": 1");
  zb_free(text);
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_SVG, &text, &len));
  ASSERT_CONTAINS(text, "<rect class=\"copy\"");
  ASSERT_CONTAINS(text, "offload to host");
  zb_free(text);

  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_CSV, &text, &len));
  ASSERT_CONTAINS(text, "0F0,0OFFLOAD0,0F1,0OFFLOAD1,0F2,0B2,0RELOAD1,0B1,0RELOAD0,0B0");
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 3, 1);
  spec.time_f = 2, spec.time_bw = 3, spec.time_offload = 1, spec.time_reload = 1;
  zb_schedule_t *back = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&back, ZB_FORMAT_CSV, text, len, &spec));
  zb_free(text);
  const zb_op_t *a, *b;
  int32_t na, nb;
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 0, &a, &na));
  ZB_ASSERT_OK(zb_schedule_rank_ops(back, 0, &b, &nb));
  assert_int_equal(na, nb);
  assert_memory_equal(a, b, sizeof(zb_op_t) * (size_t)na);
  zb_sim_result_t r1, r2;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r1));
  ZB_ASSERT_OK(zb_schedule_simulate(back, &r2));
  assert_near(r2.cost, r1.cost), assert_near(r2.max_peak_memory, 2);
  zb_schedule_destroy(back);
  zb_schedule_destroy(s);
}


/* End to end: the first op's start to the last op's end over all ranks. */
static double makespan(zb_schedule_t *s) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  ZB_ASSERT_OK(zb_schedule_simulate(s, NULL));
  double lo = INFINITY, hi = -INFINITY;
  for (int r = 0; r < info.ranks; r++) {
    const zb_op_t *ops;
    int32_t n;
    const double *st, *en;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &ops, &n));
    ZB_ASSERT_OK(zb_schedule_rank_times(s, r, &st, &en));
    for (int k = 0; k < n; k++) lo = fmin(lo, st[k]), hi = fmax(hi, en[k]);
  }
  return hi - lo;
}

static int count_copies(const zb_schedule_t *s, int p) {
  int copies = 0;
  for (int r = 0; r < p; r++) {
    const zb_op_t *ops;
    int32_t n;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &ops, &n));
    for (int k = 0; k < n; k++) copies += ops[k].type == ZB_OP_OFFLOAD || ops[k].type == ZB_OP_RELOAD;
  }
  return copies;
}

/* The compute ops of `a` and `b` are the same, in the same order, on every rank. */
static void assert_same_compute(const zb_schedule_t *a, const zb_schedule_t *b, int p) {
  for (int r = 0; r < p; r++) {
    const zb_op_t *x, *y;
    int32_t nx, ny, i = 0, j = 0;
    ZB_ASSERT_OK(zb_schedule_rank_ops(a, r, &x, &nx));
    ZB_ASSERT_OK(zb_schedule_rank_ops(b, r, &y, &ny));
    for (;; i++, j++) {
      while (i < nx && (x[i].type == ZB_OP_OFFLOAD || x[i].type == ZB_OP_RELOAD)) i++;
      while (j < ny && (y[j].type == ZB_OP_OFFLOAD || y[j].type == ZB_OP_RELOAD)) j++;
      if (i == nx || j == ny) break;
      if (memcmp(&x[i], &y[j], sizeof x[i]) != 0) fail_msg("rank %d: compute op %d differs", r, i);
    }
    assert_int_equal(nx - i, 0), assert_int_equal(ny - j, 0);
  }
}

static zb_schedule_t *generated(zb_kind_t kind, int p, int m, double copy) {
  zb_schedule_spec_t spec = zb_test_spec(kind, p, m, 0);
  spec.time_f = spec.time_b = spec.time_w = 1;
  spec.time_offload = spec.time_reload = copy;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  return s;
}

/* 1F1B, p = 4, m = 8, F = B = W = 1, copies of 1/4: rank 0 holds 4 microbatches without copies;
 * the pass moves the long-lived ones out and the step is as long as before. */
static void test_offload_pass_keeps_the_step(void **state) {
  (void)state;
  zb_schedule_t *base = generated(ZB_KIND_1F1B, 4, 8, 0.25), *off = NULL;
  ZB_ASSERT_OK(zb_schedule_plan_offload(&off, base, NULL));
  ZB_ASSERT_OK(zb_schedule_validate(off));
  assert_same_compute(base, off, 4);
  double t0 = makespan(base), t1 = makespan(off), dev0, dev1, host;
  if (t1 > t0 + 1e-9) fail_msg("the step grew from %g to %g", t0, t1);
  ZB_ASSERT_OK(zb_schedule_rank_memory(base, 0, &dev0, &host));
  ZB_ASSERT_OK(zb_schedule_rank_memory(off, 0, &dev1, &host));
  assert_near(dev0, 4);
  if (!(dev1 < dev0 - 0.5)) fail_msg("rank 0's device peak %g did not fall below %g", dev1, dev0);
  assert_true(host > 0);
  int all = count_copies(off, 4);
  assert_true(all > 0);

  /* A device limit stops the pass once met: no more copies than offloading all it can. */
  zb_offload_config_t cfg = ZB_OFFLOAD_CONFIG_INIT;
  cfg.device_limit = 3;
  zb_schedule_t *lim = NULL;
  ZB_ASSERT_OK(zb_schedule_plan_offload(&lim, base, &cfg));
  ZB_ASSERT_OK(zb_schedule_validate(lim));
  for (int r = 0; r < 4; r++) {
    ZB_ASSERT_OK(zb_schedule_rank_memory(lim, r, &dev1, &host));
    if (dev1 > 3 + 1e-9) fail_msg("rank %d holds %g, above the limit 3", r, dev1);
  }
  assert_true(count_copies(lim, 4) > 0 && count_copies(lim, 4) < all);
  zb_schedule_destroy(lim);
  zb_schedule_destroy(off);

  /* Copies of 2 (F + B) each way: rank 0 still could move some activations, but none of them
   * lowers a peak (the long-lived ones would come back too early), so none is kept (rule 5). */
  zb_schedule_t *even = generated(ZB_KIND_1F1B, 4, 8, 2), *none = NULL;
  ZB_ASSERT_OK(zb_schedule_plan_offload(&none, even, NULL));
  assert_int_equal(count_copies(none, 4), 0);
  zb_schedule_destroy(none);
  zb_schedule_destroy(even);

  /* Copies slower than any lifespan: nothing is offloaded, and that is no error. */
  zb_schedule_t *slow = generated(ZB_KIND_1F1B, 4, 8, 50);
  ZB_ASSERT_OK(zb_schedule_plan_offload(&off, slow, NULL));
  assert_int_equal(count_copies(off, 4), 0);
  assert_same_compute(slow, off, 4);
  zb_schedule_destroy(off);
  zb_schedule_destroy(slow);

  /* A schedule with copies already, and bad configs, are refused with the reason. */
  zb_schedule_t *again = NULL;
  ZB_ASSERT_OK(zb_schedule_plan_offload(&off, base, NULL));
  ASSERT_STATUS(zb_schedule_plan_offload(&again, off, NULL), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "has copies already");
  cfg.slowdown = -1;
  ASSERT_STATUS(zb_schedule_plan_offload(&again, base, &cfg), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "slowdown");
  assert_null(again);
  zb_schedule_destroy(off);
  zb_schedule_destroy(base);
}

/* Every kind: the pass validates, keeps the compute order and never lengthens the step. */
static void test_offload_pass_on_every_kind(void **state) {
  (void)state;
  const zb_kind_t kinds[] = {ZB_KIND_GPIPE, ZB_KIND_1F1B, ZB_KIND_INTERLEAVED_1F1B, ZB_KIND_ZB_H1, ZB_KIND_ZB_H2,
                             ZB_KIND_ZB_V, ZB_KIND_V_HALF, ZB_KIND_V_MIN, ZB_KIND_ZB_AUTO};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
    for (int p = 2; p <= 4; p += 2)
      for (int mult = 2; mult <= 4; mult += 2) {
      zb_schedule_t *base = generated(kinds[k], p, mult * p, mult == 2 ? 0.25 : 0.2), *off = NULL;
      ZB_ASSERT_OK(zb_schedule_plan_offload(&off, base, NULL));
      ZB_ASSERT_OK(zb_schedule_validate(off));
      assert_same_compute(base, off, p);
      double t0 = makespan(base), t1 = makespan(off);
      if (t1 > t0 + 1e-9) fail_msg("%s p=%d: the step grew from %g to %g", zb_kind_name(kinds[k]), p, t0, t1);
      zb_sim_result_t a, b;
      ZB_ASSERT_OK(zb_schedule_simulate(base, &a));
      ZB_ASSERT_OK(zb_schedule_simulate(off, &b));
      if (b.cost > a.cost + 1e-9) /* the largest rank span (the bubble's) may not grow either */
        fail_msg("%s p=%d: the cost grew from %g to %g", zb_kind_name(kinds[k]), p, a.cost, b.cost);
      if (b.max_peak_memory > a.max_peak_memory + 1e-9)
        fail_msg("%s p=%d: the device peak grew from %g to %g", zb_kind_name(kinds[k]), p, a.max_peak_memory,
                 b.max_peak_memory);
      zb_schedule_destroy(off);
      zb_schedule_destroy(base);
    }
}

/* The largest device peak over the ranks of a simulated schedule. */
static double max_peak(zb_schedule_t *s, int p) {
  double most = 0, dev, host;
  for (int r = 0; r < p; r++) {
    ZB_ASSERT_OK(zb_schedule_rank_memory(s, r, &dev, &host));
    if (dev > most) most = dev;
  }
  return most;
}

/* A slowdown is what the step may pay for a lower peak (rule 7): with one allowed, the pass gives
 * either the no-slowdown plan's step or a lower largest peak, never a longer step for the same
 * memory. Interleaved 1F1B at p = 4, m = 8 with copies as long as an F is the case that did: 56
 * copies hide at no cost and reach the peak of 1, where the pass under a 2% allowance kept 55 and a
 * 1.8% longer step for the same peak. */
static void test_slowdown_buys_memory_or_nothing(void **state) {
  (void)state;
  const zb_kind_t kinds[] = {ZB_KIND_1F1B, ZB_KIND_INTERLEAVED_1F1B, ZB_KIND_ZB_H1, ZB_KIND_ZB_V, ZB_KIND_V_HALF};
  const double copies[] = {0.5, 1, 2};
  zb_offload_config_t flat = ZB_OFFLOAD_CONFIG_INIT, slow = ZB_OFFLOAD_CONFIG_INIT;
  slow.slowdown = 0.02;
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
    for (size_t c = 0; c < sizeof copies / sizeof copies[0]; c++) {
      zb_schedule_t *base = generated(kinds[k], 4, 8, copies[c]), *a = NULL, *b = NULL;
      ZB_ASSERT_OK(zb_schedule_plan_offload(&a, base, &flat));
      ZB_ASSERT_OK(zb_schedule_plan_offload(&b, base, &slow));
      ZB_ASSERT_OK(zb_schedule_validate(b));
      double ta = makespan(a), tb = makespan(b), pa = max_peak(a, 4), pb = max_peak(b, 4);
      if (tb > ta + 1e-9 && !(pb < pa - 1e-9))
        fail_msg("%s, copies %g: the 2%% allowance made the step %g instead of %g for a peak of %g (not below %g)",
                 zb_kind_name(kinds[k]), copies[c], tb, ta, pb, pa);
      if (pb > pa + 1e-9) fail_msg("%s, copies %g: the peak %g is above the no-slowdown plan's %g",
                                   zb_kind_name(kinds[k]), copies[c], pb, pa);
      if (tb > makespan(base) * 1.02 + 1e-9) fail_msg("%s: the step grew more than 2%%", zb_kind_name(kinds[k]));
      if (kinds[k] == ZB_KIND_INTERLEAVED_1F1B && copies[c] == 1) {
        assert_near(pb, 1);
        assert_near(tb, makespan(base));
      }
      zb_schedule_destroy(a);
      zb_schedule_destroy(b);
      zb_schedule_destroy(base);
    }
}

/* v-min under a device limit of its own peak: the V orders that hold more (v-half's, ZB-V's),
 * taken down to the limit by copies, step shorter where the copies hide; the result fits the limit
 * on every rank and is never longer than v-min's own order with copies. */
static void test_v_min_under_a_limit_takes_a_faster_order(void **state) {
  (void)state;
  const int cases[][2] = {{4, 8}, {4, 16}, {6, 24}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    int p = cases[k][0], m = cases[k][1];
    zb_schedule_t *own = generated(ZB_KIND_V_MIN, p, m, 0.25), *half = generated(ZB_KIND_V_HALF, p, m, 0.25);
    ZB_ASSERT_OK(zb_schedule_simulate(own, NULL));
    double limit = max_peak(own, p);
    zb_offload_config_t cfg = ZB_OFFLOAD_CONFIG_INIT;
    cfg.device_limit = limit;
    zb_schedule_t *plain_off = NULL, *joint = NULL;
    ZB_ASSERT_OK(zb_schedule_plan_offload(&plain_off, own, &cfg));
    zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_V_MIN, p, m, 0);
    spec.time_f = spec.time_b = spec.time_w = 1;
    spec.time_offload = spec.time_reload = 0.25;
    ZB_ASSERT_OK(zb_schedule_create_offloaded(&joint, &spec, &cfg));
    ZB_ASSERT_OK(zb_schedule_validate(joint));
    double peak = max_peak(joint, p), t_joint = makespan(joint), t_own = makespan(plain_off);
    if (peak > limit + 1e-9) fail_msg("p=%d m=%d: the plan holds %g, above v-min's %g", p, m, peak, limit);
    if (!(t_joint < t_own - 1e-9))
      fail_msg("p=%d m=%d: %g is not shorter than v-min's own order with copies (%g)", p, m, t_joint, t_own);
    if (t_joint > makespan(half) + 1e-9) fail_msg("p=%d m=%d: %g, longer than v-half's %g", p, m, t_joint, makespan(half));
    assert_true(count_copies(joint, p) > 0);
    zb_schedule_destroy(joint);
    zb_schedule_destroy(plain_off);
    zb_schedule_destroy(half);
    zb_schedule_destroy(own);
  }
}

/* A caller built with the version 1 header (before the copy times) still gets its schedules: the
 * library reads the part it has and takes no copy times. Other sizes are refused. */
static void test_version_1_callers_still_work(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 0);
  spec.struct_size = (uint32_t)offsetof(zb_schedule_spec_t, time_offload), spec.version = 1;
  spec.time_offload = 99; /* past a version 1 caller's struct: must not be read */
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  double t;
  ZB_ASSERT_OK(zb_schedule_op_time(s, ZB_OP_OFFLOAD, 0, &t));
  assert_near(t, 0);
  zb_schedule_destroy(s);
  spec.struct_size += 8;
  ASSERT_STATUS(zb_schedule_create(&s, &spec), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "struct_size");
}

static double max_device_peak(const zb_schedule_t *s, int p) {
  double worst = 0;
  for (int r = 0; r < p; r++) {
    double d, h;
    ZB_ASSERT_OK(zb_schedule_rank_memory(s, r, &d, &h));
    if (d > worst) worst = d;
  }
  return worst;
}


/* zb-auto with offload plans order and copies together: at p = 8, m = 16, equal costs and copies
 * half a forward each way, zb-auto held to 3 microbatches steps 107; the order zb-auto plans for
 * more memory, taken down to 3 by copies, steps 77, and no rank holds more than 3. A fixed order
 * gets the offload pass's copies, the same as zb_schedule_plan_offload's; a limit no order fits is
 * ZB_ERR_INFEASIBLE with the limit named. */
static void test_zb_auto_plans_order_and_offload_together(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_AUTO, 8, 16, 1);
  spec.time_offload = spec.time_reload = 0.5;
  spec.mem_limit = 3;
  zb_schedule_t *plain = NULL, *joint = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&plain, &spec));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(plain, &r));
  zb_offload_config_t oc = ZB_OFFLOAD_CONFIG_INIT;
  oc.slowdown = 0.02;
  ZB_ASSERT_OK(zb_schedule_create_offloaded(&joint, &spec, &oc));
  ZB_ASSERT_OK(zb_schedule_validate(joint));
  const double step0 = makespan(plain), step1 = makespan(joint);
  if (!(step1 < 0.9 * step0)) fail_msg("zb-auto with offload steps %g, without %g: not shorter", step1, step0);
  if (max_device_peak(joint, 8) > 3 + 1e-9) fail_msg("a rank holds %g > 3", max_device_peak(joint, 8));
  zb_schedule_destroy(plain), zb_schedule_destroy(joint);

  /* A fixed order: the pass's copies on the kind's own order. */
  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  spec.time_offload = spec.time_reload = 0.25;
  zb_schedule_t *via = NULL, *direct = NULL;
  ZB_ASSERT_OK(zb_schedule_create_offloaded(&via, &spec, NULL));
  ZB_ASSERT_OK(zb_schedule_create(&plain, &spec));
  ZB_ASSERT_OK(zb_schedule_plan_offload(&direct, plain, NULL));
  for (int q = 0; q < 4; q++) {
    const zb_op_t *a, *b;
    int32_t na, nb;
    ZB_ASSERT_OK(zb_schedule_rank_ops(via, q, &a, &na));
    ZB_ASSERT_OK(zb_schedule_rank_ops(direct, q, &b, &nb));
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, (size_t)na * sizeof *a);
  }
  zb_schedule_destroy(via), zb_schedule_destroy(direct), zb_schedule_destroy(plain);

  /* Below what any order needs. */
  spec = zb_test_spec(ZB_KIND_ZB_AUTO, 4, 8, 1);
  spec.time_offload = spec.time_reload = 0.25;
  oc.device_limit = 0.25;
  ASSERT_STATUS(zb_schedule_create_offloaded(&joint, &spec, &oc), ZB_ERR_INFEASIBLE);
  ASSERT_CONTAINS(zb_last_error(), "device limit of 0.25");
  assert_null(joint);
}

/* The copies of ranks 2k and 2k+1 in the plan: 1 when two of them run at the same time. */
static int pair_copies_overlap(const zb_schedule_t *s, int p) {
  for (int r = 0; r + 1 < p; r += 2) {
    const zb_op_t *oa, *ob;
    int32_t na, nb;
    const double *sa, *ea, *sb, *eb;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &oa, &na));
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r + 1, &ob, &nb));
    ZB_ASSERT_OK(zb_schedule_rank_times(s, r, &sa, &ea));
    ZB_ASSERT_OK(zb_schedule_rank_times(s, r + 1, &sb, &eb));
    for (int i = 0; i < na; i++)
      for (int j = 0; j < nb; j++)
        if ((oa[i].type == ZB_OP_OFFLOAD || oa[i].type == ZB_OP_RELOAD) &&
            (ob[j].type == ZB_OP_OFFLOAD || ob[j].type == ZB_OP_RELOAD) && sa[i] < eb[j] - 1e-9 && sb[j] < ea[i] - 1e-9)
          return 1;
  }
  return 0;
}

/* paired_lanes: with ranks 2k and 2k+1 on one link, the pass keeps no two of a pair's copies at
 * the same time, where their own lanes overlap them (1F1B and interleaved 1F1B, p = 4, copies a
 * quarter of F each way); the step is the same, and each rank's peak is no higher than without
 * copies. The pre-paired config size is still accepted. */
static void test_paired_lanes_take_turns(void **state) {
  (void)state;
  for (int k = 0; k < 2; k++) {
    zb_schedule_spec_t spec = zb_test_spec(k ? ZB_KIND_INTERLEAVED_1F1B : ZB_KIND_1F1B, 4, 16, k ? 2 : 1);
    spec.time_offload = spec.time_reload = 0.25;
    zb_schedule_t *base = NULL, *own = NULL, *paired = NULL;
    ZB_ASSERT_OK(zb_schedule_create(&base, &spec));
    zb_offload_config_t oc = ZB_OFFLOAD_CONFIG_INIT;
    ZB_ASSERT_OK(zb_schedule_plan_offload(&own, base, &oc));
    oc.paired_lanes = 1;
    ZB_ASSERT_OK(zb_schedule_plan_offload(&paired, base, &oc));
    ZB_ASSERT_OK(zb_schedule_validate(paired));
    assert_true(pair_copies_overlap(own, 4));     /* the case is one where it matters */
    assert_false(pair_copies_overlap(paired, 4));
    if (fabs(makespan(paired) - makespan(base)) > 1e-9) fail_msg("paired: step %g, without copies %g", makespan(paired), makespan(base));
    for (int r = 0; r < 4; r++) {
      double d0, h0, d1, h1;
      ZB_ASSERT_OK(zb_schedule_rank_memory(base, r, &d0, &h0));
      ZB_ASSERT_OK(zb_schedule_rank_memory(paired, r, &d1, &h1));
      assert_true(d1 <= d0 + 1e-9);
    }
    assert_true(max_device_peak(paired, 4) < max_device_peak(base, 4));
    zb_schedule_destroy(base), zb_schedule_destroy(own), zb_schedule_destroy(paired);
  }
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 4, 1);
  spec.time_offload = spec.time_reload = 0.25;
  zb_schedule_t *base = NULL, *off = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&base, &spec));
  zb_offload_config_t old = ZB_OFFLOAD_CONFIG_INIT;
  old.struct_size = (uint32_t)offsetof(zb_offload_config_t, paired_lanes);
  ZB_ASSERT_OK(zb_schedule_plan_offload(&off, base, &old));
  zb_schedule_destroy(base), zb_schedule_destroy(off);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_copy_lane_by_hand),
      cmocka_unit_test(test_a_late_reload_delays_its_backward),
      cmocka_unit_test(test_memory_limit_counts_the_device),
      cmocka_unit_test(test_copy_rules),
      cmocka_unit_test(test_exports_show_the_copy_lane),
      cmocka_unit_test(test_offload_pass_keeps_the_step),
      cmocka_unit_test(test_offload_pass_on_every_kind),
      cmocka_unit_test(test_slowdown_buys_memory_or_nothing),
      cmocka_unit_test(test_v_min_under_a_limit_takes_a_faster_order),
      cmocka_unit_test(test_version_1_callers_still_work),
      cmocka_unit_test(test_zb_auto_plans_order_and_offload_together),
      cmocka_unit_test(test_paired_lanes_take_turns),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
