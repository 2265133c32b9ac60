/*
 * rounds_v.c - V schedules built round by round (the way the Zero Bubble paper's ZB-V was built),
 * a candidate beside the list scheduler for zb-v, zb-auto with a V, v-half and v-min.
 *
 * Rank r holds stage r ("down", the first chunk) and stage 2p-1-r ("up", the returning chunk). A
 * microbatch's forward runs down the ranks and back up; its backward runs up's B from rank 0 down
 * to rank p-1, then down's B from rank p-1 back to rank 0.
 *
 * Why rounds: the list scheduler decides on what is ready now, so in a V it starts another
 * first-chunk forward just before a returning forward arrives and delays everything downstream of
 * that forward; with unequal F/B/W the delays add up (measured: 20% bubble where the paper's
 * rounds get 6%). Here the order is decided by structure:
 *   1. Warm-up. Microbatch 0 runs down. Then, from the bottom rank up, each rank fills the wait for
 *      its returning forward with first-chunk forwards (and the ranks above it take as many, so
 *      they stay ahead), as far as time and memory allow, then runs the returning forward.
 *   2. Balance: deeper ranks take forwards until each holds as many as the rank above it and more
 *      returning ones, alternating chunks, so the steady state starts full.
 *   3. Rounds: every rank runs one B and one F per round, each in the chunk whose input is closest
 *      to ready (the returning chunk whenever its input is already there). Before each, W's fill
 *      the wait for its input when they fit in it; a W that would overrun is started only when the
 *      wait is longer than the rank may idle (its allowance: the largest per-rank bubble so far, or
 *      the previous run's), since idling a little keeps the critical path short.
 *   4. The rules run again with each rank's bubble from the previous run as its allowance, while
 *      that lowers the largest bubble (gen_auto.c keeps every run as a candidate).
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

static int down_of(int r) { return r; }
static int up_of(const zb_schedule_t *s, int r) { return 2 * s->p - 1 - r; }

/* How much longer rank r may idle, waiting for an op's input, instead of starting a W that would
 * overrun the arrival: the largest bubble of any rank (or of the previous run, through its
 * allowance) minus r's own bubble so far. */
static double slack(const zb__placer_t *pl, const zb__rounds_policy_t *pol, double max_allow, int r) {
  double b = zb__placer_max_bubble(pl);
  if (pol->allow && max_allow - pol->allow[r] > b) b = max_allow - pol->allow[r];
  return b - pl->bubble[r];
}

/* W's before an op of rank r whose cross-rank input arrives at `arrive` (NaN: none): every W that
 * ends before the input arrives, then one more if the hole left is longer than the rank may idle
 * and `fill` says to. */
static void fill_w(zb__placer_t *pl, const zb__rounds_policy_t *pol, double max_allow, int r,
                   double arrive, int fill) {
  if (isnan(arrive)) return;
  while (zb__placer_pending_w(pl, r) > 0 && arrive >= pl->cur[r] + zb__placer_next_w_cost(pl, r))
    zb__placer_put_w(pl, r);
  if (zb__placer_pending_w(pl, r) > 0 && fill &&
      arrive - pl->cur[r] > slack(pl, pol, max_allow, r))
    zb__placer_put_w(pl, r);
}

zb_status_t zb__rounds_v(zb_schedule_t *s, const zb__rounds_policy_t *pol, double *max_bubble,
                         double *bubble) {
  int p = s->p, m = s->m;
  if (s->placement != ZB_PLACEMENT_V || s->v != 2)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "round-based V rules need the V placement, 2 chunks");
  zb__placer_t pl;
  ZB_CHECK(zb__placer_init(&pl, s, pol->limit));
  double unit = 1.0 / s->v, max_allow = -1;
  if (pol->allow)
    for (int r = 0; r < p; r++)
      if (pol->allow[r] > max_allow) max_allow = pol->allow[r];
  int *nf = pl.nF, *nb = pl.nB;

  /* 1. Warm-up. */
  for (int r = 0; r < p; r++) zb__placer_put(&pl, ZB_OP_F, down_of(r));
  for (int r = p - 1; r >= 0 && !pl.failed; r--) {
    if (r < p - 1) {
      double arrive = zb__placer_arrival(&pl, ZB_OP_F, up_of(s, r), 0);
      /* Room for this microbatch's returning forward and those of the ranks below. */
      while (!pl.failed && pl.mem[r] + unit * (2 + 2 * r) <= pol->limit + ZB_EPS &&
             pl.cur[r] + s->tf[down_of(r)] <= arrive + ZB_EPS && nf[down_of(r)] < m)
        for (int j = 0; j <= r; j++) zb__placer_put(&pl, ZB_OP_F, down_of(j));
    }
    zb__placer_put(&pl, ZB_OP_F, up_of(s, r));
  }

  /* 2. Balance. */
  int chunk = 0;
  for (int r = 1; r < p && !pl.failed; r++) {
    int guard = 4 * m + 4;
    while (!pl.failed && guard-- > 0) {
      int total = nf[down_of(r)] + nf[up_of(s, r)];
      int above = nf[down_of(r - 1)] + nf[up_of(s, r - 1)];
      int up_r = nf[up_of(s, r)], up_above = nf[up_of(s, r - 1)];
      if (!(total < above || (up_r <= up_above && up_above < m))) break;
      for (int j = p - 1; j >= r; j--) {
        int st = chunk ? up_of(s, j) : down_of(j);
        if (nf[st] < m) zb__placer_put(&pl, ZB_OP_F, st);
      }
      chunk ^= 1;
    }
    if (guard < 0) pl.failed = 1;
  }

  /* 3. Rounds. */
  int *order = malloc(2 * (size_t)p * sizeof(int)); /* B's of a round: stage per slot */
  if (!order) pl.failed = pl.oom = 1;
  for (int round = 0; round < 2 * m && !pl.failed; round++) {
    int n = 0;
    /* B: down-chunk B's run from rank p-1 upwards, then up-chunk B's from rank 0 downwards (the
     * order their inputs flow in this round). */
    for (int pass = 0; pass < 2; pass++)
      for (int k = 0; k < p; k++) {
        int r = pass == 0 ? p - 1 - k : k;
        int bd = nb[down_of(r)], bu = nb[up_of(s, r)];
        int down;
        if (bd >= bu) down = 0;
        else if (r == p - 1) down = 1;
        else down = !isnan(pl.endB[(size_t)down_of(r + 1) * m + bd]) || bu >= m;
        if (down == (pass == 0)) order[n++] = down ? down_of(r) : up_of(s, r);
      }
    for (int k = 0; k < n && !pl.failed; k++) {
      int st = order[k], r = zb__stage_rank(s, st);
      if (nb[st] >= m) continue;
      double arrive = zb__placer_arrival(&pl, ZB_OP_B, st, nb[st]);
      fill_w(&pl, pol, max_allow, r, arrive, st == down_of(r) || pol->fill_b);
      zb__placer_put(&pl, ZB_OP_B, st);
    }
    /* F: the returning chunk when its input is already there, else the next microbatch down. */
    for (int r = 0; r < p && !pl.failed; r++) {
      int d = down_of(r), u = up_of(s, r), st = -1;
      if (nf[u] >= m) continue;
      if (nf[u] >= nf[d]) st = d;
      else if (r == p - 1) st = u;
      else if (!isnan(pl.endF[(size_t)up_of(s, r + 1) * m + nf[u]])) st = u;
      else if (nf[d] < m && (r == 0 || !isnan(pl.endF[(size_t)down_of(r - 1) * m + nf[d]])))
        st = d;
      if (st < 0) continue;
      while (!pl.failed && pl.mem[r] + unit > pol->limit + ZB_EPS) zb__placer_put_w(&pl, r);
      double arrive = zb__placer_arrival(&pl, ZB_OP_F, st, nf[st]);
      fill_w(&pl, pol, max_allow, r, arrive, pol->fill_f);
      zb__placer_put(&pl, ZB_OP_F, st);
    }
  }
  free(order);
  return zb__placer_finish(&pl, s, max_bubble, bubble);
}
