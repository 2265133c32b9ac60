/*
 * export_json.c - the zbpp JSON shape and the Chrome trace (Perfetto / chrome://tracing) of a
 * simulated schedule.
 *
 * The JSON shape is a contract other tools read (the Python binding, plotting scripts):
 *   {"kind", "ranks", "chunks", "stages", "microbatches", "placement", "w_share", "mem_limit",
 *    "schedule": [[{"op", "stage", "mb", "start", "end"}, ...] per rank], "cost", "bubble_rate",
 *    "peak_memory": [per rank]}
 * Keys keep this order and names; add new keys at the end rather than change these.
 *
 * What this is not: a JSON library or a reader. Numbers are written with %.17g so they read back
 * to the same double; a value that is not finite is written as null, since JSON has no NaN or inf.
 */
#include <math.h>
#include <stdio.h>

#include "internal.h"

static void put_num(zb__sbuf_t *b, double x) {
  if (isfinite(x))
    zb__sbuf_printf(b, "%.17g", x);
  else
    zb__sbuf_printf(b, "null");
}

/* A JSON string literal. Our strings are fixed ASCII names, but escaping keeps the output valid
 * whatever a future kind name holds. */
static void put_str(zb__sbuf_t *b, const char *str) {
  zb__sbuf_putc(b, '"');
  for (const unsigned char *c = (const unsigned char *)(str ? str : ""); *c; c++) {
    if (*c == '"' || *c == '\\') {
      zb__sbuf_putc(b, '\\');
      zb__sbuf_putc(b, (char)*c);
    } else if (*c < 0x20) {
      zb__sbuf_printf(b, "\\u%04x", *c);
    } else {
      zb__sbuf_putc(b, (char)*c);
    }
  }
  zb__sbuf_putc(b, '"');
}

static int has_copies(const zb_schedule_t *s) {
  for (int k = 0; k < s->n_ops; k++)
    if (zb__op_is_copy(s->ops[k].type)) return 1;
  return 0;
}

static int rank_has_copies(const zb_schedule_t *s, int r) {
  for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++)
    if (zb__op_is_copy(s->ops[k].type)) return 1;
  return 0;
}

zb_status_t zb__export_json(const zb_schedule_t *s, char **out, size_t *len) {
  zb__sbuf_t b = {0};
  zb__sbuf_printf(&b, "{\"kind\": ");
  put_str(&b, zb_kind_name(s->kind));
  zb__sbuf_printf(&b, ", \"ranks\": %d, \"chunks\": %d, \"stages\": %d, \"microbatches\": %d, "
                      "\"placement\": \"%s\", \"w_share\": ",
                  s->p, s->v, s->S, s->m, zb__placement_name(s->placement));
  put_num(&b, s->w_share);
  zb__sbuf_printf(&b, ", \"mem_limit\": ");
  if (s->mem_limit > 0)
    put_num(&b, s->mem_limit);
  else
    zb__sbuf_printf(&b, "null");
  zb__sbuf_printf(&b, ",\n \"schedule\": [");
  for (int r = 0; r < s->p; r++) {
    zb__sbuf_printf(&b, "%s\n  [", r ? "," : "");
    for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) {
      const zb_op_t *op = &s->ops[k];
      zb__sbuf_printf(&b, "%s{\"op\": \"%s\", \"stage\": %d, \"mb\": %d, \"start\": ",
                      k > s->rank_off[r] ? ", " : "", zb__op_name(op->type), (int)op->stage,
                      (int)op->mb);
      put_num(&b, s->start[k]);
      zb__sbuf_printf(&b, ", \"end\": ");
      put_num(&b, s->end[k]);
      zb__sbuf_putc(&b, '}');
    }
    zb__sbuf_putc(&b, ']');
  }
  zb__sbuf_printf(&b, "\n ],\n \"cost\": ");
  put_num(&b, s->sim.cost);
  zb__sbuf_printf(&b, ", \"bubble_rate\": ");
  put_num(&b, s->sim.bubble_rate);
  zb__sbuf_printf(&b, ", \"peak_memory\": [");
  for (int r = 0; r < s->p; r++) {
    if (r) zb__sbuf_printf(&b, ", ");
    put_num(&b, s->peak[r]);
  }
  zb__sbuf_putc(&b, ']');
  if (has_copies(s)) { /* what the OFFLOADs hold in host memory at once, per rank */
    zb__sbuf_printf(&b, ", \"host_peak_memory\": [");
    for (int r = 0; r < s->p; r++) {
      if (r) zb__sbuf_printf(&b, ", ");
      put_num(&b, s->host_peak[r]);
    }
    zb__sbuf_putc(&b, ']');
  }
  zb__sbuf_printf(&b, "}\n");
  return zb__sbuf_finish(&b, out, len);
}

/* Chrome's trace event format: complete ("X") events with times in microseconds, and metadata
 * ("M") events that name the process and one thread per rank, plus one per rank with copies (its
 * copy lane, tid p + r, drawn under the rank). Simulated times are in ms. */
zb_status_t zb__export_chrome(const zb_schedule_t *s, char **out, size_t *len) {
  zb__sbuf_t b = {0};
  zb__sbuf_printf(&b, "{\"traceEvents\": [\n");
  zb__sbuf_printf(&b, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 0, "
                      "\"args\": {\"name\": ");
  char pname[64];
  const char *kind = zb_kind_name(s->kind);
  snprintf(pname, sizeof pname, "zbpp %s", kind ? kind : "?");
  put_str(&b, pname);
  zb__sbuf_printf(&b, "}}");
  int any = has_copies(s);
  for (int r = 0; r < s->p; r++) {
    int copies = rank_has_copies(s, r);
    for (int lane = 0; lane <= copies; lane++) {
      int tid = lane ? s->p + r : r;
      zb__sbuf_printf(&b,
                      ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, "
                      "\"args\": {\"name\": \"rank %d%s\"}}",
                      tid, r, lane ? " copy" : "");
      /* Without a sort index viewers order threads by name, which puts rank 10 before rank 2. */
      zb__sbuf_printf(&b,
                      ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, "
                      "\"args\": {\"sort_index\": %d}}",
                      tid, any ? 2 * r + lane : r);
    }
  }
  for (int r = 0; r < s->p; r++) {
    for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) {
      const zb_op_t *op = &s->ops[k];
      const char *ty = zb__op_name(op->type);
      zb__sbuf_printf(&b, ",\n{\"name\": \"%s%d\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": ", ty,
                      (int)op->mb, ty);
      put_num(&b, s->start[k] * 1000);
      zb__sbuf_printf(&b, ", \"dur\": ");
      put_num(&b, (s->end[k] - s->start[k]) * 1000);
      zb__sbuf_printf(&b,
                      ", \"pid\": 0, \"tid\": %d, \"args\": {\"stage\": %d, \"mb\": %d, "
                      "\"chunk\": %d}}",
                      zb__op_is_copy(op->type) ? s->p + r : r, (int)op->stage, (int)op->mb,
                      zb__op_is_vocab(op->type) ? 0 : zb__stage_chunk(s, op->stage));
    }
  }
  zb__sbuf_printf(&b, "\n],\n\"displayTimeUnit\": \"ms\"}\n");
  return zb__sbuf_finish(&b, out, len);
}
