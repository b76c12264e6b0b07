// HF checkpoint directories: our writer's output loads back bit-exactly; sharded checkpoints with an
// index load; tied models carry no lm_head; stored dtypes convert; mismatches are clear errors.
#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <vector>

using namespace cw;
namespace fs = std::filesystem;

namespace {
bool same_bytes(const ParamSet& a, const ParamSet& b) {
  return a.numel() == b.numel() && std::memcmp(a.flat().data, b.flat().data, a.flat().bytes()) == 0;
}
}  // namespace

TEST_CASE("checkpoint round trip is bit-exact (f32 and f64, tied and untied)") {
  test::TempDir dir("ckpt");
  for (bool tied : {false, true}) {
    for (DType dt : {DType::f32, DType::f64}) {
      LlamaConfig cfg = LlamaConfig::preset("tiny");
      cfg.tie_word_embeddings = tied;
      ParamSet p(cfg, dt), q(cfg, dt);
      init_parameters(p, 3, 0.2, 0.1);
      const std::string d = dir.file(fmt::format("m-{}-{}", tied, dtype_name(dt)));
      save_checkpoint_weights(p, cfg, d, dt);
      CHECK(LlamaConfig::from_file(d + "/config.json").to_json() ==
            [&] { LlamaConfig c = cfg; c.torch_dtype = dt == DType::f32 ? "float32" : "float64"; return c.to_json(); }());
      SafetensorsReader r(d + "/model.safetensors");
      CHECK((r.find("lm_head.weight") != nullptr) == !tied);
      load_checkpoint_weights(q, d);
      CHECK(same_bytes(p, q));
    }
  }
}

TEST_CASE("checkpoint: bf16 storage converts on load; sharded index; errors") {
  test::TempDir dir("ckpt2");
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  ParamSet p(cfg, DType::f32), q(cfg, DType::f32);
  init_parameters(p, 4, 0.2, 0.1);
  save_checkpoint_weights(p, cfg, dir.file("bf16"), DType::bf16);
  load_checkpoint_weights(q, dir.file("bf16"));
  // bf16 keeps 8 significant bits: every weight within 2^-8 relative.
  for (int64_t i = 0; i < p.numel(); ++i) {
    const float a = p.flat().ptr<float>()[i], b = q.flat().ptr<float>()[i];
    CHECK(std::abs(a - b) <= std::abs(a) * 0x1.0p-8f);
  }
  // Two shards and an index, as HF writes large models.
  const std::string sd = dir.file("sharded");
  fs::create_directories(sd);
  std::vector<std::pair<std::string, Tensor>> first, second;
  nlohmann::json map;
  for (size_t i = 0; i < p.size(); ++i) {
    const bool in_first = i < p.size() / 2;
    (in_first ? first : second).emplace_back(p.specs()[i].name, p[i]);
    map[p.specs()[i].name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_safetensors(sd + "/model-00001-of-00002.safetensors", first);
  write_safetensors(sd + "/model-00002-of-00002.safetensors", second);
  std::ofstream(sd + "/model.safetensors.index.json") << nlohmann::json{{"metadata", {}}, {"weight_map", map}}.dump();
  std::ofstream(sd + "/config.json") << cfg.to_json().dump();
  ParamSet s(cfg, DType::f32);
  load_checkpoint_weights(s, sd);
  CHECK(same_bytes(p, s));
  // A tensor missing from the index, and a shard that is not there.
  map.erase("model.norm.weight");
  std::ofstream(sd + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  CHECK_THROWS_WITH_AS(load_checkpoint_weights(s, sd), doctest::Contains("model.norm.weight"), Error);
  fs::remove(sd + "/model-00002-of-00002.safetensors");
  CHECK_THROWS_AS(load_checkpoint_weights(s, sd), Error);
  // A checkpoint of another shape.
  LlamaConfig other = cfg;
  other.hidden_size = 12;
  other.head_dim = 3 * 2;
  other.num_attention_heads = 2;
  other.num_key_value_heads = 1;
  ParamSet o(other, DType::f32);
  CHECK_THROWS_WITH_AS(load_checkpoint_weights(o, dir.file("bf16")), doctest::Contains("shape"), Error);
  CHECK_THROWS_AS(load_checkpoint_weights(o, dir.file("nothing-here")), Error);
}

// One row per malformation of a valid checkpoint directory (config.json, the index, the weights),
// and a fragment of the one line that must refuse it when `chunkwise` loads the directory: the config
// resolved, the parameters allocated from it, the weights read.
TEST_CASE("checkpoint: malformed directories are refused before allocating, naming the file, as a table") {
  test::TempDir dir("ckpt-table");
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  ParamSet p(cfg, DType::f32);
  init_parameters(p, 3, 0.2);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // The directory as save_checkpoint_weights writes it, with `weights` and config.json's JSON edited.
  const auto write = [&](const std::string& d, const ParamSet& weights, const std::function<void(nlohmann::json&)>& edit) {
    save_checkpoint_weights(weights, cfg, d, DType::f32);
    nlohmann::json j = nlohmann::json::parse(test::read_text(d + "/config.json"));
    edit(j);
    std::ofstream(d + "/config.json") << j.dump();
  };
  const auto poked = [&](const std::string& name, int64_t index, float value) {
    ParamSet q = ParamSet::like(p, DType::f32);
    copy_params(q, p);
    q.get(name).ptr<float>()[index] = value;
    return q;
  };
  const auto none = [](nlohmann::json&) {};
  struct Row {
    const char* what;
    std::function<void(const std::string&)> make;
    const char* fragment;
  };
  const std::vector<Row> table = {
      {"vocab 10^12", [&](const std::string& d) { write(d, p, [](auto& j) { j["vocab_size"] = int64_t{1000000000000}; }); },
       "'vocab_size' is 1000000000000, above the limit 2147483647"},
      {"vocab 10^9, more than the file holds",
       [&](const std::string& d) { write(d, p, [](auto& j) { j["vocab_size"] = 1000000000; }); },
       "tensor 'model.embed_tokens.weight' has shape [61, 24], but config.json gives [1000000000, 24]"},
      {"FFN 2^19, more than the file holds",
       [&](const std::string& d) { write(d, p, [](auto& j) { j["intermediate_size"] = 1 << 19; }); },
       "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [40, 24], but config.json gives [524288, 24]"},
      {"a layer more than the file holds",
       [&](const std::string& d) { write(d, p, [](auto& j) { j["num_hidden_layers"] = 3; }); },
       "has no tensor 'model.layers.2.input_layernorm.weight'"},
      {"theta a string", [&](const std::string& d) { write(d, p, [](auto& j) { j["rope_theta"] = "fast"; }); },
       "config.json: \"rope_theta\" must be a number, found a string \"fast\""},
      {"a NaN weight", [&](const std::string& d) { write(d, poked("model.layers.1.self_attn.k_proj.weight", 5, nan), none); },
       "model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight' holds nan at element 5"},
      {"an infinite weight", [&](const std::string& d) { write(d, poked("model.embed_tokens.weight", 100, inf), none); },
       "tensor 'model.embed_tokens.weight' holds inf at element 100"},
      {"an index mapping to a number", [&](const std::string& d) {
         write(d, p, none);
         std::ofstream(d + "/model.safetensors.index.json") << R"({"weight_map": {"model.norm.weight": 5}})";
       }, "model.safetensors.index.json: \"weight_map.model.norm.weight\" must be a string, found the integer 5"},
      {"an index without a map", [&](const std::string& d) {
         write(d, p, none);
         std::ofstream(d + "/model.safetensors.index.json") << R"({"weight_map": [1]})";
       }, "model.safetensors.index.json: \"weight_map\" must be an object, found an array of 1"},
      {"an index that is not JSON", [&](const std::string& d) {
         write(d, p, none);
         std::ofstream(d + "/model.safetensors.index.json") << R"({"weight_map": {"a": 1e400}})";
       }, "model.safetensors.index.json: not valid JSON"},
  };
  int n = 0;
  for (const Row& row : table) {
    CAPTURE(row.what);
    const std::string d = dir.file(fmt::format("bad{}", n++));
    row.make(d);
    const std::string message = test::message_of([&] {
      ParamSet loaded(LlamaConfig::resolve(d), DType::f32);
      load_checkpoint_weights(loaded, d);
    });
    INFO("message: ", message);
    CHECK(test::contains(message, d));
    CHECK(test::contains(message, row.fragment));
    CHECK(!test::contains(message, "unexpected error"));
    CHECK(!test::contains(message, "json.exception"));
  }
}
