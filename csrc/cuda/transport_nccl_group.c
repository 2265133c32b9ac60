/*
 * transport_nccl_group.c - the NCCL group transport: collectives over every rank of a pipeline on
 * device memory (zb_transport_all_reduce / zb_transport_broadcast), for Vocabulary Parallelism's
 * passes when each rank has a GPU of its own.
 *
 * One communicator over the group (ncclCommInitRankConfig, non-blocking) and one stream of its own.
 * A collective is ncclAllReduce or ncclBroadcast in place, ordered after the work the backend's
 * compute stream was given before the call (an event the group's stream waits for), and the call
 * returns when it has finished on the device: the host polls its `done` event, so callers (the
 * torch layer's lanes, one thread per kind of pass) keep the blocking contract of the host
 * transports' collectives, and what reads the result later on any stream finds it there.
 *
 * Why NCCL's own collectives and not collective.c's messages through rank 0: those would need a
 * reduction kernel at rank 0 and p - 1 transfers each way through one GPU. The price: NCCL adds in
 * its own order (a ring or a tree, chosen by size and p), so a SUM is the host transports' within
 * float32 rounding, not bit for bit (the same on every rank of one run, which is what the shards
 * need); MAX and broadcasts are exact.
 *
 * One order per transport: NCCL runs a communicator's collectives in the order they are issued, so
 * every rank must call this transport's collectives in one order whatever their channels (the
 * channels of host transports are independent; here they only label messages). Give each kind of
 * pass a transport of its own, as the torch layer's lanes do. One thread at a time per transport.
 *
 * Failures: a collective's wait is bounded by timeout_s, counted from when this rank's data is ready
 * on the device (the compute stream reached the call), so the clock measures the peers, not this
 * rank's queue. On a timeout, an NCCL error, the abort signal (another rank failed) or
 * zb_transport_abort (from any thread), the communicator is aborted (its kernels return), the
 * failure is published on the abort signal when it is this rank's own, and the transport stays
 * failed: every later call fails at once with the first failure's message. No lock is held across
 * a CUDA or NCCL call; an abort from another thread while a collective waits is carried out by the
 * waiting thread (within a millisecond), so the communicator is never freed under it.
 *
 * What it is not: point-to-point messages (isend/irecv are refused: the runner's channels go over
 * the pair transport, zb_transport_create_nccl).
 */
#define _POSIX_C_SOURCE 200809L
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl.h"

typedef struct {
  const zb__nccl_t *nc;
  const zb__cudart_t *rt;
  zb__cuda_t *cu;
  int32_t rank;
  double timeout;
  zb_abort_signal_t signal;
  ncclComm_t comm;     /* NULL once aborted or destroyed */
  cudaStream_t stream; /* the collectives' own */
  cudaEvent_t ready, done;

  pthread_mutex_t mu; /* guards what follows; never held across a CUDA or NCCL call */
  int inuse;          /* a thread is inside a collective (it alone touches comm then) */
  int abort_wanted;   /* zb_transport_abort came while one was: the waiting thread aborts */
  int failed;
  zb_status_t fail_status;
  char fail_msg[1024];
} group_t;

static group_t *group_of(zb_transport_t *t) { return (group_t *)t->impl; }

static zb_status_t enter(const group_t *g) {
  int cur = -1;
  cudaError_t e = g->rt->GetDevice(&cur);
  if (e == cudaSuccess && cur != g->cu->device) e = g->rt->SetDevice(g->cu->device);
  return e == cudaSuccess ? ZB_OK : RT_FAIL(g, e, "cudaSetDevice");
}

/* The first failure is kept (later ones only repeat it); returns whether this was the first. */
static int record_failure(group_t *g, zb_status_t st, const char *msg) {
  pthread_mutex_lock(&g->mu);
  int first = !g->failed;
  if (first) {
    g->failed = 1, g->fail_status = st;
    snprintf(g->fail_msg, sizeof g->fail_msg, "%s", msg);
  }
  pthread_mutex_unlock(&g->mu);
  return first;
}

static zb_status_t the_failure(group_t *g) {
  pthread_mutex_lock(&g->mu);
  zb_status_t st = g->fail_status;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", g->fail_msg);
  pthread_mutex_unlock(&g->mu);
  return ZB_FAIL(st, "%s", msg);
}

/* Aborts the communicator; only by a thread that may touch it (inside a collective, or with none
 * inside). */
static void abort_comm(group_t *g) {
  pthread_mutex_lock(&g->mu);
  ncclComm_t c = g->comm;
  g->comm = NULL;
  pthread_mutex_unlock(&g->mu);
  if (c) g->nc->CommAbort(c);
}

/* A failure of this rank's own, inside a collective: recorded, the communicator aborted, and the
 * message published so every rank fails within a poll. */
static zb_status_t fail_here(group_t *g, zb_status_t st) {
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", zb__error_body());
  int first = record_failure(g, st, msg);
  abort_comm(g);
  if (first && st != ZB_ERR_REMOTE && g->signal.publish) g->signal.publish(g->signal.user, msg);
  return the_failure(g);
}

static void nap(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

/* Waits until ev has completed (ev NULL: until the communicator has finished enqueueing the call
 * that returned ncclInProgress, as a non-blocking one may, launching it from a thread of its own),
 * polling the communicator's error, the abort signal and zb_transport_abort; at most timeout s.
 * `what`: the collective; `phase`: what is waited for, for the timeout's message. */
static zb_status_t await_event(group_t *g, cudaEvent_t ev, const char *what, const char *phase) {
  const double start = zb__now(), deadline = start + g->timeout;
  double next_poll = start;
  long us = 20;
  for (;;) {
    ncclResult_t r = ncclSuccess;
    if (g->nc->CommGetAsyncError(g->comm, &r) != ncclSuccess || (r != ncclSuccess && r != ncclInProgress))
      return fail_here(g, ZB_NCCL_FAIL(g->nc, r, g->comm, what));
    if (!ev && r == ncclSuccess) return ZB_OK;
    if (ev) {
      cudaError_t e = g->rt->EventQuery(ev);
      if (e == cudaSuccess) return ZB_OK;
      if (e != cudaErrorNotReady) return fail_here(g, RT_FAIL(g, e, "cudaEventQuery"));
    }
    pthread_mutex_lock(&g->mu);
    int wanted = g->abort_wanted;
    pthread_mutex_unlock(&g->mu);
    if (wanted) {
      abort_comm(g);
      return the_failure(g);
    }
    const double now = zb__now();
    if (g->signal.poll && now >= next_poll) {
      char msg[1024] = {0};
      if (g->signal.poll(g->signal.user, msg, sizeof msg))
        return fail_here(g, ZB_FAIL(ZB_ERR_REMOTE, "rank %d, %s: another rank failed: %s", (int)g->rank, what, msg));
      next_poll = now + 0.2;
    }
    if (now >= deadline)
      return fail_here(g, ZB_FAIL(ZB_ERR_TIMEOUT,
                                  "rank %d, %s: %s within %.3g s (the timeout): some rank did not join it (dead, "
                                  "stuck, or calling this transport's collectives in another order)",
                                  (int)g->rank, what, phase, g->timeout));
    nap(us);
    if (us < 1000) us *= 2;
  }
}

/* Runs one collective: enqueue(g) issues it on g->stream. */
static zb_status_t run(zb_transport_t *t, const char *what, ncclResult_t (*enqueue)(group_t *, const void *),
                       const void *arg) {
  group_t *g = group_of(t);
  pthread_mutex_lock(&g->mu);
  int failed = g->failed;
  if (!failed) g->inuse = 1;
  pthread_mutex_unlock(&g->mu);
  if (failed) return the_failure(g);
  zb_status_t st = enter(g);
  if (st != ZB_OK) st = fail_here(g, st);
  cudaError_t e = cudaSuccess;
  /* After whatever the compute stream was given before this call. */
  if (st == ZB_OK && ((e = g->rt->EventRecord(g->ready, g->cu->compute)) != cudaSuccess ||
                      (e = g->rt->StreamWaitEvent(g->stream, g->ready, 0)) != cudaSuccess))
    st = fail_here(g, RT_FAIL(g, e, "ordering a collective after the compute stream"));
  if (st == ZB_OK) {
    ncclResult_t r = enqueue(g, arg);
    if (r != ncclSuccess && r != ncclInProgress) st = fail_here(g, ZB_NCCL_FAIL(g->nc, r, g->comm, what));
    /* On the stream only once NCCL says so: `done` recorded before would complete without it. */
    if (st == ZB_OK && r == ncclInProgress) st = await_event(g, NULL, what, "NCCL did not finish enqueueing it");
  }
  if (st == ZB_OK && (e = g->rt->EventRecord(g->done, g->stream)) != cudaSuccess)
    st = fail_here(g, RT_FAIL(g, e, "cudaEventRecord after a collective"));
  if (st == ZB_OK) st = await_event(g, g->ready, what, "this rank's data was not ready (its compute stream did not reach the call)");
  if (st == ZB_OK) st = await_event(g, g->done, what, "did not finish");
  pthread_mutex_lock(&g->mu);
  g->inuse = 0;
  int late_abort = g->abort_wanted && g->comm;
  pthread_mutex_unlock(&g->mu);
  if (late_abort) abort_comm(g); /* an abort that came as this collective finished */
  return st;
}

typedef struct {
  void *buf;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
} coll_t;

static ncclResult_t enqueue_all_reduce(group_t *g, const void *arg) {
  const coll_t *c = arg;
  return g->nc->AllReduce(c->buf, c->buf, c->count, c->type, c->op, g->comm, g->stream);
}

static ncclResult_t enqueue_broadcast(group_t *g, const void *arg) {
  const coll_t *c = arg;
  return g->nc->Broadcast(c->buf, c->buf, c->count, ncclUint8, c->root, g->comm, g->stream);
}

static zb_status_t group_all_reduce(zb_transport_t *t, int32_t channel, void *buf, size_t count, zb_dtype_t dtype,
                                    zb_reduce_op_t op, double timeout_s) {
  (void)channel, (void)timeout_s; /* one order per transport; the transport's timeout */
  coll_t c = {buf, count, dtype == ZB_DTYPE_F32 ? ncclFloat32 : dtype == ZB_DTYPE_F16 ? ncclFloat16 : ncclBfloat16,
              op == ZB_REDUCE_SUM ? ncclSum : ncclMax, 0};
  char what[96];
  snprintf(what, sizeof what, "the NCCL all-reduce (%s) of channel %d", op == ZB_REDUCE_SUM ? "sum" : "max",
           (int)channel);
  return t->ranks == 1 ? ZB_OK : run(t, what, enqueue_all_reduce, &c);
}

static zb_status_t group_broadcast(zb_transport_t *t, int32_t channel, void *buf, size_t bytes, int32_t root,
                                   double timeout_s) {
  (void)timeout_s;
  coll_t c = {buf, bytes, ncclUint8, ncclSum, (int)root};
  char what[96];
  snprintf(what, sizeof what, "the NCCL broadcast from rank %d of channel %d", (int)root, (int)channel);
  return t->ranks == 1 ? ZB_OK : run(t, what, enqueue_broadcast, &c);
}

static zb_status_t refuse_p2p(zb_transport_t *t, zb__request_t *req) {
  (void)req;
  return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                 "rank %d: the NCCL group transport carries collectives only (zb_transport_all_reduce, "
                 "zb_transport_broadcast); the runner's channels go over zb_transport_create_nccl's",
                 (int)t->rank);
}

static zb_status_t refuse_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  (void)timeout_s;
  return refuse_p2p(t, req);
}

static void no_cancel(zb_transport_t *t, zb__request_t *req) { (void)t, (void)req; }

static void group_abort(zb_transport_t *t, const char *reason) {
  group_t *g = group_of(t);
  char msg[1024];
  snprintf(msg, sizeof msg, "rank %d: the NCCL group transport was aborted: %s", (int)g->rank,
           reason ? reason : "(no reason given)");
  int first = record_failure(g, ZB_ERR_REMOTE, msg);
  pthread_mutex_lock(&g->mu);
  int busy = g->inuse;
  g->abort_wanted = 1;
  pthread_mutex_unlock(&g->mu);
  if (!busy) abort_comm(g); /* else the waiting thread does, at its next poll */
  if (first && g->signal.publish) g->signal.publish(g->signal.user, msg);
}

static zb_status_t group_check(zb_transport_t *t) {
  group_t *g = group_of(t);
  pthread_mutex_lock(&g->mu);
  int failed = g->failed;
  pthread_mutex_unlock(&g->mu);
  return failed ? the_failure(g) : ZB_OK;
}

static void group_destroy(zb_transport_t *t) {
  group_t *g = group_of(t);
  if (g) {
    /* A collective still waiting on another thread (a caller that did not join its thread) is
     * told to abort, and given a few seconds to come out before anything is freed. */
    pthread_mutex_lock(&g->mu);
    if (g->inuse) g->abort_wanted = 1;
    pthread_mutex_unlock(&g->mu);
    for (double until = zb__now() + 5.0;;) {
      pthread_mutex_lock(&g->mu);
      int busy = g->inuse;
      pthread_mutex_unlock(&g->mu);
      if (!busy || zb__now() > until) break;
      nap(1000);
    }
    if (enter(g) == ZB_OK) {
      pthread_mutex_lock(&g->mu);
      ncclComm_t c = g->comm;
      g->comm = NULL;
      int failed = g->failed;
      pthread_mutex_unlock(&g->mu);
      /* Nothing is in flight between collectives (each call waits for its own); a failed one was
       * aborted already. */
      if (c) failed ? g->nc->CommAbort(c) : g->nc->CommDestroy(c);
      if (g->ready) g->rt->EventDestroy(g->ready);
      if (g->done) g->rt->EventDestroy(g->done);
      if (g->stream) g->rt->StreamDestroy(g->stream);
    }
    pthread_mutex_destroy(&g->mu);
    free(g);
  }
  free(t);
}

static const zb__transport_ops_t group_ops = {
    .name = "NCCL group",
    .isend = refuse_p2p,
    .irecv = refuse_p2p,
    .wait = refuse_wait,
    .cancel = no_cancel,
    .abort = group_abort,
    .destroy = group_destroy,
    .check = group_check,
    .memory = ZB__TRANSPORT_DEVICE_MEMORY,
    .all_reduce = group_all_reduce,
    .broadcast = group_broadcast,
};

static zb_status_t check_config(const zb_nccl_group_config_t *c) {
  if (c->struct_size != sizeof(zb_nccl_group_config_t) || c->version != ZB_NCCL_GROUP_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_nccl_group_config_t has struct_size %u, version %u; initialise it with "
                   "ZB_NCCL_GROUP_CONFIG_INIT (size %zu, version %d)",
                   (unsigned)c->struct_size, (unsigned)c->version, sizeof(zb_nccl_group_config_t),
                   ZB_NCCL_GROUP_CONFIG_VERSION);
  if (c->ranks < 1 || c->rank < 0 || c->rank >= c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "NCCL group transport rank %d of %d; allowed: 0 <= rank < ranks",
                   (int)c->rank, (int)c->ranks);
  if (!c->unique_id)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL group transport needs unique_id (zb_nccl_unique_id on one rank, the same on every "
                   "rank, and not the one of another communicator)");
  if (!c->abort_signal.poll != !c->abort_signal.publish)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL group transport's abort_signal needs both poll and publish, or neither");
  return ZB_OK;
}

zb_status_t zb__transport_create_nccl_group_with(zb_transport_t **out, const zb_nccl_group_config_t *c,
                                                 const zb__nccl_t *nc, const zb__cudart_t *rt, zb__cuda_t *cu) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  ZB_CHECK(check_config(c));
  zb_transport_t *t = calloc(1, sizeof *t);
  group_t *g = calloc(1, sizeof *g);
  if (!t || !g) {
    free(t), free(g);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the NCCL group transport");
  }
  t->ops = &group_ops, t->rank = c->rank, t->ranks = c->ranks, t->impl = g;
  g->nc = nc, g->rt = rt, g->cu = cu, g->rank = c->rank;
  g->timeout = c->timeout_s > 0 ? c->timeout_s : 300.0;
  g->signal = c->abort_signal;
  pthread_mutex_init(&g->mu, NULL);
  zb_status_t st = enter(g);
  cudaError_t e = cudaSuccess;
  if (st == ZB_OK && ((e = rt->StreamCreateWithFlags(&g->stream, cudaStreamNonBlocking)) != cudaSuccess ||
                      (e = rt->EventCreateWithFlags(&g->ready, cudaEventDisableTiming)) != cudaSuccess ||
                      (e = rt->EventCreateWithFlags(&g->done, cudaEventDisableTiming)) != cudaSuccess))
    st = RT_FAIL(g, e, "creating the NCCL group transport's stream and events");
  if (st == ZB_OK) {
    /* Non-blocking, so a rank that never comes makes this fail at the timeout, not hang. */
    ncclUniqueId id;
    memcpy(id.internal, c->unique_id, ZB_NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = nc->CommInitRankConfig(&g->comm, c->ranks, id, c->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      g->comm = NULL;
      st = ZB_NCCL_FAIL(nc, r, NULL, "ncclCommInitRankConfig for the NCCL group transport (every rank must call "
                                     "zb_transport_create_nccl_group with the same unique id)");
    }
    const double deadline = zb__now() + g->timeout;
    double next_poll = 0;
    while (st == ZB_OK && r == ncclInProgress && zb__now() < deadline) {
      nap(200);
      if (nc->CommGetAsyncError(g->comm, &r) != ncclSuccess) r = ncclInternalError;
      char msg[1024] = {0};
      if (g->signal.poll && zb__now() >= next_poll) {
        /* A rank that failed before joining: stop waiting for it now, not at the timeout. */
        if (g->signal.poll(g->signal.user, msg, sizeof msg))
          st = ZB_FAIL(ZB_ERR_REMOTE, "rank %d: creating the NCCL group transport: another rank failed: %s",
                       (int)c->rank, msg);
        next_poll = zb__now() + 0.2;
      }
    }
    if (st == ZB_OK && r == ncclInProgress)
      st = ZB_FAIL(ZB_ERR_TIMEOUT,
                   "rank %d: creating the NCCL group transport did not finish within %.3g s: some rank did not "
                   "call zb_transport_create_nccl_group (dead, stuck, or given another unique id)",
                   (int)c->rank, g->timeout);
    else if (st == ZB_OK && r != ncclSuccess)
      st = ZB_NCCL_FAIL(nc, r, g->comm, "ncclCommInitRankConfig for the NCCL group transport");
  }
  if (st != ZB_OK) {
    g->failed = 1; /* the communicator, if any, is aborted: the peers fail too instead of waiting */
    group_destroy(t);
    return st;
  }
  *out = t;
  return ZB_OK;
}

zb_status_t zb_transport_create_nccl_group(zb_transport_t **out, const zb_nccl_group_config_t *c) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  ZB_CHECK(check_config(c)); /* the layout and the fields first, then the backend */
  if (!c->backend || !zb__cuda_of(c->backend))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the NCCL group transport needs the rank's CUDA backend (zb_backend_create_cuda); got %s",
                   c->backend ? zb_backend_name(c->backend) : "NULL");
  const zb__nccl_t *nc;
  ZB_CHECK(zb__nccl(&nc));
  ZB_CHECK(zb__transport_create_nccl_group_with(out, c, nc, zb__rt(), zb__cuda_of(c->backend)));
  (*out)->be = c->backend;
  zb__backend_ref(c->backend); /* zb_transport_destroy drops it */
  return ZB_OK;
}
