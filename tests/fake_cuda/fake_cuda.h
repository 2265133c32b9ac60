/*
 * fake_cuda.h - a CUDA device on the host, behind the libraries zbpp finds at run time
 * (csrc/cuda/libs.c): one shared library, libfakecuda.so, under the names libcudart.so.13,
 * libcuda.so.1, libcublasLt.so.13 and libnccl.so.2 (symlinks in the build's fake_cuda/ directory),
 * so that the GPU test programs (tests/c/gpu_*.c) run unchanged on a machine without a GPU,
 * through the same dlopen, the same tables and the same calls as on a GPU. ctest runs them so, as
 * `fake_gpu_*`.
 *
 * What it keeps of CUDA, because the CUDA backend relies on it:
 *  - streams run their work in order on a thread of their own, each piece after a random delay (up
 *    to FAKE_CUDA_DELAY_US microseconds, 50 by default), so a missing event wait or stream
 *    synchronisation shows as a wrong or stale value instead of passing by luck;
 *  - an event records the work issued before it; a wait captures the latest record at the time of
 *    the call; cudaEventQuery, cudaEventElapsedTime (only for timing events, only when both are
 *    complete) and cudaStreamSynchronize mean what they mean; the legacy default stream (NULL)
 *    orders itself against the device's blocking streams;
 *  - device memory is host memory, but every allocation is registered: a copy, memset, kernel
 *    argument or GEMM operand reaching outside the allocation it starts in is a device fault (sticky
 *    cudaErrorIllegalAddress, printed with what did it), as is a cudaFree of a pointer not from
 *    cudaMalloc (stricter than CUDA, which returns a plain error: a double free is a bug to see);
 *    cudaFree waits for the device's work issued before it; a copy into pageable host memory
 *    returns after it is done and one from it takes the bytes at the call (cudaMemcpyAsync's
 *    documented behaviour); fresh allocations hold all-ones bytes (NaN in every float type);
 *  - devices: FAKE_CUDA_DEVICES of them (1 by default); streams, events and modules belong to the
 *    device current when they were made; recording an event on another device's stream, or
 *    launching a function or onto a stream of a device that is not current, is refused;
 *  - kernels: the real kernels/ *.cu sources, compiled for the host (shim.h) and run block by block
 *    in a random order, the block's threads as cooperative fibers that switch at __syncthreads and
 *    are resumed in a random order, so shared memory, block reductions and "last block done"
 *    tickets run as written and nothing can lean on an order a GPU does not promise; the parameters
 *    are copied at launch, as cuLaunchKernel does, and checked (every pointer with the bytes the
 *    kernel may touch inside one allocation, piece tables covering the grid: kernels.cpp);
 *    a block above the kernel's __launch_bounds__ is refused; an unknown kernel name is
 *    CUDA_ERROR_NOT_FOUND;
 *  - cuBLASLt: descriptors, layouts and preferences keep the attributes zbpp sets (any other is
 *    refused, so a new one gets a fake of its own); the heuristic refuses type combinations cuBLASLt
 *    does not support for CUBLAS_COMPUTE_32F, ld < rows and inconsistent shapes; the algorithm
 *    remembers the alignments it was chosen for, and a matmul with a less aligned pointer or a
 *    smaller workspace fails; an operand reaching outside its allocation is a device fault;
 *    the product is D = alpha op(A) op(B) + beta C, column-major, fp32 sums, C not read when beta is 0.
 *
 * What it is not: a model of a GPU's speed or of its floating point beyond IEEE fp32/fp64 (no
 * fused multiply-adds are formed here; nvcc's _rn intrinsics forbid them there, but a plain a * b + c
 * in a kernel would be fused by nvcc and not here), a check of device code for data races
 * (compute-sanitizer's racecheck on the GPU does that), or pinned host memory (every host pointer
 * is pageable). nccl.c is its NCCL; fake_nccl.c is another, table-level one for the transports'
 * own tests.
 */
#ifndef ZB_FAKE_CUDA_H
#define ZB_FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- fake.c: devices, streams, memory, faults -------------------------------------------------------- */

typedef struct fake_stream fake_stream_t;
typedef void (*fake_work_fn)(void *arg);

/* The stream a handle names (NULL: the current device's legacy stream); NULL if the handle is not a
 * live stream. */
fake_stream_t *fake_stream_of(void *handle);
/* Enqueues fn(arg) on s; arg is freed (free()) after fn ran. Returns 0, or -1 if the device has
 * faulted (the work is dropped and arg freed). */
int fake_enqueue(fake_stream_t *s, fake_work_fn fn, void *arg);
/* Checks that [p, p + bytes) lies inside one live device allocation (not handed to cudaFreeAsync),
 * of `device` (-1: any); otherwise records a device fault naming `what` and returns -1. bytes 0 is
 * always fine. */
int fake_check_device_range_on(const void *p, size_t bytes, int device, const char *what);
int fake_check_device_range(const void *p, size_t bytes, const char *what);
/* The calling thread's current device, whether it has made a context current (cudaSetDevice), and
 * the device a stream belongs to: what driver.c checks launches against. */
int fake_current_device(void);
int fake_context_current(void);
int fake_stream_device(const fake_stream_t *s);
/* Records a device fault (sticky, as an illegal address is on a GPU) and prints it. */
void fake_fault(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* 1 while the device is faulted. */
int fake_faulted(void);

/* ---- elements.cpp: elements of fp32, f16 and bf16 arrays (a cudaDataType_t: CUDA_R_32F, _16F, _16BF) */

/* Element i widened to float (exact). */
float fake_load(const void *p, int type, uint64_t i);
/* v rounded to nearest even into element i. */
void fake_store(void *p, int type, uint64_t i, float v);

/* ---- kernels.cpp: the device code, compiled for the host ------------------------------------ */

/* A launch's shape and the device it runs on. */
typedef struct {
  unsigned grid[3], block[3];
  int device;
} fake_launch_t;

typedef struct fake_kernel {
  const char *name;
  size_t param_bytes;
  unsigned max_threads;              /* its __launch_bounds__ */
  int type, type2;                   /* the zb_dtype_t its name says it reads (and writes: db), or -1 */
  void (*entry)(const void *params); /* runs one thread of the kernel */
  /* Checks a launch against what the kernel does: the shape it is written for, the element types
   * its name fixes, every pointer with the bytes it may touch inside one allocation of the launch's
   * device, piece tables covering the grid; a fault and -1 if not. */
  int (*check)(const struct fake_kernel *k, const void *params, const fake_launch_t *l);
} fake_kernel_t;

const fake_kernel_t *fake_kernel_find(const char *name);
/* Runs a whole grid on the calling thread, one block after another, in a random order. */
void fake_kernel_run(const fake_kernel_t *k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                     unsigned bz, const void *params);

#ifdef __cplusplus
}
#endif

#endif /* ZB_FAKE_CUDA_H */
