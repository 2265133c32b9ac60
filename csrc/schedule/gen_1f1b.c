/*
 * gen_1f1b.c - the classic schedules with a fused backward: GPipe and 1F1B.
 *
 * GPipe (Huang et al., 2019): every rank runs all m forwards, then all m backwards. Simple, but
 * every rank holds all m microbatches' activations at once (peak m).
 *
 * 1F1B (PipeDream-flush, Narayanan et al., 2021; the Zero Bubble paper's baseline, its Figure 2):
 * rank r runs p-1-r warm-up forwards, then alternates one forward and one fused backward, then
 * drains the remaining backwards. At most p microbatches are in flight on rank 0 (peak p), and with
 * equal stage times the bubble rate is (p-1)/(m+p-1) for every m >= 1.
 *
 * Both use loop placement with one chunk per rank (stage r on rank r).
 */
#include "internal.h"

zb_status_t zb__gen_gpipe(zb_schedule_t *s) {
  zb__oplists_t l;
  ZB_CHECK(zb__oplists_init(&l, s->p));
  zb_status_t st = ZB_OK;
  for (int r = 0; r < s->p && st == ZB_OK; r++) {
    for (int i = 0; i < s->m && st == ZB_OK; i++) st = zb__oplists_push(&l, r, ZB_OP_F, r, i);
    for (int i = 0; i < s->m && st == ZB_OK; i++) st = zb__oplists_push(&l, r, ZB_OP_BW, r, i);
  }
  if (st == ZB_OK) st = zb__schedule_take_ops(s, &l);
  zb__oplists_free(&l);
  return st;
}

zb_status_t zb__gen_1f1b(zb_schedule_t *s) {
  zb__oplists_t l;
  ZB_CHECK(zb__oplists_init(&l, s->p));
  zb_status_t st = ZB_OK;
  for (int r = 0; r < s->p && st == ZB_OK; r++) {
    /* Phase 1, warm-up: fill the pipeline below this rank. */
    int warmup = s->p - 1 - r < s->m ? s->p - 1 - r : s->m;
    int f = 0, b = 0;
    while (f < warmup && st == ZB_OK) st = zb__oplists_push(&l, r, ZB_OP_F, r, f++);
    /* Phase 2, steady state: one forward, one backward. */
    while (f < s->m && st == ZB_OK) {
      st = zb__oplists_push(&l, r, ZB_OP_F, r, f++);
      if (st == ZB_OK) st = zb__oplists_push(&l, r, ZB_OP_BW, r, b++);
    }
    /* Phase 3, cool-down: drain the backwards still in flight. */
    while (b < s->m && st == ZB_OK) st = zb__oplists_push(&l, r, ZB_OP_BW, r, b++);
  }
  if (st == ZB_OK) st = zb__schedule_take_ops(s, &l);
  zb__oplists_free(&l);
  return st;
}
