/*
 * gen_zbh.c - the handcrafted zero-bubble schedules ZB-H1 and ZB-H2 (Zero Bubble paper, section 3.1,
 * Figure 3). Both split every backward into B and W and use loop placement with one chunk per rank.
 *
 * ZB-H1: "we adjust the starting points of W passes ... the number of in-flight microbatches is the
 * same as 1F1B". Each rank does 1F1B's warm-up forwards, then runs B as soon as its gradient
 * arrives and fills the holes that 1F1B leaves in the cool-down with the deferred W's; the last ranks
 * can defer more W's because they hold fewer activations. Peak memory stays at 1F1B's p, and with
 * equal F, B and W times the bubble falls to (p-1)(T_F+T_B-T_W), about a third of 1F1B's.
 *
 * ZB-H2: "introduce more F passes during the warm-up phase to fill the bubble preceding the initial
 * B, and reorder the W passes at the tail". Rank r runs up to 2(p-r)-1 warm-up forwards, so memory
 * grows to 2p-1 microbatches, and every remaining hole is filled with W: with equal times and m large
 * enough the bubble is zero.
 *
 * Both are the same rules: B first (the rank above waits for it), then F while the memory budget
 * (p for ZB-H1, 2p-1 for ZB-H2) and the warm-up count allow, then W. The list scheduler in greedy.c
 * applies the rules in simulated time, so the result adapts to unequal stage times and T_comm.
 */
#include <stdlib.h>

#include "internal.h"

static zb_status_t gen_with_warmup(zb_schedule_t *s, double limit, int h2) {
  int *cap = malloc(2 * (size_t)s->p * sizeof(int));
  if (!cap) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d warm-up counts", s->p);
  int *hold = cap + s->p;
  for (int r = 0; r < s->p; r++) {
    cap[r] = h2 ? 2 * (s->p - r) - 1 : s->p - r;
    /* Rank r holds 1F1B's activations for p-r microbatches, so it has room to defer r W's: it
     * does, which lets it pass B's up sooner (the paper's deferred W's on the later stages). */
    hold[r] = r;
  }
  zb__greedy_policy_t pol = {.limit = limit, .warmup_cap = cap, .hold_w = h2 ? NULL : hold};
  zb_status_t st = zb__greedy_schedule(s, &pol);
  free(cap);
  return st;
}

zb_status_t zb__gen_zb_h1(zb_schedule_t *s) { return gen_with_warmup(s, s->p, 0); }

zb_status_t zb__gen_zb_h2(zb_schedule_t *s) { return gen_with_warmup(s, 2 * s->p - 1, 1); }
