/*
 * test_transport_socket.c - the socket transport (csrc/runtime/transport_socket.c) as the runner
 * and the optimizer use it: two or three ranks in one process, connected by socketpair(), each
 * with its own transport (and progress thread).
 *  - two ranks that send each other 8 MiB before either posts its receive both finish their sends
 *    (the sockets hold far less), and the bytes arrive intact;
 *  - messages on many channels arrive in send order per channel, whatever order the receives are
 *    posted in, before or after the bytes came;
 *  - a peer whose connection ends fails the waits on it with ZB_ERR_REMOTE naming the peer and
 *    the channel, while what it sent before stays deliverable;
 *  - abort() reaches the peer (its waits fail with the reason), and reaches a third rank too;
 *  - the abort signal fails a blocked wait with its message, and a rank's own abort publishes once;
 *  - a receive that gets nothing times out naming the peer and the channel; a zero-timeout wait
 *    is a poll that leaves the request pending until the bytes come;
 *  - a size mismatch and bad configs get clear errors.
 * What it is not: a test of the connection setup (the Python binding's, test_host_transport.py).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "runtime/internal.h"

#define MAXR 3

typedef struct {
  zb_transport_t *t[MAXR];
  int n;
} mesh_t;

/* n ranks, every pair connected by a socketpair; signals[r] (may be NULL) for rank r. */
static void mesh_make(mesh_t *m, int n, const zb_abort_signal_t *signals) {
  int fds[MAXR][MAXR];
  for (int a = 0; a < n; a++) fds[a][a] = -1;
  for (int a = 0; a < n; a++)
    for (int b = a + 1; b < n; b++) {
      int sv[2];
      assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
      fds[a][b] = sv[0], fds[b][a] = sv[1];
    }
  m->n = n;
  for (int r = 0; r < n; r++) {
    zb_socket_transport_config_t c = ZB_SOCKET_TRANSPORT_CONFIG_INIT;
    c.rank = r, c.ranks = n, c.fds = fds[r];
    if (signals) c.abort_signal = signals[r];
    ZB_ASSERT_OK(zb_transport_create_socket(&m->t[r], &c));
  }
}

static void mesh_free(mesh_t *m) {
  for (int r = 0; r < m->n; r++) ZB_ASSERT_OK(zb_transport_destroy(m->t[r]));
}

static unsigned char byte_at(int src, int tag, size_t i) { return (unsigned char)(mix((uint64_t)src * 1000003u + (uint64_t)tag * 7919u + i) & 0xff); }

static void fill(unsigned char *buf, size_t n, int src, int tag) {
  for (size_t i = 0; i < n; i++) buf[i] = byte_at(src, tag, i);
}

static void check_bytes(const unsigned char *buf, size_t n, int src, int tag) {
  for (size_t i = 0; i < n; i++)
    if (buf[i] != byte_at(src, tag, i))
      fail_msg("byte %zu of the message from rank %d on channel %d is %u, expected %u", i, src, tag, buf[i],
               byte_at(src, tag, i));
}

/* ---- both ways at once -------------------------------------------------------------------------- */

static void test_large_both_ways_before_receives(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 2, NULL);
  const size_t big = 8u << 20;
  unsigned char *out[2], *in[2];
  zb__request_t sreq[2], rreq[2];
  for (int r = 0; r < 2; r++) {
    out[r] = malloc(big), in[r] = calloc(1, big);
    fill(out[r], big, r, 3);
    ZB_ASSERT_OK(zb__transport_isend(m.t[r], &sreq[r], 1 - r, 3, out[r], big));
  }
  /* Neither rank has posted its receive: the sends can only finish if the peers stage them. */
  for (int r = 0; r < 2; r++) ZB_ASSERT_OK(zb__transport_wait(m.t[r], &sreq[r], 30.0));
  for (int r = 0; r < 2; r++) ZB_ASSERT_OK(zb__transport_irecv(m.t[r], &rreq[r], 1 - r, 3, in[r], big));
  for (int r = 0; r < 2; r++) {
    ZB_ASSERT_OK(zb__transport_wait(m.t[r], &rreq[r], 30.0));
    check_bytes(in[r], big, 1 - r, 3);
    free(out[r]), free(in[r]);
  }
  mesh_free(&m);
}

/* The same from two threads, each posting its receive after starting its send, as the runner does. */
typedef struct {
  zb_transport_t *t;
  int rank;
  size_t bytes;
  zb_status_t st;
  char err[512];
} side_t;

static void *side_run(void *arg) {
  side_t *s = arg;
  unsigned char *out = malloc(s->bytes), *in = calloc(1, s->bytes);
  zb__request_t sr, rr;
  fill(out, s->bytes, s->rank, 1);
  s->st = zb__transport_isend(s->t, &sr, 1 - s->rank, 1, out, s->bytes);
  if (s->st == ZB_OK) s->st = zb__transport_irecv(s->t, &rr, 1 - s->rank, 1, in, s->bytes);
  if (s->st == ZB_OK) s->st = zb__transport_wait(s->t, &rr, 30.0);
  if (s->st == ZB_OK) s->st = zb__transport_wait(s->t, &sr, 30.0);
  if (s->st != ZB_OK) snprintf(s->err, sizeof s->err, "%s", zb_last_error());
  else
    for (size_t i = 0; i < s->bytes; i++)
      if (in[i] != byte_at(1 - s->rank, 1, i)) {
        s->st = ZB_ERR_INTERNAL;
        snprintf(s->err, sizeof s->err, "byte %zu differs", i);
        break;
      }
  free(out), free(in);
  return NULL;
}

static void test_threads_exchange(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 2, NULL);
  side_t sides[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    sides[r] = (side_t){m.t[r], r, 5u << 20, ZB_OK, ""};
    pthread_create(&th[r], NULL, side_run, &sides[r]);
  }
  for (int r = 0; r < 2; r++) {
    pthread_join(th[r], NULL);
    if (sides[r].st != ZB_OK) fail_msg("rank %d: %s: %s", r, zb_status_string(sides[r].st), sides[r].err);
  }
  mesh_free(&m);
}

/* ---- order per channel -------------------------------------------------------------------------- */

static void test_channels_in_order(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 2, NULL);
  enum { CH = 6, PER = 8 };
  int32_t payload[CH][PER], got[CH][PER];
  zb__request_t sreq[CH][PER], rreq[CH][PER];
  /* Half the receives are posted before anything is sent (channels in reverse order), half after. */
  for (int c = CH - 1; c >= 0; c--)
    for (int k = 0; k < PER / 2; k++) ZB_ASSERT_OK(zb__transport_irecv(m.t[1], &rreq[c][k], 0, c, &got[c][k], sizeof(int32_t)));
  for (int k = 0; k < PER; k++)
    for (int c = 0; c < CH; c++) {
      payload[c][k] = 1000 * c + k;
      /* sizes vary per message too: every message of a channel is one int here, others use bytes */
      ZB_ASSERT_OK(zb__transport_isend(m.t[0], &sreq[c][k], 1, c, &payload[c][k], sizeof(int32_t)));
    }
  for (int c = 0; c < CH; c++)
    for (int k = 0; k < PER; k++) ZB_ASSERT_OK(zb__transport_wait(m.t[0], &sreq[c][k], 10.0));
  for (int c = CH - 1; c >= 0; c--)
    for (int k = PER / 2; k < PER; k++) ZB_ASSERT_OK(zb__transport_irecv(m.t[1], &rreq[c][k], 0, c, &got[c][k], sizeof(int32_t)));
  for (int c = 0; c < CH; c++)
    for (int k = 0; k < PER; k++) {
      ZB_ASSERT_OK(zb__transport_wait(m.t[1], &rreq[c][k], 10.0));
      if (got[c][k] != payload[c][k]) fail_msg("channel %d, message %d: got %d, expected %d", c, k, got[c][k], payload[c][k]);
    }
  mesh_free(&m);
}

/* ---- failures ----------------------------------------------------------------------------------- */

static void test_peer_death(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 2, NULL);
  int32_t sent = 42, got = 0, never = 0;
  zb__request_t s, r1, r2;
  ZB_ASSERT_OK(zb__transport_isend(m.t[1], &s, 0, 4, &sent, sizeof sent));
  ZB_ASSERT_OK(zb__transport_wait(m.t[1], &s, 10.0));
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r2, 1, 5, &never, sizeof never));
  ZB_ASSERT_OK(zb_transport_destroy(m.t[1])); /* rank 1 goes away: its socket closes */
  /* A long timeout: the failure must come from the closed connection, not from the clock. */
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r2, 60.0), ZB_ERR_REMOTE);
  ASSERT_CONTAINS(zb_last_error(), "rank 1");
  ASSERT_CONTAINS(zb_last_error(), "channel 5");
  ASSERT_CONTAINS(zb_last_error(), "closed");
  /* What came before the death is still there. */
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r1, 1, 4, &got, sizeof got));
  ZB_ASSERT_OK(zb__transport_wait(m.t[0], &r1, 10.0));
  assert_int_equal(got, 42);
  /* Sends to the dead peer fail at once, naming it. */
  zb_status_t st = zb__transport_isend(m.t[0], &s, 1, 6, &sent, sizeof sent);
  if (st == ZB_OK) st = zb__transport_wait(m.t[0], &s, 60.0);
  assert_int_equal(st, ZB_ERR_REMOTE);
  ASSERT_CONTAINS(zb_last_error(), "rank 1");
  ZB_ASSERT_OK(zb_transport_destroy(m.t[0]));
}

static void test_abort_reaches_peers(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 3, NULL);
  int32_t a = 0, b = 0;
  zb__request_t r0, r2;
  /* Rank 0 waits on rank 2 (not the one that fails); rank 2 waits on rank 0. */
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r0, 2, 1, &a, sizeof a));
  ZB_ASSERT_OK(zb__transport_irecv(m.t[2], &r2, 0, 1, &b, sizeof b));
  ZB_ASSERT_OK(zb_transport_abort(m.t[1], "the forward of stage 1 raised ValueError"));
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r0, 60.0), ZB_ERR_REMOTE);
  ASSERT_CONTAINS(zb_last_error(), "rank 1 failed: the forward of stage 1 raised ValueError");
  ASSERT_STATUS(zb__transport_wait(m.t[2], &r2, 60.0), ZB_ERR_REMOTE);
  ASSERT_CONTAINS(zb_last_error(), "rank 1 failed: the forward of stage 1 raised ValueError");
  /* The failure stays: the runner's check between ops sees it, and new transfers are refused. */
  ASSERT_STATUS(m.t[0]->ops->check(m.t[0]), ZB_ERR_REMOTE);
  ASSERT_STATUS(zb__transport_isend(m.t[2], &r2, 0, 1, &b, sizeof b), ZB_ERR_REMOTE);
  mesh_free(&m);
}

typedef struct {
  pthread_mutex_t mu;
  char text[256];
  int fired, published;
  char published_text[256];
} fake_signal_t;

static int sig_poll(void *user, char *msg, size_t cap) {
  fake_signal_t *f = user;
  pthread_mutex_lock(&f->mu);
  int fired = f->fired;
  if (fired) snprintf(msg, cap, "%s", f->text);
  pthread_mutex_unlock(&f->mu);
  return fired;
}

static void sig_publish(void *user, const char *msg) {
  fake_signal_t *f = user;
  pthread_mutex_lock(&f->mu);
  f->published++;
  snprintf(f->published_text, sizeof f->published_text, "%s", msg);
  pthread_mutex_unlock(&f->mu);
}

static void *fire_later(void *arg) {
  fake_signal_t *f = arg;
  struct timespec ts = {0, 300 * 1000 * 1000};
  nanosleep(&ts, NULL);
  pthread_mutex_lock(&f->mu);
  snprintf(f->text, sizeof f->text, "rank 7 failed first: the loss was NaN");
  f->fired = 1;
  pthread_mutex_unlock(&f->mu);
  return NULL;
}

static void test_abort_signal(void **state) {
  (void)state;
  fake_signal_t f[2];
  zb_abort_signal_t sig[2];
  for (int r = 0; r < 2; r++) {
    memset(&f[r], 0, sizeof f[r]);
    pthread_mutex_init(&f[r].mu, NULL);
    sig[r] = (zb_abort_signal_t){sig_poll, sig_publish, &f[r]};
  }
  mesh_t m;
  mesh_make(&m, 2, sig);
  int32_t x = 0;
  zb__request_t r;
  pthread_t th;
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r, 1, 2, &x, sizeof x));
  pthread_create(&th, NULL, fire_later, &f[0]);
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r, 60.0), ZB_ERR_REMOTE);
  ASSERT_CONTAINS(zb_last_error(), "rank 7 failed first: the loss was NaN");
  pthread_join(th, NULL);
  /* A failure that came from the signal is not published again. */
  ZB_ASSERT_OK(zb_transport_abort(m.t[0], "waiting for the gradient failed"));
  assert_int_equal(f[0].published, 0);
  mesh_free(&m);

  /* Rank 1's own failure is published once, with its reason; rank 0, which learns of it over the
   * socket, does not publish its own abort that follows. */
  for (int k = 0; k < 2; k++) f[k].published = 0, f[k].fired = 0;
  mesh_make(&m, 2, sig);
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r, 1, 2, &x, sizeof x));
  ZB_ASSERT_OK(zb_transport_abort(m.t[1], "the backward raised"));
  ZB_ASSERT_OK(zb_transport_abort(m.t[1], "again"));
  assert_int_equal(f[1].published, 1);
  ASSERT_CONTAINS(f[1].published_text, "the backward raised");
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r, 60.0), ZB_ERR_REMOTE);
  ASSERT_CONTAINS(zb_last_error(), "rank 1 failed: the backward raised");
  ZB_ASSERT_OK(zb_transport_abort(m.t[0], "waiting for the gradient failed"));
  assert_int_equal(f[0].published, 0);
  mesh_free(&m);
  for (int k = 0; k < 2; k++) pthread_mutex_destroy(&f[k].mu);
}

static void test_timeout_and_poll(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 2, NULL);
  int32_t x = 0, y = 77;
  zb__request_t r, s;
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r, 1, 9, &x, sizeof x));
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r, 0.2), ZB_ERR_TIMEOUT);
  ASSERT_CONTAINS(zb_last_error(), "rank 1");
  ASSERT_CONTAINS(zb_last_error(), "channel 9");
  assert_false(r.active);
  /* A poll leaves the request pending until the bytes come. */
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r, 1, 9, &x, sizeof x));
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r, 0), ZB_ERR_TIMEOUT);
  assert_true(r.active);
  ZB_ASSERT_OK(zb__transport_isend(m.t[1], &s, 0, 9, &y, sizeof y));
  zb_status_t st = ZB_ERR_TIMEOUT;
  for (int i = 0; i < 10000 && st == ZB_ERR_TIMEOUT; i++) {
    st = zb__transport_wait(m.t[0], &r, 0);
    if (st == ZB_ERR_TIMEOUT) {
      struct timespec ts = {0, 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  ZB_ASSERT_OK(st);
  assert_int_equal(x, 77);
  ZB_ASSERT_OK(zb__transport_wait(m.t[1], &s, 10.0));
  mesh_free(&m);
}

static void test_size_mismatch(void **state) {
  (void)state;
  mesh_t m;
  mesh_make(&m, 2, NULL);
  int64_t big = 5, after = 6;
  int32_t small = 0;
  int64_t got_after = 0;
  zb__request_t s, s2, r, r2;
  ZB_ASSERT_OK(zb__transport_isend(m.t[1], &s, 0, 0, &big, sizeof big));
  ZB_ASSERT_OK(zb__transport_isend(m.t[1], &s2, 0, 0, &after, sizeof after));
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r, 1, 0, &small, sizeof small));
  ASSERT_STATUS(zb__transport_wait(m.t[0], &r, 10.0), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "received 8 bytes from rank 1 on channel 0 but expected 4");
  /* The stream stays usable: the next message of the channel is the next one sent. */
  ZB_ASSERT_OK(zb__transport_irecv(m.t[0], &r2, 1, 0, &got_after, sizeof got_after));
  ZB_ASSERT_OK(zb__transport_wait(m.t[0], &r2, 10.0));
  assert_int_equal(got_after, 6);
  ZB_ASSERT_OK(zb__transport_wait(m.t[1], &s, 10.0));
  ZB_ASSERT_OK(zb__transport_wait(m.t[1], &s2, 10.0));
  mesh_free(&m);
}

/* Collectives over sockets (test_collectives.c has them on the in-process transport): three ranks
 * as threads sum a buffer bigger than a socket's kernel buffer and each broadcasts one; every rank
 * gets the rank-order sum, ((x0 + x1) + x2), bit for bit. */
typedef struct {
  zb_transport_t *t;
  int rank;
  float *sum, *bc;
  zb_status_t st;
} coll_t;

enum { COLL_N = 300000 };

static float coll_value(int r, int i) { return urand((uint64_t)r, (uint64_t)i, 3, 5) * (i % 2 ? 1e5f : 1.0f); }

static void *coll_run(void *arg) {
  coll_t *c = arg;
  c->st = zb_transport_all_reduce(c->t, 0, c->sum, COLL_N, ZB_DTYPE_F32, ZB_REDUCE_SUM, 20.0);
  for (int root = 0; root < 3 && c->st == ZB_OK; root++)
    c->st = zb_transport_broadcast(c->t, 0, c->bc + (size_t)root * 1000, 1000 * sizeof(float), root, 20.0);
  return NULL;
}

static void test_collectives_over_sockets(void **state) {
  (void)state;
  for (int staged = 0; staged <= 1; staged++) { /* a staged transport's run on its inner one */
  mesh_t m;
  mesh_make(&m, 3, NULL);
  zb_transport_t *st[3] = {NULL, NULL, NULL};
  for (int r = 0; staged && r < 3; r++) ZB_ASSERT_OK(zb_transport_create_staged(&st[r], m.t[r]));
  coll_t c[3];
  pthread_t th[3];
  for (int r = 0; r < 3; r++) {
    c[r] = (coll_t){staged ? st[r] : m.t[r], r, malloc(COLL_N * sizeof(float)), malloc(3000 * sizeof(float)), ZB_OK};
    for (int i = 0; i < COLL_N; i++) c[r].sum[i] = coll_value(r, i);
    for (int i = 0; i < 3000; i++) c[r].bc[i] = i / 1000 == r ? coll_value(10 + r, i) : 0.0f;
  }
  for (int r = 0; r < 3; r++) assert_int_equal(pthread_create(&th[r], NULL, coll_run, &c[r]), 0);
  for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 3; r++) {
    ZB_ASSERT_OK(c[r].st);
    for (int i = 0; i < COLL_N; i++) {
      float want = (coll_value(0, i) + coll_value(1, i)) + coll_value(2, i);
      if (memcmp(&want, &c[r].sum[i], sizeof want) != 0)
        fail_msg("rank %d element %d: %.9g, rank order gives %.9g", r, i, c[r].sum[i], want);
    }
    for (int i = 0; i < 3000; i++)
      if (c[r].bc[i] != coll_value(10 + i / 1000, i)) fail_msg("rank %d: broadcast element %d is wrong", r, i);
    free(c[r].sum), free(c[r].bc);
  }
  for (int r = 0; r < 3; r++) ZB_ASSERT_OK(zb_transport_destroy(st[r]));
  mesh_free(&m);
  }
}

static void test_bad_configs(void **state) {
  (void)state;
  zb_transport_t *t = NULL;
  zb_socket_transport_config_t c = ZB_SOCKET_TRANSPORT_CONFIG_INIT;
  c.struct_size = 8;
  ASSERT_STATUS(zb_transport_create_socket(&t, &c), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "ZB_SOCKET_TRANSPORT_CONFIG_INIT");
  int p[2];
  assert_int_equal(pipe(p), 0);
  int32_t fds[2] = {-1, p[0]};
  c = (zb_socket_transport_config_t)ZB_SOCKET_TRANSPORT_CONFIG_INIT;
  c.rank = 0, c.ranks = 2, c.fds = fds;
  ASSERT_STATUS(zb_transport_create_socket(&t, &c), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "fds[1]");
  assert_null(t);
  close(p[1]);
  c = (zb_socket_transport_config_t)ZB_SOCKET_TRANSPORT_CONFIG_INIT;
  c.rank = 2, c.ranks = 2;
  ASSERT_STATUS(zb_transport_create_socket(&t, &c), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "rank 2 of 2");
}

/* A transport made without sockets refuses transfers naming the peer, and works once attached. */
static void test_attach_later(void **state) {
  (void)state;
  zb_transport_t *t[2];
  for (int r = 0; r < 2; r++) {
    zb_socket_transport_config_t c = ZB_SOCKET_TRANSPORT_CONFIG_INIT;
    c.rank = r, c.ranks = 2;
    ZB_ASSERT_OK(zb_transport_create_socket(&t[r], &c));
  }
  int32_t x = 5, y = 0;
  zb__request_t s, r;
  ASSERT_STATUS(zb__transport_isend(t[0], &s, 1, 2, &x, sizeof x), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "no connection to rank 1 (channel 2)");
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int32_t f0[2] = {-1, sv[0]}, f1[2] = {sv[1], -1};
  ZB_ASSERT_OK(zb_transport_socket_attach(t[0], f0));
  ZB_ASSERT_OK(zb_transport_socket_attach(t[1], f1));
  ZB_ASSERT_OK(zb__transport_irecv(t[1], &r, 0, 2, &y, sizeof y));
  ZB_ASSERT_OK(zb__transport_isend(t[0], &s, 1, 2, &x, sizeof x));
  ZB_ASSERT_OK(zb__transport_wait(t[1], &r, 10.0));
  ZB_ASSERT_OK(zb__transport_wait(t[0], &s, 10.0));
  assert_int_equal(y, 5);
  /* A second socket for the same peer is refused (and closed). */
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int32_t again[2] = {-1, sv[0]};
  ASSERT_STATUS(zb_transport_socket_attach(t[0], again), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "already has a socket for rank 1");
  close(sv[1]);
  for (int k = 0; k < 2; k++) ZB_ASSERT_OK(zb_transport_destroy(t[k]));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_large_both_ways_before_receives),
      cmocka_unit_test(test_threads_exchange),
      cmocka_unit_test(test_collectives_over_sockets),
      cmocka_unit_test(test_channels_in_order),
      cmocka_unit_test(test_peer_death),
      cmocka_unit_test(test_abort_reaches_peers),
      cmocka_unit_test(test_abort_signal),
      cmocka_unit_test(test_timeout_and_poll),
      cmocka_unit_test(test_size_mismatch),
      cmocka_unit_test(test_bad_configs),
      cmocka_unit_test(test_attach_later),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
