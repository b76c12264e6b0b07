// The Llama parameter table, and parameter storage built from it.
//
// One declarative table lists every tensor: its HF name, shape, role and layer. It drives
// allocation, initialisation, checkpoint IO, optimizer state, gradient checks and tests, so there is
// no second list to keep in sync. Shapes follow HF: linear weights are [out, in].
//   model.embed_tokens.weight                      [V, C]
//   model.layers.{l}.input_layernorm.weight        [C]
//   model.layers.{l}.self_attn.{q,k,v,o}_proj.weight  q [H*D, C], k/v [Hkv*D, C], o [C, H*D]
//   model.layers.{l}.post_attention_layernorm.weight  [C]
//   model.layers.{l}.mlp.{gate,up,down}_proj.weight   gate/up [F, C], down [C, F]
//   model.norm.weight                              [C]
//   lm_head.weight                                 [V, C]   (absent when tie_word_embeddings)
// A ParamSet holds all tensors in one contiguous buffer of one dtype (parameters, gradients,
// optimizer moments all use it), addressable by index, by name, or through typed weight structs.
#pragma once

#include "engine/memory.h"
#include "model/config.h"

#include <string>
#include <vector>

namespace cw {

enum class ParamRole { embedding, attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down, final_norm, lm_head };

struct ParamSpec {
  std::string name;            // HF name
  std::vector<int64_t> shape;
  ParamRole role;
  int layer = -1;              // -1 outside the blocks
  bool is_norm() const { return role == ParamRole::attn_norm || role == ParamRole::mlp_norm || role == ParamRole::final_norm; }
  int64_t numel() const;
};

std::vector<ParamSpec> parameter_table(const LlamaConfig& config);

struct LayerWeights {
  Tensor attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
};

struct ModelWeights {
  Tensor embedding;            // [V, C]
  std::vector<LayerWeights> layers;
  Tensor final_norm;           // [C]
  Tensor lm_head;              // [V, C]; the embedding itself when tied
};

class ParamSet {
 public:
  ParamSet() = default;
  // Zero-filled; device: host memory or one GPU's (the GPU's compute weights, master weights,
  // gradients and optimizer moments are ParamSets on the device).
  ParamSet(const LlamaConfig& config, DType dtype, Device device = Device::host());

  const std::vector<ParamSpec>& specs() const { return specs_; }
  const LlamaConfig& config() const { return config_; }  // the config the table was built from
  size_t size() const { return tensors_.size(); }
  const Tensor& operator[](size_t i) const { return tensors_[i]; }
  const Tensor& get(const std::string& name) const;  // throws naming the tensor
  int find(const std::string& name) const;           // -1 when absent
  Tensor flat() const;                               // every element, [numel] in table order
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  Device device() const { return buffer_.device(); }
  size_t bytes() const { return buffer_.bytes(); }
  ModelWeights weights() const;
  void zero() const;  // the values, not the set: callable through a const reference

 private:
  LlamaConfig config_;
  std::vector<ParamSpec> specs_;
  std::vector<Tensor> tensors_;
  HostBuffer buffer_;
  DType dtype_ = DType::f32;
  int64_t numel_ = 0;
  bool tied_ = false;
};

// HF's initialisation: linear and embedding weights N(0, initializer_range), norms 1. Device sets are
// drawn on the host (f64) and copied, so a GPU run starts from the same values as a CPU run.
// norm_jitter > 0 adds N(0, norm_jitter) to the norm weights (gradient checks want no special point).
// Copies every element of src into dst (same table), converting dtype and crossing devices as needed
// (bf16 rounded to nearest even): master weights to the compute copy, device to host for a checkpoint.
void copy_params(const ParamSet& dst, const ParamSet& src);

void init_parameters(ParamSet& params, uint64_t seed, double initializer_range, double norm_jitter = 0.0);

}  // namespace cw
