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

zb_status_t zb__gen_v_half(zb_schedule_t *s) { return gen_v(s, (s->p + 1) / 2 + 1); }

zb_status_t zb__gen_v_min(zb_schedule_t *s) { return gen_v(s, (s->p + 2) / 3 + 1); }
