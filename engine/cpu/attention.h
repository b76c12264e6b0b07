// The CPU kernels of the attention op (engine/ops/attention.h has the math and the contract; its
// public entry checks the operands and calls these for host tensors). f64 and f32.
#pragma once

#include "engine/memory.h"
#include "engine/ops/attention.h"

namespace cw::cpu {

// Bytes of scratch these kernels take for c queries against S keys, the arena's alignment included:
// the requests of engine/scratch.h cpu_attention_scratch (per thread one score block of up to 64
// rows x S forward, two backward).
size_t attention_scratch_bytes(int64_t c, int64_t S, DType dtype, bool backward);

// causal false: every query sees every key (AttentionMask::none) within its window, if any.
// softcap > 0: the scores capped, s = softcap tanh(s / softcap); 0: none.
void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch, bool causal, const AttentionWindow& window,
                       double softcap);
void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch, bool causal,
                        const AttentionWindow& window, double softcap);
void attention_merge(const Tensor& acc, const Tensor& lse_acc, const Tensor& out_b, const Tensor& lse_b);

}  // namespace cw::cpu
