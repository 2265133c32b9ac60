/*
 * gen_vocab.c - 1F1B with Vocabulary Parallelism's passes: the reference's per-rank order
 * (sail-sg/VocabularyParallelism 6191c3bf, megatron/core/pipeline_parallel/
 * vocab_parallel_schedule.py, forward_backward_pipelining_with_vocab_parallel), built as it runs.
 *
 * The reference places the passes with a small automaton over the ranks from the last, on the
 * profiled forward and backward times f and b: each rank either keeps the order B-S-F (its S pass
 * f earlier than the next rank's) or switches to B-F-S, which costs b - f. From it come is_bsf and
 * offsets per rank and how many S passes each rank runs in its warm-up (num_warmup_s_pass). Rank r
 * then runs min(p - r, m) warm-up forwards as 1F1B's p - r - 1 plus one (plus one more without
 * backward fusion, the reference's Vocab-1): the extra microbatches in flight that give its p + 1
 * and p + 2 activations. The rest of the order follows the reference's control flow line by line:
 * this file keeps its loops and conditions (each with the reference's line), and replaces each of
 * its helpers by the ops it runs:
 *   input_embedding_forward_step_helper(i): IF(i), then (its callback) the IF all-reduce;
 *   input_embedding_backward_step_helper(i): the broadcast, then (its callback) IB(i);
 *   forward_step_helper(i): F(r, i); backward_step_helper(i): BW(r, i);
 *   lm_head_step_helper(k): T(k - 1) when k > 0, then S(k) when k < m.
 * The collectives (broadcasts, all-reduces) are the schedule model's barriers, not ops. The
 * reference asserts b >= f >= c; here any costs run the automaton, and the reference's
 * out-of-range IF passes at m <= p (its warm-up loops have no bound) are left out.
 *
 * What this is not: the placement for other kinds (interleaved, V), which the reference does not
 * have either: simulate.c's zb__place_vocab places them.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

typedef struct {
  zb__oplists_t *l;
  int r, m;
  int if_left, ib_left; /* the reference's num_input_embedding_{forward,backward}_steps_remaining */
  int s_left;           /* num_remaining_s_pass */
  zb_status_t st;
} run_t;

static void push(run_t *x, int type, int stage, int mb) {
  if (x->st == ZB_OK && mb >= 0 && mb < x->m) x->st = zb__oplists_push(x->l, x->r, type, stage, mb);
}

/* input_embedding_forward_step_helper(m - if_left): IF now; returns the microbatch (its callback
 * is the all-reduce, a barrier here). */
static void embed_forward(run_t *x) {
  push(x, ZB_OP_IF, x->r, x->m - x->if_left);
  x->if_left--;
}

/* input_embedding_backward_step_helper(m - ib_left): the broadcast now, IB when the callback runs:
 * returns the microbatch whose IB the callback pushes (-1: none). */
static int embed_backward(run_t *x) {
  int mb = x->m - x->ib_left;
  x->ib_left--;
  return mb;
}

static void lm_head_step(run_t *x, int k) {
  if (k > 0) push(x, ZB_OP_T, x->r, k - 1);
  push(x, ZB_OP_S, x->r, k);
}

zb_status_t zb__gen_vocab_1f1b(zb_schedule_t *s) {
  const int p = s->p, m = s->m, fused = s->vocab == 2;
  /* The profiled f and b of the reference: a rank's forward and (fused) backward, averaged over
   * the ranks as its timers average them (schedule_timers.py, joint_conclusion). */
  double f = 0, b = 0;
  for (int st = 0; st < s->S; st++) f += s->tf[st] / s->S, b += s->tbw[st] / s->S;
  int *is_bsf = malloc((size_t)(p + 1) * sizeof(int)), *warm_s = calloc((size_t)p, sizeof(int));
  double *offsets = malloc((size_t)(p + 1) * sizeof(double));
  zb__oplists_t l;
  zb_status_t st = zb__oplists_init(&l, p);
  if (st == ZB_OK && (!is_bsf || !warm_s || !offsets))
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory placing the vocabulary passes of %d ranks", p);
  if (st != ZB_OK) {
    free(is_bsf), free(warm_s), free(offsets);
    if (st != ZB_OK && l.list) zb__oplists_free(&l);
    return st;
  }
  /* l.117-138: the automaton, from the last rank down, then reversed. */
  int n = 1;
  double offset = 0;
  is_bsf[0] = 1, offsets[0] = 0;
  while (n < p) {
    if (offset - f >= -b) {
      offset -= f;
      is_bsf[n] = 1, offsets[n++] = offset;
    } else {
      is_bsf[n] = 0, offsets[n++] = offset;
      offset += b - f;
      is_bsf[n] = 1, offsets[n++] = offset; /* one past p at most: dropped (l.133-135) */
    }
  }
  for (int a = 0, z = p - 1; a < z; a++, z--) {
    int t = is_bsf[a];
    is_bsf[a] = is_bsf[z], is_bsf[z] = t;
    double o = offsets[a];
    offsets[a] = offsets[z], offsets[z] = o;
  }
  /* l.140-145 */
  for (int r = p - 2; r >= 0; r--) warm_s[r] = (!is_bsf[r + 1] && is_bsf[r]) ? warm_s[r + 1] : warm_s[r + 1] + 1;

  const int off = fused ? 0 : 1; /* warmup_offset, l.1011-1014 */
  for (int r = 0; r < p && st == ZB_OK; r++) {
    run_t x = {&l, r, m, m, m, m, ZB_OK};
    const int bsf = is_bsf[r];
    const double o = offsets[r];
    int warm = p - r < m ? p - r : m;                  /* l.153-156 */
    int first_warm = p < m ? p : m;
    int remaining = m - warm - 1 > 0 ? m - warm - 1 : 0;
    if (!fused) remaining = remaining - 1 > 0 ? remaining - 1 : 0;
    int next_b = 0;

    for (int i = 0; i < first_warm - warm + 1; i++) embed_forward(&x); /* l.906-908 */
    for (int i = 0; i < warm; i++) {                                   /* l.911-926 */
      embed_forward(&x);
      push(&x, ZB_OP_F, r, i);
    }
    x.s_left = m;
    lm_head_step(&x, 0); /* l.928-931 */
    x.s_left--;
    if (!fused) embed_forward(&x); /* l.940-944 */
    if (warm + 1 <= m) push(&x, ZB_OP_F, r, warm); /* l.956-960 */
    if (!fused) {
      lm_head_step(&x, 1); /* l.976-978 */
      x.s_left--;
      if (warm + 2 <= m) push(&x, ZB_OP_F, r, warm + 1); /* l.992-996 */
    }
    for (int i = 0; i < warm_s[r]; i++) { /* l.1016-1050 */
      if (x.s_left >= 1 - off) {
        lm_head_step(&x, i + 1 + off);
        if (i + 1 >= warm_s[0] && x.if_left > 0) embed_forward(&x);
        x.s_left--;
      }
    }
    for (int i = 0; i < remaining; i++) { /* l.1053-1188: steady 1F1B */
      int ib = -1;
      if (bsf || o - f > -b) {
        if (m - x.s_left >= warm_s[0] + 2 + off) ib = embed_backward(&x);
      }
      push(&x, ZB_OP_BW, r, next_b++); /* l.1072 (the loss, on the last rank, before it) */
      if (bsf) {
        lm_head_step(&x, m - x.s_left);
        if (m - x.s_left >= warm_s[0] + off && x.if_left > 0) embed_forward(&x);
        if (ib >= 0) push(&x, ZB_OP_IB, r, ib), ib = -1; /* the callback, l.1090 */
        x.s_left--;
      }
      if (!bsf && o - f <= -b) {
        if (m - x.s_left >= warm_s[0] + 2 + off) ib = embed_backward(&x);
      }
      push(&x, ZB_OP_F, r, i + warm + 1 + off); /* l.1127 */
      if (!bsf) {
        lm_head_step(&x, m - x.s_left);
        if (m - x.s_left >= warm_s[0] + off && x.if_left > 0) embed_forward(&x);
        if (ib >= 0) push(&x, ZB_OP_IB, r, ib), ib = -1; /* l.1147 */
        x.s_left--;
      }
      /* One of the two branches above called the helper and one ran its callback: every ib is
       * pushed within its iteration, as in the reference. */
    }
    for (int i = 0; i < m - remaining; i++) { /* l.1191-1281: cool-down */
      int ib = -1;
      if (bsf || o - f > -b) {
        if (m - x.s_left >= warm_s[0] + 2 + off) ib = embed_backward(&x);
      }
      push(&x, ZB_OP_BW, r, next_b++); /* l.1213 */
      if (bsf) {
        if (x.s_left >= 1 - off) {
          lm_head_step(&x, m - x.s_left);
          x.s_left--;
        }
        if (ib >= 0) push(&x, ZB_OP_IB, r, ib), ib = -1; /* l.1226 */
      }
      if (!bsf && o - f <= -b) {
        if (m - x.s_left >= warm_s[0] + 2 + off) ib = embed_backward(&x);
      }
      if (!bsf) {
        if (x.s_left >= 1 - off) {
          lm_head_step(&x, m - x.s_left);
          x.s_left--;
        }
        if (ib >= 0) push(&x, ZB_OP_IB, r, ib), ib = -1; /* l.1266 */
      }
    }
    while (x.ib_left > 0) push(&x, ZB_OP_IB, r, embed_backward(&x)); /* l.1293-1297 */
    if (fused) lm_head_step(&x, m); /* l.1299-1304: T(m - 1) */
    st = x.st;
  }
  free(is_bsf), free(warm_s), free(offsets);
  if (st == ZB_OK) st = zb__schedule_take_ops(s, &l);
  zb__oplists_free(&l);
  return st;
}

/* Every kind but 1F1B (the reference's order) and V-Half (below) with the passes placed: neighbour
 * swaps, passes and compute alike, within the kind's own largest peak (search.c). Placing each
 * pass at the next op boundary leaves a rank idle where a barrier or a pass's input is late; the
 * swaps move the ops around them. Measured when this was added (a5512d9, Schedule.refine() of the
 * placed plans at p = 4 and 8, m = 2p, equal and B = 2F costs, fused and not; zb-v,
 * interleaved-1f1b, zb-h1, zb-h2, v-min, zb-auto): simulated steps 1 to 25% shorter, about 80 ms a
 * plan. */
zb_status_t zb__vocab_search(zb_schedule_t *s) {
  zb_sim_result_t r;
  ZB_CHECK(zb_schedule_simulate(s, &r));
  return zb__local_search(s, r.max_peak_memory, ZB_REFINE_WORK);
}

/* V-Half with the passes: the reference (branch v-half-vocab of sail-sg/zero-bubble-pipeline-
 * parallelism, zbv_greedy.py's stable_pattern_v_half) widens V-Half's pattern by 6 slots, 12
 * unfused, so that the last stage's B runs one or two forwards after its S (and T) barriers
 * instead of waiting for them: one more microbatch of activations (Vocab-2), two more (Vocab-1).
 * Here V-Half's own order with the passes placed competes with V orders that hold up to that much
 * more (the rule-based V orders and zb-auto's at each extra microbatch), and the one that steps
 * shortest with its passes placed is kept: never longer than V-Half's order, never more memory
 * than the reference's. Measured against the branch: tests/python/test_vocab_vhalf_reference.py. */
zb_status_t zb__vocab_wider_v(zb_schedule_t *s) {
  zb_sim_result_t r;
  ZB_CHECK(zb_schedule_simulate(s, &r));
  const double peak = r.max_peak_memory;
  double best = zb__makespan_of(s, s->start, s->end);
  const int vocab = s->vocab, widest = vocab == 1 ? 2 : 1;
  zb_status_t st = ZB_OK;
  for (int extra = 1; extra <= widest && st == ZB_OK; extra++) {
    for (int how = 0; how < 2 && st == ZB_OK; how++) {
      zb_schedule_t *c = NULL;
      ZB_CHECK(zb__schedule_clone_empty(s, &c));
      c->vocab = 0;
      st = how == 0 ? zb__gen_rules_best(c, peak + extra) : zb__gen_auto(c, peak + extra);
      c->vocab = vocab;
      if (st == ZB_OK) st = zb__place_vocab(c);
      if (st == ZB_OK) st = zb_schedule_simulate(c, &r);
      if (st == ZB_OK && r.max_peak_memory <= peak + extra + ZB_EPS) {
        const double span = zb__makespan_of(c, c->start, c->end);
        if (span < best - ZB_EPS * fmax(1.0, best)) {
          best = span;
          zb__schedule_take(s, c);
        }
      }
      zb__schedule_free(c);
      if (st == ZB_ERR_INFEASIBLE) { /* no order at this limit: the others still compete */
        zb__clear_error();
        st = ZB_OK;
      }
    }
  }
  /* Then swaps of neighbours, passes and compute alike, within the same memory (search.c): they
   * move a last stage's B behind forwards while its barrier is not ready, as the reference's
   * wider pattern does. */
  if (st == ZB_OK) st = zb__local_search(s, peak + widest, 4 * ZB_REFINE_WORK);
  return st;
}
