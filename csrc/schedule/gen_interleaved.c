/*
 * gen_interleaved.c - Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21, section 2.2).
 *
 * Each rank holds v chunks in a loop (stage c*p + r on rank r). Microbatches move through the
 * chunks in groups of p: a rank runs forwards for microbatches 0..p-1 of chunk 0, then the same p of
 * chunk 1, and so on, then the next group. Backwards visit the chunks in reverse. Warm-up is
 * (p-1-r)*2 + (v-1)*p forwards, then one forward one backward, then the drain. The bubble shrinks by
 * a factor of v compared with 1F1B, at the price of v times more communication and a little more
 * memory. m need not be a multiple of p: microbatches go round in max(1, m / p) groups ("rounds") of
 * equal size, and the warm-up is (p-1-r)*2 + (v-1)*g for groups of g, as torch's
 * ScheduleInterleaved1F1B does (with m a multiple of p that is Megatron's order; for m == p Megatron
 * runs all forwards first, which computes the same gradients in the same order at more memory).
 * v = 1 gives 1F1B with torch's warm-up of 2(p-1-r) forwards.
 *
 * The zero-bubble variant (zb__gen_interleaved_zb, one of zb-auto's candidates for loop placement
 * with v >= 2) is the same order with each backward split into B and W and rank r's W's held back
 * r backwards, as ZB-H1 holds them back in 1F1B: a W then fills the wait for the next gradient
 * instead of delaying it. Its warm-up is (v-1)p + factor (p-1-r) forwards, factor 1 (the memory of
 * torch's ScheduleInterleavedZeroBubble, which is built this way) or 2 (Megatron's warm-up). It
 * takes any m: microbatches go round in m / p groups of equal size (torch's rounds), when that
 * divides m.
 */
#include "internal.h"

/* The k-th forward (or backward) "virtual microbatch" of a rank when microbatches go round the
 * chunks in groups of g (p for Megatron's order): which chunk and microbatch. */
static void virtual_mb(const zb_schedule_t *s, int g, int k, int backward, int *chunk, int *mb) {
  int v = s->v;
  int c = (k / g) % v;
  *chunk = backward ? v - 1 - c : c;
  *mb = (k / (g * v)) * g + k % g;
}

/* Groups ("rounds") of about p microbatches, as torch's interleaved schedules form them for any m:
 * max(1, m / p) rounds of equal size (check_shape has made sure they divide m). */
static int round_size(const zb_schedule_t *s) {
  int rounds = s->m / s->p > 1 ? s->m / s->p : 1;
  return s->m / rounds;
}

/* The k-th forwards and backwards of each rank in torch's rounds, with a warm-up of
 * (v-1)g + factor(p-1-r) forwards. split = 0: fused backwards (interleaved 1F1B, factor 2);
 * split = 1: B and W, rank r's W's held back r backwards (the zero-bubble variants). */
static zb_status_t gen_rounds(zb_schedule_t *s, int factor, int split) {
  int p = s->p, v = s->v, total = s->m * v, g = round_size(s);
  zb__oplists_t l;
  ZB_CHECK(zb__oplists_init(&l, p));
  zb_status_t st = ZB_OK;
  for (int r = 0; r < p && st == ZB_OK; r++) {
    int warmup = (v - 1) * g + factor * (p - 1 - r);
    if (warmup > total) warmup = total;
    int f = 0, b = 0, w = 0, c, i;
    int bwd = split ? ZB_OP_B : ZB_OP_BW;
    /* W of backward number w may run once backward w + r has: r backwards of slack on rank r. */
#define PUSH_W_UPTO(limit)                                                                         \
  while (split && w < (limit) && st == ZB_OK) {                                                     \
    virtual_mb(s, g, w++, 1, &c, &i);                                                             \
    st = zb__oplists_push(&l, r, ZB_OP_W, c * p + r, i);                                            \
  }
    /* Warm-up forwards across the chunks, then one forward one backward, then the drain. */
    while (f < warmup && st == ZB_OK) {
      virtual_mb(s, g, f++, 0, &c, &i);
      st = zb__oplists_push(&l, r, ZB_OP_F, c * p + r, i);
    }
    while (f < total && st == ZB_OK) {
      virtual_mb(s, g, f++, 0, &c, &i);
      st = zb__oplists_push(&l, r, ZB_OP_F, c * p + r, i);
      if (st != ZB_OK) break;
      virtual_mb(s, g, b++, 1, &c, &i);
      st = zb__oplists_push(&l, r, bwd, c * p + r, i);
      PUSH_W_UPTO(b - r)
    }
    while (b < total && st == ZB_OK) {
      virtual_mb(s, g, b++, 1, &c, &i);
      st = zb__oplists_push(&l, r, bwd, c * p + r, i);
      PUSH_W_UPTO(b - r)
    }
    PUSH_W_UPTO(total)
#undef PUSH_W_UPTO
  }
  if (st == ZB_OK) st = zb__schedule_take_ops(s, &l);
  zb__oplists_free(&l);
  return st;
}

zb_status_t zb__gen_interleaved(zb_schedule_t *s) { return gen_rounds(s, 2, 0); }

/* zb-auto's candidates: check_shape has not seen m (zb-auto takes any), so the rounds are checked
 * here. */
static zb_status_t gen_interleaved_zb(zb_schedule_t *s, int factor) {
  int rounds = s->m / s->p > 1 ? s->m / s->p : 1;
  if (s->m % rounds != 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "interleaved zero bubble splits m = %d into %d rounds, which does not divide it", s->m, rounds);
  return gen_rounds(s, factor, 1);
}

zb_status_t zb__gen_interleaved_zb1(zb_schedule_t *s) { return gen_interleaved_zb(s, 1); }
zb_status_t zb__gen_interleaved_zb2(zb_schedule_t *s) { return gen_interleaved_zb(s, 2); }
