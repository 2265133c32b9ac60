/*
 * gen_zbv.c - the V-shaped schedules: ZB-V (Zero Bubble paper, section 6) and V-Half and V-Min
 * ("Pipeline Parallelism with Controllable Memory", Qi et al., 2024).
 *
 * Each rank holds two chunks placed in a V: stage r and stage 2p-1-r on rank r, so the first and the
 * last stage both sit on rank 0, and a microbatch's forward goes down the ranks and comes back up.
 * That makes every rank's activation lifetime about the same, which is what lets ZB-V reach zero
 * bubble at 1F1B's memory (p microbatches of a rank's layers), once m >= 2p.
 *
 * The controllable-memory paper builds V schedules from a repeated "building block" whose lifespan
 * sets the peak memory: V-Half at about half of 1F1B's activation memory and V-Min at about a third,
 * trading some bubble for it. Here the three are the same rules under three memory budgets:
 * ZB-V p, V-Half ceil(p/2)+1, V-Min ceil(p/3)+1 (never below the 1 microbatch any schedule needs),
 * searched over the list scheduler's rule sets (greedy.c) and the round-based ones (rounds_v.c),
 * the shortest kept.
 */
#include "internal.h"

static zb_status_t gen_v(zb_schedule_t *s, double limit) {
  if (limit < 1) limit = 1;
  /* Every rule set under the budget, the shortest kept: the list scheduler's (F before a ready B
   * keeps forwards flowing in a V, where the first B exists only after the forward has travelled
   * down and back up) and the round-based ones of rounds_v.c, which win when F, B and W differ. */
  return zb__gen_rules_best(s, limit);
}

zb_status_t zb__gen_zb_v(zb_schedule_t *s) { return gen_v(s, s->p); }

/* V-Half and V-Min: the paper's building block, squeezed (pattern_v.c), and the searched rule sets
 * held to that block's peak memory, so the result is never longer than the block's schedule and
 * never uses more memory. When the block cannot be built for this shape, the budget is the
 * paper's memory target instead. */
static zb_status_t gen_controlled(zb_schedule_t *s, int third, double fallback) {
  zb_schedule_t *pat = NULL;
  ZB_CHECK(zb__schedule_clone_empty(s, &pat));
  zb_sim_result_t pr = {0, 0, 0, 0};
  zb_status_t st = zb__pattern_v(pat, third);
  int have = st == ZB_OK && zb_schedule_validate(pat) == ZB_OK &&
             zb_schedule_simulate(pat, &pr) == ZB_OK;
  if (st == ZB_ERR_OUT_OF_MEMORY) {
    zb__schedule_free(pat);
    return st;
  }
  st = gen_v(s, have ? pr.max_peak_memory : fallback);
  zb_sim_result_t sr;
  if (have && (st != ZB_OK || zb_schedule_simulate(s, &sr) != ZB_OK || pr.cost < sr.cost - ZB_EPS ||
               (pr.cost <= sr.cost + ZB_EPS && pr.max_peak_memory < sr.max_peak_memory - ZB_EPS))) {
    zb__schedule_take(s, pat);
    st = ZB_OK;
  }
  zb__schedule_free(pat);
  return st;
}

zb_status_t zb__gen_v_half(zb_schedule_t *s) { return gen_controlled(s, 0, (s->p + 1) / 2 + 1); }

zb_status_t zb__gen_v_min(zb_schedule_t *s) { return gen_controlled(s, 1, (s->p + 2) / 3 + 1); }
