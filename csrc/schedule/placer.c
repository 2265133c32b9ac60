/*
 * placer.c - places ops one at a time on their ranks, timing each from its dependencies: the
 * building block of the round-based generators (rounds_v.c, rounds_loop.c).
 *
 * Where the list scheduler in greedy.c simulates time and asks each free rank what to run next,
 * a round-based generator decides the order itself (a warm-up, then rounds of one B and one F per
 * rank, W's where they fit) and needs only to know, at each decision, when the op it places would
 * start and end. Placing an op appends it to its rank's list and times it exactly as the simulator
 * will: start = max(the rank's clock, each dependency's end + T_comm across ranks). So the times a
 * generator decides on are the times the schedule has.
 *
 * A generator may ask for something that cannot run (an op whose dependency is not placed, memory
 * past the limit): the placer refuses, marks itself failed, and the generator's result is simply
 * not a candidate. That keeps each generator short: it need not prove its rules never misfire on
 * unusual costs, only stop when they do.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

zb_status_t zb__placer_init(zb__placer_t *pl, const zb_schedule_t *s, double limit) {
  memset(pl, 0, sizeof *pl);
  pl->s = s;
  pl->limit = limit;
  int p = s->p, S = s->S, m = s->m;
  size_t n = (size_t)S * m;
  pl->endF = malloc(n * sizeof(double));
  pl->endB = malloc(n * sizeof(double));
  pl->nF = calloc((size_t)S, sizeof(int));
  pl->nB = calloc((size_t)S, sizeof(int));
  pl->nW = calloc((size_t)S, sizeof(int));
  pl->cur = calloc((size_t)p, sizeof(double));
  pl->mem = calloc((size_t)p, sizeof(double));
  pl->bubble = calloc((size_t)p, sizeof(double));
  pl->started = calloc((size_t)p, sizeof(int));
  pl->wq = malloc((size_t)p * s->v * m * sizeof(int));
  pl->wq_head = calloc((size_t)p, sizeof(int));
  pl->wq_tail = calloc((size_t)p, sizeof(int));
  zb_status_t st = zb__oplists_init(&pl->ops, p);
  if (st != ZB_OK) return st;
  if (!pl->endF || !pl->endB || !pl->nF || !pl->nB || !pl->nW || !pl->cur || !pl->mem ||
      !pl->bubble || !pl->started || !pl->wq || !pl->wq_head || !pl->wq_tail) {
    zb__placer_free(pl);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory placing %d stages x %d microbatches", S, m);
  }
  for (size_t k = 0; k < n; k++) pl->endF[k] = pl->endB[k] = NAN;
  return ZB_OK;
}

void zb__placer_free(zb__placer_t *pl) {
  zb__oplists_free(&pl->ops);
  free(pl->endF), free(pl->endB), free(pl->nF), free(pl->nB), free(pl->nW), free(pl->cur);
  free(pl->mem), free(pl->bubble), free(pl->started), free(pl->wq), free(pl->wq_head);
  free(pl->wq_tail);
  memset(pl, 0, sizeof *pl);
}

double zb__placer_ready(const zb__placer_t *pl, int type, int stage, int mb) {
  const zb_schedule_t *s = pl->s;
  int m = s->m, r = zb__stage_rank(s, stage);
  if (mb >= m) return NAN;
  if (type == ZB_OP_F) {
    if (stage == 0) return 0;
    double e = pl->endF[(size_t)(stage - 1) * m + mb];
    return e + (zb__stage_rank(s, stage - 1) != r ? s->t_comm : 0);
  }
  double t = pl->endF[(size_t)stage * m + mb];
  if (type == ZB_OP_W) return pl->endB[(size_t)stage * m + mb];
  if (stage + 1 < s->S) {
    double e = pl->endB[(size_t)(stage + 1) * m + mb] +
               (zb__stage_rank(s, stage + 1) != r ? s->t_comm : 0);
    t = isnan(t) || isnan(e) ? NAN : (e > t ? e : t);
  }
  return t;
}

/* The cross-rank input an op waits for, as an arrival time: NAN when the op has none (first stage,
 * or its producer is on the same rank) or the producer is not placed yet. */
double zb__placer_arrival(const zb__placer_t *pl, int type, int stage, int mb) {
  const zb_schedule_t *s = pl->s;
  int m = s->m, r = zb__stage_rank(s, stage);
  if (mb >= m || type == ZB_OP_W) return NAN;
  int from = type == ZB_OP_F ? stage - 1 : stage + 1;
  if (from < 0 || from >= s->S || zb__stage_rank(s, from) == r) return NAN;
  const double *e = type == ZB_OP_F ? pl->endF : pl->endB;
  return e[(size_t)from * m + mb] + s->t_comm;
}

static int place(zb__placer_t *pl, int type, int stage, int mb) {
  const zb_schedule_t *s = pl->s;
  int r = zb__stage_rank(s, stage);
  double ready = zb__placer_ready(pl, type, stage, mb);
  double mem = pl->mem[r] + zb__op_mem(s, type);
  if (isnan(ready) || mem > pl->limit + ZB_EPS) {
    pl->failed = 1;
    return -1;
  }
  double start = ready > pl->cur[r] ? ready : pl->cur[r];
  if (pl->started[r]) pl->bubble[r] += start - pl->cur[r];
  double end = start + zb__op_cost(s, type, stage);
  size_t key = (size_t)stage * s->m + mb;
  if (type == ZB_OP_F) {
    pl->endF[key] = end;
    pl->nF[stage]++;
    pl->started[r] = 1;
  } else if (type == ZB_OP_B) {
    pl->endB[key] = end;
    pl->nB[stage]++;
    int cap = s->v * s->m;
    pl->wq[(size_t)r * cap + pl->wq_tail[r]++ % cap] = stage;
  } else {
    pl->nW[stage]++;
  }
  pl->cur[r] = end;
  pl->mem[r] = mem;
  if (zb__oplists_push_timed(&pl->ops, r, type, stage, mb, start, end) != ZB_OK) {
    pl->failed = pl->oom = 1;
    return -1;
  }
  return 0;
}

int zb__placer_put(zb__placer_t *pl, int type, int stage) {
  if (pl->failed) return -1;
  int mb = type == ZB_OP_F ? pl->nF[stage] : type == ZB_OP_B ? pl->nB[stage] : pl->nW[stage];
  if (type == ZB_OP_W) return -1; /* W's go through zb__placer_put_w, oldest B first */
  return place(pl, type, stage, mb);
}

int zb__placer_pending_w(const zb__placer_t *pl, int r) { return pl->wq_tail[r] - pl->wq_head[r]; }

double zb__placer_next_w_cost(const zb__placer_t *pl, int r) {
  const zb_schedule_t *s = pl->s;
  int cap = s->v * s->m;
  return s->tw[pl->wq[(size_t)r * cap + pl->wq_head[r] % cap]];
}

int zb__placer_put_w(zb__placer_t *pl, int r) {
  if (pl->failed || zb__placer_pending_w(pl, r) == 0) {
    pl->failed = 1;
    return -1;
  }
  const zb_schedule_t *s = pl->s;
  int cap = s->v * s->m;
  int stage = pl->wq[(size_t)r * cap + pl->wq_head[r]++ % cap];
  return place(pl, ZB_OP_W, stage, pl->nW[stage]);
}

double zb__placer_max_bubble(const zb__placer_t *pl) {
  double b = 0;
  for (int r = 0; r < pl->s->p; r++)
    if (pl->bubble[r] > b) b = pl->bubble[r];
  return b;
}

zb_status_t zb__placer_finish(zb__placer_t *pl, zb_schedule_t *s, double *max_bubble,
                              double *bubble) {
  for (int r = 0; r < s->p && !pl->failed; r++) /* the W's still pending run at the end */
    while (!pl->failed && zb__placer_pending_w(pl, r) > 0) zb__placer_put_w(pl, r);
  if (max_bubble) *max_bubble = zb__placer_max_bubble(pl);
  if (bubble)
    for (int r = 0; r < s->p; r++) bubble[r] = pl->bubble[r];
  int placed = 0;
  for (int r = 0; r < s->p; r++) placed += pl->ops.count[r];
  zb_status_t st;
  if (pl->oom) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory growing op lists");
  else if (pl->failed || placed != 3 * s->S * s->m)
    st = ZB_FAIL(ZB_ERR_INFEASIBLE, "a round-based rule set could not place every op here");
  else st = zb__schedule_take_ops(s, &pl->ops);
  zb__placer_free(pl);
  return st;
}
