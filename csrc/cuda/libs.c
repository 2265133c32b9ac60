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

/* ---- the CUDA runtime ----------------------------------------------------------------------------- */

static const zb__cudart_t cudart_linked = {
    .GetDevice = cudaGetDevice,
    .SetDevice = cudaSetDevice,
    .GetErrorString = cudaGetErrorString,
    .EventCreateWithFlags = cudaEventCreateWithFlags,
    .EventDestroy = cudaEventDestroy,
    .EventRecord = cudaEventRecord,
    .EventQuery = cudaEventQuery,
    .StreamCreateWithFlags = cudaStreamCreateWithFlags,
    .StreamDestroy = cudaStreamDestroy,
    .StreamWaitEvent = cudaStreamWaitEvent,
    .Malloc = cudaMalloc,
    .Free = cudaFree,
};

const zb__cudart_t *zb__cudart_linked(void) { return &cudart_linked; }
