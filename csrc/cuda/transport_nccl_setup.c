/*
 * transport_nccl_setup.c - creating the NCCL transport: checking the config, one non-blocking
 * two-rank communicator per pair of ranks that exchange data (split from one parent, splitShare,
 * in rounds so each rank takes part in one split per round), one byte each way on each so every
 * connection exists before the first transfer, and the watchdog's start. Every wait is bounded by
 * timeout_s: a rank that never comes makes the others fail with ZB_ERR_TIMEOUT, not hang.
 *
 * What it is not: the transfers (transport_nccl.c).
 */
#define _POSIX_C_SOURCE 200809L
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl.h"

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
static zb_status_t await_comm(zb__nccl_state_t *n, ncclComm_t comm, ncclResult_t r, double deadline, const char *what) {
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
static zb_status_t split_pairs(zb__nccl_state_t *n, ncclComm_t parent, const zb_nccl_transport_config_t *c, double deadline) {
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
      zb__nccl_pair_t *pr = &n->pairs[n->n_pairs++];
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
static zb_status_t connect_pairs(zb__nccl_state_t *n, double deadline) {
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
    zb__nccl_pair_t *pr = &n->pairs[k];
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
  if (st != ZB_OK) zb__nccl_abort_comms(n); /* the kernels must not outlive the scratch */
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
  zb__nccl_state_t *n = calloc(1, sizeof *n);
  if (!t || !n) {
    free(t), free(n);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the NCCL transport");
  }
  t->ops = &zb__nccl_ops, t->rank = c->rank, t->ranks = c->ranks, t->impl = n;
  n->nc = nc, n->rt = rt, n->cu = cu, n->rank = c->rank;
  n->timeout = c->timeout_s > 0 ? c->timeout_s : 300.0;
  n->signal = c->abort_signal;
  pthread_mutex_init(&n->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&n->cv, &ca);
  pthread_condattr_destroy(&ca);

  zb_status_t st = zb__nccl_enter(n);
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
  ZB_CHECK_GOTO(zb__nccl_plan(t, c->schedule), st, fail);
  ZB_CHECK_GOTO(connect_pairs(n, deadline), st, fail);
  if (pthread_create(&n->watchdog, NULL, zb__nccl_watchdog_main, t) != 0) {
    st = ZB_FAIL(ZB_ERR_INTERNAL, "could not start the NCCL watchdog thread");
    goto fail;
  }
  n->watchdog_started = 1;
  *out = t;
  return ZB_OK;

fail:
  /* The peers may be inside the same collective calls; aborting our ends makes them fail too. */
  zb__nccl_abort_comms(n);
  zb__nccl_destroy(t);
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
