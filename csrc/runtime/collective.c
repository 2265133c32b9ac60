/*
 * collective.c - all-reduce and broadcast over every rank of a transport's group
 * (zb_transport_all_reduce, zb_transport_broadcast): what Vocabulary Parallelism's passes need
 * between pipeline ranks that otherwise only talk to their neighbours.
 *
 * How: over the transport's own point-to-point messages, on channels of their own
 * (ZB__TAG_COLLECTIVE + the caller's channel; FIFO per peer and channel keeps consecutive
 * collectives of a channel apart, since every rank calls them in the same order). An all-reduce gathers every rank's buffer at rank 0, which
 * reduces them in rank order, ((x0 op x1) op x2) ..., and sends the result back to every rank: the
 * bits are the same on every transport, every run and every rank, which is what bit-for-bit
 * training against a sequential loop needs (a ring or tree all-reduce adds in an order that
 * depends on p and the message size). A broadcast sends from the root to each rank. That is p - 1
 * messages each way through rank 0: meant for per-token statistics and one hidden-sized tensor a
 * microbatch, not for a model's gradients.
 *
 * Failures: each message waits at most timeout_s; a rank that never joins fails the others at
 * their timeout, naming it (the transport's wait says which peer). A rank whose collective fails
 * aborts its transport, as a failed runner does, so the others fail at once (ZB_ERR_REMOTE) instead
 * of at their timeout, and no later collective can pair with a message the failed one left on the
 * channel. A transport that cannot withdraw a posted receive (gloo's) may still write into it after
 * the failure: rank 0's staging buffer is then kept until the transport is destroyed
 * (zb__transport_park), and the caller's buffer must stay alive (the Python binding keeps it) and
 * holds no defined value.
 *
 * What this is not: a device collective. Buffers are host memory; the NCCL pair transport, and a
 * transport bound to a device backend, are refused. A transport with collectives of its own (the
 * NCCL group transport, csrc/cuda/transport_nccl_group.c) runs them instead, after the arguments
 * are checked here. A staged transport's collectives run on its inner host transport.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static size_t dtype_size(zb_dtype_t d) { return d == ZB_DTYPE_F32 ? 4 : 2; }

static float load(const void *base, size_t i, zb_dtype_t d) {
  if (d == ZB_DTYPE_F32) return ((const float *)base)[i];
  uint16_t h = ((const uint16_t *)base)[i];
  return d == ZB_DTYPE_F16 ? zb__half_to_float(h) : zb__bf16_to_float(h);
}

static void store(void *base, size_t i, zb_dtype_t d, float v) {
  if (d == ZB_DTYPE_F32) ((float *)base)[i] = v;
  else ((uint16_t *)base)[i] = d == ZB_DTYPE_F16 ? zb__float_to_half(v) : zb__float_to_bf16(v);
}

/* acc = acc op x, element by element, rounded to the dtype at each step (as adding the tensors
 * one after another in that dtype would). MAX keeps a NaN from either side, as torch's does. */
static void reduce_into(void *acc, const void *x, size_t count, zb_dtype_t d, zb_reduce_op_t op) {
  for (size_t i = 0; i < count; i++) {
    float a = load(acc, i, d), b = load(x, i, d);
    float v = op == ZB_REDUCE_SUM ? a + b : (isnan(a) || isnan(b) ? NAN : (b > a ? b : a));
    store(acc, i, d, v);
  }
}

static zb_status_t check_transport(zb_transport_t *t, const char *what) {
  if (t->ops->memory == ZB__TRANSPORT_DEVICE_MEMORY || (t->be && t->be->ops->device_memory))
    return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                   "%s: the %s transport of rank %d moves device memory; collectives run on host-memory "
                   "transports (in-process, callback, socket, staged) for now",
                   what, t->ops->name, (int)t->rank);
  return ZB_OK;
}

/* Waits for req; on failure the status, its message prefixed with what the collective waited for. */
static zb_status_t wait_for(zb_transport_t *t, zb__request_t *req, double timeout_s, const char *what,
                            const char *step) {
  zb_status_t st = zb__transport_wait(t, req, timeout_s);
  if (st == ZB_OK) return ZB_OK;
  char body[768];
  snprintf(body, sizeof body, "%s", zb__error_body());
  return ZB_FAIL(st, "rank %d, %s: %s rank %d: %s", (int)t->rank, what, step, (int)req->peer, body);
}

static void cancel_all(zb_transport_t *t, zb__request_t *reqs, int32_t n) {
  for (int32_t k = 0; k < n; k++) zb__transport_cancel(t, &reqs[k]);
}

/* A failed collective: the transport aborted with its message (see the file comment). */
static zb_status_t failed(zb_transport_t *t, zb_status_t st) {
  char why[1024];
  snprintf(why, sizeof why, "%s", zb__error_body());
  t->ops->abort(t, why);
  return ZB_FAIL(st, "%s", why);
}

static zb_status_t check_channel(int32_t channel, const char *what) {
  if (channel < 0 || channel >= ZB_COLLECTIVE_CHANNELS)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: channel %d; channels are 0..%d", what, (int)channel,
                   ZB_COLLECTIVE_CHANNELS - 1);
  return ZB_OK;
}

zb_status_t zb_transport_all_reduce(zb_transport_t *t, int32_t channel, void *buf, size_t count, zb_dtype_t dtype,
                                    zb_reduce_op_t op, double timeout_s) {
  ZB_ARG_NOT_NULL(t);
  ZB_CHECK(check_channel(channel, "zb_transport_all_reduce"));
  const int32_t tag = ZB__TAG_COLLECTIVE + channel;
  if (t->ops->host_side) t = t->ops->host_side(t);
  if (count > 0) ZB_ARG_NOT_NULL(buf);
  if (dtype != ZB_DTYPE_F32 && dtype != ZB_DTYPE_F16 && dtype != ZB_DTYPE_BF16)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_transport_all_reduce: dtype %d; allowed: ZB_DTYPE_F32, "
                   "ZB_DTYPE_F16, ZB_DTYPE_BF16", (int)dtype);
  if (op != ZB_REDUCE_SUM && op != ZB_REDUCE_MAX)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_transport_all_reduce: op %d; allowed: ZB_REDUCE_SUM, ZB_REDUCE_MAX",
                   (int)op);
  if (!(timeout_s > 0)) timeout_s = 300.0;
  if (t->ops->all_reduce) return t->ops->all_reduce(t, channel, buf, count, dtype, op, timeout_s);
  ZB_CHECK(check_transport(t, "zb_transport_all_reduce"));
  const int32_t p = t->ranks, me = t->rank;
  const size_t bytes = count * dtype_size(dtype);
  const char *what = op == ZB_REDUCE_SUM ? "all-reduce (sum)" : "all-reduce (max)";
  if (p == 1) return ZB_OK;
  zb__request_t *reqs = calloc((size_t)p, sizeof *reqs);
  if (!reqs) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "rank %d: out of memory for an all-reduce", (int)me);
  zb_status_t st = ZB_OK;
  if (me == 0) {
    /* Every part posted at once (they arrive in any order), reduced in rank order. */
    unsigned char *parts = bytes ? malloc((size_t)(p - 1) * bytes) : NULL;
    if (bytes && !parts) {
      free(reqs);
      return failed(t, ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "rank 0: out of memory for an all-reduce of %d x %zu bytes",
                               (int)p - 1, bytes));
    }
    int32_t posted = 0;
    for (int32_t r = 1; r < p && st == ZB_OK; r++, posted++)
      st = zb__transport_irecv(t, &reqs[r - 1], r, tag, parts + (size_t)(r - 1) * bytes, bytes);
    for (int32_t r = 1; r < p && st == ZB_OK; r++) {
      st = wait_for(t, &reqs[r - 1], timeout_s, what, "waiting for the part of");
      if (st == ZB_OK) reduce_into(buf, parts + (size_t)(r - 1) * bytes, count, dtype, op);
    }
    if (st != ZB_OK) {
      cancel_all(t, reqs, posted);
      zb__transport_park(t, parts); /* a receive the transport could not withdraw may still write into it */
      parts = NULL;
    }
    free(parts);
    posted = 0;
    for (int32_t r = 1; r < p && st == ZB_OK; r++, posted++)
      st = zb__transport_isend(t, &reqs[r - 1], r, tag, buf, bytes);
    for (int32_t r = 1; r < p && st == ZB_OK; r++) st = wait_for(t, &reqs[r - 1], timeout_s, what, "sending the sum to");
    if (st != ZB_OK) cancel_all(t, reqs, posted);
  } else {
    st = zb__transport_isend(t, &reqs[0], 0, tag, buf, bytes);
    if (st == ZB_OK) st = wait_for(t, &reqs[0], timeout_s, what, "sending this rank's part to");
    if (st == ZB_OK) st = zb__transport_irecv(t, &reqs[0], 0, tag, buf, bytes);
    if (st == ZB_OK) st = wait_for(t, &reqs[0], timeout_s, what, "waiting for the result from");
    if (st != ZB_OK) cancel_all(t, reqs, 1);
  }
  free(reqs);
  return st == ZB_OK ? ZB_OK : failed(t, st);
}

zb_status_t zb_transport_broadcast(zb_transport_t *t, int32_t channel, void *buf, size_t bytes, int32_t root,
                                   double timeout_s) {
  ZB_ARG_NOT_NULL(t);
  ZB_CHECK(check_channel(channel, "zb_transport_broadcast"));
  const int32_t tag = ZB__TAG_COLLECTIVE + channel;
  if (t->ops->host_side) t = t->ops->host_side(t);
  if (bytes > 0) ZB_ARG_NOT_NULL(buf);
  if (root < 0 || root >= t->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_transport_broadcast: root %d is not a rank of 0..%d", (int)root,
                   (int)t->ranks - 1);
  if (!(timeout_s > 0)) timeout_s = 300.0;
  if (t->ops->broadcast) return t->ops->broadcast(t, channel, buf, bytes, root, timeout_s);
  ZB_CHECK(check_transport(t, "zb_transport_broadcast"));
  const int32_t p = t->ranks, me = t->rank;
  if (p == 1) return ZB_OK;
  char what[64];
  snprintf(what, sizeof what, "broadcast from rank %d", (int)root);
  if (me != root) {
    zb__request_t req = {0};
    zb_status_t st = zb__transport_irecv(t, &req, root, tag, buf, bytes);
    if (st == ZB_OK) st = wait_for(t, &req, timeout_s, what, "waiting for");
    zb__transport_cancel(t, &req);
    return st == ZB_OK ? ZB_OK : failed(t, st);
  }
  zb__request_t *reqs = calloc((size_t)p, sizeof *reqs);
  if (!reqs) return failed(t, ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "rank %d: out of memory for a broadcast", (int)me));
  zb_status_t st = ZB_OK;
  int32_t posted = 0;
  for (int32_t r = 0; r < p && st == ZB_OK; r++)
    if (r != me) st = zb__transport_isend(t, &reqs[posted++], r, tag, buf, bytes);
  for (int32_t k = 0; k < posted && st == ZB_OK; k++) st = wait_for(t, &reqs[k], timeout_s, what, "sending to");
  if (st != ZB_OK) cancel_all(t, reqs, posted);
  free(reqs);
  return st == ZB_OK ? ZB_OK : failed(t, st);
}
