/*
 * driver.c - the fake device's CUDA driver calls (libcuda.so.1; fake_cuda.h says what is kept):
 * the context query, modules loaded from the embedded fatbins, their functions, and launches that
 * run kernels.cpp's host-compiled kernels on the fake streams of fake.c.
 */
#define _GNU_SOURCE /* memmem */
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

enum { MODULE_MAGIC = 0x30d01eu };

static pthread_mutex_t functions_mu = PTHREAD_MUTEX_INITIALIZER;

/* ---- the driver: modules and launches ---------------------------------------------------------- */

enum { MODULE_FUNCTIONS = 64 };

/* A function belongs to its module, and the module to the device current when it was loaded: a
 * launch with another device current is refused, as a GPU refuses a function of another context. */
typedef struct {
  const fake_kernel_t *kernel;
  int device;
} fake_function_t;

typedef struct {
  unsigned magic;
  int device, n;
  const unsigned char *image;
  size_t bytes;
  fake_function_t functions[MODULE_FUNCTIONS];
} fake_module_t;

typedef struct {
  const fake_kernel_t *kernel;
  unsigned grid[3], block[3];
  /* the params follow */
} launch_arg_t;

CUresult cuGetErrorString(CUresult r, const char **out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  switch (r) {
    case CUDA_SUCCESS: *out = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "invalid argument"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *out = "invalid device context"; break;
    case CUDA_ERROR_INVALID_IMAGE: *out = "device kernel image is invalid"; break;
    case CUDA_ERROR_INVALID_HANDLE: *out = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_FOUND: *out = "named symbol not found"; break;
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: *out = "too many resources requested for launch"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *out = "an illegal memory access was encountered (fake CUDA)"; break;
    default: *out = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = fake_context_current() ? (CUcontext)(uintptr_t)(0x1000 + fake_current_device()) : NULL;
  return CUDA_SUCCESS;
}

/* A fatbin ("fatBinaryHeader": magic 0xBA55ED50, version, header size, then the size of what
 * follows). */
CUresult cuModuleLoadData(CUmodule *out, const void *image) {
  if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
  if (!fake_context_current()) return CUDA_ERROR_INVALID_CONTEXT;
  const unsigned char *b = image;
  uint32_t magic;
  uint16_t header;
  uint64_t size;
  memcpy(&magic, b, 4), memcpy(&header, b + 6, 2), memcpy(&size, b + 8, 8);
  if (magic != 0xBA55ED50u || header < 16 || size == 0 || size > ((uint64_t)1 << 30)) return CUDA_ERROR_INVALID_IMAGE;
  fake_module_t *m = calloc(1, sizeof *m);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  m->magic = MODULE_MAGIC, m->device = fake_current_device(), m->image = b, m->bytes = header + size;
  *out = (CUmodule)m;
  return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule mod) {
  fake_module_t *m = (fake_module_t *)mod;
  if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  m->magic = 0;
  free(m);
  return CUDA_SUCCESS;
}

/* The kernel must be in the module's image too: its name is in the symbol table of each cubin (an
 * ELF image). A fatbin of compressed PTX only (CMAKE_CUDA_ARCHITECTURES=90-virtual) shows no names,
 * so the check is made only where the image holds an ELF. */
CUresult cuModuleGetFunction(CUfunction *out, CUmodule mod, const char *name) {
  fake_module_t *m = (fake_module_t *)mod;
  if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
  if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  const fake_kernel_t *k = fake_kernel_find(name);
  if (!k || (memmem(m->image, m->bytes, "\177ELF", 4) && !memmem(m->image, m->bytes, name, strlen(name) + 1)))
    return CUDA_ERROR_NOT_FOUND;
  pthread_mutex_lock(&functions_mu);
  fake_function_t *f = NULL;
  for (int i = 0; i < m->n && !f; i++)
    if (m->functions[i].kernel == k) f = &m->functions[i];
  if (!f && m->n < MODULE_FUNCTIONS) f = &m->functions[m->n++], f->kernel = k, f->device = m->device;
  pthread_mutex_unlock(&functions_mu);
  if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
  *out = (CUfunction)f;
  return CUDA_SUCCESS;
}

static void launch_fn(void *p) {
  launch_arg_t *l = p;
  fake_kernel_run(l->kernel, l->grid[0], l->grid[1], l->grid[2], l->block[0], l->block[1], l->block[2], l + 1);
}

/* Functions are checked against the modules that made them (a function handle is a pointer into
 * its module, which the caller keeps loaded while it launches). */
CUresult cuLaunchKernel(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared_bytes, CUstream stream, void **params, void **extra) {
  const fake_function_t *f = (const fake_function_t *)fn;
  if (!fake_context_current()) return CUDA_ERROR_INVALID_CONTEXT;
  if (!f || !f->kernel || fake_kernel_find(f->kernel->name) != f->kernel) return CUDA_ERROR_INVALID_HANDLE;
  const fake_kernel_t *k = f->kernel;
  if (!gx || !gy || !gz || gx > 0x7fffffffu || gy > 65535 || gz > 65535 || !bx || !by || !bz || bz > 64 ||
      (unsigned long)bx * by * bz > 1024 || shared_bytes > 0 || !params || extra)
    return CUDA_ERROR_INVALID_VALUE;
  if ((unsigned long)bx * by * bz > k->max_threads) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
  if (f->device != fake_current_device()) return CUDA_ERROR_INVALID_HANDLE; /* a function of another device's context */
  if (fake_faulted()) return CUDA_ERROR_ILLEGAL_ADDRESS;
  fake_stream_t *s = fake_stream_of((void *)stream);
  if (!s || fake_stream_device(s) != fake_current_device()) return CUDA_ERROR_INVALID_HANDLE;
  const fake_launch_t shape = {{gx, gy, gz}, {bx, by, bz}, fake_current_device()};
  if (k->check(k, params[0], &shape) != 0) return CUDA_ERROR_ILLEGAL_ADDRESS;
  launch_arg_t *l = calloc(1, sizeof *l + k->param_bytes);
  if (!l) return CUDA_ERROR_OUT_OF_MEMORY;
  l->kernel = k;
  l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz, l->block[0] = bx, l->block[1] = by, l->block[2] = bz;
  memcpy(l + 1, params[0], k->param_bytes); /* the arguments are copied at the launch */
  return fake_enqueue(s, launch_fn, l) == 0 ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
}
