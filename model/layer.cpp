#include "model/layer.h"

#include "engine/ops/linear.h"
#include "engine/ops/lora_linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "model/lora.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <vector>

namespace cw {

namespace {
std::atomic<bool> g_fused_qkv{true};
}  // namespace

void set_fused_qkv(bool on) { g_fused_qkv.store(on); }
bool fused_qkv() { return g_fused_qkv.load(); }

namespace {
// The rule, stated once: the switch on, no tensor parallelism (each rank holds its own heads' rows of
// the three weights), no adapter on q, k or v (each adds its own low-rank term to one projection).
bool qkv_fusable(bool tensor_parallel, bool qkv_adapters) { return fused_qkv() && !tensor_parallel && !qkv_adapters; }
}  // namespace

bool fuses_qkv(const LoraConfig* lora, const TensorParallelGroup* tp) {
  bool qkv_adapters = false;
  if (lora && lora->enabled())
    for (ParamRole r : lora->target_roles())
      qkv_adapters = qkv_adapters || r == ParamRole::wq || r == ParamRole::wk || r == ParamRole::wv;
  return qkv_fusable(tp != nullptr, qkv_adapters);
}

int64_t resolve_mlp_shards(int64_t requested, const LlamaConfig& cf, int64_t rows) {
  CW_CHECK(requested >= 0, "mlp_shards must be >= 0 (0: automatic), got {}", requested);
  const int64_t n = requested == 0 ? (cf.intermediate_size + cf.hidden_size - 1) / cf.hidden_size : requested;
  return std::max<int64_t>(1, std::min(n, rows));
}

LayerActivations LayerActivations::allocate(Arena& arena, const LlamaConfig& cf, int64_t B, int64_t c, DType dt,
                                            MlpKept mlp, const TensorParallelGroup* tp) {
  const int64_t N = B * c, C = cf.hidden_size, F = cf.intermediate_size, H = cf.num_attention_heads, D = cf.head_dim;
  const int64_t R = tp_rows(tp, N), normed_rows = tp_regathers(tp) ? R : N;
  const DType acc = accum_dtype(dt);
  LayerActivations a;
  a.h1 = arena.alloc(dt, {normed_rows, C});
  a.norm1.rstd = arena.alloc(acc, {R});
  a.q = arena.alloc(dt, {B, c, H, D});
  a.attn = arena.alloc(dt, {B, c, H, D});
  a.attn_saved.lse = arena.alloc(acc, {B, H, c});
  a.x_mid = arena.alloc(dt, {R, C});
  if (mlp != MlpKept::products) a.h2 = arena.alloc(dt, {normed_rows, C});
  a.norm2.rstd = arena.alloc(acc, {R});
  if (mlp != MlpKept::input) {
    a.gate = arena.alloc(dt, {N, F});
    a.up = arena.alloc(dt, {N, F});
    if (mlp == MlpKept::all) a.act = arena.alloc(dt, {N, F});
  }
  return a;
}

size_t LayerActivations::bytes(const LlamaConfig& cf, int64_t B, int64_t c, DType dt, MlpKept mlp,
                               const TensorParallelGroup* tp) {
  const size_t N = static_cast<size_t>(B * c), R = static_cast<size_t>(tp_rows(tp, B * c));
  const size_t normed_rows = tp_regathers(tp) ? R : N, C = static_cast<size_t>(cf.hidden_size);
  const size_t e = dtype_size(dt), a = dtype_size(accum_dtype(dt)), F = static_cast<size_t>(cf.intermediate_size);
  const size_t normed = mlp == MlpKept::products ? 1 : 2;  // h1, and h2 unless products only
  const size_t ffn = mlp == MlpKept::all ? 3 * F : mlp == MlpKept::products ? 2 * F : 0;
  return e * (normed * normed_rows * C + R * C + N * (2 * static_cast<size_t>(cf.q_dim()) + ffn)) +
         a * (2 * R + N * static_cast<size_t>(cf.num_attention_heads));
}

namespace {
// ---- The block's linears: y = x Wᵀ, or with an adapter lora_linear (engine/ops/lora_linear.h) ----

// Where a call of a block linear sits: the layer, and the call's first row within the chunk (a tiled
// MLP's shard), which with the chunk's shape keys the adapter's dropout mask.
struct LinearSite {
  const BlockContext& ctx;
  int layer;
  int64_t row0 = 0;
};

LoraAdapter adapter_call(const LoraPair& p, ParamRole linear, const LinearSite& at) {
  const LoraRuntime& lr = at.ctx.lora;
  LoraAdapter a{p.a, p.b, lr.scale, {}};
  if (lr.dropout > 0) {
    // A row-parallel linear's input is this TP rank's slice of the columns: the mask is the whole input's.
    const bool row_parallel = linear == ParamRole::wo || linear == ParamRole::w_down;
    const int64_t column0 = row_parallel && at.ctx.tp ? at.ctx.tp->rank() * p.a.size(1) : 0;
    a.dropout = {lr.dropout, lora_dropout_seed(lr.lora_seed, lr.round, at.layer, linear), at.ctx.c, at.ctx.pos0, at.row0,
                 column0, lr.sequence0};
  }
  return a;
}

// y = x Wᵀ (+ the adapter's term where w has one).
void linear_fwd(const Tensor& y, const Tensor& x, const Tensor& w, const LoraPair& adapter, ParamRole linear,
                const LinearSite& at) {
  if (!adapter.defined()) return linear_forward(y, x, w);
  lora_linear_forward(y, x, w, adapter_call(adapter, linear, at), at.ctx.scratch);
}

// Its backward: d_x by `mode`; d_w (a trainable base weight) or d_adapter (an adapted, frozen one)
// accumulate; an undefined gradient is skipped.
void linear_bwd(const Tensor& d_x, const Tensor& d_w, const LoraPair& d_adapter, const Tensor& d_y, const Tensor& x,
                const Tensor& w, const LoraPair& adapter, ParamRole linear, GradMode mode, const LinearSite& at) {
  if (!adapter.defined()) return linear_backward(d_x, d_w, d_y, x, w, mode);
  CW_CHECK(!d_w.data, "layer {} {}: a linear with an adapter is frozen (its gradients are the adapter's)", at.layer,
           lora_target_name(linear));
  lora_linear_backward(d_x, d_adapter.a, d_adapter.b, d_y, x, w, adapter_call(adapter, linear, at), mode,
                       at.ctx.scratch);
}

// [Wq; Wk; Wv] as one [q_dim + 2 kv_dim, C] tensor where the three lie back to back (weights or their
// gradients); undefined otherwise (model/layer.h, fused_qkv).
Tensor stacked_qkv(const Tensor& wq, const Tensor& wk, const Tensor& wv) {
  if (!wq.data || !wk.data || !wv.data || wk.dtype != wq.dtype || wv.dtype != wq.dtype || !wq.contiguous() ||
      !wk.contiguous() || !wv.contiguous() || wk.size(1) != wq.size(1) || wv.size(1) != wq.size(1))
    return {};
  const char* q = static_cast<const char*>(wq.data);
  const char* k = static_cast<const char*>(wk.data);
  if (k != q + wq.bytes() || static_cast<const char*>(wv.data) != k + wk.bytes()) return {};
  return Tensor::packed(wq.data, wq.dtype, wq.device, std::array<int64_t, 2>{wq.size(0) + wk.size(0) + wv.size(0), wq.size(1)});
}

// The fused projection's weight for this call, or undefined where the three GEMMs run (model/layer.h).
Tensor fused_qkv_weight(const LayerWeights& w, const BlockContext& ctx) {
  if (!qkv_fusable(ctx.tp != nullptr, w.lora.q.defined() || w.lora.k.defined() || w.lora.v.defined())) return {};
  return stacked_qkv(w.wq, w.wk, w.wv);
}

// Rows [r0, r0 + rows) of the MLP: gate, up and act for those rows into the given [rows, F] tensors.
void mlp_rows_forward(const Tensor& gate, const Tensor& up, const Tensor& act, const Tensor& h2_rows,
                      const LayerWeights& w, const LinearSite& at) {
  linear_fwd(gate, h2_rows, w.w_gate, w.lora.gate, ParamRole::w_gate, at);
  linear_fwd(up, h2_rows, w.w_up, w.lora.up, ParamRole::w_up, at);
  swiglu_forward(act, gate, up);
}

// Backward of the MLP rows given their gate/up/act: d_h rows (overwritten) from d_out rows;
// weight gradients accumulate. act and h2_rows may be undefined where the linears reading them are
// frozen without adapters (MlpKept::products): d_x needs only the weights.
void mlp_rows_backward(const Tensor& d_h_rows, const LayerWeights& g, const Tensor& d_out_rows, const Tensor& gate,
                       const Tensor& up, const Tensor& act, const Tensor& h2_rows, const LayerWeights& w,
                       const LinearSite& at) {
  Arena& s = at.ctx.scratch;
  ArenaScope scope(s);
  const int64_t rows = gate.size(0), F = gate.size(1);
  Tensor d_act = s.alloc(gate.dtype, {rows, F});
  linear_bwd(d_act, g.w_down, g.lora.down, d_out_rows, act, w.w_down, w.lora.down, ParamRole::w_down,
             GradMode::overwrite, at);
  Tensor d_gate = s.alloc(gate.dtype, {rows, F}), d_up = s.alloc(gate.dtype, {rows, F});
  swiglu_backward(d_gate, d_up, d_act, gate, up, GradMode::overwrite);
  linear_bwd(d_h_rows, g.w_gate, g.lora.gate, d_gate, h2_rows, w.w_gate, w.lora.gate, ParamRole::w_gate,
             GradMode::overwrite, at);
  linear_bwd(d_h_rows, g.w_up, g.lora.up, d_up, h2_rows, w.w_up, w.lora.up, ParamRole::w_up, GradMode::accumulate, at);
}

// Row shards [bounds[i], bounds[i+1]) of N rows.
std::vector<int64_t> row_shards(int64_t N, int64_t shards) {
  std::vector<int64_t> b;
  for (int64_t i = 0; i <= shards; ++i) b.push_back(N * i / shards);
  return b;
}

// ---- The tensor-parallel seams (model/shard.h); with tp == nullptr each is what one process does. ----

// Input seam, forward: rmsnorm of the rank's rows x, and what the column-parallel linears read.
//   one process, or TP without SP: rmsnorm into `kept` [N, C]; copy_to_tp's forward is the identity.
//   SP: rmsnorm of the rank's rows, all-gathered (gather_from_sp) into `kept` [N, C]; with regather
//       `kept` holds the rank's rows [R, C] and the gathered rows go to the buffer's gathered_input
//       slot, leased for the caller's scope.
Tensor normed_input_forward(std::optional<TpLease>& lease, const Tensor& kept, const RmsNormSaved& saved,
                            const Tensor& x, const Tensor& weight, double eps, TensorParallelGroup* tp, Arena& s) {
  if (!tp || !tp->sequence_parallel()) {
    rmsnorm_forward(kept, saved, x, weight, eps);
    return kept;
  }
  const int64_t R = x.size(0), C = x.size(1);
  if (tp->regather()) {
    rmsnorm_forward(kept, saved, x, weight, eps);
    const Tensor& all = lease.emplace(*tp, TpSlot::gathered_input, kept.dtype, std::initializer_list<int64_t>{R * tp->size(), C}).tensor;
    tp->gather_from_sp_forward(all, kept);
    return all;
  }
  const Tensor rows = s.alloc(kept.dtype, {R, C});
  rmsnorm_forward(rows, saved, x, weight, eps);
  tp->gather_from_sp_forward(kept, rows);
  return kept;
}

// The kept h1 / h2 as the column-parallel linears read them in the backward: regathered into the
// buffer's gathered_input slot when only the rank's rows were kept.
Tensor normed_input_backward(std::optional<TpLease>& lease, const Tensor& kept, int64_t N, TensorParallelGroup* tp) {
  if (!tp_regathers(tp)) return kept;
  const Tensor& all = lease.emplace(*tp, TpSlot::gathered_input, kept.dtype, std::initializer_list<int64_t>{N, kept.size(1)}).tensor;
  tp->gather_from_sp_forward(all, kept);
  return all;
}

// Where a row-parallel linear writes its [N, C] output: under SP the rank's partial sum lives in the
// buffer's partial_sum slot until scatter_to_sp; otherwise in scratch.
Tensor partial_output(std::optional<TpLease>& lease, int64_t N, int64_t C, DType dt, TensorParallelGroup* tp, Arena& s) {
  if (tp && tp->sequence_parallel())
    return lease.emplace(*tp, TpSlot::partial_sum, dt, std::initializer_list<int64_t>{N, C}).tensor;
  return s.alloc(dt, {N, C});
}

// Output seam, forward: the rank's rows [R, C] of the sum over ranks of `partial` [N, C].
//   one process: partial itself; TP: reduce_from_tp (all-reduce in place); SP: scatter_to_sp.
Tensor row_parallel_output(const Tensor& partial, TensorParallelGroup* tp, Arena& s) {
  if (!tp) return partial;
  if (!tp->sequence_parallel()) {
    tp->reduce_from_tp_forward(partial);
    return partial;
  }
  const Tensor rows = s.alloc(partial.dtype, {partial.size(0) / tp->size(), partial.size(1)});
  tp->scatter_to_sp_forward(rows, partial);
  return rows;
}

// Output seam, backward: the gradient of the row-parallel linear's [N, C] output, from d_rows.
//   one process / TP: d_rows itself (reduce_from_tp's backward is the identity);
//   SP: scatter_to_sp's backward, the all-gather of every rank's d_rows, in the gathered_grad slot.
Tensor row_parallel_output_backward(std::optional<TpLease>& lease, const Tensor& d_rows, TensorParallelGroup* tp) {
  if (!tp || !tp->sequence_parallel()) return d_rows;
  const Tensor& all = lease.emplace(*tp, TpSlot::gathered_grad, d_rows.dtype,
                                    std::initializer_list<int64_t>{d_rows.size(0) * tp->size(), d_rows.size(1)}).tensor;
  tp->scatter_to_sp_backward(all, d_rows);
  return all;
}

// Input seam, backward: the rank's rows of d(normed) from the column-parallel linears' d_all
// [N, C], a partial sum over the rank's heads / FFN columns.
//   one process: d_all; TP: copy_to_tp's backward, the all-reduce (in place); SP: gather_from_sp's
//   backward, the reduce-scatter.
Tensor normed_input_grad(const Tensor& d_all, TensorParallelGroup* tp, Arena& s) {
  if (!tp) return d_all;
  if (!tp->sequence_parallel()) {
    tp->copy_to_tp_backward(d_all);
    return d_all;
  }
  const Tensor rows = s.alloc(d_all.dtype, {d_all.size(0) / tp->size(), d_all.size(1)});
  tp->gather_from_sp_backward(rows, d_all);
  return rows;
}
}  // namespace

// RoPE over a chunk's [B, c, heads, D] rows: positions [p, p + c) in one call, or with packed documents
// span by span, each from its position in its document (or in the sequence, with absolute positions).
void rope_chunk(const Tensor& y, const Tensor& x, const BlockContext& ctx, bool backward) {
  auto run = [&](const Tensor& yr, const Tensor& xr, int64_t pos0) {
    if (backward) rope_backward(yr, xr, ctx.rope_cos, ctx.rope_sin, pos0, GradMode::overwrite);
    else rope_forward(yr, xr, ctx.rope_cos, ctx.rope_sin, pos0);
  };
  if (!ctx.doc_starts || !ctx.document_positions) return run(y, x, ctx.pos0);
  for (const DocumentSpan& s : document_spans(*ctx.doc_starts, ctx.B, ctx.pos0, ctx.c)) {
    auto rows = [&](const Tensor& t) { return t.slice(0, s.b, 1).slice(1, s.q0, s.q1 - s.q0); };
    run(rows(y), rows(x), ctx.pos0 + s.q0 - s.k0);
  }
}

void block_forward(const Tensor& x_out, LayerActivations* keep, const Tensor& x_in, const LayerWeights& w,
                   KVStore& kv, int layer, const BlockContext& ctx) {
  const LlamaConfig& cf = ctx.config;
  const int64_t B = ctx.B, c = ctx.c, p = ctx.pos0, N = B * c, C = cf.hidden_size, F = cf.intermediate_size;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  TensorParallelGroup* tp = ctx.tp;
  const int64_t R = tp_rows(tp, N);  // residual-stream rows of this rank
  const DType dt = x_in.dtype;
  check_shape(x_in, {R, C}, "block input");
  const bool output = x_out.data != nullptr;
  CW_CHECK(output || keep, "layer {}: a block forward that keeps nothing must write its output", layer);
  if (output) check_shape(x_out, {R, C}, "block output");
  Arena& s = ctx.scratch;
  ArenaScope scope(s);
  const int64_t shards = resolve_mlp_shards(ctx.mlp_shards, cf, N);
  LayerActivations local;
  LayerActivations& a =
      keep ? *keep : (local = LayerActivations::allocate(s, cf, B, c, dt, shards == 1 ? MlpKept::all : MlpKept::input, tp));
  const LinearSite at{ctx, layer};

  // Attention half.
  const bool from_saved = ctx.attention_from_store;
  {
    std::optional<TpLease> gathered;  // h1 of all rows, with regather
    const Tensor h1 = normed_input_forward(gathered, a.h1, a.norm1, x_in, w.attn_norm, cf.rms_norm_eps, tp, s);
    const Tensor w_qkv = from_saved ? Tensor{} : fused_qkv_weight(w, ctx);  // the recompute needs q only
    Tensor qkv;
    if (w_qkv.data) {
      qkv = s.alloc(dt, {N, cf.q_dim() + 2 * cf.kv_dim()});
      linear_forward(qkv, h1, w_qkv);
      rope_chunk(a.q, head_columns(qkv, 0, B, c, H, D), ctx, false);
    } else {
      Tensor q_pre = s.alloc(dt, {N, cf.q_dim()});
      linear_fwd(q_pre, h1, w.wq, w.lora.q, ParamRole::wq, at);
      rope_chunk(a.q, q_pre.view({B, c, H, D}), ctx, false);
    }
    if (from_saved) {
      CW_CHECK(p + c <= kv.outputs_written(), "layer {}: saved attention outputs of tokens [{}, {}) were not written "
               "by a prefill (it reached {})", layer, p, p + c, kv.outputs_written());
      copy_convert(a.attn, kv.outputs(layer, p, p + c));
      copy_convert(a.attn_saved.lse.view({B * H, c}), kv.output_lse(layer, p, p + c));
    } else {
      if (qkv.data) {
        const Tensor k_rot = head_columns(qkv, cf.q_dim(), B, c, Hkv, D);
        rope_chunk(k_rot, k_rot, ctx, false);
        copy_heads(kv.keys(layer, p, p + c), k_rot);
        copy_heads(kv.values(layer, p, p + c), head_columns(qkv, cf.q_dim() + cf.kv_dim(), B, c, Hkv, D));
      } else {
        Tensor k_pre = s.alloc(dt, {N, cf.kv_dim()});
        linear_fwd(k_pre, h1, w.wk, w.lora.k, ParamRole::wk, at);
        Tensor k_rot = k_pre.view({B, c, Hkv, D});
        rope_chunk(k_rot, k_rot, ctx, false);
        copy_convert(kv.keys(layer, p, p + c), k_rot);
        Tensor v = s.alloc(dt, {N, cf.kv_dim()});
        linear_fwd(v, h1, w.wv, w.lora.v, ParamRole::wv, at);
        copy_convert(kv.values(layer, p, p + c), v.view({B, c, Hkv, D}));
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(D));
      kv.attend_forward(layer, p, p + c, a.attn, a.attn_saved, a.q, scale, s, ctx.doc_starts);
      if (kv.has_outputs()) {  // the prefill saves them for the recompute
        copy_convert(kv.outputs(layer, p, p + c), a.attn);
        copy_convert(kv.output_lse(layer, p, p + c), a.attn_saved.lse.view({B * H, c}));
      }
    }
  }
  {
    std::optional<TpLease> partial;
    const Tensor o_all = partial_output(partial, N, C, dt, tp, s);
    linear_fwd(o_all, a.attn.view({N, cf.q_dim()}), w.wo, w.lora.o, ParamRole::wo, at);
    residual_forward(a.x_mid, x_in, row_parallel_output(o_all, tp, s));
  }

  // MLP half. Kept without h2 and act (MlpKept::products), both are scratch here.
  std::optional<TpLease> gathered;
  const Tensor h2_out = a.h2.data ? a.h2 : s.alloc(dt, {tp_regathers(tp) ? R : N, C});
  const Tensor h2 = normed_input_forward(gathered, h2_out, a.norm2, a.x_mid, w.mlp_norm, cf.rms_norm_eps, tp, s);
  if (!output) {
    // A recompute for the backward alone: W_down's product feeds only x_out. Kept gate and up are
    // computed; kept without them (MlpKept::input), the backward computes them shard by shard.
    if (a.gate.data) mlp_rows_forward(a.gate, a.up, a.act.data ? a.act : s.alloc(dt, {N, F}), h2, w, at);
    return;
  }
  std::optional<TpLease> partial;
  const Tensor m = partial_output(partial, N, C, dt, tp, s);
  if (a.gate.data) {
    const Tensor act = a.act.data ? a.act : s.alloc(dt, {N, F});
    mlp_rows_forward(a.gate, a.up, act, h2, w, at);
    linear_fwd(m, act, w.w_down, w.lora.down, ParamRole::w_down, at);
  } else {
    // Tiled: one shard's [rows, F] intermediates at a time.
    const std::vector<int64_t> b = row_shards(N, shards);
    for (size_t i = 0; i + 1 < b.size(); ++i) {
      ArenaScope shard_scope(s);
      const int64_t r0 = b[i], rows = b[i + 1] - b[i];
      Tensor gate = s.alloc(dt, {rows, F}), up = s.alloc(dt, {rows, F}), act = s.alloc(dt, {rows, F});
      const LinearSite shard{ctx, layer, r0};
      mlp_rows_forward(gate, up, act, h2.slice(0, r0, rows), w, shard);
      linear_fwd(m.slice(0, r0, rows), act, w.w_down, w.lora.down, ParamRole::w_down, shard);
    }
  }
  gathered.reset();  // h2 of all rows is not needed any more
  residual_forward(x_out, a.x_mid, row_parallel_output(m, tp, s));
}

void block_backward(const Tensor& d_x, const LayerWeights& g, const LayerActivations& a, const Tensor& x_in,
                    const LayerWeights& w, KVStore& kv, int layer, const BlockContext& ctx) {
  const LlamaConfig& cf = ctx.config;
  const int64_t B = ctx.B, c = ctx.c, p = ctx.pos0, N = B * c, C = cf.hidden_size, F = cf.intermediate_size;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  TensorParallelGroup* tp = ctx.tp;
  const DType dt = x_in.dtype;
  check_shape(d_x, {tp_rows(tp, N), C}, "block d_x");
  Arena& s = ctx.scratch;
  ArenaScope scope(s);
  const LinearSite at{ctx, layer};

  // MLP half, in reverse. d_x holds d(x_out); the residual passes it to x_mid unchanged.
  {
    std::optional<TpLease> d_m_lease, h2_lease, d_h_lease;
    const Tensor d_m = row_parallel_output_backward(d_m_lease, d_x, tp);  // d(W_down output), all rows
    const Tensor h2 = a.h2.data ? normed_input_backward(h2_lease, a.h2, N, tp) : Tensor{};  // none: frozen MLP
    const Tensor d_h_all = partial_output(d_h_lease, N, C, dt, tp, s);    // this rank's share of d(h2)
    if (a.gate.data) {
      mlp_rows_backward(d_h_all, g, d_m, a.gate, a.up, a.act, h2, w, at);
    } else {
      // Tiled: recompute each shard's gate/up/act from the kept h2, then its backward.
      const std::vector<int64_t> b = row_shards(N, resolve_mlp_shards(ctx.mlp_shards, cf, N));
      for (size_t i = 0; i + 1 < b.size(); ++i) {
        ArenaScope shard_scope(s);
        const int64_t r0 = b[i], rows = b[i + 1] - b[i];
        Tensor gate = s.alloc(dt, {rows, F}), up = s.alloc(dt, {rows, F}), act = s.alloc(dt, {rows, F});
        const Tensor h2_rows = h2.slice(0, r0, rows);
        const LinearSite shard{ctx, layer, r0};
        mlp_rows_forward(gate, up, act, h2_rows, w, shard);
        mlp_rows_backward(d_h_all.slice(0, r0, rows), g, d_m.slice(0, r0, rows), gate, up, act, h2_rows, w, shard);
      }
    }
    d_m_lease.reset();
    h2_lease.reset();
    const Tensor d_h = normed_input_grad(d_h_all, tp, s);
    rmsnorm_backward(d_x, g.mlp_norm, d_h, a.norm2, a.x_mid, w.mlp_norm, GradMode::accumulate, s);  // now d(x_mid)
  }

  // Attention half, in reverse.
  Tensor d_attn = s.alloc(dt, {N, cf.q_dim()});
  {
    std::optional<TpLease> d_o_lease;
    const Tensor d_o = row_parallel_output_backward(d_o_lease, d_x, tp);  // d(Wo output), all rows
    linear_bwd(d_attn, g.wo, g.lora.o, d_o, a.attn.view({N, cf.q_dim()}), w.wo, w.lora.o, ParamRole::wo,
               GradMode::overwrite, at);
  }
  Tensor d_q = s.alloc(dt, {B, c, H, D});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  kv.attend_backward(layer, p, p + c, d_q, d_attn.view({B, c, H, D}), a.attn_saved, a.q, a.attn, scale, s,
                     ctx.doc_starts);
  const Tensor w_qkv = fused_qkv_weight(w, ctx);
  const Tensor g_qkv = stacked_qkv(g.wq, g.wk, g.wv);
  // Fused where the gradients lie back to back too (or are all frozen); otherwise three GEMMs, which
  // need nothing from how the forward projected.
  const bool fused = w_qkv.data && (g_qkv.data || (!g.wq.data && !g.wk.data && !g.wv.data));
  // The chunk's own K/V gradient: local part plus what later chunks added, all in the accumulator.
  // Fused: d(q, k, v) before RoPE side by side, as the fused GEMM's output was; RoPE's transpose
  // writes the q and k columns.
  Tensor d_qkv, d_k, d_v;
  if (fused) {
    d_qkv = s.alloc(dt, {N, cf.q_dim() + 2 * cf.kv_dim()});
    d_k = head_columns(d_qkv, cf.q_dim(), B, c, Hkv, D);
    rope_chunk(head_columns(d_qkv, 0, B, c, H, D), d_q, ctx, true);
    copy_heads(d_k, kv.d_keys(layer, p, p + c));
    copy_heads(head_columns(d_qkv, cf.q_dim() + cf.kv_dim(), B, c, Hkv, D), kv.d_values(layer, p, p + c));
  } else {
    d_k = s.alloc(dt, {B, c, Hkv, D});
    d_v = s.alloc(dt, {B, c, Hkv, D});
    copy_convert(d_k, kv.d_keys(layer, p, p + c));
    copy_convert(d_v, kv.d_values(layer, p, p + c));
    rope_chunk(d_q, d_q, ctx, true);
  }
  rope_chunk(d_k, d_k, ctx, true);
  std::optional<TpLease> h1_lease, d_h_lease;
  const Tensor h1 = normed_input_backward(h1_lease, a.h1, N, tp);
  const Tensor d_h_all = partial_output(d_h_lease, N, C, dt, tp, s);  // this rank's share of d(h1)
  if (fused) {
    linear_backward(d_h_all, g_qkv, d_qkv, h1, w_qkv, GradMode::overwrite);
  } else {
    linear_bwd(d_h_all, g.wq, g.lora.q, d_q.view({N, cf.q_dim()}), h1, w.wq, w.lora.q, ParamRole::wq,
               GradMode::overwrite, at);
    // The relayed K/V gradient enters x through W_k, W_v (frozen or not) and their adapters.
    linear_bwd(d_h_all, g.wk, g.lora.k, d_k.view({N, cf.kv_dim()}), h1, w.wk, w.lora.k, ParamRole::wk,
               GradMode::accumulate, at);
    linear_bwd(d_h_all, g.wv, g.lora.v, d_v.view({N, cf.kv_dim()}), h1, w.wv, w.lora.v, ParamRole::wv,
               GradMode::accumulate, at);
  }
  h1_lease.reset();
  const Tensor d_h = normed_input_grad(d_h_all, tp, s);
  rmsnorm_backward(d_x, g.attn_norm, d_h, a.norm1, x_in, w.attn_norm, GradMode::accumulate, s);  // now d(x_in)
}

}  // namespace cw
