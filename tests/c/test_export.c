/*
 * test_export.c - the export formats (text, CSV, JSON, Chrome trace, SVG) and the CSV import.
 *
 * Schedules are written out by hand here (1F1B, a split-backward variant, an interleaved loop and a
 * V), so these tests do not depend on the generators. Expected values come from the format
 * descriptions and DESIGN.md section 3 (unit times, no comm), never from running the exporters.
 *
 * What this is not: a test of validation or simulation rules; those have their own test files.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "schedule/internal.h"

/* ---- building schedules ------------------------------------------------------------------------ */

typedef struct {
  int p;
  zb_op_t *ops[8];
  int32_t count[8];
} lists_t;

static void lists_free(lists_t *l) {
  for (int r = 0; r < l->p; r++) free(l->ops[r]);
}

static void push(lists_t *l, int r, int type, int stage, int mb) {
  l->ops[r] = realloc(l->ops[r], (size_t)(l->count[r] + 1) * sizeof(zb_op_t));
  assert_non_null(l->ops[r]);
  l->ops[r][l->count[r]++] = (zb_op_t){type, stage, mb};
}

/* The backward of (stage, mb) on rank r: fused BW, or B followed at once by W when split. */
static void push_backward(lists_t *l, int r, int stage, int mb, int split) {
  if (split) {
    push(l, r, ZB_OP_B, stage, mb);
    push(l, r, ZB_OP_W, stage, mb);
  } else {
    push(l, r, ZB_OP_BW, stage, mb);
  }
}

/* 1F1B (PipeDream-flush) for p ranks and m microbatches: rank r warms up with p-1-r forwards, then
 * alternates one forward and one backward, then drains the backwards. */
static zb_schedule_t *make_1f1b(int p, int m, int split, lists_t *keep) {
  lists_t l = {.p = p};
  for (int r = 0; r < p; r++) {
    int warm = p - 1 - r < m ? p - 1 - r : m, f = 0, b = 0;
    while (f < warm) push(&l, r, ZB_OP_F, r, f++);
    while (f < m) {
      push(&l, r, ZB_OP_F, r, f++);
      push_backward(&l, r, r, b++, split);
    }
    while (b < m) push_backward(&l, r, r, b++, split);
  }
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, p, m, 1);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP,
                                           (const zb_op_t *const *)l.ops, l.count));
  if (keep)
    *keep = l;
  else
    lists_free(&l);
  return s;
}

/* A V over p = 2 ranks (stages 0..3; stage 2 on rank 1, stage 3 on rank 0), m = 2, fused backward:
 * the shape of the seed corpus file v_p2_m2.csv. */
static const char v_csv[] = "0F0,0F1,3F0,3B0,3F1,3B1,0B0,0B1\n1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1\n";

static zb_schedule_t *import_text(const char *text) {
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&s, ZB_FORMAT_CSV, text, strlen(text), NULL));
  return s;
}

static char *export_fmt(zb_schedule_t *s, zb_format_t f, size_t *len) {
  char *text = NULL;
  size_t n = 0;
  ZB_ASSERT_OK(zb_schedule_export(s, f, &text, &n));
  assert_non_null(text);
  assert_int_equal(strlen(text), n);
  if (len) *len = n;
  return text;
}

static int count_substr(const char *hay, const char *needle) {
  int n = 0;
  size_t k = strlen(needle);
  for (const char *p = strstr(hay, needle); p; p = strstr(p + k, needle)) n++;
  return n;
}

static int total_ops(const zb_schedule_t *s) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  int total = 0;
  for (int r = 0; r < info.ranks; r++) {
    const zb_op_t *ops;
    int32_t n;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &ops, &n));
    total += n;
  }
  return total;
}

/* ---- a minimal JSON syntax check (RFC 8259 grammar, no semantics) ------------------------------ */

static const char *json_value(const char *p);

static const char *json_ws(const char *p) {
  while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
  return p;
}

static const char *json_string(const char *p) {
  if (*p != '"') return NULL;
  for (p++; *p && *p != '"'; p++) {
    if ((unsigned char)*p < 0x20) return NULL;
    if (*p == '\\' && !*++p) return NULL;
  }
  return *p == '"' ? p + 1 : NULL;
}

static const char *json_value(const char *p) {
  p = json_ws(p);
  if (*p == '{' || *p == '[') {
    char close = *p == '{' ? '}' : ']';
    p = json_ws(p + 1);
    if (*p == close) return p + 1;
    for (;;) {
      if (close == '}') {
        p = json_string(json_ws(p));
        if (!p) return NULL;
        p = json_ws(p);
        if (*p++ != ':') return NULL;
      }
      p = json_value(p);
      if (!p) return NULL;
      p = json_ws(p);
      if (*p == close) return p + 1;
      if (*p++ != ',') return NULL;
    }
  }
  if (*p == '"') return json_string(p);
  if (!strncmp(p, "null", 4) || !strncmp(p, "true", 4)) return p + 4;
  if (!strncmp(p, "false", 5)) return p + 5;
  char *end;
  strtod(p, &end);
  /* strtod also takes "nan", "inf" and hex; JSON does not. */
  if (end == p || strchr("nNiIxX", p[1 + (*p == '-')]) != NULL) return NULL;
  return end;
}

static void assert_json(const char *text) {
  const char *end = json_value(text);
  if (!end || *json_ws(end) != '\0') fail_msg("not valid JSON near offset %ld:\n%s",
                                               end ? (long)(end - text) : -1L, text);
}

/* ---- sbuf --------------------------------------------------------------------------------------- */

static void test_sbuf_grows_and_terminates(void **state) {
  (void)state;
  zb__sbuf_t b = {0};
  for (int i = 0; i < 5000; i++) zb__sbuf_printf(&b, "%04d,", i % 10000);
  zb__sbuf_putc(&b, 'x');
  char *out = NULL;
  size_t len = 0;
  assert_int_equal(zb__sbuf_finish(&b, &out, &len), ZB_OK);
  assert_int_equal(len, 5000 * 5 + 1);
  assert_int_equal(strlen(out), len);
  assert_memory_equal(out + 5 * 4321, "4321,", 5);
  assert_int_equal(out[len - 1], 'x');
  free(out);

  zb__sbuf_t empty = {0};
  assert_int_equal(zb__sbuf_finish(&empty, &out, &len), ZB_OK);
  assert_string_equal(out, "");
  assert_int_equal(len, 0);
  free(out);
}

/* ---- CSV ---------------------------------------------------------------------------------------- */

static void assert_same_ops(const zb_schedule_t *a, const zb_schedule_t *b) {
  zb_schedule_info_t ia, ib;
  ZB_ASSERT_OK(zb_schedule_get_info(a, &ia));
  ZB_ASSERT_OK(zb_schedule_get_info(b, &ib));
  assert_int_equal(ia.ranks, ib.ranks);
  assert_int_equal(ia.chunks, ib.chunks);
  assert_int_equal(ia.microbatches, ib.microbatches);
  assert_int_equal(ia.placement, ib.placement);
  for (int r = 0; r < ia.ranks; r++) {
    const zb_op_t *oa, *ob;
    int32_t na, nb;
    ZB_ASSERT_OK(zb_schedule_rank_ops(a, r, &oa, &na));
    ZB_ASSERT_OK(zb_schedule_rank_ops(b, r, &ob, &nb));
    assert_int_equal(na, nb);
    for (int k = 0; k < na; k++) {
      assert_int_equal(oa[k].type, ob[k].type);
      assert_int_equal(oa[k].stage, ob[k].stage);
      assert_int_equal(oa[k].mb, ob[k].mb);
    }
  }
}

static void round_trip(zb_schedule_t *s) {
  size_t n1, n2;
  char *first = export_fmt(s, ZB_FORMAT_CSV, &n1);
  zb_schedule_t *again = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&again, ZB_FORMAT_CSV, first, n1, NULL));
  assert_same_ops(s, again);
  char *second = export_fmt(again, ZB_FORMAT_CSV, &n2);
  assert_string_equal(first, second);
  zb_free(first);
  zb_free(second);
  zb_schedule_destroy(again);
}

static void test_csv_writes_torch_letters(void **state) {
  (void)state;
  /* 1F1B, p = 2, m = 2 with fused backward: torch writes our BW as B. */
  zb_schedule_t *s = make_1f1b(2, 2, 0, NULL);
  char *csv = export_fmt(s, ZB_FORMAT_CSV, NULL);
  assert_string_equal(csv, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
  zb_free(csv);
  zb_schedule_destroy(s);
  /* Split backward: our B is torch's I. */
  s = make_1f1b(2, 2, 1, NULL);
  csv = export_fmt(s, ZB_FORMAT_CSV, NULL);
  assert_string_equal(csv, "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n");
  zb_free(csv);
  zb_schedule_destroy(s);
}

static void test_csv_round_trip(void **state) {
  (void)state;
  for (int p = 2; p <= 3; p++)
    for (int split = 0; split <= 1; split++) {
      zb_schedule_t *s = make_1f1b(p, 4, split, NULL);
      ZB_ASSERT_OK(zb_schedule_validate(s));
      round_trip(s);
      zb_schedule_destroy(s);
    }
  zb_schedule_t *v = import_text(v_csv);
  round_trip(v);
  zb_schedule_destroy(v);
  /* A rank with no ops in the middle is an empty line, and stays one. */
  zb_schedule_t *gap = import_text("0F0\n\n2F0\n");
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(gap, &info));
  assert_int_equal(info.ranks, 3);
  char *csv = export_fmt(gap, ZB_FORMAT_CSV, NULL);
  assert_string_equal(csv, "0F0\n\n2F0\n");
  zb_free(csv);
  round_trip(gap);
  zb_schedule_destroy(gap);
}

/* torch's compute_comms form: each op followed by its send, each receive before the op that needs
 * it and in the order the peer sent, REDUCE_GRAD after a stage's last backward; read back, the
 * transfers drop out and the ops are the same. */
static void test_csv_comms_export(void **state) {
  (void)state;
  zb_schedule_t *s = import_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
  char *text = export_fmt(s, ZB_FORMAT_CSV_COMMS, NULL);
  /* Unit times: rank 0's F0 ends at 1, F1 at 2; rank 1 runs F0 from 1, B0 from 2 to 4, F1 from 4,
   * B1 from 5. So RECV_F1 (sent at 2) goes before rank 1's B0 (start 2); rank 0 gets B0's gradient
   * at 4 and B1's at 7, before its own B0 (start 4) and B1 (start 7). */
  assert_string_equal(text,
                      "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD\n"
                      "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD\n");
  zb_schedule_t *back = import_text(text);
  for (int r = 0; r < 2; r++) {
    const zb_op_t *a, *b;
    int32_t na, nb;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &a, &na));
    ZB_ASSERT_OK(zb_schedule_rank_ops(back, r, &b, &nb));
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, (size_t)na * sizeof *a);
  }
  zb_free(text);
  zb_schedule_destroy(back);
  zb_schedule_destroy(s);
  zb_format_t fmt;
  ZB_ASSERT_OK(zb_format_from_name("csv-comms", &fmt));
  assert_int_equal(fmt, ZB_FORMAT_CSV_COMMS);
}

static void test_csv_import_torch_style(void **state) {
  (void)state;
  /* torch's own dump: idle steps as empty cells, I for input-grad, CRLF, spaces, no final newline,
   * and a buffer that is not NUL-terminated (an exact-size copy, so ASan sees any over-read). */
  const char text[] = ",0F0, 0F1 ,,0I0,0W0,0I1,0W1\r\n,1F0,1I0,1F1,1I1,1W0,1W1,\r\n\r\n";
  size_t n = sizeof text - 1;
  char *exact = malloc(n);
  assert_non_null(exact);
  memcpy(exact, text, n);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&s, ZB_FORMAT_CSV, exact, n, NULL));
  free(exact);
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.kind, ZB_KIND_CUSTOM);
  assert_int_equal(info.ranks, 2);
  assert_int_equal(info.chunks, 1);
  assert_int_equal(info.microbatches, 2);
  assert_int_equal(info.placement, ZB_PLACEMENT_LOOP);
  const zb_op_t *ops;
  int32_t count;
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 0, &ops, &count));
  assert_int_equal(count, 6);
  assert_int_equal(ops[1].type, ZB_OP_F);
  assert_int_equal(ops[1].mb, 1);
  assert_int_equal(ops[2].type, ZB_OP_B); /* torch I */
  assert_int_equal(ops[3].type, ZB_OP_W);
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 1, &ops, &count));
  assert_int_equal(count, 6);
  assert_int_equal(ops[0].stage, 1);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_sim_result_t res;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &res));
  /* Unit times: rank 1 runs 1F0 1I0 1F1 1I1 1W0 1W1 back to back from 1 to 7; rank 0's 0I0 waits
   * for 1I0 (ends at 3), so rank 0 runs 0F0 0F1 . 0I0 0W0 0I1 0W1 from 0 to 7: the cost is 7. */
  assert_float_equal(res.cost, 7.0, 1e-12);
  zb_schedule_destroy(s);

  /* torch's B is a full backward: our BW. */
  s = import_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1");
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 1, &ops, &count));
  assert_int_equal(ops[1].type, ZB_OP_BW);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  ZB_ASSERT_OK(zb_schedule_simulate(s, &res));
  zb_schedule_destroy(s);

  /* Placement: a V when stage p sits on rank p-1, a loop otherwise. */
  s = import_text(v_csv);
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.chunks, 2);
  assert_int_equal(info.placement, ZB_PLACEMENT_V);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_schedule_destroy(s);
  s = import_text("0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\n");
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.placement, ZB_PLACEMENT_LOOP);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_schedule_destroy(s);

  /* Rows whose stages fit no loop or V but one rank each (torch's unbalanced custom stage ids):
   * an explicit map, 3 stages on rank 0 and 2 on rank 1, that validates and simulates. */
  s = import_text("0F0,1F0,4F0,4B0,1B0,0B0\n2F0,3F0,3B0,2B0\n");
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_int_equal(info.placement, ZB_PLACEMENT_CUSTOM);
  assert_int_equal(info.stages, 5);
  assert_int_equal(info.chunks, 3);
  int32_t owner;
  ZB_ASSERT_OK(zb_schedule_stage_rank(s, 4, &owner));
  assert_int_equal(owner, 0);
  ZB_ASSERT_OK(zb_schedule_stage_rank(s, 3, &owner));
  assert_int_equal(owner, 1);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  ZB_ASSERT_OK(zb_schedule_simulate(s, &res));
  /* Unit per-rank times split among each rank's stages: rank 0's three stages cost 1/3 each, rank 1's
   * two 1/2 each; one microbatch's chain is F 1/3+1/3+1/2+1/2+1/3, then the backwards (2x each). */
  assert_float_equal(res.cost, 3 * (1.0 / 3 + 1.0 / 3 + 0.5 + 0.5 + 1.0 / 3), 1e-12);
  zb_schedule_destroy(s);

  /* torch's compute_comms form (what its _add_send_recv writes): the transfers are skipped and the
   * compute ops are those of the compute-only form, in order. An OVERLAP_F_B pair gives its actions
   * one after the other. */
  s = import_text("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                  "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,(1F1;1B1)OVERLAP_F_B,1SEND_B1\n");
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 0, &ops, &count));
  assert_int_equal(count, 4);
  assert_int_equal(ops[2].type, ZB_OP_BW);
  ZB_ASSERT_OK(zb_schedule_rank_ops(s, 1, &ops, &count));
  assert_int_equal(count, 4);
  assert_int_equal(ops[2].type, ZB_OP_F);
  assert_int_equal(ops[2].mb, 1);
  assert_int_equal(ops[3].type, ZB_OP_BW);
  assert_int_equal(ops[3].mb, 1);
  ZB_ASSERT_OK(zb_schedule_validate(s));
  zb_schedule_destroy(s);
}

static void test_csv_import_takes_costs_from_spec(void **state) {
  (void)state;
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.time_f = 2;
  spec.w_share = 0.25;
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&s, ZB_FORMAT_CSV, "0F0,0B0\n", 8, &spec));
  double t;
  ZB_ASSERT_OK(zb_schedule_op_time(s, ZB_OP_F, 0, &t));
  assert_float_equal(t, 2.0, 0);
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  assert_float_equal(info.w_share, 0.25, 0);
  zb_schedule_destroy(s);

  /* Per-stage times must describe the CSV's stages, or they would be read out of bounds. */
  const double per_stage[1] = {1.0};
  spec.stage_time_f = per_stage;
  spec.ranks = 1;
  spec.chunks = 1;
  assert_int_equal(zb_schedule_import(&s, ZB_FORMAT_CSV, "0F0,1F0\n", 8, &spec),
                   ZB_ERR_INVALID_ARGUMENT);
  assert_null(s);
  ASSERT_CONTAINS(zb_last_error(), "stage_time");
}

typedef struct {
  const char *text;
  const char *needle1, *needle2;
} bad_case_t;

static void test_csv_import_rejects_bad_input(void **state) {
  (void)state;
  const bad_case_t cases[] = {
      {"0F0,0F\n", "row 1 (rank 0), column 2", "0F"},
      {"0F0\n1F0,F1\n", "row 2", "<stage><type><microbatch>"},
      {"0F0,abc\n", "row 1", "'abc'"},
      {"0F0\n0F1\r\n0Q1\r\n", "row 3", "'Q'"},
      {"0f0\n", "row 1", "type 'f'"},
      {"0F0,0F1 2\n", "row 1", "column 2"},
      {"99999999999999999999999999F0\n", "row 1", "1000000"},
      {"0F0\n0F1000001\n", "row 2", "1000000"},
      {"0F0,(0F1;0SEND_F0)OVERLAP_F_B\n", "row 1", "inside an OVERLAP_F_B"},
      {"0F0,(0F1;0B0)OVERLAP\n", "column 2", "not a pair"},
      {"0F0,()OVERLAP_F_B\n", "column 2", "empty OVERLAP_F_B"},
      {"0UNSHARD,0F0\n", "row 1", "UNSHARD"},
      {"0F0,0B0,0RESHARD\n", "column 3", "FSDP"},
      {"0F0,(0B0;0REDUCE_GRAD)OVERLAP_F_B\n", "column 2", "REDUCE_GRAD inside"},
      {"0F0,2F0\n1F0,2F0\n", "3 stages", "one row per rank"}, /* stage 2 on both rows: no map */
      {"\"0F0\"\n", "row 1", "F, I, B and W"},
      {"", "empty schedule", NULL},
      {"\n \r\n\n", "empty schedule", NULL},
      {",,\n,\n", "empty schedule", NULL},
      {"65536F0\n", "65537 stages", NULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    zb_schedule_t *s = (zb_schedule_t *)&s; /* must be reset to NULL on failure */
    zb_status_t st = zb_schedule_import(&s, ZB_FORMAT_CSV, cases[i].text, strlen(cases[i].text), NULL);
    if (st != ZB_ERR_PARSE)
      fail_msg("case %zu (\"%s\"): status %s, expected %s; message: %s", i, cases[i].text,
               zb_status_string(st), zb_status_string(ZB_ERR_PARSE), zb_last_error());
    assert_null(s);
    ASSERT_CONTAINS(zb_last_error(), cases[i].needle1);
    if (cases[i].needle2) ASSERT_CONTAINS(zb_last_error(), cases[i].needle2);
  }

  /* Never read past len: "0F0" cut to 2 bytes is the truncated cell "0F". */
  zb_schedule_t *s = NULL;
  assert_int_equal(zb_schedule_import(&s, ZB_FORMAT_CSV, "0F0", 2, NULL), ZB_ERR_PARSE);
  ASSERT_CONTAINS(zb_last_error(), "row 1");

  /* More rows than ranks we support. */
  size_t rows = 65537;
  char *many = malloc(rows * 4 + 1);
  assert_non_null(many);
  for (size_t r = 0; r < rows; r++) memcpy(many + 4 * r, "0F0\n", 4);
  assert_int_equal(zb_schedule_import(&s, ZB_FORMAT_CSV, many, rows * 4, NULL), ZB_ERR_PARSE);
  ASSERT_CONTAINS(zb_last_error(), "row 65537");
  free(many);

  /* A duplicate op parses (it is well-formed CSV) and the validator names it. */
  s = import_text("0F0,0F0,0B0\n");
  assert_int_equal(zb_schedule_validate(s), ZB_ERR_INVALID_SCHEDULE);
  zb_schedule_destroy(s);
}

static void test_csv_export_refuses_unreadable_ops(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_CUSTOM, 1, 1, 1);
  const zb_op_t ops[2] = {{ZB_OP_F, 0, 0}, {ZB_OP_BW, -1, 0}};
  const zb_op_t *lists[1] = {ops};
  const int32_t counts[1] = {2};
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create_from_ops(&s, &spec, ZB_PLACEMENT_LOOP, lists, counts));
  char *text = (char *)"unchanged";
  assert_int_equal(zb_schedule_export(s, ZB_FORMAT_CSV, &text, NULL), ZB_ERR_INVALID_SCHEDULE);
  assert_null(text);
  ASSERT_CONTAINS(zb_last_error(), "rank 0, position 1");
  zb_schedule_destroy(s);
}

/* ---- JSON --------------------------------------------------------------------------------------- */

/* Counts the "op" objects in each rank's array of "schedule"; returns the number of ranks seen. */
static int json_ops_per_rank(const char *json, int *counts, int max_ranks) {
  const char *p = strstr(json, "\"schedule\": [");
  assert_non_null(p);
  p += strlen("\"schedule\": [");
  int rank = -1, depth = 0;
  for (; *p; p++) {
    if (*p == '[') {
      depth++;
      if (depth == 1) {
        rank++;
        assert_true(rank < max_ranks);
        counts[rank] = 0;
      }
    } else if (*p == ']') {
      if (depth == 0) break; /* the end of "schedule" */
      depth--;
    } else if (depth == 1 && !strncmp(p, "\"op\"", 4)) {
      counts[rank]++;
    }
  }
  return rank + 1;
}

static double json_number(const char *json, const char *key) {
  const char *p = strstr(json, key);
  if (!p) fail_msg("no key %s in:\n%s", key, json);
  return strtod(p + strlen(key), NULL);
}

static void test_json_shape(void **state) {
  (void)state;
  lists_t l;
  zb_schedule_t *s = make_1f1b(3, 4, 1, &l);
  size_t len;
  char *json = export_fmt(s, ZB_FORMAT_JSON, &len);
  assert_json(json);
  const char *keys[] = {"{\"kind\": \"custom\"", "\"ranks\": 3,", "\"chunks\": 1,",
                        "\"stages\": 3,", "\"microbatches\": 4,", "\"placement\": \"loop\",",
                        "\"w_share\": 0.5,", "\"mem_limit\": null,", "\"schedule\": [",
                        "\"cost\": ", "\"bubble_rate\": ", "\"peak_memory\": ["};
  const char *prev = json;
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    const char *at = strstr(json, keys[i]);
    if (!at) fail_msg("JSON lacks %s:\n%s", keys[i], json);
    /* The keys come in the documented order. */
    if (at < prev) fail_msg("JSON key %s is out of order:\n%s", keys[i], json);
    prev = at;
  }
  int counts[8];
  assert_int_equal(json_ops_per_rank(json, counts, 8), 3);
  for (int r = 0; r < 3; r++) assert_int_equal(counts[r], l.count[r]);
  assert_int_equal(count_substr(json, "\"op\": \"B\""), 12);
  assert_int_equal(count_substr(json, "\"op\": \"W\""), 12);
  /* Unit times: rank 1's first forward waits for rank 0's, so it runs from 1 to 2. */
  ASSERT_CONTAINS(json, "{\"op\": \"F\", \"stage\": 1, \"mb\": 0, \"start\": 1, \"end\": 2}");
  zb_sim_result_t res;
  ZB_ASSERT_OK(zb_schedule_simulate(s, &res));
  assert_float_equal(json_number(json, "\"cost\": "), res.cost, 0);
  assert_float_equal(json_number(json, "\"bubble_rate\": "), res.bubble_rate, 0);
  /* 1F1B's peak on rank 0 is p (DESIGN.md section 3). */
  assert_float_equal(json_number(json, "\"peak_memory\": ["), 3.0, 1e-12);
  zb_free(json);
  zb_schedule_destroy(s);

  /* A memory limit is a number; the V schedule says "v". */
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.mem_limit = 2.5;
  s = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&s, ZB_FORMAT_CSV, v_csv, strlen(v_csv), &spec));
  json = export_fmt(s, ZB_FORMAT_JSON, NULL);
  assert_json(json);
  ASSERT_CONTAINS(json, "\"mem_limit\": 2.5,");
  ASSERT_CONTAINS(json, "\"placement\": \"v\",");
  ASSERT_CONTAINS(json, "\"stages\": 4,");
  ASSERT_CONTAINS(json, "\"op\": \"BW\"");
  assert_int_equal(json_ops_per_rank(json, counts, 8), 2);
  assert_int_equal(counts[0], 8);
  assert_int_equal(counts[1], 8);
  zb_free(json);
  zb_schedule_destroy(s);
  lists_free(&l);
}

/* ---- Chrome trace ------------------------------------------------------------------------------- */

static void test_chrome_trace(void **state) {
  (void)state;
  zb_schedule_t *s = make_1f1b(3, 4, 0, NULL);
  char *trace = export_fmt(s, ZB_FORMAT_CHROME, NULL);
  assert_json(trace);
  assert_int_equal(count_substr(trace, "\"ph\": \"X\""), total_ops(s));
  assert_int_equal(count_substr(trace, "\"name\": \"thread_name\""), 3);
  ASSERT_CONTAINS(trace, "\"name\": \"zbpp custom\"");
  ASSERT_CONTAINS(trace, "\"name\": \"rank 2\"");
  ASSERT_CONTAINS(trace, "\"displayTimeUnit\": \"ms\"");
  /* Times in microseconds: rank 1's F0 runs from 1 ms to 2 ms. */
  ASSERT_CONTAINS(trace, "{\"name\": \"F0\", \"cat\": \"F\", \"ph\": \"X\", \"ts\": 1000, \"dur\": "
                         "1000, \"pid\": 0, \"tid\": 1, \"args\": {\"stage\": 1, \"mb\": 0, "
                         "\"chunk\": 0}}");
  zb_free(trace);
  zb_schedule_destroy(s);

  s = import_text(v_csv);
  trace = export_fmt(s, ZB_FORMAT_CHROME, NULL);
  assert_json(trace);
  assert_int_equal(count_substr(trace, "\"ph\": \"X\""), 16);
  /* Stage 3 is chunk 1 of rank 0 in the V. */
  ASSERT_CONTAINS(trace, "\"tid\": 0, \"args\": {\"stage\": 3, \"mb\": 0, \"chunk\": 1}");
  zb_free(trace);
  zb_schedule_destroy(s);
}

/* ---- SVG ---------------------------------------------------------------------------------------- */

static void test_svg(void **state) {
  (void)state;
  for (int split = 0; split <= 1; split++) {
    zb_schedule_t *s = make_1f1b(3, 4, split, NULL);
    size_t len;
    char *svg = export_fmt(s, ZB_FORMAT_SVG, &len);
    assert_memory_equal(svg, "<svg", 4);
    assert_true(len > 7);
    assert_string_equal(svg + len - 7, "</svg>\n");
    int n = total_ops(s);
    assert_int_equal(count_substr(svg, "<rect class=\"op\""), n);
    /* Besides the ops: one background and one legend swatch per op type used (F and BW, or F, B, W). */
    assert_int_equal(count_substr(svg, "<rect class=\"key\""), split ? 3 : 2);
    assert_int_equal(count_substr(svg, "<rect"), n + 1 + (split ? 3 : 2));
    for (int r = 0; r < 3; r++) {
      char label[16];
      snprintf(label, sizeof label, ">rank %d<", r);
      ASSERT_CONTAINS(svg, label);
    }
    ASSERT_CONTAINS(svg, "custom");
    /* Every number is finite: printf writes NaN and infinity as nan/inf (with an optional '-'). */
    const char *bad[] = {"\"nan", "\"-nan", "\"inf", "\"-inf", ">nan", ">-nan", ">inf", ">-inf"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) assert_null(strstr(svg, bad[i]));
    assert_int_equal(count_substr(svg, "<"), count_substr(svg, ">"));
    zb_free(svg);
    zb_schedule_destroy(s);
  }
}

/* ---- text --------------------------------------------------------------------------------------- */

/* Checks one line per rank and one type letter per op in each rank's grid; returns the number of
 * ops a "(truncated: N more ops" note says were left out, summed over ranks. */
static int check_text_grid(zb_schedule_t *s, const char *text) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  ASSERT_CONTAINS(text, "legend:");
  int rank_lines = 0, cut_total = 0;
  for (const char *line = text; *line; line = strchr(line, '\n') + 1) {
    const char *eol = strchr(line, '\n');
    assert_non_null(eol);
    if (strncmp(line, "rank ", 5) != 0) continue;
    int r = atoi(line + 5);
    assert_int_equal(r, rank_lines);
    rank_lines++;
    const char *a = strchr(line, '|'), *b = a ? strchr(a + 1, '|') : NULL;
    assert_true(a && b && b < eol);
    int letters = 0;
    for (const char *c = a + 1; c < b; c++) letters += strchr("FBWXfbwx", *c) != NULL && *c != '\0';
    const zb_op_t *ops;
    int32_t n;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &ops, &n));
    const char *cut = strstr(line, "(truncated: ");
    int left = cut && cut < eol ? atoi(cut + strlen("(truncated: ")) : 0;
    assert_int_equal(letters + left, n);
    cut_total += left;
  }
  assert_int_equal(rank_lines, info.ranks);
  return cut_total;
}

static void test_text_grid(void **state) {
  (void)state;
  zb_schedule_t *s = make_1f1b(3, 4, 0, NULL);
  char *text = export_fmt(s, ZB_FORMAT_TEXT, NULL);
  assert_int_equal(check_text_grid(s, text), 0);
  /* Unit times, fused BW of length 2: rank 0 of 1F1B p=3 m=4 starts F0 F1 F2, then waits. */
  ASSERT_CONTAINS(text, "rank  0 |F0-F1-F2-");
  ASSERT_CONTAINS(text, "X0----");
  assert_null(strstr(text, "lower case"));
  zb_free(text);
  zb_schedule_destroy(s);

  /* Chunk 1 of a V in lower case, and the legend says so. */
  s = import_text(v_csv);
  text = export_fmt(s, ZB_FORMAT_TEXT, NULL);
  assert_int_equal(check_text_grid(s, text), 0);
  ASSERT_CONTAINS(text, "lower case");
  ASSERT_CONTAINS(text, "f0");
  ASSERT_CONTAINS(text, "x1");
  zb_free(text);
  zb_schedule_destroy(s);

  /* Longer than a terminal: scaled toward 200 columns, one column per op at least, and a line that
   * still does not fit is cut with a note rather than losing ops silently. */
  s = make_1f1b(2, 1500, 1, NULL);
  text = export_fmt(s, ZB_FORMAT_TEXT, NULL);
  int cut = check_text_grid(s, text);
  assert_true(cut > 0);
  zb_free(text);
  zb_schedule_destroy(s);
  s = make_1f1b(2, 60, 0, NULL);
  text = export_fmt(s, ZB_FORMAT_TEXT, NULL);
  assert_int_equal(check_text_grid(s, text), 0);
  zb_free(text);
  zb_schedule_destroy(s);

  /* Zero-time ops (W costs nothing here) still get a column each. */
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.time_w = 0;
  const char *split = "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n";
  s = NULL;
  ZB_ASSERT_OK(zb_schedule_import(&s, ZB_FORMAT_CSV, split, strlen(split), &spec));
  text = export_fmt(s, ZB_FORMAT_TEXT, NULL);
  assert_int_equal(check_text_grid(s, text), 0);
  zb_free(text);
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sbuf_grows_and_terminates),
      cmocka_unit_test(test_csv_writes_torch_letters),
      cmocka_unit_test(test_csv_round_trip),
      cmocka_unit_test(test_csv_comms_export),
      cmocka_unit_test(test_csv_import_torch_style),
      cmocka_unit_test(test_csv_import_takes_costs_from_spec),
      cmocka_unit_test(test_csv_import_rejects_bad_input),
      cmocka_unit_test(test_csv_export_refuses_unreadable_ops),
      cmocka_unit_test(test_json_shape),
      cmocka_unit_test(test_chrome_trace),
      cmocka_unit_test(test_svg),
      cmocka_unit_test(test_text_grid),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
