// Context parallelism's exchange of tokens for heads (DeepSpeed-Ulysses) over a Communicator.
//
// P ranks share every sequence of a batch: rank r holds the tokens [r n, (r + 1) n) of each (n = T / P)
// for everything but attention, and attention runs on all T tokens of some of the heads. Before
// attention one all-to-all turns a rank's tokens of every head into every token of its heads; after
// it the inverse all-to-all turns the attention output back into the rank's tokens of every head.
//
// Heads. With H query heads, rank r attends heads [r H / P, (r + 1) H / P) (P divides H). Query head
// h reads K/V head h / (H / Hkv), so rank r needs the Hr = max(1, Hkv / P) K/V heads from
// first(r) = r Hkv / P (rounded down): its own share when P divides Hkv, and when Hkv divides P one
// head that P / Hkv ranks hold alike (replicated: each K/V head goes to every rank whose query heads
// read it). Any other P is refused (model/cp_group.h's cp_attention_config says which key).
//
// The maps, for a tensor of G heads (H for queries and outputs, Hkv for keys and values), each rank's
// part of the heads [first(r), first(r) + Hr) with first and Hr as above for G (G = H: Hr = H / P):
//   to_heads      forward   y_r[b, s n + i, g] = x_s[b, i, first(r) + g]          (a scatter of copies)
//   [x_r: [B, n, G, D],     backward  d_x_s[b, i, j] = sum over the ranks r with first(r) <= j <
//    y_r: [B, P n, Hr, D]]            first(r) + Hr of d_y_r[b, s n + i, j - first(r)], in rank order
//   to_tokens     forward   the inverse of to_heads for G = H (no replicas): out back to its tokens
//   [x_r: [B, P n, H/P, D], backward  the forward of to_heads (a permutation's adjoint is its inverse)
//    y_r: [B, n, H, D]]
// Each is one all_to_all of equal blocks (rank r's block for rank q: [B, n, Hq, D]), packed and
// unpacked by strided copies, so the values move unchanged in any dtype; only to_heads' backward with
// replicas adds (the replicas' gradients, in rank order: every rank gets the same bits whatever the
// timing). The backward of each map is the adjoint of its forward over the whole group:
// sum_r <f(x)_r, y_r> = sum_r <x_r, f*(y)_r> (tests/parallel/test_context_parallel.cpp).
// Outputs are overwritten; every operand is contiguous and on the communicator's device.
// Scratch: each call allocates a send and a receive buffer of P blocks on that device (the token-side
// tensor's elements each, P / G times that for K/V heads with replicas). Saves nothing.
#pragma once

#include "engine/tensor.h"
#include "model/cp_group.h"
#include "parallel/comm.h"

#include <cstdint>

namespace cw {

// The heads of G that rank r of P holds after to_heads: [first, first + count).
struct HeadRange {
  int64_t first = 0, count = 0;
};
HeadRange cp_heads_of_rank(int64_t heads, int64_t ranks, int64_t rank);

void cp_to_heads_forward(Communicator& comm, const Tensor& x_tokens, const Tensor& y_heads);
void cp_to_heads_backward(Communicator& comm, const Tensor& d_y_heads, const Tensor& d_x_tokens);
void cp_to_tokens_forward(Communicator& comm, const Tensor& x_heads, const Tensor& y_tokens);
void cp_to_tokens_backward(Communicator& comm, const Tensor& d_y_tokens, const Tensor& d_x_heads);

// A rank's context-parallel group as the model's blocks see it (model/cp_group.h): the exchanges
// above over the group's communicator (not owned; it outlives the group).
class ContextParallel final : public ContextParallelGroup {
 public:
  explicit ContextParallel(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  Communicator& communicator() const { return comm_; }
  void to_heads_forward(const Tensor& x_tokens, const Tensor& y_heads) override {
    cp_to_heads_forward(comm_, x_tokens, y_heads);
  }
  void to_heads_backward(const Tensor& d_y_heads, const Tensor& d_x_tokens) override {
    cp_to_heads_backward(comm_, d_y_heads, d_x_tokens);
  }
  void to_tokens_forward(const Tensor& x_heads, const Tensor& y_tokens) override {
    cp_to_tokens_forward(comm_, x_heads, y_tokens);
  }
  void to_tokens_backward(const Tensor& d_y_tokens, const Tensor& d_x_heads) override {
    cp_to_tokens_backward(comm_, d_y_tokens, d_x_heads);
  }

 private:
  Communicator& comm_;
};

}  // namespace cw
