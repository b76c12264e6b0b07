#include "parallel/zero3.h"

#include "engine/engine.h"
#include "engine/ops/residual.h"
#include "model/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace cw {

namespace {
// optim/training.h's policy: f32 master weights and gradients beside bf16 compute, else the compute dtype.
DType master_dtype(DType compute) { return compute == DType::bf16 ? DType::f32 : compute; }
}  // namespace

Zero3Counts Zero3Counts::operator-(const Zero3Counts& o) const {
  return {block_gathers - o.block_gathers,
          outside_gathers - o.outside_gathers,
          prefetched - o.prefetched,
          reuses - o.reuses,
          block_reduce_scatters - o.block_reduce_scatters,
          outside_reduce_scatters - o.outside_reduce_scatters,
          gathered_bytes - o.gathered_bytes,
          scattered_bytes - o.scattered_bytes};
}

ShardedParameters::ShardedParameters(Communicator& comm, const LlamaConfig& config, DType compute,
                                     const AdamWOptions& adamw, bool offload_optimizer, bool frozen)
    : comm_(comm),
      config_(config),
      compute_(compute),
      grad_dtype_(master_dtype(compute)),
      device_(comm.device()),
      layout_(parameter_table(config), comm.size()),
      master_(config, layout_.shard_table(comm.rank()), frozen ? compute : master_dtype(compute),
              offload_optimizer ? Device::host() : comm.device()),
      grads_(frozen ? ParamSet() : ParamSet(config, layout_.shard_table(comm.rank()), grad_dtype_, comm.device())),
      frozen_(frozen) {
  adamw.validate();
  CW_CHECK(compute != DType::bf16 || !device_.is_cpu(), "bf16 training needs the GPU backend");
  CW_CHECK(!(frozen && offload_optimizer), "ZeRO 3: a frozen base has no optimizer to offload");
  // A frozen base (LoRA) has no optimizer, gradient or gradient buffers: the gathers' buffers only.
  if (!frozen && offload_optimizer) {
    compute_copy_.emplace(ParamSet::like(master_, compute, device_));
    offloaded_.emplace(master_, device_, adamw);
  } else if (!frozen) {
    adamw_.emplace(master_, adamw);
  }
  const int n = comm.size();
  const int64_t block = layout_.largest_block_part() * n, outside = layout_.outside().part * n;
  const auto slot = [&](int64_t elements, DType dtype, bool gradient) {
    Slot s;
    s.buffer = Buffer(static_cast<size_t>(elements) * dtype_size(dtype), device_);
    if (gradient) s.reduced = Buffer(static_cast<size_t>(elements / n) * dtype_size(dtype), device_);
    return s;
  };
  for (int i = 0; i < kBlockSlots; ++i) {
    block_slots_.push_back(slot(block, compute_, false));
    if (!frozen) block_grad_slots_.push_back(slot(block, grad_dtype_, true));
  }
  outside_slot_ = slot(outside, compute_, false);
  if (!frozen) outside_grad_slot_ = slot(outside, grad_dtype_, true);
}

AdamW& ShardedParameters::optimizer() {
  CW_CHECK(!frozen_, "ZeRO 3: a frozen base (LoRA) has no optimizer state");
  return offloaded_ ? offloaded_->state() : *adamw_;
}
const AdamW& ShardedParameters::optimizer() const {
  CW_CHECK(!frozen_, "ZeRO 3: a frozen base (LoRA) has no optimizer state");
  return offloaded_ ? offloaded_->state() : *adamw_;
}

size_t ShardedParameters::shard_bytes() const {
  if (frozen_) return master_.bytes();
  size_t moments = optimizer().exp_avg().bytes() + optimizer().exp_avg_sq().bytes();
  return master_.bytes() + grads_.bytes() + moments + (compute_copy_ ? compute_copy_->bytes() : 0);
}

size_t ShardedParameters::buffer_bytes() const {
  size_t bytes = outside_slot_.buffer.bytes() + outside_grad_slot_.buffer.bytes() + outside_grad_slot_.reduced.bytes();
  for (const Slot& s : block_slots_) bytes += s.buffer.bytes();
  for (const Slot& s : block_grad_slots_) bytes += s.buffer.bytes() + s.reduced.bytes();
  return bytes;
}

void ShardedParameters::load(const ParamSet& whole) {
  if (master_.device().is_cpu()) {
    shard_from_whole(master_, layout_, comm_.rank(), whole);
  } else {
    ParamSet host = ParamSet::like(master_, master_.dtype(), Device::host());
    shard_from_whole(host, layout_, comm_.rank(), whole);
    copy_params(master_, host);
  }
  master_changed();
}

void ShardedParameters::master_changed() {
  if (compute_copy_) copy_params(*compute_copy_, master_);
  const auto forget = [this](Slot& s) {
    wait(s);
    s.unit = -1;
    s.asked = false;
  };
  forget(outside_slot_);
  for (Slot& s : block_slots_) forget(s);
}

Tensor ShardedParameters::whole_of(const Slot& slot, size_t unit, DType dtype) const {
  const int64_t n = layout_.units()[unit].part * layout_.ranks();
  CW_CHECK(static_cast<size_t>(n) * dtype_size(dtype) <= slot.buffer.bytes(), "ZeRO 3: unit {} does not fit its buffer",
           unit);
  return Tensor::packed(slot.buffer.data(), dtype, device_, std::vector<int64_t>{n});
}

Tensor ShardedParameters::source_part(size_t unit) const {
  const ParamSet& from = compute_copy_ ? *compute_copy_ : master_;
  return from.flat().slice(0, layout_.offset(comm_.rank(), unit), layout_.length(comm_.rank(), unit));
}

void ShardedParameters::start_gather(Slot& slot, size_t unit, bool prefetched) {
  wait(slot);  // a gather still in flight into it (a prefetch not asked for)
  const int64_t part = layout_.units()[unit].part, len = layout_.length(comm_.rank(), unit);
  const Tensor whole = whole_of(slot, unit, compute_);
  const Tensor mine = whole.slice(0, comm_.rank() * part, part);
  // The rank's part, rounded to the compute dtype as a resident copy would be; the padding zero.
  if (len > 0) copy_convert(mine.slice(0, 0, len), source_part(unit));
  if (len < part) fill(mine.slice(0, len, part - len), 0.0);
  slot.pending = comm_.all_gather(whole, mine);
  slot.unit = static_cast<int>(unit);
  slot.asked = false;
  (unit == 0 ? counts_.outside_gathers : counts_.block_gathers) += 1;
  if (prefetched) ++counts_.prefetched;
  counts_.gathered_bytes += static_cast<int64_t>(whole.bytes());
}

void ShardedParameters::wait(Slot& slot) {
  if (!slot.pending) return;
  slot.pending->wait();
  slot.pending.reset();
}

std::vector<ParamSpec> ShardedParameters::unit_specs(size_t unit) const {
  std::vector<ParamSpec> specs;
  for (size_t i : layout_.units()[unit].tensors) specs.push_back(layout_.table()[i]);
  return specs;
}

std::vector<Tensor> ShardedParameters::views(const Slot& slot, size_t unit, DType dtype) const {
  std::vector<Tensor> out;
  char* at = static_cast<char*>(slot.buffer.data());
  for (size_t i : layout_.units()[unit].tensors) {
    const ParamSpec& s = layout_.table()[i];
    out.push_back(Tensor::packed(at, dtype, device_, s.shape));
    at += static_cast<size_t>(s.numel()) * dtype_size(dtype);
  }
  return out;
}

ModelWeights ShardedParameters::outside_weights(const std::vector<Tensor>& views) const {
  ModelWeights w;
  const std::vector<size_t>& tensors = layout_.outside().tensors;
  for (size_t k = 0; k < tensors.size(); ++k) {
    switch (layout_.table()[tensors[k]].role) {
      case ParamRole::embedding: w.embedding = views[k]; break;
      case ParamRole::final_norm: w.final_norm = views[k]; break;
      case ParamRole::lm_head: w.lm_head = views[k]; break;
      default: CW_CHECK(false, "ZeRO 3: {} outside the blocks", layout_.table()[tensors[k]].name);
    }
  }
  if (config_.tie_word_embeddings) w.lm_head = w.embedding;
  return w;
}

ModelWeights ShardedParameters::outside() {
  if (outside_slot_.unit != 0) start_gather(outside_slot_, 0, false);
  wait(outside_slot_);
  return outside_weights(views(outside_slot_, 0, compute_));
}

void ShardedParameters::release_outside() {
  wait(outside_slot_);
  outside_slot_.unit = -1;
}

ShardedParameters::Slot& ShardedParameters::gathered(size_t unit) {
  auto held = std::find_if(block_slots_.begin(), block_slots_.end(), [&](const Slot& s) { return s.unit == int(unit); });
  if (held == block_slots_.end()) {
    held = std::min_element(block_slots_.begin(), block_slots_.end(),
                            [](const Slot& a, const Slot& b) { return a.used < b.used; });
    start_gather(*held, unit, false);
  } else if (held->asked) {
    ++counts_.reuses;
  }
  wait(*held);
  return *held;
}

LayerWeights ShardedParameters::block(int l) {
  CW_CHECK(l >= 0 && l < layout_.layers(), "ZeRO 3: block {} of {}", l, layout_.layers());
  const size_t unit = static_cast<size_t>(l) + 1;
  Slot& s = gathered(unit);
  s.asked = true;
  s.used = ++clock_;
  return layer_weights(unit_specs(unit), views(s, unit, compute_), l);
}

void ShardedParameters::prefetch(int l) {
  if (l < 0 || l >= layout_.layers()) return;
  const int unit = l + 1;
  if (std::any_of(block_slots_.begin(), block_slots_.end(), [&](const Slot& s) { return s.unit == unit; })) return;
  // The least recently asked-for buffer: never the block being run, which was asked for last.
  Slot& victim = *std::min_element(block_slots_.begin(), block_slots_.end(),
                                   [](const Slot& a, const Slot& b) { return a.used < b.used; });
  start_gather(victim, static_cast<size_t>(unit), true);
}

ModelWeights ShardedParameters::outside_grads() {
  CW_CHECK(!frozen_, "ZeRO 3: a frozen base (LoRA) lends no gradient buffers");
  finish_reduction(outside_grad_slot_);
  const Tensor whole = whole_of(outside_grad_slot_, 0, grad_dtype_);
  fill(whole, 0.0);
  outside_grad_slot_.unit = 0;
  return outside_weights(views(outside_grad_slot_, 0, grad_dtype_));
}

LayerWeights ShardedParameters::block_grads(int l) {
  CW_CHECK(!frozen_, "ZeRO 3: a frozen base (LoRA) lends no gradient buffers");
  const size_t unit = static_cast<size_t>(l) + 1;
  // The buffer whose reduction was posted first (the other may still be in flight behind it).
  Slot& s = *std::min_element(block_grad_slots_.begin(), block_grad_slots_.end(),
                              [](const Slot& a, const Slot& b) { return a.used < b.used; });
  finish_reduction(s);
  fill(whole_of(s, unit, grad_dtype_), 0.0);
  s.unit = static_cast<int>(unit);
  s.used = ++clock_;
  return layer_weights(unit_specs(unit), views(s, unit, grad_dtype_), l);
}

void ShardedParameters::outside_grads_done() {
  Slot& s = outside_grad_slot_;
  const int64_t part = layout_.outside().part;
  const Tensor whole = whole_of(s, 0, grad_dtype_);
  s.pending = comm_.reduce_scatter(Tensor::packed(s.reduced.data(), grad_dtype_, device_, std::vector<int64_t>{part}), whole);
  ++counts_.outside_reduce_scatters;
  counts_.scattered_bytes += static_cast<int64_t>(whole.bytes());
}

void ShardedParameters::block_grads_done(int l) {
  const int unit = l + 1;
  auto s = std::find_if(block_grad_slots_.begin(), block_grad_slots_.end(),
                        [&](const Slot& g) { return g.unit == unit && !g.pending; });
  CW_CHECK(s != block_grad_slots_.end(), "ZeRO 3: block {}'s gradient was handed back without being lent", l);
  const int64_t part = layout_.units()[static_cast<size_t>(unit)].part;
  const Tensor whole = whole_of(*s, static_cast<size_t>(unit), grad_dtype_);
  s->pending = comm_.reduce_scatter(Tensor::packed(s->reduced.data(), grad_dtype_, device_, std::vector<int64_t>{part}), whole);
  ++counts_.block_reduce_scatters;
  counts_.scattered_bytes += static_cast<int64_t>(whole.bytes());
}

void ShardedParameters::finish_reduction(Slot& slot) {
  if (!slot.pending) return;
  wait(slot);
  // The ranks' sum of this rank's part, its real elements added into the gradient shard.
  const size_t unit = static_cast<size_t>(slot.unit);
  const int64_t len = layout_.length(comm_.rank(), unit);
  if (len > 0)
    accumulate(grads_.flat().slice(0, layout_.offset(comm_.rank(), unit), len),
               Tensor::packed(slot.reduced.data(), grad_dtype_, device_, std::vector<int64_t>{len}));
  slot.unit = -1;
}

void ShardedParameters::finish_reductions() {
  for (Slot& s : block_grad_slots_) finish_reduction(s);
  finish_reduction(outside_grad_slot_);
}

ParamSet ShardedParameters::gather_whole(const ParamSet& shard_set) {
  return std::move(*gather_units(shard_set, kEveryRank));
}

std::optional<ParamSet> ShardedParameters::gather_whole_to(const ParamSet& shard_set, int root) {
  CW_CHECK(root >= 0 && root < comm_.size(), "ZeRO 3: gather_whole_to: no rank {} of {}", root, comm_.size());
  return gather_units(shard_set, root);
}

void ShardedParameters::optimizer_step(double lr) {
  CW_CHECK(!frozen_, "ZeRO 3: a frozen base (LoRA) takes no optimizer step");
  finish_reductions();
  if (offloaded_) offloaded_->step(master_, grads_, lr, *compute_copy_);
  else adamw_->step(master_, grads_, lr);
  master_changed();
}

std::optional<ParamSet> ShardedParameters::gather_units(const ParamSet& shard_set, int root) {
  CW_CHECK(same_table(shard_set.specs(), master_.specs()), "ZeRO 3: gathering takes a set of this rank's shard");
  const int n = comm_.size(), me = comm_.rank();
  const DType dtype = shard_set.dtype();
  int64_t largest = 0;
  for (const ShardUnit& u : layout_.units()) largest = std::max(largest, u.part);
  // One unit's parts of every rank, on the communicator's device; the keeping ranks' copy on the host.
  const bool keeps = root == kEveryRank || me == root;
  Buffer gathered(static_cast<size_t>(largest * n) * dtype_size(dtype), device_);
  OwnedTensor staged;
  std::optional<ParamSet> whole;
  if (keeps) {
    staged = OwnedTensor::of_shape(dtype, std::vector<int64_t>{largest * n});
    whole.emplace(config_, layout_.table(), dtype, Device::host());
  }
  const Tensor shard = shard_set.numel() > 0 ? shard_set.flat() : Tensor{};
  for (size_t u = 0; u < layout_.units().size(); ++u) {
    const ShardUnit& unit = layout_.units()[u];
    if (unit.numel == 0) continue;
    const Tensor all = Tensor::packed(gathered.data(), dtype, device_, std::vector<int64_t>{unit.part * n});
    const Tensor mine = all.slice(0, me * unit.part, unit.part);
    const int64_t length = layout_.length(me, u);
    if (length < unit.part) fill(mine, 0.0);  // the last ranks' padding
    if (length > 0) copy_convert(mine.slice(0, 0, length), shard.slice(0, layout_.offset(me, u), length));
    comm_.all_gather(all, mine)->wait();
    if (!keeps) continue;
    // The parts in rank order are the unit's tensors in table order, then the padding.
    const Tensor host = staged.tensor.slice(0, 0, unit.part * n);
    copy_convert(host, all);
    int64_t at = 0;
    for (size_t t : unit.tensors) {
      const Tensor& dst = (*whole)[t];
      const Tensor src = host.slice(0, at, dst.numel());
      copy_convert(dst, Tensor::packed(src.data, dtype, Device::host(),
                                       std::vector<int64_t>(dst.shape.begin(), dst.shape.begin() + dst.ndim)));
      at += dst.numel();
    }
  }
  return whole;
}

ShardedDataParallel::ShardedDataParallel(Communicator& comm, const LlamaConfig& config, DType compute,
                                         const AdamWOptions& adamw, const ParallelOptions& options,
                                         bool offload_optimizer, const LoraConfig& lora)
    : comm_(comm),
      shards_(comm, config, compute, adamw, offload_optimizer, /*frozen=*/lora.enabled()),
      model_(config, compute, comm.device(), shards_, lora) {
  options.validate();
  CW_CHECK(options.zero == 3, "ShardedDataParallel is parallel.zero = 3 (given {})", options.zero);
  CW_CHECK(options.dp == comm.size(), "data parallel: parallel.dp = {} but the communicator has {} ranks", options.dp,
           comm.size());
  if (lora.enabled()) {
    CW_CHECK(!offload_optimizer, "ZeRO 3 with LoRA keeps the adapters' optimizer on the device (optimizer.offload off)");
    // The adapters' master weights and gradient in optimizer/training.h's dtypes; the model's adapters
    // are their compute copy.
    adapter_master_.emplace(ParamSet::like(model_.adapters(), master_dtype(compute)));
    copy_convert(adapter_master_->flat(), model_.adapters().flat());
    adapter_grads_.emplace(ParamSet::like(model_.adapters(), master_dtype(compute)));
    adapter_adamw_.emplace(*adapter_master_, adamw);
  }
}

const ParamSet& ShardedDataParallel::adapter_master() const {
  CW_CHECK(adapter_master_, "ZeRO 3: the model has no LoRA adapters");
  return *adapter_master_;
}

const ParamSet& ShardedDataParallel::adapter_grads() const {
  CW_CHECK(adapter_grads_, "ZeRO 3: the model has no LoRA adapters");
  return *adapter_grads_;
}

AdamW& ShardedDataParallel::adapter_optimizer() {
  CW_CHECK(adapter_adamw_, "ZeRO 3: the model has no LoRA adapters");
  return *adapter_adamw_;
}
const AdamW& ShardedDataParallel::adapter_optimizer() const {
  CW_CHECK(adapter_adamw_, "ZeRO 3: the model has no LoRA adapters");
  return *adapter_adamw_;
}

void ShardedDataParallel::load_adapters(const ParamSet& adapters) {
  CW_CHECK(adapter_master_ && same_table(adapters.specs(), adapter_master_->specs()),
           "ZeRO 3: load_adapters takes the model's LoRA adapters' table");
  copy_convert(adapter_master_->flat(), adapters.flat());
  copy_convert(model_.adapters().flat(), adapter_master_->flat());
}

DataParallelStep ShardedDataParallel::compute_gradients(Schedule& schedule, const std::vector<Batch>& micro,
                                                        uint64_t step_index) {
  CW_CHECK(!micro.empty(), "data parallel: a step needs at least one micro-batch");
  const Zero3Counts before = shards_.counts();
  shards_.finish_reductions();
  if (lora()) adapter_grads_->zero();
  else shards_.grads().zero();
  // The global count of supervised labels: every rank's normaliser (data_parallel.h step 1).
  std::vector<double> count{0.0};
  for (const Batch& b : micro) count[0] += static_cast<double>(b.supervised());
  sum_host_values(comm_, count);
  DataParallelStep out;
  out.supervised = static_cast<int64_t>(count[0]);
  const StepHooks given = schedule.hooks();
  StepHooks hooks;
  hooks.progress = given.progress;
  hooks.sum_over_ranks = [this](std::vector<double>& v) { sum_host_values(comm_, v); };
  schedule.set_hooks(hooks);
  // The sharded model lends its gradient buffers (model/parameter_shards.h); under LoRA the backward
  // adds the adapters' gradient into this rank's set.
  const ParamSet none;
  const ParamSet& grads = lora() ? *adapter_grads_ : none;
  double loss = 0;
  try {
    for (size_t m = 0; m < micro.size(); ++m) {
      out.stats = schedule.step(model_, micro[m], grads, count[0], step_index + m);
      loss += out.stats.loss;
    }
  } catch (...) {
    schedule.set_hooks(given);
    throw;
  }
  schedule.set_hooks(given);
  shards_.finish_reductions();
  if (lora()) comm_.all_reduce(adapter_grads_->flat())->wait();  // the ranks' sum, in rank order on threads
  std::vector<double> total{loss};
  sum_host_values(comm_, total);
  out.loss = total[0];
  step_counts_ = shards_.counts() - before;
  out.buckets_in_backward = step_counts_.block_reduce_scatters + step_counts_.outside_reduce_scatters;
  out.buckets = out.buckets_in_backward + (lora() ? 1 : 0);  // LoRA: the adapters' all-reduce, after the step
  return out;
}

double ShardedDataParallel::gradient_norm() {
  if (lora()) return std::sqrt(sum_squares(adapter_grads_->flat()));  // the same reduced gradient on every rank
  std::vector<double> squares{shards_.grads().numel() > 0 ? sum_squares(shards_.grads().flat()) : 0.0};
  sum_host_values(comm_, squares);
  return std::sqrt(squares[0]);
}

double ShardedDataParallel::clip_gradients(double max_norm) {
  const double norm = gradient_norm();
  const ParamSet& grads = lora() ? *adapter_grads_ : shards_.grads();
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm && grads.numel() > 0)
    scale_inplace(grads.flat(), max_norm / norm);
  return norm;
}

void ShardedDataParallel::optimizer_step(double lr) {
  if (!lora()) return shards_.optimizer_step(lr);
  adapter_adamw_->step(*adapter_master_, *adapter_grads_, lr);
  copy_convert(model_.adapters().flat(), adapter_master_->flat());  // the compute copy
}

void ShardedDataParallel::save_shard(const std::string& path) const {
  CW_CHECK(!lora(), "ZeRO 3 shard checkpoints hold full-parameter training; LoRA's adapters are written as PEFT files");
  const ParamSet& master = shards_.master();
  ParamSet host = ParamSet::like(master, master.dtype(), Device::host());
  copy_params(host, master);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < host.size(); ++i) tensors.emplace_back(host.specs()[i].name, host[i]);
  write_safetensors(path, tensors, {{"zero", "3"}, {"rank", std::to_string(rank())}, {"ranks", std::to_string(size())}});
  shards_.optimizer().save(path + ".optimizer");
}

void ShardedDataParallel::load_shard(const std::string& path) {
  CW_CHECK(!lora(), "ZeRO 3 shard checkpoints hold full-parameter training; LoRA's adapters are read from PEFT files");
  const SafetensorsReader f(path);
  const auto meta = [&](const char* key) {
    const auto it = f.metadata().find(key);
    if (it == f.metadata().end())
      fail(fmt::format("{}: metadata '{}' is missing: not a ZeRO 3 shard", path, key),
           "give the file save_shard wrote for this rank");
    return it->second;
  };
  if (meta("zero") != "3" || meta("rank") != std::to_string(rank()) || meta("ranks") != std::to_string(size()))
    fail(fmt::format("{}: the shard of rank {} of {} (zero {}), but this is rank {} of {}", path, meta("rank"),
                     meta("ranks"), meta("zero"), rank(), size()),
         "resume with the ranks the shards were written by, each rank reading its own shard");
  const ParamSet& master = shards_.master();
  ParamSet host = ParamSet::like(master, master.dtype(), Device::host());
  for (size_t i = 0; i < host.size(); ++i) f.read_into(host.specs()[i].name, host[i]);
  copy_params(master, host);
  shards_.optimizer().load(path + ".optimizer");
  shards_.master_changed();
}

ParamSet consolidate_shards(const LlamaConfig& config, const std::vector<std::string>& paths) {
  const ShardLayout layout(parameter_table(config), static_cast<int>(paths.size()));
  std::vector<ParamSet> shards;
  std::optional<DType> dtype;
  for (size_t r = 0; r < paths.size(); ++r) {
    const SafetensorsReader f(paths[r]);
    const auto it = f.metadata().find("ranks");
    if (it == f.metadata().end() || it->second != std::to_string(paths.size()))
      fail(fmt::format("{}: not one of {} ZeRO 3 shards (its metadata says {} ranks)", paths[r], paths.size(),
                       it == f.metadata().end() ? "nothing of" : it->second),
           "give every rank's shard of one checkpoint, in rank order");
    const std::vector<ParamSpec> table = layout.shard_table(static_cast<int>(r));
    if (!dtype) {  // the master weights' dtype: f64 (CPU checks) or f32
      const SafetensorsEntry* first = table.empty() ? nullptr : f.find(table[0].name);
      if (!first)
        fail(fmt::format("{}: no tensor {}", paths[r], table.empty() ? "" : table[0].name),
             "the file is damaged or not a ZeRO 3 shard of this model");
      dtype = first->dtype == "F64" ? DType::f64 : DType::f32;
    }
    shards.emplace_back(config, table, *dtype, Device::host());
    for (size_t i = 0; i < table.size(); ++i) f.read_into(table[i].name, shards.back()[i]);
  }
  std::vector<const ParamSet*> pointers;
  for (const ParamSet& s : shards) pointers.push_back(&s);
  ParamSet whole(config, layout.table(), dtype.value_or(DType::f32), Device::host());
  assemble_from_shards(whole, layout, pointers);
  return whole;
}

}  // namespace cw
