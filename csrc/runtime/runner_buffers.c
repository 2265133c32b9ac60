/*
 * runner_buffers.c - the runner's message buffers (DESIGN.md section 4): every buffer is allocated
 * at zb_runner_create from the buffer plan (bufplan.c), per channel, and recycled per channel; the
 * sends of a channel wait in its queue, oldest first; in zero-copy mode (release_cb) outputs are the
 * caller's, handed back when their send finished, and inputs are kept until their microbatch's W.
 *
 * What it is not: the iteration loop (runner.c), or the transport.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runner.h"

/* ---- buffers: planned per channel at creation, recycled per channel ------------------------- */

static zb_status_t reap_oldest(zb_runner_t *r, int32_t tag);

/* Message buffers come from the caller's allocator when it gave one, else from the backend. */
static zb_status_t buf_alloc(zb_runner_t *r, size_t bytes, void **out) {
  if (!r->alloc_cb) return r->be->ops->alloc(r->be, bytes, out);
  *out = NULL;
  zb_status_t st = r->alloc_cb(r->alloc_user, bytes, out);
  if (st != ZB_OK) return ZB_FAIL(st, "the runner's alloc_cb failed for %zu bytes", bytes);
  if (!*out && bytes) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "the runner's alloc_cb gave NULL for %zu bytes", bytes);
  return ZB_OK;
}

void zb__runner_buf_free(zb_runner_t *r, void *ptr) {
  if (!ptr) return;
  if (r->free_cb)
    r->free_cb(r->alloc_user, ptr);
  else
    r->be->ops->release(r->be, ptr);
}

/* A buffer of the pool. A send pool that is empty waits for its channel's oldest send (the plan
 * counted it as received by now, so the wait is short); only if the plan fell short is a buffer
 * allocated, and counted (late_allocs), so the pool grows to what the run needs. */
zb_status_t zb__runner_pool_get(zb_runner_t *r, int32_t id, void **out) {
  pool_t *pl = &r->pools[id];
  if (pl->n == 0 && id < r->T && r->sendq[id].count > 0) ZB_CHECK(reap_oldest(r, id));
  if (pl->n > 0) {
    *out = pl->free_bufs[--pl->n];
    return ZB_OK;
  }
  void **nb = realloc(pl->free_bufs, (size_t)(pl->cap + 1) * sizeof(void *));
  if (!nb) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory tracking the runner's buffers");
  pl->free_bufs = nb;
  ZB_CHECK(buf_alloc(r, pl->bytes, out));
  pl->cap++;
  r->late_allocs++;
  return ZB_OK;
}

/* Every buffer a pool hands out comes back to it; the free list has room for all of them. NULL (an
 * op without that input or output) is ignored. */
void zb__runner_pool_put(zb_runner_t *r, int32_t id, void *buf) {
  if (!buf) return;
  pool_t *pl = &r->pools[id];
  pl->free_bufs[pl->n++] = buf;
}

/* Allocates the plan's buffers: count[t] of pool kind `kind` for every tag. */
static zb_status_t pool_fill(zb_runner_t *r, int kind, const int32_t *count, const int64_t *bytes) {
  for (int32_t t = 0; t < r->T; t++) {
    pool_t *pl = &r->pools[pool_id(r, kind, t)];
    pl->bytes = (size_t)bytes[t / 2];
    if (count[t] <= 0) continue;
    pl->free_bufs = calloc((size_t)count[t], sizeof(void *));
    if (!pl->free_bufs) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the runner's buffer plan");
    for (; pl->cap < count[t]; pl->cap++) {
      ZB_CHECK(buf_alloc(r, pl->bytes, &pl->free_bufs[pl->cap]));
      pl->n++;
    }
  }
  return ZB_OK;
}

/* The buffer plan (bufplan.c) for this rank, allocated now: nothing is allocated inside an
 * iteration unless the plan fell short (it cannot when the transport completes a send no later
 * than its receive). */
zb_status_t zb__runner_plan_buffers(zb_runner_t *r, const zb_runner_config_t *c) {
  size_t T = (size_t)(r->T ? r->T : 1);
  r->pools = calloc(3 * T, sizeof(pool_t));
  r->sendq = calloc(T, sizeof(sendq_t));
  int32_t *sends = calloc(T, sizeof(int32_t)), *recvs = calloc(T, sizeof(int32_t));
  int32_t *locals = calloc(T, sizeof(int32_t));
  int64_t *bytes = calloc(T, sizeof(int64_t));
  zb_status_t st = ZB_OK;
  if (!r->pools || !r->sendq || !sends || !recvs || !locals || !bytes)
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the runner's buffer plan");
  if (st == ZB_OK && r->T > 0) {
    for (int32_t b = 0; b < r->S - 1; b++) bytes[b] = c->boundary_bytes ? c->boundary_bytes[b] : c->boundary_bytes_all;
    st = zb__runner_buffer_plan(r->schedule, r->rank, r->depth, r->pair_first, sends, recvs, locals);
  }
  for (int32_t t = 0; st == ZB_OK && t < r->T; t++) {
    if (sends[t] > 0) {
      r->sendq[t].ring = calloc((size_t)sends[t], sizeof(send_t));
      r->sendq[t].cap = sends[t];
      if (!r->sendq[t].ring) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the runner's buffer plan");
    }
  }
  if (st == ZB_OK && r->release_cb) {
    /* Outputs are the caller's; receive buffers are kept until the microbatch's W. */
    int32_t *held = calloc(T, sizeof(int32_t));
    st = held ? zb__runner_held_inputs(r->schedule, r->rank, held) : ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory");
    for (int32_t t = 0; st == ZB_OK && t < r->T; t++) recvs[t] += held[t], sends[t] = locals[t] = 0;
    free(held);
  }
  if (st == ZB_OK) st = pool_fill(r, POOL_SEND, sends, bytes);
  if (st == ZB_OK) st = pool_fill(r, POOL_RECV, recvs, bytes);
  if (st == ZB_OK) st = pool_fill(r, POOL_LOCAL, locals, bytes);
  free(sends), free(recvs), free(locals), free(bytes);
  return st;
}

zb_status_t zb__runner_late_allocs(const zb_runner_t *r, int64_t *out) {
  ZB_ARG_NOT_NULL(r);
  ZB_ARG_NOT_NULL(out);
  *out = r->late_allocs;
  return ZB_OK;
}

/* A channel's sends go in its ring, oldest first; the plan sized it (it grows only if the plan
 * fell short). Finished ones at the front are recycled per channel, so a slow channel holds only
 * its own buffers. */
zb_status_t zb__runner_push_send(zb_runner_t *r, void *buf, uint64_t token, const op_io_t *io) {
  sendq_t *q = &r->sendq[io->out_tag];
  if (q->count == q->cap) {
    int32_t cap = q->cap ? 2 * q->cap : 4;
    send_t *ns = calloc((size_t)cap, sizeof(send_t));
    if (!ns) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory tracking %d sends", (int)cap);
    for (int32_t k = 0; k < q->count; k++) ns[k] = q->ring[(q->head + k) % q->cap];
    free(q->ring);
    q->ring = ns, q->cap = cap, q->head = 0;
  }
  send_t *sd = &q->ring[(q->head + q->count) % q->cap];
  sd->buf = buf, sd->token = token;
  q->count++;
  return zb__transport_isend(r->tr, &sd->req, io->out_peer, io->out_tag, buf, io->out_bytes);
}

/* Gives the buffer of the channel's oldest send back to its pool and drops the send (finished,
 * or cancelled after a failure). */
void zb__runner_drop_front(zb_runner_t *r, int32_t tag) {
  sendq_t *q = &r->sendq[tag];
  send_t *sd = &q->ring[q->head];
  if (r->release_cb)
    r->release_cb(r->user, sd->token); /* the caller's buffer: the send has finished reading it */
  else
    zb__runner_pool_put(r, pool_id(r, POOL_SEND, tag), sd->buf);
  sd->buf = NULL;
  q->head = (q->head + 1) % q->cap;
  q->count--;
}

/* Recycles the channel's finished sends from the front; timeout 0 only looks, a positive one waits
 * for every send of the channel. */
static zb_status_t reap_channel(zb_runner_t *r, int32_t tag, double timeout) {
  sendq_t *q = &r->sendq[tag];
  while (q->count > 0) {
    send_t *sd = &q->ring[q->head];
    if (sd->req.active) {
      zb_status_t st = zb__transport_wait(r->tr, &sd->req, timeout);
      if (st == ZB_ERR_TIMEOUT && timeout == 0) return ZB_OK; /* still in flight */
      if (st != ZB_OK) return st;
    }
    zb__runner_drop_front(r, tag);
  }
  return ZB_OK;
}

/* Waits for the channel's oldest send only: the newer ones may wait on a receiver that waits on us. */
static zb_status_t reap_oldest(zb_runner_t *r, int32_t tag) {
  send_t *sd = &r->sendq[tag].ring[r->sendq[tag].head];
  if (sd->req.active) ZB_CHECK(zb__transport_wait(r->tr, &sd->req, r->timeout));
  zb__runner_drop_front(r, tag);
  return ZB_OK;
}

zb_status_t zb__runner_reap_sends(zb_runner_t *r, double timeout) {
  for (int32_t j = 0; j < r->n_send_tags; j++) ZB_CHECK(reap_channel(r, r->send_tags[j], timeout));
  return ZB_OK;
}

/* Lets go of the inputs kept for the weight gradient of (stage, mb), or of all with stage -1. */
void zb__runner_release_held(zb_runner_t *r, int32_t stage, int32_t mb) {
  if (!r->held) return;
  size_t a = 0, b = (size_t)r->S * 2 * (size_t)r->m;
  if (stage >= 0) a = ((size_t)stage * (size_t)r->m + (size_t)mb) * 2, b = a + 2;
  for (size_t k = a; k < b; k++) {
    held_t *h = &r->held[k];
    if (!h->used) continue;
    if (h->pool >= 0) zb__runner_pool_put(r, h->pool, h->buf);
    else r->release_cb(r->user, h->token);
    memset(h, 0, sizeof *h);
  }
}

/* An op's input after its callback: back to its pool at once, or, with release_cb, kept until the
 * microbatch's W (F's and B's inputs are what autograd saves for it), which lets both go. */
void zb__runner_release_input(zb_runner_t *r, int32_t k, void *in, uint64_t token) {
  const op_io_t *io = &r->io[k];
  const zb_op_t *op = &r->ops[k];
  if (!r->release_cb) {
    zb__runner_pool_put(r, io->in_pool, in); /* NULL: none */
    return;
  }
  if (io->in_kind != IO_NONE) {
    held_t *h = &r->held[((size_t)op->stage * (size_t)r->m + (size_t)op->mb) * 2 + (op->type == ZB_OP_F ? 0 : 1)];
    h->buf = in, h->used = 1;
    h->pool = io->in_kind == IO_REMOTE ? io->in_pool : -1;
    h->token = token;
  }
  if (op->type == ZB_OP_W || op->type == ZB_OP_BW) zb__runner_release_held(r, op->stage, op->mb);
}
