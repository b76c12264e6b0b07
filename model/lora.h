// LoRA adapters (Hu et al. 2021) on a frozen Llama, in PEFT's conventions, and PEFT's files.
//
// Every targeted linear (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, in every
// layer) becomes
//   y = x Wᵀ + (alpha / r) · dropout(x) Aᵀ Bᵀ          A [r, in] (lora_A), B [out, r] (lora_B)
// (engine/ops/lora_linear.h). W, the norms, the embedding and the head stay frozen: a model with
// adapters trains only A and B (LlamaModel::trainable()), so gradients, master weights and AdamW
// moments exist for them alone (optim/training.h). Initialisation as PEFT's init_lora_weights=True:
// A from nn.Linear's default, kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in));
// B = 0, so a fresh adapter leaves the model's outputs unchanged. Dropout is applied to the adapter's
// input only, and only during training steps; its mask is deterministic (model/llama.h).
//
// Files (HF PEFT's format, which `peft.PeftModel.from_pretrained` loads onto the same base):
//   adapter_config.json        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r", "lora_alpha",
//                               "lora_dropout", "target_modules": [...], "bias": "none",
//                               "base_model_name_or_path", ...}
//   adapter_model.safetensors  base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight [r, in],
//                              ...lora_B.weight [out, r] (mlp.gate_proj etc. for the MLP), the names of
//                              lora_parameter_table.
// merge_adapters folds them into the base (W + (alpha / r) B A), which save_checkpoint_weights then
// writes as a plain HF checkpoint. Tested in tests/model/test_lora.cpp.
#pragma once

#include "model/params.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cw {

// The adapters of a run ([lora] of the run config; the option rows are optim/options.cpp's
// lora_option_table()).
struct LoraConfig {
  int64_t rank = 0;        // r; 0: no adapters (full-parameter training)
  double alpha = 16.0;     // the adapter's output is scaled by alpha / r
  double dropout = 0.0;    // on the adapter's input, training steps only; in [0, 1)
  std::string targets;     // "q_proj,v_proj", ..., or "all-linear"; empty: PEFT's Llama default q_proj,v_proj
  uint64_t seed = 0;       // the initialisation of A and the dropout masks

  bool enabled() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
  // The targeted linears as roles (wq, wk, ...), in the block's order; throws naming lora.targets
  // for an unknown name.
  std::vector<ParamRole> target_roles() const;
  // The targets as PEFT's module names, in the block's order ("q_proj", "v_proj").
  std::vector<std::string> target_names() const;
  // Adapters on none of the MLP's linears (gate, up, down), so with the base frozen the whole MLP is.
  bool freezes_mlp() const;
  // rank >= 0, alpha > 0 and finite, dropout in [0, 1), targets known, and no targets without a rank;
  // throws naming the key (lora.rank, ...).
  void validate() const;
  bool operator==(const LoraConfig&) const = default;
};

// PEFT's name of a block linear ("q_proj") and its module path in the layer ("self_attn.q_proj").
const char* lora_target_name(ParamRole linear);
std::string lora_module_path(ParamRole linear);

// The adapters' table for a model: layer by layer, each targeted linear's lora_A [r, in] then lora_B
// [out, r], named as PEFT saves them.
std::vector<ParamSpec> lora_parameter_table(const LlamaConfig& config, const LoraConfig& lora);
// The element count of that table (0 without adapters).
int64_t lora_parameter_count(const LlamaConfig& config, const LoraConfig& lora);
// What a run trains (master weights, gradients, moments): the adapters under LoRA, else every parameter.
int64_t trained_parameter_count(const LlamaConfig& config, const LoraConfig& lora);

// PEFT's initialisation (A kaiming-uniform from `seed`, each tensor its own stream; B zero), on any
// device (drawn on the host in f64, then copied). b_std > 0 draws B from N(0, b_std) instead: gradient
// checks want A's gradient, which is zero while B is.
void init_lora_parameters(const ParamSet& adapters, uint64_t seed, double b_std = 0.0);

// The mask seed of one adapter's dropout in one training step (round: the step's micro-batch index).
uint64_t lora_dropout_seed(uint64_t lora_seed, uint64_t round, int layer, ParamRole linear);

// ---- PEFT files ----

// Writes adapter_config.json and adapter_model.safetensors (in `dtype`) into dir, atomically per file.
// base_model: the base's name or path, recorded as PEFT does.
void save_peft_adapter(const ParamSet& adapters, const LoraConfig& lora, const std::string& dir,
                       const std::string& base_model, DType dtype);
// The adapter's configuration from dir/adapter_config.json (its seed is 0: not part of the format).
// Throws naming the file and key for anything this LoRA does not implement (another peft_type,
// bias, rsLoRA, DoRA, per-layer patterns, modules_to_save, a regex target).
LoraConfig read_peft_config(const std::string& dir);
// The base model PEFT recorded (base_model_name_or_path; "" when absent).
std::string read_peft_base_model(const std::string& dir);
// Loads every tensor of `adapters` from dir/adapter_model.safetensors (host set, any float dtype).
// Throws naming the file and tensor for a missing tensor, a shape that does not match the base
// (both shapes shown), or a tensor the table does not have.
void load_peft_adapter(const ParamSet& adapters, const std::string& dir);

// base[W] += (alpha / r) B A for every adapter, in f64 then rounded to the base's dtype (host sets).
void merge_adapters(const ParamSet& base, const ParamSet& adapters, const LoraConfig& lora);

}  // namespace cw
