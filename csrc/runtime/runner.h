/*
 * runner.h - the runner's state, shared by runner.c (creation and the iteration loop) and
 * runner_buffers.c (its message buffers: the per-channel pools the buffer plan fills, the send
 * queues, and the inputs kept for the weight gradient in zero-copy mode). Private to csrc/runtime/.
 */
#ifndef ZB_RUNTIME_RUNNER_H
#define ZB_RUNTIME_RUNNER_H

#include "internal.h"

enum { IO_NONE = 0, IO_LOCAL = 1, IO_REMOTE = 2 };

typedef struct {
  int in_kind, out_kind;
  int32_t in_peer, out_peer; /* ranks, for IO_REMOTE */
  int32_t in_tag, out_tag;
  int32_t in_slot, out_slot; /* local handoff slots, for IO_LOCAL */
  int32_t recv;              /* index into the receive plan, for IO_REMOTE input */
  int32_t in_pool, out_pool; /* the buffer pools of the input and the output (see pool_id) */
  size_t in_bytes, out_bytes;
} op_io_t;

typedef struct {
  void *buf;
  uint64_t token; /* lent buffers (release_cb): the caller's token */
  zb__request_t req;
} send_t;

/* An input kept after its op for the weight gradient (release_cb mode): a receive buffer (back to
 * pool `pool`) or a buffer this rank's previous stage lent (released with `token`). */
typedef struct {
  void *buf;
  int32_t pool; /* -1: lent */
  int used;
  uint64_t token;
} held_t;

/* A channel's buffers of one kind, allocated at creation (the buffer plan, bufplan.c). */
typedef struct {
  size_t bytes;
  void **free_bufs;
  int n, cap; /* free ones; cap is every buffer the pool owns */
} pool_t;

/* The sends of one channel not yet seen complete, oldest first. */
typedef struct {
  send_t *ring;
  int32_t head, count, cap;
} sendq_t;

struct zb_runner {
  int32_t rank, p, S, m;
  const zb_schedule_t *schedule;
  zb_backend_t *be;
  zb_transport_t *tr;
  zb_wstore_t *ws;
  zb_forward_cb forward;
  zb_backward_cb backward;
  void *user;
  double timeout;
  int32_t depth;

  const zb_op_t *ops;
  int32_t n;
  op_io_t *io;
  uint8_t *pair_first; /* n: 1 where ops k and k+1 run as a pair (zb_runner_config_t.pair_first) */
  double *start, *end;

  int32_t n_recv;
  int32_t *recv_op;         /* op index of each receive, in op order */
  zb__request_t *recv_req;  /* n_recv */
  void **recv_buf;          /* n_recv */
  void **local;             /* (boundary * 2 + dir) * m + mb */
  sendq_t *sendq;           /* per channel (tag): its pending sends */
  int32_t T;                /* channels: 2 (S - 1) tags */
  int32_t *send_tags, n_send_tags; /* the channels this rank sends on (reaped after every op) */
  pool_t *pools;            /* 3 T: sends, receives and local hand-offs of each tag (pool_id) */
  int64_t late_allocs;      /* buffers allocated inside an iteration (the plan fell short: never) */
  zb_status_t (*alloc_cb)(void *, size_t, void **); /* the caller's allocator, or NULL: the backend's */
  void (*free_cb)(void *, void *);
  void *alloc_user;
  /* Zero-copy stages (zb_runner_config_t.release_cb): outputs are the caller's buffers, inputs are
   * kept until the microbatch's W. lend_*: the op whose callback is running and what it lent. */
  void (*release_cb)(void *, uint64_t);
  uint64_t *local_token; /* like local: the token of a lent buffer waiting for this rank's next stage */
  held_t *held;          /* (stage * m + mb) * 2 + (0: F's input, 1: B's input) */
  int32_t lend_k;        /* op index of the running callback, -1 outside one */
  int lend_got;
  void *lend_buf;
  uint64_t lend_token;
  /* Device timing (backends with timing events): a base event, then a start and an end event per
   * op, turned into seconds after the iteration; NULL on the host, which stamps with its clock. */
  zb__event_t *ev_base, **ev_op;
  double host_base;
  /* PipeOffload's copies (runner_copies.c): the caller's callback and the lane, NULL without copies. */
  zb_copy_cb copy_cb;
  zb_vocab_cb vocab_cb; /* Vocabulary Parallelism's passes (NULL: the schedule has none) */
  struct zb__copylane *copies;
};

enum { POOL_SEND = 0, POOL_RECV = 1, POOL_LOCAL = 2 };
static inline int32_t pool_id(const zb_runner_t *r, int kind, int32_t tag) { return kind * r->T + tag; }

/* runner_buffers.c */
void zb__runner_buf_free(zb_runner_t *r, void *ptr);
/* A buffer of pool `id` (see pool_id); allocates, and counts it as late, only if the plan fell short. */
zb_status_t zb__runner_pool_get(zb_runner_t *r, int32_t id, void **out);
/* Gives a buffer back to its pool; NULL is ignored. */
void zb__runner_pool_put(zb_runner_t *r, int32_t id, void *buf);
/* The buffer plan for this rank, allocated at creation. */
zb_status_t zb__runner_plan_buffers(zb_runner_t *r, const zb_runner_config_t *c);
/* Starts the send of op output `buf` on its channel's queue (token: a lent buffer's). */
zb_status_t zb__runner_push_send(zb_runner_t *r, void *buf, uint64_t token, const op_io_t *io);
/* Drops the channel's oldest send and gives its buffer back (to the pool, or to the caller). */
void zb__runner_drop_front(zb_runner_t *r, int32_t tag);
/* Recycles finished sends of every channel; timeout 0 only looks, > 0 waits for all. */
zb_status_t zb__runner_reap_sends(zb_runner_t *r, double timeout);
/* Zero-copy mode: lets go of the inputs kept for (stage, mb)'s W, or of all with stage -1. */
void zb__runner_release_held(zb_runner_t *r, int32_t stage, int32_t mb);
/* An op's input after its callback: back to its pool, or kept until the microbatch's W. */
void zb__runner_release_input(zb_runner_t *r, int32_t k, void *in, uint64_t token);

/* runner_copies.c: the copy lane (OFFLOAD/RELOAD ops). All are no-ops on a rank without copies. */
typedef struct zb__copylane zb__copylane_t;
/* Finds the rank's copies and makes the lane (at zb_runner_create). */
zb_status_t zb__copies_plan(zb_runner_t *r, zb_copy_cb cb, double time_scale, int inline_copies);
void zb__copies_free(zb_runner_t *r);
/* Starts an iteration's lane (its thread on the host) and issues the copies before the first compute op. */
zb_status_t zb__copies_begin(zb_runner_t *r);
/* Issues the copies that follow compute op k in the list: called just before op k runs (after = 0)
 * and just after (after = 1); a host lane acts on the first call, a device lane on the second. */
zb_status_t zb__copies_issue(zb_runner_t *r, int32_t k, int after);
/* Before compute op k: waits for the RELOAD of its (stage, mb) when it has one (host lane). */
zb_status_t zb__copies_wait(zb_runner_t *r, int32_t k);
/* F(stage, mb) returned: its OFFLOAD may start. */
void zb__copies_forward_done(zb_runner_t *r, int32_t stage, int32_t mb);
/* After the last op: waits for the lane to finish every copy, then stops it. */
zb_status_t zb__copies_end(zb_runner_t *r);
/* Stops the lane at once (after a failure); a copy under way finishes first. */
void zb__copies_stop(zb_runner_t *r);

#endif /* ZB_RUNTIME_RUNNER_H */
