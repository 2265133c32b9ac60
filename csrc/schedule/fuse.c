/*
 * fuse.c - zb-auto's split where it pays: a microbatch's B and W run as one fused BW wherever a W
 * apart does not make the schedule shorter, and 1F1B's last backwards split where that does.
 *
 * Splitting a backward is not free where it really runs. A W apart is a second op (a call, a
 * dispatch, its own bookkeeping) and, in the torch layer, a split layer's forward and backward go
 * through an autograd Function in Python instead of torch's own node: on bench_torch.py's GPT the
 * second stage's B + W measured 8% more than its fused backward (RESULTS.md).
 * The plan needs a W apart only where it fills a hole the fused backward would leave. Given
 * time_bw below time_b + time_w (StageCosts measures it from the timelines), the planner weighs
 * that itself; given only time_b + time_w, this rarely changes the search's plan.
 *
 * The rule, stated so that it can be tested: in list order, rank by rank, each B whose W is on the
 * same rank becomes a BW at the B's place (its W removed) when the stage's W and BW ops stay in
 * microbatch order (so the gradients are summed as a sequential loop sums them, bit for bit) and
 * the schedule then simulates shorter: end to end (first op's start to last op's end over all
 * ranks, what a step takes) and no longer as the largest rank span (the paper's cost), or the other
 * way round, by more than ZB_EPS; passes repeat until one changes nothing (or the work budget
 * is spent). Only shorter: with time_bw = time_b + time_w (nothing measured) that is rare (a W
 * moved up next to its B can still free a hole further on), and the plan mostly stays the
 * search's. Memory never grows: a BW frees the microbatch's whole share at the B's place, where B
 * freed part of it and W the rest later. Each candidate costs a simulation,
 * so the pass runs on schedules of at most `max_ops` ops and leaves larger ones as the search
 * made them (zb-auto: every candidate up to 2,048 ops, the winner up to 6,144; p = 8, v = 2, m = 128
 * is 6,144).
 *
 * The other way (zb__unfuse_tail), from 1F1B: each BW of the last 2p + 2 microbatches, last first,
 * becomes B + W with the W at the best of the next 2p + 3 places before the stage's next W or BW
 * (microbatch order again), while that makes the schedule shorter within the memory limit. On two
 * ranks whose first stage runs its whole backward at W this finds the plan that splits only the
 * last rank's last backward (test_generators: test_zb_auto_splits_where_it_pays).
 *
 * What this is not: a search over orders; the ops keep their order, only pairs merge or part.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* At most this many ops simulated by one call (each candidate is a simulation of all ops): about
 * 10-20 ms here. What fits is searched; beyond it the schedule keeps what was found so far. */
enum { FUSE_MAX_PASSES = 8 };
#define FUSE_WORK_BUDGET 400000LL

/* Writes into `dst` (ops) and `dst_off` (rank offsets) the ops of `s` with the B at index k made a
 * BW and the W at index w (same rank, after or before it) removed. */
static void merged(const zb_schedule_t *s, int k, int w, zb_op_t *dst, int *dst_off) {
  memcpy(dst, s->ops, (size_t)w * sizeof(zb_op_t));
  memcpy(dst + w, s->ops + w + 1, (size_t)(s->n_ops - w - 1) * sizeof(zb_op_t));
  dst[k < w ? k : k - 1].type = ZB_OP_BW;
  for (int r = 0; r <= s->p; r++) dst_off[r] = s->rank_off[r] - (s->rank_off[r] > w ? 1 : 0);
}

/* Whether ops [a, b) accumulate stage `stage`'s weight gradients (its W and BW ops) in microbatch
 * order, as a sequential loop does: a BW runs its W work at once, so fusing B(s, i) while W(s, j <
 * i) still waits would add microbatch i's gradient first and change the sum's rounding. */
static int in_mb_order(const zb_op_t *ops, int a, int b, int stage) {
  int last = -1;
  for (int k = a; k < b; k++)
    if (ops[k].stage == stage && (ops[k].type == ZB_OP_W || ops[k].type == ZB_OP_BW)) {
      if (ops[k].mb < last) return 0;
      last = ops[k].mb;
    }
  return 1;
}

zb_status_t zb__fuse_free(zb_schedule_t *s, int max_ops) {
  if (s->n_ops < 2 || s->n_ops > max_ops) return ZB_OK;
  size_t n = (size_t)s->n_ops;
  zb_op_t *cand = malloc(n * sizeof(zb_op_t));
  int *cand_off = malloc(((size_t)s->p + 1) * sizeof(int));
  double *start = malloc(n * sizeof(double)), *end = malloc(n * sizeof(double));
  if (!cand || !cand_off || !start || !end) {
    free(cand), free(cand_off), free(start), free(end);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory fusing %d ops", s->n_ops);
  }
  zb_status_t st = zb__simulate_times(s, start, end);
  double cost = 0, makespan = 0;
  if (st == ZB_OK) cost = zb__sim_stats(s, start, end).cost, makespan = zb__makespan_of(s, start, end);
  int changed = st == ZB_OK;
  long long work = 0; /* simulated ops; the pass stops at FUSE_WORK_BUDGET */
  for (int pass = 0; changed && pass < FUSE_MAX_PASSES && st == ZB_OK && work < FUSE_WORK_BUDGET; pass++) {
    changed = 0;
    for (int r = 0; r < s->p && st == ZB_OK && work < FUSE_WORK_BUDGET; r++) {
      for (int k = s->rank_off[r]; k < s->rank_off[r + 1] && st == ZB_OK && work < FUSE_WORK_BUDGET; k++) {
        zb_op_t b = s->ops[k];
        if (b.type != ZB_OP_B) continue;
        int w = -1;
        for (int j = s->rank_off[r]; j < s->rank_off[r + 1]; j++)
          if (s->ops[j].type == ZB_OP_W && s->ops[j].stage == b.stage && s->ops[j].mb == b.mb) w = j;
        if (w < 0) continue; /* its W is elsewhere (a custom map): left as it is */
        merged(s, k, w, cand, cand_off);
        if (!in_mb_order(cand, cand_off[r], cand_off[r + 1], b.stage)) continue;
        zb_schedule_t t = *s; /* the same schedule but for its op list */
        t.ops = cand, t.rank_off = cand_off, t.n_ops = s->n_ops - 1, t.simulated = 0;
        zb_status_t sim = zb__simulate_times(&t, start, end);
        work += t.n_ops;
        if (sim != ZB_OK) {
          /* Fusing cannot add a dependency (BW(s,i) waits for what B(s,i) waited for), so a
           * deadlock here is a bug of this pass: reported, not hidden. */
          st = sim;
          break;
        }
        double c = zb__sim_stats(&t, start, end).cost, mk = zb__makespan_of(&t, start, end);
        if ((mk < makespan - ZB_EPS && c <= cost + ZB_EPS) || (mk <= makespan + ZB_EPS && c < cost - ZB_EPS)) {
          memcpy(s->ops, cand, (size_t)t.n_ops * sizeof(zb_op_t));
          memcpy(s->rank_off, cand_off, ((size_t)s->p + 1) * sizeof(int));
          s->n_ops = t.n_ops;
          cost = c < cost ? c : cost;
          makespan = mk < makespan ? mk : makespan;
          changed = 1;
          if (w < k) k--; /* the BW moved one place up with the W removed before it */
        }
      }
    }
  }
  free(cand), free(cand_off), free(start), free(end);
  s->simulated = 0;
  return st;
}

/* Writes into dst/dst_off the ops of `s` with the BW at index k (on rank r) made a B and its W
 * inserted at index pos (k < pos <= the end of rank r's ops). */
static void unmerged(const zb_schedule_t *s, int r, int k, int pos, zb_op_t *dst, int *dst_off) {
  memcpy(dst, s->ops, (size_t)pos * sizeof(zb_op_t));
  dst[pos] = (zb_op_t){ZB_OP_W, s->ops[k].stage, s->ops[k].mb};
  memcpy(dst + pos + 1, s->ops + pos, (size_t)(s->n_ops - pos) * sizeof(zb_op_t));
  dst[k].type = ZB_OP_B;
  for (int q = 0; q <= s->p; q++) dst_off[q] = s->rank_off[q] + (q > r ? 1 : 0);
}

zb_status_t zb__unfuse_tail(zb_schedule_t *s, double limit, int max_ops) {
  if (s->n_ops < 2 || s->n_ops > max_ops) return ZB_OK;
  size_t cap = (size_t)s->n_ops + (size_t)s->S * (size_t)s->m; /* every BW split at most once */
  zb_op_t *cand = malloc(cap * sizeof(zb_op_t)), *best = malloc(cap * sizeof(zb_op_t)),
          *ops = malloc(cap * sizeof(zb_op_t));
  size_t offs = (size_t)s->p + 1;
  int *cand_off = malloc(offs * sizeof(int)), *best_off = malloc(offs * sizeof(int)), *off = malloc(offs * sizeof(int));
  double *start = malloc(cap * sizeof(double)), *end = malloc(cap * sizeof(double));
  if (!cand || !best || !ops || !cand_off || !best_off || !off || !start || !end) {
    free(cand), free(best), free(ops), free(cand_off), free(best_off), free(off), free(start), free(end);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory splitting %d ops", s->n_ops);
  }
  /* s->ops is sized for its own ops: work on a copy with room for the W's added. */
  memcpy(ops, s->ops, (size_t)s->n_ops * sizeof(zb_op_t));
  memcpy(off, s->rank_off, offs * sizeof(int));
  zb_schedule_t cur = *s;
  cur.ops = ops, cur.rank_off = off, cur.simulated = 0;
  zb_status_t st = zb__simulate_times(&cur, start, end);
  double cost = 0, makespan = 0;
  if (st == ZB_OK) cost = zb__sim_stats(&cur, start, end).cost, makespan = zb__makespan_of(&cur, start, end);
  const int tail = 2 * s->p + 2; /* the microbatches and positions tried: the cool-down's */
  /* Simulated ops, all candidates together: the search stops there (at p = 32, m = 32 an unbounded
   * one took seconds, where zb-auto's other work takes milliseconds). */
  long long work = 0;
  const long long budget = FUSE_WORK_BUDGET;
  for (int improved = st == ZB_OK; improved && st == ZB_OK && work < budget;) {
    improved = 0;
    for (int r = 0; r < cur.p && st == ZB_OK && work < budget; r++) {
      int a = cur.rank_off[r], b = cur.rank_off[r + 1];
      /* The rank's BW's from its last backward up: a split pays where a B's gradient is awaited.
       * After a split the scan goes on up the same rank (the BW's above are where they were). */
      for (int k = b - 1; k >= a && st == ZB_OK && work < budget; k--) {
        zb_op_t bw = cur.ops[k];
        if (bw.type != ZB_OP_BW || bw.mb < cur.m - tail) continue;
        int hi = b; /* W(s, i) before any later W or BW of its stage: microbatch order */
        for (int j = k + 1; j < b; j++)
          if (cur.ops[j].stage == bw.stage && (cur.ops[j].type == ZB_OP_W || cur.ops[j].type == ZB_OP_BW)) {
            hi = j;
            break;
          }
        double bc = cost, bm = makespan;
        int found = 0;
        for (int pos = k + 1; pos <= hi && pos <= k + 1 + tail; pos++) {
          unmerged(&cur, r, k, pos, cand, cand_off);
          zb_schedule_t t = cur;
          t.ops = cand, t.rank_off = cand_off, t.n_ops = cur.n_ops + 1;
          st = zb__simulate_times(&t, start, end);
          work += t.n_ops;
          if (st != ZB_OK) break; /* cannot deadlock (W depends on its B only): a bug, reported */
          zb_sim_result_t res = zb__sim_stats(&t, start, end);
          double c = res.cost, mk = zb__makespan_of(&t, start, end);
          int shorter = (mk < bm - ZB_EPS && c <= bc + ZB_EPS) || (mk <= bm + ZB_EPS && c < bc - ZB_EPS);
          if (shorter && res.max_peak_memory <= limit + ZB_EPS) {
            memcpy(best, cand, (size_t)t.n_ops * sizeof(zb_op_t));
            memcpy(best_off, cand_off, ((size_t)cur.p + 1) * sizeof(int));
            bc = c, bm = mk, found = 1;
          }
        }
        if (found && st == ZB_OK) {
          memcpy(cur.ops, best, ((size_t)cur.n_ops + 1) * sizeof(zb_op_t));
          memcpy(cur.rank_off, best_off, ((size_t)cur.p + 1) * sizeof(int));
          cur.n_ops++;
          cost = bc, makespan = bm, improved = 1;
          b++; /* this rank's list grew by the W; the ops above k did not move */
        }
      }
    }
  }
  if (st == ZB_OK && cur.n_ops != s->n_ops) {
    zb_op_t *grown = realloc(s->ops, (size_t)cur.n_ops * sizeof(zb_op_t));
    if (!grown) {
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory splitting %d ops", s->n_ops);
    } else {
      memcpy(grown, cur.ops, (size_t)cur.n_ops * sizeof(zb_op_t));
      memcpy(s->rank_off, off, offs * sizeof(int));
      s->ops = grown, s->n_ops = cur.n_ops;
      free(s->start), free(s->end);
      s->start = s->end = NULL;
    }
  }
  free(cand), free(best), free(ops), free(cand_off), free(best_off), free(off), free(start), free(end);
  s->simulated = 0;
  return st;
}
