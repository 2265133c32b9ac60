// A C++ program with no Python in it: loads libtorch (linked) and libzbpp_torch.so (dlopen, as a
// deployment loads an op library, e.g. beside an AOTInductor package), then calls zbpp::wgrad and
// zbpp::wgrad_deferred through torch's dispatcher on tensors over its own memory, and checks the
// weight gradient against a plain loop. Usage: torch_ops_check path/to/libzbpp_torch.so
// Exit 0 and "zbpp::wgrad matches" on success; 1 with what differed otherwise.

#include <dlfcn.h>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <vector>

using torch::stable::Tensor;


static Tensor wrap(std::vector<float> &v, int64_t rows, int64_t cols) {
  return torch::stable::from_blob(v.data(), {rows, cols}, {cols, 1}, torch::stable::Device(torch::headeronly::DeviceType::CPU),
                                  torch::headeronly::ScalarType::Float);
}

static int call(const char *op, Tensor x, Tensor dy, Tensor dw, bool overwrite) {
  namespace d = torch::stable::detail;
  StableIValue stack[5] = {d::from(x), d::from(dy), d::from(dw), d::from(std::optional<Tensor>()), d::from(overwrite)};
  return torch_call_dispatcher(op, "", stack, TORCH_ABI_VERSION) == AOTI_TORCH_SUCCESS ? 0 : 1;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s path/to/libzbpp_torch.so\n", argv[0]);
    return 2;
  }
  if (!dlopen(argv[1], RTLD_NOW | RTLD_LOCAL)) {
    std::fprintf(stderr, "torch_ops_check: cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  const int64_t rows = 7, in = 5, out = 3;
  std::vector<float> x(rows * in), dy(rows * out), dw(out * in, 1.0f);
  for (size_t i = 0; i < x.size(); i++) x[i] = std::sin(0.7f * (float)i);
  for (size_t i = 0; i < dy.size(); i++) dy[i] = std::cos(0.3f * (float)i);
  // wgrad accumulates into dw (starting at 1); wgrad_deferred with no store bound runs at once and
  // accumulates again: dw = 1 + 2 dy^T x.
  if (call("zbpp::wgrad", wrap(x, rows, in), wrap(dy, rows, out), wrap(dw, out, in), false) ||
      call("zbpp::wgrad_deferred", wrap(x, rows, in), wrap(dy, rows, out), wrap(dw, out, in), false)) {
    std::fprintf(stderr, "torch_ops_check: the dispatcher call failed\n");
    return 1;
  }
  double worst = 0;
  for (int64_t o = 0; o < out; o++)
    for (int64_t i = 0; i < in; i++) {
      double want = 1;
      for (int64_t r = 0; r < rows; r++) want += 2.0 * dy[r * out + o] * x[r * in + i];
      worst = std::fmax(worst, std::fabs(want - dw[o * in + i]));
    }
  if (worst > 1e-4) {
    std::fprintf(stderr, "torch_ops_check: dw differs from the loop by %g\n", worst);
    return 1;
  }
  // A bad call fails through the dispatcher with an error code, and the program goes on.
  std::vector<float> wrong(in * out);
  if (!call("zbpp::wgrad", wrap(x, rows, in), wrap(dy, rows, out), wrap(wrong, in, out), false)) {
    std::fprintf(stderr, "torch_ops_check: a [in, out] dw was accepted\n");
    return 1;
  }
  std::printf("zbpp::wgrad matches the loop (max difference %g); a wrong shape was refused\n", worst);
  return 0;
}
