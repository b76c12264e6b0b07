// The blocks' compute weights rounded from the master weights as each block runs (schedule.cast_layers).
//
// A bf16 run keeps, beside the f32 master weights, a compute copy of every weight (optim/training.h).
// With cast_layers the blocks' part of that copy is not kept: when a chunk's forward or backward
// reaches block l, the master's block l is rounded to the compute dtype (to nearest even, as the
// resident copy is) into one of kSlots device buffers of one block's size, the way autocast rounds
// each weight before its op. The embedding, the final norm and an untied head stay resident
// (LlamaModel keeps them in its parameter set).
//   memory: kSlots x one block's weights instead of L of them (Llama-3.2-1B: 2 x 116 MiB instead of
//           1.81 GiB; Llama-3.1-8B: 2 x 416 MiB instead of 13 GiB)
//   time:   a cast reads 4 and writes 2 bytes a weight (365 MB for a 1B block), on the compute stream
//           (a second stream hides nothing: the cast takes SMs from the block's kernels); a block found
//           in a slot is not cast again, so a chunk's backward starts from the blocks its forward
//           ended with
// The weights a block computes with are the resident copy's, bit for bit, so every result is too.
// Ordering: a cast runs on the compute stream, after the ops queued before it (which may still read
// the slot it overwrites) and before the block's ops that read it.
// The master's blocks must each be contiguous in its flat vector (the parameter table lists a
// block's tensors together, model/params.h) and of one size.
#pragma once

#include "engine/memory.h"
#include "model/params.h"

#include <cstdint>
#include <vector>

namespace cw {

class LayerCast {
 public:
  static constexpr int kSlots = 2;

  // master: every parameter (the model's table) in the master dtype on the device the blocks run on;
  // it must outlive this. compute: the dtype the blocks run in.
  LayerCast(const ParamSet& master, DType compute);

  // Block l's weights in the compute dtype: views of the slot that holds them, cast from the master
  // into the least recently used slot unless one does. Valid until kSlots other blocks are asked for.
  LayerWeights layer(int l);
  // The master changed (an optimizer step, a load): no slot holds a current block.
  void invalidate();

  size_t device_bytes() const { return slot_bytes_ * slots_.size(); }
  static size_t slot_bytes_for(const LlamaConfig& config, DType compute);  // one block's weights
  int64_t casts() const { return casts_; }  // blocks cast since construction

 private:
  const ParamSet* master_;
  DType dtype_;
  std::vector<ParamSpec> block_;        // block 0's specs: every block's layout
  std::vector<int64_t> start_;          // block l's first element in the master's flat vector
  int64_t block_numel_ = 0;
  size_t slot_bytes_ = 0;
  std::vector<Buffer> slots_;
  std::vector<std::vector<Tensor>> views_;  // per slot: block_'s tensors in it
  std::vector<int> held_;               // per slot: the block it holds, -1 none
  std::vector<uint64_t> used_;          // per slot: when it was last asked for
  uint64_t clock_ = 0;
  int64_t casts_ = 0;
};

}  // namespace cw
