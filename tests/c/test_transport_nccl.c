/*
 * test_transport_nccl.c - the NCCL transport (csrc/cuda/transport_nccl.c) without a GPU: its
 * request lifecycle, pair order, watchdog, abort and creation run against the fake device and fake
 * NCCL of fake_nccl.h, behind the transport's function tables (zb__cudart_t, zb__nccl_t). Each
 * test's ranks are threads that drive the transport as the runner does: receives posted in op order
 * a few ahead, a send right after the op that produces it, the compute stream waiting for receives
 * on the device.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/internal.h"
#include "helpers.h"
#include "fake_nccl.h"
#include "runtime/internal.h"

/* ---- a rank as the runner drives the transport ------------------------------------------------- */
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


typedef struct {
  job_t *job;
  int32_t rank;
} rankarg_t;


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
    if (J->lead[r] > 0) enqueue_compute(compute, J->lead[r], NULL, NULL);
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
      enqueue_compute(compute, 0.0002, compute_fn, &ctx[i]);
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
      pthread_mutex_lock(&fake_dev.mu);
      J->mallocs_after_first[r] = fake_dev.mallocs[r];
      pthread_mutex_unlock(&fake_dev.mu);
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
  pthread_mutex_lock(&fake_dev.mu);
  J->mallocs_after_last[r] = fake_dev.mallocs[r];
  pthread_mutex_unlock(&fake_dev.mu);
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
  fake_dev.block_launch_rank = 0, fake_dev.launches_of_blocked = 0;
  job_run(&J);
  fake_dev.block_launch_rank = -1;
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
      cmocka_unit_test_setup_teardown(test_pair_queues_carry_every_kind, fake_setup, fake_teardown),
      cmocka_unit_test_setup_teardown(test_timeout_counts_from_ready, fake_setup, fake_teardown),
      cmocka_unit_test_setup_teardown(test_dead_peer_times_out_and_tells_everyone, fake_setup, fake_teardown),
      cmocka_unit_test_setup_teardown(test_abort_reaches_every_rank, fake_setup, fake_teardown),
      cmocka_unit_test_setup_teardown(test_watchdog_fires_while_host_blocks_in_enqueue, fake_setup, fake_teardown),
      cmocka_unit_test_setup_teardown(test_creation_is_bounded, fake_setup, fake_teardown),
      cmocka_unit_test(test_config_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
