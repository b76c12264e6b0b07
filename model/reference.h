// The reader's entry point: the math of one training step of a Llama, in one file.
//
// reference_step computes the loss of a batch and its gradient with respect to every trained
// parameter, over the whole sequence at once, in f64, by hand: plain loops and Eigen products on f64
// matrices, sharing no code with the engine's path (no block_forward / block_backward, no engine
// op: attention, rmsnorm, linear, rope_forward, lm_head_loss, ...). Every schedule (optim/schedule.h:
// full, checkpointed, seco, spaco visiting every chunk) must give its gradient to f64 rounding;
// `chunkwise gradcheck --against reference` and tests/model/test_reference.cpp check that, and the
// tests check this file itself against finite differences. Read this first, then model/layer.h
// and model/llama.h for how the engine computes the same thing chunk by chunk.
//
// Shapes: B sequences of T tokens, rows n = b T + t, N = B T; C hidden, H heads, Hkv K/V heads
// (query head h reads K/V head h / (H / Hkv)), D head dim, F FFN width, V vocab, L layers.
// Linear weights are [out, in] (HF): lin(x) = x Wᵀ, with a LoRA adapter (model/lora.h)
// lin(x) = x Wᵀ + s (x Aᵀ) Bᵀ, s = alpha / r, A [r, in], B [out, r] (no dropout).
//   x_0    = E[ids]                                                 [N, C]   (Gemma 2: sqrt(C) E[ids])
//   per layer l = 0 .. L-1:
//     h1   = rmsnorm(x_l; g1)          rmsnorm(x; g)_i = g_i x_i / sqrt(mean_j x_j² + eps)
//                                      (Gemma 2: (1 + g_i) in place of g_i, in every norm)
//     q    = rope(lin_q(h1)) [N, H, D]   k = rope(lin_k(h1)) [N, Hkv, D]   v = lin_v(h1) [N, Hkv, D]
//            Qwen2: lin_q, lin_k, lin_v add their biases b_q, b_k, b_v (Llama's, Qwen3's
//            attention_bias: and lin_o b_o);
//            Qwen3: q = rope(rmsnorm_D(lin_q(h1); g_q)), k likewise with g_k, rmsnorm_D over each head
//     a_t  = sum_{j in keys(t)} softmax_j(q_t . k_j / sqrt(D)) v_j       per head, [N, H D]
//            Gemma 2: the score s = q_t . k_j / sqrt(query_pre_attn_scalar), capped c tanh(s / c) with
//            c = attn_logit_softcapping
//     x_mid = x_l + lin_o(a)                      (Gemma 2: x_l + rmsnorm(lin_o(a); g_ap))
//     h2   = rmsnorm(x_mid; g2)
//     x_{l+1} = x_mid + lin_down(silu(lin_gate(h2)) * lin_up(h2))       silu(z) = z / (1 + e^-z)
//            Gemma 2: x_mid + rmsnorm(lin_down(gelu(lin_gate(h2)) * lin_up(h2)); g_fp),
//            gelu(z) = z/2 (1 + tanh(sqrt(2/pi) (z + 0.044715 z³)))
//   logits = rmsnorm(x_L; g_final) Wᵀ_head                              [N, V]; W_head = E when tied
//            Gemma 2: capped c tanh(z / c) with c = final_logit_softcapping
//   loss   = (1 / S) sum_{n: label_n != -100} (logsumexp(logits_n) - logits_n[label_n])
// S is the count of supervised labels in the batch (at least 1: a batch without any has loss 0).
// keys(t) = [start(t), t], start(t) the last document start <= t of the sequence (Batch::doc_starts;
// none: 0); under a sliding window of W keys (Mistral's sliding_window; Gemma 2's on its sliding
// layers) [max(start(t), t - W + 1), t].
// RoPE rotates each head's halves (HF rotate_half) by the angles of position pos(t) = t,
// or t - start(t) with packed documents and document positions:
//   out_i = x_i cos_i - x_{i+D/2} sin_i,   out_{i+D/2} = x_{i+D/2} cos_i + x_i sin_i.
// The cos / sin tables [T, D/2] are the engine's (engine/ops/rope.h rope_tables, for a sequence of T
// tokens): the scaling variants (linear, llama3, yarn with its attention factor, dynamic NTK) must
// agree with HF's to the last bit, so their frequencies are taken, not written again. Everything
// else is written here from the math above. The backward runs the lines in reverse (reference.cpp
// states each step's derivative).
//
// Returns the loss and the gradient as a set with the table of model.trainable() in f64 on the host:
// every parameter, or under LoRA the adapters' A and B only (the base frozen). A tied embedding
// gets both its gradients (as the table has one tensor). The model's parameters may be of any dtype
// (read as f64); it must be one process (no tensor parallelism), hold its blocks' weights
// (not cast_layers) and have adapters without dropout. Tiny models only: it keeps every
// activation and the [N, V] logits, and attention is O(T²) loops.
#pragma once

#include "model/llama.h"

#include <vector>

namespace cw {

struct ReferenceResult {
  double loss = 0;         // the batch's mean loss
  int64_t supervised = 0;  // labels != -100
  ParamSet grads;          // d loss / d (each trained tensor), f64, the table of model.trainable()
};

// ids, labels [B, T] i32 on the host: a Batch's (optim/schedule.h), labels already shifted.
// doc_starts: per sequence its document starts (ascending, the first 0), or empty: one document a
// sequence. document_positions: RoPE positions restart at each start.
ReferenceResult reference_step(const LlamaModel& model, const Tensor& ids, const Tensor& labels,
                               const std::vector<std::vector<int64_t>>& doc_starts = {},
                               bool document_positions = true);

}  // namespace cw
