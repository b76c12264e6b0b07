// LoRA on the model (model/lora.h): the configuration and its errors, the adapters' table with PEFT's
// names and shapes, PEFT's initialisation, the PEFT files written and read back bit for bit, files
// that do not fit the base refused with one line naming the file, and merging equal to the adapters'
// forward. The gradients are checked in tests/optim/test_schedules.cpp (every schedule against full,
// 1e-12 in f64) and tests/tools/test_gradcheck.cpp (finite differences); the op itself in
// tests/engine/test_backend_ops.cpp.
#include "model/lora.h"

#include "model/checkpoint.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "optim/schedule.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

using namespace cw;
namespace fs = std::filesystem;

namespace {
LlamaConfig tiny() {
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.num_key_value_heads = 2;
  return c;
}

LoraConfig lora(int64_t rank, const std::string& targets, double alpha = 8.0) {
  LoraConfig l;
  l.rank = rank;
  l.targets = targets;
  l.alpha = alpha;
  l.seed = 3;
  return l;
}

// All-position logits of `batch` under the model, [B*T, V] f64 (its RoPE tables grown to T).
OwnedTensor logits_of(LlamaModel& model, const Batch& batch) {
  const int64_t B = batch.B(), T = batch.T(), V = model.config().vocab_size;
  model.ensure_positions(T);
  KVStore kv(model.config(), B, T, model.dtype());
  Arena arena;
  const ChunkTokens chunk = slice_chunk(batch, 0, T, arena);
  OwnedTensor out(DType::f64, {B * T, V});
  chunk_logits(out, kv, model, chunk, true, arena);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data, b.data, a.bytes()) == 0;
}
}  // namespace

TEST_CASE("lora: targets, defaults and the errors of a bad configuration") {
  CHECK(lora(4, "").target_names() == std::vector<std::string>{"q_proj", "v_proj"});  // PEFT's Llama default
  CHECK(lora(4, "v_proj, q_proj").target_names() == std::vector<std::string>{"q_proj", "v_proj"});
  CHECK(lora(4, "all-linear").target_names() ==
        std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});
  CHECK(lora(8, "q_proj", 16).scale() == 2.0);
  CHECK_THROWS_WITH_AS(lora(4, "q_proj,qkv_proj").validate(), doctest::Contains("lora.targets: unknown LoRA target 'qkv_proj'"),
                       Error);
  CHECK_THROWS_WITH_AS(lora(0, "q_proj").validate(), doctest::Contains("lora.rank is 0"), Error);
  CHECK_THROWS_WITH_AS(lora(-1, "").validate(), doctest::Contains("lora.rank must be >= 0"), Error);
  LoraConfig bad = lora(4, "q_proj");
  bad.dropout = 1.0;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("lora.dropout"), Error);
  bad = lora(4, "q_proj", 0.0);
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("lora.alpha"), Error);
  CHECK_NOTHROW(LoraConfig{}.validate());  // off
}

TEST_CASE("lora: the adapters' table has PEFT's names and shapes, layer by layer") {
  const LlamaConfig c = tiny();
  const std::vector<ParamSpec> t = lora_parameter_table(c, lora(4, "q_proj,v_proj,down_proj"));
  REQUIRE(t.size() == static_cast<size_t>(c.num_hidden_layers) * 6);
  CHECK(t[0].name == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  CHECK(t[0].shape == std::vector<int64_t>{4, c.hidden_size});
  CHECK(t[1].name == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
  CHECK(t[1].shape == std::vector<int64_t>{c.q_dim(), 4});
  CHECK(t[3].shape == std::vector<int64_t>{c.kv_dim(), 4});  // v_proj's B: [Hkv D, r]
  CHECK(t[4].name == "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight");
  CHECK(t[4].shape == std::vector<int64_t>{4, c.intermediate_size});
  CHECK(t[5].shape == std::vector<int64_t>{c.hidden_size, 4});
  CHECK(t[6].layer == 1);
  CHECK(t[6].role == ParamRole::lora_a);
  CHECK(t[6].adapts == ParamRole::wq);
}

TEST_CASE("lora: PEFT's initialisation: A kaiming-uniform in (-1/sqrt(in), 1/sqrt(in)), B zero; outputs unchanged") {
  const LlamaConfig c = tiny();
  LlamaModel plain(c, DType::f64);
  init_parameters(plain.params(), 5, 0.2, 0.1);
  LlamaModel adapted(c, DType::f64, Device::host(), nullptr, lora(4, "all-linear"));
  copy_params(adapted.params(), plain.params());
  const ParamSet& a = adapted.adapters();
  for (size_t i = 0; i < a.size(); ++i) {
    const ParamSpec& s = a.specs()[i];
    const double* p = a[i].ptr<double>();
    double lo = 0, hi = 0, sum_sq = 0;
    for (int64_t k = 0; k < a[i].numel(); ++k) lo = std::min(lo, p[k]), hi = std::max(hi, p[k]), sum_sq += p[k] * p[k];
    if (s.role == ParamRole::lora_b) {
      CHECK_MESSAGE(sum_sq == 0.0, s.name);
    } else {
      const double bound = 1.0 / std::sqrt(static_cast<double>(s.shape[1]));
      CHECK_MESSAGE(-bound <= lo, s.name);
      CHECK_MESSAGE(hi < bound, s.name);
      // U(-b, b) has variance b^2 / 3: the sample within 30% of it (hundreds of elements).
      CHECK_MESSAGE(std::abs(sum_sq / static_cast<double>(a[i].numel()) / (bound * bound / 3) - 1) < 0.3, s.name);
    }
  }
  // The same seed gives the same adapters; B = 0 leaves every logit as the base's, to the bit, where the
  // base projects Q, K, V as three GEMMs as the adapted model does (adapters turn the fused GEMM off:
  // model/layer.h; with it, the base's logits agree to rounding).
  LlamaModel again(c, DType::f64, Device::host(), nullptr, lora(4, "all-linear"));
  CHECK(same_bits(again.adapters().flat(), a.flat()));
  const Batch batch = random_batch(2, 9, c.vocab_size, 4);
  const SettingScope<bool> three_gemms(fused_qkv, set_fused_qkv, false);
  CHECK(same_bits(logits_of(adapted, batch), logits_of(plain, batch)));
}

TEST_CASE("lora: PEFT files written and read back bit for bit") {
  test::TempDir dir("lora-io");
  const LlamaConfig c = tiny();
  LlamaModel m(c, DType::f64, Device::host(), nullptr, lora(3, "q_proj,k_proj,gate_proj", 6.0));
  init_lora_parameters(m.adapters(), 9, 0.1);  // B random: a zero B would hide a lost tensor
  save_peft_adapter(m.adapters(), m.lora(), dir.path.string(), "some/base", DType::f64);

  const nlohmann::json cfg = nlohmann::json::parse(test::read_text(dir.path / "adapter_config.json"));
  CHECK(cfg["peft_type"] == "LORA");
  CHECK(cfg["task_type"] == "CAUSAL_LM");
  CHECK(cfg["r"] == 3);
  CHECK(cfg["lora_alpha"] == 6.0);
  CHECK(cfg["bias"] == "none");
  CHECK(cfg["base_model_name_or_path"] == "some/base");
  CHECK(cfg["target_modules"] == nlohmann::json({"q_proj", "k_proj", "gate_proj"}));
  CHECK(cfg["use_rslora"] == false);
  const SafetensorsReader file((dir.path / "adapter_model.safetensors").string());
  CHECK(file.entries().size() == m.adapters().size());
  CHECK(file.find("base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight") != nullptr);

  const LoraConfig read = read_peft_config(dir.path.string());
  CHECK(read.rank == 3);
  CHECK(read.alpha == 6.0);
  CHECK(read.target_names() == m.lora().target_names());
  CHECK(read_peft_base_model(dir.path.string()) == "some/base");
  LlamaModel back(c, DType::f64, Device::host(), nullptr, read);
  load_peft_adapter(back.adapters(), dir.path.string());
  CHECK(same_bits(back.adapters().flat(), m.adapters().flat()));
}

TEST_CASE("lora: adapter files that do not fit are refused in one line naming the file") {
  test::TempDir dir("lora-bad");
  const LlamaConfig c = tiny();
  LlamaModel m(c, DType::f64, Device::host(), nullptr, lora(2, "q_proj,v_proj"));
  const std::string d = dir.path.string();
  save_peft_adapter(m.adapters(), m.lora(), d, "", DType::f32);

  // Another base: the shapes differ (hidden 48 instead of 24).
  LlamaConfig wide = c;
  wide.hidden_size = 48;
  LlamaModel other(wide, DType::f64, Device::host(), nullptr, read_peft_config(d));
  CHECK_THROWS_WITH_AS(load_peft_adapter(other.adapters(), d),
                       doctest::Contains("adapter_model.safetensors: tensor "
                                         "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape "
                                         "[2, 24], the base model needs [2, 48]"),
                       Error);
  // Fewer targets than the file holds: an unexpected tensor; more: a missing one.
  LlamaModel fewer(c, DType::f64, Device::host(), nullptr, lora(2, "q_proj"));
  CHECK_THROWS_WITH_AS(load_peft_adapter(fewer.adapters(), d), doctest::Contains("is not an adapter of this model"), Error);
  LlamaModel more(c, DType::f64, Device::host(), nullptr, lora(2, "q_proj,v_proj,o_proj"));
  CHECK_THROWS_WITH_AS(load_peft_adapter(more.adapters(), d), doctest::Contains("no tensor 'base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight'"),
                       Error);

  // Configurations this LoRA does not implement, each named with its key.
  const auto config_with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(test::read_text(dir.path / "adapter_config.json"));
    j[key] = value;
    std::ofstream(dir.path / "adapter_config.json") << j.dump();
    return [&] { read_peft_config(d); };
  };
  const std::string saved = test::read_text(dir.path / "adapter_config.json");
  const auto restore = [&] { std::ofstream(dir.path / "adapter_config.json") << saved; };
  CHECK_THROWS_WITH_AS(config_with("target_modules", {"q_proj", "qkv"})(), doctest::Contains("unknown LoRA target 'qkv'"),
                       Error);
  restore();
  CHECK_THROWS_WITH_AS(config_with("peft_type", "IA3")(), doctest::Contains("adapter_config.json: \"peft_type\""), Error);
  restore();
  CHECK_THROWS_WITH_AS(config_with("use_rslora", true)(), doctest::Contains("adapter_config.json: \"use_rslora\" is true"), Error);
  restore();
  CHECK_THROWS_WITH_AS(config_with("bias", "all")(), doctest::Contains("adapter_config.json: \"bias\""), Error);
  restore();
  CHECK_THROWS_WITH_AS(config_with("r", 0)(), doctest::Contains("adapter_config.json: \"r\" must be a positive integer"), Error);
  restore();
  CHECK_THROWS_WITH_AS(config_with("rank_pattern", {{"q_proj", 4}})(), doctest::Contains("rank_pattern"), Error);
  restore();
  CHECK_NOTHROW(read_peft_config(d));
  CHECK_THROWS_WITH_AS(read_peft_config(dir.file("nowhere")), doctest::Contains("adapter_config.json: cannot open"), Error);
}

TEST_CASE("lora: the merged base (W + alpha/r B A) gives the adapted model's logits") {
  const LlamaConfig c = tiny();
  for (const char* targets : {"q_proj,v_proj", "all-linear"}) {
    CAPTURE(std::string(targets));
    LlamaModel adapted(c, DType::f64, Device::host(), nullptr, lora(4, targets, 12.0));
    init_parameters(adapted.params(), 7, 0.2, 0.1);
    init_lora_parameters(adapted.adapters(), 8, 0.3);
    LlamaModel merged(c, DType::f64);
    copy_params(merged.params(), adapted.params());
    merge_adapters(merged.params(), adapted.adapters(), adapted.lora());
    const Batch batch = random_batch(2, 11, c.vocab_size, 6);
    const OwnedTensor with = logits_of(adapted, batch), folded = logits_of(merged, batch);
    const test::Worst w = test::compare(folded, with);
    INFO(w.str());
    CHECK(w.rel <= test::kSameMathF64Tol);
    // The adapters matter: without them the logits differ far beyond rounding.
    LlamaModel base(c, DType::f64);
    copy_params(base.params(), adapted.params());
    CHECK(test::compare(logits_of(base, batch), with).rel > 1e-4);
  }
}
