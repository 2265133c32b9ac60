/*
 * greedy.c - the list scheduler behind zb-h1, zb-h2, zb-v, v-half, v-min and zb-auto.
 *
 * It is the paper's observation (Zero Bubble, section 3) turned into a simulation: B is on the
 * critical path (the rank above waits for it), F keeps the pipeline fed, and W is needed only by the
 * optimizer, so W fills whatever holes are left. Time is simulated event by event; whenever a rank
 * is free it picks the next op among those whose inputs have arrived, by priority:
 *   1. a B (oldest microbatch first, then the deeper stage), always - it frees memory too;
 *   2. an F, if the memory limit allows it (deeper stage first), unless the policy puts W first;
 *   3. a W (oldest first), to fill the hole or to free memory for the next F.
 * Each stage runs its F's, B's and W's in microbatch order, so every channel is FIFO by construction.
 *
 * Memory: F adds 1/v, B frees (1-w)/v, W frees w/v. With more than one chunk on a rank, an F that
 * brings a new microbatch onto the rank must leave room for that microbatch's later chunks (see
 * f_fits); without it a V schedule can fill its memory with chunk-0 forwards and deadlock waiting for
 * chunk-1 forwards it has no room for.
 *
 * What this is not: a search. gen_auto.c runs it under several policies and keeps the best.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
  const zb_schedule_t *s;
  const zb__greedy_policy_t *pol;
  int *nf, *nb, *nw;   /* per stage: next F, B, W microbatch */
  double *endF, *endB; /* per stage x microbatch; NaN until scheduled */
  double *t_free;      /* per rank: when it is next free (or, if idle, when to look again) */
  int *idle;           /* per rank: t_free is a wake-up time, not the end of an op */
  double *idle_since;
  double *idle_from; /* per rank: when its current idle stretch began */
  double *mem; /* per rank */
  int *n_b_done;          /* per rank: B's run so far */
  int *n_f_done;
  int *stages;            /* per rank: its v stages, deepest first */
  int *tree, leaves;      /* tournament tree over t_free: tree[1] is the rank to decide next */
} state_t;

/* The tournament tree keeps the earliest-free rank at the root, so picking the next rank costs
 * O(log p) instead of a scan (zb-auto runs the scheduler many times at p = 64, m = 1024). Finished
 * ranks sit at +inf; ties go to the lower rank. */
static int earlier(const state_t *g, int a, int b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return g->t_free[b] < g->t_free[a] ? b : a;
}

static void tree_update(state_t *g, int r) {
  int i = (g->leaves + r) / 2;
  for (; i >= 1; i /= 2) {
    int old = g->tree[i], now = earlier(g, g->tree[2 * i], g->tree[2 * i + 1]);
    /* Nothing above changes when this node's winner is the same rank as before and not r (whose
     * time changed): the nodes above compare the same ranks at the same times. */
    if (now == old && old != r) return;
    g->tree[i] = now;
  }
}

static int rank_of(const zb_schedule_t *s, int st) { return zb__stage_rank(s, st); }

/* When F(st, i) can start on its rank (its input arrived), or INFINITY if not yet known. */
static double ready_f(const state_t *g, int st, int i) {
  const zb_schedule_t *s = g->s;
  if (st == 0) return 0;
  double e = g->endF[(size_t)(st - 1) * s->m + i];
  if (isnan(e)) return INFINITY;
  return e + (rank_of(s, st - 1) != rank_of(s, st) ? s->t_comm : 0);
}

static double ready_b(const state_t *g, int st, int i) {
  const zb_schedule_t *s = g->s;
  double e = g->endF[(size_t)st * s->m + i];
  if (isnan(e)) return INFINITY;
  if (st + 1 < s->S) {
    double eb = g->endB[(size_t)(st + 1) * s->m + i];
    if (isnan(eb)) return INFINITY;
    eb += rank_of(s, st + 1) != rank_of(s, st) ? s->t_comm : 0;
    if (eb > e) e = eb;
  }
  return e;
}

/* The later stages a microbatch still visits on the same rank after stage st. */
static int later_on_rank(const zb_schedule_t *s, int r, int st) {
  int n = 0;
  for (int c = 0; c < s->v; c++) {
    int other = s->placement == ZB_PLACEMENT_V ? (c == 0 ? r : 2 * s->p - 1 - r) : c * s->p + r;
    if (other > st) n++;
  }
  return n;
}

static int first_on_rank(const zb_schedule_t *s, int r, int st) {
  for (int c = 0; c < s->v; c++) {
    int other = s->placement == ZB_PLACEMENT_V ? (c == 0 ? r : 2 * s->p - 1 - r) : c * s->p + r;
    if (other < st) return 0;
  }
  return 1;
}

static int f_fits(const state_t *g, int r, int st) {
  const zb_schedule_t *s = g->s;
  double unit = 1.0 / s->v;
  /* A microbatch entering the rank must leave room for its later chunks here; later chunks only
   * need room for themselves. One slot is enough to avoid deadlock: each stage runs its forwards in
   * microbatch order, so the oldest microbatch in flight can always take the slot, reach the loss,
   * and free memory on the way back. */
  double need = g->mem[r] + unit * (1 + (first_on_rank(s, r, st) ? later_on_rank(s, r, st) : 0));
  return need <= g->pol->limit + ZB_EPS;
}

enum { PICK_NONE = -1 };

/* Picks rank r's op at time t: returns the op type and sets *pst, or PICK_NONE. */
static int pick(const state_t *g, int r, double t, int *pst) {
  const zb_schedule_t *s = g->s;
  const zb__greedy_policy_t *pol = g->pol;
  int best_b = -1, best_f = -1, best_w = -1;
  for (int k = 0; k < s->v; k++) {
    int st = g->stages[r * s->v + k];
    int i = g->nb[st];
    if (i < g->nf[st] && ready_b(g, st, i) <= t + ZB_EPS) {
      if (best_b < 0 || i < g->nb[best_b]) best_b = st;
    }
    i = g->nf[st];
    if (i < s->m && ready_f(g, st, i) <= t + ZB_EPS && f_fits(g, r, st) && best_f < 0)
      best_f = st;
    i = g->nw[st];
    if (i < g->nb[st] && (best_w < 0 || i < g->nw[best_w])) best_w = st;
  }
  if (best_f >= 0 && pol->warmup_cap && g->n_b_done[r] == 0 && g->n_f_done[r] >= pol->warmup_cap[r])
    best_f = -1;
  if (best_f >= 0 && pol->f_before_b) {
    *pst = best_f;
    return ZB_OP_F;
  }
  if (best_b >= 0) {
    *pst = best_b;
    return ZB_OP_B;
  }
  if (best_w < 0) {
    if (best_f >= 0) *pst = best_f;
    return best_f >= 0 ? ZB_OP_F : PICK_NONE;
  }
  /* A W is a candidate. Work out what would stop it. */
  int pending_w = 0, b_left = 0, f_blocked = 0;
  for (int k = 0; k < s->v; k++) {
    int st = g->stages[r * s->v + k];
    pending_w += g->nb[st] - g->nw[st];
    if (g->nb[st] < s->m) b_left = 1;
    if (g->nf[st] < s->m && ready_f(g, st, g->nf[st]) <= t + ZB_EPS && !f_fits(g, r, st))
      f_blocked = 1;
  }
  /* Holding some W's back while B's remain lets this rank pass its last B's up the pipeline sooner
   * (the ranks above wait for them); the held W's run at the end. Never when memory needs them. */
  int held = pol->hold_w && b_left && !f_blocked && pending_w <= pol->hold_w[r];
  int late_b = 0;
  if (pol->lookahead) {
    /* A B we already know about would arrive while the W runs: waiting for it keeps the critical
     * path short, and the B frees memory as well. */
    double w_end = t + s->tw[best_w];
    for (int k = 0; k < s->v; k++) {
      int st = g->stages[r * s->v + k];
      int i = g->nb[st];
      if (i < g->nf[st]) {
        double rb = ready_b(g, st, i);
        if (rb > t + ZB_EPS && rb < w_end - ZB_EPS) late_b = 1;
      }
    }
  }
  int w_ok = !held && !late_b;
  if (best_f >= 0 && !(w_ok && pol->w_before_f)) {
    *pst = best_f;
    return ZB_OP_F;
  }
  if (w_ok) {
    *pst = best_w;
    return ZB_OP_W;
  }
  return PICK_NONE;
}

/* Earliest known time after t at which something may become runnable on rank r. */
static double next_event(const state_t *g, int r, double t) {
  const zb_schedule_t *s = g->s;
  double best = INFINITY;
  for (int k = 0; k < s->v; k++) {
    int st = g->stages[r * s->v + k];
    if (g->nb[st] < g->nf[st]) {
      double x = ready_b(g, st, g->nb[st]);
      if (x > t + ZB_EPS && x < best) best = x;
    }
    if (g->nf[st] < s->m) {
      double x = ready_f(g, st, g->nf[st]);
      if (x > t + ZB_EPS && x < best) best = x;
    }
  }
  return best;
}

static void wake(state_t *g, int r, double at) {
  if (!g->idle[r]) return;
  double when = at > g->idle_since[r] ? at : g->idle_since[r];
  if (when < g->t_free[r]) {
    g->t_free[r] = when;
    tree_update(g, r);
  }
}

zb_status_t zb__greedy_schedule(zb_schedule_t *s, const zb__greedy_policy_t *pol) {
  if (!(pol->limit >= 1 - ZB_EPS))
    return ZB_FAIL(ZB_ERR_INFEASIBLE,
                   "memory limit %.4g is below the minimum of 1: every schedule holds at least one "
                   "microbatch's activations through all of a rank's layers",
                   pol->limit);
  int p = s->p, S = s->S, m = s->m, v = s->v;
  size_t n = (size_t)S * m;
  state_t g;
  memset(&g, 0, sizeof g);
  g.s = s;
  g.pol = pol;
  g.nf = calloc((size_t)S, sizeof(int));
  g.nb = calloc((size_t)S, sizeof(int));
  g.nw = calloc((size_t)S, sizeof(int));
  g.endF = malloc(n * sizeof(double));
  g.endB = malloc(n * sizeof(double));
  g.t_free = calloc((size_t)p, sizeof(double));
  g.idle = calloc((size_t)p, sizeof(int));
  g.idle_since = calloc((size_t)p, sizeof(double));
  g.idle_from = calloc((size_t)p, sizeof(double));
  g.mem = calloc((size_t)p, sizeof(double));
  g.n_b_done = calloc((size_t)p, sizeof(int));
  g.n_f_done = calloc((size_t)p, sizeof(int));
  g.stages = malloc((size_t)p * v * sizeof(int));
  for (g.leaves = 1; g.leaves < p; g.leaves *= 2) {
  }
  g.tree = malloc(2 * (size_t)g.leaves * sizeof(int));
  zb__oplists_t l;
  zb_status_t st = zb__oplists_init(&l, p);
  if (st != ZB_OK) goto fail;
  if (!g.nf || !g.nb || !g.nw || !g.endF || !g.endB || !g.t_free || !g.idle || !g.idle_since ||
      !g.idle_from || !g.mem || !g.n_b_done || !g.n_f_done || !g.stages || !g.tree) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory scheduling %d stages x %d microbatches", S, m);
    goto fail;
  }
  for (size_t k = 0; k < n; k++) g.endF[k] = g.endB[k] = NAN;
  for (int r = 0; r < p; r++)
    for (int c = 0; c < v; c++) /* deepest stage first: it is closer to producing a B */
      g.stages[r * v + c] = s->placement == ZB_PLACEMENT_V ? (c == 0 ? 2 * p - 1 - r : r)
                                                           : (v - 1 - c) * p + r;

  for (int i = 0; i < 2 * g.leaves; i++) g.tree[i] = -1;
  for (int r = 0; r < p; r++) g.tree[g.leaves + r] = r;
  for (int i = g.leaves - 1; i >= 1; i--) g.tree[i] = earlier(&g, g.tree[2 * i], g.tree[2 * i + 1]);

  long long remaining = 3LL * n;
  while (remaining > 0) {
    /* The rank that is free first (ties: the lowest rank) decides next. */
    int r = g.tree[1];
    if (r < 0 || isinf(g.t_free[r])) {
      st = ZB_FAIL(ZB_ERR_INTERNAL, "the list scheduler stalled with %lld ops left (limit %.4g)",
                   remaining, pol->limit);
      goto fail;
    }
    double t = g.t_free[r];
    int stg = -1;
    int type = pick(&g, r, t, &stg);
    if (type == PICK_NONE) {
      if (!g.idle[r]) g.idle_from[r] = t;
      g.idle[r] = 1;
      g.idle_since[r] = t;
      g.t_free[r] = next_event(&g, r, t);
      tree_update(&g, r);
      continue;
    }
    /* A W picked after the rank sat idle was pending all along (W's come only from this rank's
     * B's): the rank chose to wait, for a held W or a B due soon, and then nothing better came.
     * Replaying the op list starts that W as soon as the rank went idle, so start it there: the
     * times decided on are then the times the schedule has. Nothing on other ranks waits for a W. */
    if (type == ZB_OP_W && g.idle[r] && g.idle_from[r] < t) t = g.idle_from[r];
    g.idle[r] = 0;
    double end = t + zb__op_cost(s, type, stg);
    size_t key;
    if (type == ZB_OP_F) {
      int i = g.nf[stg]++;
      key = (size_t)stg * m + i;
      g.endF[key] = end;
      g.n_f_done[r]++;
      st = zb__oplists_push_timed(&l, r, ZB_OP_F, stg, i, t, end);
      /* Wake the consumer: the next stage (same rank: nothing to do). */
      if (stg + 1 < S) {
        int c = rank_of(s, stg + 1);
        if (c != r) wake(&g, c, end + s->t_comm);
      }
    } else if (type == ZB_OP_B) {
      int i = g.nb[stg]++;
      key = (size_t)stg * m + i;
      g.endB[key] = end;
      g.n_b_done[r]++;
      st = zb__oplists_push_timed(&l, r, ZB_OP_B, stg, i, t, end);
      if (stg > 0) {
        int c = rank_of(s, stg - 1);
        if (c != r) wake(&g, c, end + s->t_comm);
      }
    } else {
      int i = g.nw[stg]++;
      st = zb__oplists_push_timed(&l, r, ZB_OP_W, stg, i, t, end);
    }
    if (st != ZB_OK) goto fail;
    g.mem[r] += zb__op_mem(s, type);
    /* A rank with nothing left leaves the race. */
    g.t_free[r] = l.count[r] == 3 * m * v ? INFINITY : end;
    tree_update(&g, r);
    remaining--;
  }
  st = zb__schedule_take_ops(s, &l);

fail:
  zb__oplists_free(&l);
  free(g.nf), free(g.nb), free(g.nw), free(g.endF), free(g.endB), free(g.t_free), free(g.idle);
  free(g.idle_since), free(g.idle_from), free(g.mem), free(g.n_b_done), free(g.n_f_done);
  free(g.stages), free(g.tree);
  return st;
}
