/*
 * export_json.c - the zbpp JSON shape and the Chrome trace (Perfetto / chrome://tracing) of a
 * simulated schedule.
 *
 * The JSON shape is a contract other tools read (the Python binding, plotting scripts):
 *   {"kind", "ranks", "chunks", "stages", "microbatches", "placement", "w_share", "mem_limit",
 *    "schedule": [[{"op", "stage", "mb", "start", "end"}, ...] per rank], "cost", "bubble_rate",
 *    "peak_memory": [per rank], ("host_peak_memory": [per rank] with copies,) "makespan", "idle_rate",
 *    "name", "time_unit"}
 * Keys keep this order and names; add new keys at the end rather than change these. makespan and
 * idle_rate are zb_schedule_step_idle's; name and time_unit zb_schedule_set_display's (null: unset).
 *
 * What this is not: a JSON library or a reader. Numbers are written with %.17g so they read back
 * to the same double; a value that is not finite is written as null, since JSON has no NaN or inf.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

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
  double makespan, idle;
  zb__step_idle(s, &makespan, &idle);
  zb__sbuf_printf(&b, ", \"makespan\": ");
  put_num(&b, makespan);
  zb__sbuf_printf(&b, ", \"idle_rate\": ");
  put_num(&b, idle);
  zb__sbuf_printf(&b, ", \"name\": ");
  if (s->disp_name) put_str(&b, s->disp_name);
  else zb__sbuf_printf(&b, "null");
  zb__sbuf_printf(&b, ", \"time_unit\": ");
  if (s->disp_unit) put_str(&b, s->disp_unit);
  else zb__sbuf_printf(&b, "null");
  zb__sbuf_printf(&b, "}\n");
  return zb__sbuf_finish(&b, out, len);
}

/* Counter events ("C"): each rank's device-resident activations (and, with copies, its host
 * memory) in microbatches, at every change, by the simulator's memory model (zb__memory_events). */
static zb_status_t put_memory(zb__sbuf_t *b, const zb_schedule_t *s) {
  for (int r = 0; r < s->p; r++) {
    zb__mem_event_t *ev;
    int n, copies = rank_has_copies(s, r);
    ZB_CHECK(zb__memory_events(s, r, s->start, s->end, &ev, &n)); /* the simulator's model */
    double dev = 0, host = 0;
    for (int k = 0; k < n; k++) {
      *(ev[k].host ? &host : &dev) += ev[k].delta;
      if (k + 1 < n && ev[k + 1].t == ev[k].t) continue; /* one value per instant */
      zb__sbuf_printf(b, ",\n{\"name\": \"rank %d activations (microbatches)\", \"ph\": \"C\", \"pid\": 0, \"ts\": ", r);
      put_num(b, ev[k].t * 1000);
      zb__sbuf_printf(b, ", \"args\": {\"device\": ");
      put_num(b, fabs(dev) < 1e-12 ? 0 : dev); /* sums of shares round to 0 */
      if (copies) {
        zb__sbuf_printf(b, ", \"host\": ");
        put_num(b, fabs(host) < 1e-12 ? 0 : host);
      }
      zb__sbuf_printf(b, "}}");
    }
    free(ev);
  }
  return ZB_OK;
}

/* Flow events ("s" then "f", drawn as arrows): every activation and input gradient that crosses
 * ranks, from the end of the op that makes it to the start of the op that reads it. */
static zb_status_t put_transfers(zb__sbuf_t *b, const zb_schedule_t *s) {
  size_t cells = (size_t)s->S * (size_t)s->m;
  int *fwd = malloc(cells * sizeof *fwd), *bwd = malloc(cells * sizeof *bwd);
  int *rank = malloc((size_t)(s->n_ops > 0 ? s->n_ops : 1) * sizeof *rank);
  if (!fwd || !bwd || !rank) {
    free(fwd), free(bwd), free(rank);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory drawing the transfers");
  }
  for (size_t c = 0; c < cells; c++) fwd[c] = bwd[c] = -1;
  for (int r = 0; r < s->p; r++)
    for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) {
      const zb_op_t *op = &s->ops[k];
      rank[k] = r;
      if (op->stage < 0 || op->stage >= s->S || op->mb < 0 || op->mb >= s->m) continue;
      size_t c = (size_t)op->stage * (size_t)s->m + (size_t)op->mb;
      if (op->type == ZB_OP_F) fwd[c] = k;
      else if (op->type == ZB_OP_B || op->type == ZB_OP_BW) bwd[c] = k;
    }
  int id = 0;
  for (int st = 0; st + 1 < s->S; st++)
    for (int mb = 0; mb < s->m; mb++)
      for (int dir = 0; dir < 2; dir++) {
        size_t lo = (size_t)st * (size_t)s->m + (size_t)mb, hi = lo + (size_t)s->m;
        int from = dir ? bwd[hi] : fwd[lo], to = dir ? bwd[lo] : fwd[hi];
        if (from < 0 || to < 0 || rank[from] == rank[to]) continue;
        /* Inside each slice, so the viewer binds the arrow to it. */
        double d0 = (s->end[from] - s->start[from]) * 1000, d1 = (s->end[to] - s->start[to]) * 1000;
        double t0 = s->end[from] * 1000 - fmin(d0 / 2, 0.001), t1 = s->start[to] * 1000 + fmin(d1 / 2, 0.001);
        const char *what = dir ? "gradient" : "activation";
        zb__sbuf_printf(b, ",\n{\"name\": \"%s\", \"cat\": \"transfer\", \"ph\": \"s\", \"id\": %d, \"pid\": 0, "
                           "\"tid\": %d, \"ts\": ", what, id, rank[from]);
        put_num(b, t0);
        zb__sbuf_printf(b, "},\n{\"name\": \"%s\", \"cat\": \"transfer\", \"ph\": \"f\", \"bp\": \"e\", \"id\": %d, "
                           "\"pid\": 0, \"tid\": %d, \"ts\": ", what, id, rank[to]);
        put_num(b, t1);
        zb__sbuf_printf(b, ", \"args\": {\"stage\": %d, \"mb\": %d}}", dir ? st + 1 : st, mb);
        id++;
      }
  free(fwd), free(bwd), free(rank);
  return ZB_OK;
}

/* Chrome's trace event format: complete ("X") events with times in microseconds, and metadata
 * ("M") events that name the process and one thread per rank, plus one per rank with copies (its
 * copy lane, tid p + r, drawn under the rank); flow arrows for the transfers between ranks
 * (put_transfers) and a memory counter per rank (put_memory). Simulated times are in ms. */
zb_status_t zb__export_chrome(const zb_schedule_t *s, char **out, size_t *len) {
  zb__sbuf_t b = {0};
  zb__sbuf_printf(&b, "{\"traceEvents\": [\n");
  zb__sbuf_printf(&b, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 0, "
                      "\"args\": {\"name\": ");
  char pname[256];
  snprintf(pname, sizeof pname, "zbpp %s", zb__display_name(s));
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
  zb_status_t st = put_transfers(&b, s);
  if (st == ZB_OK) st = put_memory(&b, s);
  if (st != ZB_OK) {
    free(b.buf);
    return st;
  }
  zb__sbuf_printf(&b, "\n],\n\"displayTimeUnit\": \"ms\"}\n");
  return zb__sbuf_finish(&b, out, len);
}
