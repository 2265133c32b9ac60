/*
 * fake_nccl.c - the fake device and NCCL of fake_nccl.h (which says what they keep of CUDA's and
 * NCCL's semantics).
 */
#define _POSIX_C_SOURCE 200809L
#include "fake_nccl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/internal.h"

fake_dev_t fake_dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .block_launch_rank = -1};

__thread int tl_rank = -1;
static __thread int tl_group_depth;
static __thread item_t *tl_group[16]; /* per stream, the group's pending item */
static __thread fstream_t *tl_group_stream[16];
static __thread int tl_group_n;

void nap_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

void push_item(fstream_t *s, item_t *it) {
  it->next = NULL;
  if (s->tail) s->tail->next = it;
  else s->head = it;
  s->tail = it;
}

/* The op matching a send or receive, at the head of some stream (both must be running). */
static xop_t *find_match(const xop_t *x) {
  for (fstream_t *s = fake_dev.live; s; s = s->next_live) {
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

static float coll_load(const void *b, size_t i, int dtype) {
  if (dtype == ncclFloat32) return ((const float *)b)[i];
  uint16_t h = ((const uint16_t *)b)[i];
  return dtype == ncclFloat16 ? zb__half_to_float(h) : zb__bf16_to_float(h);
}

static void coll_store(void *b, size_t i, int dtype, float v) {
  if (dtype == ncclFloat32) ((float *)b)[i] = v;
  else ((uint16_t *)b)[i] = dtype == ncclFloat16 ? zb__float_to_half(v) : zb__float_to_bf16(v);
}

/* it's collective, carried out when every rank of its communicator has its at a stream's head: an
 * all-reduce in rank order, each step rounded to the dtype (NCCL's order differs; the tests compare
 * with this one), FAKE_COLL_SECONDS after they met; a broadcast copies the root's bytes. An aborted
 * communicator's returns at once.
 * Device lock held. */
static void run_collective(item_t *it) {
  fcoll_t *c = &it->coll;
  if (c->comm->aborted) {
    c->done = 1;
    return;
  }
  fgroup_t *g = c->comm->g;
  fcoll_t *by_rank[16] = {0};
  int n = 0;
  for (fstream_t *s = fake_dev.live; s; s = s->next_live) {
    item_t *h = s->head;
    if (!h || h->kind != IT_COLL || h->coll.done || h->coll.comm->g != g || h->coll.seq != c->seq) continue;
    if (h->coll.comm->aborted || h->coll.comm->rank >= 16) continue;
    by_rank[h->coll.comm->rank] = &h->coll, n++;
  }
  if (n < g->nranks) return;
  double now = zb__now();
  if (c->met_at == 0)
    for (int r = 0; r < g->nranks; r++) by_rank[r]->met_at = now;
  if (now - c->met_at < FAKE_COLL_SECONDS) return; /* it takes a while, as on a GPU */
  if (c->is_broadcast) {
    for (int r = 0; r < g->nranks; r++)
      if (r != c->root) memcpy(by_rank[r]->buf, by_rank[c->root]->buf, c->count);
  } else {
    float *acc = malloc((c->count ? c->count : 1) * sizeof *acc);
    for (size_t i = 0; i < c->count; i++) acc[i] = coll_load(by_rank[0]->buf, i, c->dtype);
    for (int r = 1; r < g->nranks; r++)
      for (size_t i = 0; i < c->count; i++) {
        float b = coll_load(by_rank[r]->buf, i, c->dtype);
        float v = c->op == ncclSum ? acc[i] + b : fmaxf(acc[i], b);
        acc[i] = v;
        if (c->dtype != ncclFloat32) { /* rounded to the dtype at each step */
          uint16_t h = c->dtype == ncclFloat16 ? zb__float_to_half(acc[i]) : zb__float_to_bf16(acc[i]);
          acc[i] = c->dtype == ncclFloat16 ? zb__half_to_float(h) : zb__bf16_to_float(h);
        }
      }
    for (int r = 0; r < g->nranks; r++)
      for (size_t i = 0; i < c->count; i++) coll_store(by_rank[r]->buf, i, c->dtype, acc[i]);
    free(acc);
  }
  for (int r = 0; r < g->nranks; r++) by_rank[r]->done = 1;
}

/* One pass over the streams' heads; 1 when something moved. Device lock held. */
static int step_once(void) {
  int moved = 0;
  double t = zb__now();
  for (fstream_t *s = fake_dev.live; s; s = s->next_live) {
    item_t *it = s->head;
    if (!it) continue;
    int pop = 0;
    if (it->kind == IT_RECORD) {
      if (it->ver > it->ev->completed) it->ev->completed = it->ver;
      pop = 1;
    } else if (it->kind == IT_WAIT) {
      pop = it->ev->completed >= it->ver;
    } else if (it->kind == IT_COLL) {
      if (!it->coll.done) run_collective(it);
      pop = it->coll.done;
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
    pthread_mutex_lock(&fake_dev.mu);
    int stop = fake_dev.stop;
    while (step_once()) {
    }
    pthread_mutex_unlock(&fake_dev.mu);
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
cudaError_t f_event_create(cudaEvent_t *e, unsigned int flags) {
  (void)flags;
  fevent_t *ev = calloc(1, sizeof *ev);
  *e = (cudaEvent_t)ev;
  return cudaSuccess;
}
cudaError_t f_event_destroy(cudaEvent_t e) {
  pthread_mutex_lock(&fake_dev.mu);
  if (fake_dev.n_grave == fake_dev.cap_grave) {
    fake_dev.cap_grave = fake_dev.cap_grave ? 2 * fake_dev.cap_grave : 4096;
    fake_dev.graveyard = realloc(fake_dev.graveyard, (size_t)fake_dev.cap_grave * sizeof *fake_dev.graveyard);
  }
  fake_dev.graveyard[fake_dev.n_grave++] = e;
  pthread_mutex_unlock(&fake_dev.mu);
  return cudaSuccess;
}
cudaError_t f_event_record(cudaEvent_t e, cudaStream_t s) {
  fevent_t *ev = (fevent_t *)e;
  item_t *it = calloc(1, sizeof *it);
  pthread_mutex_lock(&fake_dev.mu);
  it->kind = IT_RECORD, it->ev = ev, it->ver = ++ev->recorded;
  push_item((fstream_t *)s, it);
  pthread_mutex_unlock(&fake_dev.mu);
  return cudaSuccess;
}
cudaError_t f_event_query(cudaEvent_t e) {
  fevent_t *ev = (fevent_t *)e;
  pthread_mutex_lock(&fake_dev.mu);
  cudaError_t r = ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
  pthread_mutex_unlock(&fake_dev.mu);
  return r;
}
cudaError_t f_stream_create(cudaStream_t *out, unsigned int flags) {
  (void)flags;
  fstream_t *s = calloc(1, sizeof *s);
  pthread_mutex_lock(&fake_dev.mu);
  s->live = 1;
  s->next_live = fake_dev.live, fake_dev.live = s;
  s->next_all = fake_dev.all_streams, fake_dev.all_streams = s;
  pthread_mutex_unlock(&fake_dev.mu);
  *out = (cudaStream_t)s;
  return cudaSuccess;
}
cudaError_t f_stream_destroy(cudaStream_t st) {
  fstream_t *s = (fstream_t *)st;
  pthread_mutex_lock(&fake_dev.mu);
  for (fstream_t **pp = &fake_dev.live; *pp; pp = &(*pp)->next_live)
    if (*pp == s) {
      *pp = s->next_live;
      break;
    }
  s->live = 0;
  pthread_mutex_unlock(&fake_dev.mu);
  return cudaSuccess;
}
static cudaError_t f_stream_wait_event(cudaStream_t st, cudaEvent_t e, unsigned int flags) {
  (void)flags;
  fevent_t *ev = (fevent_t *)e;
  item_t *it = calloc(1, sizeof *it);
  pthread_mutex_lock(&fake_dev.mu);
  it->kind = IT_WAIT, it->ev = ev, it->ver = ev->recorded;
  push_item((fstream_t *)st, it);
  pthread_mutex_unlock(&fake_dev.mu);
  return cudaSuccess;
}
static cudaError_t f_malloc(void **p, size_t bytes) {
  pthread_mutex_lock(&fake_dev.mu);
  fake_dev.mallocs[tl_rank >= 0 && tl_rank < 8 ? tl_rank : 8]++;
  pthread_mutex_unlock(&fake_dev.mu);
  *p = calloc(1, bytes ? bytes : 1);
  return cudaSuccess;
}
static cudaError_t f_free(void *p) {
  free(p);
  return cudaSuccess;
}

const zb__cudart_t fake_rt = {
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
  g->next_all = fake_dev.groups, fake_dev.groups = g;
  return g;
}

static fcomm_t *comm_new(void) {
  fcomm_t *c = calloc(1, sizeof *c);
  c->next_all = fake_dev.comms, fake_dev.comms = c;
  return c;
}

static ncclResult_t n_init_config(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *cfg) {
  pthread_mutex_lock(&fake_dev.mu);
  fgroup_t *g = fake_dev.groups;
  while (g && (g->split_made || g->nranks != nranks || memcmp(g->id, id.internal, 16) != 0)) g = g->next_all;
  if (!g) g = group_new((const uint8_t *)id.internal, nranks);
  g->joined++;
  fcomm_t *c = comm_new();
  c->g = g, c->rank = rank, c->blocking = cfg ? cfg->blocking : 1;
  pthread_mutex_unlock(&fake_dev.mu);
  *out = (ncclComm_t)c;
  return c->blocking ? ncclSuccess : ncclInProgress;
}

static ncclResult_t n_split(ncclComm_t parent, int color, int key, ncclComm_t *out, ncclConfig_t *cfg) {
  (void)cfg;
  fcomm_t *pc = (fcomm_t *)parent;
  pthread_mutex_lock(&fake_dev.mu);
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
  pthread_mutex_unlock(&fake_dev.mu);
  *out = (ncclComm_t)child;
  return ncclInProgress;
}

static ncclResult_t n_abort(ncclComm_t c) {
  pthread_mutex_lock(&fake_dev.mu);
  ((fcomm_t *)c)->aborted = 1;
  pthread_mutex_unlock(&fake_dev.mu);
  return ncclSuccess;
}
static ncclResult_t n_destroy(ncclComm_t c) { return n_abort(c); }

static ncclResult_t n_async(ncclComm_t comm, ncclResult_t *e) {
  fcomm_t *c = (fcomm_t *)comm;
  pthread_mutex_lock(&fake_dev.mu);
  if (c->pending) { /* launched now; in progress until the next call */
    push_item(c->pending_stream, c->pending);
    c->pending = NULL;
    pthread_mutex_unlock(&fake_dev.mu);
    *e = ncclInProgress;
    return ncclSuccess;
  }
  int ready = c->g && (c->g->split_made || c->g->joined >= c->g->nranks);
  /* A parent with a split in progress is in progress too. */
  if (ready && c->g)
    for (int r = 0; r < 8; r++)
      if (c->g->split_calls[r] > 0 && c->g->split_calls[r] < c->g->nranks && c->splits > r) ready = 0;
  pthread_mutex_unlock(&fake_dev.mu);
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
  pthread_mutex_lock(&fake_dev.mu);
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
  pthread_mutex_unlock(&fake_dev.mu);
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
  pthread_mutex_lock(&fake_dev.mu);
  int blocked = 0;
  if (tl_rank == fake_dev.block_launch_rank && tl_group_n > 0 && fake_dev.launches_of_blocked++ >= 2) {
    /* A launch queue filled by a peer that never comes: the host stays inside the enqueue until
     * the communicator is aborted (what the watchdog must do without the runner's help). */
    fcomm_t *c = tl_group[0]->ops[0].comm;
    while (!c->aborted) {
      pthread_mutex_unlock(&fake_dev.mu);
      nap_us(1000);
      pthread_mutex_lock(&fake_dev.mu);
    }
    blocked = 1;
  }
  for (int k = 0; k < tl_group_n; k++) {
    if (blocked) free(tl_group[k]);
    else push_item(tl_group_stream[k], tl_group[k]);
  }
  tl_group_n = 0;
  pthread_mutex_unlock(&fake_dev.mu);
  return blocked ? ncclSystemError : ncclSuccess;
}
static ncclResult_t n_collective(int is_broadcast, const void *send, void *recv, size_t count, int dtype, int op,
                                 int root, ncclComm_t comm, cudaStream_t st) {
  fcomm_t *c = (fcomm_t *)comm;
  if (send != recv) return ncclInvalidArgument; /* the transport's are in place */
  item_t *it = calloc(1, sizeof *it);
  it->kind = IT_COLL;
  pthread_mutex_lock(&fake_dev.mu);
  it->coll = (fcoll_t){c, c->colls++, is_broadcast, dtype, op, root, recv, count, 0, 0.0};
  int later = !c->blocking && !c->pending;
  if (later) c->pending = it, c->pending_stream = (fstream_t *)st;
  else push_item((fstream_t *)st, it);
  pthread_mutex_unlock(&fake_dev.mu);
  return later ? ncclInProgress : ncclSuccess;
}
static ncclResult_t n_all_reduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                                 cudaStream_t st) {
  return n_collective(0, s, r, n, (int)t, (int)op, 0, c, st);
}
static ncclResult_t n_broadcast(const void *s, void *r, size_t n, ncclDataType_t t, int root, ncclComm_t c,
                                cudaStream_t st) {
  return t == ncclUint8 ? n_collective(1, s, r, n, (int)t, 0, root, c, st) : ncclInvalidArgument;
}
static const char *n_error_string(ncclResult_t r) { return r == ncclSuccess ? "no error" : "fake NCCL error"; }

const zb__nccl_t fake_nccl = {
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
    .AllReduce = n_all_reduce,
    .Broadcast = n_broadcast,
    .GetErrorString = n_error_string,
};

int fake_setup(void **state) {
  (void)state;
  fake_dev.stop = 0;
  fake_dev.block_launch_rank = -1, fake_dev.launches_of_blocked = 0;
  return pthread_create(&fake_dev.thread, NULL, device_main, NULL);
}

int fake_teardown(void **state) {
  (void)state;
  pthread_mutex_lock(&fake_dev.mu);
  fake_dev.stop = 1;
  pthread_mutex_unlock(&fake_dev.mu);
  pthread_join(fake_dev.thread, NULL);
  for (fstream_t *s = fake_dev.all_streams, *n; s; s = n) {
    n = s->next_all;
    for (item_t *it = s->head, *m; it; it = m) m = it->next, free(it);
    free(s);
  }
  for (fgroup_t *g = fake_dev.groups, *n; g; g = n) n = g->next_all, free(g->sseq), free(g->rseq), free(g);
  for (fcomm_t *c = fake_dev.comms, *n; c; c = n) n = c->next_all, free(c->pending), free(c);
  for (int k = 0; k < fake_dev.n_grave; k++) free(fake_dev.graveyard[k]);
  free(fake_dev.graveyard);
  fake_dev.graveyard = NULL, fake_dev.cap_grave = 0;
  fake_dev.all_streams = fake_dev.live = NULL, fake_dev.groups = NULL, fake_dev.comms = NULL, fake_dev.n_grave = 0;
  return 0;
}

void enqueue_compute(cudaStream_t st, double dur, void (*fn)(void *), void *arg) {
  item_t *it = calloc(1, sizeof *it);
  it->kind = IT_COMPUTE, it->dur = dur, it->fn = fn, it->arg = arg;
  pthread_mutex_lock(&fake_dev.mu);
  push_item((fstream_t *)st, it);
  pthread_mutex_unlock(&fake_dev.mu);
}

/* Waits until the compute stream has run everything issued (polling, bounded). */
void drain(cudaStream_t st, double limit) {
  cudaEvent_t e;
  f_event_create(&e, 0);
  f_event_record(e, st);
  double t0 = zb__now();
  while (f_event_query(e) != cudaSuccess && zb__now() - t0 < limit) nap_us(200);
  f_event_destroy(e);
}

int sig_poll(void *user, char *msg, size_t cap) {
  signal_t *s = user;
  pthread_mutex_lock(&s->mu);
  int set = s->set;
  if (set) snprintf(msg, cap, "%s", s->msg);
  pthread_mutex_unlock(&s->mu);
  return set;
}
void sig_publish(void *user, const char *msg) {
  signal_t *s = user;
  pthread_mutex_lock(&s->mu);
  if (!s->set) snprintf(s->msg, sizeof s->msg, "%s", msg), s->set = 1;
  pthread_mutex_unlock(&s->mu);
}
