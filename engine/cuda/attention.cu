// The GPU attention entry points: choose between cuDNN's fused attention and our own flash kernel.
//
// Choice (process-wide, `set_attention_impl` or the environment variable CW_ATTENTION = auto | cudnn |
// flash, read once): `automatic` takes cuDNN where it serves (bf16, head dim a multiple of 8 up to
// 128, a cuDNN that supports bottom-right causal masks), each direction on its own: the forward where
// cudnn_attention_forward_supports() says so; the backward always on the flash kernel (see use_cudnn:
// cuDNN's backward workspace grows with S^2); a cuDNN forward's out and lse feed the flash backward
// unchanged (both are the op's contract).
// The flash kernel serves everything else (f32 checks, small or odd head dims, builds without cuDNN). `cudnn` forces
// cuDNN and makes an unsupported case an error naming the reason; `flash` forces our kernel.
// Both implementations share the op's contract (engine/ops/attention.h): lse saved in f32, dK/dV
// ADDED in f32 into the caller's buffers over all S keys.
#include "chunkwise_config.h"
#include "engine/cuda/ops.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace cw::gpu {
namespace {

AttentionImpl impl_from_env() {
  const char* e = std::getenv("CW_ATTENTION");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "auto") == 0) return AttentionImpl::automatic;
  if (std::strcmp(e, "cudnn") == 0) return AttentionImpl::cudnn;
  if (std::strcmp(e, "flash") == 0) return AttentionImpl::flash;
  fail(std::string("environment variable CW_ATTENTION='") + e + "' is not an attention implementation",
       "use auto, cudnn or flash");
}

std::atomic<int> g_impl{-1};  // -1: not yet read from the environment

bool use_cudnn(const Tensor& q, const Tensor& k, bool backward) {
  switch (attention_impl()) {
    case AttentionImpl::flash: return false;
    case AttentionImpl::automatic:
      // The cuDNN backward is correct but, with the graphs we can build, takes a workspace that grows
      // with S^2 (about 12 GiB at 8K tokens, 48 GiB at 16K on the H100) and is slower than torch's
      // cuDNN backend, so `automatic` pairs the cuDNN forward with the flash backward; CW_ATTENTION=cudnn
      // still runs both directions on cuDNN.
      return backward ? false : cudnn_attention_forward_supports(q, k);
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
  if (use_cudnn(q, k, false)) return cudnn_attention_forward(out, saved, q, k, v, scale, scratch);
  flash_attention_forward(out, saved, q, k, v, scale, scratch);
}

void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch) {
  if (use_cudnn(q, k, true)) return cudnn_attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch);
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
