/*
 * search.c - a local search over a finished schedule's op orders, judged by the simulator: swaps
 * of two neighbouring ops of one rank, kept when the step gets no longer and the rank stays within
 * the memory limit, the best order kept only when it is strictly shorter than the one given.
 *
 * What it is for: the memory-tight V kinds (v-half, v-min), whose rule-built orders a CP-SAT solver
 * found up to 12% above the optimum on small cases; the search takes them closer where a few swaps
 * do it. With Vocabulary Parallelism's passes it moves them and the compute ops around each other. A swap never breaks a rule of the model: two ops that share a channel (a FIFO) or belong to
 * one (stage, microbatch) keep their order, and an order that deadlocks is refused by the simulator.
 *
 * Deterministic: a fixed pseudo-random sequence seeded from the schedule's shape and a work budget
 * counted in simulated ops (not wall time, which differs between machines), so every rank of a
 * pipeline plans the same schedule. zb_schedule_refine's budget, ZB_REFINE_WORK, is about 100 ms on
 * a 2020s core.
 *
 * What it is not: a solver. It finds what single swaps reach from the given order, no more.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"



static uint64_t next_rand(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The channels an op reads or writes (fwd boundary b: 2b, bwd: 2b + 1), -1 for none. */
static void channels(const zb_schedule_t *s, const zb_op_t *op, int ch[2]) {
  const int S = s->p * s->v, st = op->stage;
  ch[0] = ch[1] = -1;
  if (op->type == ZB_OP_F) {
    if (st > 0) ch[0] = 2 * (st - 1);
    if (st < S - 1) ch[1] = 2 * st;
  } else if (op->type == ZB_OP_B || op->type == ZB_OP_BW) {
    if (st < S - 1) ch[0] = 2 * st + 1;
    if (st > 0) ch[1] = 2 * (st - 1) + 1;
  }
}

static int is_backward(int type) { return type == ZB_OP_B || type == ZB_OP_W || type == ZB_OP_BW; }

/* Whether neighbours a (first) and b may change places: no copies, not of one (stage,
 * microbatch), not two backwards of one stage, no channel in common, and not two of Vocabulary Parallelism's passes of one kind
 * (each kind runs in microbatch order on every rank, so every rank enters its barriers in the same
 * order). A pass may pass a compute op: its dependencies are the simulator's to check. */
static int may_swap(const zb_schedule_t *s, const zb_op_t *a, const zb_op_t *b) {
  if (zb__op_is_copy(a->type) || zb__op_is_copy(b->type)) return 0;
  if (zb__op_is_vocab(a->type) || zb__op_is_vocab(b->type)) return a->type != b->type;
  if (a->stage == b->stage && a->mb == b->mb) return 0;
  /* A stage's backwards keep their microbatch order: its W ops add into the weight gradients in
   * that order, which is what makes the gradients a sequential loop's, bit for bit. */
  if (a->stage == b->stage && is_backward(a->type) && is_backward(b->type)) return 0;
  int ca[2], cb[2];
  channels(s, a, ca);
  channels(s, b, cb);
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++)
      if (ca[i] >= 0 && ca[i] == cb[j]) return 0;
  return 1;
}

/* Simulates s into start/end; *step the makespan, *fits whether rank r is within limit. */
static int judge(const zb_schedule_t *s, int r, double limit, double *start, double *end, double *step) {
  if (zb__simulate_times(s, start, end) != ZB_OK) {
    zb__clear_error();
    return 0; /* deadlocks */
  }
  if (limit > 0) {
    double dev, host, at;
    int over;
    if (zb__rank_memory(s, r, start, end, 0, &dev, &host, &over, &at) != ZB_OK) {
      zb__clear_error();
      return 0;
    }
    if (dev > limit + ZB_EPS) return 0;
  }
  *step = zb__makespan_of(s, start, end);
  return 1;
}

zb_status_t zb__local_search(zb_schedule_t *s, double limit, long long budget) {
  const int n = s->n_ops;
  if (n < 2) return ZB_OK;
  double *start = malloc((size_t)n * sizeof(double)), *end = malloc((size_t)n * sizeof(double));
  zb_op_t *best = malloc((size_t)n * sizeof(zb_op_t));
  if (!start || !end || !best) {
    free(start), free(end), free(best);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the local search over %d ops", n);
  }
  double base;
  int ok = judge(s, 0, 0, start, end, &base);
  double cur = base, best_step = base;
  memcpy(best, s->ops, (size_t)n * sizeof(zb_op_t));
  uint64_t seed = ((uint64_t)s->p << 40) ^ ((uint64_t)s->m << 20) ^ (uint64_t)s->v ^ (uint64_t)n;
  const double tol = ZB_EPS * fmax(1.0, base);
  for (long long work = 0; ok && work < budget; work += n) {
    const int r = (int)(next_rand(&seed) % (uint64_t)s->p);
    const int lo = s->rank_off[r], cnt = s->rank_off[r + 1] - lo;
    if (cnt < 2) continue;
    const int k = lo + 1 + (int)(next_rand(&seed) % (uint64_t)(cnt - 1));
    zb_op_t *a = &s->ops[k - 1], *b = &s->ops[k];
    if (!may_swap(s, a, b)) continue;
    zb_op_t t = *a;
    *a = *b, *b = t;
    double step;
    if (judge(s, r, limit, start, end, &step) && step <= cur + tol) { /* no longer: keep (plateaus too) */
      cur = step;
      if (step < best_step - tol) {
        best_step = step;
        memcpy(best, s->ops, (size_t)n * sizeof(zb_op_t));
      }
    } else {
      t = *a, *a = *b, *b = t;
    }
  }
  /* Only a strictly shorter order replaces the one given; every rank's memory was checked where
   * its list changed. */
  memcpy(s->ops, best, (size_t)n * sizeof(zb_op_t));
  zb__schedule_invalidate(s);
  free(start), free(end), free(best);
  return ZB_OK;
}
