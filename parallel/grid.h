// The ranks of a job as a grid of dp data-parallel replicas x tp tensor-parallel ranks, and the two
// groups every rank belongs to.
//
// World rank w sits at DP rank d = w / tp and TP rank t = w % tp: the TP ranks of one replica are
// adjacent (Megatron's order), so with tp <= GPUs per node a TP group, which communicates inside
// every block, stays within a node, and only the DP reduction, once per optimizer step, crosses
// nodes.
//   TP group of w: the tp ranks of replica d (color d, ranked by t): they hold the shards of one model
//   DP group of w: the dp ranks that hold TP shard t (color t, ranked by d): they reduce its gradients
// Both are Communicator::split of the world, so every rank of the world must build its grid at the
// same point of its sequence of collectives. Tested in tests/parallel/test_tensor_parallel.cpp and
// through `chunkwise gradcheck --dp N --tp M`.
#pragma once

#include "parallel/comm.h"

#include <cstdint>
#include <memory>

namespace cw {

class ParallelGrid {
 public:
  // Throws a one-line error naming parallel.dp and parallel.tp when the world is not dp x tp ranks.
  ParallelGrid(Communicator& world, int64_t dp, int64_t tp);

  Communicator& world() const { return world_; }
  Communicator& tp() const { return *tp_; }
  Communicator& dp() const { return *dp_; }
  int dp_rank() const { return dp_->rank(); }
  int tp_rank() const { return tp_->rank(); }
  int dp_size() const { return dp_->size(); }
  int tp_size() const { return tp_->size(); }

  // The world rank at (d, t).
  static int world_rank(int d, int t, int tp) { return d * tp + t; }

 private:
  Communicator& world_;
  std::unique_ptr<Communicator> tp_, dp_;
};

}  // namespace cw
