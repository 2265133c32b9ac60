/*
 * simulate.c - the schedule simulator of DESIGN.md section 3.
 *
 * Ops on a rank run in list order; an op starts at the later of the end of the previous op on its
 * rank and the end of each dependency (plus T_comm when the dependency lives on another rank):
 *   F(s,i) after F(s-1,i);  B/BW(s,i) after F(s,i) and after B/BW(s+1,i);  W(s,i) after B(s,i).
 * Memory in units of a microbatch through all of a rank's layers: F adds 1/v, B frees (1-w)/v, W
 * frees w/v, BW frees 1/v. Cost is the largest span (last end - first start) of any rank; the bubble
 * rate is (cost - busy)/cost with busy the largest total compute of any rank (the paper, section 5).
 *
 * Copies (OFFLOAD, RELOAD; PipeOffload) run on the rank's copy lane, one at a time in list order,
 * starting at the latest of: the start of the compute op before them in the list (where the
 * runtime issues them; 0 when none), the end of the lane's previous copy, and their dependency
 * (OFFLOAD(s,i) after F(s,i); RELOAD(s,i) after OFFLOAD(s,i)). An offloaded (s,i)'s B/BW and W wait
 * for its RELOAD. Copies never hold up compute otherwise. Memory is then counted in time over both
 * lanes (rank_memory below); span and busy count compute ops only.
 *
 * Vocabulary Parallelism's passes (S, T, IF, IB) run on the rank's compute like any op. S(r,i)
 * after F(S-1,i) (+ T_comm across ranks), IB(r,i) after B/BW(0,i) (likewise). Barriers join every
 * rank: the S barrier of i starts when the last rank's S(i) ends and lasts T_VOCAB_COMM; T(i) waits
 * for it, and so does B/BW(S-1,i) with vocab 2; with vocab 1 a T barrier after every rank's T(i)
 * holds B/BW(S-1,i) instead. F(0,i) waits for the IF barrier where there are IF passes.
 *
 * What this is not: a check of the schedule's rules; zb_schedule_simulate runs the validator's
 * structural rules first, so the core below may assume every op is in range and appears once.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Per (stage, mb): when its F, B/BW, B alone, OFFLOAD and RELOAD ended (NAN: not yet), and whether
 * it is offloaded at all (its backward then waits for the RELOAD). */
typedef struct {
  double *endF, *endB, *endBonly, *endOff, *endRel;
  unsigned char *offloaded;
  /* Per microbatch, for the vocabulary barriers: how many ranks ended their S, T and IF, and the
   * latest end; inputs: the lists have IF passes. */
  int *nS, *nT, *nIF;
  double *lastS, *lastT, *lastIF;
  int inputs;
} ends_t;

/* The barrier of `type` passes of microbatch i: its end into *t (raised) when every rank is
 * through, else 1 with *dep naming what it waits for. */
static int barrier_dep(const zb_schedule_t *s, const ends_t *e, int type, int i, double *t, zb_op_t *dep) {
  const int *n = type == ZB_OP_S ? e->nS : type == ZB_OP_T ? e->nT : e->nIF;
  const double *last = type == ZB_OP_S ? e->lastS : type == ZB_OP_T ? e->lastT : e->lastIF;
  if (n[i] < s->p) {
    *dep = (zb_op_t){type, -1, i}; /* stage -1: every rank */
    return 1;
  }
  double b = last[i] + s->tvc;
  if (b > *t) *t = b;
  return 0;
}

/* Which op an op waits for, if any is not yet done: fills *dep (type, stage, mb) and returns 1. */
static int pending_dep(const zb_schedule_t *s, const zb_op_t *op, const ends_t *e_, int rank, double *ready,
                       zb_op_t *dep) {
  const double *endF = e_->endF, *endB = e_->endB, *endBonly = e_->endBonly;
  int st = op->stage, i = op->mb, m = s->m;
  size_t key = (size_t)st * m + i;
  double t = 0;
  if (zb__op_is_vocab(op->type)) {
    if (op->type == ZB_OP_S) {
      double e = endF[(size_t)(s->S - 1) * m + i];
      if (isnan(e)) {
        *dep = (zb_op_t){ZB_OP_F, s->S - 1, i};
        return 1;
      }
      t = e + (zb__stage_rank(s, s->S - 1) != rank ? s->t_comm : 0);
    } else if (op->type == ZB_OP_T) {
      if (barrier_dep(s, e_, ZB_OP_S, i, &t, dep)) return 1;
    } else if (op->type == ZB_OP_IB) {
      double e = endB[(size_t)i];
      if (isnan(e)) {
        *dep = (zb_op_t){ZB_OP_B, 0, i};
        return 1;
      }
      t = e + (zb__stage_rank(s, 0) != rank ? s->t_comm : 0);
    }
    *ready = t;
    return 0;
  }
  if (op->type == ZB_OP_F && st == 0 && e_->inputs && barrier_dep(s, e_, ZB_OP_IF, i, &t, dep)) return 1;
  if ((op->type == ZB_OP_B || op->type == ZB_OP_BW) && st == s->S - 1 && s->vocab &&
      barrier_dep(s, e_, s->vocab == 2 ? ZB_OP_S : ZB_OP_T, i, &t, dep))
    return 1;
  if (zb__op_is_copy(op->type)) {
    int off = op->type == ZB_OP_OFFLOAD;
    double e = off ? endF[key] : e_->endOff[key];
    if (isnan(e)) {
      *dep = (zb_op_t){off ? ZB_OP_F : ZB_OP_OFFLOAD, st, i};
      return 1;
    }
    *ready = e;
    return 0;
  }
  if (op->type != ZB_OP_F && e_->offloaded[key]) {
    double e = e_->endRel[key];
    if (isnan(e)) {
      *dep = (zb_op_t){ZB_OP_RELOAD, st, i};
      return 1;
    }
    t = e;
  }
  if (op->type == ZB_OP_F) {
    if (st > 0) {
      double e = endF[(size_t)(st - 1) * m + i];
      if (isnan(e)) {
        *dep = (zb_op_t){ZB_OP_F, st - 1, i};
        return 1;
      }
      t = e + (zb__stage_rank(s, st - 1) != rank ? s->t_comm : 0);
    }
  } else if (op->type == ZB_OP_B || op->type == ZB_OP_BW) {
    double e = endF[(size_t)st * m + i];
    if (isnan(e)) {
      *dep = (zb_op_t){ZB_OP_F, st, i};
      return 1;
    }
    e += zb__stage_rank(s, st) != rank ? s->t_comm : 0;
    if (e > t) t = e;
    if (st + 1 < s->S) {
      double eb = endB[(size_t)(st + 1) * m + i];
      if (isnan(eb)) {
        *dep = (zb_op_t){ZB_OP_B, st + 1, i};
        return 1;
      }
      eb += zb__stage_rank(s, st + 1) != rank ? s->t_comm : 0;
      if (eb > t) t = eb;
    }
  } else { /* W */
    double e = endBonly[(size_t)st * m + i];
    if (isnan(e)) {
      *dep = (zb_op_t){ZB_OP_B, st, i};
      return 1;
    }
    e += zb__stage_rank(s, st) != rank ? s->t_comm : 0;
    if (e > t) t = e;
  }
  *ready = t;
  return 0;
}

zb_status_t zb__simulate_times(const zb_schedule_t *s, double *start, double *end) {
  return zb__simulate_durations(s, NULL, start, end);
}

zb_status_t zb__simulate_durations(const zb_schedule_t *s, const double *dur, double *start, double *end) {
  size_t n = (size_t)s->S * (size_t)s->m;
  ends_t e = {0};
  e.endF = malloc(n * sizeof(double));
  e.endB = malloc(n * sizeof(double));     /* B or BW: what the stage below waits for */
  e.endBonly = malloc(n * sizeof(double)); /* B only: what W waits for */
  e.endOff = malloc(n * sizeof(double));
  e.endRel = malloc(n * sizeof(double));
  e.offloaded = calloc(n, 1);
  size_t nm = (size_t)s->m;
  e.nS = calloc(nm, sizeof(int)), e.nT = calloc(nm, sizeof(int)), e.nIF = calloc(nm, sizeof(int));
  e.lastS = calloc(nm, sizeof(double)), e.lastT = calloc(nm, sizeof(double)), e.lastIF = calloc(nm, sizeof(double));
  int *pos = calloc((size_t)s->p, sizeof(int));
  double *free_at = calloc((size_t)s->p, sizeof(double));
  double *copy_free = calloc((size_t)s->p, sizeof(double)); /* the copy lane */
  double *issued = calloc((size_t)s->p, sizeof(double));    /* start of the last compute op */
  zb_status_t st = ZB_OK;
  if (!e.endF || !e.endB || !e.endBonly || !e.endOff || !e.endRel || !e.offloaded || !pos || !free_at ||
      !copy_free || !issued || !e.nS || !e.nT || !e.nIF || !e.lastS || !e.lastT || !e.lastIF) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory simulating %d ops", s->n_ops);
    goto done;
  }
  for (size_t k = 0; k < n; k++) e.endF[k] = e.endB[k] = e.endBonly[k] = e.endOff[k] = e.endRel[k] = NAN;
  for (int k = 0; k < s->n_ops; k++) {
    if (s->ops[k].type == ZB_OP_OFFLOAD) e.offloaded[(size_t)s->ops[k].stage * s->m + s->ops[k].mb] = 1;
    e.inputs |= s->ops[k].type == ZB_OP_IF;
  }

  /* Round-robin passes: each pass runs every rank as far as its dependencies allow. The times do
   * not depend on the order in which ranks are advanced, only on each rank's list order. */
  int done = 0, progress = 1;
  while (done < s->n_ops && progress) {
    progress = 0;
    for (int r = 0; r < s->p; r++) {
      int base = s->rank_off[r], cnt = s->rank_off[r + 1] - base;
      while (pos[r] < cnt) {
        const zb_op_t *op = &s->ops[base + pos[r]];
        double ready;
        zb_op_t dep;
        if (pending_dep(s, op, &e, r, &ready, &dep)) break;
        double d = dur ? dur[base + pos[r]] : zb__op_cost(s, op->type, op->stage);
        double t0, t1;
        if (zb__op_is_copy(op->type)) {
          t0 = fmax(ready, fmax(copy_free[r], issued[r]));
          t1 = t0 + d;
          copy_free[r] = t1;
        } else {
          t0 = ready > free_at[r] ? ready : free_at[r];
          t1 = t0 + d;
          free_at[r] = t1;
          issued[r] = t0;
        }
        start[base + pos[r]] = t0;
        end[base + pos[r]] = t1;
        if (zb__op_is_vocab(op->type)) {
          int *cnt_ = op->type == ZB_OP_S ? e.nS : op->type == ZB_OP_T ? e.nT : op->type == ZB_OP_IF ? e.nIF : NULL;
          double *last = op->type == ZB_OP_S ? e.lastS : op->type == ZB_OP_T ? e.lastT : e.lastIF;
          if (cnt_) {
            cnt_[op->mb]++;
            if (t1 > last[op->mb]) last[op->mb] = t1;
          }
          pos[r]++;
          done++;
          progress = 1;
          continue;
        }
        size_t key = (size_t)op->stage * s->m + op->mb;
        if (op->type == ZB_OP_F) e.endF[key] = t1;
        if (op->type == ZB_OP_B || op->type == ZB_OP_BW) e.endB[key] = t1;
        if (op->type == ZB_OP_B) e.endBonly[key] = t1;
        if (op->type == ZB_OP_OFFLOAD) e.endOff[key] = t1;
        if (op->type == ZB_OP_RELOAD) e.endRel[key] = t1;
        pos[r]++;
        done++;
        progress = 1;
      }
    }
  }

  if (done < s->n_ops) {
    /* Name every stuck rank: where it stopped and what it waits for. */
    char msg[1536];
    size_t len = 0;
    int shown = 0;
    len += (size_t)snprintf(msg, sizeof msg, "deadlock (rule: the schedule must be able to run):");
    for (int r = 0; r < s->p && len < sizeof msg - 200; r++) {
      int base = s->rank_off[r], cnt = s->rank_off[r + 1] - base;
      if (pos[r] >= cnt) continue;
      const zb_op_t *op = &s->ops[base + pos[r]];
      double ready;
      zb_op_t dep = {0, 0, 0};
      pending_dep(s, op, &e, r, &ready, &dep);
      const char *dname = dep.type == ZB_OP_B ? (op->type == ZB_OP_W ? "B" : "B/BW")
                          : dep.type == ZB_OP_F ? "F" : zb__op_name(dep.type);
      if (dep.stage < 0) /* a vocabulary barrier */
        len += (size_t)snprintf(msg + len, sizeof msg - len,
                                "%s rank %d at position %d (%s %s %d mb %d) waits for %s mb %d on every rank (a "
                                "barrier)", shown ? ";" : "", r, pos[r], zb__op_name(op->type),
                                zb__op_is_vocab(op->type) ? "rank" : "stage", op->stage, op->mb, dname, dep.mb);
      else
        len += (size_t)snprintf(msg + len, sizeof msg - len,
                                "%s rank %d at position %d (%s %s %d mb %d) waits for %s stage %d "
                                "mb %d on rank %d",
                                shown ? ";" : "", r, pos[r], zb__op_name(op->type),
                                zb__op_is_vocab(op->type) ? "rank" : "stage", op->stage, op->mb, dname, dep.stage,
                                dep.mb, zb__stage_rank(s, dep.stage));
      if (++shown >= 4) break;
    }
    st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE, "%s", msg);
  }
done:
  free(e.endF), free(e.endB), free(e.endBonly), free(e.endOff), free(e.endRel), free(e.offloaded);
  free(e.nS), free(e.nT), free(e.nIF), free(e.lastS), free(e.lastT), free(e.lastIF);
  free(pos), free(free_at), free(copy_free), free(issued);
  return st;
}

static zb_sim_result_t stats_of(const zb_schedule_t *s, const double *start, const double *end, double *span_out,
                                double *busy_out, double *peak_out, double *host_out);

/* The op order run with the given durations: start and end of every op (arrays of n_ops), which
 * the caller frees. */
static zb_status_t run_durations(const zb_schedule_t *s, const double *const *durations, double **start_out,
                                 double **end_out) {
  ZB_CHECK(zb__validate_structure(s));
  size_t n = (size_t)(s->n_ops ? s->n_ops : 1);
  double *dur = malloc(n * sizeof(double)), *start = malloc(n * sizeof(double)), *end = malloc(n * sizeof(double));
  if (!dur || !start || !end) {
    free(dur), free(start), free(end);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory simulating %d ops", s->n_ops);
  }
  zb_status_t st = ZB_OK;
  for (int r = 0; r < s->p && st == ZB_OK; r++) {
    int a = s->rank_off[r], b = s->rank_off[r + 1];
    if (b > a && !durations[r]) {
      st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "durations[%d] is NULL; rank %d has %d ops", r, r, b - a);
      break;
    }
    for (int k = a; k < b && st == ZB_OK; k++) {
      dur[k] = durations[r][k - a];
      if (!(dur[k] >= 0) || isinf(dur[k]))
        st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "durations[%d][%d] is %g; op durations must be finite and >= 0", r, k - a, dur[k]);
    }
  }
  if (st == ZB_OK) st = zb__simulate_durations(s, dur, start, end);
  free(dur);
  if (st != ZB_OK) {
    free(start), free(end);
    return st;
  }
  *start_out = start, *end_out = end;
  return ZB_OK;
}

zb_status_t zb_schedule_simulate_durations(const zb_schedule_t *s, const double *const *durations,
                                          zb_sim_result_t *out) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(durations);
  ZB_ARG_NOT_NULL(out);
  double *start = NULL, *end = NULL;
  ZB_CHECK(run_durations(s, durations, &start, &end));
  *out = stats_of(s, start, end, NULL, NULL, NULL, NULL);
  free(start), free(end);
  return ZB_OK;
}

zb_status_t zb_schedule_makespan_durations(const zb_schedule_t *s, const double *const *durations,
                                           double *out_makespan) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(durations);
  ZB_ARG_NOT_NULL(out_makespan);
  double *start = NULL, *end = NULL;
  ZB_CHECK(run_durations(s, durations, &start, &end));
  *out_makespan = zb__makespan_of(s, start, end);
  free(start), free(end);
  return ZB_OK;
}

double zb__makespan_of(const zb_schedule_t *s, const double *start, const double *end) {
  double first = 0.0, last = 0.0;
  for (int k = 0; k < s->n_ops; k++) {
    if (k == 0 || start[k] < first) first = start[k];
    if (k == 0 || end[k] > last) last = end[k];
  }
  return s->n_ops ? last - first : 0.0;
}

zb_sim_result_t zb__sim_stats(const zb_schedule_t *s, const double *start, const double *end) {
  return stats_of(s, start, end, NULL, NULL, NULL, NULL);
}

zb_status_t zb_schedule_simulate(zb_schedule_t *s, zb_sim_result_t *out) {
  ZB_ARG_NOT_NULL(s);
  if (s->simulated) {
    if (out) *out = s->sim;
    return ZB_OK;
  }
  ZB_CHECK(zb__validate_structure(s));
  size_t n = (size_t)(s->n_ops ? s->n_ops : 1);
  if (!s->start) s->start = malloc(n * sizeof(double));
  if (!s->end) s->end = malloc(n * sizeof(double));
  if (!s->start || !s->end)
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory simulating %d ops", s->n_ops);
  ZB_CHECK(zb__simulate_times(s, s->start, s->end));

  zb__schedule_fill_stats(s);
  if (out) *out = s->sim;
  return ZB_OK;
}

static int event_cmp(const void *a, const void *b) {
  const zb__mem_event_t *x = a, *y = b;
  if (x->t != y->t) return x->t < y->t ? -1 : 1;
  /* At one instant memory is freed before it is taken, as the runtime frees at an op's end what
   * the next op then allocates; then list order. */
  if ((x->delta < 0) != (y->delta < 0)) return x->delta < 0 ? -1 : 1;
  return x->order - y->order;
}

zb_status_t zb__memory_events(const zb_schedule_t *s, int r, const double *start, const double *end,
                              zb__mem_event_t **out, int *count) {
  int a = s->rank_off[r], b = s->rank_off[r + 1], n = 0;
  zb__mem_event_t *ev = malloc((size_t)(2 * (b - a) + 1) * sizeof *ev);
  if (!ev) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory counting rank %d's memory", r);
  for (int k = a; k < b; k++) {
    const zb_op_t *op = &s->ops[k];
    double u = zb__op_mem_at(s, ZB_OP_F, op->stage); /* the (stage, mb)'s whole share */
    switch (op->type) {
      case ZB_OP_F: ev[n++] = (zb__mem_event_t){start[k], u, 0, k}; break;
      case ZB_OP_OFFLOAD: /* on the host from its start, off the device at its end */
        ev[n++] = (zb__mem_event_t){start[k], u, 1, k};
        ev[n++] = (zb__mem_event_t){end[k], -u, 0, k};
        break;
      case ZB_OP_RELOAD: /* on the device from its start, off the host at its end */
        ev[n++] = (zb__mem_event_t){start[k], u, 0, k};
        ev[n++] = (zb__mem_event_t){end[k], -u, 1, k};
        break;
      default: ev[n++] = (zb__mem_event_t){end[k], zb__op_mem_at(s, op->type, op->stage), 0, k};
    }
  }
  qsort(ev, (size_t)n, sizeof *ev, event_cmp);
  *out = ev, *count = n;
  return ZB_OK;
}

zb_status_t zb__rank_memory(const zb_schedule_t *s, int r, const double *start, const double *end, double limit,
                            double *dev_peak, double *host_peak, int *first_over, double *over_mem) {
  int a = s->rank_off[r], b = s->rank_off[r + 1], copies = 0;
  double dev = 0, host = 0, pd = 0, ph = 0;
  *first_over = -1;
  for (int k = a; k < b; k++) copies += zb__op_is_copy(s->ops[k].type);
  if (!copies) { /* list order: compute ops run one after another */
    for (int k = a; k < b; k++) {
      dev += zb__op_mem_at(s, s->ops[k].type, s->ops[k].stage);
      if (dev > pd) pd = dev;
      if (limit > 0 && *first_over < 0 && dev > limit + ZB_EPS) *first_over = k, *over_mem = dev;
    }
    *dev_peak = pd, *host_peak = 0;
    return ZB_OK;
  }
  zb__mem_event_t *ev;
  int n;
  ZB_CHECK(zb__memory_events(s, r, start, end, &ev, &n));
  for (int k = 0; k < n; k++) {
    if (ev[k].host) {
      host += ev[k].delta;
      if (host > ph) ph = host;
    } else {
      dev += ev[k].delta;
      if (dev > pd) pd = dev;
      if (limit > 0 && *first_over < 0 && dev > limit + ZB_EPS) *first_over = ev[k].order, *over_mem = dev;
    }
  }
  free(ev);
  *dev_peak = pd, *host_peak = ph;
  return ZB_OK;
}

/* Span, busy and peak of each rank (into the arrays when not NULL) and the overall figures, from
 * op times aligned with s->ops (simulated or measured; busy is the sum of compute op durations,
 * span runs over compute ops: copies run beside them). */
static zb_sim_result_t stats_of(const zb_schedule_t *s, const double *start, const double *end, double *span_out,
                                double *busy_out, double *peak_out, double *host_out) {
  zb_sim_result_t res = {0, 0, 0, 0};
  for (int r = 0; r < s->p; r++) {
    int a = s->rank_off[r], b = s->rank_off[r + 1], seen = 0;
    double busy = 0, peak = 0, host = 0, first = 0, last = 0;
    for (int k = a; k < b; k++) {
      if (zb__op_is_copy(s->ops[k].type)) continue;
      busy += end[k] - start[k];
      if (!seen || start[k] < first) first = start[k];
      if (!seen || end[k] > last) last = end[k];
      seen = 1;
    }
    int over;
    double at;
    /* Out of memory for the event list: the list-order count (copies as 0) stands in. */
    if (zb__rank_memory(s, r, start, end, 0, &peak, &host, &over, &at) != ZB_OK) {
      double mem = 0;
      peak = host = 0;
      for (int k = a; k < b; k++) {
        mem += zb__op_mem_at(s, s->ops[k].type, s->ops[k].stage);
        if (mem > peak) peak = mem;
      }
    }
    double span = seen ? last - first : 0;
    if (span_out) span_out[r] = span, busy_out[r] = busy, peak_out[r] = peak;
    if (host_out) host_out[r] = host;
    if (span > res.cost) res.cost = span;
    if (busy > res.busy) res.busy = busy;
    if (peak > res.max_peak_memory) res.max_peak_memory = peak;
  }
  res.bubble_rate = res.cost > 0 ? (res.cost - res.busy) / res.cost : 0;
  /* Rounding in long sums can leave -1e-17; a bubble is never negative. */
  if (res.bubble_rate < 0 && res.bubble_rate > -ZB_EPS) res.bubble_rate = 0;
  return res;
}

void zb__schedule_fill_stats(zb_schedule_t *s) {
  s->sim = stats_of(s, s->start, s->end, s->span, s->busy, s->peak, s->host_peak);
  s->simulated = 1;
}

/* The accessors below read simulation results of one rank. */
static zb_status_t check_simulated_rank(const zb_schedule_t *s, int32_t rank) {
  ZB_ARG_NOT_NULL(s);
  if (!s->simulated)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the schedule has not been simulated; call "
                                            "zb_schedule_simulate first");
  if (rank < 0 || rank >= s->p)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank %d is out of range; the schedule has ranks 0..%d",
                   (int)rank, s->p - 1);
  return ZB_OK;
}

zb_status_t zb_schedule_rank_times(const zb_schedule_t *s, int32_t rank, const double **start,
                                   const double **end) {
  ZB_CHECK(check_simulated_rank(s, rank));
  if (start) *start = s->start + s->rank_off[rank];
  if (end) *end = s->end + s->rank_off[rank];
  return ZB_OK;
}

zb_status_t zb_schedule_rank_stats(const zb_schedule_t *s, int32_t rank, double *span, double *busy,
                                   double *peak) {
  ZB_CHECK(check_simulated_rank(s, rank));
  if (span) *span = s->span[rank];
  if (busy) *busy = s->busy[rank];
  if (peak) *peak = s->peak[rank];
  return ZB_OK;
}

zb_status_t zb_schedule_rank_memory(const zb_schedule_t *s, int32_t rank, double *device_peak, double *host_peak) {
  ZB_CHECK(check_simulated_rank(s, rank));
  if (device_peak) *device_peak = s->peak[rank];
  if (host_peak) *host_peak = s->host_peak[rank];
  return ZB_OK;
}

/* ---- Vocabulary Parallelism's passes placed into any kind's order (zb__place_vocab) -----------
 *
 * What zb_schedule_create does for a spec with `vocab` and a kind other than 1F1B (whose placement
 * is the reference's own, gen_vocab.c). The rule, stated so it can be tested: the kind's order
 * runs in the simulator above, and each rank runs a pass at its next op boundary as soon as the
 * pass is due, before its next op of the kind's order when it can start no later than that op:
 *   IF(i) once F(0, i-1) has started (IF(0) at once): the embedding a step ahead of its F;
 *   S(i)  once F(S-1, i) has ended (plus T_comm on other ranks: its hidden state travels);
 *   T(i)  once every rank's S(i) has ended and the barrier, T_VOCAB_COMM, with it;
 *   IB(i) once B/BW(0, i) has ended (plus T_comm on other ranks).
 * Each kind runs in microbatch order on every rank. The order the ranks ran is the result: it
 * cannot deadlock, since every pass becomes due from ops that do not wait for it, and a rank that
 * waits for its next op still runs the passes that are due. The kind's ops keep their order.
 *
 * What this is not: a search; the reference's 1F1B placement (gen_vocab.c) hides the passes
 * better where it applies. */
zb_status_t zb__place_vocab(zb_schedule_t *s) {
  const int p = s->p, m = s->m, S = s->S;
  const size_t n = (size_t)S * (size_t)m;
  ends_t e = {0};
  e.endF = malloc(n * sizeof(double)), e.endB = malloc(n * sizeof(double));
  e.endBonly = malloc(n * sizeof(double)), e.endOff = malloc(n * sizeof(double));
  e.endRel = malloc(n * sizeof(double)), e.offloaded = calloc(n, 1);
  e.nS = calloc((size_t)m, sizeof(int)), e.nT = calloc((size_t)m, sizeof(int)), e.nIF = calloc((size_t)m, sizeof(int));
  e.lastS = calloc((size_t)m, sizeof(double)), e.lastT = calloc((size_t)m, sizeof(double));
  e.lastIF = calloc((size_t)m, sizeof(double));
  e.inputs = 1;
  int *pos = calloc((size_t)p, sizeof(int)), *next = calloc((size_t)p * 4, sizeof(int));
  double *free_at = calloc((size_t)p, sizeof(double)), *startF0 = malloc((size_t)m * sizeof(double));
  zb__oplists_t l;
  zb_status_t st = zb__oplists_init(&l, p);
  if (st != ZB_OK) goto done;
  if (!e.endF || !e.endB || !e.endBonly || !e.endOff || !e.endRel || !e.offloaded || !e.nS || !e.nT || !e.nIF ||
      !e.lastS || !e.lastT || !e.lastIF || !pos || !next || !free_at || !startF0) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory placing the vocabulary passes of %d ops", s->n_ops);
    goto done;
  }
  for (size_t k = 0; k < n; k++) e.endF[k] = e.endB[k] = e.endBonly[k] = e.endOff[k] = e.endRel[k] = NAN;
  for (int i = 0; i < m; i++) startF0[i] = NAN;
  const int r_first = zb__stage_rank(s, 0), r_last = zb__stage_rank(s, S - 1);
  static const int kinds[4] = {ZB_OP_IF, ZB_OP_S, ZB_OP_T, ZB_OP_IB};
  const long long total = (long long)s->n_ops + 4LL * p * m;
  for (long long done_ops = 0; done_ops < total; done_ops++) {
    int best_r = -1, best_pass = -1;
    double best_t = INFINITY;
    for (int r = 0; r < p; r++) {
      /* Its next op of the kind's order, if its inputs are there. */
      double t_op = INFINITY;
      const int base = s->rank_off[r], cnt = s->rank_off[r + 1] - base;
      if (pos[r] < cnt) {
        double ready;
        zb_op_t dep;
        if (!pending_dep(s, &s->ops[base + pos[r]], &e, r, &ready, &dep)) t_op = fmax(ready, free_at[r]);
      }
      /* Its passes that are due: the earliest first, before the op when it does not start later. */
      for (int k = 0; k < 4; k++) {
        const int i = next[(size_t)r * 4 + (size_t)k];
        if (i >= m) continue;
        double ready = NAN;
        if (kinds[k] == ZB_OP_IF) ready = i == 0 ? 0.0 : startF0[i - 1];
        else if (kinds[k] == ZB_OP_S) ready = e.endF[(size_t)(S - 1) * m + i] + (r != r_last ? s->t_comm : 0);
        else if (kinds[k] == ZB_OP_T) ready = next[(size_t)r * 4 + 1] > i && e.nS[i] == p ? e.lastS[i] + s->tvc : NAN;
        else ready = next[(size_t)r * 4] > i ? e.endB[i] + (r != r_first ? s->t_comm : 0) : NAN;
        if (isnan(ready)) continue;
        const double t = fmax(ready, free_at[r]);
        if (t <= t_op && t < best_t) best_t = t, best_r = r, best_pass = k;
      }
      if (t_op < best_t) best_t = t_op, best_r = r, best_pass = -1;
    }
    if (best_r < 0) {
      st = ZB_FAIL(ZB_ERR_INTERNAL, "placing the vocabulary passes: no rank can go on (%lld of %lld ops placed)",
                   done_ops, total);
      goto done;
    }
    const int r = best_r;
    if (best_pass >= 0) {
      const int type = kinds[best_pass], i = next[(size_t)r * 4 + (size_t)best_pass]++;
      const double t1 = best_t + zb__op_cost(s, type, r);
      free_at[r] = t1;
      if (type == ZB_OP_S) e.nS[i]++, e.lastS[i] = fmax(e.lastS[i], t1);
      if (type == ZB_OP_T) e.nT[i]++, e.lastT[i] = fmax(e.lastT[i], t1);
      if (type == ZB_OP_IF) e.nIF[i]++, e.lastIF[i] = fmax(e.lastIF[i], t1);
      st = zb__oplists_push(&l, r, type, r, i);
    } else {
      const zb_op_t *op = &s->ops[s->rank_off[r] + pos[r]++];
      const double t1 = best_t + zb__op_cost(s, op->type, op->stage);
      free_at[r] = t1;
      const size_t key = (size_t)op->stage * m + op->mb;
      if (op->type == ZB_OP_F) e.endF[key] = t1;
      if (op->type == ZB_OP_F && op->stage == 0) startF0[op->mb] = best_t;
      if (op->type == ZB_OP_B || op->type == ZB_OP_BW) e.endB[key] = t1;
      if (op->type == ZB_OP_B) e.endBonly[key] = t1;
      st = zb__oplists_push(&l, r, op->type, op->stage, op->mb);
    }
    if (st != ZB_OK) goto done;
  }
  st = zb__schedule_take_ops(s, &l);
  free(s->start), free(s->end); /* sized for the ops before: the next simulation allocates anew */
  s->start = s->end = NULL;
done:
  zb__oplists_free(&l);
  free(e.endF), free(e.endB), free(e.endBonly), free(e.endOff), free(e.endRel), free(e.offloaded);
  free(e.nS), free(e.nT), free(e.nIF), free(e.lastS), free(e.lastT), free(e.lastIF);
  free(pos), free(next), free(free_at), free(startF0);
  return st;
}
