#include "model/layer.h"

#include "model/layer_seams.h"

#include "engine/ops/bias.h"
#include "engine/ops/geglu.h"
#include "engine/ops/linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "model/lora.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace cw {

namespace {
std::atomic<bool> g_fused_qkv{true};
}  // namespace

void set_fused_qkv(bool on) { g_fused_qkv.store(on); }
bool fused_qkv() { return g_fused_qkv.load(); }

namespace {
// The rule, stated once: the switch on, no tensor parallelism (each rank holds its own heads' rows of
// the three weights), no context parallelism (it exchanges q, k and v apart, each of its own heads), no
// adapter on q, k or v (each adds its own low-rank term to one projection).
bool qkv_fusable(const TensorParallelGroup* tp, const ContextParallelGroup* cp, bool qkv_adapters) {
  return fused_qkv() && !tp && !cp && !qkv_adapters;
}
}  // namespace

bool fuses_qkv(const LoraConfig* lora, const TensorParallelGroup* tp, const ContextParallelGroup* cp) {
  bool qkv_adapters = false;
  if (lora && lora->enabled())
    for (ParamRole r : lora->target_roles())
      qkv_adapters = qkv_adapters || r == ParamRole::wq || r == ParamRole::wk || r == ParamRole::wv;
  return qkv_fusable(tp, cp, qkv_adapters);
}

int64_t resolve_mlp_shards(int64_t requested, const LlamaConfig& cf, int64_t rows) {
  CW_CHECK(requested >= 0, "mlp_shards must be >= 0 (0: automatic), got {}", requested);
  const int64_t n = requested == 0 ? (cf.intermediate_size + cf.hidden_size - 1) / cf.hidden_size : requested;
  return std::max<int64_t>(1, std::min(n, rows));
}

LayerActivations LayerActivations::allocate(Arena& arena, const LlamaConfig& cf, int64_t B, int64_t c, DType dt,
                                            MlpKept mlp, const TensorParallelGroup* tp, const ContextParallelGroup* cp) {
  // Under context parallelism the rank's rows are its c/P tokens of each sequence, and attention's
  // tensors the whole chunk's of its H/P heads.
  const int64_t P = cp ? cp->size() : 1;
  const int64_t N = B * cp_rank_tokens(cp, c), C = cf.hidden_size, F = cf.intermediate_size, H = cf.num_attention_heads,
                D = cf.head_dim, Ha = H / P;
  const int64_t R = tp_rows(tp, N), normed_rows = tp_regathers(tp) ? R : N;
  const DType acc = accum_dtype(dt);
  LayerActivations a;
  a.h1 = arena.alloc(dt, {normed_rows, C});
  a.norm1.rstd = arena.alloc(acc, {R});
  a.q = arena.alloc(dt, {B, c, Ha, D});
  if (cf.qk_norm) {
    a.q_raw = arena.alloc(dt, {N, cf.q_dim()});
    a.k_raw = arena.alloc(dt, {N, cf.kv_dim()});
    a.q_norm.rstd = arena.alloc(acc, {N * H});
    a.k_norm.rstd = arena.alloc(acc, {N * cf.num_key_value_heads});
  }
  a.attn = arena.alloc(dt, {B, c, Ha, D});
  a.attn_rows = cp ? arena.alloc(dt, {N, cf.q_dim()}) : a.attn.view({N, cf.q_dim()});
  a.attn_saved.lse = arena.alloc(acc, {B, Ha, c});
  a.x_mid = arena.alloc(dt, {R, C});
  if (mlp != MlpKept::products) a.h2 = arena.alloc(dt, {normed_rows, C});
  a.norm2.rstd = arena.alloc(acc, {R});
  if (mlp != MlpKept::input) {
    a.gate = arena.alloc(dt, {N, F});
    a.up = arena.alloc(dt, {N, F});
    if (mlp == MlpKept::all) a.act = arena.alloc(dt, {N, F});
  }
  if (cf.post_norms) {
    a.attn_out = arena.alloc(dt, {R, C});
    a.attn_post.rstd = arena.alloc(acc, {R});
    a.mlp_out = arena.alloc(dt, {R, C});
    a.mlp_post.rstd = arena.alloc(acc, {R});
  }
  return a;
}

size_t LayerActivations::bytes(const LlamaConfig& cf, int64_t B, int64_t c, DType dt, MlpKept mlp,
                               const TensorParallelGroup* tp, const ContextParallelGroup* cp) {
  // Under context parallelism N counts the rank's tokens; q, attn and lse (the chunk's tokens of H/P
  // heads) are as many values as for N tokens of every head, and attn_rows adds one more [N, q_dim].
  const int64_t rows = B * cp_rank_tokens(cp, c);
  const size_t N = static_cast<size_t>(rows), R = static_cast<size_t>(tp_rows(tp, rows));
  const size_t attention = cp ? 3 : 2;  // q and attn; attn_rows
  const size_t normed_rows = tp_regathers(tp) ? R : N, C = static_cast<size_t>(cf.hidden_size);
  const size_t e = dtype_size(dt), a = dtype_size(accum_dtype(dt)), F = static_cast<size_t>(cf.intermediate_size);
  const size_t normed = mlp == MlpKept::products ? 1 : 2;  // h1, and h2 unless products only
  const size_t ffn = mlp == MlpKept::all ? 3 * F : mlp == MlpKept::products ? 2 * F : 0;
  // The per-head norms keep the projections before them and their statistics (qk_norm).
  const size_t raw = cf.qk_norm ? static_cast<size_t>(cf.q_dim() + cf.kv_dim()) : 0;
  const size_t raw_stats = cf.qk_norm ? static_cast<size_t>(cf.num_attention_heads + cf.num_key_value_heads) : 0;
  // The post-norms keep the sub-blocks' outputs and their statistics (post_norms).
  const size_t post = cf.post_norms ? 2 : 0;
  return e * (normed * normed_rows * C + (1 + post) * R * C +
              N * (attention * static_cast<size_t>(cf.q_dim()) + raw + ffn)) +
         a * ((2 + post) * R + N * (static_cast<size_t>(cf.num_attention_heads) + raw_stats));
}

namespace {
// RoPE over [B, n, heads, D] rows at positions [pos0, pos0 + n), forward or backward (overwriting y).
void rope_at(const Tensor& y, const Tensor& x, const BlockContext& ctx, int64_t pos0, bool backward) {
  if (backward) rope_backward(y, x, ctx.rope_cos, ctx.rope_sin, pos0, GradMode::overwrite);
  else rope_forward(y, x, ctx.rope_cos, ctx.rope_sin, pos0);
}
}  // namespace

// RoPE over a chunk's [B, c, heads, D] rows: positions [p, p + c) in one call, or with packed documents
// span by span, each from its position in its document (or in the sequence, with absolute positions).
void rope_chunk(const Tensor& y, const Tensor& x, const BlockContext& ctx, bool backward) {
  if (!ctx.doc_starts || !ctx.document_positions) return rope_at(y, x, ctx, ctx.pos0, backward);
  for (const DocumentSpan& s : document_spans(*ctx.doc_starts, ctx.B, ctx.pos0, ctx.c)) {
    auto rows = [&](const Tensor& t) { return t.slice(0, s.b, 1).slice(1, s.q0, s.q1 - s.q0); };
    rope_at(rows(y), rows(x), ctx, ctx.pos0 + s.q0 - s.k0, backward);
  }
}

namespace {
// RoPE over the rank's [B, ct, heads, D] rows: rope_chunk's, or under context parallelism at the
// positions of the rank's tokens (no packed documents there).
void rope_rows(const Tensor& y, const Tensor& x, const BlockCall& b, bool backward) {
  if (!b.cp) return rope_chunk(y, x, b.ctx, backward);
  rope_at(y, x, b.ctx, b.pt, backward);
}

// ---- The fused Q/K/V projection (model/layer.h, fused_qkv) ----

// [Wq; Wk; Wv] as one [q_dim + 2 kv_dim, C] tensor where the three lie back to back (weights or their
// gradients), or [b_q; b_k; b_v] as one [q_dim + 2 kv_dim] (biases); undefined otherwise.
Tensor stacked_qkv(const Tensor& wq, const Tensor& wk, const Tensor& wv) {
  if (!wq.data || !wk.data || !wv.data || wk.dtype != wq.dtype || wv.dtype != wq.dtype || !wq.contiguous() ||
      !wk.contiguous() || !wv.contiguous() || wk.ndim != wq.ndim || wv.ndim != wq.ndim)
    return {};
  if (wq.ndim == 2 && (wk.size(1) != wq.size(1) || wv.size(1) != wq.size(1))) return {};
  const char* q = static_cast<const char*>(wq.data);
  const char* k = static_cast<const char*>(wk.data);
  if (k != q + wq.bytes() || static_cast<const char*>(wv.data) != k + wk.bytes()) return {};
  const int64_t rows = wq.size(0) + wk.size(0) + wv.size(0);
  if (wq.ndim == 1) return Tensor::packed(wq.data, wq.dtype, wq.device, std::array<int64_t, 1>{rows});
  return Tensor::packed(wq.data, wq.dtype, wq.device, std::array<int64_t, 2>{rows, wq.size(1)});
}

// The fused projection's weight for this call, or undefined where the three GEMMs run (also where
// the model has biases that do not lie back to back).
Tensor fused_qkv_weight(const BlockCall& b) {
  const LayerWeights& w = b.w;
  if (!qkv_fusable(b.tp, b.cp, w.lora.q.defined() || w.lora.k.defined() || w.lora.v.defined())) return {};
  if (w.q_bias.data && !stacked_qkv(w.q_bias, w.k_bias, w.v_bias).data) return {};
  return stacked_qkv(w.wq, w.wk, w.wv);
}

// ---- Qwen3's per-head norms: rmsnorm over the D values of each head of each token ----

// out [N, heads D] = rmsnorm_D(raw [N, heads D]; weight [D]), its statistics into saved ([N heads]).
void norm_heads(const Tensor& out, const RmsNormSaved& saved, const Tensor& raw, const Tensor& weight,
                const BlockCall& b) {
  const int64_t rows = raw.numel() / b.D;
  rmsnorm_forward(out.view({rows, b.D}), saved, raw.view({rows, b.D}), weight, b.cf.rms_norm_eps,
                  b.cf.norm_weight_offset);
}

// d [N, heads D]: the gradient of the normed heads in, of the raw projection out (in place); the
// weight's gradient (when trained) accumulates.
void norm_heads_backward(const Tensor& d, const Tensor& d_weight, const RmsNormSaved& saved, const Tensor& raw,
                         const Tensor& weight, const BlockCall& b) {
  const int64_t rows = raw.numel() / b.D;
  const Tensor d_rows = d.view({rows, b.D});
  rmsnorm_backward(d_rows, d_weight, d_rows, saved, raw.view({rows, b.D}), weight, GradMode::overwrite, b.scratch,
                   b.cf.norm_weight_offset);
}

// ---- Gemma 2's post-norms: a sub-block's output normed before its residual add ----

// y [R, C] in scratch = rmsnorm(o; weight), o (the rank's rows of the sub-block's output, summed over
// the ranks) kept in `kept` with the norm's statistics in `saved` for the backward.
Tensor post_norm(const Tensor& kept, const RmsNormSaved& saved, const Tensor& o, const Tensor& weight,
                 const BlockCall& b) {
  copy_convert(kept, o);
  const Tensor y = b.scratch.alloc(b.dt, {b.R, b.C});
  rmsnorm_forward(y, saved, kept, weight, b.cf.rms_norm_eps, b.cf.norm_weight_offset);
  return y;
}

// d(o) [R, C] in scratch from d(y) = d_x (the residual stream's gradient, which the add passes to y
// unchanged); the norm's weight gradient accumulates.
Tensor post_norm_backward(const Tensor& d_x, const Tensor& d_weight, const RmsNormSaved& saved, const Tensor& kept,
                          const Tensor& weight, const BlockCall& b) {
  const Tensor d_o = b.scratch.alloc(b.dt, {b.R, b.C});
  rmsnorm_backward(d_o, d_weight, d_x, saved, kept, weight, GradMode::overwrite, b.scratch, b.cf.norm_weight_offset);
  return d_o;
}

// ---- Attention half: h1 -> q, K, V -> attn -> x_mid ----

double attention_scale(const BlockCall& b) { return b.cf.attention_scale(); }

// q = rope(h1 Wqᵀ + b_q) into a.q [B, c, Ha, D]; with per-head norms rope(rmsnorm_D(h1 Wqᵀ + b_q)),
// the projection kept in a.q_raw. Under context parallelism the rank's tokens of every head, then
// to_heads.
void project_q(LayerActivations& a, const Tensor& h1, const BlockCall& b) {
  const Tensor q_pre = b.scratch.alloc(b.dt, {b.N, b.cf.q_dim()});
  block_linear_forward(b.cf.qk_norm ? a.q_raw : q_pre, h1, ParamRole::wq, b);
  if (b.cf.qk_norm) norm_heads(q_pre, a.q_norm, a.q_raw, b.w.q_norm, b);
  const Tensor q_rows = q_pre.view({b.B, b.ct, b.H, b.D});
  if (!b.cp) return rope_rows(a.q, q_rows, b, false);
  rope_rows(q_rows, q_rows, b, false);
  b.cp->to_heads_forward(q_rows, a.q);
}

// The rank's K or V rows [B, ct, Hkv, D] into the store's rows [p, p+c) (`store`): as they are, or
// under context parallelism every token of the rank's K/V heads (to_heads).
void store_rows(const Tensor& store, const Tensor& rows, const BlockCall& b) {
  if (!b.cp) return copy_convert(store, rows);
  const Tensor heads = b.scratch.alloc(b.dt, {b.B, b.c, b.Hkva, b.D});
  b.cp->to_heads_forward(rows, heads);
  copy_convert(store, heads);
}

// The chunk's k before RoPE: h1 Wkᵀ + b_k into k_pre [N, kv_dim]; with per-head norms normed, the
// projection kept in a.k_raw.
void project_k(const Tensor& k_pre, LayerActivations& a, const Tensor& h1, const BlockCall& b) {
  block_linear_forward(b.cf.qk_norm ? a.k_raw : k_pre, h1, ParamRole::wk, b);
  if (b.cf.qk_norm) norm_heads(k_pre, a.k_norm, a.k_raw, b.w.k_norm, b);
}

// q as project_q, and the chunk's K = rope(h1 Wkᵀ + b_k), V = h1 Wvᵀ + b_v into the store's rows
// [p, p+c): one GEMM where the weights allow (fused_qkv), the biases added to its output, RoPE then
// working on its q and k columns in place (with per-head norms, on normed copies of them).
void project_qkv(LayerActivations& a, const Tensor& h1, const BlockCall& b) {
  const LlamaConfig& cf = b.cf;
  const int64_t B = b.B, c = b.c, p = b.p;
  const Tensor keys = b.kv.keys(b.layer, p, p + c), values = b.kv.values(b.layer, p, p + c);
  if (const Tensor w_qkv = fused_qkv_weight(b); w_qkv.data) {
    const Tensor qkv = b.scratch.alloc(b.dt, {b.N, cf.q_dim() + 2 * cf.kv_dim()});
    linear_forward(qkv, h1, w_qkv);
    if (b.w.q_bias.data) bias_forward(qkv, qkv, stacked_qkv(b.w.q_bias, b.w.k_bias, b.w.v_bias));
    const Tensor q_cols = head_columns(qkv, 0, B, c, b.H, b.D), k_cols = head_columns(qkv, cf.q_dim(), B, c, b.Hkv, b.D);
    Tensor q = q_cols, k = k_cols;
    if (cf.qk_norm) {  // the norm reads packed rows: the raw projections are copied out and kept
      copy_heads(a.q_raw.view({B, c, b.H, b.D}), q_cols);
      copy_heads(a.k_raw.view({B, c, b.Hkv, b.D}), k_cols);
      q = b.scratch.alloc(b.dt, {B, c, b.H, b.D});
      k = b.scratch.alloc(b.dt, {B, c, b.Hkv, b.D});
      norm_heads(q, a.q_norm, a.q_raw, b.w.q_norm, b);
      norm_heads(k, a.k_norm, a.k_raw, b.w.k_norm, b);
    }
    rope_chunk(a.q, q, b.ctx, false);
    rope_chunk(k, k, b.ctx, false);
    copy_heads(keys, k);
    copy_heads(values, head_columns(qkv, cf.q_dim() + cf.kv_dim(), B, c, b.Hkv, b.D));
    return;
  }
  project_q(a, h1, b);
  const Tensor k_pre = b.scratch.alloc(b.dt, {b.N, cf.kv_dim()});
  project_k(k_pre, a, h1, b);
  const Tensor k = k_pre.view({B, b.ct, b.Hkv, b.D});
  rope_rows(k, k, b, false);
  store_rows(keys, k, b);
  const Tensor v = b.scratch.alloc(b.dt, {b.N, cf.kv_dim()});
  block_linear_forward(v, h1, ParamRole::wv, b);
  store_rows(values, v.view({B, b.ct, b.Hkv, b.D}), b);
}

// attn, lse = attention(q, K[0, p+c), V[0, p+c)) against the store; a prefill that saves them for the
// reverse sweep's recompute (kv_store.h, saved attention outputs) writes them there too.
void attend(LayerActivations& a, const BlockCall& b) {
  const int64_t p = b.p, c = b.c;
  b.kv.attend_forward(b.layer, p, p + c, a.attn, a.attn_saved, a.q, attention_scale(b), b.scratch, b.ctx.doc_starts,
                      b.ctx.first_keys);
  if (b.kv.has_outputs()) {
    copy_convert(b.kv.outputs(b.layer, p, p + c), a.attn);
    copy_convert(b.kv.output_lse(b.layer, p, p + c), a.attn_saved.lse.view({b.B * b.Ha, c}));
  }
}

// attn, lse of the chunk as the prefill saved them (the recompute then needs no K, V).
void read_saved_attention(LayerActivations& a, const BlockCall& b) {
  const int64_t p = b.p, c = b.c;
  CW_CHECK(p + c <= b.kv.outputs_written(), "layer {}: saved attention outputs of tokens [{}, {}) were not written "
           "by a prefill (it reached {})", b.layer, p, p + c, b.kv.outputs_written());
  copy_convert(a.attn, b.kv.outputs(b.layer, p, p + c));
  copy_convert(a.attn_saved.lse.view({b.B * b.Ha, c}), b.kv.output_lse(b.layer, p, p + c));
}

// x_mid = x_in + (attn Woᵀ + b_o), the bias added once, to the rank's rows of the sum over the
// ranks; with post-norms x_mid = x_in + rmsnorm(attn Woᵀ + b_o; attn_post_norm), its input kept in
// a.attn_out.
// Under context parallelism attn first comes back to the rank's tokens (to_tokens) into a.attn_rows.
void project_out(LayerActivations& a, const Tensor& x_in, const BlockCall& b) {
  if (b.cp) b.cp->to_tokens_forward(a.attn, a.attn_rows.view({b.B, b.ct, b.H, b.D}));
  PartialOutput o(b);
  block_linear_forward(o.all(), a.attn_rows, ParamRole::wo, b);
  const Tensor o_rows = o.sum_rows();
  if (b.w.o_bias.data) bias_forward(o_rows, o_rows, b.w.o_bias);
  residual_forward(a.x_mid, x_in,
                   b.cf.post_norms ? post_norm(a.attn_out, a.attn_post, o_rows, b.w.attn_post_norm, b) : o_rows);
}

// d_attn = d(attn Woᵀ) Wo [N, q_dim], d(attn Woᵀ) being d(x_mid) or, with post-norms, what the
// norm's backward gives of it; Wo's gradient (and b_o's and the post-norm's, the rank's rows' share
// under sequence parallelism) accumulates.
Tensor project_out_backward(const Tensor& d_x, const LayerActivations& a, const LayerWeights& g, const BlockCall& b) {
  const Tensor d_rows = b.cf.post_norms
                            ? post_norm_backward(d_x, g.attn_post_norm, a.attn_post, a.attn_out, b.w.attn_post_norm, b)
                            : d_x;
  if (g.o_bias.data) bias_backward(g.o_bias, d_rows, b.scratch);
  const Tensor d_attn = b.scratch.alloc(b.dt, {b.N, b.cf.q_dim()});
  const OutputGrad d_o(d_rows, b);
  block_linear_backward(d_attn, g, d_o.all(), a.attn_rows, ParamRole::wo, GradMode::overwrite, b);
  return d_attn;
}

// d_q [B, ct, H, D] (the rank's rows) from d_attn [N, q_dim]; dK, dV of every key attended, [0, p+c),
// ADDED into the store. Under context parallelism d_attn goes to the rank's heads first and d_q comes
// back to its tokens (the adjoints of to_tokens and to_heads).
Tensor attend_backward(const Tensor& d_attn_rows, const LayerActivations& a, const BlockCall& b) {
  const Tensor d_attn_tokens = d_attn_rows.view({b.B, b.ct, b.H, b.D});
  Tensor d_attn = d_attn_tokens;
  if (b.cp) {
    d_attn = b.scratch.alloc(b.dt, {b.B, b.c, b.Ha, b.D});
    b.cp->to_tokens_backward(d_attn_tokens, d_attn);
  }
  const Tensor d_q = b.scratch.alloc(b.dt, {b.B, b.c, b.Ha, b.D});
  b.kv.attend_backward(b.layer, b.p, b.p + b.c, d_q, d_attn, a.attn_saved, a.q, a.attn, attention_scale(b), b.scratch,
                       b.ctx.doc_starts, b.ctx.first_keys);
  if (!b.cp) return d_q;
  const Tensor d_q_rows = b.scratch.alloc(b.dt, {b.B, b.ct, b.H, b.D});
  b.cp->to_heads_backward(d_q, d_q_rows);
  return d_q_rows;
}

// The store's K or V gradient of the chunk's own rows [p, p+c) (`store`) as the rank's rows
// [B, ct, Hkv, D]: as they are, or under context parallelism back from the rank's heads to its
// tokens (to_heads' adjoint). Where several ranks hold a K/V head (replicas) the adjoint sums their
// gradients: that runs in the store's accumulation dtype, so the sum is rounded to the compute dtype
// once, as one process rounds its accumulator.
void read_store_grad(const Tensor& rows, const Tensor& store, const BlockCall& b) {
  if (!b.cp) return copy_convert(rows, store);
  const bool replicas = b.Hkva * b.cp->size() > b.Hkv;
  const DType exchanged = replicas ? store.dtype : b.dt;
  const Tensor heads = b.scratch.alloc(exchanged, {b.B, b.c, b.Hkva, b.D});
  copy_convert(heads, store);
  if (!replicas) return b.cp->to_heads_backward(heads, rows);
  const Tensor summed = b.scratch.alloc(exchanged, {b.B, b.ct, b.Hkv, b.D});
  b.cp->to_heads_backward(heads, summed);
  copy_convert(rows, summed);
}

// The gradients of the projections' outputs, before RoPE: of q from d_q, of the chunk's own K and V
// from the store's accumulators over [p, p+c) (its local part plus what later chunks added). Fused:
// side by side in one [N, q_dim + 2 kv_dim] tensor, as the fused GEMM's output was.
struct QkvGrad {
  Tensor w_qkv, g_qkv;  // the fused weight and its gradient (or undefined: all frozen)
  Tensor d_qkv;         // fused
  Tensor d_q, d_k, d_v;  // three GEMMs
  bool fused() const { return d_qkv.data != nullptr; }
};

// Whether three gradients (or biases' gradients) allow the fused backward: back to back, or all frozen.
bool fusable_grads(const Tensor& gq, const Tensor& gk, const Tensor& gv) {
  return stacked_qkv(gq, gk, gv).data || (!gq.data && !gk.data && !gv.data);
}

QkvGrad qkv_grad(const Tensor& d_q, const LayerWeights& g, const LayerActivations& a, const BlockCall& b) {
  const LlamaConfig& cf = b.cf;
  const int64_t B = b.B, c = b.c, p = b.p;
  QkvGrad d{fused_qkv_weight(b), stacked_qkv(g.wq, g.wk, g.wv), {}, d_q, {}, {}};
  // With per-head norms, RoPE's backward and then the norm's run in place on packed q and k rows.
  auto unnorm = [&](const Tensor& d_heads, bool query) {
    if (!cf.qk_norm) return;
    norm_heads_backward(d_heads, query ? g.q_norm : g.k_norm, query ? a.q_norm : a.k_norm, query ? a.q_raw : a.k_raw,
                        query ? b.w.q_norm : b.w.k_norm, b);
  };
  // Fused where the gradients lie back to back too (or are all frozen); otherwise three GEMMs, which
  // need nothing from how the forward projected.
  if (d.w_qkv.data && fusable_grads(g.wq, g.wk, g.wv) && fusable_grads(g.q_bias, g.k_bias, g.v_bias)) {
    d.d_qkv = b.scratch.alloc(b.dt, {b.N, cf.q_dim() + 2 * cf.kv_dim()});
    const Tensor q_cols = head_columns(d.d_qkv, 0, B, c, b.H, b.D);
    const Tensor k_cols = head_columns(d.d_qkv, cf.q_dim(), B, c, b.Hkv, b.D);
    copy_heads(head_columns(d.d_qkv, cf.q_dim() + cf.kv_dim(), B, c, b.Hkv, b.D), b.kv.d_values(b.layer, p, p + c));
    if (!cf.qk_norm) {
      rope_chunk(q_cols, d_q, b.ctx, true);
      copy_heads(k_cols, b.kv.d_keys(b.layer, p, p + c));
      rope_chunk(k_cols, k_cols, b.ctx, true);
      return d;
    }
    const Tensor d_k = b.scratch.alloc(b.dt, {B, c, b.Hkv, b.D});
    copy_convert(d_k, b.kv.d_keys(b.layer, p, p + c));
    rope_chunk(d_q, d_q, b.ctx, true);
    rope_chunk(d_k, d_k, b.ctx, true);
    unnorm(d_q, true);
    unnorm(d_k, false);
    copy_heads(q_cols, d_q);
    copy_heads(k_cols, d_k);
    return d;
  }
  d.d_k = b.scratch.alloc(b.dt, {B, b.ct, b.Hkv, b.D});
  d.d_v = b.scratch.alloc(b.dt, {B, b.ct, b.Hkv, b.D});
  read_store_grad(d.d_k, b.kv.d_keys(b.layer, p, p + c), b);
  read_store_grad(d.d_v, b.kv.d_values(b.layer, p, p + c), b);
  rope_rows(d_q, d_q, b, true);
  rope_rows(d.d_k, d.d_k, b, true);
  unnorm(d_q, true);
  unnorm(d.d_k, false);
  return d;
}

// d_h1 [N, C] (overwritten) through the Q/K/V projections; their gradients accumulate. The relayed
// K/V gradient enters x through W_k, W_v (frozen or not) and their adapters.
void project_qkv_backward(const Tensor& d_h1, const QkvGrad& d, const Tensor& h1, const LayerWeights& g,
                          const BlockCall& b) {
  if (d.fused()) {
    if (g.q_bias.data) bias_backward(stacked_qkv(g.q_bias, g.k_bias, g.v_bias), d.d_qkv, b.scratch);
    return linear_backward(d_h1, d.g_qkv, d.d_qkv, h1, d.w_qkv, GradMode::overwrite);
  }
  const int64_t q_dim = b.cf.q_dim(), kv_dim = b.cf.kv_dim();
  block_linear_backward(d_h1, g, d.d_q.view({b.N, q_dim}), h1, ParamRole::wq, GradMode::overwrite, b);
  block_linear_backward(d_h1, g, d.d_k.view({b.N, kv_dim}), h1, ParamRole::wk, GradMode::accumulate, b);
  block_linear_backward(d_h1, g, d.d_v.view({b.N, kv_dim}), h1, ParamRole::wv, GradMode::accumulate, b);
}

// ---- MLP half: m = (silu(h2 W_gateᵀ) * h2 W_upᵀ) W_downᵀ (gelu in place of silu: Gemma 2) ----

// Rows [row0, row0 + rows) of the MLP: gate, up and act for those rows into the given [rows, F] tensors.
void mlp_rows_forward(const Tensor& gate, const Tensor& up, const Tensor& act, const Tensor& h2_rows,
                      const BlockCall& b, int64_t row0 = 0) {
  block_linear_forward(gate, h2_rows, ParamRole::w_gate, b, row0);
  block_linear_forward(up, h2_rows, ParamRole::w_up, b, row0);
  if (b.cf.mlp_gate == MlpGate::gelu_tanh) geglu_forward(act, gate, up);
  else swiglu_forward(act, gate, up);
}

// Backward of the MLP rows given their gate/up/act: d_h rows (overwritten) from d_m rows; weight
// gradients accumulate. act and h2_rows may be undefined where the linears reading them are frozen
// without adapters (MlpKept::products): d_x needs only the weights.
void mlp_rows_backward(const Tensor& d_h_rows, const LayerWeights& g, const Tensor& d_m_rows, const Tensor& gate,
                       const Tensor& up, const Tensor& act, const Tensor& h2_rows, const BlockCall& b,
                       int64_t row0 = 0) {
  Arena& s = b.scratch;
  ArenaScope scope(s);
  const int64_t rows = gate.size(0), F = gate.size(1);
  const Tensor d_act = s.alloc(gate.dtype, {rows, F});
  block_linear_backward(d_act, g, d_m_rows, act, ParamRole::w_down, GradMode::overwrite, b, row0);
  const Tensor d_gate = s.alloc(gate.dtype, {rows, F}), d_up = s.alloc(gate.dtype, {rows, F});
  if (b.cf.mlp_gate == MlpGate::gelu_tanh) geglu_backward(d_gate, d_up, d_act, gate, up, GradMode::overwrite);
  else swiglu_backward(d_gate, d_up, d_act, gate, up, GradMode::overwrite);
  block_linear_backward(d_h_rows, g, d_gate, h2_rows, ParamRole::w_gate, GradMode::overwrite, b, row0);
  block_linear_backward(d_h_rows, g, d_up, h2_rows, ParamRole::w_up, GradMode::accumulate, b, row0);
}

// Row shards [bounds[i], bounds[i+1]) of the tiled MLP's N rows.
std::vector<int64_t> row_shards(const BlockCall& b) {
  const int64_t shards = resolve_mlp_shards(b.ctx.mlp_shards, b.cf, b.N);
  std::vector<int64_t> bounds;
  for (int64_t i = 0; i <= shards; ++i) bounds.push_back(b.N * i / shards);
  return bounds;
}

// m [N, C] = the MLP of h2 [N, C]. How it runs follows what the layer keeps of it (MlpKept):
//   all, products: gate, up (and act) of all rows at once into `a` (act in scratch with products);
//   input (tiled or selective recompute): shard by shard, one shard's [rows, F] intermediates in
//   scratch at a time.
// m undefined: a recompute for the backward alone, which needs only what `a` keeps (W_down's product
// feeds only x_out; kept without gate and up, the backward computes them shard by shard).
void mlp_forward(const Tensor& m, const Tensor& h2, LayerActivations& a, const BlockCall& b) {
  Arena& s = b.scratch;
  if (a.gate.data) {
    const Tensor act = a.act.data ? a.act : s.alloc(b.dt, {b.N, b.F});
    mlp_rows_forward(a.gate, a.up, act, h2, b);
    if (m.data) block_linear_forward(m, act, ParamRole::w_down, b);
    return;
  }
  if (!m.data) return;
  const std::vector<int64_t> bounds = row_shards(b);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    ArenaScope shard_scope(s);
    const int64_t r0 = bounds[i], rows = bounds[i + 1] - bounds[i];
    const Tensor gate = s.alloc(b.dt, {rows, b.F}), up = s.alloc(b.dt, {rows, b.F}), act = s.alloc(b.dt, {rows, b.F});
    mlp_rows_forward(gate, up, act, h2.slice(0, r0, rows), b, r0);
    block_linear_forward(m.slice(0, r0, rows), act, ParamRole::w_down, b, r0);
  }
}

// d_h2 [N, C] (overwritten) from d_m [N, C]; weight gradients accumulate. Kept without gate and up,
// each shard's are recomputed from the kept h2 just before its backward.
void mlp_backward(const Tensor& d_h2, const LayerWeights& g, const Tensor& d_m, const Tensor& h2,
                  const LayerActivations& a, const BlockCall& b) {
  if (a.gate.data) return mlp_rows_backward(d_h2, g, d_m, a.gate, a.up, a.act, h2, b);
  Arena& s = b.scratch;
  const std::vector<int64_t> bounds = row_shards(b);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    ArenaScope shard_scope(s);
    const int64_t r0 = bounds[i], rows = bounds[i + 1] - bounds[i];
    const Tensor gate = s.alloc(b.dt, {rows, b.F}), up = s.alloc(b.dt, {rows, b.F}), act = s.alloc(b.dt, {rows, b.F});
    const Tensor h2_rows = h2.slice(0, r0, rows);
    mlp_rows_forward(gate, up, act, h2_rows, b, r0);
    mlp_rows_backward(d_h2.slice(0, r0, rows), g, d_m.slice(0, r0, rows), gate, up, act, h2_rows, b, r0);
  }
}
}  // namespace

void block_forward(const Tensor& x_out, LayerActivations* keep, const Tensor& x_in, const LayerWeights& w,
                   KVStore& kv, int layer, const BlockContext& ctx) {
  const BlockCall b(ctx, w, kv, layer, x_in.dtype);
  check_shape(x_in, {b.R, b.C}, "block input");
  const bool output = x_out.data != nullptr;
  CW_CHECK(output || keep, "layer {}: a block forward that keeps nothing must write its output", layer);
  if (output) check_shape(x_out, {b.R, b.C}, "block output");
  Arena& s = ctx.scratch;
  ArenaScope scope(s);
  // Keeping nothing (a prefill), the activations are scratch for the call; a tiled MLP keeps only h2.
  LayerActivations local;
  const MlpKept transient = resolve_mlp_shards(ctx.mlp_shards, b.cf, b.N) == 1 ? MlpKept::all : MlpKept::input;
  LayerActivations& a =
      keep ? *keep : (local = LayerActivations::allocate(s, b.cf, b.B, b.c, b.dt, transient, b.tp, b.cp));

  // Attention half: h1 = rmsnorm(x_in); q, K, V projected, RoPE on q and K, the chunk's K, V into the
  // store; attn = attention(q, K[0, p+c), V[0, p+c)); x_mid = x_in + attn Woᵀ.
  {
    const NormedInput h1(a.h1, a.norm1, x_in, w.attn_norm, b);
    if (ctx.attention_from_store) {  // the reverse sweep's recompute: the prefill saved attn and lse
      project_q(a, h1.all(), b);
      // The norm's backward of the chunk's own k reads its raw projection and statistics.
      if (b.cf.qk_norm) project_k(s.alloc(b.dt, {b.N, b.cf.kv_dim()}), a, h1.all(), b);
      read_saved_attention(a, b);
    } else {
      project_qkv(a, h1.all(), b);
      attend(a, b);
    }
  }
  project_out(a, x_in, b);

  // MLP half: h2 = rmsnorm(x_mid); x_out = x_mid + mlp(h2), or with post-norms
  // x_mid + rmsnorm(mlp(h2); mlp_post_norm). Kept without h2 and act (MlpKept::products), both are
  // scratch here.
  const Tensor h2_kept = a.h2.data ? a.h2 : s.alloc(b.dt, {tp_regathers(b.tp) ? b.R : b.N, b.C});
  NormedInput h2(h2_kept, a.norm2, a.x_mid, w.mlp_norm, b);
  // A recompute for the backward alone: the post-norm's backward reads the MLP's output; else none.
  if (!output && !b.cf.post_norms) return mlp_forward(Tensor{}, h2.all(), a, b);
  PartialOutput m(b);
  mlp_forward(m.all(), h2.all(), a, b);
  h2.release();
  if (!b.cf.post_norms) return residual_forward(x_out, a.x_mid, m.sum_rows());
  const Tensor normed = post_norm(a.mlp_out, a.mlp_post, m.sum_rows(), w.mlp_post_norm, b);
  if (output) residual_forward(x_out, a.x_mid, normed);
}

void block_backward(const Tensor& d_x, const LayerWeights& g, const LayerActivations& a, const Tensor& x_in,
                    const LayerWeights& w, KVStore& kv, int layer, const BlockContext& ctx) {
  const BlockCall b(ctx, w, kv, layer, x_in.dtype);
  check_shape(d_x, {b.R, b.C}, "block d_x");
  ArenaScope scope(ctx.scratch);

  // MLP half, in reverse. d_x holds d(x_out); the residual passes it to x_mid unchanged, and
  // d(x_mid) += rmsnorm's backward of d(h2) = mlp_backward(d(x_out)) (with post-norms, of the MLP
  // output's gradient that the post-norm's backward gives).
  const double offset = b.cf.norm_weight_offset;
  {
    const Tensor d_m_rows =
        b.cf.post_norms ? post_norm_backward(d_x, g.mlp_post_norm, a.mlp_post, a.mlp_out, w.mlp_post_norm, b) : d_x;
    OutputGrad d_m(d_m_rows, b);
    NormedInputGrad h2(a.h2, b);
    mlp_backward(h2.d_all(), g, d_m.all(), h2.input(), a, b);
    d_m.release();
    h2.release_input();
    rmsnorm_backward(d_x, g.mlp_norm, h2.d_rows(), a.norm2, a.x_mid, w.mlp_norm, GradMode::accumulate, ctx.scratch,
                     offset);
  }

  // Attention half, in reverse: d_attn through Wo (and the post-norm), the attention's backward
  // (adding dK, dV of keys [0, p+c) into the store), the chunk's own K/V gradient read back from the
  // store, all three through RoPE and the projections into d(h1); d(x_in) = d(x_mid) + rmsnorm's
  // backward of d(h1).
  const Tensor d_attn = project_out_backward(d_x, a, g, b);
  const Tensor d_q = attend_backward(d_attn, a, b);
  const QkvGrad d_qkv = qkv_grad(d_q, g, a, b);
  NormedInputGrad h1(a.h1, b);
  project_qkv_backward(h1.d_all(), d_qkv, h1.input(), g, b);
  h1.release_input();
  rmsnorm_backward(d_x, g.attn_norm, h1.d_rows(), a.norm1, x_in, w.attn_norm, GradMode::accumulate, ctx.scratch,
                   offset);
}

}  // namespace cw
