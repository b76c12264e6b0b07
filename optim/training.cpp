#include "optim/training.h"

#include "engine/engine.h"
#include "engine/random.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

namespace cw {

namespace {
DType master_dtype_for(DType compute) { return compute == DType::bf16 ? DType::f32 : compute; }

// What training updates, as a table for its master weights, gradients and moments.
ParamSet trained_set(const LlamaModel& model, DType dtype, Device device) {
  return ParamSet(model.config(), model.trainable_table(), dtype, device);
}

LlamaModel checked_model(const LlamaConfig& config, DType compute, Device device, const TrainingStateOptions& o) {
  if (o.cast_layers) {
    CW_CHECK(compute == DType::bf16 && !device.is_cpu(),
             "schedule.cast_layers rounds bf16 blocks from the f32 master weights: it needs bf16 on a GPU (dtype {} on {})",
             dtype_name(compute), device.is_cpu() ? "the CPU" : "a GPU");
    CW_CHECK(!o.offload_optimizer, "schedule.cast_layers casts from master weights on the device; optimizer.offload "
                                   "keeps them on the host: turn one of them off");
    CW_CHECK(o.full_optimizer, "schedule.cast_layers does not combine with parallel.zero > 0: set cast_layers = false");
  }
  return LlamaModel(config, compute, device, o.tp, o.lora, o.cast_layers);
}
}  // namespace

TrainingState::TrainingState(const LlamaConfig& config, DType compute, Device device, const AdamWOptions& adamw,
                             const TrainingStateOptions& o)
    : model_(checked_model(config, compute, device, o)),
      // A separate master set: f32 beside bf16 compute weights; offloaded, always (in host memory).
      master_(compute == DType::bf16 || o.offload_optimizer
                  ? std::optional<ParamSet>(trained_set(model_, master_dtype_for(compute),
                                                        o.offload_optimizer ? Device::host() : device))
                  : std::nullopt),
      grads_(trained_set(model_, master_dtype_for(compute), device)),
      adamw_options_(adamw) {
  CW_CHECK(compute != DType::bf16 || !device.is_cpu(), "bf16 training needs the GPU backend");
  CW_CHECK(!o.offload_optimizer || o.full_optimizer,
           "optimizer.offload keeps the whole AdamW state on the host: it does not combine with parallel.zero > 0");
  adamw.validate();
  if (o.cast_layers) model_.cast_layers_from(*master_);
  sync_master_from_compute();
  if (o.offload_optimizer) offloaded_.emplace(master(), device, adamw);
  else if (o.full_optimizer) adamw_.emplace(master(), adamw);
}

MemoryNeed TrainingState::memory_need(const LlamaConfig& config, DType compute, Device device,
                                      const TrainingStateOptions& o) {
  const LlamaConfig cf = o.tp ? tp_shard_config(config, o.tp->size()) : config;
  const DType master = master_dtype_for(compute);
  const std::vector<ParamSpec> trained = o.lora.enabled() ? lora_parameter_table(cf, o.lora) : parameter_table(cf);
  const uint64_t state = param_bytes(trained, master);
  const std::string m = dtype_name(master);
  MemoryNeed need;
  need.add(device, fmt::format("{} weights{}", dtype_name(compute), o.lora.enabled() ? " and adapters" : ""),
           model_weight_bytes(cf, compute, o.lora, o.cast_layers));
  if (compute == DType::bf16 || o.offload_optimizer)
    need.add(o.offload_optimizer ? Device::host() : device, m + " master weights", state);
  need.add(device, m + " gradients", state);
  if (o.offload_optimizer || o.full_optimizer)
    need.add(o.offload_optimizer ? Device::host() : device, m + " AdamW moments",
             checked_mul(2, state, "AdamW moments"));
  if (o.offload_optimizer) {
    const auto numel = static_cast<int64_t>(state / dtype_size(master));
    if (OffloadedAdamW::streams(device, master))
      need.add(device, "optimizer staging", OffloadedAdamW::device_staging_bytes_for(numel, master));
    else
      need.add(Device::host(), "optimizer staging", OffloadedAdamW::staging_bytes_for(numel, master, compute));
  }
  return need;
}

void TrainingState::sync_master_from_compute() {
  // The model initialised its adapters (PEFT's rule); a separate master starts from the same values.
  if (master_ && model_.has_adapters()) copy_params(*master_, model_.adapters());
}

const AdamW& TrainingState::optimizer() const {
  if (offloaded_) return std::as_const(*offloaded_).state();
  CW_CHECK(adamw_, "the optimizer state is sharded (parallel.zero > 0): each rank's shard is the data-parallel "
                   "group's (parallel/data_parallel.h)");
  return *adamw_;
}

AdamW& TrainingState::optimizer() {
  if (offloaded_) return offloaded_->state();  // gives up the streamed step's page-locking (a load follows)
  std::as_const(*this).optimizer();            // the sharded state's error
  return *adamw_;
}

void TrainingState::sync_compute_copy() {
  if (!master_) return;
  if (model_.casts_layers()) {
    copy_params_by_name(model_.params(), *master_);  // the tensors outside the blocks
    model_.master_changed();
  } else {
    copy_params(model_.trainable(), *master_);
  }
}

void TrainingState::load_master(const ParamSet& host) {
  copy_params(master(), host);
  sync_compute_copy();
}

void TrainingState::load_base(const ParamSet& host) {
  if (!lora()) return load_master(host);
  copy_params(model_.params(), host);  // the frozen base: straight into the compute weights
}

void TrainingState::init(uint64_t seed, double initializer_range) {
  init_parameters(lora() ? model_.params() : master(), seed, initializer_range);
  if (lora()) init_adapters();
  else sync_compute_copy();
}

void TrainingState::init_adapters() {
  CW_CHECK(lora(), "init_adapters: the model has no LoRA adapters");
  init_lora_parameters(master(), model_.lora().seed);
  sync_compute_copy();
}

void TrainingState::init_tiled(uint64_t seed, double initializer_range) {
  // Under LoRA the base is written in the compute dtype directly (it has no master).
  const ParamSet& m = lora() ? model_.params() : master();
  const int64_t block = std::min<int64_t>(int64_t(16) << 20, m.numel());
  OwnedTensor host(m.dtype() == DType::bf16 ? DType::f32 : m.dtype(), {block});
  fill_normal(host, seed, 0, 0.0, initializer_range);
  const Tensor flat = m.flat();
  for (int64_t off = 0; off < m.numel(); off += block) {
    const int64_t n = std::min(block, m.numel() - off);
    copy_convert(flat.slice(0, off, n), host.tensor.slice(0, 0, n));
  }
  for (size_t i = 0; i < m.size(); ++i) {
    if (m.specs()[i].is_norm()) fill(m[i], 1.0 - m.config().norm_weight_offset);  // the norm's identity
    if (m.specs()[i].is_bias()) fill(m[i], 0.0);  // HF's: a linear's bias starts at 0
  }
  if (lora()) init_adapters();
  else sync_compute_copy();
}

ParamSet TrainingState::master_on_host() const {
  ParamSet host = ParamSet::like(master(), master().dtype(), Device::host());
  copy_params(host, master());
  return host;
}

ParamSet TrainingState::base_on_host(DType dtype) const {
  ParamSet host(model_.config(), dtype);
  copy_params(host, lora() ? model_.params() : master());
  return host;
}

void TrainingState::optimizer_step(double lr) {
  if (offloaded_) return offloaded_->step(master(), grads_, lr, model_.trainable());
  if (model_.casts_layers()) {  // the update writes the master; the resident part of the copy follows
    optimizer().step(master(), grads_, lr, nullptr);
    return sync_compute_copy();
  }
  optimizer().step(master(), grads_, lr, master_ ? &model_.trainable() : nullptr);
}

size_t MemoryReport::other() const {
  const size_t named = weights + master + optimizer + gradients + activations + kv;
  return device_peak > named ? device_peak - named : 0;
}

std::vector<std::pair<std::string, size_t>> MemoryReport::categories() const {
  return {{"weights", weights},   {"master", master}, {"optimizer", optimizer}, {"gradients", gradients},
          {"activations", activations}, {"kv", kv}, {"other", other()},   {"peak", device_peak}};
}

std::string MemoryReport::line() const {
  std::string s;
  for (const auto& [name, bytes] : categories()) {
    if (!s.empty()) s += " | ";
    s += fmt::format("{} {:.2f} GiB", name, static_cast<double>(bytes) / double(1ull << 30));
  }
  // Host memory the run pins, what there is of it: the offloaded optimizer's and the K/V store's.
  std::string host;
  for (const auto& [name, bytes] : {std::pair<const char*, size_t>{"master", host_master},
                                    {"optimizer", host_optimizer}, {"staging", host_staging}, {"kv", host_kv}})
    if (bytes > 0)
      host += fmt::format("{}{} {:.2f} GiB", host.empty() ? " || host: " : " | ", name,
                          static_cast<double>(bytes) / double(1ull << 30));
  return s + host;
}

MemoryReport memory_report(const TrainingState& st, size_t activation_high_water, size_t kv_bytes,
                           size_t kv_host_bytes) {
  MemoryReport r;
  r.host_kv = kv_host_bytes;
  r.weights = st.model().params().bytes() + (st.lora() ? st.model().adapters().bytes() : 0) +
              (st.model().layer_cast() ? st.model().layer_cast()->device_bytes() : 0);
  const bool separate_master = &st.master() != &st.model().trainable();
  if (const OffloadedAdamW* off = st.offloaded_optimizer()) {
    r.host_master = st.master().bytes();
    r.host_optimizer = st.master().bytes() * 2;
    r.host_staging = off->staging_bytes();
    r.optimizer = off->device_staging_bytes();  // streamed through the device: its slots
  } else {
    r.master = separate_master ? st.master().bytes() : 0;
    r.optimizer = st.has_full_optimizer() ? st.master().bytes() * 2 : 0;  // exp_avg and exp_avg_sq (ZeRO: the group's)
  }
  r.gradients = st.grads().bytes();
  r.activations = activation_high_water;
  r.kv = kv_bytes;
  if (!st.device().is_cpu()) r.device_peak = pool_stats(st.device()).peak_in_use;
  return r;
}

}  // namespace cw
