#include "model/gguf_llama.h"

#include "engine/error.h"
#include "engine/memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

namespace cw {

namespace {

constexpr const char* kRopeFreqs = "rope_freqs.weight";
// rope_freqs.weight is written in f32 from frequencies computed in f32: its entries agree with the
// f64 llama3 formula to a few f32 ulps, and differ by far more than this for other parameters.
constexpr double kRopeFreqsTol = 1e-5;

[[noreturn]] void bad_model(const GgufReader& f, const std::string& what,
                            const std::string& hint = "chunkwise reads GGUF files of llama, qwen2, qwen3 and gemma2 "
                                                      "models") {
  fail(fmt::format("GGUF file '{}': {}", f.path(), what), hint);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The metadata keys a GGUF file of architecture `arch` gives the config's sizes under (each prefixed
// with the architecture's name), for validate's messages.
struct GgufKeys {
  explicit GgufKeys(const std::string& arch) : prefix(arch + ".") {
    for (const char* k : {"vocab_size", "embedding_length", "feed_forward_length", "block_count",
                          "attention.head_count", "attention.head_count_kv", "attention.key_length", "context_length",
                          "attention.layer_norm_rms_epsilon", "rope.freq_base"})
      full.push_back(prefix + k);
    names = {full[0].c_str(), full[1].c_str(), full[2].c_str(), full[3].c_str(), full[4].c_str(),
             full[5].c_str(), full[6].c_str(), full[7].c_str(), full[8].c_str(), full[9].c_str()};
  }
  std::string operator()(const char* key) const { return prefix + key; }
  std::string prefix;
  std::vector<std::string> full;
  ConfigKeyNames names;
};

// The architectures read, as llama.cpp names them, and the family each is.
std::optional<ModelFamily> family_of(const std::string& arch) {
  if (arch == "llama") return ModelFamily::llama;
  if (arch == "qwen2") return ModelFamily::qwen2;
  if (arch == "qwen3") return ModelFamily::qwen3;
  if (arch == "gemma2") return ModelFamily::gemma2;
  return std::nullopt;
}

// Llama 3.1-style scaling from the per-frequency divisors llama.cpp's converter stores.
RopeScaling rope_scaling_from_freqs(const GgufReader& f, const LlamaConfig& c) {
  const GgufTensorInfo* t = f.find_tensor(kRopeFreqs);
  if (t->shape() != std::vector<int64_t>{c.head_dim / 2})
    bad_model(f, fmt::format("{} has shape {}, expected [{}] (head_dim / 2)", kRopeFreqs, shape_str(t->shape()),
                             c.head_dim / 2));
  OwnedTensor divisors(DType::f64, {c.head_dim / 2});
  f.read_into(kRopeFreqs, divisors);
  const double* d = divisors.tensor.ptr<double>();
  // A divisor that is not a positive finite number makes the rotation NaN or infinite; NaN would also
  // slip through the comparisons below (every comparison with NaN is false).
  for (int64_t i = 0; i < c.head_dim / 2; ++i)
    if (!(std::isfinite(d[i]) && d[i] > 0))
      bad_model(f, fmt::format("{}[{}] = {} is not a positive finite divisor", kRopeFreqs, i, d[i]),
                "the file is damaged: re-download or re-convert it");
  RopeScaling s;
  s.type = RopeScaling::Type::llama3;
  s.factor = *std::max_element(d, d + c.head_dim / 2);
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position = 8192;
  if (s.factor == 1.0) return RopeScaling{};  // every divisor 1: no scaling at all
  const std::vector<double> plain = rope_inv_freq(c.head_dim, c.rope_theta, RopeScaling{});
  const std::vector<double> scaled = rope_inv_freq(c.head_dim, c.rope_theta, s);
  for (int64_t i = 0; i < c.head_dim / 2; ++i) {
    const double expected = plain[i] / scaled[i];
    if (std::abs(d[i] - expected) > kRopeFreqsTol * expected)
      bad_model(f, fmt::format("{}[{}] = {} is not llama3 RoPE scaling (factor {}, low 1, high 4, original 8192 "
                               "give {})", kRopeFreqs, i, d[i], s.factor, expected),
                "chunkwise supports llama3 scaling with Llama 3.x's parameters");
  }
  return s;
}

}  // namespace

bool is_gguf_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  std::string lower = path;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (lower.ends_with(".gguf")) return true;
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

LlamaConfig llama_config_from_gguf(const GgufReader& f) {
  const std::string arch = f.get_string("general.architecture");
  const std::optional<ModelFamily> family = family_of(arch);
  if (!family)
    bad_model(f, fmt::format("general.architecture is '{}', not 'llama', 'qwen2', 'qwen3' or 'gemma2'",
                             arch.substr(0, 60)));
  const GgufKeys key(arch);
  if (f.get_int(key("expert_count"), 0) > 0)
    bad_model(f, fmt::format("a mixture of experts ({} experts)", f.get_int(key("expert_count"))),
              "chunkwise trains dense models");
  LlamaConfig c;
  c.family = *family;
  c.attention_bias = c.family == ModelFamily::qwen2;
  c.qk_norm = c.family == ModelFamily::qwen3;
  c.num_hidden_layers = f.get_int(key("block_count"));
  c.hidden_size = f.get_int(key("embedding_length"));
  c.intermediate_size = f.get_int(key("feed_forward_length"));
  c.num_attention_heads = f.get_int(key("attention.head_count"));
  c.num_key_value_heads = f.get_int(key("attention.head_count_kv"), c.num_attention_heads);
  if (c.num_attention_heads <= 0) bad_model(f, fmt::format("{} must be positive", key("attention.head_count")));
  c.head_dim = f.get_int(key("attention.key_length"), c.hidden_size / c.num_attention_heads);
  for (const std::string& k : {key("attention.value_length"), key("rope.dimension_count")})
    if (f.has(k) && f.get_int(k) != c.head_dim)
      bad_model(f, fmt::format("{} = {} differs from the head dim {}", k, f.get_int(k), c.head_dim),
                "chunkwise rotates whole heads with equal K and V head dims");
  c.max_position_embeddings = f.get_int(key("context_length"));
  c.rope_theta = f.get_float(key("rope.freq_base"), 10000.0);
  c.rms_norm_eps = f.get_float(key("attention.layer_norm_rms_epsilon"));
  if (c.family == ModelFamily::gemma2) {
    // Gemma 2 as llama.cpp reads it (LLM_ARCH_GEMMA2): the gelu gate, (1 + w) norms and the two
    // post-norms, sqrt(C) embeddings; the even layers sliding through attention.sliding_window keys
    // (4096 absent), the others global; the caps (50 and 30 absent); the attention scale
    // 1/sqrt(head_dim), but 1/sqrt(C / H) for the 46-layer 27B (llama.cpp tells the sizes apart by
    // their layer counts; HF's configs say the same through query_pre_attn_scalar).
    c.mlp_gate = MlpGate::gelu_tanh;
    c.post_norms = true;
    c.norm_weight_offset = 1.0;
    c.scale_embeddings = true;
    c.sliding_window = f.get_int(key("attention.sliding_window"), 4096);
    for (int64_t l = 0; l < std::clamp<int64_t>(c.num_hidden_layers, 0, ConfigLimits::kMaxLayers); ++l)
      c.sliding_layers.push_back(l % 2 == 0);
    c.attn_logit_softcapping = f.get_float(key("attn_logit_softcapping"), 50.0);
    c.final_logit_softcapping = f.get_float(key("final_logit_softcapping"), 30.0);
    c.query_pre_attn_scalar = double(c.num_hidden_layers == 46 ? c.hidden_size / c.num_attention_heads : c.head_dim);
  } else if (f.has(key("attention.sliding_window"))) {
    if (c.family != ModelFamily::llama)
      bad_model(f, fmt::format("{} in a {} model", key("attention.sliding_window"), arch),
                "chunkwise reads a sliding window for architectures llama (Mistral) and gemma2 only");
    c.family = ModelFamily::mistral;
    c.sliding_window = f.get_int(key("attention.sliding_window"));
  }
  if (c.sliding_window <= 0 && (c.family == ModelFamily::mistral || c.family == ModelFamily::gemma2))
    bad_model(f, fmt::format("{} = {}: a window holds at least one key", key("attention.sliding_window"),
                             c.sliding_window));

  const GgufTensorInfo* embedding = f.find_tensor("token_embd.weight");
  if (!embedding) bad_model(f, "has no tensor 'token_embd.weight'", "is this a model file?");
  if (f.has(key("vocab_size"))) c.vocab_size = f.get_int(key("vocab_size"));
  else if (f.has("tokenizer.ggml.tokens")) c.vocab_size = static_cast<int64_t>(f.get_strings("tokenizer.ggml.tokens").size());
  else c.vocab_size = embedding->shape()[0];
  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
  c.bos_token_id = f.get_int("tokenizer.ggml.bos_token_id", -1);
  if (f.has("tokenizer.ggml.eos_token_id")) c.eos_token_ids = {f.get_int("tokenizer.ggml.eos_token_id")};
  c.pad_token_id = f.get_int("tokenizer.ggml.padding_token_id", -1);
  c.torch_dtype = "float32";  // what the weights are dequantized to

  const std::string scaling = f.get_string(key("rope.scaling.type"), "none");
  if (scaling == "linear") {
    c.rope_scaling.type = RopeScaling::Type::linear;
    c.rope_scaling.factor = f.get_float(key("rope.scaling.factor"));
  } else if (scaling != "none") {
    bad_model(f, fmt::format("{} '{}' is not supported", key("rope.scaling.type"), scaling.substr(0, 60)),
              "chunkwise supports linear and llama3 RoPE scaling in GGUF files");
  } else if (f.has(key("rope.scale_linear"))) {
    c.rope_scaling.type = RopeScaling::Type::linear;
    c.rope_scaling.factor = f.get_float(key("rope.scale_linear"));
  }
  if (c.rope_scaling.type == RopeScaling::Type::linear && !(c.rope_scaling.factor > 0))
    bad_model(f, fmt::format("the linear RoPE scaling factor {} must be positive", c.rope_scaling.factor));
  c.validate(fmt::format("GGUF file '{}'", f.path()), key.names);
  if (f.find_tensor(kRopeFreqs)) {
    if (c.family != ModelFamily::llama) bad_model(f, fmt::format("{} in a {} model", kRopeFreqs, arch));
    if (c.rope_scaling.type != RopeScaling::Type::none)
      bad_model(f, fmt::format("both {} and llama.rope.scaling metadata", kRopeFreqs));
    c.rope_scaling = rope_scaling_from_freqs(f, c);
  }
  const std::vector<int64_t> expected{c.vocab_size, c.hidden_size};
  if (embedding->shape() != expected)
    bad_model(f, fmt::format("token_embd.weight has shape {} (GGUF dims {}) but the metadata says vocab {} x hidden {}",
                             shape_str(embedding->shape()), shape_str(embedding->dims), c.vocab_size, c.hidden_size),
              "the file is inconsistent: re-convert it");
  // The sizes are now bounded (validate) but may still ask for far more than the file holds: each
  // tensor the config implies must be in the file with its shape, so the model allocated from this
  // config is no larger than the file's tensors, whatever the metadata says.
  for (const ParamSpec& spec : parameter_table(c)) {
    const std::string name = gguf_tensor_name(spec);
    const GgufTensorInfo* t = f.find_tensor(name);
    if (!t)
      bad_model(f, fmt::format("has no tensor '{}' (for {}), which its metadata implies ({} = {}, {} = {})", name,
                               spec.name, key.names.num_hidden_layers, c.num_hidden_layers, key.names.hidden_size,
                               c.hidden_size),
                "the file does not describe a complete model: fix the metadata or re-convert it");
    if (t->shape() != spec.shape)
      bad_model(f, fmt::format("tensor '{}' has shape {} (GGUF dims {}), but the metadata gives {} {}", name,
                               shape_str(t->shape()), shape_str(t->dims), spec.name, shape_str(spec.shape)),
                "the file is inconsistent: re-convert it");
  }
  return c;
}

std::string gguf_tensor_name(const ParamSpec& s) {
  const std::string blk = fmt::format("blk.{}.", s.layer);
  switch (s.role) {
    case ParamRole::embedding: return "token_embd.weight";
    case ParamRole::attn_norm: return blk + "attn_norm.weight";
    case ParamRole::wq: return blk + "attn_q.weight";
    case ParamRole::wk: return blk + "attn_k.weight";
    case ParamRole::wv: return blk + "attn_v.weight";
    case ParamRole::wo: return blk + "attn_output.weight";
    case ParamRole::mlp_norm: return blk + "ffn_norm.weight";
    case ParamRole::w_gate: return blk + "ffn_gate.weight";
    case ParamRole::w_up: return blk + "ffn_up.weight";
    case ParamRole::w_down: return blk + "ffn_down.weight";
    case ParamRole::final_norm: return "output_norm.weight";
    case ParamRole::lm_head: return "output.weight";
    case ParamRole::q_bias: return blk + "attn_q.bias";
    case ParamRole::k_bias: return blk + "attn_k.bias";
    case ParamRole::v_bias: return blk + "attn_v.bias";
    case ParamRole::o_bias: return blk + "attn_output.bias";
    case ParamRole::q_norm: return blk + "attn_q_norm.weight";
    case ParamRole::k_norm: return blk + "attn_k_norm.weight";
    case ParamRole::attn_post_norm: return blk + "post_attention_norm.weight";
    case ParamRole::mlp_post_norm: return blk + "post_ffw_norm.weight";
    case ParamRole::lora_a:
    case ParamRole::lora_b: break;  // adapters are PEFT files, not part of a GGUF model
  }
  return "";
}

int64_t gguf_qk_row(int64_t hf_row, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t head = hf_row / head_dim, within = hf_row % head_dim;
  const int64_t s = within / half, i = within % half;  // HF row = head*D + s*D/2 + i
  return head * head_dim + 2 * i + s;
}

void load_gguf_weights(ParamSet& params, const GgufReader& f) {
  const LlamaConfig& c = params.config();
  CW_CHECK(params.device().is_cpu(), "load_gguf_weights reads into host memory, got a {} parameter set",
           device_name(params.device()));
  std::set<std::string> used{kRopeFreqs};  // read by llama_config_from_gguf
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& spec = params.specs()[i];
    const std::string name = gguf_tensor_name(spec);
    const GgufTensorInfo* t = f.find_tensor(name);
    if (!t)
      bad_model(f, fmt::format("has no tensor '{}' (for {})", name, spec.name),
                "the file does not describe a complete model");
    if (t->shape() != spec.shape)
      bad_model(f, fmt::format("tensor '{}' has shape {} (GGUF dims {}), but the metadata gives {} {}", name,
                               shape_str(t->shape()), shape_str(t->dims), spec.name, shape_str(spec.shape)),
                "the file is inconsistent: re-convert it");
    const Tensor& dst = params[i];
    // llama.cpp permutes Llama's (and Mistral's) Q/K rows for its rotation of adjacent pairs; Qwen's
    // rotate halves as HF does (NEOX), unpermuted.
    const bool permuted = c.family == ModelFamily::llama || c.family == ModelFamily::mistral;
    if (c.norm_weight_offset != 0 && spec.is_norm()) {
      // Gemma's norms scale by (1 + w); llama.cpp's converter stores 1 + w. Subtracted in f64 before
      // the model's dtype rounds it, so a bf16 model keeps w's own precision, not 1 + w's.
      OwnedTensor stored = OwnedTensor::of_shape(DType::f64, spec.shape);
      f.read_into(name, stored);
      double* v = stored.tensor.ptr<double>();
      for (int64_t e = 0; e < stored.tensor.numel(); ++e) v[e] -= c.norm_weight_offset;
      copy_convert(dst, stored.tensor);
    } else if (!permuted || (spec.role != ParamRole::wq && spec.role != ParamRole::wk)) {
      f.read_into(name, dst);
    } else {
      // Read in GGUF row order, then put each row back where HF has it.
      OwnedTensor gguf_rows = OwnedTensor::of_shape(dst.dtype, spec.shape);
      f.read_into(name, gguf_rows);
      const int64_t rows = spec.shape[0];
      const size_t row_bytes = static_cast<size_t>(spec.shape[1]) * dtype_size(dst.dtype);
      const auto* src = static_cast<const char*>(gguf_rows.tensor.data);
      auto* out = static_cast<char*>(dst.data);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out + r * row_bytes, src + gguf_qk_row(r, c.head_dim) * row_bytes, row_bytes);
    }
    require_finite_weights(dst, name, f.path());
    used.insert(name);
  }
  for (const GgufTensorInfo& t : f.tensors())
    if (!used.count(t.name))
      bad_model(f, fmt::format("tensor '{}' has no place in a {} model of this configuration", t.name.substr(0, 120),
                               model_family_name(c.family)),
                "chunkwise would ignore it and compute another model: is general.architecture right?");
}

}  // namespace cw
