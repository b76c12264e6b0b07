#include "model/layer_seams.h"

#include "engine/ops/bias.h"
#include "engine/ops/linear.h"
#include "engine/ops/lora_linear.h"
#include "model/lora.h"

namespace cw {

namespace {
// The rank's tokens per sequence under context parallelism (checked: P divides the chunk), else c.
int64_t rank_tokens(const BlockContext& ctx) {
  if (!ctx.cp) return ctx.c;
  CW_CHECK_HINT(!ctx.tp, "run context parallelism without tensor parallelism",
                "context parallelism with tensor parallelism is not implemented");
  CW_CHECK_HINT(!ctx.doc_starts, "run context parallelism without data.documents",
                "context parallelism with packed documents is not implemented");
  return cp_rank_tokens(ctx.cp, ctx.c);
}
}  // namespace

BlockCall::BlockCall(const BlockContext& ctx, const LayerWeights& w, KVStore& kv, int layer, DType dtype)
    : ctx(ctx), w(w), kv(kv), layer(layer), cf(ctx.config), tp(ctx.tp), scratch(ctx.scratch), dt(dtype),
      cp(ctx.cp), B(ctx.B), c(ctx.c), p(ctx.pos0), ct(rank_tokens(ctx)), pt(ctx.pos0 + (cp ? cp->rank() * ct : 0)),
      N(ctx.B * ct), R(tp_rows(ctx.tp, N)), C(cf.hidden_size), F(cf.intermediate_size), H(cf.num_attention_heads),
      Hkv(cf.num_key_value_heads), D(cf.head_dim),
      Ha(cp ? cp_attention_config(cf, cp->size()).num_attention_heads : H),
      Hkva(cp ? cp_attention_config(cf, cp->size()).num_key_value_heads : Hkv) {}

// ---- The block's linears ----

namespace {
const Tensor& base_weight(const LayerWeights& w, ParamRole linear) {
  switch (linear) {
    case ParamRole::wq: return w.wq;
    case ParamRole::wk: return w.wk;
    case ParamRole::wv: return w.wv;
    case ParamRole::wo: return w.wo;
    case ParamRole::w_gate: return w.w_gate;
    case ParamRole::w_up: return w.w_up;
    case ParamRole::w_down: return w.w_down;
    default: break;
  }
  fail("a block's linears are its seven: q/k/v/o, gate/up/down");
}

// The bias of `linear` (q, k, v of a model with attention_bias), or an undefined tensor.
const Tensor& bias_of(const LayerWeights& w, ParamRole linear) {
  static const Tensor none;
  switch (linear) {
    case ParamRole::wq: return w.q_bias;
    case ParamRole::wk: return w.k_bias;
    case ParamRole::wv: return w.v_bias;
    default: return none;
  }
}

// The adapter of `linear` as lora_linear takes it: its scale, and its dropout mask's key for this call.
LoraAdapter adapter_call(const LoraPair& p, ParamRole linear, const BlockCall& b, int64_t row0) {
  const LoraRuntime& lr = b.ctx.lora;
  LoraAdapter a{p.a, p.b, lr.scale, {}};
  if (lr.dropout > 0) {
    // A row-parallel linear's input is this TP rank's slice of the columns: the mask is the whole input's.
    const bool row_parallel = linear == ParamRole::wo || linear == ParamRole::w_down;
    const int64_t column0 = row_parallel && b.tp ? b.tp->rank() * p.a.size(1) : 0;
    // Rows n = b ct + t at positions pt + t: the rank's tokens under context parallelism.
    a.dropout = {lr.dropout, lora_dropout_seed(lr.lora_seed, lr.round, b.layer, linear), b.ct, b.pt, row0, column0,
                 lr.sequence0};
  }
  return a;
}
}  // namespace

void block_linear_forward(const Tensor& y, const Tensor& x, ParamRole linear, const BlockCall& b, int64_t row0) {
  const LoraPair& adapter = b.w.lora.of(linear);
  if (!adapter.defined()) linear_forward(y, x, base_weight(b.w, linear));
  else lora_linear_forward(y, x, base_weight(b.w, linear), adapter_call(adapter, linear, b, row0), b.scratch);
  if (const Tensor& bias = bias_of(b.w, linear); bias.data) bias_forward(y, y, bias);
}

void block_linear_backward(const Tensor& d_x, const LayerWeights& g, const Tensor& d_y, const Tensor& x,
                           ParamRole linear, GradMode mode, const BlockCall& b, int64_t row0) {
  const LoraPair& adapter = b.w.lora.of(linear);
  const Tensor& d_w = base_weight(g, linear);
  if (const Tensor& d_bias = bias_of(g, linear); d_bias.data) bias_backward(d_bias, d_y, b.scratch);
  if (!adapter.defined()) return linear_backward(d_x, d_w, d_y, x, base_weight(b.w, linear), mode);
  CW_CHECK(!d_w.data, "layer {} {}: a linear with an adapter is frozen (its gradients are the adapter's)", b.layer,
           lora_target_name(linear));
  const LoraPair& d_adapter = g.lora.of(linear);
  lora_linear_backward(d_x, d_adapter.a, d_adapter.b, d_y, x, base_weight(b.w, linear),
                       adapter_call(adapter, linear, b, row0), mode, b.scratch);
}

// ---- Tensor-parallel seams ----

namespace {
bool sequence_parallel(const TensorParallelGroup* tp) { return tp && tp->sequence_parallel(); }

// Where a row-parallel linear (or the column-parallel linears' backward) writes its [N, C] partial
// sum: under sequence parallelism the buffer's partial_sum slot until the reduce-scatter; otherwise scratch.
Tensor partial_sum(std::optional<TpLease>& lease, const BlockCall& b) {
  if (sequence_parallel(b.tp))
    return lease.emplace(*b.tp, TpSlot::partial_sum, b.dt, std::initializer_list<int64_t>{b.N, b.C}).tensor;
  return b.scratch.alloc(b.dt, {b.N, b.C});
}
}  // namespace

NormedInput::NormedInput(const Tensor& kept, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight,
                         const BlockCall& b) {
  const double eps = b.cf.rms_norm_eps, offset = b.cf.norm_weight_offset;
  TensorParallelGroup* tp = b.tp;
  if (!sequence_parallel(tp)) {
    rmsnorm_forward(kept, saved, x, weight, eps, offset);
    all_ = kept;
    return;
  }
  const int64_t R = x.size(0), C = x.size(1);
  if (tp->regather()) {
    rmsnorm_forward(kept, saved, x, weight, eps, offset);
    all_ = lease_.emplace(*tp, TpSlot::gathered_input, kept.dtype, std::initializer_list<int64_t>{R * tp->size(), C})
               .tensor;
    tp->gather_from_sp_forward(all_, kept);
    return;
  }
  const Tensor rows = b.scratch.alloc(kept.dtype, {R, C});
  rmsnorm_forward(rows, saved, x, weight, eps, offset);
  tp->gather_from_sp_forward(kept, rows);
  all_ = kept;
}

NormedInputGrad::NormedInputGrad(const Tensor& kept, const BlockCall& b) : b_(b) {
  if (kept.data && tp_regathers(b.tp)) {
    input_ = input_lease_.emplace(*b.tp, TpSlot::gathered_input, kept.dtype,
                                  std::initializer_list<int64_t>{b.N, kept.size(1)}).tensor;
    b.tp->gather_from_sp_forward(input_, kept);
  } else {
    input_ = kept;
  }
  d_all_ = partial_sum(d_lease_, b);
}

Tensor NormedInputGrad::d_rows() {
  TensorParallelGroup* tp = b_.tp;
  if (!tp) return d_all_;
  if (!tp->sequence_parallel()) {
    tp->copy_to_tp_backward(d_all_);
    return d_all_;
  }
  const Tensor rows = b_.scratch.alloc(d_all_.dtype, {d_all_.size(0) / tp->size(), d_all_.size(1)});
  tp->gather_from_sp_backward(rows, d_all_);
  return rows;
}

PartialOutput::PartialOutput(const BlockCall& b) : b_(b), all_(partial_sum(lease_, b)) {}

Tensor PartialOutput::sum_rows() {
  TensorParallelGroup* tp = b_.tp;
  if (!tp) return all_;
  if (!tp->sequence_parallel()) {
    tp->reduce_from_tp_forward(all_);
    return all_;
  }
  const Tensor rows = b_.scratch.alloc(all_.dtype, {all_.size(0) / tp->size(), all_.size(1)});
  tp->scatter_to_sp_forward(rows, all_);
  return rows;
}

OutputGrad::OutputGrad(const Tensor& d_rows, const BlockCall& b) {
  if (!sequence_parallel(b.tp)) {
    all_ = d_rows;
    return;
  }
  all_ = lease_.emplace(*b.tp, TpSlot::gathered_grad, d_rows.dtype,
                        std::initializer_list<int64_t>{d_rows.size(0) * b.tp->size(), d_rows.size(1)}).tensor;
  b.tp->scatter_to_sp_backward(all_, d_rows);
}

}  // namespace cw
