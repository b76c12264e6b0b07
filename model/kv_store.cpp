#include "model/kv_store.h"

#include <algorithm>

namespace cw {

KVStore::KVStore(const LlamaConfig& c, int64_t batch, int64_t tokens, DType dtype, const KVStoreOptions& options)
    : options_(options), L_(c.num_hidden_layers), B_(batch), T_(tokens), H_(c.num_attention_heads),
      Hkv_(c.num_key_value_heads), D_(c.head_dim), C_(c.hidden_size), softcap_(c.attn_logit_softcapping),
      dtype_(dtype) {
  for (int64_t l = 0; l < L_; ++l) windows_.push_back(c.layer_window(l));
  const KVStoreOptions& o = options;
  CW_CHECK(batch > 0 && tokens > 0, "K/V store for batch {} and {} tokens", batch, tokens);
  CW_CHECK(o.offload_window >= 0,
           "schedule.offload_window must be >= 0 (0: the whole K/V store on the device), got {}", o.offload_window);
  CW_CHECK(o.with_grads || !o.attention_outputs, "saved attention outputs need a K/V store with gradient accumulators");
  CW_CHECK(o.with_grads || !o.layer_inputs, "saved layer inputs need a K/V store with gradient accumulators");
  CW_CHECK(!(o.layer_inputs && o.stream_block > 0), "K/V store: saved layer inputs are not kept by a streamed store "
           "(schedule.save_inputs with stream_kv)");
  CW_CHECK(o.stream_block >= 0, "K/V store: stream block {} must be >= 0 (0: not streamed)", o.stream_block);
  CW_CHECK(!o.layer_local_grads || (o.stream_block == 0 && (o.offload_window == 0 || o.offload_window >= L_)),
           "K/V store: layer-local gradients are for a store on the device (no offload window, not streamed)");
  CW_CHECK(o.stream_block == 0 || o.offload_window == 0, "schedule.stream_kv and schedule.offload_window are two kinds "
           "of K/V offload; set offload_window = 0 with stream_kv");
  // The options as applied (options()): what a caller compares to decide whether a store serves.
  options_.layer_local_grads = o.layer_local_grads && o.with_grads;
  options_.offload_window = o.offload_window < L_ ? o.offload_window : 0;
  options_.stream_block = std::min(o.stream_block, tokens);
  layout_ = {L_, B_, T_, H_, Hkv_, D_, C_, dtype, o.with_grads, o.attention_outputs, o.layer_inputs};
  written_.live_end = tokens;
  if (options_.stream_block > 0) {
    stream_ = std::make_unique<KVStream>(layout_, o.device, options_.stream_block);
    return;
  }
  if (options_.offload_window > 0) {
    window_ = std::make_unique<KVWindow>(layout_, o.device, options_.offload_window);
    return;
  }
  for (int64_t l = 0; l < L_; ++l)
    for (int p = 0; p < kParts; ++p) {
      const KVPart part = static_cast<KVPart>(p);
      const bool shared = options_.layer_local_grads && (part == kDKeys || part == kDValues);
      if (layout_.has(part) && (l == 0 || !shared))
        bufs_[p].emplace_back(layout_.row_bytes(part) * static_cast<size_t>(B_ * T_), o.device);
    }
}

KVStore::~KVStore() = default;

size_t KVStore::host_bytes_needed(const LlamaConfig& c, int64_t batch, int64_t tokens, DType dtype,
                                  const KVStoreOptions& options) {
  const size_t row = static_cast<size_t>(c.num_key_value_heads * c.head_dim), acc = dtype_size(accum_dtype(dtype));
  size_t per_token = 2 * row * dtype_size(dtype) + (options.with_grads ? 2 * row * acc : 0);
  if (options.attention_outputs)
    per_token += static_cast<size_t>(c.num_attention_heads * c.head_dim) * dtype_size(dtype) +
                 static_cast<size_t>(c.num_attention_heads) * acc;
  if (options.layer_inputs) per_token += static_cast<size_t>(c.hidden_size) * dtype_size(dtype);
  return per_token * static_cast<size_t>(c.num_hidden_layers * batch * tokens);
}

void KVStore::check_range(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(layer >= 0 && layer < L_, "K/V store has no layer {}", layer);
  CW_CHECK(0 <= t0 && t0 <= t1 && t1 <= T_, "K/V store range [{}, {}) outside [0, {})", t0, t1, T_);
  CW_CHECK(t1 <= written_.live_end, "K/V store range [{}, {}) reaches released tokens (live up to {})", t0, t1,
           written_.live_end);
}

// Rows [t0, t1) of `part`: streamed, they lie in one block and are rows of that block's device slot
// (counted from the block's start); otherwise rows of the layer's buffer or slot. The data, the rows a
// sequence has there (the block length or T) and t0's row.
KVStore::Rows KVStore::rows_of(KVPart part, int layer, int64_t t0, int64_t t1) const {
  check_range(layer, t0, t1);
  if (stream_) {
    const int64_t j = stream_->block_of(t0, t1);
    return {stream_->device(layer, j, part), stream_->block(), t0 - j * stream_->block()};
  }
  if (window_) return {window_->device(layer, part), T_, t0};
  const bool shared = options_.layer_local_grads && (part == kDKeys || part == kDValues);
  return {bufs_[part][shared ? 0 : static_cast<size_t>(layer)].data(), T_, t0};
}

Tensor KVStore::view(KVPart part, int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(has_grads() || part < kDKeys, "K/V store was built without gradient accumulators");
  const DType dt = part >= kDKeys ? accum_dtype(dtype_) : dtype_;
  const Rows r = rows_of(part, layer, t0, t1);
  return Tensor(r.data, dt, device(), {B_, r.n, Hkv_, D_}).slice(1, r.r0, t1 - t0);
}

Tensor KVStore::outputs(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(has_outputs(), "K/V store was built without saved attention outputs");
  const Rows r = rows_of(kOut, layer, t0, t1);
  return Tensor(r.data, dtype_, device(), {B_, r.n, H_, D_}).slice(1, r.r0, t1 - t0);
}

Tensor KVStore::output_lse(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(has_outputs(), "K/V store was built without saved attention outputs");
  const Rows r = rows_of(kLse, layer, t0, t1);
  return Tensor(r.data, accum_dtype(dtype_), device(), {B_ * H_, r.n}).slice(1, r.r0, t1 - t0);
}

Tensor KVStore::inputs(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(has_inputs(), "K/V store was built without saved layer inputs");
  const Rows r = rows_of(kIn, layer, t0, t1);
  return Tensor(r.data, dtype_, device(), {B_, r.n, C_}).slice(1, r.r0, t1 - t0);
}

void KVStore::begin_layer(int layer, Use use, int64_t t0, int64_t t1) {
  if (stream_) return stream_->begin_layer(layer, use, t0, t1, written_);
  if (window_) return window_->begin_layer(layer, use, t0, t1, written_);
  if (options_.layer_local_grads && use == Use::backward) {
    CW_CHECK(t0 == 0 && t1 == T_, "K/V store with layer-local gradients: layer {}'s backward covers [{}, {}), not "
             "all {} tokens (they need one backward chunk)", layer, t0, t1, T_);
    for (KVPart p : {kDKeys, kDValues}) fill(view(p, layer, 0, T_), 0.0);
  }
}

void KVStore::end_layer(int layer, Use use, int64_t t0, int64_t t1) {
  // Every layer has written its outputs of [t0, t1) once the last one has.
  if (use == Use::forward && has_outputs() && layer == L_ - 1)
    written_.outputs_end = std::max(written_.outputs_end, t1);
  if (use == Use::forward && has_inputs() && layer == L_ - 1) written_.inputs_end = std::max(written_.inputs_end, t1);
  if (stream_) stream_->end_layer(layer, use, t0, t1);
  if (window_) window_->end_layer(layer, use, t0, t1);
}

void KVStore::zero_grads() {
  if (!has_grads()) return;
  if (stream_) return stream_->zero_grads();
  if (window_) return window_->zero_grads();
  if (options_.layer_local_grads) return;  // begin_layer zeroes the one layer's accumulators before each backward
  for (KVPart p : {kDKeys, kDValues})
    for (auto& b : bufs_[p]) fill(Tensor(b.data(), DType::f32, device(), {static_cast<int64_t>(b.bytes() / 4)}), 0.0);
}

void KVStore::release_from(int64_t t) {
  CW_CHECK(t >= 0 && t <= T_, "release_from({}) outside [0, {}]", t, T_);
  written_.live_end = std::min(written_.live_end, t);
}

void KVStore::reset() {
  written_ = {T_, 0, 0};
  if (stream_) stream_->reset();
  if (window_) window_->reset();
  zero_grads();
}

size_t KVStore::bytes() const {
  if (stream_) return stream_->device_bytes();
  if (window_) return window_->device_bytes();
  size_t n = 0;
  for (const auto& part : bufs_)
    for (const auto& b : part) n += b.bytes();
  return n;
}

size_t KVStore::host_bytes() const {
  return stream_ ? stream_->host_bytes() : window_ ? window_->host_bytes() : 0;
}

size_t KVStore::bytes_moved() const {
  return stream_ ? stream_->bytes_moved() : window_ ? window_->bytes_moved() : 0;
}

size_t KVStore::bytes_per_token() const { return (bytes() + host_bytes()) / static_cast<size_t>(B_ * T_); }

namespace {
[[noreturn]] void refuse_streamed_documents_in_a_window() {
  fail("packed documents with a sliding window (config sliding_window) in a streamed K/V store (schedule.stream_kv) "
       "are not implemented",
       "keep the store on the device or offloaded by layers (schedule.offload_window) for this model's packed runs");
}
}  // namespace

int64_t KVStore::first_key(int layer, int64_t t0) const { return window_first_key(t0, window_size(layer)); }

// With a sliding window the calls read only keys [first_key(layer, t0), t1): the views start there (the
// documents' calls start each span's there or later), so no dK, dV is added before it and SeCO's
// relay stops at the window.
void KVStore::attend_forward(int layer, int64_t t0, int64_t t1, const Tensor& out, const AttentionSaved& saved,
                             const Tensor& q, double scale, Arena& scratch,
                             const std::vector<std::vector<int64_t>>* doc_starts, const Tensor& first_keys) {
  const int64_t window = window_size(layer);
  if (stream_) {
    if (doc_starts && window > 0) refuse_streamed_documents_in_a_window();
    return stream_->attend_forward(*this, layer, t0, t1, out, saved, q, scale, scratch, window, softcap_, doc_starts);
  }
  if (doc_starts) {
    attention_forward_documents(out, saved, q, keys(layer, 0, t1), values(layer, 0, t1), *doc_starts, scale, scratch,
                                window, softcap_, first_keys);
    return;
  }
  const int64_t k0 = first_key(layer, t0);
  attention_forward(out, saved, q, keys(layer, k0, t1), values(layer, k0, t1), scale, scratch, AttentionMask::causal,
                    {window}, softcap_);
}

void KVStore::attend_backward(int layer, int64_t t0, int64_t t1, const Tensor& d_q, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& out, double scale,
                              Arena& scratch, const std::vector<std::vector<int64_t>>* doc_starts,
                              const Tensor& first_keys) {
  const int64_t window = window_size(layer);
  if (stream_) {
    if (doc_starts && window > 0) refuse_streamed_documents_in_a_window();
    return stream_->attend_backward(*this, layer, t0, t1, d_q, d_out, saved, q, out, scale, scratch, window, softcap_,
                                    doc_starts);
  }
  if (doc_starts) {
    attention_backward_documents(d_q, d_keys(layer, 0, t1), d_values(layer, 0, t1), d_out, saved, q,
                                 keys(layer, 0, t1), values(layer, 0, t1), out, *doc_starts, scale,
                                 GradMode::overwrite, scratch, window, softcap_, first_keys);
    return;
  }
  const int64_t k0 = first_key(layer, t0);
  attention_backward(d_q, d_keys(layer, k0, t1), d_values(layer, k0, t1), d_out, saved, q, keys(layer, k0, t1),
                     values(layer, k0, t1), out, scale, GradMode::overwrite, scratch, AttentionMask::causal,
                     {window}, softcap_);
}

}  // namespace cw
