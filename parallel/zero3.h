// ZeRO 3 (parallel.zero = 3): data parallelism in which each of n ranks holds 1/n of every
// parameter, of its gradient and of its AdamW state, and no rank ever holds the whole model or a
// whole-model gradient.
//
// Layout: parallel/zero3_layout.h (units = the tensors outside the blocks, and each block; every unit
// split over the ranks in equal parts). A rank keeps, for its shard only:
//   master   the master weights (f32 on a GPU, the compute dtype on the CPU); with
//            offload_optimizer in host memory, with a compute-dtype copy of the shard on the device
//   grads    the reduced gradient (f32; f64 in f64 mode)
//   AdamW    the moments, by AdamW itself over the shard's table (offloaded: OffloadedAdamW, the
//            optimizer offload of one process applied to the shard)
// and a small pool of working buffers, each one unit in the compute dtype or the gradient dtype:
//   weights    kBlockSlots block buffers + one for the outside unit: block l is all-gathered into a
//              buffer when the model first asks for it (a forward, a recompute, a backward), and
//              the buffer is reused for another block once kBlockSlots others have been asked for.
//              A block still held is not gathered again (the forward's last block is the
//              backward's first; a reverse-sweep chunk's block 0 the next chunk's). The outside
//              unit is gathered at the start of a pass and released at its end.
//   gradients  kBlockSlots block gradient buffers + one for the outside unit: zeroed when a block's
//              backward starts, reduce-scattered when it ends (each rank receives the sum over the
//              ranks of its part, in rank order on the threads backend) and that sum ADDED into the
//              rank's shard of the gradient. Under seco a block's backward runs once per reverse-
//              sweep chunk, so its gradient is reduce-scattered once per chunk: the shard accumulates
//              the chunks' reduced sums (rounding apart, the sum over ranks of each rank's sum over
//              chunks: within 1e-12 of one process in f64; with one backward chunk, full and
//              checkpointed, the bits of ZeRO 0's all-reduce).
// Gathers by direction: a forward asks for block l and then says l + 1 comes next (prefetch), a
// backward l - 1, so the next block's all-gather is posted before the current block runs. On NCCL
// the collective is queued on the communicator's stream ordered after the compute queued so far
// (parallel/comm.h), so block l+1's gather (forward) or l-1's (backward) and block l+1's gradient
// reduce-scatter (backward) run while block l computes; the compute stream waits for a gather only
// when the block is asked for. On the threads backend a collective completes when the last rank
// posts it, so the same structure runs without measurable overlap. Weight buffers are never
// written by compute, so a gather into a buffer only waits for the reads of the block it held.
// Per step, with L blocks, k prefill chunks and k' reverse-sweep chunks (seco), the block gathers are
// k L (prefill) + k' (2 L - 2) (each reverse chunk's recompute and backward, less the block kept at
// the turn and the block kept from the previous chunk), and k' L reduce-scatters; the outside unit
// is gathered once per pass (k + k') and reduce-scattered k' times. Zero3Counts counts what a run
// does; the planner (tools/planner) predicts the same numbers and the bytes, tested against them.
// With LoRA the sharded parameters are the frozen base: each rank keeps its shard of the base in the
// compute dtype and gathers blocks as above, with no gradient, reduce-scatter or optimizer state for
// it; the adapters, a small fraction of the model, are replicated on every rank like ZeRO 0's
// parameters (master weights, AdamW), their gradient all-reduced once per step.
// Not with tensor parallelism (refused with one line naming the options).
#pragma once

#include "optim/adamw.h"
#include "optim/adamw_offload.h"
#include "optim/options.h"
#include "optim/schedule.h"
#include "parallel/comm.h"
#include "parallel/data_parallel.h"
#include "parallel/zero3_layout.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cw {

// What the collectives of a run moved, counted where they are issued.
struct Zero3Counts {
  int64_t block_gathers = 0;            // all-gathers of a block's weights
  int64_t outside_gathers = 0;          // all-gathers of the outside unit
  int64_t prefetched = 0;               // of the block gathers, posted ahead of the block's use
  int64_t reuses = 0;                   // blocks asked for again while their buffer still held them
  int64_t block_reduce_scatters = 0;    // reduce-scatters of a block's gradient
  int64_t outside_reduce_scatters = 0;  // ... of the outside unit's
  int64_t gathered_bytes = 0;           // every all-gather's output (ranks x part x compute bytes)
  int64_t scattered_bytes = 0;          // every reduce-scatter's input (ranks x part x gradient bytes)
  Zero3Counts operator-(const Zero3Counts& o) const;
};

class ShardedParameters final : public ParameterShards {
 public:
  static constexpr int kBlockSlots = 2;

  // config: the whole model; compute: the blocks' dtype; the master and gradient dtypes follow
  // optim/training.h (f32 master and gradients under bf16, else the compute dtype). frozen (LoRA's
  // base): the shard is kept in the compute dtype, with no gradient, gradient buffers or optimizer.
  ShardedParameters(Communicator& comm, const LlamaConfig& config, DType compute, const AdamWOptions& adamw,
                    bool offload_optimizer, bool frozen = false);

  const ShardLayout& layout() const { return layout_; }
  bool frozen() const { return frozen_; }
  const ParamSet& master() const { return master_; }  // this rank's shard (its shard_table)
  const ParamSet& grads() const { return grads_; }    // empty when frozen
  AdamW& optimizer();                                 // not when frozen
  const AdamW& optimizer() const;
  bool optimizer_offloaded() const { return offloaded_.has_value(); }
  const Zero3Counts& counts() const { return counts_; }
  // Bytes this rank holds: the shard's master, gradient and moments, and the working buffers.
  size_t shard_bytes() const;
  size_t buffer_bytes() const;

  // The rank's shard from a whole host set (every rank passes the same), then no buffer holds a unit.
  void load(const ParamSet& whole);
  // The master shard changed (a step, a load): the compute copy (offloaded) is current, no buffer
  // holds a current unit.
  void master_changed();
  // Every rank's shard of `set` (the master or the gradient) gathered into a whole host set of the
  // table on every rank (a collective: checks), one unit at a time through a device buffer of one unit.
  ParamSet gather_whole(const ParamSet& shard_set);
  // The same into `root`'s host memory alone (the other ranks get nothing): no rank holds the whole
  // model but root, and root only on the host (a collective: a sample of a model no GPU holds).
  std::optional<ParamSet> gather_whole_to(const ParamSet& shard_set, int root);
  // Waits for every reduce-scatter in flight and adds its sum into the gradient shard.
  void finish_reductions();
  // One AdamW step on the shard (clipping is the caller's).
  void optimizer_step(double lr);

  // ParameterShards (model/parameter_shards.h): what the model asks for as it runs.
  ModelWeights outside() override;
  void release_outside() override;
  LayerWeights block(int l) override;
  void prefetch(int l) override;
  ModelWeights outside_grads() override;
  LayerWeights block_grads(int l) override;
  void outside_grads_done() override;
  void block_grads_done(int l) override;

 private:
  struct Slot {
    Buffer buffer;                     // ranks x part elements of the largest unit it takes
    int unit = -1;                     // the unit it holds (or is receiving), -1 none
    bool asked = false;                // the model has been given it since it was gathered
    uint64_t used = 0;                 // when last asked for
    std::unique_ptr<CommWork> pending; // the gather (weights) or reduce-scatter (gradients) in flight
    Buffer reduced;                    // gradient slots: the reduce-scatter's output, one part
  };
  Tensor whole_of(const Slot& slot, size_t unit, DType dtype) const;  // [ranks x part]
  void start_gather(Slot& slot, size_t unit, bool prefetched);
  void wait(Slot& slot);
  void finish_reduction(Slot& slot);
  Slot& gathered(size_t unit);  // the block slot holding `unit`, gathered (and waited for) if none does
  // gather_whole and gather_whole_to: unit by unit, kept on `root` or on every rank (kEveryRank).
  static constexpr int kEveryRank = -1;
  std::optional<ParamSet> gather_units(const ParamSet& shard_set, int root);
  // The unit's tensors as views of a slot's buffer, in its table order.
  std::vector<Tensor> views(const Slot& slot, size_t unit, DType dtype) const;
  std::vector<ParamSpec> unit_specs(size_t unit) const;
  ModelWeights outside_weights(const std::vector<Tensor>& views) const;
  Tensor source_part(size_t unit) const;  // this rank's compute-dtype elements of the unit

  Communicator& comm_;
  LlamaConfig config_;
  DType compute_, grad_dtype_;
  Device device_;
  ShardLayout layout_;
  ParamSet master_;
  std::optional<ParamSet> compute_copy_;  // offloaded: the shard in the compute dtype on the device
  ParamSet grads_;
  std::optional<AdamW> adamw_;
  std::optional<OffloadedAdamW> offloaded_;
  bool frozen_;
  std::vector<Slot> block_slots_, block_grad_slots_;
  Slot outside_slot_, outside_grad_slot_;
  uint64_t clock_ = 0;
  Zero3Counts counts_;
};

// A ZeRO 3 rank: its ShardedParameters and the model that runs on them, stepped as DataParallel
// steps (the global normaliser, the loss summed over the ranks; parallel/data_parallel.h steps 1, 2
// and 4), the gradients reduce-scattered block by block as above instead of bucketed. With LoRA
// (lora.rank > 0) the shards are the frozen base and the adapters train replicated: their gradient
// (the model's backward adds into adapter_grads()) is all-reduced after the step's last micro-batch,
// and every rank applies the same AdamW step to its master copy.
class ShardedDataParallel {
 public:
  ShardedDataParallel(Communicator& comm, const LlamaConfig& config, DType compute, const AdamWOptions& adamw,
                      const ParallelOptions& options, bool offload_optimizer = false, const LoraConfig& lora = {});

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  LlamaModel& model() { return model_; }
  ShardedParameters& shards() { return shards_; }
  const ShardedParameters& shards() const { return shards_; }
  // LoRA: the adapters' master weights (every rank the same) and their reduced gradient.
  bool lora() const { return adapter_master_.has_value(); }
  const ParamSet& adapter_master() const;
  const ParamSet& adapter_grads() const;
  // LoRA: the adapters from a whole host set of their table (every rank passes the same).
  void load_adapters(const ParamSet& adapters);
  // LoRA: the adapters' AdamW (every rank's the same: a checkpoint keeps rank 0's, every rank reads it).
  AdamW& adapter_optimizer();
  const AdamW& adapter_optimizer() const;

  DataParallelStep compute_gradients(Schedule& schedule, const std::vector<Batch>& micro, uint64_t step_index);
  // The last compute_gradients' collectives.
  const Zero3Counts& step_counts() const { return step_counts_; }
  double gradient_norm();
  double clip_gradients(double max_norm);
  void optimizer_step(double lr);

  // Checkpoints: each rank writes and reads its own shard (master weights and AdamW moments, one
  // safetensors file; the layout's ranks and the rank in its metadata, checked on load).
  void save_shard(const std::string& path) const;
  void load_shard(const std::string& path);

 private:
  Communicator& comm_;
  ShardedParameters shards_;
  LlamaModel model_;
  Zero3Counts step_counts_;
  std::optional<ParamSet> adapter_master_, adapter_grads_;  // LoRA
  std::optional<AdamW> adapter_adamw_;
};

// The whole model's master weights from the n shard files save_shard wrote (rank r's at paths[r]),
// as a host set of the table in the files' dtype: the HF checkpoint of a sharded run.
ParamSet consolidate_shards(const LlamaConfig& config, const std::vector<std::string>& paths);

}  // namespace cw
