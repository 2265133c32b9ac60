/*
 * display.c - what the exports call a schedule and its time (zb_schedule_set_display), and the
 * step's figures beside the paper's bubble rate (zb_schedule_step_idle): the makespan over every
 * rank and the idle share of all ranks' time over it, which the text, SVG and JSON exports print
 * next to the bubble rate so the numbers match the pictures' fill and drain.
 *
 * What this is not: the simulation that makes the times (simulate.c) or the exports (export_*.c).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static zb_status_t copy_text(const char *text, char **out) {
  *out = NULL;
  if (!text || !text[0]) return ZB_OK;
  size_t n = strlen(text);
  if (n > 200) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "a display name or time unit of %zu bytes; at most 200", n);
  *out = malloc(n + 1);
  if (!*out) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for a display name");
  memcpy(*out, text, n + 1);
  return ZB_OK;
}

zb_status_t zb_schedule_set_display(zb_schedule_t *s, const char *name, const char *time_unit, double time_span) {
  ZB_ARG_NOT_NULL(s);
  if (!(time_span >= 0) || !isfinite(time_span))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "time_span %g; allowed: 0 (the makespan) or a finite time > 0",
                   time_span);
  char *n = NULL, *u = NULL;
  zb_status_t st = copy_text(name, &n);
  if (st == ZB_OK) st = copy_text(time_unit, &u);
  if (st != ZB_OK) {
    free(n);
    return st;
  }
  free(s->disp_name), free(s->disp_unit);
  s->disp_name = n, s->disp_unit = u, s->disp_span = time_span;
  return ZB_OK;
}

const char *zb__display_name(const zb_schedule_t *s) {
  if (s->disp_name) return s->disp_name;
  const char *kind = zb_kind_name(s->kind);
  return kind ? kind : "?";
}

void zb__step_idle(const zb_schedule_t *s, double *makespan, double *idle_rate) {
  double busy = 0, span = zb__makespan_of(s, s->start, s->end);
  for (int r = 0; r < s->p; r++) busy += s->busy[r];
  double idle = span > 0 && s->p > 0 ? 1 - busy / (s->p * span) : 0;
  if (idle < 0 && idle > -ZB_EPS) idle = 0; /* rounding in long sums */
  if (makespan) *makespan = span;
  if (idle_rate) *idle_rate = idle;
}

zb_status_t zb_schedule_step_idle(const zb_schedule_t *s, double *makespan, double *idle_rate) {
  ZB_ARG_NOT_NULL(s);
  if (!s->simulated)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the schedule has no times yet; call zb_schedule_simulate (or "
                                            "zb_schedule_set_times) first");
  zb__step_idle(s, makespan, idle_rate);
  return ZB_OK;
}
