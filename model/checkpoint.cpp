#include "model/checkpoint.h"

#include "model/json_fields.h"
#include "model/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>

namespace cw {

namespace fs = std::filesystem;

namespace {

// The tensor files of a checkpoint directory, their headers read (not their data), and which file
// holds each tensor.
struct CheckpointFiles {
  std::map<std::string, std::string> where;  // tensor name -> file
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
};

CheckpointFiles open_checkpoint(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  CheckpointFiles out;
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream in(index);
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const nlohmann::json document = json_parse(text, index.string(), "re-download the checkpoint index");
    const JsonObject weight_map = JsonObject(document, index.string(), "", "an index maps tensor names to shard files")
                                      .object("weight_map");
    std::set<std::string> seen;
    for (const auto& [name, file] : weight_map.value().items()) {
      const std::string shard = (fs::path(dir) / json_string(file, index.string(), weight_map.path_of(name),
                                                             "an index maps tensor names to shard files"))
                                    .string();
      out.where[name] = shard;
      if (seen.insert(shard).second) files.push_back(shard);
    }
  } else if (fs::exists(single)) {
    files.push_back(single.string());
  } else {
    fail(fmt::format("checkpoint directory '{}' has neither model.safetensors nor model.safetensors.index.json", dir),
         "point at an HF checkpoint directory");
  }
  for (const auto& f : files) {
    if (!fs::exists(f)) fail(fmt::format("checkpoint shard '{}' is missing", f), "the index names a file that is not there");
    out.readers[f] = std::make_unique<SafetensorsReader>(f);
    if (!fs::exists(index))
      for (const auto& e : out.readers[f]->entries()) out.where[e.name] = f;
  }
  return out;
}

// The reader of the file holding `name`; fails naming the directory (or the shard) when none does.
const SafetensorsReader& reader_of(const CheckpointFiles& files, const std::string& name, const std::string& dir) {
  const auto it = files.where.find(name);
  if (it == files.where.end())
    fail(fmt::format("checkpoint '{}' has no tensor '{}'", dir, name),
         "the checkpoint does not match config.json (layers, tie_word_embeddings?)");
  const SafetensorsReader& r = *files.readers.at(it->second);
  if (!r.find(name))
    fail(fmt::format("{}: the index says it holds '{}', but it does not", it->second, name), "re-download the shard");
  return r;
}

}  // namespace

void check_checkpoint_shapes(const LlamaConfig& config, const std::string& dir) {
  const CheckpointFiles files = open_checkpoint(dir);
  for (const ParamSpec& spec : parameter_table(config)) {
    const SafetensorsReader& r = reader_of(files, spec.name, dir);
    const SafetensorsEntry& e = *r.find(spec.name);
    if (e.shape != spec.shape)
      fail(fmt::format("{}: tensor '{}' has shape [{}], but config.json gives [{}]", r.path(), spec.name,
                       fmt::join(e.shape, ", "), fmt::join(spec.shape, ", ")),
           "the checkpoint does not match its config.json (vocab_size, hidden_size, intermediate_size, heads?)");
  }
}

std::vector<std::string> load_checkpoint_weights(ParamSet& params, const std::string& dir) {
  const CheckpointFiles files = open_checkpoint(dir);
  std::set<std::string> used;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params.specs()[i].name;
    const SafetensorsReader& r = reader_of(files, name, dir);
    r.read_into(name, params[i]);  // checks the shape and converts the dtype
    require_finite_weights(params[i], name, r.path());
    used.insert(name);
  }
  std::vector<std::string> skipped;
  for (const auto& [name, file] : files.where)
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
