/*
 * nccl.c - the fake device's NCCL (libfakecuda.so is also libnccl.so.2): communicators over the
 * fake devices (FAKE_CUDA_DEVICES of them), point-to-point transfers and the two collectives zbpp
 * uses, run by the fake streams (fake.c), so the NCCL transports run with the CUDA backend end to
 * end: ranks as threads, one fake device each.
 *
 * Kept of NCCL, because the transports rely on it:
 *  - a communicator is ready once every rank has joined (ncclCommInitRankConfig) or, for a split,
 *    once every rank of the parent has called ncclCommSplit that many times; a non-blocking one
 *    (config.blocking = 0) returns ncclInProgress until then and ncclCommGetAsyncError says when it
 *    is ready; two ranks of one communicator on one device is ncclInvalidUsage for both;
 *  - on a non-blocking communicator an operation (or ncclGroupEnd) returns ncclInProgress and is
 *    put on its stream later, from a thread of NCCL's (here: the launcher, after a random delay);
 *    until ncclCommGetAsyncError says ncclSuccess, work the caller adds to that stream may run
 *    before it, as on a GPU. On a blocking one it is on the stream when the call returns;
 *  - operations hold their stream until done, in the order issued; the k-th send from a to b meets
 *    the k-th receive at b from a, and both finish together; the operations of one group on one
 *    stream progress together (a send and a receive in one group never deadlock each other), those
 *    of separate calls one after another, so two ranks issuing in different orders deadlock, as on
 *    a GPU; a collective finishes when every rank of the communicator has reached it, adding in rank
 *    order in fp32 (max: fmaxf) and rounding once into the type; ranks that disagree on a
 *    collective's count, type, op or root, or a send and receive of different sizes, are a fault;
 *  - stream and buffers must be of the communicator's device (NCCL runs there whatever is current);
 *    a buffer that is not device memory of it is a device fault;
 *  - ncclCommAbort ends the communicator's pending operations at once (their streams go on; the
 *    other ranks' operations no longer see its posted ones); a communicator used after its abort
 *    or destroy is a fault (a use after free on NCCL); ncclCommGetAsyncError reports the errors.
 * What it is not: NCCL's algorithms, its summation order, or its error texts.
 */
#define _GNU_SOURCE /* rand_r */
#include <cuda_runtime_api.h>
#include <math.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_cuda.h"

enum { MAX_RANKS = 16, MAX_SPLITS = 16, MAX_GROUP_OPS = 256 };

typedef struct fgroup {
  struct fgroup *next;
  int from_split; /* made by ncclCommSplit: no unique id joins it */
  unsigned char id[NCCL_UNIQUE_ID_BYTES];
  int nranks, joined;
  struct fcomm *rank[MAX_RANKS];
  long sseq[MAX_RANKS][MAX_RANKS], rseq[MAX_RANKS][MAX_RANKS]; /* [src][dst], issued so far */
  /* splits: per round, the parent ranks' calls */
  int split_calls[MAX_SPLITS], split_color[MAX_SPLITS][MAX_RANKS], split_key[MAX_SPLITS][MAX_RANKS];
  struct fcomm *split_child[MAX_SPLITS][MAX_RANKS];
} fgroup_t;

typedef struct fcomm {
  unsigned magic;
  fgroup_t *g; /* NULL until the split that makes it is complete */
  int rank, device, blocking, aborted, splits;
  int launching; /* groups of a non-blocking communicator not yet on their streams (launcher_main) */
  long colls;    /* collectives issued */
  ncclResult_t async;
} fcomm_t;

typedef struct op {
  struct op *next_posted;
  fcomm_t *comm;
  int kind; /* 0 send, 1 recv, 2 all-reduce, 3 broadcast */
  int peer, dtype, redop, root, done;
  const void *sendbuf;
  void *recvbuf;
  size_t count, bytes;
  long seq;
} op_t;

typedef struct {
  int n;
  op_t ops[];
} item_t;

enum { COMM_MAGIC = 0xc0aa1u, COMM_DEAD = 0xdeadc0aau };

static pthread_mutex_t nmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ncv = PTHREAD_COND_INITIALIZER;
static fgroup_t *groups;
static op_t *posted; /* sends and collectives whose stream is running them */
static __thread int group_depth;
static __thread int group_n;
static __thread op_t group_ops[MAX_GROUP_OPS];
static __thread void *group_stream[MAX_GROUP_OPS];
static __thread char last_error[256];

static void say(const char *fmt, const char *a, int b) {
  snprintf(last_error, sizeof last_error, fmt, a, b);
}

static size_t dtype_bytes(int t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

/* The cudaDataType_t of a reducible NCCL type (CUDA_R_32F 0, _16F 2, _16BF 14), -1 otherwise. */
static int reducible(int t) { return t == ncclFloat32 ? 0 : t == ncclFloat16 ? 2 : t == ncclBfloat16 ? 14 : -1; }

/* The communicator behind a handle; NULL for NULL or garbage. A handle that was aborted or
 * destroyed is a use after free on NCCL: here a fault every later call sees (records are kept, so
 * reading one is safe). */
static fcomm_t *comm_of(ncclComm_t c) {
  fcomm_t *f = (fcomm_t *)c;
  if (f && f->magic == COMM_DEAD) {
    fake_fault("NCCL: rank %d's communicator used after ncclCommAbort or ncclCommDestroy", f->rank);
    return NULL;
  }
  return f && f->magic == COMM_MAGIC ? f : NULL;
}

static int current_device(void) {
  int d = 0;
  cudaGetDevice(&d);
  return d;
}

ncclResult_t ncclGetVersion(int *v) {
  if (!v) return ncclInvalidArgument;
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static long counter;
  if (!id) return ncclInvalidArgument;
  memset(id, 0, sizeof *id);
  pthread_mutex_lock(&nmu);
  long k = ++counter;
  pthread_mutex_unlock(&nmu);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  memcpy(id->internal, &k, sizeof k);
  memcpy(id->internal + 8, &ts, sizeof ts);
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t comm) { return last_error; }

static int blocking_of(const ncclConfig_t *cfg) { return !cfg || cfg->blocking != 0; }

/* Waits until c is ready (nmu held). */
static void wait_ready(fcomm_t *c) {
  while (!c->aborted && (!c->g || c->g->joined < c->g->nranks)) pthread_cond_wait(&ncv, &nmu);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *cfg) {
  if (!out || nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  fcomm_t *c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  c->magic = COMM_MAGIC, c->rank = rank, c->device = current_device(), c->blocking = blocking_of(cfg);
  pthread_mutex_lock(&nmu);
  fgroup_t *g = groups;
  while (g && (g->from_split || memcmp(g->id, id.internal, sizeof g->id) != 0)) g = g->next;
  if (!g) {
    g = calloc(1, sizeof *g);
    if (!g) {
      pthread_mutex_unlock(&nmu);
      free(c);
      return ncclSystemError;
    }
    memcpy(g->id, id.internal, sizeof g->id);
    g->nranks = nranks;
    g->next = groups;
    groups = g;
  }
  ncclResult_t r = ncclSuccess;
  if (g->nranks != nranks || g->rank[rank]) {
    say("%s (rank %d)", g->nranks != nranks ? "ranks disagree about nranks" : "rank joined twice", rank);
    r = ncclInvalidUsage;
  }
  for (int k = 0; r == ncclSuccess && k < nranks; k++)
    if (g->rank[k] && g->rank[k]->device == c->device) {
      say("%s: rank %d", "Duplicate GPU detected (two ranks of one communicator on one device)", k);
      g->rank[k]->async = ncclInvalidUsage; /* NCCL fails both */
      r = ncclInvalidUsage;
    }
  if (r != ncclSuccess) {
    pthread_mutex_unlock(&nmu);
    free(c);
    return r;
  }
  c->g = g;
  g->rank[rank] = c;
  g->joined++;
  pthread_cond_broadcast(&ncv);
  *out = (ncclComm_t)c;
  if (c->blocking) wait_ready(c);
  r = g->joined < g->nranks ? ncclInProgress : ncclSuccess;
  pthread_mutex_unlock(&nmu);
  return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, NULL);
}

/* Forms round r's children once every rank of g has called (nmu held). */
static void split_finish(fgroup_t *g, int r) {
  int done[MAX_RANKS] = {0};
  for (int a = 0; a < g->nranks; a++) {
    if (done[a] || g->split_color[r][a] == NCCL_SPLIT_NOCOLOR) continue;
    fgroup_t *child = calloc(1, sizeof *child);
    if (!child) {
      fake_fault("ncclCommSplit: out of memory");
      return;
    }
    int members[MAX_RANKS], n = 0;
    for (int b = 0; b < g->nranks; b++)
      if (!done[b] && g->split_color[r][b] == g->split_color[r][a]) members[n++] = b, done[b] = 1;
    for (int i = 1; i < n; i++) /* by key, then parent rank */
      for (int j = i; j > 0 && g->split_key[r][members[j]] < g->split_key[r][members[j - 1]]; j--) {
        int t = members[j];
        members[j] = members[j - 1], members[j - 1] = t;
      }
    child->nranks = child->joined = n;
    child->from_split = 1;
    for (int i = 0; i < n; i++) {
      fcomm_t *c = g->split_child[r][members[i]];
      c->rank = i, c->g = child;
      child->rank[i] = c;
    }
    child->next = groups;
    groups = child;
  }
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *out, ncclConfig_t *cfg) {
  fcomm_t *p = comm_of(comm);
  if (!p || !out) return ncclInvalidArgument;
  pthread_mutex_lock(&nmu);
  if (p->aborted || !p->g || p->g->joined < p->g->nranks || p->splits >= MAX_SPLITS) {
    pthread_mutex_unlock(&nmu);
    say("%s (rank %d)", "ncclCommSplit on a communicator that is not ready", p->rank);
    return ncclInvalidUsage;
  }
  fgroup_t *g = p->g;
  const int r = p->splits++;
  fcomm_t *c = NULL;
  if (color != NCCL_SPLIT_NOCOLOR) {
    c = calloc(1, sizeof *c);
    if (!c) {
      pthread_mutex_unlock(&nmu);
      return ncclSystemError;
    }
    c->magic = COMM_MAGIC, c->device = p->device, c->blocking = blocking_of(cfg);
  }
  g->split_color[r][p->rank] = color, g->split_key[r][p->rank] = key, g->split_child[r][p->rank] = c;
  if (++g->split_calls[r] == g->nranks) split_finish(g, r);
  pthread_cond_broadcast(&ncv);
  *out = (ncclComm_t)c;
  ncclResult_t res = ncclSuccess;
  if (c && c->blocking) wait_ready(c);
  else if (c && !c->g) res = ncclInProgress;
  pthread_mutex_unlock(&nmu);
  return res;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *err) {
  fcomm_t *c = comm_of(comm);
  if (!c || !err) return ncclInvalidArgument;
  pthread_mutex_lock(&nmu);
  *err = c->async != ncclSuccess                          ? c->async
         : !c->g || c->g->joined < c->g->nranks || c->launching ? ncclInProgress
                                                                : ncclSuccess;
  pthread_mutex_unlock(&nmu);
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  fcomm_t *c = comm_of(comm);
  if (!c || !count || !c->g) return ncclInvalidArgument;
  *count = c->g->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  fcomm_t *c = comm_of(comm);
  if (!c || !rank || !c->g) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

/* Abort and destroy leave the record (operations of other ranks may still look at it); its handle
 * stops being one. */
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess; /* NULL is allowed */
  fcomm_t *c = comm_of(comm);
  if (!c) return ncclInvalidArgument;
  pthread_mutex_lock(&nmu);
  c->aborted = 1;
  c->magic = COMM_DEAD;
  pthread_cond_broadcast(&ncv);
  pthread_mutex_unlock(&nmu);
  return ncclSuccess;
}

/* Unlike an abort, the operations already issued still run to their end. */
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  fcomm_t *c = comm_of(comm);
  if (!c) return ncclInvalidArgument;
  pthread_mutex_lock(&nmu);
  c->magic = COMM_DEAD;
  pthread_mutex_unlock(&nmu);
  return ncclSuccess;
}

/* ---- operations ------------------------------------------------------------------------------ */

/* A posted collective of c's group with this seq whose every rank is posted: reduces or broadcasts
 * into every rank's receive buffer and marks them done (nmu held). */
static void try_collective(op_t *o) {
  fgroup_t *g = o->comm->g;
  op_t *all[MAX_RANKS] = {0};
  int n = 0;
  for (op_t *p = posted; p; p = p->next_posted)
    if (p->kind == o->kind && p->comm->g == g && p->seq == o->seq && !p->comm->aborted && !all[p->comm->rank])
      all[p->comm->rank] = p, n++;
  if (n < g->nranks) return;
  for (int k = 1; k < n; k++)
    if (all[k]->count != all[0]->count || all[k]->dtype != all[0]->dtype || all[k]->redop != all[0]->redop ||
        all[k]->root != all[0]->root) {
      /* NCCL would read or write past a buffer, or hang: the ranks must agree. */
      for (int j = 0; j < n; j++) all[j]->comm->async = ncclInvalidUsage;
      fake_fault("NCCL: collective %ld: rank 0 has count %zu, type %d, op %d, root %d; rank %d has %zu, %d, %d, %d",
                 o->seq, all[0]->count, all[0]->dtype, all[0]->redop, all[0]->root, k, all[k]->count, all[k]->dtype,
                 all[k]->redop, all[k]->root);
      return;
    }
  const size_t bytes = o->count * dtype_bytes(o->dtype);
  if (o->kind == 3) {
    const op_t *root = all[o->root];
    char *tmp = malloc(bytes ? bytes : 1);
    if (!tmp) return;
    memcpy(tmp, root->sendbuf, bytes);
    for (int k = 0; k < n; k++) memcpy(all[k]->recvbuf, tmp, bytes);
    free(tmp);
  } else {
    const int t = reducible(o->dtype);
    float *acc = malloc((o->count ? o->count : 1) * sizeof *acc);
    if (!acc) return;
    for (size_t i = 0; i < o->count; i++) {
      float v = fake_load(all[0]->sendbuf, t, i);
      for (int k = 1; k < n; k++) {
        const float x = fake_load(all[k]->sendbuf, t, i);
        v = o->redop == ncclMax ? fmaxf(v, x) : v + x;
      }
      acc[i] = v;
    }
    for (int k = 0; k < n; k++)
      for (size_t i = 0; i < o->count; i++) fake_store(all[k]->recvbuf, t, i, acc[i]);
    free(acc);
  }
  for (int k = 0; k < n; k++) all[k]->done = 1;
}

static void unpost(op_t *o) {
  for (op_t **p = &posted; *p; p = &(*p)->next_posted)
    if (*p == o) {
      *p = o->next_posted;
      return;
    }
}

/* One stream's share of a group: its sends and collectives posted, then every operation served as
 * its peers come, until all are done or a communicator is aborted. */
static void item_fn(void *arg) {
  item_t *it = arg;
  pthread_mutex_lock(&nmu);
  for (int k = 0; k < it->n; k++)
    if (it->ops[k].kind != 1) it->ops[k].next_posted = posted, posted = &it->ops[k];
  for (;;) {
    int left = 0, aborted = 0;
    for (int k = 0; k < it->n; k++) {
      op_t *o = &it->ops[k];
      if (o->done) continue;
      if (o->comm->aborted) {
        aborted = 1;
        continue;
      }
      if (o->kind == 1) {
        for (op_t *s = posted; s; s = s->next_posted)
          if (s->kind == 0 && !s->done && !s->comm->aborted && s->comm->g == o->comm->g &&
              s->comm->rank == o->peer && s->peer == o->comm->rank && s->seq == o->seq) {
            if (s->bytes != o->bytes) {
              o->comm->async = s->comm->async = ncclInvalidUsage;
              fake_fault("NCCL: rank %d receives %zu bytes from rank %d, which sends %zu", o->comm->rank, o->bytes,
                         o->peer, s->bytes);
              aborted = 1;
              break;
            }
            memcpy(o->recvbuf, s->sendbuf, o->bytes);
            o->done = s->done = 1;
            pthread_cond_broadcast(&ncv);
            break;
          }
      } else if (o->kind >= 2) {
        try_collective(o);
        if (o->done) pthread_cond_broadcast(&ncv);
      }
      if (!o->done) left++;
    }
    if (fake_faulted())
      for (int k = 0; k < it->n; k++)
        if (!it->ops[k].done && it->ops[k].comm->async == ncclSuccess) it->ops[k].comm->async = ncclUnhandledCudaError;
    if (!left || aborted || fake_faulted()) break;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 5 * 1000 * 1000; /* a fault on the device does not signal this condition */
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&ncv, &nmu, &ts);
  }
  for (int k = 0; k < it->n; k++)
    if (it->ops[k].kind != 1) unpost(&it->ops[k]);
  pthread_mutex_unlock(&nmu);
}

/* A group of a non-blocking communicator that NCCL has not yet put on its streams: NCCL enqueues
 * such a group from a thread of its own, returning ncclInProgress, and the caller must wait for
 * ncclCommGetAsyncError to say ncclSuccess before it may count on the work being on the streams
 * (transport_nccl_group.c and transport_nccl.c do). Here one launcher thread enqueues them, in the
 * order they came, each after a random delay. */
typedef struct launch {
  struct launch *next;
  int n;
  item_t *items[MAX_GROUP_OPS];
  fake_stream_t *streams[MAX_GROUP_OPS];
  fcomm_t *comms[MAX_GROUP_OPS];
} launch_t;

static launch_t *launch_head, *launch_tail;
static pthread_once_t launcher_once = PTHREAD_ONCE_INIT;

static void *launcher_main(void *unused) {
  unsigned seed = 12345;
  pthread_mutex_lock(&nmu);
  for (;;) {
    while (!launch_head) pthread_cond_wait(&ncv, &nmu);
    launch_t *l = launch_head;
    launch_head = l->next;
    if (!launch_head) launch_tail = NULL;
    pthread_mutex_unlock(&nmu);
    struct timespec ts = {0, (long)(rand_r(&seed) % 200) * 1000};
    nanosleep(&ts, NULL);
    int bad = 0;
    for (int k = 0; k < l->n; k++) bad |= fake_enqueue(l->streams[k], item_fn, l->items[k]) != 0;
    pthread_mutex_lock(&nmu);
    for (int k = 0; k < l->n; k++) {
      l->comms[k]->launching--;
      if (bad && l->comms[k]->async == ncclSuccess) l->comms[k]->async = ncclUnhandledCudaError;
    }
    pthread_cond_broadcast(&ncv);
    free(l);
  }
  return NULL;
}

static void launcher_start(void) {
  pthread_t t;
  if (pthread_create(&t, NULL, launcher_main, NULL) == 0) pthread_detach(t);
}

/* Enqueues the calling thread's pending operations, one item per stream, in issue order: at once,
 * or through the launcher when any of them is on a non-blocking communicator (ncclInProgress). */
static ncclResult_t flush(void) {
  ncclResult_t r = ncclSuccess;
  int used[MAX_GROUP_OPS] = {0};
  launch_t *l = calloc(1, sizeof *l);
  int later = 0;
  for (int a = 0; a < group_n; a++) later |= !group_ops[a].comm->blocking;
  for (int a = 0; a < group_n && l; a++) {
    if (used[a]) continue;
    int n = 0;
    for (int b = a; b < group_n; b++) n += group_stream[b] == group_stream[a] && !used[b];
    item_t *it = calloc(1, sizeof *it + (size_t)n * sizeof(op_t));
    fake_stream_t *s = fake_stream_of(group_stream[a]);
    if (!it || !s) {
      free(it);
      r = !s ? ncclInvalidArgument : ncclSystemError;
      break;
    }
    for (int b = a; b < group_n; b++)
      if (group_stream[b] == group_stream[a] && !used[b]) it->ops[it->n++] = group_ops[b], used[b] = 1;
    l->items[l->n] = it, l->streams[l->n] = s, l->comms[l->n++] = it->ops[0].comm;
  }
  group_n = 0;
  if (!l) return ncclSystemError;
  if (r != ncclSuccess || !later) {
    for (int k = 0; k < l->n; k++)
      if (r != ncclSuccess) free(l->items[k]);
      else if (fake_enqueue(l->streams[k], item_fn, l->items[k]) != 0) r = ncclUnhandledCudaError;
    free(l);
    return r;
  }
  pthread_once(&launcher_once, launcher_start);
  pthread_mutex_lock(&nmu);
  for (int k = 0; k < l->n; k++) l->comms[k]->launching++;
  if (launch_tail) launch_tail->next = l;
  else launch_head = l;
  launch_tail = l;
  pthread_cond_broadcast(&ncv);
  pthread_mutex_unlock(&nmu);
  return ncclInProgress;
}

/* nccl.h declares these without a prototype. */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return ncclInvalidUsage;
  return --group_depth == 0 ? flush() : ncclSuccess;
}

/* Checks an operation and adds it to the group (or, outside one, enqueues it at once). */
static ncclResult_t issue(op_t o, cudaStream_t stream) {
  fcomm_t *c = o.comm;
  if (!c) return ncclInvalidArgument;
  const size_t bytes = o.count * dtype_bytes(o.dtype);
  if (!dtype_bytes(o.dtype) || ((o.kind == 2) && reducible(o.dtype) < 0) ||
      (o.kind == 2 && o.redop != ncclSum && o.redop != ncclMax))
    return ncclInvalidArgument;
  pthread_mutex_lock(&nmu);
  if (c->aborted || !c->g || c->g->joined < c->g->nranks) {
    pthread_mutex_unlock(&nmu);
    say("%s (rank %d)", "an operation on a communicator that is not ready or was aborted", c->rank);
    return ncclInvalidUsage;
  }
  fgroup_t *g = c->g;
  if ((o.kind <= 1 && (o.peer < 0 || o.peer >= g->nranks)) || (o.kind == 3 && (o.root < 0 || o.root >= g->nranks))) {
    pthread_mutex_unlock(&nmu);
    return ncclInvalidArgument;
  }
  if (o.kind == 0) o.seq = g->sseq[c->rank][o.peer]++;
  else if (o.kind == 1) o.seq = g->rseq[o.peer][c->rank]++;
  else o.seq = c->colls++;
  pthread_mutex_unlock(&nmu);
  o.bytes = bytes;
  /* NCCL runs on the communicator's device, whatever is current: its stream and buffers must be
   * that device's. */
  fake_stream_t *fs = fake_stream_of(stream);
  if (!fs || fake_stream_device(fs) != c->device) {
    say("%s (rank %d)", "an operation on a stream that is not of the communicator's device", c->rank);
    return ncclInvalidArgument;
  }
  if ((o.sendbuf && fake_check_device_range_on(o.sendbuf, bytes, c->device, "an NCCL send buffer")) ||
      (o.recvbuf && fake_check_device_range_on(o.recvbuf, bytes, c->device, "an NCCL receive buffer")))
    return ncclUnhandledCudaError;
  if (group_n == MAX_GROUP_OPS) return ncclInternalError;
  group_ops[group_n] = o;
  group_stream[group_n++] = stream;
  return group_depth ? ncclSuccess : flush();
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
  return issue((op_t){.comm = comm_of(comm), .kind = 0, .peer = peer, .dtype = t, .sendbuf = buf, .count = count}, s);
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
  return issue((op_t){.comm = comm_of(comm), .kind = 1, .peer = peer, .dtype = t, .recvbuf = buf, .count = count}, s);
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s) {
  return issue((op_t){.comm = comm_of(comm), .kind = 2, .dtype = t, .redop = op, .sendbuf = send, .recvbuf = recv,
                      .count = count},
               s);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s) {
  fcomm_t *c = comm_of(comm);
  /* Only the root's send buffer is read. */
  return issue((op_t){.comm = c, .kind = 3, .dtype = t, .root = root, .sendbuf = c && c->rank == root ? send : NULL,
                      .recvbuf = recv, .count = count},
               s);
}
