#include "optim/adamw_offload.h"

#include "engine/memory.h"
#include "engine/ops/adamw_update.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

namespace cw {

namespace {
// Piece i of a vector of numel elements walked from its end in pieces of `piece`: [begin, begin + length).
struct PieceRange {
  int64_t begin, length;
};
PieceRange piece_range(int64_t i, int64_t numel, int64_t piece) {
  const int64_t begin = std::max<int64_t>(0, numel - (i + 1) * piece);
  return {begin, numel - i * piece - begin};
}
// Elements one host thread updates at a time: large enough that a call's checks cost nothing, small
// enough that the cores share a piece evenly.
constexpr int64_t kThreadBlock = int64_t(1) << 16;
}  // namespace

OffloadedAdamW::OffloadedAdamW(const ParamSet& master, Device device, const AdamWOptions& options, int64_t piece_elems)
    : adamw_(master, options), device_(device), piece_(piece_elems) {
  CW_CHECK(master.device().is_cpu(), "the offloaded optimizer keeps the master weights in host memory, not on {}",
           device_name(master.device()));
  CW_CHECK(piece_elems >= 1, "the offloaded optimizer's piece must hold at least one element, got {}", piece_elems);
}

size_t OffloadedAdamW::staging_bytes_for(int64_t numel, DType grad_dtype, DType compute_dtype, int64_t piece_elems) {
  return size_t(kSlots) * size_t(std::min(piece_elems, numel)) * (dtype_size(grad_dtype) + dtype_size(compute_dtype));
}

size_t OffloadedAdamW::staging_bytes() const {
  size_t bytes = 0;
  for (const StagingBuffer& b : grad_stage_) bytes += b.bytes();
  for (const StagingBuffer& b : compute_stage_) bytes += b.bytes();
  return bytes;
}

bool OffloadedAdamW::streams(Device device, DType state_dtype) {
  return !device.is_cpu() && state_dtype == DType::f32;
}

size_t OffloadedAdamW::device_staging_bytes_for(int64_t numel, DType state_dtype, int64_t piece_elems) {
  return size_t(kSlots) * 3 * size_t(std::min(piece_elems, numel)) * dtype_size(state_dtype);
}

size_t OffloadedAdamW::device_staging_bytes() const {
  size_t bytes = 0;
  for (const Buffer& b : state_stage_) bytes += b.bytes();
  return bytes;
}

void OffloadedAdamW::update_piece(const ParamSet& master, int64_t begin, int64_t length, const void* grad,
                                  DType grad_dtype, void* compute, DType compute_dtype, double lr) {
  const AdamWOptions& o = adamw_.options();
  const Tensor p = master.flat(), m = adamw_.exp_avg_.flat(), v = adamw_.exp_avg_sq_.flat();
  const size_t gsize = dtype_size(grad_dtype), csize = dtype_size(compute_dtype);
  const int64_t blocks = (length + kThreadBlock - 1) / kThreadBlock;
  // The runs (tensors) a piece touches, found once: a block's tensors follow from them.
  const std::vector<DecayRun> runs = decay_runs(master, o, begin, begin + length);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = begin + b * kThreadBlock, hi = std::min(begin + length, lo + kThreadBlock);
    for (auto run = runs.begin(); run != runs.end() && run->begin < hi; ++run) {
      const int64_t a = std::max(lo, run->begin), z = std::min(hi, run->begin + run->length);
      if (a >= z) continue;
      const int64_t n = z - a, at = a - begin;  // at: the offset within the piece (and its staging)
      const Tensor g = Tensor::packed(static_cast<char*>(const_cast<void*>(grad)) + size_t(at) * gsize, grad_dtype,
                                      Device::host(), std::array<int64_t, 1>{n});
      const Tensor c = Tensor::packed(static_cast<char*>(compute) + size_t(at) * csize, compute_dtype,
                                      Device::host(), std::array<int64_t, 1>{n});
      const Tensor ps = p.slice(0, a, n);
      adamw_update(ps, m.slice(0, a, n), v.slice(0, a, n), g, compute_dtype == DType::bf16 ? c : Tensor{},
                   AdamWHyper{lr, o.beta1, o.beta2, o.eps, run->weight_decay, adamw_.step_});
      if (compute_dtype != DType::bf16) copy_convert(c, ps);
    }
  }
}

void OffloadedAdamW::step(const ParamSet& master, const ParamSet& grads, double lr, const ParamSet& compute) {
  CW_CHECK(std::isfinite(lr) && lr >= 0.0, "AdamW: learning rate {} must be finite and >= 0", lr);
  CW_CHECK(same_table(master, adamw_.exp_avg_) && master.dtype() == adamw_.exp_avg_.dtype() && master.device().is_cpu(),
           "the offloaded optimizer: the master weights must be the host set it was made for");
  CW_CHECK(same_table(grads, master) && same_table(compute, master),
           "the offloaded optimizer: the gradients and compute weights must have the master weights' table");
  CW_CHECK(grads.device() == device_ && compute.device() == device_,
           "the offloaded optimizer: gradients on {} and compute weights on {}, but it was made for {}",
           device_name(grads.device()), device_name(compute.device()), device_name(device_));
  CW_CHECK(grads.dtype() == DType::f32 || grads.dtype() == DType::f64, "AdamW: the gradients must be f32 or f64, got {}",
           dtype_name(grads.dtype()));
  if (streams() && grads.dtype() == DType::f32) return step_streamed(master, grads, lr, compute);

  const int64_t numel = master.numel(), piece = std::min(piece_, numel);
  const size_t gsize = dtype_size(grads.dtype()), csize = dtype_size(compute.dtype());
  if (grad_stage_.empty() || grad_stage_[0].bytes() < size_t(piece) * gsize ||
      compute_stage_[0].bytes() < size_t(piece) * csize) {
    grad_stage_.clear();
    compute_stage_.clear();
    for (int s = 0; s < kSlots; ++s) {
      grad_stage_.emplace_back(size_t(piece) * gsize, device_);
      compute_stage_.emplace_back(size_t(piece) * csize, device_);
    }
  }
  ++adamw_.step_;

  // Pieces from the end of the vector: [begin(i), begin(i) + length(i)).
  const int64_t pieces = (numel + piece - 1) / piece;
  const auto piece_begin = [&](int64_t i) { return piece_range(i, numel, piece).begin; };
  const auto piece_length = [&](int64_t i) { return piece_range(i, numel, piece).length; };
  char* const grad_dev = static_cast<char*>(grads.flat().data);
  char* const compute_dev = static_cast<char*>(compute.flat().data);
  // Gradients come out on the lane of copies to the host, compute weights go in on the other.
  std::array<uint64_t, kSlots> grad_ticket{}, weight_ticket{};
  const auto fetch = [&](int64_t i) {
    const size_t slot = size_t(i % kSlots);
    grad_ticket[slot] = copy_async(grad_stage_[slot].data(), grad_dev + size_t(piece_begin(i)) * gsize,
                                   size_t(piece_length(i)) * gsize, device_, /*to_host=*/true);
  };
  for (int64_t i = 0; i < std::min<int64_t>(kSlots, pieces); ++i) fetch(i);
  uint64_t last_out = 0;
  for (int64_t i = 0; i < pieces; ++i) {
    const size_t slot = size_t(i % kSlots);
    host_wait_for_copy(grad_ticket[slot], device_);
    if (weight_ticket[slot] != 0) host_wait_for_copy(weight_ticket[slot], device_);  // piece i - kSlots has left the slot
    update_piece(master, piece_begin(i), piece_length(i), grad_stage_[slot].data(), grads.dtype(),
                 compute_stage_[slot].data(), compute.dtype(), lr);
    last_out = weight_ticket[slot] = copy_async(compute_dev + size_t(piece_begin(i)) * csize,
                                                compute_stage_[slot].data(), size_t(piece_length(i)) * csize, device_);
    if (i + kSlots < pieces) fetch(i + kSlots);
  }
  // The next op (the next step's first kernel) reads the new compute weights.
  compute_wait_for_copy(last_out, device_);
}

void OffloadedAdamW::step_streamed(const ParamSet& master, const ParamSet& grads, double lr, const ParamSet& compute) {
  // The state page-locked (once; again if a checkpoint load gave it new memory), so its pieces move at
  // the bus's speed while the host does nothing.
  const std::array<void*, 3> state{master.flat().data, adamw_.exp_avg_.flat().data, adamw_.exp_avg_sq_.flat().data};
  if (state != pinned_at_) {
    pinned_.clear();
    for (void* at : state) pinned_.push_back(std::make_unique<PinnedRegion>(at, master.bytes(), device_));
    pinned_at_ = state;
  }
  const int64_t numel = master.numel(), piece = std::min(piece_, numel);
  const size_t bytes = size_t(piece) * sizeof(float);
  if (state_stage_.size() != size_t(kSlots) * 3 || state_stage_[0].bytes() < bytes) {
    state_stage_.clear();
    for (int s = 0; s < kSlots * 3; ++s) state_stage_.emplace_back(bytes, device_);
  }
  ++adamw_.step_;
  const AdamWOptions& o = adamw_.options();
  const Tensor p = master.flat(), m = adamw_.exp_avg_.flat(), v = adamw_.exp_avg_sq_.flat();
  const Tensor g = grads.flat(), c = compute.flat();
  const Tensor* home[3] = {&p, &m, &v};
  const int64_t pieces = (numel + piece - 1) / piece;
  std::array<uint64_t, kSlots> out_ticket{};
  for (int64_t i = 0; i < pieces; ++i) {
    const auto [begin, length] = piece_range(i, numel, piece);
    const size_t slot = size_t(i % kSlots);
    // The slot's last piece has gone home before this one comes in.
    if (out_ticket[slot] != 0) host_wait_for_copy(out_ticket[slot], device_);
    Tensor staged[3];
    uint64_t in = 0;
    for (int k = 0; k < 3; ++k) {
      void* dev = state_stage_[slot * 3 + size_t(k)].data();
      staged[k] = Tensor::packed(dev, DType::f32, device_, std::array<int64_t, 1>{length});
      in = copy_async(dev, home[k]->slice(0, begin, length).data, size_t(length) * sizeof(float), device_);
    }
    compute_wait_for_copy(in, device_);  // the lane of copies in runs in order: the last covers all three
    for (const DecayRun& run : decay_runs(master, o, begin, begin + length)) {
      const int64_t at = run.begin - begin;
      adamw_update(staged[0].slice(0, at, run.length), staged[1].slice(0, at, run.length),
                   staged[2].slice(0, at, run.length), g.slice(0, run.begin, run.length),
                   compute.dtype() == DType::bf16 ? c.slice(0, run.begin, run.length) : Tensor{},
                   AdamWHyper{lr, o.beta1, o.beta2, o.eps, run.weight_decay, adamw_.step_});
    }
    if (compute.dtype() != DType::bf16) copy_convert(c.slice(0, begin, length), staged[0]);
    for (int k = 0; k < 3; ++k)
      out_ticket[slot] = copy_async(home[k]->slice(0, begin, length).data, staged[k].data,
                                    size_t(length) * sizeof(float), device_, /*to_host=*/true);
  }
  // The state on the host is the truth between steps (checkpoints read it): the step ends when it is.
  for (uint64_t t : out_ticket)
    if (t != 0) host_wait_for_copy(t, device_);
}

}  // namespace cw
