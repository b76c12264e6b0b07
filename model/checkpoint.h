// HF checkpoint directories: loading a model's weights, writing them back.
//
// A directory holds config.json and either model.safetensors or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor name: shard file}}). Every tensor of the
// parameter table must be present with the configured shape (tied models have no lm_head.weight; an
// lm_head.weight in a tied checkpoint is ignored); stored bf16/f16/f32/f64 is converted to the
// model's dtype; a weight holding NaN or infinity is refused (model/params.h). Tensors the table does not know are reported and skipped (e.g. rotary caches).
#pragma once

#include "model/params.h"

#include <string>
#include <vector>

namespace cw {

// True for a directory holding model.safetensors or model.safetensors.index.json (its weights).
bool is_checkpoint_dir(const std::string& path);

// Fails naming the file and tensor unless every tensor of config's parameter table is in the
// checkpoint with its shape. It reads the headers alone, so a config.json asking for more than the
// checkpoint holds is refused before the model is allocated (LlamaConfig::resolve calls it).
void check_checkpoint_shapes(const LlamaConfig& config, const std::string& dir);

// Loads every parameter of `params` from the checkpoint directory; returns the names it skipped.
std::vector<std::string> load_checkpoint_weights(ParamSet& params, const std::string& dir);

// Writes config.json and model.safetensors (HF names, the given dtype) into dir, atomically per file.
void save_checkpoint_weights(const ParamSet& params, const LlamaConfig& config, const std::string& dir, DType dtype);

}  // namespace cw
