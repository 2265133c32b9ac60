/*
 * runner.c - one rank, one iteration: executes the rank's op list from a schedule (DESIGN.md 4).
 *
 * Phases of an iteration:
 *   1. Post the first recv_depth receives, in op order. Because every channel is FIFO and the
 *      validator checked that both ends agree on the order, posting in op order matches each
 *      receive with the right message without tags per microbatch.
 *   2. For each op: wait for its input (a posted receive, or a buffer a previous op of this rank
 *      left for it when both stages live here), run it (F and B through the caller's callbacks, W
 *      from the W store, BW as B then W), stamp its start and end, post the next receive (after
 *      the compute on host-ordered transports, off the path from the input's arrival to the
 *      compute; as the input arrives on NCCL, see post_ahead), and start the send of its output
 *      at once. Finished sends are collected without waiting.
 *   3. Wait for the last sends, and check that the W store is empty and nothing was left over.
 * A failure anywhere aborts the transport, so the peers fail too instead of waiting, and drops what
 * is left (receives cancelled, W-store entries released unrun).
 *
 * On a device backend the same loop only issues work: callbacks, GEMMs and copies go onto the
 * compute stream, a receive on a device-ordered transport (NCCL) makes that stream wait for the
 * data instead of blocking the host, and a send's stream waits for the compute work before it. A
 * receive buffer is reused only after the compute work issued before its next receive (the
 * transport orders the receive after it), so the host can run ahead of the device safely. The host
 * blocks only at the end: for the sends to leave and for the compute stream to finish.
 *
 * Its buffers (the plan's pools, the send queues, the inputs kept in zero-copy mode) are
 * runner_buffers.c's; the state both share is in runner.h.
 *
 * What it is not: a model. Buffers handed to callbacks are the runner's and live only for the call,
 * except in zero-copy mode (zb_runner_config_t.release_cb), where inputs live until their W.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "runner.h"

static const char *op_name(int type) {
  switch (type) {
    case ZB_OP_F: return "F";
    case ZB_OP_B: return "B";
    case ZB_OP_W: return "W";
    case ZB_OP_OFFLOAD: return "OFFLOAD";
    case ZB_OP_RELOAD: return "RELOAD";
    case ZB_OP_S: return "S";
    case ZB_OP_T: return "T";
    case ZB_OP_IF: return "IF";
    case ZB_OP_IB: return "IB";
    default: return "BW";
  }
}

/* ---- create / destroy ------------------------------------------------------------------------ */

static zb_status_t plan(zb_runner_t *r, const zb_runner_config_t *c) {
  uint8_t *sends_on = calloc((size_t)(r->T ? r->T : 1), 1);
  if (!sends_on) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning rank %d", (int)r->rank);
  zb_status_t st = ZB_OK;
  for (int32_t k = 0; k < r->n && st == ZB_OK; k++) {
    const int32_t i = r->ops[k].mb;
    op_io_t *io = &r->io[k];
    zb__link_t in, out;
    st = zb__op_links(r->schedule, r->S, &r->ops[k], &in, &out);
    if (st != ZB_OK) break;
    io->recv = -1;
    if (in.tag >= 0) { /* the tag is the boundary's: tag / 2 (zb__tag_fwd/bwd) */
      io->in_bytes = (size_t)(c->boundary_bytes ? c->boundary_bytes[in.tag / 2] : c->boundary_bytes_all);
      if (in.peer == r->rank) {
        io->in_kind = IO_LOCAL;
        io->in_slot = in.tag * r->m + i;
        io->in_pool = pool_id(r, POOL_LOCAL, in.tag);
      } else {
        io->in_kind = IO_REMOTE;
        io->in_pool = pool_id(r, POOL_RECV, in.tag);
        io->in_peer = in.peer;
        io->in_tag = in.tag;
        io->recv = r->n_recv;
        r->recv_op[r->n_recv++] = k;
      }
    }
    if (out.tag >= 0) {
      io->out_bytes = (size_t)(c->boundary_bytes ? c->boundary_bytes[out.tag / 2] : c->boundary_bytes_all);
      if (out.peer == r->rank) {
        io->out_kind = IO_LOCAL;
        io->out_slot = out.tag * r->m + i;
        io->out_pool = pool_id(r, POOL_LOCAL, out.tag);
      } else {
        io->out_kind = IO_REMOTE;
        io->out_pool = pool_id(r, POOL_SEND, out.tag);
        io->out_peer = out.peer;
        io->out_tag = out.tag;
        sends_on[out.tag] = 1;
      }
    }
  }
  if (st == ZB_OK) {
    r->send_tags = calloc((size_t)(r->T ? r->T : 1), sizeof(int32_t));
    if (!r->send_tags) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning rank %d", (int)r->rank);
    for (int32_t t = 0; st == ZB_OK && t < r->T; t++)
      if (sends_on[t]) r->send_tags[r->n_send_tags++] = t;
  }
  free(sends_on);
  return st;
}

/* Checks and records the pairs: each names ops k and k+1 of this rank's list, no op is in two,
 * and the second does not need the first's output (it could not be there before the first ran). */
static zb_status_t plan_pairs(zb_runner_t *r, const int32_t *first, int32_t count) {
  if (!first)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_runner_config_t: n_pairs is %d but pair_first is NULL", (int)count);
  r->pair_first = calloc((size_t)(r->n ? r->n : 1), 1);
  if (!r->pair_first) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory recording %d pairs", (int)count);
  for (int32_t j = 0; j < count; j++) {
    int32_t k = first[j];
    if (k < 0 || k + 1 >= r->n)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "pair %d starts at op %d, but rank %d has ops 0..%d and a pair needs op k and k+1",
                     (int)j, (int)k, (int)r->rank, (int)r->n - 1);
    if (r->pair_first[k] || (k > 0 && r->pair_first[k - 1]) || (k + 1 < r->n && r->pair_first[k + 1]))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "pair %d (ops %d and %d of rank %d) overlaps another pair",
                     (int)j, (int)k, (int)k + 1, (int)r->rank);
    const op_io_t *a = &r->io[k], *b = &r->io[k + 1];
    if (b->in_kind == IO_LOCAL && a->out_kind == IO_LOCAL && b->in_slot == a->out_slot)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "pair %d: op %d %s(stage %d, mb %d) takes its input from op %d %s(stage %d, mb %d) of "
                     "the same pair; a pair's ops must be independent",
                     (int)j, (int)k + 1, op_name(r->ops[k + 1].type), (int)r->ops[k + 1].stage,
                     (int)r->ops[k + 1].mb, (int)k, op_name(r->ops[k].type), (int)r->ops[k].stage,
                     (int)r->ops[k].mb);
    /* A transport that issues in one order per rank pair (NCCL) may need the first op's output
     * out before the second op's input can come, and the pair waits for that input first. */
    if (r->tr && r->tr->ops->plan && a->out_kind == IO_REMOTE && b->in_kind == IO_REMOTE)
      return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                     "pair %d (ops %d and %d of rank %d): the %s transport cannot run a pair whose first op "
                     "sends to another rank and whose second receives from one; run them as two ops",
                     (int)j, (int)k, (int)k + 1, (int)r->rank, r->tr->ops->name);
    r->pair_first[k] = 1;
  }
  return ZB_OK;
}

zb_status_t zb_runner_destroy(zb_runner_t *r) {
  if (!r) return ZB_OK;
  for (int32_t k = 0; r->pools && k < 3 * r->T; k++) {
    for (int j = 0; j < r->pools[k].n; j++) zb__runner_buf_free(r, r->pools[k].free_bufs[j]);
    free(r->pools[k].free_bufs);
  }
  for (int32_t t = 0; r->sendq && t < r->T; t++) free(r->sendq[t].ring);
  if (r->ev_op)
    for (int32_t k = 0; k < 2 * r->n; k++)
      if (r->ev_op[k]) r->be->ops->event_destroy(r->be, r->ev_op[k]);
  free(r->ev_op);
  if (r->ev_base) r->be->ops->event_destroy(r->be, r->ev_base);
  zb__copies_free(r);
  zb__backend_unref(r->be);
  zb__transport_unref(r->tr);
  free(r->pools), free(r->io), free(r->start), free(r->end), free(r->recv_op), free(r->recv_req);
  free(r->recv_buf), free(r->local), free(r->sendq), free(r->pair_first), free(r->send_tags);
  free(r->local_token), free(r->held);
  free(r);
  return ZB_OK;
}

zb_status_t zb_runner_create(zb_runner_t **out, const zb_runner_config_t *c) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  /* Callers built before the pair (and allocator) fields existed pass the size that ends before
   * them; those built before release_cb, the size that ends before it. */
  const size_t before_pairs = offsetof(zb_runner_config_t, pair_first);
  const size_t before_release = offsetof(zb_runner_config_t, release_cb);
  const size_t before_copies = offsetof(zb_runner_config_t, copy_cb);
  const size_t before_vocab = offsetof(zb_runner_config_t, vocab_cb);
  const int has_pairs = c->struct_size >= before_release; /* and the allocator fields */
  const int has_release = c->struct_size >= before_copies;
  const int has_copies = c->struct_size >= before_vocab;
  const int has_vocab = c->struct_size >= sizeof(zb_runner_config_t);
  if ((c->struct_size != before_pairs && c->struct_size != before_release && c->struct_size != before_copies &&
       c->struct_size != before_vocab && !has_vocab) ||
      c->version != ZB_RUNNER_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_runner_config_t has struct_size %u, version %u; initialise it with "
                   "ZB_RUNNER_CONFIG_INIT (size %zu, version %d)",
                   (unsigned)c->struct_size, (unsigned)c->version, sizeof(zb_runner_config_t),
                   ZB_RUNNER_CONFIG_VERSION);
  if (!c->schedule || !c->backend || !c->wstore || !c->forward_cb || !c->backward_cb)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_runner_config_t needs schedule, backend, wstore, forward_cb and backward_cb "
                   "(missing: %s%s%s%s%s)",
                   c->schedule ? "" : "schedule ", c->backend ? "" : "backend ", c->wstore ? "" : "wstore ",
                   c->forward_cb ? "" : "forward_cb ", c->backward_cb ? "" : "backward_cb");
  if (has_pairs && !c->alloc_cb != !c->free_cb)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_runner_config_t: alloc_cb and free_cb go together (got %s without %s)",
                   c->alloc_cb ? "alloc_cb" : "free_cb", c->alloc_cb ? "free_cb" : "alloc_cb");
  zb_schedule_info_t info;
  ZB_CHECK(zb_schedule_get_info(c->schedule, &info));
  if (c->rank < 0 || c->rank >= info.ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "runner rank %d is outside the schedule's ranks 0..%d",
                   (int)c->rank, (int)info.ranks - 1);
  if (info.ranks > 1 && !c->transport)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the schedule has %d ranks, so the runner needs a transport (zb_runner_config_t.transport)",
                   (int)info.ranks);
  for (int32_t q = 0; !has_copies && q < info.ranks; q++) { /* every rank alike: each refuses */
    const zb_op_t *ops;
    int32_t n = 0;
    ZB_CHECK(zb_schedule_rank_ops(c->schedule, q, &ops, &n));
    for (int32_t k = 0; k < n; k++)
      if (ops[k].type == ZB_OP_OFFLOAD || ops[k].type == ZB_OP_RELOAD)
        return ZB_FAIL(ZB_ERR_UNSUPPORTED,
                       "rank %d, position %d: the schedule has %s ops (PipeOffload's copies), but the "
                       "zb_runner_config_t passed (struct_size %u) predates copy_cb; build against this zbpp.h",
                       (int)q, (int)k, ops[k].type == ZB_OP_OFFLOAD ? "OFFLOAD" : "RELOAD",
                       (unsigned)c->struct_size);
  }
  for (int32_t q = 0; q < info.ranks; q++) { /* every rank alike: each refuses */
    const zb_op_t *ops;
    int32_t n = 0;
    ZB_CHECK(zb_schedule_rank_ops(c->schedule, q, &ops, &n));
    for (int32_t k = 0; k < n; k++)
      if (zb__runner_op_is_vocab(ops[k].type) && !(has_vocab && c->vocab_cb))
        return ZB_FAIL(has_vocab ? ZB_ERR_INVALID_ARGUMENT : ZB_ERR_UNSUPPORTED,
                       "rank %d, position %d: the schedule has Vocabulary Parallelism's passes (S, T, IF, IB), which "
                       "the runner runs through zb_runner_config_t.vocab_cb; %s",
                       (int)q, (int)k, has_vocab ? "set it" : "the config passed predates it: build against this zbpp.h");
  }
  if (has_pairs && c->pair_first && c->n_pairs > 0) {
    const zb_op_t *mine;
    int32_t nm = 0;
    ZB_CHECK(zb_schedule_rank_ops(c->schedule, c->rank, &mine, &nm));
    for (int32_t j = 0; j < c->n_pairs; j++) {
      const int32_t k = c->pair_first[j];
      for (int32_t d = 0; d < 2 && k >= 0 && k + d < nm; d++)
        if (zb__runner_op_is_vocab(mine[k + d].type))
          return ZB_FAIL(ZB_ERR_UNSUPPORTED, "zb_runner_config_t: pair %d (ops %d and %d) holds a Vocabulary "
                         "Parallelism pass; pairs run two ops of stages, not passes", (int)j, (int)k, (int)k + 1);
    }
  }
  if (c->transport && (c->transport->ranks != info.ranks || c->transport->rank != c->rank))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the transport is rank %d of %d but the runner is rank %d of the schedule's %d",
                   (int)c->transport->rank, (int)c->transport->ranks, (int)c->rank, (int)info.ranks);
  if (info.stages > 1) {
    for (int32_t b = 0; b < info.stages - 1; b++) {
      int64_t v = c->boundary_bytes ? c->boundary_bytes[b] : c->boundary_bytes_all;
      if (v < 0)
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                       "activation size between stage %d and %d is %lld bytes; it must be >= 0",
                       (int)b, (int)b + 1, (long long)v);
    }
  }
  /* The runner trusts the op lists (FIFO channels, no deadlock), so it checks them once here. */
  ZB_CHECK(zb_schedule_validate(c->schedule));
  if (c->transport) ZB_CHECK(zb__transport_bind(c->transport, c->backend));
  if (c->transport && c->transport->ops->plan) ZB_CHECK(c->transport->ops->plan(c->transport, c->schedule));

  zb_runner_t *r = calloc(1, sizeof(*r));
  if (!r) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a runner");
  r->rank = c->rank, r->p = info.ranks, r->S = info.stages, r->m = info.microbatches;
  r->schedule = c->schedule, r->be = c->backend, r->tr = c->transport, r->ws = c->wstore;
  r->forward = c->forward_cb, r->backward = c->backward_cb, r->user = c->user;
  if (has_pairs) r->alloc_cb = c->alloc_cb, r->free_cb = c->free_cb, r->alloc_user = c->alloc_user;
  if (has_release) r->release_cb = c->release_cb;
  r->lend_k = -1;
  r->timeout = c->timeout_s > 0 ? c->timeout_s : 300.0;
  r->depth = c->recv_depth > 0 ? c->recv_depth : 4;
  r->T = r->S > 1 ? 2 * (r->S - 1) : 0; /* channels: the pool ids plan() gives ops depend on it */
  zb__backend_ref(r->be);
  zb__transport_ref(r->tr);
  zb_status_t st = zb_schedule_rank_ops(c->schedule, c->rank, &r->ops, &r->n);
  size_t n = (size_t)(r->n ? r->n : 1), slots = (size_t)(r->S > 1 ? r->S - 1 : 1) * 2 * (size_t)r->m;
  if (st == ZB_OK) {
    r->io = calloc(n, sizeof(op_io_t));
    r->start = calloc(n, sizeof(double));
    r->end = calloc(n, sizeof(double));
    r->recv_op = calloc(n, sizeof(int32_t));
    r->recv_req = calloc(n, sizeof(zb__request_t));
    r->recv_buf = calloc(n, sizeof(void *));
    r->local = calloc(slots, sizeof(void *));
    if (r->release_cb) {
      r->local_token = calloc(slots, sizeof(uint64_t));
      r->held = calloc((size_t)r->S * 2 * (size_t)r->m, sizeof(held_t)); /* 2 per (stage, mb) */
      if (!r->local_token || !r->held) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for rank %d", (int)r->rank);
    }
    if (!r->io || !r->start || !r->end || !r->recv_op || !r->recv_req || !r->recv_buf || !r->local)
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning %d ops for rank %d", (int)r->n, (int)r->rank);
  }
  if (st == ZB_OK) st = plan(r, c);
  if (st == ZB_OK && has_pairs && c->n_pairs > 0 && r->release_cb)
    st = ZB_FAIL(ZB_ERR_UNSUPPORTED, "zb_runner_config_t: release_cb (zero-copy stages) does not go with pair_first");
  if (st == ZB_OK && has_pairs && c->n_pairs > 0) st = plan_pairs(r, c->pair_first, c->n_pairs);
  if (st == ZB_OK) st = zb__runner_plan_buffers(r, c);
  if (st == ZB_OK && has_copies) st = zb__copies_plan(r, c->copy_cb, c->copy_time_scale, c->copy_inline);
  if (has_vocab) r->vocab_cb = c->vocab_cb;
  if (st == ZB_OK && r->be->ops->timing_event_create) {
    r->ev_op = calloc(2 * n, sizeof(zb__event_t *));
    if (!r->ev_op) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d timing events", 2 * (int)n);
    if (st == ZB_OK) st = r->be->ops->timing_event_create(r->be, &r->ev_base);
    for (int32_t k = 0; k < 2 * r->n && st == ZB_OK; k++) st = r->be->ops->timing_event_create(r->be, &r->ev_op[k]);
  }
  if (st != ZB_OK) {
    zb_runner_destroy(r);
    return st;
  }
  *out = r;
  return ZB_OK;
}

/* ---- one iteration --------------------------------------------------------------------------- */

static zb_status_t post_recv(zb_runner_t *r, int32_t j) {
  const op_io_t *io = &r->io[r->recv_op[j]];
  ZB_CHECK(zb__runner_pool_get(r, io->in_pool, &r->recv_buf[j]));
  return zb__transport_irecv(r->tr, &r->recv_req[j], io->in_peer, io->in_tag, r->recv_buf[j], io->in_bytes);
}

/* Undoes whatever the failed iteration left: requests, buffers, W-store entries. */
static void cleanup_after_failure(zb_runner_t *r) {
  zb__copies_stop(r);
  for (int32_t j = 0; j < r->n_recv; j++) {
    if (r->recv_req[j].active) zb__transport_cancel(r->tr, &r->recv_req[j]);
    if (r->recv_buf[j]) zb__runner_pool_put(r, r->io[r->recv_op[j]].in_pool, r->recv_buf[j]);
    r->recv_buf[j] = NULL;
  }
  for (int32_t j = 0; j < r->n_send_tags; j++)
    for (int32_t t = r->send_tags[j]; r->sendq[t].count > 0;) {
      send_t *sd = &r->sendq[t].ring[r->sendq[t].head];
      if (sd->req.active) zb__transport_cancel(r->tr, &sd->req);
      zb__runner_drop_front(r, t);
    }
  size_t slots = (size_t)(r->S > 1 ? r->S - 1 : 1) * 2 * (size_t)r->m;
  for (size_t k = 0; k < slots; k++)
    if (r->local[k]) {
      if (r->release_cb)
        r->release_cb(r->user, r->local_token[k]);
      else
        zb__runner_pool_put(r, pool_id(r, POOL_LOCAL, (int32_t)(k / (size_t)r->m)), r->local[k]);
      r->local[k] = NULL;
    }
  zb__runner_release_held(r, -1, -1);
  zb_wstore_clear(r->ws);
}

/* Copies the current thread's error text (without its file:line), to quote it in a wider message. */
static void take_error(char *buf, size_t cap) { snprintf(buf, cap, "%s", zb__error_body()); }

static zb_status_t run_compute(zb_runner_t *r, const zb_op_t *op, const void *in, void *out) {
  zb_status_t st = ZB_OK;
  char inner[1536];
  const char *what = op->type == ZB_OP_F ? "forward" : "backward";
  zb__clear_error();
  const int32_t k = (int32_t)(op - r->ops);
  r->lend_got = 0;
  switch (op->type) {
    case ZB_OP_F:
      r->lend_k = k; /* zb_runner_lend_output's window: the callback, nothing else */
      st = r->forward(r->user, op->stage, op->mb, in, out);
      r->lend_k = -1;
      break;
    case ZB_OP_S:
    case ZB_OP_T:
    case ZB_OP_IF:
    case ZB_OP_IB:
      what = "vocabulary pass";
      st = r->vocab_cb(r->user, op->type, op->mb);
      break;
    case ZB_OP_B:
    case ZB_OP_BW:
      ZB_CHECK(zb_wstore_begin(r->ws, op->stage, op->mb));
      r->lend_k = k;
      st = r->backward(r->user, op->stage, op->mb, in, out);
      r->lend_k = -1;
      ZB_CHECK(zb_wstore_end(r->ws));
      if (st == ZB_OK && op->type == ZB_OP_BW) {
        what = "W part of the fused backward";
        st = zb__wstore_pop_run_mb(r->ws, op->stage, op->mb);
        if (st != ZB_OK) {
          take_error(inner, sizeof inner);
          return ZB_FAIL(st, "the %s failed: %s", what, inner);
        }
      }
      break;
    default:
      st = zb__wstore_pop_run_mb(r->ws, op->stage, op->mb);
      if (st != ZB_OK) {
        take_error(inner, sizeof inner);
        return ZB_FAIL(st, "the W store failed: %s", inner);
      }
      return ZB_OK;
  }
  if (st != ZB_OK) {
    take_error(inner, sizeof inner);
    return ZB_FAIL(st, "the %s callback returned %s%s%s", what, zb_status_string(st),
                   inner[0] ? ": " : "", inner);
  }
  return ZB_OK;
}

/* Keeps recv_depth receives posted beyond the ones consumed (`consumed`: how many were waited
 * for). On a host-ordered transport it runs after an op's compute, not between its input's arrival
 * and its compute: the post (a buffer from the pool, the transport's irecv) then stays off the path
 * from arrival to compute, and the receive it posts is still depth - 1 ops ahead of the op that
 * needs it. A device-ordered transport (NCCL: ops->plan) posts as the input arrives, as before: its
 * receive waits on the device for the compute issued before the post, which would then include
 * the op's own. */
static zb_status_t post_ahead(zb_runner_t *r, int32_t *next_post, int32_t consumed) {
  for (; *next_post < r->n_recv && *next_post < consumed + r->depth; (*next_post)++)
    ZB_CHECK(post_recv(r, *next_post));
  return ZB_OK;
}

static int posts_after_compute(const zb_runner_t *r) { return r->tr && !r->tr->ops->plan; }

/* Takes op k's input (waiting for its receive, or the buffer an earlier op of this rank left) and
 * a buffer for its output. On failure the message says what the op was waiting for, and nothing is
 * held. */
static zb_status_t op_acquire(zb_runner_t *r, int32_t k, int32_t *next_post, void **in, uint64_t *in_token,
                              void **out) {
  const zb_op_t *op = &r->ops[k];
  const op_io_t *io = &r->io[k];
  char inner[1536];
  *in = *out = NULL;
  /* A device-ordered transport (NCCL) notices a dead peer off the host's waits; stop at once. */
  if (r->tr && r->tr->ops->check) ZB_CHECK(r->tr->ops->check(r->tr));
  if (io->in_kind == IO_REMOTE) {
    int32_t j = io->recv;
    /* Normally posted long ago (post_ahead); only a pair's second op with recv_depth 1 can get here
     * first on a host-ordered transport. */
    for (; *next_post <= j; (*next_post)++) ZB_CHECK(post_recv(r, *next_post));
    zb_status_t st = zb__transport_wait(r->tr, &r->recv_req[j], r->timeout);
    if (st != ZB_OK) {
      take_error(inner, sizeof inner);
      return ZB_FAIL(st, "waiting for %s from rank %d: %s", op->type == ZB_OP_F ? "the activation" : "the gradient",
                     (int)io->in_peer, inner);
    }
    *in = r->recv_buf[j];
    r->recv_buf[j] = NULL;
    if (!posts_after_compute(r)) {
      st = post_ahead(r, next_post, j + 1);
      if (st != ZB_OK) {
        zb__runner_pool_put(r, io->in_pool, *in);
        *in = NULL;
        return st;
      }
    }
  } else if (io->in_kind == IO_LOCAL) {
    *in = r->local[io->in_slot];
    r->local[io->in_slot] = NULL;
    if (r->local_token) *in_token = r->local_token[io->in_slot];
    if (!*in)
      return ZB_FAIL(ZB_ERR_INTERNAL, "the input this rank should have produced itself is missing");
  }
  if (io->out_kind != IO_NONE && !r->release_cb) { /* with release_cb the callback lends it */
    zb_status_t st = zb__runner_pool_get(r, io->out_pool, out);
    if (st != ZB_OK) {
      zb__runner_pool_put(r, io->in_pool, *in);
      *in = NULL;
      return st;
    }
  }
  return ZB_OK;
}

/* Runs op k's work between its time stamps. */
static zb_status_t op_compute(zb_runner_t *r, int32_t k, const void *in, void *out) {
  /* An offloaded microbatch's backward waits for its RELOAD; the copies after this op in the list
   * start with it (the schedule model's rule). */
  ZB_CHECK(zb__copies_wait(r, k));
  ZB_CHECK(zb__copies_issue(r, k, 0));
  r->start[k] = zb__now();
  zb_status_t st = r->ev_op ? r->be->ops->event_record(r->be, r->ev_op[2 * k]) : ZB_OK;
  if (st == ZB_OK) st = run_compute(r, &r->ops[k], in, out);
  if (st == ZB_OK && r->ev_op) st = r->be->ops->event_record(r->be, r->ev_op[2 * k + 1]);
  r->end[k] = zb__now();
  if (st == ZB_OK && r->ops[k].type == ZB_OP_F) zb__copies_forward_done(r, r->ops[k].stage, r->ops[k].mb);
  if (st == ZB_OK) st = zb__copies_issue(r, k, 1);
  return st;
}

/* Hands op k's output on: to the op of this rank that needs it, or to the transport. */
static zb_status_t op_deliver(zb_runner_t *r, int32_t k, void *out, uint64_t token) {
  const op_io_t *io = &r->io[k];
  char inner[1536];
  if (io->out_kind == IO_LOCAL) {
    r->local[io->out_slot] = out;
    if (r->local_token) r->local_token[io->out_slot] = token;
  } else if (io->out_kind == IO_REMOTE) {
    zb_status_t st = zb__runner_push_send(r, out, token, io);
    if (st != ZB_OK) {
      take_error(inner, sizeof inner);
      return ZB_FAIL(st, "sending the %s to rank %d: %s", r->ops[k].type == ZB_OP_F ? "activation" : "gradient",
                     (int)io->out_peer, inner);
    }
  }
  return ZB_OK;
}

/* Runs op k once its input is there, or, when k starts a pair, ops k and k+1 as one unit: both
 * inputs first, both callbacks back to back, the next receives posted, both outputs after. *ran
 * is how many ops it ran; on failure, 1 + the position in the pair of the op that failed (the
 * caller names that op). */
static zb_status_t run_op(zb_runner_t *r, int32_t k, int32_t *next_post, int32_t *ran) {
  const int32_t count = r->pair_first && r->pair_first[k] ? 2 : 1;
  void *in[2] = {NULL, NULL}, *out[2] = {NULL, NULL};
  uint64_t in_token[2] = {0, 0}, out_token[2] = {0, 0};
  zb_status_t st = ZB_OK;
  int32_t got = 0, failed = -1;
  for (; got < count; got++) {
    st = op_acquire(r, k + got, next_post, &in[got], &in_token[got], &out[got]);
    if (st != ZB_OK) {
      failed = got;
      break;
    }
  }
  for (int32_t j = 0; st == ZB_OK && j < count; j++) {
    r->lend_got = 0;
    st = op_compute(r, k + j, in[j], out[j]);
    if (st != ZB_OK) failed = j;
    if (r->release_cb && r->io[k + j].out_kind != IO_NONE && r->ops[k + j].type != ZB_OP_W) {
      if (r->lend_got) {
        out[j] = r->lend_buf, out_token[j] = r->lend_token;
        if (st != ZB_OK) r->release_cb(r->user, out_token[j]); /* lent, but never delivered */
      } else if (st == ZB_OK) {
        const zb_op_t *op = &r->ops[k + j];
        failed = j;
        st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "the %s callback of stage %d, mb %d returned without zb_runner_lend_output; a runner made "
                     "with release_cb sends the caller's own output buffer",
                     op->type == ZB_OP_F ? "forward" : "backward", (int)op->stage, (int)op->mb);
      }
    }
  }
  for (int32_t j = 0; j < got; j++) zb__runner_release_input(r, k + j, in[j], in_token[j]);
  if (st == ZB_OK && posts_after_compute(r)) {
    /* Before the sends, so the transport sees its requests in the order it did when receives were
     * posted before the compute. */
    int32_t consumed = -1;
    for (int32_t j = 0; j < got; j++)
      if (r->io[k + j].in_kind == IO_REMOTE) consumed = r->io[k + j].recv + 1;
    if (consumed >= 0) st = post_ahead(r, next_post, consumed);
    if (st != ZB_OK) {
      failed = got - 1;
      for (int32_t j = 0; r->release_cb && j < got; j++) /* lent, but never delivered */
        if (r->io[k + j].out_kind != IO_NONE && r->ops[k + j].type != ZB_OP_W) r->release_cb(r->user, out_token[j]);
    }
  }
  for (int32_t j = 0; j < got; j++) {
    if (st == ZB_OK) {
      st = op_deliver(r, k + j, out[j], out_token[j]);
      if (st == ZB_OK) continue;
      failed = j; /* a failed send still owns its buffer (cleanup_after_failure returns it) */
      if (r->io[k + j].out_kind == IO_REMOTE) continue;
    }
    if (!r->release_cb) zb__runner_pool_put(r, r->io[k + j].out_pool, out[j]);
  }
  *ran = st == ZB_OK ? count : failed + 1;
  if (st != ZB_OK) return st;
  return zb__runner_reap_sends(r, 0);
}

zb_status_t zb_runner_run(zb_runner_t *r) {
  ZB_ARG_NOT_NULL(r);
  int32_t pending = 0;
  ZB_CHECK(zb_wstore_pending(r->ws, -1, &pending));
  if (pending > 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "rank %d: the W store already holds %d group(s) before the iteration; they "
                   "would be run by this iteration's W ops (clear it with zb_wstore_clear)",
                   (int)r->rank, (int)pending);
  zb_status_t st = ZB_OK;
  char inner[1536], full[2048];
  int32_t k = 0, next_post = 0;
  if (r->ev_base) {
    r->host_base = zb__now();
    st = r->be->ops->event_record(r->be, r->ev_base);
  }
  for (; st == ZB_OK && next_post < r->n_recv && next_post < r->depth; next_post++) {
    st = post_recv(r, next_post);
    if (st != ZB_OK) break;
  }
  if (st == ZB_OK) st = zb__copies_begin(r);
  if (st == ZB_OK)
    for (k = 0; k < r->n;) {
      int32_t ran = 1;
      if (r->ops[k].type == ZB_OP_OFFLOAD || r->ops[k].type == ZB_OP_RELOAD) {
        k++; /* issued with the compute op before it (zb__copies_issue), run by the lane */
        continue;
      }
      st = run_op(r, k, &next_post, &ran);
      if (st != ZB_OK) {
        k += ran - 1; /* the op that failed, within a pair */
        break;
      }
      k += ran;
    }
  if (st != ZB_OK) {
    const zb_op_t *op = &r->ops[k < r->n ? k : r->n - 1];
    take_error(inner, sizeof inner);
    if (k < r->n && zb__runner_op_is_vocab(op->type)) /* a vocabulary pass: no stage */
      st = ZB_FAIL(st, "rank %d, op %d of %d, %s(mb %d): %s", (int)r->rank, (int)k + 1, (int)r->n,
                   op_name(op->type), (int)op->mb, inner);
    else if (k < r->n)
      st = ZB_FAIL(st, "rank %d, op %d of %d, %s(stage %d, mb %d): %s", (int)r->rank, (int)k + 1,
                   (int)r->n, op_name(op->type), (int)op->stage, (int)op->mb, inner);
    else
      st = ZB_FAIL(st, "rank %d, before its first op: %s", (int)r->rank, inner);
    goto fail;
  }

  st = zb__runner_reap_sends(r, r->timeout);
  if (st != ZB_OK) {
    take_error(inner, sizeof inner);
    st = ZB_FAIL(st, "rank %d, after its last op, waiting for its sends to leave: %s", (int)r->rank, inner);
    goto fail;
  }
  st = zb__copies_end(r);
  if (st != ZB_OK) {
    take_error(inner, sizeof inner);
    st = ZB_FAIL(st, "rank %d: %s", (int)r->rank, inner);
    goto fail;
  }
  ZB_CHECK_GOTO(r->be->ops->sync(r->be), st, fail);
  /* With NCCL the compute stream waited for the receives on the device; a receive that never came
   * was ended by the watchdog's abort, which the transport reports now. */
  if (r->tr && r->tr->ops->check) {
    st = r->tr->ops->check(r->tr);
    if (st != ZB_OK) {
      take_error(inner, sizeof inner);
      st = ZB_FAIL(st, "rank %d, after its last op: %s", (int)r->rank, inner);
      goto fail;
    }
  }
  /* Device timestamps replace the host's issue times once the device has finished. */
  for (int32_t j = 0; r->ev_base && j < r->n; j++) {
    if (r->ops[j].type == ZB_OP_OFFLOAD || r->ops[j].type == ZB_OP_RELOAD) continue; /* host stamps */
    double a = 0, b = 0;
    ZB_CHECK_GOTO(r->be->ops->elapsed(r->be, r->ev_base, r->ev_op[2 * j], &a), st, fail);
    ZB_CHECK_GOTO(r->be->ops->elapsed(r->be, r->ev_base, r->ev_op[2 * j + 1], &b), st, fail);
    r->start[j] = r->host_base + a, r->end[j] = r->host_base + b;
  }
  zb__runner_release_held(r, -1, -1); /* inputs of microbatches without a W here (forward-only runs) */
  ZB_CHECK_GOTO(zb_wstore_pending(r->ws, -1, &pending), st, fail);
  if (pending > 0) {
    st = ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                 "rank %d: the W store still holds %d group(s) at the end of the iteration; the "
                 "schedule has fewer W ops than B ops on this rank",
                 (int)r->rank, (int)pending);
    goto fail;
  }
  return ZB_OK;

fail:
  snprintf(full, sizeof full, "%s", zb_last_error());
  if (r->tr) r->tr->ops->abort(r->tr, zb__error_body());
  cleanup_after_failure(r);
  /* The abort and the cleanup must not replace the message that says what went wrong. */
  zb__error_restore(full);
  return st;
}

zb_status_t zb_runner_lend_output(zb_runner_t *r, void *buf, uint64_t token) {
  ZB_ARG_NOT_NULL(r);
  if (!r->release_cb)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_runner_lend_output: rank %d's runner was made without release_cb; its callbacks write "
                   "into the output buffer they are given",
                   (int)r->rank);
  if (r->lend_k < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_runner_lend_output is called from a forward or backward callback");
  const zb_op_t *op = &r->ops[r->lend_k];
  const op_io_t *io = &r->io[r->lend_k];
  if (io->out_kind == IO_NONE)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_runner_lend_output: %s(stage %d, mb %d) has no output to hand on (the last stage's forward "
                   "and the first stage's backward have none)",
                   op_name(op->type), (int)op->stage, (int)op->mb);
  if (r->lend_got)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_runner_lend_output: called twice for %s(stage %d, mb %d)",
                   op_name(op->type), (int)op->stage, (int)op->mb);
  if (!buf && io->out_bytes > 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_runner_lend_output: NULL for an output of %zu bytes", io->out_bytes);
  r->lend_got = 1, r->lend_buf = buf, r->lend_token = token;
  return ZB_OK;
}

zb_status_t zb_runner_times(const zb_runner_t *r, const double **start, const double **end, int32_t *count) {
  ZB_ARG_NOT_NULL(r);
  if (start) *start = r->start;
  if (end) *end = r->end;
  if (count) *count = r->n;
  return ZB_OK;
}
