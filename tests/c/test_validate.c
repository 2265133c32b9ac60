/*
 * test_validate.c - the validator names the rank, the position and the rule for every way a
 * schedule can be wrong; and it accepts the hand-written correct ones.
 *
 * Schedules here are written out by hand (p = 2, m = 2 unless said otherwise), so each test shows
 * exactly which op breaks which rule.
 */
#include <stdio.h>
#include <string.h>

#include "helpers.h"

#define F(s, i) {ZB_OP_F, s, i}
#define B(s, i) {ZB_OP_B, s, i}
#define W(s, i) {ZB_OP_W, s, i}
#define X(s, i) {ZB_OP_BW, s, i}

static zb_schedule_t *build(int p, int m, int v, zb_placement_t placement, const zb_op_t *const *ops,
                            const int32_t *counts, double mem_limit) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, p, m, v);
  spec.mem_limit = mem_limit;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, placement, ops, counts));
  return s;
}

/* Asserts validation fails and the message names everything in `needles` (NULL-terminated). */
static void expect_invalid(zb_schedule_t *s, const char *const *needles) {
  zb_status_t st = zb_schedule_validate(s);
  if (st != ZB_ERR_INVALID_SCHEDULE)
    fail_msg("expected ZB_ERR_INVALID_SCHEDULE, got %s (%s)", zb_status_string(st), zb_last_error());
  const char *msg = zb_last_error();
  for (const char *const *n = needles; *n; n++)
    if (!strstr(msg, *n)) fail_msg("message lacks \"%s\": %s", *n, msg);
  /* Simulation refuses what cannot run, too (memory is the only rule it does not enforce). */
  zb_schedule_destroy(s);
}

static void test_valid_1f1b_and_split(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), F(0, 1), X(0, 0), X(0, 1)};
  const zb_op_t r1[] = {F(1, 0), X(1, 0), F(1, 1), X(1, 1)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {4, 4};
  zb_schedule_t *s = build(2, 2, 1, ZB_PLACEMENT_LOOP, ops, counts, 0);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_schedule_destroy(s);

  const zb_op_t q0[] = {F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)};
  const zb_op_t q1[] = {F(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 0), W(1, 1)};
  const zb_op_t *qops[] = {q0, q1};
  const int32_t qc[] = {6, 6};
  s = build(2, 2, 1, ZB_PLACEMENT_LOOP, qops, qc, 0);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_schedule_destroy(s);
}

static void test_wrong_rank(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), F(1, 0), X(0, 0)};
  const zb_op_t r1[] = {X(1, 0)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {3, 1};
  const char *need[] = {"rank 0", "position 1", "belongs on rank 1", NULL};
  expect_invalid(build(2, 1, 1, ZB_PLACEMENT_LOOP, ops, counts, 0), need);
}

static void test_out_of_range(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), F(0, 5)};
  const zb_op_t *ops[] = {r0};
  const int32_t counts[] = {2};
  const char *need[] = {"rank 0", "position 1", "out of range", NULL};
  expect_invalid(build(1, 2, 1, ZB_PLACEMENT_LOOP, ops, counts, 0), need);
}

static void test_duplicate_and_missing(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), F(0, 0), X(0, 0)};
  const zb_op_t *ops[] = {r0};
  const int32_t counts[] = {3};
  const char *dup[] = {"rank 0", "position 1", "second F", "exactly one F", NULL};
  expect_invalid(build(1, 1, 1, ZB_PLACEMENT_LOOP, ops, counts, 0), dup);

  const zb_op_t m0[] = {F(0, 0), B(0, 0)};
  const zb_op_t *mops[] = {m0};
  const int32_t mc[] = {2};
  const char *missing[] = {"rank 0", "stage 0 mb 0", "no W", NULL};
  expect_invalid(build(1, 1, 1, ZB_PLACEMENT_LOOP, mops, mc, 0), missing);

  const zb_op_t b0[] = {F(0, 0), X(0, 0), W(0, 0)};
  const zb_op_t *bops[] = {b0};
  const int32_t bc[] = {3};
  const char *both[] = {"rank 0", "position 2", "fused BW", NULL};
  expect_invalid(build(1, 1, 1, ZB_PLACEMENT_LOOP, bops, bc, 0), both);
}

static void test_same_rank_order(void **state) {
  (void)state;
  const zb_op_t r0[] = {F(0, 0), W(0, 0), B(0, 0)};
  const zb_op_t *ops[] = {r0};
  const int32_t counts[] = {3};
  const char *need[] = {"rank 0", "position 1", "dependencies in order", NULL};
  expect_invalid(build(1, 1, 1, ZB_PLACEMENT_LOOP, ops, counts, 0), need);

  /* At the bend of a V both stages p-1 and p are on rank p-1: F(p) needs F(p-1) first. */
  const zb_op_t v0[] = {F(0, 0), F(3, 0), X(3, 0), X(0, 0)};
  const zb_op_t v1[] = {F(2, 0), F(1, 0), X(2, 0), X(1, 0)};
  const zb_op_t *vops[] = {v0, v1};
  const int32_t vc[] = {4, 4};
  const char *bend[] = {"rank 1", "position 0", "F stage 2", NULL};
  expect_invalid(build(2, 1, 2, ZB_PLACEMENT_V, vops, vc, 0), bend);
}

static void test_fifo(void **state) {
  (void)state;
  /* Rank 0 sends mb 0 then 1; rank 1 receives them the other way round. */
  const zb_op_t r0[] = {F(0, 0), F(0, 1), X(0, 0), X(0, 1)};
  const zb_op_t r1[] = {F(1, 1), F(1, 0), X(1, 0), X(1, 1)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {4, 4};
  const char *need[] = {"rank 1", "position 0", "FIFO", NULL};
  expect_invalid(build(2, 2, 1, ZB_PLACEMENT_LOOP, ops, counts, 0), need);
}

static void test_deadlock(void **state) {
  (void)state;
  /* FIFO holds on both channels, but rank 0 waits for BW0 from rank 1 before it sends F1, and
   * rank 1 waits for F1 before it runs BW0. */
  const zb_op_t r0[] = {F(0, 0), X(0, 0), F(0, 1), X(0, 1)};
  const zb_op_t r1[] = {F(1, 0), F(1, 1), X(1, 0), X(1, 1)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {4, 4};
  const char *need[] = {"deadlock", "rank 0 at position 1", "rank 1 at position 1", NULL};
  zb_schedule_t *s = build(2, 2, 1, ZB_PLACEMENT_LOOP, ops, counts, 0);
  zb_sim_result_t r;
  assert_int_equal(zb_schedule_simulate(s, &r), ZB_ERR_INVALID_SCHEDULE);
  expect_invalid(s, need);
}

static void test_memory_limit(void **state) {
  (void)state;
  /* GPipe-like: two forwards in flight on rank 0 -> peak 2, above a limit of 1.5. */
  const zb_op_t r0[] = {F(0, 0), F(0, 1), X(0, 0), X(0, 1)};
  const zb_op_t r1[] = {F(1, 0), X(1, 0), F(1, 1), X(1, 1)};
  const zb_op_t *ops[] = {r0, r1};
  const int32_t counts[] = {4, 4};
  zb_schedule_t *ok = build(2, 2, 1, ZB_PLACEMENT_LOOP, ops, counts, 2);
  ZB_ASSERT_OK(zb_schedule_validate(ok));
  zb_schedule_destroy(ok);
  const char *need[] = {"rank 0", "position 1", "above the limit 1.5", "memory under the limit",
                        NULL};
  expect_invalid(build(2, 2, 1, ZB_PLACEMENT_LOOP, ops, counts, 1.5), need);
}

/* Every generated kind also passes when checked against its own peak as the limit. */
static void test_generated_schedules_fit_their_peak(void **state) {
  (void)state;
  for (int k = 0; k < ZB_KIND_COUNT; k++) {
    if (k == ZB_KIND_CUSTOM) continue;
    zb_schedule_spec_t spec = zb_test_spec((zb_kind_t)k, 4, 8, 0);
    zb_schedule_t *s = NULL;
    ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
    zb_sim_result_t r;
    ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
    zb_schedule_destroy(s);
    spec.mem_limit = r.max_peak_memory;
    if (k == ZB_KIND_ZB_AUTO) spec.mem_limit = r.max_peak_memory > 1 ? r.max_peak_memory : 1;
    ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
    ZB_ASSERT_OK(zb_schedule_validate(s));
    zb_schedule_destroy(s);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_valid_1f1b_and_split),
      cmocka_unit_test(test_wrong_rank),
      cmocka_unit_test(test_out_of_range),
      cmocka_unit_test(test_duplicate_and_missing),
      cmocka_unit_test(test_same_rank_order),
      cmocka_unit_test(test_fifo),
      cmocka_unit_test(test_deadlock),
      cmocka_unit_test(test_memory_limit),
      cmocka_unit_test(test_generated_schedules_fit_their_peak),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
