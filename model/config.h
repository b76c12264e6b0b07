// Llama model configuration: what HF's config.json says, validated.
//
// The families (config.json's `model_type`, ModelFamily) are Llama's decoder with what each adds:
//   llama  LlamaForCausalLM: the block of model/layer.h; `attention_bias` puts biases on q_proj,
//          k_proj, v_proj and o_proj; `mlp_bias` must be false.
//   qwen2  Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on q_proj, k_proj, v_proj (always; o_proj none).
//   qwen3  Qwen3ForCausalLM: RMSNorm over each head's q and k after the projection, before RoPE
//          (q_norm, k_norm: one weight of head_dim shared by the heads); head_dim its own key;
//          `attention_bias` as Llama's.
//   mistral MistralForCausalLM: Llama's block (no biases) whose every layer attends through a
//          sliding window of `sliding_window` keys (an integer, or null: no window), as transformers'
//          sliding-window mask: a query at t sees keys t - W < j <= t (engine/ops/attention.h).
//          `head_dim` may be given apart from hidden / heads.
//   gemma2 Gemma2ForCausalLM: Llama's block with the embeddings times sqrt(hidden_size); RMSNorm
//          x r (1 + w) (weights stored as the scale's difference from 1, engine/ops/rmsnorm.h); two
//          more norms a layer, on the attention's and on the MLP's output before each residual add
//          (post_attention_layernorm, post_feedforward_layernorm; the MLP's input norm is
//          pre_feedforward_layernorm); the MLP gate gelu with the tanh approximation
//          (`hidden_activation` gelu_pytorch_tanh, engine/ops/geglu.h); attention scores scaled by
//          query_pre_attn_scalar^-1/2 and capped, cap tanh(s / cap) with cap = attn_logit_softcapping
//          (null: none); layers alternately sliding (`sliding_window` keys) and global, as
//          `layer_types` says or, without it, transformers' rule (even layers slide); the logits
//          capped by final_logit_softcapping (null: none). Absent keys take Gemma2Config's defaults
//          (the 2B's: head_dim 256, num_key_value_heads 4, tied embeddings, window 4096, caps 50 and
//          30). On a GPU the capped attention runs on the flash_mma kernels in bf16 (head dims 64,
//          128 and 256) and on flash_simt otherwise (engine/ops/attention.h).
// Qwen's sliding windows (`use_sliding_window` true, or `layer_types` other than full_attention),
// MLP biases and activations other than silu are refused naming the key.
//
// Reads both key forms of transformers' LlamaConfig: v4 (`rope_theta`, `rope_scaling`, `torch_dtype`)
// and v5 (`rope_parameters` holding rope_theta and the scaling, `dtype`). `head_dim` may be absent
// (= hidden_size / num_attention_heads); `num_key_value_heads` may be absent (= heads, no grouping);
// `eos_token_id` may be a number or a list; `tie_word_embeddings` means the LM head is the embedding
// table (no `lm_head.weight`). Every error names the file and the key.
//
// RoPE scaling (engine/ops/rope.h): default, linear, llama3, yarn and dynamic, read as transformers
// 5.24 resolves them: `rope_type` or the older `type`; for llama3 and yarn a top-level
// `original_max_position_embeddings` wins over the scaling's own, and without either it is
// `max_position_embeddings`; yarn's `factor` may be null (max_position_embeddings / original); yarn's
// beta_fast, beta_slow default to 32, 1 and truncate to true; dynamic scales from
// max_position_embeddings. Checked: factor >= 1 (yarn, dynamic), beta_fast > beta_slow > 0, a positive
// original length and attention factor. to_json writes the resolved values back as `rope_scaling`
// (yarn's attention_factor, mscale and mscale_all_dim only when given, truncate only when false).
//
// Dimension letters used across the code: V vocab, C hidden, F intermediate (FFN), L layers,
// H query heads, Hkv key/value heads, D head dim.
#pragma once

#include "engine/ops/attention.h"
#include "engine/ops/rope.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace cw {

// The names a config's keys have in the file it came from, for messages: config.json's by default;
// a GGUF file's metadata keys name them otherwise (model/gguf_llama.cpp).
struct ConfigKeyNames {
  const char* vocab_size = "vocab_size";
  const char* hidden_size = "hidden_size";
  const char* intermediate_size = "intermediate_size";
  const char* num_hidden_layers = "num_hidden_layers";
  const char* num_attention_heads = "num_attention_heads";
  const char* num_key_value_heads = "num_key_value_heads";
  const char* head_dim = "head_dim";
  const char* max_position_embeddings = "max_position_embeddings";
  const char* rms_norm_eps = "rms_norm_eps";
  const char* rope_theta = "rope_theta";
  const char* sliding_window = "sliding_window";
};

// Plausibility bounds on a config's sizes. A config.json alone gives no file to measure them
// against (its weights may be absent: `chunkwise init` draws them), so each size has an absolute
// bound far above every published Llama-architecture model and far below what would make a table
// sized by it fail to allocate or overflow int64: a damaged or hostile file is refused with a line
// naming the key before anything is allocated. A file that holds the weights bounds the sizes by
// its tensors as well (model/gguf_llama.cpp, model/checkpoint.cpp).
struct ConfigLimits {
  // Llama 3.1 405B has 126 blocks; per-layer tables (KV stores, schedules) are sized by L.
  static constexpr int64_t kMaxLayers = int64_t{1} << 14;
  // Widths: Llama 3.1 405B has C = 16384 and F = 53248.
  static constexpr int64_t kMaxWidth = int64_t{1} << 20;
  // Heads and the head dim: 128 heads of 128 at most in published Llamas; the attention kernels
  // index heads and head dims in int32.
  static constexpr int64_t kMaxHeads = int64_t{1} << 16;
  static constexpr int64_t kMaxHeadDim = int64_t{1} << 14;
  // Token ids are int32 / uint32 in token files and tokenizers; the largest vocabularies hold ~256K.
  static constexpr int64_t kMaxVocab = (int64_t{1} << 31) - 1;
  // Positions are int32 in the RoPE tables and the batches.
  static constexpr int64_t kMaxPositions = (int64_t{1} << 31) - 1;
  // 2^42 parameters (4.4 trillion, 17.6 TB in f32): above every dense model published, and its
  // byte count in f64 (2^45) stays far inside int64.
  static constexpr int64_t kMaxParameters = int64_t{1} << 42;
};

// The architecture a config describes: HF's model_type.
enum class ModelFamily { llama, qwen2, qwen3, mistral, gemma2 };
const char* model_family_name(ModelFamily family);  // "llama", "qwen2", "qwen3", "mistral", "gemma2"

// The MLP's gate: silu (SwiGLU, engine/ops/swiglu.h) or gelu with the tanh approximation (GeGLU,
// engine/ops/geglu.h; transformers' gelu_pytorch_tanh).
enum class MlpGate { silu, gelu_tanh };

struct LlamaConfig {
  int64_t vocab_size = 0;            // V
  int64_t hidden_size = 0;           // C
  int64_t intermediate_size = 0;     // F
  int64_t num_hidden_layers = 0;     // L
  int64_t num_attention_heads = 0;   // H
  int64_t num_key_value_heads = 0;   // Hkv
  int64_t head_dim = 0;              // D
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;          // type none unless the config asks for linear, llama3, yarn or dynamic
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;         // -1: not given
  std::vector<int64_t> eos_token_ids;
  int64_t pad_token_id = -1;         // -1: not given (kept for the config.json a checkpoint carries)
  std::string torch_dtype = "float32";  // the checkpoint's stored dtype, as HF names it
  ModelFamily family = ModelFamily::llama;
  bool attention_bias = false;       // biases on q_proj, k_proj, v_proj [H*D], [Hkv*D] (qwen2; attention_bias)
  bool o_bias = false;               // a bias on o_proj [C] (Llama's and Qwen3's attention_bias)
  bool qk_norm = false;              // q_norm, k_norm [D] on each head before RoPE (qwen3)
  int64_t sliding_window = 0;        // W: a query attends the W newest keys, itself included (mistral); 0: all
  // The layers the window applies to (gemma2's layer_types: true for sliding_attention); empty: every
  // layer (mistral).
  std::vector<bool> sliding_layers;
  // Gemma 2's block (gemma2; each its own field, so the block reads features rather than families):
  MlpGate mlp_gate = MlpGate::silu;     // hidden_activation gelu_pytorch_tanh: gelu_tanh
  bool post_norms = false;              // post_attention_layernorm, post_feedforward_layernorm [C] a layer
  double norm_weight_offset = 0.0;      // every RMSNorm scales by (offset + w): 1 (Gemma), 0 (Llama)
  bool scale_embeddings = false;        // x_0 = sqrt(C) E[ids], the normaliser rounded to the dtype
  double query_pre_attn_scalar = 0.0;   // attention scale query_pre_attn_scalar^-1/2; 0: head_dim^-1/2
  double attn_logit_softcapping = 0.0;  // attention scores capped, cap tanh(s / cap); 0: none
  double final_logit_softcapping = 0.0; // logits capped likewise before the loss; 0: none

  // Parses a config.json document; `source` names the file in error messages.
  static LlamaConfig from_json(const nlohmann::json& j, const std::string& source);
  static LlamaConfig from_file(const std::string& path);
  // A built-in preset: "tiny", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2" (tests),
  // "small" (the CPU demo), "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b",
  // "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b", "mistral-7b", "gemma2-2b", "gemma2-9b". Throws listing the
  // names for an unknown one.
  static LlamaConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // A preset name, a config.json path, an HF checkpoint directory holding config.json, or a GGUF
  // file (its metadata: model/gguf_llama.h).
  static LlamaConfig resolve(const std::string& spec);

  // Checks the invariants (positive sizes within ConfigLimits, heads dividing, head_dim even, finite
  // RoPE parameters, ...); throws naming the key as `keys` spell it.
  void validate(const std::string& source, const ConfigKeyNames& keys = {}) const;
  void validate_gemma2(const std::string& source) const;  // Gemma 2's parts: validate() calls it
  // The config.json a checkpoint we write carries (v4 keys, which transformers 4.x and 5.x both read).
  nlohmann::json to_json() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }     // H * D
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }    // Hkv * D
  // The sliding window of layer `layer`: W where the window applies to it (every layer of a Mistral,
  // Gemma 2's sliding layers), else 0.
  int64_t layer_window(int64_t layer) const;
  // The first key a query at `position` attends within its sequence (or document, positions counted
  // in it) in layer `layer`: position - W + 1 under a sliding window, else 0.
  int64_t first_visible_key(int64_t layer, int64_t position) const {
    return window_first_key(position, layer_window(layer));
  }
  // Whether any layer has a window (the planner's and the store's question).
  bool has_sliding_window() const;
  // The attention's score scale: query_pre_attn_scalar^-1/2 (Gemma 2), else head_dim^-1/2.
  double attention_scale() const;
  int64_t parameter_count() const;  // exact; validate() keeps it within ConfigLimits::kMaxParameters
};


}  // namespace cw
