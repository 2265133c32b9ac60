/*
 * fake_nccl.h - a fake device and a fake NCCL behind the CUDA parts' function tables (zb__cudart_t,
 * zb__nccl_t), for the NCCL transports' host tests (test_transport_nccl.c, test_nccl_group.c).
 *
 * The fake keeps CUDA's and NCCL's semantics that the transports rely on: streams run their work in
 * order on a device thread, an event records the work issued before it and a wait captures the
 * latest record, a communicator's operations run one after another (so transfers between two ranks
 * that were issued in different orders deadlock, as on a GPU), a send and its receive complete
 * together, a collective completes when every rank of its communicator has reached it (an
 * all-reduce adds in rank order; max is fmaxf's, as NCCL's), a non-blocking communicator's
 * collective returns ncclInProgress and is on its stream only after a later
 * ncclCommGetAsyncError, ncclCommAbort makes a communicator's pending operations return.
 * Device memory is host memory here.
 *
 * What it is not: a test of NCCL itself, or of device memory; the GPU suites (gpu_*) do that.
 */
#ifndef ZB_TESTS_FAKE_NCCL_H
#define ZB_TESTS_FAKE_NCCL_H

#include <pthread.h>

#include "cuda/internal.h"

typedef struct fgroup {
  struct fgroup *next_all;
  uint8_t id[16];
  int nranks, joined;
  int split_made; /* made by a split: ready as soon as it exists */
  long *sseq, *rseq; /* [src * nranks + dst]: sends and receives enqueued so far */
  /* splits in progress: per round, the callers so far */
  int split_calls[8];
  struct fcomm *split_comm[8][16];
  int split_color[8][16], split_key[8][16];
  struct fcomm *split_child[8][16];
} fgroup_t;

typedef struct fcomm {
  struct fcomm *next_all;
  fgroup_t *g; /* NULL while a split that makes it is in progress */
  int rank, aborted, splits, blocking;
  long colls; /* collectives issued on it so far */
  /* A non-blocking communicator's collective returns ncclInProgress and reaches its stream only at
   * the next ncclCommGetAsyncError (NCCL launches such calls from a thread of its own). */
  struct item *pending;
  struct fstream *pending_stream;
} fcomm_t;

typedef struct {
  int recorded, completed;
} fevent_t;

typedef struct {
  fcomm_t *comm;
  int peer, is_send, done;
  void *buf;
  size_t bytes;
  long seq;
} xop_t;

enum { IT_RECORD, IT_WAIT, IT_XFER, IT_COMPUTE, IT_COLL };

/* A collective (IT_COLL): the seq-th of its communicator; done FAKE_COLL_SECONDS after every rank's
 * is at the head of its stream, or at once when its communicator is aborted. */
typedef struct {
  fcomm_t *comm;
  long seq;
  int is_broadcast, dtype, op, root; /* dtype, op: NCCL's */
  void *buf;
  size_t count; /* elements (a broadcast: bytes) */
  int done;
  double met_at; /* when every rank's was at a stream's head; it then takes FAKE_COLL_SECONDS */
} fcoll_t;

#define FAKE_COLL_SECONDS 0.001

typedef struct item {
  struct item *next;
  int kind;
  fevent_t *ev;
  int ver;
  xop_t ops[16];
  int n_ops;
  double dur, t0;
  void (*fn)(void *);
  void *arg;
  fcoll_t coll;
} item_t;

typedef struct fstream {
  struct fstream *next_live, *next_all;
  item_t *head, *tail;
  int live;
} fstream_t;

typedef struct {
  pthread_mutex_t mu;
  pthread_t thread;
  int stop;
  fstream_t *live, *all_streams;
  fgroup_t *groups;
  fcomm_t *comms;
  void **graveyard; /* events freed at teardown (waits in other streams may still read them) */
  int n_grave, cap_grave;
  long mallocs[9]; /* per rank thread (the last: others) */
  int block_launch_rank; /* >= 0: that rank's second ncclGroupEnd blocks until its comm is aborted */
  int launches_of_blocked;
} fake_dev_t;

extern fake_dev_t fake_dev;
extern __thread int tl_rank; /* the rank a test thread plays (-1: none) */
extern const zb__cudart_t fake_rt;
extern const zb__nccl_t fake_nccl;

/* cmocka setup and teardown: the device thread started, and everything freed after. */
int fake_setup(void **state);
int fake_teardown(void **state);

void nap_us(long us);
void push_item(fstream_t *s, item_t *it);
cudaError_t f_event_create(cudaEvent_t *e, unsigned int flags);
cudaError_t f_event_destroy(cudaEvent_t e);
cudaError_t f_event_record(cudaEvent_t e, cudaStream_t s);
cudaError_t f_event_query(cudaEvent_t e);
cudaError_t f_stream_create(cudaStream_t *out, unsigned int flags);
cudaError_t f_stream_destroy(cudaStream_t st);
/* Work of `dur` seconds on stream st, calling fn(arg) at its end (fn may be NULL). */
void enqueue_compute(cudaStream_t st, double dur, void (*fn)(void *), void *arg);
/* Waits until stream st has run everything issued (polling, at most `limit` seconds). */
void drain(cudaStream_t st, double limit);

/* A shared abort signal (the job's store, in a real run). */
typedef struct {
  pthread_mutex_t mu;
  char msg[512];
  int set;
} signal_t;
int sig_poll(void *user, char *msg, size_t cap);
void sig_publish(void *user, const char *msg);

#endif /* ZB_TESTS_FAKE_NCCL_H */
