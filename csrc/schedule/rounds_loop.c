/*
 * rounds_loop.c - one-chunk loop schedules built microbatch by microbatch (the Zero Bubble paper's
 * heuristic for ZB-1p/ZB-2p, section 3.2), a candidate beside the list scheduler in zb-auto.
 *
 * Why beside the list scheduler: with unequal F/B/W the list scheduler's fixed warm-up counts
 * (ZB-H1's p-r, ZB-H2's 2(p-r)-1) assume equal times. Here each rank's warm-up is counted from the
 * costs: how many forwards fit, in time and in memory, before microbatch 0's B comes back to it,
 * made strictly decreasing down the pipeline so each rank's extra forwards reach the next in time.
 * Then, one microbatch at a time, every rank runs its next F (top down) and its next B (bottom up):
 *   - before each, W's fill the wait for the op's input when they fit in it; a W that would
 *     overrun the arrival is started only when the hole is longer than the rank may idle (the
 *     largest bubble of any rank minus its own: idling there costs nothing overall), or always
 *     under `greedy_w`;
 *   - W's run first whenever memory needs them to let the F or B in;
 *   - under `prioritize_b`, a rank two or more forwards ahead of the next skips its F when running
 *     it would delay the B the next rank is about to send back (that B is on the critical path).
 * The three switches (`early_f`: warm-up forwards may overrun B0's arrival) make eight rule sets;
 * gen_auto.c tries them all.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

/* Rank j's W's before an op whose input arrives at `arrive`. */
static void fill_w(zb__placer_t *pl, const zb__rounds_policy_t *pol, int j, double arrive) {
  const zb_schedule_t *s = pl->s;
  while (zb__placer_pending_w(pl, j) > 0 && pl->cur[j] + s->tw[j] <= arrive + ZB_EPS)
    zb__placer_put_w(pl, j);
  if (zb__placer_pending_w(pl, j) > 0 && pl->cur[j] < arrive - ZB_EPS) {
    int within = arrive - pl->cur[j] <= zb__placer_max_bubble(pl) - pl->bubble[j] + ZB_EPS;
    if (!within || pol->greedy_w) zb__placer_put_w(pl, j);
  }
}

/* W's until an op of memory change `delta` fits on rank j. */
static void make_room(zb__placer_t *pl, int j, double delta) {
  while (!pl->failed && pl->mem[j] + delta > pl->limit + ZB_EPS) zb__placer_put_w(pl, j);
}

zb_status_t zb__rounds_loop(zb_schedule_t *s, const zb__rounds_policy_t *pol, double *max_bubble,
                            double *bubble) {
  int p = s->p, m = s->m;
  if (s->placement != ZB_PLACEMENT_LOOP || s->v != 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "round-based loop rules need one chunk per rank");
  zb__placer_t pl;
  ZB_CHECK(zb__placer_init(&pl, s, pol->limit));
  int *need = calloc((size_t)p, sizeof(int));
  if (!need) pl.failed = pl.oom = 1;
  double memF = zb__op_mem(s, ZB_OP_F), memB = zb__op_mem(s, ZB_OP_B);
  int *nf = pl.nF;

  /* Warm-up: microbatch 0 down, then each rank's extra forwards before its first B. */
  for (int j = 0; j < p; j++) zb__placer_put(&pl, ZB_OP_F, j);
  double back = 0; /* when microbatch 0's B leaves the rank below */
  for (int j = p - 1; j >= 0 && !pl.failed; j--) {
    if (j == p - 1) {
      back = pl.endF[(size_t)j * m] + s->tb[j];
      continue;
    }
    double mem = pl.mem[j], t = pl.cur[j];
    while (nf[j] + need[j] < m && mem + memF <= pol->limit + ZB_EPS) {
      if (pol->early_f ? t >= back + s->t_comm - ZB_EPS : t + s->tf[j] > back + s->t_comm + ZB_EPS)
        break;
      mem += memF;
      t += s->tf[j];
      need[j]++;
    }
    back = (t > back + s->t_comm ? t : back + s->t_comm) + s->tb[j];
  }
  for (int j = 1; j < p && !pl.failed; j++)
    while (need[j] > 0 && need[j] >= need[j - 1] && nf[j] + need[j] < m) need[j]--;
  for (int j = 0; j < p && !pl.failed; j++)
    for (int k = 0; k < need[j]; k++) zb__placer_put(&pl, ZB_OP_F, j);
  for (int j = p - 1; j >= 0 && !pl.failed; j--) zb__placer_put(&pl, ZB_OP_B, j);

  for (int i = 1; i < m && !pl.failed; i++) {
    for (int j = 0; j < p; j++) {
      need[j] = 0;
      if (nf[j] >= m) continue;
      if (j + 1 < p && nf[j] >= nf[j + 1] + 2 && pol->prioritize_b) {
        /* When the next rank would send its B back if it ran one F and one B now. */
        double b_back = pl.cur[j + 1] + s->tf[j + 1] + s->tb[j + 1] + s->t_comm;
        if (pl.cur[j] >= b_back - ZB_EPS) continue;
        double mem = pl.mem[j] + memF, w_time = 0;
        for (int k = 0; mem > pol->limit + ZB_EPS && k < zb__placer_pending_w(&pl, j); k++) {
          w_time += s->tw[j];
          mem += zb__op_mem(s, ZB_OP_W);
        }
        if (pl.cur[j] + s->tf[j] + w_time <= b_back + ZB_EPS) {
          need[j] = 1;
          continue;
        }
        if (b_back - pl.cur[j] <= zb__placer_max_bubble(&pl) - pl.bubble[j] + ZB_EPS) continue;
      }
      need[j] = 1;
    }
    for (int j = p - 2; j >= 0; j--)
      if (need[j + 1] < need[j]) need[j] = need[j + 1];
    for (int j = 0; j < p && !pl.failed; j++) {
      if (!need[j]) continue;
      make_room(&pl, j, memF);
      if (j > 0) fill_w(&pl, pol, j, zb__placer_arrival(&pl, ZB_OP_F, j, nf[j]));
      zb__placer_put(&pl, ZB_OP_F, j);
    }
    for (int j = p - 1; j >= 0 && !pl.failed; j--) {
      make_room(&pl, j, memB);
      if (j + 1 < p) fill_w(&pl, pol, j, zb__placer_arrival(&pl, ZB_OP_B, j, pl.nB[j]));
      if (j == 0 && nf[0] == m)
        while (!pl.failed && zb__placer_pending_w(&pl, 0) > 0) zb__placer_put_w(&pl, 0);
      zb__placer_put(&pl, ZB_OP_B, j);
    }
  }
  free(need);
  return zb__placer_finish(&pl, s, max_bubble, bubble);
}
