/*
 * spec_costs.c - the checks on a spec's costs: each time finite and >= 0, w_share in [0, 1], a
 * finite memory limit, and times small enough that the schedule they make has a finite length.
 *
 * Why the last one: every time can be finite while m of them summed is not. 1e308 passes a
 * per-value check, and then the simulated cost is inf and the bubble rate NaN, or the list
 * scheduler, whose "not known yet" is INFINITY, sees every op as never ready and reports a stall.
 * Refusing such costs up front names the input at fault instead.
 *
 * What this is not: a check of the shape (p, v, m) or of the ops; schedule.c does those.
 */
#include <math.h>
#include <stdio.h>

#include "internal.h"

/* The longest total time (see zb__schedule_check_total) a schedule may have. Not DBL_MAX: the
 * exports scale times (the Chrome trace writes microseconds, 1e3 per millisecond) and the bound
 * and the generators add and compare sums of them, all of which must stay finite. No real
 * pipeline comes near: 1e300 ms is about 1e289 years. */
#define TOTAL_TIME_LIMIT 1e300

static int bad_number(double x) { return isnan(x) || isinf(x) || x < 0; }

zb_status_t zb__spec_check_costs(const zb_schedule_spec_t *spec, int S) {
  const struct {
    const char *name;
    double v;
  } scalars[] = {{"time_f", spec->time_f},           {"time_b", spec->time_b},
                 {"time_w", spec->time_w},           {"time_comm", spec->time_comm},
                 {"time_offload", spec->time_offload}, {"time_reload", spec->time_reload},
                 {"time_s", spec->time_s}, {"time_t", spec->time_t}, {"time_if", spec->time_if},
                 {"time_ib", spec->time_ib}, {"time_vocab_comm", spec->time_vocab_comm}};
  for (size_t i = 0; i < sizeof scalars / sizeof scalars[0]; i++)
    if (bad_number(scalars[i].v))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s is %g; times must be finite and >= 0",
                     scalars[i].name, scalars[i].v);
  if (isnan(spec->time_bw) || isinf(spec->time_bw))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "time_bw is %g; give a finite time, or <= 0 for time_b + time_w", spec->time_bw);
  const struct {
    const char *name;
    const double *a;
  } arrays[] = {{"stage_time_f", spec->stage_time_f},
                {"stage_time_b", spec->stage_time_b},
                {"stage_time_w", spec->stage_time_w},
                {"stage_time_bw", spec->stage_time_bw},
                {"stage_time_offload", spec->stage_time_offload},
                {"stage_time_reload", spec->stage_time_reload}};
  for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) {
    if (!arrays[i].a) continue;
    for (int st = 0; st < S; st++)
      if (bad_number(arrays[i].a[st]))
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s[%d] is %g; times must be finite and >= 0",
                       arrays[i].name, st, arrays[i].a[st]);
  }
  if (isnan(spec->w_share) || spec->w_share < 0 || spec->w_share > 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "w_share is %g; it is the share of activations only W needs, in [0, 1]",
                   spec->w_share);
  if (isnan(spec->mem_limit) || isinf(spec->mem_limit))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "mem_limit is %g; give a finite limit in microbatches, or <= 0 for none",
                   spec->mem_limit);
  if (spec->vocab < 0 || spec->vocab > 2)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "vocab is %d; 0 (no Vocabulary Parallelism), 1 (two barriers a microbatch, Vocab-1) or 2 "
                   "(one barrier, the backward fused into S, Vocab-2)", (int)spec->vocab);
  return ZB_OK;
}

/* The spec's input behind per-stage time `which` (0 F, 1 B, 2 W, 3 BW) of stage st: its name in
 * buf and its value. */
static double input_of(const zb_schedule_spec_t *spec, int which, int st, char *buf, size_t n) {
  static const char *const names[4] = {"f", "b", "w", "bw"};
  const double *arrays[4] = {spec->stage_time_f, spec->stage_time_b, spec->stage_time_w,
                             spec->stage_time_bw};
  const double scalars[4] = {spec->time_f, spec->time_b, spec->time_w, spec->time_bw};
  if (arrays[which]) {
    snprintf(buf, n, "stage_time_%s[%d]", names[which], st);
    return arrays[which][st];
  }
  snprintf(buf, n, "time_%s", names[which]);
  return scalars[which];
}

zb_status_t zb__schedule_check_total(const zb_schedule_t *s, const zb_schedule_spec_t *named) {
  /* Every op once and every hop between stages with its T_comm: no rank's span can pass this sum,
   * since a rank is only ever idle waiting for an op earlier in a chain of ops and hops, each
   * counted here (max(B + W, BW): either form of a backward). */
  double m = s->m, work = 0;
  for (int st = 0; st < s->S; st++) work += s->tf[st] + fmax(s->tb[st] + s->tw[st], s->tbw[st]);
  double total = m * work + 2 * m * (s->S - 1) * s->t_comm;
  if (total <= TOTAL_TIME_LIMIT) return ZB_OK;

  /* Name the one input that weighs most in the sum: the user's value, as the user gave it. */
  int bw_given = named->stage_time_bw || named->time_bw > 0;
  double worst = s->S > 1 ? 2 * m * (s->S - 1) * s->t_comm : 0;
  int which = -1, where = 0;
  for (int st = 0; st < s->S; st++) {
    const double t[4] = {s->tf[st], s->tb[st], s->tw[st], bw_given ? s->tbw[st] : 0};
    for (int k = 0; k < 4; k++)
      if (m * t[k] > worst) worst = m * t[k], which = k, where = st;
  }
  char name[48] = "time_comm";
  double value = named->time_comm;
  if (which >= 0) value = input_of(named, which, where, name, sizeof name);
  return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                 "%s is %g, so the schedule's total time (m = %d microbatches times the sum over "
                 "%d stages of F + max(B + W, BW), plus time_comm on each hop between stages) "
                 "would be %g; times must be finite, >= 0 and small enough that this total is at "
                 "most %g",
                 name, value, s->m, s->S, total, TOTAL_TIME_LIMIT);
}
