/*
 * test_collectives.c - zb_transport_all_reduce and zb_transport_broadcast over the in-process
 * transport, ranks as threads (test_transport_socket.c runs them over sockets): every rank gets
 * the sum in rank order, ((x0 + x1) + x2) + ..., bit for bit, in fp32 and in bf16 rounded at each
 * step; MAX keeps NaNs; a broadcast from any root; a rank that never joins fails rank 0 at its
 * timeout naming it, and rank 0's abort fails the rest with that reason; one that aborts fails them
 * at once with its reason; bad arguments are
 * refused with what is allowed. Expected values are computed here, one addition after another.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

#define MAXP 4
#define N 1000

typedef struct {
  zb_transport_t *t;
  int rank, p;
  int skip;           /* 1: this rank never joins; 2: it aborts instead */
  double timeout;
  zb_status_t st[4];  /* sum f32, max f32, sum bf16, broadcasts */
  char msg[4][512];
  float sum[N], max[N];
  uint16_t bsum[N];
  float bcast[MAXP][N];
} rank_t;

/* Rank r's value at i: mixed magnitudes, so the order of the additions shows in the low bits. */
static float value(int r, int i) { return urand((uint64_t)r, (uint64_t)i, 7, 11) * (i % 3 == 0 ? 1e6f : 1.0f); }

static void note(rank_t *k, int which, zb_status_t st) {
  k->st[which] = st;
  snprintf(k->msg[which], sizeof k->msg[which], "%s", st == ZB_OK ? "" : zb_last_error());
}

static void *rank_main(void *arg) {
  rank_t *k = arg;
  if (k->skip == 2) {
    zb_transport_abort(k->t, "rank stopped: out of memory in its S pass");
    return NULL;
  }
  if (k->skip) return NULL;
  for (int i = 0; i < N; i++) {
    k->sum[i] = value(k->rank, i);
    k->max[i] = (k->rank == 1 && i == 5) ? NAN : value(k->rank, i);
    k->bsum[i] = zb__float_to_bf16(value(k->rank, i));
  }
  note(k, 0, zb_transport_all_reduce(k->t, 0, k->sum, N, ZB_DTYPE_F32, ZB_REDUCE_SUM, k->timeout));
  if (k->st[0] != ZB_OK) return NULL;
  note(k, 1, zb_transport_all_reduce(k->t, 0, k->max, N, ZB_DTYPE_F32, ZB_REDUCE_MAX, k->timeout));
  note(k, 2, zb_transport_all_reduce(k->t, 0, k->bsum, N, ZB_DTYPE_BF16, ZB_REDUCE_SUM, k->timeout));
  zb_status_t st = ZB_OK;
  for (int root = 0; root < k->p && st == ZB_OK; root++) {
    for (int i = 0; i < N; i++) k->bcast[root][i] = k->rank == root ? value(100 + root, i) : -1.0f;
    st = zb_transport_broadcast(k->t, 1, k->bcast[root], sizeof k->bcast[root], root, k->timeout);
  }
  note(k, 3, st);
  return NULL;
}

/* Runs p ranks of one in-process group; skip: the rank that does not join (-1 none), how. */
static rank_t *run(int p, int skip_rank, int skip_how, double timeout) {
  zb_inproc_group_t *g = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, p));
  rank_t *ranks = calloc((size_t)p, sizeof *ranks);
  pthread_t th[MAXP];
  for (int r = 0; r < p; r++) {
    ZB_ASSERT_OK(zb_transport_create_inproc(&ranks[r].t, g, r));
    /* With a rank missing, rank 0 gives up first (the others wait longer), so which rank fails
     * first, and how, does not depend on the threads' timing. */
    ranks[r].rank = r, ranks[r].p = p, ranks[r].timeout = skip_how == 1 && r > 0 ? 20 * timeout : timeout;
    ranks[r].skip = r == skip_rank ? skip_how : 0;
    for (int w = 0; w < 4; w++) ranks[r].st[w] = ZB_OK;
  }
  for (int r = 0; r < p; r++) assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ranks[r]), 0);
  for (int r = 0; r < p; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < p; r++) ZB_ASSERT_OK(zb_transport_destroy(ranks[r].t));
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
  return ranks;
}

static void test_every_rank_gets_the_rank_order_result(void **state) {
  (void)state;
  for (int p = 2; p <= MAXP; p++) {
    rank_t *ranks = run(p, -1, 0, 10.0);
    for (int r = 0; r < p; r++)
      for (int w = 0; w < 4; w++)
        if (ranks[r].st[w] != ZB_OK) fail_msg("p=%d rank %d collective %d: %s", p, r, w, ranks[r].msg[w]);
    int order_shows = 0;
    for (int i = 0; i < N; i++) {
      float want = value(0, i), back = value(p - 1, i), mx = value(0, i);
      uint16_t bwant = zb__float_to_bf16(value(0, i));
      for (int r = 1; r < p; r++) {
        want = want + value(r, i);
        mx = value(r, i) > mx ? value(r, i) : mx;
        bwant = zb__float_to_bf16(zb__bf16_to_float(bwant) + zb__bf16_to_float(zb__float_to_bf16(value(r, i))));
      }
      for (int r = p - 2; r >= 0; r--) back = back + value(r, i);
      order_shows += back != want;
      for (int r = 0; r < p; r++) {
        if (memcmp(&ranks[r].sum[i], &want, sizeof want) != 0)
          fail_msg("p=%d rank %d element %d: sum %.9g, rank order gives %.9g", p, r, i, ranks[r].sum[i], want);
        if (i == 5 && p > 1) {
          if (!isnan(ranks[r].max[i])) fail_msg("p=%d rank %d: the NaN was lost in the max", p, r);
        } else if (ranks[r].max[i] != mx) {
          fail_msg("p=%d rank %d element %d: max %g, want %g", p, r, i, ranks[r].max[i], mx);
        }
        if (ranks[r].bsum[i] != bwant) fail_msg("p=%d rank %d element %d: bf16 sum differs", p, r, i);
        for (int root = 0; root < p; root++)
          if (ranks[r].bcast[root][i] != value(100 + root, i))
            fail_msg("p=%d rank %d: element %d of the broadcast from %d is %g", p, r, i, root, ranks[r].bcast[root][i]);
      }
    }
    /* The check means something: adding in another order gives other bits somewhere. */
    if (p > 2) assert_true(order_shows > 0);
    free(ranks);
  }
}

static void test_a_rank_that_never_joins_is_named(void **state) {
  (void)state;
  rank_t *ranks = run(3, 2, 1, 0.3);
  ASSERT_STATUS(ranks[0].st[0], ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(ranks[0].msg[0], "all-reduce (sum)");
  ASSERT_CONTAINS(ranks[0].msg[0], "rank 2");
  /* Rank 1 waits for rank 0's result: rank 0's failure aborts its transport, so rank 1 hears why
   * at once instead of timing out itself, and the reason names the missing rank. */
  ASSERT_STATUS(ranks[1].st[0], ZB_ERR_REMOTE);
  ASSERT_CONTAINS(ranks[1].msg[0], "rank 2");
  free(ranks);
}

static void test_a_rank_that_aborts_fails_the_others_with_its_reason(void **state) {
  (void)state;
  rank_t *ranks = run(3, 1, 2, 5.0);
  ASSERT_STATUS(ranks[0].st[0], ZB_ERR_REMOTE);
  ASSERT_CONTAINS(ranks[0].msg[0], "out of memory in its S pass");
  assert_true(ranks[2].st[0] != ZB_OK);
  free(ranks);
}

static void test_bad_arguments_say_what_is_allowed(void **state) {
  (void)state;
  zb_inproc_group_t *g = NULL;
  zb_transport_t *t = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 2));
  ZB_ASSERT_OK(zb_transport_create_inproc(&t, g, 0));
  float x = 1;
  ASSERT_STATUS(zb_transport_all_reduce(t, 0, &x, 1, (zb_dtype_t)7, ZB_REDUCE_SUM, 1), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "ZB_DTYPE_F32");
  ASSERT_STATUS(zb_transport_all_reduce(t, 0, &x, 1, ZB_DTYPE_F32, (zb_reduce_op_t)5, 1), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "ZB_REDUCE_MAX");
  ASSERT_STATUS(zb_transport_broadcast(t, 0, &x, 4, 2, 1), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "root 2 is not a rank of 0..1");
  ASSERT_STATUS(zb_transport_all_reduce(t, ZB_COLLECTIVE_CHANNELS, &x, 1, ZB_DTYPE_F32, ZB_REDUCE_SUM, 1),
                ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "channels are 0..1023");
  ASSERT_STATUS(zb_transport_all_reduce(NULL, 0, &x, 1, ZB_DTYPE_F32, ZB_REDUCE_SUM, 1), ZB_ERR_INVALID_ARGUMENT);
  ZB_ASSERT_OK(zb_transport_destroy(t));
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_rank_gets_the_rank_order_result),
      cmocka_unit_test(test_a_rank_that_never_joins_is_named),
      cmocka_unit_test(test_a_rank_that_aborts_fails_the_others_with_its_reason),
      cmocka_unit_test(test_bad_arguments_say_what_is_allowed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
