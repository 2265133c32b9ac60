/*
 * gpu_runner.c - the runner on the CUDA backend: several ranks as threads on one GPU, joined by the
 * in-process transport (device-to-device copies), train a stack of Linear layers; the weight and
 * bias gradients after one iteration equal those of a sequential loop on the same device bit for
 * bit, for a loop schedule, ZB-H1 and a V schedule. Plus a 2-rank NCCL run when two GPUs exist.
 *
 * The model's F and B run on the host (the test copies activations through zb_backend_copy); the W
 * GEMMs run through the W store on cuBLASLt, which is what this test is about, with the runner's
 * device buffers, events and channels. cuBLASLt picks the same algorithm for the same shape on the
 * same device, and each stage's W ops run in microbatch order in both loops, so the sums are the
 * same sums in the same order.
 *
 * Exits 77 (skipped) without a CUDA build or a GPU.
 */
/* pthread barriers are POSIX, outside ISO C11 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "runtime/internal.h"

enum { D = 48, ROWS = 40, MAX_S = 8, MAX_M = 8 };

/* The same weights everywhere: W_s[o][i] and b_s[o] from (s, o, i). */
static float weight(int s, int o, int i) { return urand(1, (uint64_t)s, (uint64_t)o, (uint64_t)i) / 4; }
static float bias(int s, int o) { return urand(2, (uint64_t)s, (uint64_t)o, 0); }
static float input(int mb, int r, int c) { return urand(3, (uint64_t)mb, (uint64_t)r, (uint64_t)c); }

typedef struct {
  zb_backend_t *be;
  zb_wstore_t *ws;
  int S, m;
  float *dw[MAX_S], *db[MAX_S];  /* device, fp32 */
  float *y_last[MAX_M];          /* host: the last stage's outputs, for the loss gradient */
  /* Device copies of x and dy that a W-store entry points at, one per (stage, mb), made before the
   * run: a cudaFree during the run would wait for the whole device, NCCL kernels included. */
  void *saved_x[MAX_S][MAX_M], *saved_dy[MAX_S][MAX_M];
  int fail_mb;                   /* forward of this microbatch fails (-1: none), to kill a rank */
} model_t;


static zb_status_t to_host(model_t *md, float *dst, const void *src, size_t n) {
  zb_status_t st = zb_backend_copy(md->be, dst, src, n * sizeof(float));
  return st == ZB_OK ? zb_backend_synchronize(md->be) : st;
}

static zb_status_t to_device(model_t *md, void *dst, const float *src, size_t n) {
  zb_status_t st = zb_backend_copy(md->be, dst, src, n * sizeof(float));
  return st == ZB_OK ? zb_backend_synchronize(md->be) : st;
}

static zb_status_t forward(void *user, int32_t s, int32_t mb, const void *in, void *out) {
  model_t *md = user;
  if (mb == md->fail_mb) return ZB_FAIL(ZB_ERR_INTERNAL, "injected failure in F(stage %d, mb %d)", (int)s, (int)mb);
  static _Thread_local float x[ROWS * D], y[ROWS * D];
  if (s == 0) {
    for (int r = 0; r < ROWS; r++)
      for (int c = 0; c < D; c++) x[r * D + c] = input(mb, r, c);
  } else {
    ZB_CHECK(to_host(md, x, in, ROWS * D));
  }
  for (int r = 0; r < ROWS; r++)
    for (int o = 0; o < D; o++) {
      float acc = bias(s, o);
      for (int i = 0; i < D; i++) acc += x[r * D + i] * weight(s, o, i);
      y[r * D + o] = acc;
    }
  if (out) ZB_CHECK(to_device(md, out, y, ROWS * D));
  else memcpy(md->y_last[mb], y, sizeof y);
  return ZB_OK;
}

/* B needs the stage's input again: recompute it from the saved input (kept as a device copy). */
static _Thread_local float saved_x[MAX_S][MAX_M][ROWS * D];

static zb_status_t forward_saving(void *user, int32_t s, int32_t mb, const void *in, void *out) {
  model_t *md = user;
  if (s == 0) {
    for (int r = 0; r < ROWS; r++)
      for (int c = 0; c < D; c++) saved_x[s][mb][r * D + c] = input(mb, r, c);
  } else {
    ZB_CHECK(to_host(md, saved_x[s][mb], in, ROWS * D));
  }
  return forward(user, s, mb, in, out);
}

static zb_status_t backward(void *user, int32_t s, int32_t mb, const void *gout, void *gin) {
  model_t *md = user;
  static _Thread_local float dy[ROWS * D], dx[ROWS * D];
  if (s == md->S - 1) {
    /* loss = (1/m) sum 0.5 |y|^2, so dy = y / m */
    for (int k = 0; k < ROWS * D; k++) dy[k] = md->y_last[mb][k] / (float)md->m;
  } else {
    ZB_CHECK(to_host(md, dy, gout, ROWS * D));
  }
  if (gin) {
    for (int r = 0; r < ROWS; r++)
      for (int i = 0; i < D; i++) {
        float acc = 0;
        for (int o = 0; o < D; o++) acc += dy[r * D + o] * weight(s, o, i);
        dx[r * D + i] = acc;
      }
    ZB_CHECK(to_device(md, gin, dx, ROWS * D));
  }
  ZB_CHECK(to_device(md, md->saved_x[s][mb], saved_x[s][mb], ROWS * D));
  ZB_CHECK(to_device(md, md->saved_dy[s][mb], dy, ROWS * D));
  zb_wgrad_t e;
  memset(&e, 0, sizeof e);
  e.struct_size = sizeof e;
  e.dtype = ZB_DTYPE_F32;
  e.rows = ROWS, e.in_features = D, e.out_features = D;
  e.x = md->saved_x[s][mb], e.dy = md->saved_dy[s][mb], e.dw = md->dw[s], e.db = md->db[s];
  e.dw_dtype = ZB_DTYPE_F32;
  return zb_wstore_push(md->ws, &e);
}

static void model_init(model_t *md, int S, int m, const int *own, int n_own, int device) {
  memset(md, 0, sizeof *md);
  md->S = S, md->m = m, md->fail_mb = -1;
  zb_cuda_backend_config_t bc = ZB_CUDA_BACKEND_CONFIG_INIT;
  bc.device = device;
  ZB_ASSERT_OK(zb_backend_create_cuda(&md->be, &bc));
  ZB_ASSERT_OK(zb_wstore_create(&md->ws, md->be, NULL, NULL));
  static const float zeros[D * D];
  for (int k = 0; k < n_own; k++) {
    int s = own[k];
    ZB_ASSERT_OK(zb_backend_alloc(md->be, sizeof zeros, (void **)&md->dw[s]));
    ZB_ASSERT_OK(zb_backend_alloc(md->be, D * sizeof(float), (void **)&md->db[s]));
    ZB_ASSERT_OK(to_device(md, md->dw[s], zeros, D * D));
    ZB_ASSERT_OK(to_device(md, md->db[s], zeros, D));
    for (int i = 0; i < m; i++) {
      ZB_ASSERT_OK(zb_backend_alloc(md->be, ROWS * D * sizeof(float), &md->saved_x[s][i]));
      ZB_ASSERT_OK(zb_backend_alloc(md->be, ROWS * D * sizeof(float), &md->saved_dy[s][i]));
    }
  }
  for (int i = 0; i < m; i++) md->y_last[i] = calloc(ROWS * D, sizeof(float));
}

static void model_free(model_t *md) {
  zb_wstore_destroy(md->ws);
  for (int s = 0; s < MAX_S; s++) {
    zb_backend_free(md->be, md->dw[s]), zb_backend_free(md->be, md->db[s]);
    for (int i = 0; i < MAX_M; i++) zb_backend_free(md->be, md->saved_x[s][i]), zb_backend_free(md->be, md->saved_dy[s][i]);
  }
  for (int i = 0; i < md->m; i++) free(md->y_last[i]);
  ZB_ASSERT_OK(zb_backend_destroy(md->be));
}

/* The sequential loop: every microbatch through all stages and back, W right after each B. */
static void run_sequential(int S, int m, float grads[MAX_S][D * D + D]) {
  int own[MAX_S] = {0};
  for (int s = 0; s < S; s++) own[s] = s;
  model_t md;
  model_init(&md, S, m, own, S, 0);
  void *buf[MAX_S + 1];
  for (int s = 0; s <= S; s++) ZB_ASSERT_OK(zb_backend_alloc(md.be, ROWS * D * sizeof(float), &buf[s]));
  for (int i = 0; i < m; i++) {
    for (int s = 0; s < S; s++) ZB_ASSERT_OK(forward_saving(&md, s, i, s ? buf[s] : NULL, s < S - 1 ? buf[s + 1] : NULL));
    for (int s = S - 1; s >= 0; s--) {
      ZB_ASSERT_OK(zb_wstore_begin(md.ws, s, i));
      ZB_ASSERT_OK(backward(&md, s, i, s < S - 1 ? buf[s + 1] : NULL, s ? buf[s] : NULL));
      ZB_ASSERT_OK(zb_wstore_end(md.ws));
      ZB_ASSERT_OK(zb_wstore_pop_run(md.ws, s, NULL));
    }
  }
  ZB_ASSERT_OK(zb_backend_synchronize(md.be));
  for (int s = 0; s < S; s++) {
    ZB_ASSERT_OK(to_host(&md, grads[s], md.dw[s], D * D));
    ZB_ASSERT_OK(to_host(&md, grads[s] + D * D, md.db[s], D));
  }
  for (int s = 0; s <= S; s++) zb_backend_free(md.be, buf[s]);
  model_free(&md);
}

typedef struct {
  const zb_schedule_t *sched;
  zb_transport_t *tr;   /* in-process: made by the test; NULL: the rank makes an NCCL transport */
  const uint8_t *nccl_id;
  int rank, S, m, fail_mb;
  float (*grads)[D * D + D];
  zb_status_t st;
  char err[1024];
  double seconds;
  int64_t late; /* buffers the runner allocated inside the iteration: 0 (its plan covers all) */
  /* In-process: every rank waits here once its runner is gone, then destroys its own transport
   * before its backend (a transport holds its backend: destroying the backend first is refused). */
  pthread_barrier_t *done;
} rank_ctx_t;

static void *rank_main(void *arg) {
  rank_ctx_t *c = arg;
  int own[MAX_S] = {0}, n_own = 0;
  for (int s = 0; s < c->S; s++) {
    int32_t r;
    zb_schedule_stage_rank(c->sched, s, &r);
    if (r == c->rank) own[n_own++] = s;
  }
  model_t md;
  model_init(&md, c->S, c->m, own, n_own, c->nccl_id ? c->rank : 0);
  md.fail_mb = c->fail_mb;
  zb_transport_t *nccl = NULL;
  c->st = ZB_OK;
  if (c->nccl_id) {
    zb_nccl_transport_config_t nc = ZB_NCCL_TRANSPORT_CONFIG_INIT;
    nc.rank = c->rank, nc.ranks = 2, nc.unique_id = c->nccl_id, nc.backend = md.be;
    nc.schedule = c->sched, nc.timeout_s = 5;
    c->st = zb_transport_create_nccl(&nccl, &nc);
  }
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = c->rank, rc.schedule = c->sched, rc.backend = md.be, rc.wstore = md.ws;
  rc.transport = c->nccl_id ? nccl : c->tr;
  rc.boundary_bytes_all = ROWS * D * sizeof(float);
  rc.forward_cb = forward_saving, rc.backward_cb = backward, rc.user = &md;
  rc.timeout_s = 60;
  zb_runner_t *run = NULL;
  double t0 = zb__now();
  if (c->st == ZB_OK) c->st = zb_runner_create(&run, &rc);
  if (c->st == ZB_OK) c->st = zb_runner_run(run);
  c->seconds = zb__now() - t0;
  if (c->st == ZB_OK) zb__runner_late_allocs(run, &c->late);
  if (c->st != ZB_OK) snprintf(c->err, sizeof c->err, "%s", zb_last_error());
  if (c->st == ZB_OK)
    for (int k = 0; k < n_own; k++) {
      to_host(&md, c->grads[own[k]], md.dw[own[k]], D * D);
      to_host(&md, c->grads[own[k]] + D * D, md.db[own[k]], D);
    }
  zb_runner_destroy(run);
  zb_transport_destroy(nccl);
  if (c->done) {
    pthread_barrier_wait(c->done);
    ZB_ASSERT_OK(zb_transport_destroy(c->tr));
    c->tr = NULL;
  }
  model_free(&md);
  return NULL;
}

static zb_status_t dummy_isend(void *u, int32_t peer, int32_t tag, const void *buf, size_t n, void **req) {
  return ZB_ERR_UNSUPPORTED;
}
static zb_status_t dummy_irecv(void *u, int32_t peer, int32_t tag, void *buf, size_t n, void **req) {
  return ZB_ERR_UNSUPPORTED;
}
static zb_status_t dummy_wait(void *u, void *req, double timeout_s) { return ZB_ERR_UNSUPPORTED; }
static void dummy_cancel(void *u, void *req) {}

static void check_schedule(zb_kind_t kind, int p, int m) {
  zb_schedule_spec_t spec = zb_test_spec(kind, p, m, 0);
  zb_schedule_t *sched = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&sched, &spec));
  zb_schedule_info_t info;
  ZB_ASSERT_OK(zb_schedule_get_info(sched, &info));
  int S = info.stages;
  assert_true(S <= MAX_S && m <= MAX_M);
  static float want[MAX_S][D * D + D], got[MAX_S][D * D + D];
  run_sequential(S, m, want);

  zb_inproc_group_t *g = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, p));
  rank_ctx_t ctx[8];
  pthread_t th[8];
  pthread_barrier_t done;
  pthread_barrier_init(&done, NULL, (unsigned)p);
  for (int r = 0; r < p; r++) {
    ctx[r] = (rank_ctx_t){sched, NULL, NULL, r, S, m, -1, got, ZB_OK, "", 0, 0, &done};
    ZB_ASSERT_OK(zb_transport_create_inproc(&ctx[r].tr, g, r));
  }
  for (int r = 0; r < p; r++) pthread_create(&th[r], NULL, rank_main, &ctx[r]);
  for (int r = 0; r < p; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < p; r++) {
    if (ctx[r].st != ZB_OK) fail_msg("%s p=%d m=%d rank %d: %s", zb_kind_name(kind), p, m, r, ctx[r].err);
    if (ctx[r].late) fail_msg("%s p=%d rank %d: %lld buffers allocated inside the iteration", zb_kind_name(kind), p, r,
                              (long long)ctx[r].late);
  }
  pthread_barrier_destroy(&done);
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
  for (int s = 0; s < S; s++)
    for (int k = 0; k < D * D + D; k++)
      if (memcmp(&got[s][k], &want[s][k], sizeof(float)) != 0)
        fail_msg("%s p=%d m=%d: stage %d %s[%d] = %.9g, sequential %.9g", zb_kind_name(kind), p, m, s,
                 k < D * D ? "dW" : "db", k < D * D ? k : k - D * D, got[s][k], want[s][k]);
  zb_schedule_destroy(sched);
}

static void test_runner_on_one_gpu_equals_sequential(void **state) {
  check_schedule(ZB_KIND_1F1B, 3, 6);
  check_schedule(ZB_KIND_ZB_H1, 2, 4);
  check_schedule(ZB_KIND_ZB_V, 2, 4);
}

/* Two GPUs, one rank each, over NCCL: the same bits as the sequential loop on GPU 0 (same GPU model,
 * so cuBLASLt picks the same algorithm); then a rank that fails makes the other fail naming it. */
static void test_nccl_two_gpus(void **state) {
  int32_t devices = 0;
  zb_cuda_device_count(&devices);
  if (devices < 2) {
    printf("test_nccl_two_gpus: skipped (%d GPU; NCCL needs one per rank)\n", (int)devices);
    skip();
  }
  const zb_kind_t kinds[] = {ZB_KIND_ZB_H1, ZB_KIND_ZB_V};
  for (int kk = 0; kk < 2; kk++) {
    zb_schedule_spec_t spec = zb_test_spec(kinds[kk], 2, 4, 0);
    zb_schedule_t *sched = NULL;
    ZB_ASSERT_OK(zb_schedule_create(&sched, &spec));
    zb_schedule_info_t info;
    ZB_ASSERT_OK(zb_schedule_get_info(sched, &info));
    static float want[MAX_S][D * D + D], got[MAX_S][D * D + D];
    run_sequential(info.stages, 4, want);
    for (int fail = 0; fail < 2; fail++) {
      uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES];
      ZB_ASSERT_OK(zb_nccl_unique_id(id));
      rank_ctx_t ctx[2];
      pthread_t th[2];
      for (int r = 0; r < 2; r++) ctx[r] = (rank_ctx_t){sched, NULL, id, r, info.stages, 4, -1, got, ZB_OK, "", 0, 0, NULL};
      if (fail) ctx[1].fail_mb = 1;
      for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, rank_main, &ctx[r]);
      for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
      if (!fail) {
        for (int r = 0; r < 2; r++) {
          if (ctx[r].st != ZB_OK) fail_msg("%s over NCCL, rank %d: %s", zb_kind_name(kinds[kk]), r, ctx[r].err);
          if (ctx[r].late) fail_msg("%s over NCCL, rank %d: %lld late buffers", zb_kind_name(kinds[kk]), r,
                                    (long long)ctx[r].late);
        }
        for (int s = 0; s < info.stages; s++)
          if (memcmp(got[s], want[s], sizeof got[s]) != 0)
            fail_msg("%s over NCCL: stage %d gradients differ from the sequential loop", zb_kind_name(kinds[kk]), s);
      } else {
        assert_int_not_equal(ctx[0].st, ZB_OK);
        ASSERT_CONTAINS(ctx[0].err, "rank 1");
        /* The watchdog's timeout is 5 s; allow for the run and NCCL's abort. */
        assert_true(ctx[0].seconds < 30);
      }
    }
    zb_schedule_destroy(sched);
  }
}

/* A transport carries one backend's buffers; the callback transport (host memory) is refused by a
 * runner on the CUDA backend, with a message saying what to use. */
static void test_transport_backend_rules(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 2, 0);
  zb_schedule_t *sched = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&sched, &spec));
  zb_inproc_group_t *g = NULL;
  zb_transport_t *tr = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 2));
  ZB_ASSERT_OK(zb_transport_create_inproc(&tr, g, 0));
  int own[1] = {0};
  model_t md;
  model_init(&md, 2, 2, own, 1, 0);
  zb_backend_t *host = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&host));
  zb_wstore_t *hws = NULL;
  ZB_ASSERT_OK(zb_wstore_create(&hws, host, NULL, NULL));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = 0, rc.schedule = sched, rc.backend = md.be, rc.transport = tr, rc.wstore = md.ws;
  rc.boundary_bytes_all = 64, rc.forward_cb = forward, rc.backward_cb = backward, rc.user = &md;
  zb_runner_t *run = NULL;
  ZB_ASSERT_OK(zb_runner_create(&run, &rc));
  /* The transport now carries this CUDA backend's buffers: a runner on another backend is refused. */
  rc.backend = host, rc.wstore = hws;
  zb_runner_t *other = NULL;
  ASSERT_STATUS(zb_runner_create(&other, &rc), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "another backend");
  zb_runner_destroy(run);

  zb_transport_callbacks_t cbs;
  memset(&cbs, 0, sizeof cbs);
  cbs.struct_size = sizeof cbs;
  cbs.isend_cb = dummy_isend, cbs.irecv_cb = dummy_irecv, cbs.wait_cb = dummy_wait, cbs.cancel_cb = dummy_cancel;
  zb_transport_t *cb = NULL;
  ZB_ASSERT_OK(zb_transport_create_callback(&cb, &cbs, 0, 2));
  rc.backend = md.be, rc.wstore = md.ws, rc.transport = cb;
  ASSERT_STATUS(zb_runner_create(&other, &rc), ZB_ERR_UNSUPPORTED);
  ASSERT_CONTAINS(zb_last_error(), "NCCL");
  zb_transport_destroy(cb);
  zb_wstore_destroy(hws);
  zb_backend_destroy(host);
  ZB_ASSERT_OK(zb_transport_destroy(tr)); /* before the backend it carries (it holds a reference) */
  model_free(&md);
  zb_inproc_group_destroy(g);
  zb_schedule_destroy(sched);
}

int main(void) {
  int32_t devices = 0;
  zb_cuda_device_count(&devices);
  if (!zb_cuda_built() || devices < 1) {
    printf("gpu_runner: skipped (%s)\n", zb_cuda_built() ? "no CUDA device" : "built without CUDA");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_runner_on_one_gpu_equals_sequential),
      cmocka_unit_test(test_transport_backend_rules),
      cmocka_unit_test(test_nccl_two_gpus),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
