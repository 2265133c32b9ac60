/*
 * test_pairorder.c - the order in which two ranks issue the transfers between them on one shared
 * communicator (csrc/runtime/pairorder.c), for every generator on 2 to 5 ranks: both ends compute
 * the same order without talking, it covers each transfer once, and a runner that posts receives
 * one op ahead and sends right after each op can always issue what it waits for (its predecessors
 * in the order are posted by then). The NCCL transport's own test runs these orders end to end.
 */
#include <stdio.h>
#include <stdlib.h>

#include "helpers.h"
#include "runtime/internal.h"

static void check_schedule(const zb_schedule_t *s, const char *what) {
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(s, &info));
  const int32_t p = info.ranks, S = info.stages, T = 2 * (S - 1);
  zb__pair_order_t *o = calloc((size_t)p, sizeof *o);
  for (int32_t r = 0; r < p; r++) ZB_ASSERT_OK(zb__pair_order_make(s, r, &o[r]));

  for (int32_t r = 0; r < p; r++) {
    /* 1. Both ends agree: the k-th message of a channel has one place, seen from either rank. */
    for (int32_t t = 0; t < T; t++) {
      const zb__pair_chan_t *c = &o[r].chans[t];
      if (c->pair < 0) continue;
      const zb__pair_chan_t *d = &o[c->peer].chans[t];
      if (d->pair < 0 || d->peer != r || d->is_send == c->is_send || d->count != c->count)
        fail_msg("%s: channel %d between ranks %d and %d is not seen alike from both ends", what, (int)t, (int)r,
                 (int)c->peer);
      for (int32_t k = 0; k < c->count; k++)
        if (c->seq[k] != d->seq[k])
          fail_msg("%s: message %d of channel %d is number %d on rank %d but %d on rank %d", what, (int)k, (int)t,
                   (int)c->seq[k], (int)r, (int)d->seq[k], (int)c->peer);
    }
    /* 2. Each pair's order numbers every transfer once. */
    for (int32_t i = 0; i < o[r].n_pairs; i++) {
      int32_t len = o[r].pairs[i].length;
      int *seen = calloc((size_t)(len ? len : 1), sizeof *seen);
      for (int32_t t = 0; t < T; t++)
        if (o[r].chans[t].pair == i)
          for (int32_t k = 0; k < o[r].chans[t].count; k++) {
            int32_t q = o[r].chans[t].seq[k];
            assert_true(q >= 0 && q < len);
            seen[q]++;
          }
      for (int32_t q = 0; q < len; q++)
        if (seen[q] != 1) fail_msg("%s: rank %d, pair with rank %d: place %d taken %d times", what, (int)r,
                                   (int)o[r].pairs[i].peer, (int)q, seen[q]);
      free(seen);
    }
    /* 3. A runner that posts receives one ahead can issue every receive when it waits for it. */
    const zb_op_t *ops;
    int32_t n;
    ZB_ASSERT_OK(zb_schedule_rank_ops(s, r, &ops, &n));
    int32_t *sent = calloc((size_t)(T ? T : 1), sizeof *sent), *rcvd = calloc((size_t)(T ? T : 1), sizeof *rcvd);
    uint8_t **posted = calloc((size_t)(o[r].n_pairs ? o[r].n_pairs : 1), sizeof *posted);
    for (int32_t i = 0; i < o[r].n_pairs; i++) posted[i] = calloc((size_t)o[r].pairs[i].length + 1, 1);
    for (int32_t j = 0; j < n; j++) {
      zb__link_t in, out;
      ZB_ASSERT_OK(zb__op_links(s, S, &ops[j], &in, &out));
      if (in.tag >= 0 && in.peer != r) {
        const zb__pair_chan_t *c = &o[r].chans[in.tag];
        int32_t q = c->seq[rcvd[in.tag]++];
        posted[c->pair][q] = 1;
        for (int32_t x = 0; x < q; x++)
          if (!posted[c->pair][x])
            fail_msg("%s: rank %d waits at op %d for place %d with rank %d, but place %d is not posted yet", what,
                     (int)r, (int)j, (int)q, (int)c->peer, (int)x);
      }
      if (out.tag >= 0 && out.peer != r) {
        const zb__pair_chan_t *c = &o[r].chans[out.tag];
        posted[c->pair][c->seq[sent[out.tag]++]] = 1;
      }
    }
    for (int32_t i = 0; i < o[r].n_pairs; i++) free(posted[i]);
    free(posted), free(sent), free(rcvd);
  }
  for (int32_t r = 0; r < p; r++) zb__pair_order_free(&o[r]);
  free(o);
}

static void test_every_kind_orders_alike_and_issuably(void **state) {
  (void)state;
  const zb_kind_t kinds[] = {ZB_KIND_GPIPE, ZB_KIND_1F1B, ZB_KIND_INTERLEAVED_1F1B, ZB_KIND_ZB_H1, ZB_KIND_ZB_H2,
                             ZB_KIND_ZB_V, ZB_KIND_V_HALF, ZB_KIND_V_MIN, ZB_KIND_ZB_AUTO};
  int checked = 0;
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
    for (int p = 2; p <= 5; p++)
      for (int mul = 2; mul <= 3; mul++) {
        zb_schedule_spec_t spec = zb_test_spec(kinds[k], p, mul * p, 0);
        zb_schedule_t *s = NULL;
        if (zb_schedule_create(&s, &spec) != ZB_OK) continue; /* a kind that needs more microbatches */
        char what[64];
        snprintf(what, sizeof what, "kind %d, p %d, m %d", (int)kinds[k], p, mul * p);
        check_schedule(s, what);
        zb_schedule_destroy(s);
        checked++;
      }
  assert_true(checked >= 50);
}

/* Pairs for communicator splits: a rank's pairs fall in different rounds (a ring of 3 needs 3). */
static void test_pair_rounds(void **state) {
  (void)state;
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_INTERLEAVED_1F1B, 3, 6, 2);
  zb_schedule_t *s = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  int32_t np, (*pairs)[2], *round, rounds;
  ZB_ASSERT_OK(zb__pair_list(s, &np, &pairs, &round, &rounds));
  assert_int_equal(np, 3);
  assert_int_equal(rounds, 3);
  for (int32_t i = 0; i < np; i++)
    for (int32_t j = i + 1; j < np; j++)
      if (round[i] == round[j])
        assert_true(pairs[i][0] != pairs[j][0] && pairs[i][0] != pairs[j][1] && pairs[i][1] != pairs[j][0] &&
                    pairs[i][1] != pairs[j][1]);
  free(pairs), free(round);
  zb_schedule_destroy(s);
  spec = zb_test_spec(ZB_KIND_ZB_V, 4, 8, 2);
  ZB_ASSERT_OK(zb_schedule_create(&s, &spec));
  ZB_ASSERT_OK(zb__pair_list(s, &np, &pairs, &round, &rounds));
  assert_int_equal(np, 3); /* V: neighbours only, (0,1), (1,2), (2,3) */
  assert_int_equal(rounds, 2);
  free(pairs), free(round);
  zb_schedule_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_kind_orders_alike_and_issuably),
      cmocka_unit_test(test_pair_rounds),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
