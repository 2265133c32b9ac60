/*
 * transport.c - what every transport shares: request bookkeeping, the public abort/destroy calls
 * and the runtime's clock.
 *
 * The kinds themselves live next to this file: transport_inproc.c (ranks as threads of one
 * process) and transport_callback.c (send/recv supplied by the binding). The NCCL transport of the
 * CUDA backend plugs in through the same zb__transport_ops_t.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <time.h>

#include "internal.h"

double zb__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static zb_status_t start(zb_transport_t *t, zb__request_t *req, int is_send, int32_t peer,
                         int32_t tag, void *buf, size_t bytes) {
  if (peer < 0 || peer >= t->ranks || peer == t->rank)
    return ZB_FAIL(ZB_ERR_INTERNAL, "rank %d: %s peer rank %d is not another rank of 0..%d",
                   (int)t->rank, is_send ? "send to" : "receive from", (int)peer, (int)t->ranks - 1);
  *req = (zb__request_t){is_send, peer, tag, buf, bytes, NULL, 0};
  zb_status_t st = is_send ? t->ops->isend(t, req) : t->ops->irecv(t, req);
  if (st == ZB_OK) req->active = 1;
  return st;
}

zb_status_t zb__transport_isend(zb_transport_t *t, zb__request_t *req, int32_t peer, int32_t tag,
                                const void *buf, size_t bytes) {
  /* The transport only reads a send buffer; the cast keeps one request type for both directions. */
  return start(t, req, 1, peer, tag, (void *)buf, bytes);
}

zb_status_t zb__transport_irecv(zb_transport_t *t, zb__request_t *req, int32_t peer, int32_t tag,
                                void *buf, size_t bytes) {
  return start(t, req, 0, peer, tag, buf, bytes);
}

zb_status_t zb__transport_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  if (!req->active) return ZB_FAIL(ZB_ERR_INTERNAL, "waiting on a request that was not started");
  zb_status_t st = t->ops->wait(t, req, timeout_s);
  /* A poll that finds the request unfinished leaves it active; anything else ends it. */
  if (!(st == ZB_ERR_TIMEOUT && timeout_s == 0)) req->active = 0;
  return st;
}

void zb__transport_cancel(zb_transport_t *t, zb__request_t *req) {
  if (!req->active) return;
  t->ops->cancel(t, req);
  req->active = 0;
}

zb_status_t zb__transport_bind(zb_transport_t *t, zb_backend_t *be) {
  if (t->be && t->be != be)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the %s transport of rank %d already moves another backend's buffers; give each "
                   "rank's runners one backend",
                   t->ops->name, (int)t->rank);
  if (be->ops->device_memory && t->ops->memory == ZB__TRANSPORT_HOST_MEMORY)
    return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                   "the %s transport moves host memory, but the runner's backend is %s (device "
                   "memory); use the NCCL transport (zb_transport_create_nccl) or the in-process one",
                   t->ops->name, be->ops->name);
  if (!be->ops->device_memory && t->ops->memory == ZB__TRANSPORT_DEVICE_MEMORY)
    return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                   "the %s transport moves device memory, but the runner's backend is %s",
                   t->ops->name, be->ops->name);
  if (!t->be) {
    t->be = be;
    zb__backend_ref(be);
  }
  return ZB_OK;
}

void zb__transport_park(zb_transport_t *t, void *buf) {
  if (!buf) return;
  void **grown = realloc(t->parked, ((size_t)t->n_parked + 1) * sizeof *grown);
  if (!grown) return; /* out of memory: leaked, which is safer than a late write into freed memory */
  t->parked = grown;
  t->parked[t->n_parked++] = buf;
}

zb_status_t zb_transport_abort(zb_transport_t *t, const char *reason) {
  ZB_ARG_NOT_NULL(t);
  t->ops->abort(t, reason ? reason : "(no reason given)");
  return ZB_OK;
}

zb_status_t zb_transport_destroy(zb_transport_t *t) {
  if (!t) return ZB_OK;
  if (t->users > 0)
    return ZB_FAIL(ZB_ERR_BUSY,
                   "the %s transport of rank %d is still used by %d runner(s) or post-validation "
                   "handle(s); destroy those first",
                   t->ops->name, (int)t->rank, t->users);
  zb_backend_t *be = t->be;
  void **parked = t->parked;
  int32_t n_parked = t->n_parked;
  t->ops->destroy(t);
  for (int32_t k = 0; k < n_parked; k++) free(parked[k]);
  free(parked);
  if (be) zb__backend_unref(be);
  return ZB_OK;
}
