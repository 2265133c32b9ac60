/*
 * gpu_collectives.c - the NCCL group transport (zb_transport_create_nccl_group: Vocabulary
 * Parallelism's collectives when every rank has a GPU) with the CUDA backend, ranks as threads, one
 * GPU each: zb_transport_all_reduce (SUM and MAX; float32, float16, bfloat16) and
 * zb_transport_broadcast on device buffers that the compute stream was still filling when the
 * collective was called (behind an 8 MiB device-to-device copy, so the stream is certainly late).
 * What a user relies on: every rank gets the same result; a sum within the rounding of NCCL's own
 * order of the rank-order sum (within p roundings of the type, each at most u = 2^-24, 2^-11 or
 * 2^-8 of the magnitudes summed), a max and a broadcast exact; and the values the compute stream
 * wrote before the call, never the buffer's old contents. And when a rank never joins: the other
 * fails at its timeout naming the collective, at once on the next call; zb_transport_abort from
 * another thread ends a waiting collective at once (on a GPU: ncclCommAbort with a collective on
 * the stream).
 *
 * Needs two GPUs (NCCL allows no two ranks of a communicator on one GPU). It runs in CI on the fake
 * device (tests/fake_cuda, two fake devices). Exits 77 (skipped) without a CUDA build or two GPUs.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "runtime/internal.h" /* zb__now */

enum { N = 1000, P = 2, LATE_BYTES = 8 << 20 };

/* A failing rank tells the other at once instead of leaving it to its timeouts. */
typedef struct {
  pthread_mutex_t mu;
  char msg[1100];
} signal_t;

static int signal_poll(void *user, char *msg, size_t cap) {
  signal_t *g = user;
  pthread_mutex_lock(&g->mu);
  int set = g->msg[0] != 0;
  if (set) snprintf(msg, cap, "%s", g->msg);
  pthread_mutex_unlock(&g->mu);
  return set;
}

static void signal_publish(void *user, const char *msg) {
  signal_t *g = user;
  pthread_mutex_lock(&g->mu);
  if (!g->msg[0]) snprintf(g->msg, sizeof g->msg, "%s", msg);
  pthread_mutex_unlock(&g->mu);
}

typedef struct {
  int rank;
  const uint8_t *id;
  signal_t *sig;
  zb_status_t st;
  char err[1024];
  float sum[3][N], max[3][N]; /* per dtype (f32, f16, bf16), widened */
  uint8_t bcast[N];
} rank_t;

static const zb_dtype_t kDtypes[3] = {ZB_DTYPE_F32, ZB_DTYPE_F16, ZB_DTYPE_BF16};

/* Rank r's element i: of many magnitudes and both signs, exact in every dtype after rounding. */
static float value(int r, int i, zb_dtype_t t) {
  float v = urand(40 + (uint64_t)r, (uint64_t)i, 0, 0) * ldexpf(1.0f, i % 9 - 4);
  return t == ZB_DTYPE_F16 ? zb__half_to_float(zb__float_to_half(v))
         : t == ZB_DTYPE_BF16 ? zb__bf16_to_float(zb__float_to_bf16(v))
                              : v;
}

static void put(void *buf, zb_dtype_t t, int i, float v) {
  if (t == ZB_DTYPE_F32) ((float *)buf)[i] = v;
  else ((uint16_t *)buf)[i] = t == ZB_DTYPE_F16 ? zb__float_to_half(v) : zb__float_to_bf16(v);
}

static float get(const void *buf, zb_dtype_t t, int i) {
  if (t == ZB_DTYPE_F32) return ((const float *)buf)[i];
  const uint16_t h = ((const uint16_t *)buf)[i];
  return t == ZB_DTYPE_F16 ? zb__half_to_float(h) : zb__bf16_to_float(h);
}

/* Rank `rank`'s CUDA backend on its own GPU and its group transport (on *be and *t, kept on failure
 * for the caller to destroy). The group transport's collectives wait for the transport's timeout
 * (the call's is for the host transports); it also bounds creation, NCCL's initialisation on a GPU,
 * so not less than 2 s. */
static zb_status_t join(int rank, const uint8_t *id, double timeout, signal_t *sig, zb_backend_t **be,
                        zb_transport_t **t) {
  zb_cuda_backend_config_t bc = ZB_CUDA_BACKEND_CONFIG_INIT;
  bc.device = rank;
  zb_status_t st = zb_backend_create_cuda(be, &bc);
  if (st != ZB_OK) return st;
  zb_nccl_group_config_t gc = ZB_NCCL_GROUP_CONFIG_INIT;
  gc.rank = rank, gc.ranks = P, gc.unique_id = id, gc.backend = *be, gc.timeout_s = timeout;
  if (sig) gc.abort_signal = (zb_abort_signal_t){signal_poll, signal_publish, sig};
  return zb_transport_create_nccl_group(t, &gc);
}

#define TRY(call)                                                                                  \
  do {                                                                                             \
    if ((r->st = (call)) != ZB_OK) {                                                               \
      snprintf(r->err, sizeof r->err, "%s: %s", #call, zb_last_error());                           \
      signal_publish(r->sig, r->err);                                                              \
      goto out;                                                                                    \
    }                                                                                              \
  } while (0)

static void *rank_main(void *arg) {
  rank_t *r = arg;
  zb_backend_t *be = NULL;
  zb_transport_t *t = NULL;
  void *dev = NULL, *late = NULL;
  unsigned char host[N * 4];
  TRY(join(r->rank, r->id, 10, r->sig, &be, &t));
  TRY(zb_backend_alloc(be, sizeof host, &dev));
  TRY(zb_backend_alloc(be, LATE_BYTES, &late));
  for (int d = 0; d < 3; d++)
    for (int op = 0; op < 2; op++) {
      const zb_dtype_t dt = kDtypes[d];
      for (int i = 0; i < N; i++) put(host, dt, i, value(r->rank, i, dt));
      /* Enqueued on the compute stream behind a long copy, not waited for: the collective must come
       * after both. */
      TRY(zb_backend_copy(be, (char *)late + LATE_BYTES / 2, late, LATE_BYTES / 2));
      TRY(zb_backend_copy(be, dev, host, (size_t)N * (dt == ZB_DTYPE_F32 ? 4 : 2)));
      TRY(zb_transport_all_reduce(t, 3, dev, N, dt, op ? ZB_REDUCE_MAX : ZB_REDUCE_SUM, 10));
      memset(host, 0, sizeof host);
      TRY(zb_backend_copy(be, host, dev, (size_t)N * (dt == ZB_DTYPE_F32 ? 4 : 2)));
      TRY(zb_backend_synchronize(be));
      for (int i = 0; i < N; i++) (op ? r->max : r->sum)[d][i] = get(host, dt, i);
    }
  for (int i = 0; i < N; i++) host[i] = (uint8_t)(r->rank * 100 + i);
  TRY(zb_backend_copy(be, (char *)late + LATE_BYTES / 2, late, LATE_BYTES / 2));
  TRY(zb_backend_copy(be, dev, host, N));
  TRY(zb_transport_broadcast(t, 5, dev, N, 1, 10));
  TRY(zb_backend_copy(be, r->bcast, dev, N));
  TRY(zb_backend_synchronize(be));
out:
  if (dev) zb_backend_free(be, dev);
  if (late) zb_backend_free(be, late);
  zb_transport_destroy(t);
  zb_backend_destroy(be);
  return NULL;
}

static void test_collectives_on_a_gpu_each(void **state) {
  uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES];
  ZB_ASSERT_OK(zb_nccl_unique_id(id));
  static rank_t ranks[P];
  static signal_t sig = {PTHREAD_MUTEX_INITIALIZER, ""};
  pthread_t th[P];
  for (int k = 0; k < P; k++) {
    memset(&ranks[k], 0, sizeof ranks[k]);
    ranks[k].rank = k, ranks[k].id = id, ranks[k].sig = &sig;
    assert_int_equal(pthread_create(&th[k], NULL, rank_main, &ranks[k]), 0);
  }
  for (int k = 0; k < P; k++) pthread_join(th[k], NULL);
  for (int k = 0; k < P; k++)
    if (ranks[k].st != ZB_OK) fail_msg("rank %d: %s", k, ranks[k].err);
  for (int d = 0; d < 3; d++) {
    const zb_dtype_t dt = kDtypes[d];
    /* One rounding of the type (f32: 2^-24; f16 2^-11; bf16 2^-8) per addition, of the magnitudes. */
    const double u = dt == ZB_DTYPE_F32 ? 0x1p-24 : dt == ZB_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    for (int i = 0; i < N; i++) {
      double want_sum = 0, mag = 0;
      float want_max = -INFINITY;
      for (int k = 0; k < P; k++) {
        const float v = value(k, i, dt);
        want_sum += v, mag += fabs(v);
        want_max = fmaxf(want_max, v);
      }
      for (int k = 0; k < P; k++) {
        if (memcmp(&ranks[k].sum[d][i], &ranks[0].sum[d][i], sizeof(float)) != 0)
          fail_msg("dtype %d, element %d: rank %d's sum %.9g differs from rank 0's %.9g", (int)dt, i, k,
                   ranks[k].sum[d][i], ranks[0].sum[d][i]);
        if (!(fabs(ranks[k].sum[d][i] - want_sum) <= P * u * mag))
          fail_msg("dtype %d, element %d: rank %d's sum %.9g, want %.9g (bound %.3g)", (int)dt, i, k,
                   ranks[k].sum[d][i], want_sum, P * u * mag);
        if (ranks[k].max[d][i] != want_max)
          fail_msg("dtype %d, element %d: rank %d's max %.9g, want %.9g", (int)dt, i, k, ranks[k].max[d][i],
                   want_max);
      }
    }
  }
  for (int k = 0; k < P; k++)
    for (int i = 0; i < N; i++)
      if (ranks[k].bcast[i] != (uint8_t)(100 + i))
        fail_msg("rank %d, byte %d of the broadcast from rank 1: %d, want %d", k, i, ranks[k].bcast[i],
                 (uint8_t)(100 + i));
}

/* ---- a rank that never joins ------------------------------------------------------------------ */

typedef struct {
  int rank;
  const uint8_t *id;
  double timeout;
  int abort_after_ms; /* > 0: rank 0's transport is aborted from another thread then */
  pthread_barrier_t *done; /* rank 1 stays (transport made, no collective) until rank 0 is through */
  zb_transport_t *t;
  zb_status_t made, st, again;
  char msg[1024], again_msg[1024];
  double took;
} silent_t;

static void *aborter(void *arg) {
  silent_t *r = arg;
  struct timespec ts = {0, (long)r->abort_after_ms * 1000000L};
  nanosleep(&ts, NULL);
  zb_transport_abort(r->t, "the S lane's pass failed");
  return NULL;
}

static void *silent_main(void *arg) {
  silent_t *r = arg;
  zb_backend_t *be = NULL;
  void *dev = NULL;
  r->made = join(r->rank, r->id, r->timeout, NULL, &be, &r->t);
  if (r->made == ZB_OK) r->made = zb_backend_alloc(be, 4 * N, &dev);
  if (r->made != ZB_OK) snprintf(r->msg, sizeof r->msg, "%s", zb_last_error());
  if (r->made == ZB_OK && r->rank == 0) {
    pthread_t ab;
    if (r->abort_after_ms) pthread_create(&ab, NULL, aborter, r);
    const double t0 = zb__now();
    r->st = zb_transport_all_reduce(r->t, 3, dev, N, ZB_DTYPE_F32, ZB_REDUCE_SUM, r->timeout);
    r->took = zb__now() - t0;
    snprintf(r->msg, sizeof r->msg, "%s", zb_last_error());
    r->again = zb_transport_all_reduce(r->t, 3, dev, N, ZB_DTYPE_F32, ZB_REDUCE_SUM, r->timeout);
    snprintf(r->again_msg, sizeof r->again_msg, "%s", zb_last_error());
    if (r->abort_after_ms) pthread_join(ab, NULL);
  }
  pthread_barrier_wait(r->done);
  if (dev) zb_backend_free(be, dev);
  zb_transport_destroy(r->t);
  zb_backend_destroy(be);
  return NULL;
}

static void run_silent(silent_t *r, double timeout, int abort_after_ms) {
  static uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES];
  ZB_ASSERT_OK(zb_nccl_unique_id(id));
  pthread_barrier_t done;
  pthread_barrier_init(&done, NULL, P);
  pthread_t th[P];
  for (int k = 0; k < P; k++) {
    memset(&r[k], 0, sizeof r[k]);
    r[k].rank = k, r[k].id = id, r[k].timeout = timeout, r[k].abort_after_ms = abort_after_ms, r[k].done = &done;
    assert_int_equal(pthread_create(&th[k], NULL, silent_main, &r[k]), 0);
  }
  for (int k = 0; k < P; k++) pthread_join(th[k], NULL);
  pthread_barrier_destroy(&done);
  for (int k = 0; k < P; k++)
    if (r[k].made != ZB_OK) fail_msg("rank %d could not set up: %s", k, r[k].msg);
}

static void test_a_rank_that_never_joins_fails_the_other_at_its_timeout(void **state) {
  silent_t r[P];
  run_silent(r, 2, 0);
  ASSERT_STATUS(r[0].st, ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(r[0].msg, "all-reduce (sum) of channel 3");
  ASSERT_CONTAINS(r[0].msg, "did not finish within 2 s");
  ASSERT_CONTAINS(r[0].msg, "some rank did not join it");
  if (!(r[0].took >= 2 && r[0].took < 8)) fail_msg("the timeout of 2 s came after %.2f s", r[0].took);
  /* The transport stays failed: at once, the same failure. */
  ASSERT_STATUS(r[0].again, ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(r[0].again_msg, "all-reduce (sum) of channel 3");
}

static void test_an_abort_from_another_thread_ends_a_waiting_collective(void **state) {
  silent_t r[P];
  run_silent(r, 30, 100);
  ASSERT_STATUS(r[0].st, ZB_ERR_REMOTE);
  ASSERT_CONTAINS(r[0].msg, "the S lane's pass failed");
  if (r[0].took > 5.0) fail_msg("the abort took %.2f s to end the wait", r[0].took);
  ASSERT_STATUS(r[0].again, ZB_ERR_REMOTE);
}

int main(void) {
  int32_t devices = 0;
  zb_cuda_device_count(&devices);
  if (!zb_cuda_built() || devices < P) {
    /* 77, not cmocka's skip (which exits 0): ctest then says "skipped", not "passed", on one GPU. */
    printf("gpu_collectives: skipped (%s)\n", !zb_cuda_built() ? "built without CUDA"
                                                : devices ? "one GPU; NCCL needs one per rank"
                                                          : "no CUDA device");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_collectives_on_a_gpu_each),
      cmocka_unit_test(test_a_rank_that_never_joins_fails_the_other_at_its_timeout),
      cmocka_unit_test(test_an_abort_from_another_thread_ends_a_waiting_collective),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
