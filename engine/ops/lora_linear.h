// A frozen linear map with a LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
// Models"), in PEFT's form: dropout on the adapter's input, scale s = alpha / r.
//   forward:  u   = drop(x) Aᵀ                        [N, r]
//             out = x Wᵀ + s · u Bᵀ                     [N, O]
//   backward: g   = s · d_out B                         [N, r]
//             d_B += s · d_outᵀ u                       (always accumulates)
//             d_A += gᵀ drop(x)                         (always accumulates)
//             d_x  = d_out W + drop(g A)                (overwrite or accumulate)
// W gets no gradient: it is the frozen base weight (engine/ops/linear.h is the trainable one).
// drop(z)[n, i] = z[n, i] · keep(n, i) / (1 - p), the mask a pure function of the dropout seed, the
// row's sequence and position and the column (below), so the backward regenerates it and a token's
// mask does not depend on how its sequence was cut into chunks. p = 0: drop(z) = z, no mask.
// Shapes: x, d_x [N, I]; W [O, I]; A, d_A [r, I]; B, d_B [O, r]; out, d_out [N, O]. Dtypes: x, W, A,
// B, out, d_out, d_x one compute dtype; d_A, d_B accum_dtype(x.dtype) (f32 for bf16).
// Saves nothing: the backward recomputes u (r/O of the base product's work), so a layer keeps the
// same activations with adapters as without. Scratch (from the caller's arena, returned as found):
// u and g [N, r], and with dropout drop(x) [N, I] (and drop(g A) in the backward).
// Any gradient may be skipped by passing an undefined Tensor{}. out must not alias an input; d_x
// must not alias x, d_out or a weight. Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/memory.h"
#include "engine/random.h"
#include "engine/tensor.h"

#include <cstdint>

namespace cw {

// Dropout on the adapter's input, deterministic. The call's rows are rows row0, row0 + 1, ... of a
// chunk of sequences of seq_rows tokens each, the first at position pos0: row m of the chunk is the
// token at position pos0 + m % seq_rows of sequence sequence0 + m / seq_rows; its columns are columns column0,
// column0 + 1, ... of the whole input (a tensor-parallel rank holds a slice of a row-parallel
// linear's input). Element (row, column i) of that token is kept when the top 32 bits of
// mix64(row_key ^ i) are >= lora_dropout_threshold(p), with row_key = lora_dropout_row_key(seed,
// sequence, position): the same bits on the CPU and the GPU, and on any split of the columns.
struct LoraDropout {
  double p = 0;          // probability of dropping an element, in [0, 1); 0: no dropout
  uint64_t seed = 0;     // the mask's seed (the model mixes in its LoRA seed, the step, layer and target)
  int64_t seq_rows = 1;  // tokens per sequence in the chunk (c)
  int64_t pos0 = 0;      // position of each sequence's first token in the chunk
  int64_t row0 = 0;      // the call's first row within the chunk (a tiled MLP calls with row shards)
  int64_t column0 = 0;   // the call's first column within the whole input (a TP rank's slice)
  int64_t sequence0 = 0; // the chunk's first sequence within the whole batch (a data-parallel rank's slice)
};

struct LoraAdapter {
  Tensor a;            // [r, I] lora_A
  Tensor b;            // [O, r] lora_B
  double scale = 1.0;  // s = alpha / r
  LoraDropout dropout;
};

CW_HOST_DEVICE inline uint64_t lora_dropout_row_key(uint64_t seed, int64_t sequence, int64_t position) {
  return mix64(seed ^ mix64((static_cast<uint64_t>(sequence) << 40) ^ static_cast<uint64_t>(position)));
}
CW_HOST_DEVICE inline bool lora_dropout_keeps(uint64_t row_key, int64_t column, uint32_t threshold) {
  return static_cast<uint32_t>(mix64(row_key ^ static_cast<uint64_t>(column)) >> 32) >= threshold;
}
// floor(p 2^32): an element is dropped with probability p to within 2^-32.
uint32_t lora_dropout_threshold(double p);

void lora_linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight, const LoraAdapter& adapter,
                         Arena& scratch);
void lora_linear_backward(const Tensor& d_x, const Tensor& d_a, const Tensor& d_b, const Tensor& d_out,
                          const Tensor& x, const Tensor& weight, const LoraAdapter& adapter, GradMode mode,
                          Arena& scratch);

}  // namespace cw
