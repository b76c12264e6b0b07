// The Llama parameter table, and parameter storage built from it.
//
// One declarative table lists every tensor: its HF name, shape, role and layer. It drives
// allocation, initialisation, checkpoint IO, optimizer state, gradient checks and tests, so there is
// no second list to keep in sync. Shapes follow HF: linear weights are [out, in]. Within a block the
// q, k, v weights lie back to back, and so do their biases (the fused projection, model/layer.h).
//   model.embed_tokens.weight                      [V, C]
//   model.layers.{l}.input_layernorm.weight        [C]
//   model.layers.{l}.self_attn.{q,k,v,o}_proj.weight  q [H*D, C], k/v [Hkv*D, C], o [C, H*D]
//   model.layers.{l}.self_attn.{q,k,v}_proj.bias      q [H*D], k/v [Hkv*D]   (attention_bias: Qwen2)
//   model.layers.{l}.self_attn.o_proj.bias            [C]                    (o_bias: Llama's, Qwen3's)
//   model.layers.{l}.self_attn.{q,k}_norm.weight      [D] each               (qk_norm: Qwen3)
//   model.layers.{l}.post_attention_layernorm.weight  [C]   the MLP's input norm (Llama's name)
//   model.layers.{l}.mlp.{gate,up,down}_proj.weight   gate/up [F, C], down [C, F]
// Gemma 2 (post_norms) names its four norms by where they sit: input_layernorm (attention's input),
// post_attention_layernorm [C] on the attention's output (role attn_post_norm), pre_feedforward_layernorm
// (the MLP's input: role mlp_norm), post_feedforward_layernorm [C] on the MLP's output (mlp_post_norm).
//   model.norm.weight                              [C]
//   lm_head.weight                                 [V, C]   (absent when tie_word_embeddings)
// A ParamSet holds all tensors in one contiguous buffer of one dtype (parameters, gradients,
// optimizer moments all use it), addressable by index, by name, or through typed weight structs.
// The same class holds a model's LoRA adapters (model/lora.h: lora_parameter_table, PEFT's names
// base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight [r, in] and ...lora_B.weight
// [out, r]), so their gradients, master copy, AdamW moments and checkpoints are built the same way.
#pragma once

#include "engine/memory.h"
#include "model/config.h"

#include <string>
#include <vector>

namespace cw {

enum class ParamRole {
  embedding, attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down, final_norm, lm_head,
  q_bias, k_bias, v_bias,  // the q, k, v projections' biases (Qwen2; attention_bias)
  o_bias,                  // o_proj's bias (Llama's and Qwen3's attention_bias)
  q_norm, k_norm,          // the per-head RMSNorm weights of q and k (Qwen3)
  attn_post_norm, mlp_post_norm,  // the norms of the attention's and the MLP's outputs (Gemma 2)
  lora_a, lora_b  // a LoRA adapter's matrices (model/lora.h); `adapts` names the linear
};

struct ParamSpec {
  std::string name;            // HF name (PEFT's for an adapter)
  std::vector<int64_t> shape;
  ParamRole role;
  int layer = -1;              // -1 outside the blocks
  ParamRole adapts = ParamRole::wq;  // lora_a / lora_b: the linear the adapter belongs to (wq ... w_down)
  bool is_norm() const {
    return role == ParamRole::attn_norm || role == ParamRole::mlp_norm || role == ParamRole::final_norm ||
           role == ParamRole::q_norm || role == ParamRole::k_norm || role == ParamRole::attn_post_norm ||
           role == ParamRole::mlp_post_norm;
  }
  bool is_bias() const {
    return role == ParamRole::q_bias || role == ParamRole::k_bias || role == ParamRole::v_bias ||
           role == ParamRole::o_bias;
  }
  bool is_adapter() const { return role == ParamRole::lora_a || role == ParamRole::lora_b; }
  int64_t numel() const;
};

std::vector<ParamSpec> parameter_table(const LlamaConfig& config);

// A LoRA adapter of one linear: A [r, in] and B [out, r]; both undefined where the linear has none.
struct LoraPair {
  Tensor a, b;
  bool defined() const { return a.data != nullptr; }
};

// The adapters of one block's seven linears, by the linear's role.
struct LayerAdapters {
  LoraPair q, k, v, o, gate, up, down;
  LoraPair& of(ParamRole linear);
  const LoraPair& of(ParamRole linear) const { return const_cast<LayerAdapters*>(this)->of(linear); }
};

// One block's tensors. A set of adapters (or of their gradients) leaves the base tensors undefined;
// a base set leaves `lora` undefined; LlamaModel::weights() joins the two.
struct LayerWeights {
  Tensor attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
  Tensor q_bias, k_bias, v_bias;  // undefined without attention_bias
  Tensor o_bias;                  // undefined without o_bias
  Tensor q_norm, k_norm;          // undefined without qk_norm
  Tensor attn_post_norm, mlp_post_norm;  // undefined without post_norms
  LayerAdapters lora;
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
  // A zero-filled set of the given table (another table than the model's: LoRA adapters).
  ParamSet(const LlamaConfig& config, std::vector<ParamSpec> specs, DType dtype, Device device = Device::host());
  // A zero-filled set with the table of `like` (its gradients, its master copy, its moments).
  static ParamSet like(const ParamSet& like, DType dtype, Device device);
  static ParamSet like(const ParamSet& like, DType dtype) { return ParamSet::like(like, dtype, like.device()); }

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
  LayerWeights layer(int layer) const;  // block `layer`'s tensors (undefined where the table has none)
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

// HF's initialisation: linear and embedding weights N(0, initializer_range), norms at the identity (1,
// or 0 where the norm scales by (1 + w): config norm_weight_offset), biases 0. Device
// sets are drawn on the host (f64) and copied, so a GPU run starts from the same values as a CPU run.
// norm_jitter > 0 adds N(0, norm_jitter) to the norm weights and draws the biases N(0, norm_jitter)
// (gradient checks want no special point).
// Copies every element of src into dst (same table), converting dtype and crossing devices as needed
// (bf16 rounded to nearest even): master weights to the compute copy, device to host for a checkpoint.
void copy_params(const ParamSet& dst, const ParamSet& src);
// Every tensor of dst from the tensor of src with its name and shape (dst's table a part of src's),
// converting as copy_params does: the compute copy of the tensors outside the blocks when the blocks
// are rounded from the master a layer at a time (model/layer_cast.h).
void copy_params_by_name(const ParamSet& dst, const ParamSet& src);
// Whether two sets (tables) have the same table (names and shapes, in order).
bool same_table(const ParamSet& a, const ParamSet& b);
bool same_table(const std::vector<ParamSpec>& a, const std::vector<ParamSpec>& b);
// The table's tensors outside the blocks: the embedding, the final norm, an untied LM head.
std::vector<ParamSpec> outside_blocks(const std::vector<ParamSpec>& table);
// Block `layer`'s tensors of a table and its tensors (in table order), by role.
LayerWeights layer_weights(const std::vector<ParamSpec>& specs, const std::vector<Tensor>& tensors, int layer);

// Fails naming `tensor` and `file` at the first element of `t` (a host tensor) that is NaN or
// infinite: such a weight makes every output NaN, silently. The loaders (checkpoint, GGUF, adapter)
// call it on each tensor they read; CW_ALLOW_NONFINITE_WEIGHTS=1 lets them through for debugging.
void require_finite_weights(const Tensor& t, const std::string& tensor, const std::string& file);

void init_parameters(ParamSet& params, uint64_t seed, double initializer_range, double norm_jitter = 0.0);

}  // namespace cw
