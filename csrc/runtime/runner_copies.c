/*
 * runner_copies.c - the runner's copy lane: PipeOffload's OFFLOAD and RELOAD ops (DESIGN.md 3, 4).
 *
 * The schedule model starts a copy at the latest of: the start of the compute op before it in the
 * rank's list, the end of the lane's previous copy, and its dependency (OFFLOAD(s, mb) after
 * F(s, mb); RELOAD after its OFFLOAD). The runner follows that: on the host, just before it runs
 * compute op k, it issues the copies that follow k in the list (zb__copies_issue), and a B, BW or W
 * of an offloaded (s, mb) waits for its RELOAD (zb__copies_wait). On a device it issues them just
 * after op k's work is enqueued (so an OFFLOAD right after its F finds the F's tensors); the copy
 * stream then runs them beside op k, as the model has it.
 *
 * Host backend: one thread per iteration runs the issued copies one at a time in list order,
 * calling copy_cb on that thread; an OFFLOAD first waits until the runner has finished F(s, mb).
 * With copy_time_scale > 0 a copy lasts at least its schedule time times the scale (a modelled
 * PCIe link), so the protocol and its timing can be tested on a machine without one. A copy that
 * fails stops the lane; the runner reports it at its next wait, naming the copy.
 * Device backends: copy_cb is called on the runner's thread when the copy is issued and only
 * enqueues the copy; the caller orders it against the compute stream with events (the torch layer
 * uses a copy stream of its own), so here nothing waits.
 *
 * With copy_inline the host calls copy_cb on the runner's thread too, done when it returns, in list
 * order: the RELOADs that lead the copies after op k just before op k (where the model starts
 * them), the rest from the first OFFLOAD on just after op k (the OFFLOAD's F).
 *
 * Copies are stamped with the host clock where they ran (host) or were issued (device).
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep, clock_gettime */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runner.h"

struct zb__copylane {
  int32_t n;            /* copies on this rank, in list order */
  int32_t *op;          /* their op indices */
  double *min_s;        /* their modelled duration (0: none) */
  int32_t *next_copy;   /* per op k: the first copy at a list position > k (n when none) */
  int32_t *reload;      /* per (stage * m + mb): the lane index of its RELOAD, -1 */
  uint8_t *f_done;      /* per (stage * m + mb): F returned in this iteration (host lane) */
  int device;           /* 1: copy_cb runs inline, on the runner's thread (device backend, copy_inline) */
  int host_inline;      /* copy_inline on the host: RELOADs before the op before them, OFFLOADs after */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int sync_made, thread_up;
  pthread_t th;
  int32_t issued, done; /* copies handed to the lane, and finished */
  int stop;
  zb_status_t st;       /* the lane's failure, with its message and the copy */
  int32_t failed;
  char msg[1024];
};

static const char *copy_name(int32_t type) { return type == ZB_OP_OFFLOAD ? "OFFLOAD" : "RELOAD"; }
static int is_copy(int32_t type) { return type == ZB_OP_OFFLOAD || type == ZB_OP_RELOAD; }

zb_status_t zb__copies_plan(zb_runner_t *r, zb_copy_cb cb, double time_scale, int inline_copies) {
  r->copy_cb = cb;
  int32_t n = 0;
  for (int32_t k = 0; k < r->n; k++) n += is_copy(r->ops[k].type);
  if (n == 0) return ZB_OK;
  if (time_scale < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_runner_config_t.copy_time_scale is %g; it must be >= 0 (0: no "
                   "modelled copy time)", time_scale);
  zb__copylane_t *l = calloc(1, sizeof(*l));
  if (!l) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for rank %d's copy lane", (int)r->rank);
  r->copies = l;
  const size_t cells = (size_t)r->S * (size_t)r->m;
  l->n = n;
  l->op = calloc((size_t)n, sizeof(int32_t));
  l->min_s = calloc((size_t)n, sizeof(double));
  l->next_copy = calloc((size_t)r->n, sizeof(int32_t));
  l->reload = malloc(cells * sizeof(int32_t));
  l->f_done = calloc(cells, 1);
  if (!l->op || !l->min_s || !l->next_copy || !l->reload || !l->f_done)
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for rank %d's %d copies", (int)r->rank, (int)n);
  for (size_t c = 0; c < cells; c++) l->reload[c] = -1;
  int32_t j = 0;
  for (int32_t k = 0; k < r->n; k++) {
    const zb_op_t *op = &r->ops[k];
    if (!is_copy(op->type)) continue;
    l->op[j] = k;
    double t = 0;
    ZB_CHECK(zb_schedule_op_time(r->schedule, (zb_op_type_t)op->type, op->stage, &t));
    l->min_s[j] = t * time_scale;
    if (op->type == ZB_OP_RELOAD) l->reload[(size_t)op->stage * (size_t)r->m + (size_t)op->mb] = j;
    j++;
  }
  for (int32_t k = r->n - 1, next = n; k >= 0; k--) { /* next: the first copy after k */
    l->next_copy[k] = next;
    if (is_copy(r->ops[k].type)) next--;
  }
  l->device = r->be->ops->device_memory || inline_copies;
  l->host_inline = !r->be->ops->device_memory && inline_copies;
  if (pthread_mutex_init(&l->mu, NULL) != 0)
    return ZB_FAIL(ZB_ERR_INTERNAL, "could not create rank %d's copy lane lock", (int)r->rank);
  if (pthread_cond_init(&l->cv, NULL) != 0) {
    pthread_mutex_destroy(&l->mu);
    return ZB_FAIL(ZB_ERR_INTERNAL, "could not create rank %d's copy lane condition", (int)r->rank);
  }
  l->sync_made = 1;
  return ZB_OK;
}

void zb__copies_free(zb_runner_t *r) {
  zb__copylane_t *l = r->copies;
  if (!l) return;
  zb__copies_stop(r);
  if (l->sync_made) pthread_cond_destroy(&l->cv), pthread_mutex_destroy(&l->mu);
  free(l->op), free(l->min_s), free(l->next_copy), free(l->reload), free(l->f_done);
  free(l);
  r->copies = NULL;
}

static void sleep_until(double t) {
  for (;;) {
    double left = t - zb__now();
    if (left <= 0) return;
    struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
    if (nanosleep(&ts, NULL) == 0) return;
  }
}

/* Runs copy j (a host lane's thread, or inline on a device backend): copy_cb, then the modelled
 * rest of its time. Returns the callback's status; its message is in this thread's error. */
static zb_status_t run_copy(zb_runner_t *r, int32_t j) {
  zb__copylane_t *l = r->copies;
  const int32_t k = l->op[j];
  const zb_op_t *op = &r->ops[k];
  zb__clear_error();
  const double t0 = zb__now();
  zb_status_t st = r->copy_cb ? r->copy_cb(r->user, op->type, op->stage, op->mb) : ZB_OK;
  if (st == ZB_OK && !l->device && l->min_s[j] > 0) sleep_until(t0 + l->min_s[j]);
  r->start[k] = t0, r->end[k] = zb__now();
  return st;
}

static void *lane_main(void *arg) {
  zb_runner_t *r = arg;
  zb__copylane_t *l = r->copies;
  pthread_mutex_lock(&l->mu);
  while (!l->stop && l->done < l->n) {
    if (l->done == l->issued) {
      pthread_cond_wait(&l->cv, &l->mu);
      continue;
    }
    const int32_t j = l->done;
    const zb_op_t *op = &r->ops[l->op[j]];
    if (op->type == ZB_OP_OFFLOAD && !l->f_done[(size_t)op->stage * (size_t)r->m + (size_t)op->mb]) {
      pthread_cond_wait(&l->cv, &l->mu); /* its F has not returned yet */
      continue;
    }
    pthread_mutex_unlock(&l->mu);
    zb_status_t st = run_copy(r, j);
    pthread_mutex_lock(&l->mu);
    if (st != ZB_OK) {
      l->st = st, l->failed = j;
      snprintf(l->msg, sizeof l->msg, "%s", zb__error_body());
      pthread_cond_broadcast(&l->cv);
      break;
    }
    l->done++;
    pthread_cond_broadcast(&l->cv);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* The lane's failure as the runner reports it: which copy, and the callback's words. */
static zb_status_t lane_failure(zb_runner_t *r) {
  zb__copylane_t *l = r->copies;
  const zb_op_t *op = &r->ops[l->op[l->failed]];
  return ZB_FAIL(l->st, "the copy %s(stage %d, mb %d) failed: the copy callback returned %s%s%s",
                 copy_name(op->type), (int)op->stage, (int)op->mb, zb_status_string(l->st),
                 l->msg[0] ? ": " : "", l->msg);
}

zb_status_t zb__copies_begin(zb_runner_t *r) {
  zb__copylane_t *l = r->copies;
  if (!l) return ZB_OK;
  l->issued = l->done = 0, l->stop = 0, l->st = ZB_OK, l->failed = -1, l->msg[0] = '\0';
  memset(l->f_done, 0, (size_t)r->S * (size_t)r->m);
  if (!l->device) {
    if (pthread_create(&l->th, NULL, lane_main, r) != 0)
      return ZB_FAIL(ZB_ERR_INTERNAL, "rank %d: could not start the copy lane's thread", (int)r->rank);
    l->thread_up = 1;
  }
  /* Copies before the first compute op start with the iteration. */
  int32_t first = 0;
  while (first < r->n && is_copy(r->ops[first].type)) first++;
  return first > 0 ? zb__copies_issue(r, -1, l->device) : ZB_OK;
}

zb_status_t zb__copies_issue(zb_runner_t *r, int32_t k, int after) {
  zb__copylane_t *l = r->copies;
  if (!l || (!l->host_inline && after != l->device)) return ZB_OK;
  int32_t upto = l->n; /* copies [from, upto) are the ones between k and the next compute op */
  int32_t from = k < 0 ? 0 : l->next_copy[k];
  if (from >= l->n || l->op[from] != k + 1) return ZB_OK; /* none right after k */
  for (int32_t j = from; j < l->n; j++)
    if (l->op[j] != (j == from ? l->op[from] : l->op[j - 1] + 1)) {
      upto = j;
      break;
    }
  if (from >= upto) return ZB_OK;
  if (l->device) {
    /* Inline on the host, in list order as on a lane: the RELOADs before the group's first OFFLOAD
     * where the model starts them (with the op before them), the rest once that op (the OFFLOAD's
     * F) is done. */
    int32_t split = from;
    while (l->host_inline && split < upto && r->ops[l->op[split]].type == ZB_OP_RELOAD) split++;
    if (l->host_inline) {
      if (!after) upto = split;
      else from = split;
    }
    for (int32_t j = from; j < upto; j++) {
      zb_status_t st = run_copy(r, j);
      if (st != ZB_OK) {
        l->st = st, l->failed = j;
        snprintf(l->msg, sizeof l->msg, "%s", zb__error_body());
        return lane_failure(r);
      }
      l->issued = l->done = j + 1;
    }
    return ZB_OK;
  }
  pthread_mutex_lock(&l->mu);
  l->issued = upto;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  return ZB_OK;
}

void zb__copies_forward_done(zb_runner_t *r, int32_t stage, int32_t mb) {
  zb__copylane_t *l = r->copies;
  if (!l || l->device) return;
  pthread_mutex_lock(&l->mu);
  l->f_done[(size_t)stage * (size_t)r->m + (size_t)mb] = 1;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
}

/* Waits (at most timeout_s) until the lane has finished copy `upto` - 1, or has failed. */
static zb_status_t lane_wait(zb_runner_t *r, int32_t upto, const char *what) {
  zb__copylane_t *l = r->copies;
  const double deadline = zb__now() + r->timeout;
  zb_status_t st = ZB_OK;
  pthread_mutex_lock(&l->mu);
  while (l->st == ZB_OK && l->done < upto) {
    double left = deadline - zb__now();
    if (left <= 0) break;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double add = left < 0.2 ? left : 0.2;
    ts.tv_sec += (time_t)add;
    ts.tv_nsec += (long)((add - (double)(time_t)add) * 1e9);
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    int rc = pthread_cond_timedwait(&l->cv, &l->mu, &ts);
    (void)rc; /* ETIMEDOUT or a wake-up: the loop looks again */
  }
  if (l->st != ZB_OK) {
    pthread_mutex_unlock(&l->mu);
    return lane_failure(r);
  }
  if (l->done < upto) {
    const zb_op_t *op = &r->ops[l->op[l->done]];
    st = ZB_FAIL(ZB_ERR_TIMEOUT, "%s: the copy lane is still at %s(stage %d, mb %d) after %g s", what,
                 copy_name(op->type), (int)op->stage, (int)op->mb, r->timeout);
  }
  pthread_mutex_unlock(&l->mu);
  return st;
}

zb_status_t zb__copies_wait(zb_runner_t *r, int32_t k) {
  zb__copylane_t *l = r->copies;
  const zb_op_t *op = &r->ops[k];
  if (!l || l->device || op->type == ZB_OP_F || is_copy(op->type) || zb__runner_op_is_vocab(op->type))
    return ZB_OK; /* a vocabulary pass reads no stage's saved activations */
  const int32_t j = l->reload[(size_t)op->stage * (size_t)r->m + (size_t)op->mb];
  if (j < 0) return ZB_OK;
  char what[96];
  snprintf(what, sizeof what, "waiting for RELOAD(stage %d, mb %d)", (int)op->stage, (int)op->mb);
  return lane_wait(r, j + 1, what);
}

zb_status_t zb__copies_end(zb_runner_t *r) {
  zb__copylane_t *l = r->copies;
  if (!l) return ZB_OK;
  zb_status_t st = l->device ? ZB_OK : lane_wait(r, l->n, "after the last op, waiting for the copies");
  zb__copies_stop(r);
  return st;
}

void zb__copies_stop(zb_runner_t *r) {
  zb__copylane_t *l = r->copies;
  if (!l || !l->thread_up) return;
  pthread_mutex_lock(&l->mu);
  l->stop = 1;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  pthread_join(l->th, NULL); /* a copy under way finishes first: the callback is not interrupted */
  l->thread_up = 0;
}
