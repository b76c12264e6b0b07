// Where a model whose parameters are sharded over ranks (ZeRO 3, parallel/zero3.h) finds them as its
// chunks run, and where its backward sends their gradients.
//
// Such a model (LlamaModel built with a ParameterShards) holds no parameters of its own. A chunk's
// forward asks for the tensors outside the blocks (embedding, final norm, LM head: one unit) when it
// starts and for block l as it reaches it, telling which block it asks for next (so that block's
// gather can be in flight behind block l's compute); the backward asks for each block again and for
// a zeroed gradient buffer of it, and hands the buffer back once the block's backward has added into
// it (the owner reduces it over the ranks then, each keeping its own shard's sum).
//   weights   gathered into a small pool of buffers owned by the source: block views are valid until
//             two other blocks are asked for; the outside unit's until release_outside()
//   gradients every parameter's gradient is ADDED by the ops, so each buffer starts at zero; a
//             buffer is the owner's again once handed back (block_grads_done / outside_grads_done)
// Implemented by parallel/zero3.h (ShardedParameters); the model side is model/llama.cpp.
#pragma once

#include "model/params.h"

namespace cw {

class ParameterShards {
 public:
  virtual ~ParameterShards() = default;

  // The embedding, final norm and LM head (the embedding itself when tied); `layers` is empty.
  virtual ModelWeights outside() = 0;
  // The outside unit's buffer may go back to the pool (a chunk's pass is over).
  virtual void release_outside() = 0;
  // Block l's weights in the compute dtype.
  virtual LayerWeights block(int l) = 0;
  // Block l will be asked for next: its gather may start now (nothing for l outside [0, L)).
  virtual void prefetch(int l) = 0;

  // Zeroed gradient buffers of the outside unit and of block l, in the gradient dtype.
  virtual ModelWeights outside_grads() = 0;
  virtual LayerWeights block_grads(int l) = 0;
  // The backward has finished adding into them for this chunk.
  virtual void outside_grads_done() = 0;
  virtual void block_grads_done(int l) = 0;
};

}  // namespace cw
