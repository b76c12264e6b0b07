#include "model/config.h"

#include "engine/error.h"
#include "model/gguf_llama.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

namespace cw {

namespace {
using nlohmann::json;

// Reads an integer key; absent -> fallback when one is given, else an error naming file and key.
int64_t get_int(const json& j, const char* key, const std::string& src, const int64_t* fallback = nullptr) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback) return *fallback;
    fail(fmt::format("{}: missing key '{}'", src, key), "is this a Llama config.json? add the key");
  }
  const json& v = j[key];
  if (v.is_number_integer() || v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()) return static_cast<int64_t>(v.get<double>());
  fail(fmt::format("{}: key '{}' must be an integer, got {}", src, key, v.dump()), "fix the value in the config");
}

double get_double(const json& j, const char* key, const std::string& src, double fallback, bool required = false) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) fail(fmt::format("{}: missing key '{}'", src, key), "add the key to the config");
    return fallback;
  }
  if (!j[key].is_number()) fail(fmt::format("{}: key '{}' must be a number, got {}", src, key, j[key].dump()));
  return j[key].get<double>();
}

// The range checks of a scaling's values; `where` is the key its values came from (rope_scaling or
// rope_parameters), so the message names the key as the file spells it.
void check_rope_scaling(const RopeScaling& r, int64_t max_position_embeddings, const std::string& src,
                        const std::string& where) {
  const std::string type = rope_type_name(r.type);
  auto bad = [&](const std::string& what, const std::string& hint) {
    fail(fmt::format("{}: {}.{} ({} RoPE)", src, where, what, type), hint);
  };
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
RopeScaling parse_rope_scaling(const json& s, const json& config, int64_t max_position_embeddings,
                               const std::string& src, const char* where) {
  RopeScaling r;
  if (s.is_null()) return r;
  if (!s.is_object()) fail(fmt::format("{}: '{}' must be an object or null", src, where));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (s.contains(key) && !s[key].is_null()) {
      if (!s[key].is_string()) fail(fmt::format("{}: {}.{} must be a string, got {}", src, where, key, s[key].dump()));
      type = s[key].get<std::string>();
      break;
    }
  if (type == "default") return r;
  const std::string ctx = fmt::format("{}: {}", src, where);
  // original_max_position_embeddings as HF resolves it for llama3 and yarn.
  auto original_max = [&] {
    const char* key = "original_max_position_embeddings";
    if (config.contains(key) && !config[key].is_null()) return get_int(config, key, src);
    return get_int(s, key, ctx, &max_position_embeddings);
  };
  auto optional_double = [&](const char* key) -> std::optional<double> {
    if (!s.contains(key) || s[key].is_null()) return std::nullopt;
    return get_double(s, key, ctx, 0.0);
  };
  if (type == "linear") {
    r.type = RopeScaling::Type::linear;
    r.factor = get_double(s, "factor", ctx, 1.0, true);
  } else if (type == "llama3") {
    r.type = RopeScaling::Type::llama3;
    r.factor = get_double(s, "factor", ctx, 1.0, true);
    r.low_freq_factor = get_double(s, "low_freq_factor", ctx, 1.0, true);
    r.high_freq_factor = get_double(s, "high_freq_factor", ctx, 4.0, true);
    r.original_max_position = original_max();
  } else if (type == "yarn") {
    r.type = RopeScaling::Type::yarn;
    r.original_max_position = original_max();
    if (!s.contains("factor")) fail(fmt::format("{}: missing key 'factor'", ctx), "add the key to the config");
    // null: the ratio of the extended context to the original one, as DeepSeek-V3's configs mean it.
    r.factor = s["factor"].is_null()
                   ? static_cast<double>(max_position_embeddings) / static_cast<double>(r.original_max_position)
                   : get_double(s, "factor", ctx, 1.0);
    r.beta_fast = get_double(s, "beta_fast", ctx, 32.0);
    r.beta_slow = get_double(s, "beta_slow", ctx, 1.0);
    r.attention_factor = optional_double("attention_factor");
    r.mscale = optional_double("mscale");
    r.mscale_all_dim = optional_double("mscale_all_dim");
    if (s.contains("truncate")) {
      // HF tests truthiness: null truncates nothing, like false.
      if (!s["truncate"].is_null() && !s["truncate"].is_boolean())
        fail(fmt::format("{}: key 'truncate' must be true or false, got {}", ctx, s["truncate"].dump()));
      r.truncate = s["truncate"].is_boolean() && s["truncate"].get<bool>();
    }
  } else if (type == "dynamic") {
    r.type = RopeScaling::Type::dynamic;
    r.factor = get_double(s, "factor", ctx, 1.0, true);
    r.original_max_position = max_position_embeddings;
  } else {
    fail(fmt::format("{}: unknown {}.rope_type '{}'", src, where, type),
         "chunkwise supports default, linear, llama3, yarn and dynamic RoPE");
  }
  check_rope_scaling(r, max_position_embeddings, src, where);
  return r;
}
}  // namespace

LlamaConfig LlamaConfig::from_json(const json& j, const std::string& src) {
  if (!j.is_object()) fail(fmt::format("{}: config must be a JSON object", src));
  if (j.contains("architectures") && j["architectures"].is_array()) {
    bool llama = false;
    for (const auto& a : j["architectures"]) llama = llama || (a.is_string() && a.get<std::string>() == "LlamaForCausalLM");
    if (!llama)
      fail(fmt::format("{}: architectures {} does not include LlamaForCausalLM", src, j["architectures"].dump()),
           "chunkwise trains Llama-architecture models");
  }
  LlamaConfig c;
  c.vocab_size = get_int(j, "vocab_size", src);
  c.hidden_size = get_int(j, "hidden_size", src);
  c.intermediate_size = get_int(j, "intermediate_size", src);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", src);
  c.num_attention_heads = get_int(j, "num_attention_heads", src);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", src, &c.num_attention_heads);
  if (c.num_attention_heads > 0 && !j.contains("head_dim")) {
    if (c.hidden_size % c.num_attention_heads != 0)
      fail(fmt::format("{}: hidden_size {} is not divisible by num_attention_heads {} and head_dim is absent", src,
                       c.hidden_size, c.num_attention_heads), "give head_dim explicitly");
  }
  const int64_t derived_head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  c.head_dim = get_int(j, "head_dim", src, &derived_head_dim);
  const int64_t default_max_pos = 2048;
  c.max_position_embeddings = get_int(j, "max_position_embeddings", src, &default_max_pos);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", src, 1e-6);
  c.initializer_range = get_double(j, "initializer_range", src, 0.02);
  if (j.contains("tie_word_embeddings") && !j["tie_word_embeddings"].is_null()) {
    if (!j["tie_word_embeddings"].is_boolean()) fail(fmt::format("{}: key 'tie_word_embeddings' must be true or false", src));
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  // v5 keeps theta and scaling together in rope_parameters; v4 has rope_theta and rope_scaling.
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const json& rp = j["rope_parameters"];
    if (!rp.is_object()) fail(fmt::format("{}: 'rope_parameters' must be an object", src));
    c.rope_theta = get_double(rp, "rope_theta", src + ": rope_parameters", 10000.0);
    c.rope_scaling = parse_rope_scaling(rp, j, c.max_position_embeddings, src, "rope_parameters");
  } else {
    c.rope_theta = get_double(j, "rope_theta", src, 10000.0);
    if (j.contains("rope_scaling"))
      c.rope_scaling = parse_rope_scaling(j["rope_scaling"], j, c.max_position_embeddings, src, "rope_scaling");
  }
  const int64_t none = -1;
  c.bos_token_id = get_int(j, "bos_token_id", src, &none);
  c.pad_token_id = get_int(j, "pad_token_id", src, &none);
  if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
    const json& e = j["eos_token_id"];
    if (e.is_array()) {
      for (const auto& x : e) {
        if (!x.is_number_integer()) fail(fmt::format("{}: 'eos_token_id' list must hold integers", src));
        c.eos_token_ids.push_back(x.get<int64_t>());
      }
    } else if (e.is_number_integer()) {
      c.eos_token_ids.push_back(e.get<int64_t>());
    } else {
      fail(fmt::format("{}: 'eos_token_id' must be an integer or a list of integers", src));
    }
  }
  for (const char* key : {"dtype", "torch_dtype"})
    if (j.contains(key) && j[key].is_string()) {
      c.torch_dtype = j[key].get<std::string>();
      break;
    }
  c.validate(src);
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(fmt::format("cannot open model config '{}'", path), "check the path");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(fmt::format("{}: not valid JSON ({})", path, e.what()), "fix or re-download config.json");
  }
  try {
    return from_json(j, path);
  } catch (const json::exception& e) {
    fail(fmt::format("{}: unexpected value type ({})", path, e.what()), "compare with a transformers LlamaConfig");
  }
}

void LlamaConfig::validate(const std::string& src) const {
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0) fail(fmt::format("{}: '{}' must be positive, got {}", src, key, v));
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(max_position_embeddings, "max_position_embeddings");
  if (num_attention_heads % num_key_value_heads != 0)
    fail(fmt::format("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", src,
                     num_attention_heads, num_key_value_heads), "grouped-query attention needs whole groups");
  if (head_dim % 2 != 0) fail(fmt::format("{}: head_dim {} must be even for RoPE", src, head_dim));
  if (!(rms_norm_eps > 0)) fail(fmt::format("{}: 'rms_norm_eps' must be positive", src));
  if (!(rope_theta > 0)) fail(fmt::format("{}: 'rope_theta' must be positive", src));
  if (rope_scaling.type == RopeScaling::Type::dynamic && head_dim <= 2)
    fail(fmt::format("{}: dynamic RoPE needs head_dim > 2, got {}", src, head_dim), "use another RoPE scaling");
  check_rope_scaling(rope_scaling, max_position_embeddings, src, "rope_scaling");
}

json LlamaConfig::to_json() const {
  json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
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
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"torch_dtype", torch_dtype},
  };
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
  const int64_t per_layer = 2 * C + C * q_dim() + 2 * C * kv_dim() + q_dim() * C + 3 * C * F;
  return vocab_size * C * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + C;
}

namespace {
LlamaConfig llama3_family(int64_t C, int64_t F, int64_t L, int64_t H, int64_t D, bool tied, double factor) {
  LlamaConfig c;
  c.vocab_size = 128256;
  c.hidden_size = C;
  c.intermediate_size = F;
  c.num_hidden_layers = L;
  c.num_attention_heads = H;
  c.num_key_value_heads = 8;
  c.head_dim = D;
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
}  // namespace

std::vector<std::string> LlamaConfig::preset_names() {
  return {"tiny", "tiny-tp", "small", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"};
}

LlamaConfig LlamaConfig::preset(const std::string& name) {
  LlamaConfig c;
  if (name == "tiny") {
    // For tests: every feature at toy size. GQA 2:1, llama3 RoPE scaling that bites at these lengths
    // (original context 32), untied (tests flip tie_word_embeddings).
    c.vocab_size = 61;
    c.hidden_size = 24;
    c.intermediate_size = 40;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 6;
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
  } else if (name == "small") {
    // The CPU demo: byte-level vocabulary (258 ids padded to 320), trains in minutes on two cores.
    c.vocab_size = 320;
    c.hidden_size = 192;
    c.intermediate_size = 512;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 6;
    c.num_key_value_heads = 2;
    c.head_dim = 32;
    c.max_position_embeddings = 4096;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000.0;
    c.tie_word_embeddings = true;
    c.bos_token_id = 256;
    c.eos_token_ids = {257};
  } else if (name == "llama-3.2-1b") {
    c = llama3_family(2048, 8192, 16, 32, 64, true, 32.0);
  } else if (name == "llama-3.2-3b") {
    c = llama3_family(3072, 8192, 28, 24, 128, true, 32.0);
  } else if (name == "llama-3.1-8b") {
    c = llama3_family(4096, 14336, 32, 32, 128, false, 8.0);
    c.eos_token_ids = {128001, 128008, 128009};
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
    return from_file(p.string());
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
