/*
 * test_nccl_group.c - the NCCL group transport (csrc/cuda/transport_nccl_group.c) without a GPU,
 * against the fake device and NCCL of fake_nccl.h: ranks as threads, each with its own compute
 * stream. What a user of zb_transport_all_reduce / zb_transport_broadcast relies on: every rank gets
 * the sum (max, root's bytes), after the work its compute stream was given before the call and
 * only once NCCL has put the call on the stream (a non-blocking communicator may launch it later),
 * in float32, float16 and bfloat16; a rank that never joins fails the others at the timeout, naming
 * the collective, and the transport stays failed; zb_transport_abort from another thread and the
 * abort signal end a waiting collective at once; point-to-point and bad configs are refused.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_nccl.h"
#include "helpers.h"
#include "runtime/internal.h"

#define N 257
#define MAXR 4

typedef struct job job_t;

typedef struct {
  job_t *job;
  int rank;
} arg_t;

struct job {
  int p;
  uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES];
  double timeout;
  int silent_rank;   /* makes its transport, then joins no collective (-1: none) */
  int abort_after;   /* > 0: rank 0's transport is aborted from another thread after that many ms */
  int signal_after;  /* > 0: the abort signal is set after that many ms */
  signal_t sig;
  int use_signal;
  zb_transport_t *t[MAXR];
  zb__cuda_t cu[MAXR]; /* each rank's device state, which its transport points to until destroyed */
  /* results */
  float buf[MAXR][N], sum[MAXR][N], max[MAXR][N], bcast[MAXR][MAXR][8];
  uint16_t bf[MAXR][N], hf[MAXR][N];
  zb_status_t st[MAXR], again[MAXR];
  char msg[MAXR][1024], again_msg[MAXR][1024];
  double took[MAXR];
  int finished[MAXR]; /* under sig.mu */
};

static float value(int rank, int i) { return (float)((rank + 1) * 0.37 + i * (i % 3 == 0 ? 1e5 : 0.01)); }

typedef struct {
  float *dst;
  int rank;
} fill_t;

/* The compute stream's work before the collective: the rank's values appear only when it has run. */
static void fill(void *arg) {
  fill_t *f = arg;
  for (int i = 0; i < N; i++) f->dst[i] = value(f->rank, i);
  if (f->rank == 1) f->dst[5] = NAN; /* max keeps it */
}

static zb_status_t collectives(job_t *J, int r, zb_transport_t *t, cudaStream_t compute) {
  /* The results are read as the calls return: a call must not return before its collective ran. */
  fill_t f = {J->buf[r], r};
  enqueue_compute(compute, 0.002, fill, &f); /* the collective must wait for it */
  ZB_CHECK(zb_transport_all_reduce(t, 3, J->buf[r], N, ZB_DTYPE_F32, ZB_REDUCE_SUM, J->timeout));
  memcpy(J->sum[r], J->buf[r], sizeof J->sum[r]);
  enqueue_compute(compute, 0.001, fill, &f);
  ZB_CHECK(zb_transport_all_reduce(t, 3, J->buf[r], N, ZB_DTYPE_F32, ZB_REDUCE_MAX, J->timeout));
  memcpy(J->max[r], J->buf[r], sizeof J->max[r]);
  for (int i = 0; i < N; i++) J->bf[r][i] = zb__float_to_bf16(value(r, i) / 1000.0f);
  for (int i = 0; i < N; i++) J->hf[r][i] = zb__float_to_half((float)(r + i % 7) * 0.125f);
  ZB_CHECK(zb_transport_all_reduce(t, 3, J->bf[r], N, ZB_DTYPE_BF16, ZB_REDUCE_SUM, J->timeout));
  ZB_CHECK(zb_transport_all_reduce(t, 3, J->hf[r], N, ZB_DTYPE_F16, ZB_REDUCE_SUM, J->timeout));
  for (int root = 0; root < J->p; root++) {
    for (int i = 0; i < 8; i++) J->bcast[r][root][i] = r == root ? (float)(100 * root + i) : -1.0f;
    ZB_CHECK(zb_transport_broadcast(t, 4, J->bcast[r][root], sizeof J->bcast[r][root], root, J->timeout));
  }
  return ZB_OK;
}

static void *rank_main(void *arg) {
  arg_t *a = arg;
  job_t *J = a->job;
  int r = a->rank;
  tl_rank = r;
  cudaStream_t compute;
  f_stream_create(&compute, 0);
  zb__cuda_t *cu = &J->cu[r];
  memset(cu, 0, sizeof *cu);
  cu->device = 0, cu->compute = compute;
  zb_nccl_group_config_t c = ZB_NCCL_GROUP_CONFIG_INIT;
  c.rank = r, c.ranks = J->p, c.unique_id = J->id, c.timeout_s = J->timeout;
  if (J->use_signal) c.abort_signal = (zb_abort_signal_t){sig_poll, sig_publish, &J->sig};
  zb_transport_t *t = NULL;
  double t0 = zb__now();
  zb_status_t st = zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, cu);
  J->t[r] = t;
  if (st == ZB_OK && r != J->silent_rank) {
    t0 = zb__now();
    st = collectives(J, r, t, compute);
  } else if (st == ZB_OK) {
    /* Alive, in no collective, until the others are done with theirs (at most 20 s). */
    for (double until = zb__now() + 20; zb__now() < until;) {
      pthread_mutex_lock(&J->sig.mu);
      int others = 0;
      for (int q = 0; q < J->p; q++) others += q != r && J->finished[q];
      pthread_mutex_unlock(&J->sig.mu);
      if (others == J->p - 1) break;
      nap_us(2000);
    }
  }
  J->took[r] = zb__now() - t0;
  J->st[r] = st;
  snprintf(J->msg[r], sizeof J->msg[r], "%s", st == ZB_OK ? "" : zb_last_error());
  if (st != ZB_OK && t) {
    /* A failed transport stays failed, at once, with the first failure's message. */
    float x = 0;
    double t1 = zb__now();
    J->again[r] = zb_transport_all_reduce(t, 3, &x, 1, ZB_DTYPE_F32, ZB_REDUCE_SUM, J->timeout);
    snprintf(J->again_msg[r], sizeof J->again_msg[r], "%s", zb_last_error());
    if (zb__now() - t1 > 0.5) J->again[r] = ZB_OK; /* flagged: it should not have waited */
  }
  pthread_mutex_lock(&J->sig.mu);
  J->finished[r] = 1;
  pthread_mutex_unlock(&J->sig.mu);
  drain(compute, 5);
  return NULL;
}

static void *aborter(void *arg) {
  job_t *J = arg;
  nap_us(1000L * J->abort_after);
  while (!J->t[0]) nap_us(1000);
  zb_transport_abort(J->t[0], "the S lane's pass failed");
  return NULL;
}

static void *signaller(void *arg) {
  job_t *J = arg;
  nap_us(1000L * J->signal_after);
  sig_publish(&J->sig, "rank 1 failed first: a stage raised");
  return NULL;
}

static void run_job(job_t *J) {
  static int ids;
  J->id[0] = (uint8_t)++ids;
  pthread_t th[MAXR], extra;
  arg_t args[MAXR];
  for (int r = 0; r < J->p; r++) {
    args[r] = (arg_t){J, r};
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  int helper = J->abort_after > 0 || J->signal_after > 0;
  if (helper) pthread_create(&extra, NULL, J->abort_after > 0 ? aborter : signaller, J);
  for (int r = 0; r < J->p; r++) pthread_join(th[r], NULL);
  if (helper) pthread_join(extra, NULL);
  for (int r = 0; r < J->p; r++) zb_transport_destroy(J->t[r]);
}

static job_t *job_new(int p, double timeout) {
  job_t *J = calloc(1, sizeof *J);
  J->p = p, J->timeout = timeout, J->silent_rank = -1;
  pthread_mutex_init(&J->sig.mu, NULL);
  return J;
}

static void job_free(job_t *J) {
  pthread_mutex_destroy(&J->sig.mu);
  free(J);
}

/* ---- tests --------------------------------------------------------------------------------------- */

static void every_rank_gets_the_sum_max_and_broadcast_after_its_compute_work(void **state) {
  (void)state;
  for (int p = 2; p <= MAXR; p += 2) {
    job_t *J = job_new(p, 10.0);
    run_job(J);
    for (int r = 0; r < p; r++) {
      if (J->st[r] != ZB_OK) fail_msg("p %d rank %d: %s", p, r, J->msg[r]);
      for (int i = 0; i < N; i++) {
        /* Rank order, one addition after another (the fake's order; NCCL's own may differ in
         * rounding, which a GPU test bounds). */
        float want = value(0, i), most = value(0, i);
        for (int q = 1; q < p; q++) want += value(q, i), most = value(q, i) > most ? value(q, i) : most;
        if (i == 5) want = NAN;
        if (!(J->sum[r][i] == want || (isnan(want) && isnan(J->sum[r][i]))))
          fail_msg("p %d rank %d element %d: sum %.9g, want %.9g", p, r, i, J->sum[r][i], want);
        /* fmaxf's max, as NCCL's: rank 1's NaN is dropped. */
        if (i == 5) {
          most = -INFINITY;
          for (int q = 0; q < p; q++)
            if (q != 1) most = fmaxf(most, value(q, i));
        }
        assert_true(J->max[r][i] == most);
        assert_memory_equal(J->bf[r], J->bf[0], sizeof J->bf[0]);
        assert_memory_equal(J->hf[r], J->hf[0], sizeof J->hf[0]);
      }
      for (int root = 0; root < p; root++)
        for (int i = 0; i < 8; i++) assert_true(J->bcast[r][root][i] == (float)(100 * root + i));
    }
    /* bfloat16 and float16 rounded at each step, as the host transports' sum. */
    for (int i = 0; i < N; i++) {
      float b = zb__bf16_to_float(zb__float_to_bf16(value(0, i) / 1000.0f));
      float h = zb__half_to_float(zb__float_to_half((float)(i % 7) * 0.125f));
      for (int q = 1; q < p; q++) {
        b = zb__bf16_to_float(zb__float_to_bf16(b + zb__bf16_to_float(zb__float_to_bf16(value(q, i) / 1000.0f))));
        h = zb__half_to_float(zb__float_to_half(h + zb__half_to_float(zb__float_to_half((float)(q + i % 7) * 0.125f))));
      }
      assert_true(zb__bf16_to_float(J->bf[0][i]) == b);
      assert_true(zb__half_to_float(J->hf[0][i]) == h);
    }
    job_free(J);
  }
}

static void a_rank_that_never_joins_fails_the_others_at_the_timeout_naming_the_collective(void **state) {
  (void)state;
  job_t *J = job_new(2, 0.3);
  J->silent_rank = 1, J->use_signal = 1;
  run_job(J);
  ASSERT_STATUS(J->st[0], ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(J->msg[0], "all-reduce (sum) of channel 3");
  ASSERT_CONTAINS(J->msg[0], "did not finish within 0.3 s");
  ASSERT_CONTAINS(J->msg[0], "some rank did not join it");
  assert_true(J->took[0] >= 0.3 && J->took[0] < 3.0);
  /* Sticky, at once, with the same message; and published, so the other ranks learn it. */
  ASSERT_STATUS(J->again[0], ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(J->again_msg[0], "all-reduce (sum) of channel 3");
  assert_true(J->sig.set);
  ASSERT_CONTAINS(J->sig.msg, "did not finish");
  job_free(J);
}

static void an_abort_from_another_thread_ends_a_waiting_collective_at_once(void **state) {
  (void)state;
  job_t *J = job_new(2, 30.0);
  J->silent_rank = 1, J->abort_after = 100;
  run_job(J);
  ASSERT_STATUS(J->st[0], ZB_ERR_REMOTE);
  ASSERT_CONTAINS(J->msg[0], "the S lane's pass failed");
  if (J->took[0] > 5.0) fail_msg("the abort took %.2f s to end the wait", J->took[0]);
  ASSERT_STATUS(J->again[0], ZB_ERR_REMOTE);
  job_free(J);
}

static void another_ranks_failure_on_the_abort_signal_ends_the_wait(void **state) {
  (void)state;
  job_t *J = job_new(2, 30.0);
  J->silent_rank = 1, J->use_signal = 1, J->signal_after = 100;
  run_job(J);
  ASSERT_STATUS(J->st[0], ZB_ERR_REMOTE);
  ASSERT_CONTAINS(J->msg[0], "rank 1 failed first: a stage raised");
  if (J->took[0] > 5.0) fail_msg("the signal took %.2f s to end the wait", J->took[0]);
  job_free(J);
}

typedef struct {
  uint8_t *id;
  int rank;
  zb_status_t st;
  char msg[1024];
} lone_t;

static void *lone_create(void *arg) {
  lone_t *l = arg;
  cudaStream_t compute;
  f_stream_create(&compute, 0);
  zb__cuda_t cu;
  memset(&cu, 0, sizeof cu);
  cu.compute = compute;
  zb_nccl_group_config_t c = ZB_NCCL_GROUP_CONFIG_INIT;
  c.rank = l->rank, c.ranks = 2, c.unique_id = l->id, c.timeout_s = 0.2;
  zb_transport_t *t = NULL;
  l->st = zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, &cu);
  snprintf(l->msg, sizeof l->msg, "%s", zb_last_error());
  zb_transport_destroy(t);
  return NULL;
}

static void creation_is_bounded_and_bad_configs_and_messages_are_refused(void **state) {
  (void)state;
  uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES] = {200};
  /* Only rank 0 of 2 comes: it fails at the timeout instead of waiting forever. */
  lone_t l = {id, 0, ZB_OK, ""};
  pthread_t th;
  pthread_create(&th, NULL, lone_create, &l);
  pthread_join(th, NULL);
  ASSERT_STATUS(l.st, ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(l.msg, "did not call zb_transport_create_nccl_group");

  zb__cuda_t cu;
  memset(&cu, 0, sizeof cu);
  zb_transport_t *t = NULL;
  zb_nccl_group_config_t c = ZB_NCCL_GROUP_CONFIG_INIT;
  c.rank = 2, c.ranks = 2, c.unique_id = id;
  ASSERT_STATUS(zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, &cu), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "rank 2 of 2");
  c.rank = 0, c.unique_id = NULL;
  ASSERT_STATUS(zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, &cu), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "needs unique_id");
  c.unique_id = id, c.version = 99;
  ASSERT_STATUS(zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, &cu), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "ZB_NCCL_GROUP_CONFIG_INIT");
  c.version = ZB_NCCL_GROUP_CONFIG_VERSION;
  c.abort_signal.poll = sig_poll;
  ASSERT_STATUS(zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, &cu), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "both poll and publish");
  /* The public entry point wants the rank's CUDA backend. */
  c.abort_signal.poll = NULL;
  ASSERT_STATUS(zb_transport_create_nccl_group(&t, &c), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "CUDA backend");
  assert_null(t);

  /* One rank: nothing to combine; no point-to-point; collectives' arguments checked first. */
  uint8_t id1[ZB_NCCL_UNIQUE_ID_BYTES] = {201};
  cudaStream_t compute;
  f_stream_create(&compute, 0);
  cu.compute = compute;
  c.rank = 0, c.ranks = 1, c.unique_id = id1, c.timeout_s = 2.0;
  ZB_ASSERT_OK(zb__transport_create_nccl_group_with(&t, &c, &fake_nccl, &fake_rt, &cu));
  float x[3] = {1, 2, 3};
  ZB_ASSERT_OK(zb_transport_all_reduce(t, 0, x, 3, ZB_DTYPE_F32, ZB_REDUCE_SUM, 1.0));
  assert_true(x[0] == 1 && x[2] == 3);
  zb__request_t req = {.is_send = 1, .peer = 1, .tag = 1, .buf = x, .bytes = sizeof x};
  ASSERT_STATUS(t->ops->isend(t, &req), ZB_ERR_UNSUPPORTED); /* what a runner given it would get */
  ASSERT_CONTAINS(zb_last_error(), "collectives only");
  ASSERT_STATUS(zb_transport_all_reduce(t, 0, x, 3, (zb_dtype_t)7, ZB_REDUCE_SUM, 1.0), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_STATUS(zb_transport_broadcast(t, 0, x, sizeof x, 1, 1.0), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "root 1 is not a rank");
  zb_transport_destroy(t);
  f_stream_destroy(compute);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(every_rank_gets_the_sum_max_and_broadcast_after_its_compute_work, fake_setup,
                                      fake_teardown),
      cmocka_unit_test_setup_teardown(a_rank_that_never_joins_fails_the_others_at_the_timeout_naming_the_collective,
                                      fake_setup, fake_teardown),
      cmocka_unit_test_setup_teardown(an_abort_from_another_thread_ends_a_waiting_collective_at_once, fake_setup,
                                      fake_teardown),
      cmocka_unit_test_setup_teardown(another_ranks_failure_on_the_abort_signal_ends_the_wait, fake_setup,
                                      fake_teardown),
      cmocka_unit_test_setup_teardown(creation_is_bounded_and_bad_configs_and_messages_are_refused, fake_setup,
                                      fake_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
