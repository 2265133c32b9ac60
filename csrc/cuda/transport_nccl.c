/*
 * transport_nccl.c - the NCCL transport: the runner's channels between GPUs of different processes.
 *
 * NCCL matches sends and receives by order per communicator and peer, has no tags, and runs the
 * operations of one communicator one after another. So each pipeline channel (boundary b, forward
 * activations or backward gradients) that crosses ranks gets a two-rank communicator of its own,
 * split from one parent, and a stream of its own. On each of them one rank only sends and the
 * other only receives, in the FIFO order the validator checked, so no channel ever waits for
 * another one: forward and backward traffic, and the chunks of an interleaved or V schedule, flow
 * independently, like the in-process transport's mailboxes.
 *
 * Ordering is on the device (DESIGN.md section 4): a send's stream waits for an event recorded on
 * the compute stream when the send is issued; a receive's stream does too (its buffer may have been
 * read by compute work issued before); waiting for a receive makes the compute stream wait for the
 * receive's done event and returns at once. The host only blocks waiting for sends to finish (the
 * runner does that at the end of an iteration).
 *
 * Failures: a watchdog thread polls ncclCommGetAsyncError on every communicator and the done
 * events of the operations in flight. An NCCL error, or an operation unfinished after timeout_s,
 * marks the transport failed and aborts every communicator (ncclCommAbort), so kernels stuck on a
 * dead peer return and the streams drain; the runner then fails with the watchdog's message, which
 * names the peer and the channel. The failure is sticky: make a new transport to go on.
 *
 * What it is not: a general NCCL wrapper. It carries the runner's channels only (device memory);
 * the optimizer's and post-validation's host-memory exchange goes over a host transport.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../runtime/internal.h"
#include "internal.h"

typedef struct {
  int32_t tag, peer; /* the channel's tag and the other rank (global) */
  int is_sender;
  int peer_local;    /* the peer's rank inside comm */
  ncclComm_t comm;   /* NULL once aborted */
  cudaStream_t stream;
} chan_t;

/* One operation in flight. It stays on the in-flight list until the runner let go of it and its
 * done event completed, then it goes to the free list with its events for reuse. */
typedef struct nreq {
  struct nreq *next;
  cudaEvent_t ready, done;
  int chan;
  size_t bytes;
  double issued;
  int released; /* the runner is done with it (waited or cancelled) */
  int finished; /* done event seen complete */
} nreq_t;

typedef struct {
  const zb__nccl_t *nc;
  zb__cuda_t *cu;
  chan_t *chans;
  int n_chans;
  double timeout;
  pthread_mutex_t mu; /* guards everything below and every NCCL call after creation */
  pthread_cond_t cv;
  pthread_t watchdog;
  int watchdog_started, stop;
  nreq_t *inflight, *free_list;
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

static int find_chan(const nccl_t *n, int32_t tag, int32_t peer, int is_send) {
  for (int k = 0; k < n->n_chans; k++)
    if (n->chans[k].tag == tag && n->chans[k].peer == peer && n->chans[k].is_sender == is_send) return k;
  return -1;
}

/* Aborts every communicator (mu held). ncclCommAbort makes kernels waiting on a peer return. */
static void abort_comms_locked(nccl_t *n) {
  if (n->aborted) return;
  n->aborted = 1;
  for (int k = 0; k < n->n_chans; k++)
    if (n->chans[k].comm) {
      n->nc->CommAbort(n->chans[k].comm);
      n->chans[k].comm = NULL;
    }
}

/* Marks the transport failed with a message (mu held); the first failure is the one kept. */
static void fail_locked(nccl_t *n, zb_status_t status, const char *msg) {
  if (n->failed) return;
  n->failed = 1;
  n->fail_status = status;
  snprintf(n->fail_msg, sizeof n->fail_msg, "%s", msg);
  abort_comms_locked(n);
}

static zb_status_t failure(const nccl_t *n) {
  return ZB_FAIL(n->fail_status, "%s", n->fail_msg);
}

/* Moves finished, released requests to the free list (mu held). */
static void reclaim_locked(nccl_t *n) {
  nreq_t **pp = &n->inflight;
  while (*pp) {
    nreq_t *q = *pp;
    if (!q->finished && cudaEventQuery(q->done) == cudaSuccess) q->finished = 1;
    if (q->released && (q->finished || n->aborted)) {
      *pp = q->next;
      q->next = n->free_list;
      n->free_list = q;
    } else {
      pp = &q->next;
    }
  }
}

/* The watchdog's look at the world (mu held): asynchronous NCCL errors, then operations that have
 * been in flight longer than the timeout. */
static void watch_once_locked(nccl_t *n, int32_t rank) {
  char what[128], msg[1024];
  for (int k = 0; k < n->n_chans && !n->failed; k++) {
    ncclResult_t e = ncclSuccess;
    if (!n->chans[k].comm || n->nc->CommGetAsyncError(n->chans[k].comm, &e) != ncclSuccess) continue;
    if (e != ncclSuccess && e != ncclInProgress) {
      describe_tag(n->chans[k].tag, what, sizeof what);
      snprintf(msg, sizeof msg, "rank %d: NCCL reported %s on the channel with rank %d (%s)",
               (int)rank, n->nc->GetErrorString(e), (int)n->chans[k].peer, what);
      fail_locked(n, e == ncclRemoteError ? ZB_ERR_REMOTE : ZB_ERR_NCCL, msg);
    }
  }
  double now = zb__now();
  for (nreq_t *q = n->inflight; q && !n->failed; q = q->next) {
    if (q->finished) continue;
    if (cudaEventQuery(q->done) == cudaSuccess) {
      q->finished = 1;
      continue;
    }
    if (now - q->issued > n->timeout) {
      const chan_t *c = &n->chans[q->chan];
      describe_tag(c->tag, what, sizeof what);
      snprintf(msg, sizeof msg,
               "rank %d: the %s of %zu bytes %s rank %d (%s) has not finished within %.3g s; rank %d "
               "is dead, stuck or behind (the watchdog aborted the NCCL communicators)",
               (int)rank, c->is_sender ? "send" : "receive", q->bytes, c->is_sender ? "to" : "from",
               (int)c->peer, what, n->timeout, (int)c->peer);
      fail_locked(n, ZB_ERR_TIMEOUT, msg);
    }
  }
  reclaim_locked(n);
}

static void *watchdog_main(void *arg) {
  zb_transport_t *t = arg;
  nccl_t *n = impl_of(t);
  /* Event queries need the backend's device current on this thread too. */
  zb__cuda_enter(n->cu);
  pthread_mutex_lock(&n->mu);
  while (!n->stop) {
    watch_once_locked(n, t->rank);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += 20 * 1000 * 1000; /* 20 ms: cheap, and far below any sensible timeout */
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&n->cv, &n->mu, &ts);
  }
  pthread_mutex_unlock(&n->mu);
  return NULL;
}

/* ---- operations ---------------------------------------------------------------------------------- */

static zb_status_t get_req_locked(nccl_t *n, nreq_t **out) {
  reclaim_locked(n);
  if (n->free_list) {
    *out = n->free_list;
    n->free_list = (*out)->next;
    return ZB_OK;
  }
  nreq_t *q = calloc(1, sizeof *q);
  if (!q) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for an NCCL request");
  cudaError_t e = cudaEventCreateWithFlags(&q->ready, cudaEventDisableTiming);
  if (e == cudaSuccess) {
    e = cudaEventCreateWithFlags(&q->done, cudaEventDisableTiming);
    if (e != cudaSuccess) cudaEventDestroy(q->ready);
  }
  if (e != cudaSuccess) {
    free(q);
    return ZB_CUDA_FAIL(e, "cudaEventCreateWithFlags");
  }
  *out = q;
  return ZB_OK;
}

static zb_status_t nccl_start(zb_transport_t *t, zb__request_t *req) {
  nccl_t *n = impl_of(t);
  char what[128];
  req->handle = NULL;
  int k = find_chan(n, req->tag, req->peer, req->is_send);
  if (k < 0) {
    describe_tag(req->tag, what, sizeof what);
    return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                   "rank %d: the NCCL transport carries only the schedule's channels between ranks, "
                   "and a %s %s rank %d on channel %d is not one of them (zb_optimizer and zb_postval "
                   "need a host transport)",
                   (int)t->rank, req->is_send ? "send" : "receive", req->is_send ? "to" : "from",
                   (int)req->peer, (int)req->tag);
  }
  if (req->bytes == 0) return ZB_OK; /* both ends know the size: nothing to move */
  ZB_CHECK(zb__cuda_enter(n->cu));
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure(n) : ZB_OK;
  nreq_t *q = NULL;
  if (st == ZB_OK) st = get_req_locked(n, &q);
  if (st == ZB_OK) {
    chan_t *c = &n->chans[k];
    cudaError_t e = cudaEventRecord(q->ready, n->cu->compute);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(c->stream, q->ready, 0);
    if (e != cudaSuccess) {
      st = ZB_CUDA_FAIL(e, "ordering an NCCL operation after the compute stream");
    } else {
      ncclResult_t r = req->is_send
                           ? n->nc->Send(req->buf, req->bytes, ncclUint8, c->peer_local, c->comm, c->stream)
                           : n->nc->Recv(req->buf, req->bytes, ncclUint8, c->peer_local, c->comm, c->stream);
      if (r != ncclSuccess) {
        describe_tag(c->tag, what, sizeof what);
        st = ZB_FAIL(ZB_ERR_NCCL, "rank %d: %s rank %d (%s) failed: %s%s%s", (int)t->rank,
                     req->is_send ? "ncclSend to" : "ncclRecv from", (int)c->peer, what,
                     n->nc->GetErrorString(r), n->nc->GetLastError ? ": " : "",
                     n->nc->GetLastError ? n->nc->GetLastError(c->comm) : "");
      } else if ((e = cudaEventRecord(q->done, c->stream)) != cudaSuccess) {
        st = ZB_CUDA_FAIL(e, "cudaEventRecord after an NCCL operation");
      }
    }
    if (st == ZB_OK) {
      q->chan = k, q->bytes = req->bytes, q->issued = zb__now();
      q->released = 0, q->finished = 0;
      q->next = n->inflight;
      n->inflight = q;
      req->handle = q;
    } else {
      q->next = n->free_list;
      n->free_list = q;
    }
  }
  pthread_mutex_unlock(&n->mu);
  return st;
}

static zb_status_t nccl_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  nccl_t *n = impl_of(t);
  nreq_t *q = req->handle;
  if (!q) return ZB_OK;
  ZB_CHECK(zb__cuda_enter(n->cu));
  if (!req->is_send) {
    /* The device waits, not the host: compute work issued from now on sees the data. */
    pthread_mutex_lock(&n->mu);
    zb_status_t st = n->failed ? failure(n) : ZB_OK;
    if (st == ZB_OK) {
      cudaError_t e = cudaStreamWaitEvent(n->cu->compute, q->done, 0);
      if (e != cudaSuccess) st = ZB_CUDA_FAIL(e, "making the compute stream wait for a receive");
    }
    q->released = 1;
    pthread_mutex_unlock(&n->mu);
    return st;
  }
  double deadline = zb__now() + (timeout_s > 0 ? timeout_s : 0);
  for (;;) {
    cudaError_t e = cudaEventQuery(q->done);
    pthread_mutex_lock(&n->mu);
    zb_status_t st = ZB_OK;
    int over = 0;
    if (e == cudaSuccess) {
      q->finished = q->released = 1;
      over = 1;
    } else if (e != cudaErrorNotReady) {
      st = ZB_CUDA_FAIL(e, "waiting for an NCCL send");
      q->released = over = 1;
    } else if (n->failed) {
      st = failure(n);
      q->released = over = 1;
    } else if (timeout_s <= 0) {
      st = ZB_ERR_TIMEOUT; /* a poll: still in flight, the runner keeps the request */
      over = 1;
    } else if (zb__now() > deadline) {
      const chan_t *c = &n->chans[q->chan];
      char what[128];
      describe_tag(c->tag, what, sizeof what);
      st = ZB_FAIL(ZB_ERR_TIMEOUT, "rank %d: the send of %zu bytes to rank %d (%s) has not finished within %.3g s",
                   (int)t->rank, q->bytes, (int)c->peer, what, timeout_s);
      q->released = over = 1;
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
  pthread_mutex_lock(&n->mu);
  q->released = 1;
  pthread_mutex_unlock(&n->mu);
}

static void nccl_abort(zb_transport_t *t, const char *reason) {
  nccl_t *n = impl_of(t);
  char msg[1024];
  snprintf(msg, sizeof msg, "rank %d aborted: %s", (int)t->rank, reason);
  pthread_mutex_lock(&n->mu);
  fail_locked(n, ZB_ERR_REMOTE, msg);
  pthread_mutex_unlock(&n->mu);
}

static zb_status_t nccl_check(zb_transport_t *t) {
  nccl_t *n = impl_of(t);
  pthread_mutex_lock(&n->mu);
  zb_status_t st = n->failed ? failure(n) : ZB_OK;
  pthread_mutex_unlock(&n->mu);
  return st;
}

static void free_list(nreq_t *q) {
  while (q) {
    nreq_t *next = q->next;
    cudaEventDestroy(q->ready);
    cudaEventDestroy(q->done);
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
    zb__cuda_enter(n->cu);
    /* Work still in flight (a destroy after a failure that was not aborted) would keep kernels
     * waiting on a peer forever; abort first so the streams drain. */
    pthread_mutex_lock(&n->mu);
    reclaim_locked(n);
    if (n->inflight) abort_comms_locked(n);
    pthread_mutex_unlock(&n->mu);
    for (int k = 0; k < n->n_chans; k++) {
      if (n->chans[k].stream) cudaStreamSynchronize(n->chans[k].stream);
      if (n->chans[k].comm) n->nc->CommDestroy(n->chans[k].comm);
      if (n->chans[k].stream) cudaStreamDestroy(n->chans[k].stream);
    }
    free_list(n->inflight);
    free_list(n->free_list);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->mu);
    free(n->chans);
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
    .memory = ZB__TRANSPORT_DEVICE_MEMORY,
};

/* ---- creation -------------------------------------------------------------------------------------- */

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

static zb_status_t check_config(const zb_nccl_transport_config_t *c, zb_schedule_info_t *info) {
  if (c->struct_size < sizeof(zb_nccl_transport_config_t) || c->version != ZB_NCCL_TRANSPORT_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_nccl_transport_config_t has struct_size %u, version %u; initialise it with "
                   "ZB_NCCL_TRANSPORT_CONFIG_INIT (size %zu, version %d)",
                   (unsigned)c->struct_size, (unsigned)c->version, sizeof(zb_nccl_transport_config_t),
                   ZB_NCCL_TRANSPORT_CONFIG_VERSION);
  if (c->ranks < 1 || c->rank < 0 || c->rank >= c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "NCCL transport rank %d of %d; allowed: 0 <= rank < ranks",
                   (int)c->rank, (int)c->ranks);
  if (!c->unique_id == !c->comm)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL transport needs exactly one of unique_id (from zb_nccl_unique_id, the "
                   "same on every rank) and comm (an ncclComm_t to borrow); got %s",
                   c->unique_id ? "both" : "neither");
  if (!c->backend || !zb__cuda_of(c->backend))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL transport needs the rank's CUDA backend (zb_backend_create_cuda); got %s",
                   c->backend ? zb_backend_name(c->backend) : "NULL");
  if (!c->schedule)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the NCCL transport needs the schedule (its channels)");
  ZB_CHECK(zb_schedule_get_info(c->schedule, info));
  if (info->ranks != c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the schedule has %d ranks but the NCCL transport %d",
                   (int)info->ranks, (int)c->ranks);
  return ZB_OK;
}

/* Splits one two-rank communicator per channel that crosses ranks. ncclCommSplit is collective over
 * the parent, so every rank walks the same channel list in the same order; ranks outside a channel
 * pass NCCL_SPLIT_NOCOLOR. */
static zb_status_t split_channels(nccl_t *n, ncclComm_t parent, const zb_nccl_transport_config_t *c,
                                  int32_t stages) {
  n->chans = calloc((size_t)(stages > 1 ? 2 * (stages - 1) : 1), sizeof(chan_t));
  if (!n->chans) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d NCCL channels", 2 * (stages - 1));
  int color = 0;
  for (int32_t b = 0; b + 1 < stages; b++)
    for (int dir = 0; dir < 2; dir++) {
      int32_t from = dir == 0 ? b : b + 1, to = dir == 0 ? b + 1 : b, rs, rr;
      ZB_CHECK(zb_schedule_stage_rank(c->schedule, from, &rs));
      ZB_CHECK(zb_schedule_stage_rank(c->schedule, to, &rr));
      if (rs == rr) continue; /* handed over inside the rank */
      int member = c->rank == rs || c->rank == rr;
      ncclComm_t child = NULL;
      ncclResult_t r = n->nc->CommSplit(parent, member ? color : NCCL_SPLIT_NOCOLOR, c->rank == rs ? 0 : 1,
                                        &child, NULL);
      color++;
      if (r != ncclSuccess) return ZB_NCCL_FAIL(n->nc, r, parent, "ncclCommSplit for a pipeline channel");
      if (!member) continue;
      chan_t *ch = &n->chans[n->n_chans++];
      ch->tag = dir == 0 ? zb__tag_fwd(b) : zb__tag_bwd(b);
      ch->is_sender = c->rank == rs;
      ch->peer = ch->is_sender ? rr : rs;
      ch->peer_local = ch->is_sender ? 1 : 0;
      ch->comm = child;
      ZB_CUDA_CHECK(cudaStreamCreateWithFlags(&ch->stream, cudaStreamNonBlocking));
    }
  return ZB_OK;
}

/* One byte each way on every channel, all in one group, so every connection is set up now, while
 * all ranks are known to be here, and never inside a later send or receive. */
static zb_status_t connect_channels(nccl_t *n) {
  if (n->n_chans == 0) return ZB_OK;
  void *scratch = NULL;
  ZB_CUDA_CHECK(cudaMalloc(&scratch, (size_t)n->n_chans));
  zb_status_t st = ZB_OK;
  n->nc->GroupStart();
  for (int k = 0; k < n->n_chans && st == ZB_OK; k++) {
    chan_t *ch = &n->chans[k];
    char *p = (char *)scratch + k;
    ncclResult_t r = ch->is_sender ? n->nc->Send(p, 1, ncclUint8, ch->peer_local, ch->comm, ch->stream)
                                   : n->nc->Recv(p, 1, ncclUint8, ch->peer_local, ch->comm, ch->stream);
    if (r != ncclSuccess) st = ZB_NCCL_FAIL(n->nc, r, ch->comm, "connecting a pipeline channel");
  }
  ncclResult_t r = n->nc->GroupEnd();
  if (st == ZB_OK && r != ncclSuccess) st = ZB_NCCL_FAIL(n->nc, r, NULL, "ncclGroupEnd connecting the channels");
  for (int k = 0; k < n->n_chans && st == ZB_OK; k++)
    ZB_CUDA_CHECK_GOTO(cudaStreamSynchronize(n->chans[k].stream), st, done);
done:
  cudaFree(scratch);
  return st;
}

zb_status_t zb_transport_create_nccl(zb_transport_t **out, const zb_nccl_transport_config_t *c) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  zb_schedule_info_t info;
  ZB_CHECK(check_config(c, &info));
  const zb__nccl_t *nc;
  ZB_CHECK(zb__nccl(&nc));
  zb__cuda_t *cu = zb__cuda_of(c->backend);
  ZB_CHECK(zb__cuda_enter(cu));

  zb_transport_t *t = calloc(1, sizeof *t);
  nccl_t *n = calloc(1, sizeof *n);
  if (!t || !n) {
    free(t), free(n);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the NCCL transport");
  }
  t->ops = &nccl_ops, t->rank = c->rank, t->ranks = c->ranks, t->impl = n, t->be = c->backend;
  zb__backend_ref(t->be); /* zb_transport_destroy drops it; the failure path below too */
  n->nc = nc, n->cu = cu;
  n->timeout = c->timeout_s > 0 ? c->timeout_s : 300.0;
  pthread_mutex_init(&n->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&n->cv, &ca);
  pthread_condattr_destroy(&ca);

  zb_status_t st = ZB_OK;
  ncclComm_t parent = (ncclComm_t)c->comm;
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
    ncclUniqueId id;
    memcpy(id.internal, c->unique_id, ZB_NCCL_UNIQUE_ID_BYTES);
    ncclResult_t r = nc->CommInitRank(&parent, c->ranks, id, c->rank);
    if (r != ncclSuccess) {
      st = ZB_NCCL_FAIL(nc, r, NULL, "ncclCommInitRank (every rank must call zb_transport_create_nccl with the same unique id)");
      parent = NULL;
      goto fail;
    }
  }
  st = split_channels(n, parent, c, info.stages);
  /* Our own parent only served the splits; a borrowed one stays the caller's. */
  if (!c->comm) nc->CommDestroy(parent);
  if (st != ZB_OK) goto fail;
  ZB_CHECK_GOTO(connect_channels(n), st, fail);
  if (pthread_create(&n->watchdog, NULL, watchdog_main, t) != 0) {
    st = ZB_FAIL(ZB_ERR_INTERNAL, "could not start the NCCL watchdog thread");
    goto fail;
  }
  n->watchdog_started = 1;
  *out = t;
  return ZB_OK;

fail:
  /* The peers may be inside the same collective calls; aborting our ends makes them fail too. */
  pthread_mutex_lock(&n->mu);
  abort_comms_locked(n);
  pthread_mutex_unlock(&n->mu);
  zb__backend_unref(t->be);
  nccl_destroy(t);
  return st;
}
