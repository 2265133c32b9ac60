/*
 * offload.c - the offload pass (PipeOffload): copies placed into any schedule, zb_schedule_plan_offload.
 *
 * The rule, stated so it can be tested:
 *   1. Candidates are the (stage, mb) whose activations live longer than a round trip: from the end
 *      of F(s,i) to the start of its backward (B or BW) at least T_OFFLOAD(s) + T_RELOAD(s), in the
 *      schedule as given. They are tried longest lifespan first (ties: lower stage, then lower mb),
 *      as the activations held longest are the ones worth moving (PipeOffload's selective offload).
 *   2. A candidate gets its OFFLOAD right after its F in the rank's list (issued with the F, so it
 *      starts when the F ends and the lane is free) and its RELOAD right after the latest compute
 *      op whose start leaves T_RELOAD before the backward starts (it is issued there), in the
 *      schedule as it stands with the copies accepted so far, each behind copies already issued at
 *      that point; when that does not pass rule 3, after one of the two compute ops before it. With
 *      no compute op between the F and that point, there is no room: the candidate is skipped.
 *   3. The schedule with the candidate's copies is simulated; it is kept when the end-to-end time
 *      (makespan) and the largest rank span (the cost, which bubble rates use) stay within
 *      (1 + slowdown) of the schedule without copies, the rank's device peak
 *      does not grow, the host peak stays under host_limit where one is set, and, with
 *      paired_lanes, no two copies of a pair of ranks (2k, 2k+1) overlap in time. Otherwise the
 *      candidate is dropped and the next one is tried: a copy that does not fit is never an error,
 *      the result just has fewer copies.
 *   4. With device_limit set, the pass stops once every rank's device peak is at most the limit;
 *      without, it offloads every candidate that the rule keeps.
 *   5. Then each kept candidate is taken out again, shortest-lived first, where that leaves every
 *      rank's device peak and the step as they are (and pairs' copies apart): a copy that lowers no peak only costs
 *      bandwidth and host memory. Rules 3 and 5 repeat (at most MAX_SWEEPS times) while 3 keeps
 *      a candidate it had not: one that did not fit may, once others have gone or moved.
 *   6. Each try simulates the whole schedule, so the pass stops trying after WORK_BUDGET simulated
 *      ops (about a second here), keeping what it placed: 1F1B at p = 32, m = 128 takes all of it.
 *   7. With slowdown > 0 the pass (1-6) runs twice, with no slowdown and with the one allowed, and
 *      keeps the second only where it lowers the largest device peak (and the first does not meet
 *      device_limit already): the slowdown is what the step may pay for memory. A copy kept early
 *      under the allowance can block one that would have hidden, so the second can reach the same
 *      peak with a longer step (interleaved 1F1B at p = 4, m = 8, copies k = 0.5 did: 1.018x).
 * Compute ops keep their order, so what the ranks compute, and in which order, is unchanged.
 *
 * What this is not: a search over op orders (the compute order is the input's; zb-auto's planning
 * with offload is a later step), nor a model of a PCIe link shared by two ranks.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Sweeps of rules 3 and 5 (insert, then take out what lowers no peak), while insertion keeps
 * something new. */
#define MAX_SWEEPS 4

/* Places tried for a candidate's RELOAD (rule 2). */
#define RELOAD_TRIES 3

/* Simulated ops the pass may spend on tries (rule 6). */
#define WORK_BUDGET 60000000LL

typedef struct {
  int stage, mb;
  double life;
} cand_t;

static int cand_cmp(const void *a, const void *b) {
  const cand_t *x = a, *y = b;
  if (x->life != y->life) return x->life > y->life ? -1 : 1;
  if (x->stage != y->stage) return x->stage - y->stage;
  return x->mb - y->mb;
}

/* Simulates t's ops into start/end and fills the makespan, every rank's device peak (dev, p
 * values) and the largest host peak. ZB_ERR_INVALID_SCHEDULE when the ops cannot run. */
static zb_status_t measure(const zb_schedule_t *t, double *start, double *end, double *makespan, double *dev,
                           double *host_max) {
  ZB_CHECK(zb__simulate_times(t, start, end));
  *makespan = zb__makespan_of(t, start, end);
  *host_max = 0;
  for (int r = 0; r < t->p; r++) {
    double d, h, at;
    int over;
    ZB_CHECK(zb__rank_memory(t, r, start, end, 0, &d, &h, &over, &at));
    dev[r] = d;
    if (h > *host_max) *host_max = h;
  }
  return ZB_OK;
}

/* With paired lanes (ranks 2k and 2k+1 share a link): whether a copy of rank r and one of its
 * partner run at the same time. Each lane runs its copies one at a time in list order, so both
 * sides' intervals come sorted by start. */
static int pair_overlap(const zb_schedule_t *t, const double *start, const double *end, int r) {
  const int q = r ^ 1;
  if (q >= t->p) return 0;
  int a = t->rank_off[r], ae = t->rank_off[r + 1], b = t->rank_off[q], be = t->rank_off[q + 1];
  for (;;) {
    while (a < ae && !zb__op_is_copy(t->ops[a].type)) a++;
    while (b < be && !zb__op_is_copy(t->ops[b].type)) b++;
    if (a >= ae || b >= be) return 0;
    if (start[a] < end[b] - ZB_EPS && start[b] < end[a] - ZB_EPS) return 1;
    if (end[a] <= end[b]) a++;
    else b++;
  }
}

/* Any pair's copies at the same time: a change on one rank can move the compute, and so the copies,
 * of others (within the step's bound), so every pair is looked at. */
static int pair_overlaps(const zb_schedule_t *t, const double *start, const double *end, int r) {
  (void)r;
  for (int q = 0; q < t->p; q += 2)
    if (pair_overlap(t, start, end, q)) return 1;
  return 0;
}

/* The largest rank span over compute ops (the paper's cost; copies run beside them). */
static double cost_of(const zb_schedule_t *t, const double *start, const double *end) {
  double cost = 0;
  for (int r = 0; r < t->p; r++) {
    double lo = INFINITY, hi = -INFINITY;
    for (int k = t->rank_off[r]; k < t->rank_off[r + 1]; k++)
      if (!zb__op_is_copy(t->ops[k].type)) lo = fmin(lo, start[k]), hi = fmax(hi, end[k]);
    if (hi > lo) cost = fmax(cost, hi - lo);
  }
  return cost;
}

/* Positions (in t's flat list) of F(s,i) and its backward on their rank; -1 if absent. */
static void find_ops(const zb_schedule_t *t, int r, int stage, int mb, int *pf, int *pb) {
  *pf = *pb = -1;
  for (int k = t->rank_off[r]; k < t->rank_off[r + 1]; k++) {
    const zb_op_t *op = &t->ops[k];
    if (op->stage != stage || op->mb != mb) continue;
    if (op->type == ZB_OP_F) *pf = k;
    if ((op->type == ZB_OP_B || op->type == ZB_OP_BW) && *pb < 0) *pb = k;
  }
}

/* A try's undo: t's lists as they were (saved into ops and off), put back. */
typedef struct {
  zb_op_t *ops;
  int *off, n;
} undo_t;

static void snapshot(const zb_schedule_t *t, undo_t *u) {
  memcpy(u->ops, t->ops, (size_t)t->n_ops * sizeof *u->ops);
  memcpy(u->off, t->rank_off, ((size_t)t->p + 1) * sizeof(int));
  u->n = t->n_ops;
}

static void restore(zb_schedule_t *t, const undo_t *u) {
  memcpy(t->ops, u->ops, (size_t)u->n * sizeof *u->ops);
  memcpy(t->rank_off, u->off, ((size_t)t->p + 1) * sizeof(int));
  t->n_ops = u->n;
  zb__schedule_invalidate(t);
}

/* Removes the OFFLOAD and RELOAD of (stage, mb) from rank r's list. */
static void remove_copies(zb_schedule_t *t, int r, int stage, int mb) {
  int j = 0, gone = 0;
  for (int k = 0; k < t->n_ops; k++) {
    const zb_op_t *op = &t->ops[k];
    if (zb__op_is_copy(op->type) && op->stage == stage && op->mb == mb) {
      gone++;
      continue;
    }
    t->ops[j++] = *op;
  }
  t->n_ops = j;
  for (int x = r + 1; x <= t->p; x++) t->rank_off[x] -= gone;
  zb__schedule_invalidate(t);
}

/* t's ops with OFFLOAD inserted after position pf and RELOAD after position q (pf < q, compute
 * ops of rank r), each behind the copies already there: the copy lane runs in list order, so a
 * copy put ahead of one issued at the same point could hold it up (an OFFLOAD waits for its F to
 * end, while a RELOAD behind it could have started at the F's start). `into` has n_ops + 2
 * entries; rank_off of t is updated. */
static void insert_copies(zb_schedule_t *t, zb_op_t *into, int r, int pf, int q, int stage, int mb) {
  int last = t->rank_off[r + 1] - 1;
  while (pf < last && zb__op_is_copy(t->ops[pf + 1].type)) pf++;
  while (q < last && zb__op_is_copy(t->ops[q + 1].type)) q++;
  int j = 0;
  for (int k = 0; k < t->n_ops; k++) {
    into[j++] = t->ops[k];
    if (k == pf) into[j++] = (zb_op_t){ZB_OP_OFFLOAD, stage, mb};
    if (k == q) into[j++] = (zb_op_t){ZB_OP_RELOAD, stage, mb};
  }
  memcpy(t->ops, into, (size_t)j * sizeof *into);
  t->n_ops = j;
  for (int x = r + 1; x <= t->p; x++) t->rank_off[x] += 2;
  zb__schedule_invalidate(t);
}

/* The largest device peak of any rank of a simulated schedule, and its makespan. */
static zb_status_t peak_and_step(const zb_schedule_t *s, double *peak, double *step) {
  *peak = 0;
  for (int r = 0; r < s->p; r++) {
    double d, h;
    ZB_CHECK(zb_schedule_rank_memory(s, r, &d, &h));
    if (d > *peak) *peak = d;
  }
  *step = zb__makespan_of(s, s->start, s->end);
  return ZB_OK;
}

static zb_status_t offload_pass(zb_schedule_t **out, const zb_schedule_t *src, const zb_offload_config_t *cfg);

zb_status_t zb_schedule_plan_offload(zb_schedule_t **out, const zb_schedule_t *src, const zb_offload_config_t *cfg) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(src);
  zb_offload_config_t c = ZB_OFFLOAD_CONFIG_INIT;
  if (cfg) {
    const size_t before_stages = offsetof(zb_offload_config_t, stages);
    const size_t before_paired = offsetof(zb_offload_config_t, paired_lanes);
    if ((cfg->struct_size != before_stages && cfg->struct_size != before_paired &&
         cfg->struct_size < sizeof(zb_offload_config_t)) ||
        cfg->version != ZB_OFFLOAD_CONFIG_VERSION)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "zb_offload_config_t has struct_size %u and version %u; initialise it with "
                     "ZB_OFFLOAD_CONFIG_INIT (size %zu, version %d)",
                     (unsigned)cfg->struct_size, (unsigned)cfg->version, sizeof(zb_offload_config_t),
                     ZB_OFFLOAD_CONFIG_VERSION);
    memcpy(&c, cfg, cfg->struct_size < sizeof c ? cfg->struct_size : sizeof c);
  }
  if (isnan(c.device_limit) || isinf(c.device_limit) || isnan(c.host_limit) || isinf(c.host_limit) ||
      !(c.slowdown >= 0) || isinf(c.slowdown))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_offload_config_t: device_limit %g, host_limit %g (finite; <= 0 for none) and slowdown %g "
                   "(a fraction >= 0 the step may grow by)",
                   c.device_limit, c.host_limit, c.slowdown);
  ZB_CHECK(zb__validate_structure(src));
  for (int k = 0; k < src->n_ops; k++) {
    if (zb__op_is_copy(src->ops[k].type))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "the schedule has copies already (%s stage %d mb %d); plan offload on a schedule without them",
                     zb__op_name(src->ops[k].type), src->ops[k].stage, src->ops[k].mb);
    if (zb__op_is_vocab(src->ops[k].type))
      return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                     "the schedule has Vocabulary Parallelism's passes (%s mb %d on rank %d); the offload pass does "
                     "not place copies around them yet", zb__op_name(src->ops[k].type), src->ops[k].mb,
                     src->ops[k].stage);
  }
  if (!(c.slowdown > 0)) return offload_pass(out, src, &c);
  /* 7: the slowdown is what the step may pay for a lower peak, not a budget to spend. */
  zb_schedule_t *flat = NULL, *slow = NULL;
  zb_offload_config_t c0 = c;
  c0.slowdown = 0;
  ZB_CHECK(offload_pass(&flat, src, &c0));
  zb_status_t st = offload_pass(&slow, src, &c);
  double flat_peak = 0, slow_peak = 0, step;
  if (st == ZB_OK) st = peak_and_step(flat, &flat_peak, &step);
  if (st == ZB_OK) st = peak_and_step(slow, &slow_peak, &step);
  if (st != ZB_OK) {
    zb_schedule_destroy(flat);
    zb_schedule_destroy(slow);
    return st;
  }
  const int flat_meets = c.device_limit > 0 && flat_peak <= c.device_limit + ZB_EPS;
  if (!flat_meets && slow_peak < flat_peak - ZB_EPS) {
    zb_schedule_destroy(flat);
    *out = slow;
  } else {
    zb_schedule_destroy(slow);
    *out = flat;
  }
  return ZB_OK;
}

/* Rules 1-6 under c (validated), into *out. */
static zb_status_t offload_pass(zb_schedule_t **out, const zb_schedule_t *src, const zb_offload_config_t *cfg) {
  const zb_offload_config_t c = *cfg;
  *out = NULL;
  zb_schedule_t *t = NULL;
  ZB_CHECK(zb__schedule_clone_empty(src, &t));
  t->kind = src->kind;
  size_t cap = (size_t)src->n_ops + 2 * (size_t)src->S * (size_t)src->m + 1;
  zb_op_t *ops = malloc(cap * sizeof *ops), *scratch = malloc(cap * sizeof *ops);
  double *start = malloc(cap * sizeof(double)), *end = malloc(cap * sizeof(double));
  double *tstart = malloc(cap * sizeof(double)), *tend = malloc(cap * sizeof(double));
  double *dev = malloc((size_t)src->p * sizeof(double)), *tdev = malloc((size_t)src->p * sizeof(double));
  cand_t *cand = malloc(((size_t)src->S * (size_t)src->m + 1) * sizeof *cand);
  unsigned char *kept = calloc((size_t)src->S * (size_t)src->m + 1, 1);
  double *life_from = malloc(((size_t)src->S * (size_t)src->m + 1) * sizeof(double));
  double *life_to = malloc(((size_t)src->S * (size_t)src->m + 1) * sizeof(double));
  zb_op_t *saved = malloc(cap * sizeof *saved);
  int *saved_off = malloc(((size_t)src->p + 1) * sizeof(int));
  zb_status_t st = ZB_OK;
  if (!ops || !scratch || !start || !end || !tstart || !tend || !dev || !tdev || !cand || !kept || !saved || !saved_off || !life_from ||
      !life_to) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning offload for %d ops", src->n_ops);
    goto done;
  }
  undo_t undo = {saved, saved_off, 0};
  memcpy(ops, src->ops, (size_t)src->n_ops * sizeof *ops);
  free(t->ops);
  t->ops = ops, ops = NULL;
  t->n_ops = src->n_ops;
  memcpy(t->rank_off, src->rank_off, ((size_t)src->p + 1) * sizeof(int));

  double base, host;
  ZB_CHECK_GOTO(measure(t, start, end, &base, dev, &host), st, done);
  double bound = base * (1 + c.slowdown) + ZB_EPS * fmax(1.0, base);
  /* The largest rank span (the paper's cost, which bubble rates use) may not grow beyond the same
   * factor either: a step that keeps its length can still stretch one rank. */
  double base_cost = cost_of(t, start, end);
  double cost_bound = base_cost * (1 + c.slowdown) + ZB_EPS * fmax(1.0, base_cost);

  /* 1: candidates from the schedule as given (one pass: each F's and backward's end and start). */
  int nc = 0;
  size_t nkeys = (size_t)t->S * (size_t)t->m;
  for (size_t key = 0; key < nkeys; key++) life_from[key] = life_to[key] = NAN;
  for (int k = 0; k < t->n_ops; k++) {
    const zb_op_t *op = &t->ops[k];
    size_t key = (size_t)op->stage * t->m + op->mb;
    if (op->type == ZB_OP_F) life_from[key] = end[k];
    if ((op->type == ZB_OP_B || op->type == ZB_OP_BW) && isnan(life_to[key])) life_to[key] = start[k];
  }
  for (int st_ = 0; st_ < t->S; st_++)
    for (int mb = 0; mb < t->m; mb++) {
      size_t key = (size_t)st_ * t->m + mb;
      double life = life_to[key] - life_from[key];
      if ((!c.stages || c.stages[st_]) && life + ZB_EPS >= t->toff[st_] + t->trel[st_])
        cand[nc++] = (cand_t){st_, mb, life};
    }
  qsort(cand, (size_t)nc, sizeof *cand, cand_cmp);

  long long work = 0;
  /* Sweeps of rules 3 and 5: insert what fits, take out what lowers no peak, and again while the
   * insertion keeps something new (a candidate that did not fit may, once others have moved). */
  for (int sweep = 0; sweep < MAX_SWEEPS; sweep++) {
    int added = 0;
    for (int ci = 0; ci < nc && work < WORK_BUDGET; ci++) {
      if (kept[ci]) continue;
      if (c.device_limit > 0) {
        int met = 1;
        for (int r = 0; r < t->p; r++) met &= dev[r] <= c.device_limit + ZB_EPS;
        if (met) break;
      }
      int stage = cand[ci].stage, mb = cand[ci].mb, r = zb__stage_rank(t, stage), pf, pb;
      find_ops(t, r, stage, mb, &pf, &pb);
      work += t->rank_off[r + 1] - t->rank_off[r];
      /* 2: the RELOAD's place, in the schedule as it stands: after the latest compute op that
       * leaves T_RELOAD before the backward, or failing that one of the RELOAD_TRIES - 1 compute
       * ops before it (an earlier reload waits less behind the lane's other copies). */
      double latest = start[pb] - t->trel[stage];
      int q[RELOAD_TRIES], nq = 0;
      for (int k = pb - 1; k > pf && nq < RELOAD_TRIES; k--)
        if (!zb__op_is_copy(t->ops[k].type) && start[k] <= latest + ZB_EPS) q[nq++] = k;
      /* 3: try it; keep it or put the lists back. */
      for (int tq = 0; tq < nq; tq++) {
        snapshot(t, &undo);
        insert_copies(t, scratch, r, pf, q[tq], stage, mb);
        work += 3LL * t->n_ops; /* simulation, memory events (sorted), the cost */
        double span, thost;
        zb_status_t ms = measure(t, tstart, tend, &span, tdev, &thost);
        int keep = ms == ZB_OK && span <= bound && cost_of(t, tstart, tend) <= cost_bound && tdev[r] <= dev[r] + ZB_EPS &&
                   (c.host_limit <= 0 || thost <= c.host_limit + ZB_EPS) &&
                   !(c.paired_lanes && pair_overlaps(t, tstart, tend, r));
        if (keep) {
          memcpy(start, tstart, (size_t)t->n_ops * sizeof(double));
          memcpy(end, tend, (size_t)t->n_ops * sizeof(double));
          memcpy(dev, tdev, (size_t)t->p * sizeof(double));
          kept[ci] = 1, added++;
          break;
        }
        restore(t, &undo);
      }
    }
    if (!added) break;
    /* 5: take out, shortest-lived first, what lowers no peak. */
    for (int ci = nc - 1; ci >= 0 && work < WORK_BUDGET; ci--) {
      if (!kept[ci]) continue;
      int stage = cand[ci].stage, mb = cand[ci].mb, r = zb__stage_rank(t, stage);
      snapshot(t, &undo);
      remove_copies(t, r, stage, mb);
      work += 3LL * t->n_ops;
      double span, thost;
      int gone = measure(t, tstart, tend, &span, tdev, &thost) == ZB_OK && span <= bound &&
                 cost_of(t, tstart, tend) <= cost_bound && !(c.paired_lanes && pair_overlaps(t, tstart, tend, r));
      for (int x = 0; x < t->p && gone; x++) gone = tdev[x] <= dev[x] + ZB_EPS;
      if (gone) {
        memcpy(start, tstart, (size_t)t->n_ops * sizeof(double));
        memcpy(end, tend, (size_t)t->n_ops * sizeof(double));
        memcpy(dev, tdev, (size_t)t->p * sizeof(double));
        kept[ci] = 0;
      } else {
        restore(t, &undo);
      }
    }
  }

  /* The result carries its simulation. */
  free(t->start), free(t->end);
  t->start = malloc(cap * sizeof(double));
  t->end = malloc(cap * sizeof(double));
  if (!t->start || !t->end) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d times", t->n_ops);
    goto done;
  }
  memcpy(t->start, start, (size_t)t->n_ops * sizeof(double));
  memcpy(t->end, end, (size_t)t->n_ops * sizeof(double));
  zb__schedule_fill_stats(t);

done:
  free(ops), free(scratch), free(start), free(end), free(tstart), free(tend), free(dev), free(tdev), free(cand);
  free(saved), free(saved_off), free(kept), free(life_from), free(life_to);
  if (st != ZB_OK) {
    zb__schedule_free(t);
    return st;
  }
  *out = t;
  return ZB_OK;
}

/* ---- zb-auto with offload: order and copies planned together ---------------------------------- */

/* The memory limits zb-auto's order is tried under, as multiples of the device limit (0: none). */
static const double JOINT_LADDER[] = {1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 0.0};

/* The memory-tight V kinds under a device limit: their own order, and the V orders that hold more
 * (v-half's and ZB-V's for v-min, ZB-V's for v-half), each refined (zb_schedule_refine) and taken
 * down to the limit by the pass; the shortest step whose every rank fits wins, the kind's own
 * order when none does (the pass never fails: it places what fits). Offload extends the search
 * over orders: a faster order's extra memory goes to the host where the copies hide. */
static zb_status_t v_kinds_offloaded(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                     const zb_offload_config_t *c) {
  const zb_kind_t kinds[] = {spec->kind, ZB_KIND_V_HALF, ZB_KIND_ZB_V};
  const size_t n = spec->kind == ZB_KIND_V_MIN ? 3 : 2;
  zb_schedule_t *best = NULL;
  double best_step = 0, best_peak = 0;
  int best_fits = 0;
  for (size_t k = 0; k < n; k++) {
    if (k > 0 && kinds[k] == spec->kind) continue;
    zb_schedule_spec_t sp = *spec;
    sp.kind = kinds[k];
    if (k > 0) sp.mem_limit = 0; /* the kind's own memory */
    zb_schedule_t *order = NULL, *refined = NULL, *off = NULL;
    zb_status_t st = zb_schedule_create(&order, &sp);
    if (st == ZB_OK) st = zb_schedule_refine(&refined, order, 0);
    zb_schedule_destroy(order);
    if (st == ZB_OK) st = zb_schedule_plan_offload(&off, refined, c);
    zb_schedule_destroy(refined);
    double peak = 0, step = 0;
    if (st == ZB_OK) st = peak_and_step(off, &peak, &step);
    if (st != ZB_OK) {
      zb_schedule_destroy(off);
      if (k == 0) {
        zb_schedule_destroy(best);
        return st;
      }
      zb__clear_error();
      continue; /* an order this pipeline does not have (a V kind's own limits): the others stand */
    }
    const int fits = peak <= c->device_limit + ZB_EPS;
    if (!best || (fits && (!best_fits || step < best_step - ZB_EPS ||
                           (step <= best_step + ZB_EPS && peak < best_peak - ZB_EPS)))) {
      zb_schedule_destroy(best);
      best = off, best_step = step, best_peak = peak, best_fits = fits;
    } else {
      zb_schedule_destroy(off);
    }
  }
  *out = best;
  return ZB_OK;
}

zb_status_t zb_schedule_create_offloaded(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                         const zb_offload_config_t *config) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(spec);
  zb_schedule_spec_t upgraded; /* read no further than an older caller's struct */
  ZB_CHECK(zb__upgrade_spec(&spec, &upgraded));
  zb_offload_config_t c = ZB_OFFLOAD_CONFIG_INIT;
  if (config) memcpy(&c, config, config->struct_size < sizeof c ? config->struct_size : sizeof c);
  zb_schedule_t *plain = NULL;
  if ((spec->kind == ZB_KIND_V_MIN || spec->kind == ZB_KIND_V_HALF) && c.device_limit > 0)
    return v_kinds_offloaded(out, spec, &c);
  if (spec->kind != ZB_KIND_ZB_AUTO) { /* a fixed order: its copies only */
    ZB_CHECK(zb_schedule_create(&plain, spec));
    zb_status_t st = zb_schedule_plan_offload(out, plain, config);
    zb_schedule_destroy(plain);
    return st;
  }
  /* zb-auto: the device limit is the memory the plan may hold (the spec's mem_limit, else zb-auto's
   * default, p). Orders planned for more memory are tried too, each with the offload pass taking it
   * down to the limit; the shortest step whose every rank fits wins (the order planned for the limit
   * itself always fits, so there is always one). */
  double limit = c.device_limit > 0 ? c.device_limit : spec->mem_limit;
  zb_schedule_info_t info;
  ZB_CHECK(zb_schedule_create(&plain, spec));
  zb_status_t st = zb_schedule_get_info(plain, &info);
  zb_schedule_destroy(plain);
  ZB_CHECK(st);
  if (!(limit > 0)) limit = info.mem_limit > 0 ? info.mem_limit : info.ranks;
  c.device_limit = limit;
  zb_schedule_t *best = NULL;
  double best_step = 0, best_peak = 0;
  for (size_t k = 0; k < sizeof JOINT_LADDER / sizeof JOINT_LADDER[0]; k++) {
    zb_schedule_spec_t sp = *spec;
    sp.mem_limit = limit * JOINT_LADDER[k];
    zb_schedule_t *order = NULL, *off = NULL;
    st = zb_schedule_create(&order, &sp);
    if (st == ZB_ERR_INFEASIBLE) continue; /* no order fits this limit (below the kind's smallest) */
    if (st == ZB_OK) st = zb_schedule_plan_offload(&off, order, &c);
    zb_schedule_destroy(order);
    double peak = 0, step = 0;
    if (st == ZB_OK) st = peak_and_step(off, &peak, &step);
    if (st != ZB_OK) {
      zb_schedule_destroy(off);
      zb_schedule_destroy(best);
      return st;
    }
    if (peak <= limit + ZB_EPS && (!best || step < best_step - ZB_EPS ||
                                   (step <= best_step + ZB_EPS && peak < best_peak - ZB_EPS))) {
      zb_schedule_destroy(best);
      best = off, best_step = step, best_peak = peak;
    } else {
      zb_schedule_destroy(off);
    }
  }
  if (!best)
    return ZB_FAIL(ZB_ERR_INFEASIBLE, "zb-auto with offload: no order fits a device limit of %g microbatches, even "
                   "with copies", limit);
  *out = best;
  return ZB_OK;
}
