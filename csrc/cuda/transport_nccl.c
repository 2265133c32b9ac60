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
 * Every CUDA runtime and NCCL call goes through a table (zb__cudart_t, zb__nccl_t), so the host
 * tests drive all of this against a fake device (tests/c/test_transport_nccl.c).
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

#include "../runtime/internal.h"
#include "internal.h"

#define RT_FAIL(n, e, what) \
  ZB_FAIL(ZB_ERR_CUDA, "%s failed: %s (error %d)", (what), (n)->rt->GetErrorString(e), (int)(e))

enum { REQ_FREE = 0, REQ_POSTED = 1, REQ_ISSUED = 2 };

typedef struct nreq {
  struct nreq *next;          /* in the in-flight list (issue order) or the free list */
  cudaEvent_t ready, need, done;
  uint64_t gen;               /* bumped at each reuse: the watchdog's snapshots check it */
  int pair, tag, is_send, state;
  void *buf;
  size_t bytes;
  int needed;   /* a receive the runner waited for: `need` was recorded on the compute stream */
  double clock; /* when the watchdog saw it ready at the head of its pair; 0 until then */
  int released; /* the runner is done with it (waited or cancelled) */
  int finished; /* done event seen complete */
} nreq_t;

typedef struct {
  int32_t peer, peer_local; /* the other rank, globally and inside comm */
  ncclComm_t comm;          /* NULL once aborted */
  cudaStream_t stream;
  /* The issue order (the runner thread's only): slot[i] holds the i-th transfer of the iteration
   * once posted; next is the first not issued yet. */
  nreq_t **slot;
  int32_t length, next;
} pair_t;

/* A posted zero-byte message: it takes its place in the order but nothing moves. */
static nreq_t zero_bytes;

typedef struct {
  const zb__nccl_t *nc;
  const zb__cudart_t *rt;
  zb__cuda_t *cu;
  int32_t rank;
  pair_t *pairs;
  int n_pairs;
  zb__pair_order_t order;
  int32_t *posted; /* per tag: messages posted this iteration */
  double timeout;
  zb_abort_signal_t signal;

  pthread_mutex_t mu; /* guards what follows; never held across a CUDA or NCCL call */
  pthread_cond_t cv;
  pthread_t watchdog;
  int watchdog_started, stop;
  nreq_t *inflight, *inflight_tail, *free_list;
  int n_reqs;    /* requests ever made (their events are the transport's), for the tests */
  int failed, aborted;
  zb_status_t fail_status;
  char fail_msg[1024];
} nccl_t;

static nccl_t *impl_of(zb_transport_t *t) { return (nccl_t *)t->impl; }

/* "the activations of boundary 2 (stage 2 -> 3)" */
static void describe_tag(int32_t tag, char *buf, size_t cap) {
  int32_t b = tag / 2;
  if (tag % 2 == 0)
    snprintf(buf, cap, "the activations of boundary %d (stage %d -> %d)", (int)b, (int)b, (int)b + 1);
  else
    snprintf(buf, cap, "the gradients of boundary %d (stage %d -> %d)", (int)b, (int)b + 1, (int)b);
}

static zb_status_t enter(const nccl_t *n) {
  int cur = -1;
  cudaError_t e = n->rt->GetDevice(&cur);
  if (e == cudaSuccess && cur != n->cu->device) e = n->rt->SetDevice(n->cu->device);
  return e == cudaSuccess ? ZB_OK : RT_FAIL(n, e, "cudaSetDevice");
}

/* ---- failure --------------------------------------------------------------------------------- */

static zb_status_t failure_locked(const nccl_t *n) { return ZB_FAIL(n->fail_status, "%s", n->fail_msg); }

/* Marks the transport failed (the first failure is the one kept) and wakes the watchdog, which
 * aborts the communicators. A failure of this rank's own (publish = 1) goes out on the abort
 * signal, after the lock is dropped. */
static void fail(nccl_t *n, zb_status_t status, const char *msg, int publish) {
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
 * waiting on a peer return, and an enqueue blocked on a full launch queue come back. */
static void abort_comms(nccl_t *n) {
  ncclComm_t comms[64];
  int k = 0;
  pthread_mutex_lock(&n->mu);
  if (!n->aborted) {
    n->aborted = 1;
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
  nreq_t *q;
  uint64_t gen;
  int is_send, needed;
  ncclComm_t comm;
} snap_t;

static void watch_once(zb_transport_t *t, snap_t *snap) {
  nccl_t *n = impl_of(t);
  char what[128], msg[1024];
  /* 1. Under the lock: each pair's oldest unfinished transfer and its communicator. */
  pthread_mutex_lock(&n->mu);
  for (int i = 0; i < n->n_pairs; i++) {
    snap[i].q = NULL;
    snap[i].comm = n->failed ? NULL : n->pairs[i].comm;
  }
  for (nreq_t *q = n->inflight; q; q = q->next)
    if (!q->finished && !snap[q->pair].q) {
      snap[q->pair].q = q, snap[q->pair].gen = q->gen;
      snap[q->pair].is_send = q->is_send, snap[q->pair].needed = q->needed;
    }
  pthread_mutex_unlock(&n->mu);

  /* 2. Without it: NCCL's asynchronous errors and the device's progress. */
  for (int i = 0; i < n->n_pairs; i++) {
    ncclResult_t e = ncclSuccess;
    if (snap[i].comm && n->nc->CommGetAsyncError(snap[i].comm, &e) == ncclSuccess && e != ncclSuccess &&
        e != ncclInProgress) {
      snprintf(msg, sizeof msg, "rank %d: NCCL reported %s on the communicator with rank %d", (int)t->rank,
               n->nc->GetErrorString(e), (int)n->pairs[i].peer);
      fail(n, e == ncclRemoteError ? ZB_ERR_REMOTE : ZB_ERR_NCCL, msg, 1);
    }
    nreq_t *q = snap[i].q;
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
      describe_tag(q->tag, what, sizeof what);
      snprintf(msg, sizeof msg,
               "rank %d: the %s of %zu bytes %s rank %d (%s) has not finished within %.3g s of %s; rank %d is "
               "dead, stuck or behind (the watchdog aborted the NCCL communicators)",
               (int)t->rank, q->is_send ? "send" : "receive", q->bytes, q->is_send ? "to" : "from",
               (int)n->pairs[i].peer, what, n->timeout,
               q->is_send ? "its data being ready" : "the compute stream needing it", (int)n->pairs[i].peer);
      fail(n, ZB_ERR_TIMEOUT, msg, 1);
    }
  }
}

static void *watchdog_main(void *arg) {
  zb_transport_t *t = arg;
  nccl_t *n = impl_of(t);
  /* Event queries need the backend's device current on this thread too. */
  enter(n);
  snap_t *snap = calloc((size_t)(n->n_pairs ? n->n_pairs : 1), sizeof *snap);
  char msg[1024];
  int tick = 0;
  for (;;) {
    pthread_mutex_lock(&n->mu);
    int stop = n->stop, failed = n->failed, aborted = n->aborted;
    pthread_mutex_unlock(&n->mu);
    if (stop) break;
    if (failed && !aborted) abort_comms(n);
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
static void reclaim(nccl_t *n) {
  for (nreq_t *q = n->inflight; q; q = q->next)
    if (!q->finished && q->released && n->rt->EventQuery(q->done) == cudaSuccess) {
      pthread_mutex_lock(&n->mu);
      q->finished = 1;
      pthread_mutex_unlock(&n->mu);
    }
  pthread_mutex_lock(&n->mu);
  nreq_t **pp = &n->inflight, *prev = NULL;
  while (*pp) {
    nreq_t *q = *pp;
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
static zb_status_t make_req(nccl_t *n, nreq_t **out) {
  nreq_t *q = calloc(1, sizeof *q);
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

static zb_status_t get_req(nccl_t *n, nreq_t **out) {
  reclaim(n);
  pthread_mutex_lock(&n->mu);
  nreq_t *q = n->free_list;
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

static void put_free(nccl_t *n, nreq_t *q) {
  pthread_mutex_lock(&n->mu);
  q->state = REQ_FREE;
  q->next = n->free_list;
  n->free_list = q;
  pthread_mutex_unlock(&n->mu);
}

/* A posted request that will never be issued (after a failure): out of the order, back to the free
 * list. */
static void drop_posted(nccl_t *n, nreq_t *q) {
  pair_t *pr = &n->pairs[q->pair];
  for (int32_t i = 0; i < pr->length; i++)
    if (pr->slot[i] == q) pr->slot[i] = NULL;
  put_free(n, q);
}

/* Waits out ncclInProgress on a non-blocking communicator (no lock held); fails when the watchdog
 * has failed the transport meanwhile. */
static zb_status_t settle(nccl_t *n, ncclComm_t comm, ncclResult_t r, const char *what) {
  while (r == ncclInProgress) {
    pthread_mutex_lock(&n->mu);
    int failed = n->failed;
    pthread_mutex_unlock(&n->mu);
    if (failed) break;
    struct timespec nap = {0, 20 * 1000};
    nanosleep(&nap, NULL);
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
  nccl_t *n = impl_of(t);
  pair_t *pr = &n->pairs[pi];
  for (;;) {
    while (pr->next < pr->length && pr->slot[pr->next] == &zero_bytes) pr->slot[pr->next++] = NULL;
    nreq_t *batch[32];
    int nb = 0;
    int32_t at = pr->next;
    while (nb < 32 && at < pr->length && pr->slot[at] && pr->slot[at] != &zero_bytes) batch[nb++] = pr->slot[at++];
    if (nb == 0) break;

    pthread_mutex_lock(&n->mu);
    zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
    ncclComm_t comm = pr->comm;
    pthread_mutex_unlock(&n->mu);
    if (st != ZB_OK) return st;

    char what[160], tagtxt[128];
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < nb && e == cudaSuccess; i++) e = n->rt->StreamWaitEvent(pr->stream, batch[i]->ready, 0);
    if (e != cudaSuccess) {
      st = RT_FAIL(n, e, "ordering an NCCL transfer after the compute stream");
    } else {
      ncclResult_t r = n->nc->GroupStart();
      for (int i = 0; i < nb && r == ncclSuccess; i++) {
        nreq_t *q = batch[i];
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

    if (st != ZB_OK) {
      /* Part of the group may be out: the pair's order is broken for good. */
      fail(n, st, zb__error_body(), 1);
      return st;
    }
    pthread_mutex_lock(&n->mu);
    if (st == ZB_OK)
      for (int i = 0; i < nb; i++) {
        nreq_t *q = batch[i];
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
  nccl_t *n = impl_of(t);
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
  pair_t *pr = &n->pairs[c->pair];
  int32_t k = n->posted[req->tag];
  int32_t seq = c->seq[k];
  if (pr->slot[seq] || seq < pr->next)
    return ZB_FAIL(ZB_ERR_INTERNAL, "rank %d: message %d of channel %d came before the previous iteration's were out",
                   (int)t->rank, (int)k, (int)req->tag);
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
  pthread_mutex_unlock(&n->mu);
  if (st != ZB_OK) return st;
  ZB_CHECK(enter(n));
  if (req->bytes == 0) {
    /* Both ends know the size: nothing moves, but the place in the order is taken. */
    pr->slot[seq] = &zero_bytes;
  } else {
    nreq_t *q = NULL;
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
static zb_status_t must_be_issued(zb_transport_t *t, nreq_t *q) {
  nccl_t *n = impl_of(t);
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
  nccl_t *n = impl_of(t);
  nreq_t *q = req->handle;
  if (!q) return ZB_OK;
  ZB_CHECK(enter(n));
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
  nccl_t *n = impl_of(t);
  nreq_t *q = req->handle;
  if (!q) return;
  if (q->state == REQ_POSTED) {
    drop_posted(n, q);
    return;
  }
  pthread_mutex_lock(&n->mu);
  q->released = 1;
  pthread_mutex_unlock(&n->mu);
}

static void nccl_abort(zb_transport_t *t, const char *reason) {
  nccl_t *n = impl_of(t);
  char msg[1024];
  snprintf(msg, sizeof msg, "rank %d aborted: %s", (int)t->rank, reason);
  fail(n, ZB_ERR_REMOTE, msg, 1);
}

static zb_status_t nccl_check(zb_transport_t *t) {
  nccl_t *n = impl_of(t);
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure_locked(n) : ZB_OK;
  pthread_mutex_unlock(&n->mu);
  return st;
}

/* The order for a schedule (the one at creation, then each runner's). Its pairs must be ones this
 * transport has a communicator for. Between iterations only. */
static zb_status_t nccl_plan(zb_transport_t *t, const zb_schedule_t *s) {
  nccl_t *n = impl_of(t);
  for (int i = 0; i < n->n_pairs; i++)
    for (int32_t k = 0; k < n->pairs[i].length; k++)
      if (n->pairs[i].slot[k])
        return ZB_FAIL(ZB_ERR_BUSY, "rank %d: the NCCL transport has transfers of an unfinished iteration", (int)t->rank);
  zb__pair_order_t o;
  ZB_CHECK(zb__pair_order_make(s, t->rank, &o));
  zb_status_t st = ZB_OK;
  nreq_t ***slots = calloc((size_t)(o.n_pairs ? o.n_pairs : 1), sizeof *slots);
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
    ZB_CHECK(enter(n));
    while (n->n_reqs < want && st == ZB_OK) {
      nreq_t *q = NULL;
      st = make_req(n, &q);
      if (st == ZB_OK) put_free(n, q);
    }
  } else {
    zb__pair_order_free(&o);
  }
  for (int32_t j = 0; slots && j < o.n_pairs; j++) free(slots[j]);
  free(slots), free(posted), free(which);
  return st;
}

static void free_reqs(nccl_t *n, nreq_t *q) {
  while (q) {
    nreq_t *next = q->next;
    n->rt->EventDestroy(q->ready);
    n->rt->EventDestroy(q->need);
    n->rt->EventDestroy(q->done);
    free(q);
    q = next;
  }
}

static void nccl_destroy(zb_transport_t *t) {
  nccl_t *n = impl_of(t);
  if (n) {
    if (n->watchdog_started) {
      pthread_mutex_lock(&n->mu);
      n->stop = 1;
      pthread_cond_broadcast(&n->cv);
      pthread_mutex_unlock(&n->mu);
      pthread_join(n->watchdog, NULL);
    }
    enter(n);
    /* Work still in flight (a destroy after a failure) would keep kernels waiting on a peer
     * forever; abort first so the streams drain. */
    reclaim(n);
    if (n->inflight || n->failed) abort_comms(n);
    for (int i = 0; i < n->n_pairs; i++) {
      pair_t *pr = &n->pairs[i];
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

static const zb__transport_ops_t nccl_ops = {
    .name = "NCCL",
    .isend = nccl_start,
    .irecv = nccl_start,
    .wait = nccl_wait,
    .cancel = nccl_cancel,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
    .check = nccl_check,
    .plan = nccl_plan,
    .memory = ZB__TRANSPORT_DEVICE_MEMORY,
};

int zb__transport_nccl_requests(zb_transport_t *t) {
  nccl_t *n = impl_of(t);
  pthread_mutex_lock(&n->mu);
  int k = n->n_reqs;
  pthread_mutex_unlock(&n->mu);
  return k;
}

int zb__transport_nccl_comms(zb_transport_t *t) { return impl_of(t)->n_pairs; }

/* ---- creation -------------------------------------------------------------------------------- */

zb_status_t zb_nccl_unique_id(uint8_t out[ZB_NCCL_UNIQUE_ID_BYTES]) {
  ZB_ARG_NOT_NULL(out);
  const zb__nccl_t *nc;
  ZB_CHECK(zb__nccl(&nc));
  ncclUniqueId id;
  ncclResult_t r = nc->GetUniqueId(&id);
  if (r != ncclSuccess) return ZB_NCCL_FAIL(nc, r, NULL, "ncclGetUniqueId");
  memcpy(out, id.internal, ZB_NCCL_UNIQUE_ID_BYTES);
  return ZB_OK;
}

/* The config as this library's layout, from a caller's of this or the previous size. */
static zb_status_t check_config(const zb_nccl_transport_config_t *c, zb_nccl_transport_config_t *full,
                                zb_schedule_info_t *info) {
  const size_t old = offsetof(zb_nccl_transport_config_t, abort_signal);
  if ((c->struct_size != sizeof(zb_nccl_transport_config_t) && c->struct_size != old) ||
      c->version != ZB_NCCL_TRANSPORT_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_nccl_transport_config_t has struct_size %u, version %u; initialise it with "
                   "ZB_NCCL_TRANSPORT_CONFIG_INIT (size %zu, version %d)",
                   (unsigned)c->struct_size, (unsigned)c->version, sizeof(zb_nccl_transport_config_t),
                   ZB_NCCL_TRANSPORT_CONFIG_VERSION);
  memset(full, 0, sizeof *full);
  memcpy(full, c, c->struct_size);
  if (c->ranks < 1 || c->rank < 0 || c->rank >= c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "NCCL transport rank %d of %d; allowed: 0 <= rank < ranks",
                   (int)c->rank, (int)c->ranks);
  if (!c->unique_id == !c->comm)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL transport needs exactly one of unique_id (from zb_nccl_unique_id, the "
                   "same on every rank) and comm (an ncclComm_t to borrow); got %s",
                   c->unique_id ? "both" : "neither");
  if (!c->schedule)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the NCCL transport needs the schedule (its channels)");
  if (!full->abort_signal.poll != !full->abort_signal.publish)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the NCCL transport's abort_signal needs both poll and publish, or neither");
  ZB_CHECK(zb_schedule_get_info(c->schedule, info));
  if (info->ranks != c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the schedule has %d ranks but the NCCL transport %d",
                   (int)info->ranks, (int)c->ranks);
  return ZB_OK;
}

/* Waits until a non-blocking communicator is ready, at most until the deadline. */
static zb_status_t await_comm(nccl_t *n, ncclComm_t comm, ncclResult_t r, double deadline, const char *what) {
  while (r == ncclInProgress && zb__now() < deadline) {
    struct timespec nap = {0, 200 * 1000};
    nanosleep(&nap, NULL);
    if (n->nc->CommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  if (r == ncclSuccess) return ZB_OK;
  if (r == ncclInProgress)
    return ZB_FAIL(ZB_ERR_TIMEOUT,
                   "rank %d: %s did not finish within %.3g s: some rank did not call zb_transport_create_nccl "
                   "(dead, stuck, or given another unique id)",
                   (int)n->rank, what, n->timeout);
  return ZB_NCCL_FAIL(n->nc, r, comm, what);
}

/* One two-rank communicator per pair, split from the parent with splitShare in rounds (a rank
 * takes part in one split per round; ranks outside every pair of a round pass NCCL_SPLIT_NOCOLOR). */
static zb_status_t split_pairs(nccl_t *n, ncclComm_t parent, const zb_nccl_transport_config_t *c, double deadline) {
  int32_t np, (*pairs)[2], *round, rounds;
  ZB_CHECK(zb__pair_list(c->schedule, &np, &pairs, &round, &rounds));
  zb_status_t st = ZB_OK;
  n->pairs = calloc((size_t)(np ? np : 1), sizeof *n->pairs);
  if (!n->pairs) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the NCCL transport");
  for (int32_t rd = 0; rd < rounds && st == ZB_OK; rd++) {
    int color = NCCL_SPLIT_NOCOLOR, key = 0;
    int32_t peer = -1;
    for (int32_t i = 0; i < np; i++)
      if (round[i] == rd && (pairs[i][0] == c->rank || pairs[i][1] == c->rank)) {
        color = (int)i, key = pairs[i][0] == c->rank ? 0 : 1;
        peer = pairs[i][0] == c->rank ? pairs[i][1] : pairs[i][0];
      }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    cfg.splitShare = 1;
    ncclComm_t child = NULL;
    ncclResult_t r = n->nc->CommSplit(parent, color, key, &child, &cfg);
    if (r == ncclInProgress) {
      /* Non-blocking: the split finishes in the background; the parent says when. */
      st = await_comm(n, parent, r, deadline, "splitting the pair communicators (ncclCommSplit)");
      r = st == ZB_OK ? ncclSuccess : r;
    } else if (r != ncclSuccess) {
      st = ZB_NCCL_FAIL(n->nc, r, parent, "ncclCommSplit for a pair of ranks");
    }
    if (st == ZB_OK && child)
      st = await_comm(n, child, ncclInProgress, deadline, "creating a pair communicator (ncclCommSplit)");
    if (child) {
      pair_t *pr = &n->pairs[n->n_pairs++];
      pr->peer = peer, pr->peer_local = key == 0 ? 1 : 0, pr->comm = child;
      if (st == ZB_OK) {
        cudaError_t e = n->rt->StreamCreateWithFlags(&pr->stream, cudaStreamNonBlocking);
        if (e != cudaSuccess) st = RT_FAIL(n, e, "cudaStreamCreateWithFlags");
      }
    }
  }
  free(pairs), free(round);
  return st;
}

/* One byte each way on every pair, in one group, so every connection is set up now, while all
 * ranks are known to be here, and never inside a later transfer. Bounded by the deadline. */
static zb_status_t connect_pairs(nccl_t *n, double deadline) {
  if (n->n_pairs == 0) return ZB_OK;
  void *scratch = NULL;
  cudaEvent_t *ev = calloc((size_t)n->n_pairs, sizeof *ev);
  if (!ev) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory connecting the NCCL pairs");
  zb_status_t st = ZB_OK;
  cudaError_t e = n->rt->Malloc(&scratch, 2 * (size_t)n->n_pairs);
  if (e != cudaSuccess) {
    free(ev);
    return RT_FAIL(n, e, "cudaMalloc of the connection scratch");
  }
  ncclResult_t r = n->nc->GroupStart();
  for (int k = 0; k < n->n_pairs && (r == ncclSuccess || r == ncclInProgress); k++) {
    pair_t *pr = &n->pairs[k];
    char *p = (char *)scratch + 2 * k;
    r = n->nc->Send(p, 1, ncclUint8, pr->peer_local, pr->comm, pr->stream);
    if (r == ncclSuccess || r == ncclInProgress) r = n->nc->Recv(p + 1, 1, ncclUint8, pr->peer_local, pr->comm, pr->stream);
  }
  ncclResult_t r2 = n->nc->GroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = r2;
  for (int k = 0; k < n->n_pairs && st == ZB_OK; k++)
    st = await_comm(n, n->pairs[k].comm, r == ncclSuccess ? ncclInProgress : r, deadline, "connecting a pair of ranks");
  for (int k = 0; k < n->n_pairs && st == ZB_OK; k++) {
    if ((e = n->rt->EventCreateWithFlags(&ev[k], cudaEventDisableTiming)) != cudaSuccess ||
        (e = n->rt->EventRecord(ev[k], n->pairs[k].stream)) != cudaSuccess)
      st = RT_FAIL(n, e, "cudaEventRecord after connecting");
  }
  for (int k = 0; k < n->n_pairs && st == ZB_OK; k++) {
    while ((e = n->rt->EventQuery(ev[k])) == cudaErrorNotReady && zb__now() < deadline) {
      struct timespec nap = {0, 200 * 1000};
      nanosleep(&nap, NULL);
    }
    if (e == cudaErrorNotReady)
      st = ZB_FAIL(ZB_ERR_TIMEOUT, "rank %d: connecting to rank %d did not finish within %.3g s", (int)n->rank,
                   (int)n->pairs[k].peer, n->timeout);
    else if (e != cudaSuccess)
      st = RT_FAIL(n, e, "connecting a pair of ranks");
  }
  if (st != ZB_OK) abort_comms(n); /* the kernels must not outlive the scratch */
  for (int k = 0; k < n->n_pairs; k++)
    if (ev[k]) n->rt->EventDestroy(ev[k]);
  free(ev);
  n->rt->Free(scratch);
  return st;
}

zb_status_t zb__transport_create_nccl_with(zb_transport_t **out, const zb_nccl_transport_config_t *config,
                                           const zb__nccl_t *nc, const zb__cudart_t *rt, zb__cuda_t *cu) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(config);
  zb_nccl_transport_config_t cf;
  zb_schedule_info_t info;
  ZB_CHECK(check_config(config, &cf, &info));
  const zb_nccl_transport_config_t *c = &cf;

  zb_transport_t *t = calloc(1, sizeof *t);
  nccl_t *n = calloc(1, sizeof *n);
  if (!t || !n) {
    free(t), free(n);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the NCCL transport");
  }
  t->ops = &nccl_ops, t->rank = c->rank, t->ranks = c->ranks, t->impl = n;
  n->nc = nc, n->rt = rt, n->cu = cu, n->rank = c->rank;
  n->timeout = c->timeout_s > 0 ? c->timeout_s : 300.0;
  n->signal = c->abort_signal;
  pthread_mutex_init(&n->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&n->cv, &ca);
  pthread_condattr_destroy(&ca);

  zb_status_t st = enter(n);
  double deadline = zb__now() + n->timeout;
  ncclComm_t parent = (ncclComm_t)c->comm;
  if (st != ZB_OK) goto fail;
  if (parent) {
    int count = 0, me = -1;
    if (nc->CommCount(parent, &count) != ncclSuccess || nc->CommUserRank(parent, &me) != ncclSuccess ||
        count != c->ranks || me != c->rank) {
      st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the borrowed NCCL communicator is rank %d of %d, but the transport was asked for "
                   "rank %d of %d",
                   me, count, (int)c->rank, (int)c->ranks);
      goto fail;
    }
  } else {
    /* Non-blocking, so a rank that never comes makes this fail at the deadline, not hang. */
    ncclUniqueId id;
    memcpy(id.internal, c->unique_id, ZB_NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = nc->CommInitRankConfig(&parent, c->ranks, id, c->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      st = ZB_NCCL_FAIL(nc, r, NULL, "ncclCommInitRankConfig (every rank must call zb_transport_create_nccl with the same unique id)");
      parent = NULL;
      goto fail;
    }
    st = await_comm(n, parent, ncclInProgress, deadline, "ncclCommInitRankConfig");
    if (st != ZB_OK) {
      nc->CommAbort(parent);
      goto fail;
    }
  }
  st = split_pairs(n, parent, c, deadline);
  /* Our own parent only served the splits (its children share its resources and outlive it). */
  if (!c->comm) st == ZB_OK ? nc->CommDestroy(parent) : nc->CommAbort(parent);
  if (st != ZB_OK) goto fail;
  ZB_CHECK_GOTO(nccl_plan(t, c->schedule), st, fail);
  ZB_CHECK_GOTO(connect_pairs(n, deadline), st, fail);
  if (pthread_create(&n->watchdog, NULL, watchdog_main, t) != 0) {
    st = ZB_FAIL(ZB_ERR_INTERNAL, "could not start the NCCL watchdog thread");
    goto fail;
  }
  n->watchdog_started = 1;
  *out = t;
  return ZB_OK;

fail:
  /* The peers may be inside the same collective calls; aborting our ends makes them fail too. */
  abort_comms(n);
  nccl_destroy(t);
  return st;
}

zb_status_t zb_transport_create_nccl(zb_transport_t **out, const zb_nccl_transport_config_t *c) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  zb_nccl_transport_config_t full;
  zb_schedule_info_t info;
  ZB_CHECK(check_config(c, &full, &info)); /* the layout and the fields first, then the backend */
  if (!c->backend || !zb__cuda_of(c->backend))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL transport needs the rank's CUDA backend (zb_backend_create_cuda); got %s",
                   c->backend ? zb_backend_name(c->backend) : "NULL");
  const zb__nccl_t *nc;
  ZB_CHECK(zb__nccl(&nc));
  ZB_CHECK(zb__transport_create_nccl_with(out, c, nc, zb__rt(), zb__cuda_of(c->backend)));
  (*out)->be = c->backend;
  zb__backend_ref(c->backend); /* zb_transport_destroy drops it */
  return ZB_OK;
}
