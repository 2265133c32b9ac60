/*
 * bufplan.c - how many message buffers one rank's runner needs per channel, from the op lists.
 *
 * Why: a runner that allocates when it runs dry allocates mid-iteration (cudaMalloc, and cudaFree
 * synchronises the device: the classic way to stall NCCL kernels waiting on a peer), and its pool
 * grows with how far the host runs ahead instead of with the schedule. The schedule already says
 * how many buffers each channel can ever need, so the runner allocates exactly those at creation.
 *
 * Channels are the tags of zb__tag_fwd/zb__tag_bwd (one per boundary and direction); each kind of
 * buffer is counted per tag:
 *  - sends: a send's buffer is held from its op until the send completes, which is at the latest
 *    when the receiver's op consumes the message. A happens-before sweep (vector clocks over every
 *    rank's op list, messages as edges) gives, at each of this rank's sends, the receiver ops that
 *    must have completed before it, so the messages they consumed are certainly free; the rest may
 *    still be in flight. The bound is the largest such count: what a host running ahead as far as
 *    the dependencies allow can hold, whatever the timing.
 *  - receives: posted `depth` ahead in op order and held until the op that consumes them has run:
 *    the largest number of the tag's receives in any window of depth + 2 consecutive receives (2:
 *    a pair of ops holds both inputs).
 *  - local hand-offs (both stages on this rank): held from the producing op to the consuming one;
 *    the largest number alive at once in op order (a pair holds its inputs until both ops ran).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

zb_status_t zb__op_links(const zb_schedule_t *s, int32_t S, const zb_op_t *op, zb__link_t *in, zb__link_t *out) {
  const int32_t st = op->stage;
  in->tag = out->tag = -1;
  in->peer = out->peer = -1;
  if (op->type == ZB_OP_F) {
    if (st > 0) in->tag = zb__tag_fwd(st - 1), in->peer = st - 1;
    if (st < S - 1) out->tag = zb__tag_fwd(st), out->peer = st + 1;
  } else if (op->type == ZB_OP_B || op->type == ZB_OP_BW) {
    if (st < S - 1) in->tag = zb__tag_bwd(st), in->peer = st + 1;
    if (st > 0) out->tag = zb__tag_bwd(st - 1), out->peer = st - 1;
  }
  /* peer holds the stage at the other end so far; the rank that holds it: */
  if (in->tag >= 0) ZB_CHECK(zb_schedule_stage_rank(s, in->peer, &in->peer));
  if (out->tag >= 0) ZB_CHECK(zb_schedule_stage_rank(s, out->peer, &out->peer));
  return ZB_OK;
}

/* An op's channels as the plan counts them: across ranks (in_tag, out_tag) or on this rank
 * (in_local, out_local); -1 where the op has none of that kind. */
static void op_channels(const zb_schedule_t *s, int32_t S, const zb_op_t *op, int32_t rank, int32_t *in_tag,
                        int32_t *out_tag, int32_t *in_local, int32_t *out_local) {
  zb__link_t in, out;
  *in_tag = *out_tag = *in_local = *out_local = -1;
  if (zb__op_links(s, S, op, &in, &out) != ZB_OK) return; /* stages were checked when the schedule was made */
  if (in.tag >= 0) *(in.peer == rank ? in_local : in_tag) = in.tag;
  if (out.tag >= 0) *(out.peer == rank ? out_local : out_tag) = out.tag;
}

/* A FIFO of vector clocks (p values each): the clocks of messages sent and not yet received. */
typedef struct {
  int32_t *vc;
  int32_t head, count, cap;
} vcq_t;

static int vcq_push(vcq_t *q, const int32_t *vc, int32_t p) {
  if (q->count == q->cap) {
    int32_t cap = q->cap ? 2 * q->cap : 8;
    int32_t *nv = malloc((size_t)cap * (size_t)p * sizeof(int32_t));
    if (!nv) return -1;
    for (int32_t k = 0; k < q->count; k++)
      memcpy(nv + (size_t)k * p, q->vc + (size_t)((q->head + k) % q->cap) * p, (size_t)p * sizeof(int32_t));
    free(q->vc);
    q->vc = nv, q->cap = cap, q->head = 0;
  }
  memcpy(q->vc + (size_t)((q->head + q->count) % q->cap) * p, vc, (size_t)p * sizeof(int32_t));
  q->count++;
  return 0;
}

static const int32_t *vcq_pop(vcq_t *q, int32_t p) {
  const int32_t *v = q->vc + (size_t)q->head * p;
  q->head = (q->head + 1) % q->cap;
  q->count--;
  return v; /* valid until the next push */
}

/* Send bounds by the happens-before sweep; sends[t] for this rank's tags. */
static zb_status_t send_bounds(const zb_schedule_t *s, int32_t p, int32_t S, int32_t me, int32_t *sends) {
  const int32_t T = 2 * (S - 1);
  zb_status_t st = ZB_OK;
  const zb_op_t **ops = calloc((size_t)p, sizeof *ops);
  int32_t *n = calloc((size_t)p, sizeof *n), *pos = calloc((size_t)p, sizeof *pos);
  int32_t *vc = calloc((size_t)p * (size_t)p, sizeof *vc); /* vc[q*p + x]: x's ops done before q's point */
  vcq_t *fifo = calloc((size_t)T, sizeof *fifo);
  int32_t *sent = calloc((size_t)T, sizeof *sent);
  int32_t **recv_prefix = calloc((size_t)T, sizeof *recv_prefix); /* receiver's receives of t in its first k ops */
  int32_t *receiver = calloc((size_t)T, sizeof *receiver);
  if (!ops || !n || !pos || !vc || !fifo || !sent || !recv_prefix || !receiver) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning the runner's buffers");
    goto done;
  }
  for (int32_t q = 0; q < p && st == ZB_OK; q++) st = zb_schedule_rank_ops(s, q, &ops[q], &n[q]);
  if (st != ZB_OK) goto done;
  for (int32_t t = 0; t < T; t++) receiver[t] = -1;
  for (int32_t q = 0; q < p; q++)
    for (int32_t k = 0; k < n[q]; k++) {
      int32_t it, ot, il, ol;
      op_channels(s, S, &ops[q][k], q, &it, &ot, &il, &ol);
      if (it >= 0) receiver[it] = q;
    }
  for (int32_t t = 0; t < T; t++) {
    int32_t q = receiver[t];
    if (q < 0) continue;
    recv_prefix[t] = calloc((size_t)n[q] + 1, sizeof(int32_t));
    if (!recv_prefix[t]) {
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning the runner's buffers");
      goto done;
    }
    for (int32_t k = 0; k < n[q]; k++) {
      int32_t it, ot, il, ol;
      op_channels(s, S, &ops[q][k], q, &it, &ot, &il, &ol);
      recv_prefix[t][k + 1] = recv_prefix[t][k] + (it == t);
    }
  }
  /* Execute every rank's list as far as its receives allow, over and over: a validated schedule
   * finishes (no deadlock), and each op's clock is what must have happened before it. */
  for (int progress = 1; progress;) {
    progress = 0;
    for (int32_t q = 0; q < p; q++) {
      int32_t *mine = vc + (size_t)q * p;
      while (pos[q] < n[q]) {
        int32_t it, ot, il, ol;
        op_channels(s, S, &ops[q][pos[q]], q, &it, &ot, &il, &ol);
        if (it >= 0) {
          if (fifo[it].count == 0) break;
          const int32_t *got = vcq_pop(&fifo[it], p);
          for (int32_t x = 0; x < p; x++)
            if (got[x] > mine[x]) mine[x] = got[x];
        }
        mine[q] = ++pos[q];
        if (ot >= 0) {
          if (vcq_push(&fifo[ot], mine, p) != 0) {
            st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning the runner's buffers");
            goto done;
          }
          if (q == me) {
            int32_t dst = receiver[ot];
            int32_t done_there = dst >= 0 ? recv_prefix[ot][mine[dst]] : 0;
            int32_t in_flight = ++sent[ot] - done_there;
            if (in_flight > sends[ot]) sends[ot] = in_flight;
          }
        }
        progress = 1;
      }
    }
  }
  for (int32_t q = 0; q < p; q++)
    if (pos[q] < n[q]) { /* cannot happen after validation; plan for every send being in flight */
      for (int32_t k = 0; k < n[me]; k++) {
        int32_t it, ot, il, ol;
        op_channels(s, S, &ops[me][k], me, &it, &ot, &il, &ol);
        if (ot >= 0) sends[ot] = 0;
      }
      for (int32_t k = 0; k < n[me]; k++) {
        int32_t it, ot, il, ol;
        op_channels(s, S, &ops[me][k], me, &it, &ot, &il, &ol);
        if (ot >= 0) sends[ot]++;
      }
      break;
    }
done:
  if (fifo)
    for (int32_t t = 0; t < T; t++) free(fifo[t].vc);
  if (recv_prefix)
    for (int32_t t = 0; t < T; t++) free(recv_prefix[t]);
  free(ops), free(n), free(pos), free(vc), free(fifo), free(sent), free(recv_prefix), free(receiver);
  return st;
}

zb_status_t zb__runner_buffer_plan(const zb_schedule_t *s, int32_t rank, int32_t depth, const uint8_t *pair_first,
                                   int32_t *sends, int32_t *recvs, int32_t *locals) {
  zb_schedule_info_t info;
  ZB_CHECK(zb_schedule_get_info(s, &info));
  const int32_t S = info.stages, T = S > 1 ? 2 * (S - 1) : 0;
  memset(sends, 0, (size_t)(T ? T : 1) * sizeof(int32_t));
  memset(recvs, 0, (size_t)(T ? T : 1) * sizeof(int32_t));
  memset(locals, 0, (size_t)(T ? T : 1) * sizeof(int32_t));
  if (T == 0) return ZB_OK;
  const zb_op_t *ops;
  int32_t n;
  ZB_CHECK(zb_schedule_rank_ops(s, rank, &ops, &n));

  /* Local hand-offs and the order of this rank's receives. */
  int32_t *alive = calloc((size_t)T, sizeof(int32_t)), *order = calloc((size_t)(n ? n : 1), sizeof(int32_t));
  if (!alive || !order) {
    free(alive), free(order);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning the runner's buffers");
  }
  int32_t n_recv = 0;
  for (int32_t k = 0; k < n;) {
    int32_t unit = pair_first && pair_first[k] && k + 1 < n ? 2 : 1;
    int32_t ins[2] = {-1, -1};
    for (int32_t j = 0; j < unit; j++) {
      int32_t it, ot, il, ol;
      op_channels(s, S, &ops[k + j], rank, &it, &ot, &il, &ol);
      if (it >= 0) order[n_recv++] = it;
      ins[j] = il;
      if (ol >= 0 && ++alive[ol] > locals[ol]) locals[ol] = alive[ol];
    }
    for (int32_t j = 0; j < unit; j++)
      if (ins[j] >= 0) alive[ins[j]]--;
    k += unit;
  }
  /* Receives: the most of one tag among any depth + 2 consecutive receives. */
  const int32_t window = (depth > 0 ? depth : 1) + 2;
  memset(alive, 0, (size_t)T * sizeof(int32_t));
  for (int32_t j = 0; j < n_recv; j++) {
    if (++alive[order[j]] > recvs[order[j]]) recvs[order[j]] = alive[order[j]];
    if (j + 1 >= window) alive[order[j + 1 - window]]--;
  }
  free(alive), free(order);
  return send_bounds(s, info.ranks, S, rank, sends);
}

zb_status_t zb__runner_held_inputs(const zb_schedule_t *s, int32_t rank, int32_t *held) {
  zb_schedule_info_t info;
  ZB_CHECK(zb_schedule_get_info(s, &info));
  const int32_t S = info.stages, m = info.microbatches, T = S > 1 ? 2 * (S - 1) : 0;
  const zb_op_t *ops;
  int32_t n;
  ZB_CHECK(zb_schedule_rank_ops(s, rank, &ops, &n));
  int32_t *cur = calloc((size_t)(T ? T : 1), sizeof *cur);
  int32_t *tag_of = malloc((size_t)S * (size_t)m * 2 * sizeof *tag_of); /* (stage, mb, F/B) -> tag held or -1 */
  if (!cur || !tag_of) {
    free(cur), free(tag_of);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory planning the runner's buffers");
  }
  for (size_t k = 0; k < (size_t)S * (size_t)m * 2; k++) tag_of[k] = -1;
  for (int32_t t = 0; t < T; t++) held[t] = 0;
  zb_status_t st = ZB_OK;
  for (int32_t k = 0; k < n && st == ZB_OK; k++) {
    const zb_op_t *op = &ops[k];
    size_t key = ((size_t)op->stage * (size_t)m + (size_t)op->mb) * 2;
    zb__link_t in, out;
    st = zb__op_links(s, S, op, &in, &out);
    if (st != ZB_OK) break;
    if (op->type != ZB_OP_W && in.tag >= 0 && in.peer != rank) {
      int32_t t = in.tag;
      tag_of[key + (op->type == ZB_OP_F ? 0 : 1)] = t;
      if (++cur[t] > held[t]) held[t] = cur[t];
    }
    if (op->type == ZB_OP_W || op->type == ZB_OP_BW)
      for (int j = 0; j < 2; j++)
        if (tag_of[key + j] >= 0) cur[tag_of[key + j]]--, tag_of[key + j] = -1;
  }
  free(cur), free(tag_of);
  return st;
}
