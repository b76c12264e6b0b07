#include "model/kv_store.h"

#include "engine/ops/residual.h"

#include <algorithm>

namespace cw {

KVStore::KVStore(const LlamaConfig& c, int64_t batch, int64_t tokens, DType dtype, const KVStoreOptions& options)
    : L_(c.num_hidden_layers), B_(batch), T_(tokens), H_(c.num_attention_heads),
      Hkv_(c.num_key_value_heads), D_(c.head_dim), C_(c.hidden_size), dtype_(dtype), device_(options.device),
      with_grads_(options.with_grads), with_outputs_(options.attention_outputs), with_inputs_(options.layer_inputs),
      live_end_(tokens) {
  const Device device = options.device;
  const int64_t offload_window = options.offload_window, stream_block = options.stream_block;
  const bool with_grads = options.with_grads, attention_outputs = options.attention_outputs;
  const bool layer_inputs = options.layer_inputs, layer_local_grads = options.layer_local_grads;
  CW_CHECK(batch > 0 && tokens > 0, "K/V store for batch {} and {} tokens", batch, tokens);
  CW_CHECK(offload_window >= 0, "schedule.offload_window must be >= 0 (0: the whole K/V store on the device), got {}",
           offload_window);
  CW_CHECK(with_grads || !attention_outputs, "saved attention outputs need a K/V store with gradient accumulators");
  CW_CHECK(with_grads || !layer_inputs, "saved layer inputs need a K/V store with gradient accumulators");
  CW_CHECK(!(layer_inputs && stream_block > 0), "K/V store: saved layer inputs are not kept by a streamed store "
           "(schedule.save_inputs with stream_kv)");
  CW_CHECK(stream_block >= 0, "K/V store: stream block {} must be >= 0 (0: not streamed)", stream_block);
  CW_CHECK(!layer_local_grads || (stream_block == 0 && (offload_window == 0 || offload_window >= L_)),
           "K/V store: layer-local gradients are for a store on the device (no offload window, not streamed)");
  layer_local_grads_ = layer_local_grads && with_grads;
  if (stream_block > 0) {
    CW_CHECK(offload_window == 0, "schedule.stream_kv and schedule.offload_window are two kinds of K/V offload; set "
             "offload_window = 0 with stream_kv");
    block_ = std::min(stream_block, tokens);
    blocks_ = (tokens + block_ - 1) / block_;
    std::vector<size_t> sizes;
    for (int p = 0; p < kIn; ++p)
      sizes.push_back(has_part(static_cast<Part>(p)) ? row_bytes(static_cast<Part>(p)) * static_cast<size_t>(B_ * block_) : 0);
    // The chunk's own block, the prefix block being attended and the next one coming in.
    res_ = std::make_unique<Residency>(device, sizes, static_cast<int>(L_ * blocks_), 3, "kv block");
    home_kv_.assign(static_cast<size_t>(L_ * blocks_), 0);
    home_grads_.assign(static_cast<size_t>(L_ * blocks_), 0);
    return;
  }
  if (offload_window > 0 && offload_window < L_) {
    std::vector<size_t> sizes;
    for (int p = 0; p < kParts; ++p) sizes.push_back(has_part(static_cast<Part>(p)) ? part_bytes(static_cast<Part>(p)) : 0);
    res_ = std::make_unique<Residency>(device, sizes, static_cast<int>(L_), static_cast<int>(offload_window), "kv layer");
    dev_kv_end_.assign(static_cast<size_t>(L_), 0);
    dev_grad_end_.assign(static_cast<size_t>(L_), 0);
    host_kv_end_.assign(static_cast<size_t>(L_), 0);
    host_grad_end_.assign(static_cast<size_t>(L_), 0);
    dev_out_.assign(static_cast<size_t>(L_), {0, 0});
    dev_in_.assign(static_cast<size_t>(L_), {0, 0});
    return;
  }
  for (int64_t l = 0; l < L_; ++l)
    for (int p = 0; p < kParts; ++p)
      if (has_part(static_cast<Part>(p)) && (l == 0 || !(layer_local_grads_ && (p == kDKeys || p == kDValues))))
        bufs_[p].emplace_back(part_bytes(static_cast<Part>(p)), device);
}

bool KVStore::has_part(Part part) const {
  switch (part) {
    case kKeys: case kValues: return true;
    case kDKeys: case kDValues: return with_grads_;
    case kOut: case kLse: return with_outputs_;
    case kIn: return with_inputs_;
    default: return false;
  }
}

size_t KVStore::row_bytes(Part part) const {
  switch (part) {
    case kKeys: case kValues: return static_cast<size_t>(Hkv_ * D_) * dtype_size(dtype_);
    case kDKeys: case kDValues: return static_cast<size_t>(Hkv_ * D_) * dtype_size(accum_dtype(dtype_));
    case kOut: return static_cast<size_t>(H_ * D_) * dtype_size(dtype_);
    case kIn: return static_cast<size_t>(C_) * dtype_size(dtype_);
    default: return static_cast<size_t>(H_) * dtype_size(accum_dtype(dtype_));  // kLse
  }
}

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
  CW_CHECK(t1 <= live_end_, "K/V store range [{}, {}) reaches released tokens (live up to {})", t0, t1, live_end_);
}

// Rows [t0, t1) of `part`: streamed, they lie in one block and are rows of that block's device slot
// (counted from the block's start); otherwise rows of the layer's buffer. The data, the rows a
// sequence has there (the block length or T) and t0's row.
KVStore::Rows KVStore::rows_of(Part part, int layer, int64_t t0, int64_t t1) const {
  check_range(layer, t0, t1);
  if (block_ > 0) {
    const int64_t j = block_of(t0, t1);
    return {res_->device(item(layer, j), part), block_, t0 - j * block_};
  }
  if (res_) return {res_->device(layer, part), T_, t0};
  const bool shared = layer_local_grads_ && (part == kDKeys || part == kDValues);
  return {bufs_[part][shared ? 0 : static_cast<size_t>(layer)].data(), T_, t0};
}

Tensor KVStore::view(Part part, int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(with_grads_ || part < kDKeys, "K/V store was built without gradient accumulators");
  const DType dt = part >= kDKeys ? accum_dtype(dtype_) : dtype_;
  const Rows r = rows_of(part, layer, t0, t1);
  return Tensor(r.data, dt, device_, {B_, r.n, Hkv_, D_}).slice(1, r.r0, t1 - t0);
}

Tensor KVStore::outputs(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(with_outputs_, "K/V store was built without saved attention outputs");
  const Rows r = rows_of(kOut, layer, t0, t1);
  return Tensor(r.data, dtype_, device_, {B_, r.n, H_, D_}).slice(1, r.r0, t1 - t0);
}

Tensor KVStore::output_lse(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(with_outputs_, "K/V store was built without saved attention outputs");
  const Rows r = rows_of(kLse, layer, t0, t1);
  return Tensor(r.data, accum_dtype(dtype_), device_, {B_ * H_, r.n}).slice(1, r.r0, t1 - t0);
}

Tensor KVStore::inputs(int layer, int64_t t0, int64_t t1) const {
  CW_CHECK(with_inputs_, "K/V store was built without saved layer inputs");
  const Rows r = rows_of(kIn, layer, t0, t1);
  return Tensor(r.data, dtype_, device_, {B_, r.n, C_}).slice(1, r.r0, t1 - t0);
}

int64_t KVStore::block_of(int64_t t0, int64_t t1) const {
  const int64_t j = t0 / block_;
  CW_CHECK(t1 <= j * block_ + block_rows(j), "streamed K/V store: range [{}, {}) crosses a block of {} tokens", t0, t1,
           block_);
  return j;
}

void KVStore::fetch_block(int layer, int64_t block, bool kv, bool grads) {
  const int it = item(layer, block);
  const int64_t rows = block_rows(block);
  std::vector<Residency::Span> need;
  if (kv) {
    CW_CHECK(home_kv_[static_cast<size_t>(it)], "streamed K/V store: layer {} block {} read before a forward wrote it",
             layer, block);
    need = spans(kKeys, kValues, 0, rows);
  }
  if (grads)
    for (Residency::Span sp : spans(kDKeys, kDValues, 0, rows)) {
      sp.zero = !home_grads_[static_cast<size_t>(it)];  // a home not written this step is logical zeros
      need.push_back(sp);
    }
  res_->fetch(it, need);
}

// The byte spans of rows [r0, r1) for parts first..last, one strided span a part: token rows of every
// sequence, and for lse columns of every (sequence, head) row. A part holds n rows a sequence: T, or
// streamed one block's Kb (rows then counted from the block's start).
std::vector<Residency::Span> KVStore::spans(Part first, Part last, int64_t r0, int64_t r1) const {
  std::vector<Residency::Span> out;
  if (r1 <= r0) return out;
  const int64_t n = block_ > 0 ? block_ : T_;
  for (int p = first; p <= last; ++p) {
    const bool lse = p == kLse;  // [B*H, n] of single values
    const size_t unit = lse ? dtype_size(accum_dtype(dtype_)) : row_bytes(static_cast<Part>(p));
    const int64_t rows = lse ? B_ * H_ : B_;
    out.push_back({p, static_cast<size_t>(r0) * unit, static_cast<size_t>(r1 - r0) * unit, false,
                   static_cast<size_t>(rows), static_cast<size_t>(n) * unit});
  }
  return out;
}

std::vector<Residency::Span> KVStore::grad_spans(int layer, int64_t t0, int64_t t1) const {
  const int64_t written = std::clamp(host_grad_end_[static_cast<size_t>(layer)], t0, t1);
  std::vector<Residency::Span> out = spans(kDKeys, kDValues, t0, written);
  for (Residency::Span sp : spans(kDKeys, kDValues, written, t1)) {
    sp.zero = true;
    out.push_back(sp);
  }
  return out;
}

// Adds rows [t0, t1) of a prefill's saved parts first..last to `need` unless the layer's slot holds
// them already (`have`: the rows the slot holds; `written`: the rows the prefill wrote).
void KVStore::fetch_saved(Part first, Part last, std::pair<int64_t, int64_t>& have, int64_t written, int64_t t0,
                          int64_t t1, std::vector<Residency::Span>& need) const {
  if (have.first <= t0 && t1 <= have.second) return;
  CW_CHECK(t1 <= written, "saved {} of tokens [{}, {}) were not written (prefill wrote [0, {}))",
           first == kIn ? "layer inputs" : "attention outputs", t0, t1, written);
  const auto s = spans(first, last, t0, t1);
  need.insert(need.end(), s.begin(), s.end());
  have = {t0, t1};
}

void KVStore::fetch_outputs(int layer, int64_t t0, int64_t t1, std::vector<Residency::Span>& need) {
  fetch_saved(kOut, kLse, dev_out_[static_cast<size_t>(layer)], outputs_end_, t0, t1, need);
}

void KVStore::fetch_inputs(int layer, int64_t t0, int64_t t1, std::vector<Residency::Span>& need) {
  fetch_saved(kIn, kIn, dev_in_[static_cast<size_t>(layer)], inputs_end_, t0, t1, need);
}

// A layer not in a device slot (evicted, or never fetched) holds no rows there.
void KVStore::forget_slot_rows(size_t l) {
  dev_kv_end_[l] = dev_grad_end_[l] = 0;
  dev_out_[l] = dev_in_[l] = {0, 0};
}

void KVStore::begin_layer(int layer, Use use, int64_t t0, int64_t t1) {
  if (!res_) {
    if (layer_local_grads_ && use == Use::backward) {
      CW_CHECK(t0 == 0 && t1 == T_, "K/V store with layer-local gradients: layer {}'s backward covers [{}, {}), not "
               "all {} tokens (they need one backward chunk)", layer, t0, t1, T_);
      for (Part p : {kDKeys, kDValues}) fill(view(p, layer, 0, T_), 0.0);
    }
    return;
  }
  if (block_ > 0) {
    const int64_t j = t0 / block_;
    CW_CHECK(t0 == j * block_ && t1 <= t0 + block_rows(j),
             "streamed K/V store: chunk [{}, {}) is not one block of {} tokens (schedule.stream_kv needs the chunks to "
             "be the blocks: bwd_chunk = chunk)", t0, t1, block_);
    const int own = item(layer, j);
    if (use == Use::forward) {
      res_->fetch(own, {});  // the chunk writes its K, V (and outputs) into the slot
    } else if (use == Use::recompute) {
      res_->fetch(own, spans(kOut, kLse, 0, t1 - t0));
    } else {
      fetch_block(layer, j, true, true);
      // A layer recomputed inside the backward reads its saved outputs (when the prefill reached it).
      if (with_outputs_ && t1 <= outputs_end_) res_->fetch(own, spans(kOut, kLse, 0, t1 - t0));
    }
    res_->ready(own);
    return;
  }
  const size_t l = static_cast<size_t>(layer);
  if (!res_->resident(layer)) forget_slot_rows(l);
  if (use == Use::recompute) {
    std::vector<Residency::Span> need;
    fetch_outputs(layer, t0, t1, need);
    res_->fetch(layer, need);
    res_->ready_to_read(layer);  // the layer's dK, dV may still be going home from the last backward
    if (res_->slots() > 1 && layer + 1 < L_) prefetch(layer + 1, use, t0, t1);
    // The last layer's backward follows (after the LM head): what it reads (K, V, dK, dV [0, t1), the
    // largest copy of the chunk) comes in now, behind this recompute, which reads only saved outputs.
    if (layer == L_ - 1 && with_grads_) prefetch(layer, Use::backward, t0, t1);
    return;
  }
  // Forward: K, V [0, t0) must be current (the chunk writes [t0, t1)). Backward: K, V [0, t1) and dK, dV
  // [0, t1). What the slot already holds is not copied again.
  const int64_t kv_end = use == Use::forward ? t0 : t1;
  std::vector<Residency::Span> need;
  if (dev_kv_end_[l] < kv_end) need = spans(kKeys, kValues, dev_kv_end_[l], kv_end);
  if (use == Use::backward && dev_grad_end_[l] < t1) {
    const auto g = grad_spans(layer, dev_grad_end_[l], t1);
    need.insert(need.end(), g.begin(), g.end());
  }
  if (use == Use::backward && with_outputs_) fetch_outputs(layer, t0, t1, need);
  if (use == Use::backward && with_inputs_ && t1 <= inputs_end_) fetch_inputs(layer, t0, t1, need);
  res_->fetch(layer, need);
  dev_kv_end_[l] = std::max(dev_kv_end_[l], kv_end);
  if (use == Use::backward) dev_grad_end_[l] = std::max(dev_grad_end_[l], t1);
  res_->ready(layer);
  // The next layer in the direction of travel comes in while this one computes (with one slot there
  // is nowhere to put it). Forward wraps to layer 0 of the next chunk.
  if (res_->slots() > 1) {
    const int next = use == Use::forward ? (layer + 1) % static_cast<int>(L_) : layer - 1;
    if (next >= 0 && next != layer) prefetch(next, use, t0, t1);
  }
}

// What layer `layer` will read next, fetched ahead. [t0, t1): the chunk now in flight (the next
// layer of a backward or recompute works on the same chunk).
void KVStore::prefetch(int layer, Use use, int64_t t0, int64_t t1) {
  const size_t l = static_cast<size_t>(layer);
  if (!res_->resident(layer)) forget_slot_rows(l);
  if (use == Use::recompute) {
    std::vector<Residency::Span> need;
    fetch_outputs(layer, t0, t1, need);
    res_->fetch(layer, need);
    return;
  }
  // Everything the host holds that a coming call may read: K, V written so far (up to the live end);
  // in the backward also dK, dV up to the live end.
  const int64_t kv_end = std::min(host_kv_end_[l], live_end_);
  std::vector<Residency::Span> need;
  if (dev_kv_end_[l] < kv_end) need = spans(kKeys, kValues, dev_kv_end_[l], kv_end);
  if (use == Use::backward && dev_grad_end_[l] < live_end_) {
    const auto g = grad_spans(layer, dev_grad_end_[l], live_end_);
    need.insert(need.end(), g.begin(), g.end());
  }
  if (use == Use::backward && with_outputs_ && t1 <= outputs_end_) fetch_outputs(layer, t0, t1, need);
  if (use == Use::backward && with_inputs_ && t1 <= inputs_end_) fetch_inputs(layer, t0, t1, need);
  res_->fetch(layer, need);
  dev_kv_end_[l] = std::max(dev_kv_end_[l], kv_end);
  if (use == Use::backward) dev_grad_end_[l] = std::max(dev_grad_end_[l], live_end_);
}

void KVStore::end_layer(int layer, Use use, int64_t t0, int64_t t1) {
  // Every layer has written its outputs of [t0, t1) once the last one has.
  if (use == Use::forward && with_outputs_ && layer == L_ - 1) outputs_end_ = std::max(outputs_end_, t1);
  if (use == Use::forward && with_inputs_ && layer == L_ - 1) inputs_end_ = std::max(inputs_end_, t1);
  if (!res_ || use == Use::recompute) return;  // a recompute from saved outputs writes nothing
  if (block_ > 0) {
    // The chunk's K, V (and outputs) go home; its dK, dV are complete once its backward has read
    // them (nothing earlier attends these keys), so they stay.
    if (use == Use::forward) {
      const int own = item(layer, t0 / block_);
      res_->store(own, spans(kKeys, kValues, 0, t1 - t0));
      if (with_outputs_) res_->store(own, spans(kOut, kLse, 0, t1 - t0));
      home_kv_[static_cast<size_t>(own)] = 1;
    }
    return;
  }
  const size_t l = static_cast<size_t>(layer);
  if (use == Use::forward) {
    // The chunk's K, V (and saved outputs) go home (a recompute writes the same values again: the
    // copy is small, and keeping it unconditional keeps the host the single truth for everything a
    // layer wrote).
    std::vector<Residency::Span> out = spans(kKeys, kValues, t0, t1);
    if (with_outputs_) {
      const auto o = spans(kOut, kLse, t0, t1);
      out.insert(out.end(), o.begin(), o.end());
      dev_out_[l] = {t0, t1};
    }
    if (with_inputs_) {
      const auto in = spans(kIn, kIn, t0, t1);
      out.insert(out.end(), in.begin(), in.end());
      dev_in_[l] = {t0, t1};
    }
    res_->store(layer, out);
    dev_kv_end_[l] = std::max(dev_kv_end_[l], t1);
    host_kv_end_[l] = std::max(host_kv_end_[l], t1);
  } else {
    res_->store(layer, spans(kDKeys, kDValues, 0, t1));  // every key up to t1 got its share of dK, dV
    host_grad_end_[l] = std::max(host_grad_end_[l], t1);
  }
}

void KVStore::zero_grads() {
  if (!with_grads_) return;
  if (block_ > 0) {
    std::fill(home_grads_.begin(), home_grads_.end(), 0);
    res_->evict_all();
    return;
  }
  if (res_) {
    // The homes become logical zeros (nothing is cleared in host memory: the next fetch zeroes the
    // device rows); the slots are forgotten, so the next backward fetches (zeroes) its rows afresh.
    std::fill(host_grad_end_.begin(), host_grad_end_.end(), 0);
    res_->evict_all();
    return;
  }
  if (layer_local_grads_) return;  // begin_layer zeroes the one layer's accumulators before each backward
  for (Part p : {kDKeys, kDValues})
    for (auto& b : bufs_[p]) fill(Tensor(b.data(), DType::f32, device_, {static_cast<int64_t>(b.bytes() / 4)}), 0.0);
}

void KVStore::release_from(int64_t t) {
  CW_CHECK(t >= 0 && t <= T_, "release_from({}) outside [0, {}]", t, T_);
  live_end_ = std::min(live_end_, t);
}

void KVStore::reset() {
  live_end_ = T_;
  outputs_end_ = inputs_end_ = 0;
  if (block_ > 0) std::fill(home_kv_.begin(), home_kv_.end(), 0);
  if (res_ && block_ == 0) {
    std::fill(host_kv_end_.begin(), host_kv_end_.end(), 0);
    std::fill(dev_kv_end_.begin(), dev_kv_end_.end(), 0);
    std::fill(dev_grad_end_.begin(), dev_grad_end_.end(), 0);
    std::fill(dev_out_.begin(), dev_out_.end(), std::pair<int64_t, int64_t>{0, 0});
    std::fill(dev_in_.begin(), dev_in_.end(), std::pair<int64_t, int64_t>{0, 0});
  }
  zero_grads();
}

size_t KVStore::bytes() const {
  if (res_) return res_->device_bytes();
  size_t n = 0;
  for (const auto& part : bufs_)
    for (const auto& b : part) n += b.bytes();
  return n;
}

size_t KVStore::host_bytes() const { return res_ ? res_->host_bytes() : 0; }

size_t KVStore::bytes_per_token() const { return (bytes() + host_bytes()) / static_cast<size_t>(B_ * T_); }

void KVStore::for_prefix_blocks(int layer, int64_t j, bool grads,
                                const std::function<void(int item, int64_t k0, int64_t k1)>& visit) {
  const int own = item(layer, j);
  for (int64_t i = 0; i < j; ++i) {
    res_->ready(item(layer, i));
    res_->fetch(own, {});  // most recently used: the prefetch below takes the block before this one
    if (i + 1 < j) fetch_block(layer, i + 1, true, grads);
    visit(item(layer, i), i * block_, i * block_ + block_rows(i));
  }
}

namespace {
[[noreturn]] void refuse_streamed_documents() {
  fail("packed documents with a streamed K/V store (schedule.stream_kv) are not implemented",
       "keep the store in host memory with schedule.offload_window instead");
}
}  // namespace

void KVStore::attend_forward(int layer, int64_t t0, int64_t t1, const Tensor& out, const AttentionSaved& saved,
                             const Tensor& q, double scale, Arena& scratch,
                             const std::vector<std::vector<int64_t>>* doc_starts) {
  if (doc_starts) {
    if (block_ != 0) refuse_streamed_documents();
    attention_forward_documents(out, saved, q, keys(layer, 0, t1), values(layer, 0, t1), *doc_starts, scale, scratch);
    return;
  }
  if (block_ == 0) {
    attention_forward(out, saved, q, keys(layer, 0, t1), values(layer, 0, t1), scale, scratch);
    return;
  }
  // The chunk against its own block (causal), then against each earlier block (unmasked), merged in
  // the accumulation dtype; the next block comes in while one is attended.
  const int64_t j = t0 / block_;
  if (j > 0) fetch_block(layer, 0, true, false);  // queued first: it comes in while the own block is attended
  attention_forward(out, saved, q, keys(layer, t0, t1), values(layer, t0, t1), scale, scratch);
  if (j == 0) return;
  ArenaScope scope(scratch);
  const int64_t B = out.size(0), c = out.size(1), H = out.size(2), D = out.size(3);
  const Tensor acc = scratch.alloc(saved.lse.dtype, {B, c, H, D}), block_out = scratch.alloc(out.dtype, {B, c, H, D});
  const Tensor block_lse = scratch.alloc(saved.lse.dtype, {saved.lse.size(0), saved.lse.size(1), saved.lse.size(2)});
  copy_convert(acc, out);
  for_prefix_blocks(layer, j, false, [&](int, int64_t k0, int64_t k1) {
    attention_forward(block_out, {block_lse}, q, keys(layer, k0, k1), values(layer, k0, k1), scale, scratch,
                      AttentionMask::none);
    attention_merge(acc, saved.lse, block_out, block_lse);
  });
  copy_convert(out, acc);
}

void KVStore::attend_backward(int layer, int64_t t0, int64_t t1, const Tensor& d_q, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& out, double scale,
                              Arena& scratch, const std::vector<std::vector<int64_t>>* doc_starts) {
  if (doc_starts) {
    if (block_ != 0) refuse_streamed_documents();
    attention_backward_documents(d_q, d_keys(layer, 0, t1), d_values(layer, 0, t1), d_out, saved, q,
                                 keys(layer, 0, t1), values(layer, 0, t1), out, *doc_starts, scale,
                                 GradMode::overwrite, scratch);
    return;
  }
  if (block_ == 0) {
    attention_backward(d_q, d_keys(layer, 0, t1), d_values(layer, 0, t1), d_out, saved, q, keys(layer, 0, t1),
                       values(layer, 0, t1), out, scale, GradMode::overwrite, scratch);
    return;
  }
  // Each block's share given the merged out and lse: dQ summed over the blocks in the accumulation
  // dtype (one rounding per block, not a running bf16 sum), each earlier block's dK, dV fetched,
  // added to and sent home.
  const int64_t j = t0 / block_;
  if (j > 0) fetch_block(layer, 0, true, true);  // comes in while the own block runs
  attention_backward(d_q, d_keys(layer, t0, t1), d_values(layer, t0, t1), d_out, saved, q, keys(layer, t0, t1),
                     values(layer, t0, t1), out, scale, GradMode::overwrite, scratch);
  if (j == 0) return;
  ArenaScope scope(scratch);
  const int64_t rows = d_q.size(0) * d_q.size(1), width = d_q.size(2) * d_q.size(3);
  const Tensor dq_sum = scratch.alloc(saved.lse.dtype, {rows, width}), dq_block = scratch.alloc(d_q.dtype, {rows, width});
  copy_convert(dq_sum, d_q.view({rows, width}));
  const Tensor dq_block4 = dq_block.view({d_q.size(0), d_q.size(1), d_q.size(2), d_q.size(3)});
  for_prefix_blocks(layer, j, true, [&](int it, int64_t k0, int64_t k1) {
    attention_backward(dq_block4, d_keys(layer, k0, k1), d_values(layer, k0, k1), d_out, saved, q, keys(layer, k0, k1),
                       values(layer, k0, k1), out, scale, GradMode::overwrite, scratch, AttentionMask::none);
    accumulate(dq_sum, dq_block);
    res_->store(it, spans(kDKeys, kDValues, 0, k1 - k0));
    home_grads_[static_cast<size_t>(it)] = 1;
  });
  copy_convert(d_q.view({rows, width}), dq_sum);
}

}  // namespace cw
