// A rank's place in a training run and the whole model's weights through it (tools/train/train.h's
// parallel runs). RankGroups names the groups a rank belongs to and the optimizer file it writes and
// reads; whole_master and whole_base assemble the whole model on the host from the TP group's shards
// or, under ZeRO 3, from every rank's shard (for a checkpoint or a sample); resume_or_initialise is
// where a run's weights, optimizer state and sampler position come from: a checkpoint of the run,
// model.source, or a seeded initialisation, the whole model loaded and each rank given its TP shard
// (or ZeRO 3 shard) of it.
#pragma once

#include "model/config.h"
#include "model/params.h"
#include "optim/training.h"
#include "parallel/comm.h"
#include "parallel/data_parallel.h"
#include "parallel/grid.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero3.h"
#include "tools/data/tokens.h"
#include "tools/train/run_config.h"
#include "tools/train/run_dir.h"

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

namespace cw {

// This rank's place in a parallel run; all null for one process.
struct RankGroups {
  Communicator* world = nullptr;  // every rank: barriers, the agreed stop
  ParallelGrid* grid = nullptr;   // its TP and DP groups
  DataParallel* dp = nullptr;     // the gradient reduction and the optimizer over the DP group
  TensorParallel* tp = nullptr;   // tp > 1: the rank's tensor-parallel group, the model's
  ShardedDataParallel* zero3 = nullptr;  // parallel.zero = 3: the rank's shards and the model on them
  // parallel.cp > 1: the rank's context-parallel group (its data-parallel rank's cp adjacent ranks),
  // whose exchanges the model makes; `dp` and `grid`'s DP group are then the whole world.
  Communicator* cp = nullptr;

  int world_rank() const { return world ? world->rank() : 0; }
  int world_size() const { return world ? world->size() : 1; }
  int tp_rank() const { return grid ? grid->tp_rank() : 0; }
  int tp_size() const { return grid ? grid->tp_size() : 1; }
  int cp_size() const { return cp ? cp->size() : 1; }
  bool lead() const { return world_rank() == 0; }  // prints, logs and writes the shared files
  // Which slice of the global batch the rank takes (its data-parallel rank), of how many: a
  // context-parallel group's ranks take the same one.
  int batch_slot() const { return grid ? grid->dp_rank() / cp_size() : 0; }
  int batch_slots() const { return grid ? grid->dp_size() / cp_size() : 1; }
  // The first replica's TP (or CP) ranks: they hold the model together, so they evaluate, assemble
  // the whole weights and sample together (collectives of their TP or CP group).
  bool first_replica() const { return batch_slot() == 0; }
  // The ranks that run an evaluation or assemble the whole weights together: the first replica's, or
  // under ZeRO 3 every rank (each block is gathered from all of them).
  bool holds_model_together() const { return zero3 != nullptr || first_replica(); }
  int zero() const { return zero3 ? 3 : dp ? dp->zero() : 0; }

  // The optimizer file this rank writes into a checkpoint and reads on resume; "" when it writes none.
  // Under ZeRO 3 it holds the rank's shard of the master weights too, its moments beside it
  // (ShardedDataParallel::save_shard: FILE and FILE.optimizer; optimizer_files_of lists both); with
  // LoRA the adapters' state, the same on every rank, is rank 0's optimizer.safetensors.
  std::string optimizer_file() const { return optimizer_file_of(world_rank()); }
  std::vector<std::string> optimizer_files_of(int w) const;
  // The optimizer file world rank w writes ("" for none): its ZeRO shard, its TP shard's moments
  // (replica 0's TP ranks), or the whole state (rank 0).
  std::string optimizer_file_of(int w) const;
  // Which file this rank reads on resume (zero 0 with TP: its TP shard's, whoever wrote it).
  std::string optimizer_file_to_read() const;
};

// A whole model's master weights in host memory: the state's own set where it lives there already
// (the CPU, an offloaded optimizer: no copy of an 8B model's 32 GB), else a host copy.
class HostWeights {
 public:
  HostWeights() = default;
  static HostWeights borrowed(const ParamSet& own) {
    HostWeights w;
    w.set_ = &own;
    return w;
  }
  static HostWeights owned(ParamSet&& copy) {
    HostWeights w;
    w.copy_.emplace(std::move(copy));
    w.set_ = &*w.copy_;
    return w;
  }
  HostWeights(HostWeights&& other) noexcept
      : copy_(std::move(other.copy_)), set_(copy_ ? &*copy_ : other.set_) {}
  HostWeights& operator=(HostWeights&&) = delete;
  explicit operator bool() const { return set_ != nullptr; }
  const ParamSet& operator*() const { return *set_; }

 private:
  std::optional<ParamSet> copy_;
  const ParamSet* set_ = nullptr;
};

// The whole model's master weights on the host: with tensor parallelism assembled from the TP group's
// shards (a collective of the first replica's TP ranks; the other replicas get nothing), else rank
// 0's own (the other ranks get nothing).
HostWeights whole_master(TrainingState& state, const LlamaConfig& full_config, const RankGroups& g);

// Under ZeRO 3, the whole model's master weights gathered from every rank's shard, unit by unit, into
// rank 0's host memory (a collective of all ranks; the other ranks get nothing). For a sample; a
// checkpoint assembles the whole weights from the shard files on rank 0.
// Under LoRA the adapters (replicated): rank 0's own, no collective.
HostWeights whole_master(ShardedDataParallel& zero3, const RankGroups& g);
// Under ZeRO 3 with LoRA, the whole frozen base gathered from the ranks' shards, unit by unit, into
// rank 0's host memory (a collective of all ranks), for a sample.
std::optional<ParamSet> whole_base(ShardedDataParallel& zero3, const RankGroups& g);

// Under LoRA, the whole frozen base on the host (for a sample): with tensor parallelism gathered from
// the TP group's shards (a collective of the first replica's TP ranks), else rank 0's own.
std::optional<ParamSet> whole_base(TrainingState& state, const LlamaConfig& full_config, const RankGroups& g);

// Where the loop starts: step 0, or the resumed checkpoint's step and token count.
struct ResumePoint {
  int64_t step = 0;
  int64_t tokens_seen = 0;
};

// Resume from the run directory's latest complete checkpoint (weights, optimizer moments, step,
// sampler position, metrics truncated after it), or load the model.source checkpoint, or initialise.
// In a parallel run every rank reads the same checkpoint (the whole weights, state.json), takes its
// TP shard of the weights, and reads its own optimizer file; rank 0 alone truncates the metrics.
// A random initialisation with tensor parallelism draws the whole model and shards it, so the run
// starts from the weights one process starts from.
// Under LoRA the base always comes from model.source (a checkpoint, a GGUF file, or the seeded random
// initialisation of a preset or config), frozen; the adapters from the checkpoint (PEFT files), else
// model.adapter, else PEFT's initialisation from lora.seed.
ResumePoint resume_or_initialise(const RunConfig& rc, const LlamaConfig& full_config, bool resume,
                                 RunDirectory& run_dir, const std::string& run_path, const std::string& metrics_path,
                                 TrainingState& state, WindowSampler& sampler, const RankGroups& g, std::ostream& out);
// The same under ZeRO 3: the whole model (model.source or the seeded initialisation, drawn as one
// process draws it) loaded by every rank and cut to its shard; or on resume each rank's own shard
// file (its master weights and moments, exact) and the checkpoint's step and sampler.
ResumePoint resume_or_initialise(const RunConfig& rc, const LlamaConfig& full_config, bool resume,
                                 RunDirectory& run_dir, const std::string& run_path, const std::string& metrics_path,
                                 ShardedDataParallel& zero3, WindowSampler& sampler, const RankGroups& g,
                                 std::ostream& out);

}  // namespace cw
