// The GPU attention entry points: choose between cuDNN's fused attention and our own flash kernel.
//
// Choice (process-wide, `set_attention_impl` or the environment variable CW_ATTENTION = auto | cudnn |
// flash, read once): `automatic` takes cuDNN where it serves (bf16, head dim a multiple of 8 up to
// 128, a cuDNN that supports bottom-right causal masks), each direction on its own:
//  * forward: cuDNN where cudnn_attention_forward_supports() says so (its workspace is tiny);
//  * backward: cuDNN only while determinism is not requested and its plan's workspace fits the
//    attention workspace budget, else the flash kernel. cuDNN's fast backward (dQ summed with f32
//    atomics) needs O(S) workspace in the graph form attention_cudnn.cu builds (the per-query-head
//    f32 dK/dV of its GQA head reduction: 128 MiB at 16K tokens with 32 heads); its deterministic
//    engine stages dS for all c x S pairs (B H c S 2 bytes) and its older graph forms staged f32
//    scores (B H c S 4 bytes: 32 GiB at 16K). The budget is a quarter of the device memory free
//    when the first backward asks (at least 256 MiB), fixed for the process;
//    CW_ATTENTION_WORKSPACE_MIB=N sets it. The flash backward's scratch is O(c) whatever happens.
// A cuDNN forward's out and lse feed the flash backward unchanged (both are the op's contract).
#include "chunkwise_config.h"
#include "engine/cuda/ops.h"

#include "engine/cuda/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <cstring>
#include <string>

namespace cw::gpu {
namespace {

// CW_ATTENTION: the choices in the order of AttentionImpl.
AttentionImpl impl_from_env() {
  return static_cast<AttentionImpl>(env_choice("CW_ATTENTION", {"auto", "cudnn", "flash"}, "use auto, cudnn or flash"));
}

std::atomic<int> g_impl{-1};  // -1: not yet read from the environment
std::atomic<int> g_deterministic{-1};

constexpr int64_t kMinWorkspaceBudget = int64_t{256} << 20;

// The attention backward's workspace budget on `device` (see the top of the file), fixed on first use.
int64_t workspace_budget(int device) {
  static std::mutex mutex;
  static std::map<int, int64_t> budgets;
  std::lock_guard lock(mutex);
  if (auto it = budgets.find(device); it != budgets.end()) return it->second;
  int64_t budget = 0;
  if (const char* e = std::getenv("CW_ATTENTION_WORKSPACE_MIB"); e != nullptr && *e != '\0') {
    char* end = nullptr;
    const long long mib = std::strtoll(e, &end, 10);
    if (end == e || *end != '\0' || mib < 0)
      fail(std::string("environment variable CW_ATTENTION_WORKSPACE_MIB='") + e + "' is not a number of MiB",
           "set it to a whole number, e.g. 1024, or unset it for a quarter of the free device memory");
    budget = static_cast<int64_t>(mib) << 20;
  } else {
    budget = std::max(kMinWorkspaceBudget, static_cast<int64_t>(memory_info(device).free / 4));
  }
  budgets.emplace(device, budget);
  return budget;
}

bool use_cudnn(const Tensor& q, const Tensor& k, const Tensor& v, bool backward) {
  switch (attention_impl()) {
    case AttentionImpl::flash: return false;
    case AttentionImpl::automatic:
      if (!backward) return cudnn_attention_forward_supports(q, k);
      return !deterministic() && cudnn_attention_forward_supports(q, k) &&
             cudnn_attention_backward_fits(q, k, v, workspace_budget(q.device.index));
    case AttentionImpl::cudnn: {
      std::string why;
      if (!(backward ? cudnn_attention_supports(q, k, &why) : cudnn_attention_forward_supports(q, k, &why)))
        fail("attention: cuDNN was requested (CW_ATTENTION=cudnn) but cannot take " + q.describe() + ": " + why,
             "use CW_ATTENTION=auto or flash");
      return true;
    }
  }
  return false;
}

}  // namespace

void set_attention_impl(AttentionImpl impl) { g_impl.store(static_cast<int>(impl)); }

void set_deterministic(bool on) { g_deterministic.store(on ? 1 : 0); }

bool deterministic() {
  int v = g_deterministic.load();
  if (v < 0) {
    v = env_switch("CW_DETERMINISTIC",
                   "use CW_DETERMINISTIC=1 for bitwise-reproducible gradients, 0 (the default) for the fastest kernels")
            ? 1
            : 0;
    g_deterministic.store(v);
  }
  return v == 1;
}

AttentionImpl attention_impl() {
  int v = g_impl.load();
  if (v < 0) {
    v = static_cast<int>(impl_from_env());
    g_impl.store(v);
  }
  return static_cast<AttentionImpl>(v);
}

const char* attention_impl_name(AttentionImpl impl) {
  switch (impl) {
    case AttentionImpl::automatic: return "auto";
    case AttentionImpl::cudnn: return "cudnn";
    case AttentionImpl::flash: return "flash";
  }
  return "?";
}

void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch) {
  if (use_cudnn(q, k, v, false)) return cudnn_attention_forward(out, saved, q, k, v, scale, scratch);
  flash_attention_forward(out, saved, q, k, v, scale, scratch);
}

void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch) {
  if (use_cudnn(q, k, v, true)) return cudnn_attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch);
  flash_attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch);
}

#if !CW_HAVE_CUDNN
// A build without cuDNN: the flash kernel serves every case.
bool cudnn_attention_supports(const Tensor&, const Tensor&, std::string* why_not) {
  if (why_not) *why_not = "this build has no cuDNN";
  return false;
}
bool cudnn_attention_forward_supports(const Tensor& q, const Tensor& k, std::string* why_not) {
  return cudnn_attention_supports(q, k, why_not);
}
bool cudnn_attention_backward_fits(const Tensor& q, const Tensor& k, const Tensor&, int64_t, std::string* why_not) {
  return cudnn_attention_supports(q, k, why_not);
}
void set_cudnn_autotune(bool) {}
bool cudnn_autotune() { return false; }
void cudnn_attention_forward(const Tensor&, const AttentionSaved&, const Tensor&, const Tensor&, const Tensor&, double,
                             Arena&) {
  fail("attention: this build has no cuDNN", "rebuild with cuDNN installed, or use CW_ATTENTION=flash");
}
void cudnn_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AttentionSaved&,
                              const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, GradMode, Arena&) {
  fail("attention: this build has no cuDNN", "rebuild with cuDNN installed, or use CW_ATTENTION=flash");
}
#endif

}  // namespace cw::gpu
