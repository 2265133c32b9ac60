/*
 * test_simulate.c - the simulator's times, spans, cost, bubble rate and memory against values
 * worked out by hand from DESIGN.md section 3 for small schedules.
 */
#include <math.h>
#include <stdio.h>

#include "helpers.h"

#define F(s, i) {ZB_OP_F, s, i}
#define B(s, i) {ZB_OP_B, s, i}
#define W(s, i) {ZB_OP_W, s, i}
#define X(s, i) {ZB_OP_BW, s, i}

static void assert_near(double got, double want) {
  if (fabs(got - want) > 1e-12) fail_msg("got %.15g, want %.15g", got, want);
}

/* One microbatch through two ranks, fused backward, T_F=1, T_B=2, T_W=3 (BW = 5), T_comm = 0.5. */
static zb_schedule_t *two_ranks_one_microbatch(void) {
  const zb_op_t r0[] = {F(0, 0), X(0, 0)};
  const zb_op_t r1[] = {F(1, 0), X(1, 0)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {2, 2};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 1, 1);
  spec.time_f = 1, spec.time_b = 2, spec.time_w = 3, spec.time_comm = 0.5;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, ops, counts));
  return s;
}

/* That pipeline by hand:
 *   rank 0: F [0,1]            ...                BW [8,13]
 *   rank 1:        F [1.5,2.5]  BW [2.5,7.5]
 * spans 13 and 6, busy 6 each, cost 13, bubble (13-6)/13. */
static void test_two_ranks_by_hand(void **state) {
  (void)state;
  zb_schedule_t *s = two_ranks_one_microbatch();
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  const double *st, *en;
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 0, &st, &en));
  assert_near(st[0], 0), assert_near(en[0], 1), assert_near(st[1], 8), assert_near(en[1], 13);
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 1, &st, &en));
  assert_near(st[0], 1.5), assert_near(en[0], 2.5), assert_near(st[1], 2.5), assert_near(en[1], 7.5);
  double span, busy, peak;
  ZB_ASSERT_OK(zb_schedule_rank_stats(s, 1, &span, &busy, &peak));
  assert_near(span, 6), assert_near(busy, 6), assert_near(peak, 1);
  assert_near(r.cost, 13);
  assert_near(r.busy, 6);
  assert_near(r.bubble_rate, 7.0 / 13.0);
  zb_schedule_destroy(s);
}

/* A split pipeline whose last rank ends last (its W is long) and whose first rank starts first:
 *   rank 0: F [0,1]                              B [4,5] W [5,5.1]
 *   rank 1:        F [1.5,2.5] B [2.5,3.5] W [3.5,13.5]
 * (T_comm 0.5). The largest rank span (the cost) is rank 1's, 12; end to end it is 13.5. */
static void test_makespan_durations_counts_the_staggered_start(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), B(0, 0), W(0, 0)};
  const zb_op_t r1[] = {F(1, 0), B(1, 0), W(1, 0)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {3, 3};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 1, 1);
  spec.time_f = 1, spec.time_b = 1, spec.time_w = 1, spec.time_comm = 0.5;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, ops, counts));
  const double d0[] = {1, 1, 0.1}, d1[] = {1, 1, 10};
  const double *d[] = {d0, d1};
  zb_sim_result_t r;
  double makespan = 0;
  ZB_ASSERT_OK(zb_schedule_simulate_durations(s, d, &r));
  ZB_ASSERT_OK(zb_schedule_makespan_durations(s, d, &makespan));
  assert_near(r.cost, 12), assert_near(makespan, 13.5);
  const double *missing[] = {d0, NULL};
  ASSERT_STATUS(zb_schedule_makespan_durations(s, missing, &makespan), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_schedule_makespan_durations(s, d, NULL), ZB_ERR_INVALID_ARGUMENT);
  zb_schedule_destroy(s);
}

/* The same pipeline run with given op durations: the default ones reproduce the simulation, and
 * rank 1's BW taking 7 instead of 5 moves rank 0's BW to [10, 15]: cost 15, busy 8 (rank 1),
 * bubble 7/15. The handle's own simulation is left as it was. */
static void test_simulate_durations_by_hand(void **state) {
  (void)state;
  zb_schedule_t *s = two_ranks_one_microbatch();
  const double d0[] = {1, 5}, d1[] = {1, 5}, d1_slow[] = {1, 7};
  const double *same[] = {d0, d1}, *slow[] = {d0, d1_slow};
  zb_sim_result_t r, plain;
  ZB_ASSERT_OK(zb_schedule_simulate_durations(s, same, &r));
  ZB_ASSERT_OK(zb_schedule_simulate(s, &plain));
  assert_near(r.cost, plain.cost), assert_near(r.busy, plain.busy), assert_near(r.bubble_rate, plain.bubble_rate);
  ZB_ASSERT_OK(zb_schedule_simulate_durations(s, slow, &r));
  assert_near(r.cost, 15), assert_near(r.busy, 8), assert_near(r.bubble_rate, 7.0 / 15);
  assert_near(r.max_peak_memory, 1);
  const double *st, *en;
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 0, &st, &en));
  assert_near(st[1], 8); /* still the schedule's own simulation */

  const double bad[] = {1, -1};
  const double *negative[] = {d0, bad}, *missing[] = {d0, NULL};
  ASSERT_STATUS(zb_schedule_simulate_durations(s, negative, &r), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "durations[1][1]");
  ASSERT_STATUS(zb_schedule_simulate_durations(s, missing, &r), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "durations[1] is NULL");
  ASSERT_STATUS(zb_schedule_simulate_durations(s, NULL, &r), ZB_ERR_INVALID_ARGUMENT);
  zb_schedule_destroy(s);
}

/* Memory with a split backward, w = 0.25 on one rank: F +1, F +1, B -0.75, W -0.25, B, W.
 * Prefix: 1, 2, 1.25, 1, 0.25, 0 -> peak 2. */
static void test_memory_split_backward(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)};
  const zb_op_t *ops[] = {r0};
  const int32_t counts[] = {6};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 2, 1);
  spec.w_share = 0.25;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, ops, counts));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  assert_near(r.max_peak_memory, 2);
  assert_near(r.cost, 6);
  assert_near(r.bubble_rate, 0);
  zb_schedule_destroy(s);

  /* B, F, B order: F0 +1, B0 -0.75 (0.25), F1 +1 (1.25), B1 (0.5), W0 (0.25), W1 (0). */
  const zb_op_t q0[] = {F(0, 0), B(0, 0), F(0, 1), B(0, 1), W(0, 0), W(0, 1)};
  const zb_op_t *qops[] = {q0};
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, qops, counts));
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  assert_near(r.max_peak_memory, 1.25);
  zb_schedule_destroy(s);
}

/* Per-stage times: stage arrays are absolute; per-rank scalars are divided by v. A V on one rank
 * (p = 1, v = 2) with stage F times 1 and 3, B 2 and 4, W 0.5 each, run as F0 F1 B1 B0 W1 W0:
 * ends at 1, 4, 8, 10, 10.5, 11. */
static void test_stage_times(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), F(1, 0), B(1, 0), B(0, 0), W(1, 0), W(0, 0)};
  const zb_op_t *ops[] = {r0};
  const int32_t counts[] = {6};
  const double tf[] = {1, 3}, tb[] = {2, 4}, tw[] = {0.5, 0.5};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 1, 2);
  spec.stage_time_f = tf, spec.stage_time_b = tb, spec.stage_time_w = tw;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_V, ops, counts));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  const double *st, *en;
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 0, &st, &en));
  const double want[] = {1, 4, 8, 10, 10.5, 11};
  for (int k = 0; k < 6; k++) assert_near(en[k], want[k]);
  assert_near(r.cost, 11);
  /* Memory in a V: each chunk's F adds 1/2. */
  assert_near(r.max_peak_memory, 1);
  zb_schedule_destroy(s);
}

/* Bubble rate is measured against the busiest rank: with unequal stages a lighter rank's idle
 * time is not bubble. Rank 1's stage costs twice rank 0's. */
static void test_bubble_uses_busiest_rank(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), X(0, 0)};
  const zb_op_t r1[] = {F(1, 0), X(1, 0)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {2, 2};
  const double tf[] = {1, 2}, tb[] = {1, 2}, tw[] = {1, 2};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 1, 1);
  spec.stage_time_f = tf, spec.stage_time_b = tb, spec.stage_time_w = tw;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, ops, counts));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  /* rank 0: F [0,1], BW [7,9]; rank 1: F [1,3], BW [3,7]. Cost 9, busiest rank 6. */
  assert_near(r.cost, 9);
  assert_near(r.busy, 6);
  assert_near(r.bubble_rate, 3.0 / 9.0);
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_ranks_by_hand),
      cmocka_unit_test(test_simulate_durations_by_hand),
      cmocka_unit_test(test_makespan_durations_counts_the_staggered_start),
      cmocka_unit_test(test_memory_split_backward),
      cmocka_unit_test(test_stage_times),
      cmocka_unit_test(test_bubble_uses_busiest_rank),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
