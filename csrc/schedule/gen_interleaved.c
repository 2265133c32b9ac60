/*
 * gen_interleaved.c - Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21, section 2.2).
 *
 * Each rank holds v chunks in a loop (stage c*p + r on rank r). Microbatches move through the
 * chunks in groups of p: a rank runs forwards for microbatches 0..p-1 of chunk 0, then the same p of
 * chunk 1, and so on, then the next group. Backwards visit the chunks in reverse. Warm-up is
 * (p-1-r)*2 + (v-1)*p forwards, then one forward one backward, then the drain. The bubble shrinks by
 * a factor of v compared with 1F1B, at the price of v times more communication and a little more
 * memory. Like Megatron (and torch's ScheduleInterleaved1F1B), m must be a multiple of p; when m == p
 * every rank runs all forwards first, as Megatron does, because the steady phase would be empty.
 */
#include "internal.h"

/* The k-th forward (or backward) "virtual microbatch" of a rank: which chunk and microbatch. */
static void virtual_mb(const zb_schedule_t *s, int k, int backward, int *chunk, int *mb) {
  int p = s->p, v = s->v;
  int c = (k / p) % v;
  *chunk = backward ? v - 1 - c : c;
  *mb = (k / (p * v)) * p + k % p;
}

zb_status_t zb__gen_interleaved(zb_schedule_t *s) {
  int p = s->p, v = s->v, total = s->m * v;
  zb__oplists_t l;
  ZB_CHECK(zb__oplists_init(&l, p));
  zb_status_t st = ZB_OK;
  for (int r = 0; r < p && st == ZB_OK; r++) {
    int warmup = s->m == p ? total : (p - 1 - r) * 2 + (v - 1) * p;
    if (warmup > total) warmup = total;
    int f = 0, b = 0, c, i;
    /* Phase 1: warm-up forwards across the chunks. */
    while (f < warmup && st == ZB_OK) {
      virtual_mb(s, f++, 0, &c, &i);
      st = zb__oplists_push(&l, r, ZB_OP_F, c * p + r, i);
    }
    /* Phase 2: steady one forward, one backward. */
    while (f < total && st == ZB_OK) {
      virtual_mb(s, f++, 0, &c, &i);
      st = zb__oplists_push(&l, r, ZB_OP_F, c * p + r, i);
      if (st != ZB_OK) break;
      virtual_mb(s, b++, 1, &c, &i);
      st = zb__oplists_push(&l, r, ZB_OP_BW, c * p + r, i);
    }
    /* Phase 3: drain. */
    while (b < total && st == ZB_OK) {
      virtual_mb(s, b++, 1, &c, &i);
      st = zb__oplists_push(&l, r, ZB_OP_BW, c * p + r, i);
    }
  }
  if (st == ZB_OK) st = zb__schedule_take_ops(s, &l);
  zb__oplists_free(&l);
  return st;
}
