// The state a training run updates, under the precision policy of DESIGN.md section 6, on the CPU
// or a GPU, and the memory it takes by category.
//
//   compute weights  the model's parameters in the compute dtype: bf16 on a GPU (training), f32 or
//                    f64 for checks (and on the CPU)
//   master weights   f32 when the compute dtype is bf16 (AdamW updates these and writes the bf16
//                    compute copy in the same kernel); otherwise the compute weights themselves
//   gradients        f32 (f64 in f64 mode), accumulated over chunks and micro-batches
//   AdamW moments    the master weights' dtype
// Everything lives on `device`, unless the optimizer is offloaded (offload_optimizer): then the master
// weights (f32, or the compute dtype on the CPU) and the moments live in host memory and the update
// runs there (optim/adamw_offload.h); the compute weights and gradients stay on `device`. Checkpoints read and write the master weights through host copies,
// so a bf16 GPU run saves f32 weights and resumes bit-exactly.
// With LoRA (a LoraConfig of rank > 0; model/lora.h) the policy applies to the adapters alone: the
// base parameters are the model's compute weights (bf16 on a GPU) and nothing else, no master copy,
// no gradient, no moments; master weights, gradients and moments are the adapters' (f32 on a GPU). With ZeRO (parallel/data_parallel.h)
// the state is built without the full AdamW moments (full_optimizer = false): each rank keeps the
// moments of its own shard there, and updates through optimizer_step are refused. With tensor
// parallelism (a TensorParallelGroup, model/shard.h) the state is the rank's shard: the model is
// built with the group, and master weights, gradients and moments have the shard's shapes
// (model().config()); the caller loads the shard's values (parallel/tensor_parallel.h:
// shard_parameters of the full model's).
#pragma once

#include "model/llama.h"
#include "model/memory_need.h"
#include "optim/adamw.h"
#include "optim/adamw_offload.h"

#include <optional>
#include <string>
#include <vector>

namespace cw {

// How a training state is built beside the model's config and the optimizer's settings. Call sites
// name what they set: TrainingState(config, DType::bf16, gpu, adamw, {.lora = lora, .offload_optimizer = true}).
struct TrainingStateOptions {
  bool full_optimizer = true;         // false: no AdamW state here (ZeRO: each rank keeps its shard's)
  TensorParallelGroup* tp = nullptr;  // this rank's tensor-parallel group (null: the whole model)
  LoraConfig lora = {};               // adapters (rank > 0) on the targeted linears, the base frozen
  // The master weights and AdamW's moments in host memory, updated on the host's cores
  // (optim/adamw_offload.h); the compute weights and gradients stay on the device.
  bool offload_optimizer = false;
  // schedule.cast_layers: no resident compute copy of the blocks' weights; each block's is rounded
  // from the master weights as it runs (model/layer_cast.h). Needs a master apart from the compute
  // weights on the device: bf16 on a GPU, full parameters, the optimizer neither offloaded nor sharded.
  bool cast_layers = false;
};

class TrainingState {
 public:
  // config: the whole model's (with options.tp, the rank holds its shard).
  TrainingState(const LlamaConfig& config, DType compute, Device device, const AdamWOptions& adamw,
                const TrainingStateOptions& options = {});
  // What a state of these arguments allocates, by part, on the device and in host memory: the rule
  // of the constructor (and of the offloaded optimizer's staging, allocated at its first step), for
  // require_memory before anything is allocated. Under ZeRO (full_optimizer = false) the moments of a
  // rank's shard are the data-parallel group's and not counted here.
  static MemoryNeed memory_need(const LlamaConfig& config, DType compute, Device device,
                                const TrainingStateOptions& options = {});

  LlamaModel& model() { return model_; }
  const LlamaModel& model() const { return model_; }
  // The master weights of what is trained: every parameter, or the adapters under LoRA.
  const ParamSet& master() const { return master_ ? *master_ : model_.trainable(); }
  ParamSet& master() { return master_ ? *master_ : model_.trainable(); }
  bool lora() const { return model_.has_adapters(); }
  const ParamSet& grads() const { return grads_; }
  // The AdamW state (offloaded: its host copy, for checkpoints); throws when the state was built
  // without it (ZeRO).
  AdamW& optimizer();  // to load a state (offloaded: its page-locking is given up first)
  const AdamW& optimizer() const;  // to save it
  bool has_full_optimizer() const { return adamw_.has_value() || offloaded_.has_value(); }
  bool optimizer_offloaded() const { return offloaded_.has_value(); }
  const OffloadedAdamW* offloaded_optimizer() const { return offloaded_ ? &*offloaded_ : nullptr; }
  const AdamWOptions& adamw_options() const { return adamw_options_; }
  Device device() const { return model_.device(); }
  DType master_dtype() const { return master().dtype(); }

  // Master weights from a host parameter set (any dtype: converted), then the compute copy. Under
  // LoRA the set is the adapters'.
  void load_master(const ParamSet& host);
  // The base weights from a host set of the model's table: under LoRA into the frozen compute
  // weights (rounded to the compute dtype, no master); otherwise the same as load_master.
  void load_base(const ParamSet& host);
  // Seeded initialisation (drawn on the host) of the base (HF's rule), then the compute copy; under
  // LoRA also the adapters (init_adapters). With tensor parallelism these are the shard's own
  // draws, not a shard of a whole model's.
  void init(uint64_t seed, double initializer_range);
  // Under LoRA: the adapters by PEFT's rule from lora.seed, then the compute copy.
  void init_adapters();
  // For benchmarks: one block of 16 Mi values drawn on the host (N(0, initializer_range)) tiled over
  // every base weight, norm gains 1 (then the compute copy; under LoRA the adapters by PEFT's rule):
  // random values without drawing a billion of them on the host.
  void init_tiled(uint64_t seed, double initializer_range);
  // The master weights as a host parameter set of the master dtype (for checkpoints and sampling);
  // under LoRA the adapters'.
  ParamSet master_on_host() const;
  // The base weights as a host set of the model's table in `dtype` (under LoRA from the compute
  // weights; otherwise from the master weights).
  ParamSet base_on_host(DType dtype) const;
  // One AdamW step on the accumulated gradients (updates master and compute weights).
  void optimizer_step(double lr);
  // The compute weights from the master weights (bf16 rounding; nothing when they are the same set).
  void sync_compute_copy();

 private:
  void sync_master_from_compute();

  LlamaModel model_;
  std::optional<ParamSet> master_;
  ParamSet grads_;
  AdamWOptions adamw_options_;
  std::optional<AdamW> adamw_;
  std::optional<OffloadedAdamW> offloaded_;
};

// Bytes by category, for the memory report of train and bench. activations and kv come from the
// schedule's last step (the arena's high-water mark, the K/V store); device_peak is the caching
// pool's peak (GPU) and `other` what the peak holds beyond the named categories (LM-head and
// attention scratch outside the arena, cuBLASLt/cuDNN workspaces, pool slack). Under LoRA,
// weights are the base's compute weights and the adapters' compute copy; master, optimizer and
// gradients the adapters' alone.
// With the optimizer offloaded, master and optimizer are host bytes (host_master, host_optimizer,
// and the staging slots in host_staging), not the device's.
struct MemoryReport {
  size_t weights = 0, master = 0, optimizer = 0, gradients = 0, activations = 0, kv = 0, device_peak = 0;
  size_t host_master = 0, host_optimizer = 0, host_staging = 0, host_kv = 0;
  size_t other() const;
  std::string line() const;  // "weights 2.30 GiB | master ... | peak ..."
  std::vector<std::pair<std::string, size_t>> categories() const;
};
// kv_host_bytes: the K/V store's pinned host homes (an offload window or the streamed store).
MemoryReport memory_report(const TrainingState& state, size_t activation_high_water, size_t kv_bytes,
                           size_t kv_host_bytes = 0);

}  // namespace cw
