/*
 * test_api.c - the public API's contract as a caller sees it: status strings and version, the
 * per-thread error message, kind and format names, argument checks on schedule creation (each
 * with the right status, a message naming the problem, and *out left NULL), the meaning of the
 * spec's times, explicit op lists, and one large zb-auto run.
 *
 * Expected values come from zbpp.h's comments and DESIGN.md section 3, never from running the
 * code under test. What this is not: a test of the generators' shapes, the validator's rules or
 * the exporters; those have their own test files.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

/* ---- assertions that print both sides --------------------------------------------------------- */

#define ASSERT_NEAR(actual, expected)                                                              \
  do {                                                                                             \
    double zb__a = (actual), zb__e = (expected);                                                   \
    if (!(fabs(zb__a - zb__e) <= 1e-12 * (1 + fabs(zb__e))))                                       \
      fail_msg("%s is %.17g, expected %.17g", #actual, zb__a, zb__e);                              \
  } while (0)

/* ---- status codes and version ----------------------------------------------------------------- */

static void test_status_strings_distinct(void **state) {
  (void)state;
  static const zb_status_t codes[] = {
#define ZB_X_CODE(name, value, text) name,
      ZB_STATUS_LIST(ZB_X_CODE)
#undef ZB_X_CODE
  };
  const size_t n = sizeof codes / sizeof codes[0];
  assert_int_equal(codes[0], ZB_OK);
  assert_int_equal(ZB_OK, 0);
  for (size_t i = 0; i < n; i++) {
    const char *s = zb_status_string(codes[i]);
    assert_non_null(s);
    if (s[0] == '\0') fail_msg("status %d has an empty string", (int)codes[i]);
    if (strcmp(s, "unknown status") == 0)
      fail_msg("status %d is in ZB_STATUS_LIST but reads \"unknown status\"", (int)codes[i]);
    for (size_t j = 0; j < i; j++) {
      if (codes[i] == codes[j]) fail_msg("statuses %zu and %zu share the value %d", i, j, (int)codes[i]);
      if (strcmp(s, zb_status_string(codes[j])) == 0)
        fail_msg("statuses %d and %d share the string \"%s\"", (int)codes[i], (int)codes[j], s);
    }
  }
  assert_string_equal(zb_status_string((zb_status_t)-1), "unknown status");
  assert_string_equal(zb_status_string((zb_status_t)999), "unknown status");
}

static void test_version(void **state) {
  (void)state;
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", ZB_VERSION_MAJOR, ZB_VERSION_MINOR, ZB_VERSION_PATCH);
  assert_string_equal(zb_version(), want);
  assert_int_equal(zb_version_code(), ZB_VERSION_CODE);
  assert_int_equal(ZB_VERSION_CODE,
                   ZB_VERSION_MAJOR * 10000 + ZB_VERSION_MINOR * 100 + ZB_VERSION_PATCH);
  zb_free(NULL); /* documented as a no-op */
}

/* ---- the last error is per thread ------------------------------------------------------------- */

typedef struct {
  char before[256]; /* the thread's message before it fails: a fresh thread has none */
  char after[2048];
  zb_status_t status;
} thread_result_t;

static void *fail_in_thread(void *arg) {
  thread_result_t *r = arg;
  snprintf(r->before, sizeof r->before, "%s", zb_last_error());
  zb_kind_t kind;
  double factor;
  r->status = zb_kind_from_name("nope", &kind, &factor);
  snprintf(r->after, sizeof r->after, "%s", zb_last_error());
  return NULL;
}

static void test_last_error_per_thread(void **state) {
  (void)state;
  zb_format_t fmt;
  ASSERT_STATUS(zb_format_from_name("png", &fmt), ZB_ERR_INVALID_ARGUMENT);
  char mine[2048];
  snprintf(mine, sizeof mine, "%s", zb_last_error());
  ASSERT_CONTAINS(mine, "png");

  thread_result_t r;
  memset(&r, 0, sizeof r);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, fail_in_thread, &r), 0);
  assert_int_equal(pthread_join(t, NULL), 0);

  ASSERT_STATUS(r.status, ZB_ERR_INVALID_ARGUMENT);
  assert_string_equal(r.before, "");
  ASSERT_CONTAINS(r.after, "nope");
  /* The other thread's failure must not have touched this thread's message. */
  assert_string_equal(zb_last_error(), mine);
}

/* ---- kind names ------------------------------------------------------------------------------- */

static void expect_kind(const char *name, zb_kind_t want, double want_factor) {
  zb_kind_t got = (zb_kind_t)-1;
  double factor = -1;
  zb_status_t st = zb_kind_from_name(name, &got, &factor);
  if (st != ZB_OK)
    fail_msg("zb_kind_from_name(\"%s\") -> %s: %s", name, zb_status_string(st), zb_last_error());
  if (got != want)
    fail_msg("zb_kind_from_name(\"%s\") gave kind %d (%s), expected %d (%s)", name, (int)got,
             zb_kind_name(got) ? zb_kind_name(got) : "?", (int)want, zb_kind_name(want));
  if (factor != want_factor)
    fail_msg("zb_kind_from_name(\"%s\") gave factor %g, expected %g", name, factor, want_factor);
}

static void test_kind_names_round_trip(void **state) {
  (void)state;
  for (int k = 0; k < ZB_KIND_COUNT; k++) {
    const char *name = zb_kind_name((zb_kind_t)k);
    assert_non_null(name);
    assert_non_null(zb_kind_help((zb_kind_t)k));
    if (k == ZB_KIND_CUSTOM) {
      zb_kind_t got;
      double factor;
      ASSERT_STATUS(zb_kind_from_name(name, &got, &factor), ZB_ERR_INVALID_ARGUMENT);
      ASSERT_CONTAINS(zb_last_error(), "custom");
      continue;
    }
    expect_kind(name, (zb_kind_t)k, 0);
  }
  assert_null(zb_kind_name((zb_kind_t)ZB_KIND_COUNT));
  assert_null(zb_kind_name((zb_kind_t)-1));
  assert_null(zb_kind_help((zb_kind_t)ZB_KIND_COUNT));
}

static void test_kind_names_forgiving(void **state) {
  (void)state;
  expect_kind("ZB_V", ZB_KIND_ZB_V, 0);
  expect_kind("Zb-H1", ZB_KIND_ZB_H1, 0);
  expect_kind("INTERLEAVED_1F1B", ZB_KIND_INTERLEAVED_1F1B, 0);
  expect_kind("V_Half", ZB_KIND_V_HALF, 0);
  /* torch.distributed.pipelining's class names */
  expect_kind("1F1B", ZB_KIND_1F1B, 0);
  expect_kind("Interleaved1F1B", ZB_KIND_INTERLEAVED_1F1B, 0);
  expect_kind("GPipe", ZB_KIND_GPIPE, 0);
  expect_kind("ZBVZeroBubble", ZB_KIND_ZB_V, 0);
  expect_kind("InterleavedZeroBubble", ZB_KIND_ZB_AUTO, 0);
  /* the paper's memory-limited variants */
  expect_kind("zb-1p", ZB_KIND_ZB_AUTO, 1);
  expect_kind("zb-2p", ZB_KIND_ZB_AUTO, 2);
  expect_kind("ZB_2P", ZB_KIND_ZB_AUTO, 2);
}

static void test_kind_unknown(void **state) {
  (void)state;
  zb_kind_t got = ZB_KIND_1F1B;
  double factor = 0;
  ASSERT_STATUS(zb_kind_from_name("nope", &got, &factor), ZB_ERR_INVALID_ARGUMENT);
  const char *msg = zb_last_error();
  ASSERT_CONTAINS(msg, "nope");
  ASSERT_CONTAINS(msg, "zb-v");
  ASSERT_CONTAINS(msg, "1f1b");
  ASSERT_CONTAINS(msg, "zb-auto");
  ASSERT_STATUS(zb_kind_from_name("", &got, &factor), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_kind_from_name(NULL, &got, &factor), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_kind_from_name("1f1b", NULL, &factor), ZB_ERR_INVALID_ARGUMENT);
}

/* ---- schedule creation: bad input ------------------------------------------------------------- */

/* Creates from spec and expects status `want`, *out NULL, and every NULL-terminated substring in
 * the message. `what` names the case in a failure. */
static void expect_create_fails(const char *what, const zb_schedule_spec_t *spec, zb_status_t want,
                                ...) {
  static char sentinel;
  zb_schedule_t *s = (zb_schedule_t *)(void *)&sentinel;
  zb_status_t st = zb_schedule_create(&s, spec);
  if (st != want)
    fail_msg("%s: zb_schedule_create -> %d (%s), expected %d (%s); last error: %s", what, (int)st,
             zb_status_string(st), (int)want, zb_status_string(want), zb_last_error());
  if (s != NULL) fail_msg("%s: zb_schedule_create failed but *out is %p, not NULL", what, (void *)s);
  va_list ap;
  va_start(ap, want);
  for (const char *sub = va_arg(ap, const char *); sub; sub = va_arg(ap, const char *))
    if (!strstr(zb_last_error(), sub))
      fail_msg("%s: expected \"%s\" in the message \"%s\"", what, sub, zb_last_error());
  va_end(ap);
}

static void test_create_null_and_header(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  ASSERT_STATUS(zb_schedule_create(NULL, &spec), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "'out'");
  expect_create_fails("NULL spec", NULL, ZB_ERR_INVALID_ARGUMENT, "'spec'", NULL);

  spec.struct_size = (uint32_t)sizeof spec - 8;
  expect_create_fails("short struct_size", &spec, ZB_ERR_INVALID_ARGUMENT, "struct_size",
                      "ZB_SCHEDULE_SPEC_INIT", NULL);
  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  spec.struct_size = 0;
  expect_create_fails("struct_size 0", &spec, ZB_ERR_INVALID_ARGUMENT, "struct_size", NULL);
  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  spec.version = ZB_SCHEDULE_SPEC_VERSION + 1;
  expect_create_fails("future version", &spec, ZB_ERR_INVALID_ARGUMENT, "version", NULL);
}

static void test_create_bad_shape(void **state) {
  (void)state;
  zb_schedule_spec_t spec;
  spec = zb_test_spec(ZB_KIND_1F1B, 0, 8, 1);
  expect_create_fails("p = 0", &spec, ZB_ERR_INVALID_ARGUMENT, "ranks", "0", ">= 1", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, -3, 8, 0);
  expect_create_fails("p = -3", &spec, ZB_ERR_INVALID_ARGUMENT, "ranks", "-3", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_H1, 4, 0, 1);
  expect_create_fails("m = 0", &spec, ZB_ERR_INVALID_ARGUMENT, "microbatches", ">= 1", NULL);
  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, -1);
  expect_create_fails("v = -1", &spec, ZB_ERR_INVALID_ARGUMENT, "chunks", NULL);

  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 2);
  expect_create_fails("1f1b with v = 2", &spec, ZB_ERR_INVALID_ARGUMENT, "1f1b", "v = 2", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 3);
  expect_create_fails("zb-v with v = 3", &spec, ZB_ERR_INVALID_ARGUMENT, "zb-v", "v = 3", NULL);
  spec = zb_test_spec(ZB_KIND_CUSTOM, 4, 8, 1);
  expect_create_fails("custom has no generator", &spec, ZB_ERR_INVALID_ARGUMENT, "zb-v", NULL);

  /* torch's rule: max(1, m / p) rounds of equal size. m = 9 with p = 4 is 2 rounds, which do not
   * divide 9; 8 and 10 are equally near, either is a right answer. */
  spec = zb_test_spec(ZB_KIND_INTERLEAVED_1F1B, 4, 9, 2);
  expect_create_fails("interleaved m = 9, p = 4", &spec, ZB_ERR_INVALID_ARGUMENT, "multiple of 2",
                      "m = 9", NULL);
  const char *msg = zb_last_error();
  if (!strstr(msg, "8 or 10") && !strstr(msg, "nearest valid: 8") && !strstr(msg, "nearest valid: 10"))
    fail_msg("expected the nearest valid m (8 or 10) in \"%s\"", msg);
  /* m = 13 with p = 4: 3 rounds; 12 is the only nearest valid m (14 is 3 rounds too: no). */
  spec = zb_test_spec(ZB_KIND_INTERLEAVED_1F1B, 4, 13, 2);
  expect_create_fails("interleaved m = 13, p = 4", &spec, ZB_ERR_INVALID_ARGUMENT, "multiple of 3",
                      "nearest valid: 12", NULL);
}

static void test_create_bad_costs(void **state) {
  (void)state;
  zb_schedule_spec_t spec;
  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  spec.time_f = -1;
  expect_create_fails("negative time_f", &spec, ZB_ERR_INVALID_ARGUMENT, "time_f", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_H1, 4, 8, 1);
  spec.time_b = NAN;
  expect_create_fails("NaN time_b", &spec, ZB_ERR_INVALID_ARGUMENT, "time_b", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_H1, 4, 8, 1);
  spec.time_w = INFINITY;
  expect_create_fails("infinite time_w", &spec, ZB_ERR_INVALID_ARGUMENT, "time_w", NULL);
  spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  spec.time_bw = NAN;
  expect_create_fails("NaN time_bw", &spec, ZB_ERR_INVALID_ARGUMENT, "time_bw", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  spec.time_comm = INFINITY;
  expect_create_fails("infinite time_comm", &spec, ZB_ERR_INVALID_ARGUMENT, "time_comm", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  spec.time_comm = -0.5;
  expect_create_fails("negative time_comm", &spec, ZB_ERR_INVALID_ARGUMENT, "time_comm", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  spec.w_share = 1.5;
  expect_create_fails("w_share 1.5", &spec, ZB_ERR_INVALID_ARGUMENT, "w_share", "[0, 1]", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  spec.w_share = NAN;
  expect_create_fails("NaN w_share", &spec, ZB_ERR_INVALID_ARGUMENT, "w_share", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_AUTO, 4, 8, 1);
  spec.mem_limit = NAN;
  expect_create_fails("NaN mem_limit", &spec, ZB_ERR_INVALID_ARGUMENT, "mem_limit", NULL);

  spec = zb_test_spec(ZB_KIND_ZB_AUTO, 4, 8, 1);
  spec.mem_limit = 0.5;
  expect_create_fails("zb-auto under limit 0.5", &spec, ZB_ERR_INFEASIBLE, "minimum is 1", NULL);

  double tf[4] = {1, 1, -1, 1};
  spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 2);
  spec.stage_time_f = tf;
  expect_create_fails("negative stage_time_f[2]", &spec, ZB_ERR_INVALID_ARGUMENT,
                      "stage_time_f[2]", NULL);
  double tw[4] = {1, 1, 1, NAN};
  spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 2);
  spec.stage_time_w = tw;
  expect_create_fails("NaN stage_time_w[3]", &spec, ZB_ERR_INVALID_ARGUMENT, "stage_time_w[3]",
                      NULL);
}

/* ---- handle accessors ------------------------------------------------------------------------- */

static zb_schedule_t *create_ok(const zb_schedule_spec_t *spec) {
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, spec));
  assert_non_null(s);
  return s;
}

/* Each time finite, but m of them summed not: the library must refuse the costs by name, not
 * return a cost of inf, a NaN bubble, or a scheduler stall (issue 24). */
static void test_create_costs_too_long(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 4, 8, 1);
  spec.time_f = 1e308;
  expect_create_fails("1f1b, time_f 1e308", &spec, ZB_ERR_INVALID_ARGUMENT, "time_f is 1e+308",
                      "finite", NULL);
  spec = zb_test_spec(ZB_KIND_ZB_AUTO, 4, 8, 1);
  spec.time_f = 1e308;
  expect_create_fails("zb-auto, time_f 1e308", &spec, ZB_ERR_INVALID_ARGUMENT, "time_f is 1e+308",
                      NULL);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  spec.time_comm = 1e308;
  expect_create_fails("zb-v, time_comm 1e308", &spec, ZB_ERR_INVALID_ARGUMENT,
                      "time_comm is 1e+308", NULL);
  /* 1e307 is finite, and so is 4 of it; m = 64 of them is not. */
  double tw[4] = {1, 1, 1, 1e307};
  spec = zb_test_spec(ZB_KIND_ZB_V, 2, 64, 2);
  spec.stage_time_w = tw;
  expect_create_fails("stage_time_w[3] 1e307, m = 64", &spec, ZB_ERR_INVALID_ARGUMENT,
                      "stage_time_w[3] is 1e+307", NULL);

  /* Explicit op lists over a custom map: the message names the spec's scalar the caller gave, not
   * the per-stage arrays made from it. */
  const zb_op_t r0[4] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 2, 0}, {ZB_OP_BW, 2, 0}, {ZB_OP_BW, 0, 0}};
  const zb_op_t r1[2] = {{ZB_OP_F, 1, 0}, {ZB_OP_BW, 1, 0}};
  const zb_op_t *lists[2] = {r0, r1};
  const int32_t counts[2] = {4, 2}, map[3] = {0, 1, 0};
  spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 1, 1);
  spec.time_b = DBL_MAX;
  zb_schedule_t *s = NULL;
  ASSERT_STATUS(zb_schedule_create_from_ops_mapped(&s, &spec, map, 3, lists, counts),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "time_b is 1.79769e+308");
  if (strstr(zb_last_error(), "stage_time"))
    fail_msg("the message names an array the caller did not give: %s", zb_last_error());

  /* The same from a CSV. */
  const char csv[] = "0F0,0I0,0W0\n";
  zb_schedule_spec_t plain = ZB_SCHEDULE_SPEC_INIT;
  spec = plain;
  spec.time_w = 1e308;
  ASSERT_STATUS(zb_schedule_import(&s, ZB_FORMAT_CSV, csv, sizeof csv - 1, &spec), ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "time_w is 1e+308");

  /* Huge but within the limit: the plan is made, and its figures are finite. */
  spec = zb_test_spec(ZB_KIND_ZB_AUTO, 4, 8, 1);
  spec.time_f = 1e297;
  s = create_ok(&spec);
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  if (!isfinite(r.cost) || !(r.cost >= 8 * 1e297) || !(r.bubble_rate >= 0 && r.bubble_rate < 1))
    fail_msg("time_f 1e297: cost %g (want finite, >= 8e297), bubble rate %g", r.cost, r.bubble_rate);
  ZB_ASSERT_OK(zb_schedule_destroy(s));
}

static void test_destroy_null(void **state) {
  (void)state;
  ASSERT_STATUS(zb_schedule_destroy(NULL), ZB_OK);
}

static void test_accessor_errors(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_H1, 4, 8, 1);
  zb_schedule_t *s = create_ok(&spec);
  const zb_op_t *ops = NULL;
  int32_t count = -1;
  ASSERT_STATUS(zb_schedule_rank_ops(s, -1, &ops, &count), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "-1");
  ASSERT_STATUS(zb_schedule_rank_ops(s, 4, &ops, &count), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "0..3");
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 3, &ops, &count));
  assert_int_equal(count, 3 * 8); /* rank 3 holds one stage: F, B and W for each microbatch */

  const double *start = NULL, *end = NULL;
  double span, busy, peak;
  ASSERT_STATUS(zb_schedule_rank_times(s, 0, &start, &end), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "simulate");
  ASSERT_STATUS(zb_schedule_rank_stats(s, 0, &span, &busy, &peak), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "simulate");

  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  ZB_ASSERT_OK(zb_schedule_rank_times(s, 3, &start, &end));
  /* Ops on a rank run in list order, each for its op time (1 at unit times, v = 1). */
  for (int k = 0; k < count; k++) {
    if (!(fabs(end[k] - start[k] - 1.0) <= 1e-12))
      fail_msg("rank 3 op %d runs [%g, %g]; expected it to last 1", k, start[k], end[k]);
    if (k > 0 && !(start[k] >= end[k - 1] - 1e-12))
      fail_msg("rank 3 op %d starts at %g, before op %d ends at %g", k, start[k], k - 1, end[k - 1]);
  }
  ZB_ASSERT_OK(zb_schedule_rank_stats(s, 3, &span, &busy, &peak));
  ASSERT_NEAR(span, end[count - 1] - start[0]); /* span: last end minus first start */
  if (!(span <= r.cost + 1e-12)) fail_msg("rank 3's span %g exceeds the cost %g", span, r.cost);
  ASSERT_NEAR(busy, 8 * 3.0); /* m * (T_F + T_B + T_W) at unit times */
  ASSERT_STATUS(zb_schedule_rank_times(s, 4, &start, &end), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_schedule_rank_stats(s, -1, &span, &busy, &peak), ZB_ERR_INVALID_ARGUMENT);

  int32_t rank = -1;
  ASSERT_STATUS(zb_schedule_stage_rank(s, 4, &rank), ZB_ERR_INVALID_ARGUMENT);
  double t;
  ASSERT_STATUS(zb_schedule_op_time(s, ZB_OP_F, -1, &t), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_schedule_op_time(s, (zb_op_type_t)10, 0, &t), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "ZB_OP_IB");
  ZB_ASSERT_OK(zb_schedule_op_time(s, ZB_OP_T, 0, &t)); /* a vocabulary pass names a rank, not a stage */
  ASSERT_STATUS(zb_schedule_op_time(s, ZB_OP_S, 4, &t), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "rank 4 is out of range");
  ZB_ASSERT_OK(zb_schedule_destroy(s));
}

static void test_format_names(void **state) {
  (void)state;
  static const struct {
    const char *name;
    zb_format_t fmt;
  } names[] = {{"text", ZB_FORMAT_TEXT},
               {"csv", ZB_FORMAT_CSV},
               {"json", ZB_FORMAT_JSON},
               {"chrome", ZB_FORMAT_CHROME},
               {"svg", ZB_FORMAT_SVG}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    zb_format_t got = (zb_format_t)-1;
    ZB_ASSERT_OK(zb_format_from_name(names[i].name, &got));
    assert_int_equal(got, names[i].fmt);
  }
  zb_format_t got;
  ASSERT_STATUS(zb_format_from_name("png", &got), ZB_ERR_INVALID_ARGUMENT);
  const char *msg = zb_last_error();
  ASSERT_CONTAINS(msg, "png");
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) ASSERT_CONTAINS(msg, names[i].name);
}

/* ---- the spec's defaults and times ------------------------------------------------------------ */

static void expect_default_chunks(zb_kind_t kind, int want_v, zb_placement_t want_placement) {
  zb_schedule_spec_t spec = zb_test_spec(kind, 4, 8, 0);
  zb_schedule_t *s = create_ok(&spec);
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  if (info.chunks != want_v || info.stages != 4 * want_v || info.placement != want_placement)
    fail_msg("%s with chunks = 0: v = %d, S = %d, placement %d; expected v = %d, S = %d, "
             "placement %d",
             zb_kind_name(kind), info.chunks, info.stages, (int)info.placement, want_v, 4 * want_v,
             (int)want_placement);
  assert_int_equal(info.kind, kind);
  assert_int_equal(info.ranks, 4);
  assert_int_equal(info.microbatches, 8);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  ZB_ASSERT_OK(zb_schedule_destroy(s));
}

static void test_default_chunks(void **state) {
  (void)state;
  expect_default_chunks(ZB_KIND_ZB_V, 2, ZB_PLACEMENT_V);
  expect_default_chunks(ZB_KIND_V_HALF, 2, ZB_PLACEMENT_V);
  expect_default_chunks(ZB_KIND_V_MIN, 2, ZB_PLACEMENT_V);
  expect_default_chunks(ZB_KIND_INTERLEAVED_1F1B, 2, ZB_PLACEMENT_LOOP);
  expect_default_chunks(ZB_KIND_1F1B, 1, ZB_PLACEMENT_LOOP);
  expect_default_chunks(ZB_KIND_GPIPE, 1, ZB_PLACEMENT_LOOP);
  expect_default_chunks(ZB_KIND_ZB_H2, 1, ZB_PLACEMENT_LOOP);
  expect_default_chunks(ZB_KIND_ZB_AUTO, 1, ZB_PLACEMENT_LOOP);
}

static void expect_op_time(const zb_schedule_t *s, zb_op_type_t type, int stage, double want) {
  double got = NAN;
  ZB_ASSERT_OK(zb_schedule_op_time(s, type, stage, &got));
  if (!(fabs(got - want) <= 1e-12))
    fail_msg("op time of %d at stage %d is %.17g, expected %.17g", (int)type, stage, got, want);
}

static void test_times_per_rank_divided_by_v(void **state) {
  (void)state;
  /* Per-rank times for a two-chunk schedule: each stage's op takes half. */
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  spec.time_f = 2;
  spec.time_b = 4;
  spec.time_w = 6;
  spec.time_bw = 0; /* <= 0: B + W */
  spec.time_comm = 0.25;
  spec.w_share = 0.75;
  spec.mem_limit = 6;
  zb_schedule_t *s = create_ok(&spec);
  for (int st = 0; st < 8; st++) {
    expect_op_time(s, ZB_OP_F, st, 1.0);
    expect_op_time(s, ZB_OP_B, st, 2.0);
    expect_op_time(s, ZB_OP_W, st, 3.0);
    expect_op_time(s, ZB_OP_BW, st, 5.0);
  }
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  ASSERT_NEAR(info.time_comm, 0.25); /* comm is per hop, never divided */
  ASSERT_NEAR(info.w_share, 0.75);
  ASSERT_NEAR(info.mem_limit, 6);
  ZB_ASSERT_OK(zb_schedule_destroy(s));

  /* A negative time_bw is also "B + W"; a positive one is used (divided by v). */
  spec = zb_test_spec(ZB_KIND_1F1B, 2, 4, 1);
  spec.time_b = 1.5;
  spec.time_w = 0.5;
  spec.time_bw = -1;
  s = create_ok(&spec);
  expect_op_time(s, ZB_OP_BW, 1, 2.0);
  ZB_ASSERT_OK(zb_schedule_destroy(s));
  spec = zb_test_spec(ZB_KIND_INTERLEAVED_1F1B, 2, 4, 2);
  spec.time_bw = 3;
  s = create_ok(&spec);
  expect_op_time(s, ZB_OP_BW, 3, 1.5);
  expect_op_time(s, ZB_OP_F, 3, 0.5);
  ZB_ASSERT_OK(zb_schedule_destroy(s));
}

static void test_stage_times_override_and_copied(void **state) {
  (void)state;
  double tf[4] = {1.0, 2.0, 3.0, 4.0};
  double tb[4] = {0.5, 0.25, 0.125, 2.0};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V, 2, 4, 2);
  spec.time_f = 10; /* overridden by the array */
  spec.time_w = 6;  /* no array: per rank, divided by v */
  spec.stage_time_f = tf;
  spec.stage_time_b = tb;
  zb_schedule_t *s = create_ok(&spec);
  /* The caller keeps ownership and may reuse its arrays at once. */
  for (int i = 0; i < 4; i++) tf[i] = tb[i] = 100.0;
  const double want_f[4] = {1.0, 2.0, 3.0, 4.0}, want_b[4] = {0.5, 0.25, 0.125, 2.0};
  for (int st = 0; st < 4; st++) {
    expect_op_time(s, ZB_OP_F, st, want_f[st]); /* absolute, not divided by v */
    expect_op_time(s, ZB_OP_B, st, want_b[st]);
    expect_op_time(s, ZB_OP_W, st, 3.0);
    expect_op_time(s, ZB_OP_BW, st, want_b[st] + 3.0);
  }
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  /* busy: the largest total compute of a rank; rank 0 holds stages 0 and 3. */
  double rank0 = 4 * (1.0 + 0.5 + 3.0) + 4 * (4.0 + 2.0 + 3.0);
  double rank1 = 4 * (2.0 + 0.25 + 3.0) + 4 * (3.0 + 0.125 + 3.0);
  ASSERT_NEAR(r.busy, rank0 > rank1 ? rank0 : rank1);
  ZB_ASSERT_OK(zb_schedule_destroy(s));
}

/* ---- explicit op lists ------------------------------------------------------------------------ */

static void test_create_from_ops(void **state) {
  (void)state;
  /* 1F1B over p = 2, m = 2, fused backward. */
  zb_op_t r0[4] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 0, 1}, {ZB_OP_BW, 0, 0}, {ZB_OP_BW, 0, 1}};
  zb_op_t r1[4] = {{ZB_OP_F, 1, 0}, {ZB_OP_BW, 1, 0}, {ZB_OP_F, 1, 1}, {ZB_OP_BW, 1, 1}};
  const zb_op_t want0[4] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 0, 1}, {ZB_OP_BW, 0, 0}, {ZB_OP_BW, 0, 1}};
  const zb_op_t *lists[2] = {r0, r1};
  int32_t counts[2] = {4, 4};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_V /* ignored */, 2, 2, 1);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, counts));
  assert_non_null(s);
  /* Everything was copied: the caller's lists may change. */
  for (int k = 0; k < 4; k++) r0[k] = (zb_op_t){ZB_OP_W, 9, 9};
  counts[0] = 0;
  const zb_op_t *ops = NULL;
  int32_t n = 0;
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 0, &ops, &n));
  assert_int_equal(n, 4);
  for (int k = 0; k < 4; k++)
    if (ops[k].type != want0[k].type || ops[k].stage != want0[k].stage || ops[k].mb != want0[k].mb)
      fail_msg("rank 0 op %d is (%d, %d, %d), expected (%d, %d, %d)", k, ops[k].type,
               ops[k].stage, ops[k].mb, want0[k].type, want0[k].stage, want0[k].mb);
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.kind, ZB_KIND_CUSTOM);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  ZB_ASSERT_OK(zb_schedule_destroy(s));

  /* A negative count is rejected. */
  const zb_op_t *good[2] = {want0, r1};
  int32_t bad_counts[2] = {4, -1};
  s = (zb_schedule_t *)(void *)good;
  ASSERT_STATUS(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, good, bad_counts),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "rank 1");
  ASSERT_CONTAINS(zb_last_error(), "-1");

  /* V placement needs exactly two chunks. */
  int32_t zero[2] = {0, 0};
  spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 2, 1);
  s = (zb_schedule_t *)(void *)good;
  ASSERT_STATUS(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_V, good, zero),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "v = 2");
  spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 2, 3);
  s = (zb_schedule_t *)(void *)good;
  ASSERT_STATUS(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_V, good, zero),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "v = 3");

  /* Bad shape and bad costs are checked here too. */
  spec = zb_test_spec(ZB_KIND_CUSTOM, 0, 2, 1);
  s = (zb_schedule_t *)(void *)good;
  ASSERT_STATUS(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, good, zero),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 2, 1);
  spec.time_f = NAN;
  s = (zb_schedule_t *)(void *)good;
  ASSERT_STATUS(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, good, counts),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "time_f");
}

/* An explicit stage-to-rank map: ranks may hold different numbers of stages; a map that is the loop
 * or the V gets that placement; a rank out of range or a rank with no stage is refused. */
static void test_create_from_ops_mapped(void **state) {
  (void)state;
  /* One microbatch through 3 stages: 0 and 2 on rank 0, 1 on rank 1. */
  const zb_op_t r0[4] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 2, 0}, {ZB_OP_BW, 2, 0}, {ZB_OP_BW, 0, 0}};
  const zb_op_t r1[2] = {{ZB_OP_F, 1, 0}, {ZB_OP_BW, 1, 0}};
  const zb_op_t *lists[2] = {r0, r1};
  const int32_t counts[2] = {4, 2};
  const int32_t map[3] = {0, 1, 0};
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 1, 1);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops_mapped(&s, &spec, map, 3, lists, counts));
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.placement, ZB_PLACEMENT_CUSTOM);
  assert_int_equal(info.stages, 3);
  assert_int_equal(info.chunks, 2);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_sim_result_t res;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &res));
  /* rank 0's stages cost half of its unit each, rank 1's stage the whole unit: the chain of one
   * microbatch is F 0.5 + 1 + 0.5, then the fused backwards (2x each). */
  assert_float_equal(res.cost, 3 * (0.5 + 1 + 0.5), 1e-12);
  ZB_ASSERT_OK(zb_schedule_destroy(s));

  /* Memory: a microbatch through all of a rank's layers is 1, whatever the rank's stage count.
   * GPipe over m = 2: rank 0 (stages 0 and 2, 1/2 each) and rank 1 (stage 1, 1 each) both peak at 2. */
  {
    const zb_op_t g0[8] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 0, 1}, {ZB_OP_F, 2, 0}, {ZB_OP_F, 2, 1},
                           {ZB_OP_BW, 2, 0}, {ZB_OP_BW, 2, 1}, {ZB_OP_BW, 0, 0}, {ZB_OP_BW, 0, 1}};
    const zb_op_t g1[4] = {{ZB_OP_F, 1, 0}, {ZB_OP_F, 1, 1}, {ZB_OP_BW, 1, 0}, {ZB_OP_BW, 1, 1}};
    const zb_op_t *g[2] = {g0, g1};
    const int32_t gc[2] = {8, 4};
    zb_schedule_spec_t two = zb_test_spec(ZB_KIND_CUSTOM, 2, 2, 1);
    ZB_ASSERT_OK(zb_schedule_create_from_ops_mapped(&s, &two, map, 3, g, gc));
    ZB_ASSERT_OK(zb_schedule_validate(s));
    ZB_ASSERT_OK(zb_schedule_simulate(s, &res));
    double span, busy, peak0, peak1;
    ZB_ASSERT_OK(zb_schedule_rank_stats(s, 0, &span, &busy, &peak0));
    ZB_ASSERT_OK(zb_schedule_rank_stats(s, 1, &span, &busy, &peak1));
    assert_float_equal(peak0, 2.0, 1e-12);
    assert_float_equal(peak1, 2.0, 1e-12);
    ZB_ASSERT_OK(zb_schedule_destroy(s));
  }

  /* The same map with op lists that put stage 1 on rank 0: validation names the rank. */
  const zb_op_t w0[4] = {{ZB_OP_F, 0, 0}, {ZB_OP_F, 1, 0}, {ZB_OP_BW, 1, 0}, {ZB_OP_BW, 0, 0}};
  const zb_op_t w1[2] = {{ZB_OP_F, 2, 0}, {ZB_OP_BW, 2, 0}};
  const zb_op_t *wrong[2] = {w0, w1};
  ZB_ASSERT_OK(zb_schedule_create_from_ops_mapped(&s, &spec, map, 3, wrong, counts));
  ASSERT_STATUS(zb_schedule_validate(s), ZB_ERR_INVALID_SCHEDULE);
  ASSERT_CONTAINS(zb_last_error(), "custom placement");
  ZB_ASSERT_OK(zb_schedule_destroy(s));

  /* A map that is the V gets the V placement. */
  const int32_t vee[4] = {0, 1, 1, 0};
  const int32_t none[2] = {0, 0};
  ZB_ASSERT_OK(zb_schedule_create_from_ops_mapped(&s, &spec, vee, 4, lists, none));
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.placement, ZB_PLACEMENT_V);
  ZB_ASSERT_OK(zb_schedule_destroy(s));

  const int32_t out_of_range[3] = {0, 2, 1};
  s = (zb_schedule_t *)(void *)lists;
  ASSERT_STATUS(zb_schedule_create_from_ops_mapped(&s, &spec, out_of_range, 3, lists, counts),
                ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "stage 1 is mapped to rank 2");
  const int32_t idle[3] = {0, 0, 0};
  ASSERT_STATUS(zb_schedule_create_from_ops_mapped(&s, &spec, idle, 3, lists, counts),
                ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "no stage on rank 1");
}

/* ---- scale ------------------------------------------------------------------------------------ */

static void test_zb_auto_at_scale(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_ZB_AUTO, 64, 1024, 1);
  spec.time_f = 10.4;
  spec.time_b = 10.2;
  spec.time_w = 7.7;
  spec.time_comm = 0.41;
  zb_schedule_t *s = create_ok(&spec);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_sim_result_t r;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &r));
  /* No rank can finish before its own compute: m * (F + B + W). */
  if (!(r.cost >= 1024 * (10.4 + 10.2 + 7.7) - 1e-6) || !(r.bubble_rate >= 0 && r.bubble_rate < 1))
    fail_msg("cost %g, bubble rate %g for zb-auto p=64 m=1024", r.cost, r.bubble_rate);
  /* Without a limit zb-auto keeps 1F1B's memory, p. */
  if (!(r.max_peak_memory <= 64 + 1e-9))
    fail_msg("peak memory %g above p = 64 with no limit given", r.max_peak_memory);
  ZB_ASSERT_OK(zb_schedule_destroy(s));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_strings_distinct),
      cmocka_unit_test(test_version),
      cmocka_unit_test(test_last_error_per_thread),
      cmocka_unit_test(test_kind_names_round_trip),
      cmocka_unit_test(test_kind_names_forgiving),
      cmocka_unit_test(test_kind_unknown),
      cmocka_unit_test(test_create_null_and_header),
      cmocka_unit_test(test_create_bad_shape),
      cmocka_unit_test(test_create_bad_costs),
      cmocka_unit_test(test_create_costs_too_long),
      cmocka_unit_test(test_destroy_null),
      cmocka_unit_test(test_accessor_errors),
      cmocka_unit_test(test_format_names),
      cmocka_unit_test(test_default_chunks),
      cmocka_unit_test(test_times_per_rank_divided_by_v),
      cmocka_unit_test(test_stage_times_override_and_copied),
      cmocka_unit_test(test_create_from_ops),
      cmocka_unit_test(test_create_from_ops_mapped),
      cmocka_unit_test(test_zb_auto_at_scale),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
