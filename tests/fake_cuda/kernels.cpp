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

#include <memory>
#include <vector>

#include "shim.h" /* the device language, as the kernels' sources see it */

#include "bias_grad.h"
#include "fake_cuda.h"
#include "launch.h"

/* The kernels as shim.h compiles them: extern "C" functions taking their params struct by value.
 * Per kernel: its params type, its __launch_bounds__ (threads a block may have; the shim erases
 * the attribute, so a bigger launch is refused here as a GPU refuses it), and the check of what
 * the host put in its params (check_<P>, below). */
#define FAKE_KERNELS(X)                                                                            \
  X(sq_norm_f32_kernel, zb__sq_norm_params_t, ZB__KERNEL_THREADS)                                  \
  X(sq_norm_f16_kernel, zb__sq_norm_params_t, ZB__KERNEL_THREADS)                                  \
  X(sq_norm_bf16_kernel, zb__sq_norm_params_t, ZB__KERNEL_THREADS)                                 \
  X(unscale_f32_kernel, zb__unscale_params_t, ZB__KERNEL_THREADS)                                  \
  X(unscale_f16_kernel, zb__unscale_params_t, ZB__KERNEL_THREADS)                                  \
  X(unscale_bf16_kernel, zb__unscale_params_t, ZB__KERNEL_THREADS)                                 \
  X(scale_update_kernel, zb__scale_update_params_t, 1024)                                          \
  X(optim_step_f32_kernel, zb__optim_step_params_t, ZB__KERNEL_THREADS)                            \
  X(optim_step_f16_kernel, zb__optim_step_params_t, ZB__KERNEL_THREADS)                            \
  X(optim_step_bf16_kernel, zb__optim_step_params_t, ZB__KERNEL_THREADS)                           \
  X(optim_undo_kernel, zb__optim_undo_params_t, ZB__KERNEL_THREADS)                                \
  X(bias_grad_f32_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES)    \
  X(bias_grad_f16_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES)    \
  X(bias_grad_f16_f16_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES)    \
  X(bias_grad_bf16_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES)   \
  X(bias_grad_bf16_bf16_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES)  \
  X(bias_combine_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_COMBINE_THREADS)                     \
  X(bias_combine_f16_kernel, zb__bias_grad_params_t, ZB__BIAS_COMBINE_THREADS)                     \
  X(bias_combine_bf16_kernel, zb__bias_grad_params_t, ZB__BIAS_COMBINE_THREADS)
#define FAKE_KERNEL(name, P, bound) extern "C" void name(const P p);
FAKE_KERNELS(FAKE_KERNEL)
#undef FAKE_KERNEL

namespace {

size_t esize(zb_dtype_t t) { return t == ZB_DTYPE_F32 ? 4 : 2; }

/* Every device pointer a kernel will touch, with the bytes it may touch, is inside one allocation
 * (fake_check_device_range faults otherwise: a kernel reading past a buffer is an illegal address
 * on a GPU, or silently someone else's memory). Returns 0 when all are. */
int dev(const void *p, size_t bytes, const char *what) { return fake_check_device_range(p, bytes, what); }

/* A piece table covers the grid exactly: first_block[0] = 0, each piece ceil(numel / CHUNK)
 * blocks, the last ending at gx (launch.h's layout; the kernels find their piece by it). */
int table_ok(int32_t count, const int32_t *first, const int64_t *numel, int32_t max, unsigned gx,
             const char *what) {
  if (count < 1 || count > max || first[0] != 0) {
    fake_fault("%s: a piece table of %d pieces starting at block %d", what, (int)count, count > 0 ? (int)first[0] : -1);
    return -1;
  }
  int64_t next = 0;
  for (int32_t k = 0; k < count; k++) {
    if (first[k] != next || numel[k] < 1) {
      fake_fault("%s: piece %d starts at block %d with %lld elements; the pieces before it end at block %lld",
                 what, (int)k, (int)first[k], (long long)numel[k], (long long)next);
      return -1;
    }
    next += (numel[k] + ZB__KERNEL_CHUNK - 1) / ZB__KERNEL_CHUNK;
  }
  if (next != (int64_t)gx) {
    fake_fault("%s: the pieces cover %lld blocks, the grid has %u", what, (long long)next, gx);
    return -1;
  }
  return 0;
}

int check_zb__sq_norm_params_t(const void *v, unsigned gx, unsigned gy) {
  const zb__sq_norm_params_t &p = *static_cast<const zb__sq_norm_params_t *>(v);
  int bad = table_ok(p.t.count, p.t.first_block, p.t.numel, ZB__LIST_MAX_PIECES, gx, "sq_norm");
  for (int32_t k = 0; !bad && k < p.t.count; k++) bad |= dev(p.t.ptr[k], (size_t)p.t.numel[k] * esize(p.dtype), "sq_norm's tensor");
  return bad || dev(p.sq, sizeof(double), "sq_norm's sum") || dev(p.nonfinite, 4, "sq_norm's flag") ||
         dev(p.partials, (size_t)gx * sizeof(double), "sq_norm's partials") || dev(p.done, 4, "sq_norm's counter");
}

int check_zb__unscale_params_t(const void *v, unsigned gx, unsigned gy) {
  const zb__unscale_params_t &p = *static_cast<const zb__unscale_params_t *>(v);
  int bad = table_ok(p.t.count, p.t.first_block, p.t.numel, ZB__LIST_MAX_PIECES, gx, "unscale");
  for (int32_t k = 0; !bad && k < p.t.count; k++) bad |= dev(p.t.ptr[k], (size_t)p.t.numel[k] * esize(p.dtype), "unscale's tensor");
  return bad || dev(p.nonfinite, 4, "unscale's flag");
}

int check_zb__scale_update_params_t(const void *v, unsigned gx, unsigned gy) {
  const zb__scale_update_params_t &p = *static_cast<const zb__scale_update_params_t *>(v);
  return dev(p.scale, 4, "the loss scale") || dev(p.tracker, 4, "the growth tracker") ||
         dev(p.nonfinite, 4, "scale_update's flag");
}

int optim_table_ok(const zb__optim_table_t &t, int nstate, const void *undo, int64_t total, zb_dtype_t grad_dtype,
                   int with_grad, unsigned gx, const char *what) {
  int bad = table_ok(t.count, t.first_block, t.numel, ZB__OPTIM_MAX_PIECES, gx, what);
  for (int32_t k = 0; !bad && k < t.count; k++) {
    const size_t n = (size_t)t.numel[k];
    bad |= dev(t.param[k], n * 4, "an optimizer's parameter");
    if (!bad && with_grad) bad |= dev(t.grad[k], n * esize(grad_dtype), "an optimizer's gradient");
    if (!bad && nstate >= 1) bad |= dev(t.state1[k], n * 4, "an optimizer's first state");
    if (!bad && nstate >= 2) bad |= dev(t.state2[k], n * 4, "an optimizer's second state");
    if (!bad && undo && (t.offset[k] < 0 || t.offset[k] + t.numel[k] > total)) {
      fake_fault("%s: piece %d at offset %lld with %lld elements, in an undo block of %lld", what, (int)k,
                 (long long)t.offset[k], (long long)t.numel[k], (long long)total);
      bad = 1;
    }
  }
  return bad || (undo && dev(undo, (size_t)(nstate + 1) * (size_t)total * 4, "the undo buffer"));
}

int check_zb__optim_step_params_t(const void *v, unsigned gx, unsigned gy) {
  const zb__optim_step_params_t &p = *static_cast<const zb__optim_step_params_t *>(v);
  return optim_table_ok(p.t, p.nstate, p.undo, p.total, p.grad_dtype, 1, gx, "optim_step");
}

int check_zb__optim_undo_params_t(const void *v, unsigned gx, unsigned gy) {
  const zb__optim_undo_params_t &p = *static_cast<const zb__optim_undo_params_t *>(v);
  return optim_table_ok(p.t, p.nstate, p.undo, p.total, ZB_DTYPE_F32, 0, gx, "optim_undo");
}

int check_zb__bias_grad_params_t(const void *v, unsigned gx, unsigned gy) {
  const zb__bias_grad_params_t &p = *static_cast<const zb__bias_grad_params_t *>(v);
  if (p.rows < 1 || p.cols < 1 || p.ldy < p.cols || p.splits < 1 || (p.splits > 1 && !p.partial)) {
    fake_fault("bias_grad: rows %lld, cols %lld, ldy %lld, splits %d", (long long)p.rows, (long long)p.cols,
               (long long)p.ldy, (int)p.splits);
    return -1;
  }
  return dev(p.dy, (size_t)((p.rows - 1) * p.ldy + p.cols) * esize(p.dy_dtype), "bias_grad's dy") ||
         dev(p.db, (size_t)p.cols * esize(p.db_dtype), "bias_grad's db") ||
         (p.splits > 1 && dev(p.partial, (size_t)p.splits * (size_t)p.cols * 4, "bias_grad's partial sums"));
}

#define FAKE_ENTRY(name, P, bound)                                                                 \
  void entry_##name(const void *params) { name(*static_cast<const P *>(params)); }
FAKE_KERNELS(FAKE_ENTRY)
#undef FAKE_ENTRY

const fake_kernel_t kernels[] = {
#define FAKE_ROW(name, P, bound) {#name, sizeof(P), (bound), entry_##name, check_##P},
    FAKE_KERNELS(FAKE_ROW)
#undef FAKE_ROW
};

}  // namespace

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
  std::unique_ptr<char[]> stack; /* new char[]: not zero-filled, so not committed until used */
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

/* Fisher-Yates with a generator of its own (one grid at a time runs, under grid_lock). */
uint64_t rng = 0x9e3779b97f4a7c15ull;
template <typename T> void shuffle(T *a, uint64_t n) {
  for (uint64_t i = n; i > 1; i--) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    const uint64_t j = rng % i;
    const T t = a[i - 1];
    a[i - 1] = a[j], a[j] = t;
  }
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
      f.stack.reset(new char[kStack]);
      getcontext(&f.start);
      f.start.uc_stack.ss_sp = f.stack.get();
      f.start.uc_stack.ss_size = kStack;
      f.start.uc_link = nullptr;
      makecontext(&f.start, fiber_main, 0);
      f.started = 0;
    }
  }
  g_kernel = k, g_params = params;
  fakecuda::grid_dim = {gx, gy, gz};
  fakecuda::block_dim = {bx, by, bz};
  /* Blocks in a random order, and a block's threads resumed in a random order at each barrier: a GPU
   * promises neither, so a kernel that relies on either (the last block being the last index, say)
   * fails here too. */
  const uint64_t blocks = (uint64_t)gx * gy * gz;
  std::vector<uint64_t> order(blocks);
  std::vector<int> turn((size_t)n);
  for (uint64_t b = 0; b < blocks; b++) order[b] = b;
  for (int t = 0; t < n; t++) turn[(size_t)t] = t;
  shuffle(order.data(), blocks);
  for (uint64_t b : order) {
    fakecuda::block_idx = {(unsigned)(b % gx), (unsigned)(b / gx % gy), (unsigned)(b / ((uint64_t)gx * gy))};
    shuffle(turn.data(), (uint64_t)n);
    for (int t : turn) {
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
      shuffle(turn.data(), (uint64_t)n);
      for (int t : turn)
        if (!fibers[(size_t)t].done) resume(t);
    }
  }
  pthread_mutex_unlock(&grid_lock);
}
