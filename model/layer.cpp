#include "model/layer.h"

#include "engine/ops/linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cw {

int64_t resolve_mlp_shards(int64_t requested, const LlamaConfig& cf, int64_t rows) {
  CW_CHECK(requested >= 0, "mlp_shards must be >= 0 (0: automatic), got {}", requested);
  const int64_t n = requested == 0 ? (cf.intermediate_size + cf.hidden_size - 1) / cf.hidden_size : requested;
  return std::max<int64_t>(1, std::min(n, rows));
}

LayerActivations LayerActivations::allocate(Arena& arena, const LlamaConfig& cf, int64_t B, int64_t c, DType dt,
                                            bool keep_mlp) {
  const int64_t N = B * c, C = cf.hidden_size, F = cf.intermediate_size, H = cf.num_attention_heads, D = cf.head_dim;
  const DType acc = accum_dtype(dt);
  LayerActivations a;
  a.h1 = arena.alloc(dt, {N, C});
  a.norm1.rstd = arena.alloc(acc, {N});
  a.q = arena.alloc(dt, {B, c, H, D});
  a.attn = arena.alloc(dt, {B, c, H, D});
  a.attn_saved.lse = arena.alloc(acc, {B, H, c});
  a.x_mid = arena.alloc(dt, {N, C});
  a.h2 = arena.alloc(dt, {N, C});
  a.norm2.rstd = arena.alloc(acc, {N});
  if (keep_mlp) {
    a.gate = arena.alloc(dt, {N, F});
    a.up = arena.alloc(dt, {N, F});
    a.act = arena.alloc(dt, {N, F});
  }
  return a;
}

size_t LayerActivations::bytes(const LlamaConfig& cf, int64_t B, int64_t c, DType dt, bool keep_mlp) {
  const int64_t N = B * c;
  const size_t e = dtype_size(dt), a = dtype_size(accum_dtype(dt));
  const int64_t mlp = keep_mlp ? 3 * cf.intermediate_size : 0;
  return static_cast<size_t>(N) * (e * static_cast<size_t>(3 * cf.hidden_size + 2 * cf.q_dim() + mlp) +
                                   a * static_cast<size_t>(2 + cf.num_attention_heads));
}

namespace {
// Rows [r0, r1) of the MLP: gate, up and act for those rows into the given [rows, F] tensors.
void mlp_rows_forward(const Tensor& gate, const Tensor& up, const Tensor& act, const Tensor& h2_rows,
                      const LayerWeights& w) {
  linear_forward(gate, h2_rows, w.w_gate);
  linear_forward(up, h2_rows, w.w_up);
  swiglu_forward(act, gate, up);
}

// Backward of the MLP rows given their gate/up/act: d_h rows (overwritten) from d_out rows;
// weight gradients accumulate.
void mlp_rows_backward(const Tensor& d_h_rows, const LayerWeights& g, const Tensor& d_out_rows, const Tensor& gate,
                       const Tensor& up, const Tensor& act, const Tensor& h2_rows, const LayerWeights& w, Arena& s) {
  ArenaScope scope(s);
  const int64_t rows = gate.size(0), F = gate.size(1);
  Tensor d_act = s.alloc(gate.dtype, {rows, F});
  linear_backward(d_act, g.w_down, d_out_rows, act, w.w_down, GradMode::overwrite);
  Tensor d_gate = s.alloc(gate.dtype, {rows, F}), d_up = s.alloc(gate.dtype, {rows, F});
  swiglu_backward(d_gate, d_up, d_act, gate, up, GradMode::overwrite);
  linear_backward(d_h_rows, g.w_gate, d_gate, h2_rows, w.w_gate, GradMode::overwrite);
  linear_backward(d_h_rows, g.w_up, d_up, h2_rows, w.w_up, GradMode::accumulate);
}

// Row shards [bounds[i], bounds[i+1]) of N rows.
std::vector<int64_t> row_shards(int64_t N, int64_t shards) {
  std::vector<int64_t> b;
  for (int64_t i = 0; i <= shards; ++i) b.push_back(N * i / shards);
  return b;
}
}  // namespace

void block_forward(const Tensor& x_out, LayerActivations* keep, const Tensor& x_in, const LayerWeights& w,
                   KVStore& kv, int layer, const BlockContext& ctx) {
  const LlamaConfig& cf = ctx.config;
  const int64_t B = ctx.B, c = ctx.c, p = ctx.pos0, N = B * c, C = cf.hidden_size, F = cf.intermediate_size;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  const DType dt = x_in.dtype;
  check_shape(x_in, {N, C}, "block input");
  check_shape(x_out, {N, C}, "block output");
  Arena& s = ctx.scratch;
  ArenaScope scope(s);
  const int64_t shards = resolve_mlp_shards(ctx.mlp_shards, cf, N);
  LayerActivations local;
  LayerActivations& a = keep ? *keep : (local = LayerActivations::allocate(s, cf, B, c, dt, shards == 1));

  // Attention half.
  const bool from_saved = ctx.attention_from_store;
  rmsnorm_forward(a.h1, a.norm1, x_in, w.attn_norm, cf.rms_norm_eps);
  Tensor q_pre = s.alloc(dt, {N, cf.q_dim()});
  linear_forward(q_pre, a.h1, w.wq);
  rope_forward(a.q, q_pre.view({B, c, H, D}), ctx.rope_cos, ctx.rope_sin, p);
  if (from_saved) {
    CW_CHECK(p + c <= kv.outputs_written(), "layer {}: saved attention outputs of tokens [{}, {}) were not written by "
             "a prefill (it reached {})", layer, p, p + c, kv.outputs_written());
    copy_convert(a.attn, kv.outputs(layer, p, p + c));
    copy_convert(a.attn_saved.lse.view({B * H, c}), kv.output_lse(layer, p, p + c));
  } else {
    Tensor k_pre = s.alloc(dt, {N, cf.kv_dim()});
    linear_forward(k_pre, a.h1, w.wk);
    Tensor k_rot = k_pre.view({B, c, Hkv, D});
    rope_forward(k_rot, k_rot, ctx.rope_cos, ctx.rope_sin, p);
    copy_convert(kv.keys(layer, p, p + c), k_rot);
    Tensor v = s.alloc(dt, {N, cf.kv_dim()});
    linear_forward(v, a.h1, w.wv);
    copy_convert(kv.values(layer, p, p + c), v.view({B, c, Hkv, D}));
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    attention_forward(a.attn, a.attn_saved, a.q, kv.keys(layer, 0, p + c), kv.values(layer, 0, p + c), scale, s);
    if (kv.has_outputs()) {  // the prefill saves them for the recompute
      copy_convert(kv.outputs(layer, p, p + c), a.attn);
      copy_convert(kv.output_lse(layer, p, p + c), a.attn_saved.lse.view({B * H, c}));
    }
  }
  Tensor o = s.alloc(dt, {N, C});
  linear_forward(o, a.attn.view({N, cf.q_dim()}), w.wo);
  residual_forward(a.x_mid, x_in, o);

  // MLP half.
  rmsnorm_forward(a.h2, a.norm2, a.x_mid, w.mlp_norm, cf.rms_norm_eps);
  Tensor m = s.alloc(dt, {N, C});
  if (a.gate.data) {
    mlp_rows_forward(a.gate, a.up, a.act, a.h2, w);
    linear_forward(m, a.act, w.w_down);
  } else {
    // Tiled: one shard's [rows, F] intermediates at a time.
    const std::vector<int64_t> b = row_shards(N, shards);
    for (size_t i = 0; i + 1 < b.size(); ++i) {
      ArenaScope shard_scope(s);
      const int64_t r0 = b[i], rows = b[i + 1] - b[i];
      Tensor gate = s.alloc(dt, {rows, F}), up = s.alloc(dt, {rows, F}), act = s.alloc(dt, {rows, F});
      mlp_rows_forward(gate, up, act, a.h2.slice(0, r0, rows), w);
      linear_forward(m.slice(0, r0, rows), act, w.w_down);
    }
  }
  residual_forward(x_out, a.x_mid, m);
}

void block_backward(const Tensor& d_x, const LayerWeights& g, const LayerActivations& a, const Tensor& x_in,
                    const LayerWeights& w, KVStore& kv, int layer, const BlockContext& ctx) {
  const LlamaConfig& cf = ctx.config;
  const int64_t B = ctx.B, c = ctx.c, p = ctx.pos0, N = B * c, C = cf.hidden_size, F = cf.intermediate_size;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  const DType dt = x_in.dtype;
  check_shape(d_x, {N, C}, "block d_x");
  Arena& s = ctx.scratch;
  ArenaScope scope(s);

  // MLP half, in reverse. d_x holds d(x_out); the residual passes it to x_mid unchanged.
  Tensor d_h = s.alloc(dt, {N, C});
  if (a.gate.data) {
    mlp_rows_backward(d_h, g, d_x, a.gate, a.up, a.act, a.h2, w, s);
  } else {
    // Tiled: recompute each shard's gate/up/act from the kept h2, then its backward.
    const std::vector<int64_t> b = row_shards(N, resolve_mlp_shards(ctx.mlp_shards, cf, N));
    for (size_t i = 0; i + 1 < b.size(); ++i) {
      ArenaScope shard_scope(s);
      const int64_t r0 = b[i], rows = b[i + 1] - b[i];
      Tensor gate = s.alloc(dt, {rows, F}), up = s.alloc(dt, {rows, F}), act = s.alloc(dt, {rows, F});
      const Tensor h2_rows = a.h2.slice(0, r0, rows);
      mlp_rows_forward(gate, up, act, h2_rows, w);
      mlp_rows_backward(d_h.slice(0, r0, rows), g, d_x.slice(0, r0, rows), gate, up, act, h2_rows, w, s);
    }
  }
  rmsnorm_backward(d_x, g.mlp_norm, d_h, a.norm2, a.x_mid, w.mlp_norm, GradMode::accumulate, s);  // now d(x_mid)

  // Attention half, in reverse.
  Tensor d_attn = s.alloc(dt, {N, cf.q_dim()});
  linear_backward(d_attn, g.wo, d_x, a.attn.view({N, cf.q_dim()}), w.wo, GradMode::overwrite);
  Tensor d_q = s.alloc(dt, {B, c, H, D});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  attention_backward(d_q, kv.d_keys(layer, 0, p + c), kv.d_values(layer, 0, p + c), d_attn.view({B, c, H, D}),
                     a.attn_saved, a.q, kv.keys(layer, 0, p + c), kv.values(layer, 0, p + c), a.attn, scale,
                     GradMode::overwrite, s);
  // The chunk's own K/V gradient: local part plus what later chunks added, all in the accumulator.
  Tensor d_k = s.alloc(dt, {B, c, Hkv, D}), d_v = s.alloc(dt, {B, c, Hkv, D});
  copy_convert(d_k, kv.d_keys(layer, p, p + c));
  copy_convert(d_v, kv.d_values(layer, p, p + c));
  rope_backward(d_q, d_q, ctx.rope_cos, ctx.rope_sin, p, GradMode::overwrite);
  rope_backward(d_k, d_k, ctx.rope_cos, ctx.rope_sin, p, GradMode::overwrite);
  linear_backward(d_h, g.wq, d_q.view({N, cf.q_dim()}), a.h1, w.wq, GradMode::overwrite);
  linear_backward(d_h, g.wk, d_k.view({N, cf.kv_dim()}), a.h1, w.wk, GradMode::accumulate);
  linear_backward(d_h, g.wv, d_v.view({N, cf.kv_dim()}), a.h1, w.wv, GradMode::accumulate);
  rmsnorm_backward(d_x, g.attn_norm, d_h, a.norm1, x_in, w.attn_norm, GradMode::accumulate, s);  // now d(x_in)
}

}  // namespace cw
