// A GGUF writer for tests (tests/model/test_gguf.cpp, test_qwen.cpp): every field can be set, so
// every malformation can be built, and a model's parameters written as llama.cpp's converter writes them.
#pragma once

#include "model/gguf_llama.h"
#include "model/params.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace cw::test {

template <class T> std::string raw(T v) {
  std::string s(sizeof(T), '\0');
  std::memcpy(s.data(), &v, sizeof(T));
  return s;
}
inline std::string gguf_string(const std::string& s) { return raw<uint64_t>(s.size()) + s; }

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;  // innermost first, as stored
  uint32_t type = 0;
  std::string data;            // the tensor's bytes
  std::optional<uint64_t> offset = std::nullopt;  // default: packed after the previous tensor, aligned
  std::optional<uint32_t> n_dims = std::nullopt;  // default: dims.size()
};

struct GgufBuilder {
  uint32_t magic = 0x46554747u;
  uint32_t version = 3;
  uint64_t alignment = 32;
  std::optional<uint64_t> tensor_count, kv_count;  // overrides of the true counts
  std::string kvs;
  uint64_t n_kv = 0;
  std::vector<TensorSpec> tensors;
  std::set<std::string> omit;  // keys left out when written (a file without an optional key)

  // One key-value pair; `value` is the value's bytes (the type id comes first).
  void kv(const std::string& key, uint32_t type, const std::string& value) {
    if (omit.count(key)) return;
    kvs += gguf_string(key) + raw<uint32_t>(type) + value;
    ++n_kv;
  }
  void u32(const std::string& key, uint32_t v) { kv(key, 4, raw(v)); }
  void f32(const std::string& key, float v) { kv(key, 6, raw(v)); }
  void str(const std::string& key, const std::string& v) { kv(key, 8, gguf_string(v)); }
  // Replaces the value of a u32, f32, u64 or f64 key written earlier, its type too: a metadata value
  // malformed in place, the rest of the file as it was.
  void replace(const std::string& key, uint32_t type, const std::string& value) {
    const std::string head = gguf_string(key);
    const size_t at = kvs.find(head);
    REQUIRE(at != std::string::npos);
    const size_t type_at = at + head.size();
    uint32_t old_type = 0;
    std::memcpy(&old_type, kvs.data() + type_at, 4);
    const size_t old_size = old_type == 4 || old_type == 6 ? 4 : old_type == 10 || old_type == 12 ? 8 : 0;
    REQUIRE(old_size > 0);
    kvs.replace(type_at, 4 + old_size, raw(type) + value);
  }
  void strings(const std::string& key, const std::vector<std::string>& v) {
    std::string bytes = raw<uint32_t>(8) + raw<uint64_t>(v.size());
    for (const auto& s : v) bytes += gguf_string(s);
    kv(key, 9, bytes);
  }

  std::string bytes() const {
    std::string out = raw(magic) + raw(version) + raw<uint64_t>(tensor_count.value_or(tensors.size())) +
                      raw<uint64_t>(kv_count.value_or(n_kv)) + kvs;
    std::vector<uint64_t> offsets;
    uint64_t next = 0;
    for (const TensorSpec& t : tensors) {
      offsets.push_back(t.offset.value_or(next));
      next = (offsets.back() + t.data.size() + alignment - 1) / alignment * alignment;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorSpec& t = tensors[i];
      out += gguf_string(t.name) + raw<uint32_t>(t.n_dims.value_or(static_cast<uint32_t>(t.dims.size())));
      for (uint64_t d : t.dims) out += raw(d);
      out += raw(t.type) + raw(offsets[i]);
    }
    out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
    // Data: each tensor at its offset (the last one ends the file: no trailing padding).
    const size_t start = out.size();
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (offsets[i] > (uint64_t(1) << 20)) continue;  // an out-of-range offset: no bytes to place
      const size_t at = start + offsets[i];
      if (out.size() < at + tensors[i].data.size()) out.resize(at + tensors[i].data.size(), '\0');
      std::memcpy(out.data() + at, tensors[i].data.data(), tensors[i].data.size());
    }
    return out;
  }
};

inline std::string write_file(const TempDir& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

template <class T> std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// The row permutation llama.cpp's converter applies to q_proj / k_proj (convert_hf_to_gguf.py,
// LlamaModel.permute: reshape(heads, 2, D/2, C).swapaxes(1, 2)), written out independently of the
// loader's inverse: GGUF row (h, i, s) holds HF row (h, s, i).
inline std::vector<float> converter_permute(const std::vector<float>& w, int64_t heads, int64_t D, int64_t C) {
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < D / 2; ++i)
        std::copy_n(&w[static_cast<size_t>((h * D + s * (D / 2) + i) * C)], C,
                    &out[static_cast<size_t>((h * D + 2 * i + s) * C)]);
  return out;
}

// A GGUF file of `params` as llama.cpp writes it: the architecture's metadata (llama, qwen2, qwen3 or
// gemma2, each key prefixed with it), F32 tensors with GGUF names and innermost-first dims, Llama's
// Q/K rows permuted (Qwen's and Gemma's rotate halves as HF does: not permuted). Mistral is written
// as llama.cpp's converter writes it, architecture llama, with its window under
// llama.attention.sliding_window; Gemma 2 with its window and caps, and every norm weight as 1 + w
// (Gemma2Model.modify_tensors: data_torch + 1, in f32).
// `omit`: metadata keys to leave out.
inline GgufBuilder model_gguf_builder(const ParamSet& params, const std::set<std::string>& omit = {}) {
  const LlamaConfig& c = params.config();
  const bool llama_arch = c.family == ModelFamily::llama || c.family == ModelFamily::mistral;
  const std::string arch = llama_arch ? "llama" : model_family_name(c.family);
  const bool permute = llama_arch;
  GgufBuilder b;
  b.omit = omit;
  b.str("general.architecture", arch);
  b.u32(arch + ".block_count", static_cast<uint32_t>(c.num_hidden_layers));
  b.u32(arch + ".context_length", static_cast<uint32_t>(c.max_position_embeddings));
  b.u32(arch + ".embedding_length", static_cast<uint32_t>(c.hidden_size));
  b.u32(arch + ".feed_forward_length", static_cast<uint32_t>(c.intermediate_size));
  b.u32(arch + ".attention.head_count", static_cast<uint32_t>(c.num_attention_heads));
  b.u32(arch + ".attention.head_count_kv", static_cast<uint32_t>(c.num_key_value_heads));
  b.u32(arch + ".attention.key_length", static_cast<uint32_t>(c.head_dim));
  b.u32(arch + ".rope.dimension_count", static_cast<uint32_t>(c.head_dim));
  b.f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
  b.f32(arch + ".attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  if (c.sliding_window > 0) b.u32(arch + ".attention.sliding_window", static_cast<uint32_t>(c.sliding_window));
  if (c.family == ModelFamily::gemma2) {
    b.f32(arch + ".attn_logit_softcapping", static_cast<float>(c.attn_logit_softcapping));
    b.f32(arch + ".final_logit_softcapping", static_cast<float>(c.final_logit_softcapping));
  }
  std::vector<std::string> tokens;
  for (int64_t i = 0; i < c.vocab_size; ++i) tokens.push_back(fmt::format("t{}", i));
  b.strings("tokenizer.ggml.tokens", tokens);
  b.u32("tokenizer.ggml.bos_token_id", 1);
  b.u32("tokenizer.ggml.eos_token_id", 2);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& s = params.specs()[i];
    const float* p = params[i].ptr<float>();
    std::vector<float> values(p, p + params[i].numel());
    if (permute && s.role == ParamRole::wq)
      values = converter_permute(values, c.num_attention_heads, c.head_dim, c.hidden_size);
    if (permute && s.role == ParamRole::wk)
      values = converter_permute(values, c.num_key_value_heads, c.head_dim, c.hidden_size);
    if (c.family == ModelFamily::gemma2 && s.name.ends_with("norm.weight"))
      for (float& v : values) v += 1.0f;
    std::vector<uint64_t> dims(s.shape.rbegin(), s.shape.rend());
    b.tensors.push_back({gguf_tensor_name(s), dims, 0, bytes_of(values)});
  }
  return b;
}

// A preset as model_gguf_builder's file of it reads back: eps stored in f32, the builder's bos and eos
// ids, float32, the loader's initializer_range (GGUF stores none).
inline LlamaConfig as_gguf_reads(LlamaConfig c) {
  c.rms_norm_eps = static_cast<float>(c.rms_norm_eps);
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.torch_dtype = "float32";
  c.initializer_range = LlamaConfig{}.initializer_range;
  return c;
}

// `original` written as the GGUF file `name` in `dir` reads back as the same config and every tensor
// bit for bit; the builder, for variations of the file.
inline GgufBuilder check_gguf_round_trip(const ParamSet& original, const TempDir& dir, const std::string& name) {
  GgufBuilder b = model_gguf_builder(original);
  const std::string path = write_file(dir, name, b.bytes());
  const LlamaConfig loaded_config = LlamaConfig::resolve(path);
  CHECK(loaded_config.to_json() == original.config().to_json());
  ParamSet loaded(loaded_config, DType::f64);
  load_gguf_weights(loaded, GgufReader(path));
  for (size_t i = 0; i < original.size(); ++i) {
    CAPTURE(original.specs()[i].name);
    CHECK(compare(loaded[i], original[i]).max_abs == 0.0);
  }
  return b;
}

}  // namespace cw::test
