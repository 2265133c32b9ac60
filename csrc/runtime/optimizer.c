/*
 * optimizer.c - AdamW and SGD over fp32 host parameters, with clipping by global norm, a dynamic
 * loss scale, and the paper's optimizer post-validation (section 4) across the ranks of a pipeline.
 *
 * What it is: one optimizer per rank over the parameters of that rank's stages. Each step computes
 * this rank's part of the global state (per stage: the squared L2 norm of the scaled gradients and
 * an inf/NaN flag) and hands it to its post-validation handle (postval.c), which reduces it along
 * the chain of ranks and decides whether to skip the step, how much to clip, and the loss scale;
 * this file applies the updates. With post-validation a rank steps with the partial state before
 * the full one comes back, and undoes that step exactly when the handle says it turned out wrong.
 *
 * What it is not: a device optimizer (parameters, gradients and the exchanged state are host
 * memory; for device parameters, zb_postval with zb_optim_step runs the same formulas on the CUDA
 * backend), nor an owner of parameters (they are borrowed), nor a master-weight manager for half
 * precision.
 *
 * Bit-for-bit reproducibility is the point of the design, so three rules hold everywhere:
 *  - the update formulas (AdamW, SGD) are written once, in the optimizer kernels' host reference
 *    (csrc/backend/reference.c, which the CUDA kernels match bit for bit), and every path (ranks ==
 *    1, synchronous, speculative, redo after a rollback) calls them through apply_step with the same
 *    float gradient factor;
 *  - each stage's squared norm is one double accumulator over its arrays in registration order
 *    (fill_local, through the same reference as zb_sq_norm), and postval.c sums the stages in
 *    stage order whatever the partition of stages over ranks (its header comment says why);
 *  - a rollback restores a copy of everything a step changes (parameters, optimizer state, step
 *    count) rather than inverting the update arithmetically, which would not be exact in floats.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../backend/reference.h"
#include "internal.h"

typedef struct {
  int32_t stage;
  float *param;
  const float *grad;
  int64_t numel;
  int64_t offset; /* of this array's first element in the flat state and snapshot */
} entry_t;

struct zb_optimizer {
  zb_optimizer_config_t cfg;
  zb_postval_t *pv; /* the exchange, the decision and the loss scale */

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

  /* This rank's part of the global state, [S] each, read by zb_postval_begin for its stages. */
  double *sq;
  int32_t *bad;
};

static const char *placement_name(zb_placement_t p) { return p == ZB_PLACEMENT_V ? "v" : "loop"; }

/* ---- configuration ------------------------------------------------------------------------------ */

/* The post-validation part of an optimizer config. */
static zb_postval_config_t postval_config(const zb_optimizer_config_t *c) {
  zb_postval_config_t pc = ZB_POSTVAL_CONFIG_INIT;
  pc.clip_grad = c->clip_grad;
  pc.loss_scale = c->loss_scale, pc.backoff = c->backoff, pc.growth = c->growth;
  pc.growth_interval = c->growth_interval;
  pc.post_validation = c->post_validation;
  pc.stages = c->stages, pc.rank = c->rank, pc.ranks = c->ranks;
  pc.placement = c->placement;
  pc.transport = c->transport;
  pc.timeout_s = c->timeout_s;
  return pc;
}

/* The optimizer's own fields here; the rest (loss scale, clipping, the pipeline) are
 * post-validation's, checked by the same code that checks zb_postval_create's config. */
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
  zb_postval_config_t pc = postval_config(c);
  return zb__postval_check(&pc, "optimizer");
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
  const int32_t S = config->stages;
  o->nstate = config->kind == ZB_OPTIM_ADAMW ? 2 : config->momentum != 0 ? 1 : 0;

  const zb_postval_config_t pc = postval_config(config);
  zb_status_t st = zb__postval_create(&o->pv, &pc, "optimizer");
  if (st != ZB_OK) {
    zb_optimizer_destroy(o);
    return st;
  }
  o->sq = calloc((size_t)S, sizeof(double));
  o->bad = calloc((size_t)S, sizeof(int32_t));
  if (!o->sq || !o->bad) {
    zb_optimizer_destroy(o);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating an optimizer for %d stages", (int)S);
  }
  *out = o;
  return ZB_OK;
}

zb_status_t zb_optimizer_destroy(zb_optimizer_t *o) {
  if (!o) return ZB_OK;
  /* The optimizer's handle is never left between begin and end, so this cannot be busy. */
  zb_postval_destroy(o->pv);
  free(o->entries);
  free(o->state);
  free(o->snapshot);
  free(o->sq);
  free(o->bad);
  free(o);
  return ZB_OK;
}

zb_status_t zb_optimizer_loss_scale(const zb_optimizer_t *o, double *out) {
  ZB_ARG_NOT_NULL(o);
  ZB_ARG_NOT_NULL(out);
  return zb_postval_loss_scale(o->pv, out);
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
  const int32_t owner = zb__placement_rank(c->placement, c->ranks, stage);
  if (owner != c->rank)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_optimizer_add: stage %d is on rank %d under the %s placement, not on this "
                   "rank %d; add only this rank's stages",
                   (int)stage, (int)owner, placement_name(c->placement), (int)c->rank);
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

/* ---- the update formulas ------------------------------------------------------------------------ */

/* One step with the given factor over every registered array. The formulas (AdamW, SGD) are the
 * optimizer kernels' host reference (csrc/backend/reference.c), so this optimizer, zb_optim_step on
 * the host backend and the CUDA kernels run one formula: the scalars come from zb__optim_scalars
 * (double from the step count t, rounded to float once) and every element gets the same sequence of
 * float operations. */
static void apply_step(zb_optimizer_t *o, float factor) {
  const zb_optimizer_config_t *c = &o->cfg;
  o->t += 1;
  zb_optim_step_t s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.version = ZB_OPTIM_STEP_VERSION;
  s.kind = c->kind;
  s.lr = c->lr, s.momentum = c->momentum, s.beta1 = c->beta1, s.beta2 = c->beta2;
  s.eps = c->eps, s.weight_decay = c->weight_decay;
  s.step = o->t;
  s.factor = factor;
  s.grad_dtype = ZB_DTYPE_F32;
  for (int32_t k = 0; k < o->n_entries; k++) {
    const entry_t *e = &o->entries[k];
    /* One-tensor lists; the reference only reads the gradient, so dropping its const is safe. */
    void *param = e->param, *grad = (void *)(uintptr_t)e->grad;
    void *m = o->nstate >= 1 ? o->state + e->offset : NULL;
    void *v = o->nstate >= 2 ? o->state + o->numel + e->offset : NULL;
    s.params = (zb_tensor_list_t){1, &param, &e->numel};
    s.grads = (zb_tensor_list_t){1, &grad, &e->numel};
    s.state1 = (zb_tensor_list_t){o->nstate >= 1, &m, &e->numel};
    s.state2 = (zb_tensor_list_t){o->nstate >= 2, &v, &e->numel};
    zb__ref_optim_step(&s);
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

/* ---- this rank's part of the global state ------------------------------------------------------ */

/* Fills o->sq and o->bad for this rank's stages (the others stay 0 and are not read): per stage one
 * double accumulator over its arrays in registration order and their elements in order. */
static void fill_local(zb_optimizer_t *o) {
  const int32_t S = o->cfg.stages;
  for (int32_t s = 0; s < S; s++) o->sq[s] = 0.0, o->bad[s] = 0;
  for (int32_t k = 0; k < o->n_entries; k++) {
    const entry_t *e = &o->entries[k];
    void *grad = (void *)(uintptr_t)e->grad; /* read only */
    const zb_tensor_list_t one = {1, &grad, &e->numel};
    zb__ref_sq_norm(ZB_DTYPE_F32, &one, &o->sq[e->stage], &o->bad[e->stage]);
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
  if (zb__postval_speculates(o->pv)) {
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

/*
 * The post-validation protocol (zbpp.h, "post-validation for an optimizer the caller runs") with
 * this optimizer as the caller: begin exchanges the partial state and may say to step at once;
 * then snapshot and step; end brings the full state and says whether to undo and whether to step
 * (again). With ranks == 1 the same calls exchange nothing.
 * On failure, a speculative step is undone, so this rank's parameters, optimizer state and loss
 * scale are as they were before the call. The ranks are then out of step with each other (some may
 * have finished, a channel may hold a message nobody took), as after any failed iteration; the
 * caller decides whether to abort the transport.
 */
zb_status_t zb_optimizer_step(zb_optimizer_t *o, zb_step_result_t *out) {
  ZB_ARG_NOT_NULL(o);
  ZB_ARG_NOT_NULL(out);
  memset(out, 0, sizeof *out);
  if (!o->started) ZB_CHECK(first_step_alloc(o));
  zb_step_result_t res = {0, 0, 0, 0.0, 0.0};
  zb_postval_decision_t d;

  fill_local(o);
  ZB_CHECK(zb_postval_begin(o->pv, o->sq, o->bad, &d));
  if (d.step) {
    take_snapshot(o);
    apply_step(o, d.factor);
  }
  const zb_status_t st = zb_postval_end(o->pv, &d);
  if (d.undo) {
    restore_snapshot(o);
    res.rolled_back = 1;
  }
  if (st != ZB_OK) return st;
  if (d.step) apply_step(o, d.factor);
  res.skipped = d.skipped;
  res.clipped = d.clipped;
  res.grad_norm = d.grad_norm;
  res.loss_scale = d.loss_scale;
  *out = res;
  return ZB_OK;
}
