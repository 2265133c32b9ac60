/*
 * transport_callback.c - the transport whose send and receive the binding supplies (the PyTorch
 * layer hands in torch.distributed.isend/irecv over gloo).
 *
 * What this is: a thin adapter from zb__transport_ops_t to zb_transport_callbacks_t that turns the
 * callbacks' bare status codes into messages naming the rank, the peer and the channel. What it is
 * not: a place that knows about processes; when a peer dies, only the callbacks' timeouts (or an
 * abort_cb that reaches the others) can tell.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
  zb_transport_callbacks_t cb;
} cb_impl_t;

static zb_transport_callbacks_t *cbs(zb_transport_t *t) { return &((cb_impl_t *)t->impl)->cb; }

static zb_status_t cb_start(zb_transport_t *t, zb__request_t *req) {
  zb_transport_callbacks_t *cb = cbs(t);
  void *handle = NULL;
  zb_status_t st = req->is_send
                       ? cb->isend_cb(cb->user, req->peer, req->tag, req->buf, req->bytes, &handle)
                       : cb->irecv_cb(cb->user, req->peer, req->tag, req->buf, req->bytes, &handle);
  if (st != ZB_OK)
    return ZB_FAIL(st == ZB_ERR_REMOTE || st == ZB_ERR_TIMEOUT ? st : ZB_ERR_REMOTE,
                   "rank %d: the %s callback for rank %d (channel %d, %zu bytes) failed: %s",
                   (int)t->rank, req->is_send ? "isend" : "irecv", (int)req->peer, (int)req->tag,
                   req->bytes, zb_status_string(st));
  req->handle = handle;
  return ZB_OK;
}

static zb_status_t cb_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  zb_transport_callbacks_t *cb = cbs(t);
  zb_status_t st = cb->wait_cb(cb->user, req->handle, timeout_s);
  if (st == ZB_OK) return ZB_OK;
  if (st == ZB_ERR_TIMEOUT) {
    if (timeout_s == 0) return ZB_ERR_TIMEOUT; /* a poll: not done yet, no message needed */
    return ZB_FAIL(ZB_ERR_TIMEOUT, "nothing %s rank %d on channel %d within %.3g s",
                   req->is_send ? "taken by" : "from", (int)req->peer, (int)req->tag, timeout_s);
  }
  return ZB_FAIL(st == ZB_ERR_REMOTE ? st : ZB_ERR_REMOTE,
                 "the %s with rank %d on channel %d failed in the transport callback: %s",
                 req->is_send ? "send" : "receive", (int)req->peer, (int)req->tag, zb_status_string(st));
}

static void cb_cancel(zb_transport_t *t, zb__request_t *req) {
  zb_transport_callbacks_t *cb = cbs(t);
  if (cb->cancel_cb) cb->cancel_cb(cb->user, req->handle);
}

static void cb_abort(zb_transport_t *t, const char *reason) {
  zb_transport_callbacks_t *cb = cbs(t);
  if (cb->abort_cb) cb->abort_cb(cb->user, reason);
}

static void cb_destroy(zb_transport_t *t) {
  free(t->impl);
  free(t);
}

/* Host memory only: the binding's send/recv (gloo) read and write the buffers from the host. */
static const zb__transport_ops_t callback_ops = {
    .name = "callback",
    .isend = cb_start,
    .irecv = cb_start,
    .wait = cb_wait,
    .cancel = cb_cancel,
    .abort = cb_abort,
    .destroy = cb_destroy,
    .memory = ZB__TRANSPORT_HOST_MEMORY,
};

zb_status_t zb_transport_create_callback(zb_transport_t **out, const zb_transport_callbacks_t *callbacks,
                                         int32_t rank, int32_t ranks) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(callbacks);
  if (callbacks->struct_size < sizeof(zb_transport_callbacks_t))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_transport_callbacks_t.struct_size is %u; set it to sizeof(zb_transport_callbacks_t) (%zu)",
                   (unsigned)callbacks->struct_size, sizeof(zb_transport_callbacks_t));
  if (!callbacks->isend_cb || !callbacks->irecv_cb || !callbacks->wait_cb)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "callback transport: isend_cb, irecv_cb and wait_cb are required (cancel_cb and "
                   "abort_cb may be NULL)");
  if (ranks < 1 || rank < 0 || rank >= ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "callback transport: rank %d of %d; need 0 <= rank < ranks",
                   (int)rank, (int)ranks);
  zb_transport_t *t = calloc(1, sizeof(*t));
  cb_impl_t *impl = calloc(1, sizeof(*impl));
  if (!t || !impl) {
    free(t), free(impl);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a callback transport");
  }
  impl->cb = *callbacks;
  t->ops = &callback_ops;
  t->rank = rank;
  t->ranks = ranks;
  t->impl = impl;
  *out = t;
  return ZB_OK;
}
