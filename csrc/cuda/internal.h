/*
 * internal.h - what the CUDA parts of the library share: the check macros, the cuBLASLt and NCCL
 * entry points found at run time (libs.c), and the CUDA backend's state that the W GEMMs (gemm.c)
 * and the NCCL transport (transport_nccl.c) reach into. Private to csrc/cuda/; compiled only when
 * CMake found nvcc (ZB_HAVE_CUDA).
 *
 * Only C headers of the toolkit are included here (cuda.h, cuda_runtime_api.h, cublasLt.h, nccl.h),
 * for their types: no function of theirs is linked, every call goes through a table filled at run
 * time (libs.c). The C11 core never sees CUDA C++; device code lives in kernels/, compiled to
 * fatbins that launch.c loads and launches by name.
 */
#ifndef ZB_CUDA_INTERNAL_H
#define ZB_CUDA_INTERNAL_H

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "../backend/internal.h"

/* ---- check macros: a foreign status becomes a zb_status_t with the library's own text --------- */

#define ZB_CUDA_FAIL(err, what)                                                                    \
  ZB_FAIL(ZB_ERR_CUDA, "%s failed: %s (%s)", (what), zb__cuda_error_text(err), zb__cuda_error_name(err))

#define ZB_CUDA_CHECK(call)                                                                        \
  do {                                                                                             \
    cudaError_t zb__e = (call);                                                                    \
    if (zb__e != cudaSuccess) return ZB_CUDA_FAIL(zb__e, #call);                                   \
  } while (0)

#define ZB_CUDA_CHECK_GOTO(call, st, label)                                                        \
  do {                                                                                             \
    cudaError_t zb__e = (call);                                                                    \
    if (zb__e != cudaSuccess) {                                                                    \
      (st) = ZB_CUDA_FAIL(zb__e, #call);                                                           \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

/* ---- cuBLASLt and NCCL, found at run time (libs.c) ---------------------------------------------
 * Not linked, so that libzbpp.so loads on machines without them (CPU-only runs, CI) and binds to
 * the copies torch already loaded. Each table is filled once per process; a missing library or
 * symbol is reported by zb__cublaslt()/zb__nccl() with the names tried. */
typedef struct {
  const char *path; /* what was loaded, for messages and benchmark reports */
  cublasStatus_t (*Create)(cublasLtHandle_t *);
  cublasStatus_t (*Destroy)(cublasLtHandle_t);
  size_t (*GetVersion)(void);
  const char *(*GetStatusString)(cublasStatus_t);
  cublasStatus_t (*MatmulDescCreate)(cublasLtMatmulDesc_t *, cublasComputeType_t, cudaDataType_t);
  cublasStatus_t (*MatmulDescDestroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*MatmulDescSetAttribute)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t,
                                           const void *, size_t);
  cublasStatus_t (*MatrixLayoutCreate)(cublasLtMatrixLayout_t *, cudaDataType, uint64_t, uint64_t,
                                       int64_t);
  cublasStatus_t (*MatrixLayoutDestroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*MatrixLayoutSetAttribute)(cublasLtMatrixLayout_t, cublasLtMatrixLayoutAttribute_t,
                                             const void *, size_t);
  cublasStatus_t (*MatmulPreferenceCreate)(cublasLtMatmulPreference_t *);
  cublasStatus_t (*MatmulPreferenceDestroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*MatmulPreferenceSetAttribute)(cublasLtMatmulPreference_t,
                                                 cublasLtMatmulPreferenceAttributes_t, const void *,
                                                 size_t);
  cublasStatus_t (*MatmulAlgoGetHeuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           cublasLtMatmulPreference_t, int,
                                           cublasLtMatmulHeuristicResult_t[], int *);
  cublasStatus_t (*MatmulAlgoCheck)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                    cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                    const cublasLtMatmulAlgo_t *, cublasLtMatmulHeuristicResult_t *);
  cublasStatus_t (*Matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *,
                           cublasLtMatrixLayout_t, const void *, cublasLtMatrixLayout_t,
                           const void *, const void *, cublasLtMatrixLayout_t, void *,
                           cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t *, void *, size_t,
                           cudaStream_t);
} zb__cublaslt_t;

typedef struct {
  const char *path;
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*CommCount)(const ncclComm_t, int *);
  ncclResult_t (*CommUserRank)(const ncclComm_t, int *);
  ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t);
} zb__nccl_t;

zb_status_t zb__cublaslt(const zb__cublaslt_t **out);
zb_status_t zb__nccl(const zb__nccl_t **out);

/* The CUDA runtime, found at run time (libs.c: the copy torch loaded, libcudart.so.13 or .12): every
 * runtime call of the CUDA parts goes through this table. The NCCL transport takes it as an
 * argument, so its host tests can hand it a fake device (tests/c/test_transport_nccl.c). */
typedef struct {
  const char *path;
  cudaError_t (*GetDeviceCount)(int *);
  cudaError_t (*GetDevice)(int *);
  cudaError_t (*SetDevice)(int);
  const char *(*GetErrorString)(cudaError_t);
  const char *(*GetErrorName)(cudaError_t);
  cudaError_t (*GetLastError)(void);
  cudaError_t (*EventCreate)(cudaEvent_t *);
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t *, unsigned int);
  cudaError_t (*EventDestroy)(cudaEvent_t);
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*EventQuery)(cudaEvent_t);
  cudaError_t (*EventElapsedTime)(float *, cudaEvent_t, cudaEvent_t);
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t *, unsigned int);
  cudaError_t (*StreamDestroy)(cudaStream_t);
  cudaError_t (*StreamSynchronize)(cudaStream_t);
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned int);
  cudaError_t (*Malloc)(void **, size_t);
  cudaError_t (*Free)(void *);
  cudaError_t (*MallocAsync)(void **, size_t, cudaStream_t);
  cudaError_t (*FreeAsync)(void *, cudaStream_t);
  cudaError_t (*MemsetAsync)(void *, int, size_t, cudaStream_t);
  cudaError_t (*MemcpyAsync)(void *, const void *, size_t, enum cudaMemcpyKind, cudaStream_t);
} zb__cudart_t;

/* Loads the runtime once per process; fails (ZB_ERR_CUDA) with the names tried. */
zb_status_t zb__cudart(const zb__cudart_t **out);
/* The loaded table, for code that runs only after zb__cudart succeeded (a CUDA backend exists). */
const zb__cudart_t *zb__rt(void);
/* cudaGetErrorString / cudaGetErrorName through the table (a placeholder text if none is loaded). */
const char *zb__cuda_error_text(cudaError_t e);
const char *zb__cuda_error_name(cudaError_t e);

/* The driver calls that load and launch the embedded device code (libcuda.so.1). */
typedef struct {
  const char *path;
  CUresult (*GetErrorString)(CUresult, const char **);
  CUresult (*CtxGetCurrent)(CUcontext *);
  CUresult (*ModuleLoadData)(CUmodule *, const void *);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void **, void **);
} zb__cudrv_t;

zb_status_t zb__cudrv(const zb__cudrv_t **out);

#define ZB_CUBLAS_CHECK(lt, call)                                                                  \
  do {                                                                                             \
    cublasStatus_t zb__b = (call);                                                                 \
    if (zb__b != CUBLAS_STATUS_SUCCESS)                                                            \
      return ZB_FAIL(ZB_ERR_CUBLAS, "%s failed: %s (status %d)", #call, (lt)->GetStatusString(zb__b), \
                     (int)zb__b);                                                                  \
  } while (0)

/* NCCL's own text plus its last-error detail for the communicator (may be NULL). */
#define ZB_NCCL_FAIL(nc, res, comm, what)                                                          \
  ZB_FAIL(ZB_ERR_NCCL, "%s failed: %s%s%s", (what), (nc)->GetErrorString(res),                     \
          (nc)->GetLastError ? ": " : "", (nc)->GetLastError ? (nc)->GetLastError(comm) : "")

/* ---- the CUDA backend's state (backend.c owns it) ------------------------------------------------ */

typedef struct zb__wgemm_cache zb__wgemm_cache_t;

/* The device code's modules (one fatbin per .cu file of kernels/) and kernels, by name: launch.c. */
#define ZB__MODULE_LIST(X) X(SQ_NORM, sq_norm) X(LOSS_SCALE, loss_scale) X(OPTIM, optim) X(BIAS_GRAD, bias_grad)
#define ZB__KERNEL_LIST(X)                                                                         \
  X(SQ_NORM_F32, SQ_NORM, "sq_norm_f32_kernel")                                                   \
  X(SQ_NORM_F16, SQ_NORM, "sq_norm_f16_kernel")                                                   \
  X(SQ_NORM_BF16, SQ_NORM, "sq_norm_bf16_kernel")                                                 \
  X(UNSCALE_F32, LOSS_SCALE, "unscale_f32_kernel")                                                \
  X(UNSCALE_F16, LOSS_SCALE, "unscale_f16_kernel")                                                \
  X(UNSCALE_BF16, LOSS_SCALE, "unscale_bf16_kernel")                                              \
  X(SCALE_UPDATE, LOSS_SCALE, "scale_update_kernel")                                              \
  X(OPTIM_STEP_F32, OPTIM, "optim_step_f32_kernel")                                               \
  X(OPTIM_STEP_F16, OPTIM, "optim_step_f16_kernel")                                               \
  X(OPTIM_STEP_BF16, OPTIM, "optim_step_bf16_kernel")                                             \
  X(OPTIM_UNDO, OPTIM, "optim_undo_kernel")                                                       \
  X(BIAS_GRAD_F32_F32, BIAS_GRAD, "bias_grad_f32_f32_kernel")                                     \
  X(BIAS_GRAD_F16_F32, BIAS_GRAD, "bias_grad_f16_f32_kernel")                                     \
  X(BIAS_GRAD_F16_F16, BIAS_GRAD, "bias_grad_f16_f16_kernel")                                     \
  X(BIAS_GRAD_BF16_F32, BIAS_GRAD, "bias_grad_bf16_f32_kernel")                                   \
  X(BIAS_GRAD_BF16_BF16, BIAS_GRAD, "bias_grad_bf16_bf16_kernel")                                 \
  X(BIAS_COMBINE_F32, BIAS_GRAD, "bias_combine_f32_kernel")                                       \
  X(BIAS_COMBINE_F16, BIAS_GRAD, "bias_combine_f16_kernel")                                       \
  X(BIAS_COMBINE_BF16, BIAS_GRAD, "bias_combine_bf16_kernel")

enum {
#define ZB__X(id, file) ZB__MODULE_##id,
  ZB__MODULE_LIST(ZB__X)
#undef ZB__X
  ZB__MODULES
};
enum {
#define ZB__X(id, module, name) ZB__KERNEL_##id,
  ZB__KERNEL_LIST(ZB__X)
#undef ZB__X
  ZB__KERNELS
};

typedef struct {
  int device;
  cudaStream_t compute;    /* borrowed (zb_backend_set_stream) or own_stream */
  cudaStream_t own_stream; /* created by the backend, destroyed with it */
  cudaEvent_t order;       /* scratch event for ordering one stream after another */
  void *workspace;         /* cuBLASLt workspace, workspace_bytes, device memory */
  size_t workspace_bytes;
  /* zb_sq_norm's scratch (a double per block and a counter), kept between calls and grown in stream
   * order when a call needs more blocks; freed with the backend. */
  void *norm_scratch;
  size_t norm_slots;
  /* gemm.c's: cuBLASLt (loaded at the first GEMM), its handle and the per-shape cache; all NULL
   * until then, freed by zb__wgemm_destroy. */
  const zb__cublaslt_t *lt;
  cublasLtHandle_t lt_handle;
  zb__wgemm_cache_t *gemm;
  /* launch.c's: the device code's modules on this device and its kernels, loaded at first use. */
  CUmodule modules[ZB__MODULES];
  CUfunction kernels[ZB__KERNELS];
} zb__cuda_t;

/* The backend's state, or NULL when `be` is not a CUDA backend. */
zb__cuda_t *zb__cuda_of(zb_backend_t *be);
/* Makes the calling thread's current device the backend's (threads start on device 0). */
zb_status_t zb__cuda_enter(const zb__cuda_t *cu);

/* gemm.c: dw (+)= dy^T x and db (+)= column sums of dy, on cu->compute, per zb_wgrad_t's contract
 * (dtype, dw_dtype, overwrite). The entry was checked by zb__wgrad_check. Loads cuBLASLt and
 * makes cu->lt_handle on first use. */
zb_status_t zb__wgemm_run(zb__cuda_t *cu, const zb_wgrad_t *e);
/* Frees the cache, its descriptors and the cuBLASLt handle (not the workspace: backend.c owns it). */
void zb__wgemm_destroy(zb__cuda_t *cu);

/* launch.c: launches kernel `id` (ZB__KERNEL_LIST) on cu->compute with one params struct by value;
 * grid_x * grid_y blocks of block_x * block_y threads. Loads the kernel's module on first use.
 * Never blocks. */
zb_status_t zb__cuda_launch(zb__cuda_t *cu, int id, unsigned grid_x, unsigned grid_y, unsigned block_x,
                            unsigned block_y, void *params);
/* Unloads the modules (at backend destroy). */
void zb__cuda_unload(zb__cuda_t *cu);

/* kernels.c, the C side of the kernels/ code: builds each launch's params and launches on cu->compute.
 * Arguments were checked by the public entry points (csrc/backend/ops.c). */
zb_status_t zb__cuda_sq_norm(zb__cuda_t *cu, zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq,
                             int32_t *nonfinite);
zb_status_t zb__cuda_unscale(zb__cuda_t *cu, zb_dtype_t dtype, const zb_tensor_list_t *t, float factor,
                             int32_t *nonfinite);
zb_status_t zb__cuda_scale_update(zb__cuda_t *cu, float *scale, int32_t *tracker, const int32_t *nonfinite,
                                  double growth, double backoff, int32_t interval);
zb_status_t zb__cuda_optim_step(zb__cuda_t *cu, const zb_optim_step_t *s);
zb_status_t zb__cuda_optim_undo(zb__cuda_t *cu, const zb_optim_step_t *s);

/* transport_nccl.c: zb_transport_create_nccl with its NCCL and CUDA runtime tables and the device
 * state given (config->backend is not read and may be NULL): the seam the fake-NCCL tests use. */
zb_status_t zb__transport_create_nccl_with(zb_transport_t **out, const zb_nccl_transport_config_t *c,
                                           const zb__nccl_t *nc, const zb__cudart_t *rt, zb__cuda_t *cu);
/* transport_nccl_group.c: zb_transport_create_nccl_group with its tables and device state given
 * (config->backend is not read and may be NULL), for the fake-NCCL tests. */
zb_status_t zb__transport_create_nccl_group_with(zb_transport_t **out, const zb_nccl_group_config_t *c,
                                                 const zb__nccl_t *nc, const zb__cudart_t *rt, zb__cuda_t *cu);
/* For the tests: requests the transport has made (each with its events), communicators it holds. */
int zb__transport_nccl_requests(zb_transport_t *t);
int zb__transport_nccl_comms(zb_transport_t *t);

#endif /* ZB_CUDA_INTERNAL_H */
