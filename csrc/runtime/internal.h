/*
 * internal.h - the transport interface and the helpers the runner, the optimizer and the reference
 * model share. Private to csrc/runtime/.
 *
 * A transport moves bytes between ranks on tagged FIFO channels. Every operation is a request that
 * the caller owns (zb__request_t lives in the runner's tables, not in the transport): start it with
 * isend/irecv, finish it with wait, or drop it with cancel after a failure. Sends never wait for
 * the receiver; only wait blocks, and never longer than its timeout.
 */
#ifndef ZB_RUNTIME_INTERNAL_H
#define ZB_RUNTIME_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../backend/internal.h"
#include "../common/error.h"
#include "zbpp.h"

typedef struct {
  int is_send;
  int32_t peer, tag;
  void *buf;
  size_t bytes;
  void *handle; /* the transport's own state for the request */
  int active;   /* started and not yet waited or cancelled */
} zb__request_t;

typedef struct {
  const char *name;
  zb_status_t (*isend)(zb_transport_t *t, zb__request_t *req);
  zb_status_t (*irecv)(zb_transport_t *t, zb__request_t *req);
  /* ZB_OK when done; ZB_ERR_TIMEOUT (message names the peer and the wait) when timeout_s passes
   * first (timeout_s = 0 only polls); ZB_ERR_REMOTE when the peer or any rank of the group aborted. */
  zb_status_t (*wait)(zb_transport_t *t, zb__request_t *req, double timeout_s);
  void (*cancel)(zb_transport_t *t, zb__request_t *req);
  void (*abort)(zb_transport_t *t, const char *reason);
  void (*destroy)(zb_transport_t *t);
  /* Optional (NULL: never fails). A failure noticed away from wait, such as the NCCL watchdog's
   * timeout or an asynchronous NCCL error; the runner asks between ops and after the last one. */
  zb_status_t (*check)(zb_transport_t *t);
  /* Optional (NULL: order-free). The schedule the runner about to use the transport runs; called
   * at zb_runner_create, between iterations. A transport that orders its transfers by the
   * schedule (NCCL, one queue per rank pair) takes its order from here. */
  zb_status_t (*plan)(zb_transport_t *t, const zb_schedule_t *s);
  /* Which memory the transport moves: 0 host memory only, 1 the memory of any backend (the
   * in-process transport copies with the bound backend), 2 device memory only (NCCL). */
  int memory;
  /* Optional (NULL: the transport itself). The transport that carries the collectives' host
   * buffers (collective.c): a staged transport's inner one, which moves host memory as it is. */
  zb_transport_t *(*host_side)(zb_transport_t *t);
  /* Optional (NULL: collective.c's messages through rank 0). Collectives of the transport's own
   * (the NCCL group transport: ncclAllReduce, ncclBroadcast on device memory); called with the
   * arguments checked and timeout_s > 0. */
  zb_status_t (*all_reduce)(zb_transport_t *t, int32_t channel, void *buf, size_t count, zb_dtype_t dtype,
                            zb_reduce_op_t op, double timeout_s);
  zb_status_t (*broadcast)(zb_transport_t *t, int32_t channel, void *buf, size_t bytes, int32_t root,
                           double timeout_s);
} zb__transport_ops_t;

enum { ZB__TRANSPORT_HOST_MEMORY = 0, ZB__TRANSPORT_ANY_MEMORY = 1, ZB__TRANSPORT_DEVICE_MEMORY = 2 };

struct zb_transport {
  const zb__transport_ops_t *ops;
  int32_t rank, ranks;
  void *impl;
  /* The backend whose buffers the transport moves: set at creation (NCCL) or by the first runner
   * created on it (zb__transport_bind); NULL until then. The transport holds a reference on it
   * (zb_backend_destroy is ZB_ERR_BUSY while the transport exists). */
  zb_backend_t *be;
  /* Runners and post-validation handles using the transport: zb_transport_destroy is ZB_ERR_BUSY
   * while any exists (they would use freed memory). Objects of one rank live on one thread. */
  int users;
  /* Buffers a failed collective left behind (collective.c): a receive the transport could not
   * withdraw may still write into them, so they are freed with the transport. */
  void **parked;
  int32_t n_parked;
};

/* Keeps buf (malloc'd) until the transport is destroyed; frees it at once when the list cannot grow. */
void zb__transport_park(zb_transport_t *t, void *buf);

static inline void zb__transport_ref(zb_transport_t *t) {
  if (t) t->users++;
}
static inline void zb__transport_unref(zb_transport_t *t) {
  if (t) t->users--;
}

/* Ties a transport to the backend of the runner that uses it; fails with a message when the
 * transport cannot carry that backend's memory or is already tied to another backend. */
zb_status_t zb__transport_bind(zb_transport_t *t, zb_backend_t *be);

/* Thin wrappers that keep zb__request_t's bookkeeping in one place. */
zb_status_t zb__transport_isend(zb_transport_t *t, zb__request_t *req, int32_t peer, int32_t tag,
                                const void *buf, size_t bytes);
zb_status_t zb__transport_irecv(zb_transport_t *t, zb__request_t *req, int32_t peer, int32_t tag,
                                void *buf, size_t bytes);
zb_status_t zb__transport_wait(zb_transport_t *t, zb__request_t *req, double timeout_s);
void zb__transport_cancel(zb_transport_t *t, zb__request_t *req);

/* Channel tags. The runner's boundary b (between stage b and b+1) has a forward tag (activations)
 * and a backward tag (gradients); the optimizer's exchange uses two tags after all of them. */
/* Vocabulary Parallelism's passes (S, T, IF, IB): ops of a rank, not of a stage. */
static inline int zb__runner_op_is_vocab(int32_t type) { return type >= ZB_OP_S && type <= ZB_OP_IB; }

static inline int32_t zb__tag_fwd(int32_t boundary) { return 2 * boundary; }
static inline int32_t zb__tag_bwd(int32_t boundary) { return 2 * boundary + 1; }
static inline int32_t zb__tag_optim(int32_t stages, int32_t dir) { return 2 * stages + dir; }
/* The collectives' channels start here (collective.c; + 0 .. ZB_COLLECTIVE_CHANNELS - 1): above
 * every channel the runner and the optimizer count up to, and apart from the binding's own (shape
 * inference 1 << 20, the unstick receive 2^30 + 7). */
#define ZB__TAG_COLLECTIVE ((int32_t)((1 << 30) + 16))

/* Where an op's input comes from and its output goes (bufplan.c): the channel's tag (zb__tag_fwd or
 * zb__tag_bwd of the boundary, so tag / 2 is the boundary) and the rank holding the stage at the
 * other end; tag -1 (and peer -1) where there is none, e.g. stage 0's forward input. The runner
 * and the buffer plan both read an op's channels from here. */
typedef struct {
  int32_t tag, peer;
} zb__link_t;
zb_status_t zb__op_links(const zb_schedule_t *s, int32_t S, const zb_op_t *op, zb__link_t *in, zb__link_t *out);

/* The buffer plan of one rank (bufplan.c): per tag (2 (S - 1) of them), how many send, receive and
 * local hand-off buffers its runner can need at once, receives posted `depth` ahead; pair_first as
 * the runner's (NULL: no pairs). */
zb_status_t zb__runner_buffer_plan(const zb_schedule_t *s, int32_t rank, int32_t depth, const uint8_t *pair_first,
                                   int32_t *sends, int32_t *recvs, int32_t *locals);
/* Zero-copy stages (release_cb): per tag, the most receive buffers this rank keeps after their op
 * at once, an input being kept from its F or B until the W or BW of its (stage, microbatch). */
zb_status_t zb__runner_held_inputs(const zb_schedule_t *s, int32_t rank, int32_t *held);
/* Buffers the runner had to allocate inside iterations because the plan fell short (0 expected). */
zb_status_t zb__runner_late_allocs(const zb_runner_t *r, int64_t *out);
/* The W store's group of (stage, mb), wherever it is in the stage's queue, run and recycled (as
 * zb_wstore_pop_run runs the oldest): a W op or a fused BW runs its own microbatch's W work even
 * when an earlier B's W is still pending. ZB_ERR_INVALID_SCHEDULE when there is none. */
zb_status_t zb__wstore_pop_run_mb(zb_wstore_t *w, int32_t stage, int32_t mb);

/* The order in which the two ranks of a pair issue the transfers between them on one shared
 * communicator (pairorder.c says why it cannot deadlock). For one rank: the peers it exchanges
 * with, and per channel tag, where each message of an iteration falls in its pair's order. */
typedef struct {
  int32_t peer;   /* the other rank */
  int32_t length; /* transfers between the two ranks in one iteration */
} zb__pair_t;

typedef struct {
  int32_t pair;    /* index into pairs; -1: the tag does not cross between this rank and another */
  int32_t peer, is_send;
  int32_t count;   /* messages per iteration */
  int32_t *seq;    /* count: the k-th message's index in its pair's order */
} zb__pair_chan_t;

typedef struct {
  int32_t n_pairs;
  zb__pair_t *pairs; /* n_pairs */
  int32_t n_tags;
  zb__pair_chan_t *chans; /* n_tags, indexed by tag */
} zb__pair_order_t;

zb_status_t zb__pair_order_make(const zb_schedule_t *s, int32_t rank, zb__pair_order_t *out);
void zb__pair_order_free(zb__pair_order_t *o);
/* Every pair of ranks {a < b} with a stage boundary between them, in one order all ranks compute,
 * each with a round: a rank's pairs fall in different rounds (one communicator split per round).
 * The caller frees *pairs and *round. */
zb_status_t zb__pair_list(const zb_schedule_t *s, int32_t *n_pairs, int32_t (**pairs)[2], int32_t **round,
                          int32_t *n_rounds);

/* Seconds on CLOCK_MONOTONIC: the clock the runner stamps ops with. */
double zb__now(void);

/* The rank holding a stage (zbpp.h, "the schedule model"); with one rank, every stage. */
static inline int32_t zb__placement_rank(zb_placement_t placement, int32_t ranks, int32_t stage) {
  if (ranks == 1) return 0;
  if (placement == ZB_PLACEMENT_V) return stage < ranks ? stage : 2 * ranks - 1 - stage;
  return stage % ranks;
}

/* postval.c, the post-validation exchange zb_optimizer is built on. zb__postval_check checks the
 * fields every post-validation config shares (not struct_size or version); `owner` names the config
 * in its messages ("optimizer": "... but the optimizer config says ..."). zb__postval_create checks
 * the same way and makes a handle whose exchange failures read "<owner> step on rank r: ...";
 * zb_postval_create is this with the public names. */
zb_status_t zb__postval_check(const zb_postval_config_t *c, const char *owner);
zb_status_t zb__postval_create(zb_postval_t **out, const zb_postval_config_t *c, const char *owner);
/* 1 when zb_postval_begin may tell this rank to step speculatively (post_validation on and not the
 * chain's last rank): the ranks that need an undo copy. */
int zb__postval_speculates(const zb_postval_t *pv);

#endif /* ZB_RUNTIME_INTERNAL_H */
