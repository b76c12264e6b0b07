// The Gemma 2 family (model/config.h: Llama's block with sqrt(C) embeddings, (1 + w) norms, a norm on
// each sub-block's output, a gelu gate, query_pre_attn_scalar, capped attention scores and logits, and
// sliding and global layers) where it meets files and devices:
//   - transformers' own config.json and checkpoints (tests/data/gemma2_reference, made by
//     tests/data/gemma2_reference.py with eager attention): the logits, the loss and every parameter's
//     gradient equal transformers' in f64 under full backprop, checkpointing, seco and spaco with
//     chunks shorter than, as long as and longer than the window; the same weights without the caps
//     or without the window are far off;
//   - config.json read (transformers' defaults for absent keys, layer_types or its rule), written and
//     read back, with transformers' own values for every key it writes; what is refused, naming the key;
//     the presets' parameter counts are transformers';
//   - a checkpoint chunkwise writes carries transformers' names for the four norms and reads back;
//   - the K/V store: only the sliding layers read a window, the global ones every earlier key;
//   - a GPU refuses a model with attn_logit_softcapping before any work, in one line naming it (the
//     model's construction on a GPU: tests/model/test_cuda_model.cpp).
// The schedules against full backprop: tests/optim/test_schedules.cpp; against the reference step:
// tests/model/test_reference.cpp; the ops: the op table's geglu, rmsnorm offset, embedding scale,
// attention softcap and lm_head softcap rows (tests/engine/test_backend_ops.cpp).
#include "engine/random.h"
#include "model/gguf_llama.h"
#include "model/kv_store.h"
#include "model/safetensors.h"
#include "optim/schedule.h"
#include "tests/model/gguf_builder.h"
#include "tests/model/hf_reference.h"
#include "tests/support.h"
#include "tools/plan.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

using namespace cw;

namespace {

namespace fs = std::filesystem;

fs::path reference_dir(const char* name) { return test::hf_reference_dir("gemma2_reference", name); }

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(test::read_text(path)); }

ScheduleOptions seco(int64_t chunk, int64_t bwd_chunk = 0) {
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = chunk;
  o.bwd_chunk = bwd_chunk;
  return o;
}

// A copy of reference case `name` in `tmp` whose config.json has `patch` merged in (the same weights,
// another model), and the logits' distance from transformers'.
double logits_err_with(const test::TempDir& tmp, const char* name, const nlohmann::json& patch, const std::string& as) {
  const fs::path dir = tmp.file(as);
  fs::copy(reference_dir(name), dir);
  nlohmann::json j = read_json(dir / "config.json");
  j.merge_patch(patch);
  fs::permissions(dir / "config.json", fs::perms::owner_write, fs::perm_options::add);
  std::ofstream(dir / "config.json") << j.dump(2);
  const SafetensorsReader expected((reference_dir(name) / "expected.safetensors").string());
  return test::logits_against_transformers(dir.string(), expected, 4).rel;
}

const char* const kCases[] = {"caps_window", "layer_types", "no_caps"};

}  // namespace

TEST_CASE("gemma2: transformers' config.json reads as the model it describes, and round-trips") {
  const LlamaConfig a = LlamaConfig::from_file((reference_dir("caps_window") / "config.json").string());
  CHECK(a.family == ModelFamily::gemma2);
  CHECK(a.mlp_gate == MlpGate::gelu_tanh);
  CHECK((a.post_norms && a.scale_embeddings && a.norm_weight_offset == 1.0));
  CHECK(a.head_dim == 8);  // its own key, apart from hidden / heads = 6
  CHECK(a.query_pre_attn_scalar == 6);
  CHECK(a.attention_scale() == 1.0 / std::sqrt(6.0));
  CHECK(a.attn_logit_softcapping == 5.0);
  CHECK(a.final_logit_softcapping == 3.0);
  CHECK(a.sliding_window == 5);
  CHECK(a.sliding_layers == std::vector<bool>{true, false});  // transformers' rule: the even layers slide
  CHECK(a.layer_window(0) == 5);
  CHECK(a.layer_window(1) == 0);
  CHECK(a.first_visible_key(0, 12) == 8);
  CHECK(a.first_visible_key(1, 12) == 0);
  CHECK(a.tie_word_embeddings);  // Gemma2Config's default
  CHECK(!a.attention_bias);
  const LlamaConfig b = LlamaConfig::from_file((reference_dir("layer_types") / "config.json").string());
  CHECK(b.sliding_layers == std::vector<bool>{false, true, true});
  CHECK((b.attention_bias && b.o_bias));
  CHECK(!b.tie_word_embeddings);
  const LlamaConfig c = LlamaConfig::from_file((reference_dir("no_caps") / "config.json").string());
  CHECK(c.attn_logit_softcapping == 0.0);
  CHECK(c.final_logit_softcapping == 0.0);
  for (const char* name : kCases) {
    CAPTURE(std::string(name));
    const LlamaConfig cf = LlamaConfig::from_file((reference_dir(name) / "config.json").string());
    const nlohmann::json j = cf.to_json();
    CHECK(j["model_type"] == "gemma2");
    CHECK(j["architectures"][0] == "Gemma2ForCausalLM");
    CHECK(!j.contains("hidden_act"));  // Gemma2MLP reads hidden_activation
    CHECK(LlamaConfig::from_json(j, "round trip").to_json() == j);
    // Every key we write is transformers' with transformers' value: what it reads back is this model
    // (torch_dtype is the stored dtype, named dtype by transformers 5).
    const nlohmann::json hf = read_json(reference_dir(name) / "config.json");
    for (const auto& [key, value] : j.items()) {
      CAPTURE(key);
      if (key == "torch_dtype") continue;
      if (key == "rope_theta") {  // transformers 5 writes it inside rope_parameters
        CHECK(value == hf["rope_parameters"]["rope_theta"]);
        continue;
      }
      if (key == "rope_scaling") {
        CHECK(value.is_null());
        CHECK(hf["rope_parameters"]["rope_type"] == "default");
        continue;
      }
      REQUIRE(hf.contains(key));
      CHECK(value == hf[key]);
    }
    // The table has transformers' tensors: what save_pretrained wrote, each with its shape.
    const LlamaConfig resolved = LlamaConfig::resolve(reference_dir(name).string());
    const SafetensorsReader r((reference_dir(name) / "model.safetensors").string());
    CHECK(parameter_table(resolved).size() == r.entries().size());
    for (const ParamSpec& s : parameter_table(resolved)) {
      CAPTURE(s.name);
      const SafetensorsEntry* e = r.find(s.name);
      REQUIRE(e != nullptr);
      CHECK(e->shape == s.shape);
    }
    CHECK(resolved.parameter_count() == ParamSet(resolved, DType::f32).numel());
  }
  // Absent keys take Gemma2Config's defaults (the 2B's); without layer_types, the even layers slide.
  nlohmann::json j = read_json(reference_dir("caps_window") / "config.json");
  for (const char* key : {"head_dim", "num_key_value_heads", "query_pre_attn_scalar", "attn_logit_softcapping",
                          "final_logit_softcapping", "sliding_window", "layer_types", "tie_word_embeddings",
                          "hidden_activation", "max_position_embeddings"})
    j.erase(key);
  j["num_hidden_layers"] = 5;
  const LlamaConfig d = LlamaConfig::from_json(j, "config.json");
  CHECK(d.head_dim == 256);
  CHECK(d.num_key_value_heads == 4);
  CHECK(d.query_pre_attn_scalar == 256);
  CHECK(d.attn_logit_softcapping == 50.0);
  CHECK(d.final_logit_softcapping == 30.0);
  CHECK(d.sliding_window == 4096);
  CHECK(d.sliding_layers == std::vector<bool>{true, false, true, false, true});
  CHECK(d.tie_word_embeddings);
  CHECK(d.max_position_embeddings == 8192);
  CHECK(d.mlp_gate == MlpGate::gelu_tanh);
  // Without model_type, the architecture names the family; a transformers 4 config's hidden_act
  // beside hidden_activation is not Gemma2MLP's and is not read.
  j = read_json(reference_dir("caps_window") / "config.json");
  j.erase("model_type");
  j["hidden_act"] = "gelu";
  CHECK(LlamaConfig::from_json(j, "config.json").family == ModelFamily::gemma2);
}

TEST_CASE("gemma2: logits, loss and every gradient equal transformers' in f64 (tests/data/gemma2_reference)") {
  // Windows of 5, 3 and 9 on 24 tokens (global layers beside them): seco's chunks shorter than, as long
  // as and longer than the window, forward and reverse chunks apart; checkpointing (its recompute runs
  // W_down's product for the post-norm), spaco visiting every chunk, saved attention outputs.
  std::vector<ScheduleOptions> schedules{ScheduleOptions{}, seco(3), seco(5, 7), seco(7, 5), seco(9, 4), seco(24)};
  schedules.emplace_back().kind = ScheduleKind::checkpointed;
  ScheduleOptions spaco = seco(5, 4);
  spaco.kind = ScheduleKind::spaco;
  schedules.push_back(spaco);
  ScheduleOptions saved = seco(6);
  saved.save_attention = true;
  schedules.push_back(saved);
  double worst = 0;
  for (const char* name : kCases) {
    CAPTURE(std::string(name));
    worst = std::max(worst, test::compare_with_transformers(reference_dir(name).string(), schedules, 4));
  }
  MESSAGE("gemma2 (caps 5 and 3 or none; windows 5, 3 and 9 beside global layers) against transformers (f64): "
          "max_rel_err=", worst);
}

TEST_CASE("gemma2: the same weights without the caps or the window are far from transformers") {
  // The comparison sees each part: the caps (null) and the window (every layer global) move the
  // logits far beyond the tolerance. (Gemma's (1 + w) shows in the comparison itself: the reference's
  // norm weights are drawn near 1, so the scales are near 2, not near 1.)
  test::TempDir tmp("gemma2-parts");
  const double no_caps = logits_err_with(tmp, "caps_window",
                                         {{"attn_logit_softcapping", nullptr}, {"final_logit_softcapping", nullptr}},
                                         "no-caps");
  const double no_attn_cap = logits_err_with(tmp, "caps_window", {{"attn_logit_softcapping", nullptr}}, "no-attn-cap");
  const double global = logits_err_with(tmp, "layer_types",
                                        {{"layer_types", {"full_attention", "full_attention", "full_attention"}}},
                                        "global");
  MESSAGE("against transformers: without the caps ", no_caps, ", without the attention cap ", no_attn_cap,
          ", every layer global ", global, " (logits' relative error)");
  CHECK(no_caps > 1e-2);
  CHECK(no_attn_cap > 1e-3);
  CHECK(global > 1e-2);
}

TEST_CASE("gemma2: what is refused, naming the key") {
  test::check_config_refusals(LlamaConfig::preset("tiny-gemma2").to_json(), {
      {"another activation", {{"hidden_activation", "gelu"}}, "\"hidden_activation\" is 'gelu'"},
      {"an activation that is no string", {{"hidden_activation", 3}}, "\"hidden_activation\""},
      {"bidirectional attention", {{"use_bidirectional_attention", true}}, "\"use_bidirectional_attention\" is true"},
      {"a zero attention cap", {{"attn_logit_softcapping", 0.0}}, "\"attn_logit_softcapping\" is 0"},
      {"a negative final cap", {{"final_logit_softcapping", -30.0}}, "\"final_logit_softcapping\" is -30"},
      {"a cap that is no number", {{"attn_logit_softcapping", "50"}}, "\"attn_logit_softcapping\""},
      {"a zero query_pre_attn_scalar", {{"query_pre_attn_scalar", 0}}, "\"query_pre_attn_scalar\" is 0"},
      {"an empty window", {{"sliding_window", 0}}, "\"sliding_window\" is 0"},
      {"layer_types of another length", {{"layer_types", {"sliding_attention"}}}, "has 1 entries for 2 layers"},
      {"an unknown layer type", {{"layer_types", {"sliding_attention", "chunked_attention"}}},
       "\"layer_types\" [1] is 'chunked_attention'"},
      {"a layer type that is no string", {{"layer_types", {"sliding_attention", 1}}}, "\"layer_types[1]\""},
      {"layer_types that are no list", {{"layer_types", "sliding_attention"}}, "\"layer_types\""},
      {"another class", {{"architectures", {"LlamaForCausalLM"}}}, "does not include Gemma2ForCausalLM"},
      {"MLP biases", {{"mlp_bias", true}}, "\"mlp_bias\""},
  });
  // A null window (merge_patch would drop the key): transformers' Gemma 2 refuses it too.
  nlohmann::json null_window = LlamaConfig::preset("tiny-gemma2").to_json();
  null_window["sliding_window"] = nullptr;
  const std::string message = test::error_of([&] { LlamaConfig::from_json(null_window, "model/config.json"); });
  CHECK(test::contains(message, "model/config.json: \"sliding_window\" is null"));
  CHECK(!test::contains(message, "\n"));
  // Gemma 2's parts belong to it alone (a config.json could not say them otherwise), and all of them.
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.post_norms = true;
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "belong to gemma2, not llama"));
  c = LlamaConfig::preset("tiny");
  c.attn_logit_softcapping = 50;
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "belong to gemma2, not llama"));
  c = LlamaConfig::preset("tiny-gemma2");
  c.mlp_gate = MlpGate::silu;
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "all of them"));
  c = LlamaConfig::preset("tiny-gemma2");
  c.sliding_layers.pop_back();
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "'layer_types' has 1 entries for 2 layers"));
  c = LlamaConfig::preset("tiny-gemma2");
  c.final_logit_softcapping = std::numeric_limits<double>::infinity();
  CHECK(test::contains(test::error_of([&] { c.validate("preset"); }), "'final_logit_softcapping' must be positive"));
}

TEST_CASE("gemma2: the presets have the released models' shapes (transformers' parameter counts)") {
  // AutoModelForCausalLM.from_config on the meta device: Gemma2Config's defaults (the 2B), and the
  // 9B's config.json shapes (hidden 3584, FFN 14336, 42 layers, 16 heads, 8 K/V heads).
  const LlamaConfig b2 = LlamaConfig::preset("gemma2-2b"), b9 = LlamaConfig::preset("gemma2-9b");
  CHECK(b2.parameter_count() == 2614341888);
  CHECK(b9.parameter_count() == 9241705984);
  for (const LlamaConfig* c : {&b2, &b9}) {
    CHECK(c->family == ModelFamily::gemma2);
    CHECK(c->head_dim == 256);
    CHECK(c->attention_scale() == 1.0 / 16.0);
    CHECK(c->sliding_window == 4096);
    CHECK(c->layer_window(0) == 4096);
    CHECK(c->layer_window(1) == 0);
    CHECK(c->attn_logit_softcapping == 50.0);
    CHECK(c->final_logit_softcapping == 30.0);
    CHECK(c->tie_word_embeddings);
    CHECK(LlamaConfig::from_json(c->to_json(), "round trip").to_json() == c->to_json());
  }
  // The embeddings' normaliser in each dtype, rounded as transformers rounds it.
  CHECK(embedding_scale(b9, DType::f64) == std::sqrt(3584.0));
  CHECK(embedding_scale(b9, DType::f32) == static_cast<double>(static_cast<float>(std::sqrt(3584.0))));
  CHECK(embedding_scale(b9, DType::bf16) == 59.75);  // 59.866 in bf16's 8 bits
  CHECK(embedding_scale(b2, DType::bf16) == 48.0);
  CHECK(embedding_scale(LlamaConfig::preset("tiny"), DType::bf16) == 1.0);
  const LlamaConfig tiny = LlamaConfig::preset("tiny-gemma2");
  CHECK(tiny.sliding_layers == std::vector<bool>{true, false});
  CHECK(tiny.query_pre_attn_scalar != static_cast<double>(tiny.head_dim));
}

TEST_CASE("gemma2: a checkpoint chunkwise writes carries transformers' names and config, and reads back the same") {
  test::TempDir tmp("gemma2-checkpoint");
  const LlamaConfig c = LlamaConfig::preset("tiny-gemma2");
  ParamSet params(c, DType::f64);
  init_parameters(params, 5, c.initializer_range, 0.1);
  const std::string dir = tmp.file("gemma2");
  save_checkpoint_weights(params, c, dir, DType::f64);
  const SafetensorsReader r((fs::path(dir) / "model.safetensors").string());
  for (const char* norm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"})
    CHECK(r.find(fmt::format("model.layers.1.{}.weight", norm)) != nullptr);
  CHECK(r.find("lm_head.weight") == nullptr);  // tied
  const nlohmann::json j = read_json(fs::path(dir) / "config.json");
  CHECK(j["model_type"] == "gemma2");
  CHECK(j["hidden_activation"] == "gelu_pytorch_tanh");
  CHECK(j["layer_types"] == nlohmann::json{"sliding_attention", "full_attention"});
  LlamaConfig written = c;
  written.torch_dtype = "float64";
  CHECK(LlamaConfig::resolve(dir).to_json() == written.to_json());
  ParamSet loaded(LlamaConfig::resolve(dir), DType::f64);
  CHECK(load_checkpoint_weights(loaded, dir).empty());
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(params.specs()[i].name);
    CHECK(test::compare(loaded[i], params[i]).max_abs == 0.0);
  }
  // A norm at the identity is 0 in Gemma's (1 + w) (transformers initialises it so), 1 in Llama's.
  ParamSet fresh(c, DType::f64);
  init_parameters(fresh, 5, c.initializer_range);
  CHECK(fresh.get("model.layers.0.post_feedforward_layernorm.weight").ptr<double>()[0] == 0.0);
  CHECK(fresh.get("model.norm.weight").ptr<double>()[3] == 0.0);
}

TEST_CASE("gemma2: a GGUF file of architecture gemma2, as llama.cpp's converter writes it, reads as the model") {
  // The converter stores every norm weight as 1 + w in f32 (Gemma2Model.modify_tensors) and no
  // lm_head (tied); the loader subtracts the 1 in f64. Q/K rows unpermuted (NEOX rotation).
  test::TempDir tmp("gemma2-gguf");
  LlamaConfig c = test::as_gguf_reads(LlamaConfig::preset("tiny-gemma2"));
  c.query_pre_attn_scalar = double(c.head_dim);  // GGUF stores no scale: head_dim's (llama.cpp's rule)
  ParamSet original(c, DType::f32);
  init_parameters(original, 13, 0.5, 0.1);
  const std::string path = test::write_file(tmp, "gemma2.gguf", test::model_gguf_builder(original).bytes());
  const LlamaConfig loaded_config = LlamaConfig::resolve(path);
  CHECK(loaded_config.to_json() == c.to_json());
  ParamSet loaded(loaded_config, DType::f64);
  load_gguf_weights(loaded, GgufReader(path));
  int norms = 0;
  for (size_t i = 0; i < original.size(); ++i) {
    const ParamSpec& spec = original.specs()[i];
    CAPTURE(spec.name);
    const float* w = original[i].ptr<float>();
    const double* got = loaded[i].ptr<double>();
    bool same = true;
    for (int64_t e = 0; e < original[i].numel(); ++e) {
      // The converter's f32 1 + w, read back less 1 in f64; every other tensor bit for bit.
      const double expected = spec.is_norm() ? double(w[e] + 1.0f) - 1.0 : double(w[e]);
      same = same && got[e] == expected;
    }
    CHECK(same);
    norms += spec.is_norm() ? 1 : 0;
  }
  CHECK(norms == 4 * c.num_hidden_layers + 1);  // input, post-attention, pre- and post-feedforward; final

  // Without the optional keys, llama.cpp's defaults: a window of 4096, caps 50 and 30.
  const std::string bare = test::write_file(
      tmp, "bare.gguf",
      test::model_gguf_builder(original, {"gemma2.attention.sliding_window", "gemma2.attn_logit_softcapping",
                                          "gemma2.final_logit_softcapping"})
          .bytes());
  const LlamaConfig defaults = LlamaConfig::resolve(bare);
  CHECK(defaults.sliding_window == 4096);
  CHECK(defaults.attn_logit_softcapping == 50.0);
  CHECK(defaults.final_logit_softcapping == 30.0);
  CHECK(defaults.sliding_layers == std::vector<bool>{true, false});

  // 46 layers (the 27B's count): the scale is C / H's, as llama.cpp reads it, not head_dim's.
  LlamaConfig deep = c;
  deep.num_hidden_layers = 46;
  deep.sliding_layers.clear();
  for (int64_t l = 0; l < 46; ++l) deep.sliding_layers.push_back(l % 2 == 0);
  const std::string deep_path =
      test::write_file(tmp, "deep.gguf", test::model_gguf_builder(ParamSet(deep, DType::f32)).bytes());
  CHECK(LlamaConfig::resolve(deep_path).query_pre_attn_scalar == double(c.hidden_size / c.num_attention_heads));

  // A Gemma 2 file is not read as another architecture's tensors: a window in a qwen2 file is refused.
  LlamaConfig qwen = test::as_gguf_reads(LlamaConfig::preset("tiny-qwen2"));
  ParamSet qwen_params(qwen, DType::f32);
  test::GgufBuilder windowed = test::model_gguf_builder(qwen_params);
  windowed.u32("qwen2.attention.sliding_window", 5);
  const std::string message =
      test::error_of([&] { LlamaConfig::resolve(test::write_file(tmp, "qwen2-window.gguf", windowed.bytes())); });
  CHECK(test::contains(message, "qwen2.attention.sliding_window in a qwen2 model"));
}

TEST_CASE("gemma2: the K/V store reads a window in the sliding layers only; the global layers read every key") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny-gemma2");  // layer 0: W = 5; layer 1: global
  const int64_t B = 2, T = 20, H = cfg.num_attention_heads, D = cfg.head_dim, t0 = 12, t1 = 16, c = t1 - t0;
  KVStore kv(cfg, B, T, DType::f64, {.with_grads = true});
  CHECK(kv.first_key(0, t0) == 8);
  CHECK(kv.first_key(1, t0) == 0);
  Arena scratch;
  for (const int layer : {0, 1}) {
    CAPTURE(layer);
    fill_normal(kv.keys(layer, 0, T), 1, 1);
    fill_normal(kv.values(layer, 0, T), 1, 2);
    fill(kv.d_keys(layer, 0, T), 7.0);
    fill(kv.d_values(layer, 0, T), 7.0);
    OwnedTensor q(DType::f64, {B, c, H, D}), out(DType::f64, {B, c, H, D}), lse(DType::f64, {B, H, c});
    OwnedTensor d_q(DType::f64, {B, c, H, D}), d_out(DType::f64, {B, c, H, D});
    fill_normal(q, 1, 3);
    fill_normal(d_out, 1, 4);
    kv.attend_forward(layer, t0, t1, out, {lse}, q, cfg.attention_scale(), scratch);
    kv.attend_backward(layer, t0, t1, d_q, d_out, {lse}, q, out, cfg.attention_scale(), scratch);
    OwnedTensor dk(DType::f64, {B, T, cfg.num_key_value_heads, D});
    copy_convert(dk, kv.d_keys(layer, 0, T));
    for (int64_t t = 0; t < t1; ++t) {
      CAPTURE(t);
      const double x = dk.tensor.ptr<double>()[t * cfg.kv_dim()];
      if (t < kv.first_key(layer, t0)) CHECK(x == 7.0);  // untouched
      else CHECK((std::isfinite(x) && x != 7.0));
    }
  }
}

TEST_CASE("gemma2: the planner plans the GPU step with the capped attention on the SIMT kernels") {
  // A capped call runs on flash_simt (engine/ops/attention.cpp): the plan replays the flash scratch,
  // no cuDNN workspace, and times the attention at the SIMT kernels' rate, below cuDNN's.
  const LlamaConfig capped = LlamaConfig::preset("gemma2-2b");
  REQUIRE(capped.attn_logit_softcapping > 0);
  LlamaConfig uncapped = capped;
  uncapped.attn_logit_softcapping = 0.0;
  uncapped.head_dim = 128;  // a head dim cuDNN takes
  LlamaConfig uncapped_256 = uncapped;
  uncapped_256.head_dim = 256;
  const ScheduleOptions full;  // full backprop
  const PlanReport a = plan_step(capped, 1, 8192, full, DType::bf16, 80);
  const PlanReport b = plan_step(uncapped, 1, 8192, full, DType::bf16, 80);
  CHECK(a.attention_workspace_bytes == 0);
  CHECK(b.attention_workspace_bytes > 0);
  const auto attention_s = [](const PlanReport& p) {
    for (const auto& [what, s] : p.time)
      if (what == "attention") return s;
    return -1.0;
  };
  // The capped call's flops at D 256 are twice D 128's; its rate is the SIMT kernels'.
  CHECK(attention_s(a) > 4 * attention_s(b));
  CHECK(attention_s(plan_step(uncapped_256, 1, 8192, full, DType::bf16, 80)) == doctest::Approx(attention_s(a)));
}
