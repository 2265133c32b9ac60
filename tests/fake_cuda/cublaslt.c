/*
 * cublaslt.c - the fake device's cuBLASLt (fake_cuda.h): the calls csrc/cuda/gemm.c makes, with the
 * checks a GPU's cuBLASLt would make of them, and the product computed on the stream's thread.
 *
 * Kept of cuBLASLt: matrices are column-major, element (i, j) of a layout at i + j * ld; op(A) is A
 * or its transpose per CUBLASLT_MATMUL_DESC_TRANSA (B likewise); D = alpha op(A) op(B) + beta C with
 * alpha and beta host floats read at the call, C never read when beta is 0; CUBLAS_COMPUTE_32F with
 * CUDA_R_32F scale supports A = B in fp32 with C = D fp32, and A = B in f16 or bf16 with C = D in
 * the same type or fp32 (cuBLASLt's table of supported combinations); ld >= rows; an algorithm is
 * valid only for pointers as aligned as it was chosen for, and with the workspace it asked for.
 * What it is not: cuBLASLt's summation order (the host BLAS's sgemm adds here; a GPU's tiles add in
 * another order, so only bit-for-bit comparisons between two runs of one shape are meaningful), nor
 * any of its other attributes, epilogues, batches or types.
 */
#include <cblas.h>
#include <cublasLt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

enum { HANDLE_MAGIC = 0x17a0d1u, DESC_MAGIC = 0xde5cu, LAYOUT_MAGIC = 0x1a70u, PREF_MAGIC = 0x9e3fu };
enum { ALGO_TAG = 0x5a4b };

typedef struct {
  unsigned magic;
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t transa, transb;
} desc_t;

typedef struct {
  unsigned magic;
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
} layout_t;

typedef struct {
  unsigned magic;
  uint64_t workspace;
  uint32_t align[4]; /* A, B, C, D */
} pref_t;

/* What an algorithm holds (in cublasLtMatmulAlgo_t.data): a tag, the minimum alignments it needs
 * and the workspace it needs. */
typedef struct {
  uint64_t tag, align_a, align_b, align_cd, workspace;
} algo_state_t;

_Static_assert(sizeof(algo_state_t) <= sizeof(cublasLtMatmulAlgo_t), "algo state too big");

static const char *status_text(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

const char *cublasLtGetStatusString(cublasStatus_t s) { return status_text(s); }
size_t cublasLtGetVersion(void) { return 130000; }

cublasStatus_t cublasLtCreate(cublasLtHandle_t *out) {
  if (!out) return CUBLAS_STATUS_INVALID_VALUE;
  unsigned *h = malloc(sizeof *h);
  if (!h) return CUBLAS_STATUS_ALLOC_FAILED;
  *h = HANDLE_MAGIC;
  *out = (cublasLtHandle_t)h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  unsigned *p = (unsigned *)h;
  if (!p || *p != HANDLE_MAGIC) return CUBLAS_STATUS_NOT_INITIALIZED;
  *p = 0;
  free(p);
  return CUBLAS_STATUS_SUCCESS;
}

static int handle_ok(cublasLtHandle_t h) { return h && *(unsigned *)h == HANDLE_MAGIC; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *out, cublasComputeType_t compute, cudaDataType_t scale) {
  if (!out) return CUBLAS_STATUS_INVALID_VALUE;
  desc_t *d = calloc(1, sizeof *d);
  if (!d) return CUBLAS_STATUS_ALLOC_FAILED;
  d->magic = DESC_MAGIC, d->compute = compute, d->scale = scale, d->transa = d->transb = CUBLAS_OP_N;
  *out = (cublasLtMatmulDesc_t)d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  desc_t *d = (desc_t *)desc;
  if (!d || d->magic != DESC_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
  d->magic = 0;
  free(d);
  return CUBLAS_STATUS_SUCCESS;
}

/* Only the transposes: another attribute is refused, so code that starts setting one gets a fake of
 * it here before it is trusted. */
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
  desc_t *d = (desc_t *)desc;
  if (!d || d->magic != DESC_MAGIC || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr != CUBLASLT_MATMUL_DESC_TRANSA && attr != CUBLASLT_MATMUL_DESC_TRANSB) {
    fprintf(stderr, "fake cuBLASLt: matmul attribute %d is not faked\n", (int)attr);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  int32_t v;
  if (size != sizeof v) return CUBLAS_STATUS_INVALID_VALUE;
  memcpy(&v, buf, sizeof v);
  if (v != CUBLAS_OP_N && v != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_DESC_TRANSA) d->transa = v;
  else d->transb = v;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *out, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (!out) return CUBLAS_STATUS_INVALID_VALUE;
  layout_t *l = calloc(1, sizeof *l);
  if (!l) return CUBLAS_STATUS_ALLOC_FAILED;
  l->magic = LAYOUT_MAGIC, l->type = type, l->rows = rows, l->cols = cols, l->ld = ld;
  *out = (cublasLtMatrixLayout_t)l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  layout_t *l = (layout_t *)layout;
  if (!l || l->magic != LAYOUT_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
  l->magic = 0;
  free(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
  layout_t *l = (layout_t *)layout;
  if (!l || l->magic != LAYOUT_MAGIC || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_ROWS:
    case CUBLASLT_MATRIX_LAYOUT_COLS:
      if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      memcpy(attr == CUBLASLT_MATRIX_LAYOUT_ROWS ? &l->rows : &l->cols, buf, size);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_LD:
      if (size != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      memcpy(&l->ld, buf, size);
      return CUBLAS_STATUS_SUCCESS;
    default:
      fprintf(stderr, "fake cuBLASLt: layout attribute %d is not faked\n", (int)attr);
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *out) {
  if (!out) return CUBLAS_STATUS_INVALID_VALUE;
  pref_t *p = calloc(1, sizeof *p);
  if (!p) return CUBLAS_STATUS_ALLOC_FAILED;
  p->magic = PREF_MAGIC;
  for (int i = 0; i < 4; i++) p->align[i] = 256; /* cuBLASLt assumes 256-byte aligned pointers unless told */
  *out = (cublasLtMatmulPreference_t)p;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  pref_t *p = (pref_t *)pref;
  if (!p || p->magic != PREF_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
  p->magic = 0;
  free(p);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
  pref_t *p = (pref_t *)pref;
  if (!p || p->magic != PREF_MAGIC || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      memcpy(&p->workspace, buf, size);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
      if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      const int i = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
                    : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
                    : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
                                                                         : 3;
      memcpy(&p->align[i], buf, size);
      return CUBLAS_STATUS_SUCCESS;
    }
    default:
      fprintf(stderr, "fake cuBLASLt: preference attribute %d is not faked\n", (int)attr);
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

static size_t type_size(cudaDataType t) {
  return t == CUDA_R_32F ? 4 : t == CUDA_R_16F || t == CUDA_R_16BF ? 2 : 0;
}

/* The problem a descriptor and its layouts describe: m, n, k, or a status saying what is wrong. */
static cublasStatus_t problem(const desc_t *d, const layout_t *a, const layout_t *b, const layout_t *c,
                              const layout_t *dd, uint64_t *m, uint64_t *n, uint64_t *k) {
  if (!d || d->magic != DESC_MAGIC || !a || a->magic != LAYOUT_MAGIC || !b || b->magic != LAYOUT_MAGIC || !c ||
      c->magic != LAYOUT_MAGIC || !dd || dd->magic != LAYOUT_MAGIC)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (a->type != b->type || c->type != dd->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!type_size(a->type) || !type_size(c->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (a->type == CUDA_R_32F && c->type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (c->type != CUDA_R_32F && c->type != a->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  const layout_t *ls[4] = {a, b, c, dd};
  for (int i = 0; i < 4; i++)
    if (ls[i]->ld < 1 || (uint64_t)ls[i]->ld < ls[i]->rows) return CUBLAS_STATUS_INVALID_VALUE;
  const uint64_t am = d->transa == CUBLAS_OP_N ? a->rows : a->cols, ak = d->transa == CUBLAS_OP_N ? a->cols : a->rows;
  const uint64_t bk = d->transb == CUBLAS_OP_N ? b->rows : b->cols, bn = d->transb == CUBLAS_OP_N ? b->cols : b->rows;
  if (ak != bk || c->rows != am || c->cols != bn || dd->rows != am || dd->cols != bn || dd->ld != c->ld)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!am || !bn || !ak) return CUBLAS_STATUS_INVALID_VALUE;
  *m = am, *n = bn, *k = ak;
  return CUBLAS_STATUS_SUCCESS;
}

/* The alignment cuBLASLt needs of every pointer at least: one element. */
static uint64_t min_align(uint64_t asked, cudaDataType t) {
  return asked < type_size(t) ? type_size(t) : asked;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                              cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *found) {
  const pref_t *p = (const pref_t *)pref;
  if (!handle_ok(h) || !p || p->magic != PREF_MAGIC || requested < 1 || !results || !found)
    return CUBLAS_STATUS_INVALID_VALUE;
  uint64_t m, n, k;
  const layout_t *a = (const layout_t *)A, *cc = (const layout_t *)C;
  cublasStatus_t st = problem((const desc_t *)desc, a, (const layout_t *)B, cc, (const layout_t *)D, &m, &n, &k);
  if (st != CUBLAS_STATUS_SUCCESS) {
    *found = 0;
    return st;
  }
  memset(&results[0], 0, sizeof results[0]);
  /* The algorithm uses up to 1 MiB of the workspace offered and scribbles on it (gemm_fn), so a
   * caller that runs it with less, or reuses the workspace while a GEMM may still run, is caught. */
  algo_state_t s = {ALGO_TAG, min_align(p->align[0], a->type), min_align(p->align[1], a->type),
                    min_align(p->align[2] < p->align[3] ? p->align[2] : p->align[3], cc->type),
                    p->workspace < ((uint64_t)1 << 20) ? p->workspace : (uint64_t)1 << 20};
  memcpy(results[0].algo.data, &s, sizeof s);
  results[0].workspaceSize = s.workspace;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t A,
                                       cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                       const cublasLtMatmulAlgo_t *algo, cublasLtMatmulHeuristicResult_t *result) {
  if (!handle_ok(h) || !algo || !result) return CUBLAS_STATUS_INVALID_VALUE;
  algo_state_t s;
  memcpy(&s, algo->data, sizeof s);
  if (s.tag != ALGO_TAG) return CUBLAS_STATUS_INVALID_VALUE;
  uint64_t m, n, k;
  cublasStatus_t st = problem((const desc_t *)desc, (const layout_t *)A, (const layout_t *)B, (const layout_t *)C,
                              (const layout_t *)D, &m, &n, &k);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  memset(result, 0, sizeof *result);
  result->algo = *algo;
  result->workspaceSize = s.workspace;
  result->state = CUBLAS_STATUS_SUCCESS;
  result->wavesCount = 1.0f;
  return CUBLAS_STATUS_SUCCESS;
}

typedef struct {
  uint64_t m, n, k;
  int transa, transb;
  cudaDataType ab, cd;
  int64_t lda, ldb, ldc, ldd;
  float alpha, beta;
  const void *a, *b, *c;
  void *d, *workspace;
  size_t workspace_bytes;
} gemm_arg_t;


/* op(X) as a dense row-major fp32 matrix of `rows` x `cols` (exact: every input type widens). */
static float *widen(const void *p, cudaDataType t, int op, uint64_t rows, uint64_t cols, int64_t ld) {
  float *w = malloc((size_t)(rows * cols) * sizeof *w);
  if (!w) return NULL;
  for (uint64_t i = 0; i < rows; i++)
    for (uint64_t j = 0; j < cols; j++)
      w[i * cols + j] = fake_load(p, t, op == CUBLAS_OP_N ? i + j * (uint64_t)ld : j + i * (uint64_t)ld);
  return w;
}

/* The product in fp32 through the host's BLAS (its own summation order, as a GPU has its own), then
 * alpha, beta and one rounding into D's type. */
static void gemm_fn(void *p) {
  const gemm_arg_t *g = p;
  if (g->workspace_bytes) memset(g->workspace, 0xff, g->workspace_bytes); /* as a GPU's split-K would */
  float *a = widen(g->a, g->ab, g->transa, g->m, g->k, g->lda);
  float *b = widen(g->b, g->ab, g->transb, g->k, g->n, g->ldb);
  float *prod = malloc((size_t)(g->m * g->n) * sizeof *prod);
  if (!a || !b || !prod) {
    fake_fault("cublasLtMatmul: out of host memory for a %llu x %llu x %llu product", (unsigned long long)g->m,
               (unsigned long long)g->n, (unsigned long long)g->k);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)g->m, (int)g->n, (int)g->k, 1.0f, a, (int)g->k, b,
                (int)g->n, 0.0f, prod, (int)g->n);
    for (uint64_t j = 0; j < g->n; j++)
      for (uint64_t i = 0; i < g->m; i++) {
        float v = g->alpha * prod[i * g->n + j];
        if (g->beta != 0.0f) v += g->beta * fake_load(g->c, g->cd, i + j * (uint64_t)g->ldc);
        fake_store(g->d, g->cd, i + j * (uint64_t)g->ldd, v);
      }
  }
  free(a), free(b), free(prod);
}

/* Bytes a column-major rows x cols matrix with leading dimension ld spans. */
static size_t span(uint64_t rows, uint64_t cols, int64_t ld, cudaDataType t) {
  return (size_t)(((cols - 1) * (uint64_t)ld + rows) * type_size(t));
}

static uint64_t alignment_of(const void *p) {
  uint64_t al = 256;
  while (al > 1 && (uintptr_t)p % al) al /= 2;
  return al;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  if (!handle_ok(h) || !alpha || !beta || !algo) return CUBLAS_STATUS_INVALID_VALUE;
  const desc_t *d = (const desc_t *)desc;
  const layout_t *a = (const layout_t *)Adesc, *b = (const layout_t *)Bdesc, *c = (const layout_t *)Cdesc,
                 *dd = (const layout_t *)Ddesc;
  uint64_t m, n, k;
  cublasStatus_t st = problem(d, a, b, c, dd, &m, &n, &k);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  algo_state_t s;
  memcpy(&s, algo->data, sizeof s);
  if (s.tag != ALGO_TAG) return CUBLAS_STATUS_INVALID_VALUE;
  if (alignment_of(A) < s.align_a || alignment_of(B) < s.align_b || alignment_of(C) < s.align_cd ||
      alignment_of(D) < s.align_cd) {
    fprintf(stderr, "fake cuBLASLt: pointers aligned to A %llu, B %llu, C %llu, D %llu bytes; the algorithm needs "
                    "%llu, %llu, %llu\n",
            (unsigned long long)alignment_of(A), (unsigned long long)alignment_of(B),
            (unsigned long long)alignment_of(C), (unsigned long long)alignment_of(D), (unsigned long long)s.align_a,
            (unsigned long long)s.align_b, (unsigned long long)s.align_cd);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (workspace_bytes < s.workspace || (s.workspace && !workspace)) return CUBLAS_STATUS_INVALID_VALUE;
  fake_stream_t *fs = fake_stream_of(stream);
  if (!fs) return CUBLAS_STATUS_INVALID_VALUE;
  gemm_arg_t *g = calloc(1, sizeof *g);
  if (!g) return CUBLAS_STATUS_ALLOC_FAILED;
  memcpy(&g->alpha, alpha, sizeof g->alpha);
  memcpy(&g->beta, beta, sizeof g->beta);
  if (fake_check_device_range(A, span(a->rows, a->cols, a->ld, a->type), "cublasLtMatmul's A") ||
      fake_check_device_range(B, span(b->rows, b->cols, b->ld, b->type), "cublasLtMatmul's B") ||
      (g->beta != 0.0f && fake_check_device_range(C, span(c->rows, c->cols, c->ld, c->type), "cublasLtMatmul's C")) ||
      fake_check_device_range(D, span(dd->rows, dd->cols, dd->ld, dd->type), "cublasLtMatmul's D") ||
      (s.workspace && fake_check_device_range(workspace, s.workspace, "cublasLtMatmul's workspace"))) {
    free(g);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  g->m = m, g->n = n, g->k = k, g->transa = d->transa, g->transb = d->transb, g->ab = a->type, g->cd = c->type;
  g->lda = a->ld, g->ldb = b->ld, g->ldc = c->ld, g->ldd = dd->ld;
  g->a = A, g->b = B, g->c = C, g->d = D, g->workspace = workspace, g->workspace_bytes = (size_t)s.workspace;
  return fake_enqueue(fs, gemm_fn, g) == 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
