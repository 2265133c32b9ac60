/*
 * timeline.c - measured timelines: a runner's real op times put into a schedule handle in place of
 * the simulated ones, and per-stage costs read back out of either.
 *
 * What this is for: the same pictures and figures for a real run as for a plan (text grid, JSON,
 * Chrome trace, SVG, bubble rate), and the loop "run, measure, plan again with zb-auto".
 * Measured times are stored in milliseconds, the unit the exports assume for simulated times.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

zb_status_t zb_schedule_set_times(zb_schedule_t *s, const double *const *start,
                                  const double *const *end, zb_sim_result_t *out) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(start);
  ZB_ARG_NOT_NULL(end);
  ZB_CHECK(zb__validate_structure(s));
  double t0 = INFINITY;
  for (int r = 0; r < s->p; r++) {
    int n = s->rank_off[r + 1] - s->rank_off[r];
    if (n > 0 && (!start[r] || !end[r]))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_schedule_set_times: rank %d has %d ops but no times", r, n);
    for (int k = 0; k < n; k++) {
      if (!isfinite(start[r][k]) || !isfinite(end[r][k]) || end[r][k] < start[r][k])
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                       "zb_schedule_set_times: rank %d op %d has start %g and end %g; times must be "
                       "finite with end >= start",
                       r, k, start[r][k], end[r][k]);
      if (start[r][k] < t0) t0 = start[r][k];
    }
  }
  size_t n = (size_t)(s->n_ops ? s->n_ops : 1);
  if (!s->start) s->start = malloc(n * sizeof(double));
  if (!s->end) s->end = malloc(n * sizeof(double));
  if (!s->start || !s->end)
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory storing %d op times", s->n_ops);
  for (int r = 0; r < s->p; r++)
    for (int k = 0; k < s->rank_off[r + 1] - s->rank_off[r]; k++) {
      s->start[s->rank_off[r] + k] = (start[r][k] - t0) * 1e3;
      s->end[s->rank_off[r] + k] = (end[r][k] - t0) * 1e3;
    }
  zb__schedule_fill_stats(s);
  if (out) *out = s->sim;
  return ZB_OK;
}

zb_status_t zb_schedule_stage_costs(const zb_schedule_t *s, double *tf, double *tb, double *tw,
                                    double *tbw) {
  ZB_ARG_NOT_NULL(s);
  if (!s->simulated)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the schedule has no times yet; call zb_schedule_simulate or zb_schedule_set_times first");
  double *sum = calloc((size_t)s->S * 6, sizeof(double)); /* per op type, copies included */
  int *cnt = calloc((size_t)s->S * 6, sizeof(int));
  if (!sum || !cnt) {
    free(sum), free(cnt);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory averaging op times");
  }
  for (int k = 0; k < s->n_ops; k++) {
    if (zb__op_is_vocab(s->ops[k].type)) continue; /* no stage's: the rank's vocabulary shard */
    int idx = s->ops[k].type * s->S + s->ops[k].stage;
    sum[idx] += s->end[k] - s->start[k];
    cnt[idx]++;
  }
  double *outs[4] = {tf, tb, tw, tbw};
  for (int t = 0; t < 4; t++)
    if (outs[t])
      for (int st = 0; st < s->S; st++) {
        int idx = t * s->S + st;
        outs[t][st] = cnt[idx] ? sum[idx] / cnt[idx] : 0.0;
      }
  free(sum), free(cnt);
  return ZB_OK;
}
