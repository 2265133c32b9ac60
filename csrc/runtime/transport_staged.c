/*
 * transport_staged.c - a backend's buffers carried over a host-memory transport (the socket or the
 * callback transport) by way of host copies: zb_transport_create_staged.
 *
 * Why: NCCL refuses two ranks of a communicator on one GPU, so pipeline ranks that share a GPU (a
 * one-GPU machine, a test, a debugging run) have no device transport. This one gives them a slow
 * but correct one: a send copies its buffer to host memory on the backend's compute stream and
 * waits for that copy (the buffer was written on that stream), then sends the host copy; a receive
 * lands in host memory and is copied into the runner's buffer when it is waited on, on the compute
 * stream, before the op that reads it is issued there.
 * What it is not: fast. Every message costs two copies, a stream synchronisation and a malloc; one
 * GPU per rank with NCCL is the production path.
 * On the host backend the copies are memcpy, which is how it is tested without a GPU.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
  zb_transport_t *inner;
  /* Host buffers of requests that were cancelled or failed: an inner transport that cannot take
   * back a posted request (the callback transport over gloo) may still read or write them, so
   * they are freed only with the transport. */
  void **parked;
  int n_parked, cap_parked;
} staged_impl_t;

typedef struct {
  zb__request_t in; /* the inner transport's request, over `host` */
  void *host;
} staged_req_t;

static zb_transport_t *inner_of(zb_transport_t *t) { return ((staged_impl_t *)t->impl)->inner; }

static void req_free(staged_req_t *s) {
  if (!s) return;
  free(s->host);
  free(s);
}

/* Frees a request whose inner transfer may still touch its host buffer: the buffer waits for
 * staged_destroy (kept even when the list cannot grow: a leak is safer than a write into freed
 * memory). */
static void req_park(zb_transport_t *t, staged_req_t *s) {
  staged_impl_t *impl = t->impl;
  if (impl->n_parked == impl->cap_parked) {
    int cap = impl->cap_parked ? 2 * impl->cap_parked : 8;
    void **grown = realloc(impl->parked, (size_t)cap * sizeof(void *));
    if (grown) impl->parked = grown, impl->cap_parked = cap;
  }
  if (impl->n_parked < impl->cap_parked) impl->parked[impl->n_parked++] = s->host;
  free(s);
}

static zb_status_t staged_start(zb_transport_t *t, zb__request_t *req) {
  zb_backend_t *be = t->be;
  if (!be)
    return ZB_FAIL(ZB_ERR_INTERNAL, "rank %d: the staged transport moved a message before a runner bound it "
                                    "to a backend",
                   (int)t->rank);
  staged_req_t *s = calloc(1, sizeof(*s));
  if (s) s->host = malloc(req->bytes ? req->bytes : 1);
  if (!s || !s->host) {
    req_free(s);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "rank %d: out of memory staging a %zu-byte message %s rank %d",
                   (int)t->rank, req->bytes, req->is_send ? "to" : "from", (int)req->peer);
  }
  zb_status_t st;
  if (req->is_send) {
    /* The buffer was written on the compute stream: copy it there and wait, then it is the host's. */
    st = be->ops->copy(be, s->host, req->buf, req->bytes);
    if (st == ZB_OK) st = be->ops->sync(be);
    if (st == ZB_OK) st = zb__transport_isend(inner_of(t), &s->in, req->peer, req->tag, s->host, req->bytes);
  } else {
    st = zb__transport_irecv(inner_of(t), &s->in, req->peer, req->tag, s->host, req->bytes);
  }
  if (st != ZB_OK) {
    req_free(s);
    return st;
  }
  req->handle = s;
  return ZB_OK;
}

static zb_status_t staged_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  staged_req_t *s = req->handle;
  zb_status_t st = zb__transport_wait(inner_of(t), &s->in, timeout_s);
  if (st == ZB_ERR_TIMEOUT && timeout_s == 0) return st; /* a poll: still in flight, keep it */
  if (st == ZB_OK && !req->is_send) {
    /* Into the runner's buffer on the compute stream; the synchronisation lets the host copy go. */
    zb_backend_t *be = t->be;
    st = be->ops->copy(be, req->buf, s->host, req->bytes);
    if (st == ZB_OK) st = be->ops->sync(be);
  }
  if (st != ZB_OK)
    req_park(t, s); /* the inner transfer failed or timed out: it may still read or land */
  else
    req_free(s);
  req->handle = NULL;
  return st;
}

static void staged_cancel(zb_transport_t *t, zb__request_t *req) {
  staged_req_t *s = req->handle;
  if (!s) return;
  zb__transport_cancel(inner_of(t), &s->in);
  req_park(t, s);
  req->handle = NULL;
}

static void staged_abort(zb_transport_t *t, const char *reason) {
  zb_transport_t *in = inner_of(t);
  in->ops->abort(in, reason);
}

static zb_status_t staged_check(zb_transport_t *t) {
  zb_transport_t *in = inner_of(t);
  return in->ops->check ? in->ops->check(in) : ZB_OK;
}

static void staged_destroy(zb_transport_t *t) {
  staged_impl_t *impl = t->impl;
  zb__transport_unref(impl->inner);
  for (int k = 0; k < impl->n_parked; k++) free(impl->parked[k]);
  free(impl->parked);
  free(impl);
  free(t);
}

/* Any backend's memory: the copies go through the bound backend. No `plan`: the inner transport is
 * host-ordered (order-free), and so is this one. */
static const zb__transport_ops_t staged_ops = {
    .name = "staged",
    .isend = staged_start,
    .irecv = staged_start,
    .wait = staged_wait,
    .cancel = staged_cancel,
    .abort = staged_abort,
    .destroy = staged_destroy,
    .check = staged_check,
    .memory = ZB__TRANSPORT_ANY_MEMORY,
    .host_side = inner_of,
};

zb_status_t zb_transport_create_staged(zb_transport_t **out, zb_transport_t *inner) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(inner);
  if (inner->ops->memory != ZB__TRANSPORT_HOST_MEMORY || inner->ops->plan)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_transport_create_staged: the %s transport is not a host-memory transport; stage over the "
                   "socket or the callback transport",
                   inner->ops->name);
  zb_transport_t *t = calloc(1, sizeof(*t));
  staged_impl_t *impl = calloc(1, sizeof(*impl));
  if (!t || !impl) {
    free(t), free(impl);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a staged transport");
  }
  impl->inner = inner;
  zb__transport_ref(inner); /* destroying the inner transport first is ZB_ERR_BUSY */
  t->ops = &staged_ops;
  t->rank = inner->rank;
  t->ranks = inner->ranks;
  t->impl = impl;
  *out = t;
  return ZB_OK;
}
