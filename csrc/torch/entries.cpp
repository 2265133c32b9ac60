// The W entries libzbpp_torch.so pushed into W stores and keeps alive until the store releases them
// (zbpp::wgrad_deferred's, whose GEMM the store runs, and zbpp::linear_wgrad's, which run torch's
// ops when released), and the C entry points a store's owner uses to hand them back.
//
// Tokens of these entries have ZBPP_TORCH_TOKEN_BIT set. A store created with the Python binding
// forwards them to zbpp_torch_release; a C/C++ caller creating its own store passes
// zbpp_torch_release as the store's release callback.

#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "internal.h"

namespace zbpp_torch {
namespace {

std::mutex g_mu;
std::unordered_map<uint64_t, std::unique_ptr<Entry>> g_live;
uint64_t g_next = 1;

// What the last failed release on this thread said (zbpp_torch_last_error).
thread_local std::string t_error;

}  // namespace

uint64_t keep_entry(std::unique_ptr<Entry> entry) {
  std::lock_guard<std::mutex> lock(g_mu);
  const uint64_t token = ZBPP_TORCH_TOKEN_BIT | g_next++;
  g_live.emplace(token, std::move(entry));
  return token;
}

void forget_entry(uint64_t token) {
  std::unique_ptr<Entry> gone;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_live.find(token);
    if (it == g_live.end()) return;
    gone = std::move(it->second);
    g_live.erase(it);
  }
}

}  // namespace zbpp_torch

using namespace zbpp_torch;

// The release callback of the entries this library pushed (a zb_wgrad_release_cb): when the entry
// ran (ran = 1) its work runs now (zbpp::linear_wgrad's torch ops; nothing more for
// zbpp::wgrad_deferred's, whose GEMM has run), then the tensors it kept are dropped. Returns ZB_OK,
// ZB_ERR_INVALID_ARGUMENT for an unknown token, or ZB_ERR_INTERNAL when the work raised (its message
// in zbpp_torch_last_error()); the entry is dropped in every case.
ZBPP_TORCH_API zb_status_t zbpp_torch_release(void *user, uint64_t token, int32_t ran) {
  (void)user;
  std::unique_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_live.find(token);
    if (it == g_live.end()) return ZB_ERR_INVALID_ARGUMENT;
    entry = std::move(it->second);
    g_live.erase(it);
  }
  // Outside the lock: the work calls into torch, and the tensors' last references may free memory
  // (which can call back into torch).
  zb_status_t st = ZB_OK;
  if (ran) {
    try {
      entry->run();
    } catch (const std::exception &e) {
      t_error = e.what();
      st = ZB_ERR_INTERNAL;
    }
  }
  entry.reset();
  return st;
}

// Why the last zbpp_torch_release on this thread failed ("" when none has).
ZBPP_TORCH_API const char *zbpp_torch_last_error(void) { return t_error.c_str(); }

// Entries pushed into `store` (NULL: any store) and not yet released.
ZBPP_TORCH_API int64_t zbpp_torch_live(const zb_wstore_t *store) {
  std::lock_guard<std::mutex> lock(g_mu);
  int64_t n = 0;
  for (const auto &kv : g_live)
    if (!store || kv.second->store == store) n++;
  return n;
}
