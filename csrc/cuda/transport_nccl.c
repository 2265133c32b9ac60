/*
 * transport_nccl.c - the NCCL transport: the runner's channels between GPUs of different processes.
 *
 * One communicator per pair of ranks that exchange data (not per channel): a rank has one or two
 * (its neighbours), split from one parent with splitShare, non-blocking, each with a stream of its
 * own. NCCL runs a communicator's operations one after another on both ends, and the pair's
 * traffic (activations one way, gradients the other, and under V or interleaved placement the
 * channels of several boundaries) shares that queue, so both ranks issue it in one order derived
 * from the schedule (csrc/runtime/pairorder.c, which says why it cannot deadlock). The runner posts
 * in its own order (receives ahead, sends after each op); a request whose turn has not come waits
 * here, on the host, and goes out, grouped with the ones after it that are ready, when the ones
 * before it have been posted.
 *
 * Ordering is on the device (DESIGN.md section 4): when a request is posted, an event on the
 * compute stream marks the work its data (a send) or its buffer (a receive) depends on, and the
 * pair's stream waits for it before the NCCL call; waiting for a receive makes the compute stream
 * wait for the receive's done event and returns at once. The host blocks only for sends to finish.
 *
 * The watchdog thread owns failure: it polls ncclCommGetAsyncError, the age of each pair's oldest
 * unfinished transfer, and the job's abort signal (zb_abort_signal_t). A transfer's clock starts
 * when it is at the head of its pair's queue and ready on the device: a send once the work that
 * produces its data is done, a receive once the compute stream reaches the op that needs it. So
 * timeout_s bounds a stall on one transfer, however far the host ran ahead. No lock is held across
 * a CUDA or NCCL call (the watchdog snapshots under the lock and queries outside it), so it fires
 * even while the host is blocked inside an enqueue. On failure it aborts the communicators
 * (ncclCommAbort: stuck kernels return, the streams drain), publishes the message on the abort
 * signal so every rank fails within a second, and the runner fails with the message, which names
 * the peer and the channel. The failure is sticky: make a new transport to go on.
 *
 * Every CUDA runtime and NCCL call goes through a table (zb__cudart_t, zb__nccl_state_t), so the host
 * tests drive all of this against a fake device (tests/c/test_transport_nccl.c). Creation (the
 * communicators, their connections, the watchdog's start) is transport_nccl_setup.c's.
 *
 * What it is not: a general NCCL wrapper. It carries the runner's channels only (device memory);
 * the optimizer's and post-validation's host-memory exchange goes over a host transport.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl.h"

/* A posted zero-byte message: it takes its place in the order but nothing moves. */
static zb__nccl_req_t zero_bytes;

/* "the activations of boundary 2 (stage 2 -> 3)" */
static void describe_tag(int32_t tag, char *buf, size_t cap) {
  int32_t b = tag / 2;
  if (tag % 2 == 0)
    snprintf(buf, cap, "the activations of boundary %d (stage %d -> %d)", (int)b, (int)b, (int)b + 1);
  else
    snprintf(buf, cap, "the gradients of boundary %d (stage %d -> %d)", (int)b, (int)b + 1, (int)b);
}

zb_status_t zb__nccl_enter(const zb__nccl_state_t *n) {
  int cur = -1;
  cudaError_t e = n->rt->GetDevice(&cur);
  if (e == cudaSuccess && cur != n->cu->device) e = n->rt->SetDevice(n->cu->device);
  return e == cudaSuccess ? ZB_OK : RT_FAIL(n, e, "cudaSetDevice");
}

/* ---- failure --------------------------------------------------------------------------------- */

static zb_status_t failure_locked(const zb__nccl_state_t *n) { return ZB_FAIL(n->fail_status, "%s", n->fail_msg); }

/* Marks the transport failed (the first failure is the one kept) and wakes the watchdog, which
 * aborts the communicators. A failure of this rank's own (publish = 1) goes out on the abort
 * signal, after the lock is dropped. */
static void fail(zb__nccl_state_t *n, zb_status_t status, const char *msg, int publish) {
  pthread_mutex_lock(&n->mu);
  int first = !n->failed;
  if (first) {
    n->failed = 1;
    n->fail_status = status;
    snprintf(n->fail_msg, sizeof n->fail_msg, "%s", msg);
    pthread_cond_broadcast(&n->cv);
  }
  pthread_mutex_unlock(&n->mu);
  if (first && publish && n->signal.publish) n->signal.publish(n->signal.user, msg);
}

/* Aborts every communicator once (no lock held while NCCL aborts). ncclCommAbort makes kernels
 * waiting on a peer return, and an enqueue blocked on a full launch queue come back. NCCL does not
 * allow a communicator to be used by two threads at once, so the abort first waits for the other
 * thread (the runner's enqueues, or the watchdog's error polls) to leave its NCCL calls (it sees
 * `failed` and stops within microseconds); only a host stuck inside an enqueue for a second is
 * aborted under its feet, the one way to free it. */
void zb__nccl_abort_comms(zb__nccl_state_t *n) {
  ncclComm_t comms[64];
  int k = 0;
  pthread_mutex_lock(&n->mu);
  if (!n->aborted) {
    n->aborted = 1;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += 1;
    while (n->inuse > 0 && pthread_cond_timedwait(&n->cv, &n->mu, &until) != ETIMEDOUT) {
    }
    for (int i = 0; i < n->n_pairs && k < 64; i++)
      if (n->pairs[i].comm) comms[k++] = n->pairs[i].comm;
  }
  pthread_mutex_unlock(&n->mu);
  for (int i = 0; i < k; i++) n->nc->CommAbort(comms[i]);
  pthread_mutex_lock(&n->mu);
  for (int i = 0; i < n->n_pairs; i++) n->pairs[i].comm = NULL;
  pthread_mutex_unlock(&n->mu);
}

/* ---- the watchdog ---------------------------------------------------------------------------- */

typedef struct {
  zb__nccl_req_t *q;
  uint64_t gen;
  int is_send, needed, tag;
  size_t bytes;
  ncclComm_t comm;
} snap_t;

static void watch_once(zb_transport_t *t, snap_t *snap) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  char what[128], msg[1024];
  /* 1. Under the lock: each pair's oldest unfinished transfer and its communicator, held in use
   * (the runner's abort may free the communicators, and waits for this). */
  pthread_mutex_lock(&n->mu);
  const int use = !n->failed && !n->aborted;
  if (use) n->inuse++;
  for (int i = 0; i < n->n_pairs; i++) {
    snap[i].q = NULL;
    snap[i].comm = use ? n->pairs[i].comm : NULL;
  }
  for (zb__nccl_req_t *q = n->inflight; q; q = q->next)
    if (!q->finished && !snap[q->pair].q) {
      snap[q->pair].q = q, snap[q->pair].gen = q->gen;
      snap[q->pair].is_send = q->is_send, snap[q->pair].needed = q->needed;
      snap[q->pair].tag = q->tag, snap[q->pair].bytes = q->bytes;
    }
  pthread_mutex_unlock(&n->mu);

  /* 2. Without it: NCCL's asynchronous errors, then the device's progress. */
  for (int i = 0; i < n->n_pairs; i++) {
    ncclResult_t e = ncclSuccess;
    if (snap[i].comm && n->nc->CommGetAsyncError(snap[i].comm, &e) == ncclSuccess && e != ncclSuccess &&
        e != ncclInProgress) {
      snprintf(msg, sizeof msg, "rank %d: NCCL reported %s on the communicator with rank %d", (int)t->rank,
               n->nc->GetErrorString(e), (int)n->pairs[i].peer);
      fail(n, e == ncclRemoteError ? ZB_ERR_REMOTE : ZB_ERR_NCCL, msg, 1);
    }
  }
  if (use) {
    pthread_mutex_lock(&n->mu);
    n->inuse--;
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
  }
  for (int i = 0; i < n->n_pairs; i++) {
    zb__nccl_req_t *q = snap[i].q;
    if (!q) continue;
    int done = n->rt->EventQuery(q->done) == cudaSuccess;
    int ready = !done && n->rt->EventQuery(snap[i].is_send ? q->ready : q->need) == cudaSuccess;
    if (!snap[i].is_send && !snap[i].needed) ready = 0; /* nothing waits for it yet */
    double now = zb__now();
    int late = 0;
    pthread_mutex_lock(&n->mu);
    if (q->gen == snap[i].gen) {
      if (done) q->finished = 1;
      else if (ready && q->clock == 0) q->clock = now;
      else if (ready && now - q->clock > n->timeout) late = 1;
    }
    pthread_mutex_unlock(&n->mu);
    if (late) {
      const snap_t *sn = &snap[i]; /* q may be reused by now: its fields as they were */
      describe_tag(sn->tag, what, sizeof what);
      snprintf(msg, sizeof msg,
               "rank %d: the %s of %zu bytes %s rank %d (%s) has not finished within %.3g s of %s; rank %d is "
               "dead, stuck or behind (the watchdog aborted the NCCL communicators)",
               (int)t->rank, sn->is_send ? "send" : "receive", sn->bytes, sn->is_send ? "to" : "from",
               (int)n->pairs[i].peer, what, n->timeout,
               sn->is_send ? "its data being ready" : "the compute stream needing it", (int)n->pairs[i].peer);
      fail(n, ZB_ERR_TIMEOUT, msg, 1);
    }
  }
}

void *zb__nccl_watchdog_main(void *arg) {
  zb_transport_t *t = arg;
  zb__nccl_state_t *n = zb__nccl_of(t);
  /* Event queries need the backend's device current on this thread too. */
  zb__nccl_enter(n);
  snap_t *snap = calloc((size_t)(n->n_pairs ? n->n_pairs : 1), sizeof *snap);
  char msg[1024];
  int tick = 0;
  for (;;) {
    pthread_mutex_lock(&n->mu);
    int stop = n->stop, failed = n->failed, aborted = n->aborted;
    pthread_mutex_unlock(&n->mu);
    if (stop) break;
    if (failed && !aborted) zb__nccl_abort_comms(n);
    if (!failed && snap) watch_once(t, snap);
    /* The job's abort signal, every 0.2 s: another rank's failure fails this one within a second. */
    if (!failed && n->signal.poll && tick++ % 10 == 0) {
      msg[0] = 0;
      if (n->signal.poll(n->signal.user, msg, sizeof msg)) fail(n, ZB_ERR_REMOTE, msg[0] ? msg : "another rank failed", 0);
    }
    pthread_mutex_lock(&n->mu);
    if (!n->stop && !(n->failed && !n->aborted)) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      ts.tv_nsec += 20 * 1000 * 1000; /* 20 ms: cheap, and far below any sensible timeout */
      if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
      pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    }
    pthread_mutex_unlock(&n->mu);
  }
  free(snap);
  return NULL;
}

/* ---- requests -------------------------------------------------------------------------------- */

/* Moves finished, released requests to the free list. Runner thread only: it is the one thread
 * that changes the lists' shape, so it may walk them and query events without the lock. */
static void reclaim(zb__nccl_state_t *n) {
  for (zb__nccl_req_t *q = n->inflight; q; q = q->next)
    if (!q->finished && q->released && n->rt->EventQuery(q->done) == cudaSuccess) {
      pthread_mutex_lock(&n->mu);
      q->finished = 1;
      pthread_mutex_unlock(&n->mu);
    }
  pthread_mutex_lock(&n->mu);
  zb__nccl_req_t **pp = &n->inflight, *prev = NULL;
  while (*pp) {
    zb__nccl_req_t *q = *pp;
    if (q->released && (q->finished || n->aborted)) {
      *pp = q->next;
      q->state = REQ_FREE;
      q->next = n->free_list;
      n->free_list = q;
    } else {
      prev = q;
      pp = &q->next;
    }
  }
  n->inflight_tail = prev;
  pthread_mutex_unlock(&n->mu);
}

/* A new request with its three events. */
static zb_status_t make_req(zb__nccl_state_t *n, zb__nccl_req_t **out) {
  zb__nccl_req_t *q = calloc(1, sizeof *q);
  if (!q) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for an NCCL request");
  cudaError_t e = n->rt->EventCreateWithFlags(&q->ready, cudaEventDisableTiming);
  if (e == cudaSuccess) {
    e = n->rt->EventCreateWithFlags(&q->need, cudaEventDisableTiming);
    if (e != cudaSuccess) n->rt->EventDestroy(q->ready);
  }
  if (e == cudaSuccess) {
    e = n->rt->EventCreateWithFlags(&q->done, cudaEventDisableTiming);
    if (e != cudaSuccess) n->rt->EventDestroy(q->ready), n->rt->EventDestroy(q->need);
  }
  if (e != cudaSuccess) {
    free(q);
    return RT_FAIL(n, e, "cudaEventCreateWithFlags");
  }
  pthread_mutex_lock(&n->mu);
  n->n_reqs++;
  pthread_mutex_unlock(&n->mu);
  *out = q;
  return ZB_OK;
}

static zb_status_t get_req(zb__nccl_state_t *n, zb__nccl_req_t **out) {
  /* Each post reclaims: the in-flight list then holds only transfers still out (a few per
   * channel), which keeps this cheap and the watchdog's oldest-per-pair current. */
  reclaim(n);
  pthread_mutex_lock(&n->mu);
  zb__nccl_req_t *q = n->free_list;
  if (q) n->free_list = q->next;
  pthread_mutex_unlock(&n->mu);
  /* nccl_plan made one per message of an iteration, and an iteration ends with all of them
   * finished, so this only allocates if a caller posts beyond the schedule. */
  if (!q) ZB_CHECK(make_req(n, &q));
  pthread_mutex_lock(&n->mu);
  q->gen++;
  q->next = NULL;
  q->needed = q->released = q->finished = 0;
  q->clock = 0;
  pthread_mutex_unlock(&n->mu);
  *out = q;
  return ZB_OK;
}

static void put_free(zb__nccl_state_t *n, zb__nccl_req_t *q) {
  pthread_mutex_lock(&n->mu);
  q->state = REQ_FREE;
  q->next = n->free_list;
  n->free_list = q;
  pthread_mutex_unlock(&n->mu);
}

/* A posted request that will never be issued (after a failure): out of the order, back to the free
 * list. */
static void drop_posted(zb__nccl_state_t *n, zb__nccl_req_t *q) {
  zb__nccl_pair_t *pr = &n->pairs[q->pair];
  for (int32_t i = 0; i < pr->length; i++)
    if (pr->slot[i] == q) pr->slot[i] = NULL;
  put_free(n, q);
}

/* Waits out ncclInProgress on a non-blocking communicator (no lock held); fails when the watchdog
 * has failed the transport meanwhile. */
static zb_status_t settle(zb__nccl_state_t *n, ncclComm_t comm, ncclResult_t r, const char *what) {
  while (r == ncclInProgress) {
    struct timespec nap = {0, 20 * 1000};
    nanosleep(&nap, NULL);
    pthread_mutex_lock(&n->mu);
    int failed = n->failed; /* then the watchdog is about to abort: touch the communicator no more */
    pthread_mutex_unlock(&n->mu);
    if (failed) break;
    if (n->nc->CommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  if (r == ncclSuccess) return ZB_OK;
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
  pthread_mutex_unlock(&n->mu);
  if (st != ZB_OK) return st;
  if (r == ncclInProgress) return ZB_FAIL(ZB_ERR_NCCL, "%s: NCCL did not finish enqueueing", what);
  return ZB_FAIL(ZB_ERR_NCCL, "%s failed: %s%s%s", what, n->nc->GetErrorString(r), n->nc->GetLastError ? ": " : "",
                 n->nc->GetLastError ? n->nc->GetLastError(comm) : "");
}

/* Issues the pair's requests whose turn has come, in one NCCL group. Runner thread only. */
static zb_status_t issue_ready(zb_transport_t *t, int pi) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  zb__nccl_pair_t *pr = &n->pairs[pi];
  for (;;) {
    while (pr->next < pr->length && pr->slot[pr->next] == &zero_bytes) pr->slot[pr->next++] = NULL;
    zb__nccl_req_t *batch[32];
    int nb = 0;
    int32_t at = pr->next;
    while (nb < 32 && at < pr->length && pr->slot[at] && pr->slot[at] != &zero_bytes) batch[nb++] = pr->slot[at++];
    if (nb == 0) break;

    pthread_mutex_lock(&n->mu);
    zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
    ncclComm_t comm = pr->comm;
    if (st == ZB_OK) n->inuse++;
    pthread_mutex_unlock(&n->mu);
    if (st != ZB_OK) return st;

    char what[160], tagtxt[128];
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < nb && e == cudaSuccess; i++) e = n->rt->StreamWaitEvent(pr->stream, batch[i]->ready, 0);
    if (e != cudaSuccess) {
      st = RT_FAIL(n, e, "ordering an NCCL transfer after the compute stream");
    } else {
      ncclResult_t r = n->nc->GroupStart();
      for (int i = 0; i < nb && (r == ncclSuccess || r == ncclInProgress); i++) {
        zb__nccl_req_t *q = batch[i];
        r = q->is_send ? n->nc->Send(q->buf, q->bytes, ncclUint8, pr->peer_local, comm, pr->stream)
                       : n->nc->Recv(q->buf, q->bytes, ncclUint8, pr->peer_local, comm, pr->stream);
        if (r != ncclSuccess && r != ncclInProgress) {
          describe_tag(q->tag, tagtxt, sizeof tagtxt);
          snprintf(what, sizeof what, "rank %d: %s rank %d (%s)", (int)t->rank, q->is_send ? "ncclSend to" : "ncclRecv from",
                   (int)pr->peer, tagtxt);
        }
      }
      if (r != ncclSuccess && r != ncclInProgress) {
        n->nc->GroupEnd();
        st = settle(n, comm, r, what);
      } else {
        snprintf(what, sizeof what, "rank %d: ncclGroupEnd of %d transfer(s) with rank %d", (int)t->rank, nb, (int)pr->peer);
        st = settle(n, comm, n->nc->GroupEnd(), what);
      }
      for (int i = 0; i < nb && st == ZB_OK; i++)
        if ((e = n->rt->EventRecord(batch[i]->done, pr->stream)) != cudaSuccess)
          st = RT_FAIL(n, e, "cudaEventRecord after an NCCL transfer");
    }

    pthread_mutex_lock(&n->mu);
    n->inuse--;
    pthread_cond_broadcast(&n->cv); /* an abort may be waiting for this */
    pthread_mutex_unlock(&n->mu);
    if (st != ZB_OK) {
      /* Part of the group may be out: the pair's order is broken for good. */
      fail(n, st, zb__error_body(), 1);
      return st;
    }
    pthread_mutex_lock(&n->mu);
    if (st == ZB_OK)
      for (int i = 0; i < nb; i++) {
        zb__nccl_req_t *q = batch[i];
        q->state = REQ_ISSUED;
        q->next = NULL;
        if (n->inflight_tail) n->inflight_tail->next = q;
        else n->inflight = q;
        n->inflight_tail = q;
        pr->slot[pr->next++] = NULL;
      }
    pthread_mutex_unlock(&n->mu);
    if (st != ZB_OK) return st;
  }
  if (pr->next == pr->length) pr->next = 0; /* the iteration's transfers are all out */
  return ZB_OK;
}

static zb_status_t nccl_start(zb_transport_t *t, zb__request_t *req) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  char what[128];
  req->handle = NULL;
  const zb__pair_chan_t *c = req->tag >= 0 && req->tag < n->order.n_tags ? &n->order.chans[req->tag] : NULL;
  if (!c || c->pair < 0 || c->peer != req->peer || c->is_send != req->is_send) {
    describe_tag(req->tag, what, sizeof what);
    return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                   "rank %d: the NCCL transport carries only the schedule's channels between ranks, "
                   "and a %s %s rank %d on channel %d is not one of them (zb_optimizer and zb_postval "
                   "need a host transport)",
                   (int)t->rank, req->is_send ? "send" : "receive", req->is_send ? "to" : "from",
                   (int)req->peer, (int)req->tag);
  }
  zb__nccl_pair_t *pr = &n->pairs[c->pair];
  int32_t k = n->posted[req->tag];
  int32_t seq = c->seq[k];
  if (pr->slot[seq] || seq < pr->next)
    return ZB_FAIL(ZB_ERR_INTERNAL, "rank %d: message %d of channel %d came before the previous iteration's were out",
                   (int)t->rank, (int)k, (int)req->tag);
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
  pthread_mutex_unlock(&n->mu);
  if (st != ZB_OK) return st;
  ZB_CHECK(zb__nccl_enter(n));
  if (req->bytes == 0) {
    /* Both ends know the size: nothing moves, but the place in the order is taken. */
    pr->slot[seq] = &zero_bytes;
  } else {
    zb__nccl_req_t *q = NULL;
    ZB_CHECK(get_req(n, &q));
    q->pair = c->pair, q->tag = req->tag, q->is_send = req->is_send, q->buf = req->buf, q->bytes = req->bytes;
    /* Now, not at issue time: the compute work issued so far is exactly what the data (a send)
     * or the buffer's earlier readers (a receive) need; later work may wait on this transfer. */
    cudaError_t e = n->rt->EventRecord(q->ready, n->cu->compute);
    if (e != cudaSuccess) {
      put_free(n, q);
      return RT_FAIL(n, e, "cudaEventRecord on the compute stream");
    }
    q->state = REQ_POSTED;
    pr->slot[seq] = q;
    req->handle = q;
  }
  n->posted[req->tag] = k + 1 == c->count ? 0 : k + 1;
  return issue_ready(t, c->pair);
}

/* A request the runner now blocks on must be out; if its turn has not come the runner waited out
 * of the order pairorder.c assumes (a bug, not a hang: say so). */
static zb_status_t must_be_issued(zb_transport_t *t, zb__nccl_req_t *q) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  if (q->state == REQ_ISSUED) return ZB_OK;
  ZB_CHECK(issue_ready(t, q->pair));
  if (q->state == REQ_ISSUED) return ZB_OK;
  char what[128];
  describe_tag(q->tag, what, sizeof what);
  return ZB_FAIL(ZB_ERR_INTERNAL,
                 "rank %d: the %s rank %d (%s) is waited for before transfers that come earlier in the "
                 "pair's order were posted (ops run as pairs are not supported by the NCCL transport)",
                 (int)t->rank, q->is_send ? "send to" : "receive from", (int)n->pairs[q->pair].peer, what);
}

static zb_status_t nccl_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  zb__nccl_req_t *q = req->handle;
  if (!q) return ZB_OK;
  ZB_CHECK(zb__nccl_enter(n));
  if (!req->is_send) {
    zb_status_t st = must_be_issued(t, q);
    /* The device waits, not the host: compute work issued from now on sees the data. `need`
     * starts the watchdog's clock when the compute stream gets here. */
    cudaError_t e = cudaSuccess;
    if (st == ZB_OK && (e = n->rt->EventRecord(q->need, n->cu->compute)) == cudaSuccess)
      e = n->rt->StreamWaitEvent(n->cu->compute, q->done, 0);
    if (st == ZB_OK && e != cudaSuccess) st = RT_FAIL(n, e, "making the compute stream wait for a receive");
    pthread_mutex_lock(&n->mu);
    if (st == ZB_OK && n->failed) st = failure_locked(n);
    q->needed = st == ZB_OK;
    q->released = 1;
    pthread_mutex_unlock(&n->mu);
    if (st != ZB_OK && q->state == REQ_POSTED) drop_posted(n, q);
    return st;
  }
  if (q->state != REQ_ISSUED) {
    if (timeout_s <= 0) {
      ZB_CHECK(issue_ready(t, q->pair));
      if (q->state != REQ_ISSUED) return ZB_ERR_TIMEOUT; /* a poll: not out yet */
    } else {
      zb_status_t st = must_be_issued(t, q);
      if (st != ZB_OK) {
        drop_posted(n, q);
        return st;
      }
    }
  }
  /* The watchdog bounds how long the send may take once ready; this loop only watches. */
  for (;;) {
    cudaError_t e = n->rt->EventQuery(q->done);
    pthread_mutex_lock(&n->mu);
    zb_status_t st = ZB_OK;
    int over = 1;
    if (n->failed) {
      /* First: after ncclCommAbort, the transfers "finish" without having moved anything. */
      st = failure_locked(n);
      q->released = 1;
    } else if (e == cudaSuccess) {
      q->finished = q->released = 1;
    } else if (e != cudaErrorNotReady) {
      st = RT_FAIL(n, e, "waiting for an NCCL send");
      q->released = 1;
    } else if (timeout_s <= 0) {
      st = ZB_ERR_TIMEOUT; /* a poll: still in flight, the runner keeps the request */
    } else {
      over = 0;
    }
    pthread_mutex_unlock(&n->mu);
    if (over) return st;
    struct timespec nap = {0, 50 * 1000}; /* 50 us: a send finishes within microseconds of its peer */
    nanosleep(&nap, NULL);
  }
}

static void nccl_cancel(zb_transport_t *t, zb__request_t *req) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  zb__nccl_req_t *q = req->handle;
  if (!q) return;
  if (q->state == REQ_POSTED) {
    drop_posted(n, q);
    return;
  }
  pthread_mutex_lock(&n->mu);
  q->released = 1;
  pthread_mutex_unlock(&n->mu);
}

/* The runner's abort, before it gives its buffers back: fail, abort the communicators now (not at
 * the watchdog's next look), and wait a bounded time for the transfers in flight to come out of
 * their kernels, so no NCCL kernel still reads a buffer the caller is about to reuse. */
static void nccl_abort(zb_transport_t *t, const char *reason) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  char msg[1024];
  snprintf(msg, sizeof msg, "rank %d aborted: %s", (int)t->rank, reason);
  fail(n, ZB_ERR_REMOTE, msg, 1);
  zb__nccl_abort_comms(n);
  double until = zb__now() + 2.0;
  for (zb__nccl_req_t *q = n->inflight; q; q = q->next) /* the runner thread's: the list is its */
    while (!q->finished && n->rt->EventQuery(q->done) == cudaErrorNotReady && zb__now() < until) {
      struct timespec nap = {0, 200 * 1000};
      nanosleep(&nap, NULL);
    }
}

static zb_status_t nccl_check(zb_transport_t *t) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
  pthread_mutex_unlock(&n->mu);
  return st;
}

/* The order for a schedule (the one at creation, then each runner's). Its pairs must be ones this
 * transport has a communicator for. Between iterations only. */
zb_status_t zb__nccl_plan(zb_transport_t *t, const zb_schedule_t *s) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  for (int i = 0; i < n->n_pairs; i++)
    for (int32_t k = 0; k < n->pairs[i].length; k++)
      if (n->pairs[i].slot[k])
        return ZB_FAIL(ZB_ERR_BUSY, "rank %d: the NCCL transport has transfers of an unfinished iteration", (int)t->rank);
  zb__pair_order_t o;
  ZB_CHECK(zb__pair_order_make(s, t->rank, &o));
  zb_status_t st = ZB_OK;
  zb__nccl_req_t ***slots = calloc((size_t)(o.n_pairs ? o.n_pairs : 1), sizeof *slots);
  int32_t *posted = calloc((size_t)(o.n_tags ? o.n_tags : 1), sizeof *posted);
  int *which = calloc((size_t)(o.n_pairs ? o.n_pairs : 1), sizeof *which);
  if (!slots || !posted || !which) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the NCCL transport's order");
  for (int32_t j = 0; j < o.n_pairs && st == ZB_OK; j++) {
    int i = 0;
    while (i < n->n_pairs && n->pairs[i].peer != o.pairs[j].peer) i++;
    if (i == n->n_pairs)
      st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "rank %d: the schedule exchanges data between ranks %d and %d, but this NCCL transport was "
                   "made for a schedule without that pair (make a transport for this schedule)",
                   (int)t->rank, (int)t->rank, (int)o.pairs[j].peer);
    else if (!(slots[j] = calloc((size_t)(o.pairs[j].length ? o.pairs[j].length : 1), sizeof **slots)))
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the NCCL transport's order");
    which[j] = i;
  }
  if (st == ZB_OK) {
    /* Re-index the channels by this transport's pairs. */
    for (int32_t tag = 0; tag < o.n_tags; tag++)
      if (o.chans[tag].pair >= 0) o.chans[tag].pair = which[o.chans[tag].pair];
    for (int i = 0; i < n->n_pairs; i++) {
      free(n->pairs[i].slot);
      n->pairs[i].slot = NULL, n->pairs[i].length = 0, n->pairs[i].next = 0;
    }
    for (int32_t j = 0; j < o.n_pairs; j++) {
      n->pairs[which[j]].slot = slots[j];
      n->pairs[which[j]].length = o.pairs[j].length;
      slots[j] = NULL;
    }
    zb__pair_order_free(&n->order);
    free(n->posted);
    n->order = o, n->posted = posted;
    posted = NULL;
    /* Every request an iteration can have out at once (all its messages, at most), made now:
     * nothing is created inside an iteration. */
    int want = 0;
    for (int i = 0; i < n->n_pairs; i++) want += n->pairs[i].length;
    st = zb__nccl_enter(n);
    while (n->n_reqs < want && st == ZB_OK) {
      zb__nccl_req_t *q = NULL;
      st = make_req(n, &q);
      if (st == ZB_OK) put_free(n, q);
    }
  } else {
    for (int32_t j = 0; slots && j < o.n_pairs; j++) free(slots[j]); /* before the order forgets n_pairs */
    zb__pair_order_free(&o);
  }
  free(slots), free(posted), free(which);
  return st;
}

static void free_reqs(zb__nccl_state_t *n, zb__nccl_req_t *q) {
  while (q) {
    zb__nccl_req_t *next = q->next;
    n->rt->EventDestroy(q->ready);
    n->rt->EventDestroy(q->need);
    n->rt->EventDestroy(q->done);
    free(q);
    q = next;
  }
}

void zb__nccl_destroy(zb_transport_t *t) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  if (n) {
    if (n->watchdog_started) {
      pthread_mutex_lock(&n->mu);
      n->stop = 1;
      pthread_cond_broadcast(&n->cv);
      pthread_mutex_unlock(&n->mu);
      pthread_join(n->watchdog, NULL);
    }
    zb__nccl_enter(n);
    /* Work still in flight (a destroy after a failure) would keep kernels waiting on a peer
     * forever; abort first so the streams drain. */
    reclaim(n);
    if (n->inflight || n->failed) zb__nccl_abort_comms(n);
    for (int i = 0; i < n->n_pairs; i++) {
      zb__nccl_pair_t *pr = &n->pairs[i];
      if (pr->comm) n->nc->CommDestroy(pr->comm);
      if (pr->stream) {
        /* Without a device sync: poll the last events, so a dead device cannot hang a destroy. */
        n->rt->StreamDestroy(pr->stream);
      }
      for (int32_t k = 0; k < pr->length; k++)
        if (pr->slot && pr->slot[k] && pr->slot[k] != &zero_bytes) free_reqs(n, pr->slot[k]);
      free(pr->slot);
    }
    free_reqs(n, n->inflight);
    free_reqs(n, n->free_list);
    zb__pair_order_free(&n->order);
    free(n->posted);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->mu);
    free(n->pairs);
    free(n);
  }
  free(t);
}

const zb__transport_ops_t zb__nccl_ops = {
    .name = "NCCL",
    .isend = nccl_start,
    .irecv = nccl_start,
    .wait = nccl_wait,
    .cancel = nccl_cancel,
    .abort = nccl_abort,
    .destroy = zb__nccl_destroy,
    .check = nccl_check,
    .plan = zb__nccl_plan,
    .memory = ZB__TRANSPORT_DEVICE_MEMORY,
};

int zb__transport_nccl_requests(zb_transport_t *t) {
  zb__nccl_state_t *n = zb__nccl_of(t);
  pthread_mutex_lock(&n->mu);
  int k = n->n_reqs;
  pthread_mutex_unlock(&n->mu);
  return k;
}

int zb__transport_nccl_comms(zb_transport_t *t) { return zb__nccl_of(t)->n_pairs; }
