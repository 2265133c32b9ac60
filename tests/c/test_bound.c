/*
 * test_bound.c - zb_schedule_cost_bound: never above the shortest schedule (found here by trying
 * every op order of small pipelines: 2 and 3 ranks, 2 microbatches), met where the optimum is known (ZB-H1 on equal costs), and
 * never above what any generator produces on random costs.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "helpers.h"

static double bound_of(const zb_schedule_t *s) {
  double b = -1;
  ZB_ASSERT_OK(zb_schedule_cost_bound(s, &b));
  return b;
}

/* A uniform value in [lo, hi) from the seeded generator. */
static double pick(uint64_t seed, int k, double lo, double hi) {
  return lo + (hi - lo) * (urand(seed, (uint64_t)k, 7, 11) + 1.0) / 2.0;
}

/* Every order of one rank's six ops (F, B, W of microbatches 0 and 1) with F before B before W per
 * microbatch: the 20 orders any valid schedule of p = 2, m = 2 draws from on each rank. Op k is of
 * type k / 2 (F, B, W) and microbatch k % 2; orders are built position by position. */
static void orders_from(int depth, int used, int *seq, int stage, zb_op_t out[][6], int *n) {
  if (depth == 6) {
    for (int k = 0; k < 6; k++)
      out[*n][k] = (zb_op_t){seq[k] / 2 == 0 ? ZB_OP_F : seq[k] / 2 == 1 ? ZB_OP_B : ZB_OP_W, stage, seq[k] % 2};
    (*n)++;
    return;
  }
  for (int op = 0; op < 6; op++) {
    if (used & (1 << op)) continue;
    if (op >= 2 && !(used & (1 << (op - 2)))) continue; /* B after its F, W after its B */
    seq[depth] = op;
    orders_from(depth + 1, used | (1 << op), seq, stage, out, n);
  }
}

static int rank_orders(int stage, zb_op_t out[][6]) {
  int n = 0, seq[6];
  orders_from(0, 0, seq, stage, out, &n);
  return n;
}

/* The shortest valid schedule of p ranks (2 or 3), m = 2 under the spec, by trying every
 * combination of the ranks' 20 orders. */
static double brute_force_optimum(const zb_schedule_spec_t *spec, int p, double *bound) {
  static zb_op_t orders[3][20][6];
  for (int r = 0; r < p; r++) assert_int_equal(rank_orders(r, orders[r]), 20);
  int total = 1;
  for (int r = 0; r < p; r++) total *= 20;
  double best = INFINITY;
  *bound = NAN;
  for (int code = 0; code < total; code++) {
    const zb_op_t *ops[3];
    int32_t counts[3];
    for (int r = 0, c = code; r < p; r++, c /= 20) ops[r] = orders[r][c % 20], counts[r] = 6;
    zb_schedule_t *s = NULL;
    ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, spec, ZB_PLACEMENT_LOOP, ops, counts));
    if (isnan(*bound)) *bound = bound_of(s);
    zb_sim_result_t r;
    if (zb_schedule_validate(s) == ZB_OK && zb_schedule_simulate(s, &r) == ZB_OK && r.cost < best) best = r.cost;
    zb_schedule_destroy(s);
  }
  return best;
}

/* One small case: bound <= brute-force optimum; returns whether they are equal. Seed 0 is equal
 * costs and no comm, where at limit p the optimum is ZB-H1's order and the bound must meet it. */
static int check_small_case(int p, int seed, double limit) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, p, 2, 1);
  if (seed > 0) {
    spec.time_f = pick(seed, 0, 0.5, 2), spec.time_b = pick(seed, 1, 0.5, 2);
    spec.time_w = pick(seed, 2, 0.5, 2), spec.time_comm = pick(seed, 3, 0, 0.3);
  }
  spec.mem_limit = limit;
  double bound, opt = brute_force_optimum(&spec, p, &bound);
  if (!(opt < INFINITY)) fail_msg("p=%d seed %d limit %g: no valid schedule found", p, seed, limit);
  if (bound > opt + 1e-9)
    fail_msg("p=%d seed %d limit %g: bound %.9g above the optimum %.9g (F %g B %g W %g c %g)", p, seed, limit,
             bound, opt, spec.time_f, spec.time_b, spec.time_w, spec.time_comm);
  if (seed == 0 && limit == p && fabs(bound - opt) > 1e-9)
    fail_msg("p=%d equal costs at limit p: bound %.9g, optimum %.9g", p, bound, opt);
  return fabs(bound - opt) <= 1e-9;
}

/* The bound is a bound: never above the true optimum of a small pipeline, on random costs, comm and
 * memory limits (1 to 4 microbatches, so memory binds in some). */
static void test_bound_never_above_the_optimum(void **state) {
  (void)state;
  int seeds = getenv("ZBPP_TEST_QUICK") ? 4 : 16, met = 0, cases = 0;
  const double limits[] = {1.0, 2.0, 3.0, 4.0};
  for (int p = 2; p <= 3; p++) {
    for (int seed = 0; seed < (p == 2 ? 4 * seeds : seeds); seed++) {
      for (int li = 0; li < 4; li++, cases++) met += check_small_case(p, seed, limits[li]);
    }
  }
  printf("bound met the brute-force optimum in %d of %d small cases\n", met, cases);
}

/* Worked by hand: p = 4, m = 8, F = B = W = 1, no comm, limit p. Rank 0 does 24 units of work; its
 * first backward waits F + 3 (F + B) = 7 after its first op, in which at most 4 forwards (memory)
 * run: 3 idle. Bound 27, which ZB-H1 meets (its bubble is (p-1)(F + B - W) = 3). */
static void test_bound_by_hand_and_met_by_zb_h1(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_H1, 4, 8, 1);
  spec.mem_limit = 4;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  double b = bound_of(s);
  if (fabs(b - 27.0) > 1e-12) fail_msg("bound %.15g, want 27", b);
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  if (fabs(r.cost - b) > 1e-9) fail_msg("ZB-H1 cost %.15g, bound %.15g", r.cost, b);
  zb_schedule_destroy(s);

  /* 1F1B on the same costs is (p-1)(F+B+W) = 9 longer than the work: above the bound. */
  spec.kind = ZB_KIND_1F1B;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  if (!(r.cost > bound_of(s) + 1)) fail_msg("1F1B cost %.15g not above the bound %.15g", r.cost, bound_of(s));
  zb_schedule_destroy(s);
}

/* No generator goes below it, on random per-stage costs, comm and limits, loop and V alike. */
static void test_no_generator_below_the_bound(void **state) {
  (void)state;
  const zb_kind_t kinds[] = {ZB_KIND_1F1B, ZB_KIND_ZB_H1, ZB_KIND_ZB_H2, ZB_KIND_ZB_AUTO,
                             ZB_KIND_ZB_V, ZB_KIND_V_HALF, ZB_KIND_V_MIN};
  int n = getenv("ZBPP_TEST_QUICK") ? 6 : 24;
  for (int seed = 1; seed <= n; seed++) {
    int p = 2 + (int)pick(seed, 10, 0, 6), m = p * (1 + (int)pick(seed, 11, 0, 4));
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
      zb_schedule_spec_t spec = zb_test_spec(kinds[k], p, m, 0);
      int v_kind = kinds[k] == ZB_KIND_ZB_V || kinds[k] == ZB_KIND_V_HALF || kinds[k] == ZB_KIND_V_MIN;
      int S = v_kind ? 2 * p : p;
      double tf[32], tb[32], tw[32];
      for (int st = 0; st < S; st++) {
        tf[st] = pick(seed, 100 + st, 0.5, 2), tb[st] = pick(seed, 200 + st, 0.5, 2);
        tw[st] = pick(seed, 300 + st, 0.2, 2);
      }
      spec.stage_time_f = tf, spec.stage_time_b = tb, spec.stage_time_w = tw;
      spec.time_comm = pick(seed, 12, 0, 0.3);
      if (kinds[k] == ZB_KIND_ZB_AUTO) spec.mem_limit = seed % 2 ? p : 2 * p;
      zb_schedule_t *s = NULL;
      if (zb_schedule_create(&s, &spec) != ZB_OK) continue; /* a kind that needs other shapes */
      zb_sim_result_t r;
      ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
      double b = bound_of(s);
      if (b > r.cost + 1e-9)
        fail_msg("%s p=%d m=%d seed %d: bound %.9g above the schedule's cost %.9g", zb_kind_name(kinds[k]), p,
                 m, seed, b, r.cost);
      if (!(b > 0)) fail_msg("bound %.9g not positive", b);
      zb_schedule_destroy(s);
    }
  }
}

static void test_bound_arguments(void **state) {
  (void)state;
  double b;
  ASSERT_STATUS(zb_schedule_cost_bound(NULL, &b), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "zb_schedule_cost_bound");
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 4, 1);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  ASSERT_STATUS(zb_schedule_cost_bound(s, NULL), ZB_ERR_INVALID_ARGUMENT);
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bound_never_above_the_optimum),
      cmocka_unit_test(test_bound_by_hand_and_met_by_zb_h1),
      cmocka_unit_test(test_no_generator_below_the_bound),
      cmocka_unit_test(test_bound_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
