/*
 * test_transport_nccl.c - the NCCL transport (csrc/cuda/transport_nccl.c) without a GPU: its
 * request lifecycle, pair order, watchdog, abort and creation run against a fake device and a fake
 * NCCL behind the transport's function tables (zb__cudart_t, zb__nccl_t).
 *
 * The fake device keeps CUDA's and NCCL's semantics that the transport relies on: streams run their
 * work in order on a device thread, an event records the work issued before it and a wait captures
 * the latest record, a communicator's operations run one after another (so transfers between two
 * ranks that were issued in different orders deadlock, as on a GPU), a send and its receive complete
 * together, ncclCommAbort makes a communicator's pending operations return. Each test's ranks are
 * threads that drive the transport as the runner does: receives posted in op order a few ahead, a
 * send right after the op that produces it, the compute stream waiting for receives on the device.
 *
 * What it is not: a test of NCCL itself, or of device memory; the GPU suites (gpu_*) do that.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/internal.h"
#include "helpers.h"
#include "runtime/internal.h"

/* ---- the fake device ----------------------------------------------------------------------------- */

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

enum { IT_RECORD, IT_WAIT, IT_XFER, IT_COMPUTE };

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
} item_t;

typedef struct fstream {
  struct fstream *next_live, *next_all;
  item_t *head, *tail;
  int live;
} fstream_t;

static struct {
  pthread_mutex_t mu;
  pthread_t thread;
  int stop;
  fstream_t *live, *all_streams;
  fgroup_t *groups;
  fcomm_t *comms;
  void *graveyard[4096]; /* events freed at teardown (waits in other streams may still read them) */
  int n_grave;
  long mallocs[9]; /* per rank thread (the last: others) */
  int block_launch_rank; /* >= 0: that rank's second ncclGroupEnd blocks until its comm is aborted */
  int launches_of_blocked;
} dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .block_launch_rank = -1};

static __thread int tl_rank = -1;
static __thread int tl_group_depth;
static __thread item_t *tl_group[16]; /* per stream, the group's pending item */
static __thread fstream_t *tl_group_stream[16];
static __thread int tl_group_n;

static void nap_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

static void push_item(fstream_t *s, item_t *it) {
  it->next = NULL;
  if (s->tail) s->tail->next = it;
  else s->head = it;
  s->tail = it;
}

/* The op matching a send or receive, at the head of some stream (both must be running). */
static xop_t *find_match(const xop_t *x) {
  for (fstream_t *s = dev.live; s; s = s->next_live) {
    item_t *it = s->head;
    if (!it || it->kind != IT_XFER) continue;
    for (int k = 0; k < it->n_ops; k++) {
      xop_t *y = &it->ops[k];
      if (y->done || y->is_send == x->is_send || y->comm->g != x->comm->g) continue;
      if (y->comm->rank == x->peer && y->peer == x->comm->rank && y->seq == x->seq) return y;
    }
  }
  return NULL;
}

/* One pass over the streams' heads; 1 when something moved. Device lock held. */
static int step_once(void) {
  int moved = 0;
  double t = zb__now();
  for (fstream_t *s = dev.live; s; s = s->next_live) {
    item_t *it = s->head;
    if (!it) continue;
    int pop = 0;
    if (it->kind == IT_RECORD) {
      if (it->ver > it->ev->completed) it->ev->completed = it->ver;
      pop = 1;
    } else if (it->kind == IT_WAIT) {
      pop = it->ev->completed >= it->ver;
    } else if (it->kind == IT_COMPUTE) {
      if (it->t0 == 0) it->t0 = t;
      if (t - it->t0 >= it->dur) {
        if (it->fn) it->fn(it->arg);
        pop = 1;
      }
    } else {
      int all = 1;
      for (int k = 0; k < it->n_ops; k++) {
        xop_t *x = &it->ops[k];
        if (!x->done && x->comm->aborted) x->done = 1;
        if (!x->done && x->is_send) {
          xop_t *y = find_match(x);
          if (y) {
            memcpy(y->buf, x->buf, x->bytes < y->bytes ? x->bytes : y->bytes);
            x->done = y->done = 1;
          }
        }
        all &= x->done;
      }
      pop = all;
    }
    if (pop) {
      s->head = it->next;
      if (!s->head) s->tail = NULL;
      free(it);
      moved = 1;
    }
  }
  return moved;
}

static void *device_main(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&dev.mu);
    int stop = dev.stop;
    while (step_once()) {
    }
    pthread_mutex_unlock(&dev.mu);
    if (stop) break;
    nap_us(100);
  }
  return NULL;
}

/* ---- the CUDA runtime table ---- */

static cudaError_t f_get_device(int *d) {
  *d = 0;
  return cudaSuccess;
}
static cudaError_t f_set_device(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
static const char *f_error_string(cudaError_t e) { return e == cudaSuccess ? "no error" : "fake CUDA error"; }
static cudaError_t f_event_create(cudaEvent_t *e, unsigned int flags) {
  (void)flags;
  fevent_t *ev = calloc(1, sizeof *ev);
  *e = (cudaEvent_t)ev;
  return cudaSuccess;
}
static cudaError_t f_event_destroy(cudaEvent_t e) {
  pthread_mutex_lock(&dev.mu);
  if (dev.n_grave < 4096) dev.graveyard[dev.n_grave++] = e;
  pthread_mutex_unlock(&dev.mu);
  return cudaSuccess;
}
static cudaError_t f_event_record(cudaEvent_t e, cudaStream_t s) {
  fevent_t *ev = (fevent_t *)e;
  item_t *it = calloc(1, sizeof *it);
  pthread_mutex_lock(&dev.mu);
  it->kind = IT_RECORD, it->ev = ev, it->ver = ++ev->recorded;
  push_item((fstream_t *)s, it);
  pthread_mutex_unlock(&dev.mu);
  return cudaSuccess;
}
static cudaError_t f_event_query(cudaEvent_t e) {
  fevent_t *ev = (fevent_t *)e;
  pthread_mutex_lock(&dev.mu);
  cudaError_t r = ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
  pthread_mutex_unlock(&dev.mu);
  return r;
}
static cudaError_t f_stream_create(cudaStream_t *out, unsigned int flags) {
  (void)flags;
  fstream_t *s = calloc(1, sizeof *s);
  pthread_mutex_lock(&dev.mu);
  s->live = 1;
  s->next_live = dev.live, dev.live = s;
  s->next_all = dev.all_streams, dev.all_streams = s;
  pthread_mutex_unlock(&dev.mu);
  *out = (cudaStream_t)s;
  return cudaSuccess;
}
static cudaError_t f_stream_destroy(cudaStream_t st) {
  fstream_t *s = (fstream_t *)st;
  pthread_mutex_lock(&dev.mu);
  for (fstream_t **pp = &dev.live; *pp; pp = &(*pp)->next_live)
    if (*pp == s) {
      *pp = s->next_live;
      break;
    }
  s->live = 0;
  pthread_mutex_unlock(&dev.mu);
  return cudaSuccess;
}
static cudaError_t f_stream_wait_event(cudaStream_t st, cudaEvent_t e, unsigned int flags) {
  (void)flags;
  fevent_t *ev = (fevent_t *)e;
  item_t *it = calloc(1, sizeof *it);
  pthread_mutex_lock(&dev.mu);
  it->kind = IT_WAIT, it->ev = ev, it->ver = ev->recorded;
  push_item((fstream_t *)st, it);
  pthread_mutex_unlock(&dev.mu);
  return cudaSuccess;
}
static cudaError_t f_malloc(void **p, size_t bytes) {
  pthread_mutex_lock(&dev.mu);
  dev.mallocs[tl_rank >= 0 && tl_rank < 8 ? tl_rank : 8]++;
  pthread_mutex_unlock(&dev.mu);
  *p = calloc(1, bytes ? bytes : 1);
  return cudaSuccess;
}
static cudaError_t f_free(void *p) {
  free(p);
  return cudaSuccess;
}

static const zb__cudart_t fake_rt = {
    .GetDevice = f_get_device,
    .SetDevice = f_set_device,
    .GetErrorString = f_error_string,
    .EventCreateWithFlags = f_event_create,
    .EventDestroy = f_event_destroy,
    .EventRecord = f_event_record,
    .EventQuery = f_event_query,
    .StreamCreateWithFlags = f_stream_create,
    .StreamDestroy = f_stream_destroy,
    .StreamWaitEvent = f_stream_wait_event,
    .Malloc = f_malloc,
    .Free = f_free,
};

/* ---- the NCCL table ---- */

static fgroup_t *group_new(const uint8_t *id, int nranks) {
  fgroup_t *g = calloc(1, sizeof *g);
  if (id) memcpy(g->id, id, 16);
  g->nranks = nranks;
  g->sseq = calloc((size_t)(nranks * nranks), sizeof(long));
  g->rseq = calloc((size_t)(nranks * nranks), sizeof(long));
  g->next_all = dev.groups, dev.groups = g;
  return g;
}

static fcomm_t *comm_new(void) {
  fcomm_t *c = calloc(1, sizeof *c);
  c->next_all = dev.comms, dev.comms = c;
  return c;
}

static ncclResult_t n_init_config(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *cfg) {
  pthread_mutex_lock(&dev.mu);
  fgroup_t *g = dev.groups;
  while (g && (g->split_made || g->nranks != nranks || memcmp(g->id, id.internal, 16) != 0)) g = g->next_all;
  if (!g) g = group_new((const uint8_t *)id.internal, nranks);
  g->joined++;
  fcomm_t *c = comm_new();
  c->g = g, c->rank = rank, c->blocking = cfg ? cfg->blocking : 1;
  pthread_mutex_unlock(&dev.mu);
  *out = (ncclComm_t)c;
  return c->blocking ? ncclSuccess : ncclInProgress;
}

static ncclResult_t n_split(ncclComm_t parent, int color, int key, ncclComm_t *out, ncclConfig_t *cfg) {
  (void)cfg;
  fcomm_t *pc = (fcomm_t *)parent;
  pthread_mutex_lock(&dev.mu);
  fgroup_t *g = pc->g;
  int round = pc->splits++;
  int slot = g->split_calls[round]++;
  fcomm_t *child = color == NCCL_SPLIT_NOCOLOR ? NULL : comm_new();
  g->split_comm[round][slot] = pc;
  g->split_color[round][slot] = color, g->split_key[round][slot] = key;
  g->split_child[round][slot] = child;
  if (g->split_calls[round] == g->nranks) {
    /* Everyone is here: one group per colour, ranks by key. */
    for (int a = 0; a < g->nranks; a++) {
      fcomm_t *ca = g->split_child[round][a];
      if (!ca || ca->g) continue;
      int n = 0;
      for (int b = 0; b < g->nranks; b++)
        if (g->split_child[round][b] && g->split_color[round][b] == g->split_color[round][a]) n++;
      fgroup_t *ng = group_new(NULL, n);
      ng->split_made = 1;
      for (int b = 0; b < g->nranks; b++) {
        if (!g->split_child[round][b] || g->split_color[round][b] != g->split_color[round][a]) continue;
        int below = 0;
        for (int c = 0; c < g->nranks; c++)
          if (g->split_child[round][c] && g->split_color[round][c] == g->split_color[round][a] &&
              g->split_key[round][c] < g->split_key[round][b])
            below++;
        g->split_child[round][b]->rank = below;
        g->split_child[round][b]->g = ng;
      }
    }
  }
  pthread_mutex_unlock(&dev.mu);
  *out = (ncclComm_t)child;
  return ncclInProgress;
}

static ncclResult_t n_abort(ncclComm_t c) {
  pthread_mutex_lock(&dev.mu);
  ((fcomm_t *)c)->aborted = 1;
  pthread_mutex_unlock(&dev.mu);
  return ncclSuccess;
}
static ncclResult_t n_destroy(ncclComm_t c) { return n_abort(c); }

static ncclResult_t n_async(ncclComm_t comm, ncclResult_t *e) {
  fcomm_t *c = (fcomm_t *)comm;
  pthread_mutex_lock(&dev.mu);
  int ready = c->g && (c->g->split_made || c->g->joined >= c->g->nranks);
  /* A parent with a split in progress is in progress too. */
  if (ready && c->g)
    for (int r = 0; r < 8; r++)
      if (c->g->split_calls[r] > 0 && c->g->split_calls[r] < c->g->nranks && c->splits > r) ready = 0;
  pthread_mutex_unlock(&dev.mu);
  *e = ready ? ncclSuccess : ncclInProgress;
  return ncclSuccess;
}

static ncclResult_t n_count(const ncclComm_t c, int *n) {
  *n = ((const fcomm_t *)c)->g->nranks;
  return ncclSuccess;
}
static ncclResult_t n_user_rank(const ncclComm_t c, int *r) {
  *r = ((const fcomm_t *)c)->rank;
  return ncclSuccess;
}

static ncclResult_t n_p2p(int is_send, void *buf, size_t bytes, int peer, ncclComm_t comm, cudaStream_t st) {
  fcomm_t *c = (fcomm_t *)comm;
  fstream_t *s = (fstream_t *)st;
  pthread_mutex_lock(&dev.mu);
  fgroup_t *g = c->g;
  xop_t x = {c, peer, is_send, 0, buf, bytes, 0};
  x.seq = is_send ? g->sseq[c->rank * g->nranks + peer]++ : g->rseq[peer * g->nranks + c->rank]++;
  int k = 0;
  while (k < tl_group_n && tl_group_stream[k] != s) k++;
  if (k == tl_group_n) {
    tl_group_stream[k] = s;
    tl_group[k] = calloc(1, sizeof(item_t));
    tl_group[k]->kind = IT_XFER;
    tl_group_n++;
  }
  tl_group[k]->ops[tl_group[k]->n_ops++] = x;
  if (tl_group_depth == 0) {
    push_item(s, tl_group[0]);
    tl_group_n = 0;
  }
  pthread_mutex_unlock(&dev.mu);
  return ncclSuccess;
}
static ncclResult_t n_send(const void *b, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  (void)t;
  return n_p2p(1, (void *)b, n, peer, c, s);
}
static ncclResult_t n_recv(void *b, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  (void)t;
  return n_p2p(0, b, n, peer, c, s);
}
static ncclResult_t n_group_start(void) {
  tl_group_depth++;
  return ncclSuccess;
}
static ncclResult_t n_group_end(void) {
  if (--tl_group_depth > 0) return ncclSuccess;
  pthread_mutex_lock(&dev.mu);
  int blocked = 0;
  if (tl_rank == dev.block_launch_rank && tl_group_n > 0 && dev.launches_of_blocked++ >= 2) {
    /* A launch queue filled by a peer that never comes: the host stays inside the enqueue until
     * the communicator is aborted (what the watchdog must do without the runner's help). */
    fcomm_t *c = tl_group[0]->ops[0].comm;
    while (!c->aborted) {
      pthread_mutex_unlock(&dev.mu);
      nap_us(1000);
      pthread_mutex_lock(&dev.mu);
    }
    blocked = 1;
  }
  for (int k = 0; k < tl_group_n; k++) {
    if (blocked) free(tl_group[k]);
    else push_item(tl_group_stream[k], tl_group[k]);
  }
  tl_group_n = 0;
  pthread_mutex_unlock(&dev.mu);
  return blocked ? ncclSystemError : ncclSuccess;
}
static const char *n_error_string(ncclResult_t r) { return r == ncclSuccess ? "no error" : "fake NCCL error"; }

static const zb__nccl_t fake_nccl = {
    .path = "fake",
    .CommInitRankConfig = n_init_config,
    .CommSplit = n_split,
    .CommAbort = n_abort,
    .CommDestroy = n_destroy,
    .CommGetAsyncError = n_async,
    .CommCount = n_count,
    .CommUserRank = n_user_rank,
    .Send = n_send,
    .Recv = n_recv,
    .GroupStart = n_group_start,
    .GroupEnd = n_group_end,
    .GetErrorString = n_error_string,
};

static int setup(void **state) {
  (void)state;
  dev.stop = 0;
  dev.block_launch_rank = -1, dev.launches_of_blocked = 0;
  return pthread_create(&dev.thread, NULL, device_main, NULL);
}

static int teardown(void **state) {
  (void)state;
  pthread_mutex_lock(&dev.mu);
  dev.stop = 1;
  pthread_mutex_unlock(&dev.mu);
  pthread_join(dev.thread, NULL);
  for (fstream_t *s = dev.all_streams, *n; s; s = n) {
    n = s->next_all;
    for (item_t *it = s->head, *m; it; it = m) m = it->next, free(it);
    free(s);
  }
  for (fgroup_t *g = dev.groups, *n; g; g = n) n = g->next_all, free(g->sseq), free(g->rseq), free(g);
  for (fcomm_t *c = dev.comms, *n; c; c = n) n = c->next_all, free(c);
  for (int k = 0; k < dev.n_grave; k++) free(dev.graveyard[k]);
  dev.all_streams = dev.live = NULL, dev.groups = NULL, dev.comms = NULL, dev.n_grave = 0;
  return 0;
}

/* ---- a rank as the runner drives the transport ------------------------------------------------- */

/* A shared abort signal (the job's store, in a real run). */
typedef struct {
  pthread_mutex_t mu;
  char msg[512];
  int set;
} signal_t;

static int sig_poll(void *user, char *msg, size_t cap) {
  signal_t *s = user;
  pthread_mutex_lock(&s->mu);
  int set = s->set;
  if (set) snprintf(msg, cap, "%s", s->msg);
  pthread_mutex_unlock(&s->mu);
  return set;
}
static void sig_publish(void *user, const char *msg) {
  signal_t *s = user;
  pthread_mutex_lock(&s->mu);
  if (!s->set) snprintf(s->msg, sizeof s->msg, "%s", msg), s->set = 1;
  pthread_mutex_unlock(&s->mu);
}

typedef struct {
  int32_t tag, mb, iter, magic;
} msg_t;

typedef struct job job_t;

typedef struct {
  job_t *job;
  int32_t rank;
  /* per op: its message buffers and what its compute checks and writes */
  msg_t *in, *out;
  int32_t iter;
  const zb_op_t *op;
  int32_t in_tag, out_tag;
} opctx_t;

struct job {
  const zb_schedule_t *s;
  uint8_t id[16];
  int32_t p, iters, depth;
  double timeout;
  double lead[8];          /* compute time each rank spends before its first op */
  int dead_rank;           /* this rank makes its transport, then posts nothing until the others fail */
  int abort_rank;          /* this rank aborts its transport at once, as the runner does when a callback raises */
  int create_only_rank;    /* only this rank creates (the others never come); -1: all */
  signal_t sig;
  int use_signal;
  pthread_mutex_t mu;
  long bad_messages;
  char bad[256];
  /* per rank results */
  zb_status_t st[8];
  char msg[8][1024];
  double took[8];
  double done_at[8]; /* when each rank's transport failed or finished (zb__now) */
  double created_at[8]; /* when each rank's transport was made (zb__now) */
  double failed_at[8];  /* when a failing rank first saw the failure, before its own abort's cleanup */
  double abort_at;   /* when abort_rank aborted */
  int comms[8], reqs_after_first[8], reqs_after_last[8];
  long mallocs_after_first[8], mallocs_after_last[8];
};

static void compute_fn(void *arg) {
  opctx_t *o = arg;
  if (o->in && o->in_tag >= 0) {
    msg_t want = {o->in_tag, o->op->mb, o->iter, 0x5eed};
    if (memcmp(o->in, &want, sizeof want) != 0) {
      pthread_mutex_lock(&o->job->mu);
      if (!o->job->bad_messages++)
        snprintf(o->job->bad, sizeof o->job->bad,
                 "rank %d op (type %d, stage %d, mb %d) of iteration %d got tag %d mb %d iteration %d magic %x",
                 (int)o->rank, (int)o->op->type, (int)o->op->stage, (int)o->op->mb, (int)o->iter, (int)o->in->tag,
                 (int)o->in->mb, (int)o->in->iter, (unsigned)o->in->magic);
      pthread_mutex_unlock(&o->job->mu);
    }
  }
  if (o->out) *o->out = (msg_t){o->out_tag, o->op->mb, o->iter, 0x5eed};
}

static void enqueue_compute(fstream_t *s, double dur, void (*fn)(void *), void *arg) {
  item_t *it = calloc(1, sizeof *it);
  it->kind = IT_COMPUTE, it->dur = dur, it->fn = fn, it->arg = arg;
  pthread_mutex_lock(&dev.mu);
  push_item(s, it);
  pthread_mutex_unlock(&dev.mu);
}

typedef struct {
  job_t *job;
  int32_t rank;
} rankarg_t;

/* Waits until the compute stream has run everything issued (polling, bounded). */
static void drain(cudaStream_t st, double limit) {
  cudaEvent_t e;
  f_event_create(&e, 0);
  f_event_record(e, st);
  double t0 = zb__now();
  while (f_event_query(e) != cudaSuccess && zb__now() - t0 < limit) nap_us(200);
  f_event_destroy(e);
}

static zb_status_t run_iterations(job_t *J, int32_t r, zb_transport_t *t, cudaStream_t compute) {
  const zb_op_t *ops;
  int32_t n;
  zb_schedule_info_t info;
  ZB_CHECK(zb_schedule_get_info(J->s, &info));
  ZB_CHECK(zb_schedule_rank_ops(J->s, r, &ops, &n));
  opctx_t *ctx = calloc((size_t)n, sizeof *ctx);
  zb__request_t *rq = calloc((size_t)n, sizeof *rq), *sq = calloc((size_t)n, sizeof *sq);
  int32_t *recv_ops = calloc((size_t)n, sizeof *recv_ops), n_recv = 0;
  zb_status_t st = ZB_OK;
  for (int32_t i = 0; i < n; i++) {
    zb__link_t in, out;
    ZB_CHECK(zb__op_links(J->s, info.stages, &ops[i], &in, &out));
    ctx[i].job = J, ctx[i].rank = r, ctx[i].op = &ops[i];
    ctx[i].in_tag = in.tag >= 0 && in.peer != r ? in.tag : -1;
    ctx[i].out_tag = out.tag >= 0 && out.peer != r ? out.tag : -1;
    if (ctx[i].in_tag >= 0) ctx[i].in = calloc(1, sizeof(msg_t)), recv_ops[n_recv++] = i;
    if (ctx[i].out_tag >= 0) ctx[i].out = calloc(1, sizeof(msg_t));
  }
  for (int32_t it = 0; it < J->iters && st == ZB_OK; it++) {
    if (J->lead[r] > 0) enqueue_compute((fstream_t *)compute, J->lead[r], NULL, NULL);
    int32_t posted = 0;
    for (int32_t i = 0; i < n; i++) ctx[i].iter = it;
    for (; posted < n_recv && posted < J->depth && st == ZB_OK; posted++) {
      opctx_t *o = &ctx[recv_ops[posted]];
      zb__link_t in, out;
      zb__op_links(J->s, info.stages, o->op, &in, &out);
      st = zb__transport_irecv(t, &rq[recv_ops[posted]], in.peer, in.tag, o->in, sizeof(msg_t));
    }
    for (int32_t i = 0; i < n && st == ZB_OK; i++) {
      if (ctx[i].in_tag >= 0) {
        st = zb__transport_wait(t, &rq[i], J->timeout);
        if (st == ZB_OK && posted < n_recv) {
          opctx_t *o = &ctx[recv_ops[posted]];
          zb__link_t in, out;
          zb__op_links(J->s, info.stages, o->op, &in, &out);
          st = zb__transport_irecv(t, &rq[recv_ops[posted]], in.peer, in.tag, o->in, sizeof(msg_t));
          posted++;
        }
      }
      if (st != ZB_OK) break;
      enqueue_compute((fstream_t *)compute, 0.0002, compute_fn, &ctx[i]);
      if (ctx[i].out_tag >= 0) {
        zb__link_t in, out;
        zb__op_links(J->s, info.stages, &ops[i], &in, &out);
        st = zb__transport_isend(t, &sq[i], out.peer, out.tag, ctx[i].out, sizeof(msg_t));
      }
      /* The runner reaps finished sends without waiting, and asks the transport between ops. */
      for (int32_t k = 0; k <= i && st == ZB_OK; k++)
        if (sq[k].active) {
          zb_status_t w = zb__transport_wait(t, &sq[k], 0);
          if (w != ZB_OK && w != ZB_ERR_TIMEOUT) st = w;
        }
      if (st == ZB_OK) st = t->ops->check(t);
    }
    for (int32_t k = 0; k < n && st == ZB_OK; k++)
      if (sq[k].active) st = zb__transport_wait(t, &sq[k], J->timeout);
    if (st == ZB_OK) drain(compute, 10 * J->timeout);
    if (it == 0) {
      J->reqs_after_first[r] = zb__transport_nccl_requests(t);
      pthread_mutex_lock(&dev.mu);
      J->mallocs_after_first[r] = dev.mallocs[r];
      pthread_mutex_unlock(&dev.mu);
    }
  }
  if (st != ZB_OK) {
    J->failed_at[r] = zb__now();
    /* What the runner does on failure: abort, cancel what is left. */
    char why[1024];
    snprintf(why, sizeof why, "%s", zb_last_error());
    t->ops->abort(t, why);
    for (int32_t k = 0; k < n; k++) zb__transport_cancel(t, &rq[k]), zb__transport_cancel(t, &sq[k]);
    ZB_FAIL(st, "%s", why);
  }
  J->reqs_after_last[r] = zb__transport_nccl_requests(t);
  pthread_mutex_lock(&dev.mu);
  J->mallocs_after_last[r] = dev.mallocs[r];
  pthread_mutex_unlock(&dev.mu);
  drain(compute, 5);
  for (int32_t i = 0; i < n; i++) free(ctx[i].in), free(ctx[i].out);
  free(ctx), free(rq), free(sq), free(recv_ops);
  return st;
}

static void *rank_main(void *arg) {
  rankarg_t *a = arg;
  job_t *J = a->job;
  int32_t r = a->rank;
  tl_rank = r;
  double t0 = zb__now();
  cudaStream_t compute;
  f_stream_create(&compute, 0);
  zb__cuda_t cu;
  memset(&cu, 0, sizeof cu);
  cu.device = 0, cu.compute = compute;
  zb_nccl_transport_config_t c = ZB_NCCL_TRANSPORT_CONFIG_INIT;
  c.rank = r, c.ranks = J->p, c.unique_id = J->id, c.schedule = J->s, c.timeout_s = J->timeout;
  if (J->use_signal) c.abort_signal = (zb_abort_signal_t){sig_poll, sig_publish, &J->sig};
  zb_transport_t *t = NULL;
  zb_status_t st = zb__transport_create_nccl_with(&t, &c, &fake_nccl, &fake_rt, &cu);
  J->created_at[r] = zb__now();
  if (st == ZB_OK) {
    J->comms[r] = zb__transport_nccl_comms(t);
    if (r == J->abort_rank) {
      J->abort_at = zb__now();
      zb_transport_abort(t, "the forward callback raised");
      st = t->ops->check(t);
    } else if (r == J->dead_rank) {
      /* Alive enough to make the transport, then silent: it only notices failure. */
      double until = zb__now() + 20 * J->timeout + 5;
      while ((st = t->ops->check(t)) == ZB_OK && zb__now() < until) nap_us(1000);
    } else {
      st = run_iterations(J, r, t, compute);
    }
  }
  J->st[r] = st;
  snprintf(J->msg[r], sizeof J->msg[r], "%s", st == ZB_OK ? "" : zb_last_error());
  J->done_at[r] = zb__now();
  J->took[r] = J->done_at[r] - t0;
  drain(compute, 5);
  zb_transport_destroy(t);
  f_stream_destroy(compute);
  return NULL;
}

static void job_init(job_t *J, const zb_schedule_t *s) {
  static int ids;
  memset(J, 0, sizeof *J);
  J->s = s;
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  J->p = info.ranks;
  snprintf((char *)J->id, sizeof J->id, "job%d", ++ids);
  J->iters = 3, J->depth = 4, J->timeout = 5.0;
  J->dead_rank = J->abort_rank = -1, J->create_only_rank = -1;
  pthread_mutex_init(&J->mu, NULL);
  pthread_mutex_init(&J->sig.mu, NULL);
}

static void job_run(job_t *J) {
  pthread_t th[8];
  rankarg_t a[8];
  for (int32_t r = 0; r < J->p; r++) {
    a[r] = (rankarg_t){J, r};
    if (J->create_only_rank < 0 || J->create_only_rank == r) pthread_create(&th[r], NULL, rank_main, &a[r]);
  }
  for (int32_t r = 0; r < J->p; r++)
    if (J->create_only_rank < 0 || J->create_only_rank == r) pthread_join(th[r], NULL);
  pthread_mutex_destroy(&J->mu);
  pthread_mutex_destroy(&J->sig.mu);
}

/* ---- tests --------------------------------------------------------------------------------------- */

static zb_schedule_t *make(zb_kind_t kind, int p, int m, int v) {
  zb_schedule_spec_t spec = zb_test_spec(kind, p, m, v);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  return s;
}

/* Every kind's traffic over one communicator per rank pair arrives intact, in every iteration,
 * with the ranks issuing in their runner order: activations and gradients (and under V and
 * interleaved placement several boundaries) share a pair's queue without deadlock. Requests and
 * device memory are made in the first iteration only. */
static void test_pair_queues_carry_every_kind(void **state) {
  (void)state;
  struct {
    zb_kind_t kind;
    int p, m, v;
  } cases[] = {{ZB_KIND_1F1B, 2, 4, 1},        {ZB_KIND_1F1B, 4, 8, 1},  {ZB_KIND_ZB_H1, 3, 6, 1},
               {ZB_KIND_ZB_H2, 3, 6, 1},       {ZB_KIND_ZB_V, 2, 4, 2},  {ZB_KIND_ZB_V, 4, 8, 2},
               {ZB_KIND_INTERLEAVED_1F1B, 3, 6, 2}, {ZB_KIND_V_HALF, 3, 6, 2}, {ZB_KIND_GPIPE, 3, 3, 1}};
  int quick = getenv("ZBPP_TEST_QUICK") != NULL;
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    if (quick && cases[k].p > 3) continue;
    zb_schedule_t *s = make(cases[k].kind, cases[k].p, cases[k].m, cases[k].v);
    for (int depth = 1; depth <= 4; depth += 3) {
      job_t J;
      job_init(&J, s);
      J.depth = depth;
      job_run(&J);
      for (int32_t r = 0; r < J.p; r++) {
        if (J.st[r] != ZB_OK)
          fail_msg("kind %d p %d m %d depth %d: rank %d failed: %s", (int)cases[k].kind, cases[k].p, cases[k].m,
                   depth, (int)r, J.msg[r]);
        /* One communicator per neighbour: loop placement with v = 1 and V have 1 or 2, a ring 2. */
        int ring = cases[k].kind == ZB_KIND_INTERLEAVED_1F1B;
        int want = cases[k].p == 2 ? 1 : !ring && (r == 0 || r == J.p - 1) ? 1 : 2;
        assert_int_equal(J.comms[r], want);
        assert_int_equal(J.reqs_after_last[r], J.reqs_after_first[r]);
        assert_int_equal(J.mallocs_after_last[r], J.mallocs_after_first[r]);
      }
      if (J.bad_messages) fail_msg("kind %d p %d: %ld messages wrong, first: %s", (int)cases[k].kind, cases[k].p,
                                   J.bad_messages, J.bad);
    }
    zb_schedule_destroy(s);
  }
}

/* timeout_s bounds a stall, not the time since the host issued: a receive posted at once whose
 * data comes 0.8 s later, while the receiver's own compute runs 1.2 s first, is no failure at a
 * 0.5 s timeout (a clock started at issue would have fired at 0.5 s). */
static void test_timeout_counts_from_ready(void **state) {
  (void)state;
  zb_schedule_t *s = make(ZB_KIND_1F1B, 2, 2, 1);
  job_t J;
  job_init(&J, s);
  J.timeout = 0.5, J.iters = 1;
  J.lead[0] = 0.8, J.lead[1] = 1.2;
  job_run(&J);
  for (int32_t r = 0; r < 2; r++)
    if (J.st[r] != ZB_OK) fail_msg("rank %d failed: %s", (int)r, J.msg[r]);
  assert_int_equal(J.bad_messages, 0);
  zb_schedule_destroy(s);
}

/* A dead peer: the send to it is ready and never taken; the watchdog fails the rank about
 * timeout_s later, naming the peer and the channel, and the abort signal fails the silent rank
 * too, within a second. */
static void test_dead_peer_times_out_and_tells_everyone(void **state) {
  (void)state;
  zb_schedule_t *s = make(ZB_KIND_1F1B, 2, 2, 1);
  job_t J;
  job_init(&J, s);
  J.timeout = 0.3, J.iters = 1, J.dead_rank = 1, J.use_signal = 1;
  job_run(&J);
  ASSERT_STATUS(J.st[0], ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(J.msg[0], "rank 0: the send of");
  ASSERT_CONTAINS(J.msg[0], "to rank 1 (the activations of boundary 0");
  ASSERT_CONTAINS(J.msg[0], "within 0.3 s");
  assert_true(J.took[0] < 0.3 + 2.0);
  ASSERT_STATUS(J.st[1], ZB_ERR_REMOTE);
  ASSERT_CONTAINS(J.msg[1], "rank 0: the send of");
  assert_true(J.took[1] < J.took[0] + 1.0);
  zb_schedule_destroy(s);
}

/* One rank's failure (a callback raised, so its runner aborted) fails every other rank within a
 * second with that rank's message, though their timeout is 30 s. */
static void test_abort_reaches_every_rank(void **state) {
  (void)state;
  zb_schedule_t *s = make(ZB_KIND_1F1B, 3, 6, 1);
  job_t J;
  job_init(&J, s);
  J.timeout = 30, J.iters = 1, J.abort_rank = 2, J.use_signal = 1;
  job_run(&J);
  for (int32_t r = 0; r < 3; r++) {
    ASSERT_STATUS(J.st[r], ZB_ERR_REMOTE);
    ASSERT_CONTAINS(J.msg[r], "rank 2 aborted: the forward callback raised");
    /* Counted from the abort, or from when this rank had made its transport if that was later
     * (making the communicators is no part of it: on a loaded machine it alone took seconds), to
     * when the rank saw the failure. Not to the end of its own abort: that waits up to 2 s for
     * transfers in flight to leave their kernels (nccl_abort), and the fake device sometimes
     * holds one that long (2 or 7 s measured, in about 1 run of 10). */
    double from = J.created_at[r] > J.abort_at ? J.created_at[r] : J.abort_at;
    double seen = r == J.abort_rank ? J.done_at[r] : J.failed_at[r];
    double after = seen - from;
    if (after > 1.5) fail_msg("rank %d saw the failure %.2f s after the abort", (int)r, after);
  }
  zb_schedule_destroy(s);
}

/* The host blocked inside an enqueue (a launch queue filled by a dead peer) does not stop the
 * watchdog: it fires, aborts the communicators, and the blocked call returns with its message. */
static void test_watchdog_fires_while_host_blocks_in_enqueue(void **state) {
  (void)state;
  zb_schedule_t *s = make(ZB_KIND_1F1B, 2, 4, 1);
  job_t J;
  job_init(&J, s);
  J.timeout = 0.3, J.iters = 1, J.dead_rank = 1, J.use_signal = 1;
  dev.block_launch_rank = 0, dev.launches_of_blocked = 0;
  job_run(&J);
  dev.block_launch_rank = -1;
  ASSERT_STATUS(J.st[0], ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(J.msg[0], "has not finished within 0.3 s");
  assert_true(J.took[0] < 0.3 + 2.0);
  zb_schedule_destroy(s);
}

/* A rank that never calls create: the others fail at timeout_s instead of hanging in init. */
static void test_creation_is_bounded(void **state) {
  (void)state;
  zb_schedule_t *s = make(ZB_KIND_1F1B, 2, 2, 1);
  job_t J;
  job_init(&J, s);
  J.timeout = 0.3, J.create_only_rank = 0;
  job_run(&J);
  ASSERT_STATUS(J.st[0], ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(J.msg[0], "did not call zb_transport_create_nccl");
  assert_true(J.took[0] < 0.3 + 2.0);
  zb_schedule_destroy(s);
}

/* Bad configurations are named: a half-set abort signal, an unknown layout. */
static void test_config_errors(void **state) {
  (void)state;
  zb_schedule_t *s = make(ZB_KIND_1F1B, 2, 2, 1);
  uint8_t id[16] = "cfg";
  zb__cuda_t cu;
  memset(&cu, 0, sizeof cu);
  zb_nccl_transport_config_t c = ZB_NCCL_TRANSPORT_CONFIG_INIT;
  c.rank = 0, c.ranks = 2, c.unique_id = id, c.schedule = s;
  c.abort_signal.poll = sig_poll;
  zb_transport_t *t = NULL;
  ASSERT_STATUS(zb__transport_create_nccl_with(&t, &c, &fake_nccl, &fake_rt, &cu), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "both poll and publish");
  c.abort_signal.poll = NULL;
  c.struct_size = 12;
  ASSERT_STATUS(zb__transport_create_nccl_with(&t, &c, &fake_nccl, &fake_rt, &cu), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "ZB_NCCL_TRANSPORT_CONFIG_INIT");
  assert_null(t);
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_pair_queues_carry_every_kind, setup, teardown),
      cmocka_unit_test_setup_teardown(test_timeout_counts_from_ready, setup, teardown),
      cmocka_unit_test_setup_teardown(test_dead_peer_times_out_and_tells_everyone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_abort_reaches_every_rank, setup, teardown),
      cmocka_unit_test_setup_teardown(test_watchdog_fires_while_host_blocks_in_enqueue, setup, teardown),
      cmocka_unit_test_setup_teardown(test_creation_is_bounded, setup, teardown),
      cmocka_unit_test(test_config_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
