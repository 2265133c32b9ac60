/*
 * libs.c - finds cuBLASLt and NCCL at run time and fills the tables of their entry points.
 *
 * Why not link them: a libzbpp.so with DT_NEEDED on libcublasLt.so.13 and libnccl.so.2 would not
 * even load on a CPU-only machine, and next to torch it could bind a second copy of each. So the
 * first CUDA backend (or NCCL transport) looks for them: first among the libraries the process has
 * already loaded (RTLD_NOLOAD: torch's copies when torch was imported first), then by soname on the
 * loader's path, then in /usr/local/cuda. The result, good or bad, is decided once per process;
 * these tables and their once-flags are the only process-wide state of the CUDA parts.
 */
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Opens the first of `names` that is already loaded, else the first that loads. */
static void *open_first(const char *const *names, const char **path, char *tried, size_t cap) {
  for (int pass = 0; pass < 2; pass++)
    for (int k = 0; names[k]; k++) {
      void *h = dlopen(names[k], RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
      if (h) {
        *path = names[k];
        return h;
      }
      if (pass == 1) {
        size_t used = strlen(tried);
        snprintf(tried + used, cap - used, "%s%s", used ? ", " : "", names[k]);
      }
    }
  return NULL;
}

/* Resolves `name` into *slot; remembers the first missing one. */
static void need(void *h, const char *name, void **slot, const char **missing) {
  *slot = dlsym(h, name);
  if (!*slot && !*missing) *missing = name;
}

/* ---- cuBLASLt ----------------------------------------------------------------------------------- */

static pthread_once_t lt_once = PTHREAD_ONCE_INIT;
static zb__cublaslt_t lt_table;
static char lt_error[512];

static void lt_load(void) {
  static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so",
                                      "/usr/local/cuda/lib64/libcublasLt.so", NULL};
  char tried[384] = "";
  void *h = open_first(names, &lt_table.path, tried, sizeof tried);
  if (!h) {
    snprintf(lt_error, sizeof lt_error,
             "cuBLASLt was not found (tried %s: %s); install the CUDA toolkit's cuBLAS, or import "
             "torch before zbpp so its copy is used",
             tried, dlerror());
    return;
  }
  const char *missing = NULL;
#define ZB_SYM(field) need(h, "cublasLt" #field, (void **)&lt_table.field, &missing)
  ZB_SYM(Create);
  ZB_SYM(Destroy);
  ZB_SYM(GetVersion);
  ZB_SYM(GetStatusString);
  ZB_SYM(MatmulDescCreate);
  ZB_SYM(MatmulDescDestroy);
  ZB_SYM(MatmulDescSetAttribute);
  ZB_SYM(MatrixLayoutCreate);
  ZB_SYM(MatrixLayoutDestroy);
  ZB_SYM(MatrixLayoutSetAttribute);
  ZB_SYM(MatmulPreferenceCreate);
  ZB_SYM(MatmulPreferenceDestroy);
  ZB_SYM(MatmulPreferenceSetAttribute);
  ZB_SYM(MatmulAlgoGetHeuristic);
  ZB_SYM(MatmulAlgoCheck);
  ZB_SYM(Matmul);
#undef ZB_SYM
  if (missing) {
    snprintf(lt_error, sizeof lt_error, "%s has no symbol %s; it is too old for zbpp (cuBLAS 12 or later)",
             lt_table.path, missing);
    lt_table.path = NULL;
  }
}

zb_status_t zb__cublaslt(const zb__cublaslt_t **out) {
  pthread_once(&lt_once, lt_load);
  if (!lt_table.path) return ZB_FAIL(ZB_ERR_UNSUPPORTED, "%s", lt_error);
  *out = &lt_table;
  return ZB_OK;
}

/* ---- NCCL --------------------------------------------------------------------------------------- */

static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static zb__nccl_t nccl_table;
static char nccl_error[512];

static void nccl_load(void) {
  static const char *const names[] = {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2",
                                      NULL};
  char tried[384] = "";
  void *h = open_first(names, &nccl_table.path, tried, sizeof tried);
  if (!h) {
    snprintf(nccl_error, sizeof nccl_error,
             "NCCL was not found (tried %s: %s); install NCCL 2.18 or later, or import torch before "
             "zbpp so its copy is used",
             tried, dlerror());
    return;
  }
  const char *missing = NULL;
#define ZB_SYM(field) need(h, "nccl" #field, (void **)&nccl_table.field, &missing)
  ZB_SYM(GetVersion);
  ZB_SYM(GetUniqueId);
  ZB_SYM(CommInitRank);
  ZB_SYM(CommInitRankConfig);
  ZB_SYM(CommSplit);
  ZB_SYM(CommAbort);
  ZB_SYM(CommDestroy);
  ZB_SYM(CommGetAsyncError);
  ZB_SYM(CommCount);
  ZB_SYM(CommUserRank);
  ZB_SYM(Send);
  ZB_SYM(Recv);
  ZB_SYM(GroupStart);
  ZB_SYM(GroupEnd);
  ZB_SYM(AllReduce);
  ZB_SYM(Broadcast);
  ZB_SYM(GetErrorString);
#undef ZB_SYM
  /* ncclGetLastError appeared in 2.13; its absence only shortens messages. */
  nccl_table.GetLastError = (const char *(*)(ncclComm_t))dlsym(h, "ncclGetLastError");
  if (missing) {
    snprintf(nccl_error, sizeof nccl_error,
             "%s has no symbol %s; zbpp needs NCCL 2.18 or later (ncclCommSplit)", nccl_table.path, missing);
    nccl_table.path = NULL;
  }
}

zb_status_t zb__nccl(const zb__nccl_t **out) {
  pthread_once(&nccl_once, nccl_load);
  if (!nccl_table.path) return ZB_FAIL(ZB_ERR_UNSUPPORTED, "%s", nccl_error);
  *out = &nccl_table;
  return ZB_OK;
}

/* ---- the CUDA runtime and driver ----------------------------------------------------------------
 * Not linked either: the library uses the cudart torch already loaded (libcudart.so.13 or .12; the
 * calls below have the same names and signatures in both), so one build runs beside a CUDA 12 and a
 * CUDA 13 torch, and there is one runtime state per process, not a second static copy. The device
 * code (kernels/, compiled to fatbins embedded in the library) is loaded and launched through the
 * driver (libcuda.so.1), which every CUDA install has. */

static pthread_once_t rt_once = PTHREAD_ONCE_INIT;
static zb__cudart_t rt_table;
static char rt_error[512];

static void rt_load(void) {
  static const char *const names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so",
                                      "/usr/local/cuda/lib64/libcudart.so", NULL};
  char tried[384] = "";
  void *h = open_first(names, &rt_table.path, tried, sizeof tried);
  if (!h) {
    snprintf(rt_error, sizeof rt_error,
             "the CUDA runtime was not found (tried %s: %s); import torch (with CUDA) before zbpp, or "
             "install the CUDA runtime",
             tried, dlerror());
    return;
  }
  const char *missing = NULL;
#define ZB_SYM(field) need(h, "cuda" #field, (void **)&rt_table.field, &missing)
  ZB_SYM(GetDeviceCount);
  ZB_SYM(GetDevice);
  ZB_SYM(SetDevice);
  ZB_SYM(GetErrorString);
  ZB_SYM(GetErrorName);
  ZB_SYM(GetLastError);
  ZB_SYM(EventCreate);
  ZB_SYM(EventCreateWithFlags);
  ZB_SYM(EventDestroy);
  ZB_SYM(EventRecord);
  ZB_SYM(EventQuery);
  ZB_SYM(EventElapsedTime);
  ZB_SYM(StreamCreateWithFlags);
  ZB_SYM(StreamDestroy);
  ZB_SYM(StreamSynchronize);
  ZB_SYM(StreamWaitEvent);
  ZB_SYM(Malloc);
  ZB_SYM(Free);
  ZB_SYM(MallocAsync);
  ZB_SYM(FreeAsync);
  ZB_SYM(MemsetAsync);
  ZB_SYM(MemcpyAsync);
#undef ZB_SYM
  if (missing) {
    snprintf(rt_error, sizeof rt_error, "%s has no symbol %s; zbpp needs the CUDA 12 or 13 runtime", rt_table.path,
             missing);
    rt_table.path = NULL;
  }
}

zb_status_t zb__cudart(const zb__cudart_t **out) {
  pthread_once(&rt_once, rt_load);
  if (!rt_table.path) return ZB_FAIL(ZB_ERR_CUDA, "%s", rt_error);
  *out = &rt_table;
  return ZB_OK;
}

const zb__cudart_t *zb__rt(void) { return &rt_table; }

const char *zb__cuda_error_text(cudaError_t e) {
  return rt_table.GetErrorString ? rt_table.GetErrorString(e) : "CUDA error (no CUDA runtime loaded)";
}

const char *zb__cuda_error_name(cudaError_t e) {
  return rt_table.GetErrorName ? rt_table.GetErrorName(e) : "?";
}

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static zb__cudrv_t drv_table;
static char drv_error[512];

static void drv_load(void) {
  static const char *const names[] = {"libcuda.so.1", "libcuda.so", NULL};
  char tried[128] = "";
  void *h = open_first(names, &drv_table.path, tried, sizeof tried);
  if (!h) {
    snprintf(drv_error, sizeof drv_error, "the CUDA driver was not found (tried %s: %s)", tried, dlerror());
    return;
  }
  const char *missing = NULL;
#define ZB_SYM(field) need(h, "cu" #field, (void **)&drv_table.field, &missing)
  ZB_SYM(GetErrorString);
  ZB_SYM(CtxGetCurrent);
  ZB_SYM(ModuleLoadData);
  ZB_SYM(ModuleUnload);
  ZB_SYM(ModuleGetFunction);
  ZB_SYM(LaunchKernel);
#undef ZB_SYM
  if (missing) {
    snprintf(drv_error, sizeof drv_error, "%s has no symbol %s", drv_table.path, missing);
    drv_table.path = NULL;
  }
}

zb_status_t zb__cudrv(const zb__cudrv_t **out) {
  pthread_once(&drv_once, drv_load);
  if (!drv_table.path) return ZB_FAIL(ZB_ERR_CUDA, "%s", drv_error);
  *out = &drv_table;
  return ZB_OK;
}
