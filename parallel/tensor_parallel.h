// Tensor parallelism (Megatron style) over a Communicator: the paired communication ops, the
// reusable activation buffer, a rank's TensorParallelGroup (model/shard.h), and moving parameters
// and gradients between a full model and its shards.
//
// The paired ops. Each is a linear map of the ranks' tensors together with its adjoint, the map the
// backward applies to gradients. Rows are along dimension 0; "rows of r" is rank r's block
// [r*n, (r+1)*n) of a tensor of all P*n rows. x_r is rank r's input, y_r its output.
//   copy_to_tp      forward  y_r = x                    (x the same on every rank: identity)
//                   backward d_x = sum_s d_y_s          (all-reduce: every rank's linears read x)
//   reduce_from_tp  forward  y = sum_s x_s              (all-reduce of partial sums)
//                   backward d_x_r = d_y                (identity: each partial enters with weight 1)
//   gather_from_sp  forward  y = [x_0; x_1; ...; x_P-1] (all-gather of rows)
//                   backward d_x_r = rows of r of sum_s d_y_s   (reduce-scatter)
//   scatter_to_sp   forward  y_r = rows of r of sum_s x_s       (reduce-scatter)
//                   backward d_x = [d_y_0; ...; d_y_P-1]        (all-gather of rows)
// The backward of each is the adjoint of its forward over the whole group: sum_r <f(x)_r, y_r> =
// sum_r <x_r, f*(y)_r> (tests/parallel/test_tensor_parallel.cpp checks it for every pair). The
// identity halves need no call; the other six are below, each one collective.
//
// The buffer: a rank's gathered and partial-sum [N, C] activations (model/shard.h's three slots) live
// in one ActivationBuffer instead of a fresh allocation per call. A slot grows to the largest request
// and is reused by every later one; only one user holds a slot at a time. It counts what it replaces:
// the bytes and number of the requests (what per-call allocations would have allocated in all) against
// its capacity (its high-water mark).
//
// Parameters: q/k/v/gate/up are split along dimension 0 (rows: heads, FFN columns), o/down along
// dimension 1, in P equal contiguous blocks, and q/k/v's biases (Qwen2) with their rows; embedding,
// norms and LM head are replicated. The per-head norms' weights (Qwen3's q_norm, k_norm) are
// replicated, and each rank's gradient is its heads' part of the whole (tp_partial_gradient).
// Gradients of replicated parameters: without sequence parallelism every rank computes them from
// the same replicated values, so they are whole and identical on every rank. With it each rank's
// norms, embedding and LM head saw only its rows, so each rank holds its rows' share and
// reduce_replicated_gradients sums them (once per optimizer step, like the data-parallel reduction).
#pragma once

#include "engine/memory.h"
#include "model/params.h"
#include "model/shard.h"
#include "parallel/comm.h"

#include <array>
#include <cstdint>

namespace cw {

// ---- the paired ops (the identity halves need no call) ----
void copy_to_tp_backward(Communicator& comm, const Tensor& d_x);                          // all-reduce, in place
void reduce_from_tp_forward(Communicator& comm, const Tensor& x);                         // all-reduce, in place
void gather_from_sp_forward(Communicator& comm, const Tensor& all, const Tensor& rows);   // all-gather rows
void gather_from_sp_backward(Communicator& comm, const Tensor& d_rows, const Tensor& d_all);  // reduce-scatter
void scatter_to_sp_forward(Communicator& comm, const Tensor& rows, const Tensor& all);    // reduce-scatter
void scatter_to_sp_backward(Communicator& comm, const Tensor& d_all, const Tensor& d_rows);   // all-gather rows

// ---- the reusable buffer ----
class ActivationBuffer {
 public:
  explicit ActivationBuffer(Device device) : device_(device) {}
  // A packed view of the slot's memory; grows the slot when it is smaller (nothing lives in a free
  // slot, so growing loses nothing). Throws when the slot is lent already.
  Tensor acquire(TpSlot slot, DType dtype, std::initializer_list<int64_t> shape);
  void release(TpSlot slot);

  size_t capacity_bytes() const;   // all slots: the buffer's high-water mark
  size_t requested_bytes() const { return requested_bytes_; }  // every acquire's bytes, summed
  int64_t requests() const { return requests_; }
  size_t largest_request() const { return largest_request_; }

 private:
  static constexpr size_t kSlots = 3;
  Device device_;
  std::array<Buffer, kSlots> slots_;
  std::array<bool, kSlots> lent_{};
  size_t requested_bytes_ = 0, largest_request_ = 0;
  int64_t requests_ = 0;
};

struct TensorParallelOptions {
  bool sequence_parallel = false;  // norms, residuals, embedding and loss on the rank's rows
  bool regather = false;           // (with sequence_parallel) the backward all-gathers h1/h2 again
};

// A rank's group: the communicator of its TP ranks, the options, the buffer. Given to LlamaModel.
class TensorParallel final : public TensorParallelGroup {
 public:
  // Throws when regather is asked without sequence parallelism (there is nothing gathered to redo).
  TensorParallel(Communicator& comm, const TensorParallelOptions& options);

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  bool sequence_parallel() const override { return options_.sequence_parallel; }
  bool regather() const override { return options_.regather; }
  Communicator& communicator() const { return comm_; }
  const ActivationBuffer& buffer() const { return buffer_; }

  void copy_to_tp_backward(const Tensor& d_x) override { cw::copy_to_tp_backward(comm_, d_x); }
  void reduce_from_tp_forward(const Tensor& x) override { cw::reduce_from_tp_forward(comm_, x); }
  void gather_from_sp_forward(const Tensor& all, const Tensor& rows) override {
    cw::gather_from_sp_forward(comm_, all, rows);
  }
  void gather_from_sp_backward(const Tensor& d_rows, const Tensor& d_all) override {
    cw::gather_from_sp_backward(comm_, d_rows, d_all);
  }
  void scatter_to_sp_forward(const Tensor& rows, const Tensor& all) override {
    cw::scatter_to_sp_forward(comm_, rows, all);
  }
  void scatter_to_sp_backward(const Tensor& d_all, const Tensor& d_rows) override {
    cw::scatter_to_sp_backward(comm_, d_all, d_rows);
  }
  Tensor acquire(TpSlot slot, DType dtype, std::initializer_list<int64_t> shape) override {
    return buffer_.acquire(slot, dtype, shape);
  }
  void release(TpSlot slot) override { buffer_.release(slot); }

 private:
  Communicator& comm_;
  TensorParallelOptions options_;
  ActivationBuffer buffer_;
};

// ---- parameters and gradients between the full model and its shards ----
// The dimension TP splits a parameter along: 0 (column-parallel q, k, v, gate, up), 1 (row-parallel
// o, down), -1 (replicated). A LoRA adapter follows its linear (y = x Wᵀ + s x Aᵀ Bᵀ): a
// column-parallel linear's B [out, r] is split along out and its A replicated; a row-parallel
// linear's A [r, in] along in and its B replicated.
int tp_split_dim(const ParamSpec& spec);
// A replicated tensor of which each rank's gradient is a part of the whole: a column-parallel
// adapter's A (dA sums over the output columns each rank holds), a row-parallel adapter's B (the
// adapter's rank-r activation is a sum over the ranks' input slices, as the linear's output is), and
// the per-head norms q_norm, k_norm (each rank norms only its own heads).
bool tp_partial_gradient(const ParamSpec& spec);
// Rank `rank` of `size`: every tensor of `shard` (a ParamSet of tp_shard_config) from its block of
// `full`'s (any dtypes; converted).
void shard_parameters(const ParamSet& shard, const ParamSet& full, int rank, int size);
// The inverse: rank `rank`'s split tensors into their blocks of `full`; its replicated tensors too
// when with_replicated.
void unshard_parameters(const ParamSet& full, const ParamSet& shard, int rank, int size, bool with_replicated);
// Every rank's shard assembled into the whole model's tensors: `full` (host, any dtype; converted)
// receives on every rank of `comm` (the TP group) each split tensor's blocks from every rank's
// `shard` (on comm's device) through one all-gather per tensor, so the device holds one gathered
// tensor at a time, and the replicated tensors from this rank's own (the same on every rank). For
// the consolidated HF checkpoint and the sample of a tensor-parallel run.
void gather_parameters(const ParamSet& full, const ParamSet& shard, Communicator& comm);
// The replicated parameters' gradients summed over the group where each rank holds a part: with
// sequence parallelism all of them (each rank held its rows' share), without it the adapters'
// partial ones (tp_partial_gradient); the rest are whole on every rank already.
// Only their elements within [begin, end) of the flat vector (ParamSet::flat; end < 0: its end):
// under ZeRO 2 a rank reads only its shard of the reduced gradient, the same range on every TP rank
// of a replica (parallel/data_parallel.h).
void reduce_replicated_gradients(const ParamSet& grads, TensorParallel& tp, int64_t begin = 0, int64_t end = -1);

}  // namespace cw
