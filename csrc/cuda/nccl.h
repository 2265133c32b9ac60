/*
 * nccl.h - the NCCL transport's state, shared by transport_nccl.c (requests, the pair order, the
 * watchdog) and transport_nccl_setup.c (communicators and connections at creation). Private to
 * csrc/cuda/; transport_nccl.c's opening comment says how the transport works.
 */
#ifndef ZB_CUDA_NCCL_H
#define ZB_CUDA_NCCL_H

#include <pthread.h>

#include "../runtime/internal.h"
#include "internal.h"

#define RT_FAIL(n, e, what) \
  ZB_FAIL(ZB_ERR_CUDA, "%s failed: %s (error %d)", (what), (n)->rt->GetErrorString(e), (int)(e))

enum { REQ_FREE = 0, REQ_POSTED = 1, REQ_ISSUED = 2 };

typedef struct zb__nccl_req {
  struct zb__nccl_req *next;          /* in the in-flight list (issue order) or the free list */
  cudaEvent_t ready, need, done;
  uint64_t gen;               /* bumped at each reuse: the watchdog's snapshots check it */
  int pair, tag, is_send, state;
  void *buf;
  size_t bytes;
  int needed;   /* a receive the runner waited for: `need` was recorded on the compute stream */
  double clock; /* when the watchdog saw it ready at the head of its pair; 0 until then */
  int released; /* the runner is done with it (waited or cancelled) */
  int finished; /* done event seen complete */
} zb__nccl_req_t;

typedef struct {
  int32_t peer, peer_local; /* the other rank, globally and inside comm */
  ncclComm_t comm;          /* NULL once aborted */
  cudaStream_t stream;
  /* The issue order (the runner thread's only): slot[i] holds the i-th transfer of the iteration
   * once posted; next is the first not issued yet. */
  zb__nccl_req_t **slot;
  int32_t length, next;
} zb__nccl_pair_t;


typedef struct {
  const zb__nccl_t *nc;
  const zb__cudart_t *rt;
  zb__cuda_t *cu;
  int32_t rank;
  zb__nccl_pair_t *pairs;
  int n_pairs;
  zb__pair_order_t order;
  int32_t *posted; /* per tag: messages posted this iteration */
  double timeout;
  zb_abort_signal_t signal;

  pthread_mutex_t mu; /* guards what follows; never held across a CUDA or NCCL call */
  pthread_cond_t cv;
  pthread_t watchdog;
  int watchdog_started, stop;
  zb__nccl_req_t *inflight, *inflight_tail, *free_list;
  int n_reqs;    /* requests ever made (their events are the transport's), for the tests */
  int failed, aborted;
  /* The runner thread is inside NCCL calls on the communicators (issue_ready): the abort waits for
   * it to come out (bounded: a host stuck inside an enqueue is aborted anyway). */
  int inuse;
  zb_status_t fail_status;
  char fail_msg[1024];
} zb__nccl_state_t;

/* transport_nccl.c */
extern const zb__transport_ops_t zb__nccl_ops;
static inline zb__nccl_state_t *zb__nccl_of(zb_transport_t *t) { return (zb__nccl_state_t *)t->impl; }
/* Makes the backend's device current on the calling thread. */
zb_status_t zb__nccl_enter(const zb__nccl_state_t *n);
/* Aborts every communicator once, with no lock held during ncclCommAbort. */
void zb__nccl_abort_comms(zb__nccl_state_t *n);
/* The watchdog thread (arg: the transport). */
void *zb__nccl_watchdog_main(void *arg);
/* Sets the pair order from a schedule (the transport's `plan` op). */
zb_status_t zb__nccl_plan(zb_transport_t *t, const zb_schedule_t *s);
/* Frees the transport (the watchdog joined first, work in flight aborted). */
void zb__nccl_destroy(zb_transport_t *t);

#endif /* ZB_CUDA_NCCL_H */
