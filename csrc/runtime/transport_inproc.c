/*
 * transport_inproc.c - the in-process transport: ranks are threads of one process that share a
 * group, and a send copies its bytes into the receiver's mailbox at once.
 *
 * Sends never wait (the copy is the buffering), so any schedule the validator accepts runs without
 * deadlock. A receive waits on the group's condition variable for the first message from its peer
 * with its tag; FIFO per (sender, receiver, tag) follows from appending in send order. When any rank
 * aborts, the group is marked failed and every waiting or later call fails with ZB_ERR_REMOTE and
 * that rank's message, so no thread is left waiting for a partner that will never come.
 *
 * With a device backend (CUDA: several ranks on one GPU in the tests and benchmarks) the runner binds
 * its backend to the transport and messages travel in device memory: a send copies the buffer on
 * the sender's compute stream into a device buffer of its own and waits for that copy, a receive
 * copies it out on the receiver's compute stream and waits again. That is slow (two host waits per
 * message) but exact and simple, which is what a test transport needs. Undelivered device messages
 * are freed with the sender's backend, so destroy the group before the backends.
 *
 * What it is not: fast for large tensors (one allocation and copy per message) or cross-process.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

typedef struct msg {
  int32_t src, tag;
  size_t bytes;
  struct msg *next;
  zb_backend_t *dev_be; /* the sender's device backend when the bytes are in dev, else NULL */
  void *dev;
  unsigned char data[];
} msg_t;

static void msg_free(msg_t *m) {
  if (m->dev_be) m->dev_be->ops->release(m->dev_be, m->dev);
  free(m);
}

struct zb_inproc_group {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int32_t ranks;
  int members;           /* transports created on the group and not yet destroyed */
  unsigned char *joined; /* one flag per rank: a transport exists for it */
  int32_t *waiting_on;   /* per rank: the peer it is blocked receiving from, or -1 */
  msg_t **inbox_head, **inbox_tail; /* per receiving rank, in arrival order */
  int failed;
  int32_t failed_rank;
  char failed_msg[1024];
};

zb_status_t zb_inproc_group_create(zb_inproc_group_t **out, int32_t ranks) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  if (ranks < 1 || ranks > 65536)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "in-process group of %d ranks; allowed: 1..65536", (int)ranks);
  zb_inproc_group_t *g = calloc(1, sizeof(*g));
  if (g) {
    g->joined = calloc((size_t)ranks, 1);
    g->waiting_on = malloc((size_t)ranks * sizeof(int32_t));
    g->inbox_head = calloc((size_t)ranks, sizeof(msg_t *));
    g->inbox_tail = calloc((size_t)ranks, sizeof(msg_t *));
  }
  if (!g || !g->joined || !g->waiting_on || !g->inbox_head || !g->inbox_tail) {
    if (g) free(g->joined), free(g->waiting_on), free(g->inbox_head), free(g->inbox_tail);
    free(g);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating an in-process group of %d ranks", (int)ranks);
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  /* Timeouts are measured on the monotonic clock, so a wall-clock jump cannot fire or stall them. */
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&g->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&g->mu, NULL);
  g->ranks = ranks;
  for (int32_t r = 0; r < ranks; r++) g->waiting_on[r] = -1;
  *out = g;
  return ZB_OK;
}

zb_status_t zb_inproc_group_destroy(zb_inproc_group_t *g) {
  if (!g) return ZB_OK;
  pthread_mutex_lock(&g->mu);
  int members = g->members;
  pthread_mutex_unlock(&g->mu);
  if (members > 0)
    return ZB_FAIL(ZB_ERR_BUSY, "the in-process group still has %d transport(s); destroy them first", members);
  for (int32_t r = 0; r < g->ranks; r++) {
    msg_t *m = g->inbox_head[r];
    while (m) {
      msg_t *next = m->next;
      msg_free(m);
      m = next;
    }
  }
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
  free(g->joined), free(g->waiting_on), free(g->inbox_head), free(g->inbox_tail);
  free(g);
  return ZB_OK;
}

static zb_status_t remote_failure(const zb_inproc_group_t *g, int32_t me) {
  return ZB_FAIL(ZB_ERR_REMOTE, "rank %d failed: %s", (int)g->failed_rank, g->failed_msg);
}

/* A timeout names the peer; when that peer is itself blocked on another rank, the chain of waits
 * says who is really silent (all ranks are visible here, unlike across processes). */
static zb_status_t timeout_error(const zb_inproc_group_t *g, int32_t peer, int32_t tag, double timeout_s) {
  char chain[512] = "";
  size_t len = 0;
  int32_t x = peer;
  for (int32_t hops = 0; hops < g->ranks && g->waiting_on[x] >= 0; hops++) {
    int n = snprintf(chain + len, sizeof chain - len, "%s rank %d is waiting for rank %d",
                     hops ? ";" : " (", (int)x, (int)g->waiting_on[x]);
    if (n < 0 || (size_t)n >= sizeof chain - len) break;
    len += (size_t)n;
    x = g->waiting_on[x];
    if (x == peer) break;
  }
  if (len > 0)
    snprintf(chain + len, sizeof chain - len, "; rank %d %s)", (int)x,
             g->joined[x] ? "is not waiting on anyone: it is busy or stuck" : "never joined the group");
  else if (!g->joined[peer])
    snprintf(chain, sizeof chain, " (rank %d never joined the group)", (int)peer);
  return ZB_FAIL(ZB_ERR_TIMEOUT, "nothing from rank %d on channel %d within %.3g s%s", (int)peer,
                 (int)tag, timeout_s, chain);
}

static zb_status_t inproc_isend(zb_transport_t *t, zb__request_t *req) {
  zb_inproc_group_t *g = t->impl;
  zb_backend_t *be = t->be && t->be->ops->device_memory ? t->be : NULL;
  msg_t *m = malloc(sizeof(msg_t) + (!be && req->bytes ? req->bytes : 1));
  if (!m) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory buffering %zu bytes for rank %d", req->bytes, (int)req->peer);
  m->src = t->rank, m->tag = req->tag, m->bytes = req->bytes, m->next = NULL;
  m->dev_be = NULL, m->dev = NULL;
  if (be && req->bytes) {
    zb_status_t st = be->ops->alloc(be, req->bytes, &m->dev);
    if (st == ZB_OK) {
      m->dev_be = be;
      st = be->ops->copy(be, m->dev, req->buf, req->bytes);
    }
    if (st == ZB_OK) st = be->ops->sync(be);
    if (st != ZB_OK) {
      msg_free(m);
      return st;
    }
  } else if (req->bytes) {
    memcpy(m->data, req->buf, req->bytes);
  }
  pthread_mutex_lock(&g->mu);
  if (g->failed) {
    zb_status_t st = remote_failure(g, t->rank);
    pthread_mutex_unlock(&g->mu);
    msg_free(m);
    return st;
  }
  int32_t d = req->peer;
  if (g->inbox_tail[d]) g->inbox_tail[d]->next = m;
  else g->inbox_head[d] = m;
  g->inbox_tail[d] = m;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  return ZB_OK;
}

static zb_status_t inproc_irecv(zb_transport_t *t, zb__request_t *req) { return ZB_OK; }

/* Removes and returns the first message in `me`'s inbox from src with tag, or NULL. */
static msg_t *take(zb_inproc_group_t *g, int32_t me, int32_t src, int32_t tag) {
  msg_t *prev = NULL, *m = g->inbox_head[me];
  while (m && !(m->src == src && m->tag == tag)) prev = m, m = m->next;
  if (!m) return NULL;
  if (prev) prev->next = m->next;
  else g->inbox_head[me] = m->next;
  if (g->inbox_tail[me] == m) g->inbox_tail[me] = prev;
  return m;
}

static zb_status_t inproc_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  if (req->is_send) return ZB_OK; /* copied when started */
  zb_inproc_group_t *g = t->impl;
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  double whole = (double)(long long)timeout_s;
  deadline.tv_sec += (time_t)whole;
  deadline.tv_nsec += (long)((timeout_s - whole) * 1e9);
  if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;

  pthread_mutex_lock(&g->mu);
  zb_status_t st = ZB_OK;
  g->waiting_on[t->rank] = req->peer;
  /* After the deadline passes, look once more: the message may have come with the timeout. */
  for (int last = 0;;) {
    msg_t *m = take(g, t->rank, req->peer, req->tag);
    if (m) {
      if (m->bytes != req->bytes) {
        st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "rank %d received %zu bytes from rank %d on channel %d but expected %zu; the "
                     "ranks disagree about the activation size",
                     (int)t->rank, m->bytes, (int)req->peer, (int)req->tag, req->bytes);
      } else if (m->bytes && m->dev_be) {
        /* Device to device on the receiver's stream; the host waits so the message can go. */
        st = t->be ? t->be->ops->copy(t->be, req->buf, m->dev, m->bytes)
                   : ZB_FAIL(ZB_ERR_UNSUPPORTED, "rank %d received device memory but has no device backend",
                             (int)t->rank);
        if (st == ZB_OK) st = t->be->ops->sync(t->be);
      } else if (m->bytes && t->be && t->be->ops->device_memory) {
        st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "rank %d runs on the %s backend but rank %d sent host memory; every rank of an "
                     "in-process group needs the same kind of backend",
                     (int)t->rank, t->be->ops->name, (int)req->peer);
      } else if (m->bytes) {
        memcpy(req->buf, m->data, m->bytes);
      }
      msg_free(m);
      break;
    }
    if (g->failed) {
      st = remote_failure(g, t->rank);
      break;
    }
    if (last || timeout_s <= 0) {
      st = timeout_s > 0 ? timeout_error(g, req->peer, req->tag, timeout_s) : ZB_ERR_TIMEOUT;
      break;
    }
    if (pthread_cond_timedwait(&g->cv, &g->mu, &deadline) == ETIMEDOUT) last = 1;
  }
  /* A rank that timed out stays marked as waiting on its peer until its next wait: it is about to
   * abort, and a rank timing out on it meanwhile must still see whom the chain is stuck on. */
  if (!(st == ZB_ERR_TIMEOUT && timeout_s > 0)) g->waiting_on[t->rank] = -1;
  pthread_mutex_unlock(&g->mu);
  return st;
}

static void inproc_cancel(zb_transport_t *t, zb__request_t *req) {}

static void inproc_abort(zb_transport_t *t, const char *reason) {
  zb_inproc_group_t *g = t->impl;
  pthread_mutex_lock(&g->mu);
  if (!g->failed) {
    g->failed = 1;
    g->failed_rank = t->rank;
    snprintf(g->failed_msg, sizeof g->failed_msg, "%s", reason);
  }
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static void inproc_destroy(zb_transport_t *t) {
  zb_inproc_group_t *g = t->impl;
  pthread_mutex_lock(&g->mu);
  g->members--;
  g->joined[t->rank] = 0;
  pthread_mutex_unlock(&g->mu);
  free(t);
}

static const zb__transport_ops_t inproc_ops = {
    .name = "in-process",
    .isend = inproc_isend,
    .irecv = inproc_irecv,
    .wait = inproc_wait,
    .cancel = inproc_cancel,
    .abort = inproc_abort,
    .destroy = inproc_destroy,
    .memory = ZB__TRANSPORT_ANY_MEMORY,
};

zb_status_t zb_transport_create_inproc(zb_transport_t **out, zb_inproc_group_t *g, int32_t rank) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(g);
  if (rank < 0 || rank >= g->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank %d is outside the group's ranks 0..%d", (int)rank,
                   (int)g->ranks - 1);
  zb_transport_t *t = calloc(1, sizeof(*t));
  if (!t) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a transport");
  pthread_mutex_lock(&g->mu);
  if (g->joined[rank]) {
    pthread_mutex_unlock(&g->mu);
    free(t);
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank %d already has a transport in this group", (int)rank);
  }
  g->joined[rank] = 1;
  g->members++;
  pthread_mutex_unlock(&g->mu);
  t->ops = &inproc_ops;
  t->rank = rank;
  t->ranks = g->ranks;
  t->impl = g;
  *out = t;
  return ZB_OK;
}
