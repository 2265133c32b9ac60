/*
 * postval.c - the paper's optimizer post-validation (section 4) as a protocol: the exchange of the
 * global state along the chain of ranks and the decision taken from it (skip on inf/NaN, the
 * clipping coefficient, the dynamic loss scale).
 *
 * What it is: the one place this logic lives. zb_optimizer_step runs it around its own updates, and
 * the public zb_postval_* calls hand it to a caller that steps its own optimizer (a torch one from
 * the Python binding): begin and end here, the snapshot, the step and the undo there.
 *
 * What it is not: an optimizer. It never sees a parameter or a gradient, only per-stage sums of
 * squares and inf/NaN flags; it keeps no undo copy and cannot undo anything itself. Its only state
 * between iterations is the loss scale, its growth count and the iteration counts, which
 * zb_postval_get_state and zb_postval_set_state hand to and take from a checkpoint.
 *
 * Bit-for-bit reproducibility depends on two rules kept here:
 *  - the global state is exchanged as the whole per-stage vector, not as a running scalar, and the
 *    total norm is always summed over stages 0..S-1 in stage order (decide()). A running scalar
 *    would be summed in chain order, which depends on how stages are spread over ranks; summing the
 *    vector in stage order gives the same bits for any partition, ranks == 1 included. A partial
 *    state is the same vector with the stages not yet seen left at 0 (x + 0.0 == x, so this changes
 *    nothing once they are filled in);
 *  - every path (ranks == 1, synchronous, speculative, redo after a rollback) gets its factor from
 *    decide(), as one float, so the caller's update sees the same multiplier whichever path ran.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define DEFAULT_TIMEOUT_S 300.0

/* What a step does, derived from a (full or partial) global state by decide(). */
typedef struct {
  int nan;      /* inf/NaN in some stage's gradients: skip */
  int clipped;  /* coef < 1 */
  double total; /* global L2 norm of the unscaled gradients; inf when nan */
  float factor; /* every gradient element is multiplied by this: (float)(inv_scale * coef) */
} decision_t;

struct zb_postval {
  zb_postval_config_t cfg;
  const char *owner;  /* NULL: the public API; else the wrapping object ("optimizer") for messages */
  double timeout_s;
  int32_t prev, next; /* the chain neighbours' ranks, -1 at the ends */
  uint8_t *mine;      /* [S]: 1 for the stages this rank holds */

  /* What a checkpoint carries (zb_postval_get_state / zb_postval_set_state); changes only in end. */
  double scale;       /* the loss scale the current gradients carry */
  int64_t good_steps; /* good steps in a row since the scale last changed */
  int64_t steps, skipped, clipped, undone; /* iterations ended, and how many of them did what */

  /* The exchanged vectors, 2*S doubles each: sq[0..S) then flags[0..S) (0.0 or 1.0). `partial`
   * is what this rank sends forward, `full` what comes back; they stay untouched while a send of
   * them may still be in flight, and the transport may write `full` while a receive is posted. */
  double *partial, *full;

  /* Between begin and end. */
  int begun;
  int stepped;         /* begin told the caller to step speculatively */
  float spec_factor;   /* with this factor */
  zb__request_t send_fwd, recv_ret;
};

/* ---- configuration ------------------------------------------------------------------------------ */

zb_status_t zb__postval_check(const zb_postval_config_t *c, const char *owner) {
  /* Comparisons are written so that NaN fails them. */
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
                   "transport is rank %d of %d but the %s config says rank %d of %d",
                   (int)c->transport->rank, (int)c->transport->ranks, owner, (int)c->rank,
                   (int)c->ranks);
  return ZB_OK;
}

zb_status_t zb__postval_create(zb_postval_t **out, const zb_postval_config_t *config,
                               const char *owner) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(config);
  ZB_CHECK(zb__postval_check(config, owner ? owner : "post-validation"));

  zb_postval_t *pv = calloc(1, sizeof *pv);
  if (!pv) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a post-validation handle");
  pv->cfg = *config;
  pv->cfg.struct_size = sizeof(zb_postval_config_t);
  zb__transport_ref(pv->cfg.transport); /* dropped by zb_postval_destroy, the failure path too */
  pv->owner = owner;
  const int32_t S = config->stages, p = config->ranks, r = config->rank;
  pv->timeout_s = config->timeout_s > 0 ? config->timeout_s : DEFAULT_TIMEOUT_S;
  pv->scale = config->loss_scale;

  /* The chain runs toward the rank holding the last stage: 0 -> p-1 in a loop, p-1 -> 0 in a V. */
  const int32_t pos = config->placement == ZB_PLACEMENT_V ? p - 1 - r : r;
  const int32_t dir = config->placement == ZB_PLACEMENT_V ? -1 : 1;
  pv->prev = pos > 0 ? r - dir : -1;
  pv->next = pos < p - 1 ? r + dir : -1;

  pv->mine = calloc((size_t)S, 1);
  pv->partial = calloc(2 * (size_t)S, sizeof(double));
  pv->full = calloc(2 * (size_t)S, sizeof(double));
  if (!pv->mine || !pv->partial || !pv->full) {
    zb_postval_destroy(pv);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating post-validation for %d stages",
                   (int)S);
  }
  for (int32_t s = 0; s < S; s++) pv->mine[s] = zb__placement_rank(config->placement, p, s) == r;
  *out = pv;
  return ZB_OK;
}

zb_status_t zb_postval_create(zb_postval_t **out, const zb_postval_config_t *config) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(config);
  if (config->struct_size < sizeof(zb_postval_config_t) ||
      config->version != ZB_POSTVAL_CONFIG_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "post-validation config has struct_size %u and version %u; this library needs "
                   "%zu and %d (initialise it with ZB_POSTVAL_CONFIG_INIT)",
                   config->struct_size, config->version, sizeof(zb_postval_config_t),
                   ZB_POSTVAL_CONFIG_VERSION);
  return zb__postval_create(out, config, NULL);
}

zb_status_t zb_postval_destroy(zb_postval_t *pv) {
  if (!pv) return ZB_OK;
  if (pv->begun)
    return ZB_FAIL(ZB_ERR_BUSY,
                   "zb_postval_destroy between zb_postval_begin and zb_postval_end: the exchange is "
                   "still in flight; call zb_postval_end first (it returns within the timeout)");
  zb__transport_unref(pv->cfg.transport);
  free(pv->mine);
  free(pv->partial);
  free(pv->full);
  free(pv);
  return ZB_OK;
}

zb_status_t zb_postval_loss_scale(const zb_postval_t *pv, double *out) {
  ZB_ARG_NOT_NULL(pv);
  ZB_ARG_NOT_NULL(out);
  *out = pv->scale;
  return ZB_OK;
}

/* ---- checkpoints ---------------------------------------------------------------------------- */

static zb_status_t check_state_struct(const zb_postval_state_t *s, const char *call) {
  if (s->struct_size < sizeof(zb_postval_state_t) || s->version != ZB_POSTVAL_STATE_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "%s: the state struct has struct_size %u and version %u; this library needs %zu "
                   "and %d (initialise it with ZB_POSTVAL_STATE_INIT)",
                   call, s->struct_size, s->version, sizeof(zb_postval_state_t),
                   ZB_POSTVAL_STATE_VERSION);
  return ZB_OK;
}

zb_status_t zb_postval_get_state(const zb_postval_t *pv, zb_postval_state_t *out) {
  ZB_ARG_NOT_NULL(pv);
  ZB_ARG_NOT_NULL(out);
  ZB_CHECK(check_state_struct(out, "zb_postval_get_state"));
  out->struct_size = sizeof(zb_postval_state_t);
  out->loss_scale = pv->scale;
  out->good_steps = pv->good_steps;
  out->steps = pv->steps;
  out->skipped = pv->skipped;
  out->clipped = pv->clipped;
  out->undone = pv->undone;
  return ZB_OK;
}

zb_status_t zb_postval_set_state(zb_postval_t *pv, const zb_postval_state_t *state) {
  ZB_ARG_NOT_NULL(pv);
  ZB_ARG_NOT_NULL(state);
  ZB_CHECK(check_state_struct(state, "zb_postval_set_state"));
  if (pv->begun)
    return ZB_FAIL(ZB_ERR_BUSY,
                   "zb_postval_set_state on rank %d between zb_postval_begin and zb_postval_end: "
                   "begin decided with the current loss scale; call zb_postval_end first",
                   (int)pv->cfg.rank);
  const zb_postval_state_t *s = state;
  /* Written so that NaN fails it, as the config's checks. */
  if (!(s->loss_scale > 0) || isinf(s->loss_scale))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_postval_set_state: loss_scale is %g; allowed: a finite value > 0",
                   s->loss_scale);
  if (s->good_steps < 0 || s->steps < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_postval_set_state: good_steps is %lld and steps %lld; allowed: >= 0",
                   (long long)s->good_steps, (long long)s->steps);
  const struct {
    const char *name;
    int64_t v;
  } counts[] = {{"skipped", s->skipped}, {"clipped", s->clipped}, {"undone", s->undone}};
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
    if (counts[i].v < 0 || counts[i].v > s->steps)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "zb_postval_set_state: %s is %lld; allowed: 0..steps (%lld)", counts[i].name,
                     (long long)counts[i].v, (long long)s->steps);
  pv->scale = s->loss_scale;
  pv->good_steps = s->good_steps;
  pv->steps = s->steps;
  pv->skipped = s->skipped;
  pv->clipped = s->clipped;
  pv->undone = s->undone;
  return ZB_OK;
}

int zb__postval_speculates(const zb_postval_t *pv) {
  return pv->cfg.post_validation && pv->next >= 0;
}

/* ---- the decision ------------------------------------------------------------------------------- */

/* The decision from a state vector; stages not yet filled in hold 0. Clipping follows torch's
 * clip_grad_norm_: coef = max_norm / (total + 1e-6) when total > max_norm. */
static decision_t decide(const zb_postval_t *pv, const double *vec) {
  const int32_t S = pv->cfg.stages;
  decision_t d = {0, 0, 0.0, 1.0f};
  double sum = 0.0;
  for (int32_t s = 0; s < S; s++) {
    sum += vec[s];
    if (vec[S + s] != 0.0) d.nan = 1;
  }
  const double inv_scale = 1.0 / pv->scale;
  if (d.nan) {
    d.total = INFINITY;
    d.factor = 0.0f;
    return d;
  }
  d.total = sqrt(sum) * inv_scale;
  double coef = 1.0;
  if (pv->cfg.clip_grad > 0 && d.total > pv->cfg.clip_grad) {
    coef = pv->cfg.clip_grad / (d.total + 1e-6);
    d.clipped = 1;
  }
  d.factor = (float)(inv_scale * coef);
  return d;
}

/* The loss scale for the next iteration (torch.cuda.amp.GradScaler's rule), from the full decision,
 * so every rank moves it the same way. */
static void update_scale(zb_postval_t *pv, const decision_t *d) {
  if (d->nan) {
    pv->scale *= pv->cfg.backoff;
    pv->good_steps = 0;
    return;
  }
  pv->good_steps += 1;
  if (pv->cfg.growth_interval > 0 && pv->good_steps >= pv->cfg.growth_interval) {
    pv->scale *= pv->cfg.growth;
    pv->good_steps = 0;
  }
}

/* ---- the exchange ------------------------------------------------------------------------------- */

/* Replaces the message of a failed exchange call with one that says where it happened. */
static zb_status_t exchange_error(const zb_postval_t *pv, const char *call, zb_status_t st,
                                  const char *what, int32_t peer) {
  char inner[1024];
  snprintf(inner, sizeof inner, "%s", zb_last_error());
  return ZB_FAIL(st, "%s%s on rank %d: %s rank %d failed (%s): %s", pv->owner ? pv->owner : call,
                 pv->owner ? " step" : "", (int)pv->cfg.rank, what, (int)peer, zb_status_string(st),
                 inner);
}

/* Drops whatever is still posted and makes the handle ready for the next begin. */
static void reset(zb_postval_t *pv, zb__request_t *extra) {
  zb_transport_t *tr = pv->cfg.transport;
  if (tr) {
    zb__transport_cancel(tr, &pv->send_fwd);
    zb__transport_cancel(tr, &pv->recv_ret);
    if (extra) zb__transport_cancel(tr, extra);
  }
  pv->begun = 0;
  pv->stepped = 0;
  pv->spec_factor = 0.0f;
}

static zb_postval_decision_t idle_decision(const zb_postval_t *pv) {
  zb_postval_decision_t d = {0, 0, 0.0f, 0, 0, 0.0, pv->scale};
  return d;
}

/*
 * The exchange along the chain, numbered as it runs on the rank at position k (zbpp.h's steps 2
 * and 4 are begin and end here; the caller's step sits between 2 and 3):
 *  1. receive the partial state from the predecessor (unless first), fill in this rank's stages;
 *  2. send it to the successor (unless last) and post the receive of the full state from it;
 *     post-validation only, not last: decide from the partial state; the caller steps with it;
 *  3. receive the full state (the last rank already has it) and pass it to the predecessor
 *     straight away, so the ranks before this one are not kept waiting by its own work;
 *  4. decide from the full state: undo the speculative step if it used another factor or should
 *     have been skipped, and step with the full decision if that has not been done yet.
 */
zb_status_t zb_postval_begin(zb_postval_t *pv, const double *sq_norms, const int32_t *nonfinite,
                             zb_postval_decision_t *out) {
  ZB_ARG_NOT_NULL(pv);
  ZB_ARG_NOT_NULL(out);
  *out = idle_decision(pv);
  if (pv->begun)
    return ZB_FAIL(ZB_ERR_BUSY,
                   "zb_postval_begin on rank %d: the previous zb_postval_begin has not been ended; "
                   "call zb_postval_end once after each begin",
                   (int)pv->cfg.rank);
  ZB_ARG_NOT_NULL(sq_norms);
  ZB_ARG_NOT_NULL(nonfinite);
  const int32_t S = pv->cfg.stages;
  for (int32_t s = 0; s < S; s++)
    if (pv->mine[s] && sq_norms[s] < 0)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "zb_postval_begin: sq_norms[%d] is %g; allowed: a sum of squares >= 0 (inf or "
                     "NaN counts as nonfinite)",
                     (int)s, sq_norms[s]);

  zb_transport_t *tr = pv->cfg.transport;
  const int32_t tag_fwd = zb__tag_optim(S, 0), tag_ret = zb__tag_optim(S, 1);
  const size_t bytes = 2 * (size_t)S * sizeof(double);
  zb__request_t recv_fwd = {0};
  zb_status_t st = ZB_OK;
  pv->send_fwd = (zb__request_t){0};
  pv->recv_ret = (zb__request_t){0};

  /* 1 */
  if (pv->prev >= 0) {
    st = zb__transport_irecv(tr, &recv_fwd, pv->prev, tag_fwd, pv->partial, bytes);
    if (st == ZB_OK) st = zb__transport_wait(tr, &recv_fwd, pv->timeout_s);
    if (st != ZB_OK) {
      st = exchange_error(pv, "zb_postval_begin", st, "receiving the partial state from", pv->prev);
      goto fail;
    }
  } else {
    memset(pv->partial, 0, bytes);
  }
  for (int32_t s = 0; s < S; s++)
    if (pv->mine[s]) {
      pv->partial[s] = sq_norms[s];
      pv->partial[S + s] = nonfinite[s] != 0 || !isfinite(sq_norms[s]) ? 1.0 : 0.0;
    }

  /* 2 */
  if (pv->next >= 0) {
    st = zb__transport_isend(tr, &pv->send_fwd, pv->next, tag_fwd, pv->partial, bytes);
    if (st != ZB_OK) {
      st = exchange_error(pv, "zb_postval_begin", st, "sending the partial state to", pv->next);
      goto fail;
    }
    st = zb__transport_irecv(tr, &pv->recv_ret, pv->next, tag_ret, pv->full, bytes);
    if (st != ZB_OK) {
      st = exchange_error(pv, "zb_postval_begin", st, "posting the receive of the full state from",
                          pv->next);
      goto fail;
    }
    if (pv->cfg.post_validation) {
      const decision_t pd = decide(pv, pv->partial);
      if (!pd.nan) {
        pv->stepped = 1;
        pv->spec_factor = pd.factor;
        out->step = 1;
        out->factor = pd.factor;
      }
    }
  }
  pv->begun = 1;
  return ZB_OK;

fail:
  reset(pv, &recv_fwd);
  return st;
}

zb_status_t zb_postval_end(zb_postval_t *pv, zb_postval_decision_t *out) {
  ZB_ARG_NOT_NULL(pv);
  ZB_ARG_NOT_NULL(out);
  *out = idle_decision(pv);
  if (!pv->begun)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_postval_end on rank %d without a zb_postval_begin before it; call begin, "
                   "step if it says so, then end",
                   (int)pv->cfg.rank);

  zb_transport_t *tr = pv->cfg.transport;
  const int32_t S = pv->cfg.stages;
  const int32_t tag_ret = zb__tag_optim(S, 1);
  const size_t bytes = 2 * (size_t)S * sizeof(double);
  zb__request_t send_ret = {0};
  zb_status_t st = ZB_OK;

  /* 3 */
  if (pv->next >= 0) {
    st = zb__transport_wait(tr, &pv->recv_ret, pv->timeout_s);
    if (st != ZB_OK) {
      st = exchange_error(pv, "zb_postval_end", st, "receiving the full state from", pv->next);
      goto fail;
    }
  } else {
    memcpy(pv->full, pv->partial, bytes);
  }
  if (pv->prev >= 0) {
    st = zb__transport_isend(tr, &send_ret, pv->prev, tag_ret, pv->full, bytes);
    if (st != ZB_OK) {
      st = exchange_error(pv, "zb_postval_end", st, "sending the full state to", pv->prev);
      goto fail;
    }
  }

  /* The sends were copied or are on their way; finish their requests before the decision is
   * final, so that a failure still finds everything as it was. */
  if (pv->send_fwd.active && (st = zb__transport_wait(tr, &pv->send_fwd, pv->timeout_s)) != ZB_OK) {
    st = exchange_error(pv, "zb_postval_end", st, "completing the send of the partial state to",
                        pv->next);
    goto fail;
  }
  if (send_ret.active && (st = zb__transport_wait(tr, &send_ret, pv->timeout_s)) != ZB_OK) {
    st = exchange_error(pv, "zb_postval_end", st, "completing the send of the full state to",
                        pv->prev);
    goto fail;
  }

  /* 4 */
  const decision_t fd = decide(pv, pv->full);
  const int undo = pv->stepped && (fd.nan || fd.factor != pv->spec_factor);
  out->undo = undo;
  out->step = (!pv->stepped || undo) && !fd.nan;
  out->factor = fd.factor;
  out->skipped = fd.nan;
  out->clipped = fd.clipped;
  out->grad_norm = fd.total;
  update_scale(pv, &fd);
  out->loss_scale = pv->scale;
  pv->steps += 1;
  pv->skipped += fd.nan;
  pv->clipped += fd.clipped;
  pv->undone += undo;
  reset(pv, NULL);
  return ZB_OK;

fail:
  /* The caller's speculative step (if any) must go; the scale stays as it was. */
  out->undo = pv->stepped;
  reset(pv, &send_ret);
  return st;
}
