/*
 * validate.c - the schedule validator: every rule of DESIGN.md section 3, with a message that names
 * the rank, the position in that rank's list and the rule broken.
 *
 * Rules, in the order they are checked:
 *   1. every op is well formed and sits on the rank its stage lives on;
 *   2. every (stage, microbatch) has exactly one F and either one BW or one B and one W;
 *   3. dependencies between ops of the same rank appear in list order;
 *   4. every channel between adjacent stages on different ranks is FIFO: the producer's send order
 *      equals the consumer's receive order (what lets the runtime post receives early);
 *   5. the schedule cannot deadlock (the simulator can run every op);
 *   6. the memory peak of every rank stays under the limit, when one is set.
 * Copies (OFFLOAD, RELOAD) are checked with rules 2 and 3: at most one of each per (stage,
 * microbatch), an OFFLOAD after its F and before its backward, a RELOAD after its OFFLOAD and
 * before its backward (so every OFFLOAD has its RELOAD, since every F has its backward). Rule 6 counts device-resident memory in
 * simulated time when copies are present (they move memory while compute runs).
 * Vocabulary Parallelism's passes (S, T, IF, IB) with rules 1-3: each on the rank its stage field
 * names, only in a schedule with vocab set, one S and one T per rank and microbatch (and IF and IB
 * likewise, in every list or in none); on one rank S after F(S-1, mb) where that stage is on it, T
 * after S, F(0, mb) after IF, IB after IF and after B/BW(0, mb) where stage 0 is on it, and
 * B/BW(S-1, mb) after S (vocab 2) or T (vocab 1), and each kind of pass in microbatch order (the
 * collectives behind them pair up in order on every rank). What crosses ranks (the barriers) is
 * rule 5's.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define NONE (-1)

typedef struct {
  int *posV[4];            /* p x m each: the position of S, T, IF, IB of (rank, mb) */
  int inputs;              /* the lists have IF/IB passes */
  int *posF, *posB, *posW; /* position in the owning rank's list; posB covers B and BW */
  int *posOff, *posRel;    /* the copies of (stage, mb), when it has them */
  int *isBW;
  int *orderF, *orderB; /* S x m: k-th F (resp. B/BW) of a stage is for microbatch order[k] */
  int *nF, *nB;         /* S counters while filling order* */
} tables_t;

static void tables_free(tables_t *t) {
  free(t->posF), free(t->posB), free(t->posW), free(t->isBW), free(t->posOff), free(t->posRel);
  free(t->orderF), free(t->orderB), free(t->nF), free(t->nB);
  for (int k = 0; k < 4; k++) free(t->posV[k]);
}

/* Rules 1-3 for a vocabulary pass at position k of rank r. */
static zb_status_t check_vocab(const zb_schedule_t *s, tables_t *t, int r, int k, const zb_op_t *op) {
  const char *name = zb__op_name(op->type);
  if (!s->vocab)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: %s mb %d is a Vocabulary Parallelism pass, but the schedule's vocab is 0 "
                   "(rule: vocabulary passes only with vocab 1 or 2)", r, k, name, op->mb);
  if (op->stage != r || op->mb < 0 || op->mb >= s->m)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: %s with stage %d mb %d; a vocabulary pass names the rank that runs it "
                   "(%d) and a microbatch in 0..%d (rule: well-formed ops)",
                   r, k, name, op->stage, op->mb, r, s->m - 1);
  size_t key = (size_t)r * s->m + op->mb, skey = (size_t)op->mb;
  int *slot = &t->posV[op->type - ZB_OP_S][key];
  if (*slot != NONE)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: a second %s for mb %d (the first is at position %d) (rule: one S and one T, "
                   "and one IF and one IB where there are any, per rank and microbatch)",
                   r, k, name, op->mb, *slot);
  const char *before = NULL;
  int missing = 0;
  if (op->type == ZB_OP_S && zb__stage_rank(s, s->S - 1) == r && t->posF[(size_t)(s->S - 1) * s->m + skey] == NONE)
    before = "F of the last stage (whose hidden state it reads)", missing = 1;
  else if (op->type == ZB_OP_T && t->posV[0][key] == NONE)
    before = "S", missing = 1;
  else if (op->type == ZB_OP_IB && t->posV[2][key] == NONE)
    before = "IF", missing = 1;
  else if (op->type == ZB_OP_IB && zb__stage_rank(s, 0) == r && t->posB[skey] == NONE)
    before = "B/BW of stage 0 (whose input gradient it reads)", missing = 1;
  if (missing)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: %s mb %d comes before the %s of mb %d, which must run earlier on this "
                   "rank (rule: dependencies in order)", r, k, name, op->mb, before, op->mb);
  if (op->mb > 0 && t->posV[op->type - ZB_OP_S][key - 1] == NONE)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: %s mb %d comes before %s mb %d (rule: every rank runs each kind of "
                   "vocabulary pass in microbatch order, so that their collectives pair up in order)",
                   r, k, name, op->mb, name, op->mb - 1);
  *slot = k;
  return ZB_OK;
}

static const char *rank_label(int type) { return zb__op_name(type); }

/* Rules 2 and 3 for a copy op at position k of rank r (the ops before it are in the tables). */
static zb_status_t check_copy(const zb_schedule_t *s, tables_t *t, int r, int k, const zb_op_t *op, size_t key) {
  (void)s;
  const char *rule = "(rule: an OFFLOAD after its F and before its backward, then one RELOAD before the backward)";
  int *slot = op->type == ZB_OP_OFFLOAD ? &t->posOff[key] : &t->posRel[key];
  if (*slot != NONE)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE, "rank %d, position %d: a second %s for stage %d mb %d (the first is at "
                                            "position %d) %s",
                   r, k, zb__op_name(op->type), op->stage, op->mb, *slot, rule);
  if (op->type == ZB_OP_OFFLOAD) {
    if (t->posF[key] == NONE)
      return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: OFFLOAD of stage %d mb %d comes before its F, which saves what it "
                     "moves %s",
                     r, k, op->stage, op->mb, rule);
    if (t->posB[key] != NONE)
      return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: OFFLOAD of stage %d mb %d comes after its backward at position %d, "
                     "which has used the activations already %s",
                     r, k, op->stage, op->mb, t->posB[key], rule);
  } else if (t->posOff[key] == NONE) {
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: RELOAD of stage %d mb %d with no OFFLOAD of them before it %s", r, k,
                   op->stage, op->mb, rule);
  }
  *slot = k;
  return ZB_OK;
}

zb_status_t zb__validate_structure(const zb_schedule_t *s) {
  size_t n = (size_t)s->S * (size_t)s->m;
  /* A schedule needs at least one F and one BW per (stage, microbatch). Say so before allocating
   * tables for a huge S x m that a few ops could never fill (an imported "65535F900" claims 65536
   * stages and 901 microbatches). Small cases go on, to name the exact op that is missing. */
  if ((size_t)s->n_ops < 2 * n && n > ((size_t)1 << 22))
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "%d ops cannot cover %d stages x %d microbatches, which need at least %zu (rule: "
                   "exactly one F, and one BW or one B and one W, per stage and microbatch)",
                   s->n_ops, s->S, s->m, 2 * n);
  tables_t t = {0};
  t.posF = malloc(n * sizeof(int));
  t.posB = malloc(n * sizeof(int));
  t.posW = malloc(n * sizeof(int));
  t.posOff = malloc(n * sizeof(int));
  t.posRel = malloc(n * sizeof(int));
  t.isBW = calloc(n, sizeof(int));
  t.orderF = malloc(n * sizeof(int));
  t.orderB = malloc(n * sizeof(int));
  t.nF = calloc((size_t)s->S, sizeof(int));
  t.nB = calloc((size_t)s->S, sizeof(int));
  zb_status_t st = ZB_OK;
  if (!t.posF || !t.posB || !t.posW || !t.posOff || !t.posRel || !t.isBW || !t.orderF || !t.orderB || !t.nF ||
      !t.nB) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory validating %d ops", s->n_ops);
    goto fail;
  }
  for (size_t k = 0; k < n; k++) t.posF[k] = t.posB[k] = t.posW[k] = t.posOff[k] = t.posRel[k] = NONE;
  size_t nv = (size_t)s->p * (size_t)s->m;
  for (int v = 0; v < 4 && st == ZB_OK; v++) {
    t.posV[v] = malloc(nv * sizeof(int));
    if (!t.posV[v]) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory validating %d ops", s->n_ops);
    else
      for (size_t k = 0; k < nv; k++) t.posV[v][k] = NONE;
  }
  if (st != ZB_OK) goto fail;
  for (int k = 0; k < s->n_ops; k++) t.inputs |= s->ops[k].type == ZB_OP_IF || s->ops[k].type == ZB_OP_IB;

  /* Rules 1 and 2 (duplicates), and rule 3 as we go: a same-rank dependency must already be seen. */
  for (int r = 0; r < s->p; r++) {
    int base = s->rank_off[r], cnt = s->rank_off[r + 1] - base;
    for (int k = 0; k < cnt; k++) {
      const zb_op_t *op = &s->ops[base + k];
      if (op->type < ZB_OP_F || op->type > ZB_OP_IB) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: op type %d is not F, B, W, BW, OFFLOAD, RELOAD, S, T, IF or IB (rule: "
                     "well-formed ops)",
                     r, k, op->type);
        goto fail;
      }
      if (zb__op_is_vocab(op->type)) {
        st = check_vocab(s, &t, r, k, op);
        if (st != ZB_OK) goto fail;
        continue;
      }
      if (op->stage < 0 || op->stage >= s->S || op->mb < 0 || op->mb >= s->m) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: %s stage %d mb %d is out of range; stages are 0..%d and "
                     "microbatches 0..%d (rule: well-formed ops)",
                     r, k, rank_label(op->type), op->stage, op->mb, s->S - 1, s->m - 1);
        goto fail;
      }
      int owner = zb__stage_rank(s, op->stage);
      if (owner != r) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: %s stage %d mb %d belongs on rank %d under %s placement "
                     "(rule: each op runs on its stage's rank)",
                     r, k, rank_label(op->type), op->stage, op->mb, owner,
                     zb__placement_name(s->placement));
        goto fail;
      }
      size_t key = (size_t)op->stage * s->m + op->mb;
      if (zb__op_is_copy(op->type)) {
        st = check_copy(s, &t, r, k, op, key);
        if (st != ZB_OK) goto fail;
        continue;
      }
      int *slot = op->type == ZB_OP_F ? &t.posF[key] : op->type == ZB_OP_W ? &t.posW[key] : &t.posB[key];
      if (*slot != NONE) {
        const char *what = op->type == ZB_OP_F ? "F" : op->type == ZB_OP_W ? "W" : "B or BW";
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: a second %s for stage %d mb %d (the first is at "
                     "position %d) (rule: exactly one F, and one BW or one B and one W, per stage "
                     "and microbatch)",
                     r, k, what, op->stage, op->mb, *slot);
        goto fail;
      }
      *slot = k;
      if (op->type == ZB_OP_BW) t.isBW[key] = 1;

      /* Rule 3: same-rank dependencies must come earlier. */
      int dep_stage = -1, dep_type = 0, dep_pos = NONE;
      if (op->type == ZB_OP_F && op->stage > 0 && zb__stage_rank(s, op->stage - 1) == r) {
        dep_stage = op->stage - 1, dep_type = ZB_OP_F;
        dep_pos = t.posF[key - (size_t)s->m];
      } else if (op->type == ZB_OP_B || op->type == ZB_OP_BW) {
        if (t.posF[key] == NONE) {
          dep_stage = op->stage, dep_type = ZB_OP_F;
        } else if (op->stage + 1 < s->S && zb__stage_rank(s, op->stage + 1) == r) {
          dep_stage = op->stage + 1, dep_type = ZB_OP_B;
          dep_pos = t.posB[key + (size_t)s->m];
        }
      } else if (op->type == ZB_OP_W) {
        if (t.isBW[key]) {
          st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                       "rank %d, position %d: W for stage %d mb %d whose backward is already a "
                       "fused BW at position %d (rule: one BW or one B and one W)",
                       r, k, op->stage, op->mb, t.posB[key]);
          goto fail;
        }
        dep_stage = op->stage, dep_type = ZB_OP_B;
        dep_pos = t.isBW[key] ? NONE : t.posB[key];
      }
      /* Vocabulary Parallelism on this rank: stage 0's F reads the embedding (IF's barrier), the
       * last stage's backward the output layer's input gradient (S's barrier, or T's). */
      if (op->type == ZB_OP_F && op->stage == 0 && t.inputs && t.posV[2][(size_t)r * s->m + op->mb] == NONE) {
        dep_stage = 0, dep_type = ZB_OP_IF, dep_pos = NONE;
      } else if ((op->type == ZB_OP_B || op->type == ZB_OP_BW) && op->stage == s->S - 1 && s->vocab &&
                 t.posV[s->vocab == 2 ? 0 : 1][(size_t)r * s->m + op->mb] == NONE) {
        dep_stage = 0, dep_type = s->vocab == 2 ? ZB_OP_S : ZB_OP_T, dep_pos = NONE;
      }
      /* A backward reads what its F saved: offloaded, that must be back first. */
      if ((op->type == ZB_OP_B || op->type == ZB_OP_BW) && t.posOff[key] != NONE && t.posRel[key] == NONE) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: %s stage %d mb %d reads the activations offloaded at position "
                     "%d, but no RELOAD of them comes before it (rule: a RELOAD after each OFFLOAD and "
                     "before its backward)",
                     r, k, rank_label(op->type), op->stage, op->mb, t.posOff[key]);
        goto fail;
      }
      if (dep_stage >= 0 && dep_pos == NONE) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: %s stage %d mb %d comes before the %s of stage %d mb %d "
                     "it depends on, which must run earlier on this rank (rule: dependencies in "
                     "order)",
                     r, k, rank_label(op->type), op->stage, op->mb,
                     dep_type == ZB_OP_F ? "F" : zb__op_is_vocab(dep_type) ? zb__op_name(dep_type)
                                                 : (op->type == ZB_OP_W ? "B" : "B/BW"),
                     zb__op_is_vocab(dep_type) ? r : dep_stage, op->mb);
        goto fail;
      }
      if (op->type == ZB_OP_F) t.orderF[(size_t)op->stage * s->m + t.nF[op->stage]++] = op->mb;
      if (op->type == ZB_OP_B || op->type == ZB_OP_BW)
        t.orderB[(size_t)op->stage * s->m + t.nB[op->stage]++] = op->mb;
    }
  }

  /* Rule 2: nothing missing, and no mix of BW with B/W. */
  for (int stg = 0; stg < s->S; stg++) {
    for (int i = 0; i < s->m; i++) {
      size_t key = (size_t)stg * s->m + i;
      int owner = zb__stage_rank(s, stg);
      const char *missing = NULL;
      if (t.posF[key] == NONE) missing = "F";
      else if (t.posB[key] == NONE) missing = "B or BW";
      else if (!t.isBW[key] && t.posW[key] == NONE) missing = "W (it has a B)";
      if (missing) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d: stage %d mb %d has no %s (rule: exactly one F, and one BW or one B "
                     "and one W, per stage and microbatch)",
                     owner, stg, i, missing);
        goto fail;
      }
      if (t.isBW[key] && t.posW[key] != NONE) {
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: W for stage %d mb %d whose backward is already a fused "
                     "BW at position %d (rule: one BW or one B and one W)",
                     owner, t.posW[key], stg, i, t.posB[key]);
        goto fail;
      }
    }
  }

  /* Rule 2 for the vocabulary passes: S and T for every rank and microbatch, IF and IB too where
   * there are any. */
  for (int r = 0; s->vocab && r < s->p; r++)
    for (int i = 0; i < s->m; i++)
      for (int v = 0; v < (t.inputs ? 4 : 2); v++)
        if (t.posV[v][(size_t)r * s->m + i] == NONE) {
          st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                       "rank %d: mb %d has no %s (rule: with vocab %d every rank runs one S and one T per microbatch, "
                       "and one IF and one IB where any rank has them)",
                       r, i, zb__op_name(ZB_OP_S + v), s->vocab);
          goto fail;
        }

  /* Rule 4: FIFO channels between adjacent stages on different ranks. */
  for (int stg = 0; stg + 1 < s->S; stg++) {
    int ra = zb__stage_rank(s, stg), rb = zb__stage_rank(s, stg + 1);
    if (ra == rb) continue;
    const int *sendF = t.orderF + (size_t)stg * s->m, *recvF = t.orderF + (size_t)(stg + 1) * s->m;
    const int *sendB = t.orderB + (size_t)(stg + 1) * s->m, *recvB = t.orderB + (size_t)stg * s->m;
    for (int k = 0; k < s->m; k++) {
      if (sendF[k] != recvF[k]) {
        size_t key = (size_t)(stg + 1) * s->m + recvF[k];
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: F stage %d mb %d is its forward input number %d from "
                     "rank %d, but rank %d sends mb %d as number %d (rule: channels are FIFO, the "
                     "receive order must equal the send order)",
                     rb, t.posF[key], stg + 1, recvF[k], k, ra, ra, sendF[k], k);
        goto fail;
      }
      if (sendB[k] != recvB[k]) {
        size_t key = (size_t)stg * s->m + recvB[k];
        st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                     "rank %d, position %d: %s stage %d mb %d is its gradient input number %d from "
                     "rank %d, but rank %d sends mb %d as number %d (rule: channels are FIFO, the "
                     "receive order must equal the send order)",
                     ra, t.posB[key], t.isBW[key] ? "BW" : "B", stg, recvB[k], k, rb, rb, sendB[k],
                     k);
        goto fail;
      }
    }
  }

fail:
  tables_free(&t);
  return st;
}

zb_status_t zb_schedule_validate(const zb_schedule_t *s) {
  ZB_ARG_NOT_NULL(s);
  ZB_CHECK(zb__validate_structure(s));

  /* Rule 5: run it. */
  size_t n = (size_t)(s->n_ops ? s->n_ops : 1);
  double *start = malloc(n * sizeof(double)), *end = malloc(n * sizeof(double));
  if (!start || !end) {
    free(start), free(end);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory validating %d ops", s->n_ops);
  }
  zb_status_t st = zb__simulate_times(s, start, end);

  /* Rule 6: memory (device-resident, in time over both lanes where there are copies). */
  for (int r = 0; st == ZB_OK && s->mem_limit > 0 && r < s->p; r++) {
    double dev, host, at = 0;
    int over;
    st = zb__rank_memory(s, r, start, end, s->mem_limit, &dev, &host, &over, &at);
    if (st == ZB_OK && over >= 0) {
      const zb_op_t *op = &s->ops[over];
      int copies = 0;
      for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) copies |= zb__op_is_copy(s->ops[k].type);
      st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "rank %d, position %d: after %s stage %d mb %d the rank holds %.4g microbatches of "
                   "activations%s, above the limit %.4g (rule: memory under the limit)",
                   r, over - s->rank_off[r], zb__op_name(op->type), op->stage, op->mb, at,
                   copies ? " on the device" : "", s->mem_limit);
    }
  }
  free(start), free(end);
  if (st != ZB_OK) return st;
  return ZB_OK;
}
