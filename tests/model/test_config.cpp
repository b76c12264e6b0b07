// LlamaConfig: HF config.json in its v4 and v5 forms, presets, and clear errors for bad configs.
#include "model/config.h"
#include "model/params.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

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
  j["rope_scaling"]["rope_type"] = "longrope";
  expect_error(j, {"rope_type", "longrope"});
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

namespace {
// A small Llama config.json around a RoPE section: rope_scaling (v4) or, with v5, rope_parameters
// holding rope_theta too.
json with_rope(const json& scaling, int64_t max_position_embeddings = 32768, bool v5 = false) {
  json j = llama32_1b_v4();
  j["max_position_embeddings"] = max_position_embeddings;
  j.erase("rope_scaling");
  if (v5) {
    j.erase("rope_theta");
    j["rope_parameters"] = scaling;
    j["rope_parameters"]["rope_theta"] = 500000.0;
  } else {
    j["rope_scaling"] = scaling;
  }
  return j;
}

json yarn_scaling() {
  return {{"rope_type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 4096}};
}
}  // namespace

TEST_CASE("config: yarn and dynamic read as transformers resolves them (tests/data/rope_scaling_reference.json)") {
  std::ifstream in(std::string(CW_SOURCE_ROOT) + "/tests/data/rope_scaling_reference.json");
  REQUIRE(in.good());
  // The reference's float64 values against ours through the parsed config: the same formulas, a few
  // ulps apart (tests/engine/test_rope_scaling.cpp holds the tables to them).
  constexpr double kReferenceTol = 1e-14;
  for (const json& c : json::parse(in).at("cases")) {
    INFO(c.at("name").get<std::string>());
    json j = with_rope(c.at("rope_scaling"), c.at("max_position_embeddings"));
    j["head_dim"] = c.at("head_dim");
    j["rope_theta"] = c.at("rope_theta");
    const LlamaConfig cf = LlamaConfig::from_json(j, "cfg.json");
    const json& r = c.at("resolved");
    CHECK(rope_type_name(cf.rope_scaling.type) == r.at("rope_type").get<std::string>());
    CHECK(cf.rope_scaling.factor == r.at("factor").get<double>());
    CHECK(cf.rope_scaling.original_max_position == r.at("original_max_position_embeddings").get<int64_t>());
    const int64_t seq_len = c.at("seq_len").is_null() ? 0 : c.at("seq_len").get<int64_t>();
    const std::vector<double> inv = rope_inv_freq(cf.head_dim, cf.rope_theta, cf.rope_scaling, seq_len);
    const auto want = c.at("inv_freq").get<std::vector<double>>();
    REQUIRE(inv.size() == want.size());
    for (size_t i = 0; i < inv.size(); ++i) CHECK(inv[i] == doctest::Approx(want[i]).epsilon(kReferenceTol));
    CHECK(rope_attention_factor(cf.rope_scaling) ==
          doctest::Approx(c.at("attention_factor").get<double>()).epsilon(kReferenceTol));
  }
}

TEST_CASE("config: yarn and dynamic round-trip through the config.json a checkpoint carries, from v4 and v5") {
  const json full = {{"rope_type", "yarn"},     {"factor", 16.0},         {"original_max_position_embeddings", 2048},
                     {"beta_fast", 24.0},       {"beta_slow", 2.0},       {"attention_factor", 1.3},
                     {"mscale", 0.9},           {"mscale_all_dim", 0.8},  {"truncate", false}};
  const json dynamic = {{"type", "dynamic"}, {"factor", 2.0}};
  for (const bool v5 : {false, true})
    for (const json& scaling : {yarn_scaling(), full, dynamic}) {
      INFO((v5 ? "v5 " : "v4 ") << scaling.dump());
      const LlamaConfig c = LlamaConfig::from_json(with_rope(scaling, 32768, v5), "cfg.json");
      const json written = c.to_json();
      const LlamaConfig back = LlamaConfig::from_json(written, "round trip");
      CHECK(back.rope_scaling == c.rope_scaling);
      CHECK(back.rope_theta == c.rope_theta);
      CHECK(back.max_position_embeddings == c.max_position_embeddings);
      CHECK(back.to_json() == written);
      // What transformers reads: the values given, nothing it would read differently.
      const json& rs = written.at("rope_scaling");
      for (const auto& [key, value] : scaling.items())
        if (key != "type") CHECK(rs.at(key) == value);
      CHECK(rs.at("rope_type") == rope_type_name(c.rope_scaling.type));
    }
  const json plain = LlamaConfig::from_json(with_rope(yarn_scaling()), "cfg.json").to_json().at("rope_scaling");
  CHECK(plain.at("beta_fast") == 32.0);
  CHECK(plain.at("beta_slow") == 1.0);
  for (const char* absent : {"attention_factor", "mscale", "mscale_all_dim", "truncate"}) CHECK_FALSE(plain.contains(absent));
  CHECK_FALSE(LlamaConfig::from_json(with_rope(dynamic), "cfg.json").to_json().at("rope_scaling").contains(
      "original_max_position_embeddings"));
}

TEST_CASE("config: yarn's original length and factor as transformers resolves them") {
  // A top-level original_max_position_embeddings wins over the scaling's own (transformers'
  // standardize_rope_params, for Phi-3's configs); without either it is max_position_embeddings.
  json j = with_rope(yarn_scaling());
  j["original_max_position_embeddings"] = 8192;
  CHECK(LlamaConfig::from_json(j, "cfg.json").rope_scaling.original_max_position == 8192);
  json no_original = yarn_scaling();
  no_original.erase("original_max_position_embeddings");
  CHECK(LlamaConfig::from_json(with_rope(no_original, 4096), "cfg.json").rope_scaling.original_max_position == 4096);
  // A null factor: max_position_embeddings / original (DeepSeek-V3's reading).
  json null_factor = yarn_scaling();
  null_factor["factor"] = nullptr;
  CHECK(LlamaConfig::from_json(with_rope(null_factor, 16384), "cfg.json").rope_scaling.factor == 4.0);
  // truncate: null truncates nothing, as Python's truthiness reads it.
  json truncate_null = yarn_scaling();
  truncate_null["truncate"] = nullptr;
  CHECK_FALSE(LlamaConfig::from_json(with_rope(truncate_null), "cfg.json").rope_scaling.truncate);
  // dynamic scales from max_position_embeddings, whatever else the section holds.
  json dyn = {{"rope_type", "dynamic"}, {"factor", 2.0}, {"original_max_position_embeddings", 99}};
  CHECK(LlamaConfig::from_json(with_rope(dyn, 2048), "cfg.json").rope_scaling.original_max_position == 2048);
}

TEST_CASE("config: bad yarn and dynamic values are one-line errors naming the file and the key") {
  auto yarn_with = [](const char* key, const json& value) {
    json s = yarn_scaling();
    s[key] = value;
    return s;
  };
  expect_error(with_rope(yarn_with("factor", 0.5)), {"rope_scaling.factor", ">= 1", "yarn"});
  json no_factor = yarn_scaling();
  no_factor.erase("factor");
  expect_error(with_rope(no_factor), {"factor", "missing"});
  expect_error(with_rope(yarn_with("factor", "eight")), {"factor", "number"});
  expect_error(with_rope(yarn_with("beta_fast", 1.0)), {"beta_fast", "beta_slow"});
  expect_error(with_rope(yarn_with("beta_slow", 0.0)), {"beta_slow", "> 0"});
  expect_error(with_rope(yarn_with("original_max_position_embeddings", 0)), {"original_max_position_embeddings", "positive"});
  expect_error(with_rope(yarn_with("original_max_position_embeddings", 4096.5)), {"original_max_position_embeddings", "integer"});
  expect_error(with_rope(yarn_with("attention_factor", -1.0)), {"attention_factor", "positive"});
  expect_error(with_rope(yarn_with("truncate", "yes")), {"truncate", "true or false"});
  expect_error(with_rope(yarn_with("rope_type", 5)), {"rope_type", "string"});
  expect_error(with_rope(yarn_with("factor", 0.5), 32768, true), {"rope_parameters.factor", ">= 1"});
  expect_error(with_rope({{"rope_type", "dynamic"}, {"factor", 0.9}}), {"factor", ">= 1", "dynamic"});
  expect_error(with_rope({{"rope_type", "dynamic"}}), {"factor", "missing"});
  json tiny_head = with_rope({{"rope_type", "dynamic"}, {"factor", 2.0}});
  tiny_head["head_dim"] = 2;
  expect_error(tiny_head, {"dynamic", "head_dim"});
}

// One row per malformation of a valid config.json: the value a key is set to and a fragment of the
// one line that must refuse it (the file, the key, the value and the limit or the type expected).
TEST_CASE("config.json: malformed values are refused in one line naming the key, as a table") {
  struct Row {
    const char* what;
    std::function<void(json&)> mutate;
    const char* fragment;
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Row> table = {
      {"vocab 10^12", [](json& j) { j["vocab_size"] = int64_t{1000000000000}; },
       "'vocab_size' is 1000000000000, above the limit 2147483647 (token ids are int32)"},
      {"2^40 layers", [](json& j) { j["num_hidden_layers"] = int64_t{1} << 40; },
       "'num_hidden_layers' is 1099511627776, above the limit 16384"},
      {"10^6 layers", [](json& j) { j["num_hidden_layers"] = 1000000; }, "'num_hidden_layers' is 1000000, above the limit"},
      {"FFN 2^40", [](json& j) { j["intermediate_size"] = int64_t{1} << 40; },
       "'intermediate_size' is 1099511627776, above the limit 1048576"},
      {"2^40 heads", [](json& j) { j["num_attention_heads"] = int64_t{1} << 40; },
       "'num_attention_heads' is 1099511627776, above the limit 65536"},
      {"head dim 2^20", [](json& j) { j["head_dim"] = int64_t{1} << 20; }, "'head_dim' is 1048576, above the limit 16384"},
      {"every size at its limit", [](json& j) {
         j["vocab_size"] = (int64_t{1} << 31) - 1;
         j["hidden_size"] = int64_t{1} << 20;
       }, "parameters, above the limit 4398046511104 (2^42)"},
      {"a u64 past int64", [](json& j) { j["vocab_size"] = uint64_t{1} << 63; },
       "cfg.json: \"vocab_size\" must be an int64, found the integer 9223372036854775808"},
      {"negative KV heads", [](json& j) { j["num_key_value_heads"] = -8; }, "'num_key_value_heads' must be positive, got -8"},
      {"theta a string", [](json& j) { j["rope_theta"] = "abc"; },
       "cfg.json: \"rope_theta\" must be a number, found a string \"abc\""},
      {"theta infinite", [&](json& j) { j["rope_theta"] = inf; }, "cfg.json: \"rope_theta\" must be a finite number"},
      {"factor a string", [](json& j) { j["rope_scaling"]["factor"] = "x"; },
       "cfg.json: \"rope_scaling.factor\" must be a number, found a string \"x\""},
      {"factor NaN", [&](json& j) { j["rope_scaling"]["factor"] = nan; }, "\"rope_scaling.factor\" must be a finite number"},
      {"scaling a number", [](json& j) { j["rope_scaling"] = 5; },
       "cfg.json: \"rope_scaling\" must be an object, found the integer 5"},
      {"v5 theta a list", [](json& j) { j["rope_parameters"] = {{"rope_theta", json::array({1, 2})}}; },
       "cfg.json: \"rope_parameters.rope_theta\" must be a number, found an array of 2"},
      {"eos id a string", [](json& j) { j["eos_token_id"] = {128001, "end"}; },
       "cfg.json: \"eos_token_id[1]\" must be an integer, found a string \"end\""},
      {"tie a string", [](json& j) { j["tie_word_embeddings"] = "yes"; },
       "cfg.json: \"tie_word_embeddings\" must be true or false"},
      {"eps an object", [](json& j) { j["rms_norm_eps"] = json::object(); },
       "cfg.json: \"rms_norm_eps\" must be a number, found an object of 0 keys"},
      {"vocab missing", [](json& j) { j.erase("vocab_size"); }, "cfg.json: \"vocab_size\" is missing"},
  };
  for (const Row& row : table) {
    CAPTURE(row.what);
    json j = llama32_1b_v4();
    row.mutate(j);
    const std::string message = test::message_of([&] { LlamaConfig::from_json(j, "cfg.json"); });
    INFO("message: ", message);
    CHECK(test::contains(message, row.fragment));
    CHECK(!test::contains(message, "unexpected error"));
    CHECK(!test::contains(message, "json.exception"));
  }
}

TEST_CASE("config.json: invalid JSON is refused naming the file, without the parser's tag") {
  test::TempDir dir("config-json");
  for (const char* text : {"{\"vocab_size\": 1e400}", "{ not json", "[1, 2"}) {
    CAPTURE(text);
    std::ofstream(dir.file("config.json")) << text;
    const std::string message = test::message_of([&] { LlamaConfig::from_file(dir.file("config.json")); });
    CHECK(test::contains(message, "config.json: not valid JSON"));
    CHECK(!test::contains(message, "json.exception"));
  }
}
