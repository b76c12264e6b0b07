// The Mistral family (model/config.h: Llama's block, every layer attending through a sliding window
// of sliding_window keys) where it meets files and devices:
//   - transformers' own config.json and checkpoints (tests/data/mistral_reference, made by
//     tests/data/mistral_reference.py with eager attention): the logits, the loss and every
//     parameter's gradient equal transformers' in f64 under full backprop and seco with chunks shorter
//     than, as long as and longer than the window; the same weights without the window are far off;
//   - config.json read (the window an integer, null or absent: MistralConfig's 4096), written and
//     read back; what is refused; the presets' parameter counts are transformers';
//   - the K/V store reads only each chunk's window: keys before it are neither read nor given dK, dV;
//   - a GPU run is not refused (the flash kernels honour the window; tests/model/test_cuda_model.cpp);
//   - GGUF: architecture llama with llama.attention.sliding_window is Mistral.
// The schedules against full backprop with a window: tests/optim/test_schedules.cpp; against the
// reference step: tests/model/test_reference.cpp; the op: tests/engine/test_attention_documents.cpp.
#include "engine/random.h"
#include "model/gguf_llama.h"
#include "model/kv_store.h"
#include "model/safetensors.h"
#include "optim/schedule.h"
#include "tests/model/gguf_builder.h"
#include "tests/model/hf_reference.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

using namespace cw;

namespace {

namespace fs = std::filesystem;

fs::path reference_dir(const char* name) { return test::hf_reference_dir("mistral_reference", name); }

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(test::read_text(path)); }

ScheduleOptions seco(int64_t chunk, int64_t bwd_chunk = 0) {
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = chunk;
  o.bwd_chunk = bwd_chunk;
  return o;
}

}  // namespace

TEST_CASE("mistral: transformers' config.json reads as the model it describes, and round-trips") {
  const LlamaConfig w5 = LlamaConfig::from_file((reference_dir("window5") / "config.json").string());
  CHECK(w5.family == ModelFamily::mistral);
  CHECK(w5.sliding_window == 5);
  CHECK(w5.head_dim == 8);  // its own key, twice hidden / heads
  CHECK(!w5.attention_bias);
  CHECK(!w5.tie_word_embeddings);
  const LlamaConfig w7 = LlamaConfig::from_file((reference_dir("window7") / "config.json").string());
  CHECK(w7.sliding_window == 7);
  CHECK(w7.num_key_value_heads == 1);
  CHECK(w7.tie_word_embeddings);
  for (const LlamaConfig* c : {&w5, &w7}) {
    const nlohmann::json j = c->to_json();
    CHECK(j["model_type"] == "mistral");
    CHECK(j["architectures"][0] == "MistralForCausalLM");
    CHECK(j["sliding_window"] == c->sliding_window);
    CHECK(!j.contains("attention_bias"));  // MistralConfig has none
    CHECK(!j.contains("use_sliding_window"));
    CHECK(LlamaConfig::from_json(j, "round trip").to_json() == j);
  }
  // The window: null is none, absent is MistralConfig's default 4096; head_dim absent is hidden / heads.
  nlohmann::json j = read_json(reference_dir("window7") / "config.json");
  j["sliding_window"] = nullptr;
  const LlamaConfig none = LlamaConfig::from_json(j, "config.json");
  CHECK(none.sliding_window == 0);
  CHECK(none.to_json()["sliding_window"].is_null());
  CHECK(LlamaConfig::from_json(none.to_json(), "round trip").sliding_window == 0);
  j.erase("sliding_window");
  j.erase("head_dim");
  const LlamaConfig absent = LlamaConfig::from_json(j, "config.json");
  CHECK(absent.sliding_window == 4096);
  CHECK(absent.head_dim == 4);
  // Without model_type, the architecture names the family.
  j = read_json(reference_dir("window5") / "config.json");
  j.erase("model_type");
  CHECK(LlamaConfig::from_json(j, "config.json").family == ModelFamily::mistral);
  // The table has transformers' tensors: what save_pretrained wrote, each with its shape.
  for (const char* name : {"window5", "window7"}) {
    const LlamaConfig c = LlamaConfig::resolve(reference_dir(name).string());
    const SafetensorsReader r((reference_dir(name) / "model.safetensors").string());
    CHECK(parameter_table(c).size() == r.entries().size());
  }
}

TEST_CASE("mistral: logits, loss and every gradient equal transformers' in f64 (tests/data/mistral_reference)") {
  // Windows of 5 and 7 on 24 tokens: seco's chunks shorter than, as long as and longer than the
  // window, forward and reverse chunks apart, the window cutting inside chunks.
  const std::vector<ScheduleOptions> schedules{ScheduleOptions{}, seco(3), seco(5, 7), seco(7, 5), seco(9, 4),
                                               seco(24)};
  double worst = 0;
  for (const char* name : {"window5", "window7"}) {
    CAPTURE(std::string(name));
    worst = std::max(worst, test::compare_with_transformers(reference_dir(name).string(), schedules, 4));
  }
  MESSAGE("mistral (windows 5, 7) against transformers (f64): max_rel_err=", worst);
}

TEST_CASE("mistral: the same weights without the window are far from transformers (the comparison sees the window)") {
  test::TempDir tmp("mistral-no-window");
  for (const char* name : {"window5", "window7"}) {
    CAPTURE(std::string(name));
    const fs::path dir = tmp.file(name);
    fs::copy(reference_dir(name), dir);
    nlohmann::json j = read_json(dir / "config.json");
    j["sliding_window"] = nullptr;
    fs::permissions(dir / "config.json", fs::perms::owner_write, fs::perm_options::add);
    std::ofstream(dir / "config.json") << j.dump(2);
    const SafetensorsReader expected((reference_dir(name) / "expected.safetensors").string());
    const test::Worst w = test::logits_against_transformers(dir.string(), expected, 4);
    MESSAGE(std::string(name), " without its window against transformers: logits rel err ", w.rel);
    CHECK(w.rel > 1e-3);
  }
}

TEST_CASE("mistral: what is refused, naming the key") {
  test::check_config_refusals(LlamaConfig::preset("tiny-mistral").to_json(), {
      {"an empty window", {{"sliding_window", 0}}, "\"sliding_window\" is 0"},
      {"a negative window", {{"sliding_window", -3}}, "\"sliding_window\" is -3"},
      {"a window that is no integer", {{"sliding_window", "4096"}}, "\"sliding_window\""},
      {"another class", {{"architectures", {"LlamaForCausalLM"}}}, "does not include MistralForCausalLM"},
      {"another activation", {{"hidden_act", "gelu"}}, "\"hidden_act\" is 'gelu'"},
  });
  // transformers' Llama and Qwen have no window of this kind: a config.json's sliding_window is not
  // theirs, and a window set on them could not be written back.
  nlohmann::json llama = LlamaConfig::preset("tiny").to_json();
  llama["sliding_window"] = 4;
  CHECK(LlamaConfig::from_json(llama, "config.json").sliding_window == 0);
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.sliding_window = 4;
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "a sliding window belongs to mistral"));
  c = LlamaConfig::preset("tiny-mistral");
  c.attention_bias = c.o_bias = true;
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "mistral has no attention biases"));
}

TEST_CASE("mistral: the presets have Mistral-7B-v0.1's shapes (transformers' parameter count)") {
  const LlamaConfig m = LlamaConfig::preset("mistral-7b");
  // AutoModelForCausalLM.from_config on the meta device with the HF config.json's shapes.
  CHECK(m.parameter_count() == 7241732096);
  CHECK(m.sliding_window == 4096);
  CHECK(m.kv_dim() == 1024);
  CHECK(m.to_json()["sliding_window"] == 4096);
  const LlamaConfig tiny = LlamaConfig::preset("tiny-mistral");
  CHECK(tiny.family == ModelFamily::mistral);
  CHECK(tiny.sliding_window == 5);
  CHECK(tiny.first_visible_key(0, 4) == 0);
  CHECK(tiny.first_visible_key(1, 5) == 1);  // every layer of a Mistral has the window
  CHECK(tiny.first_visible_key(0, 12) == 8);
}

TEST_CASE("mistral: the K/V store reads only a chunk's window; keys before it get no dK, dV (the relay stops)") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny-mistral");  // W = 5
  const int64_t B = 2, T = 20, H = cfg.num_attention_heads, D = cfg.head_dim;
  KVStore kv(cfg, B, T, DType::f64, {.with_grads = true});
  Arena scratch;
  for (const auto& [t0, t1] : {std::pair<int64_t, int64_t>{12, 16}, {3, 9}, {0, 20}}) {
    CAPTURE(t0);
    const int64_t c = t1 - t0, first = kv.first_key(0, t0);
    CHECK(first == std::max<int64_t>(0, t0 - 4));
    // Keys [0, first) NaN, the rest drawn; the accumulators filled with a sentinel.
    fill_normal(kv.keys(0, 0, T), 1, 1);
    fill_normal(kv.values(0, 0, T), 1, 2);
    if (first > 0) {
      fill(kv.keys(0, 0, first), std::numeric_limits<double>::quiet_NaN());
      fill(kv.values(0, 0, first), std::numeric_limits<double>::quiet_NaN());
    }
    fill(kv.d_keys(0, 0, T), 7.0);
    fill(kv.d_values(0, 0, T), 7.0);
    OwnedTensor q(DType::f64, {B, c, H, D}), out(DType::f64, {B, c, H, D}), lse(DType::f64, {B, H, c});
    OwnedTensor d_q(DType::f64, {B, c, H, D}), d_out(DType::f64, {B, c, H, D});
    fill_normal(q, 1, 3);
    fill_normal(d_out, 1, 4);
    kv.attend_forward(0, t0, t1, out, {lse}, q, 0.5, scratch);
    kv.attend_backward(0, t0, t1, d_q, d_out, {lse}, q, out, 0.5, scratch);
    auto all_finite = [](const Tensor& t) {
      for (int64_t i = 0; i < t.numel(); ++i)
        if (!std::isfinite(t.ptr<double>()[i])) return false;
      return true;
    };
    CHECK(all_finite(out));
    CHECK(all_finite(d_q));
    OwnedTensor dk(DType::f64, {B, T, cfg.num_key_value_heads, D});
    copy_convert(dk, kv.d_keys(0, 0, T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < t1; ++t) {
        const double x = dk.tensor.ptr<double>()[(b * T + t) * cfg.kv_dim()];
        CAPTURE(t);
        if (t < first) CHECK(x == 7.0);  // untouched
        else CHECK((std::isfinite(x) && x != 7.0));
      }
  }
}

TEST_CASE("mistral: GGUF of architecture llama with llama.attention.sliding_window loads as Mistral") {
  test::TempDir tmp("mistral-gguf");
  const LlamaConfig c = test::as_gguf_reads(LlamaConfig::preset("tiny-mistral"));
  ParamSet original(c, DType::f32);
  init_parameters(original, 13, 0.5, 0.1);
  const test::GgufBuilder b = test::check_gguf_round_trip(original, tmp, "mistral.gguf");
  CHECK(b.bytes().find("llama.attention.sliding_window") != std::string::npos);
  // Without the key (as llama.cpp's converter writes Mistral 7B) the file is a Llama: no window.
  LlamaConfig llama = c;
  llama.family = ModelFamily::llama;
  llama.sliding_window = 0;
  const std::string plain = test::write_file(tmp, "llama.gguf", test::model_gguf_builder(ParamSet(llama, DType::f32)).bytes());
  CHECK(LlamaConfig::resolve(plain).family == ModelFamily::llama);
  CHECK(LlamaConfig::resolve(plain).sliding_window == 0);
}
