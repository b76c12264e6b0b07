#include "model/checkpoint.h"

#include "model/safetensors.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

namespace cw {

namespace fs = std::filesystem;

std::vector<std::string> load_checkpoint_weights(ParamSet& params, const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  // Which file holds each tensor.
  std::map<std::string, std::string> where;
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream in(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail(fmt::format("{}: not valid JSON ({})", index.string(), e.what()), "re-download the checkpoint index");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(fmt::format("{}: no 'weight_map' object", index.string()), "an index maps tensor names to shard files");
    std::set<std::string> seen;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) fail(fmt::format("{}: weight_map['{}'] must be a file name", index.string(), it.key()));
      const std::string shard = (fs::path(dir) / it.value().get<std::string>()).string();
      where[it.key()] = shard;
      if (seen.insert(shard).second) files.push_back(shard);
    }
  } else if (fs::exists(single)) {
    files.push_back(single.string());
  } else {
    fail(fmt::format("checkpoint directory '{}' has neither model.safetensors nor model.safetensors.index.json", dir),
         "point at an HF checkpoint directory");
  }
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  for (const auto& f : files) {
    if (!fs::exists(f)) fail(fmt::format("checkpoint shard '{}' is missing", f), "the index names a file that is not there");
    readers[f] = std::make_unique<SafetensorsReader>(f);
    if (where.empty())
      for (const auto& e : readers[f]->entries()) where[e.name] = f;
  }
  std::set<std::string> used;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params.specs()[i].name;
    auto it = where.find(name);
    if (it == where.end())
      fail(fmt::format("checkpoint '{}' has no tensor '{}'", dir, name),
           "the checkpoint does not match config.json (layers, tie_word_embeddings?)");
    const SafetensorsReader& r = *readers.at(it->second);
    if (!r.find(name))
      fail(fmt::format("{}: the index says it holds '{}', but it does not", it->second, name), "re-download the shard");
    r.read_into(name, params[i]);  // checks the shape and converts the dtype
    used.insert(name);
  }
  std::vector<std::string> skipped;
  for (const auto& [name, file] : where)
    if (!used.count(name)) skipped.push_back(name);
  return skipped;
}

bool is_checkpoint_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && (fs::exists(fs::path(path) / "model.safetensors", ec) ||
                                        fs::exists(fs::path(path) / "model.safetensors.index.json", ec));
}

void save_checkpoint_weights(const ParamSet& params, const LlamaConfig& config, const std::string& dir, DType dtype) {
  fs::create_directories(dir);
  std::vector<OwnedTensor> converted;
  converted.reserve(params.size());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].dtype == dtype) {
      tensors.emplace_back(params.specs()[i].name, params[i]);
    } else {
      converted.push_back(OwnedTensor::of_shape(dtype, params.specs()[i].shape));
      copy_convert(converted.back(), params[i]);
      tensors.emplace_back(params.specs()[i].name, converted.back().tensor);
    }
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  LlamaConfig c = config;
  c.torch_dtype = dtype == DType::bf16 ? "bfloat16" : dtype == DType::f64 ? "float64" : "float32";
  const std::string path = (fs::path(dir) / "config.json").string();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << c.to_json().dump(2) << "\n";
    if (!out) fail(fmt::format("cannot write '{}'", tmp), "check disk space and permissions");
  }
  fs::rename(tmp, path);
}

}  // namespace cw
