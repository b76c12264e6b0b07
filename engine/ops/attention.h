// Causal multi-head attention with grouped K/V heads, in the "chunk against cache" form.
//   The chunk's c queries sit at positions [p, p+c); they attend the S = p + c keys at [0, p+c),
//   the causal mask aligned bottom-right: query i sees keys j <= p + i. Full-sequence attention is
//   p = 0. Query head h reads K/V head h / (H / Hkv): grouped-query attention without copies.
//   forward:  s_ij = scale * q_i . k_j;  lse_i = log sum_j exp(s_ij);  P_ij = exp(s_ij - lse_i)
//             out_i = sum_j P_ij v_j
//   backward: Delta_i = d_out_i . out_i;  dP_ij = d_out_i . v_j;  dS_ij = P_ij (dP_ij - Delta_i)
//             d_q_i   = scale sum_j dS_ij k_j                 (overwrite or accumulate)
//             d_k_j  += scale sum_i dS_ij q_i                  (always ADDED: the caller's buffer covers
//             d_v_j  += sum_i P_ij d_out_i                      [0, p+c), which is what SeCO needs)
// Shapes: q, out, d_q, d_out [B, c, H, D]; k, v [B, S, Hkv, D]; d_k, d_v [B, S, Hkv, D] in the
// accumulation dtype (f32 for f32/bf16, f64 for f64). k, v, d_k, d_v may have any batch stride
// (a slice of the K/V store); their inner [S, Hkv, D] must be packed.
// Saved: lse [B, H, c] in the accumulation dtype; the backward recomputes P from q, k and lse.
// Scratch: the CPU path takes, per thread, score blocks of up to 64 query rows x S keys from
// `scratch` (one in the forward, two in the backward): attention_scratch_bytes says how much.
// Tested in tests/engine/test_ops.cpp (fp64 finite differences, chunked against whole-sequence).
#pragma once

#include "engine/memory.h"
#include "engine/tensor.h"

namespace cw {

struct AttentionSaved {
  Tensor lse;  // [B, H, c]
};

// Bytes of scratch the CPU attention takes for c queries against S keys (forward or backward).
size_t attention_scratch_bytes(int64_t c, int64_t S, DType dtype, bool backward);

void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch);
void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch);

}  // namespace cw
