#include "model/layer_cast.h"

#include "engine/engine.h"
#include "engine/error.h"

#include <algorithm>

namespace cw {

LayerCast::LayerCast(const ParamSet& master, DType compute) : master_(&master), dtype_(compute) {
  const int L = master.config().num_hidden_layers;
  const int slots = kSlots;
  start_.assign(static_cast<size_t>(L), -1);
  std::vector<int64_t> end(static_cast<size_t>(L), -1);
  int64_t offset = 0;
  for (const ParamSpec& s : master.specs()) {
    CW_CHECK(!s.is_adapter(), "LayerCast: the master holds adapters ({}); LoRA's base has no master to cast from",
             s.name);
    if (s.layer >= 0) {
      const size_t l = static_cast<size_t>(s.layer);
      if (start_[l] < 0) start_[l] = offset;
      CW_CHECK(end[l] < 0 || end[l] == offset, "LayerCast: block {}'s tensors are not contiguous in the master ({})",
               s.layer, s.name);
      end[l] = offset + s.numel();
      if (s.layer == 0) block_.push_back(s);
    }
    offset += s.numel();
  }
  for (int l = 0; l < L; ++l) {
    const size_t li = static_cast<size_t>(l);
    CW_CHECK(start_[li] >= 0, "LayerCast: the master has no tensors of block {}", l);
    if (l == 0) block_numel_ = end[0] - start_[0];
    CW_CHECK(end[li] - start_[li] == block_numel_, "LayerCast: block {} has {} weights, block 0 {}", l,
             end[li] - start_[li], block_numel_);
  }
  slot_bytes_ = static_cast<size_t>(block_numel_) * dtype_size(compute);
  for (int s = 0; s < slots; ++s) {
    slots_.emplace_back(slot_bytes_, master.device());
    std::vector<Tensor> views;
    size_t at = 0;
    for (const ParamSpec& spec : block_) {
      views.push_back(Tensor::packed(static_cast<char*>(slots_.back().data()) + at, compute, master.device(), spec.shape));
      at += static_cast<size_t>(spec.numel()) * dtype_size(compute);
    }
    views_.push_back(std::move(views));
  }
  held_.assign(static_cast<size_t>(slots), -1);
  used_.assign(static_cast<size_t>(slots), 0);
  pending_.assign(static_cast<size_t>(slots), 0);
}

size_t LayerCast::device_bytes_for(const LlamaConfig& config, DType compute, int slots) {
  int64_t block = 0;
  for (const ParamSpec& s : parameter_table(config))
    if (s.layer == 0) block += s.numel();
  return static_cast<size_t>(block) * dtype_size(compute) * static_cast<size_t>(slots);
}

size_t LayerCast::cast_into(int l, int keep_slot, bool ahead) {
  size_t victim = slots_.size();
  for (size_t s = 0; s < slots_.size(); ++s)
    if (static_cast<int>(s) != keep_slot && (victim == slots_.size() || used_[s] < used_[victim])) victim = s;
  // A cast ahead into this slot that was never asked for still writes it: order after it.
  compute_wait_for_convert(pending_[victim], master_->device());
  pending_[victim] = 0;
  const Tensor into = Tensor::packed(slots_[victim].data(), dtype_, master_->device(), std::vector<int64_t>{block_numel_});
  const Tensor from = master_->flat().slice(0, start_[static_cast<size_t>(l)], block_numel_);
  if (ahead) {
    pending_[victim] = convert_async(into, from);
  } else {
    copy_convert(into, from);
    ++cold_casts_;
  }
  held_[victim] = l;
  used_[victim] = ++clock_;
  ++casts_;
  return victim;
}

LayerWeights LayerCast::layer(int l, int next) {
  const int L = static_cast<int>(start_.size());
  CW_CHECK(l >= 0 && l < L && next >= -1 && next < L, "LayerCast: block {} (next {}) of {}", l, next, L);
  auto held = std::find(held_.begin(), held_.end(), l);
  const size_t s = held != held_.end() ? static_cast<size_t>(held - held_.begin()) : cast_into(l, -1, false);
  compute_wait_for_convert(pending_[s], master_->device());
  pending_[s] = 0;
  used_[s] = ++clock_;
  if (next >= 0 && next != l && std::find(held_.begin(), held_.end(), next) == held_.end())
    cast_into(next, static_cast<int>(s), true);
  return layer_weights(block_, views_[s], 0);
}

void LayerCast::invalidate() {
  for (uint64_t& ticket : pending_) {
    compute_wait_for_convert(ticket, master_->device());
    ticket = 0;
  }
  std::fill(held_.begin(), held_.end(), -1);
}

}  // namespace cw
