#include "model/layer_cast.h"

#include "engine/error.h"

#include <algorithm>

namespace cw {

LayerCast::LayerCast(const ParamSet& master, DType compute) : master_(&master), dtype_(compute) {
  const int L = master.config().num_hidden_layers;
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
  for (int s = 0; s < kSlots; ++s) {
    slots_.emplace_back(slot_bytes_, master.device());
    std::vector<Tensor> views;
    size_t at = 0;
    for (const ParamSpec& spec : block_) {
      views.push_back(Tensor::packed(static_cast<char*>(slots_.back().data()) + at, compute, master.device(), spec.shape));
      at += static_cast<size_t>(spec.numel()) * dtype_size(compute);
    }
    views_.push_back(std::move(views));
  }
  held_.assign(static_cast<size_t>(kSlots), -1);
  used_.assign(static_cast<size_t>(kSlots), 0);
}

size_t LayerCast::slot_bytes_for(const LlamaConfig& config, DType compute) {
  int64_t block = 0;
  for (const ParamSpec& s : parameter_table(config))
    if (s.layer == 0) block += s.numel();
  return static_cast<size_t>(block) * dtype_size(compute);
}

LayerWeights LayerCast::layer(int l) {
  CW_CHECK(l >= 0 && static_cast<size_t>(l) < start_.size(), "LayerCast: block {} of {}", l, start_.size());
  auto slot = std::find(held_.begin(), held_.end(), l);
  if (slot == held_.end()) {
    slot = held_.begin() + (std::min_element(used_.begin(), used_.end()) - used_.begin());
    const size_t s = static_cast<size_t>(slot - held_.begin());
    const Tensor into = Tensor::packed(slots_[s].data(), dtype_, master_->device(), std::vector<int64_t>{block_numel_});
    copy_convert(into, master_->flat().slice(0, start_[static_cast<size_t>(l)], block_numel_));
    *slot = l;
    ++casts_;
  }
  const size_t s = static_cast<size_t>(slot - held_.begin());
  used_[s] = ++clock_;
  return layer_weights(block_, views_[s], 0);
}

void LayerCast::invalidate() {
  std::fill(held_.begin(), held_.end(), -1);
}

}  // namespace cw
