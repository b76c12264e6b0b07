#include "model/config.h"

#include "engine/error.h"
#include "model/checkpoint.h"
#include "model/gguf_llama.h"
#include "model/json_fields.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>

namespace cw {

namespace {
using nlohmann::json;

// The range checks of a scaling's values; `where` is the key its values came from (rope_scaling or
// rope_parameters), so the message names the key as the file spells it.
void check_rope_scaling(const RopeScaling& r, int64_t max_position_embeddings, const std::string& src,
                        const std::string& where) {
  const std::string type = rope_type_name(r.type);
  auto bad = [&](const std::string& what, const std::string& hint) {
    fail(fmt::format("{}: {}.{} ({} RoPE)", src, where, what, type), hint);
  };
  // Every factor must be finite: inf or NaN passes the range checks below (NaN fails every
  // comparison, so `!(x > 0)` catches it, but inf > 0) and turns the rotation into NaN.
  for (const auto& [name, value] : {std::pair<const char*, double>{"factor", r.factor},
                                    {"low_freq_factor", r.low_freq_factor}, {"high_freq_factor", r.high_freq_factor},
                                    {"beta_fast", r.beta_fast}, {"beta_slow", r.beta_slow}})
    if (!std::isfinite(value)) bad(fmt::format("{} must be finite, got {}", name, value), "fix the value in the config");
  for (const auto& [name, value] : {std::pair<const char*, std::optional<double>>{"attention_factor", r.attention_factor},
                                    {"mscale", r.mscale}, {"mscale_all_dim", r.mscale_all_dim}})
    if (value && !std::isfinite(*value)) bad(fmt::format("{} must be finite, got {}", name, *value), "fix the value in the config");
  const bool has_original = r.type == RopeScaling::Type::llama3 || r.type == RopeScaling::Type::yarn;
  if (has_original && r.original_max_position <= 0)
    bad(fmt::format("original_max_position_embeddings must be positive, got {}", r.original_max_position),
        "give the context length the model was pretrained with");
  switch (r.type) {
    case RopeScaling::Type::none: return;
    case RopeScaling::Type::linear:
      if (!(r.factor > 0)) bad(fmt::format("factor must be positive, got {}", r.factor), "fix the value in the config");
      return;
    case RopeScaling::Type::llama3:
      if (!(r.factor > 0)) bad(fmt::format("factor must be positive, got {}", r.factor), "fix the value in the config");
      if (!(r.high_freq_factor > r.low_freq_factor))
        bad(fmt::format("high_freq_factor {} must exceed low_freq_factor {}", r.high_freq_factor, r.low_freq_factor),
            "fix the values in the config");
      return;
    case RopeScaling::Type::yarn:
      if (!(r.factor >= 1))
        bad(fmt::format("factor must be >= 1, got {}", r.factor),
            "factor is the ratio of the extended context to original_max_position_embeddings");
      if (!(r.beta_slow > 0 && r.beta_fast > r.beta_slow))
        bad(fmt::format("beta_fast {} and beta_slow {} must satisfy beta_fast > beta_slow > 0", r.beta_fast, r.beta_slow),
            "leave them out for YaRN's 32 and 1");
      if (const double a = rope_attention_factor(r); !(a > 0 && std::isfinite(a)))
        bad(fmt::format("{} must be positive, got {}",
                        r.attention_factor ? "attention_factor" : "attention factor from factor, mscale and mscale_all_dim",
                        a),
            "fix attention_factor, or mscale and mscale_all_dim");
      return;
    case RopeScaling::Type::dynamic:
      if (!(r.factor >= 1)) bad(fmt::format("factor must be >= 1, got {}", r.factor), "fix the value in the config");
      if (r.original_max_position != max_position_embeddings)
        fail(fmt::format("{}: dynamic RoPE scales from max_position_embeddings ({}), but its original length is {}", src,
                         max_position_embeddings, r.original_max_position),
             "keep the scaling's original length equal to max_position_embeddings");
      return;
  }
}

// Reads rope_scaling (v4) or rope_parameters (v5) as transformers 5.24's standardize_rope_params and
// _compute_*_parameters do: rope_type, or the older `type`; for llama3 and yarn a top-level
// original_max_position_embeddings wins over the scaling's own, and without either it is
// max_position_embeddings; yarn's factor may be null (max_position_embeddings / original); dynamic
// scales from max_position_embeddings.
RopeScaling parse_rope_scaling(const JsonObject& s, const JsonObject& config, int64_t max_position_embeddings,
                               const std::string& src) {
  RopeScaling r;
  const char* where = nullptr;
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (s.has(key)) {
      type = s.string(key);
      where = key;
      break;
    }
  if (type == "default") return r;
  // original_max_position_embeddings as HF resolves it for llama3 and yarn.
  auto original_max = [&] {
    const char* key = "original_max_position_embeddings";
    if (config.has(key)) return config.integer(key);
    return s.integer_or(key, max_position_embeddings);
  };
  auto optional_double = [&](const char* key) -> std::optional<double> {
    if (!s.has(key)) return std::nullopt;
    return s.number(key);
  };
  if (type == "linear") {
    r.type = RopeScaling::Type::linear;
    r.factor = s.number("factor");
  } else if (type == "llama3") {
    r.type = RopeScaling::Type::llama3;
    r.factor = s.number("factor");
    r.low_freq_factor = s.number("low_freq_factor");
    r.high_freq_factor = s.number("high_freq_factor");
    r.original_max_position = original_max();
  } else if (type == "yarn") {
    r.type = RopeScaling::Type::yarn;
    r.original_max_position = original_max();
    if (!s.value().contains("factor")) s.fail_key("factor", "is missing", "add the key to the config");
    // null: the ratio of the extended context to the original one, as DeepSeek-V3's configs mean it.
    r.factor = s.has("factor") ? s.number("factor")
                               : static_cast<double>(max_position_embeddings) / static_cast<double>(r.original_max_position);
    r.beta_fast = s.number_or("beta_fast", 32.0);
    r.beta_slow = s.number_or("beta_slow", 1.0);
    r.attention_factor = optional_double("attention_factor");
    r.mscale = optional_double("mscale");
    r.mscale_all_dim = optional_double("mscale_all_dim");
    // HF tests truthiness: null truncates nothing, like false.
    if (s.value().contains("truncate")) r.truncate = s.boolean_or("truncate", false);
  } else if (type == "dynamic") {
    r.type = RopeScaling::Type::dynamic;
    r.factor = s.number("factor");
    r.original_max_position = max_position_embeddings;
  } else {
    s.fail_key(where, fmt::format("is '{}', an unknown RoPE type", type),
               "chunkwise supports default, linear, llama3, yarn and dynamic RoPE");
  }
  check_rope_scaling(r, max_position_embeddings, src, s.path());
  return r;
}
}  // namespace

namespace {
// Each family's names in config.json: its model_type and its transformers class (`architectures`).
struct FamilyNames {
  ModelFamily family;
  const char* model_type;
  const char* architecture;
};
constexpr FamilyNames kFamilies[] = {{ModelFamily::llama, "llama", "LlamaForCausalLM"},
                                     {ModelFamily::qwen2, "qwen2", "Qwen2ForCausalLM"},
                                     {ModelFamily::qwen3, "qwen3", "Qwen3ForCausalLM"},
                                     {ModelFamily::mistral, "mistral", "MistralForCausalLM"},
                                     {ModelFamily::gemma2, "gemma2", "Gemma2ForCausalLM"}};

const FamilyNames& names_of(ModelFamily f) {
  for (const FamilyNames& n : kFamilies)
    if (n.family == f) return n;
  fail(fmt::format("model family {} has no names", static_cast<int>(f)));
}
const char* architecture_name(ModelFamily f) { return names_of(f).architecture; }

// The family from `model_type`, or without it from `architectures`, or Llama; `architectures`, when
// given, must name the family's class.
ModelFamily read_family(const JsonObject& j, const std::string& src) {
  const json* architectures = j.find("architectures");
  auto names = [&](ModelFamily f) {
    if (!architectures || !architectures->is_array()) return false;
    for (const auto& a : *architectures)
      if (a.is_string() && a.get<std::string>() == architecture_name(f)) return true;
    return false;
  };
  std::optional<ModelFamily> family;
  if (j.has("model_type")) {
    const std::string type = j.string("model_type");
    for (const FamilyNames& n : kFamilies)
      if (type == n.model_type) family = n.family;
    if (!family)
      j.fail_key("model_type", fmt::format("is '{}', a model chunkwise does not train", type.substr(0, 60)),
                 "chunkwise trains llama, qwen2, qwen3, mistral and gemma2 models");
  } else {
    for (const FamilyNames& n : kFamilies)
      if (names(n.family)) family = n.family;
  }
  const ModelFamily f = family.value_or(ModelFamily::llama);
  if (architectures && architectures->is_array() && !names(f))
    fail(fmt::format("{}: architectures {} does not include {}", src, architectures->dump(), architecture_name(f)),
         "chunkwise trains LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM and "
         "Gemma2ForCausalLM models");
  return f;
}

// The keys of a config that ask for something chunkwise's blocks do not compute: each refused by name.
// Gemma 2's activation and layer types are its own keys (read_gemma2): Gemma2MLP reads
// hidden_activation and no hidden_act, whatever the file says of it.
void refuse_unsupported(const JsonObject& j, ModelFamily family) {
  if (j.boolean_or("mlp_bias", false))
    j.fail_key("mlp_bias", "is true: biases on the MLP's projections are not supported", "use a model without them");
  if (family == ModelFamily::gemma2) return;
  if (const std::string act = j.string_or("hidden_act", "silu"); act != "silu")
    j.fail_key("hidden_act", fmt::format("is '{}': chunkwise's MLP is SwiGLU with silu", act.substr(0, 60)),
               "use a model whose hidden_act is silu");
  if (j.boolean_or("use_sliding_window", false))
    j.fail_key("use_sliding_window", "is true: sliding-window attention is not supported",
               "set it to false (every layer then attends to the whole context, as Qwen's released models do)");
  if (const json* types = j.find("layer_types"); types) {
    if (!types->is_array()) j.fail_key("layer_types", "must be a list", "give one entry per layer");
    for (size_t i = 0; i < types->size(); ++i)
      if (!(*types)[i].is_string() || (*types)[i].get<std::string>() != "full_attention")
        j.fail_key("layer_types", fmt::format("[{}] is {}: chunkwise's layers are all full_attention", i,
                                              (*types)[i].dump().substr(0, 60)),
                   "use a model without sliding-window layers");
  }
}

// A cap of Gemma 2 (attn_logit_softcapping, final_logit_softcapping): absent, Gemma2Config's
// default; null, none (0); else positive and finite.
double read_softcap(const JsonObject& j, const char* key, double absent) {
  if (!j.value().contains(key)) return absent;
  if (!j.has(key)) return 0.0;
  const double cap = j.number(key);
  if (!(cap > 0)) j.fail_key(key, fmt::format("is {}: a cap must be positive", cap), "give a positive cap, or null for none");
  return cap;
}

// What Gemma 2 adds to Llama's config (model/config.h), read as transformers 5.24's Gemma2Config:
// absent keys take its defaults, the 2B's.
void read_gemma2(const JsonObject& j, LlamaConfig& c) {
  c.post_norms = true;
  c.norm_weight_offset = 1.0;
  c.scale_embeddings = true;
  if (const std::string act = j.string_or("hidden_activation", "gelu_pytorch_tanh"); act != "gelu_pytorch_tanh")
    j.fail_key("hidden_activation",
               fmt::format("is '{}': chunkwise's Gemma 2 MLP gate is gelu with the tanh approximation",
                           act.substr(0, 60)),
               "use a model whose hidden_activation is gelu_pytorch_tanh");
  c.mlp_gate = MlpGate::gelu_tanh;
  if (j.boolean_or("use_bidirectional_attention", false))
    j.fail_key("use_bidirectional_attention", "is true: chunkwise's attention is causal",
               "use a causal language model (use_bidirectional_attention false)");
  c.query_pre_attn_scalar = j.number_or("query_pre_attn_scalar", 256.0);
  if (!(c.query_pre_attn_scalar > 0))
    j.fail_key("query_pre_attn_scalar", fmt::format("is {}: the attention scale is its inverse square root",
                                                    c.query_pre_attn_scalar),
               "give a positive value (Gemma 2 uses 256, or hidden_size / num_attention_heads)");
  c.attn_logit_softcapping = read_softcap(j, "attn_logit_softcapping", 50.0);
  c.final_logit_softcapping = read_softcap(j, "final_logit_softcapping", 30.0);
  // The window: Gemma2Config's default 4096 when the key is absent. transformers' Gemma 2 builds its
  // sliding layers' mask from it whatever the layer types, and refuses null: so does this.
  if (j.value().contains("sliding_window") && !j.has("sliding_window"))
    j.fail_key("sliding_window", "is null: Gemma 2's sliding layers need a window",
               "give a window; layer_types all full_attention make every layer global");
  c.sliding_window = j.integer_or("sliding_window", 4096);
  if (c.sliding_window <= 0)
    j.fail_key("sliding_window", fmt::format("is {}: a window holds at least one key", c.sliding_window),
               "give a positive window");
  // Which layers slide: layer_types, or transformers' rule without it (layers 0, 2, 4, ... slide).
  // A layer count out of bounds is refused by validate() before anything is sized by it.
  const int64_t L = c.num_hidden_layers;
  if (L <= 0 || L > ConfigLimits::kMaxLayers) return;
  if (!j.has("layer_types")) {
    for (int64_t l = 0; l < L; ++l) c.sliding_layers.push_back(l % 2 == 0);
    return;
  }
  const nlohmann::json& types = j.array("layer_types");
  if (static_cast<int64_t>(types.size()) != L)
    j.fail_key("layer_types", fmt::format("has {} entries for {} layers (num_hidden_layers)", types.size(), L),
               "give one entry per layer");
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string type = json_string(types[i], j.file(), j.path_of("layer_types") + fmt::format("[{}]", i));
    if (type != "sliding_attention" && type != "full_attention")
      j.fail_key("layer_types", fmt::format("[{}] is '{}': Gemma 2's layers are sliding_attention or full_attention", i,
                                            type.substr(0, 60)),
                 "give sliding_attention or full_attention for each layer");
    c.sliding_layers.push_back(type == "sliding_attention");
  }
}
}  // namespace

const char* model_family_name(ModelFamily family) { return names_of(family).model_type; }

int64_t LlamaConfig::layer_window(int64_t layer) const {
  if (sliding_window == 0 || sliding_layers.empty()) return sliding_window;
  CW_CHECK(layer >= 0 && layer < static_cast<int64_t>(sliding_layers.size()), "layer {} of a model of {} layers",
           layer, sliding_layers.size());
  return sliding_layers[static_cast<size_t>(layer)] ? sliding_window : 0;
}

bool LlamaConfig::has_sliding_window() const {
  for (int64_t l = 0; l < num_hidden_layers; ++l)
    if (layer_window(l) > 0) return true;
  return false;
}

double LlamaConfig::attention_scale() const {
  return 1.0 / std::sqrt(query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim));
}

LlamaConfig LlamaConfig::from_json(const json& document, const std::string& src) {
  const JsonObject j(document, src, "",
                     "compare with a transformers LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig or "
                     "Gemma2Config");
  LlamaConfig c;
  c.family = read_family(j, src);
  const bool gemma2 = c.family == ModelFamily::gemma2;
  refuse_unsupported(j, c.family);
  // Qwen2's q/k/v biases are its type's; Llama's, Qwen3's and Gemma 2's attention_bias adds o_proj's
  // too; Mistral's projections have none (MistralAttention reads no attention_bias).
  c.attention_bias = c.family == ModelFamily::qwen2 ||
                     (c.family != ModelFamily::mistral && j.boolean_or("attention_bias", false));
  c.o_bias = c.family != ModelFamily::qwen2 && c.attention_bias;
  c.qk_norm = c.family == ModelFamily::qwen3;
  c.vocab_size = j.integer("vocab_size");
  c.hidden_size = j.integer("hidden_size");
  c.intermediate_size = j.integer("intermediate_size");
  c.num_hidden_layers = j.integer("num_hidden_layers");
  c.num_attention_heads = j.integer("num_attention_heads");
  // Gemma2Config's defaults are the 2B's: 4 K/V heads of 256.
  c.num_key_value_heads = j.integer_or("num_key_value_heads", gemma2 ? 4 : c.num_attention_heads);
  if (c.num_attention_heads > 0 && !j.has("head_dim") && !gemma2) {
    if (c.hidden_size % c.num_attention_heads != 0)
      fail(fmt::format("{}: hidden_size {} is not divisible by num_attention_heads {} and head_dim is absent", src,
                       c.hidden_size, c.num_attention_heads), "give head_dim explicitly");
  }
  c.head_dim = j.integer_or("head_dim", gemma2                    ? 256
                                       : c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads
                                                                   : 0);
  c.max_position_embeddings = j.integer_or("max_position_embeddings", gemma2 ? 8192 : 2048);
  c.rms_norm_eps = j.number_or("rms_norm_eps", 1e-6);
  // Mistral's window: MistralConfig's default 4096 when the key is absent; null, no window. Other
  // families carry no window (Qwen2's sliding_window counts only with use_sliding_window, refused).
  if (c.family == ModelFamily::mistral && !j.value().contains("sliding_window")) c.sliding_window = 4096;
  if (c.family == ModelFamily::mistral && j.has("sliding_window")) {
    c.sliding_window = j.integer("sliding_window");
    if (c.sliding_window <= 0)
      j.fail_key("sliding_window", fmt::format("is {}: a window holds at least one key", c.sliding_window),
                 "give a positive window, or null for none");
  }
  if (gemma2) read_gemma2(j, c);
  c.initializer_range = j.number_or("initializer_range", 0.02);
  c.tie_word_embeddings = j.boolean_or("tie_word_embeddings", gemma2);
  // v5 keeps theta and scaling together in rope_parameters; v4 has rope_theta and rope_scaling.
  if (j.has("rope_parameters")) {
    const JsonObject rp = j.object("rope_parameters");
    c.rope_theta = rp.number_or("rope_theta", 10000.0);
    c.rope_scaling = parse_rope_scaling(rp, j, c.max_position_embeddings, src);
  } else {
    c.rope_theta = j.number_or("rope_theta", 10000.0);
    if (j.has("rope_scaling"))
      c.rope_scaling = parse_rope_scaling(j.object("rope_scaling"), j, c.max_position_embeddings, src);
  }
  c.bos_token_id = j.integer_or("bos_token_id", -1);
  c.pad_token_id = j.integer_or("pad_token_id", -1);
  if (const json* e = j.find("eos_token_id")) {
    if (e->is_array()) {
      for (size_t i = 0; i < e->size(); ++i)
        c.eos_token_ids.push_back(json_integer((*e)[i], src, fmt::format("eos_token_id[{}]", i)));
    } else {
      c.eos_token_ids.push_back(j.integer("eos_token_id"));
    }
  }
  for (const char* key : {"dtype", "torch_dtype"})
    if (const json* v = j.find(key); v && v->is_string()) {
      c.torch_dtype = v->get<std::string>();
      break;
    }
  c.validate(src);
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(fmt::format("cannot open model config '{}'", path), "check the path");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return from_json(json_parse(text, path, "fix or re-download config.json"), path);
}

// Gemma 2's parts come together and with the family alone: config.json says them through
// model_type gemma2, so no other combination could be written back.
void LlamaConfig::validate_gemma2(const std::string& src) const {
  const bool gemma2 = family == ModelFamily::gemma2;
  const bool parts = mlp_gate == MlpGate::gelu_tanh && post_norms && norm_weight_offset == 1.0 && scale_embeddings;
  const bool none = mlp_gate == MlpGate::silu && !post_norms && norm_weight_offset == 0.0 && !scale_embeddings &&
                    query_pre_attn_scalar == 0.0 && attn_logit_softcapping == 0.0 && final_logit_softcapping == 0.0 &&
                    sliding_layers.empty();
  if (gemma2 ? !parts : !none)
    fail(fmt::format("{}: {}", src,
                     gemma2 ? "gemma2's block has the gelu gate, the post-norms, the (1 + w) norm weights and the "
                              "scaled embeddings, all of them"
                            : fmt::format("Gemma 2's gate, post-norms, norm offset, embedding scale, attention scalar, "
                                          "caps and layer types belong to gemma2, not {}",
                                          model_family_name(family))),
         "set model_type to gemma2, or leave Gemma 2's parts out");
  if (!gemma2) return;
  auto positive = [&](double v, const char* key, bool zero_allowed) {
    if (!std::isfinite(v) || v < 0 || (v == 0 && !zero_allowed))
      fail(fmt::format("{}: '{}' must be positive and finite{}, got {}", src, key, zero_allowed ? " (0: none)" : "", v),
           "fix the value in the file");
  };
  positive(query_pre_attn_scalar, "query_pre_attn_scalar", false);
  positive(attn_logit_softcapping, "attn_logit_softcapping", true);
  positive(final_logit_softcapping, "final_logit_softcapping", true);
  if (sliding_window <= 0)
    fail(fmt::format("{}: gemma2's 'sliding_window' must be positive, got {}", src, sliding_window),
         "give a window (transformers' Gemma 2 needs one); layer_types all full_attention make every layer global");
  if (static_cast<int64_t>(sliding_layers.size()) != num_hidden_layers)
    fail(fmt::format("{}: 'layer_types' has {} entries for {} layers", src, sliding_layers.size(), num_hidden_layers),
         "give one entry per layer");
}

void LlamaConfig::validate(const std::string& src, const ConfigKeyNames& keys) const {
  auto in_range = [&](int64_t v, const char* key, int64_t limit, const char* why) {
    if (v <= 0) fail(fmt::format("{}: '{}' must be positive, got {}", src, key, v), "fix the value in the file");
    if (v > limit)
      fail(fmt::format("{}: '{}' is {}, above the limit {} ({})", src, key, v, limit, why),
           "the file is damaged or not a Llama model's: fix the value or re-download the file");
  };
  in_range(vocab_size, keys.vocab_size, ConfigLimits::kMaxVocab, "token ids are int32");
  in_range(hidden_size, keys.hidden_size, ConfigLimits::kMaxWidth, "no Llama is a thousandth as wide");
  in_range(intermediate_size, keys.intermediate_size, ConfigLimits::kMaxWidth, "no Llama is a tenth as wide");
  in_range(num_hidden_layers, keys.num_hidden_layers, ConfigLimits::kMaxLayers, "no Llama has a hundredth as many");
  in_range(num_attention_heads, keys.num_attention_heads, ConfigLimits::kMaxHeads, "heads are indexed in int32");
  in_range(num_key_value_heads, keys.num_key_value_heads, ConfigLimits::kMaxHeads, "heads are indexed in int32");
  in_range(head_dim, keys.head_dim, ConfigLimits::kMaxHeadDim, "no Llama has a head a hundredth as wide");
  in_range(max_position_embeddings, keys.max_position_embeddings, ConfigLimits::kMaxPositions,
           "positions are int32");
  // Each size is at most 2^31 here, so every product below fits int64; the total is checked with
  // overflow checks all the same, as the sum of many of them.
  int64_t total = 0;
  const int64_t C = hidden_size;
  const int64_t per_layer = 4 * C + 2 * C * q_dim() + 2 * C * kv_dim() + 3 * C * intermediate_size +
                            q_dim() + 2 * kv_dim() + C + 2 * head_dim;  // norms, biases and per-head norms at most
  bool overflow = __builtin_mul_overflow(per_layer, num_hidden_layers, &total);
  overflow = overflow || __builtin_add_overflow(total, 2 * vocab_size * C + C, &total);
  if (overflow || total > ConfigLimits::kMaxParameters)
    fail(fmt::format("{}: {} = {}, {} = {}, {} = {} and {} = {} make {} parameters, above the limit {} (2^42)", src,
                     keys.vocab_size, vocab_size, keys.hidden_size, hidden_size, keys.intermediate_size,
                     intermediate_size, keys.num_hidden_layers, num_hidden_layers,
                     overflow ? std::string("more than 2^63") : std::to_string(total), ConfigLimits::kMaxParameters),
         "the file is damaged or not a Llama model's: fix the sizes or re-download the file");
  if (num_attention_heads % num_key_value_heads != 0)
    fail(fmt::format("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", src,
                     num_attention_heads, num_key_value_heads), "grouped-query attention needs whole groups");
  if (head_dim % 2 != 0) fail(fmt::format("{}: head_dim {} must be even for RoPE", src, head_dim));
  // config.json says these through the family and attention_bias: anything else could not be written back.
  if (o_bias != (attention_bias && family != ModelFamily::qwen2))
    fail(fmt::format("{}: {} has {} o_proj bias {} q/k/v biases", src, model_family_name(family), o_bias ? "an" : "no",
                     attention_bias ? "with" : "without"),
         "Qwen2 biases q, k and v; Llama's and Qwen3's attention_bias biases q, k, v and o");
  if (qk_norm && family != ModelFamily::qwen3)
    fail(fmt::format("{}: per-head q/k norms belong to qwen3, not {}", src, model_family_name(family)),
         "set model_type to qwen3, or leave the norms out");
  if (sliding_window < 0)
    fail(fmt::format("{}: '{}' must be positive (or null: no window), got {}", src, keys.sliding_window,
                     sliding_window),
         "fix the value in the file (Mistral 7B v0.1 uses 4096)");
  if (sliding_window > 0 && family != ModelFamily::mistral && family != ModelFamily::gemma2)
    fail(fmt::format("{}: a sliding window belongs to mistral and gemma2, not {}", src, model_family_name(family)),
         "set model_type to mistral, or leave the window out");
  if (family == ModelFamily::mistral && attention_bias)
    fail(fmt::format("{}: mistral has no attention biases", src), "leave attention_bias out");
  validate_gemma2(src);
  // Non-finite values would pass a bare `> 0`; they make every activation NaN.
  if (!(rms_norm_eps > 0 && std::isfinite(rms_norm_eps)))
    fail(fmt::format("{}: '{}' must be positive and finite, got {}", src, keys.rms_norm_eps, rms_norm_eps),
         "fix the value in the file");
  if (!(rope_theta > 0 && std::isfinite(rope_theta)))
    fail(fmt::format("{}: '{}' must be positive and finite, got {}", src, keys.rope_theta, rope_theta),
         "fix the value in the file (Llama 3 uses 500000, Llama 2 10000)");
  if (rope_scaling.type == RopeScaling::Type::dynamic && head_dim <= 2)
    fail(fmt::format("{}: dynamic RoPE needs head_dim > 2, got {}", src, head_dim), "use another RoPE scaling");
  check_rope_scaling(rope_scaling, max_position_embeddings, src, "rope_scaling");
}

json LlamaConfig::to_json() const {
  json j = {
      {"architectures", {architecture_name(family)}},
      {"model_type", model_family_name(family)},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"max_position_embeddings", max_position_embeddings},
      {"rms_norm_eps", rms_norm_eps},
      {"rope_theta", rope_theta},
      {"tie_word_embeddings", tie_word_embeddings},
      {"initializer_range", initializer_range},
      {"torch_dtype", torch_dtype},
  };
  // Gemma2MLP reads hidden_activation; the others' MLPs hidden_act.
  if (mlp_gate == MlpGate::gelu_tanh) j["hidden_activation"] = "gelu_pytorch_tanh";
  else j["hidden_act"] = "silu";
  // Qwen2's biases are implied by its model_type (Qwen2Config has no attention_bias).
  if (family != ModelFamily::qwen2) j["attention_bias"] = attention_bias;
  if (family == ModelFamily::llama) j["mlp_bias"] = false;
  if (family == ModelFamily::qwen2 || family == ModelFamily::qwen3) j["use_sliding_window"] = false;
  if (family == ModelFamily::mistral) {
    j.erase("attention_bias");  // MistralConfig has none
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  }
  if (family == ModelFamily::gemma2) {
    j["sliding_window"] = sliding_window;
    json& types = j["layer_types"] = json::array();
    for (const bool sliding : sliding_layers) types.push_back(sliding ? "sliding_attention" : "full_attention");
    // Gemma2Config types the scalar an int: written as one where it is integral.
    const double scalar = query_pre_attn_scalar;
    j["query_pre_attn_scalar"] = scalar == std::floor(scalar) && scalar < 9.0e15 ? json(static_cast<int64_t>(scalar))
                                                                                 : json(scalar);
    auto cap = [](double c) { return c > 0 ? json(c) : json(nullptr); };
    j["attn_logit_softcapping"] = cap(attn_logit_softcapping);
    j["final_logit_softcapping"] = cap(final_logit_softcapping);
  }
  switch (rope_scaling.type) {
    case RopeScaling::Type::none: j["rope_scaling"] = nullptr; break;
    case RopeScaling::Type::linear: j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rope_scaling.factor}}; break;
    case RopeScaling::Type::llama3:
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", rope_scaling.factor},
                           {"low_freq_factor", rope_scaling.low_freq_factor},
                           {"high_freq_factor", rope_scaling.high_freq_factor},
                           {"original_max_position_embeddings", rope_scaling.original_max_position}};
      break;
    case RopeScaling::Type::yarn: {
      json& y = j["rope_scaling"];
      y = {{"rope_type", "yarn"},
           {"factor", rope_scaling.factor},
           {"original_max_position_embeddings", rope_scaling.original_max_position},
           {"beta_fast", rope_scaling.beta_fast},
           {"beta_slow", rope_scaling.beta_slow}};
      // Only what was given: absent, HF derives the attention factor (and truncates) itself.
      if (rope_scaling.attention_factor) y["attention_factor"] = *rope_scaling.attention_factor;
      if (rope_scaling.mscale) y["mscale"] = *rope_scaling.mscale;
      if (rope_scaling.mscale_all_dim) y["mscale_all_dim"] = *rope_scaling.mscale_all_dim;
      if (!rope_scaling.truncate) y["truncate"] = false;
      break;
    }
    case RopeScaling::Type::dynamic:
      // HF's dynamic scales from max_position_embeddings: no original length of its own.
      j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", rope_scaling.factor}};
      break;
  }
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (pad_token_id >= 0) j["pad_token_id"] = pad_token_id;
  if (eos_token_ids.size() == 1) j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty()) j["eos_token_id"] = eos_token_ids;
  return j;
}

int64_t LlamaConfig::parameter_count() const {
  const int64_t C = hidden_size, F = intermediate_size;
  const int64_t per_layer = (post_norms ? 4 : 2) * C + C * q_dim() + 2 * C * kv_dim() + q_dim() * C + 3 * C * F +
                            (attention_bias ? q_dim() + 2 * kv_dim() : 0) + (o_bias ? C : 0) +
                            (qk_norm ? 2 * head_dim : 0);
  return vocab_size * C * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + C;
}

namespace {
// The six numbers that size a preset's transformer; each family's builder below adds the rest.
struct Shape {
  int64_t hidden, ffn, layers, heads, kv_heads, head_dim;
};
LlamaConfig shaped(const Shape& s) {
  LlamaConfig c;
  c.hidden_size = s.hidden;
  c.intermediate_size = s.ffn;
  c.num_hidden_layers = s.layers;
  c.num_attention_heads = s.heads;
  c.num_key_value_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  return c;
}
// Llama 3.x as Meta's config.json gives it: vocabulary 128,256, RoPE theta 5e5 with llama3 scaling
// of `factor` over 8,192, RMSNorm eps 1e-5, <|begin_of_text|> 128000 as bos.
LlamaConfig llama3_family(const Shape& s, bool tied, double factor) {
  LlamaConfig c = shaped(s);
  c.vocab_size = 128256;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling = {RopeScaling::Type::llama3, factor, 1.0, 4.0, 8192};
  c.tie_word_embeddings = tied;
  c.bos_token_id = 128000;
  c.eos_token_ids = {128001};
  c.torch_dtype = "bfloat16";
  return c;
}
// Qwen2.5 and Qwen3 as their HF config.json give them: vocabulary 151,936 (152,064 for Qwen2.5-7B),
// RoPE theta 1e6 without scaling, RMSNorm eps 1e-6, <|endoftext|> 151643 as bos.
LlamaConfig qwen_family(ModelFamily family, const Shape& s, bool tied) {
  LlamaConfig c = shaped(s);
  c.family = family;
  c.attention_bias = family == ModelFamily::qwen2;
  c.qk_norm = family == ModelFamily::qwen3;
  c.vocab_size = 151936;
  c.max_position_embeddings = family == ModelFamily::qwen3 ? 40960 : 32768;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = tied;
  c.bos_token_id = 151643;
  c.eos_token_ids = {family == ModelFamily::qwen3 ? 151645 : 151643};  // Qwen3's <|im_end|>
  c.torch_dtype = "bfloat16";
  return c;
}
// Gemma 2 as transformers' Gemma2Config gives it (its defaults are the 2B's; the 9B's shapes from its
// released config.json): vocabulary 256,000, head_dim 256 and query_pre_attn_scalar 256, a window of
// 4096 keys on the even layers, caps 50 (attention) and 30 (logits), RoPE theta 1e4, RMSNorm eps
// 1e-6, tied embeddings, <bos> 2, <eos> 1, <pad> 0.
LlamaConfig gemma2_family(const Shape& s) {
  LlamaConfig c = shaped(s);
  c.family = ModelFamily::gemma2;
  c.mlp_gate = MlpGate::gelu_tanh;
  c.post_norms = true;
  c.norm_weight_offset = 1.0;
  c.scale_embeddings = true;
  c.vocab_size = 256000;
  c.query_pre_attn_scalar = 256;
  c.max_position_embeddings = 8192;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.sliding_window = 4096;
  for (int64_t l = 0; l < s.layers; ++l) c.sliding_layers.push_back(l % 2 == 0);
  c.attn_logit_softcapping = 50.0;
  c.final_logit_softcapping = 30.0;
  c.tie_word_embeddings = true;
  c.bos_token_id = 2;
  c.eos_token_ids = {1};
  c.pad_token_id = 0;
  c.torch_dtype = "float32";
  return c;
}
}  // namespace

std::vector<std::string> LlamaConfig::preset_names() {
  return {"tiny",         "tiny-tp",      "tiny-qwen2",   "tiny-qwen3", "tiny-mistral", "tiny-gemma2",
          "small",        "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b",
          "qwen3-0.6b",   "qwen3-8b",     "mistral-7b",   "gemma2-2b",  "gemma2-9b"};
}

LlamaConfig LlamaConfig::preset(const std::string& name) {
  LlamaConfig c;
  if (name == "tiny") {
    // For tests: every feature at toy size. GQA 2:1, llama3 RoPE scaling that bites at these lengths
    // (original context 32), untied (tests flip tie_word_embeddings).
    c = shaped({24, 40, 2, 4, 2, 6});
    c.vocab_size = 61;
    c.max_position_embeddings = 4096;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000.0;
    c.rope_scaling = {RopeScaling::Type::llama3, 4.0, 1.0, 4.0, 32};
    c.initializer_range = 0.2;  // large enough that every path carries signal in gradient checks
  } else if (name == "tiny-tp") {
    // For tensor-parallel tests: tiny, with heads (8), K/V heads (4) and FFN width (48) that 2 and 4
    // divide, so every rank keeps whole GQA groups (2 query heads per K/V head).
    c = preset("tiny");
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 4;
    c.head_dim = 4;
  } else if (name == "tiny-qwen2" || name == "tiny-qwen3") {
    // For tests: tiny as Qwen2 (q/k/v biases, tied) or Qwen3 (per-head q/k norms, head_dim 8 apart
    // from hidden / heads = 6, untied), RoPE theta 1e6 without scaling as theirs.
    c = preset("tiny");
    c.rope_scaling = {};
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
    if (name == "tiny-qwen2") {
      c.family = ModelFamily::qwen2;
      c.attention_bias = true;
      c.tie_word_embeddings = true;
    } else {
      c.family = ModelFamily::qwen3;
      c.qk_norm = true;
      c.head_dim = 8;
    }
  } else if (name == "tiny-mistral") {
    // For tests: tiny as Mistral, a window of 5 keys (shorter than the tests' chunks and sequences,
    // so it cuts inside chunks and the relay stops), RoPE theta 1e4 without scaling as Mistral's.
    c = preset("tiny");
    c.family = ModelFamily::mistral;
    c.rope_scaling = {};
    c.sliding_window = 5;
  } else if (name == "tiny-gemma2") {
    // For tests: tiny as Gemma 2 with every part biting at toy size: layer 0 sliding (a window of 5
    // keys, shorter than the tests' chunks and sequences) and layer 1 global, head_dim 8 apart from
    // hidden / heads = 6, query_pre_attn_scalar 10 apart from head_dim, caps 2 (attention) and 3
    // (logits) against scores and logits of about their size, tied embeddings as Gemma's.
    const LlamaConfig t = preset("tiny");
    c = gemma2_family({t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
                       t.num_key_value_heads, 8});
    c.vocab_size = t.vocab_size;
    c.query_pre_attn_scalar = 10;
    c.max_position_embeddings = t.max_position_embeddings;
    c.sliding_window = 5;
    c.attn_logit_softcapping = 2.0;
    c.final_logit_softcapping = 3.0;
    c.initializer_range = t.initializer_range;
    c.bos_token_id = -1;
    c.eos_token_ids = {};
    c.pad_token_id = -1;
    c.torch_dtype = t.torch_dtype;
  } else if (name == "small") {
    // The CPU demo: byte-level vocabulary (258 ids padded to 320), trains in minutes on two cores.
    c = shaped({192, 512, 4, 6, 2, 32});
    c.vocab_size = 320;
    c.max_position_embeddings = 4096;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000.0;
    c.tie_word_embeddings = true;
    c.bos_token_id = 256;
    c.eos_token_ids = {257};
  } else if (name == "llama-3.2-1b") {
    c = llama3_family({2048, 8192, 16, 32, 8, 64}, true, 32.0);
  } else if (name == "llama-3.2-3b") {
    c = llama3_family({3072, 8192, 28, 24, 8, 128}, true, 32.0);
  } else if (name == "llama-3.1-8b") {
    c = llama3_family({4096, 14336, 32, 32, 8, 128}, false, 8.0);
    c.eos_token_ids = {128001, 128008, 128009};
  } else if (name == "qwen2.5-0.5b") {
    c = qwen_family(ModelFamily::qwen2, {896, 4864, 24, 14, 2, 64}, true);
  } else if (name == "qwen2.5-7b") {
    c = qwen_family(ModelFamily::qwen2, {3584, 18944, 28, 28, 4, 128}, false);
    c.vocab_size = 152064;
    c.max_position_embeddings = 131072;
  } else if (name == "qwen3-0.6b") {
    c = qwen_family(ModelFamily::qwen3, {1024, 3072, 28, 16, 8, 128}, true);
  } else if (name == "qwen3-8b") {
    c = qwen_family(ModelFamily::qwen3, {4096, 12288, 36, 32, 8, 128}, false);
  } else if (name == "mistral-7b") {
    // Mistral-7B-v0.1 as its HF config.json gives it: GQA 32:8, a window of 4096 keys on every layer.
    c = shaped({4096, 14336, 32, 32, 8, 128});
    c.family = ModelFamily::mistral;
    c.vocab_size = 32000;
    c.max_position_embeddings = 32768;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000.0;
    c.sliding_window = 4096;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c.torch_dtype = "bfloat16";
  } else if (name == "gemma2-2b") {
    c = gemma2_family({2304, 9216, 26, 8, 4, 256});
  } else if (name == "gemma2-9b") {
    c = gemma2_family({3584, 14336, 42, 16, 8, 256});
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail(fmt::format("unknown model preset '{}'", name), fmt::format("use one of {}, or a config.json path", names));
  }
  c.validate("preset " + name);
  return c;
}

LlamaConfig LlamaConfig::resolve(const std::string& spec) {
  namespace fs = std::filesystem;
  if (fs::is_directory(spec)) {
    const fs::path p = fs::path(spec) / "config.json";
    if (!fs::exists(p)) fail(fmt::format("model directory '{}' has no config.json", spec), "point at an HF checkpoint directory");
    LlamaConfig c = from_file(p.string());
    // With the weights beside it, the config may ask for no more than they hold.
    if (is_checkpoint_dir(spec)) check_checkpoint_shapes(c, spec);
    return c;
  }
  if (is_gguf_file(spec)) return llama_config_from_gguf(GgufReader(spec));
  if (fs::exists(spec)) return from_file(spec);
  const auto names = preset_names();
  if (std::find(names.begin(), names.end(), spec) != names.end()) return preset(spec);
  if (spec.find('/') != std::string::npos || spec.ends_with(".json"))
    fail(fmt::format("model '{}' does not exist", spec), "give a preset name, a config.json, a checkpoint directory or a .gguf file");
  return preset(spec);  // raises the unknown-preset error listing the names
}

}  // namespace cw
