#include "model/kv_store.h"

#include <cstring>

namespace cw {

KVStore::KVStore(const LlamaConfig& c, int64_t batch, int64_t tokens, DType dtype, bool with_grads, Device device)
    : L_(c.num_hidden_layers), B_(batch), T_(tokens), Hkv_(c.num_key_value_heads), D_(c.head_dim), dtype_(dtype),
      device_(device), live_end_(tokens) {
  CW_CHECK(batch > 0 && tokens > 0, "K/V store for batch {} and {} tokens", batch, tokens);
  const size_t elems = static_cast<size_t>(B_ * T_ * Hkv_ * D_);
  for (int64_t l = 0; l < L_; ++l) {
    k_.emplace_back(elems * dtype_size(dtype), device);
    v_.emplace_back(elems * dtype_size(dtype), device);
    if (with_grads) {
      dk_.emplace_back(elems * dtype_size(accum_dtype(dtype)), device);
      dv_.emplace_back(elems * dtype_size(accum_dtype(dtype)), device);
    }
  }
}

Tensor KVStore::view(const std::vector<HostBuffer>& bufs, int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(!bufs.empty(), "K/V store was built without gradient accumulators");
  CW_CHECK(layer >= 0 && layer < L_, "K/V store has no layer {}", layer);
  CW_CHECK(0 <= t0 && t0 <= t1 && t1 <= T_, "K/V store range [{}, {}) outside [0, {})", t0, t1, T_);
  CW_CHECK(t1 <= live_end_, "K/V store range [{}, {}) reaches released tokens (live up to {})", t0, t1, live_end_);
  const DType dt = (&bufs == &dk_ || &bufs == &dv_) ? accum_dtype(dtype_) : dtype_;
  Tensor whole = Tensor(bufs[static_cast<size_t>(layer)].data(), dt, device_, {B_, T_, Hkv_, D_});
  return whole.slice(1, t0, t1 - t0);
}

void KVStore::zero_grads() {
  for (auto* bufs : {&dk_, &dv_})
    for (auto& b : *bufs)
      if (b.bytes()) fill(Tensor(b.data(), DType::f32, device_, {static_cast<int64_t>(b.bytes() / 4)}), 0.0);
}

void KVStore::release_from(int64_t t) {
  CW_CHECK(t >= 0 && t <= T_, "release_from({}) outside [0, {}]", t, T_);
  live_end_ = std::min(live_end_, t);
}

void KVStore::reset() {
  live_end_ = T_;
  zero_grads();
}

size_t KVStore::bytes() const {
  size_t n = 0;
  for (auto* bufs : {&k_, &v_, &dk_, &dv_})
    for (const auto& b : *bufs) n += b.bytes();
  return n;
}

size_t KVStore::bytes_per_token() const { return bytes() / static_cast<size_t>(B_ * T_); }

}  // namespace cw
