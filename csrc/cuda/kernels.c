/*
 * kernels.c - the C side of the optimizer kernels (kernels/launch.h): cuts each tensor list into
 * the pieces of one launch's table, fills the params struct and launches on the compute stream,
 * turning CUDA errors into ZB_ERR_CUDA messages. Arguments were checked by csrc/backend/ops.c.
 *
 * One call is one launch unless the list has more pieces than a table holds (ZB__LIST_MAX_PIECES,
 * ZB__OPTIM_MAX_PIECES); the launches then run in list order on the same stream. Nothing here waits
 * for the device. zb_sq_norm's per-block partial sums need device scratch: the backend keeps it
 * between calls and grows it only when a call needs more blocks than any before (in stream order,
 * cudaFreeAsync / cudaMallocAsync on the compute stream: no host synchronisation, no allocation
 * in the steady state).
 *
 * What it is not: a place for arithmetic. The per-step scalars come from the host reference's
 * zb__optim_scalars, so the kernels and the host backend start from the same floats.
 */
#include <stdlib.h>
#include <string.h>

#include "../backend/reference.h"
#include "internal.h"
#include "launch.h"

/* Walks a list's elements in order, piece by piece. `before` counts the elements of the tensors
 * before k (the offset of a piece in the whole list, which the undo buffer is indexed by). */
typedef struct {
  const zb_tensor_list_t *l;
  int32_t k;
  int64_t off, before;
} cursor_t;

typedef struct {
  int32_t k;          /* tensor */
  int64_t off, n;     /* its elements [off, off + n) */
  int64_t global;     /* index of element off in the whole list */
} piece_t;

/* The next piece of at most max_blocks blocks; 0 when the list is done. Empty tensors are skipped. */
static int next_piece(cursor_t *c, int64_t max_blocks, piece_t *out) {
  const zb_tensor_list_t *l = c->l;
  while (c->k < l->count && l->numels[c->k] == c->off) c->before += l->numels[c->k++], c->off = 0;
  if (c->k >= l->count || max_blocks < 1) return 0;
  int64_t n = l->numels[c->k] - c->off;
  if (n > max_blocks * ZB__KERNEL_CHUNK) n = max_blocks * ZB__KERNEL_CHUNK;
  *out = (piece_t){c->k, c->off, n, c->before + c->off};
  c->off += n;
  return 1;
}

static int64_t blocks_of(int64_t n) { return (n + ZB__KERNEL_CHUNK - 1) / ZB__KERNEL_CHUNK; }

/* Fills a list table from the cursor on; returns the launch's blocks (0: nothing left). */
static int32_t fill_list(zb__list_table_t *t, cursor_t *c, size_t esize) {
  int64_t blocks = 0;
  piece_t pc;
  t->count = 0;
  while (t->count < ZB__LIST_MAX_PIECES && next_piece(c, ZB__KERNEL_MAX_BLOCKS - blocks, &pc)) {
    const int32_t i = t->count++;
    t->first_block[i] = (int32_t)blocks;
    t->numel[i] = pc.n;
    t->ptr[i] = (char *)c->l->ptrs[pc.k] + (size_t)pc.off * esize;
    blocks += blocks_of(pc.n);
  }
  return (int32_t)blocks;
}

/* Fills an optimizer table from a cursor over params; the other lists are indexed alike (ops.c
 * checked they pair with params). grads may be NULL (the undo kernel reads none). */
static int32_t fill_optim(zb__optim_table_t *t, cursor_t *c, const zb_optim_step_t *s, int nstate,
                          int with_grads) {
  const size_t gsize = with_grads ? zb__dtype_size(s->grad_dtype) : 0;
  int64_t blocks = 0;
  piece_t pc;
  t->count = 0;
  while (t->count < ZB__OPTIM_MAX_PIECES && next_piece(c, ZB__KERNEL_MAX_BLOCKS - blocks, &pc)) {
    const int32_t i = t->count++;
    t->first_block[i] = (int32_t)blocks;
    t->numel[i] = pc.n;
    t->offset[i] = pc.global;
    t->param[i] = (float *)s->params.ptrs[pc.k] + pc.off;
    t->grad[i] = with_grads ? (const char *)s->grads.ptrs[pc.k] + (size_t)pc.off * gsize : NULL;
    t->state1[i] = nstate >= 1 ? (float *)s->state1.ptrs[pc.k] + pc.off : NULL;
    t->state2[i] = nstate >= 2 ? (float *)s->state2.ptrs[pc.k] + pc.off : NULL;
    blocks += blocks_of(pc.n);
  }
  return (int32_t)blocks;
}

/* The kernel of a dtype among three consecutive ids (f32, f16, bf16). */
static int by_dtype(int f32_id, zb_dtype_t dtype) {
  return f32_id + (dtype == ZB_DTYPE_F32 ? 0 : dtype == ZB_DTYPE_F16 ? 1 : 2);
}

/* The most blocks any launch over the list can have: the scratch size of zb_sq_norm. */
static int64_t max_launch_blocks(const zb_tensor_list_t *l) {
  int64_t total = 0;
  for (int32_t k = 0; k < l->count && total < ZB__KERNEL_MAX_BLOCKS; k++)
    total += blocks_of(l->numels[k]);
  return total < ZB__KERNEL_MAX_BLOCKS ? total : ZB__KERNEL_MAX_BLOCKS;
}

zb_status_t zb__cuda_sq_norm(zb__cuda_t *cu, zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq,
                             int32_t *nonfinite) {
  const int64_t max_blocks = max_launch_blocks(t);
  if (max_blocks == 0) return ZB_OK; /* no elements: sq and the flag stay as they are */
  zb__sq_norm_params_t *p = calloc(1, sizeof *p);
  if (!p) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "zb_sq_norm: out of memory for a launch table");
  /* One double per block, then the finished-block counter (zeroed once; the last block of every
   * launch puts it back to 0, so the launches of one call share the scratch in stream order). */
  size_t slots = (size_t)max_blocks * sizeof(double);
  zb_status_t st = ZB_OK;
  cursor_t c = {t, 0, 0, 0};
  if (slots > cu->norm_slots) {
    /* Grow to the next power of two, so a few sizes settle at once. */
    size_t want = 4096;
    while (want < slots) want *= 2;
    if (cu->norm_scratch) {
      cudaError_t fe = zb__rt()->FreeAsync(cu->norm_scratch, cu->compute);
      cu->norm_scratch = NULL, cu->norm_slots = 0;
      if (fe != cudaSuccess) {
        free(p);
        return ZB_CUDA_FAIL(fe, "cudaFreeAsync of the old sq_norm scratch");
      }
    }
    cudaError_t e = zb__rt()->MallocAsync(&cu->norm_scratch, want + sizeof(double), cu->compute);
    if (e != cudaSuccess) {
      zb__rt()->GetLastError();
      cu->norm_scratch = NULL;
      free(p);
      return ZB_FAIL(ZB_ERR_CUDA, "zb_sq_norm: cudaMallocAsync of %zu bytes of scratch failed: %s (%s)",
                     want + sizeof(double), zb__cuda_error_text(e), zb__cuda_error_name(e));
    }
    cu->norm_slots = want;
  }
  slots = cu->norm_slots;
  void *scratch = cu->norm_scratch;
  p->dtype = dtype;
  p->sq = sq;
  p->nonfinite = nonfinite;
  p->partials = scratch;
  p->done = (unsigned int *)((char *)scratch + slots);
  ZB_CUDA_CHECK_GOTO(zb__rt()->MemsetAsync(p->done, 0, sizeof(unsigned int), cu->compute), st, out);
  for (int32_t blocks; (blocks = fill_list(&p->t, &c, zb__dtype_size(dtype))) > 0;) {
    st = zb__cuda_launch(cu, by_dtype(ZB__KERNEL_SQ_NORM_F32, dtype), (unsigned)blocks, 1, ZB__KERNEL_THREADS, 1, p);
    if (st != ZB_OK) break;
  }
out:
  free(p);
  return st;
}

zb_status_t zb__cuda_unscale(zb__cuda_t *cu, zb_dtype_t dtype, const zb_tensor_list_t *t, float factor,
                             int32_t *nonfinite) {
  zb__unscale_params_t *p = calloc(1, sizeof *p);
  if (!p) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "zb_unscale: out of memory for a launch table");
  p->dtype = dtype;
  p->factor = factor;
  p->nonfinite = nonfinite;
  zb_status_t st = ZB_OK;
  cursor_t c = {t, 0, 0, 0};
  for (int32_t blocks; (blocks = fill_list(&p->t, &c, zb__dtype_size(dtype))) > 0;) {
    st = zb__cuda_launch(cu, by_dtype(ZB__KERNEL_UNSCALE_F32, dtype), (unsigned)blocks, 1, ZB__KERNEL_THREADS, 1, p);
    if (st != ZB_OK) break;
  }
  free(p);
  return st;
}

zb_status_t zb__cuda_scale_update(zb__cuda_t *cu, float *scale, int32_t *tracker, const int32_t *nonfinite,
                                  double growth, double backoff, int32_t interval) {
  zb__scale_update_params_t p = {scale, tracker, nonfinite, growth, backoff, interval};
  return zb__cuda_launch(cu, ZB__KERNEL_SCALE_UPDATE, 1, 1, 1, 1, &p);
}

static int64_t list_total(const zb_tensor_list_t *l) {
  int64_t total = 0;
  for (int32_t k = 0; k < l->count; k++) total += l->numels[k];
  return total;
}

zb_status_t zb__cuda_optim_step(zb__cuda_t *cu, const zb_optim_step_t *s) {
  zb__optim_step_params_t *p = calloc(1, sizeof *p);
  if (!p) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "zb_optim_step: out of memory for a launch table");
  const zb__optim_scalars_t k = zb__optim_scalars(s);
  p->kind = s->kind;
  p->grad_dtype = s->grad_dtype;
  p->nstate = zb__optim_nstate(s);
  p->first = k.first;
  p->factor = s->factor;
  p->lr = k.lr, p->decay = k.decay;
  p->b1 = k.b1, p->omb1 = k.omb1, p->b2 = k.b2, p->omb2 = k.omb2;
  p->step_size = k.step_size, p->bc2_sqrt = k.bc2_sqrt;
  p->eps = k.eps, p->wd = k.wd, p->momentum = k.momentum;
  p->undo = s->undo;
  p->total = list_total(&s->params);
  zb_status_t st = ZB_OK;
  cursor_t c = {&s->params, 0, 0, 0};
  for (int32_t blocks; (blocks = fill_optim(&p->t, &c, s, p->nstate, 1)) > 0;) {
    st = zb__cuda_launch(cu, by_dtype(ZB__KERNEL_OPTIM_STEP_F32, s->grad_dtype), (unsigned)blocks, 1,
                         ZB__KERNEL_THREADS, 1, p);
    if (st != ZB_OK) break;
  }
  free(p);
  return st;
}

zb_status_t zb__cuda_optim_undo(zb__cuda_t *cu, const zb_optim_step_t *s) {
  zb__optim_undo_params_t *p = calloc(1, sizeof *p);
  if (!p) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "zb_optim_undo: out of memory for a launch table");
  p->nstate = zb__optim_nstate(s);
  p->undo = s->undo;
  p->total = list_total(&s->params);
  zb_status_t st = ZB_OK;
  cursor_t c = {&s->params, 0, 0, 0};
  for (int32_t blocks; (blocks = fill_optim(&p->t, &c, s, p->nstate, 0)) > 0;) {
    st = zb__cuda_launch(cu, ZB__KERNEL_OPTIM_UNDO, (unsigned)blocks, 1, ZB__KERNEL_THREADS, 1, p);
    if (st != ZB_OK) break;
  }
  free(p);
  return st;
}
