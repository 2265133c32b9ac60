/*
 * test_ops.c - the argument checks of the optimizer kernels' entry points (csrc/backend/ops.c):
 * every bad argument of zb_sq_norm, zb_unscale, zb_loss_scale_update, zb_optim_step, zb_optim_undo
 * and zb_optim_undo_bytes fails with ZB_ERR_INVALID_ARGUMENT and a message that names the call,
 * the field, its value and what is allowed, and nothing is changed. What the calls compute is
 * test_kernels_ref.c's.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

/* An AdamW step over four fp32 parameters of 1, 3, 1000 and 0 elements. Every list has its own
 * numels array, so a test can break one list's without the others following. */
enum { NPARAM = 4, NTOTAL = 1004 };
static const int64_t kParamSizes[NPARAM] = {1, 3, 1000, 0};
typedef struct {
  float p[NTOTAL], g[NTOTAL], m[NTOTAL], v[NTOTAL];
  void *pp[NPARAM], *gp[NPARAM], *mp[NPARAM], *vp[NPARAM];
  int64_t pn[NPARAM], gn[NPARAM], mn[NPARAM], vn[NPARAM];
  zb_optim_step_t s;
} fix_t;

static fix_t *fix_make(void) {
  fix_t *f = calloc(1, sizeof *f);
  assert_non_null(f);
  for (int64_t i = 0; i < NTOTAL; i++) f->p[i] = urand(5, 0, (uint64_t)i, 0), f->g[i] = 0.5f;
  for (int k = 0, off = 0; k < NPARAM; off += (int)kParamSizes[k], k++) {
    f->pp[k] = f->p + off, f->gp[k] = f->g + off, f->mp[k] = f->m + off, f->vp[k] = f->v + off;
    f->pn[k] = f->gn[k] = f->mn[k] = f->vn[k] = kParamSizes[k];
  }
  zb_optim_step_t s = {sizeof(zb_optim_step_t), ZB_OPTIM_STEP_VERSION, ZB_OPTIM_ADAMW, 1e-2, 0.0, 0.9,
                       0.999, 1e-8, 0.01, 1, 1.0f, ZB_DTYPE_F32, {NPARAM, f->pp, f->pn},
                       {NPARAM, f->gp, f->gn}, {NPARAM, f->mp, f->mn}, {NPARAM, f->vp, f->vn}, NULL};
  f->s = s;
  return f;
}

#define EXPECT_INVALID(call, text)                                                                 \
  do {                                                                                             \
    ASSERT_STATUS(call, ZB_ERR_INVALID_ARGUMENT);                                                  \
    ASSERT_CONTAINS(zb_last_error(), text);                                                        \
  } while (0)

static void test_bad_list_arguments(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  float x[4] = {1, 2, 3, 4};
  void *ptrs[2] = {x, NULL};
  int64_t numels[2] = {4, 0};
  zb_tensor_list_t l = {2, ptrs, numels};
  double sq = 0;
  int32_t bad = 0;
  ZB_ASSERT_OK(zb_sq_norm(be, ZB_DTYPE_F32, &l, &sq, &bad)); /* NULL is fine for an empty tensor */
  assert_true(sq == 30.0);
  EXPECT_INVALID(zb_sq_norm(NULL, ZB_DTYPE_F32, &l, &sq, &bad), "zb_sq_norm: argument 'be' is NULL");
  EXPECT_INVALID(zb_sq_norm(be, ZB_DTYPE_F32, &l, NULL, &bad), "argument 'sq_out' is NULL");
  EXPECT_INVALID(zb_sq_norm(be, ZB_DTYPE_F32, &l, &sq, NULL), "argument 'nonfinite_out' is NULL");
  EXPECT_INVALID(zb_sq_norm(be, (zb_dtype_t)7, &l, &sq, &bad), "dtype is 7; allowed: ZB_DTYPE_F32");
  EXPECT_INVALID(zb_sq_norm(be, ZB_DTYPE_F32, NULL, &sq, &bad), "zb_sq_norm: tensors is NULL");
  l.count = -1;
  EXPECT_INVALID(zb_sq_norm(be, ZB_DTYPE_F32, &l, &sq, &bad), "tensors.count is -1; allowed: >= 0");
  l.count = 2, l.numels = NULL;
  EXPECT_INVALID(zb_sq_norm(be, ZB_DTYPE_F32, &l, &sq, &bad), "tensors.numels is NULL with count 2");
  l.numels = numels, numels[1] = -3;
  EXPECT_INVALID(zb_sq_norm(be, ZB_DTYPE_F32, &l, &sq, &bad), "tensors.numels[1] is -3; allowed: >= 0");
  numels[1] = 5;
  EXPECT_INVALID(zb_unscale(be, ZB_DTYPE_F32, &l, 0.5f, &bad),
                 "zb_unscale: tensors.ptrs[1] is NULL with numels[1] = 5");
  numels[1] = 0;
  EXPECT_INVALID(zb_unscale(be, ZB_DTYPE_F32, &l, INFINITY, &bad), "factor is inf; allowed: a finite");
  EXPECT_INVALID(zb_unscale(be, ZB_DTYPE_BF16, &l, 0.5f, NULL), "argument 'nonfinite_out' is NULL");
  EXPECT_INVALID(zb_unscale(be, (zb_dtype_t)-1, &l, 0.5f, &bad), "dtype is -1");
  assert_true(x[0] == 1 && x[3] == 4); /* nothing ran */
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

static void test_bad_scale_arguments(void **state) {
  (void)state;
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  float scale = 8;
  int32_t tracker = 0, inf = 0;
  EXPECT_INVALID(zb_loss_scale_update(NULL, &scale, &tracker, &inf, 2, 0.5, 1), "argument 'be' is NULL");
  EXPECT_INVALID(zb_loss_scale_update(be, NULL, &tracker, &inf, 2, 0.5, 1), "argument 'scale' is NULL");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, NULL, &inf, 2, 0.5, 1), "'growth_tracker' is NULL");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, &tracker, NULL, 2, 0.5, 1), "'nonfinite' is NULL");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, &tracker, &inf, 0.5, 0.5, 1),
                 "growth is 0.5; allowed: a finite value >= 1");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, &tracker, &inf, INFINITY, 0.5, 1), "growth is inf");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, &tracker, &inf, 2, 0, 1),
                 "backoff is 0; allowed: (0, 1]");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, &tracker, &inf, 2, 1.5, 1), "backoff is 1.5");
  EXPECT_INVALID(zb_loss_scale_update(be, &scale, &tracker, &inf, 2, 0.5, 0),
                 "growth_interval is 0; allowed: >= 1");
  assert_true(scale == 8 && tracker == 0);
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

#define EDIT(name, body)                                                                           \
  static void edit_##name(zb_optim_step_t *s) { body; }
EDIT(size, s->struct_size = 8)
EDIT(version, s->version = 9)
EDIT(kind, s->kind = (zb_optim_kind_t)5)
EDIT(lr, s->lr = -1)
EDIT(lr_inf, s->lr = INFINITY)
EDIT(wd, s->weight_decay = NAN)
EDIT(beta1, s->beta1 = 1)
EDIT(beta2, s->beta2 = -0.1)
EDIT(eps, s->eps = 0)
EDIT(step0, s->step = 0)
EDIT(factor, s->factor = NAN)
EDIT(gdtype, s->grad_dtype = (zb_dtype_t)9)
EDIT(gcount, s->grads.count = 3)
EDIT(gnumel, ((int64_t *)s->grads.numels)[2] = 999)
EDIT(pnull, ((void **)s->params.ptrs)[1] = NULL)
EDIT(pcount, s->params.count = -2)
EDIT(pneg, ((int64_t *)s->params.numels)[0] = -1)
EDIT(no_state2, s->state2.count = 0)
EDIT(sgd_momentum, (s->kind = ZB_OPTIM_SGD, s->momentum = 1))
EDIT(sgd_state2, (s->kind = ZB_OPTIM_SGD, s->momentum = 0.9))
EDIT(plain_state1, (s->kind = ZB_OPTIM_SGD, s->momentum = 0, s->state2.count = 0))
#undef EDIT

static void test_bad_step_arguments(void **state) {
  (void)state;
  static const struct {
    void (*edit)(zb_optim_step_t *s);
    const char *text;
  } cases[] = {
      {edit_size, "struct_size 8 and version 1"},
      {edit_version, "version 9"},
      {edit_kind, "kind is 5; allowed: ZB_OPTIM_SGD (0) or ZB_OPTIM_ADAMW (1)"},
      {edit_lr, "lr is -1; allowed: a finite value >= 0"},
      {edit_lr_inf, "lr is inf"},
      {edit_wd, "weight_decay is nan"},
      {edit_beta1, "beta1 is 1; allowed: [0, 1)"},
      {edit_beta2, "beta2 is -0.1"},
      {edit_eps, "eps is 0; allowed: a finite value > 0"},
      {edit_step0, "step is 0; allowed: >= 1"},
      {edit_factor, "factor is nan; allowed: a finite value"},
      {edit_gdtype, "grad_dtype is 9"},
      {edit_gcount, "grads.count is 3 but params.count is 4"},
      {edit_gnumel, "grads.numels[2] is 999 but params.numels[2] is 1000"},
      {edit_pnull, "params.ptrs[1] is NULL with numels[1] = 3"},
      {edit_pcount, "params.count is -2; allowed: >= 0"},
      {edit_pneg, "params.numels[0] is -1; allowed: >= 0"},
      {edit_no_state2, "state2.count is 0 but params.count is 4; AdamW needs"},
      {edit_sgd_momentum, "SGD momentum is 1; allowed: [0, 1)"},
      {edit_sgd_state2, "state2.count is 4 but SGD keeps no state2"},
      {edit_plain_state1, "plain SGD (momentum 0) keeps no state1"},
  };
  zb_backend_t *be = NULL;
  ZB_ASSERT_OK(zb_backend_create_host(&be));
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    fix_t *f = fix_make();
    cases[c].edit(&f->s);
    ASSERT_STATUS(zb_optim_step(be, &f->s), ZB_ERR_INVALID_ARGUMENT);
    ASSERT_CONTAINS(zb_last_error(), "zb_optim_step: ");
    ASSERT_CONTAINS(zb_last_error(), cases[c].text);
    fix_t *fresh = fix_make(); /* nothing ran: the parameters and the state are as made */
    if (memcmp(f->p, fresh->p, sizeof f->p) || memcmp(f->m, fresh->m, sizeof f->m))
      fail_msg("zb_optim_step changed memory before failing on \"%s\"", cases[c].text);
    free(f), free(fresh);
  }
  fix_t *f = fix_make();
  size_t bytes = 7;
  EXPECT_INVALID(zb_optim_step(NULL, &f->s), "zb_optim_step: argument 'be' is NULL");
  EXPECT_INVALID(zb_optim_step(be, NULL), "zb_optim_step: argument 'step' is NULL");
  EXPECT_INVALID(zb_optim_undo(be, &f->s), "zb_optim_undo: step->undo is NULL");
  EXPECT_INVALID(zb_optim_undo(NULL, &f->s), "zb_optim_undo: argument 'be' is NULL");
  EXPECT_INVALID(zb_optim_undo_bytes(&f->s, NULL), "argument 'out' is NULL");
  EXPECT_INVALID(zb_optim_undo_bytes(NULL, &bytes), "zb_optim_undo_bytes: argument 'step' is NULL");
  assert_int_equal(bytes, 0);
  f->s.state1.count = 2;
  EXPECT_INVALID(zb_optim_undo_bytes(&f->s, &bytes), "zb_optim_undo_bytes: state1.count is 2");
  f->s.state1.count = NPARAM;
  f->s.step = 0, f->s.grads.count = 0, f->s.lr = -1; /* none of them read by undo_bytes or undo */
  ZB_ASSERT_OK(zb_optim_undo_bytes(&f->s, &bytes));
  assert_int_equal(bytes, 12 * NTOTAL);
  free(f);
  ZB_ASSERT_OK(zb_backend_destroy(be));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_list_arguments),
      cmocka_unit_test(test_bad_scale_arguments),
      cmocka_unit_test(test_bad_step_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
