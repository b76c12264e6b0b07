// The LM head fused with cross-entropy: the [N, V] logits never exist in full.
//   logits[n, :] = x[n, :] Wᵀ   (W [V, C], the unembedding; tied models pass the embedding table)
//   lse[n] = log sum_v exp(logits[n, v])
//   row_loss[n] = (lse[n] - logits[n, label[n]]) / normaliser,  0 for label[n] = -100 (ignored)
//   The sum of row_loss over all chunks of a batch is the mean loss when `normaliser` is the batch's
//   count of supervised tokens (the caller counts them once, before chunking).
//   backward of L = sum_n row_loss[n]:
//     G[n, v] = (softmax(logits[n])[v] - [v == label[n]]) / normaliser   (0 for ignored rows)
//     d_x = G W  (overwrite or accumulate);   d_W += Gᵀ x  (always accumulates)
// Final-logit cap (softcap > 0; Gemma 2's final_logit_softcapping): the logits above are
//   z[n, v] = cap tanh((x[n, :] Wᵀ)[v] / cap), the loss is the cross-entropy of the capped logits,
//   and the backward multiplies G[n, v] by the cap's derivative 1 - (z[n, v] / cap)^2 before the
//   products. 0: no cap (Llama). lm_head_logits gives the capped logits themselves (sampling, eval).
// Rows are processed in blocks of `block_rows`, each block's logits living only in scratch
// ([block_rows, V]); the log-sum-exp is taken in the accumulation dtype.
// Shapes: x, d_x [N, C]; W, d_W [V, C] (V > 0); labels [N] i32, each in [0, V) or -100. Dtypes: W,
// d_x x's; row_loss, saved.lse and d_W accum_dtype(x.dtype) (f32 for bf16). All contiguous, on x's
// device (scratch too); d_x must not alias x.
// Saved: lse. lm_head_loss_backward recomputes each block's logits from x, W and lse;
// lm_head_loss_fused computes loss and gradients in one pass (no recompute), for training steps
// that need both at once. Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/memory.h"
#include "engine/tensor.h"

namespace cw {

constexpr int32_t kIgnoreLabel = -100;

struct LmHeadSaved {
  Tensor lse;  // [N]
};

void lm_head_loss_forward(const Tensor& row_loss, const LmHeadSaved& saved, const Tensor& x, const Tensor& weight,
                          const Tensor& labels, double normaliser, Arena& scratch, int64_t block_rows = 256,
                          double softcap = 0.0);
void lm_head_loss_backward(const Tensor& d_x, const Tensor& d_weight, const LmHeadSaved& saved, const Tensor& x,
                           const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode,
                           Arena& scratch, int64_t block_rows = 256, double softcap = 0.0);
void lm_head_loss_fused(const Tensor& row_loss, const Tensor& d_x, const Tensor& d_weight, const Tensor& x,
                        const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
                        int64_t block_rows = 256, double softcap = 0.0);

// The logits alone, for sampling and comparisons (no loss, no backward): logits [N, V] = x Wᵀ, capped
// as above when softcap > 0. x [N, C], W [V, C] and logits in one dtype, contiguous, on one device.
void lm_head_logits(const Tensor& logits, const Tensor& x, const Tensor& weight, double softcap = 0.0);

}  // namespace cw
