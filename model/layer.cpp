#include "model/layer.h"

#include "engine/ops/linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"

#include <cmath>

namespace cw {

LayerActivations LayerActivations::allocate(Arena& arena, const LlamaConfig& cf, int64_t B, int64_t c, DType dt) {
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
  a.gate = arena.alloc(dt, {N, F});
  a.up = arena.alloc(dt, {N, F});
  a.act = arena.alloc(dt, {N, F});
  return a;
}

size_t LayerActivations::bytes(const LlamaConfig& cf, int64_t B, int64_t c, DType dt) {
  const int64_t N = B * c;
  const size_t e = dtype_size(dt), a = dtype_size(accum_dtype(dt));
  return static_cast<size_t>(N) * (e * static_cast<size_t>(3 * cf.hidden_size + 2 * cf.q_dim() + 3 * cf.intermediate_size) +
                                   a * static_cast<size_t>(2 + cf.num_attention_heads));
}

void block_forward(const Tensor& x_out, LayerActivations* keep, const Tensor& x_in, const LayerWeights& w,
                   KVStore& kv, int layer, const BlockContext& ctx) {
  const LlamaConfig& cf = ctx.config;
  const int64_t B = ctx.B, c = ctx.c, p = ctx.pos0, N = B * c, C = cf.hidden_size;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  const DType dt = x_in.dtype;
  check_shape(x_in, {N, C}, "block input");
  check_shape(x_out, {N, C}, "block output");
  Arena& s = ctx.scratch;
  ArenaScope scope(s);
  LayerActivations local;
  LayerActivations& a = keep ? *keep : (local = LayerActivations::allocate(s, cf, B, c, dt));

  // Attention half.
  rmsnorm_forward(a.h1, a.norm1, x_in, w.attn_norm, cf.rms_norm_eps);
  Tensor q_pre = s.alloc(dt, {N, cf.q_dim()});
  linear_forward(q_pre, a.h1, w.wq);
  rope_forward(a.q, q_pre.view({B, c, H, D}), ctx.rope_cos, ctx.rope_sin, p);
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
  Tensor o = s.alloc(dt, {N, C});
  linear_forward(o, a.attn.view({N, cf.q_dim()}), w.wo);
  residual_forward(a.x_mid, x_in, o);

  // MLP half.
  rmsnorm_forward(a.h2, a.norm2, a.x_mid, w.mlp_norm, cf.rms_norm_eps);
  linear_forward(a.gate, a.h2, w.w_gate);
  linear_forward(a.up, a.h2, w.w_up);
  swiglu_forward(a.act, a.gate, a.up);
  Tensor m = s.alloc(dt, {N, C});
  linear_forward(m, a.act, w.w_down);
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
  Tensor d_act = s.alloc(dt, {N, F});
  linear_backward(d_act, g.w_down, d_x, a.act, w.w_down, GradMode::overwrite);
  Tensor d_gate = s.alloc(dt, {N, F}), d_up = s.alloc(dt, {N, F});
  swiglu_backward(d_gate, d_up, d_act, a.gate, a.up, GradMode::overwrite);
  Tensor d_h = s.alloc(dt, {N, C});
  linear_backward(d_h, g.w_gate, d_gate, a.h2, w.w_gate, GradMode::overwrite);
  linear_backward(d_h, g.w_up, d_up, a.h2, w.w_up, GradMode::accumulate);
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
