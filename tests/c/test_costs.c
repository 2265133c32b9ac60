/*
 * test_costs.c - per-stage cost files: the reader in csrc/tool/costs.c, and `zbpp schedule` and
 * `zbpp simulate` with --stage-times run as a user runs them.
 *
 * The reader is tool code, not part of libzbpp, so this file compiles it in (#include below) to
 * test it directly: exact numbers, skipped unknown keys, and a line:column message for every kind of
 * malformed JSON. The tool tests run the binary that ctest names in ZBPP_TOOL (they are skipped
 * when it is not set) and compare what it prints with what the C API gives for the same numbers
 * through zb_schedule_spec_t.stage_time_*: the independent route to the same schedule.
 *
 * What this is not: a test of the schedules themselves (test_generators.c, test_simulate.c).
 */
#define _POSIX_C_SOURCE 200809L /* fork, mkdtemp */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "tool/costs.c" /* the reader under test; it is linked into the tool, not the library */

/* ---- files and the tool ------------------------------------------------------------------------- */

static char g_dir[256]; /* a fresh directory for this run's files, removed at the end */
static char g_files[64][320];
static int g_nfiles;

/* A path in g_dir, remembered so that teardown removes it. */
static const char *tmp_path(const char *name) {
  assert_true(g_nfiles < 64);
  char *p = g_files[g_nfiles++];
  snprintf(p, sizeof g_files[0], "%s/%s", g_dir, name);
  return p;
}

static const char *write_file(const char *name, const char *text) {
  const char *path = tmp_path(name);
  FILE *f = fopen(path, "wb");
  if (!f) fail_msg("cannot write %s: %s", path, strerror(errno));
  fputs(text, f);
  fclose(f);
  return path;
}

static int setup(void **state) {
  (void)state;
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/zbpp_costs.XXXXXX", tmp && *tmp ? tmp : "/tmp");
  return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  for (int k = 0; k < g_nfiles; k++) unlink(g_files[k]);
  unlink(tmp_path("stdout")), unlink(tmp_path("stderr"));
  rmdir(g_dir);
  return 0;
}

typedef struct {
  int rc;          /* exit status, or 128 + signal */
  char *out, *err; /* what it printed (malloc'd, NUL-terminated) */
} run_t;

static void run_free(run_t *r) {
  free(r->out);
  free(r->err);
}

/* Runs the tool with args (NULL-terminated, without argv[0]); skips the test where ctest did not
 * say where the tool is. */
static run_t run_tool(const char *const *args) {
  const char *tool = getenv("ZBPP_TOOL");
  if (!tool || !*tool) skip();
  const char *argv[32] = {tool};
  int n = 1;
  for (; args[n - 1]; n++) {
    assert_true(n < 31);
    argv[n] = args[n - 1];
  }
  argv[n] = NULL;
  char out_path[320], err_path[320];
  snprintf(out_path, sizeof out_path, "%s/stdout", g_dir);
  snprintf(err_path, sizeof err_path, "%s/stderr", g_dir);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0) _exit(126);
    execv(tool, (char *const *)argv);
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  run_t r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = zb_test_read_file(out_path, NULL);
  r.err = zb_test_read_file(err_path, NULL);
  assert_non_null(r.out);
  assert_non_null(r.err);
  return r;
}

/* ---- cost files ---------------------------------------------------------------------------------- */

typedef struct {
  int S;
  double f[8], b[8], w[8], bw[8];
  int with_bw;
  double comm, w_share;
} costs_t;

/* Per-stage costs with a heavy last stage (three times the others), in values that decimal cannot
 * write exactly (0.1, 1/3, ...), so that a reader that rounds even once changes the schedule's
 * times, which the JSON export prints with %.17g. */
static costs_t heavy_last(int S) {
  costs_t c = {.S = S, .comm = 0.1 + 0.2, .w_share = 1.0 / 3.0};
  for (int s = 0; s < S; s++) {
    double k = s == S - 1 ? 3.0 : 1.0;
    c.f[s] = k * (1.0 + s / 10.0);
    c.b[s] = k * (1.1 + s / 7.0);
    c.w[s] = k * (0.45 + s / 3.0);
    c.bw[s] = c.b[s] + c.w[s] - 0.01; /* fused slightly cheaper than B + W */
  }
  return c;
}

static void put_array(FILE *f, const char *key, const double *a, int n) {
  fprintf(f, ", \"%s\": [", key);
  for (int s = 0; s < n; s++) fprintf(f, "%s%.17g", s ? ", " : "", a[s]);
  fprintf(f, "]");
}

/* Writes c in the "zbpp-costs" format; `meta` is inserted as is (e.g. "\"ranks\": 4, "). */
static const char *write_costs(const char *name, const costs_t *c, const char *meta) {
  const char *path = tmp_path(name);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fprintf(f, "{\"format\": \"zbpp-costs\", \"version\": 1, \"unit\": \"ms\", %s\"time_comm\": %.17g, "
             "\"w_share\": %.17g",
          meta, c->comm, c->w_share);
  put_array(f, "time_f", c->f, c->S);
  put_array(f, "time_b", c->b, c->S);
  put_array(f, "time_w", c->w, c->S);
  if (c->with_bw) put_array(f, "time_bw", c->bw, c->S);
  fprintf(f, "}\n");
  fclose(f);
  return path;
}

/* The C API's JSON for the same costs; the caller frees it with zb_free. */
static char *c_api_json(zb_schedule_spec_t spec, const costs_t *c) {
  spec.stage_time_f = c->f;
  spec.stage_time_b = c->b;
  spec.stage_time_w = c->w;
  spec.stage_time_bw = c->with_bw ? c->bw : NULL;
  spec.time_comm = c->comm;
  spec.w_share = c->w_share;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  ZB_ASSERT_OK(zb_schedule_validate(s));
  char *text = NULL;
  size_t len = 0;
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_JSON, &text, &len));
  zb_schedule_destroy(s);
  return text;
}

/* Asserts two outputs are the same text, showing where they first differ. */
static void assert_same_text(const char *what, const char *got, const char *want) {
  if (!strcmp(got, want)) return;
  size_t k = 0;
  while (got[k] && got[k] == want[k]) k++;
  size_t from = k > 60 ? k - 60 : 0;
  fail_msg("%s: the tool's output differs from the C API's at byte %zu:\n  tool:  ...%.160s\n"
           "  C API: ...%.160s",
           what, k, got + from, want + from);
}

static double json_cost(const char *json) {
  const char *at = strstr(json, "\"cost\": ");
  if (!at) fail_msg("no \"cost\" in %.200s", json);
  return strtod(at + 8, NULL);
}

/* ---- the reader ---------------------------------------------------------------------------------- */

static int parse(const char *text, zb__costs_t *c, char *err, size_t n) {
  return zb__costs_parse(text, strlen(text), "c.json", c, err, n);
}

/* Numbers read back to the very double that %.17g wrote, including the awkward ones: 0.1, thirds,
 * the smallest subnormal, the largest finite double, and a 17-digit value halfway between two
 * doubles near 2^53 (9007199254740993 rounds to even, 9007199254740992). */
static void test_numbers_read_exactly(void **state) {
  (void)state;
  const double want[] = {0.1, 1.0 / 3.0, 2.0 / 3.0, 5e-324, 2.2250738585072014e-308,
                         1.7976931348623157e308, 123.456, 1e-7, 0.30000000000000004, 0,
                         9007199254740992.0, 4.35, 1e22};
  /* Other spellings JSON allows for the same values. */
  const char *spelled[] = {"1E-1", "0.333333333333333314829616256247390992939472198486328125",
                           "6.6666666666666663e-1", "4.9406564584124654e-324",
                           "22250738585072014e-324", "1.7976931348623157E+308", "123456e-3",
                           "0.0000001", "0.30000000000000004", "-0", "9007199254740993", "435e-2",
                           "1e22"};
  const int n = (int)(sizeof want / sizeof want[0]);
  char text[4096];
  size_t k = (size_t)snprintf(text, sizeof text, "{\"time_f\": [");
  for (int i = 0; i < n; i++) k += (size_t)snprintf(text + k, sizeof text - k, "%s%.17g", i ? ", " : "", want[i]);
  k += (size_t)snprintf(text + k, sizeof text - k, "], \"time_b\": [");
  for (int i = 0; i < n; i++) k += (size_t)snprintf(text + k, sizeof text - k, "%s%s", i ? ", " : "", spelled[i]);
  k += (size_t)snprintf(text + k, sizeof text - k, "], \"time_w\": [");
  for (int i = 0; i < n; i++) k += (size_t)snprintf(text + k, sizeof text - k, "%s1", i ? ", " : "");
  snprintf(text + k, sizeof text - k, "]}");
  zb__costs_t c;
  char err[512] = "";
  if (!parse(text, &c, err, sizeof err)) fail_msg("parse failed: %s\n%s", err, text);
  assert_int_equal(c.stages, n);
  for (int i = 0; i < n; i++) {
    if (memcmp(&c.time_f[i], &want[i], sizeof(double)) != 0)
      fail_msg("time_f[%d] read as %.17g (%a), written %.17g (%a)", i, c.time_f[i], c.time_f[i], want[i], want[i]);
    /* -0 reads as negative zero, which is == 0 and allowed; compare values there. */
    if (!(c.time_b[i] == want[i]))
      fail_msg("time_b[%d] (\"%s\") read as %.17g, expected %.17g", i, spelled[i], c.time_b[i], want[i]);
  }
  zb__costs_free(&c);
}

static void test_optional_and_unknown_keys(void **state) {
  (void)state;
  zb__costs_t c;
  char err[512] = "";
  /* The smallest file: the three required arrays. */
  if (!parse("{\"time_f\": [1], \"time_b\": [2], \"time_w\": [3]}", &c, err, sizeof err)) fail_msg("%s", err);
  assert_int_equal(c.stages, 1);
  assert_null(c.time_bw);
  assert_null(c.mem_f_bytes);
  assert_int_equal(c.ranks, 0);
  assert_int_equal(c.chunks, 0);
  assert_int_equal(c.placement, -1);
  assert_int_equal(c.has_time_comm, 0);
  assert_int_equal(c.has_w_share, 0);
  zb__costs_free(&c);

  /* null is a missing optional key; keys of a newer version are skipped whatever they hold;
   * whitespace and escapes anywhere JSON allows them. */
  const char *text =
      "\r\n\t{ \"format\" : \"zbpp\\u002dcosts\", \"version\": 1.0, \"unit\": null,\n"
      "  \"profiler\": {\"torch\": \"2.3 \\\"nightly\\\" \\ud83d\\ude00\", \"runs\": [1, -2.5e3, \"x\", "
      "[[], {}], {\"ok\": true, \"no\": false, \"n\": null}]},\n"
      "  \"ranks\": 2, \"chunks\": 1, \"placement\": \"loop\", \"time_bw\": null, \"mem_f_bytes\": "
      "[1e9, 2e9],\n"
      "  \"time_f\": [1, 2], \"time_b\": [3, 4], \"time_w\": [5, 6], \"time_comm\": 0.25, "
      "\"w_share\": 0, \"zzz\": \"\\/\\b\\f\\n\\r\\t\"}\n  ";
  if (!parse(text, &c, err, sizeof err)) fail_msg("%s", err);
  assert_int_equal(c.stages, 2);
  assert_int_equal(c.ranks, 2);
  assert_int_equal(c.chunks, 1);
  assert_int_equal(c.placement, ZB_PLACEMENT_LOOP);
  assert_null(c.time_bw);
  assert_non_null(c.mem_f_bytes);
  assert_true(c.mem_f_bytes[1] == 2e9);
  assert_true(c.time_w[1] == 6);
  assert_int_equal(c.has_time_comm, 1);
  assert_true(c.time_comm == 0.25);
  assert_int_equal(c.has_w_share, 1);
  assert_true(c.w_share == 0);
  zb__costs_free(&c);
}

/* Malformed JSON: each fails with "c.json:LINE:COLUMN:" at the offending character and says what
 * was wrong. */
static void test_malformed_json_has_line_and_column(void **state) {
  (void)state;
  const struct {
    const char *text, *where, *needle;
  } cases[] = {
      {"", "c.json:1:1:", "expected '{'"},
      {"[1, 2]", "c.json:1:1:", "expected '{'"},
      {"{\"time_f\": [1, 2,]}", "c.json:1:18:", "trailing comma"},
      {"{\n  \"time_f\": [1,\n    2 3]\n}", "c.json:3:7:", "expected ',' or ']' after time_f[1]"},
      {"{\"time_f\": [01]}", "c.json:1:13:", "may not start with 0"},
      {"{\"time_f\": [1.]}", "c.json:1:15:", "digit after the decimal point"},
      {"{\"time_f\": [.5]}", "c.json:1:13:", "time_f[0] must be a number"},
      {"{\"time_f\": [1e]}", "c.json:1:15:", "exponent"},
      {"{\"time_f\": [-]}", "c.json:1:13:", "expected a number"},
      {"{\"time_f\": [0x10]}", "c.json:1:14:", "expected ',' or ']'"},
      {"{\"time_f\": [inf]}", "c.json:1:13:", "time_f[0] must be a number"},
      {"{'time_f': [1]}", "c.json:1:2:", "expected a key"},
      {"{\"a\": tru}", "c.json:1:7:", "expected a value"},
      {"{\"a\" 1}", "c.json:1:6:", "expected ':'"},
      {"{\"a\": 1,}", "c.json:1:9:", "trailing comma"},
      {"{\"a\": 1 \"b\": 2}", "c.json:1:9:", "expected ',' or '}'"},
      {"{\"a\": [1 2]}", "c.json:1:10:", "expected ',' or ']'"},
      {"{\"a\": \"x\\q\"}", "c.json:1:9:", "bad escape"},
      {"{\"a\": \"\\u12\"}", "c.json:1:8:", "bad escape"},
      {"{\"a\": \"\\ud800x\"}", "c.json:1:8:", "surrogate"},
      {"{\"a\": \"tab\there\"}", "c.json:1:11:", "control character"},
      {"{\"a\": \"open", "c.json:1:7:", "not closed"},
      {"{\"a\": 1", "c.json:1:8:", "the end of the file"},
      {"{\"time_f\": [1], \"time_b\": [1], \"time_w\": [1]} {}", "c.json:1:47:", "after the object"},
      {"{\"a\": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]"
       "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
       "c.json:1:", "nested more than"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    zb__costs_t c;
    char err[512] = "";
    if (parse(cases[k].text, &c, err, sizeof err))
      fail_msg("case %zu (%s) parsed, expected an error", k, cases[k].text);
    if (strncmp(err, cases[k].where, strlen(cases[k].where)) != 0 || !strstr(err, cases[k].needle))
      fail_msg("case %zu (%s): message \"%s\", expected it to start with \"%s\" and contain \"%s\"",
               k, cases[k].text, err, cases[k].where, cases[k].needle);
  }
  /* A NUL byte is not JSON either, even after a complete object. */
  const char nul[] = "{\"time_f\": [1], \"time_b\": [1], \"time_w\": [1]}";
  zb__costs_t c;
  char err[512] = "";
  assert_int_equal(zb__costs_parse(nul, sizeof nul, "c.json", &c, err, sizeof err), 0);
  ASSERT_CONTAINS(err, "c.json:1:46: unexpected text after the object");
}

/* Well-formed JSON that breaks a rule of the format: the message names the key (and the index for
 * array values). */
static void test_bad_values_name_the_key(void **state) {
  (void)state;
  const char *ok3 = "\"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, 1]";
  const struct {
    const char *body, *needle;
  } cases[] = {
      {"\"time_f\": [1, -2], \"time_b\": [1, 1], \"time_w\": [1, 1]", "time_f[1] is -2"},
      {"\"time_f\": [1, 1], \"time_b\": [1, NaN], \"time_w\": [1, 1]", "time_b[1] is nan"},
      {"\"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [Infinity, 1]", "time_w[0] is inf"},
      {"\"time_f\": [1, 1e999], \"time_b\": [1, 1], \"time_w\": [1, 1]", "time_f[1] is inf"},
      {"\"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, -Infinity]", "time_w[1] is -inf"},
      {"\"time_f\": [1, \"2\"], \"time_b\": [1, 1], \"time_w\": [1, 1]", "time_f[1] must be a number"},
      {"\"time_f\": [1, null], \"time_b\": [1, 1], \"time_w\": [1, 1]", "time_f[1] must be a number"},
      {"\"time_f\": [], \"time_b\": [], \"time_w\": []", "\"time_f\" is empty"},
      {"\"time_f\": 1, \"time_b\": [1], \"time_w\": [1]", "\"time_f\" must be an array"},
      {"\"time_f\": null, \"time_b\": [1], \"time_w\": [1]", "\"time_f\" must be an array"},
      {"\"time_f\": [1, 1], \"time_b\": [1, 1]", "\"time_w\" is missing"},
      {"\"time_f\": [1, 1], \"time_w\": [1, 1]", "\"time_b\" is missing"},
      {"\"time_f\": [1, 1], \"time_b\": [1], \"time_w\": [1, 1]", "\"time_b\" has 1 values but \"time_f\" has 2"},
      {"\"time_bw\": [1, 2, 3], \"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, 1]", "\"time_bw\" has 3 values"},
      {"\"time_bw\": [1, -1], \"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, 1]", "time_bw[1] is -1"},
      {"\"mem_f_bytes\": [1e9], \"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, 1]", "\"mem_f_bytes\" has 1 values"},
      {"\"mem_f_bytes\": [-1, 1], \"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, 1]", "mem_f_bytes[0] is -1; sizes"},
      {"\"time_f\": [1, 1], \"time_f\": [1, 1], \"time_b\": [1, 1], \"time_w\": [1, 1]", "\"time_f\" appears twice"},
      {"\"format\": \"zbpp-schedule\", %s", "\"format\" is \"zbpp-schedule\""},
      {"\"format\": 1, %s", "\"format\" must be a string"},
      {"\"version\": 2, %s", "\"version\" is 2"},
      {"\"version\": \"1\", %s", "\"version\" must be a number"},
      {"\"unit\": \"s\", %s", "\"unit\" is \"s\""},
      {"\"ranks\": 0, %s", "\"ranks\" is 0"},
      {"\"ranks\": 1.5, %s", "\"ranks\" is 1.5"},
      {"\"chunks\": \"2\", %s", "\"chunks\" must be a whole number"},
      {"\"placement\": \"zigzag\", %s", "\"placement\" is \"zigzag\""},
      {"\"placement\": \"vvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvv\", %s",
       "\"placement\" is \"vvvv"},
      {"\"time_comm\": -0.5, %s", "\"time_comm\" is -0.5"},
      {"\"time_comm\": NaN, %s", "\"time_comm\" is nan"},
      {"\"w_share\": 1.5, %s", "\"w_share\" is 1.5"},
      {"\"ranks\": 3, \"chunks\": 1, %s", "\"ranks\": 3 times \"chunks\": 1 is 3 stages, but the per-stage arrays have 2"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char text[1024], body[768];
    snprintf(body, sizeof body, cases[k].body, ok3);
    snprintf(text, sizeof text, "{%s}", body);
    zb__costs_t c;
    char err[512] = "";
    if (parse(text, &c, err, sizeof err)) fail_msg("case %zu (%s) parsed, expected an error", k, text);
    if (strncmp(err, "c.json", 6) != 0 || !strstr(err, cases[k].needle))
      fail_msg("case %zu (%s): message \"%s\", expected the file name and \"%s\"", k, text, err,
               cases[k].needle);
  }
}

/* The file's metadata and stage count against the schedule's: the message gives both sides. */
static void test_shape_checks(void **state) {
  (void)state;
  zb__costs_t c;
  char err[512] = "";
  const char *text = "{\"ranks\": 2, \"chunks\": 2, \"placement\": \"v\", \"time_f\": [1, 1, 1, 3], "
                     "\"time_b\": [1, 1, 1, 3], \"time_w\": [1, 1, 1, 3]}";
  if (!parse(text, &c, err, sizeof err)) fail_msg("%s", err);
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 2, 2, ZB_PLACEMENT_V, "the command asks for", err, sizeof err), 1);
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 2, 2, -1, "the command asks for", err, sizeof err), 1);
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 4, 1, -1, "the command asks for", err, sizeof err), 0);
  ASSERT_CONTAINS(err, "c.json says \"ranks\": 2, but the command asks for p = 4");
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 2, 1, -1, "the command asks for", err, sizeof err), 0);
  ASSERT_CONTAINS(err, "c.json says \"chunks\": 2, but the command asks for v = 1");
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 2, 2, ZB_PLACEMENT_LOOP, "the command asks for", err, sizeof err), 0);
  ASSERT_CONTAINS(err, "c.json says \"placement\": \"v\", but the command asks for the \"loop\" placement");
  zb__costs_free(&c);

  /* Without metadata only the stage count is checked; the message gives both numbers. */
  if (!parse("{\"time_f\": [1, 1, 1, 3], \"time_b\": [1, 1, 1, 3], \"time_w\": [1, 1, 1, 3]}", &c, err, sizeof err))
    fail_msg("%s", err);
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 4, 1, ZB_PLACEMENT_LOOP, "x has", err, sizeof err), 1);
  assert_int_equal(zb__costs_check_shape(&c, "c.json", 2, 1, -1, "x has", err, sizeof err), 0);
  ASSERT_CONTAINS(err, "c.json has 4 stages");
  ASSERT_CONTAINS(err, "p * v = 2 * 1 = 2 stages");
  ASSERT_CONTAINS(err, "4 stages over p = 2 ranks is v = 2");
  zb__costs_free(&c);
}

/* ---- the tool -------------------------------------------------------------------------------------- */

/* zb-auto with a heavy last stage: the tool's JSON is the C API's for the same per-stage numbers,
 * byte for byte (times printed with %.17g, so every number was read exactly), for a loop (v = 1)
 * and a V (v = 2), with fused-backward times given (1F1B runs BW) and left out (B + W). */
static void test_schedule_matches_c_api(void **state) {
  (void)state;
  const struct {
    const char *kind;
    zb_kind_t k;
    int p, v, m, with_bw;
    const char *meta;
  } cases[] = {
      {"zb-auto", ZB_KIND_ZB_AUTO, 4, 1, 8, 0, "\"ranks\": 4, \"chunks\": 1, \"placement\": \"loop\", "},
      {"zb-auto", ZB_KIND_ZB_AUTO, 2, 2, 8, 0, "\"ranks\": 2, \"chunks\": 2, \"placement\": \"v\", "},
      {"zb-v", ZB_KIND_ZB_V, 2, 2, 6, 0, ""},
      {"1f1b", ZB_KIND_1F1B, 3, 1, 6, 1, "\"ranks\": 3, "},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    costs_t c = heavy_last(cases[k].p * cases[k].v);
    c.with_bw = cases[k].with_bw;
    char name[32], p[8], m[8], v[8];
    snprintf(name, sizeof name, "heavy%zu.json", k);
    snprintf(p, sizeof p, "%d", cases[k].p);
    snprintf(m, sizeof m, "%d", cases[k].m);
    snprintf(v, sizeof v, "%d", cases[k].v);
    const char *path = write_costs(name, &c, cases[k].meta);
    const char *args[] = {"schedule", cases[k].kind, "-p", p, "-m", m, "-v", v, "--stage-times", path, "--format", "json", NULL};
    run_t r = run_tool(args);
    if (r.rc != 0) fail_msg("%s -p %s: exit %d: %s", cases[k].kind, p, r.rc, r.err);
    zb_schedule_spec_t spec = zb_test_spec(cases[k].k, cases[k].p, cases[k].m, cases[k].v);
    char *want = c_api_json(spec, &c);
    assert_same_text(cases[k].kind, r.out, want);

    /* The costs mattered: the last rank's own work is a lower bound the cost must reach, and the
     * same command without the file gives another schedule. */
    double last = 0;
    for (int s = 0; s < c.S; s++) {
      int rank = s < cases[k].p ? s : 2 * cases[k].p - 1 - s; /* loop (v = 1) or V (v = 2) */
      if (rank == (cases[k].v == 1 ? cases[k].p - 1 : 0))
        last += cases[k].m * (c.f[s] + (c.with_bw ? c.bw[s] : c.b[s] + c.w[s]));
    }
    if (!(json_cost(r.out) >= last - 1e-9))
      fail_msg("%s: cost %.17g is below the busiest rank's work %.17g", cases[k].kind, json_cost(r.out), last);
    const char *plain[] = {"schedule", cases[k].kind, "-p", p, "-m", m, "-v", v, "--format", "json", NULL};
    run_t u = run_tool(plain);
    assert_int_equal(u.rc, 0);
    if (!strcmp(u.out, r.out)) fail_msg("%s: the cost file changed nothing", cases[k].kind);
    run_free(&u);
    run_free(&r);
    zb_free(want);
  }
}

/* The file's time_comm and w_share apply unless --comm / --w-share are given: the command line
 * wins. -v is left out: zb-v's default of 2 chunks is what the file describes. */
static void test_command_line_wins(void **state) {
  (void)state;
  costs_t c = heavy_last(4);
  const char *path = write_costs("comm.json", &c, "");
  const char *args[] = {"schedule", "zb-v", "-p", "2", "-m", "4", "--stage-times", path, "--comm", "0.75",
                        "--w-share", "0.625", "--format", "json", NULL};
  run_t r = run_tool(args);
  if (r.rc != 0) fail_msg("exit %d: %s", r.rc, r.err);
  costs_t given = c;
  given.comm = 0.75;
  given.w_share = 0.625;
  char *want = c_api_json(zb_test_spec(ZB_KIND_ZB_V, 2, 4, 2), &given);
  assert_same_text("--comm/--w-share over the file", r.out, want);
  ASSERT_CONTAINS(r.out, "\"w_share\": 0.625");
  zb_free(want);
  run_free(&r);
}

/* zbpp simulate FILE.csv --stage-times: the CSV's schedule under the file's costs, as the C API's
 * import gives it; a file that does not fit the CSV's shape is refused. */
static void test_simulate_with_stage_times(void **state) {
  (void)state;
  const char *csv = tmp_path("zbv.csv");
  const char *gen[] = {"schedule", "zb-v", "-p", "2", "-m", "4", "--format", "csv", "-o", csv, NULL};
  run_t g = run_tool(gen);
  if (g.rc != 0) fail_msg("exit %d: %s", g.rc, g.err);
  run_free(&g);
  costs_t c = heavy_last(4);
  const char *path = write_costs("sim.json", &c, "\"ranks\": 2, \"chunks\": 2, \"placement\": \"v\", ");
  const char *args[] = {"simulate", csv, "--stage-times", path, "--format", "json", NULL};
  run_t r = run_tool(args);
  if (r.rc != 0) fail_msg("exit %d: %s", r.rc, r.err);

  size_t len = 0;
  char *text = zb_test_read_file(csv, &len);
  assert_non_null(text);
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 2, 4, 2);
  spec.stage_time_f = c.f, spec.stage_time_b = c.b, spec.stage_time_w = c.w;
  spec.time_comm = c.comm, spec.w_share = c.w_share;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&s, ZB_FORMAT_CSV, text, len, &spec));
  char *want = NULL;
  ZB_ASSERT_OK(zb_schedule_export(s, ZB_FORMAT_JSON, &want, &len));
  assert_same_text("simulate --stage-times", r.out, want);
  zb_free(want);
  zb_schedule_destroy(s);
  free(text);
  run_free(&r);

  /* The CSV is a V over 2 ranks: a file for a loop, or for 3 ranks, does not fit it. */
  const char *loop = write_costs("sim_loop.json", &c, "\"placement\": \"loop\", ");
  const char *bad[] = {"simulate", csv, "--stage-times", loop, NULL};
  r = run_tool(bad);
  assert_int_equal(r.rc, 1);
  ASSERT_CONTAINS(r.err, "\"placement\": \"loop\"");
  ASSERT_CONTAINS(r.err, "zbv.csv has the \"v\" placement");
  assert_string_equal(r.out, "");
  run_free(&r);
  costs_t six = heavy_last(6);
  const char *three = write_costs("sim6.json", &six, "");
  bad[3] = three;
  r = run_tool(bad);
  assert_int_equal(r.rc, 1);
  ASSERT_CONTAINS(r.err, "sim6.json has 6 stages");
  ASSERT_CONTAINS(r.err, "p * v = 2 * 2 = 4 stages");
  run_free(&r);
}

/* Bad cost files and mismatches end in exit 1 (bad input, as for a bad CSV) with a message naming
 * the key, nothing on stdout; --times with --stage-times is a usage error (exit 2). */
static void test_tool_errors(void **state) {
  (void)state;
  const char *ok3 = "\"time_f\": [1, 1, 1, 1], \"time_b\": [1, 1, 1, 1], \"time_w\": [1, 1, 1, 1]";
  char body[512];
  const struct {
    const char *file, *kind, *p, *v, *needle, *needle2;
  } cases[] = {
      {"{\"time_f\": [1, 1, 1, -1], \"time_b\": [1, 1, 1, 1], \"time_w\": [1, 1, 1, 1]}", "zb-auto", "4", "1",
       "time_f[3]", "-1"},
      {"{\"time_f\": [1, 1, 1, 1], \"time_b\": [1, NaN, 1, 1], \"time_w\": [1, 1, 1, 1]}", "zb-auto", "4", "1",
       "time_b[1]", "nan"},
      {"{\"time_f\": [1, 1, 1, 1], \"time_b\": [1, 1, 1, 1]}", "zb-auto", "4", "1", "time_w", "missing"},
      {"{\"time_f\": [1, 1, 1, 1], \"time_b\": [1, 1, 1, 1], \"time_w\": [1, 1, 1]}", "zb-auto", "4", "1", "time_w",
       "3 values"},
      {"{\"format\": \"other\", %s}", "zb-auto", "4", "1", "format", "other"},
      {"{\"version\": 2, %s}", "zb-auto", "4", "1", "version", "2"},
      {"{\"w_share\": 2, %s}", "zb-auto", "4", "1", "w_share", "2"},
      {"{\"ranks\": 2, %s}", "zb-auto", "4", "1", "\"ranks\": 2", "p = 4"},
      {"{\"chunks\": 2, %s}", "zb-auto", "4", "1", "\"chunks\": 2", "v = 1"},
      {"{\"placement\": \"v\", %s}", "zb-h1", "4", "1", "\"placement\": \"v\"", "\"loop\""},
      {"{\"placement\": \"loop\", %s}", "zb-v", "2", "2", "\"placement\": \"loop\"", "\"v\""},
      {"{%s}", "zb-auto", "2", "1", "4 stages", "2 * 1 = 2"},
      {"{%s}", "zb-v", "4", "2", "4 stages", "4 * 2 = 8"},
      {"{\"time_f\": [1, 1, 1, 1],\n \"time_b\": [1 1, 1, 1]}", "zb-auto", "4", "1", ":2:15:", "after time_b[0], got a number"},
      {"", "zb-auto", "4", "1", ":1:1:", "expected '{'"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    snprintf(body, sizeof body, cases[k].file, ok3);
    char name[32];
    snprintf(name, sizeof name, "bad%zu.json", k);
    const char *path = write_file(name, body);
    const char *args[] = {"schedule", cases[k].kind, "-p", cases[k].p, "-m", "8", "-v", cases[k].v,
                          "--stage-times", path, NULL};
    run_t r = run_tool(args);
    if (r.rc != 1 || !strstr(r.err, cases[k].needle) || !strstr(r.err, cases[k].needle2) || *r.out)
      fail_msg("case %zu (%s): exit %d, stderr \"%s\"; expected exit 1, \"%s\" and \"%s\" on stderr "
               "and nothing on stdout",
               k, body, r.rc, r.err, cases[k].needle, cases[k].needle2);
    run_free(&r);
  }

  const char *missing[] = {"schedule", "zb-auto", "-p", "4", "-m", "8", "--stage-times",
                           tmp_path("no-such-file.json"), NULL};
  run_t r = run_tool(missing);
  assert_int_equal(r.rc, 1);
  ASSERT_CONTAINS(r.err, "no-such-file.json");
  run_free(&r);

  costs_t c = heavy_last(4);
  const char *path = write_costs("both.json", &c, "");
  const char *both[] = {"schedule", "zb-auto", "-p", "4", "-m", "8", "--times", "1,2,3", "--stage-times", path, NULL};
  r = run_tool(both);
  assert_int_equal(r.rc, 2);
  ASSERT_CONTAINS(r.err, "drop --times");
  assert_string_equal(r.out, "");
  run_free(&r);
  const char *no_value[] = {"schedule", "zb-auto", "-p", "4", "-m", "8", "--stage-times", NULL};
  r = run_tool(no_value);
  assert_int_equal(r.rc, 2);
  ASSERT_CONTAINS(r.err, "--stage-times");
  run_free(&r);

  const char *help[] = {"schedule", "--help", NULL};
  r = run_tool(help);
  assert_int_equal(r.rc, 0);
  ASSERT_CONTAINS(r.out, "--stage-times FILE");
  run_free(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_numbers_read_exactly),
      cmocka_unit_test(test_optional_and_unknown_keys),
      cmocka_unit_test(test_malformed_json_has_line_and_column),
      cmocka_unit_test(test_bad_values_name_the_key),
      cmocka_unit_test(test_shape_checks),
      cmocka_unit_test(test_schedule_matches_c_api),
      cmocka_unit_test(test_command_line_wins),
      cmocka_unit_test(test_simulate_with_stage_times),
      cmocka_unit_test(test_tool_errors),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
