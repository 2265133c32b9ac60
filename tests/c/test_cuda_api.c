/*
 * test_cuda_api.c - the CUDA parts of the C API as a machine without a GPU sees them, and the
 * backend-generic calls on the host backend: every CUDA entry point exists in every build and fails
 * with a status and a message that say why (not built with CUDA, no device, wrong backend), and the
 * rules that tie transports to backends hold on the host too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

static int have_gpu(void) {
  int32_t n = -1;
  ZB_ASSERT_OK(zb_cuda_device_count(&n));
  assert_true(n >= 0);
  return zb_cuda_built() && n > 0;
}

/* Without a GPU (or without CUDA in the build) creating a CUDA backend fails, saying which. */
static void test_cuda_backend_without_gpu(void **state) {
  if (have_gpu()) skip();
  zb_backend_t *be = (zb_backend_t *)&be; /* must be reset to NULL */
  zb_cuda_backend_config_t c = ZB_CUDA_BACKEND_CONFIG_INIT;
  zb_status_t st = zb_backend_create_cuda(&be, &c);
  assert_null(be);
  if (zb_cuda_built()) {
    ASSERT_STATUS(st, ZB_ERR_CUDA);
    ASSERT_CONTAINS(zb_last_error(), "no CUDA device");
  } else {
    ASSERT_STATUS(st, ZB_ERR_UNSUPPORTED);
    ASSERT_CONTAINS(zb_last_error(), "built without CUDA");
  }
  /* A config that was not initialised is named as such before anything else is tried. */
  c.version = 99;
  st = zb_backend_create_cuda(&be, &c);
  if (zb_cuda_built()) {
    ASSERT_STATUS(st, ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "ZB_CUDA_BACKEND_CONFIG_INIT");
  }
}

/* The NCCL transport wants exactly one of unique_id and comm, and a CUDA backend. */
static void test_nccl_transport_arguments(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 4, 0);
  zb_schedule_t *sched = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&sched, &spec));
  zb_backend_t *host = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&host));
  uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES] = {0};
  zb_nccl_transport_config_t c = ZB_NCCL_TRANSPORT_CONFIG_INIT;
  c.rank = 0, c.ranks = 2, c.schedule = sched, c.backend = host, c.unique_id = id;
  zb_transport_t *t = NULL;
  zb_status_t st = zb_transport_create_nccl(&t, &c);
  assert_null(t);
  if (!zb_cuda_built()) {
    ASSERT_STATUS(st, ZB_ERR_UNSUPPORTED);
    ASSERT_CONTAINS(zb_last_error(), "built without CUDA");
  } else {
    ASSERT_STATUS(st, ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "CUDA backend");
    c.comm = (void *)&c;
    ASSERT_STATUS(zb_transport_create_nccl(&t, &c), ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "exactly one of unique_id");
    c.comm = NULL, c.rank = 2;
    ASSERT_STATUS(zb_transport_create_nccl(&t, &c), ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "rank 2 of 2");
  }
  ZB_ASSERT_OK(zb_backend_destroy(host));
  zb_schedule_destroy(sched);
}

/* The NCCL group transport wants a CUDA backend (and says it is missing from builds without CUDA). */
static void test_nccl_group_transport_arguments(void **state) {
  (void)state;
  zb_backend_t *host = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&host));
  uint8_t id[ZB_NCCL_UNIQUE_ID_BYTES] = {0};
  zb_nccl_group_config_t c = ZB_NCCL_GROUP_CONFIG_INIT;
  c.rank = 0, c.ranks = 2, c.backend = host, c.unique_id = id;
  zb_transport_t *t = NULL;
  zb_status_t st = zb_transport_create_nccl_group(&t, &c);
  assert_null(t);
  if (!zb_cuda_built()) {
    ASSERT_STATUS(st, ZB_ERR_UNSUPPORTED);
    ASSERT_CONTAINS(zb_last_error(), "built without CUDA");
  } else {
    ASSERT_STATUS(st, ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "needs the rank's CUDA backend");
    c.unique_id = NULL;
    ASSERT_STATUS(zb_transport_create_nccl_group(&t, &c), ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "needs unique_id");
  }
  ZB_ASSERT_OK(zb_backend_destroy(host));
}

/* The backend-generic calls on the host: memory, copies, no streams. */
static void test_host_backend_generic_calls(void **state) {
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  void *a = NULL, *b = NULL;
  ZB_ASSERT_OK(zb_backend_alloc(be, 16, &a));
  ZB_ASSERT_OK(zb_backend_alloc(be, 16, &b));
  memcpy(a, "fifteen chars!!", 16);
  ZB_ASSERT_OK(zb_backend_copy(be, b, a, 16));
  ZB_ASSERT_OK(zb_backend_synchronize(be));
  assert_memory_equal(a, b, 16);
  ZB_ASSERT_OK(zb_backend_set_stream(be, NULL));
  ASSERT_STATUS(zb_backend_set_stream(be, (void *)be), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "only NULL");
  ASSERT_STATUS(zb_backend_copy(be, NULL, a, 4), ZB_ERR_INVALID_ARGUMENT);
  ZB_ASSERT_OK(zb_backend_free(be, a));
  ZB_ASSERT_OK(zb_backend_free(be, b));
  ZB_ASSERT_OK(zb_backend_free(be, NULL));
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static zb_status_t no_forward(void *u, int32_t s, int32_t mb, const void *in, void *out) { return ZB_OK; }
static zb_status_t no_backward(void *u, int32_t s, int32_t mb, const void *g, void *gi) { return ZB_OK; }

/* A transport moves one backend's buffers: a second runner on another backend is refused, naming
 * the rule, while a second runner on the same backend is fine. */
static void test_transport_keeps_one_backend(void **state) {
  zb_schedule_spec_t spec = zb_test_spec(ZB_KIND_1F1B, 2, 2, 0);
  zb_schedule_t *sched = NULL;
  ZB_ASSERT_OK(zb_schedule_create(&sched, &spec));
  zb_backend_t *b1 = NULL, *b2 = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&b1));
  ZB_ASSERT_OK(zb_backend_create_host(&b2));
  zb_wstore_t *w1 = NULL, *w2 = NULL;
  ZB_ASSERT_OK(zb_wstore_create(&w1, b1, NULL, NULL));
  ZB_ASSERT_OK(zb_wstore_create(&w2, b2, NULL, NULL));
  zb_inproc_group_t *g = NULL;
  zb_transport_t *t = NULL;
  ZB_ASSERT_OK(zb_inproc_group_create(&g, 2));
  ZB_ASSERT_OK(zb_transport_create_inproc(&t, g, 0));
  zb_runner_config_t rc = ZB_RUNNER_CONFIG_INIT;
  rc.rank = 0, rc.schedule = sched, rc.backend = b1, rc.transport = t, rc.wstore = w1;
  rc.boundary_bytes_all = 8, rc.forward_cb = no_forward, rc.backward_cb = no_backward;
  zb_runner_t *r1 = NULL, *r2 = NULL, *r3 = NULL;
  ZB_ASSERT_OK(zb_runner_create(&r1, &rc));
  ZB_ASSERT_OK(zb_runner_create(&r2, &rc));
  rc.backend = b2, rc.wstore = w2;
  ASSERT_STATUS(zb_runner_create(&r3, &rc), ZB_ERR_INVALID_ARGUMENT);
  ASSERT_CONTAINS(zb_last_error(), "another backend");
  assert_null(r3);
  zb_runner_destroy(r1);
  zb_runner_destroy(r2);
  zb_transport_destroy(t);
  ZB_ASSERT_OK(zb_inproc_group_destroy(g));
  zb_wstore_destroy(w1);
  zb_wstore_destroy(w2);
  ZB_ASSERT_OK(zb_backend_destroy(b1));
  ZB_ASSERT_OK(zb_backend_destroy(b2));
  zb_schedule_destroy(sched);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_backend_without_gpu),
      cmocka_unit_test(test_nccl_transport_arguments),
      cmocka_unit_test(test_nccl_group_transport_arguments),
      cmocka_unit_test(test_host_backend_generic_calls),
      cmocka_unit_test(test_transport_keeps_one_backend),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
