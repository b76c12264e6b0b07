// Llama model configuration: what HF's config.json says, validated.
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

#include "engine/ops/rope.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace cw {

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

  // Parses a config.json document; `source` names the file in error messages.
  static LlamaConfig from_json(const nlohmann::json& j, const std::string& source);
  static LlamaConfig from_file(const std::string& path);
  // A built-in preset: "tiny" (tests), "small" (the CPU demo), "llama-3.2-1b", "llama-3.2-3b",
  // "llama-3.1-8b". Throws listing the names for an unknown one.
  static LlamaConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // A preset name, a config.json path, an HF checkpoint directory holding config.json, or a GGUF
  // file (its metadata: model/gguf_llama.h).
  static LlamaConfig resolve(const std::string& spec);

  // Checks the invariants (positive sizes, heads dividing, head_dim even, ...); throws naming the key.
  void validate(const std::string& source) const;
  // The config.json a checkpoint we write carries (v4 keys, which transformers 4.x and 5.x both read).
  nlohmann::json to_json() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }     // H * D
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }    // Hkv * D
  int64_t parameter_count() const;
};

}  // namespace cw
