/*
 * export_text.c - a rank-by-time grid of a simulated schedule, for a person at a terminal.
 *
 * Each op is its type letter (F, B, W, or X for a fused backward) followed by its microbatch number,
 * padded with '-' to its length in time; '.' is idle. Chunks after the first are drawn in lower case
 * so the two legs of a V (or the laps of an interleaved loop) can be told apart. A rank with copies
 * (PipeOffload) gets a second line below its own, its copy lane: O offload, R reload.
 *
 * What this is not: an exact picture. Columns are rounded to a time unit, every op gets at least one
 * column (so a zero-time op pushes its rank's later ops right by one), and a line longer than
 * MAX_COLS is cut with a note saying how many ops were left out. The svg and chrome formats are the
 * exact views.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define TARGET_COLS 200 /* the width we try to fit, so a schedule fits a wide terminal */
#define MAX_COLS 4000   /* a rank's line is cut here (and says so) */

static int digits(int x) {
  int d = 1;
  while (x >= 10) x /= 10, d++;
  return d;
}

/* Column of time t. Anything that does not fit (or is not a number) lands just past MAX_COLS, so
 * the caller's cap applies and no double is converted to an int it cannot hold. */
static int col_of(double t, double origin, double scale) {
  double c = floor((t - origin) * scale + 0.5);
  if (!(c >= 0)) return 0; /* also catches NaN */
  if (c > MAX_COLS) return MAX_COLS + 1;
  return (int)c;
}

/* Lays out rank r's compute ops (copy = 0) or its copies (copy = 1). Writes into line (MAX_COLS + 1
 * bytes) when it is not NULL, and returns the columns used; *cut gets the number of ops that did
 * not fit before MAX_COLS. */
static int layout_rank(const zb_schedule_t *s, int r, int copy, double origin, double scale, char *line,
                       int *cut) {
  int cursor = 0;
  *cut = 0;
  for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) {
    if (zb__op_is_copy(s->ops[k].type) != copy) continue;
    int c0 = col_of(s->start[k], origin, scale);
    if (c0 < cursor) c0 = cursor; /* rounding or an earlier zero-time op pushed us right */
    if (c0 >= MAX_COLS) {
      for (int j = k; j < s->rank_off[r + 1]; j++) *cut += zb__op_is_copy(s->ops[j].type) == copy;
      break;
    }
    int c1 = col_of(s->end[k], origin, scale);
    if (c1 < c0 + 1) c1 = c0 + 1; /* never drop an op: at least one column each */
    if (c1 > MAX_COLS) c1 = MAX_COLS;
    if (line) {
      const zb_op_t *op = &s->ops[k];
      char letter = "FBWXORSTIE"[op->type >= 0 && op->type <= ZB_OP_IB ? op->type : 3];
      if (!zb__op_is_vocab(op->type) && zb__stage_chunk(s, op->stage) > 0) letter = (char)(letter - 'A' + 'a');
      memset(line + cursor, '.', (size_t)(c0 - cursor));
      memset(line + c0, '-', (size_t)(c1 - c0));
      line[c0] = letter;
      /* The number only when all of it fits: a cut "1" of "12" would name the wrong microbatch. */
      char num[16];
      int nd = snprintf(num, sizeof num, "%d", (int)op->mb);
      if (nd > 0 && c1 - c0 - 1 >= nd) memcpy(line + c0 + 1, num, (size_t)nd);
    }
    cursor = c1;
  }
  return cursor;
}


zb_status_t zb__export_text(const zb_schedule_t *s, char **out, size_t *len) {
  /* Time unit: the shortest op, so it gets the fewest columns that still show a label. */
  double unit = 0, origin = INFINITY, last = 0;
  for (int k = 0; k < s->n_ops; k++) {
    double d = s->end[k] - s->start[k];
    if (d > 0 && isfinite(d) && (unit == 0 || d < unit)) unit = d;
    if (s->start[k] < origin) origin = s->start[k];
    if (s->end[k] > last) last = s->end[k];
  }
  if (!(unit > 0)) unit = 1;
  if (!isfinite(origin)) origin = 0;
  /* Enough columns per unit for the longest label ("F12") and one '-' to separate it from the next
   * op; then fewer toward TARGET_COLS, but never below one column for the shortest op. A whole
   * number of columns per unit keeps ops of equal length equally wide. */
  int label = 1 + digits(s->m > 0 ? s->m - 1 : 0);
  double units = (last - origin) / unit, per_unit = label + 1;
  if (isfinite(units) && units * per_unit > TARGET_COLS) {
    per_unit = floor(TARGET_COLS / units);
    if (per_unit < 1) per_unit = 1;
  }
  double scale = per_unit / unit;

  int width = 0, copies = 0, vocab = 0;
  for (int k = 0; k < s->n_ops; k++) copies += zb__op_is_copy(s->ops[k].type), vocab |= zb__op_is_vocab(s->ops[k].type);
  for (int r = 0; r < s->p; r++)
    for (int lane = 0; lane <= (copies > 0); lane++) {
      int cut, w = layout_rank(s, r, lane, origin, scale, NULL, &cut);
      if (w > width) width = w;
    }

  zb__sbuf_t b = {0};
  double makespan, idle;
  zb__step_idle(s, &makespan, &idle);
  zb__sbuf_printf(&b, "%s: p=%d v=%d m=%d  cost %.6g  bubble %.2f%%  idle %.2f%%  peak memory %.4g (max of ranks)\n",
                  zb__display_name(s), s->p, s->v, s->m, s->sim.cost, 100 * s->sim.bubble_rate, 100 * idle,
                  s->sim.max_peak_memory);
  zb__sbuf_printf(&b,
                  "figures: cost = the longest rank's span (first op to last); bubble = the paper's rate, the busiest "
                  "rank's idle share of its span; idle = the idle share of all ranks' time over the step (%.6g%s%s, "
                  "the fill and drain included)\n",
                  makespan, s->disp_unit ? " " : "", s->disp_unit ? s->disp_unit : "");
  zb__sbuf_printf(&b,
                  "legend: F forward, B input-grad backward, W weight-grad backward, X fused B+W, "
                  "each then its microbatch; . idle;%s%s%s time per column %.4g\n",
                  s->v > 1 ? " lower case (f b w x) = chunk 1 and up;" : "",
                  vocab ? " vocabulary passes: S output layer forward, T its backward, I embedding forward, E its "
                          "backward;"
                        : "",
                  copies ? " copy lane: O offload, R reload (o r for chunk 1 and up; peak: device-resident, and host);"
                         : "",
                  1 / scale);

  int rw = digits(s->p > 0 ? s->p - 1 : 0);
  if (rw < 2) rw = 2;
  char *line = malloc(MAX_COLS + 1);
  if (!line) {
    free(b.buf);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory drawing the text grid");
  }
  for (int r = 0; r < s->p; r++) {
    int cut, w = layout_rank(s, r, 0, origin, scale, line, &cut);
    memset(line + w, '.', (size_t)(width - w));
    line[width] = '\0';
    zb__sbuf_printf(&b, "rank %*d |%s| peak %.4g", rw, r, line, s->peak[r]);
    if (cut) zb__sbuf_printf(&b, " (truncated: %d more ops; export svg or chrome for all)", cut);
    zb__sbuf_putc(&b, '\n');
    int has = 0;
    for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) has |= zb__op_is_copy(s->ops[k].type);
    if (!has) continue;
    w = layout_rank(s, r, 1, origin, scale, line, &cut);
    memset(line + w, ' ', (size_t)(width - w));
    line[width] = '\0';
    zb__sbuf_printf(&b, "%*s |%s| host %.4g", rw + 5, "copy", line, s->host_peak[r]);
    if (cut) zb__sbuf_printf(&b, " (truncated: %d more copies)", cut);
    zb__sbuf_putc(&b, '\n');
  }

  /* A time axis: tick labels at a round step, placed where they fit. */
  double step = zb__nice_step(10 / scale);
  memset(line, ' ', (size_t)width);
  line[width] = '\0';
  int free_from = 0;
  for (int i = 0; i <= MAX_COLS; i++) {
    double t = i * step;
    int c = col_of(origin + t, origin, scale);
    char num[32];
    int nd = snprintf(num, sizeof num, "|%g", t + origin);
    if (nd <= 0 || c + nd > width) break;
    if (c < free_from) continue; /* a long label before it still occupies these columns */
    memcpy(line + c, num, (size_t)nd);
    free_from = c + nd + 1;
  }
  zb__sbuf_printf(&b, "%*s  %s\n", rw + 5, "time", line);
  free(line);
  return zb__sbuf_finish(&b, out, len);
}
