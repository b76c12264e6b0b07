// The K/V store: every layer's post-RoPE keys and values for every processed token, and their
// gradient accumulators.
//
// Layout: per layer, separate buffers K, V [B, T, Hkv, D] (the grouped heads, never expanded) in the
// compute dtype, and dK, dV of the same shape in the accumulation dtype (f64 in f64 mode, f32
// otherwise). A range of token positions [t0, t1) of a layer is a view with batch stride T*Hkv*D,
// which the attention op accepts directly. The unit of placement is the layer: each layer's four
// buffers are independent allocations, so a GPU backend can keep a window of layers on the device
// and the rest in pinned host memory, moving one layer ahead of use.
//
// Ranges are tracked: `release_from(t)` marks tokens [t, T) as released (SeCO's reverse sweep is done
// with them), after which a view that touches them is an error, so a schedule that reads what it
// has already given up is caught in tests.
//
// Who writes what (SeCO): the prefill writes K, V of each chunk; the reverse sweep's recompute
// rewrites the chunk's own K, V; each chunk's attention backward ADDS into dK, dV over [0, p+c);
// the chunk then reads dK, dV over its own [p, p+c) (local plus everything later chunks added).
#pragma once

#include "engine/memory.h"
#include "model/config.h"

#include <vector>

namespace cw {

class KVStore {
 public:
  // device: where the buffers live (host memory, or one GPU's: the GPU backend keeps the whole store
  // on the device; bf16 K/V with f32 gradients under the GPU precision policy).
  KVStore(const LlamaConfig& config, int64_t batch, int64_t tokens, DType dtype, bool with_grads,
          Device device = Device::host());

  Tensor keys(int layer, int64_t t0, int64_t t1) const { return view(k_, layer, t0, t1); }
  Tensor values(int layer, int64_t t0, int64_t t1) const { return view(v_, layer, t0, t1); }
  Tensor d_keys(int layer, int64_t t0, int64_t t1) const { return view(dk_, layer, t0, t1); }
  Tensor d_values(int layer, int64_t t0, int64_t t1) const { return view(dv_, layer, t0, t1); }

  void zero_grads();
  void release_from(int64_t t);  // tokens [t, T) are no longer readable
  void reset();                  // all tokens readable again, gradients zeroed

  int64_t batch() const { return B_; }
  int64_t tokens() const { return T_; }
  bool has_grads() const { return !dk_.empty(); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  DType grad_dtype() const { return accum_dtype(dtype_); }
  size_t bytes() const;          // all buffers
  size_t bytes_per_token() const;

 private:
  Tensor view(const std::vector<HostBuffer>& bufs, int layer, int64_t t0, int64_t t1) const;

  int64_t L_, B_, T_, Hkv_, D_;
  DType dtype_;
  Device device_;
  int64_t live_end_;
  std::vector<HostBuffer> k_, v_, dk_, dv_;
};

}  // namespace cw
