// The whole-sequence f64 Llama step by hand (model/reference.h states the math). Every activation is
// an Eigen matrix whose rows are the batch's tokens, n = b T + t; each backward line below names the
// forward line it inverts. Nothing here calls an engine op: the engine is only where the parameters
// live (ParamSet) and where the RoPE tables come from (rope_tables).
#include "model/reference.h"

#include "engine/ops/lm_head_loss.h"  // kIgnoreLabel: HF's ignore_index, -100
#include "engine/ops/rope.h"          // rope_tables

#include <Eigen/Dense>

#include <cmath>
#include <optional>

namespace cw {

namespace {

using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXd;
using MatrixMap = Eigen::Map<Matrix>;
using VectorMap = Eigen::Map<Vector>;

// A tensor of an f64 host set as a matrix [size(0), numel / size(0)] (a linear weight [out, in]).
MatrixMap mat(const Tensor& t) { return MatrixMap(t.ptr<double>(), t.size(0), t.numel() / t.size(0)); }
VectorMap vec(const Tensor& t) { return VectorMap(t.ptr<double>(), t.numel()); }
bool given(const Tensor& t) { return t.data != nullptr; }  // a frozen tensor's gradient is not

// ---- RMSNorm: y_n = (o + g) ⊙ x_n r_n, r_n = (mean_i x_ni² + eps)^(-1/2) ----
// o is the weight offset: 0 (Llama: the weight is the scale), 1 (Gemma: the weight is its difference from 1).
Matrix rms_norm(const Matrix& x, const Tensor& g, double eps, double o, Vector& r) {
  r = (x.array().square().rowwise().mean() + eps).sqrt().inverse().matrix();
  return r.asDiagonal() * x * (vec(g).array() + o).matrix().asDiagonal();
}
// dr_n/dx_ni = -r_n³ x_ni / C, so d_x_n = r_n (s ⊙ dy_n) - r_n³ x_n mean_i(s_i dy_ni x_ni), s = o + g;
// d_g += sum_n dy_n ⊙ x_n r_n (the offset is a constant).
Matrix rms_norm_backward(const Matrix& dy, const Matrix& x, const Tensor& g, double o, const Vector& r,
                         const Tensor& d_g) {
  if (given(d_g)) {
    const Matrix x_r = r.asDiagonal() * x;
    vec(d_g) += (dy.array() * x_r.array()).colwise().sum().transpose().matrix();
  }
  const Matrix g_dy = dy * (vec(g).array() + o).matrix().asDiagonal();
  const Vector m = (g_dy.array() * x.array()).rowwise().mean();
  return r.asDiagonal() * g_dy - (r.array().cube() * m.array()).matrix().asDiagonal() * x;
}

// ---- Linear, with a LoRA adapter where one is given: y = x Wᵀ + s (x Aᵀ) Bᵀ ----
Matrix linear(const Matrix& x, const Tensor& w, const LoraPair& adapter, double s) {
  Matrix y = x * mat(w).transpose();
  if (adapter.defined()) y += s * (x * mat(adapter.a).transpose()) * mat(adapter.b).transpose();
  return y;
}
// d_W += dyᵀ x;  with u = x Aᵀ and e = s dy B [N, r]: d_B += s dyᵀ u, d_A += eᵀ x;  d_x = dy W + e A.
Matrix linear_backward(const Matrix& dy, const Matrix& x, const Tensor& w, const LoraPair& adapter, double s,
                       const Tensor& d_w, const LoraPair& d_adapter) {
  if (given(d_w)) mat(d_w) += dy.transpose() * x;
  Matrix dx = dy * mat(w);
  if (adapter.defined()) {
    const Matrix e = s * dy * mat(adapter.b);
    mat(d_adapter.b) += s * dy.transpose() * (x * mat(adapter.a).transpose());
    mat(d_adapter.a) += e.transpose() * x;
    dx += e * mat(adapter.a);
  }
  return dx;
}

// ---- RoPE on the `heads` heads of every row, at the row's position ----
// The forward rotates each pair (x_i, x_{i+D/2}) by the angle: [c -s; s c]. Its transpose, the
// backward, is the rotation by minus the angle (inverse = true).
void rope(Matrix& x, int64_t heads, int64_t D, const std::vector<int64_t>& pos, const MatrixMap& cos,
          const MatrixMap& sin, bool inverse) {
  const int64_t half = D / 2;
  for (int64_t n = 0; n < x.rows(); ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double c = cos(pos[n], i), s = inverse ? -sin(pos[n], i) : sin(pos[n], i);
        double& lo = x(n, h * D + i);
        double& hi = x(n, h * D + half + i);
        const double a = lo, b = hi;
        lo = a * c - b * s;
        hi = b * c + a * s;
      }
}

// ---- Causal attention within a document, grouped K/V heads ----
// Row n's query attends key rows [first[n], n] (its document's tokens up to itself, within its window).
// scale: 1 / sqrt(D), or Gemma 2's 1 / sqrt(query_pre_attn_scalar); cap: Gemma 2's score cap (0: none).
struct Heads {
  int64_t H, Hkv, D;
  double scale, cap;
  int64_t kv_head(int64_t h) const { return h / (H / Hkv); }
};

// The scores of query n, head h, against key rows j in [first, n]: s_j = scale q_n . k_j, capped
// s_j = cap tanh(s_j / cap) where there is a cap.
Vector scores(const Matrix& q, const Matrix& k, int64_t n, int64_t first, int64_t h, const Heads& hd) {
  const int64_t m = n - first + 1;
  Vector s = k.block(first, hd.kv_head(h) * hd.D, m, hd.D) * q.block(n, h * hd.D, 1, hd.D).transpose() * hd.scale;
  if (hd.cap > 0) s = ((s.array() / hd.cap).tanh() * hd.cap).matrix();
  return s;
}

// P_j = softmax_j(s_j) over key rows j in [first, n], for query head h.
Vector probabilities(const Vector& scores) {
  const Vector e = (scores.array() - scores.maxCoeff()).exp().matrix();
  return e / e.sum();
}
Vector probabilities(const Matrix& q, const Matrix& k, int64_t n, int64_t first, int64_t h, const Heads& hd) {
  return probabilities(scores(q, k, n, first, h, hd));
}

// out_n = sum_j P_j v_j, per head.
Matrix attention(const Matrix& q, const Matrix& k, const Matrix& v, const std::vector<int64_t>& first,
                 const Heads& hd) {
  Matrix out = Matrix::Zero(q.rows(), q.cols());
  for (int64_t n = 0; n < q.rows(); ++n)
    for (int64_t h = 0; h < hd.H; ++h) {
      const Vector p = probabilities(q, k, n, first[n], h, hd);
      out.block(n, h * hd.D, 1, hd.D) = p.transpose() * v.block(first[n], hd.kv_head(h) * hd.D, p.size(), hd.D);
    }
  return out;
}

// With do = d_out_n (one head): dP_j = do . v_j; dS_j = P_j (dP_j - sum_i P_i dP_i) (the softmax's
// Jacobian), times the cap's derivative 1 - (s_j / cap)² where there is a cap; d_q_n = scale sum_j
// dS_j k_j; d_k_j += scale dS_j q_n; d_v_j += P_j do.
void attention_backward(Matrix& d_q, Matrix& d_k, Matrix& d_v, const Matrix& d_out, const Matrix& q,
                        const Matrix& k, const Matrix& v, const std::vector<int64_t>& first, const Heads& hd) {
  const double scale = hd.scale;
  d_q = Matrix::Zero(q.rows(), q.cols());
  d_k = Matrix::Zero(k.rows(), k.cols());
  d_v = Matrix::Zero(v.rows(), v.cols());
  for (int64_t n = 0; n < q.rows(); ++n)
    for (int64_t h = 0; h < hd.H; ++h) {
      const int64_t g = hd.kv_head(h), f = first[n];
      const Vector s = scores(q, k, n, f, h, hd);
      const Vector p = probabilities(s);
      const int64_t m = p.size();
      const Matrix d_o = d_out.block(n, h * hd.D, 1, hd.D);
      const Vector dp = v.block(f, g * hd.D, m, hd.D) * d_o.transpose();
      Vector ds = (p.array() * (dp.array() - p.dot(dp))).matrix();
      if (hd.cap > 0) ds = (ds.array() * (1.0 - (s.array() / hd.cap).square())).matrix();
      d_q.block(n, h * hd.D, 1, hd.D) = scale * ds.transpose() * k.block(f, g * hd.D, m, hd.D);
      d_k.block(f, g * hd.D, m, hd.D) += scale * ds * q.block(n, h * hd.D, 1, hd.D);
      d_v.block(f, g * hd.D, m, hd.D) += p * d_o;
    }
}

// ---- SwiGLU: act = silu(gate) ⊙ up, silu(z) = z σ(z) ----
Matrix sigmoid(const Matrix& z) { return (1.0 + (-z.array()).exp()).inverse().matrix(); }

// ---- GeGLU (Gemma 2): act = gelu(gate) ⊙ up, gelu(z) = z/2 (1 + tanh(u)), u = k0 (z + k1 z³) ----
constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876, kGeluCubic = 0.044715;
Matrix gelu_tanh(const Matrix& z) {
  const Eigen::ArrayXXd t = (kSqrt2OverPi * (z.array() + kGeluCubic * z.array().cube())).tanh();
  return (0.5 * z.array() * (1.0 + t)).matrix();
}
// gelu'(z) = (1 + tanh u) / 2 + z/2 (1 - tanh² u) k0 (1 + 3 k1 z²).
Matrix gelu_tanh_slope(const Matrix& z) {
  const Eigen::ArrayXXd t = (kSqrt2OverPi * (z.array() + kGeluCubic * z.array().cube())).tanh();
  return (0.5 * (1.0 + t) +
          0.5 * z.array() * (1.0 - t.square()) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * z.array().square()))
      .matrix();
}

// ---- Qwen2's biases: y_n = lin(x)_n + b ----
void add_bias(Matrix& y, const Tensor& b) {
  if (given(b)) y.rowwise() += vec(b).transpose();
}
// d_b += sum_n dy_n.
void bias_backward(const Matrix& dy, const Tensor& d_b) {
  if (given(d_b)) vec(d_b) += dy.colwise().sum().transpose();
}

// ---- Qwen3's per-head norms: rmsnorm over each D-wide head of each row, one weight g [D] ----
// The [N, heads D] rows as [N heads, D] rows (row-major: the same numbers), normed as rms_norm.
Matrix norm_heads(const Matrix& x, int64_t D, const Tensor& g, double eps, Vector& r) {
  const Matrix heads = Eigen::Map<const Matrix>(x.data(), x.size() / D, D);
  const Matrix y = rms_norm(heads, g, eps, 0.0, r);
  return Eigen::Map<const Matrix>(y.data(), x.rows(), x.cols());
}
Matrix norm_heads_backward(const Matrix& dy, const Matrix& x, int64_t D, const Tensor& g, const Vector& r,
                           const Tensor& d_g) {
  const Matrix d_heads = rms_norm_backward(Eigen::Map<const Matrix>(dy.data(), dy.size() / D, D),
                                           Eigen::Map<const Matrix>(x.data(), x.size() / D, D), g, 0.0, r, d_g);
  return Eigen::Map<const Matrix>(d_heads.data(), x.rows(), x.cols());
}

// What a block's backward reads of its forward.
struct LayerSaved {
  Matrix x, h1, q, k, v, attn, x_mid, h2, gate, up, act;
  Matrix q_raw, k_raw;  // q, k before the per-head norms (Qwen3)
  Matrix o, m;          // the attention's and the MLP's outputs before the post-norms (Gemma 2)
  Vector r1, r2;        // the norms' r_n
  Vector rq, rk;        // the per-head norms' r, one per row and head
  Vector ro, rm;        // the post-norms' r_n
  std::vector<int64_t> first;  // per row the first key its query attends in this layer
};

}  // namespace

ReferenceResult reference_step(const LlamaModel& model, const Tensor& ids, const Tensor& labels,
                               const std::vector<std::vector<int64_t>>& doc_starts, bool document_positions) {
  CW_CHECK(model.tensor_parallel() == nullptr, "the reference step runs one process, not a tensor-parallel shard");
  CW_CHECK(!model.casts_layers(), "the reference step reads the blocks' resident weights; build the model "
                                  "without schedule.cast_layers");
  CW_CHECK_HINT(!model.has_adapters() || model.lora().dropout == 0.0, "give lora.dropout = 0",
                "the reference step has no dropout on the adapters (lora.dropout is {})", model.lora().dropout);
  check_dtype(ids, DType::i32, "reference ids");
  check_dtype(labels, DType::i32, "reference labels");
  CW_CHECK(ids.ndim == 2 && ids.device.is_cpu() && ids.contiguous(), "reference ids: [B, T] on the host, got {}",
           ids.describe());
  check_same_shape(labels, ids, "reference labels", "reference ids");
  check_contiguous(labels, "reference labels");
  const LlamaConfig& cfg = model.config();
  const int64_t B = ids.size(0), T = ids.size(1), N = B * T, L = cfg.num_hidden_layers, D = cfg.head_dim;
  const Heads hd{cfg.num_attention_heads, cfg.num_key_value_heads, D, cfg.attention_scale(),
                 cfg.attn_logit_softcapping};
  const double o = cfg.norm_weight_offset;
  const int32_t* id = ids.ptr<int32_t>();
  const int32_t* label = labels.ptr<int32_t>();
  CW_CHECK(doc_starts.empty() || static_cast<int64_t>(doc_starts.size()) == B,
           "document starts for {} sequences, the batch has {}", doc_starts.size(), B);

  // Per row: its RoPE position, its document's first row, and per window W the first key it attends:
  // its document's first row, or under a sliding window of W keys the row W - 1 before it when that
  // is later (each layer takes its own window's: config layer_window).
  std::vector<int64_t> pos(static_cast<size_t>(N)), doc_first(static_cast<size_t>(N));
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t> starts = doc_starts.empty() ? std::vector<int64_t>{0} : doc_starts[size_t(b)];
    CW_CHECK(!starts.empty() && starts[0] == 0, "sequence {}: its first document must start at 0", b);
    for (size_t i = 1; i < starts.size(); ++i)
      CW_CHECK(starts[i] > starts[i - 1] && starts[i] < T, "sequence {}: document starts must ascend within [0, {})",
               b, T);
    size_t next = 1;
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      while (next < starts.size() && starts[next] <= t) start = starts[next++];
      pos[size_t(b * T + t)] = document_positions ? t - start : t;
      doc_first[size_t(b * T + t)] = b * T + start;
    }
  }
  const auto first_keys = [&](int64_t W) {
    std::vector<int64_t> first(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) first[size_t(n)] = W > 0 ? std::max(doc_first[size_t(n)], n - W + 1) : doc_first[size_t(n)];
    return first;
  };
  OwnedTensor cos_table(DType::f64, {T, D / 2}), sin_table(DType::f64, {T, D / 2});
  rope_tables(cos_table, sin_table, D, cfg.rope_theta, cfg.rope_scaling);
  const MatrixMap cos = mat(cos_table), sin = mat(sin_table);

  // The parameters in f64 on the host; the adapters joined into the blocks' weights.
  ParamSet base = ParamSet::like(model.params(), DType::f64, Device::host());
  copy_params(base, model.params());
  std::optional<ParamSet> adapters;
  if (model.has_adapters()) {
    adapters.emplace(ParamSet::like(model.adapters(), DType::f64, Device::host()));
    copy_params(*adapters, model.adapters());
  }
  const double s = model.has_adapters() ? model.lora().scale() : 0.0;
  const ModelWeights w = base.weights();
  std::vector<LayerWeights> layer(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    layer[size_t(l)] = base.layer(l);
    if (adapters) layer[size_t(l)].lora = adapters->layer(l).lora;
  }
  ReferenceResult r{0.0, 0, ParamSet::like(model.trainable(), DType::f64, Device::host())};
  const ModelWeights grad = r.grads.weights();  // undefined where frozen (LoRA: all but A and B)

  // ---- forward ----
  // x_0 = e E[ids], e = sqrt(C) for Gemma 2's scaled embeddings (the exact root: this is the math in
  // f64), else 1.
  const double e_scale = cfg.scale_embeddings ? std::sqrt(static_cast<double>(cfg.hidden_size)) : 1.0;
  Matrix x(N, cfg.hidden_size);
  for (int64_t n = 0; n < N; ++n) {
    CW_CHECK(id[n] >= 0 && id[n] < cfg.vocab_size, "token id {} at row {} is outside the vocabulary ({})", id[n], n,
             cfg.vocab_size);
    x.row(n) = e_scale * mat(w.embedding).row(id[n]);
  }
  const bool gelu = cfg.mlp_gate == MlpGate::gelu_tanh;
  std::vector<LayerSaved> saved(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    const LayerWeights& lw = layer[size_t(l)];
    LayerSaved& a = saved[size_t(l)];
    a.first = first_keys(cfg.layer_window(l));
    a.x = x;
    a.h1 = rms_norm(a.x, lw.attn_norm, cfg.rms_norm_eps, o, a.r1);
    a.q = linear(a.h1, lw.wq, lw.lora.q, s);
    a.k = linear(a.h1, lw.wk, lw.lora.k, s);
    a.v = linear(a.h1, lw.wv, lw.lora.v, s);
    add_bias(a.q, lw.q_bias);
    add_bias(a.k, lw.k_bias);
    add_bias(a.v, lw.v_bias);
    if (cfg.qk_norm) {
      a.q_raw = a.q;
      a.k_raw = a.k;
      a.q = norm_heads(a.q_raw, D, lw.q_norm, cfg.rms_norm_eps, a.rq);
      a.k = norm_heads(a.k_raw, D, lw.k_norm, cfg.rms_norm_eps, a.rk);
    }
    rope(a.q, hd.H, D, pos, cos, sin, false);
    rope(a.k, hd.Hkv, D, pos, cos, sin, false);
    a.attn = attention(a.q, a.k, a.v, a.first, hd);
    // x_mid = x + lin_o(attn) + b_o; Gemma 2: x + rmsnorm(lin_o(attn) + b_o; g_ap).
    Matrix attn_out = linear(a.attn, lw.wo, lw.lora.o, s);
    add_bias(attn_out, lw.o_bias);
    if (cfg.post_norms) {
      a.o = attn_out;
      attn_out = rms_norm(a.o, lw.attn_post_norm, cfg.rms_norm_eps, o, a.ro);
    }
    a.x_mid = a.x + attn_out;
    a.h2 = rms_norm(a.x_mid, lw.mlp_norm, cfg.rms_norm_eps, o, a.r2);
    a.gate = linear(a.h2, lw.w_gate, lw.lora.gate, s);
    a.up = linear(a.h2, lw.w_up, lw.lora.up, s);
    a.act = ((gelu ? gelu_tanh(a.gate) : (a.gate.array() * sigmoid(a.gate).array()).matrix()).array() * a.up.array())
                .matrix();
    // x_out = x_mid + lin_down(act); Gemma 2: x_mid + rmsnorm(lin_down(act); g_fp).
    Matrix mlp_out = linear(a.act, lw.w_down, lw.lora.down, s);
    if (cfg.post_norms) {
      a.m = mlp_out;
      mlp_out = rms_norm(a.m, lw.mlp_post_norm, cfg.rms_norm_eps, o, a.rm);
    }
    x = a.x_mid + mlp_out;
  }
  Vector r_final;
  const Matrix normed = rms_norm(x, w.final_norm, cfg.rms_norm_eps, o, r_final);
  // logits = normed W_headᵀ [N, V]; Gemma 2 caps them: z = cap tanh(z / cap).
  const double cap = cfg.final_logit_softcapping;
  Matrix logits = normed * mat(w.lm_head).transpose();
  if (cap > 0) logits = ((logits.array() / cap).tanh() * cap).matrix();

  // loss = (1/S) sum_n (lse_n - logits_n[label_n]); d logits_n = (softmax(logits_n) - onehot(label_n)) / S.
  for (int64_t n = 0; n < N; ++n) r.supervised += label[n] != kIgnoreLabel;
  const double S = std::max<double>(1.0, static_cast<double>(r.supervised));
  Matrix d_logits = Matrix::Zero(N, cfg.vocab_size);
  for (int64_t n = 0; n < N; ++n) {
    if (label[n] == kIgnoreLabel) continue;
    CW_CHECK(label[n] >= 0 && label[n] < cfg.vocab_size, "label {} at row {} is outside the vocabulary ({})",
             label[n], n, cfg.vocab_size);
    const double top = logits.row(n).maxCoeff();
    const Eigen::RowVectorXd e = (logits.row(n).array() - top).exp().matrix();
    const double lse = top + std::log(e.sum());
    r.loss += (lse - logits(n, label[n])) / S;
    d_logits.row(n) = e / e.sum() / S;
    d_logits(n, label[n]) -= 1.0 / S;
  }

  // ---- backward: the lines above in reverse ----
  // The cap: d(normed W_headᵀ) = d_logits (1 - (z / cap)²), z the capped logits.
  if (cap > 0) d_logits = (d_logits.array() * (1.0 - (logits.array() / cap).square())).matrix();
  // logits = normed W_headᵀ: d_W_head += d_logitsᵀ normed (into the embedding when tied), d_normed = d_logits W_head.
  if (given(grad.lm_head)) mat(grad.lm_head) += d_logits.transpose() * normed;
  Matrix dx = rms_norm_backward(d_logits * mat(w.lm_head), x, w.final_norm, o, r_final, grad.final_norm);
  for (int l = L - 1; l >= 0; --l) {
    const LayerWeights& lw = layer[size_t(l)];
    const LayerWeights gw = r.grads.layer(l);
    const LayerSaved& a = saved[size_t(l)];
    // x_out = x_mid + lin_down(act): dx reaches x_mid unchanged, and act through down_proj (through
    // the post-norm first, Gemma 2).
    const Matrix d_m = cfg.post_norms ? rms_norm_backward(dx, a.m, lw.mlp_post_norm, o, a.rm, gw.mlp_post_norm) : dx;
    const Matrix d_act = linear_backward(d_m, a.act, lw.w_down, lw.lora.down, s, gw.w_down, gw.lora.down);
    // act = silu(gate) ⊙ up: d_up = d_act ⊙ silu(gate); d_gate = d_act ⊙ up ⊙ σ(gate) (1 + gate (1 - σ(gate)));
    // act = gelu(gate) ⊙ up: d_up = d_act ⊙ gelu(gate); d_gate = d_act ⊙ up ⊙ gelu'(gate).
    Matrix d_up, d_gate;
    if (gelu) {
      d_up = (d_act.array() * gelu_tanh(a.gate).array()).matrix();
      d_gate = (d_act.array() * a.up.array() * gelu_tanh_slope(a.gate).array()).matrix();
    } else {
      const Matrix sg = sigmoid(a.gate);
      d_up = (d_act.array() * a.gate.array() * sg.array()).matrix();
      d_gate = (d_act.array() * a.up.array() * sg.array() * (1.0 + a.gate.array() * (1.0 - sg.array()))).matrix();
    }
    const Matrix d_h2 = linear_backward(d_gate, a.h2, lw.w_gate, lw.lora.gate, s, gw.w_gate, gw.lora.gate) +
                        linear_backward(d_up, a.h2, lw.w_up, lw.lora.up, s, gw.w_up, gw.lora.up);
    const Matrix d_mid = dx + rms_norm_backward(d_h2, a.x_mid, lw.mlp_norm, o, a.r2, gw.mlp_norm);
    // x_mid = x + lin_o(attn) + b_o (Gemma 2: through the post-norm first).
    const Matrix d_o =
        cfg.post_norms ? rms_norm_backward(d_mid, a.o, lw.attn_post_norm, o, a.ro, gw.attn_post_norm) : d_mid;
    bias_backward(d_o, gw.o_bias);
    const Matrix d_attn = linear_backward(d_o, a.attn, lw.wo, lw.lora.o, s, gw.wo, gw.lora.o);
    Matrix d_q, d_k, d_v;
    attention_backward(d_q, d_k, d_v, d_attn, a.q, a.k, a.v, a.first, hd);
    rope(d_q, hd.H, D, pos, cos, sin, true);
    rope(d_k, hd.Hkv, D, pos, cos, sin, true);
    if (cfg.qk_norm) {
      d_q = norm_heads_backward(d_q, a.q_raw, D, lw.q_norm, a.rq, gw.q_norm);
      d_k = norm_heads_backward(d_k, a.k_raw, D, lw.k_norm, a.rk, gw.k_norm);
    }
    bias_backward(d_q, gw.q_bias);
    bias_backward(d_k, gw.k_bias);
    bias_backward(d_v, gw.v_bias);
    const Matrix d_h1 = linear_backward(d_q, a.h1, lw.wq, lw.lora.q, s, gw.wq, gw.lora.q) +
                        linear_backward(d_k, a.h1, lw.wk, lw.lora.k, s, gw.wk, gw.lora.k) +
                        linear_backward(d_v, a.h1, lw.wv, lw.lora.v, s, gw.wv, gw.lora.v);
    dx = d_mid + rms_norm_backward(d_h1, a.x, lw.attn_norm, o, a.r1, gw.attn_norm);
  }
  // x_0 = e E[ids]: each row's gradient, times e, goes to its token's row of E.
  if (given(grad.embedding))
    for (int64_t n = 0; n < N; ++n) mat(grad.embedding).row(id[n]) += e_scale * dx.row(n);
  return r;
}

}  // namespace cw
