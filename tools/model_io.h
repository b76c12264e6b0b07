// Small model utilities behind `chunkwise init` and `chunkwise logits`, and the token-batch reader
// that gradcheck shares: the pieces a user needs to compare chunkwise with another framework on the
// same checkpoint and the same tokens (tools/bench/hf_compare.py does exactly that). And the model
// that `sample` and `eval` run, from --model or from a run directory's checkpoint, with its tokenizer.
#pragma once

#include "model/tokenizer.h"
#include "optim/schedule.h"

#include <memory>
#include <string>
#include <vector>

namespace cw {

// B x T ids from a headerless little-endian uint32 file, as a causal-LM batch (labels = ids shifted
// left by one, the last position -100). Errors name the file: wrong size, id >= vocab.
Batch read_token_batch(const std::string& path, int64_t B, int64_t T, int64_t vocab);

// Loads a model from a preset / config.json (random init with `seed`, norms 1 + N(0, norm_jitter)),
// from an HF checkpoint directory (its weights) or from a GGUF file (its weights, dequantized).
void load_or_init(LlamaModel& model, const std::string& spec, uint64_t seed, double norm_jitter);

struct InitOptions {
  std::string model = "tiny";
  std::string out;
  std::string dtype = "f32";   // storage dtype of model.safetensors
  uint64_t seed = 1234;
  double norm_jitter = 0.0;
  int tie_embeddings = -1;     // -1: as configured
};
// Writes a randomly initialised HF checkpoint (config.json + model.safetensors).
void init_checkpoint(const InitOptions& options);

struct LogitsOptions {
  std::string model;           // preset, config.json, checkpoint directory or .gguf file
  std::string tokens;          // headerless u32 file of batch x seq ids
  int64_t batch = 1, seq = 0;
  std::string dtype = "f32";   // compute dtype on the CPU (f64 or f32)
  int64_t chunk = 0;           // > 0: run the sequence in chunks against the K/V store
  std::string out;             // safetensors with "logits" [batch * seq, V] (f32, or f64 in f64)
  uint64_t seed = 1234;        // random init when `model` is not a checkpoint
  std::string adapter;         // a PEFT LoRA adapter directory put on the base (its config from the directory)
};
void write_logits(const LogitsOptions& options);

// A host model of `spec` (load_or_init with `seed`, norms 1) with the PEFT adapter of `adapter_dir`
// (its adapter_config.json: rank, alpha, targets) loaded onto it, in `dtype`.
LlamaModel load_with_adapter(const LlamaConfig& config, const std::string& spec, const std::string& adapter_dir,
                             DType dtype, uint64_t seed);

struct MergeOptions {
  std::string model;           // the base: preset, config.json, checkpoint directory or .gguf file
  std::string adapter;         // the PEFT adapter directory
  std::string out;             // the merged HF checkpoint directory
  std::string dtype = "f32";   // stored dtype: f32 | bf16 | f64
  uint64_t seed = 1234;        // random init of a base that is not a checkpoint
};
// W + (alpha / r) B A for every adapted linear, in f64, written as a plain HF checkpoint
// (config.json + model.safetensors) that transformers loads without peft.
void merge_adapter_checkpoint(const MergeOptions& options);

// Where the model of `chunkwise sample` and `chunkwise eval` comes from: --model SPEC, or --run DIR
// [--step N] (a checkpoint of a training run; a LoRA run's adapters on the base it trained), and the
// tokenizer that goes with it.
struct ModelSource {
  std::string model;       // a preset or config.json (random init), an HF checkpoint directory or a .gguf file
  std::string run;         // or a run directory
  int64_t step = 0;        // --run: the checkpoint's step; 0: the latest complete one
  // "": the run's recorded tokenizer (--run), the model's own (--model); else a spec
  // (tools/data/tokenizer.h: "model", "bytes", a tokenizer.json, a directory, a .gguf file).
  std::string tokenizer;
  uint64_t seed = 1234;    // random init of a preset or config.json
  // --rope KEY=VALUE...: the model's RoPE scaling replaced, as a run's [rope] section replaces it
  // (tools/train/run_config.h; e.g. type=yarn factor=8 original_max_position_embeddings=8192): a
  // model extended without training, or dynamic NTK at inference. Empty: the model's own.
  std::vector<std::string> rope;
};

struct LoadedModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null unless asked for
  std::string tokenizer_spec;            // the spec it was loaded from
  std::string name;                      // what reports call the model: --model as given, or the checkpoint's directory
};

// What load_model needs of the source.
struct ModelNeeds {
  bool weights = true;     // a preset or config.json (no weights) fails naming `what`; false: random init
  bool tokenizer = true;   // load the tokenizer and check that it fits the model
};

// The model of `source` on `device` in `dtype` (weights read on the host, then copied and converted),
// with its tokenizer when asked. `what` says what the weights are for in the error a model without
// them gets ("--model 'small' has no weights to sample from").
LoadedModel load_model(const ModelSource& source, Device device, DType dtype, const ModelNeeds& needs,
                       const std::string& what);

// Where and in which dtype a command computes, from a setting named `name` (a flag, "--device", or a
// run-config key, "train.device": errors show the setting as the user wrote it). device: auto (a GPU
// when one is usable) | cpu | cuda. dtype: auto (bf16 on a GPU, f32 on the CPU) | f64 | f32 | bf16,
// bf16 only on a GPU and f64 only on the CPU.
Device resolve_device(const std::string& setting, const std::string& name);
DType resolve_compute_dtype(const std::string& setting, Device device, const std::string& name,
                            const std::string& device_name);

}  // namespace cw
