// zbpp::linear_wgrad: the weight and bias gradients of a linear layer computed by the ops torch's
// autograd runs for torch.nn.functional.linear, in the same order, so a split layer's gradients are
// nn.Linear's bit for bit (and Megatron's: its layer runs the same ops without fusion).
//
//   zbpp::linear_wgrad(Tensor x, Tensor dy, Tensor? dw, Tensor? db, Tensor? bias_of=None,
//                      int[] bias_dims=[0], bool dy_t_x=True, bool dw_add=True, bool db_add=True,
//                      int store=0) -> int
//
// What autograd does for y = linear(x, W, b) (aten/src/ATen/native/Linear.cpp; the backward
// formulas of addmm and mm in derivatives.yaml / FunctionsManual.cpp mm_mat2_backward):
//   - the forward is addmm(b, x2, W^T) over x2 = x viewed [rows, in] (2-d input, or a contiguous
//     one with a 1-d bias), else matmul(x, W^T) (+ b in place), whose mm reads the same x2;
//   - W's gradient is mm(dy2^T, x2), dy2 = the output gradient viewed [rows, out], when W^T is
//     column-major (a contiguous W) -- `dy_t_x` -- else mm(x2^T, dy2)^T;
//   - b's gradient is sum_to(grad, [out]): the sum, keeping dims, of addmm's output gradient (dy2)
//     over dim 0, or of the full output gradient over its leading dims (matmul + add) -- `bias_of`
//     and `bias_dims` -- viewed [out];
//   - each gradient is converted to its parameter's dtype (autocast's casts: ToCopyBackward), then
//     AccumulateGrad makes it .grad when there is none (`*_add` false: here a copy into the .grad
//     the caller made) or adds it in place (`*_add` true; Megatron's DDP hook adds .grad to
//     main_grad the same way).
// x and dy are [rows, in] and [rows, out] exactly as autograd has them (their strides decide the
// BLAS call, so they are read as given, never copied). dw [out, in] and db [out] are the targets.
//
// store = 0: the work runs now. Otherwise it is a zb_wstore_t* whose group is open: an empty GEMM
// entry (rows = 0: nothing for the store's backend to do) marks the work's place in the group, and
// the work runs when the store releases it after running it (zbpp_torch_release, entries.cpp), in
// push order with the rest of the group. Returns the entry's token, or 0 when it ran now.
//
// Only ops without a Scalar argument go through torch's dispatcher here (the stable ABI cannot pass
// a Scalar yet): mm.out, sum.IntList_out, copy_; the in-place add is the stable subtract shim,
// target - (-1) * g, which is the same add kernel with alpha = 1 (sub calls add with -alpha). The
// out= overloads are also what keeps autocast away: autocast casts the inputs of mm, not of mm.out,
// and a W run inside an autocast region must compute what the backward computed.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "internal.h"

namespace zbpp_torch {
namespace {

constexpr const char *kOp = "zbpp::linear_wgrad";

// Grad mode off while W runs, as in a backward: a W op runs outside any backward (grad mode on),
// and out= kernels refuse inputs that require grad while it is on.
struct NoGrad {
  bool was = aoti_torch_grad_mode_is_enabled();
  NoGrad() { aoti_torch_grad_mode_set_enabled(false); }
  ~NoGrad() { aoti_torch_grad_mode_set_enabled(was); }
  NoGrad(const NoGrad &) = delete;
  NoGrad &operator=(const NoGrad &) = delete;
};

// out = a @ b, by the kernel at::mm runs (mm and mm.out share their implementation).
void mm_out(Tensor &out, const Tensor &a, const Tensor &b) {
  std::array<StableIValue, 3> stack{torch::stable::detail::from(a), torch::stable::detail::from(b),
                                    torch::stable::detail::from(out)};
  // TORCH_ERROR_CODE_CHECK, not STABLE_TORCH_ERROR_CODE_CHECK: torch 2.11's headers lack the latter,
  // and for a 2.10 target torch 2.13 defines it as the former.
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::mm", "out", stack.data(), TORCH_ABI_VERSION));
  (void)torch::stable::detail::to<Tensor>(stack[0]);  // the returned reference to out
}

// Autograd's accumulation of one gradient into its target: the first one copied in, later ones
// added in place (converted to the target's dtype first, as autograd converts before it adds).
void put(Tensor &target, const Tensor &g, bool add) {
  if (!add) {
    torch::stable::copy_(target, g);
    return;
  }
  Tensor sum = torch::stable::subtract(target, g, -1.0);
  torch::stable::copy_(target, sum);
}

bool is_float(ScalarType s) {
  return s == ScalarType::Float || s == ScalarType::Double || s == ScalarType::BFloat16 || s == ScalarType::Half;
}

struct LinearW : Entry {
  Tensor x, dy;
  std::optional<Tensor> dw, db, bias_of;
  std::vector<int64_t> bias_dims;
  bool dy_t_x = true, dw_add = true, db_add = true;

  LinearW(Tensor x_, Tensor dy_) : x(std::move(x_)), dy(std::move(dy_)) {}

  void run() override {
    NoGrad no_grad;
    if (dw) {
      if (dy_t_x && !dw_add && dw->scalar_type() == x.scalar_type() && dw->is_contiguous() && dw->dim() == 2 &&
          dw->size(0) == dy.size(1) && dw->size(1) == x.size(1)) {
        // The first gradient, straight into its (fresh, contiguous) .grad: mm and mm.out share their
        // kernel, so this is the product autograd's mm makes, without a copy. (The shape is checked
        // again: mm.out would quietly resize a target changed since the push.)
        mm_out(*dw, torch::stable::transpose(dy, 0, 1), x);
      } else {
        put(*dw, weight_grad(), dw_add);
      }
    }
    if (db) put(*db, bias_grad(), db_add);
  }

  // mm_mat2_backward: dy^T x, or (x^T dy)^T for a weight whose transpose is not column-major.
  Tensor weight_grad() const {
    const int64_t in = x.size(1), out = dy.size(1);
    if (dy_t_x) {
      Tensor g = torch::stable::new_empty(x, {out, in});
      mm_out(g, torch::stable::transpose(dy, 0, 1), x);
      return g;
    }
    Tensor gt = torch::stable::new_empty(x, {in, out});
    mm_out(gt, torch::stable::transpose(x, 0, 1), dy);
    return torch::stable::transpose(gt, 0, 1);
  }

  // sum_to(grad, [out]): summed over bias_dims keeping them (none: the gradient itself), as [out].
  Tensor bias_grad() const {
    const Tensor &src = bias_of ? *bias_of : dy;
    Tensor g = src;
    if (!bias_dims.empty()) {
      std::vector<int64_t> kept;
      for (int64_t d = 0; d < src.dim(); d++) kept.push_back(src.size(d));
      for (int64_t d : bias_dims) kept[static_cast<size_t>(d)] = 1;
      g = torch::stable::new_empty(src, kept);
      torch::stable::sum_out(g, src, torch::headeronly::IntHeaderOnlyArrayRef(bias_dims), true);
    }
    return torch::stable::view(g, {dy.size(1)});
  }
};

void check_target(const char *name, const Tensor &t, const std::vector<int64_t> &shape, int32_t dev) {
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); i++) want += (i ? ", " : "") + std::to_string(shape[i]);
  want += "]";
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; same && i < shape.size(); i++) same = t.size(static_cast<int64_t>(i)) == shape[i];
  check(same, kOp, ": ", name, " must be ", want, "; got ", shape_of(t));
  check(is_float(t.scalar_type()), kOp, ": ", name, " must be a floating-point tensor; got ",
        dtype_name(t.scalar_type()));
  check(device_key(t) == dev, kOp, ": x, dy, ", name, " must be on one device");
}

int64_t linear_wgrad(Tensor x, Tensor dy, std::optional<Tensor> dw, std::optional<Tensor> db,
                     std::optional<Tensor> bias_of, std::vector<int64_t> bias_dims, bool dy_t_x, bool dw_add,
                     bool db_add, int64_t store) {
  check(x.dim() == 2 && dy.dim() == 2, kOp, ": x and dy must be [rows, in] and [rows, out] as autograd has them; got x ",
        shape_of(x), ", dy ", shape_of(dy));
  check(x.size(0) == dy.size(0), kOp, ": x and dy must have the same number of rows; got x ", shape_of(x), ", dy ",
        shape_of(dy));
  check(x.scalar_type() == dy.scalar_type() && is_float(x.scalar_type()), kOp,
        ": x and dy must have one floating-point dtype; got ", dtype_name(x.scalar_type()), " and ",
        dtype_name(dy.scalar_type()));
  check(dw.has_value() || db.has_value(), kOp, ": give dw, db or both (the gradients to compute)");
  const int32_t dev = device_key(x);
  check(device_key(dy) == dev, kOp, ": x, dy must be on one device");
  const int64_t in = x.size(1), out = dy.size(1);
  if (dw) check_target("dw", *dw, {out, in}, dev);
  if (db) {
    check_target("db", *db, {out}, dev);
    const Tensor &src = bias_of ? *bias_of : dy;
    check(device_key(src) == dev && src.scalar_type() == dy.scalar_type(), kOp,
          ": bias_of must be on dy's device, in dy's dtype");
    check(src.dim() >= 1 && src.size(src.dim() - 1) == out, kOp, ": bias_of must end in out = ", out, "; got ",
          shape_of(src));
    int64_t left = src.numel();
    std::vector<bool> seen(static_cast<size_t>(src.dim()), false);
    for (int64_t d : bias_dims) {
      check(d >= 0 && d < src.dim() - 1 && !seen[static_cast<size_t>(d)], kOp,
            ": bias_dims must be distinct leading dimensions of bias_of ", shape_of(src));
      seen[static_cast<size_t>(d)] = true;
      left /= src.size(d) ? src.size(d) : 1;
    }
    check(left == out, kOp, ": bias_of ", shape_of(src), " summed over bias_dims does not leave [", out, "]");
  }
  auto w = std::make_unique<LinearW>(std::move(x), std::move(dy));
  w->dw = dw;
  w->db = db;
  w->bias_of = bias_of;
  w->bias_dims = std::move(bias_dims);
  w->dy_t_x = dy_t_x;
  w->dw_add = dw_add;
  w->db_add = db_add;
  if (store == 0) {
    w->run();
    return 0;
  }
  auto *st = reinterpret_cast<zb_wstore_t *>(static_cast<uintptr_t>(store));
  w->store = st;
  // The store's entry: no rows, so its backend writes nothing (dw only has to be a valid pointer).
  static float mark = 0.0f;
  zb_wgrad_t e{};
  e.struct_size = sizeof(zb_wgrad_t);
  e.dtype = ZB_DTYPE_F32;
  e.rows = 0;
  e.in_features = 1;
  e.out_features = 1;
  e.ldx = ZB_LD_DENSE;
  e.ldy = ZB_LD_DENSE;
  e.dw = &mark;
  e.dw_dtype = ZB_DTYPE_F32;
  e.overwrite = 0;
  e.token = keep_entry(std::move(w));
  zb_status_t status = zb_wstore_push(st, &e);
  if (status != ZB_OK) {
    forget_entry(e.token);
    fail(kOp, "pushing into the W store", status);
  }
  return static_cast<int64_t>(e.token);
}

int64_t linear_wgrad_meta(Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>,
                          std::vector<int64_t>, bool, bool, bool, int64_t) {
  return 0;
}

}  // namespace
}  // namespace zbpp_torch

STABLE_TORCH_LIBRARY_FRAGMENT(zbpp, m) {
  m.def("linear_wgrad(Tensor x, Tensor dy, Tensor? dw, Tensor? db, Tensor? bias_of=None, int[] bias_dims=[0], "
        "bool dy_t_x=True, bool dw_add=True, bool db_add=True, int store=0) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(zbpp, CPU, m) { m.impl("linear_wgrad", TORCH_BOX(&zbpp_torch::linear_wgrad)); }

STABLE_TORCH_LIBRARY_IMPL(zbpp, CUDA, m) { m.impl("linear_wgrad", TORCH_BOX(&zbpp_torch::linear_wgrad)); }

STABLE_TORCH_LIBRARY_IMPL(zbpp, Meta, m) { m.impl("linear_wgrad", TORCH_BOX(&zbpp_torch::linear_wgrad_meta)); }
