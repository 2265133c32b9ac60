/*
 * bound.c - a cost no schedule of a given shape, costs and memory limit can go below.
 *
 * Why: "how far is this schedule from the best one?" needs an answer that does not depend on our
 * own generators. The bubble a schedule shows is partly the pipeline's (a warm-up and a drain that no
 * order avoids) and partly the scheduler's; the gap between the schedule's cost and this bound is an
 * upper limit on what any better scheduler could still win. When a schedule meets the bound it is
 * shortest, proven.
 *
 * The cost is the largest span (first start to last end) of any rank, so every argument below is
 * about one rank's span and the result is the largest over ranks. Each holds for any op order, FIFO
 * or not, any mix of B+W and fused BW, and any schedule that respects the memory limit (the
 * validator's rule); bmin/wmin below are the cheapest way a backward can be done.
 *
 *  1. Work: a rank's span holds all its ops, m (f + min(b + w, bw)) summed over its stages.
 *  2. Round trip (any placement): the rank holding stage 0 starts with a forward of stage 0; that
 *     microbatch's forwards through every stage, its backwards back, and its W on stage 0 follow one
 *     another, with T_comm on each hop between ranks.
 *  3. The last rank's chain (loop, v = 1), for every rank k: from k's first op, some microbatch's
 *     forward must reach the last rank (sum of f and c from k), which then does all m forwards and m
 *     backwards, and its last backward climbs back to k (c and bmin per hop) where k still does that
 *     microbatch's backward and W.
 *  4. Warm-up and drain (loop, v = 1), per rank k: between k's first op and its first backward only
 *     forwards can run (a W needs its B), at most n = min(m, floor(limit)) of them, for that first
 *     backward waits on its microbatch's trip down and back, D = f_k + sum_{s>k}(f_s + bmin_s) + 2(p-1-k)c;
 *     so at least D - n f_k of it is idle. Between the end of k's last forward and that microbatch's
 *     backward (at least D - f_k) only backwards and W's of microbatches that still hold memory can
 *     run: at most limit - 1 microbatches' worth, one unit each before its B, w_share after; what that
 *     work cannot cover is idle too. The two windows are disjoint when memory forces a backward
 *     before the last forward (m > n); otherwise only the larger counts.
 *
 * What this is not: tight everywhere. 2-4 ignore how ranks interact beyond one chain, so a gap to
 * the bound is not proof that a shorter schedule exists; and for V and interleaved placements only
 * 1 and 2 apply, which say little (a V's warm-up under a memory limit is not bounded here).
 */
#include <math.h>

#include "internal.h"

static double bmin(const zb_schedule_t *s, int st) { return fmin(s->tb[st], s->tbw[st]); }
static double bwmin(const zb_schedule_t *s, int st) { return fmin(s->tb[st] + s->tw[st], s->tbw[st]); }
static double bwmax(const zb_schedule_t *s, int st) { return fmax(s->tb[st] + s->tw[st], s->tbw[st]); }

/* The most backward work a rank can have left when its memory holds `budget` microbatches' worth
 * (besides the one it just forwarded) out of `others` microbatches: nb before their B (1 unit and
 * up to bw of work each) and nw between B and W (w_share units, w of work each). A small LP whose
 * optimum is at a vertex of {nb + ws nw <= budget, nb + nw <= others, nb, nw >= 0}. */
static double pending_work(double budget, double others, double ws, double bw, double w) {
  if (budget <= 0 || others <= 0) return 0;
  double best = fmin(budget, others) * bw;                           /* all before their B */
  double nw = ws > 0 ? fmin(others, budget / ws) : others;           /* all between B and W */
  best = fmax(best, nw * w);
  if (ws < 1 && others > budget) {                                   /* both constraints tight */
    double nw2 = (others - budget) / (1 - ws), nb2 = others - nw2;
    if (nb2 >= 0 && nw2 >= 0) best = fmax(best, nb2 * bw + nw2 * w);
  }
  return best;
}

/* T_comm times the number of rank changes walking stages lo..hi (either direction). */
static double hops(const zb_schedule_t *s, int lo, int hi) {
  int n = 0;
  for (int st = lo; st < hi; st++) n += zb__stage_rank(s, st) != zb__stage_rank(s, st + 1);
  return n * s->t_comm;
}

/* 3: the last rank's chain (loop, v = 1), from k's first op to k's backward and W of the microbatch
 * the last rank backs last. */
static double last_rank_chain(const zb_schedule_t *s, int k) {
  int p = s->p, m = s->m;
  double c = s->t_comm, chain = 0;
  for (int st = k; st < p - 1; st++) chain += s->tf[st] + c;
  chain += m * (s->tf[p - 1] + bmin(s, p - 1));
  for (int st = p - 2; st >= k; st--) chain += c + (st > k ? bmin(s, st) : 0);
  if (k < p - 1) chain += bwmin(s, k);
  return chain;
}

/* 4: warm-up and drain of rank r (any placement). Its lowest stage lo is where its first op runs
 * (any forward of a higher stage of r needs lo's first); its highest stage hi is where its first
 * backward can come soonest, after one microbatch went from lo to the last stage and back to hi.
 * Memory is in chunk units (1/v of a microbatch through the rank's layers each). */
static double warmup_drain_idle(const zb_schedule_t *s, int r) {
  int S = s->S, m = s->m, v = s->v, lo = -1, hi = -1;
  double fmax_r = 0, bwmax_r = 0, wmax_r = 0;
  for (int st = 0; st < S; st++) {
    if (zb__stage_rank(s, st) != r) continue;
    if (lo < 0) lo = st;
    hi = st;
    fmax_r = fmax(fmax_r, s->tf[st]), bwmax_r = fmax(bwmax_r, bwmax(s, st)), wmax_r = fmax(wmax_r, s->tw[st]);
  }
  if (lo < 0) return 0;
  /* Microbatches through the rank's layers. A schedule with copies (PipeOffload) holds more in
   * flight than its device limit, so for it the limit bounds nothing here. */
  int copies = 0;
  for (int k = 0; k < s->n_ops && !copies; k++) copies = zb__op_is_copy(s->ops[k].type);
  double limit = s->mem_limit > 0 && !copies ? s->mem_limit : m;
  double D = hops(s, lo, S - 1) + hops(s, hi, S - 1);
  for (int st = lo; st < S; st++) D += s->tf[st];
  for (int st = hi + 1; st < S; st++) D += bmin(s, st);
  /* Head: only forwards before the first backward, at most n of them (memory), each at most the
   * costliest of the rank's stages, m per stage at most. */
  int n = (int)fmin((double)v * m, floor(limit * v + ZB_EPS));
  if (n < 1) n = 1;
  double head = fmax(0.0, D - n * fmax_r);
  /* Drain: after the last forward of hi (then every forward of r is done), until that
   * microbatch's backward on hi, only backwards and W's of what still holds memory: the other
   * microbatches' v chunks, within v (limit - 1) units. */
  double D2 = 2 * hops(s, hi, S - 1);
  for (int st = hi + 1; st < S; st++) D2 += s->tf[st] + bmin(s, st);
  double tail = fmax(0.0, D2 - pending_work(v * (limit - 1), (double)v * (m - 1), s->w_share, bwmax_r, wmax_r));
  /* Disjoint when memory forces a backward before the last forward. */
  return n < v * m ? head + tail : fmax(head, tail);
}

zb_status_t zb_schedule_cost_bound(const zb_schedule_t *s, double *out) {
  if (!s || !out) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s", "zb_schedule_cost_bound: NULL argument");
  int p = s->p, S = s->S, m = s->m;
  double best = 0;

  /* 1: the busiest rank's work (its Vocabulary Parallelism passes too, where it has them). */
  for (int r = 0; r < p; r++) {
    double work = 0;
    for (int st = 0; st < S; st++)
      if (zb__stage_rank(s, st) == r) work += m * (s->tf[st] + bwmin(s, st));
    for (int k = s->ops ? s->rank_off[r] : 0; s->ops && k < s->rank_off[r + 1]; k++)
      if (zb__op_is_vocab(s->ops[k].type)) work += zb__op_cost(s, s->ops[k].type, r);
    best = fmax(best, work);
  }

  /* 2: one microbatch's round trip, on the rank that holds stage 0. */
  double trip = 0;
  for (int st = 0; st < S; st++) {
    int hop = st + 1 < S && zb__stage_rank(s, st) != zb__stage_rank(s, st + 1);
    trip += s->tf[st] + (hop ? 2 * s->t_comm : 0) + (st > 0 ? bmin(s, st) : 0);
  }
  trip += bwmin(s, 0);
  best = fmax(best, trip);

  /* 3 and 4, per rank. */
  for (int r = 0; r < p; r++) {
    double work = 0;
    for (int st = 0; st < S; st++)
      if (zb__stage_rank(s, st) == r) work += m * (s->tf[st] + bwmin(s, st));
    best = fmax(best, work + warmup_drain_idle(s, r));
    if (s->placement == ZB_PLACEMENT_LOOP && s->v == 1) best = fmax(best, last_rank_chain(s, r));
  }
  *out = best;
  return ZB_OK;
}
