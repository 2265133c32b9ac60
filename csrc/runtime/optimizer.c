/*
 * optimizer.c - AdamW and SGD over fp32 host parameters, with clipping by global norm, a dynamic
 * loss scale, and the paper's optimizer post-validation (section 4) across the ranks of a pipeline.
 *
 * What it is: one optimizer per rank over the parameters of that rank's stages. Each step reduces a
 * global state (per stage: the squared L2 norm of the scaled gradients and an inf/NaN flag) along a
 * chain of ranks, decides from it whether to skip the step and how much to clip, updates the
 * parameters and the loss scale. With post-validation a rank steps with the partial state before
 * the full one comes back, and undoes that step exactly when it turns out wrong.
 *
 * What it is not: a device optimizer (parameters, gradients and the exchanged state are host
 * memory; a CUDA backend needs its own update kernels and device-side staging for NCCL), nor an
 * owner of parameters (they are borrowed), nor a master-weight manager for half precision.
 *
 * Bit-for-bit reproducibility is the point of the design, so three rules hold everywhere:
 *  - the update formulas (AdamW, SGD) are written once, in adamw_update/sgd_update, and every path
 *    (ranks == 1, synchronous, speculative, redo after a rollback) calls them with the same float
 *    gradient factor;
 *  - the global state is exchanged as the whole per-stage vector, not as a running scalar, and the
 *    total norm is always summed over stages 0..S-1 in stage order (decide()). A running scalar
 *    would be summed in chain order, which depends on how stages are spread over ranks; summing the
 *    vector in stage order gives the same bits for any partition, ranks == 1 included. A partial
 *    state is the same vector with the stages not yet seen left at 0 (x + 0.0 == x, so this changes
 *    nothing once they are filled in);
 *  - a rollback restores a copy of everything a step changes (parameters, optimizer state, step
 *    count) rather than inverting the update arithmetically, which would not be exact in floats.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define DEFAULT_TIMEOUT_S 300.0

typedef struct {
  int32_t stage;
  float *param;
  const float *grad;
  int64_t numel;
  int64_t offset; /* of this array's first element in the flat state and snapshot */
} entry_t;

/* What a step does, derived from a (full or partial) global state by decide(). */
typedef struct {
  int nan;      /* inf/NaN in some stage's gradients: skip */
  int clipped;  /* coef < 1 */
  double total; /* global L2 norm of the unscaled gradients; inf when nan */
  float factor; /* every gradient element is multiplied by this: (float)(inv_scale * coef) */
} decision_t;

struct zb_optimizer {
  zb_optimizer_config_t cfg;
  double timeout_s;
  int32_t pos;        /* this rank's position in the chain the partial state travels along */
  int32_t prev, next; /* the chain neighbours' ranks, -1 at the ends */
  uint8_t *mine;      /* [S]: 1 for the stages this rank holds */

  entry_t *entries;
  int32_t n_entries, cap_entries;
  int64_t numel; /* all registered elements */

  /* Optimizer state, allocated at the first step: nstate blocks of numel floats (AdamW: m then v;
   * SGD with momentum: the momentum buffer; plain SGD: none). */
  int nstate;
  float *state;
  int64_t t; /* steps applied, not counting skipped ones (AdamW's bias correction, SGD's first step) */
  int started;

  /* Post-validation's undo copy: params then the state blocks, (1 + nstate) * numel floats. Only
   * ranks that speculate (post_validation = 1, not the chain's last) have one. */
  float *snapshot;
  int64_t snapshot_t;

  double scale;       /* the loss scale the current gradients carry */
  int32_t good_steps; /* good steps in a row since the scale last changed */

  /* The exchanged vectors, 2*S doubles each: sq[0..S) then flags[0..S) (0.0 or 1.0). `partial`
   * is what this rank sends forward, `full` what comes back; they stay untouched while a send of
   * them may still be in flight. */
  double *partial, *full;
};

/* ---- placement ---------------------------------------------------------------------------------- */

/* The rank holding a stage (zbpp.h, "the schedule model"); with one rank, every stage. */
static int32_t stage_rank(const zb_optimizer_config_t *c, int32_t s) {
  if (c->ranks == 1) return 0;
  if (c->placement == ZB_PLACEMENT_V) return s < c->ranks ? s : 2 * c->ranks - 1 - s;
  return s % c->ranks;
}

static const char *placement_name(zb_placement_t p) { return p == ZB_PLACEMENT_V ? "v" : "loop"; }

/* ---- configuration ------------------------------------------------------------------------------ */

static zb_status_t check_config(const zb_optimizer_config_t *c) {
  if (c->struct_size < sizeof(zb_optimizer_config_t) || c->version != ZB_OPTIMIZER_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "optimizer config has struct_size %u and version %u; this library needs %zu and "
                   "%d (initialise it with ZB_OPTIMIZER_CONFIG_INIT)",
                   c->struct_size, c->version, sizeof(zb_optimizer_config_t),
                   ZB_OPTIMIZER_CONFIG_VERSION);
  if (c->kind != ZB_OPTIM_SGD && c->kind != ZB_OPTIM_ADAMW)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "optimizer kind is %d; allowed: ZB_OPTIM_SGD (0) or ZB_OPTIM_ADAMW (1)", (int)c->kind);
  /* Comparisons are written so that NaN fails them. */
  if (!(c->lr >= 0) || isinf(c->lr))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "lr is %g; allowed: a finite value >= 0", c->lr);
  if (!(c->weight_decay >= 0) || isinf(c->weight_decay))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "weight_decay is %g; allowed: a finite value >= 0",
                   c->weight_decay);
  if (c->kind == ZB_OPTIM_SGD && !(c->momentum >= 0 && c->momentum < 1))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "SGD momentum is %g; allowed: [0, 1)", c->momentum);
  if (c->kind == ZB_OPTIM_ADAMW) {
    if (!(c->beta1 >= 0 && c->beta1 < 1))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "AdamW beta1 is %g; allowed: [0, 1)", c->beta1);
    if (!(c->beta2 >= 0 && c->beta2 < 1))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "AdamW beta2 is %g; allowed: [0, 1)", c->beta2);
    if (!(c->eps > 0) || isinf(c->eps))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "AdamW eps is %g; allowed: a finite value > 0", c->eps);
  }
  if (isnan(c->clip_grad) || isinf(c->clip_grad))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "clip_grad is %g; allowed: a finite max norm, or <= 0 for no clipping", c->clip_grad);
  if (!(c->loss_scale > 0) || isinf(c->loss_scale))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "loss_scale is %g; allowed: a finite value > 0 (1.0: no scaling)",
                   c->loss_scale);
  if (!(c->backoff > 0 && c->backoff <= 1))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "loss-scale backoff is %g; allowed: (0, 1]", c->backoff);
  if (!(c->growth >= 1) || isinf(c->growth))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "loss-scale growth is %g; allowed: a finite value >= 1",
                   c->growth);
  if (c->growth_interval < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "growth_interval is %d; allowed: >= 0 (0: never grow)",
                   (int)c->growth_interval);
  if (c->post_validation != 0 && c->post_validation != 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "post_validation is %d; allowed: 0 (synchronous) or 1 (post-validation)",
                   (int)c->post_validation);
  if (c->stages < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "stages is %d; allowed: >= 1", (int)c->stages);
  if (c->ranks < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "ranks is %d; allowed: >= 1", (int)c->ranks);
  if (c->rank < 0 || c->rank >= c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank is %d; allowed: 0..%d (ranks is %d)", (int)c->rank,
                   (int)c->ranks - 1, (int)c->ranks);
  if (c->placement != ZB_PLACEMENT_LOOP && c->placement != ZB_PLACEMENT_V)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "placement is %d; allowed: ZB_PLACEMENT_LOOP (0) or ZB_PLACEMENT_V (1)",
                   (int)c->placement);
  if (isnan(c->timeout_s))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "timeout_s is NaN; allowed: seconds, or <= 0 for 300 s");
  if (c->ranks == 1) return ZB_OK;

  /* Several ranks: the stages must fit the placement (S = p*v), and the transport must be this
   * rank's. */
  if (c->placement == ZB_PLACEMENT_V && c->stages != 2 * c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "stages is %d with placement v over %d ranks; a V needs stages = 2 * ranks = %d",
                   (int)c->stages, (int)c->ranks, 2 * (int)c->ranks);
  if (c->placement == ZB_PLACEMENT_LOOP && c->stages % c->ranks != 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "stages is %d with placement loop over %d ranks; stages must be a multiple of ranks",
                   (int)c->stages, (int)c->ranks);
  if (!c->transport)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "transport is NULL with ranks = %d; a transport is needed when ranks > 1",
                   (int)c->ranks);
  if (c->transport->rank != c->rank || c->transport->ranks != c->ranks)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "transport is rank %d of %d but the optimizer config says rank %d of %d",
                   (int)c->transport->rank, (int)c->transport->ranks, (int)c->rank, (int)c->ranks);
  return ZB_OK;
}

zb_status_t zb_optimizer_create(zb_optimizer_t **out, const zb_optimizer_config_t *config) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(config);
  ZB_CHECK(check_config(config));

  zb_optimizer_t *o = calloc(1, sizeof *o);
  if (!o) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating an optimizer");
  o->cfg = *config;
  o->cfg.struct_size = sizeof(zb_optimizer_config_t);
  const int32_t S = config->stages, p = config->ranks, r = config->rank;
  o->timeout_s = config->timeout_s > 0 ? config->timeout_s : DEFAULT_TIMEOUT_S;
  o->scale = config->loss_scale;
  o->nstate = config->kind == ZB_OPTIM_ADAMW ? 2 : config->momentum != 0 ? 1 : 0;

  /* The chain runs toward the rank holding the last stage: 0 -> p-1 in a loop, p-1 -> 0 in a V. */
  o->pos = config->placement == ZB_PLACEMENT_V ? p - 1 - r : r;
  int32_t step = config->placement == ZB_PLACEMENT_V ? -1 : 1;
  o->prev = o->pos > 0 ? r - step : -1;
  o->next = o->pos < p - 1 ? r + step : -1;

  o->mine = calloc((size_t)S, 1);
  o->partial = calloc(2 * (size_t)S, sizeof(double));
  o->full = calloc(2 * (size_t)S, sizeof(double));
  if (!o->mine || !o->partial || !o->full) {
    zb_optimizer_destroy(o);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating an optimizer for %d stages", (int)S);
  }
  for (int32_t s = 0; s < S; s++) o->mine[s] = stage_rank(config, s) == r;
  *out = o;
  return ZB_OK;
}

zb_status_t zb_optimizer_destroy(zb_optimizer_t *o) {
  if (!o) return ZB_OK;
  free(o->mine);
  free(o->entries);
  free(o->state);
  free(o->snapshot);
  free(o->partial);
  free(o->full);
  free(o);
  return ZB_OK;
}

zb_status_t zb_optimizer_loss_scale(const zb_optimizer_t *o, double *out) {
  ZB_ARG_NOT_NULL(o);
  ZB_ARG_NOT_NULL(out);
  *out = o->scale;
  return ZB_OK;
}

zb_status_t zb_optimizer_add(zb_optimizer_t *o, int32_t stage, float *param, const float *grad,
                             int64_t numel) {
  ZB_ARG_NOT_NULL(o);
  ZB_ARG_NOT_NULL(param);
  ZB_ARG_NOT_NULL(grad);
  const zb_optimizer_config_t *c = &o->cfg;
  if (stage < 0 || stage >= c->stages)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_optimizer_add: stage %d; allowed: 0..%d",
                   (int)stage, (int)c->stages - 1);
  if (!o->mine[stage])
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_optimizer_add: stage %d is on rank %d under the %s placement, not on this "
                   "rank %d; add only this rank's stages",
                   (int)stage, (int)stage_rank(c, stage), placement_name(c->placement), (int)c->rank);
  if (numel < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_optimizer_add: numel is %lld; allowed: >= 0",
                   (long long)numel);
  /* The state and the snapshot are sized at the first step, and AdamW's step count is shared by
   * all parameters, so a later parameter would start with the wrong bias correction. */
  if (o->started)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_optimizer_add after the first zb_optimizer_step; register every parameter first");
  /* The snapshot holds three floats per element at most (param + 2 state blocks); its size in
   * bytes must fit a size_t. o->numel stays <= max_elems, so the subtraction cannot wrap. */
  const uint64_t max_elems = (uint64_t)(SIZE_MAX / (3 * sizeof(float)));
  if ((uint64_t)numel > max_elems - (uint64_t)o->numel)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_optimizer_add: %lld more elements would pass the %llu this optimizer can hold",
                   (long long)numel, (unsigned long long)max_elems);
  if (o->n_entries == o->cap_entries) {
    int32_t cap = o->cap_entries ? 2 * o->cap_entries : 8;
    entry_t *e = realloc(o->entries, (size_t)cap * sizeof *e);
    if (!e) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory registering parameters");
    o->entries = e;
    o->cap_entries = cap;
  }
  o->entries[o->n_entries++] = (entry_t){stage, param, grad, numel, o->numel};
  o->numel += numel;
  return ZB_OK;
}

/* ---- the update formulas (each written once) ---------------------------------------------------- */

/* AdamW as torch.optim.AdamW computes it (Loshchilov & Hutter, "Decoupled Weight Decay
 * Regularization", Algorithm 2): the scalars are computed in double from the step count, as torch
 * does in Python, then cast to float; everything per element is float arithmetic.
 *   p = p * (1 - lr*wd);  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
 *   p = p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps) */
static void adamw_update(const zb_optimizer_config_t *c, int64_t t, float factor, float *p, float *m,
                         float *v, const float *grad, int64_t n) {
  const double bc1 = 1.0 - pow(c->beta1, (double)t), bc2 = 1.0 - pow(c->beta2, (double)t);
  const float decay = (float)(1.0 - c->lr * c->weight_decay);
  const float b1 = (float)c->beta1, omb1 = (float)(1.0 - c->beta1);
  const float b2 = (float)c->beta2, omb2 = (float)(1.0 - c->beta2);
  const float step_size = (float)(c->lr / bc1), bc2_sqrt = (float)sqrt(bc2);
  const float eps = (float)c->eps;
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * factor;
    const float mi = b1 * m[i] + omb1 * g;
    const float vi = b2 * v[i] + omb2 * g * g;
    const float pi = p[i] * decay;
    p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    m[i] = mi;
    v[i] = vi;
  }
}

/* SGD as torch.optim.SGD (dampening 0, no Nesterov): g' = g + wd*p; with momentum the buffer starts
 * as g' on the first step and is momentum*buf + g' afterwards; p = p - lr*d. */
static void sgd_update(const zb_optimizer_config_t *c, int64_t t, float factor, float *p, float *buf,
                       const float *grad, int64_t n) {
  const float wd = (float)c->weight_decay, lr = (float)c->lr, mom = (float)c->momentum;
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * factor + wd * p[i];
    float d = g;
    if (buf) {
      buf[i] = t == 1 ? g : mom * buf[i] + g;
      d = buf[i];
    }
    p[i] = p[i] - lr * d;
  }
}

/* Applies one step with the given factor to every registered array. */
static void apply_step(zb_optimizer_t *o, float factor) {
  o->t += 1;
  for (int32_t k = 0; k < o->n_entries; k++) {
    const entry_t *e = &o->entries[k];
    if (o->cfg.kind == ZB_OPTIM_ADAMW)
      adamw_update(&o->cfg, o->t, factor, e->param, o->state + e->offset,
                   o->state + o->numel + e->offset, e->grad, e->numel);
    else
      sgd_update(&o->cfg, o->t, factor, e->param, o->nstate ? o->state + e->offset : NULL, e->grad,
                 e->numel);
  }
}

static void take_snapshot(zb_optimizer_t *o) {
  for (int32_t k = 0; k < o->n_entries; k++) {
    const entry_t *e = &o->entries[k];
    memcpy(o->snapshot + e->offset, e->param, (size_t)e->numel * sizeof(float));
  }
  if (o->nstate)
    memcpy(o->snapshot + o->numel, o->state, (size_t)(o->nstate * o->numel) * sizeof(float));
  o->snapshot_t = o->t;
}

static void restore_snapshot(zb_optimizer_t *o) {
  for (int32_t k = 0; k < o->n_entries; k++) {
    const entry_t *e = &o->entries[k];
    memcpy(e->param, o->snapshot + e->offset, (size_t)e->numel * sizeof(float));
  }
  if (o->nstate)
    memcpy(o->state, o->snapshot + o->numel, (size_t)(o->nstate * o->numel) * sizeof(float));
  o->t = o->snapshot_t;
}

/* ---- the global state and the decision ---------------------------------------------------------- */

/* Writes this rank's stages into a state vector (leaving the others as they are): per stage one
 * double accumulator over its arrays in registration order and their elements in order. */
static void fill_local(const zb_optimizer_t *o, double *vec) {
  const int32_t S = o->cfg.stages;
  double *sq = vec, *flag = vec + S;
  for (int32_t s = 0; s < S; s++)
    if (o->mine[s]) sq[s] = 0.0, flag[s] = 0.0;
  for (int32_t k = 0; k < o->n_entries; k++) {
    const entry_t *e = &o->entries[k];
    double acc = sq[e->stage];
    int bad = 0;
    for (int64_t i = 0; i < e->numel; i++) {
      const float g = e->grad[i];
      bad |= !isfinite(g);
      acc += (double)g * (double)g;
    }
    sq[e->stage] = acc;
    if (bad) flag[e->stage] = 1.0;
  }
}

/* The decision from a state vector; stages not yet filled in hold 0. Clipping follows torch's
 * clip_grad_norm_: coef = max_norm / (total + 1e-6) when total > max_norm. */
static decision_t decide(const zb_optimizer_t *o, const double *vec) {
  const int32_t S = o->cfg.stages;
  decision_t d = {0, 0, 0.0, 1.0f};
  double sum = 0.0;
  for (int32_t s = 0; s < S; s++) {
    sum += vec[s];
    if (vec[S + s] != 0.0) d.nan = 1;
  }
  const double inv_scale = 1.0 / o->scale;
  if (d.nan) {
    d.total = INFINITY;
    d.factor = 0.0f;
    return d;
  }
  d.total = sqrt(sum) * inv_scale;
  double coef = 1.0;
  if (o->cfg.clip_grad > 0 && d.total > o->cfg.clip_grad) {
    coef = o->cfg.clip_grad / (d.total + 1e-6);
    d.clipped = 1;
  }
  d.factor = (float)(inv_scale * coef);
  return d;
}

/* The loss scale for the next iteration (torch.cuda.amp.GradScaler's rule), from the full decision,
 * so every rank moves it the same way. */
static void update_scale(zb_optimizer_t *o, const decision_t *d) {
  if (d->nan) {
    o->scale *= o->cfg.backoff;
    o->good_steps = 0;
    return;
  }
  o->good_steps += 1;
  if (o->cfg.growth_interval > 0 && o->good_steps >= o->cfg.growth_interval) {
    o->scale *= o->cfg.growth;
    o->good_steps = 0;
  }
}

/* First step: allocate the state (zeroed, as torch starts m, v at 0) and, on a rank that
 * speculates, the snapshot. Nothing is allocated after this, however many steps follow. */
static zb_status_t first_step_alloc(zb_optimizer_t *o) {
  size_t n = (size_t)o->numel;
  if (o->nstate) {
    o->state = calloc(n ? (size_t)o->nstate * n : 1, sizeof(float));
    if (!o->state)
      return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the optimizer state of %zu parameters", n);
  }
  if (o->cfg.post_validation && o->next >= 0) {
    o->snapshot = malloc((n ? (size_t)(1 + o->nstate) * n : 1) * sizeof(float));
    if (!o->snapshot) {
      free(o->state);
      o->state = NULL;
      return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY,
                     "out of memory for the post-validation snapshot of %zu parameters", n);
    }
  }
  o->started = 1;
  return ZB_OK;
}

/* ---- the step ----------------------------------------------------------------------------------- */

/* Replaces the message of a failed exchange call with one that says where it happened. */
static zb_status_t exchange_error(const zb_optimizer_t *o, zb_status_t st, const char *what,
                                  int32_t peer) {
  char inner[1024];
  snprintf(inner, sizeof inner, "%s", zb_last_error());
  return ZB_FAIL(st, "optimizer step on rank %d: %s rank %d failed (%s): %s", (int)o->cfg.rank, what,
                 (int)peer, zb_status_string(st), inner);
}

/*
 * The exchange along the chain, numbered as it runs on the rank at position k:
 *  1. receive the partial state from the predecessor (unless first), fill in this rank's stages;
 *  2. send it to the successor (unless last) and post the receive of the full state from it;
 *  3. post-validation only, not last: snapshot and step at once with the partial decision;
 *  4. receive the full state (the last rank already has it) and pass it to the predecessor
 *     straight away, so the ranks before this one are not kept waiting by its own work;
 *  5. decide from the full state; undo the speculative step if it used another factor or should
 *     have been skipped, and step with the full decision if that has not been done yet.
 * On failure, a speculative step is undone, so this rank's parameters, optimizer state and loss
 * scale are as they were before the call. The ranks are then out of step with each other (some may
 * have finished, a channel may hold a message nobody took), as after any failed iteration; the
 * caller decides whether to abort the transport.
 */
static zb_status_t step_chain(zb_optimizer_t *o, zb_step_result_t *res) {
  zb_transport_t *tr = o->cfg.transport;
  const int32_t S = o->cfg.stages;
  const int32_t tag_fwd = zb__tag_optim(S, 0), tag_ret = zb__tag_optim(S, 1);
  const size_t bytes = 2 * (size_t)S * sizeof(double);
  const int speculate = o->cfg.post_validation && o->next >= 0;
  zb__request_t recv_fwd = {0}, send_fwd = {0}, recv_ret = {0}, send_ret = {0};
  zb_status_t st = ZB_OK;
  int stepped = 0;
  decision_t pd = {0, 0, 0.0, 0.0f};

  /* 1 */
  if (o->prev >= 0) {
    st = zb__transport_irecv(tr, &recv_fwd, o->prev, tag_fwd, o->partial, bytes);
    if (st == ZB_OK) st = zb__transport_wait(tr, &recv_fwd, o->timeout_s);
    if (st != ZB_OK) {
      st = exchange_error(o, st, "receiving the partial state from", o->prev);
      goto fail;
    }
  } else {
    memset(o->partial, 0, bytes);
  }
  fill_local(o, o->partial);

  /* 2, 3 */
  if (o->next >= 0) {
    st = zb__transport_isend(tr, &send_fwd, o->next, tag_fwd, o->partial, bytes);
    if (st != ZB_OK) {
      st = exchange_error(o, st, "sending the partial state to", o->next);
      goto fail;
    }
    st = zb__transport_irecv(tr, &recv_ret, o->next, tag_ret, o->full, bytes);
    if (st != ZB_OK) {
      st = exchange_error(o, st, "posting the receive of the full state from", o->next);
      goto fail;
    }
    if (speculate) {
      pd = decide(o, o->partial);
      if (!pd.nan) {
        take_snapshot(o);
        apply_step(o, pd.factor);
        stepped = 1;
      }
    }
    /* 4 */
    st = zb__transport_wait(tr, &recv_ret, o->timeout_s);
    if (st != ZB_OK) {
      st = exchange_error(o, st, "receiving the full state from", o->next);
      goto fail;
    }
  } else {
    memcpy(o->full, o->partial, bytes);
  }
  if (o->prev >= 0) {
    st = zb__transport_isend(tr, &send_ret, o->prev, tag_ret, o->full, bytes);
    if (st != ZB_OK) {
      st = exchange_error(o, st, "sending the full state to", o->prev);
      goto fail;
    }
  }

  /* The sends were copied or are on their way; finish their requests before the step is final,
   * so that a failure still finds everything as it was. */
  if (send_fwd.active && (st = zb__transport_wait(tr, &send_fwd, o->timeout_s)) != ZB_OK) {
    st = exchange_error(o, st, "completing the send of the partial state to", o->next);
    goto fail;
  }
  if (send_ret.active && (st = zb__transport_wait(tr, &send_ret, o->timeout_s)) != ZB_OK) {
    st = exchange_error(o, st, "completing the send of the full state to", o->prev);
    goto fail;
  }

  /* 5 */
  const decision_t fd = decide(o, o->full);
  if (stepped && (fd.nan || fd.factor != pd.factor)) {
    restore_snapshot(o);
    stepped = 0;
    res->rolled_back = 1;
  }
  if (!stepped && !fd.nan) apply_step(o, fd.factor);
  update_scale(o, &fd);
  res->skipped = fd.nan;
  res->clipped = fd.clipped;
  res->grad_norm = fd.total;
  res->loss_scale = o->scale;
  return ZB_OK;

fail:
  zb__transport_cancel(tr, &recv_fwd);
  zb__transport_cancel(tr, &send_fwd);
  zb__transport_cancel(tr, &recv_ret);
  zb__transport_cancel(tr, &send_ret);
  if (stepped) restore_snapshot(o);
  return st;
}

zb_status_t zb_optimizer_step(zb_optimizer_t *o, zb_step_result_t *out) {
  ZB_ARG_NOT_NULL(o);
  ZB_ARG_NOT_NULL(out);
  memset(out, 0, sizeof *out);
  if (!o->started) ZB_CHECK(first_step_alloc(o));
  zb_step_result_t res = {0, 0, 0, 0.0, 0.0};
  if (o->cfg.ranks > 1) {
    ZB_CHECK(step_chain(o, &res));
  } else {
    /* One rank holds every stage: no exchange and nothing to speculate on. */
    fill_local(o, o->full);
    const decision_t d = decide(o, o->full);
    if (!d.nan) apply_step(o, d.factor);
    update_scale(o, &d);
    res.skipped = d.nan;
    res.clipped = d.clipped;
    res.grad_norm = d.total;
    res.loss_scale = o->scale;
  }
  *out = res;
  return ZB_OK;
}
