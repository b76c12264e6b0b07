// The planner: the predicted peak device and pinned host memory of one training step, by category,
// and its predicted time, from the code's own allocation pattern (not from curve fits); and the
// settings `auto` chooses from them. README.md says what it predicts and how each part is checked.
//
// Device memory on a GPU = the caching pool's peak (engine.h device_pool_block), the figure
// `chunkwise bench` reports as peak_gib; on the CPU the buffers' bytes:
//   fixed        compute weights, f32 master weights (bf16 compute), AdamW's two moments and the
//                gradients in the accumulator dtype (optim/training.h), one buffer per parameter set;
//                RoPE tables; on a GPU cuBLASLt's workspace (engine.h kCublasWorkspaceBytes)
//   K/V store    K, V and dK, dV of every layer and token (model/kv_store.h), dK, dV of one layer when
//                one backward chunk covers all T tokens (layer-local gradients); what the prefill saves
//                with them (attention outputs and lse, layer inputs); with an offload window W > 0, W
//                layers on the device and all L in pinned host memory; streamed, three key blocks
//   activations  the schedule's arena over the step (arena_replay.h): every chunk's buffers and every
//                op's scratch as its backend exports it (engine/scratch.h)
// With LoRA the base is frozen: fixed = the base's compute weights alone, plus the adapters' compute
// copy, master, moments and gradients; the activations add each adapted linear's scratch.
// Host memory: offloaded layer inputs (checkpointed offload) and the K/V store's host copy (pinned);
// with the optimizer offloaded its master weights and moments, and its pinned staging slots
// (optim/adamw_offload.h), off the device. The CUDA context is outside the pool: it counts for `fits`.
//
// Step time (time_model.cpp) = matmul FLOPs / their rate at the chunk's rows + attention FLOPs / its
// rate at the head size + elementwise traffic / bandwidth + the optimizer's time, with the passes each
// schedule runs (full: forward + backward; checkpointed and seco: one forward more, less W_down where
// a layer is recomputed for its backward alone; seco with saved inputs: the prefill and each layer's
// recompute; selective: the MLP's gate/up once more); with the K/V store offloaded, the part of its
// copies the compute cannot hide. The rates are H100 measurements, each with its record in
// docs/performance.md, "The rates of the planner's time model".
#pragma once

#include "engine/dtype.h"
#include "model/config.h"
#include "model/lora.h"
#include "optim/schedule.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cw {

// The CUDA context (driver, kernels, cuDNN/cuBLAS handles): device memory outside the pool.
inline constexpr size_t kCudaContextBytes = size_t(512) << 20;

// What a plan must fit: device_gib of device memory (the pool's peak and the CUDA context) and,
// when host_gib > 0, host_gib of host memory for its pinned part, of which it may take 90%
// (kPinnableHostShare, engine/residency.h). A GiB count alone means the device's.
// zero3_ranks > 0: the budget is one rank's of ZeRO 3 over that many ranks, and a plan holds the
// rank's shard and gathered buffers instead of the whole model's state (plan_zero3, apply_zero3), so
// that every choice made against the budget (auto, --longest) is made for a ZeRO 3 rank.
// cp_ranks > 1: the budget is one rank's of context parallelism over that many ranks (model/cp_group.h):
// a plan holds the whole model, the rank's c/cp tokens of each chunk and a K/V store of its heads.
struct MemoryBudget {
  double device_gib = 0;
  double host_gib = 0;  // 0: not checked
  int zero3_ranks = 0;  // 0: no ZeRO 3
  int cp_ranks = 0;     // 0 or 1: no context parallelism
  MemoryBudget(double device, double host = 0, int zero3 = 0) : device_gib(device), host_gib(host), zero3_ranks(zero3) {}
};

// A schedule's settings as one line ("seco recompute full chunk 4096 bwd-chunk 4096 offload-window 2
// save-attention"): PlanReport::schedule, bench's and train's report of what auto chose.
std::string describe_schedule(const ScheduleOptions& o);

struct PlanReport {
  std::string schedule;                                  // the options it was planned for, as text
  int64_t B = 0, T = 0, chunk = 0, bwd_chunk = 0, offload_window = 0;
  std::vector<std::pair<std::string, size_t>> device;    // bytes by category (a GPU: the pool's peak)
  std::vector<std::pair<std::string, size_t>> host;      // pinned host bytes by category
  std::vector<std::pair<std::string, double>> time;      // seconds by category
  size_t peak_device_bytes = 0, peak_host_bytes = 0;
  size_t context_bytes = 0;                              // CUDA context, outside the pool (0 on the CPU)
  double step_s = 0, flops = 0;                          // flops: what the step executes (with recompute)
  double kv_moved_bytes = 0;                             // the K/V offload's host <-> device bytes a step
  double layer_casts = 0;                                // cast_layers: blocks cast from the master a step
  std::vector<std::string> arena_blocks;                 // the replayed arena's blocks (engine/memory.h CW_ARENA_LOG)
  // The largest attention backward workspace the step's activations count (cuDNN's, for the head
  // reduction of GQA): bench and train raise the engine's workspace budget to it
  // (raise_attention_workspace_budget), so no call the plan fits runs a slower kernel for want of it.
  size_t attention_workspace_bytes = 0;
  // Context parallelism (budget.cp_ranks): the rank's all-to-alls a step (count, and the bytes out of
  // its GPU: (cp - 1) / cp of each exchange's buffer), and its gradient all-reduce's bytes; not in
  // step_s, which is the rank's compute.
  int64_t cp = 1, cp_all_to_alls = 0;
  double cp_exchange_bytes = 0, cp_all_reduce_bytes = 0;
  double device_gib = 0, host_gib = 0;                  // the budget it was checked against (host 0: none)
  bool device_fits = false, host_fits = true;
  bool fits = false;                                     // both
  std::string advice;                                    // when it does not fit: which knob to turn

  double peak_device_gib() const;
  double peak_host_gib() const;
  double tokens_per_s() const { return step_s > 0 ? double(B * T) / step_s : 0; }
};

// The plan of one step of `schedule` (its chunk / bwd_chunk / offload_window / recompute /
// mlp_shards / offload) for B sequences of T tokens in `dtype`, against the memory budget.
// optimizer_offload: the master weights and moments in host memory (optim/adamw_offload.h).
// doc_starts: packed documents, per sequence the offsets where its documents start (Batch::doc_starts,
// the first 0); empty: each sequence one causal document. Attention's work is then the documents'
// causal squares, not T's (docs/packed_documents.md); memory grows only by the step's int32 [B, T]
// document starts on a GPU (optim/schedule.h StepTokens).
// device: where the step runs, whose memory is planned: a GPU (bf16 or f32) or the CPU (f64 or f32,
// no CUDA context); the step time is an H100's either way.
// With budget.zero3_ranks the plan is a ZeRO 3 rank's (apply_zero3).
PlanReport plan_step(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule, DType dtype,
                     const MemoryBudget& budget, const LoraConfig& lora = {}, bool optimizer_offload = false,
                     const std::vector<std::vector<int64_t>>& doc_starts = {}, Device device = Device::gpu(0));

// ZeRO 3 (parallel/zero3.h) on `ranks` data-parallel ranks: one rank's step, predicted from the
// shard layout (parallel/zero3_layout.h) and the order in which the schedule visits the blocks. The
// counts follow the buffer pool's rule (kBlockSlots buffers; a block still held is not gathered
// again): a pass over the blocks in the direction opposite to the one before it reuses the two it
// ends with, one in the same direction reuses them only when the model has two blocks; each pass
// gathers the outside unit once (a forward that keeps activations shares it with its backward), and
// each backward reduce-scatters every block and the outside unit. tests/parallel/test_zero3.cpp holds
// them to a CPU run's counters.
struct Zero3Plan {
  int64_t block_gathers = 0, reuses = 0, outside_gathers = 0;
  int64_t block_reduce_scatters = 0, outside_reduce_scatters = 0;
  int64_t gathered_bytes = 0;   // every all-gather's output (ranks x part x compute bytes)
  int64_t scattered_bytes = 0;  // every reduce-scatter's input (ranks x part x gradient bytes)
  size_t shard_bytes = 0;       // this rank's master weights, gradient and moments (and offloaded: compute copy)
  size_t host_shard_bytes = 0;  // with the optimizer offloaded: its master weights and moments in host memory
  size_t gathered_buffer_bytes = 0, gradient_buffer_bytes = 0;  // the working buffers
  size_t largest_shard_elements = 0;  // the largest rank's shard (the last ranks' hold less padding)
  // LoRA: the shards are the frozen base (the compute dtype, no gradient or moments, no reduce-
  // scatter); the adapters' compute copy, which plan_step counts among the weights, stays whole.
  bool frozen = false;
  size_t adapter_bytes = 0;
};
Zero3Plan plan_zero3(const LlamaConfig& config, int64_t T, const ScheduleOptions& schedule, DType dtype, int ranks,
                     bool optimizer_offload = false, Device device = Device::gpu(0), const LoraConfig& lora = {});
// The report of plan_step with the whole-model weights, master weights, moments and gradients
// replaced by the rank's shard and the working buffers of plan_zero3 (its peak and fit again); under
// LoRA the weights by the frozen shard and the adapters, the adapters' master, moments and gradient
// kept (replicated on every rank).
void apply_zero3(PlanReport& report, const Zero3Plan& zero3, const MemoryBudget& budget, Device device = Device::gpu(0));

// The default candidates for `--chunk auto` (seco, spaco).
const std::vector<int64_t>& chunk_candidates();
// The fastest chunk length of `candidates` (<= T) whose plan fits the budget (the backward chunk
// follows it; a larger chunk within 1% of a smaller one's time wins); 0 when none fits. The
// schedule's own chunk is ignored. `--chunk auto` on `chunkwise plan`.
int64_t choose_chunk(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule, DType dtype,
                     const MemoryBudget& budget, const std::vector<int64_t>& candidates = chunk_candidates(),
                     const LoraConfig& lora = {}, bool optimizer_offload = false);
// The smallest K/V offload window (0 = everything on the device, then 1..L) whose plan fits at the
// schedule's chunk; -1 when none. (`--offload-window auto` with `--chunk auto` searches both.)
int64_t choose_offload_window(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule,
                              DType dtype, const MemoryBudget& budget, const LoraConfig& lora = {},
                              bool optimizer_offload = false);
// schedule.chunk and/or schedule.offload_window = auto (kAuto; plan's, bench's and train's): the
// fastest plan that fits among the K/V store on the device, in a window of two layers, of one, and
// streamed, each with its fastest chunk (an offload must be 1% faster than keeping the store nearer);
// with recompute = auto (seco, spaco) also the fastest of none,
// selective and full recompute inside the chunk. The schedule with them set (unchanged when neither
// chunk nor window is auto). Throws an "out of memory" error saying which knob to turn when no
// candidate fits.
// One plan auto compared (`weighed`, when given, collects them in order; `chosen` marks the winner).
struct AutoCandidate {
  ScheduleOptions schedule;
  bool fits = false;
  double peak_device_gib = 0, peak_host_gib = 0, step_s = 0;
  bool chosen = false;
};
ScheduleOptions resolve_auto_schedule(const LlamaConfig& config, int64_t B, int64_t T, ScheduleOptions schedule,
                                      DType dtype, const MemoryBudget& budget, const LoraConfig& lora = {},
                                      bool optimizer_offload = false, std::vector<AutoCandidate>* weighed = nullptr);
// The longest sequence whose step fits the budget with the schedule's settings (chunk and window
// = auto resolved again at each length): a multiple of the fixed chunk (else of 1024 tokens), at most
// `limit`; T = 0 when not even one granule fits. `chunkwise plan --longest`.
struct LongestPlan {
  int64_t T = 0, granule = 0;
  ScheduleOptions schedule;  // as resolved at T
};
LongestPlan longest_sequence(const LlamaConfig& config, int64_t B, const ScheduleOptions& schedule, DType dtype,
                             const MemoryBudget& budget, const LoraConfig& lora = {}, bool optimizer_offload = false,
                             int64_t limit = int64_t(1) << 24);
// The budget in words, for errors: "24.0 GiB" or "24.0 GiB of device and 90% of 128.0 GiB of host memory".
std::string budget_text(const MemoryBudget& budget);

// gib when positive, else the first GPU's memory, else 80.
double device_gib_or_gpu(double gib);
// gib when positive, else this machine's available host memory when it has a GPU (the run's host),
// else 0 (not checked: planning elsewhere for a GPU machine).
double host_gib_or_machine(double gib);
// The caching pool's ceiling (engine.h set_device_memory_limit) for `gib` of device memory
// (--device-memory): the GiB less the CUDA context. Throws naming `option` when they do not cover it.
size_t pool_limit_for(double gib, const char* option);

}  // namespace cw
