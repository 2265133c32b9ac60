// libzbpp_torch.so: zbpp's weight-gradient entry points as torch custom ops, registered through
// libtorch's stable ABI (STABLE_TORCH_LIBRARY; torch >= 2.10, built against the installed torch's
// headers and targeting the 2.10 ABI, so one build loads into every later torch).
//
// Why: a ctypes call is invisible to torch.compile and torch.export (a graph break, or nothing to
// export), and needs Python at run time. Ops registered here are dispatcher ops: graphs record
// them as nodes, and a program that loads this library (Python or C++, an AOTInductor package
// included) runs them without Python.
//
//   zbpp::wgrad(Tensor x, Tensor dy, Tensor(a!) dw, Tensor(b!)? db=None, bool overwrite=False) -> ()
//     The W of a linear map y = x W^T (+ b), now: dw += dy^T x and db += sum of dy over rows
//     (overwrite: = instead of +=), through the library's GEMM (CBLAS on the host backend,
//     cuBLASLt on CUDA, torch's current stream). x [..., in] and dy [..., out] of one dtype
//     (f32, bf16, f16), any strides; dw [out, in] and db [out] contiguous, f32 or x's dtype.
//
//   zbpp::wgrad_deferred(Tensor x, Tensor dy, Tensor dw, Tensor? db=None, bool overwrite=False,
//                        bool copy_inputs=True) -> ()
//     The same W, deferred: when a W store is bound to the tensors' device (zbpp_torch_bind, which
//     the Python binding does while a runner's backward or capture() is active) it is pushed into
//     the store's open group and runs at that group's W op; otherwise it runs now as zbpp::wgrad.
//     A deferred W reads copies of x and dy (a compiled graph reuses their memory as soon as the op
//     returns); copy_inputs=False reads x and dy themselves, for eager callers whose tensors stay
//     untouched until the W op. dw and db must outlive the W (a parameter's main_grad, say). What
//     the entry reads is kept alive here until the store releases it. dw and db are not
//     marked as mutated in the schema, on purpose: the write happens after the op has returned, so
//     a functionalized copy (what a graph compiler makes of a mutated argument) would receive it
//     and drop it. Compilers must keep the op in order as a side effect instead (Python registers
//     it as an ordered effect; see bindings/python/zbpp/_ops.py).
//
// zbpp::linear_wgrad (linear_wgrad.cpp) is the other kind of W: nn.Linear's weight and bias
// gradients by torch's own ops, as autograd computes them. The entries both push are kept in
// entries.cpp, whose zbpp_torch_release a store calls back with their tokens.
//
// C++ only where torch's headers demand it: the kernels are plain functions over the C ABI.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <dlfcn.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "internal.h"
#include "zbpp.h"

namespace zbpp_torch {

std::string dtype_name(ScalarType s) {
  switch (s) {
    case ScalarType::Float: return "float32";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Half: return "float16";
    case ScalarType::Double: return "float64";
    default: return "dtype " + std::to_string(static_cast<int>(s));
  }
}

std::string shape_of(const Tensor &t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

[[noreturn]] void fail(const char *op, const char *what, zb_status_t st) {
  const char *msg = zb_last_error();
  std::string text = std::string(op) + ": " + what + " failed: " + zb_status_string(st);
  if (msg && *msg) text += std::string(": ") + msg;
  throw std::runtime_error(text);
}

}  // namespace zbpp_torch

using namespace zbpp_torch;

namespace {

zb_dtype_t zb_dtype(ScalarType s, const char *op) {
  switch (s) {
    case ScalarType::Float: return ZB_DTYPE_F32;
    case ScalarType::BFloat16: return ZB_DTYPE_BF16;
    case ScalarType::Half: return ZB_DTYPE_F16;
    default:
      check(false, op, ": x and dy must be float32, bfloat16 or float16; got ", dtype_name(s));
  }
  return ZB_DTYPE_F32;  // not reached
}


// t [..., cols] as [rows, cols] rows the GEMM can read: a row's elements adjacent, rows at least a
// row apart. Anything else (a broadcast stride 0, a transposed view) is copied; so is everything
// when `copy` is set.
Tensor as_rows(const Tensor &t, int64_t cols, bool copy) {
  Tensor r = torch::stable::reshape(t, {-1, cols});
  if (copy) {
    Tensor c = torch::stable::new_empty(r, {r.size(0), cols});
    torch::stable::copy_(c, r);
    return c;
  }
  if (r.size(0) > 1 && r.stride(1) == 1 && r.stride(0) >= cols) return r;
  return torch::stable::contiguous(r);
}

// One W, checked and laid out: what zb_wgrad_t needs, with the tensors that own its memory.
struct Work {
  Tensor x, dy, dw;
  std::optional<Tensor> db;
  zb_wgrad_t entry;
};

Work prepare(const char *op, const Tensor &x, const Tensor &dy, const Tensor &dw, const std::optional<Tensor> &db,
             bool overwrite, bool copy = false) {
  check(x.dim() >= 1 && dy.dim() >= 1, op, ": x and dy need at least one dimension; got x ", shape_of(x),
        ", dy ", shape_of(dy));
  check(x.scalar_type() == dy.scalar_type(), op, ": x and dy must have one dtype; got ",
        dtype_name(x.scalar_type()), " and ", dtype_name(dy.scalar_type()));
  zb_dtype_t dtype = zb_dtype(x.scalar_type(), op);
  const int64_t in = x.size(x.dim() - 1), out = dy.size(dy.dim() - 1);
  check(x.numel() / (in ? in : 1) == dy.numel() / (out ? out : 1), op,
        ": x and dy must have the same number of rows (all but the last dimension); got x ", shape_of(x),
        ", dy ", shape_of(dy));
  const int32_t dev = device_key(x);
  check(device_key(dy) == dev && device_key(dw) == dev && (!db || device_key(*db) == dev), op,
        ": x, dy, dw and db must be on one device");
  check(dw.dim() == 2 && dw.size(0) == out && dw.size(1) == in && dw.is_contiguous(), op,
        ": dw must be a contiguous [out, in] = [", out, ", ", in, "] tensor; got ", shape_of(dw),
        dw.is_contiguous() ? "" : " (not contiguous)");
  const ScalarType dws = dw.scalar_type();
  check(dws == ScalarType::Float || dws == x.scalar_type(), op,
        ": dw must be float32 (accumulated in fp32) or x's dtype ", dtype_name(x.scalar_type()), "; got ",
        dtype_name(dws));
  if (db) {
    check(db->dim() == 1 && db->size(0) == out && db->is_contiguous() && db->scalar_type() == dws, op,
          ": db must be a contiguous [", out, "] tensor of dw's dtype ", dtype_name(dws), "; got ",
          shape_of(*db), " ", dtype_name(db->scalar_type()));
  }
  Work w{as_rows(x, in, copy), as_rows(dy, out, copy), dw, db, {}};
  zb_wgrad_t &e = w.entry;
  e.struct_size = sizeof(zb_wgrad_t);
  e.dtype = dtype;
  e.rows = w.x.size(0);
  e.in_features = in;
  e.out_features = out;
  e.x = w.x.const_data_ptr();
  e.ldx = w.x.is_contiguous() ? ZB_LD_DENSE : w.x.stride(0);
  e.dy = w.dy.const_data_ptr();
  e.ldy = w.dy.is_contiguous() ? ZB_LD_DENSE : w.dy.stride(0);
  e.dw = dw.data_ptr();
  e.db = db ? db->data_ptr() : nullptr;
  e.token = 0;
  e.dw_dtype = dws == ScalarType::Float ? ZB_DTYPE_F32 : dtype;
  e.overwrite = overwrite ? 1 : 0;
  return w;
}


// ---- immediate W: one backend and store per device, created on first use, kept for the process
// (destroying CUDA objects from a static destructor would run after the CUDA runtime's teardown).
struct Immediate {
  zb_backend_t *backend = nullptr;
  zb_wstore_t *store = nullptr;
};

std::mutex g_immediate_mu;
std::unordered_map<int32_t, Immediate> g_immediate;

// torch's current CUDA stream. The shim call that gives it exists only in CUDA builds of torch
// (libtorch_cuda.so), so it is looked up in the copy the process has loaded, not linked: this
// library then loads into CPU builds too.
void *current_cuda_stream(int32_t device) {
  using Fn = AOTITorchError (*)(int32_t, void **);
  static Fn fn = [] {
    void *lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<Fn>(dlsym(lib, "aoti_torch_get_current_cuda_stream")) : nullptr;
  }();
  check(fn != nullptr, "zbpp: CUDA tensors need a CUDA build of torch (libtorch_cuda.so is not loaded)");
  void *stream = nullptr;
  check(fn(device, &stream) == AOTI_TORCH_SUCCESS,
        "zbpp: torch could not give the current CUDA stream of device ", device);
  return stream;
}

void run_now(const char *op, Work &w, int32_t dev) {
  std::lock_guard<std::mutex> lock(g_immediate_mu);
  Immediate &im = g_immediate[dev];
  zb_status_t st;
  if (!im.backend) {
    if (dev == kCpu) {
      st = zb_backend_create_host(&im.backend);
    } else {
      zb_cuda_backend_config_t cfg = ZB_CUDA_BACKEND_CONFIG_INIT;
      cfg.device = dev;
      st = zb_backend_create_cuda(&im.backend, &cfg);
    }
    if (st != ZB_OK) fail(op, "creating the backend", st);
    if ((st = zb_wstore_create(&im.store, im.backend, nullptr, nullptr)) != ZB_OK) {
      zb_backend_destroy(im.backend);
      im.backend = nullptr;
      fail(op, "creating the W store", st);
    }
  }
  if (dev != kCpu) {
    // torch's current stream, in the stream order of the tensors' producers; handle 0 (the legacy
    // default stream) must be named explicitly (zbpp.h, zb_backend_set_stream).
    void *s = current_cuda_stream(dev);
    if ((st = zb_backend_set_stream(im.backend, s ? s : reinterpret_cast<void *>(1))) != ZB_OK)
      fail(op, "setting the stream", st);
  }
  if ((st = zb_wstore_begin(im.store, 0, 0)) != ZB_OK) fail(op, "opening a group", st);
  st = zb_wstore_push(im.store, &w.entry);
  zb_status_t end = zb_wstore_end(im.store);
  if (st != ZB_OK) {
    zb_wstore_clear(im.store);  // the empty group must not be left for the next call
    fail(op, "pushing the GEMM", st);
  }
  if (end != ZB_OK) fail(op, "closing the group", end);
  if ((st = zb_wstore_pop_run(im.store, 0, nullptr)) != ZB_OK) fail(op, "running the GEMM", st);
}

void wgrad(Tensor x, Tensor dy, Tensor dw, std::optional<Tensor> db, bool overwrite) {
  Work w = prepare("zbpp::wgrad", x, dy, dw, db, overwrite);
  run_now("zbpp::wgrad", w, device_key(x));
}

// ---- deferred W: bound stores and the tensors their entries read ---------------------------------
struct Binding {
  zb_wstore_t *store;
  void *stream;  // CUDA: the stream pushes must be made on (the runner's), or NULL for any
};

// A deferred zbpp::wgrad: its GEMM is the store's own; kept here are the tensors it reads.
struct Kept : Entry {
  explicit Kept(Work w) : work(std::move(w)) {}
  Work work;
};

std::mutex g_mu;  // g_bound
std::unordered_map<int32_t, Binding> g_bound;

void wgrad_deferred(Tensor x, Tensor dy, Tensor dw, std::optional<Tensor> db, bool overwrite, bool copy_inputs) {
  const char *op = "zbpp::wgrad_deferred";
  const int32_t dev = device_key(x);
  Binding b{nullptr, nullptr};
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_bound.find(dev);
    if (it != g_bound.end()) b = it->second;
  }
  if (!b.store) {  // no pipeline around: W now, as a plain backward expects
    Work now = prepare(op, x, dy, dw, db, overwrite);
    run_now(op, now, dev);
    return;
  }
  // Deferred, the GEMM reads x and dy after this op has returned. A compiled graph (inductor)
  // plans its buffers as if nothing did and reuses their memory at once, whatever references
  // exist (measured: the gradients were wrong); hence copies of our own unless the caller says
  // its x and dy live on untouched until the W op.
  Work w = prepare(op, x, dy, dw, db, overwrite, copy_inputs);
  if (dev != kCpu && b.stream) {
    void *s = current_cuda_stream(dev);
    check(s == b.stream, op, ": the W store of cuda:", dev,
          " runs its GEMMs on the runner's stream, and this push came from another stream; run the "
          "backward on the runner's stream (torch.cuda.current_stream() when the step began)");
  }
  zb_wgrad_t entry = w.entry;
  auto kept = std::make_unique<Kept>(std::move(w));
  kept->store = b.store;
  entry.token = keep_entry(std::move(kept));
  zb_status_t st = zb_wstore_push(b.store, &entry);
  if (st != ZB_OK) {
    forget_entry(entry.token);
    fail(op, "pushing into the bound W store", st);
  }
}

// Shape-only kernels for tracing (FakeTensor, torch.export): the ops return nothing.
void wgrad_meta(Tensor, Tensor, Tensor, std::optional<Tensor>, bool) {}
void wgrad_deferred_meta(Tensor, Tensor, Tensor, std::optional<Tensor>, bool, bool) {}

}  // namespace

// Binds `store` (borrowed; NULL unbinds) to a device: -1 the CPU, otherwise a CUDA ordinal. While
// bound, zbpp::wgrad_deferred on that device pushes into the store's open group. `stream`: CUDA, the
// stream pushes must come from (NULL: any). Returns ZB_OK or ZB_ERR_INVALID_ARGUMENT.
ZBPP_TORCH_API zb_status_t zbpp_torch_bind(int32_t device, zb_wstore_t *store, void *stream) {
  if (device < kCpu) return ZB_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> lock(g_mu);
  if (store)
    g_bound[device] = Binding{store, stream};
  else
    g_bound.erase(device);
  return ZB_OK;
}

STABLE_TORCH_LIBRARY(zbpp, m) {
  m.def("wgrad(Tensor x, Tensor dy, Tensor(a!) dw, Tensor(b!)? db=None, bool overwrite=False) -> ()");
  m.def("wgrad_deferred(Tensor x, Tensor dy, Tensor dw, Tensor? db=None, bool overwrite=False, "
        "bool copy_inputs=True) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(zbpp, CPU, m) {
  m.impl("wgrad", TORCH_BOX(&wgrad));
  m.impl("wgrad_deferred", TORCH_BOX(&wgrad_deferred));
}

STABLE_TORCH_LIBRARY_IMPL(zbpp, CUDA, m) {
  m.impl("wgrad", TORCH_BOX(&wgrad));
  m.impl("wgrad_deferred", TORCH_BOX(&wgrad_deferred));
}

STABLE_TORCH_LIBRARY_IMPL(zbpp, Meta, m) {
  m.impl("wgrad", TORCH_BOX(&wgrad_meta));
  m.impl("wgrad_deferred", TORCH_BOX(&wgrad_deferred_meta));
}
