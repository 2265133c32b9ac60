/*
 * fake.c - the fake device's runtime (fake_cuda.h says what is kept of CUDA): devices, streams as
 * threads, events, registered device memory with its faults. driver.c has the driver's calls.
 *
 * Streams are never freed: a destroyed stream's thread drains its work and ends, and the record
 * stays, so an event recorded on it can still be waited on, as CUDA allows. It is a test fixture;
 * the few hundred bytes per stream go with the process.
 */
#define _GNU_SOURCE /* rand_r, aligned_alloc under -std=c11 */
#include "fake_cuda.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { STREAM_MAGIC = 0x57ea3u, EVENT_MAGIC = 0xe7e27u, MAX_DEVICES = 8 };

typedef struct work {
  struct work *next;
  fake_work_fn fn;
  void *arg;
} work_t;

struct fake_stream {
  unsigned magic;
  int device, blocking, legacy, stop;
  long issued, completed;
  work_t *head, *tail;
  pthread_t thread;
  struct fake_stream *next_all;
};

typedef struct {
  unsigned magic;
  int timing, dead, pending, device;
  fake_stream_t *stream; /* of the latest record; NULL before the first */
  long seq;              /* that stream's work count the record completes at */
  long record_id;
  double done_at; /* seconds, when the latest record ran */
} fake_event_t;

typedef struct alloc {
  struct alloc *next;
  char *base;
  size_t bytes;
  int device;
  int freed; /* cudaFreeAsync was called: work issued after it must not touch it */
} alloc_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static fake_stream_t *streams;
static fake_stream_t *legacy[MAX_DEVICES];
static alloc_t *allocs;
static int fault; /* sticky */
static char fault_text[512];
static __thread int cur_device;
static __thread int ctx_current;
static __thread cudaError_t last_error;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int device_count(void) {
  const char *s = getenv("FAKE_CUDA_DEVICES");
  int n = s ? atoi(s) : 1;
  return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static long delay;
static pthread_once_t delay_once = PTHREAD_ONCE_INIT;
static void delay_read(void) {
  const char *s = getenv("FAKE_CUDA_DELAY_US");
  delay = s ? atol(s) : 50;
  if (delay < 0) delay = 0;
}
static long delay_us(void) {
  pthread_once(&delay_once, delay_read);
  return delay;
}

/* ---- faults and errors --------------------------------------------------------------------------- */

void fake_fault(const char *fmt, ...) {
  va_list ap;
  pthread_mutex_lock(&mu);
  if (!fault) {
    va_start(ap, fmt);
    vsnprintf(fault_text, sizeof fault_text, fmt, ap);
    va_end(ap);
    fault = 1;
    fprintf(stderr, "fake CUDA: device fault: %s\n", fault_text);
  }
  pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&mu);
}

int fake_faulted(void) {
  pthread_mutex_lock(&mu);
  int f = fault;
  pthread_mutex_unlock(&mu);
  return f;
}

/* Every runtime call returns the sticky fault once there is one, as on a GPU after an illegal
 * address. */
static cudaError_t ret(cudaError_t e) {
  if (fake_faulted()) e = cudaErrorIllegalAddress;
  if (e != cudaSuccess) last_error = e;
  return e;
}

/* ---- memory ---------------------------------------------------------------------------------------- */

/* The allocation holding p (mu held), or NULL. */
static alloc_t *alloc_holding(const void *p) {
  const char *c = p;
  for (alloc_t *a = allocs; a; a = a->next)
    if (c >= a->base && c < a->base + a->bytes) return a;
  return NULL;
}

enum { HOST = 0, DEVICE = 1, PAST_END = -1, FREED = -2 };

/* What [p, p + bytes) is: DEVICE memory (*device set), HOST memory, or a bad use of device memory:
 * PAST_END of the allocation it starts in, or in one FREED by a cudaFreeAsync (mu not held). */
static int classify_on(const void *p, size_t bytes, int *device) {
  pthread_mutex_lock(&mu);
  alloc_t *a = alloc_holding(p);
  int r = !a                                                       ? HOST
          : a->freed                                               ? FREED
          : (size_t)((const char *)p - a->base) + bytes <= a->bytes ? DEVICE
                                                                   : PAST_END;
  if (a && device) *device = a->device;
  pthread_mutex_unlock(&mu);
  return r;
}

static int classify(const void *p, size_t bytes) { return classify_on(p, bytes, NULL); }

int fake_check_device_range_on(const void *p, size_t bytes, int device, const char *what) {
  if (bytes == 0) return 0;
  int on = -1;
  int r = classify_on(p, bytes, &on);
  if (r == DEVICE && (device < 0 || on == device)) return 0;
  if (r == DEVICE)
    fake_fault("%s: %zu bytes at %p are memory of device %d, used on device %d", what, bytes, p, on, device);
  else
    fake_fault("%s: %zu bytes at %p %s", what, bytes, p,
               r == HOST    ? "are not device memory (no cudaMalloc allocation holds them)"
               : r == FREED ? "are in an allocation already handed to cudaFreeAsync"
                            : "run past the end of the cudaMalloc allocation they start in");
  return -1;
}

int fake_check_device_range(const void *p, size_t bytes, const char *what) {
  return fake_check_device_range_on(p, bytes, -1, what);
}
/* ---- streams ----------------------------------------------------------------------------------------- */

static void nap(long us) {
  if (us <= 0) return;
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

static void *stream_main(void *p) {
  fake_stream_t *s = p;
  unsigned seed = (unsigned)(uintptr_t)s;
  pthread_mutex_lock(&mu);
  for (;;) {
    while (!s->head && !s->stop) pthread_cond_wait(&changed, &mu);
    if (!s->head) break;
    work_t *w = s->head;
    s->head = w->next;
    if (!s->head) s->tail = NULL;
    const int skip = fault;
    pthread_mutex_unlock(&mu);
    if (delay_us()) nap((long)(rand_r(&seed) % (unsigned)(delay_us() + 1)));
    if (!skip) w->fn(w->arg);
    free(w->arg);
    free(w);
    pthread_mutex_lock(&mu);
    s->completed++;
    pthread_cond_broadcast(&changed);
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

static fake_stream_t *stream_new(int device, int blocking, int is_legacy) {
  fake_stream_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->magic = STREAM_MAGIC, s->device = device, s->blocking = blocking, s->legacy = is_legacy;
  if (pthread_create(&s->thread, NULL, stream_main, s) != 0) {
    free(s);
    return NULL;
  }
  pthread_detach(s->thread); /* nobody joins it: a destroyed stream's thread ends on its own */
  pthread_mutex_lock(&mu);
  s->next_all = streams;
  streams = s;
  pthread_mutex_unlock(&mu);
  return s;
}

fake_stream_t *fake_stream_of(void *handle) {
  if (handle == NULL || handle == cudaStreamLegacy) {
    pthread_mutex_lock(&mu);
    fake_stream_t *s = legacy[cur_device];
    pthread_mutex_unlock(&mu);
    if (!s) {
      s = stream_new(cur_device, 1, 1);
      pthread_mutex_lock(&mu);
      if (legacy[cur_device]) { /* another thread made it first: this one idles */
        s->stop = 1;
        pthread_cond_broadcast(&changed);
        s = legacy[cur_device];
      } else {
        legacy[cur_device] = s;
      }
      pthread_mutex_unlock(&mu);
    }
    return s;
  }
  pthread_mutex_lock(&mu);
  fake_stream_t *s = NULL;
  for (fake_stream_t *t = streams; t; t = t->next_all)
    if (t == handle && t->magic == STREAM_MAGIC && !t->stop) s = t;
  pthread_mutex_unlock(&mu);
  return s;
}

typedef struct {
  fake_stream_t *stream;
  long seq;
} wait_arg_t;

static void wait_fn(void *p) {
  wait_arg_t *w = p;
  pthread_mutex_lock(&mu);
  while (w->stream->completed < w->seq && !fault) pthread_cond_wait(&changed, &mu);
  pthread_mutex_unlock(&mu);
}

/* Appends w to s (mu held). */
static void push(fake_stream_t *s, work_t *w) {
  w->next = NULL;
  if (s->tail) s->tail->next = w;
  else s->head = w;
  s->tail = w;
  s->issued++;
}

/* A wait on `on` up to its work issued so far, pushed onto s (mu held). */
static int push_wait(fake_stream_t *s, fake_stream_t *on) {
  if (on == s || on->completed >= on->issued) return 0;
  work_t *w = calloc(1, sizeof *w);
  wait_arg_t *a = calloc(1, sizeof *a);
  if (!w || !a) {
    free(w), free(a);
    return -1;
  }
  a->stream = on, a->seq = on->issued;
  w->fn = wait_fn, w->arg = a;
  push(s, w);
  return 0;
}

/* fake_enqueue, and the work count of s at which this work is done (*seq, when seq is not NULL). */
static int enqueue(fake_stream_t *s, fake_work_fn fn, void *arg, long *seq) {
  work_t *w = calloc(1, sizeof *w);
  pthread_mutex_lock(&mu);
  if (!w || fault || s->stop) { /* stop: destroyed, or a legacy stream that lost the race to exist */
    pthread_mutex_unlock(&mu);
    free(w), free(arg);
    return -1;
  }
  /* The legacy stream: its work waits for the device's blocking streams, and theirs for it. */
  if (s->legacy) {
    for (fake_stream_t *t = streams; t; t = t->next_all)
      if (t->device == s->device && t->blocking && !t->legacy) push_wait(s, t);
  } else if (s->blocking && legacy[s->device]) {
    push_wait(s, legacy[s->device]);
  }
  w->fn = fn, w->arg = arg;
  push(s, w);
  if (seq) *seq = s->issued;
  pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&mu);
  return 0;
}

int fake_enqueue(fake_stream_t *s, fake_work_fn fn, void *arg) { return enqueue(s, fn, arg, NULL); }

/* Waits until s has done the work issued before the call. Also after a fault: the work queued
 * then is skipped, but what a stream is running finishes first (memory it uses stays until then). */
static void drain(fake_stream_t *s) {
  pthread_mutex_lock(&mu);
  const long upto = s->issued;
  while (s->completed < upto) pthread_cond_wait(&changed, &mu);
  pthread_mutex_unlock(&mu);
}

/* Waits until every stream of the device has done the work issued before the call (not for work
 * issued later, which may wait on something this thread does next). */
static void drain_device(int device) {
  pthread_mutex_lock(&mu);
  long n = 0;
  for (fake_stream_t *t = streams; t; t = t->next_all) n++;
  fake_stream_t **which = calloc((size_t)n + 1, sizeof *which);
  long *upto = calloc((size_t)n + 1, sizeof *upto);
  n = 0;
  for (fake_stream_t *t = streams; t && which && upto; t = t->next_all)
    if (t->device == device) which[n] = t, upto[n++] = t->issued;
  for (long k = 0; k < n; k++)
    while (which[k]->completed < upto[k]) pthread_cond_wait(&changed, &mu);
  pthread_mutex_unlock(&mu);
  free(which), free(upto);
}

/* ---- the runtime: devices and errors --------------------------------------------------------------- */

cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return ret(cudaErrorInvalidValue);
  *count = device_count();
  return ret(*count ? cudaSuccess : cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int *device) {
  if (!device) return ret(cudaErrorInvalidValue);
  *device = cur_device;
  return ret(cudaSuccess);
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return ret(cudaErrorInvalidDevice);
  cur_device = device;
  ctx_current = 1;
  return ret(cudaSuccess);
}

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
  }
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered (fake CUDA)";
    default: return "unknown error";
  }
}

cudaError_t cudaGetLastError(void) {
  if (fake_faulted()) return cudaErrorIllegalAddress;
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

/* ---- events ----------------------------------------------------------------------------------------- */

static fake_event_t *event_of(cudaEvent_t e) {
  fake_event_t *ev = (fake_event_t *)e;
  return ev && ev->magic == EVENT_MAGIC && !ev->dead ? ev : NULL;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned int flags) {
  if (!out || (flags & ~(unsigned)(cudaEventDisableTiming | cudaEventBlockingSync | cudaEventInterprocess)))
    return ret(cudaErrorInvalidValue);
  fake_event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return ret(cudaErrorMemoryAllocation);
  ev->magic = EVENT_MAGIC;
  ev->timing = !(flags & cudaEventDisableTiming);
  ev->device = cur_device;
  *out = (cudaEvent_t)ev;
  return ret(cudaSuccess);
}

cudaError_t cudaEventCreate(cudaEvent_t *out) { return cudaEventCreateWithFlags(out, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  pthread_mutex_lock(&mu);
  fake_event_t *ev = event_of(e);
  if (!ev) {
    pthread_mutex_unlock(&mu);
    return ret(cudaErrorInvalidResourceHandle);
  }
  ev->dead = 1; /* a pending record frees it when it runs, as CUDA releases it "once complete" */
  const int free_now = ev->pending == 0;
  if (free_now) ev->magic = 0;
  pthread_mutex_unlock(&mu);
  if (free_now) free(ev);
  return ret(cudaSuccess);
}

typedef struct {
  fake_event_t *ev;
  long record_id;
} record_arg_t;

static void record_fn(void *p) {
  record_arg_t *r = p;
  pthread_mutex_lock(&mu);
  fake_event_t *ev = r->ev;
  if (ev->record_id == r->record_id) ev->done_at = now();
  const int free_now = --ev->pending == 0 && ev->dead;
  if (free_now) ev->magic = 0;
  pthread_mutex_unlock(&mu);
  if (free_now) free(ev);
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  record_arg_t *r = calloc(1, sizeof *r);
  if (!r) return ret(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&mu);
  fake_event_t *ev = event_of(e);
  if (!ev || ev->device != s->device) { /* an event is recorded on a stream of its own device */
    pthread_mutex_unlock(&mu);
    free(r);
    return ret(cudaErrorInvalidResourceHandle);
  }
  ev->record_id++;
  ev->pending++;
  r->ev = ev, r->record_id = ev->record_id;
  const long r_id = r->record_id;
  pthread_mutex_unlock(&mu);
  long seq = 0; /* complete once s has done everything up to and including the record */
  if (enqueue(s, record_fn, r, &seq) != 0) { /* r was freed with the refused work */
    pthread_mutex_lock(&mu);
    const int free_now = --ev->pending == 0 && ev->dead;
    if (free_now) ev->magic = 0;
    pthread_mutex_unlock(&mu);
    if (free_now) free(ev);
    return ret(cudaErrorIllegalAddress);
  }
  pthread_mutex_lock(&mu);
  if (ev->record_id == r_id) ev->stream = s, ev->seq = seq;
  pthread_mutex_unlock(&mu);
  return ret(cudaSuccess);
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  pthread_mutex_lock(&mu);
  fake_event_t *ev = event_of(e);
  cudaError_t r = !ev ? cudaErrorInvalidResourceHandle
                  : !ev->stream || ev->stream->completed >= ev->seq ? cudaSuccess
                                                                     : cudaErrorNotReady;
  pthread_mutex_unlock(&mu);
  return r == cudaErrorNotReady && !fake_faulted() ? r : ret(r); /* "not ready" is not an error to keep */
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  if (!ms) return ret(cudaErrorInvalidValue);
  pthread_mutex_lock(&mu);
  fake_event_t *x = event_of(a), *y = event_of(b);
  cudaError_t r = cudaSuccess;
  if (!x || !y || !x->timing || !y->timing || !x->stream || !y->stream) r = cudaErrorInvalidResourceHandle;
  else if (x->stream->completed < x->seq || y->stream->completed < y->seq) r = cudaErrorNotReady;
  else *ms = (float)(1e3 * (y->done_at - x->done_at));
  pthread_mutex_unlock(&mu);
  return ret(r);
}

/* ---- streams: the runtime calls -------------------------------------------------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned int flags) {
  if (!out || (flags & ~(unsigned)cudaStreamNonBlocking)) return ret(cudaErrorInvalidValue);
  fake_stream_t *s = stream_new(cur_device, !(flags & cudaStreamNonBlocking), 0);
  if (!s) return ret(cudaErrorMemoryAllocation);
  *out = (cudaStream_t)s;
  return ret(cudaSuccess);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  fake_stream_t *s = stream ? fake_stream_of(stream) : NULL;
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  pthread_mutex_lock(&mu);
  s->stop = 1; /* its thread finishes the work it has, then ends */
  pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&mu);
  return ret(cudaSuccess);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  drain(s);
  return ret(cudaSuccess);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned int flags) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  wait_arg_t *a = calloc(1, sizeof *a);
  if (!a) return ret(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&mu);
  fake_event_t *ev = event_of(e);
  if (!ev) {
    pthread_mutex_unlock(&mu);
    free(a);
    return ret(cudaErrorInvalidResourceHandle);
  }
  if (!ev->stream) { /* never recorded: nothing to wait for */
    pthread_mutex_unlock(&mu);
    free(a);
    return ret(cudaSuccess);
  }
  a->stream = ev->stream, a->seq = ev->seq; /* the latest record at the time of this call */
  pthread_mutex_unlock(&mu);
  return ret(fake_enqueue(s, wait_fn, a) == 0 ? cudaSuccess : cudaErrorIllegalAddress);
}

/* ---- memory: the runtime calls ---------------------------------------------------------------------- */

cudaError_t cudaMalloc(void **out, size_t bytes) {
  if (!out) return ret(cudaErrorInvalidValue);
  *out = NULL;
  if (fake_faulted()) return ret(cudaErrorIllegalAddress);
  const size_t padded = (bytes + 255) / 256 * 256;
  alloc_t *a = calloc(1, sizeof *a);
  char *p = padded ? aligned_alloc(256, padded) : NULL;
  if (!a || (padded && !p)) {
    free(a), free(p);
    return ret(cudaErrorMemoryAllocation);
  }
  /* Fresh device memory holds whatever was there: all-ones bytes read as NaN in every float type,
   * so a result computed from memory nobody wrote does not pass for zero. */
  if (padded) memset(p, 0xff, padded);
  a->base = p, a->bytes = bytes, a->device = cur_device;
  pthread_mutex_lock(&mu);
  a->next = allocs;
  allocs = a;
  pthread_mutex_unlock(&mu);
  *out = p;
  return ret(cudaSuccess);
}

/* Unlinks the allocation starting at p (mu held); NULL if none does. */
static alloc_t *unlink_alloc(void *p) {
  for (alloc_t **a = &allocs; *a; a = &(*a)->next)
    if ((*a)->base == p) {
      alloc_t *hit = *a;
      *a = hit->next;
      return hit;
    }
  return NULL;
}

cudaError_t cudaFree(void *p) {
  if (!p) return ret(cudaSuccess);
  pthread_mutex_lock(&mu);
  alloc_t *a = NULL;
  for (alloc_t *t = allocs; t; t = t->next)
    if (t->base == p && !t->freed) a = t;
  pthread_mutex_unlock(&mu);
  if (!a) {
    /* CUDA returns cudaErrorInvalidValue, which the caller may not look at (zbpp's release does not):
     * here a double free or a free of a pointer nobody allocated is a fault that every later call sees. */
    fake_fault("cudaFree(%p): not a live cudaMalloc allocation (freed twice, or never allocated)", p);
    return ret(cudaErrorInvalidValue);
  }
  drain_device(a->device); /* cudaFree synchronises the device */
  pthread_mutex_lock(&mu);
  a = unlink_alloc(p);
  pthread_mutex_unlock(&mu);
  if (a) free(a->base), free(a);
  return ret(a ? cudaSuccess : cudaErrorInvalidValue);
}

cudaError_t cudaMallocAsync(void **out, size_t bytes, cudaStream_t stream) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->device != cur_device) return ret(cudaErrorInvalidResourceHandle);
  return cudaMalloc(out, bytes);
}

static void free_fn(void *p) {
  void *ptr = *(void **)p;
  pthread_mutex_lock(&mu);
  alloc_t *a = unlink_alloc(ptr);
  pthread_mutex_unlock(&mu);
  if (a) free(a->base), free(a);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t stream) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (!p) return ret(cudaSuccess);
  pthread_mutex_lock(&mu);
  alloc_t *known = NULL;
  for (alloc_t *t = allocs; t; t = t->next)
    if (t->base == p && !t->freed) known = t;
  if (known) known->freed = 1; /* from now on: work issued after this call must not use it */
  pthread_mutex_unlock(&mu);
  if (!known) {
    fake_fault("cudaFreeAsync(%p): not a live cudaMalloc allocation (freed twice, or never allocated)", p);
    return ret(cudaErrorInvalidValue);
  }
  void **arg = malloc(sizeof *arg);
  if (!arg) return ret(cudaErrorMemoryAllocation);
  *arg = p;
  return ret(fake_enqueue(s, free_fn, arg) == 0 ? cudaSuccess : cudaErrorIllegalAddress);
}

typedef struct {
  void *dst;
  const void *src; /* NULL: the bytes follow this struct (taken from pageable memory at the call) */
  size_t bytes;
  int value; /* memset */
  int is_memset;
} copy_arg_t;

static void copy_fn(void *p) {
  copy_arg_t *c = p;
  if (c->is_memset) memset(c->dst, c->value, c->bytes);
  else memcpy(c->dst, c->src ? c->src : (const void *)(c + 1), c->bytes);
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t stream) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return ret(cudaSuccess);
  if (classify(dst, bytes) != 1) {
    fake_check_device_range(dst, bytes, "cudaMemsetAsync's destination");
    return ret(cudaErrorInvalidValue);
  }
  copy_arg_t *c = calloc(1, sizeof *c);
  if (!c) return ret(cudaErrorMemoryAllocation);
  c->dst = dst, c->bytes = bytes, c->value = value, c->is_memset = 1;
  return ret(fake_enqueue(s, copy_fn, c) == 0 ? cudaSuccess : cudaErrorIllegalAddress);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t stream) {
  fake_stream_t *s = fake_stream_of(stream);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return ret(cudaSuccess);
  const int d = classify(dst, bytes), r = classify(src, bytes);
  if (d < 0 || r < 0) {
    fake_check_device_range(d < 0 ? dst : src, bytes,
                            d < 0 ? "cudaMemcpyAsync's destination" : "cudaMemcpyAsync's source");
    return ret(cudaErrorInvalidValue);
  }
  const enum cudaMemcpyKind actual = d ? (r ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                       : (r ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  if (kind != cudaMemcpyDefault && kind != actual) return ret(cudaErrorInvalidValue);
  /* Pageable host memory: the source's bytes are taken at the call, and a copy into it returns only
   * once done (the runtime's documented behaviour for cudaMemcpyAsync with pageable memory). */
  copy_arg_t *c = calloc(1, sizeof *c + (r ? 0 : bytes));
  if (!c) return ret(cudaErrorMemoryAllocation);
  c->dst = dst, c->bytes = bytes, c->src = r ? src : NULL;
  if (!r) memcpy(c + 1, src, bytes);
  if (fake_enqueue(s, copy_fn, c) != 0) return ret(cudaErrorIllegalAddress);
  if (!d) drain(s);
  return ret(cudaSuccess);
}

/* ---- what driver.c needs of the runtime's state ------------------------------------------------ */

int fake_current_device(void) { return cur_device; }
int fake_context_current(void) { return ctx_current; }
int fake_stream_device(const fake_stream_t *s) { return s->device; }
