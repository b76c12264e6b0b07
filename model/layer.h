// One Llama decoder block over a chunk of tokens, forward and backward, built from engine ops.
//
// A chunk is B sequences x c tokens at positions [p, p+c); rows are n = b*c + t, N = B*c.
//   h1   = rmsnorm(x_in; attn_norm)
//   q    = rope(h1 Wqᵀ, p)          k = rope(h1 Wkᵀ, p)        v = h1 Wvᵀ        -> K/V store [p, p+c)
//          Qwen2 adds the biases: h1 Wqᵀ + b_q, h1 Wkᵀ + b_k, h1 Wvᵀ + b_v (engine/ops/bias.h);
//          Llama's and Qwen3's attention_bias these and b_o: x_mid = x_in + attn Woᵀ + b_o.
//          Qwen3 norms each head before RoPE: q = rope(rmsnorm_D(h1 Wqᵀ; q_norm)), the same for k
//          with k_norm (rmsnorm over the D values of one head of one token, the weight shared).
//   attn = attention(q, K[0, p+c), V[0, p+c))                 (bottom-right causal, grouped heads)
//   x_mid = x_in + attn Woᵀ
//   h2   = rmsnorm(x_mid; mlp_norm)
//   act  = silu(h2 W_gateᵀ) * (h2 W_upᵀ)
//   x_out = x_mid + act W_downᵀ
// Gemma 2 (config post_norms, mlp_gate, norm_weight_offset; model/config.h) norms each sub-block's
// output before its residual add and gates with gelu:
//   x_mid = x_in + rmsnorm(attn Woᵀ; attn_post_norm)
//   act   = gelu_tanh(h2 W_gateᵀ) * (h2 W_upᵀ)              (engine/ops/geglu.h)
//   x_out = x_mid + rmsnorm(act W_downᵀ; mlp_post_norm)
// every norm of the block scaling by (1 + w), its attention scaled by query_pre_attn_scalar^-1/2 and
// its scores capped, and the window of its layer (config layer_window) in the store's attention.
// The backward runs these lines in reverse. Its attention step ADDS dK, dV for all keys [0, p+c) into
// the store's gradient accumulators; then the chunk's own K/V gradient is read back from the
// accumulator over [p, p+c) — its local part plus whatever later chunks added before — and carried
// through RoPE and the K/V projections. With one chunk covering the sequence this is plain backprop;
// with many (SeCO) it is the same gradient, exactly.
// Parameter gradients accumulate (+=). d_x enters as the gradient of x_out and leaves as that of x_in.
//
// LoRA (model/lora.h): a linear whose LayerWeights carry an adapter (w.lora) runs lora_linear, its
// base weight frozen; its adapter's gradient goes into grads.lora. A frozen tensor's gradient is an
// undefined Tensor in `grads` (a set of adapter gradients has no base tensors): the ops skip it.
//
// Tensor parallel (ctx.tp set; model/shard.h): the weights are the rank's shard and the config the
// shard's (H/P heads, Hkv/P K/V heads, FFN F/P), so every line above runs unchanged on the rank's
// heads and FFN columns; the K/V store holds the rank's K/V heads. Two seams per half-block join the
// ranks: h1 and h2 enter the column-parallel linears through copy_to_tp (or gather_from_sp), and
// the outputs of Wo and W_down, partial sums over the rank's heads / FFN columns, leave through
// reduce_from_tp (or scatter_to_sp). With sequence parallelism x_in, x_mid, x_out and d_x are the
// rank's rows [N/P, C]; the norms and residual adds run on them only.
//
// Context parallel (ctx.cp set; model/cp_group.h): the chunk's c tokens at [p, p+c) are shared by P
// ranks, rank r holding tokens [p + r c/P, p + (r+1) c/P) of each sequence, so x_in, x_out, d_x and
// every row-wise step above (norms, projections, RoPE at those positions, the MLP) work on its
// N = B c/P rows with the whole model's weights. Only attention sees the whole chunk: q, k and v go
// through to_heads (every token of the rank's H/P heads, the K/V store holding its K/V heads), attn
// comes back through to_tokens before Wo; the backward runs the adjoints in reverse (d_attn to the
// heads, d_q, dK and dV of the chunk's own tokens back to the rank's tokens). Not with tensor
// parallelism, packed documents or the fused Q/K/V projection.
#pragma once

#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "engine/ops/rmsnorm.h"
#include "model/config.h"
#include "model/cp_group.h"
#include "model/kv_store.h"
#include "model/params.h"
#include "model/shard.h"

namespace cw {

// What a layer keeps of its MLP for the backward. A linear's input feeds only its own weight's
// gradient or its adapter's, so the MLP of a frozen model without MLP adapters (LoRA on the
// attention's linears) needs neither h2 nor act: the backward's d_h2 and d_act come from the
// weights and the kept gate and up.
enum class MlpKept {
  all,       // h2, gate, up, act
  products,  // gate, up: h2 and act feed only frozen, unadapted linears (ActivationPolicy::mlp_frozen)
  input,     // h2 alone: the MLP is recomputed from it (selective recompute, or tiled shard by shard)
};

// What a block's backward reads, for one chunk. Shapes with N = B*c; under tensor parallelism H, F are
// the rank's (config is the shard's) and R = N/P with sequence parallelism, else R = N. Under context
// parallelism N = R = B c/P (the rank's tokens) and the attention's tensors (q, attn, lse) are of the
// whole chunk's c tokens and the rank's Ha = H/P heads; elsewhere Ha = H.
struct LayerActivations {
  Tensor h1;                  // [N, C]    attn_norm(x_in) as the column-parallel linears read it (all
                              //           rows); [R, C], the rank's rows only, when tp->regather()
  RmsNormSaved norm1;         // rstd [R]
  Tensor q;                   // [B, c, Ha, D] post-RoPE queries
  Tensor q_raw, k_raw;        // [N, H*D], [N, Hkv*D] the projections before the per-head norm
                              //           (qk_norm; undefined otherwise)
  RmsNormSaved q_norm, k_norm;  // rstd [N*H], [N*Hkv] of the per-head norms (qk_norm)
  Tensor attn;                // [B, c, Ha, D] attention output
  Tensor attn_rows;           // [N, H*D]  the same as o_proj reads it: attn itself, or under context
                              //           parallelism the rank's tokens of every head (to_tokens)
  AttentionSaved attn_saved;  // lse [B, Ha, c]
  Tensor x_mid;               // [R, C]    residual stream after attention
  Tensor h2;                  // [N, C]    mlp_norm(x_mid), as h1: [R, C] when tp->regather();
                              //           undefined with MlpKept::products
  RmsNormSaved norm2;         // rstd [R]
  Tensor gate, up, act;       // [N, F]    gate and up projections, silu(gate) * up (gelu: Gemma 2);
                              //           none with MlpKept::input, no act with MlpKept::products
  // Gemma 2's post-norms (post_norms): the attention's output attn Woᵀ (+ b_o) and the MLP's
  // act W_downᵀ, the rank's rows of the sums over the ranks, as the norms read them, with their rstd.
  Tensor attn_out, mlp_out;   // [R, C]
  RmsNormSaved attn_post, mlp_post;  // rstd [R]

  // mlp: what is kept of the MLP (above). tp: the rank's group (null: one process), for R and the
  // regathered h1/h2. cp: the context-parallel group, for the rank's tokens and heads (c stays the
  // chunk's).
  static LayerActivations allocate(Arena& arena, const LlamaConfig& config, int64_t B, int64_t c, DType dtype,
                                   MlpKept mlp = MlpKept::all, const TensorParallelGroup* tp = nullptr,
                                   const ContextParallelGroup* cp = nullptr);
  static size_t bytes(const LlamaConfig& config, int64_t B, int64_t c, DType dtype, MlpKept mlp = MlpKept::all,
                      const TensorParallelGroup* tp = nullptr, const ContextParallelGroup* cp = nullptr);
};

// The adapters' settings for the chunks of a call (model/lora.h, LlamaModel::lora_runtime): the scale
// alpha / r, and the dropout probability and seed of the current training step (p = 0 outside one:
// evaluation, sampling, logits). Unused where the layer's linears have no adapters.
struct LoraRuntime {
  double scale = 0.0;
  double dropout = 0.0;
  uint64_t lora_seed = 0;   // the run's lora.seed
  uint64_t round = 0;       // the step's micro-batch index (with dropout > 0)
  int64_t sequence0 = 0;    // the chunk's first sequence in the step's global batch (the masks' key)
};

// The chunk a block works on and the tables and scratch it uses.
struct BlockContext {
  const LlamaConfig& config;
  const Tensor& rope_cos;     // [P, D/2], P >= p + c
  const Tensor& rope_sin;
  int64_t B, c, pos0;         // batch, chunk length, position of the chunk's first token
  Arena& scratch;
  // Tiled MLP: > 1 runs the MLP in this many row shards, so its [rows, F] intermediates exist for one
  // shard at a time; with activations kept, gate/up/act are not kept but recomputed per shard in
  // the backward (the MLP is row-wise, so shards are exact). 1: untiled.
  int64_t mlp_shards = 1;
  // The reverse sweep's recompute with saved attention outputs (kv_store.h): the chunk's attention
  // output and lse are read from the store instead of computed, and its K, V are not rewritten.
  bool attention_from_store = false;
  // Tensor parallelism: the rank's group (model/shard.h); null: one process, no communication.
  TensorParallelGroup* tp = nullptr;
  // LoRA: what the adapters in the LayerWeights need (their scale and dropout).
  LoraRuntime lora{};
  // Packed documents (model/llama.h ChunkTokens): per sequence its document starts, so attention stays
  // within a document (engine/ops/attention.h) and, with document_positions, RoPE positions restart
  // at each start; null: each sequence is one document.
  const std::vector<std::vector<int64_t>>* doc_starts = nullptr;
  bool document_positions = true;
  // On a GPU, the step's document starts per position, int32 [B, T] (optim/schedule.h StepTokens),
  // read in place by the one-call attention; empty: built by the op where it needs them.
  Tensor first_keys = {};
  // Context parallelism: the rank's group (model/cp_group.h); B, c and pos0 are then the whole
  // chunk's, of which the rank holds tokens [pos0 + r c/P, pos0 + (r+1) c/P) of each sequence.
  ContextParallelGroup* cp = nullptr;
};

struct LoraConfig;  // model/lora.h

// The fused Q/K/V projection (on by default; the setter is for the tests that hold it against three
// GEMMs): where Wq, Wk, Wv lie back to back in memory (the parameter table's order,
// model/params.cpp; so do their gradients), carry no adapters and are not tensor-parallel shards, a
// chunk's three projections run as one GEMM of q_dim + 2 kv_dim outputs,
// [N, q_dim + 2 kv_dim] = h1 [Wq; Wk; Wv]ᵀ, and the backward as one d_h1 GEMM and one d_W GEMM; RoPE
// reads and writes the q and k columns in place (engine/ops/rope.h). The values are the same sums;
// the K and V GEMMs of 512 columns alone fill under half an H100 (1B's run at 91-96 TFLOP/s alone,
// the three fused at 650-670: docs/decisions.md, "GEMMs"). Off: three GEMMs each way.
void set_fused_qkv(bool on);
bool fused_qkv();
// Whether block_forward / block_backward fuse the projections of a model with these adapters and
// this TP (or context-parallel) group (the planner's rule: tools/planner); the weights' adjacency is checked per call.
bool fuses_qkv(const LoraConfig* lora, const TensorParallelGroup* tp, const ContextParallelGroup* cp = nullptr);

// The shard count `mlp_shards = 0` (automatic) means: ceil(F / C), so one shard's [rows, F]
// intermediates are about the size of one [N, C] residual-stream tensor.
int64_t resolve_mlp_shards(int64_t requested, const LlamaConfig& config, int64_t rows);

// keep == nullptr: nothing is saved (prefill); the activations live in scratch for the call.
// x_out undefined (with keep): a recompute for the backward alone; what only x_out needs (W_down's
// product and the residual add) is skipped, but for Gemma 2's post-norm, whose backward reads the
// MLP's output (W_down's product runs, the residual add does not).
void block_forward(const Tensor& x_out, LayerActivations* keep, const Tensor& x_in, const LayerWeights& w,
                   KVStore& kv, int layer, const BlockContext& ctx);
void block_backward(const Tensor& d_x, const LayerWeights& grads, const LayerActivations& act, const Tensor& x_in,
                    const LayerWeights& w, KVStore& kv, int layer, const BlockContext& ctx);

}  // namespace cw
