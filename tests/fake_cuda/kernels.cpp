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
 * the attribute, so a bigger launch is refused here as a GPU refuses it), the element types its
 * name fixes, and the check of the launch and of what the host put in its params (check_<P>). */
#define F32 ZB_DTYPE_F32
#define F16 ZB_DTYPE_F16
#define BF16 ZB_DTYPE_BF16
#define FAKE_KERNELS(X)                                                                            \
  X(sq_norm_f32_kernel, zb__sq_norm_params_t, ZB__KERNEL_THREADS, F32, -1)                         \
  X(sq_norm_f16_kernel, zb__sq_norm_params_t, ZB__KERNEL_THREADS, F16, -1)                         \
  X(sq_norm_bf16_kernel, zb__sq_norm_params_t, ZB__KERNEL_THREADS, BF16, -1)                       \
  X(unscale_f32_kernel, zb__unscale_params_t, ZB__KERNEL_THREADS, F32, -1)                         \
  X(unscale_f16_kernel, zb__unscale_params_t, ZB__KERNEL_THREADS, F16, -1)                         \
  X(unscale_bf16_kernel, zb__unscale_params_t, ZB__KERNEL_THREADS, BF16, -1)                       \
  X(scale_update_kernel, zb__scale_update_params_t, 1024, -1, -1)                                  \
  X(optim_step_f32_kernel, zb__optim_step_params_t, ZB__KERNEL_THREADS, F32, -1)                   \
  X(optim_step_f16_kernel, zb__optim_step_params_t, ZB__KERNEL_THREADS, F16, -1)                   \
  X(optim_step_bf16_kernel, zb__optim_step_params_t, ZB__KERNEL_THREADS, BF16, -1)                 \
  X(optim_undo_kernel, zb__optim_undo_params_t, ZB__KERNEL_THREADS, -1, -1)                        \
  X(bias_grad_f32_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES, F32, F32)   \
  X(bias_grad_f16_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES, F16, F32)   \
  X(bias_grad_f16_f16_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES, F16, F16)   \
  X(bias_grad_bf16_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES, BF16, F32) \
  X(bias_grad_bf16_bf16_kernel, zb__bias_grad_params_t, ZB__BIAS_GRAD_COLS * ZB__BIAS_GRAD_LANES, BF16, BF16) \
  X(bias_combine_f32_kernel, zb__bias_grad_params_t, ZB__BIAS_COMBINE_THREADS, -1, F32)            \
  X(bias_combine_f16_kernel, zb__bias_grad_params_t, ZB__BIAS_COMBINE_THREADS, -1, F16)            \
  X(bias_combine_bf16_kernel, zb__bias_grad_params_t, ZB__BIAS_COMBINE_THREADS, -1, BF16)
#define FAKE_KERNEL(name, P, bound, t1, t2) extern "C" void name(const P p);
FAKE_KERNELS(FAKE_KERNEL)
#undef FAKE_KERNEL

namespace {

size_t esize(int t) { return t == ZB_DTYPE_F32 ? 4 : 2; }

/* Every device pointer a kernel will touch, with the bytes it may touch, is inside one allocation
 * of the launch's device (fake_check_device_range_on faults otherwise: a kernel reading past a
 * buffer is an illegal address on a GPU, or silently someone else's memory). Returns 0 when all are. */
int dev(const fake_launch_t *l, const void *p, size_t bytes, const char *what) {
  return fake_check_device_range_on(p, bytes, l->device, what);
}

/* fmt takes exactly two %lld. */
int refuse(const fake_kernel_t *k, const char *fmt, long long a, long long b) {
  char what[192];
  snprintf(what, sizeof what, fmt, a, b);
  fake_fault("%s: %s", k->name, what);
  return -1;
}

/* The table kernels' shape: blocks of ZB__KERNEL_THREADS threads in x (their loops stride by it and
 * their trees are that wide), a grid in x only (they read blockIdx.x alone: a y or z would run the
 * same pieces again). */
int table_shape(const fake_kernel_t *k, const fake_launch_t *l) {
  if (l->block[0] != ZB__KERNEL_THREADS || l->block[1] != 1 || l->block[2] != 1)
    return refuse(k, "blocks of %lld x %lld threads; it is written for 256 x 1", l->block[0], l->block[1]);
  if (l->grid[1] != 1 || l->grid[2] != 1) return refuse(k, "a grid of %lld x %lld in y and z; it reads x only", l->grid[1], l->grid[2]);
  return 0;
}

/* The type a params field names is the one the kernel's name reads. */
int same_type(const fake_kernel_t *k, int named, int want, const char *field) {
  if (named == want) return 0;
  char what[160];
  snprintf(what, sizeof what, "params say %s %%lld, the kernel reads dtype %%lld", field);
  return refuse(k, what, named, want);
}

/* A piece table covers the grid exactly: first_block[0] = 0, each piece ceil(numel / CHUNK)
 * blocks, the last ending at gx (launch.h's layout; the kernels find their piece by it). */
int table_ok(const fake_kernel_t *k, int32_t count, const int32_t *first, const int64_t *numel, int32_t max,
             unsigned gx) {
  if (count < 1 || count > max || first[0] != 0)
    return refuse(k, "a piece table of %lld pieces starting at block %lld", count, count > 0 ? first[0] : -1);
  int64_t next = 0;
  for (int32_t i = 0; i < count; i++) {
    if (first[i] != next || numel[i] < 1)
      return refuse(k, "piece %lld starts at a block the pieces before it do not end at, or is empty (%lld elements)",
                    i, numel[i]);
    next += (numel[i] + ZB__KERNEL_CHUNK - 1) / ZB__KERNEL_CHUNK;
  }
  if (next != (int64_t)gx) return refuse(k, "the pieces cover %lld blocks, the grid has %lld", next, gx);
  return 0;
}

/* A list kernel's launch: its shape, its dtype, its piece table over the grid, and every tensor of
 * the list inside device memory (sq_norm and unscale read the same list layout). */
template <typename P> int list_ok(const fake_kernel_t *k, const P &p, const fake_launch_t *l, const char *what) {
  if (table_shape(k, l) || same_type(k, p.dtype, k->type, "dtype") ||
      table_ok(k, p.t.count, p.t.first_block, p.t.numel, ZB__LIST_MAX_PIECES, l->grid[0]))
    return -1;
  for (int32_t i = 0; i < p.t.count; i++)
    if (dev(l, p.t.ptr[i], (size_t)p.t.numel[i] * esize(k->type), what)) return -1;
  return 0;
}

int check_zb__sq_norm_params_t(const fake_kernel_t *k, const void *v, const fake_launch_t *l) {
  const zb__sq_norm_params_t &p = *static_cast<const zb__sq_norm_params_t *>(v);
  if (list_ok(k, p, l, "sq_norm's tensor")) return -1;
  return dev(l, p.sq, sizeof(double), "sq_norm's sum") || dev(l, p.nonfinite, 4, "sq_norm's flag") ||
         dev(l, p.partials, (size_t)l->grid[0] * sizeof(double), "sq_norm's partials") ||
         dev(l, p.done, 4, "sq_norm's counter");
}

int check_zb__unscale_params_t(const fake_kernel_t *k, const void *v, const fake_launch_t *l) {
  const zb__unscale_params_t &p = *static_cast<const zb__unscale_params_t *>(v);
  return list_ok(k, p, l, "unscale's tensor") || dev(l, p.nonfinite, 4, "unscale's flag");
}

int check_zb__scale_update_params_t(const fake_kernel_t *k, const void *v, const fake_launch_t *l) {
  const zb__scale_update_params_t &p = *static_cast<const zb__scale_update_params_t *>(v);
  if ((unsigned long)l->grid[0] * l->grid[1] * l->grid[2] * l->block[0] * l->block[1] * l->block[2] != 1)
    return refuse(k, "%lld blocks of %lld threads; it is one thread (several would update the scale again)",
                  (long long)l->grid[0] * l->grid[1] * l->grid[2], (long long)l->block[0] * l->block[1] * l->block[2]);
  return dev(l, p.scale, 4, "the loss scale") || dev(l, p.tracker, 4, "the growth tracker") ||
         dev(l, p.nonfinite, 4, "scale_update's flag");
}

/* What the step and undo kernels touch per piece: the parameter, the gradient (the step), and the
 * states the step's kind reads (AdamW both, SGD with momentum the first) or undo's nstate says. */
int optim_ok(const fake_kernel_t *k, const fake_launch_t *l, const zb__optim_table_t &t, int states,
             const void *undo, int nstate, int64_t total, int grad_type) {
  if (table_shape(k, l) || table_ok(k, t.count, t.first_block, t.numel, ZB__OPTIM_MAX_PIECES, l->grid[0])) return -1;
  for (int32_t i = 0; i < t.count; i++) {
    const size_t n = (size_t)t.numel[i];
    if (dev(l, t.param[i], n * 4, "an optimizer's parameter") ||
        (grad_type >= 0 && dev(l, t.grad[i], n * esize(grad_type), "an optimizer's gradient")) ||
        (states >= 1 && dev(l, t.state1[i], n * 4, "an optimizer's first state")) ||
        (states >= 2 && dev(l, t.state2[i], n * 4, "an optimizer's second state")))
      return -1;
    if (undo && (t.offset[i] < 0 || t.offset[i] + t.numel[i] > total))
      return refuse(k, "a piece reaching element %lld of undo blocks of %lld", t.offset[i] + t.numel[i], total);
  }
  return undo && dev(l, undo, (size_t)(nstate + 1) * (size_t)total * 4, "the undo buffer");
}

int check_zb__optim_step_params_t(const fake_kernel_t *k, const void *v, const fake_launch_t *l) {
  const zb__optim_step_params_t &p = *static_cast<const zb__optim_step_params_t *>(v);
  const int states = p.kind == ZB_OPTIM_ADAMW ? 2 : p.nstate >= 1 ? 1 : 0;
  if (p.kind == ZB_OPTIM_ADAMW && p.nstate != 2)
    return refuse(k, "AdamW (which reads and saves both states) with nstate %lld, not %lld", p.nstate, 2);
  return same_type(k, p.grad_dtype, k->type, "grad_dtype") ||
         optim_ok(k, l, p.t, states, p.undo, p.nstate, p.total, k->type);
}

int check_zb__optim_undo_params_t(const fake_kernel_t *k, const void *v, const fake_launch_t *l) {
  const zb__optim_undo_params_t &p = *static_cast<const zb__optim_undo_params_t *>(v);
  if (!p.undo) return refuse(k, "no undo buffer for its %lld pieces (%lld states); it reads one", p.t.count, p.nstate);
  return optim_ok(k, l, p.t, p.nstate, p.undo, p.nstate, p.total, -1);
}

/* bias_grad: blocks of COLS x LANES threads (its shared array is LANES rows of COLS), a grid of
 * column blocks x splits covering every column and every row; combine: one thread per column. */
int check_zb__bias_grad_params_t(const fake_kernel_t *k, const void *v, const fake_launch_t *l) {
  const zb__bias_grad_params_t &p = *static_cast<const zb__bias_grad_params_t *>(v);
  const int combine = k->type < 0;
  if (p.rows < 1 || p.cols < 1 || p.ldy < p.cols || p.splits < 1 || p.chunk < 1 || (p.splits > 1 && !p.partial))
    return refuse(k, "rows %lld, cols %lld (or ldy < cols, splits < 1, no partial buffer)", p.rows, p.cols);
  if (same_type(k, p.db_dtype, k->type2, "db_dtype") || (!combine && same_type(k, p.dy_dtype, k->type, "dy_dtype")))
    return -1;
  if (combine) {
    if (l->block[1] != 1 || l->block[2] != 1 || l->grid[1] != 1 || l->grid[2] != 1 || p.splits < 2)
      return refuse(k, "a launch in y or z, or %lld splits (of %lld columns); it is one thread per column, after splits",
                    p.splits, p.cols);
    if ((int64_t)l->grid[0] * l->block[0] < p.cols)
      return refuse(k, "%lld threads for %lld columns", (long long)l->grid[0] * l->block[0], p.cols);
  } else {
    if (l->block[0] != ZB__BIAS_GRAD_COLS || l->block[1] != ZB__BIAS_GRAD_LANES || l->block[2] != 1)
      return refuse(k, "blocks of %lld x %lld threads; it is written for 32 x 16", l->block[0], l->block[1]);
    if ((int64_t)l->grid[0] * ZB__BIAS_GRAD_COLS < p.cols || (int64_t)l->grid[1] != p.splits || l->grid[2] != 1)
      return refuse(k, "a grid of %lld x %lld for the columns and splits", l->grid[0], l->grid[1]);
    if (p.chunk * p.splits < p.rows) return refuse(k, "%lld splits of %lld rows leave rows out", p.splits, p.chunk);
  }
  return (!combine && dev(l, p.dy, (size_t)((p.rows - 1) * p.ldy + p.cols) * esize(k->type), "bias_grad's dy")) ||
         dev(l, p.db, (size_t)p.cols * esize(k->type2), "bias_grad's db") ||
         (p.splits > 1 && dev(l, p.partial, (size_t)p.splits * (size_t)p.cols * 4, "bias_grad's partial sums"));
}

#define FAKE_ENTRY(name, P, bound, t1, t2)                                                         \
  void entry_##name(const void *params) { name(*static_cast<const P *>(params)); }
FAKE_KERNELS(FAKE_ENTRY)
#undef FAKE_ENTRY

const fake_kernel_t kernels[] = {
#define FAKE_ROW(name, P, bound, t1, t2) {#name, sizeof(P), (bound), (t1), (t2), entry_##name, check_##P},
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
