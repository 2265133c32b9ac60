/*
 * transport_socket.c - the host transport over connected stream sockets (AF_UNIX or TCP), one per
 * peer, with a progress thread per transport. This is what CPU pipelines of several processes use
 * (the Python binding connects the sockets and hands the descriptors over).
 *
 * Why a thread of our own: a send must never wait for its receiver (internal.h), yet a socket
 * takes only as many bytes as its kernel buffer holds. Two ranks sending each other a large message
 * before either posts its receive would deadlock if only the callers moved bytes. The progress
 * thread poll()s every peer socket: it writes queued sends as the sockets take them and reads each
 * incoming message straight into the posted receive it matches, or into a staging buffer when
 * none is posted yet (an unexpected message), so both sides always drain. The caller's thread
 * writes a send itself when nothing is queued before it (most sends then finish inside isend, with
 * no hand-over), and wait() blocks on a condition variable the progress thread signals; a wait
 * with timeout 0 only looks (the progress thread keeps the state current).
 *
 * Wire format: each message is a header (hdr_t: magic, kind, channel, byte count) and its bytes.
 * Messages are matched in order per (peer, channel): the stream keeps a peer's order, the posted
 * receives of a channel are matched oldest first, and so are its staged messages. Headers are in
 * the host's byte order: every rank of a job runs the same build on the same kind of machine.
 *
 * Failures: a peer whose socket reaches end of stream or an error (its process died, or it closed
 * its transport) fails the waits on that peer at once, naming the peer and the channel; messages
 * that arrived before stay deliverable. abort() queues an abort message (the reason) to every
 * peer and fails this transport; a peer that reads it fails every wait of its own with
 * ZB_ERR_REMOTE and the reason, and so does the optional abort signal (zb_abort_signal_t), which a
 * wait that blocks checks every 0.2 s from the waiting thread (never from the progress thread,
 * which never calls out of the library).
 *
 * What this is not: a transport for device memory (NCCL's), or a way to connect ranks; the caller
 * brings connected sockets, and the transport owns them from then on.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define MAGIC 0x7a627070u /* "zbpp" */
#define ABORT_TEXT_MAX 4096
#define SIGNAL_POLL_S 0.2
#define LINGER_S 1.0 /* how long destroy lets queued abort messages leave */

enum { KIND_DATA = 1, KIND_ABORT = 2 };
typedef struct {
  uint32_t magic, kind;
  int32_t tag, pad;
  uint64_t bytes;
} hdr_t;

/* Where a request is: it moves from a list of the transport's to DONE (or stays in the list when
 * its peer closed); the caller's wait or cancel frees it, unless the caller gave it up while the
 * transport still writes it (detached: the transport frees it when the bytes are out). */
enum { IN_NONE, IN_SENDQ, IN_POSTED, IN_READING, IN_CLAIMED };

typedef struct sreq {
  struct sreq *next;
  int is_send, where, done, detached, owned; /* owned: buf is ours (abort text, a detached send) */
  int32_t peer, tag;
  unsigned char *buf;
  size_t bytes, moved; /* moved counts header and body bytes of a send */
  hdr_t hdr;
  struct smsg *claimed; /* a receive waiting for the staged message it matched to finish arriving */
  zb_status_t status;   /* of a finished request */
  char err[256];
} sreq_t;

typedef struct smsg { /* an unexpected message, staged until its receive is posted */
  struct smsg *next;
  int32_t tag;
  size_t bytes, got;
  sreq_t *claimed;
  unsigned char data[];
} smsg_t;

typedef struct {
  int fd, closed, abort_queued;
  char why[160];                     /* why the connection closed */
  sreq_t *sq_head, *sq_tail;         /* sends in order; the head may be partly written */
  sreq_t *posted_head, *posted_tail; /* receives not yet matched */
  smsg_t *ux_head, *ux_tail;         /* staged messages, complete or arriving */
  hdr_t in_hdr;                      /* the incoming message */
  size_t in_hdr_got, in_got;
  int in_body;
  sreq_t *in_req;   /* its bytes go into this receive's buffer, */
  smsg_t *in_msg;   /* or into this staged message, */
  char *in_abort;   /* or it is an abort's reason; none of them: discarded */
} peer_t;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  peer_t *peers;
  struct pollfd *pfd;
  int32_t *pfd_peer;
  int wake[2];
  pthread_t thread;
  int thread_started, stop;
  int failed, from_peer, signal_asked; /* from_peer: the failure is a peer's abort message */
  zb_status_t fail_status;
  char fail_msg[1024];
  zb_abort_signal_t signal;
  unsigned char scratch[65536]; /* where discarded bytes go */
} sock_t;

static sock_t *S(zb_transport_t *t) { return t->impl; }

static void wake_thread(sock_t *s) {
  char c = 1;
  ssize_t n = write(s->wake[1], &c, 1); /* a full pipe already wakes the thread */
  (void)n;
}

static void deadline_after(struct timespec *ts, double seconds) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  double whole = (double)(long long)seconds;
  ts->tv_sec += (time_t)whole;
  ts->tv_nsec += (long)((seconds - whole) * 1e9);
  if (ts->tv_nsec >= 1000000000L) ts->tv_sec++, ts->tv_nsec -= 1000000000L;
}

static void finish(sreq_t *r, zb_status_t st) {
  r->done = 1, r->status = st, r->where = IN_NONE;
}

static void req_free(sreq_t *r) {
  if (r->owned) free(r->buf);
  free(r);
}

/* Fails the whole transport (first failure wins) and wakes every waiter. Caller holds mu. */
static int fail_all(sock_t *s, zb_status_t st, const char *msg) {
  if (s->failed) return 0;
  s->failed = 1, s->fail_status = st;
  snprintf(s->fail_msg, sizeof s->fail_msg, "%s", msg);
  pthread_cond_broadcast(&s->cv);
  return 1;
}

static void peer_close(sock_t *s, peer_t *p, const char *why) {
  if (p->closed) return;
  p->closed = 1;
  snprintf(p->why, sizeof p->why, "%s", why);
  /* Sends still queued cannot leave; detached ones are freed, the callers' fail at their wait. */
  for (sreq_t *r = p->sq_head, *next; r; r = next) {
    next = r->next;
    if (r->detached) req_free(r);
    else r->where = IN_NONE;
  }
  p->sq_head = p->sq_tail = NULL;
  pthread_cond_broadcast(&s->cv);
}

/* ---- writing --------------------------------------------------------------------------------- */

/* Writes queued sends of p until the socket is full. Caller holds mu; any thread. */
static void flush_peer(sock_t *s, peer_t *p) {
  while (p->sq_head && !p->closed) {
    sreq_t *r = p->sq_head;
    struct iovec iov[2];
    int n = 0;
    if (r->moved < sizeof(hdr_t))
      iov[n++] = (struct iovec){(char *)&r->hdr + r->moved, sizeof(hdr_t) - r->moved};
    size_t body = r->moved > sizeof(hdr_t) ? r->moved - sizeof(hdr_t) : 0;
    if (r->bytes > body) iov[n++] = (struct iovec){r->buf + body, r->bytes - body};
    ssize_t w = 0;
    if (n > 0) {
      struct msghdr mh = {0};
      mh.msg_iov = iov, mh.msg_iovlen = (size_t)n;
      w = sendmsg(p->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        char why[160];
        snprintf(why, sizeof why, "writing to it failed: %s", strerror(errno));
        peer_close(s, p, why);
        return;
      }
    }
    r->moved += (size_t)w;
    if (r->moved < sizeof(hdr_t) + r->bytes) continue;
    p->sq_head = r->next;
    if (!p->sq_head) p->sq_tail = NULL;
    if (r->detached) req_free(r);
    else finish(r, ZB_OK);
    pthread_cond_broadcast(&s->cv);
  }
}

static void enqueue_send(peer_t *p, sreq_t *r) {
  r->where = IN_SENDQ, r->next = NULL;
  if (p->sq_tail) p->sq_tail->next = r;
  else p->sq_head = r;
  p->sq_tail = r;
}

/* The caller gives up a send still queued: one not started leaves the queue; the one partly
 * written must still be finished (the stream would be corrupt otherwise), from a copy, since the
 * caller's buffer may go. Returns 1 when the transport keeps r (detached). Caller holds mu. */
static int detach_send(sock_t *s, peer_t *p, sreq_t *r) {
  if (r->where != IN_SENDQ) return 0;
  if (p->sq_head == r && r->moved > 0) {
    if (!r->owned && r->bytes) {
      unsigned char *copy = malloc(r->bytes);
      if (!copy) { /* cannot finish the message: the stream to this peer is unusable */
        peer_close(s, p, "out of memory copying a send its caller gave up");
        return 0;
      }
      memcpy(copy, r->buf, r->bytes);
      r->buf = copy, r->owned = 1;
    }
    r->detached = 1;
    return 1;
  }
  sreq_t **pp = &p->sq_head, *prev = NULL;
  while (*pp && *pp != r) prev = *pp, pp = &(*pp)->next;
  if (*pp) *pp = r->next;
  if (p->sq_tail == r) p->sq_tail = prev;
  r->where = IN_NONE;
  return 0;
}

/* ---- reading --------------------------------------------------------------------------------- */

static void size_mismatch(sock_t *s, sreq_t *r, size_t got, int32_t me) {
  snprintf(r->err, sizeof r->err,
           "rank %d received %zu bytes from rank %d on channel %d but expected %zu; the ranks disagree "
           "about the activation size",
           (int)me, got, (int)r->peer, (int)r->tag, r->bytes);
  finish(r, ZB_ERR_INVALID_ARGUMENT);
  pthread_cond_broadcast(&s->cv);
}

/* The header of a message from peer `src` is in; decide where its bytes go. Caller holds mu. */
static int route(sock_t *s, peer_t *p, int32_t me) {
  hdr_t *h = &p->in_hdr;
  if (h->magic != MAGIC || (h->kind != KIND_DATA && h->kind != KIND_ABORT)) return -1;
  p->in_body = 1, p->in_got = 0, p->in_req = NULL, p->in_msg = NULL, p->in_abort = NULL;
  if (h->kind == KIND_ABORT) {
    if (h->bytes > ABORT_TEXT_MAX) return -1;
    p->in_abort = calloc(1, (size_t)h->bytes + 1);
    return p->in_abort ? 0 : -1;
  }
  sreq_t **pp = &p->posted_head, *prev = NULL;
  while (*pp && (*pp)->tag != h->tag) prev = *pp, pp = &(*pp)->next;
  if (*pp) {
    sreq_t *r = *pp;
    *pp = r->next;
    if (p->posted_tail == r) p->posted_tail = prev;
    if (r->bytes == h->bytes) {
      p->in_req = r, r->where = IN_READING;
    } else {
      size_mismatch(s, r, (size_t)h->bytes, me); /* its bytes are discarded */
    }
    return 0;
  }
  smsg_t *m = malloc(sizeof(smsg_t) + (size_t)h->bytes);
  if (!m) return -1;
  m->next = NULL, m->tag = h->tag, m->bytes = (size_t)h->bytes, m->got = 0, m->claimed = NULL;
  if (p->ux_tail) p->ux_tail->next = m;
  else p->ux_head = m;
  p->ux_tail = m;
  p->in_msg = m;
  return 0;
}

static void ux_remove(peer_t *p, smsg_t *m) {
  smsg_t **pp = &p->ux_head, *prev = NULL;
  while (*pp && *pp != m) prev = *pp, pp = &(*pp)->next;
  if (*pp) *pp = m->next;
  if (p->ux_tail == m) p->ux_tail = prev;
}

/* A staged message is complete and a receive had claimed it: hand it over. Caller holds mu. */
static void deliver_staged(sock_t *s, peer_t *p, smsg_t *m, int32_t me) {
  sreq_t *r = m->claimed;
  ux_remove(p, m);
  if (r->bytes != m->bytes) {
    size_mismatch(s, r, m->bytes, me);
  } else {
    if (m->bytes) memcpy(r->buf, m->data, m->bytes);
    finish(r, ZB_OK);
    pthread_cond_broadcast(&s->cv);
  }
  r->claimed = NULL;
  free(m);
}

static void body_done(sock_t *s, peer_t *p, int32_t src, int32_t me) {
  p->in_body = 0, p->in_hdr_got = 0;
  if (p->in_req) {
    sreq_t *r = p->in_req;
    if (r->detached) req_free(r);
    else {
      finish(r, ZB_OK);
      pthread_cond_broadcast(&s->cv);
    }
  } else if (p->in_msg) {
    p->in_msg->got = p->in_msg->bytes;
    if (p->in_msg->claimed) deliver_staged(s, p, p->in_msg, me);
  } else if (p->in_abort) {
    char msg[1024];
    snprintf(msg, sizeof msg, "rank %d failed: %.990s", (int)src, p->in_abort);
    if (fail_all(s, ZB_ERR_REMOTE, msg)) s->from_peer = 1;
    free(p->in_abort);
  }
  p->in_req = NULL, p->in_msg = NULL, p->in_abort = NULL;
}

/* Reads what peer src's socket holds. Caller holds mu; the progress thread only. */
static void read_peer(sock_t *s, int32_t src, int32_t me) {
  peer_t *p = &s->peers[src];
  for (;;) {
    if (p->closed) return;
    ssize_t n;
    if (!p->in_body) {
      n = recv(p->fd, (char *)&p->in_hdr + p->in_hdr_got, sizeof(hdr_t) - p->in_hdr_got, MSG_DONTWAIT);
    } else {
      size_t left = (size_t)p->in_hdr.bytes - p->in_got;
      unsigned char *to = p->in_req ? p->in_req->buf + p->in_got
                          : p->in_msg ? p->in_msg->data + p->in_got
                          : p->in_abort ? (unsigned char *)p->in_abort + p->in_got
                                        : s->scratch;
      if (!p->in_req && !p->in_msg && !p->in_abort && left > sizeof s->scratch) left = sizeof s->scratch;
      n = left ? recv(p->fd, to, left, MSG_DONTWAIT) : 0;
      if (!left) {
        body_done(s, p, src, me);
        continue;
      }
    }
    if (n == 0) {
      peer_close(s, p, "end of stream: its process exited or closed its transport");
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      char why[160];
      snprintf(why, sizeof why, "reading from it failed: %s", strerror(errno));
      peer_close(s, p, why);
      return;
    }
    if (!p->in_body) {
      p->in_hdr_got += (size_t)n;
      if (p->in_hdr_got == sizeof(hdr_t) && route(s, p, me) != 0) {
        char why[160];
        snprintf(why, sizeof why, "it sent a message this rank cannot take (header kind %u, %llu bytes)",
                 (unsigned)p->in_hdr.kind, (unsigned long long)p->in_hdr.bytes);
        peer_close(s, p, why);
        return;
      }
    } else {
      p->in_got += (size_t)n;
      if (p->in_msg) p->in_msg->got = p->in_got;
      if (p->in_got == p->in_hdr.bytes) body_done(s, p, src, me);
    }
  }
}

/* ---- the progress thread --------------------------------------------------------------------- */

static void *progress(void *arg) {
  zb_transport_t *t = arg;
  sock_t *s = S(t);
  pthread_mutex_lock(&s->mu);
  while (!s->stop) {
    int n = 0;
    s->pfd[n++] = (struct pollfd){s->wake[0], POLLIN, 0};
    for (int32_t r = 0; r < t->ranks; r++) {
      peer_t *p = &s->peers[r];
      if (p->fd < 0 || p->closed) continue;
      s->pfd_peer[n] = r;
      s->pfd[n++] = (struct pollfd){p->fd, (short)(POLLIN | (p->sq_head ? POLLOUT : 0)), 0};
    }
    pthread_mutex_unlock(&s->mu);
    int got = poll(s->pfd, (nfds_t)n, -1);
    pthread_mutex_lock(&s->mu);
    if (got < 0) continue; /* EINTR */
    if (s->pfd[0].revents) {
      char drain[64];
      while (read(s->wake[0], drain, sizeof drain) > 0) {
      }
    }
    for (int k = 1; k < n; k++) {
      if (!s->pfd[k].revents) continue;
      peer_t *p = &s->peers[s->pfd_peer[k]];
      if (s->pfd[k].revents & (POLLIN | POLLHUP | POLLERR)) read_peer(s, s->pfd_peer[k], t->rank);
      if (s->pfd[k].revents & (POLLOUT | POLLERR)) flush_peer(s, p);
      if ((s->pfd[k].revents & POLLNVAL)) peer_close(s, p, "its socket is not open");
    }
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ---- the transport operations ------------------------------------------------------------------ */

/* The transport's failure as a status and message. A peer's abort message carries that peer's
 * own text, but the signal holds the failure every rank agrees came first (the binding publishes a
 * stage's exception there before the runner aborts), so once per failure the signal's text is
 * preferred. Caller holds mu; it is dropped while the signal is asked. */
static zb_status_t failed_error(sock_t *s) {
  if (s->from_peer && !s->signal_asked && s->signal.poll) {
    char msg[1024] = "";
    s->signal_asked = 1;
    pthread_mutex_unlock(&s->mu);
    int fired = s->signal.poll(s->signal.user, msg, sizeof msg);
    pthread_mutex_lock(&s->mu);
    if (fired && msg[0]) snprintf(s->fail_msg, sizeof s->fail_msg, "%s", msg);
  }
  return ZB_FAIL(s->fail_status, "%s", s->fail_msg);
}

static zb_status_t sock_start(zb_transport_t *t, zb__request_t *req) {
  sock_t *s = S(t);
  peer_t *p = &s->peers[req->peer];
  if (p->fd < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank %d has no connection to rank %d (channel %d): the socket "
                   "transport was given no socket for it (zb_transport_create_socket or zb_transport_socket_attach)",
                   (int)t->rank, (int)req->peer, (int)req->tag);
  sreq_t *r = calloc(1, sizeof(*r));
  if (!r) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory starting a transfer with rank %d", (int)req->peer);
  r->is_send = req->is_send, r->peer = req->peer, r->tag = req->tag;
  r->buf = req->buf, r->bytes = req->bytes;
  pthread_mutex_lock(&s->mu);
  if (s->failed) {
    zb_status_t st = failed_error(s);
    pthread_mutex_unlock(&s->mu);
    free(r);
    return st;
  }
  if (r->is_send) {
    if (p->closed) {
      zb_status_t st = ZB_FAIL(ZB_ERR_REMOTE, "rank %d cannot send to rank %d on channel %d: its connection "
                               "closed (%s)", (int)t->rank, (int)r->peer, (int)r->tag, p->why);
      pthread_mutex_unlock(&s->mu);
      free(r);
      return st;
    }
    r->hdr = (hdr_t){MAGIC, KIND_DATA, r->tag, 0, (uint64_t)r->bytes};
    int was_empty = p->sq_head == NULL;
    enqueue_send(p, r);
    /* Nothing queued before it: write it on this thread; the progress thread only gets the rest. */
    if (was_empty) flush_peer(s, p);
    if (!r->done && p->sq_head) wake_thread(s);
  } else {
    smsg_t *m = p->ux_head;
    while (m && (m->tag != r->tag || m->claimed)) m = m->next;
    if (m) {
      m->claimed = r, r->claimed = m, r->where = IN_CLAIMED;
      if (m->got == m->bytes && !(p->in_msg == m && p->in_body)) deliver_staged(s, p, m, t->rank);
    } else {
      r->where = IN_POSTED;
      if (p->posted_tail) p->posted_tail->next = r;
      else p->posted_head = r;
      p->posted_tail = r;
    }
  }
  req->handle = r;
  pthread_mutex_unlock(&s->mu);
  return ZB_OK;
}

/* The caller is done with r (wait ended or cancel): take it out of wherever it is. Caller holds
 * mu. Frees r unless the transport must keep writing it. */
static void drop(sock_t *s, sreq_t *r) {
  peer_t *p = &s->peers[r->peer];
  if (r->where == IN_SENDQ && detach_send(s, p, r)) return;
  if (r->where == IN_POSTED) {
    sreq_t **pp = &p->posted_head, *prev = NULL;
    while (*pp && *pp != r) prev = *pp, pp = &(*pp)->next;
    if (*pp) *pp = r->next;
    if (p->posted_tail == r) p->posted_tail = prev;
  } else if (r->where == IN_READING) {
    p->in_req = NULL; /* the rest of its bytes are discarded */
  } else if (r->where == IN_CLAIMED && r->claimed) {
    r->claimed->claimed = NULL; /* the staged message waits for the next receive */
  }
  req_free(r);
}

static zb_status_t pending_error(zb_transport_t *t, const sreq_t *r, double timeout_s) {
  const peer_t *p = &S(t)->peers[r->peer];
  if (p->closed)
    return r->is_send
               ? ZB_FAIL(ZB_ERR_REMOTE, "the send to rank %d on channel %d could not finish: rank %d's connection "
                         "closed (%s)", (int)r->peer, (int)r->tag, (int)r->peer, p->why)
               : ZB_FAIL(ZB_ERR_REMOTE, "nothing more can come from rank %d on channel %d: its connection closed (%s)",
                         (int)r->peer, (int)r->tag, p->why);
  if (r->is_send)
    return ZB_FAIL(ZB_ERR_TIMEOUT, "the send to rank %d on channel %d (%zu bytes) was not taken within %.3g s",
                   (int)r->peer, (int)r->tag, r->bytes, timeout_s);
  return ZB_FAIL(ZB_ERR_TIMEOUT, "nothing from rank %d on channel %d within %.3g s", (int)r->peer, (int)r->tag,
                 timeout_s);
}

static zb_status_t sock_wait(zb_transport_t *t, zb__request_t *req, double timeout_s) {
  sock_t *s = S(t);
  sreq_t *r = req->handle;
  struct timespec deadline;
  deadline_after(&deadline, timeout_s > 0 ? timeout_s : 0);
  double next_signal = zb__now() + SIGNAL_POLL_S;
  zb_status_t st = ZB_OK;
  pthread_mutex_lock(&s->mu);
  for (int last = 0;;) {
    if (r->done) {
      st = r->status == ZB_OK ? ZB_OK : ZB_FAIL(r->status, "%s", r->err);
      break;
    }
    if (s->failed) {
      st = failed_error(s);
      break;
    }
    if (s->peers[r->peer].closed) {
      st = pending_error(t, r, timeout_s);
      break;
    }
    if (timeout_s <= 0) {
      pthread_mutex_unlock(&s->mu);
      return ZB_ERR_TIMEOUT; /* a poll: not done yet, the request stays */
    }
    if (last) {
      st = pending_error(t, r, timeout_s);
      break;
    }
    /* Sleep until the deadline, or until the abort signal is due to be looked at. */
    struct timespec until = deadline;
    if (s->signal.poll) {
      struct timespec sig;
      deadline_after(&sig, next_signal - zb__now() > 0 ? next_signal - zb__now() : 0);
      if (sig.tv_sec < until.tv_sec || (sig.tv_sec == until.tv_sec && sig.tv_nsec < until.tv_nsec)) until = sig;
    }
    int rc = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    if (s->signal.poll && zb__now() >= next_signal) {
      /* The signal calls out of the library (the binding's store): never under our lock. */
      char msg[1024] = "";
      pthread_mutex_unlock(&s->mu);
      int fired = s->signal.poll(s->signal.user, msg, sizeof msg);
      pthread_mutex_lock(&s->mu);
      if (fired) fail_all(s, ZB_ERR_REMOTE, msg[0] ? msg : "another rank failed");
      next_signal = zb__now() + SIGNAL_POLL_S;
    }
    if (rc == ETIMEDOUT) {
      struct timespec now;
      clock_gettime(CLOCK_MONOTONIC, &now);
      if (now.tv_sec > deadline.tv_sec || (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec))
        last = 1; /* look once more: it may have come with the timeout */
    }
  }
  drop(s, r);
  req->handle = NULL;
  pthread_mutex_unlock(&s->mu);
  return st;
}

static void sock_cancel(zb_transport_t *t, zb__request_t *req) {
  sock_t *s = S(t);
  if (!req->handle) return;
  pthread_mutex_lock(&s->mu);
  drop(s, req->handle);
  req->handle = NULL;
  pthread_mutex_unlock(&s->mu);
}

static zb_status_t sock_check(zb_transport_t *t) {
  sock_t *s = S(t);
  pthread_mutex_lock(&s->mu);
  zb_status_t st = s->failed ? failed_error(s) : ZB_OK;
  pthread_mutex_unlock(&s->mu);
  return st;
}

static void sock_abort(zb_transport_t *t, const char *reason) {
  sock_t *s = S(t);
  char msg[1024];
  snprintf(msg, sizeof msg, "rank %d failed: %.990s", (int)t->rank, reason);
  pthread_mutex_lock(&s->mu);
  int first = !s->failed;
  pthread_mutex_unlock(&s->mu);
  /* Published before the peers hear of it over the sockets, so that they find it on the signal
   * (failed_error) rather than only this rank's abort text. */
  if (first && s->signal.publish) s->signal.publish(s->signal.user, reason);
  pthread_mutex_lock(&s->mu);
  fail_all(s, ZB_ERR_REMOTE, msg);
  /* Tell every peer, after whatever part of a message the stream is in the middle of. */
  size_t len = strlen(reason) < ABORT_TEXT_MAX ? strlen(reason) : ABORT_TEXT_MAX;
  for (int32_t k = 0; k < t->ranks; k++) {
    peer_t *p = &s->peers[k];
    if (p->fd < 0 || p->closed || p->abort_queued) continue;
    for (sreq_t *r = p->sq_head ? p->sq_head->next : NULL, *next; r; r = next) {
      next = r->next; /* unstarted sends will not go: their waits fail with the abort */
      r->next = NULL;
      if (r->detached) req_free(r);
      else r->where = IN_NONE;
    }
    if (p->sq_head) p->sq_head->next = NULL, p->sq_tail = p->sq_head;
    if (p->sq_head && p->sq_head->moved == 0) { /* not started either */
      sreq_t *h = p->sq_head;
      p->sq_head = p->sq_tail = NULL;
      if (h->detached) req_free(h);
      else h->where = IN_NONE;
    }
    sreq_t *a = calloc(1, sizeof(*a));
    char *text = malloc(len + 1);
    if (!a || !text) {
      free(a), free(text);
      continue;
    }
    memcpy(text, reason, len);
    a->buf = (unsigned char *)text, a->bytes = len, a->owned = 1, a->detached = 1, a->peer = k, a->is_send = 1;
    a->hdr = (hdr_t){MAGIC, KIND_ABORT, -1, 0, (uint64_t)len};
    enqueue_send(p, a);
    p->abort_queued = 1;
    flush_peer(s, p);
  }
  wake_thread(s);
  pthread_mutex_unlock(&s->mu);
}

static void sock_destroy(zb_transport_t *t) {
  sock_t *s = S(t);
  if (s->thread_started) {
    /* Let queued abort messages leave (bounded): a peer learns why rather than only that we left. */
    struct timespec until;
    deadline_after(&until, LINGER_S);
    pthread_mutex_lock(&s->mu);
    for (;;) {
      int queued = 0;
      for (int32_t k = 0; k < t->ranks; k++) queued |= s->peers[k].abort_queued && s->peers[k].sq_head != NULL;
      if (!queued || pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT) break;
    }
    s->stop = 1;
    wake_thread(s);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
  }
  for (int32_t k = 0; k < t->ranks; k++) {
    peer_t *p = &s->peers[k];
    for (sreq_t *r = p->sq_head, *next; r; r = next) {
      next = r->next;
      if (r->detached) req_free(r);
    }
    if (p->in_req && p->in_req->detached) req_free(p->in_req);
    for (smsg_t *m = p->ux_head, *next; m; m = next) next = m->next, free(m);
    free(p->in_abort);
    if (p->fd >= 0) close(p->fd);
  }
  if (s->wake[0] >= 0) close(s->wake[0]), close(s->wake[1]);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  free(s->peers), free(s->pfd), free(s->pfd_peer);
  free(s);
  free(t);
}

/* Host memory only: the sockets read and write the buffers from the host. */
static const zb__transport_ops_t socket_ops = {
    .name = "socket",
    .isend = sock_start,
    .irecv = sock_start,
    .wait = sock_wait,
    .cancel = sock_cancel,
    .abort = sock_abort,
    .destroy = sock_destroy,
    .check = sock_check,
    .memory = ZB__TRANSPORT_HOST_MEMORY,
};

static void close_fds(const int32_t *fds, int32_t rank, int32_t ranks) {
  if (!fds) return;
  for (int32_t k = 0; k < ranks; k++)
    if (fds[k] >= 0 && k != rank) close(fds[k]);
}

static zb_status_t check_fds(const int32_t *fds, int32_t rank, int32_t ranks) {
  for (int32_t k = 0; fds && k < ranks; k++) {
    int type = 0;
    socklen_t len = sizeof type;
    if (k == rank || fds[k] < 0) continue;
    errno = 0;
    if (getsockopt(fds[k], SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "socket transport: fds[%d] = %d is not a connected stream socket (%s)",
                     (int)k, fds[k], errno ? strerror(errno) : "another socket type");
  }
  return ZB_OK;
}

static void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

zb_status_t zb_transport_socket_attach(zb_transport_t *t, const int32_t *fds) {
  ZB_ARG_NOT_NULL(t);
  ZB_ARG_NOT_NULL(fds);
  if (t->ops != &socket_ops)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_transport_socket_attach: the transport is a %s transport, not a "
                   "socket transport", t->ops->name);
  zb_status_t st = check_fds(fds, t->rank, t->ranks);
  sock_t *s = S(t);
  pthread_mutex_lock(&s->mu);
  for (int32_t k = 0; st == ZB_OK && k < t->ranks; k++)
    if (k != t->rank && fds[k] >= 0 && s->peers[k].fd >= 0)
      st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_transport_socket_attach: rank %d already has a socket for rank %d",
                   (int)t->rank, (int)k);
  for (int32_t k = 0; st == ZB_OK && k < t->ranks; k++)
    if (k != t->rank && fds[k] >= 0) {
      set_nonblocking(fds[k]);
      s->peers[k].fd = fds[k];
    }
  if (st == ZB_OK) wake_thread(s); /* the progress thread polls the new sockets from now on */
  pthread_mutex_unlock(&s->mu);
  if (st != ZB_OK) close_fds(fds, t->rank, t->ranks);
  return st;
}

zb_status_t zb_transport_create_socket(zb_transport_t **out, const zb_socket_transport_config_t *c) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  zb_status_t st = ZB_OK;
  if (c->struct_size != sizeof(zb_socket_transport_config_t) || c->version != ZB_SOCKET_TRANSPORT_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_socket_transport_config_t has struct_size %u and version %u; start from "
                   "ZB_SOCKET_TRANSPORT_CONFIG_INIT (size %zu, version %d)",
                   (unsigned)c->struct_size, (unsigned)c->version, sizeof(zb_socket_transport_config_t),
                   ZB_SOCKET_TRANSPORT_CONFIG_VERSION);
  if (c->ranks < 1 || c->ranks > 65536 || c->rank < 0 || c->rank >= c->ranks) {
    st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "socket transport: rank %d of %d; need 0 <= rank < ranks <= 65536",
                 (int)c->rank, (int)c->ranks);
    goto fail_early;
  }
  if (!c->abort_signal.poll != !c->abort_signal.publish) {
    st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the socket transport's abort_signal needs both poll and publish, or neither");
    goto fail_early;
  }
  st = check_fds(c->fds, c->rank, c->ranks);
  if (st != ZB_OK) goto fail_early;
  zb_transport_t *t = calloc(1, sizeof(*t));
  sock_t *s = calloc(1, sizeof(*s));
  if (s) {
    s->peers = calloc((size_t)c->ranks, sizeof(peer_t));
    s->pfd = calloc((size_t)c->ranks + 1, sizeof(struct pollfd));
    s->pfd_peer = calloc((size_t)c->ranks + 1, sizeof(int32_t));
  }
  if (!t || !s || !s->peers || !s->pfd || !s->pfd_peer) {
    if (s) free(s->peers), free(s->pfd), free(s->pfd_peer);
    free(s), free(t);
    st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a socket transport of %d ranks", (int)c->ranks);
    goto fail_early;
  }
  s->wake[0] = s->wake[1] = -1;
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* a wall-clock jump cannot fire or stall a wait */
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  s->signal = c->abort_signal;
  t->ops = &socket_ops, t->rank = c->rank, t->ranks = c->ranks, t->impl = s;
  for (int32_t k = 0; k < c->ranks; k++) {
    s->peers[k].fd = k == c->rank || !c->fds ? -1 : c->fds[k];
    if (s->peers[k].fd >= 0) set_nonblocking(s->peers[k].fd);
  }
  if (pipe(s->wake) != 0) {
    s->wake[0] = s->wake[1] = -1;
    st = ZB_FAIL(ZB_ERR_IO, "socket transport: pipe() failed: %s", strerror(errno));
    goto fail;
  }
  for (int i = 0; i < 2; i++) set_nonblocking(s->wake[i]);
  int e = pthread_create(&s->thread, NULL, progress, t);
  if (e != 0) {
    st = ZB_FAIL(ZB_ERR_IO, "socket transport: cannot start its progress thread: %s", strerror(e));
    goto fail;
  }
  s->thread_started = 1;
  *out = t;
  return ZB_OK;

fail:
  sock_destroy(t); /* closes the peers' sockets too */
  return st;
fail_early:
  if (c->ranks >= 1 && c->ranks <= 65536) close_fds(c->fds, c->rank, c->ranks);
  return st;
}
