// The seams of a decoder block: where LoRA adapters and tensor parallelism join the math of
// model/layer.h (context parallelism's two exchanges are named steps of layer.cpp itself, around
// attention; BlockCall holds the rank's tokens and heads for them). block_forward / block_backward (model/layer.cpp) state the math; they reach the
// block's linears and the other ranks only through what is declared here. With one process (no
// tensor-parallel group) and no adapters every seam is the plain step: a linear is y = x Wᵀ, the
// normed input the linears read is rmsnorm's output itself, a partial sum is the whole sum.
// Internal to model/layer.cpp; tested through it (tests/model, tests/parallel/test_tensor_parallel.cpp,
// tests/tools/test_gradcheck.cpp's LoRA checks).
#pragma once

#include "model/layer.h"

#include <optional>

namespace cw {

// One call of block_forward or block_backward: what its steps share.
struct BlockCall {
  BlockCall(const BlockContext& ctx, const LayerWeights& w, KVStore& kv, int layer, DType dtype);

  const BlockContext& ctx;
  const LayerWeights& w;
  KVStore& kv;
  const int layer;
  const LlamaConfig& cf;
  TensorParallelGroup* const tp;  // null: one process
  Arena& scratch;
  const DType dt;                 // the compute dtype
  ContextParallelGroup* const cp;  // null: the rank holds every token of the chunk
  const int64_t B, c, p;          // sequences, tokens each, the first token's position (the chunk's)
  const int64_t ct, pt;           // the tokens of each sequence in this rank's rows, the first one's
                                  // position: c and p, or under context parallelism c/P and p + r c/P
  const int64_t N;                // rows N = B*ct
  const int64_t R;                // residual-stream rows of this rank: N, or N/P with sequence parallelism
  const int64_t C, F, H, Hkv, D;  // model width, FFN width, heads, K/V heads, head dim (the rank's)
  const int64_t Ha, Hkva;         // the heads and K/V heads attention runs on: H, Hkv, or under
                                  // context parallelism the rank's (cp_attention_config)
};

// ---- The block's linears: base weight, and LoRA's adapter where the layer has one ----

// y = x Wᵀ for the block's linear `linear` (wq ... w_down), plus its adapter's term where b.w carries
// one (engine/ops/lora_linear.h: the base is then frozen), plus its bias where it has one (Qwen2's
// q, k, v; a frozen base's bias is frozen with it). row0: the call's first row within the
// chunk (a tiled MLP's shard), which keys the adapter's dropout mask.
void block_linear_forward(const Tensor& y, const Tensor& x, ParamRole linear, const BlockCall& b, int64_t row0 = 0);
// Its backward: d_x by `mode`; the base weight's and bias's gradients (trainable) or the adapter's
// (an adapted linear is frozen) accumulate into g; an undefined gradient is skipped.
void block_linear_backward(const Tensor& d_x, const LayerWeights& g, const Tensor& d_y, const Tensor& x,
                           ParamRole linear, GradMode mode, const BlockCall& b, int64_t row0 = 0);

// ---- Tensor parallelism: the two seams of each half-block (model/shard.h) ----
// In:  the column-parallel linears (q, k, v; gate, up) read their normed input h of all N rows.
// Out: the row-parallel linear (o; down) leaves this rank's partial sum over its heads or FFN
//      columns; the residual stream takes the rank's rows of the sum over the ranks.
// A gathered or partial [N, C] tensor may live in a slot of the group's reusable buffer: each object
// below holds its slot until released or destroyed, so none outlives its use.

// In, forward: h = rmsnorm(x; weight) of the rank's rows into `kept` (with its statistics), and h of
// all rows as the linears read it: `kept` itself (one process; TP: copy_to_tp is the identity), or
// all-gathered (gather_from_sp) into `kept` [N, C], or with regather (`kept` the rank's rows [R, C])
// into the buffer.
class NormedInput {
 public:
  NormedInput(const Tensor& kept, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight,
              const BlockCall& b);
  const Tensor& all() const { return all_; }  // [N, C]
  void release() { lease_.reset(); }          // the gathered rows are read no more

 private:
  std::optional<TpLease> lease_;
  Tensor all_;
};

// In, backward: the kept h as the linears' backward reads it (all rows: all-gathered again where only
// the rank's rows were kept), and d(h) of all rows [N, C], this rank's partial sum over its heads or
// FFN columns, which the linears' backward writes; d_rows() sums it over the ranks into the rank's
// rows (copy_to_tp's backward: the all-reduce, in place; gather_from_sp's: the reduce-scatter).
class NormedInputGrad {
 public:
  // kept undefined: h is not read (a frozen MLP's backward needs only its weights and products).
  NormedInputGrad(const Tensor& kept, const BlockCall& b);
  const Tensor& input() const { return input_; }  // h [N, C]
  const Tensor& d_all() const { return d_all_; }  // d(h) [N, C], this rank's share
  void release_input() { input_lease_.reset(); }
  Tensor d_rows();                                // d(h) of the rank's rows [R, C]

 private:
  const BlockCall& b_;
  std::optional<TpLease> input_lease_, d_lease_;
  Tensor input_, d_all_;
};

// Out, forward: the [N, C] output of a row-parallel linear, this rank's partial sum (in scratch, or
// under sequence parallelism in the buffer until scattered), and the rank's rows of the sum
// (reduce_from_tp: the all-reduce, in place; scatter_to_sp: the reduce-scatter).
class PartialOutput {
 public:
  explicit PartialOutput(const BlockCall& b);
  const Tensor& all() const { return all_; }  // [N, C]
  Tensor sum_rows();                           // [R, C]

 private:
  const BlockCall& b_;
  std::optional<TpLease> lease_;
  Tensor all_;
};

// Out, backward: the gradient of a row-parallel linear's [N, C] output from d_rows, the rank's rows'
// (reduce_from_tp's backward: d_rows itself; scatter_to_sp's: the all-gather, into the buffer).
class OutputGrad {
 public:
  OutputGrad(const Tensor& d_rows, const BlockCall& b);
  const Tensor& all() const { return all_; }  // [N, C]
  void release() { lease_.reset(); }

 private:
  std::optional<TpLease> lease_;
  Tensor all_;
};

}  // namespace cw
