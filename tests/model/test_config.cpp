// LlamaConfig: HF config.json in its v4 and v5 forms, presets, and clear errors for bad configs.
#include "model/config.h"
#include "model/params.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <fstream>

using namespace cw;
using nlohmann::json;

namespace {
json llama32_1b_v4() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]})");
}

// Expects from_json to throw an error whose message contains every fragment.
void expect_error(const json& j, std::initializer_list<const char*> fragments) {
  try {
    LlamaConfig::from_json(j, "cfg.json");
    FAIL("no error for " << j.dump());
  } catch (const Error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("cfg.json") != std::string::npos);
    for (const char* f : fragments) CHECK(what.find(f) != std::string::npos);
  }
}
}  // namespace

TEST_CASE("config v4 keys: Llama-3.2-1B") {
  const LlamaConfig c = LlamaConfig::from_json(llama32_1b_v4(), "cfg.json");
  CHECK(c.hidden_size == 2048);
  CHECK(c.head_dim == 64);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.tie_word_embeddings);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rope_scaling.type == RopeScaling::Type::llama3);
  CHECK(c.rope_scaling.factor == 32.0);
  CHECK(c.rope_scaling.original_max_position == 8192);
  CHECK(c.eos_token_ids == std::vector<int64_t>{128001, 128008, 128009});
  CHECK(c.torch_dtype == "bfloat16");
  CHECK(c.parameter_count() == 1235814400);  // what transformers reports for Llama-3.2-1B
}

TEST_CASE("config v5 keys: rope_parameters and dtype") {
  json j = llama32_1b_v4();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j.erase("torch_dtype");
  j["dtype"] = "float32";
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  const LlamaConfig c = LlamaConfig::from_json(j, "cfg.json");
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rope_scaling.type == RopeScaling::Type::llama3);
  CHECK(c.torch_dtype == "float32");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  CHECK(LlamaConfig::from_json(j, "cfg.json").rope_scaling.type == RopeScaling::Type::none);
}

TEST_CASE("config: head_dim and kv heads may be absent; eos may be a number") {
  json j = llama32_1b_v4();
  j.erase("head_dim");
  j.erase("num_key_value_heads");
  j["eos_token_id"] = 2;
  j["pad_token_id"] = 5;
  const LlamaConfig c = LlamaConfig::from_json(j, "cfg.json");
  CHECK(c.head_dim == 64);
  CHECK(c.num_key_value_heads == 32);
  CHECK(c.eos_token_ids == std::vector<int64_t>{2});
  CHECK(c.pad_token_id == 5);
  CHECK(c.to_json().at("pad_token_id") == 5);
  CHECK_FALSE(LlamaConfig::from_json(llama32_1b_v4(), "cfg.json").to_json().contains("pad_token_id"));
  // A config round-trips through the JSON a checkpoint carries.
  const LlamaConfig back = LlamaConfig::from_json(c.to_json(), "round trip");
  CHECK(back.to_json() == c.to_json());
}

TEST_CASE("config errors name the file and the key") {
  json j = llama32_1b_v4();
  j.erase("hidden_size");
  expect_error(j, {"hidden_size", "missing"});
  j = llama32_1b_v4();
  j["num_hidden_layers"] = "sixteen";
  expect_error(j, {"num_hidden_layers", "integer"});
  j = llama32_1b_v4();
  j["num_hidden_layers"] = 2.5;
  expect_error(j, {"num_hidden_layers", "integer"});
  j = llama32_1b_v4();
  j["num_key_value_heads"] = 5;
  expect_error(j, {"num_attention_heads", "num_key_value_heads"});
  j = llama32_1b_v4();
  j.erase("head_dim");
  j["num_attention_heads"] = 3;
  j["num_key_value_heads"] = 3;
  expect_error(j, {"hidden_size", "divisible"});
  j = llama32_1b_v4();
  j["rope_scaling"]["rope_type"] = "yarn";
  expect_error(j, {"rope_type", "yarn"});
  j = llama32_1b_v4();
  j["rope_scaling"].erase("factor");
  expect_error(j, {"factor"});
  j = llama32_1b_v4();
  j["architectures"] = {"GPT2LMHeadModel"};
  expect_error(j, {"LlamaForCausalLM"});
  j = llama32_1b_v4();
  j["vocab_size"] = 0;
  expect_error(j, {"vocab_size", "positive"});
  CHECK_THROWS_AS(LlamaConfig::from_json(json::array(), "cfg.json"), Error);
}

TEST_CASE("config files: unreadable, malformed, directory resolution") {
  test::TempDir dir("config");
  CHECK_THROWS_AS(LlamaConfig::from_file(dir.file("absent.json")), Error);
  {
    std::ofstream(dir.file("bad.json")) << "{ not json";
  }
  try {
    LlamaConfig::from_file(dir.file("bad.json"));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("bad.json") != std::string::npos);
  }
  {
    std::ofstream(dir.file("config.json")) << llama32_1b_v4().dump();
  }
  CHECK(LlamaConfig::resolve(dir.path.string()).hidden_size == 2048);
  CHECK(LlamaConfig::resolve(dir.file("config.json")).hidden_size == 2048);
  CHECK_THROWS_AS(LlamaConfig::resolve("no-such-preset"), Error);
}

TEST_CASE("presets and the parameter table") {
  for (const auto& name : LlamaConfig::preset_names()) CHECK_NOTHROW(LlamaConfig::preset(name));
  CHECK(LlamaConfig::preset("llama-3.1-8b").parameter_count() == 8030261248);
  CHECK(LlamaConfig::preset("llama-3.2-3b").parameter_count() == 3212749824);
  LlamaConfig tiny = LlamaConfig::preset("tiny");
  auto table = parameter_table(tiny);
  CHECK(table.size() == 1 + 9 * 2 + 1 + 1);
  CHECK(table.front().name == "model.embed_tokens.weight");
  CHECK(table[2].name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(table[3].shape == std::vector<int64_t>{tiny.kv_dim(), tiny.hidden_size});
  CHECK(table.back().name == "lm_head.weight");
  int64_t total = 0;
  for (const auto& s : table) total += s.numel();
  CHECK(total == tiny.parameter_count());
  tiny.tie_word_embeddings = true;
  CHECK(parameter_table(tiny).back().name == "model.norm.weight");
  ParamSet p(tiny, DType::f64);
  CHECK(p.weights().lm_head.data == p.weights().embedding.data);
}
