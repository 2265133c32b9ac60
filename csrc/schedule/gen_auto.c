/*
 * gen_auto.c - zb-auto, the automatic zero-bubble scheduler (Zero Bubble paper, section 3.2), and
 * the search zb-v, v-half and v-min share with it.
 *
 * The paper's scheduler takes profiled T_F, T_B, T_W, T_comm and a memory limit, builds a schedule
 * with a greedy heuristic, then refines it with an ILP. Here the search runs rule sets, each a
 * complete generator, and keeps the shortest schedule under the limit:
 *
 *   1. The list scheduler of greedy.c under a family of its rules: F or B first; for loop placement
 *      a warm-up cap (none, ZB-H1's, ZB-H2's) and W's held back (none, r, 4r on rank r); for a V, W
 *      or F first and W look-ahead. It adapts to per-stage costs and T_comm as they come.
 *   2. The round-based rules (rounds_loop.c, rounds_v.c): warm-up counted from the costs, then one
 *      B and one F per rank per round, W's where they fit or where idling would cost more; eight
 *      rule sets for a loop, four for a V, the V ones re-run with each rank's bubble as allowance.
 *      They win when F, B and W differ, where the list scheduler's ready-now choices lose time.
 *   3. zb-auto also tries every handcrafted schedule of the placement (1F1B, ZB-H1, ZB-H2, GPipe;
 *      V-Half, V-Min), kept when its peak memory fits: never worse than the best one that fits.
 *   The shortest candidate under the limit wins, end to end (the first op's start to the last op's
 *   end over all ranks: what a step takes; ties: the shorter largest rank span, the paper's cost,
 *   then the lower peak memory, then the first tried), so the result does not depend on which
 *   thread finished first.
 *   4. Fused where splitting does not pay (fuse.c): each candidate's B and W become one BW wherever
 *      the W apart does not make it shorter, and 1F1B with its cool-down's backwards split where
 *      that shortens it is one more candidate. With measured time_bw below time_b + time_w (a
 *      split costs something where it runs), W runs apart only where it fills a hole.
 *
 * Speed: rule sets run in parallel on a few threads. On very large problems (more than
 * FULL_SEARCH_CELLS rank x microbatch cells) every rule set first runs on a copy with fewer
 * microbatches, and only the two best run at full size: with m >> p the rule sets differ in the
 * warm-up and cool-down, which the shorter copy has too, while the steady state between them is the
 * same for all (measured at p = 64, m = 1024: 0.5 s for the full search, see RESULTS.md).
 *
 * Without a limit zb-auto keeps 1F1B's memory, p. The paper's ZB-1p is zb-auto at limit p and its
 * ZB-2p is zb-auto at limit 2p.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

enum { FULL_SEARCH_CELLS = 8192, MAX_THREADS = 8, FINALISTS = 2, FUSE_EACH_MAX_OPS = 2048,
       FUSE_MAX_OPS = 6144 };

typedef enum { JOB_GREEDY, JOB_ROUNDS, JOB_KIND, JOB_1F1B_SPLIT } job_kind_t;

/* One rule set and, after it ran, its best candidate. */
typedef struct {
  job_kind_t kind;
  zb__greedy_policy_t greedy; /* JOB_GREEDY (limit filled in at run time) */
  zb__rounds_policy_t rounds; /* JOB_ROUNDS (limit filled in at run time) */
  zb_status_t (*gen)(zb_schedule_t *); /* JOB_KIND */
  zb_schedule_t *best;
  double cost, span, peak; /* cost: end to end (makespan); span: the largest rank span */
  int oom;
} job_t;

typedef struct {
  job_t *jobs;
  const int *which; /* indices into jobs to run */
  int n, next;
  const zb_schedule_t *shape;
  double limit;
  int fuse;
  pthread_mutex_t lock;
} pool_t;

/* Keeps c in *job if it fits and beats what the job has; takes ownership of c. zb-auto's
 * candidates (fuse set) are compared after fuse.c's pass: a candidate whose W's apart mostly fill
 * no hole can be the shortest once they are fused (with time_bw below time_b + time_w). */
static void keep(job_t *job, zb_schedule_t *c, double limit, int fuse) {
  zb_sim_result_t r;
  if (fuse) {
    zb_status_t st = zb__fuse_free(c, FUSE_EACH_MAX_OPS);
    if (st != ZB_OK) {
      if (st == ZB_ERR_OUT_OF_MEMORY) job->oom = 1;
      zb__schedule_free(c);
      return;
    }
  }
  if (zb_schedule_simulate(c, &r) == ZB_OK && r.max_peak_memory <= limit + ZB_EPS) {
    double mk = zb__makespan_of(c, c->start, c->end);
    if (!job->best || mk < job->cost - ZB_EPS ||
        (mk <= job->cost + ZB_EPS && (r.cost < job->span - ZB_EPS ||
                                       (r.cost <= job->span + ZB_EPS && r.max_peak_memory < job->peak - ZB_EPS)))) {
      zb__schedule_free(job->best);
      job->best = c;
      job->cost = mk;
      job->span = r.cost;
      job->peak = r.max_peak_memory;
      return;
    }
  }
  zb__schedule_free(c);
}

/* Runs one generator on a fresh copy of the shape: 1 if it produced a schedule, 0 if its rules
 * could not finish here (not a candidate), -1 out of memory. */
static int run_one(job_t *job, const zb_schedule_t *shape, double limit, zb_schedule_t **out,
                   double *maxb, double *bubble) {
  zb_schedule_t *c = NULL;
  if (zb__schedule_clone_empty(shape, &c) != ZB_OK) return -1;
  zb_status_t st;
  if (job->kind == JOB_GREEDY) {
    zb__greedy_policy_t pol = job->greedy;
    pol.limit = limit;
    st = zb__greedy_schedule(c, &pol);
  } else if (job->kind == JOB_ROUNDS) {
    zb__rounds_policy_t pol = job->rounds;
    pol.limit = limit;
    st = c->placement == ZB_PLACEMENT_V ? zb__rounds_v(c, &pol, maxb, bubble)
                                        : zb__rounds_loop(c, &pol, maxb, bubble);
  } else if (job->kind == JOB_1F1B_SPLIT) {
    st = zb__gen_1f1b(c);
    if (st == ZB_OK) st = zb__unfuse_tail(c, limit, FUSE_EACH_MAX_OPS);
  } else {
    st = job->gen(c);
  }
  if (st != ZB_OK) {
    zb__schedule_free(c);
    return st == ZB_ERR_OUT_OF_MEMORY ? -1 : 0;
  }
  *out = c;
  return 1;
}

static void run_job(job_t *job, const zb_schedule_t *shape, double limit, int fuse) {
  zb_schedule_t *c = NULL;
  if (job->kind != JOB_ROUNDS || shape->placement != ZB_PLACEMENT_V) {
    double maxb;
    int got = run_one(job, shape, limit, &c, &maxb, NULL);
    if (got < 0) job->oom = 1;
    if (got > 0) keep(job, c, limit, fuse);
    return;
  }
  /* The V rounds again with each rank's bubble as its allowance while the largest bubble falls;
   * a handful of re-runs is where that stops in practice. */
  int p = shape->p;
  double *allow = malloc(2 * (size_t)p * sizeof(double));
  if (!allow) {
    job->oom = 1;
    return;
  }
  double *bubble = allow + p, prev = INFINITY;
  job_t step = *job;
  for (int iter = 0; iter < 6; iter++) {
    double maxb = 0;
    int got = run_one(&step, shape, limit, &c, &maxb, bubble);
    if (got < 0) job->oom = 1;
    if (got <= 0) break;
    keep(job, c, limit, fuse);
    if (!(maxb < prev - ZB_EPS)) break;
    prev = maxb;
    for (int r = 0; r < p; r++) allow[r] = bubble[r];
    step.rounds.allow = allow;
  }
  free(allow);
}

static void *worker(void *arg) {
  pool_t *pool = arg;
  for (;;) {
    pthread_mutex_lock(&pool->lock);
    int i = pool->next < pool->n ? pool->which[pool->next++] : -1;
    pthread_mutex_unlock(&pool->lock);
    if (i < 0) return NULL;
    run_job(&pool->jobs[i], pool->shape, pool->limit, pool->fuse);
  }
}

/* Runs jobs[which[0..n)] on copies of `shape`, on up to MAX_THREADS threads. */
static void run_jobs(job_t *jobs, const int *which, int n, const zb_schedule_t *shape, double limit,
                     int fuse) {
  pool_t pool = {jobs, which, n, 0, shape, limit, fuse, PTHREAD_MUTEX_INITIALIZER};
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int nt = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
  if (nt > n) nt = n;
  pthread_t tid[MAX_THREADS];
  int started = 0;
  for (; started < nt - 1; started++) /* the calling thread is the last worker */
    if (pthread_create(&tid[started], NULL, worker, &pool) != 0) break;
  worker(&pool);
  for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
  pthread_mutex_destroy(&pool.lock);
}

/* Is job a's result better than b's (shorter end to end; then the shorter largest rank span; then
 * less memory; then a comes first)? */
static int better(const job_t *a, const job_t *b) {
  if (!a->best) return 0;
  if (!b->best) return 1;
  if (a->cost < b->cost - ZB_EPS) return 1;
  if (a->cost > b->cost + ZB_EPS) return 0;
  if (a->span < b->span - ZB_EPS) return 1;
  return a->span <= b->span + ZB_EPS && a->peak < b->peak - ZB_EPS;
}

/* The rule sets for the placement; `with_kinds` adds zb-auto's handcrafted candidates. Returns
 * the count (at most MAX_JOBS). `rules` gets per-rank warm-up caps and W holds (4p ints). */
static int make_jobs(const zb_schedule_t *s, int with_kinds, job_t *jobs, int *rules) {
  int p = s->p, n = 0;
  for (int r = 0; r < p; r++) {
    rules[r] = p - r;               /* ZB-H1's warm-up */
    rules[p + r] = 2 * (p - r) - 1; /* ZB-H2's warm-up */
    rules[2 * p + r] = r;           /* W's held back: ZB-H1's deferral */
    rules[3 * p + r] = 4 * r;       /* and a deeper one, for when memory allows */
  }
  if (s->placement == ZB_PLACEMENT_LOOP) {
    /* F or B first x warm-up cap (none, ZB-H1's, ZB-H2's) x W's held (none, r, 4r). */
    for (int variant = 0; variant < 18; variant++) {
      int cap = (variant >> 1) % 3, hold = (variant >> 1) / 3;
      job_t j = {.kind = JOB_GREEDY};
      j.greedy.f_before_b = variant & 1;
      j.greedy.warmup_cap = cap ? rules + (size_t)(cap - 1) * p : NULL;
      j.greedy.hold_w = hold ? rules + (size_t)(hold + 1) * p : NULL;
      jobs[n++] = j;
    }
  } else {
    /* F or B first x W or F first x W look-ahead. */
    for (int variant = 0; variant < 8; variant++) {
      job_t j = {.kind = JOB_GREEDY};
      j.greedy.f_before_b = variant & 1;
      j.greedy.w_before_f = (variant >> 1) & 1;
      j.greedy.lookahead = (variant >> 2) & 1;
      jobs[n++] = j;
    }
  }
  if (s->placement == ZB_PLACEMENT_V && s->v == 2)
    for (int variant = 0; variant < 4; variant++) {
      job_t j = {.kind = JOB_ROUNDS};
      j.rounds.fill_f = variant & 1;
      j.rounds.fill_b = variant >> 1;
      jobs[n++] = j;
    }
  if (s->placement == ZB_PLACEMENT_LOOP && s->v == 1)
    for (int variant = 0; variant < 8; variant++) {
      job_t j = {.kind = JOB_ROUNDS};
      j.rounds.early_f = variant & 1;
      j.rounds.prioritize_b = (variant >> 1) & 1;
      j.rounds.greedy_w = variant >> 2;
      jobs[n++] = j;
    }
  if (with_kinds) {
    zb_status_t (*const loop_kinds[])(zb_schedule_t *) = {zb__gen_1f1b, zb__gen_zb_h1,
                                                          zb__gen_zb_h2, zb__gen_gpipe};
    /* zb-v's own rules are the search itself at limit p; v-half's and v-min's run at their lower
     * limits, which can order differently. */
    zb_status_t (*const v_kinds[])(zb_schedule_t *) = {zb__gen_v_half, zb__gen_v_min};
    if (s->placement == ZB_PLACEMENT_LOOP && s->v == 1) {
      for (int i = 0; i < 4; i++) jobs[n++] = (job_t){.kind = JOB_KIND, .gen = loop_kinds[i]};
      /* 1F1B with the cool-down's backwards split where that shortens it (fuse.c): with time_bw
       * below time_b + time_w, the zero-bubble plan that splits only where W fills a hole. */
      jobs[n++] = (job_t){.kind = JOB_1F1B_SPLIT};
    }
    /* Several loop-placed chunks per rank: interleaved 1F1B where it applies (torch's rounds
     * divide m) and its zero-bubble variants (warm-up factor 1 is the order of torch's
     * ScheduleInterleavedZeroBubble), so zb-auto is never worse than either within the same memory. */
    if (s->placement == ZB_PLACEMENT_LOOP && s->v > 1) {
      if (s->m % (s->m / s->p > 1 ? s->m / s->p : 1) == 0)
        jobs[n++] = (job_t){.kind = JOB_KIND, .gen = zb__gen_interleaved};
      jobs[n++] = (job_t){.kind = JOB_KIND, .gen = zb__gen_interleaved_zb1};
      jobs[n++] = (job_t){.kind = JOB_KIND, .gen = zb__gen_interleaved_zb2};
    }
    if (s->placement == ZB_PLACEMENT_V)
      for (int i = 0; i < 2; i++) jobs[n++] = (job_t){.kind = JOB_KIND, .gen = v_kinds[i]};
  }
  return n;
}

enum { MAX_JOBS = 40 };

static zb_status_t search(zb_schedule_t *s, double limit, int with_kinds) {
  job_t jobs[MAX_JOBS];
  int which[MAX_JOBS];
  int *rules = malloc(4 * (size_t)s->p * sizeof(int));
  if (!rules) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for per-rank rules");
  int n = make_jobs(s, with_kinds, jobs, rules);
  for (int i = 0; i < n; i++) which[i] = i;
  zb_status_t st = ZB_OK;

  size_t cells = (size_t)s->p * s->m;
  int m_small = (int)(FULL_SEARCH_CELLS / s->p);
  if (cells > FULL_SEARCH_CELLS && m_small >= 2 * s->p) {
    /* Rank every rule set on a shorter copy, then run the best few at full size. */
    zb_schedule_t *small = NULL;
    st = zb__schedule_clone_shape(s, m_small, &small);
    if (st == ZB_OK) {
      run_jobs(jobs, which, n, small, limit, with_kinds);
      zb__schedule_free(small);
      int keep_n = 0;
      for (int f = 0; f < FINALISTS; f++) {
        int pick = -1;
        for (int i = 0; i < n; i++) {
          int taken = 0;
          for (int q = 0; q < keep_n; q++) taken |= which[q] == i;
          if (!taken && jobs[i].best && (pick < 0 || better(&jobs[i], &jobs[pick]))) pick = i;
        }
        if (pick >= 0) which[keep_n++] = pick;
      }
      for (int i = 0; i < n; i++) {
        zb__schedule_free(jobs[i].best);
        jobs[i].best = NULL;
        if (jobs[i].oom) st = ZB_ERR_OUT_OF_MEMORY;
      }
      n = keep_n;
    }
  }
  if (st == ZB_OK) run_jobs(jobs, which, n, s, limit, with_kinds);

  int win = -1;
  for (int q = 0; q < n; q++) {
    job_t *j = &jobs[which[q]];
    if (j->oom) st = ZB_ERR_OUT_OF_MEMORY;
    if (j->best && (win < 0 || better(j, &jobs[win]))) win = which[q];
  }
  if (st == ZB_OK && win < 0)
    st = ZB_FAIL(ZB_ERR_INFEASIBLE,
                 "no rule set found a schedule for p=%d v=%d m=%d under memory limit %.4g",
                 s->p, s->v, s->m, limit);
  else if (st == ZB_ERR_OUT_OF_MEMORY)
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory searching schedules for p=%d m=%d", s->p,
                 s->m);
  if (st == ZB_OK) zb__schedule_take(s, jobs[win].best);
  for (int q = 0; q < n; q++) zb__schedule_free(jobs[which[q]].best);
  free(rules);
  return st;
}

zb_status_t zb__gen_rules_best(zb_schedule_t *s, double limit) { return search(s, limit, 0); }

zb_status_t zb__gen_auto(zb_schedule_t *s, double limit) {
  if (limit <= 0) limit = s->p;
  if (limit < 1 - ZB_EPS)
    return ZB_FAIL(ZB_ERR_INFEASIBLE,
                   "memory limit %.4g is below what any schedule needs: the minimum is 1 (one "
                   "microbatch's activations through all of a rank's layers)",
                   limit);
  ZB_CHECK(search(s, limit, 1));
  /* Candidates too large to fuse each are fused once, the winner (fuse.c: a W apart only where
   * it shortens the plan). */
  return zb__fuse_free(s, FUSE_MAX_OPS);
}
