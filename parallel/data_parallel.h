// Data parallelism: n ranks, each with a whole copy of the model and its own slice of every
// micro-batch, behave as one process on the global batch (the ranks' sequences concatenated).
//
// One optimizer step (compute_gradients, then clip_gradients and optimizer_step):
//   1. Normaliser. The loss is a mean over supervised tokens, so every rank divides by the GLOBAL
//      count N = sum over ranks and micro-batches of the labels != -100 (one all-reduce of a
//      scalar). Rank r's gradient is then sum_{its tokens} dl/dθ / N, and the SUM over ranks is
//      exactly one process's gradient on the global batch; nothing is divided after the reduction.
//   2. Backwards. Every micro-batch runs through the schedule with that normaliser, accumulating
//      into the rank's gradient buffer; nothing is communicated per chunk or per micro-batch.
//   3. Reduction, once. The flat gradient vector (table order, ParamSet::flat) is cut into buckets
//      of parallel.bucket_mb from its end. The last micro-batch's step carries the schedule's
//      grads_final hook (optim/schedule.h): its last chunk backward reports, layer by layer, the
//      offset from which the gradient is complete (the backward runs the table backwards), and each
//      bucket's all-reduce is launched as soon as that offset passes the bucket's start, while the
//      backward of the layers below still runs. Then every pending reduction is waited for.
//      With NCCL the launch is a call on the host after the layer's kernels are queued: the
//      backend orders the collective after the compute stream's work (an event the comm stream
//      waits on), so it overlaps the following layers' backward; wait() makes the compute stream
//      wait for it (parallel/comm.h). On the threads backend the structure is the same and the
//      overlap is not measurable.
//   4. Loss. Each rank's reported loss is its tokens' share of the global mean; their sum (one
//      all-reduce) is the global mean loss, the same on every rank.
//
// ZeRO (parallel.zero). The flat vector is split into contiguous shards: with S = floor(P / n),
// rank r owns [r S, (r+1) S) and the last rank also the remainder [n S, P) (fewer than n
// elements). The collectives run on the first n S elements, where every shard has the same length
// S, and the remainder goes through a small all-reduce (gradients) or broadcast (weights) of the
// last rank; so no padded copy of any P-element buffer is needed.
//   zero 1  gradients all-reduced in buckets as above; AdamW moments only for the rank's shard
//           (optim/adamw.h AdamWShard); the rank updates its shard of the master weights; the
//           master weights are all-gathered (in place), then the compute copy is made locally from
//           them (bf16 rounding, the same bits on every rank).
//   zero 2  the reduced gradient is sharded too: the buckets are also cut at the shard boundaries,
//           so each lies in one rank's shard, and each is reduced to that rank only (Communicator::
//           reduce, in place), launched from inside the last backward like zero 0/1's all-reduces:
//           together they are the reduce-scatter of the whole vector, overlapped with the backward,
//           and the shards stay contiguous (AdamWShard, the checkpoints' optimizer files). A rank's
//           buffer outside its shard is left unreduced. The local accumulation buffer stays whole
//           (the chunk schedules add into it across every chunk of the step); what is sharded is the
//           reduced gradient, which the norm, clipping and update read only on the shard (the norm's
//           square sums are all-reduced).
// With tensor parallelism (a DP x TP grid, parallel/grid.h) `comm` is the rank's DP group and the
// state is its TP shard: the DP ranks that hold the same shard reduce its gradient as above (the
// flat vector, buckets and ZeRO shards are the TP shard's). After the reduction the replicated
// parameters' gradients are summed over the TP group (parallel/tensor_parallel.h:
// reduce_replicated_gradients; only with sequence parallelism, and under ZeRO 2 only the rank's
// shard of them). The gradient norm adds each TP rank's split tensors' squares over the TP group and
// counts the replicated ones once; the loss is already whole on every TP rank.
// With context parallelism (parallel.cp > 1; parallel/context_parallel.h) `comm` is the whole world
// of dp x cp ranks, the cp ranks of a data-parallel rank adjacent and sharing its micro-batches, each
// computing the share of its tokens (c/cp of every chunk) in the gradient and the loss: the reduction
// over all of them sums the shares as above, and the labels of a shared micro-batch are counted once,
// by the first of its cp ranks. ZeRO's shards are then the world's.
// Every rank's sums are taken in rank order by the threads backend, so all-reduce and reduce
// give the same bits, and zero 1 / zero 2 give exactly the parameters of zero 0
// (without clipping; with it, zero 2's norm sums the shards' partial sums, equal to rounding).
//
// Every rank must call these in the same order with the same micro-batch count: they communicate.
#pragma once

#include "optim/adamw.h"
#include "optim/options.h"
#include "optim/schedule.h"
#include "optim/training.h"
#include "parallel/comm.h"
#include "parallel/tensor_parallel.h"

#include <memory>
#include <optional>
#include <vector>

namespace cw {

struct DataParallelStep {
  double loss = 0;           // the global batch's mean loss (the same on every rank)
  int64_t supervised = 0;    // the global batch's supervised labels (the normaliser)
  StepStats stats;           // this rank's last micro-batch's
  int64_t buckets = 0;       // gradient reductions launched (all-reduces; zero 2: reduces to the shard's owner)
  int64_t buckets_in_backward = 0;  // of them, launched from inside the last backward (overlapped)
};

class DataParallel {
 public:
  // state: this rank's training state, built with full_optimizer = (options.zero == 0); comm: the
  // ranks that hold the same model (or TP shard); tp: the rank's tensor-parallel group, which the
  // state's model was built with (null without tensor parallelism).
  DataParallel(Communicator& comm, TrainingState& state, const ParallelOptions& options, TensorParallel* tp = nullptr);

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  int zero() const { return zero_; }
  // This rank's shard [begin, end) of the flat parameter vector (ZeRO), and any rank's.
  int64_t shard_begin(int rank) const;
  int64_t shard_end(int rank) const;

  // Sums host values over the ranks in place (rank order on the threads backend: the same bits on
  // every rank). Goes through the communicator's device.
  void sum_over_ranks(std::vector<double>& values);

  // Steps 1-4 of the header for this rank's micro-batches (its own slice of the global batch);
  // micro-batch m runs as schedule step step_index + m, as a single process numbers them.
  DataParallelStep compute_gradients(Schedule& schedule, const std::vector<Batch>& micro, uint64_t step_index);

  // The global L2 norm of the reduced gradient (the same on every rank of the grid).
  double gradient_norm();
  // Scales the reduced gradient by max_norm / norm when norm > max_norm (max_norm <= 0: never);
  // returns the norm before clipping. A non-finite norm is returned without scaling.
  double clip_gradients(double max_norm);
  // The AdamW step: zero 0 the state's own AdamW; zero 1/2 the shard's, then the all-gather.
  void optimizer_step(double lr);

  // ZeRO: this rank's optimizer shard (null for zero 0: the state's AdamW is whole).
  const AdamWShard* optimizer_shard() const { return optimizer_shard_ ? &*optimizer_shard_ : nullptr; }
  AdamWShard* optimizer_shard() { return optimizer_shard_ ? &*optimizer_shard_ : nullptr; }
  // Bytes of optimizer state this rank holds.
  size_t optimizer_bytes() const;

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;  // in the flat gradient vector
    int owner = -1;              // zero 2: the rank whose shard holds it (reduced to it); else all-reduced
  };
  void launch_ready(int64_t from);  // every not yet launched bucket starting at or after `from`
  void finish_reduction();
  // The first n S elements (where every shard has length S) and the remainder of a flat set.
  Tensor even_part(const ParamSet& set) const;
  Tensor remainder(const ParamSet& set) const;
  // This rank's shard of a flat set (with the remainder for the last rank: contiguous).
  Tensor own_shard(const ParamSet& set) const;

  Communicator& comm_;
  TrainingState& state_;
  TensorParallel* tp_;
  const int zero_;
  const int cp_;  // parallel.cp: the adjacent ranks that share a micro-batch (its labels counted once)
  const int64_t numel_, shard_len_;  // P, S = floor(P / n)
  std::vector<Bucket> buckets_;  // in launch order: from the end of the vector to its start
  size_t next_bucket_ = 0;
  bool in_backward_ = false;
  int64_t launched_in_backward_ = 0;
  std::vector<std::unique_ptr<CommWork>> pending_;
  std::optional<AdamWShard> optimizer_shard_;
};

}  // namespace cw
