#include "model/params.h"

#include "engine/env.h"
#include "engine/random.h"
#include "model/memory_need.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace cw {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<ParamSpec> parameter_table(const LlamaConfig& c) {
  const int64_t V = c.vocab_size, C = c.hidden_size, F = c.intermediate_size;
  std::vector<ParamSpec> t;
  t.push_back({"model.embed_tokens.weight", {V, C}, ParamRole::embedding});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    t.push_back({p + "input_layernorm.weight", {C}, ParamRole::attn_norm, l});
    t.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), C}, ParamRole::wq, l});
    t.push_back({p + "self_attn.k_proj.weight", {c.kv_dim(), C}, ParamRole::wk, l});
    t.push_back({p + "self_attn.v_proj.weight", {c.kv_dim(), C}, ParamRole::wv, l});
    if (c.attention_bias) {
      t.push_back({p + "self_attn.q_proj.bias", {c.q_dim()}, ParamRole::q_bias, l});
      t.push_back({p + "self_attn.k_proj.bias", {c.kv_dim()}, ParamRole::k_bias, l});
      t.push_back({p + "self_attn.v_proj.bias", {c.kv_dim()}, ParamRole::v_bias, l});
    }
    if (c.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, ParamRole::q_norm, l});
      t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, ParamRole::k_norm, l});
    }
    t.push_back({p + "self_attn.o_proj.weight", {C, c.q_dim()}, ParamRole::wo, l});
    if (c.o_bias) t.push_back({p + "self_attn.o_proj.bias", {C}, ParamRole::o_bias, l});
    if (c.post_norms) {
      t.push_back({p + "post_attention_layernorm.weight", {C}, ParamRole::attn_post_norm, l});
      t.push_back({p + "pre_feedforward_layernorm.weight", {C}, ParamRole::mlp_norm, l});
    } else {
      t.push_back({p + "post_attention_layernorm.weight", {C}, ParamRole::mlp_norm, l});
    }
    t.push_back({p + "mlp.gate_proj.weight", {F, C}, ParamRole::w_gate, l});
    t.push_back({p + "mlp.up_proj.weight", {F, C}, ParamRole::w_up, l});
    t.push_back({p + "mlp.down_proj.weight", {C, F}, ParamRole::w_down, l});
    if (c.post_norms) t.push_back({p + "post_feedforward_layernorm.weight", {C}, ParamRole::mlp_post_norm, l});
  }
  t.push_back({"model.norm.weight", {C}, ParamRole::final_norm});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {V, C}, ParamRole::lm_head});
  return t;
}

LoraPair& LayerAdapters::of(ParamRole linear) {
  switch (linear) {
    case ParamRole::wq: return q;
    case ParamRole::wk: return k;
    case ParamRole::wv: return v;
    case ParamRole::wo: return o;
    case ParamRole::w_gate: return gate;
    case ParamRole::w_up: return up;
    case ParamRole::w_down: return down;
    default: break;
  }
  fail("LayerAdapters::of: only the seven linears of a block (q/k/v/o, gate/up/down) take adapters");
}

ParamSet::ParamSet(const LlamaConfig& config, DType dtype, Device device)
    : ParamSet(config, parameter_table(config), dtype, device) {}

ParamSet ParamSet::like(const ParamSet& like, DType dtype, Device device) {
  return ParamSet(like.config(), like.specs(), dtype, device);
}

ParamSet::ParamSet(const LlamaConfig& config, std::vector<ParamSpec> specs, DType dtype, Device device)
    : config_(config), specs_(std::move(specs)), dtype_(dtype), tied_(config.tie_word_embeddings) {
  const uint64_t bytes = param_bytes(specs_, dtype);  // first: it refuses a count that wraps
  for (const auto& s : specs_) numel_ += s.numel();
  buffer_ = Buffer(bytes, device);
  size_t offset = 0;
  for (const auto& s : specs_) {
    tensors_.push_back(Tensor::packed(static_cast<char*>(buffer_.data()) + offset, dtype, device, s.shape));
    offset += static_cast<size_t>(s.numel()) * dtype_size(dtype);
  }
}

int ParamSet::find(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return static_cast<int>(i);
  return -1;
}

const Tensor& ParamSet::get(const std::string& name) const {
  const int i = find(name);
  CW_CHECK(i >= 0, "no parameter named '{}'", name);
  return tensors_[static_cast<size_t>(i)];
}

Tensor ParamSet::flat() const { return Tensor(buffer_.data(), dtype_, buffer_.device(), {numel_}); }

void ParamSet::zero() const {
  if (buffer_.bytes()) cw::fill(flat(), 0.0);
}

void copy_params(const ParamSet& dst, const ParamSet& src) {
  CW_CHECK(dst.size() == src.size() && dst.numel() == src.numel(),
           "copy_params: parameter sets of {} and {} tensors ({} and {} elements) differ", dst.size(), src.size(),
           dst.numel(), src.numel());
  if (dst.numel() > 0) copy_convert(dst.flat(), src.flat());
}

bool same_table(const ParamSet& a, const ParamSet& b) { return same_table(a.specs(), b.specs()); }

namespace {
// Where a table's tensor goes in the weight structs, by its role: a block's into `layer`, the others
// into `w`.
void place(ModelWeights* w, LayerWeights* layer, const ParamSpec& s, const Tensor& t) {
  switch (s.role) {
    case ParamRole::embedding: w->embedding = t; break;
    case ParamRole::attn_norm: layer->attn_norm = t; break;
    case ParamRole::wq: layer->wq = t; break;
    case ParamRole::wk: layer->wk = t; break;
    case ParamRole::wv: layer->wv = t; break;
    case ParamRole::wo: layer->wo = t; break;
    case ParamRole::mlp_norm: layer->mlp_norm = t; break;
    case ParamRole::w_gate: layer->w_gate = t; break;
    case ParamRole::w_up: layer->w_up = t; break;
    case ParamRole::w_down: layer->w_down = t; break;
    case ParamRole::final_norm: w->final_norm = t; break;
    case ParamRole::lm_head: w->lm_head = t; break;
    case ParamRole::q_bias: layer->q_bias = t; break;
    case ParamRole::k_bias: layer->k_bias = t; break;
    case ParamRole::v_bias: layer->v_bias = t; break;
    case ParamRole::o_bias: layer->o_bias = t; break;
    case ParamRole::q_norm: layer->q_norm = t; break;
    case ParamRole::k_norm: layer->k_norm = t; break;
    case ParamRole::attn_post_norm: layer->attn_post_norm = t; break;
    case ParamRole::mlp_post_norm: layer->mlp_post_norm = t; break;
    case ParamRole::lora_a: layer->lora.of(s.adapts).a = t; break;
    case ParamRole::lora_b: layer->lora.of(s.adapts).b = t; break;
  }
}
}  // namespace

ModelWeights ParamSet::weights() const {
  ModelWeights w;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& s = specs_[i];
    if (s.layer >= 0 && static_cast<size_t>(s.layer) >= w.layers.size()) w.layers.resize(static_cast<size_t>(s.layer) + 1);
    place(&w, s.layer >= 0 ? &w.layers[static_cast<size_t>(s.layer)] : nullptr, s, tensors_[i]);
  }
  if (tied_ && w.embedding.data) w.lm_head = w.embedding;
  return w;
}

LayerWeights ParamSet::layer(int layer) const { return layer_weights(specs_, tensors_, layer); }

LayerWeights layer_weights(const std::vector<ParamSpec>& specs, const std::vector<Tensor>& tensors, int layer) {
  LayerWeights w;
  for (size_t i = 0; i < specs.size(); ++i)
    if (specs[i].layer == layer) place(nullptr, &w, specs[i], tensors[i]);
  return w;
}

std::vector<ParamSpec> outside_blocks(const std::vector<ParamSpec>& table) {
  std::vector<ParamSpec> out;
  for (const ParamSpec& s : table)
    if (s.layer < 0) out.push_back(s);
  return out;
}

void copy_params_by_name(const ParamSet& dst, const ParamSet& src) {
  for (size_t i = 0; i < dst.size(); ++i) {
    const int j = src.find(dst.specs()[i].name);
    CW_CHECK(j >= 0 && src.specs()[static_cast<size_t>(j)].shape == dst.specs()[i].shape,
             "copy_params_by_name: {} is not in the source set with its shape", dst.specs()[i].name);
    copy_convert(dst[i], src[static_cast<size_t>(j)]);
  }
}

bool same_table(const std::vector<ParamSpec>& a, const std::vector<ParamSpec>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].name != b[i].name || a[i].shape != b[i].shape) return false;
  return true;
}

void require_finite_weights(const Tensor& t, const std::string& tensor, const std::string& file) {
  CW_CHECK(t.device.is_cpu() && t.contiguous(), "require_finite_weights reads a contiguous host tensor, got {}",
           t.describe());
  if (env::flag(env::kAllowNonfiniteWeights)) return;
  const int64_t n = t.numel();
  auto first_bad = [&]() -> int64_t {
    switch (t.dtype) {
      case DType::f64:
        for (int64_t i = 0; i < n; ++i)
          if (!std::isfinite(t.ptr<double>()[i])) return i;
        return -1;
      case DType::f32:
        for (int64_t i = 0; i < n; ++i)
          if (!std::isfinite(t.ptr<float>()[i])) return i;
        return -1;
      case DType::bf16: {
        // bf16 is f32's upper half: all exponent bits set is infinity or NaN.
        const auto* bits = static_cast<const uint16_t*>(t.data);
        for (int64_t i = 0; i < n; ++i)
          if ((bits[i] & 0x7f80u) == 0x7f80u) return i;
        return -1;
      }
      case DType::i32: return -1;
    }
    return -1;
  };
  if (const int64_t i = first_bad(); i >= 0) {
    OwnedTensor one(DType::f64, {1});
    copy_convert(one, t.view({n}).slice(0, i, 1));
    fail(fmt::format("{}: tensor '{}' holds {} at element {} of {} (shape {})", file, tensor,
                     one.tensor.ptr<double>()[0], i, n, t.describe()),
         fmt::format("the weights are damaged (or come from a diverged run): use another file, or set {}=1 to "
                     "load them anyway for debugging",
                     env::kAllowNonfiniteWeights.name));
  }
}

void init_parameters(ParamSet& params, uint64_t seed, double initializer_range, double norm_jitter) {
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& s = params.specs()[i];
    CW_CHECK(!s.is_adapter(), "init_parameters: {} is a LoRA adapter (model/lora.h: init_lora_parameters)", s.name);
    // Each tensor draws from its own stream (its index in the table), so initialisation does not
    // depend on the order tensors are visited in.
    // A device tensor is drawn on the host in f64 (the host path's own rounding) and copied with one
    // conversion, a tensor at a time: the host holds one tensor, not the model, in f64.
    const bool on_host = params.device().is_cpu();
    const OwnedTensor drawn = on_host ? OwnedTensor{} : OwnedTensor::of_shape(DType::f64, s.shape);
    const Tensor& target = on_host ? params[i] : drawn.tensor;
    if (s.is_norm()) {
      // The weight that makes the norm's scale 1: 1, or 0 under Gemma's (1 + w).
      const double identity = 1.0 - params.config().norm_weight_offset;
      if (norm_jitter > 0)
        fill_normal(target, seed, i, identity, norm_jitter);
      else
        fill(target, identity);
    } else if (s.is_bias()) {
      if (norm_jitter > 0)
        fill_normal(target, seed, i, 0.0, norm_jitter);
      else
        fill(target, 0.0);
    } else {
      fill_normal(target, seed, i, 0.0, initializer_range);
    }
    if (!on_host) copy_convert(params[i], target);
  }
}

}  // namespace cw
