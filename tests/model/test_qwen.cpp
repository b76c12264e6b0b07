// The Qwen family (model/config.h: qwen2's q/k/v biases, qwen3's per-head q/k norms) at the edges
// where it meets files:
//   - transformers' own config.json and checkpoints (tests/data/qwen_reference, made by
//     tests/data/qwen_reference.py, with a Llama of attention_bias beside them): the logits, the loss
//     and every parameter's gradient equal transformers' in f64, under full backprop and seco;
//   - config.json read, written and read back; the presets' parameter counts are transformers';
//   - what chunkwise does not compute (MLP biases, sliding windows, other activations) refused naming
//     the key; Llama's and Qwen3's attention_bias (q, k, v and o_proj biases) read and written back;
//   - GGUF files of architecture qwen2 and qwen3 as llama.cpp writes them (Q/K rows unpermuted,
//     biases and per-head norms by their GGUF names), and the qwen2 pre-tokenizer.
// The schedules against the reference step with Qwen's blocks: tests/model/test_reference.cpp.
#include "model/gguf_llama.h"
#include "model/pretokenizer.h"
#include "model/safetensors.h"
#include "optim/schedule.h"
#include "tests/model/gguf_builder.h"
#include "tests/model/hf_reference.h"
#include "tests/support.h"
#include "tools/model_io.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

using namespace cw;

namespace {

namespace fs = std::filesystem;

fs::path reference_dir(const char* name) { return test::hf_reference_dir("qwen_reference", name); }

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(test::read_text(path)); }

}  // namespace

TEST_CASE("qwen: transformers' config.json of Qwen2 and Qwen3 reads as the model they describe") {
  const LlamaConfig q2 = LlamaConfig::from_file((reference_dir("qwen2") / "config.json").string());
  CHECK(q2.family == ModelFamily::qwen2);
  CHECK(q2.attention_bias);
  CHECK(!q2.qk_norm);
  CHECK(q2.head_dim == 4);  // hidden / heads: Qwen2's config.json has no head_dim
  CHECK(q2.tie_word_embeddings);
  CHECK(q2.rope_theta == 1e6);
  const LlamaConfig q3 = LlamaConfig::from_file((reference_dir("qwen3") / "config.json").string());
  CHECK(q3.family == ModelFamily::qwen3);
  CHECK(!q3.attention_bias);
  CHECK(q3.qk_norm);
  CHECK(q3.head_dim == 8);  // its own key, twice hidden / heads
  CHECK(q3.q_dim() == 32);
  CHECK(!q3.tie_word_embeddings);
  for (const LlamaConfig* c : {&q2, &q3}) {
    CAPTURE(model_family_name(c->family));
    const nlohmann::json j = c->to_json();
    CHECK(j["model_type"] == model_family_name(c->family));
    CHECK(j["architectures"][0] == (c->family == ModelFamily::qwen2 ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM"));
    CHECK(j["use_sliding_window"] == false);
    CHECK(LlamaConfig::from_json(j, "round trip").to_json() == j);
  }
  // The table has transformers' tensors: what save_pretrained wrote, each with its shape.
  for (const char* name : {"qwen2", "qwen3"}) {
    const LlamaConfig c = LlamaConfig::resolve(reference_dir(name).string());
    const SafetensorsReader r((reference_dir(name) / "model.safetensors").string());
    CHECK(parameter_table(c).size() == r.entries().size());
    CHECK(c.parameter_count() == ParamSet(c, DType::f32).numel());
  }
}

TEST_CASE("qwen: logits, loss and every gradient equal transformers' in f64 (tests/data/qwen_reference)") {
  std::vector<ScheduleOptions> schedules(2);
  schedules[1].kind = ScheduleKind::seco;
  schedules[1].chunk = 5;
  schedules[1].bwd_chunk = 3;
  double worst = 0;
  for (const char* name : {"qwen2", "qwen3", "llama_bias"}) {
    CAPTURE(std::string(name));
    worst = std::max(worst, test::compare_with_transformers(reference_dir(name).string(), schedules));
  }
  MESSAGE("qwen2, qwen3, llama with attention_bias against transformers (f64): max_rel_err=", worst);
}

TEST_CASE("qwen: a checkpoint chunkwise writes carries transformers' config and reads back the same") {
  test::TempDir tmp("qwen-checkpoint");
  for (const char* preset : {"tiny-qwen2", "tiny-qwen3"}) {
    CAPTURE(std::string(preset));
    const LlamaConfig c = LlamaConfig::preset(preset);
    ParamSet params(c, DType::f64);
    init_parameters(params, 5, c.initializer_range, 0.1);
    const std::string dir = tmp.file(preset);
    save_checkpoint_weights(params, c, dir, DType::f64);
    const nlohmann::json j = read_json(fs::path(dir) / "config.json");
    CHECK(j["model_type"] == model_family_name(c.family));
    CHECK(j.contains("attention_bias") == (c.family == ModelFamily::qwen3));  // Qwen2's biases are its type's
    LlamaConfig written = c;
    written.torch_dtype = "float64";
    CHECK(LlamaConfig::resolve(dir).to_json() == written.to_json());
    const LlamaConfig back = LlamaConfig::resolve(dir);
    ParamSet loaded(back, DType::f64);
    CHECK(load_checkpoint_weights(loaded, dir).empty());
    for (size_t i = 0; i < params.size(); ++i) {
      CAPTURE(params.specs()[i].name);
      CHECK(test::compare(loaded[i], params[i]).max_abs == 0.0);
    }
  }
}

TEST_CASE("qwen: the presets have the released models' shapes (transformers' parameter counts)") {
  // AutoModelForCausalLM.from_config on the meta device with the HF config.json's shapes.
  CHECK(LlamaConfig::preset("qwen2.5-0.5b").parameter_count() == 494032768);
  CHECK(LlamaConfig::preset("qwen2.5-7b").parameter_count() == 7615616512);
  CHECK(LlamaConfig::preset("qwen3-0.6b").parameter_count() == 596049920);
  CHECK(LlamaConfig::preset("qwen3-8b").parameter_count() == 8190735360);
  const LlamaConfig q3 = LlamaConfig::preset("qwen3-0.6b");
  CHECK(q3.q_dim() == 2048);  // 16 heads of 128 on a width of 1024
  CHECK(q3.tie_word_embeddings);
  CHECK(!LlamaConfig::preset("qwen2.5-7b").tie_word_embeddings);
}

TEST_CASE("qwen: what chunkwise does not compute is refused, naming the key") {
  test::check_config_refusals(LlamaConfig::preset("tiny-qwen2").to_json(), {
      {"MLP biases", {{"mlp_bias", true}}, "\"mlp_bias\""},
      {"another activation", {{"hidden_act", "gelu"}}, "\"hidden_act\" is 'gelu'"},
      {"sliding windows", {{"use_sliding_window", true}}, "\"use_sliding_window\" is true"},
      {"a sliding layer", {{"layer_types", {"full_attention", "sliding_attention"}}}, "\"layer_types\""},
      {"another model", {{"model_type", "gemma"}}, "\"model_type\" is 'gemma'"},
      {"another class", {{"architectures", {"LlamaForCausalLM"}}}, "does not include Qwen2ForCausalLM"},
  });
  // Llama's and Qwen3's attention_bias: biases on q, k, v and o_proj, written back as given.
  for (const char* family : {"llama", "qwen3"}) {
    CAPTURE(family);
    nlohmann::json biased = LlamaConfig::preset(std::string(family) == "llama" ? "tiny" : "tiny-qwen3").to_json();
    biased["attention_bias"] = true;
    const LlamaConfig c = LlamaConfig::from_json(biased, "config.json");
    CHECK((c.attention_bias && c.o_bias));
    CHECK(c.to_json()["attention_bias"] == true);
    CHECK(ParamSet(c, DType::f32).find("model.layers.1.self_attn.o_proj.bias") >= 0);
  }
  // Without model_type, the architecture names the family.
  nlohmann::json j = LlamaConfig::preset("tiny-qwen2").to_json();
  j.erase("model_type");
  CHECK(LlamaConfig::from_json(j, "config.json").family == ModelFamily::qwen2);
  // A family's own parts belong to it alone: the config could not be written back.
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.qk_norm = true;
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "per-head q/k norms belong to qwen3"));
}

TEST_CASE("qwen: GGUF files of architecture qwen2 and qwen3 load into the same parameters") {
  test::TempDir tmp("qwen-gguf");
  for (const char* preset : {"tiny-qwen2", "tiny-qwen3"}) {
    CAPTURE(std::string(preset));
    const LlamaConfig c = test::as_gguf_reads(LlamaConfig::preset(preset));
    ParamSet original(c, DType::f32);
    init_parameters(original, 11, 0.5, 0.1);
    const test::GgufBuilder b = test::check_gguf_round_trip(original, tmp, std::string(preset) + ".gguf");
    // A Qwen tensor in a file that says llama has no place there, and a missing one is named.
    const std::string extra = c.family == ModelFamily::qwen2 ? "blk.0.attn_q.bias" : "blk.0.attn_q_norm.weight";
    LlamaConfig llama = c;
    llama.family = ModelFamily::llama;
    llama.attention_bias = llama.qk_norm = false;
    test::GgufBuilder as_llama = test::model_gguf_builder(ParamSet(llama, DType::f32));
    for (const test::TensorSpec& t : b.tensors)
      if (t.name == extra) as_llama.tensors.push_back(t);
    const std::string llama_path = test::write_file(tmp, std::string(preset) + "-as-llama.gguf", as_llama.bytes());
    const std::string message = test::error_of([&] {
      ParamSet p(LlamaConfig::resolve(llama_path), DType::f32);
      load_gguf_weights(p, GgufReader(llama_path));
    });
    INFO(message);
    CHECK(test::contains(message, "tensor '" + extra + "' has no place in a llama model"));
    test::GgufBuilder missing = b;
    std::erase_if(missing.tensors, [&](const test::TensorSpec& t) { return t.name == extra; });
    const std::string missing_path = test::write_file(tmp, std::string(preset) + "-missing.gguf", missing.bytes());
    CHECK(test::contains(test::error_of([&] { LlamaConfig::resolve(missing_path); }), "has no tensor '" + extra + "'"));
  }
}

TEST_CASE("qwen: the qwen2 pre-tokenizer splits digits one by one, as llama.cpp's and Qwen's tokenizer.json") {
  const Pretokenizer qwen2 = Pretokenizer::named("qwen2", "test");
  const std::vector<std::string_view> pieces = qwen2.split("x 123 abc's\n\n  y");
  CHECK(pieces == std::vector<std::string_view>{"x", " ", "1", "2", "3", " abc", "'s", "\n\n", " ", " y"});
  // Llama 3's groups digits in threes: the one difference.
  CHECK(Pretokenizer::named("llama-bpe", "test").split("123")[0] == "123");
}
