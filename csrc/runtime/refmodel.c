/*
 * refmodel.c - the reference model of refmodel.h: residual Linear-GELU-Linear blocks with an MSE
 * loss, run on the host with real F, B (input gradient only) and W (through the W store).
 *
 * What it is: a small, exactly reproducible workload for the runtime's tests and benchmarks. Every
 * number it produces depends only on the configuration, the step and the (stage, microbatch) of the
 * op: parameters come from (seed, stage), data from (seed, step, microbatch), every matrix product
 * goes through zb__host_sgemm and every other loop runs in a fixed order. So the same op gives the
 * same bits in any instance, any partition of the stages and any thread.
 *
 * What it is not: fast, thread-safe, or a general layer library. One instance is driven by one
 * thread at a time (the rank's runner thread), and the W store must hand tokens back on that
 * thread too, as the host W store does. The W store has to be cleared or destroyed before the model
 * is destroyed, since its pending entries point into the model's buffers.
 *
 * Memory: the activations of one (stage, microbatch) live in one "slot" buffer, taken from a pool
 * when F runs and returned when the last of its W-store entries has been released. The pool only
 * grows to the number of slots in flight at once, so a schedule's activation memory (p for 1F1B, m
 * for GPipe) shows up as this model's memory too.
 */
#include "refmodel.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backend/internal.h"
#include "../common/error.h"

/* Every array starts on a 64-byte boundary, and sub-arrays are padded to 16 floats, so that each
 * GEMM sees the same alignment in every instance (a BLAS may pick its kernel by alignment, and a
 * different kernel may sum in a different order). */
#define ALIGN_BYTES 64
#define PAD_FLOATS 16

enum { SLOT_EMPTY = 0, SLOT_FORWARD = 1, SLOT_BACKWARD = 2 };

/* Distinct PRNG streams for the three kinds of data, so that no stream overlaps another. */
enum { TAG_PARAM = 1, TAG_INPUT = 2, TAG_TARGET = 3 };

typedef struct {
  float *buf;      /* activations of this (stage, microbatch); NULL while the slot is empty */
  int state;       /* SLOT_EMPTY, SLOT_FORWARD (F ran), SLOT_BACKWARD (B ran, entries pushed) */
  int64_t pending; /* entries of this slot the W store holds */
  uint8_t *held;   /* 2 * layers flags: entry (block, which) is in the W store */
  float *host;     /* its copy in "host memory" while offloaded, or NULL */
  int offloaded;   /* OFFLOAD ran and its RELOAD has not */
} slot_t;

struct zb__refmodel {
  zb__refmodel_config_t cfg;
  int32_t n_own;
  int32_t *own;   /* the owned stages, as given */
  int32_t *local; /* [S]: index into own/param/grad, or -1 when not owned */
  int64_t n_param;
  float **param, **grad; /* [n_own] arrays of n_param floats */
  /* Offsets (in floats) inside one slot buffer. */
  int64_t off_rd, off_rf; /* padded rows*width and rows*ffn */
  int64_t block_floats;   /* x, h, a, dy of one block */
  int64_t slot_floats;    /* layers blocks, then the edge buffer */
  slot_t *slots;          /* [n_own * m], slot of (local stage l, mb i) at l * m + i */
  uint8_t *held;          /* backing store of every slot's held flags */
  float **pool;           /* free slot buffers */
  int64_t pool_n;         /* how many are in the pool */
  /* PipeOffload (zb__refmodel_copy runs on the runner's copy thread): the lock guards the pool;
   * made counts slot buffers ever allocated (the resident peak), hosted the host copies. */
  pthread_mutex_t pool_mu;
  int pool_mu_made;
  int64_t made, hosted;
  float **hpool; /* free host copies */
  int64_t hpool_n;
  float *scratch;         /* [rows, ffn]: da in B */
  double *loss;           /* [m]: L_i of the current step */
  uint8_t *loss_set;      /* [m]: L_i computed this step */
  int32_t step;
  float loss_scale;
  int64_t pending;
  zb_wstore_t *wstore;
};

/* ---- deterministic random numbers ------------------------------------------------------------ */

/* splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014): a
 * Weyl sequence through a strong 64-bit finaliser. Small, portable and identical everywhere. */
static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static uint64_t rng_next(uint64_t *s) {
  *s += 0x9e3779b97f4a7c15ULL;
  return mix64(*s);
}

/* The starting state of the stream for (seed, tag, a, b); each argument goes through the finaliser
 * so that neighbouring steps, stages or microbatches get unrelated streams. */
static uint64_t rng_stream(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b) {
  uint64_t h = mix64(seed + 0x9e3779b97f4a7c15ULL * tag);
  h = mix64(h ^ mix64(a + 0x632be59bd9b4e019ULL));
  return mix64(h ^ mix64(b + 0x8cb92ba72f3d8dd7ULL));
}

/* n values uniform in [-bound, bound): 24 random bits give u in [0, 1) exactly as a float, and
 * 2u - 1 is exact too, so the only rounding is the final multiplication. */
static void rng_fill(uint64_t *s, float *out, int64_t n, float bound) {
  for (int64_t k = 0; k < n; k++) {
    float u = (float)(rng_next(s) >> 40) * 0x1.0p-24f;
    out[k] = bound * (2.0f * u - 1.0f);
  }
}

/* ---- GELU, tanh form (Hendrycks and Gimpel 2016, section 2; torch's approximate="tanh") ---- */

#define GELU_K 0.7978845608028654 /* sqrt(2 / pi) */
#define GELU_C 0.044715

/* Evaluated in double and rounded once, so the float result is the correctly rounded value of the
 * formula as far as tanh() allows; the same libm gives the same bits everywhere it runs. */
static float gelu(float hf) {
  double h = hf, t = tanh(GELU_K * (h + GELU_C * h * h * h));
  return (float)(0.5 * h * (1.0 + t));
}

/* d gelu / dh = 0.5 (1 + t) + 0.5 h (1 - t^2) k (1 + 3 c h^2), with t = tanh(k (h + c h^3)). */
static double gelu_grad(float hf) {
  double h = hf, t = tanh(GELU_K * (h + GELU_C * h * h * h));
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * h * h);
}

/* ---- sizes ----------------------------------------------------------------------------------- */

/* Overflow-checked int64 arithmetic for sizes from the caller's config. */
static int mul64(int64_t a, int64_t b, int64_t *out) {
  if (a < 0 || b < 0 || (a != 0 && b > INT64_MAX / a)) return 0;
  *out = a * b;
  return 1;
}
static int add64(int64_t a, int64_t b, int64_t *out) {
  if (a < 0 || b < 0 || a > INT64_MAX - b) return 0;
  *out = a + b;
  return 1;
}
static int pad64(int64_t n, int64_t *out) {
  if (!add64(n, PAD_FLOATS - 1, out)) return 0;
  *out -= *out % PAD_FLOATS;
  return 1;
}

/* aligned_alloc wants a size that is a multiple of the alignment. */
static float *alloc_floats(int64_t n) {
  size_t bytes = (size_t)n * sizeof(float);
  bytes = (bytes + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
  return aligned_alloc(ALIGN_BYTES, bytes ? bytes : ALIGN_BYTES);
}

/* Floats of one block's parameters: W1 [f, d], b1 [f], W2 [d, f], b2 [d]. */
static int64_t block_params(const zb__refmodel_config_t *c) {
  return 2 * (int64_t)c->ffn * c->width + c->ffn + c->width;
}

int64_t zb__refmodel_boundary_bytes(const zb__refmodel_config_t *cfg) {
  if (!cfg || cfg->rows < 1 || cfg->width < 1) return 0; /* no valid model has such a boundary */
  return (int64_t)cfg->rows * cfg->width * (int64_t)sizeof(float);
}

/* ---- create / destroy ------------------------------------------------------------------------ */

static zb_status_t check_config(const zb__refmodel_config_t *c) {
  const struct {
    const char *name;
    int32_t value;
  } f[] = {{"stages", c->stages}, {"layers", c->layers},  {"width", c->width},
           {"ffn", c->ffn},       {"rows", c->rows},      {"microbatches", c->microbatches}};
  for (size_t k = 0; k < sizeof f / sizeof f[0]; k++)
    if (f[k].value < 1)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "reference model: %s is %d; stages, layers, width, ffn, rows and microbatches "
                     "must all be >= 1",
                     f[k].name, (int)f[k].value);
  return ZB_OK;
}

/* Writes "0, 2, 5" (the owned stages) into buf, shortened with "..." when long. */
static void format_owned(const zb__refmodel_t *m, char *buf, size_t size) {
  size_t n = 0;
  int32_t k = 0;
  buf[0] = '\0';
  /* Each entry takes at most 13 characters (", " and an int32), so 32 spare always leave room for
   * the entry and a closing ", ...". */
  for (; k < m->n_own && n + 32 < size; k++) {
    int w = snprintf(buf + n, size - n, "%s%d", k ? ", " : "", (int)m->own[k]);
    if (w < 0) return;
    n += (size_t)w;
  }
  if (k < m->n_own) snprintf(buf + n, size - n, ", ...");
}

void zb__refmodel_destroy(zb__refmodel_t *m) {
  if (!m) return;
  if (m->slots)
    for (int64_t k = 0; k < (int64_t)m->n_own * m->cfg.microbatches; k++) free(m->slots[k].buf), free(m->slots[k].host);
  if (m->hpool)
    for (int64_t k = 0; k < m->hpool_n; k++) free(m->hpool[k]);
  free(m->hpool);
  if (m->pool_mu_made) pthread_mutex_destroy(&m->pool_mu);
  if (m->pool)
    for (int64_t k = 0; k < m->pool_n; k++) free(m->pool[k]);
  if (m->param)
    for (int32_t k = 0; k < m->n_own; k++) free(m->param[k]);
  if (m->grad)
    for (int32_t k = 0; k < m->n_own; k++) free(m->grad[k]);
  free(m->param);
  free(m->grad);
  free(m->slots);
  free(m->held);
  free(m->pool);
  free(m->scratch);
  free(m->loss);
  free(m->loss_set);
  free(m->own);
  free(m->local);
  free(m);
}

/* Parameters of one stage from (seed, stage) alone, as torch.nn.Linear initialises them: weights
 * and biases uniform in +-1/sqrt(fan_in). */
static void init_stage(const zb__refmodel_config_t *c, int32_t stage, float *p) {
  uint64_t s = rng_stream(c->seed, TAG_PARAM, (uint64_t)(uint32_t)stage, 0);
  const int64_t d = c->width, f = c->ffn;
  const float bound1 = (float)(1.0 / sqrt((double)d)), bound2 = (float)(1.0 / sqrt((double)f));
  for (int32_t j = 0; j < c->layers; j++) {
    float *w1 = p + j * block_params(c), *b1 = w1 + f * d, *w2 = b1 + f, *b2 = w2 + d * f;
    rng_fill(&s, w1, f * d, bound1);
    rng_fill(&s, b1, f, bound1);
    rng_fill(&s, w2, d * f, bound2);
    rng_fill(&s, b2, d, bound2);
  }
}

zb_status_t zb__refmodel_create(zb__refmodel_t **out, const zb__refmodel_config_t *cfg,
                                const int32_t *own_stages, int32_t n_own) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(cfg);
  ZB_CHECK(check_config(cfg));
  const int32_t S = cfg->stages, M = cfg->microbatches;
  if (n_own < 1 || n_own > S)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model: %d owned stages; an instance owns 1 to %d (the model's "
                   "stages)",
                   (int)n_own, (int)S);
  ZB_ARG_NOT_NULL(own_stages);

  /* Every size the model allocates or encodes in a token, checked for overflow up front. */
  int64_t n_param, rd, rf, t1, t2, block_floats, slot_floats, n_slots, n_held, tokens;
  int ok = mul64(cfg->layers, block_params(cfg), &n_param) &&
           pad64((int64_t)cfg->rows * cfg->width, &rd) &&
           pad64((int64_t)cfg->rows * cfg->ffn, &rf) &&
           mul64(2, rd, &t1) && mul64(2, rf, &t2) && add64(t1, t2, &block_floats) &&
           mul64(cfg->layers, block_floats, &t1) && add64(t1, rd, &slot_floats) &&
           mul64(n_own, M, &n_slots) && mul64(n_slots, 2 * (int64_t)cfg->layers, &n_held) &&
           mul64((int64_t)S * M, 2 * (int64_t)cfg->layers, &tokens) &&
           slot_floats <= INT64_MAX / 2 / (int64_t)sizeof(float) &&
           n_param <= INT64_MAX / 2 / (int64_t)sizeof(float);
  if (!ok || (uint64_t)slot_floats > SIZE_MAX / sizeof(float) ||
      (uint64_t)n_param > SIZE_MAX / sizeof(float))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model too large: layers=%d width=%d ffn=%d rows=%d microbatches=%d "
                   "overflow the sizes of its buffers",
                   (int)cfg->layers, (int)cfg->width, (int)cfg->ffn, (int)cfg->rows, (int)M);

  zb__refmodel_t *m = calloc(1, sizeof(*m));
  if (!m) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating the reference model");
  m->cfg = *cfg;
  m->n_own = n_own;
  m->n_param = n_param;
  m->off_rd = rd;
  m->off_rf = rf;
  m->block_floats = block_floats;
  m->slot_floats = slot_floats;
  m->loss_scale = 1.0f;
  m->own = malloc((size_t)n_own * sizeof(int32_t));
  m->local = malloc((size_t)S * sizeof(int32_t));
  if (!m->own || !m->local) goto oom;
  for (int32_t s = 0; s < S; s++) m->local[s] = -1;
  for (int32_t k = 0; k < n_own; k++) {
    int32_t s = own_stages[k];
    if (s < 0 || s >= S) {
      zb__refmodel_destroy(m);
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "reference model: owned stage %d (entry %d) is outside 0..%d", (int)s, (int)k,
                     (int)(S - 1));
    }
    if (m->local[s] >= 0) {
      zb__refmodel_destroy(m);
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "reference model: stage %d is listed twice among the owned stages", (int)s);
    }
    m->local[s] = k;
    m->own[k] = s;
  }

  m->param = calloc((size_t)n_own, sizeof(float *));
  m->grad = calloc((size_t)n_own, sizeof(float *));
  m->slots = calloc((size_t)n_slots, sizeof(slot_t));
  m->held = calloc((size_t)n_held, 1);
  m->pool = calloc((size_t)n_slots, sizeof(float *));
  m->hpool = calloc((size_t)n_slots, sizeof(float *));
  m->pool_mu_made = pthread_mutex_init(&m->pool_mu, NULL) == 0;
  m->scratch = alloc_floats(rf);
  m->loss = calloc((size_t)M, sizeof(double));
  m->loss_set = calloc((size_t)M, 1);
  if (!m->param || !m->grad || !m->slots || !m->held || !m->pool || !m->hpool || !m->pool_mu_made ||
      !m->scratch || !m->loss || !m->loss_set)
    goto oom;
  for (int64_t k = 0; k < n_slots; k++) m->slots[k].held = m->held + k * 2 * cfg->layers;
  for (int32_t k = 0; k < n_own; k++) {
    m->param[k] = alloc_floats(n_param);
    m->grad[k] = alloc_floats(n_param);
    if (!m->param[k] || !m->grad[k]) goto oom;
    init_stage(cfg, m->own[k], m->param[k]);
    memset(m->grad[k], 0, (size_t)n_param * sizeof(float));
  }
  *out = m;
  return ZB_OK;

oom:
  zb__refmodel_destroy(m);
  return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY,
                 "out of memory creating the reference model (%d stages of %lld parameters)",
                 (int)n_own, (long long)n_param);
}

void zb__refmodel_set_wstore(zb__refmodel_t *m, zb_wstore_t *wstore) {
  if (m) m->wstore = wstore;
}

/* ---- slots ----------------------------------------------------------------------------------- */

/* The arrays of block j inside a slot buffer: x [rows, d] (the block's input), h [rows, f] (before
 * GELU; B overwrites it with dh, which is all that W needs), a [rows, f], dy [rows, d]. */
static float *blk_x(const zb__refmodel_t *m, float *buf, int32_t j) {
  return buf + j * m->block_floats;
}
static float *blk_h(const zb__refmodel_t *m, float *buf, int32_t j) {
  return blk_x(m, buf, j) + m->off_rd;
}
static float *blk_a(const zb__refmodel_t *m, float *buf, int32_t j) {
  return blk_h(m, buf, j) + m->off_rf;
}
static float *blk_dy(const zb__refmodel_t *m, float *buf, int32_t j) {
  return blk_a(m, buf, j) + m->off_rf;
}
/* The edge buffer [rows, d] after the blocks: y - t on the last stage (from F to B), otherwise the
 * stage's output before it is copied out, and in B the gradient for the stage's input. Computing in
 * our own aligned memory and copying keeps the caller's buffer alignment out of the arithmetic. */
static float *edge(const zb__refmodel_t *m, float *buf) {
  return buf + (int64_t)m->cfg.layers * m->block_floats;
}

/* A slot buffer from the pool, or a new one (counted in made); NULL when out of memory. */
static float *pool_take(zb__refmodel_t *m) {
  pthread_mutex_lock(&m->pool_mu);
  float *buf = m->pool_n > 0 ? m->pool[--m->pool_n] : NULL;
  if (!buf && (buf = alloc_floats(m->slot_floats)) != NULL) m->made++;
  pthread_mutex_unlock(&m->pool_mu);
  return buf;
}

static void pool_put(zb__refmodel_t *m, float *buf) {
  pthread_mutex_lock(&m->pool_mu);
  m->pool[m->pool_n++] = buf; /* cannot overflow: at most one buffer per slot exists */
  pthread_mutex_unlock(&m->pool_mu);
}

static void slot_to_pool(zb__refmodel_t *m, slot_t *sl) {
  pool_put(m, sl->buf);
  sl->buf = NULL;
  sl->state = SLOT_EMPTY;
  sl->offloaded = 0;
}

/* Token of W-store entry `which` (0: W2/b2, 1: W1/b1) of block j of (stage, mb). create checked
 * that S * m * layers * 2 fits. */
static uint64_t make_token(const zb__refmodel_t *m, int32_t stage, int32_t mb, int32_t j,
                           int which) {
  return (((uint64_t)stage * (uint64_t)m->cfg.microbatches + (uint64_t)mb) *
              (uint64_t)m->cfg.layers + (uint64_t)j) * 2u + (uint64_t)which;
}

/* Checks (stage, mb) for an op and finds the slot and the local stage index. */
static zb_status_t find_slot(zb__refmodel_t *m, const char *op, int32_t stage, int32_t mb,
                             int32_t *out_local, slot_t **out_slot) {
  if (stage < 0 || stage >= m->cfg.stages)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "reference model %s: stage %d is outside 0..%d", op,
                   (int)stage, (int)(m->cfg.stages - 1));
  if (m->local[stage] < 0) {
    char owned[256];
    format_owned(m, owned, sizeof owned);
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model %s: stage %d is not owned by this instance (it owns stages %s)",
                   op, (int)stage, owned);
  }
  if (mb < 0 || mb >= m->cfg.microbatches)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model %s of stage %d: microbatch %d is outside 0..%d", op, (int)stage,
                   (int)mb, (int)(m->cfg.microbatches - 1));
  *out_local = m->local[stage];
  *out_slot = &m->slots[(int64_t)m->local[stage] * m->cfg.microbatches + mb];
  return ZB_OK;
}

/* ---- step, forward, backward, release -------------------------------------------------------- */

void zb__refmodel_begin_step(zb__refmodel_t *m, int32_t step, float loss_scale) {
  if (!m) return;
  m->step = step;
  m->loss_scale = loss_scale;
  for (int32_t k = 0; k < m->n_own; k++) memset(m->grad[k], 0, (size_t)m->n_param * sizeof(float));
  memset(m->loss, 0, (size_t)m->cfg.microbatches * sizeof(double));
  memset(m->loss_set, 0, (size_t)m->cfg.microbatches);
  /* Activations of forwards whose backward never ran (a failed iteration) belong to the old step;
   * give them back. Slots with entries in the W store stay until the store releases them. */
  for (int64_t k = 0; k < (int64_t)m->n_own * m->cfg.microbatches; k++)
    if (m->slots[k].state == SLOT_FORWARD) {
      if (m->slots[k].offloaded) { /* offloaded and never reloaded: its buffer is in the pool already */
        m->hpool[m->hpool_n++] = m->slots[k].host;
        m->slots[k].host = NULL;
        m->slots[k].state = SLOT_EMPTY, m->slots[k].offloaded = 0;
      }
      else
        slot_to_pool(m, &m->slots[k]);
    }
}

zb_status_t zb__refmodel_forward(void *model, int32_t stage, int32_t mb, const void *input,
                                 void *output) {
  zb__refmodel_t *m = model;
  ZB_ARG_NOT_NULL(model);
  int32_t loc;
  slot_t *sl;
  ZB_CHECK(find_slot(m, "forward", stage, mb, &loc, &sl));
  const zb__refmodel_config_t *c = &m->cfg;
  const int first = stage == 0, last = stage == c->stages - 1;
  if (!first && !input)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model forward of stage %d microbatch %d: input is NULL (only stage 0 "
                   "reads its own data)",
                   (int)stage, (int)mb);
  if (!last && !output)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model forward of stage %d microbatch %d: output is NULL (only the "
                   "last stage, %d, has none)",
                   (int)stage, (int)mb, (int)(c->stages - 1));
  if (sl->pending > 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model forward of stage %d microbatch %d: the slot still has %lld "
                   "W-store entries of the previous use pending (their W has not run and they were "
                   "not released); run or clear the W store first",
                   (int)stage, (int)mb, (long long)sl->pending);
  if (!sl->buf) {
    sl->buf = pool_take(m);
    if (!sl->buf)
      return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY,
                     "reference model forward of stage %d microbatch %d: out of memory for %lld "
                     "bytes of activations",
                     (int)stage, (int)mb, (long long)(m->slot_floats * (int64_t)sizeof(float)));
  }
  sl->state = SLOT_FORWARD;

  const int r = c->rows, d = c->width, f = c->ffn;
  const int64_t rd = (int64_t)r * d, rf = (int64_t)r * f;
  float *buf = sl->buf, *out = edge(m, buf);
  if (first) {
    uint64_t s = rng_stream(c->seed, TAG_INPUT, (uint64_t)(uint32_t)m->step, (uint64_t)mb);
    rng_fill(&s, blk_x(m, buf, 0), rd, 1.0f);
  } else {
    memcpy(blk_x(m, buf, 0), input, (size_t)rd * sizeof(float));
  }
  for (int32_t j = 0; j < c->layers; j++) {
    const float *w1 = m->param[loc] + j * block_params(c), *b1 = w1 + (int64_t)f * d,
                *w2 = b1 + f, *b2 = w2 + (int64_t)d * f;
    const float *x = blk_x(m, buf, j);
    float *h = blk_h(m, buf, j), *a = blk_a(m, buf, j);
    float *y = j + 1 < c->layers ? blk_x(m, buf, j + 1) : out;
    /* h = x W1^T + b1: the bias goes in first and the GEMM accumulates onto it (beta = 1). */
    for (int i = 0; i < r; i++) memcpy(h + (int64_t)i * f, b1, (size_t)f * sizeof(float));
    zb__host_sgemm(0, 1, r, f, d, 1.0f, x, d, w1, d, 1.0f, h, f);
    for (int64_t k = 0; k < rf; k++) a[k] = gelu(h[k]);
    /* y = x + a W2^T + b2 */
    for (int i = 0; i < r; i++)
      for (int k = 0; k < d; k++) y[(int64_t)i * d + k] = x[(int64_t)i * d + k] + b2[k];
    zb__host_sgemm(0, 1, r, d, f, 1.0f, a, f, w2, f, 1.0f, y, d);
  }

  if (!last) {
    memcpy(output, out, (size_t)rd * sizeof(float));
    return ZB_OK;
  }
  /* The last stage keeps y - t for B and records L_i = mean((y - t)^2), summed in double in element
   * order. */
  uint64_t s = rng_stream(c->seed, TAG_TARGET, (uint64_t)(uint32_t)m->step, (uint64_t)mb);
  double sum = 0.0;
  for (int64_t k = 0; k < rd; k++) {
    float t;
    rng_fill(&s, &t, 1, 1.0f);
    out[k] = out[k] - t;
    sum += (double)out[k] * out[k];
  }
  m->loss[mb] = sum / (double)rd;
  m->loss_set[mb] = 1;
  return ZB_OK;
}

/* Pushes one entry, marking it held first so that a store that released it at once would still
 * find it. */
static zb_status_t push_entry(zb__refmodel_t *m, slot_t *sl, int32_t stage, int32_t mb, int32_t j,
                              int which, const float *x, const float *dy, int64_t in, int64_t outf,
                              float *dw, float *db) {
  zb_wgrad_t e;
  memset(&e, 0, sizeof e);
  e.struct_size = sizeof(zb_wgrad_t);
  e.dtype = ZB_DTYPE_F32;
  e.rows = m->cfg.rows;
  e.in_features = in;
  e.out_features = outf;
  e.x = x;
  e.dy = dy;
  e.dw = dw;
  e.db = db;
  e.token = make_token(m, stage, mb, j, which);
  uint8_t *held = &sl->held[2 * j + which];
  *held = 1;
  sl->pending++;
  m->pending++;
  zb_status_t st = zb_wstore_push(m->wstore, &e);
  if (st != ZB_OK && *held) { /* the store did not take it */
    *held = 0;
    sl->pending--;
    m->pending--;
  }
  return st;
}

zb_status_t zb__refmodel_backward(void *model, int32_t stage, int32_t mb, const void *grad_output,
                                  void *grad_input) {
  zb__refmodel_t *m = model;
  ZB_ARG_NOT_NULL(model);
  int32_t loc;
  slot_t *sl;
  ZB_CHECK(find_slot(m, "backward", stage, mb, &loc, &sl));
  const zb__refmodel_config_t *c = &m->cfg;
  const int last = stage == c->stages - 1;
  if (!m->wstore)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model backward of stage %d microbatch %d: no W store; call "
                   "zb__refmodel_set_wstore first",
                   (int)stage, (int)mb);
  if (sl->state != SLOT_FORWARD)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model backward of stage %d microbatch %d: %s", (int)stage, (int)mb,
                   sl->state == SLOT_EMPTY ? "its forward has not run"
                                           : "it already ran and its W-store entries are pending");
  if (sl->offloaded)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model backward of stage %d microbatch %d: its activations are in host memory "
                   "(OFFLOAD ran, its RELOAD has not)", (int)stage, (int)mb);
  if (!last && !grad_output)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model backward of stage %d microbatch %d: grad_output is NULL (only "
                   "the last stage, %d, starts from the loss)",
                   (int)stage, (int)mb, (int)(c->stages - 1));

  const int r = c->rows, d = c->width, f = c->ffn;
  const int64_t rd = (int64_t)r * d, rf = (int64_t)r * f;
  float *buf = sl->buf, *ed = edge(m, buf), *dy_last = blk_dy(m, buf, c->layers - 1);
  if (last) {
    /* dL/dy = 2 (y - t) / (rows d) / m, times the loss scale; the factor is rounded to float once
     * so every element gets the same one. */
    const float k = (float)(2.0 / (double)rd / (double)c->microbatches * (double)m->loss_scale);
    for (int64_t e = 0; e < rd; e++) dy_last[e] = k * ed[e];
  } else {
    memcpy(dy_last, grad_output, (size_t)rd * sizeof(float)); /* valid only during this call */
  }

  zb_status_t st = ZB_OK;
  for (int32_t j = c->layers - 1; j >= 0; j--) {
    const float *w1 = m->param[loc] + j * block_params(c), *w2 = w1 + (int64_t)f * d + f;
    float *dw1 = m->grad[loc] + j * block_params(c), *db1 = dw1 + (int64_t)f * d, *dw2 = db1 + f,
          *db2 = dw2 + (int64_t)d * f;
    const float *x = blk_x(m, buf, j), *a = blk_a(m, buf, j), *dy = blk_dy(m, buf, j);
    float *hd = blk_h(m, buf, j);
    /* da = dy W2 ([r, d] x [d, f]); dh = da * gelu'(h), written over h (nothing needs h later). */
    zb__host_sgemm(0, 0, r, f, d, 1.0f, dy, d, w2, f, 0.0f, m->scratch, f);
    for (int64_t k = 0; k < rf; k++) hd[k] = (float)((double)m->scratch[k] * gelu_grad(hd[k]));
    /* dx = dy + dh W1 ([r, f] x [f, d]): the previous block's dy, or the stage's input gradient. */
    float *dx = j > 0 ? blk_dy(m, buf, j - 1) : (grad_input ? ed : NULL);
    if (dx) {
      memcpy(dx, dy, (size_t)rd * sizeof(float));
      zb__host_sgemm(0, 0, r, d, f, 1.0f, hd, f, w1, d, 1.0f, dx, d);
    }
    /* W's share, in refmodel.h's order: dW2 += dy^T a, db2; then dW1 += dh^T x, db1. */
    st = push_entry(m, sl, stage, mb, j, 0, a, dy, f, d, dw2, db2);
    if (st != ZB_OK) break;
    st = push_entry(m, sl, stage, mb, j, 1, x, hd, d, f, dw1, db1);
    if (st != ZB_OK) break;
  }
  if (st == ZB_OK && grad_input) memcpy(grad_input, ed, (size_t)rd * sizeof(float));
  /* Only now is the slot marked as backwarded: a store that released entries during the pushes
   * must not have handed the buffer back while the blocks below still used it. */
  sl->state = SLOT_BACKWARD;
  if (sl->pending == 0) slot_to_pool(m, sl); /* all released already, or nothing pushed */
  return st;
}

zb_status_t zb__refmodel_release(void *model, uint64_t token, int32_t ran) {
  zb__refmodel_t *m = model;
  if (!m) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s", "zb__refmodel_release: no model");
  const zb__refmodel_config_t *c = &m->cfg;
  /* A token this model did not make, or one released twice, is a bug in whoever pushed it: say so
   * and touch nothing (changing a slot for it would corrupt the bookkeeping of a real one). */
  uint64_t t = token, which = t % 2u;
  t /= 2u;
  uint64_t j = t % (uint64_t)c->layers;
  t /= (uint64_t)c->layers;
  uint64_t mb = t % (uint64_t)c->microbatches, stage = t / (uint64_t)c->microbatches;
  if (stage >= (uint64_t)c->stages || m->local[stage] < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "W-store token %llu is not one of this model's (stage %llu)",
                   (unsigned long long)token, (unsigned long long)stage);
  slot_t *sl = &m->slots[(int64_t)m->local[stage] * c->microbatches + (int64_t)mb];
  uint8_t *held = &sl->held[2 * j + which];
  if (!*held)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "W-store token %llu was released twice", (unsigned long long)token);
  *held = 0;
  sl->pending--;
  m->pending--;
  /* ran = 0 frees the slot as well: the entry is gone from the store either way. */
  if (sl->pending == 0 && sl->state == SLOT_BACKWARD) slot_to_pool(m, sl);
  (void)ran;
  return ZB_OK;
}

/* ---- queries --------------------------------------------------------------------------------- */

double zb__refmodel_loss(const zb__refmodel_t *m) {
  if (!m || m->local[m->cfg.stages - 1] < 0) return NAN;
  double sum = 0.0;
  for (int32_t i = 0; i < m->cfg.microbatches; i++) {
    if (!m->loss_set[i]) return NAN;
    sum += m->loss[i];
  }
  return sum / (double)m->cfg.microbatches;
}

zb_status_t zb__refmodel_stage_params(zb__refmodel_t *m, int32_t stage, float **param, float **grad,
                                      int64_t *n) {
  ZB_ARG_NOT_NULL(m);
  if (stage < 0 || stage >= m->cfg.stages || m->local[stage] < 0) {
    char owned[256];
    format_owned(m, owned, sizeof owned);
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "reference model parameters: stage %d is not owned by this instance (it owns "
                   "stages %s)",
                   (int)stage, owned);
  }
  if (param) *param = m->param[m->local[stage]];
  if (grad) *grad = m->grad[m->local[stage]];
  if (n) *n = m->n_param;
  return ZB_OK;
}

int64_t zb__refmodel_pending_saves(const zb__refmodel_t *m) { return m ? m->pending : 0; }

/* ---- PipeOffload ----------------------------------------------------------------------------- */

zb_status_t zb__refmodel_copy(void *model, int32_t type, int32_t stage, int32_t mb) {
  zb__refmodel_t *m = model;
  ZB_ARG_NOT_NULL(model);
  int32_t loc;
  slot_t *sl;
  const char *what = type == ZB_OP_OFFLOAD ? "OFFLOAD" : "RELOAD";
  ZB_CHECK(find_slot(m, what, stage, mb, &loc, &sl));
  const size_t bytes = (size_t)m->slot_floats * sizeof(float);
  if (type == ZB_OP_OFFLOAD) {
    if (sl->state != SLOT_FORWARD || sl->offloaded)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "reference model OFFLOAD of stage %d microbatch %d: %s", (int)stage,
                     (int)mb, sl->offloaded ? "already offloaded" : "its forward has not run, or its backward has");
    pthread_mutex_lock(&m->pool_mu);
    sl->host = m->hpool_n > 0 ? m->hpool[--m->hpool_n] : NULL;
    if (!sl->host && (sl->host = alloc_floats(m->slot_floats)) != NULL) m->hosted++;
    pthread_mutex_unlock(&m->pool_mu);
    if (!sl->host)
      return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "reference model OFFLOAD: out of memory for %zu bytes", bytes);
    memcpy(sl->host, sl->buf, bytes);
    /* Poisoned before it goes back to the pool: a backward that read it anyway would show. */
    for (int64_t k = 0; k < m->slot_floats; k++) sl->buf[k] = NAN;
    pool_put(m, sl->buf);
    sl->buf = NULL;
    sl->offloaded = 1;
    return ZB_OK;
  }
  if (type != ZB_OP_RELOAD)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "reference model copy: type %d is neither OFFLOAD (%d) nor RELOAD (%d)",
                   (int)type, (int)ZB_OP_OFFLOAD, (int)ZB_OP_RELOAD);
  if (!sl->offloaded)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "reference model RELOAD of stage %d microbatch %d: it is not offloaded",
                   (int)stage, (int)mb);
  float *buf = pool_take(m);
  if (!buf)
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "reference model RELOAD: out of memory for %zu bytes", bytes);
  memcpy(buf, sl->host, bytes);
  pthread_mutex_lock(&m->pool_mu);
  m->hpool[m->hpool_n++] = sl->host; /* cannot overflow: one host copy per slot at most */
  pthread_mutex_unlock(&m->pool_mu);
  sl->host = NULL;
  sl->buf = buf;
  sl->offloaded = 0;
  return ZB_OK;
}

void zb__refmodel_memory(zb__refmodel_t *m, int64_t *resident, int64_t *hosted) {
  pthread_mutex_lock(&m->pool_mu);
  if (resident) *resident = m->made;
  if (hosted) *hosted = m->hosted;
  pthread_mutex_unlock(&m->pool_mu);
}
