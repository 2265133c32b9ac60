/*
 * pairorder.c - the order in which two ranks issue the transfers between them on one communicator.
 *
 * The NCCL transport (csrc/cuda/transport_nccl.c) gives every pair of ranks that exchange data one
 * communicator, whose operations NCCL runs one after another on both ends. Activations one way and
 * gradients the other (and, under V or interleaved placement, the channels of several boundaries)
 * then share one queue, so both ranks must issue them in the same order, or each waits for a
 * transfer the other has queued behind the one it waits for. This file computes that order from
 * the schedule alone, so both ranks get it without talking.
 *
 * The order: every transfer is keyed by the simulated start of the op that consumes it (unit op
 * durations; any positive durations would do), ties broken by the consuming rank, the channel and
 * the message's index on it. Why that order never deadlocks, on the host or on the device, with a
 * runner that posts receives in op order and sends right after the producing op:
 *   - A rank that waits for a receive consumed by op c has already posted everything that comes
 *     before it in the order: receives consumed before c (posted in op order), and sends consumed
 *     no later than c starts, whose producing op ended by then, so came before c on this rank.
 *   - On the device, give each op its simulated start and each transfer its key. A transfer needs
 *     its producer (ended before the key), the receiver's compute issued before the receive was
 *     posted (before the consumer's start), and the transfers before it on the communicator (keys
 *     no larger). An op needs its input (key equal to its start) and the ops before it (earlier).
 *     Every dependency points to an equal or earlier time, and among equal times only from an op to
 *     its input and from a transfer to earlier ones in the order: no cycle.
 * Ops the runner runs as a pair (both inputs waited before the first runs) are not covered: the
 * second op's input may come after the first op's output in the order.
 *
 * What it is not: a transport. It only computes indices; the NCCL transport issues by them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../schedule/internal.h"
#include "internal.h"

typedef struct {
  int32_t src, dst, tag, k;
  double key;
} xfer_t;

static int cmp_xfer(const void *pa, const void *pb) {
  const xfer_t *a = pa, *b = pb;
  if (a->key != b->key) return a->key < b->key ? -1 : 1;
  if (a->dst != b->dst) return a->dst < b->dst ? -1 : 1;
  if (a->tag != b->tag) return a->tag < b->tag ? -1 : 1;
  return (a->k > b->k) - (a->k < b->k);
}

void zb__pair_order_free(zb__pair_order_t *o) {
  if (!o) return;
  if (o->chans)
    for (int32_t t = 0; t < o->n_tags; t++) free(o->chans[t].seq);
  free(o->chans);
  free(o->pairs);
  memset(o, 0, sizeof *o);
}

zb_status_t zb__pair_list(const zb_schedule_t *s, int32_t *n_pairs, int32_t (**pairs)[2], int32_t **round,
                          int32_t *n_rounds) {
  *n_pairs = 0, *pairs = NULL, *round = NULL, *n_rounds = 0;
  const int32_t p = s->p, S = s->S;
  uint8_t *adj = calloc((size_t)p * (size_t)p, 1);
  if (!adj) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory listing rank pairs");
  for (int32_t b = 0; b + 1 < S; b++) {
    int32_t x, y;
    zb_status_t st = zb_schedule_stage_rank(s, b, &x);
    if (st == ZB_OK) st = zb_schedule_stage_rank(s, b + 1, &y);
    if (st != ZB_OK) {
      free(adj);
      return st;
    }
    if (x != y) adj[(size_t)(x < y ? x : y) * p + (x < y ? y : x)] = 1;
  }
  int32_t n = 0;
  for (size_t k = 0; k < (size_t)p * p; k++) n += adj[k];
  int32_t(*pr)[2] = malloc((size_t)(n ? n : 1) * sizeof *pr);
  int32_t *rd = malloc((size_t)(n ? n : 1) * sizeof *rd);
  /* used[round * p + rank]: rank already has a pair in that round; at most n rounds */
  uint8_t *used = calloc((size_t)(n ? n : 1) * (size_t)p, 1);
  if (!pr || !rd || !used) {
    free(adj), free(pr), free(rd), free(used);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory listing rank pairs");
  }
  int32_t i = 0, rounds = 0;
  for (int32_t a = 0; a < p; a++)
    for (int32_t b = a + 1; b < p; b++) {
      if (!adj[(size_t)a * p + b]) continue;
      /* Greedy edge colouring: the first round where neither rank has a pair yet. A rank takes
       * part in one split per round, so its pairs must fall in different rounds. */
      int32_t r = 0;
      while (used[(size_t)r * p + a] || used[(size_t)r * p + b]) r++;
      used[(size_t)r * p + a] = used[(size_t)r * p + b] = 1;
      if (r + 1 > rounds) rounds = r + 1;
      pr[i][0] = a, pr[i][1] = b, rd[i] = r;
      i++;
    }
  free(adj), free(used);
  *n_pairs = n, *pairs = pr, *round = rd, *n_rounds = rounds;
  return ZB_OK;
}

zb_status_t zb__pair_order_make(const zb_schedule_t *s, int32_t rank, zb__pair_order_t *o) {
  memset(o, 0, sizeof *o);
  const int32_t p = s->p, S = s->S, T = S > 1 ? 2 * (S - 1) : 0;
  if (rank < 0 || rank >= p)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "pair order for rank %d of a %d-rank schedule", (int)rank, (int)p);
  ZB_CHECK(zb__validate_structure(s));
  zb_status_t st = ZB_OK;
  size_t n_ops = (size_t)(s->n_ops ? s->n_ops : 1);
  double *dur = malloc(n_ops * sizeof *dur), *start = malloc(n_ops * sizeof *start),
         *end = malloc(n_ops * sizeof *end);
  int32_t *nrecv = calloc((size_t)p * (size_t)(T ? T : 1), sizeof *nrecv);
  xfer_t *xf = malloc(n_ops * sizeof *xf);
  o->n_tags = T;
  o->chans = calloc((size_t)(T ? T : 1), sizeof *o->chans);
  o->pairs = calloc((size_t)p, sizeof *o->pairs);
  if (!dur || !start || !end || !nrecv || !xf || !o->chans || !o->pairs) {
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory ordering the transfers of %d ops", s->n_ops);
    goto done;
  }
  for (size_t k = 0; k < (size_t)s->n_ops; k++) dur[k] = 1.0;
  ZB_CHECK_GOTO(zb__simulate_durations(s, dur, start, end), st, done);

  /* Every transfer that involves this rank, named from its receiving end: the k-th receive of a
   * channel is the k-th send of it (channels are FIFO). */
  size_t n = 0;
  for (int32_t q = 0; q < p; q++)
    for (int32_t i = s->rank_off[q]; i < s->rank_off[q + 1]; i++) {
      zb__link_t in, out;
      ZB_CHECK_GOTO(zb__op_links(s, S, &s->ops[i], &in, &out), st, done);
      if (in.tag < 0 || in.peer == q) continue;
      int32_t k = nrecv[(size_t)q * T + in.tag]++;
      if (q != rank && in.peer != rank) continue;
      xf[n].src = in.peer, xf[n].dst = q, xf[n].tag = in.tag, xf[n].k = k, xf[n].key = start[i];
      n++;
    }
  qsort(xf, n, sizeof *xf, cmp_xfer);

  for (int32_t t = 0; t < T; t++) o->chans[t].pair = -1;
  for (size_t j = 0; j < n; j++) {
    int32_t peer = xf[j].src == rank ? xf[j].dst : xf[j].src;
    int32_t pi = 0;
    while (pi < o->n_pairs && o->pairs[pi].peer != peer) pi++;
    if (pi == o->n_pairs) o->pairs[o->n_pairs++].peer = peer;
    zb__pair_chan_t *c = &o->chans[xf[j].tag];
    if (c->pair < 0) {
      c->pair = pi, c->peer = peer, c->is_send = xf[j].src == rank;
      c->count = xf[j].src == rank ? -1 : nrecv[(size_t)rank * T + xf[j].tag];
      if (c->count < 0) c->count = nrecv[(size_t)peer * T + xf[j].tag];
      c->seq = malloc((size_t)c->count * sizeof *c->seq);
      if (!c->seq) {
        st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory ordering the transfers");
        goto done;
      }
    }
    c->seq[xf[j].k] = o->pairs[pi].length++;
  }
done:
  free(dur), free(start), free(end), free(nrecv), free(xf);
  if (st != ZB_OK) zb__pair_order_free(o);
  return st;
}
