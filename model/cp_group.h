// Context parallelism (DeepSpeed-Ulysses) as a decoder block sees it: which tokens and which heads a
// rank holds, and the exchange between the two. parallel/context_parallel.h implements the exchange
// with a communicator; the model never talks to other ranks itself (the arrows of the code point
// down: parallel/ -> model/).
//
// A group of P ranks, rank r, shares a chunk of c tokens at positions [p, p+c) of B sequences. Every
// weight is replicated. For everything but attention rank r holds the tokens [p + r c/P, p + (r+1) c/P)
// of each sequence: its residual stream is [B c/P, C], and its norms, linears, RoPE (at the tokens'
// own positions), MLP and residual adds run on those rows alone. Attention runs on all c tokens of
// H/P of the heads: before it q, k and v are exchanged from the rank's tokens of every head to every
// token of its heads (to_heads), after it the output comes back to the rank's tokens (to_tokens). The
// rank's K/V store holds its heads only, Hkv/P of them (or, where the ranks outnumber the K/V heads,
// the one its query heads read: cp_attention_config), for every position, so the store's memory
// divides by P with the heads. Each rank's parameter gradients are its tokens' share; summing them
// over the group gives one process's.
#pragma once

#include "engine/tensor.h"
#include "model/config.h"

#include <cstdint>

namespace cw {

// The config rank r's attention and K/V store work with: H/P query heads and max(1, Hkv/P) K/V
// heads, the rest as the model's. Throws naming the numbers when P splits neither (and parallel.cp).
LlamaConfig cp_attention_config(const LlamaConfig& config, int64_t cp);

// Whether every chunk of a `seq`-token sequence splits into cp equal shares: seq, the chunk and the
// backward chunk (each <= 0 or >= seq meaning one chunk of the whole) multiples of cp, so that the
// last chunk's remainder is one too. The run's and gradcheck's rule; each caller words its refusal.
bool cp_splits_chunks(int64_t cp, int64_t seq, int64_t chunk, int64_t bwd_chunk);

class ContextParallelGroup;

// The tokens of each sequence a rank holds of a chunk of c: c, or under context parallelism (cp set)
// c/P. Throws, naming the numbers, when P does not divide c.
int64_t cp_rank_tokens(const ContextParallelGroup* cp, int64_t c);

class ContextParallelGroup {
 public:
  virtual ~ContextParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The exchanges (parallel/context_parallel.h states their math and adjoints): tokens [B, c/P, G, D]
  // of G heads (H, or Hkv for keys and values), heads [B, c, G_r, D] of the rank's G_r of them.
  virtual void to_heads_forward(const Tensor& x_tokens, const Tensor& y_heads) = 0;
  virtual void to_heads_backward(const Tensor& d_y_heads, const Tensor& d_x_tokens) = 0;
  virtual void to_tokens_forward(const Tensor& x_heads, const Tensor& y_tokens) = 0;
  virtual void to_tokens_backward(const Tensor& d_y_tokens, const Tensor& d_x_heads) = 0;
};

}  // namespace cw
