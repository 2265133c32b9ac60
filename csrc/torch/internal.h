// What the files of libzbpp_torch.so share: argument checks with plain messages, tensor names for
// those messages, and the table of W entries this library keeps alive until their store releases
// them. Not a public header: nothing outside csrc/torch includes it.

#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

#include "zbpp.h"

#define ZBPP_TORCH_API extern "C" __attribute__((visibility("default")))
#define ZBPP_TORCH_TOKEN_BIT (1ull << 63)

namespace zbpp_torch {

using torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// Bad input raises RuntimeError in Python with exactly this text (torch's check macros would prefix
// it with a C++ function name and line, which tells a user nothing).
template <typename... Args>
void check(bool cond, const Args &...args) {
  if (cond) return;
  std::ostringstream os;
  (os << ... << args);
  throw std::runtime_error(os.str());
}

constexpr int32_t kCpu = -1;  // device key of the CPU in bindings and backends

inline int32_t device_key(const Tensor &t) {
  return t.is_cuda() ? static_cast<int32_t>(t.get_device_index()) : kCpu;
}

std::string dtype_name(ScalarType s);
std::string shape_of(const Tensor &t);

// A library failure as a RuntimeError: "op: what failed: status: zb_last_error()".
[[noreturn]] void fail(const char *op, const char *what, zb_status_t st);

// An entry this library pushed into a W store and keeps until the store releases it. run() is its
// work once the store has run the entry's GEMM (a real one, or an empty one that only marks the
// entry's place in its group); it may throw, and the entry is dropped either way.
struct Entry {
  zb_wstore_t *store = nullptr;
  virtual ~Entry() = default;
  virtual void run() {}
};

// Files an entry under a new token (ZBPP_TORCH_TOKEN_BIT set) and returns the token; the caller
// then pushes it. forget() takes it back when the push failed.
uint64_t keep_entry(std::unique_ptr<Entry> entry);
void forget_entry(uint64_t token);

}  // namespace zbpp_torch
