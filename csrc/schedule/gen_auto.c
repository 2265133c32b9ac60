/*
 * gen_auto.c - zb-auto, the automatic zero-bubble scheduler (Zero Bubble paper, section 3.2).
 *
 * The paper's scheduler takes profiled T_F, T_B, T_W, T_comm and a memory limit, builds a schedule
 * with a greedy heuristic (using the median of the stage costs), then refines it with an ILP. Here:
 *
 *   1. The list scheduler of greedy.c runs under the memory limit with the real per-stage costs
 *      (unequal first and last stages included) and T_comm, under a family of its rules: F or B
 *      first; for loop placement a warm-up cap (none, ZB-H1's, ZB-H2's) and W's held back (none, r,
 *      4r on rank r); for a V, W or F first and W look-ahead. Each rule set wins somewhere (F-first
 *      closes V schedules, B-first loop ones, the caps and holds matter when T_W is small against
 *      T_F and T_B or communication is expensive), so trying them all is the search.
 *   2. Every handcrafted schedule for the same placement (1F1B, ZB-H1, ZB-H2, GPipe for one chunk;
 *      ZB-V, V-Half, V-Min for a V) is generated too and kept as a candidate when its peak memory
 *      fits the limit. So zb-auto is never worse than the best handcrafted schedule that fits.
 *   3. The shortest candidate under the limit wins (ties: the lower peak memory, then the first).
 *
 * Without a limit zb-auto keeps 1F1B's memory, p. The paper's ZB-1p is zb-auto at limit p and its
 * ZB-2p is zb-auto at limit 2p.
 */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

typedef struct {
  zb_schedule_t *best;
  double best_cost, best_peak;
  double limit;
} search_t;

/* Simulates a candidate and keeps it if it fits and is the best so far; takes ownership of c. */
static zb_status_t consider(search_t *k, zb_schedule_t *c) {
  zb_sim_result_t r;
  zb_status_t st = zb_schedule_simulate(c, &r);
  if (st != ZB_OK) {
    zb__schedule_free(c);
    return st;
  }
  int fits = r.max_peak_memory <= k->limit + ZB_EPS;
  int better = !k->best || r.cost < k->best_cost - ZB_EPS ||
               (r.cost <= k->best_cost + ZB_EPS && r.max_peak_memory < k->best_peak - ZB_EPS);
  if (fits && better) {
    zb__schedule_free(k->best);
    k->best = c;
    k->best_cost = r.cost;
    k->best_peak = r.max_peak_memory;
  } else {
    zb__schedule_free(c);
  }
  return ZB_OK;
}

static zb_status_t try_policy(search_t *k, const zb_schedule_t *s, const zb__greedy_policy_t *pol) {
  zb_schedule_t *c = NULL;
  ZB_CHECK(zb__schedule_clone_empty(s, &c));
  zb_status_t st = zb__greedy_schedule(c, pol);
  if (st != ZB_OK) {
    /* One rule set that cannot finish is not a reason to give the user nothing: the others are
     * still candidates (and if none is, the caller reports this message). */
    zb__schedule_free(c);
    return st == ZB_ERR_OUT_OF_MEMORY ? st : ZB_OK;
  }
  return consider(k, c);
}

static zb_status_t try_handcrafted(search_t *k, const zb_schedule_t *s,
                                   zb_status_t (*gen)(zb_schedule_t *)) {
  zb_schedule_t *c = NULL;
  ZB_CHECK(zb__schedule_clone_empty(s, &c));
  zb_status_t st = gen(c);
  if (st != ZB_OK) { /* a handcrafted kind that cannot take this shape is simply not a candidate */
    zb__schedule_free(c);
    return st == ZB_ERR_OUT_OF_MEMORY ? st : ZB_OK;
  }
  return consider(k, c);
}

zb_status_t zb__gen_auto(zb_schedule_t *s, double limit) {
  if (limit <= 0) limit = s->p;
  if (limit < 1 - ZB_EPS)
    return ZB_FAIL(ZB_ERR_INFEASIBLE,
                   "memory limit %.4g is below what any schedule needs: the minimum is 1 (one "
                   "microbatch's activations through all of a rank's layers)",
                   limit);
  search_t k = {NULL, 0, 0, limit};
  int p = s->p;
  int *rules = malloc(4 * (size_t)p * sizeof(int)); /* per-rank warm-up caps and W holds */
  if (!rules) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for per-rank rules");
  for (int r = 0; r < p; r++) {
    rules[r] = p - r;               /* ZB-H1's warm-up */
    rules[p + r] = 2 * (p - r) - 1; /* ZB-H2's warm-up */
    rules[2 * p + r] = r;           /* W's held back: ZB-H1's deferral */
    rules[3 * p + r] = 4 * r;       /* and a deeper one, for when memory allows */
  }
  zb_status_t st = ZB_OK;
  if (s->placement == ZB_PLACEMENT_LOOP) {
    /* F or B first x warm-up cap (none, ZB-H1's, ZB-H2's) x W's held (none, r, 4r). */
    for (int variant = 0; variant < 18 && st == ZB_OK; variant++) {
      int cap = (variant >> 1) % 3, hold = (variant >> 1) / 3;
      zb__greedy_policy_t pol = {.limit = limit, .f_before_b = variant & 1};
      pol.warmup_cap = cap ? rules + (size_t)(cap - 1) * p : NULL;
      pol.hold_w = hold ? rules + (size_t)(hold + 1) * p : NULL;
      st = try_policy(&k, s, &pol);
    }
  } else {
    /* F or B first x W or F first x W look-ahead. */
    for (int variant = 0; variant < 8 && st == ZB_OK; variant++) {
      zb__greedy_policy_t pol = {.limit = limit, .f_before_b = variant & 1,
                                 .w_before_f = (variant >> 1) & 1, .lookahead = (variant >> 2) & 1};
      st = try_policy(&k, s, &pol);
    }
  }
  free(rules);

  if (st == ZB_OK) {
    zb_status_t (*const loop_kinds[])(zb_schedule_t *) = {zb__gen_1f1b, zb__gen_zb_h1,
                                                          zb__gen_zb_h2, zb__gen_gpipe};
    zb_status_t (*const v_kinds[])(zb_schedule_t *) = {zb__gen_zb_v, zb__gen_v_half,
                                                       zb__gen_v_min};
    if (s->placement == ZB_PLACEMENT_LOOP && s->v == 1)
      for (size_t i = 0; i < 4 && st == ZB_OK; i++) st = try_handcrafted(&k, s, loop_kinds[i]);
    if (s->placement == ZB_PLACEMENT_V)
      for (size_t i = 0; i < 3 && st == ZB_OK; i++) st = try_handcrafted(&k, s, v_kinds[i]);
  }
  if (st != ZB_OK) {
    zb__schedule_free(k.best);
    return st;
  }
  if (!k.best) {
    char why[512]; /* the message buffer is about to be rewritten: copy what it says first */
    snprintf(why, sizeof why, "%s", zb_last_error());
    return ZB_FAIL(ZB_ERR_INTERNAL, "zb-auto found no schedule under limit %.4g (last error: %s)",
                   limit, why);
  }
  /* Move the winner's ops into s. */
  free(s->ops);
  free(s->rank_off);
  s->ops = k.best->ops;
  s->rank_off = k.best->rank_off;
  s->n_ops = k.best->n_ops;
  k.best->ops = NULL;
  k.best->rank_off = NULL;
  zb__schedule_free(k.best);
  zb__schedule_invalidate(s);
  return ZB_OK;
}
