/*
 * reference.c - the host references of the optimizer kernels (reference.h): what the host backend
 * runs for zb_sq_norm, zb_unscale, zb_loss_scale_update, zb_optim_step and zb_optim_undo, what
 * zb_optimizer's updates call, and the oracle of the GPU tests.
 *
 * The per-element optimizer arithmetic is written one IEEE operation per statement. ISO C lets a
 * compiler contract a*b + c within one expression into a fused multiply-add (clang does so by
 * default where the target has FMA), which rounds once instead of twice; a statement boundary forbids
 * it, and the pragma below says so again. GCC fuses across statements too, but only in GNU C mode
 * (-ffp-contract=fast): the build is ISO C11, and the check below keeps it so. kernels/optim.cu runs
 * the same operations in the same order with __fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn, which are
 * never contracted either, so fp32 results agree bit for bit (NaN payloads aside: which NaN an
 * operation passes on is not specified). Change one and you must change the other (the GPU test
 * gpu_kernels.c compares them).
 *
 * What this is not: fast. Arguments were checked by the public entry points (ops.c).
 */
#include "reference.h"

#include <math.h>
#include <string.h>

#include "internal.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__) && !defined(__STRICT_ANSI__)
#error "compile reference.c as ISO C (-std=c11): in GNU C mode GCC fuses a*b + c across statements"
#endif

float zb__load_elem(const void *base, zb_dtype_t dtype, int64_t i) {
  switch (dtype) {
    case ZB_DTYPE_F16: return zb__half_to_float(((const uint16_t *)base)[i]);
    case ZB_DTYPE_BF16: return zb__bf16_to_float(((const uint16_t *)base)[i]);
    case ZB_DTYPE_F32: break;
  }
  return ((const float *)base)[i];
}

/* Rounds v to dtype (nearest even), stores it as element i, and says whether what was stored is inf
 * or NaN (an all-ones exponent), so an fp32 value that overflows the half type counts. */
static int store_elem(void *base, zb_dtype_t dtype, int64_t i, float v) {
  uint16_t h;
  switch (dtype) {
    case ZB_DTYPE_F16:
      h = zb__float_to_half(v);
      ((uint16_t *)base)[i] = h;
      return (h & 0x7c00u) == 0x7c00u;
    case ZB_DTYPE_BF16:
      h = zb__float_to_bf16(v);
      ((uint16_t *)base)[i] = h;
      return (h & 0x7f80u) == 0x7f80u;
    case ZB_DTYPE_F32: break;
  }
  ((float *)base)[i] = v;
  return !isfinite(v);
}

/* One accumulator for the whole list, in list order, as zb_optimizer's per-stage norm. Widening a
 * float to double and squaring it is exact (24 + 24 significant bits fit 53), so the only rounding
 * is in the additions. */
void zb__ref_sq_norm(zb_dtype_t dtype, const zb_tensor_list_t *t, double *sq, int32_t *nonfinite) {
  double acc = *sq;
  int bad = 0;
  for (int32_t k = 0; k < t->count; k++) {
    const int64_t n = t->numels[k];
    const void *base = t->ptrs[k];
    if (dtype == ZB_DTYPE_F32) {
      const float *x = base;
      for (int64_t i = 0; i < n; i++) {
        bad |= !isfinite(x[i]);
        acc += (double)x[i] * (double)x[i];
      }
    } else {
      for (int64_t i = 0; i < n; i++) {
        const float x = zb__load_elem(base, dtype, i);
        bad |= !isfinite(x);
        acc += (double)x * (double)x;
      }
    }
  }
  *sq = acc;
  if (bad) *nonfinite = 1;
}

/* torch's _amp_foreach_non_finite_check_and_unscale_, except that the flag looks at the result as
 * stored (zbpp.h): an inf/NaN input still gives an inf/NaN result for any finite factor. */
void zb__ref_unscale(zb_dtype_t dtype, const zb_tensor_list_t *t, float factor, int32_t *nonfinite) {
  int bad = 0;
  for (int32_t k = 0; k < t->count; k++) {
    void *base = t->ptrs[k];
    for (int64_t i = 0; i < t->numels[k]; i++) {
      const float x = zb__load_elem(base, dtype, i);
      const float r = x * factor;
      bad |= store_elem(base, dtype, i, r);
    }
  }
  if (bad) *nonfinite = 1;
}

/* torch's _amp_update_scale_ (aten/src/ATen/native/cuda/AmpKernels.cu): the products are taken in
 * double (the factors are doubles there too) and rounded to float once. The tracker comparison is
 * >= rather than torch's ==, the same for every tracker value GradScaler itself produces (0 ..
 * interval - 1) and safe for a caller whose interval shrank. */
void zb__ref_scale_update(float *scale, int32_t *tracker, const int32_t *nonfinite, double growth,
                          double backoff, int32_t interval) {
  if (*nonfinite) {
    *scale = (float)((double)*scale * backoff);
    *tracker = 0;
    return;
  }
  const int32_t good = *tracker + 1;
  if (good >= interval) {
    const float grown = (float)((double)*scale * growth);
    if (isfinite(grown)) *scale = grown;
    *tracker = 0;
  } else {
    *tracker = good;
  }
}

int zb__optim_nstate(const zb_optim_step_t *s) {
  if (s->kind == ZB_OPTIM_ADAMW) return 2;
  return s->momentum != 0 ? 1 : 0;
}

/* Exactly the expressions zb_optimizer has always used, so its bits do not change. The AdamW
 * scalars are left 0 for SGD (its betas are not checked and need not be valid). */
zb__optim_scalars_t zb__optim_scalars(const zb_optim_step_t *s) {
  zb__optim_scalars_t k;
  memset(&k, 0, sizeof k);
  k.lr = (float)s->lr;
  k.eps = (float)s->eps;
  k.wd = (float)s->weight_decay;
  k.momentum = (float)s->momentum;
  k.first = s->step == 1;
  if (s->kind == ZB_OPTIM_ADAMW) {
    const double t = (double)s->step;
    const double bc1 = 1.0 - pow(s->beta1, t), bc2 = 1.0 - pow(s->beta2, t);
    k.decay = (float)(1.0 - s->lr * s->weight_decay);
    k.b1 = (float)s->beta1, k.omb1 = (float)(1.0 - s->beta1);
    k.b2 = (float)s->beta2, k.omb2 = (float)(1.0 - s->beta2);
    k.step_size = (float)(s->lr / bc1);
    k.bc2_sqrt = (float)sqrt(bc2);
  }
  return k;
}

/* AdamW as torch.optim.AdamW computes it (Loshchilov & Hutter, "Decoupled Weight Decay
 * Regularization", Algorithm 2), with the scalars of zb__optim_scalars:
 *   g = grad * factor
 *   m = b1*m + (1-b1)*g;  v = b2*v + ((1-b2)*g)*g;  p = p * (1 - lr*wd)
 *   p = p - (step_size * m) / (sqrt(v) / sqrt(1 - b2^t) + eps),  step_size = lr / (1 - b1^t)
 * With u set, the old p, m, v go to u[i], u[total + i], u[2 total + i] first. */
static void adamw_elems(const zb__optim_scalars_t *k, float factor, zb_dtype_t gd, float *p,
                        float *m, float *v, const void *grad, int64_t n, float *u, int64_t total) {
  for (int64_t i = 0; i < n; i++) {
    const float p0 = p[i], m0 = m[i], v0 = v[i];
    if (u) {
      u[i] = p0;
      u[total + i] = m0;
      u[2 * total + i] = v0;
    }
    const float gw = zb__load_elem(grad, gd, i);
    const float g = gw * factor;
    const float m_a = k->b1 * m0;
    const float m_b = k->omb1 * g;
    const float m1 = m_a + m_b;
    const float v_a = k->b2 * v0;
    const float v_g = k->omb2 * g;
    const float v_b = v_g * g;
    const float v1 = v_a + v_b;
    const float pd = p0 * k->decay;
    const float root = sqrtf(v1);
    const float scaled = root / k->bc2_sqrt;
    const float den = scaled + k->eps;
    const float num = k->step_size * m1;
    const float upd = num / den;
    p[i] = pd - upd;
    m[i] = m1;
    v[i] = v1;
  }
}

/* SGD as torch.optim.SGD (dampening 0, no Nesterov): g' = grad*factor + wd*p; with momentum the
 * buffer starts as g' at step 1 and is momentum*buf + g' afterwards; p = p - lr*d, d the buffer or
 * g'. With u set, the old p (and buffer) go to u[i] (and u[total + i]) first. */
static void sgd_elems(const zb__optim_scalars_t *k, float factor, zb_dtype_t gd, float *p,
                      float *buf, const void *grad, int64_t n, float *u, int64_t total) {
  for (int64_t i = 0; i < n; i++) {
    const float p0 = p[i];
    if (u) u[i] = p0;
    const float gw = zb__load_elem(grad, gd, i);
    const float gs = gw * factor;
    const float wdp = k->wd * p0;
    const float g = gs + wdp;
    float d = g;
    if (buf) {
      const float b0 = buf[i];
      if (u) u[total + i] = b0;
      if (!k->first) {
        const float mb = k->momentum * b0;
        d = mb + g;
      }
      buf[i] = d;
    }
    const float step = k->lr * d;
    p[i] = p0 - step;
  }
}

static int64_t list_total(const zb_tensor_list_t *t) {
  int64_t total = 0;
  for (int32_t j = 0; j < t->count; j++) total += t->numels[j];
  return total;
}

void zb__ref_optim_step(const zb_optim_step_t *s) {
  const zb__optim_scalars_t k = zb__optim_scalars(s);
  const int nstate = zb__optim_nstate(s);
  const int64_t total = s->undo ? list_total(&s->params) : 0;
  int64_t off = 0;
  for (int32_t j = 0; j < s->params.count; j++) {
    const int64_t n = s->params.numels[j];
    if (n == 0) continue;
    float *p = s->params.ptrs[j];
    float *m = nstate >= 1 ? (float *)s->state1.ptrs[j] : NULL;
    float *v = nstate >= 2 ? (float *)s->state2.ptrs[j] : NULL;
    float *u = s->undo ? s->undo + off : NULL;
    if (s->kind == ZB_OPTIM_ADAMW)
      adamw_elems(&k, s->factor, s->grad_dtype, p, m, v, s->grads.ptrs[j], n, u, total);
    else
      sgd_elems(&k, s->factor, s->grad_dtype, p, m, s->grads.ptrs[j], n, u, total);
    off += n;
  }
}

void zb__ref_optim_undo(const zb_optim_step_t *s) {
  const int nstate = zb__optim_nstate(s);
  const int64_t total = list_total(&s->params);
  int64_t off = 0;
  for (int32_t j = 0; j < s->params.count; j++) {
    const int64_t n = s->params.numels[j];
    if (n == 0) continue;
    const size_t bytes = (size_t)n * sizeof(float);
    memcpy(s->params.ptrs[j], s->undo + off, bytes);
    if (nstate >= 1) memcpy(s->state1.ptrs[j], s->undo + total + off, bytes);
    if (nstate >= 2) memcpy(s->state2.ptrs[j], s->undo + 2 * total + off, bytes);
    off += n;
  }
}
