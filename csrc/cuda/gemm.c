/*
 * gemm.c - the W store's weight-gradient GEMMs on the CUDA backend, through cuBLASLt:
 *
 *   dw[out, in] (+)= dy[rows, out]^T x[rows, in]      db[out] (+)= sum over rows of dy
 *
 * on the compute stream, with fp32 compute and fp32 alpha/beta for every input type, the output in
 * dw_dtype (fp32 main_grad, or the input type rounded once), beta = 1 to accumulate and beta = 0 to
 * overwrite (zb_wgrad_t's contract). The bias runs as its own deterministic kernel after the GEMM
 * (kernels/bias_grad.cu).
 *
 * A warm GEMM creates nothing and asks no heuristic: the matmul descriptor, the layouts and the
 * algorithm are kept per (shape, dtypes, leading dimensions, beta kind, pointer alignments) in a
 * small LRU cache owned by the backend. The same key always gets the same algorithm, so repeated
 * runs of an entry give the same bits.
 *
 * What it is not: a general GEMM. It is this one product in this one orientation.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bias_grad.h"
#include "internal.h"

/* Plans kept per backend. A model has a handful of distinct W shapes (a few linear layers), so a
 * linear search over a few dozen is cheaper than the GEMM launch. The number of rows (tokens of a
 * microbatch) varies with variable sequence lengths, so a plan is kept per power-of-two bucket of
 * rows, not per row count: a new count in the bucket only changes the layouts' row count and checks
 * the algorithm (cublasLtMatmulAlgoCheck), and picks another only if that one does not fit. */
enum { PLAN_CAP = 64 };

typedef struct {
  /* The key. All int64_t, so the struct has no padding and two keys compare with memcmp. */
  int64_t dtype, dw_dtype, rows, in, out, ldx, ldy, overwrite, align_x, align_dy, align_dw;
} plan_key_t;

typedef struct {
  plan_key_t key;      /* rows: the bucket (a power of two) */
  int64_t rows;        /* the rows the layouts and the algorithm are set for now */
  uint64_t last_used; /* cache clock at the last hit, for LRU eviction */
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c; /* c describes both C and D (the same buffer, dw) */
  cublasLtMatmulAlgo_t algo;
} plan_t;

struct zb__wgemm_cache {
  plan_t plans[PLAN_CAP];
  int n;
  uint64_t clock;
};

static const char *dtype_name(int64_t t) {
  switch (t) {
    case ZB_DTYPE_F32: return "fp32";
    case ZB_DTYPE_F16: return "f16";
    case ZB_DTYPE_BF16: return "bf16";
  }
  return "?";
}

static cudaDataType_t cuda_type(int64_t t) {
  return t == ZB_DTYPE_F16 ? CUDA_R_16F : t == ZB_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

/* The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address. The
 * heuristic must be told when a buffer is less aligned than 256 bytes (a view into a larger tensor),
 * or it may pick a kernel that needs more; torch's cuBLASLt path does the same. */
static int64_t alignment(const void *p) {
  uintptr_t a = (uintptr_t)p;
  int64_t al = 256;
  while (al > 1 && a % (uintptr_t)al) al /= 2;
  return al;
}

/* dw_dtype and overwrite as the entry means them: an entry whose struct_size ends before a field
 * (built against an older zbpp.h) gets that field's default, fp32 and accumulate. */
static void entry_target(const zb_wgrad_t *e, zb_dtype_t *dw_dtype, int *overwrite) {
  size_t size = e->struct_size;
  *dw_dtype = size >= offsetof(zb_wgrad_t, dw_dtype) + sizeof e->dw_dtype ? e->dw_dtype : ZB_DTYPE_F32;
  *overwrite = size >= offsetof(zb_wgrad_t, overwrite) + sizeof e->overwrite ? e->overwrite != 0 : 0;
}

/* "dw[out=.., in=..] fp32 = dy^T x over .. rows (bf16, ldx .., ldy ..)", for error messages. */
static const char *describe(const plan_key_t *k, char *buf, size_t cap) {
  snprintf(buf, cap, "W GEMM dw[out=%lld, in=%lld] %s %s dy^T x over %lld rows (x, dy %s; ldx %lld, ldy %lld)",
           (long long)k->out, (long long)k->in, dtype_name(k->dw_dtype), k->overwrite ? "=" : "+=",
           (long long)k->rows, dtype_name(k->dtype), (long long)k->ldx, (long long)k->ldy);
  return buf;
}

/* A failed cuBLASLt call becomes ZB_ERR_CUBLAS naming the call, cuBLAS's text and the GEMM. */
#define LT_TRY(lt, call, key, st, label)                                                           \
  do {                                                                                             \
    cublasStatus_t zb__b = (call);                                                                 \
    if (zb__b != CUBLAS_STATUS_SUCCESS) {                                                          \
      char zb__d[256];                                                                             \
      (st) = ZB_FAIL(ZB_ERR_CUBLAS, "%s failed for the %s: %s (status %d)", #call,                \
                     describe((key), zb__d, sizeof zb__d), (lt)->GetStatusString(zb__b), (int)zb__b); \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

static void plan_free(const zb__cublaslt_t *lt, plan_t *p) {
  if (p->a) lt->MatrixLayoutDestroy(p->a);
  if (p->b) lt->MatrixLayoutDestroy(p->b);
  if (p->c) lt->MatrixLayoutDestroy(p->c);
  if (p->desc) lt->MatmulDescDestroy(p->desc);
  memset(p, 0, sizeof *p);
}

static zb_status_t pick_algo(const zb__cuda_t *cu, const plan_key_t *k, plan_t *p);

/* Builds the descriptor, the layouts and the algorithm for key k into p (freed again on failure).
 *
 * The row-major to column-major mapping. cuBLASLt is column-major: a row-major [r, c] matrix with
 * leading dimension ld is, read column-major, its transpose [c, r] with the same ld. So the buffers
 * as cuBLASLt sees them are
 *   X  = x^T   [in,  rows], ld ldx       DY = dy^T [out, rows], ld ldy       DW = dw^T [in, out], ld in
 * and the product we want, dw = dy^T x, transposed is dw^T = x^T dy, i.e.
 *   DW[in, out] = X[in, rows] * DY^T[rows, out]
 * a column-major GEMM with m = in, n = out, k = rows, A = X untransposed (op N) and B = DY
 * transposed (op T). No copy or explicit transpose of any operand is needed. */
static zb_status_t plan_build(const zb__cuda_t *cu, const plan_key_t *k, plan_t *p) {
  const zb__cublaslt_t *lt = cu->lt;
  zb_status_t st = ZB_OK;
  memset(p, 0, sizeof *p);
  p->key = *k;
  /* CUBLAS_COMPUTE_32F, not CUBLAS_COMPUTE_32F_FAST_TF32: for fp32 inputs the products and sums are
   * true fp32 (no rounding of x and dy to TF32's 10-bit mantissa), so the CUDA backend agrees with
   * the host backend's sgemm to fp32 rounding. Half inputs are multiplied exactly and summed in
   * fp32 under this compute type too. Scale type (alpha, beta) is fp32 for every input type. */
  LT_TRY(lt, lt->MatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), k, st, fail);
  const int32_t op_n = CUBLAS_OP_N, op_t = CUBLAS_OP_T;
  LT_TRY(lt, lt->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_n, sizeof op_n), k, st, fail);
  LT_TRY(lt, lt->MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_t, sizeof op_t), k, st, fail);
  /* The layouts describe the buffers as stored (before op): A = X [in, rows], B = DY [out, rows]. */
  LT_TRY(lt, lt->MatrixLayoutCreate(&p->a, cuda_type(k->dtype), (uint64_t)k->in, (uint64_t)k->rows, k->ldx),
         k, st, fail);
  LT_TRY(lt, lt->MatrixLayoutCreate(&p->b, cuda_type(k->dtype), (uint64_t)k->out, (uint64_t)k->rows, k->ldy),
         k, st, fail);
  LT_TRY(lt, lt->MatrixLayoutCreate(&p->c, cuda_type(k->dw_dtype), (uint64_t)k->in, (uint64_t)k->out, k->in),
         k, st, fail);
  p->rows = k->rows;
  ZB_CHECK_GOTO(pick_algo(cu, k, p), st, fail);
  return ZB_OK;

fail:
  plan_free(lt, p);
  return st;
}

/* The first algorithm cuBLASLt's heuristic gives for the plan's descriptor and layouts (set for
 * k->rows rows), within the workspace and the pointers' alignments. */
static zb_status_t pick_algo(const zb__cuda_t *cu, const plan_key_t *k, plan_t *p) {
  const zb__cublaslt_t *lt = cu->lt;
  zb_status_t st = ZB_OK;
  cublasLtMatmulPreference_t pref = NULL;
  LT_TRY(lt, lt->MatmulPreferenceCreate(&pref), k, st, fail);
  const uint64_t ws = cu->workspace_bytes;
  LT_TRY(lt, lt->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
         k, st, fail);
  const uint32_t al_a = (uint32_t)k->align_x, al_b = (uint32_t)k->align_dy, al_c = (uint32_t)k->align_dw;
  LT_TRY(lt, lt->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                              sizeof al_a),
         k, st, fail);
  LT_TRY(lt, lt->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                              sizeof al_b),
         k, st, fail);
  LT_TRY(lt, lt->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                              sizeof al_c),
         k, st, fail);
  LT_TRY(lt, lt->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                              sizeof al_c),
         k, st, fail);

  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  memset(&res, 0, sizeof res);
  LT_TRY(lt, lt->MatmulAlgoGetHeuristic(cu->lt_handle, p->desc, p->a, p->b, p->c, p->c, pref, 1, &res, &found),
         k, st, fail);
  if (found < 1 || res.state != CUBLAS_STATUS_SUCCESS) {
    char d[256];
    st = ZB_FAIL(ZB_ERR_CUBLAS,
                 "cuBLASLt has no algorithm for the %s with a %zu-byte workspace and pointer alignments "
                 "x %lld, dy %lld, dw %lld bytes",
                 describe(k, d, sizeof d), cu->workspace_bytes, (long long)k->align_x,
                 (long long)k->align_dy, (long long)k->align_dw);
    goto fail;
  }
  p->algo = res.algo;
  lt->MatmulPreferenceDestroy(pref);
  return ZB_OK;

fail:
  if (pref) lt->MatmulPreferenceDestroy(pref);
  return st;
}

/* A plan of the bucket for another row count: the layouts' rows set to it, the algorithm checked
 * for it, and replaced by the heuristic's if it does not fit (or needs more workspace). */
static zb_status_t plan_resize(const zb__cuda_t *cu, const plan_key_t *k, plan_t *p) {
  const zb__cublaslt_t *lt = cu->lt;
  zb_status_t st = ZB_OK;
  const uint64_t rows = (uint64_t)k->rows;
  p->rows = -1; /* until the layouts and the algorithm agree again */
  LT_TRY(lt, lt->MatrixLayoutSetAttribute(p->a, CUBLASLT_MATRIX_LAYOUT_COLS, &rows, sizeof rows), k, st, fail);
  LT_TRY(lt, lt->MatrixLayoutSetAttribute(p->b, CUBLASLT_MATRIX_LAYOUT_COLS, &rows, sizeof rows), k, st, fail);
  cublasLtMatmulHeuristicResult_t res;
  memset(&res, 0, sizeof res);
  if (lt->MatmulAlgoCheck(cu->lt_handle, p->desc, p->a, p->b, p->c, p->c, &p->algo, &res) != CUBLAS_STATUS_SUCCESS ||
      res.state != CUBLAS_STATUS_SUCCESS || res.workspaceSize > cu->workspace_bytes)
    ZB_CHECK_GOTO(pick_algo(cu, k, p), st, fail);
  p->rows = k->rows;
fail:
  return st;
}

static int64_t bucket_of(int64_t rows) {
  int64_t b = 1;
  while (b < rows) b <<= 1;
  return b;
}

/* The plan for k, set for k->rows: a hit in k's bucket (resized to these rows if need be), or a new
 * one built into a free slot or over the least recently used. */
static zb_status_t plan_get(zb__cuda_t *cu, const plan_key_t *k, const plan_t **out) {
  zb__wgemm_cache_t *c = cu->gemm;
  plan_key_t ck = *k;
  ck.rows = bucket_of(k->rows);
  c->clock++;
  for (int i = 0; i < c->n; i++)
    if (memcmp(&c->plans[i].key, &ck, sizeof ck) == 0) {
      c->plans[i].last_used = c->clock;
      if (c->plans[i].rows != k->rows) {
        zb_status_t st = plan_resize(cu, k, &c->plans[i]);
        if (st != ZB_OK) return st; /* the plan stays, marked as set for no row count */
      }
      *out = &c->plans[i];
      return ZB_OK;
    }
  int slot = c->n;
  if (slot == PLAN_CAP) {
    slot = 0;
    for (int i = 1; i < PLAN_CAP; i++)
      if (c->plans[i].last_used < c->plans[slot].last_used) slot = i;
    plan_free(cu->lt, &c->plans[slot]);
  } else {
    c->n++;
  }
  zb_status_t st = plan_build(cu, k, &c->plans[slot]);
  if (st != ZB_OK) {
    /* Keep the cache dense: move the last plan into the hole. */
    c->n--;
    if (slot != c->n) {
      c->plans[slot] = c->plans[c->n];
      memset(&c->plans[c->n], 0, sizeof c->plans[c->n]);
    }
    return st;
  }
  c->plans[slot].key = ck;
  c->plans[slot].last_used = c->clock;
  *out = &c->plans[slot];
  return ZB_OK;
}

/* Loads cuBLASLt, makes the handle and the (empty) cache, once per backend. */
static zb_status_t wgemm_init(zb__cuda_t *cu) {
  if (!cu->lt) ZB_CHECK(zb__cublaslt(&cu->lt));
  if (!cu->lt_handle) {
    cublasStatus_t b = cu->lt->Create(&cu->lt_handle);
    if (b != CUBLAS_STATUS_SUCCESS) {
      cu->lt_handle = NULL;
      return ZB_FAIL(ZB_ERR_CUBLAS, "cublasLtCreate failed (%s): %s (status %d)", cu->lt->path,
                     cu->lt->GetStatusString(b), (int)b);
    }
  }
  if (!cu->gemm) {
    cu->gemm = calloc(1, sizeof *cu->gemm);
    if (!cu->gemm) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the cuBLASLt plan cache");
  }
  return ZB_OK;
}

zb_status_t zb__wgemm_run(zb__cuda_t *cu, const zb_wgrad_t *e) {
  zb_dtype_t dw_dtype;
  int overwrite;
  entry_target(e, &dw_dtype, &overwrite);
  plan_key_t k = {e->dtype, dw_dtype, e->rows, e->in_features, e->out_features,
                  e->ldx != ZB_LD_DENSE ? e->ldx : e->in_features, e->ldy != ZB_LD_DENSE ? e->ldy : e->out_features, overwrite,
                  alignment(e->x), alignment(e->dy), alignment(e->dw)};
  const size_t out_size = zb__dtype_size(dw_dtype);
  char d[256];

  if (k.rows == 0) {
    /* An empty sum: overwrite writes zeros (all-zero bits are +0 in every dtype), accumulate keeps
     * dw and db as they are. cuBLASLt is not asked: k = 0 is not a shape every algorithm accepts. */
    if (!overwrite) return ZB_OK;
    cudaError_t ce = zb__rt()->MemsetAsync(e->dw, 0, (size_t)(k.out * k.in) * out_size, cu->compute);
    if (ce == cudaSuccess && e->db) ce = zb__rt()->MemsetAsync(e->db, 0, (size_t)k.out * out_size, cu->compute);
    if (ce != cudaSuccess)
      return ZB_FAIL(ZB_ERR_CUDA, "cudaMemsetAsync zeroing the %s failed: %s (%s)", describe(&k, d, sizeof d),
                     zb__cuda_error_text(ce), zb__cuda_error_name(ce));
    return ZB_OK;
  }

  ZB_CHECK(wgemm_init(cu));
  const plan_t *p;
  ZB_CHECK(plan_get(cu, &k, &p));
  const zb__cublaslt_t *lt = cu->lt;
  const float alpha = 1.0f, beta = overwrite ? 0.0f : 1.0f; /* host scalars, read at enqueue */
  zb_status_t st = ZB_OK;
  LT_TRY(lt, lt->Matmul(cu->lt_handle, p->desc, &alpha, e->x, p->a, e->dy, p->b, &beta, e->dw, p->c, e->dw, p->c,
                        &p->algo, cu->workspace, cu->workspace_bytes, cu->compute),
         &k, st, done);

  if (e->db) {
    zb__bias_grad_params_t bp = {e->dy, k.rows, k.out, k.ldy, e->dtype, e->db, dw_dtype, !overwrite, 1, k.rows, NULL};
    /* db in fp32 (main_grad) or in dy's dtype (zb__wgrad_check allowed only those). */
    const int f32_db = dw_dtype == ZB_DTYPE_F32;
    const int id = e->dtype == ZB_DTYPE_F32   ? ZB__KERNEL_BIAS_GRAD_F32_F32
                   : e->dtype == ZB_DTYPE_F16 ? (f32_db ? ZB__KERNEL_BIAS_GRAD_F16_F32 : ZB__KERNEL_BIAS_GRAD_F16_F16)
                                              : (f32_db ? ZB__KERNEL_BIAS_GRAD_BF16_F32 : ZB__KERNEL_BIAS_GRAD_BF16_BF16);
    const int64_t col_blocks = (k.out + ZB__BIAS_GRAD_COLS - 1) / ZB__BIAS_GRAD_COLS;
    /* Few columns, many rows: split the rows into ranges so about 256 blocks run, at least 1024
     * rows a range, at most 64 ranges, their fp32 partial sums in the GEMM's workspace (free again
     * once the GEMM before it on this stream is done). A function of rows and cols only, so the
     * order of the sums, and so the bits, never change between runs. */
    int64_t splits = k.rows / 1024;
    if (splits > 256 / col_blocks) splits = 256 / col_blocks;
    if (splits > 64) splits = 64;
    while (splits > 1 && (size_t)splits * (size_t)k.out * sizeof(float) > cu->workspace_bytes) splits /= 2;
    if (splits > 1) {
      bp.splits = (int32_t)splits, bp.chunk = (k.rows + splits - 1) / splits, bp.partial = cu->workspace;
    }
    if (k.out >= 1) {
      st = zb__cuda_launch(cu, id, (unsigned)col_blocks, (unsigned)bp.splits, ZB__BIAS_GRAD_COLS, ZB__BIAS_GRAD_LANES,
                           &bp);
      if (st == ZB_OK && bp.splits > 1) {
        const int cid = !f32_db && e->dtype == ZB_DTYPE_F16   ? ZB__KERNEL_BIAS_COMBINE_F16
                        : !f32_db && e->dtype == ZB_DTYPE_BF16 ? ZB__KERNEL_BIAS_COMBINE_BF16
                                                               : ZB__KERNEL_BIAS_COMBINE_F32;
        st = zb__cuda_launch(cu, cid, (unsigned)((k.out + ZB__BIAS_COMBINE_THREADS - 1) / ZB__BIAS_COMBINE_THREADS),
                             1, ZB__BIAS_COMBINE_THREADS, 1, &bp);
      }
      if (st != ZB_OK) {
        char inner[1024];
        snprintf(inner, sizeof inner, "%s", zb__error_body());
        st = ZB_FAIL(st, "the bias gradient of the %s: %s", describe(&k, d, sizeof d), inner);
      }
    }
  }
done:
  return st;
}

void zb__wgemm_destroy(zb__cuda_t *cu) {
  if (cu->gemm) {
    for (int i = 0; i < cu->gemm->n; i++) plan_free(cu->lt, &cu->gemm->plans[i]);
    free(cu->gemm);
    cu->gemm = NULL;
  }
  if (cu->lt_handle) cu->lt->Destroy(cu->lt_handle);
  cu->lt_handle = NULL;
}
