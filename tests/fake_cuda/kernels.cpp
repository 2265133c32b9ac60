/*
 * kernels.cpp - runs the kernels of kernels/ *.cu, compiled for the host through shim.h, on the fake
 * device: a grid block by block on the calling thread (a stream's thread), each block's threads as
 * fibers that switch only at __syncthreads.
 *
 * Fibers: each thread of a block starts on a stack of its own (makecontext, entered once with
 * setcontext) and then switches with _setjmp/_longjmp, which save no signal mask: a switch is a few
 * dozen nanoseconds instead of swapcontext's two system calls, and a block of 256 threads passes a
 * barrier about ten times in the reductions. The scheduler runs every thread of the block until it
 * reaches the barrier or returns, then releases the barrier (the OR of the votes), and so on until
 * every thread has returned; which is the block's threads passing each barrier together, as on a
 * GPU. One grid at a time in the process (a lock): __shared__ variables are statics (shim.h).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <vector>

#include "shim.h" /* the device language, as the kernels' sources see it */

#include "bias_grad.h"
#include "fake_cuda.h"
#include "launch.h"

/* The kernels as shim.h compiles them: extern "C" functions taking their params struct by value. */
#define FAKE_KERNEL(name, P) extern "C" void name(const P p);
#define FAKE_KERNELS(X)                                                                            \
  X(sq_norm_f32_kernel, zb__sq_norm_params_t)                                                      \
  X(sq_norm_f16_kernel, zb__sq_norm_params_t)                                                      \
  X(sq_norm_bf16_kernel, zb__sq_norm_params_t)                                                     \
  X(unscale_f32_kernel, zb__unscale_params_t)                                                      \
  X(unscale_f16_kernel, zb__unscale_params_t)                                                      \
  X(unscale_bf16_kernel, zb__unscale_params_t)                                                     \
  X(scale_update_kernel, zb__scale_update_params_t)                                                \
  X(optim_step_f32_kernel, zb__optim_step_params_t)                                                \
  X(optim_step_f16_kernel, zb__optim_step_params_t)                                                \
  X(optim_step_bf16_kernel, zb__optim_step_params_t)                                               \
  X(optim_undo_kernel, zb__optim_undo_params_t)                                                    \
  X(bias_grad_f32_f32_kernel, zb__bias_grad_params_t)                                              \
  X(bias_grad_f16_f32_kernel, zb__bias_grad_params_t)                                              \
  X(bias_grad_f16_f16_kernel, zb__bias_grad_params_t)                                              \
  X(bias_grad_bf16_f32_kernel, zb__bias_grad_params_t)                                             \
  X(bias_grad_bf16_bf16_kernel, zb__bias_grad_params_t)                                            \
  X(bias_combine_f32_kernel, zb__bias_grad_params_t)                                               \
  X(bias_combine_f16_kernel, zb__bias_grad_params_t)                                               \
  X(bias_combine_bf16_kernel, zb__bias_grad_params_t)
FAKE_KERNELS(FAKE_KERNEL)
#undef FAKE_KERNEL

#define FAKE_ENTRY(name, P)                                                                        \
  static void entry_##name(const void *params) { name(*static_cast<const P *>(params)); }
FAKE_KERNELS(FAKE_ENTRY)
#undef FAKE_ENTRY

static const fake_kernel_t kernels[] = {
#define FAKE_ROW(name, P) {#name, sizeof(P), entry_##name},
    FAKE_KERNELS(FAKE_ROW)
#undef FAKE_ROW
};

extern "C" const fake_kernel_t *fake_kernel_find(const char *name) {
  for (const fake_kernel_t &k : kernels)
    if (strcmp(k.name, name) == 0) return &k;
  return nullptr;
}

namespace fakecuda {
fake_uint3 thread_idx, block_idx, block_dim, grid_dim;
}

namespace {

constexpr size_t kStack = 256 << 10; /* a params struct by value is up to 32 KB, on the fiber's stack */

struct fiber_t {
  ucontext_t start;
  jmp_buf at;
  fake_uint3 idx;
  int started, done, waiting;
  std::vector<char> stack;
};

pthread_mutex_t grid_lock = PTHREAD_MUTEX_INITIALIZER;
std::vector<fiber_t> fibers;
jmp_buf sched;
int current, vote_or, released_or;
const fake_kernel_t *g_kernel;
const void *g_params;

/* A fiber runs its thread of the current block, says so, and waits to be resumed for the next
 * block or grid: fibers outlive grids, so a stack is set up once per process, not once per thread. */
void fiber_main() {
  for (;;) {
    g_kernel->entry(g_params);
    fiber_t &f = fibers[(size_t)current];
    f.done = 1;
    if (!_setjmp(f.at)) _longjmp(sched, 1);
  }
}

/* Runs fiber t until it waits at a barrier or returns. */
void resume(int t) {
  fiber_t &f = fibers[(size_t)t];
  current = t;
  fakecuda::thread_idx = f.idx;
  if (_setjmp(sched)) return;
  if (f.started) _longjmp(f.at, 1);
  f.started = 1;
  setcontext(&f.start);
}

}  // namespace

int fakecuda::barrier(int vote) {
  fiber_t &f = fibers[(size_t)current];
  vote_or |= vote;
  f.waiting = 1;
  if (!_setjmp(f.at)) _longjmp(sched, 1);
  return released_or;
}

extern "C" void fake_kernel_run(const fake_kernel_t *k, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, const void *params) {
  pthread_mutex_lock(&grid_lock);
  const int n = (int)(bx * by * bz);
  /* More threads than fibers so far: a new set, made where it stays (a suspended fiber's jmp_buf
   * points into its stack, so fibers never move); the old ones are all parked between grids and are
   * dropped. */
  if (fibers.size() < (size_t)n) {
    std::vector<fiber_t> fresh((size_t)n);
    fibers.swap(fresh);
    for (fiber_t &f : fibers) {
      f.stack.resize(kStack);
      getcontext(&f.start);
      f.start.uc_stack.ss_sp = f.stack.data();
      f.start.uc_stack.ss_size = f.stack.size();
      f.start.uc_link = nullptr;
      makecontext(&f.start, fiber_main, 0);
      f.started = 0;
    }
  }
  g_kernel = k, g_params = params;
  fakecuda::grid_dim = {gx, gy, gz};
  fakecuda::block_dim = {bx, by, bz};
  for (unsigned z = 0; z < gz; z++)
    for (unsigned y = 0; y < gy; y++)
      for (unsigned x = 0; x < gx; x++) {
        fakecuda::block_idx = {x, y, z};
        for (int t = 0; t < n; t++) {
          fiber_t &f = fibers[(size_t)t];
          f.idx = {(unsigned)t % bx, ((unsigned)t / bx) % by, (unsigned)t / (bx * by)};
          f.done = f.waiting = 0;
          resume(t);
        }
        /* Every thread now waits at a barrier or has returned: release, run to the next, repeat. */
        for (;;) {
          int waiting = 0;
          for (int t = 0; t < n; t++) waiting += fibers[(size_t)t].waiting;
          if (!waiting) break;
          released_or = vote_or;
          vote_or = 0;
          for (int t = 0; t < n; t++) fibers[(size_t)t].waiting = 0;
          for (int t = 0; t < n; t++)
            if (!fibers[(size_t)t].done) resume(t);
        }
      }
  pthread_mutex_unlock(&grid_lock);
}
