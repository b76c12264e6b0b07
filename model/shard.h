// Tensor parallelism (Megatron style) as the model sees it: which part of Llama a rank holds, and the
// seams where its blocks exchange activations with the other ranks. parallel/tensor_parallel.h
// implements the seams with a communicator; the model never talks to other ranks itself (the arrows
// of the code point down: parallel/ -> model/).
//
// A group of P ranks, rank r. Linear weights are HF's [out, in] (y = x Wᵀ):
//   q/k/v, gate/up   column-parallel: rank r holds rows [r*out/P, (r+1)*out/P), i.e. the query heads
//                    [r*H/P, (r+1)*H/P), the K/V heads [r*Hkv/P, ...) and the FFN columns [r*F/P, ...)
//   o, down          row-parallel: rank r holds the matching columns [r*in/P, (r+1)*in/P)
//   embedding, the norms, the LM head   replicated (every rank holds all of them)
// Query head h uses K/V head h / (H/Hkv), so a rank's query heads use only its own K/V heads: the
// rank's part of a block is a Llama block with H/P heads, Hkv/P K/V heads and FFN width F/P
// (tp_shard_config), whose attention, RoPE and SwiGLU need nothing from other ranks, joined to the
// others at two seams per half-block:
//   in:  the column-parallel linears read the normed residual stream of ALL tokens;
//   out: the row-parallel linear leaves a partial sum over the rank's heads (or FFN columns), which
//        the ranks add up.
// Without sequence parallelism the residual stream [N, C] is replicated:
//   in  = copy_to_tp     forward identity          backward all-reduce (sum of the ranks' dX)
//   out = reduce_from_tp forward all-reduce        backward identity
// With sequence parallelism the residual stream, the norms and the residual adds work on the rank's
// rows only, [N/P, C] (rows n = b*c + t split into P contiguous blocks, rank r's the r-th):
//   in  = gather_from_sp forward all-gather rows   backward reduce-scatter rows
//   out = scatter_to_sp  forward reduce-scatter    backward all-gather rows
// The seams hold the same math: the all-gather followed by the reduce-scatter is the all-reduce
// split in two, with the row-wise norm/residual work between them done once per row instead of P
// times, and the activations kept for it 1/P the size.
//
// Gathered and partial [N, C] activations live in one reusable buffer per rank (acquire / release
// below), so none of them outlives the seam that needs it. With `regather`, the gathered input of
// the column-parallel linears is not kept for the backward either: the block keeps the rank's rows
// [N/P, C] and the backward all-gathers them again into the buffer (memory for one all-gather).
#pragma once

#include "engine/tensor.h"
#include "model/config.h"

#include <cstddef>
#include <initializer_list>

namespace cw {

// The config of rank r's part of a block: H/P heads, Hkv/P K/V heads, F/P FFN width; the rest as the
// model's. Throws naming the key that P does not divide (and parallel.tp).
LlamaConfig tp_shard_config(const LlamaConfig& config, int64_t tp);

// The reusable buffer's slots: three [N, C] tensors that a block needs at the same time at most
// (the backward of a tiled MLP holds a gathered input, a gathered gradient and a partial sum).
enum class TpSlot {
  gathered_input,  // the all-gathered normed rows the column-parallel linears read (regathered in the backward)
  gathered_grad,   // the all-gathered residual-stream gradient the row-parallel linears' backward reads
  partial_sum,     // a rank's partial sum before the reduce-scatter (forward: o or down output; backward: dX)
};

class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual bool sequence_parallel() const = 0;
  virtual bool regather() const = 0;  // only with sequence_parallel

  // The paired ops (parallel/tensor_parallel.h states each one's math and adjoint). Tensors are
  // contiguous with rows along dimension 0; "rows" below: rank-local [n, ...], all ranks' [P*n, ...].
  virtual void copy_to_tp_backward(const Tensor& d_x) = 0;                   // all-reduce, in place
  virtual void reduce_from_tp_forward(const Tensor& x) = 0;                  // all-reduce, in place
  virtual void gather_from_sp_forward(const Tensor& all, const Tensor& rows) = 0;       // all-gather
  virtual void gather_from_sp_backward(const Tensor& d_rows, const Tensor& d_all) = 0;  // reduce-scatter
  virtual void scatter_to_sp_forward(const Tensor& rows, const Tensor& all) = 0;        // reduce-scatter
  virtual void scatter_to_sp_backward(const Tensor& d_all, const Tensor& d_rows) = 0;   // all-gather

  // A view of `slot` shaped [shape] in dtype, valid until release(slot); a slot is lent to one user
  // at a time (acquiring it twice is an error, so no two activations share it by accident).
  virtual Tensor acquire(TpSlot slot, DType dtype, std::initializer_list<int64_t> shape) = 0;
  virtual void release(TpSlot slot) = 0;
};

// A slot of the reusable buffer for one scope.
class TpLease {
 public:
  TpLease(TensorParallelGroup& group, TpSlot slot, DType dtype, std::initializer_list<int64_t> shape)
      : group_(&group), slot_(slot), tensor(group.acquire(slot, dtype, shape)) {}
  ~TpLease() { group_->release(slot_); }
  TpLease(const TpLease&) = delete;
  TpLease& operator=(const TpLease&) = delete;

 private:
  TensorParallelGroup* group_;
  TpSlot slot_;

 public:
  const Tensor tensor;
};

// Rows a rank holds of a chunk's N = B*c rows: N/P with sequence parallelism, else N. Throws when
// sequence parallelism gets a chunk whose N is not a multiple of P (naming the options to change).
int64_t tp_rows(const TensorParallelGroup* tp, int64_t N);
// The rank's rows of a tensor of all N rows with sequence parallelism (a view); else the tensor itself.
Tensor tp_local_rows(const TensorParallelGroup* tp, const Tensor& all);
// Whether a block keeps only the rank's rows of h1, h2 and all-gathers them again in the backward.
inline bool tp_regathers(const TensorParallelGroup* tp) { return tp && tp->sequence_parallel() && tp->regather(); }

}  // namespace cw
