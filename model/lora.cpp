#include "model/lora.h"

#include "engine/random.h"
#include "model/json_fields.h"
#include "model/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

namespace cw {

namespace fs = std::filesystem;

namespace {
// The block's linears in table order.
constexpr ParamRole kLinears[] = {ParamRole::wq,     ParamRole::wk,   ParamRole::wv,    ParamRole::wo,
                                  ParamRole::w_gate, ParamRole::w_up, ParamRole::w_down};

// PEFT's choice when a Llama LoraConfig names no target_modules.
constexpr const char* kDefaultTargets = "q_proj,v_proj";
constexpr const char* kTargetsHint =
    "targets are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (a comma list) or all-linear";

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

// "q_proj,v_proj" -> {wq, wv} in the block's order; "all-linear" -> all seven.
std::vector<ParamRole> parse_targets(const std::string& text, const std::string& where) {
  std::set<ParamRole> chosen;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    start = comma == std::string::npos ? text.size() + 1 : comma + 1;
    if (item == "all-linear") {
      chosen.insert(std::begin(kLinears), std::end(kLinears));
      continue;
    }
    bool known = false;
    for (const ParamRole r : kLinears)
      if (item == lora_target_name(r)) chosen.insert(r), known = true;
    if (!known) fail(fmt::format("{}: unknown LoRA target '{}' in '{}'", where, item, text), kTargetsHint);
  }
  std::vector<ParamRole> out;
  for (const ParamRole r : kLinears)
    if (chosen.count(r)) out.push_back(r);
  return out;
}

std::pair<int64_t, int64_t> linear_shape(const LlamaConfig& c, ParamRole linear) {  // [out, in]
  switch (linear) {
    case ParamRole::wq: return {c.q_dim(), c.hidden_size};
    case ParamRole::wk:
    case ParamRole::wv: return {c.kv_dim(), c.hidden_size};
    case ParamRole::wo: return {c.hidden_size, c.q_dim()};
    case ParamRole::w_gate:
    case ParamRole::w_up: return {c.intermediate_size, c.hidden_size};
    case ParamRole::w_down: return {c.hidden_size, c.intermediate_size};
    default: break;
  }
  fail("LoRA: not a block linear");
}

void write_text_replacing(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
    if (!out) fail(fmt::format("cannot write '{}'", tmp), "check disk space and permissions");
  }
  fs::rename(tmp, path);
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(fmt::format("{}: cannot open (no PEFT adapter here?)", path), "point at a directory holding adapter_config.json");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  nlohmann::json j = json_parse(text, path, "the adapter config is damaged");
  if (!j.is_object()) fail(fmt::format("{}: not a JSON object", path), "a PEFT adapter_config.json is an object");
  return j;
}
}  // namespace

const char* lora_target_name(ParamRole linear) {
  switch (linear) {
    case ParamRole::wq: return "q_proj";
    case ParamRole::wk: return "k_proj";
    case ParamRole::wv: return "v_proj";
    case ParamRole::wo: return "o_proj";
    case ParamRole::w_gate: return "gate_proj";
    case ParamRole::w_up: return "up_proj";
    case ParamRole::w_down: return "down_proj";
    default: break;
  }
  fail("lora_target_name: only the seven linears of a block take adapters");
}

std::string lora_module_path(ParamRole linear) {
  const bool attention = linear == ParamRole::wq || linear == ParamRole::wk || linear == ParamRole::wv ||
                         linear == ParamRole::wo;
  return std::string(attention ? "self_attn." : "mlp.") + lora_target_name(linear);
}

std::vector<ParamRole> LoraConfig::target_roles() const {
  return parse_targets(targets.empty() ? kDefaultTargets : targets, "lora.targets");
}

std::vector<std::string> LoraConfig::target_names() const {
  std::vector<std::string> names;
  for (const ParamRole r : target_roles()) names.push_back(lora_target_name(r));
  return names;
}

bool LoraConfig::freezes_mlp() const {
  if (!enabled()) return false;
  for (const ParamRole r : target_roles())
    if (r == ParamRole::w_gate || r == ParamRole::w_up || r == ParamRole::w_down) return false;
  return true;
}

void LoraConfig::validate() const {
  if (rank < 0) fail(fmt::format("lora.rank must be >= 0 (0: no adapters), got {}", rank));
  if (!(std::isfinite(alpha) && alpha > 0)) fail(fmt::format("lora.alpha must be > 0, got {}", alpha), "the scale is alpha / rank");
  if (!(dropout >= 0 && dropout < 1)) fail(fmt::format("lora.dropout must be in [0, 1), got {}", dropout));
  target_roles();  // names them in the error when one is unknown
  if (rank == 0 && !targets.empty())
    fail(fmt::format("lora.targets = \"{}\" but lora.rank is 0 (no adapters)", targets),
         "set lora.rank (--lora-rank) to train adapters, or leave lora.targets empty");
}

std::vector<ParamSpec> lora_parameter_table(const LlamaConfig& c, const LoraConfig& lora) {
  CW_CHECK(lora.rank > 0, "lora_parameter_table: rank {} (0 means no adapters)", lora.rank);
  const std::vector<ParamRole> targets = lora.target_roles();
  std::vector<ParamSpec> t;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    for (const ParamRole linear : targets) {
      const auto [out, in] = linear_shape(c, linear);
      const std::string p = fmt::format("base_model.model.model.layers.{}.{}.", l, lora_module_path(linear));
      t.push_back({p + "lora_A.weight", {lora.rank, in}, ParamRole::lora_a, l, linear});
      t.push_back({p + "lora_B.weight", {out, lora.rank}, ParamRole::lora_b, l, linear});
    }
  return t;
}

int64_t lora_parameter_count(const LlamaConfig& config, const LoraConfig& lora) {
  if (!lora.enabled()) return 0;
  int64_t n = 0;
  for (const ParamSpec& spec : lora_parameter_table(config, lora)) n += spec.numel();
  return n;
}

int64_t trained_parameter_count(const LlamaConfig& config, const LoraConfig& lora) {
  return lora.enabled() ? lora_parameter_count(config, lora) : config.parameter_count();
}

void init_lora_parameters(const ParamSet& adapters, uint64_t seed, double b_std) {
  ParamSet host = ParamSet::like(adapters, DType::f64, Device::host());
  for (size_t i = 0; i < host.size(); ++i) {
    const ParamSpec& s = host.specs()[i];
    CW_CHECK(s.is_adapter(), "init_lora_parameters: {} is not a LoRA adapter", s.name);
    if (s.role == ParamRole::lora_a) {
      // nn.Linear's default: kaiming_uniform_(a = sqrt(5)), bound = gain sqrt(3 / fan_in) with
      // gain = sqrt(2 / (1 + a^2)) = sqrt(1/3): U(-1/sqrt(in), 1/sqrt(in)).
      const double bound = 1.0 / std::sqrt(static_cast<double>(s.shape[1]));
      fill_uniform(host[i], seed, i, -bound, bound);
    } else if (b_std > 0) {
      fill_normal(host[i], seed, i, 0.0, b_std);
    }
  }
  copy_params(adapters, host);
}

uint64_t lora_dropout_seed(uint64_t lora_seed, uint64_t round, int layer, ParamRole linear) {
  const uint64_t step = mix64(mix64(lora_seed ^ 0x10a0d0c0ffee) ^ round);
  return mix64(step ^ mix64(static_cast<uint64_t>(layer) * 16 + static_cast<uint64_t>(linear)));
}

// ---- PEFT files ----

void save_peft_adapter(const ParamSet& adapters, const LoraConfig& lora, const std::string& dir,
                       const std::string& base_model, DType dtype) {
  fs::create_directories(dir);
  std::vector<OwnedTensor> converted;
  converted.reserve(adapters.size());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < adapters.size(); ++i) {
    converted.push_back(OwnedTensor::of_shape(dtype, adapters.specs()[i].shape));
    copy_convert(converted.back(), adapters[i]);  // from the device where the adapters live there
    tensors.emplace_back(adapters.specs()[i].name, converted.back().tensor);
  }
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  // The keys PEFT's LoraConfig reads; what is not written takes PEFT's default (fan_in_fan_out false, ...).
  const nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"target_modules", lora.target_names()},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
      {"use_rslora", false},
      {"use_dora", false},
  };
  write_text_replacing((fs::path(dir) / "adapter_config.json").string(), config.dump(2) + "\n");
}

LoraConfig read_peft_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  const nlohmann::json document = read_json_file(path);
  const std::string hint = "chunkwise reads PEFT LoRA adapters with bias none, plain alpha / r scaling and "
                           "the same rank and targets in every layer";
  const JsonObject j(document, path, "", hint);
  auto key_error = [&](const std::string& key, const std::string& what) -> void { j.fail_key(key, what); };
  if (const std::string type = j.string_or("peft_type", ""); type != "LORA")
    key_error("peft_type", fmt::format("is {}, not \"LORA\"", type.empty() ? "missing" : nlohmann::json(type).dump()));
  LoraConfig c;
  c.rank = j.integer("r");
  if (c.rank <= 0) key_error("r", fmt::format("must be a positive integer, got {}", c.rank));
  c.alpha = j.number("lora_alpha");
  c.dropout = j.number_or("lora_dropout", c.dropout);
  if (!j.has("target_modules"))
    key_error("target_modules", "is missing (PEFT's Llama default would be q_proj, v_proj: write it out)");
  const nlohmann::json& tm = *j.find("target_modules");
  if (tm.is_string()) {
    c.targets = tm.get<std::string>();
  } else if (tm.is_array()) {
    for (size_t i = 0; i < tm.size(); ++i) {
      // PEFT matches a module by its name's end: "self_attn.q_proj" names q_proj too.
      std::string name = json_string(tm[i], path, fmt::format("target_modules[{}]", i), hint);
      if (const auto dot = name.rfind('.'); dot != std::string::npos) name = name.substr(dot + 1);
      c.targets += (c.targets.empty() ? "" : ",") + name;
    }
  } else {
    key_error("target_modules", fmt::format("must be a list of module names, found {}", json_found(tm)));
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail(fmt::format("{}: {}", path, e.what()), hint);
  }
  if (const std::string bias = j.string_or("bias", "none"); bias != "none")
    key_error("bias", fmt::format("is {} (only \"none\" is implemented)", nlohmann::json(bias).dump()));
  for (const char* flag : {"use_rslora", "use_dora", "fan_in_fan_out"})
    if (j.boolean_or(flag, false)) key_error(flag, "is true (not implemented)");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"})
    if (const nlohmann::json* v = j.find(pattern); v && !v->empty())
      key_error(pattern, fmt::format("is {} (per-layer ranks are not implemented)", json_found(*v)));
  for (const char* list : {"modules_to_save", "layers_to_transform"})
    if (const nlohmann::json* v = j.find(list); v && !(v->is_array() && v->empty()))
      key_error(list, fmt::format("is {} (not implemented)", json_found(*v)));
  return c;
}

std::string read_peft_base_model(const std::string& dir) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  const nlohmann::json document = read_json_file(path);
  return JsonObject(document, path).string_or("base_model_name_or_path", "");
}

void load_peft_adapter(const ParamSet& adapters, const std::string& dir) {
  CW_CHECK(adapters.device().is_cpu(), "load_peft_adapter reads into a host set (then copy it to the device)");
  const std::string path = (fs::path(dir) / "adapter_model.safetensors").string();
  if (!fs::exists(path)) fail(fmt::format("{}: no such file", path), "a PEFT adapter directory holds adapter_model.safetensors");
  const SafetensorsReader reader(path);
  const std::string hint = "the adapter must come from LoRA on this base model, with its adapter_config.json's "
                           "rank and targets";
  std::set<std::string> expected;
  for (size_t i = 0; i < adapters.size(); ++i) {
    const ParamSpec& s = adapters.specs()[i];
    expected.insert(s.name);
    const SafetensorsEntry* e = reader.find(s.name);
    if (!e) fail(fmt::format("{}: no tensor '{}'", path, s.name), hint);
    if (e->shape != s.shape)
      fail(fmt::format("{}: tensor '{}' has shape [{}], the base model needs [{}]", path, s.name,
                       fmt::join(e->shape, ", "), fmt::join(s.shape, ", ")),
           hint);
  }
  for (const SafetensorsEntry& e : reader.entries())
    if (!expected.count(e.name))
      fail(fmt::format("{}: tensor '{}' is not an adapter of this model and configuration", path, e.name), hint);
  for (size_t i = 0; i < adapters.size(); ++i) {
    reader.read_into(adapters.specs()[i].name, adapters[i]);
    require_finite_weights(adapters[i], adapters.specs()[i].name, path);
  }
}

void merge_adapters(const ParamSet& base, const ParamSet& adapters, const LoraConfig& lora) {
  CW_CHECK(base.device().is_cpu() && adapters.device().is_cpu(), "merge_adapters works on host sets");
  const ModelWeights w = base.weights(), a = adapters.weights();
  CW_CHECK(a.layers.size() <= w.layers.size(), "merge_adapters: adapters for {} layers, the base has {}",
           a.layers.size(), w.layers.size());
  const double s = lora.scale();
  for (size_t l = 0; l < a.layers.size(); ++l)
    for (const ParamRole linear : kLinears) {
      const LoraPair& p = a.layers[l].lora.of(linear);
      if (!p.defined()) continue;
      const Tensor& W = linear == ParamRole::wq       ? w.layers[l].wq
                        : linear == ParamRole::wk     ? w.layers[l].wk
                        : linear == ParamRole::wv     ? w.layers[l].wv
                        : linear == ParamRole::wo     ? w.layers[l].wo
                        : linear == ParamRole::w_gate ? w.layers[l].w_gate
                        : linear == ParamRole::w_up   ? w.layers[l].w_up
                                                      : w.layers[l].w_down;
      const int64_t O = W.size(0), I = W.size(1), r = p.a.size(0);
      CW_CHECK(p.a.size(1) == I && p.b.size(0) == O, "merge_adapters: layer {} {}: A {} and B {} do not fit W {}", l,
               lora_target_name(linear), p.a.describe(), p.b.describe(), W.describe());
      OwnedTensor w64(DType::f64, {O, I}), a64(DType::f64, {r, I}), b64(DType::f64, {O, r});
      copy_convert(w64, W);
      copy_convert(a64, p.a);
      copy_convert(b64, p.b);
      double* wp = w64.tensor.ptr<double>();
      const double *ap = a64.tensor.ptr<double>(), *bp = b64.tensor.ptr<double>();
      for (int64_t o = 0; o < O; ++o)
        for (int64_t k = 0; k < r; ++k) {
          const double sb = s * bp[o * r + k];
          for (int64_t i = 0; i < I; ++i) wp[o * I + i] += sb * ap[k * I + i];
        }
      copy_convert(W, w64);
    }
}

}  // namespace cw
