/*
 * backend.c - the CUDA backend: device memory, the compute stream (the caller's or its own), timing
 * events, and the entry points that hand GEMMs to gemm.c and the optimizer kernels to kernels.c.
 *
 * What it is: the production backend of the runner (DESIGN.md section 4). Every operation is
 * enqueued on the compute stream and returns; only sync blocks the host. Communication streams are
 * the NCCL transport's, which orders them against this stream with events on the device.
 * Every runtime call goes through the table libs.c fills from the cudart the process has (torch's);
 * zb_backend_create_cuda loads it, so the other functions here find it loaded.
 * What it is not: a memory pool. alloc is cudaMalloc; the runner keeps its own free lists so a warm
 * iteration allocates nothing, and torch tensors come from torch's caching allocator anyway.
 */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

struct zb__event {
  cudaEvent_t ev;
};

static zb__cuda_t *cu_of(zb_backend_t *be) { return (zb__cuda_t *)be->impl; }

zb_status_t zb__cuda_enter(const zb__cuda_t *cu) {
  int cur = -1;
  ZB_CUDA_CHECK(zb__rt()->GetDevice(&cur));
  if (cur != cu->device) ZB_CUDA_CHECK(zb__rt()->SetDevice(cu->device));
  return ZB_OK;
}

static zb_status_t cuda_alloc(zb_backend_t *be, size_t bytes, void **out) {
  zb__cuda_t *cu = cu_of(be);
  ZB_CHECK(zb__cuda_enter(cu));
  cudaError_t e = zb__rt()->Malloc(out, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    *out = NULL;
    zb__rt()->GetLastError(); /* an allocation failure is not sticky; do not leave it for the next call */
    return ZB_FAIL(ZB_ERR_CUDA, "cudaMalloc of %zu bytes on device %d failed: %s", bytes, cu->device,
                   zb__cuda_error_text(e));
  }
  return ZB_OK;
}

static void cuda_release(zb_backend_t *be, void *ptr) {
  if (!ptr) return;
  zb__cuda_enter(cu_of(be));
  zb__rt()->Free(ptr); /* synchronises the device: freed memory is never reused under running work */
}

static zb_status_t cuda_wgrad(zb_backend_t *be, const zb_wgrad_t *e) {
  zb__cuda_t *cu = cu_of(be);
  ZB_CHECK(zb__cuda_enter(cu));
  return zb__wgemm_run(cu, e);
}

static zb_status_t cuda_timing_event_create(zb_backend_t *be, zb__event_t **out) {
  zb__cuda_t *cu = cu_of(be);
  ZB_CHECK(zb__cuda_enter(cu));
  zb__event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for a CUDA event");
  cudaError_t e = zb__rt()->EventCreate(&ev->ev);
  if (e != cudaSuccess) {
    free(ev);
    return ZB_CUDA_FAIL(e, "cudaEventCreate");
  }
  *out = ev;
  return ZB_OK;
}

static zb_status_t cuda_elapsed(zb_backend_t *be, zb__event_t *from, zb__event_t *to, double *seconds) {
  float ms = 0;
  ZB_CUDA_CHECK(zb__rt()->EventElapsedTime(&ms, from->ev, to->ev));
  *seconds = 1e-3 * (double)ms;
  return ZB_OK;
}

static void cuda_event_destroy(zb_backend_t *be, zb__event_t *ev) {
  if (!ev) return;
  zb__rt()->EventDestroy(ev->ev);
  free(ev);
}

static zb_status_t cuda_event_record(zb_backend_t *be, zb__event_t *ev) {
  ZB_CUDA_CHECK(zb__rt()->EventRecord(ev->ev, cu_of(be)->compute));
  return ZB_OK;
}

static zb_status_t cuda_sync(zb_backend_t *be) {
  zb__cuda_t *cu = cu_of(be);
  ZB_CHECK(zb__cuda_enter(cu));
  ZB_CUDA_CHECK(zb__rt()->StreamSynchronize(cu->compute));
  return ZB_OK;
}

static void cuda_destroy(zb_backend_t *be) {
  zb__cuda_t *cu = cu_of(be);
  if (cu) {
    if (zb__cuda_enter(cu) == ZB_OK) {
      /* Work may still be queued on a borrowed stream that uses our workspace. */
      if (cu->compute) zb__rt()->StreamSynchronize(cu->compute);
      zb__wgemm_destroy(cu);
      zb__cuda_unload(cu);
      zb__rt()->Free(cu->workspace);
      zb__rt()->Free(cu->norm_scratch);
      if (cu->order) zb__rt()->EventDestroy(cu->order);
      if (cu->own_stream) zb__rt()->StreamDestroy(cu->own_stream);
    }
    free(cu);
  }
  free(be);
}

/* A new compute stream starts after everything the old one was given: the runner's events and the
 * GEMM workspace assume one stream order. */
static zb_status_t cuda_set_stream(zb_backend_t *be, void *stream) {
  zb__cuda_t *cu = cu_of(be);
  cudaStream_t next = stream ? (cudaStream_t)stream : cu->own_stream;
  if (next == cu->compute) return ZB_OK;
  ZB_CHECK(zb__cuda_enter(cu));
  ZB_CUDA_CHECK(zb__rt()->EventRecord(cu->order, cu->compute));
  ZB_CUDA_CHECK(zb__rt()->StreamWaitEvent(next, cu->order, 0));
  cu->compute = next;
  return ZB_OK;
}

static zb_status_t cuda_copy(zb_backend_t *be, void *dst, const void *src, size_t bytes) {
  zb__cuda_t *cu = cu_of(be);
  ZB_CHECK(zb__cuda_enter(cu));
  ZB_CUDA_CHECK(zb__rt()->MemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cu->compute));
  return ZB_OK;
}

static zb_status_t cuda_sq_norm(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t,
                                double *sq, int32_t *nonfinite) {
  ZB_CHECK(zb__cuda_enter(cu_of(be)));
  return zb__cuda_sq_norm(cu_of(be), dtype, t, sq, nonfinite);
}
static zb_status_t cuda_unscale(zb_backend_t *be, zb_dtype_t dtype, const zb_tensor_list_t *t,
                                float factor, int32_t *nonfinite) {
  ZB_CHECK(zb__cuda_enter(cu_of(be)));
  return zb__cuda_unscale(cu_of(be), dtype, t, factor, nonfinite);
}
static zb_status_t cuda_scale_update(zb_backend_t *be, float *scale, int32_t *tracker,
                                     const int32_t *nonfinite, double growth, double backoff,
                                     int32_t interval) {
  ZB_CHECK(zb__cuda_enter(cu_of(be)));
  return zb__cuda_scale_update(cu_of(be), scale, tracker, nonfinite, growth, backoff, interval);
}
static zb_status_t cuda_optim_step(zb_backend_t *be, const zb_optim_step_t *s) {
  ZB_CHECK(zb__cuda_enter(cu_of(be)));
  return zb__cuda_optim_step(cu_of(be), s);
}
static zb_status_t cuda_optim_undo(zb_backend_t *be, const zb_optim_step_t *s) {
  ZB_CHECK(zb__cuda_enter(cu_of(be)));
  return zb__cuda_optim_undo(cu_of(be), s);
}

static const zb__backend_ops_t cuda_ops = {
    .name = "cuda",
    .device_memory = 1,
    .alloc = cuda_alloc,
    .release = cuda_release,
    .wgrad = cuda_wgrad,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .sync = cuda_sync,
    .destroy = cuda_destroy,
    .set_stream = cuda_set_stream,
    .copy = cuda_copy,
    .sq_norm = cuda_sq_norm,
    .unscale = cuda_unscale,
    .scale_update = cuda_scale_update,
    .optim_step = cuda_optim_step,
    .optim_undo = cuda_optim_undo,
    .timing_event_create = cuda_timing_event_create,
    .elapsed = cuda_elapsed,
};

zb__cuda_t *zb__cuda_of(zb_backend_t *be) { return be && be->ops == &cuda_ops ? cu_of(be) : NULL; }

int zb_cuda_built(void) { return 1; }

zb_status_t zb_cuda_device_count(int32_t *out) {
  ZB_ARG_NOT_NULL(out);
  int n = 0;
  const zb__cudart_t *rt;
  /* No runtime, no driver or no device is an answer (0), not an error; clear CUDA's sticky "last
   * error". */
  if (zb__cudart(&rt) != ZB_OK) {
    zb__clear_error();
  } else if (rt->GetDeviceCount(&n) != cudaSuccess) {
    zb__rt()->GetLastError();
    n = 0;
  }
  *out = n;
  return ZB_OK;
}

zb_status_t zb_backend_create_cuda(zb_backend_t **out, const zb_cuda_backend_config_t *c) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(c);
  if (c->struct_size < sizeof(zb_cuda_backend_config_t) || c->version != ZB_CUDA_BACKEND_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_cuda_backend_config_t has struct_size %u, version %u; initialise it with "
                   "ZB_CUDA_BACKEND_CONFIG_INIT (size %zu, version %d)",
                   (unsigned)c->struct_size, (unsigned)c->version, sizeof(zb_cuda_backend_config_t),
                   ZB_CUDA_BACKEND_CONFIG_VERSION);
  int n = 0;
  const zb__cudart_t *rt;
  zb_status_t lst = zb__cudart(&rt);
  if (lst != ZB_OK) {
    char why[512];
    snprintf(why, sizeof why, "%s", zb__error_body());
    return ZB_FAIL(lst, "no CUDA device to create the CUDA backend on: %s", why);
  }
  cudaError_t e = rt->GetDeviceCount(&n);
  if (e != cudaSuccess) {
    zb__rt()->GetLastError();
    return ZB_FAIL(ZB_ERR_CUDA, "no CUDA device to create the CUDA backend on: %s", zb__cuda_error_text(e));
  }
  if (c->device < 0 || c->device >= n)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist; this process sees %d (0..%d)",
                   (int)c->device, n, n - 1);

  zb_backend_t *be = calloc(1, sizeof *be);
  zb__cuda_t *cu = calloc(1, sizeof *cu);
  if (!be || !cu) {
    free(be), free(cu);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the CUDA backend");
  }
  be->ops = &cuda_ops;
  be->impl = cu;
  cu->device = c->device;
  cu->workspace_bytes = c->workspace_bytes ? c->workspace_bytes : (size_t)32 << 20;
  zb_status_t st = zb__cuda_enter(cu);
  if (st != ZB_OK) goto fail;
  ZB_CUDA_CHECK_GOTO(zb__rt()->StreamCreateWithFlags(&cu->own_stream, cudaStreamNonBlocking), st, fail);
  ZB_CUDA_CHECK_GOTO(zb__rt()->EventCreateWithFlags(&cu->order, cudaEventDisableTiming), st, fail);
  ZB_CUDA_CHECK_GOTO(zb__rt()->Malloc(&cu->workspace, cu->workspace_bytes), st, fail);
  cu->compute = c->stream ? (cudaStream_t)c->stream : cu->own_stream;
  *out = be;
  return ZB_OK;

fail:
  zb__rt()->GetLastError();
  cuda_destroy(be);
  return st;
}
