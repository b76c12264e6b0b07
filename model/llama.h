// The Llama model over one chunk of tokens: embedding, L blocks, final norm, LM head + loss.
//
// Every schedule is built from two calls on a chunk (B sequences x c tokens at positions [p, p+c)):
//   forward_chunk:  x_0 = embed(ids) (times sqrt(C): Gemma 2); x_{l+1} = block_l(x_l) writing K/V of
//                   [p, p+c) into the store;
//                   normed = rmsnorm(x_L); with `keep`, everything the backward needs is saved (and
//                   the loss is left to backward_chunk, which computes it fused with its gradient);
//                   without, only the loss (when asked) is computed, and nothing outlives the call.
//   backward_chunk: loss and d(normed) from the fused LM head; final norm, blocks L-1..0 and the
//                   embedding in reverse; parameter gradients accumulate into `grads`, K/V gradients
//                   into the store's accumulators (see model/layer.h).
// Losses are sums of per-token losses divided by the caller's normaliser (the batch's count of
// supervised tokens), so the chunk losses of a batch add up to its mean loss.
//
// Tensor parallel (a model built with a TensorParallelGroup; model/shard.h): the model is the rank's
// shard, config() the shard's (H/P heads, Hkv/P K/V heads, FFN F/P) and full_config() the model's;
// the K/V store a schedule builds from config() therefore holds the rank's K/V heads only. Without
// sequence parallelism the embedding, final norm and LM head + loss run replicated on every rank
// (the same values; their gradients come out identical on every rank). With it, the residual stream,
// the embedding, the final norm and the LM head + loss work on the rank's rows [N/P, C] of the chunk
// (their ids and labels), every chunk's loss is summed over all rows (all-gathered), and the
// gradients of the replicated parameters are each rank's rows' share: parallel/tensor_parallel.h's
// reduce_replicated_gradients sums them over the group once per optimizer step.
//
// Context parallel (set_context_parallel; model/cp_group.h): P ranks share each chunk, every rank
// holding the whole model and c/P tokens of each sequence of it (ChunkTokens' ids and labels are
// those tokens, B, c and pos0 the whole chunk's): the embedding, the blocks' row-wise steps, the final
// norm and the LM head + loss run on the rank's rows, attention on the rank's heads of the whole
// chunk, and the K/V store a schedule builds from store_config() holds those heads. Each rank's loss
// and gradients are its tokens' share; summed over the group they are one process's. Not with
// tensor parallelism or sharded parameters; not with saved layer inputs.
//
// LoRA (a model built with a LoraConfig of rank > 0; model/lora.h): the model holds its base
// parameters, frozen, and the adapters' set; weights() joins them, so every targeted linear runs
// lora_linear (engine/ops/lora_linear.h). trainable() is the adapters' set, and the `grads` a
// backward takes must have its table: no base tensor gets a gradient (the ops skip them), only A
// and B. The K/V relay of a chunked schedule needs nothing new: the K/V gradient read back from the
// store flows into x through the frozen W_k, W_v and their adapters, which accumulate theirs.
// Dropout acts while a dropout round is set (a training step sets it: optim/chunks.h StepFrame);
// each mask is a function of (lora.seed, round, layer, linear, sequence, position, column), so the
// prefill, the recompute and the backward of a token see the same mask whatever the chunking.
#pragma once

#include "engine/memory.h"
#include "engine/residency.h"
#include "model/config.h"
#include "model/kv_store.h"
#include "model/layer.h"
#include "model/layer_cast.h"
#include "model/lora.h"
#include "model/parameter_shards.h"
#include "model/params.h"

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace cw {

class LlamaModel {
 public:
  // device: where weights, RoPE tables and everything the model's chunks allocate live. On a GPU the
  // compute dtype is bf16 (training) or f32 (checks); the RoPE tables are f32 there.
  // tp: this rank's tensor-parallel group (not owned; it outlives the model), or null: one process.
  // lora: adapters (rank > 0) on the targeted linears, initialised by PEFT's rule from lora.seed; the
  // base parameters are then frozen. Tensor parallelism with adapters is not implemented.
  // cast_layers: the model keeps no compute copy of the blocks' weights, only of the tensors outside
  // them (params() has that part of the table); each block's are rounded from a master set as it runs
  // (model/layer_cast.h), which cast_layers_from() gives before the first chunk. Not with adapters.
  LlamaModel(const LlamaConfig& config, DType dtype, Device device = Device::host(), TensorParallelGroup* tp = nullptr,
             const LoraConfig& lora = {}, bool cast_layers = false);
  // A model whose parameters are sharded over ranks (ZeRO 3, parallel/zero3.h): it allocates none
  // (params() is empty), every chunk asks `shards` for them as it runs (model/parameter_shards.h),
  // and backward_chunk adds the gradients into the buffers `shards` lends, not into its `grads`
  // argument, which must then be an empty set. With lora the sharded parameters are the frozen base:
  // the model owns its adapters, as above, and backward_chunk adds their gradient into `grads` (the
  // adapters' table), asking `shards` for no gradient buffer. Without tensor parallelism.
  LlamaModel(const LlamaConfig& config, DType dtype, Device device, ParameterShards& shards,
             const LoraConfig& lora = {});

  const LlamaConfig& config() const { return config_; }            // what the parameters are shaped by
  const LlamaConfig& full_config() const { return full_config_; }  // the model's (= config() without TP)
  TensorParallelGroup* tensor_parallel() const { return tp_; }
  // Context parallelism (above): the rank's group (not owned; it outlives the model's use of it), or
  // null: every rank of the chunk. Throws when the heads do not split over the group, or with tensor
  // parallelism or sharded parameters.
  void set_context_parallel(ContextParallelGroup* cp);
  ContextParallelGroup* context_parallel() const { return cp_; }
  // The config a K/V store of this model is built from: config(), or under context parallelism the
  // rank's heads of it (cp_attention_config).
  LlamaConfig store_config() const;
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  ParamSet& params() { return params_; }              // the base parameters (frozen under LoRA)
  const ParamSet& params() const { return params_; }
  const LoraConfig& lora() const { return lora_; }
  bool has_adapters() const { return adapters_.has_value(); }
  ParamSet& adapters();                                // throws without LoRA
  const ParamSet& adapters() const;
  // What training updates: the adapters under LoRA, else every parameter.
  ParamSet& trainable() { return adapters_ ? *adapters_ : params_; }
  const ParamSet& trainable() const { return adapters_ ? *adapters_ : params_; }
  ModelWeights weights() const;                        // the base, with the adapters joined in
  // Block l's weights in the compute dtype, with its adapters: the resident set's, or with
  // cast_layers a slot the master's block l is rounded into (valid until two other blocks are asked
  // for). weights().layers is empty with cast_layers: the blocks run on layer(l).
  LayerWeights layer(int l) const;
  // Sharded parameters: block l is asked for after the one being run (its gather may start); the
  // tensors outside the blocks are not needed again by this pass. Nothing otherwise.
  void prefetch_layer(int l) const {
    if (shards_) shards_->prefetch(l);
  }
  void release_outside() const {
    if (shards_) shards_->release_outside();
  }
  ParameterShards* shards() const { return shards_; }  // null unless sharded
  // Where backward_chunk's gradients go: the shards' buffers (sharded, full-parameter), else null:
  // its `grads` argument (one process; the adapters of a sharded LoRA model).
  ParameterShards* gradient_shards() const { return adapters_ ? nullptr : shards_; }
  // The table of what training updates (master weights, gradients, moments): the adapters' under
  // LoRA, else every parameter's (also with cast_layers, where params() holds only a part).
  std::vector<ParamSpec> trainable_table() const;
  bool casts_layers() const { return cast_layers_; }
  // cast_layers: the master weights (the model's whole table, in the master dtype, on its device;
  // outliving the model's use of it) the blocks are rounded from.
  void cast_layers_from(const ParamSet& master);
  // cast_layers: the master changed (an optimizer step, a load), so no cast block is current.
  void master_changed();
  const LayerCast* layer_cast() const { return cast_.get(); }  // null without cast_layers

  // Dropout on the adapters' inputs acts while a round is set (the step's micro-batch index).
  void set_dropout_round(std::optional<uint64_t> round) { dropout_round_ = round; }
  std::optional<uint64_t> dropout_round() const { return dropout_round_; }
  // What the blocks need of the adapters for a chunk (model/layer.h).
  LoraRuntime lora_runtime() const;

  // RoPE tables for positions [0, n) of a sequence of n tokens; grown on demand (a schedule calls this
  // before a step). Dynamic scaling's frequencies depend on n: its tables are rebuilt for each n above
  // the original length (engine/ops/rope.h).
  void ensure_positions(int64_t n);
  const Tensor& rope_cos() const { return rope_cos_.tensor; }
  const Tensor& rope_sin() const { return rope_sin_.tensor; }

 private:
  LlamaConfig full_config_;
  TensorParallelGroup* tp_;
  LlamaConfig config_;
  DType dtype_;
  Device device_;
  ParamSet params_;
  LoraConfig lora_;
  bool cast_layers_;
  std::unique_ptr<LayerCast> cast_;
  std::optional<ParamSet> adapters_;
  std::optional<uint64_t> dropout_round_;
  OwnedTensor rope_cos_, rope_sin_;
  ParameterShards* shards_ = nullptr;
  ContextParallelGroup* cp_ = nullptr;
};

// Sets the model's dropout round for a scope and restores the previous one.
class DropoutRoundScope {
 public:
  DropoutRoundScope(LlamaModel& model, std::optional<uint64_t> round) : model_(model), saved_(model.dropout_round()) {
    model.set_dropout_round(round);
  }
  ~DropoutRoundScope() { model_.set_dropout_round(saved_); }
  DropoutRoundScope(const DropoutRoundScope&) = delete;
  DropoutRoundScope& operator=(const DropoutRoundScope&) = delete;

 private:
  LlamaModel& model_;
  std::optional<uint64_t> saved_;
};

// The ids and labels of one chunk, contiguous, rows n = b*c + t.
struct ChunkTokens {
  Tensor ids;     // [N] i32
  Tensor labels;  // [N] i32, -100 where no loss
  int64_t B = 0, c = 0, pos0 = 0;
  int64_t sequence0 = 0;  // the first sequence's index in the step's global batch (optim/schedule.h Batch)
  // Packed documents (optim/schedule.h Batch::doc_starts): per sequence, where its documents start
  // (positions in the whole sequence); null: each sequence is one document.
  const std::vector<std::vector<int64_t>>* doc_starts = nullptr;
  bool document_positions = true;  // RoPE positions restart at each document start
  Tensor first_keys = {};          // on a GPU: the step's [B, T] document starts (model/layer.h)
};

// What a chunk's forward keeps for its backward.
//   keep_layers = true:  every layer's activations (model/layer.h).
//   keep_layers = false: only each layer's input (the residual stream); the backward recomputes a
//                        layer's activations from its input just before that layer's backward
//                        (activation checkpointing at layer granularity: L x [N, C] kept).
//   mlp_shards:          the tiled MLP's row shards (model/layer.h BlockContext); 1 = untiled,
//                        0 = automatic.
//   recompute_mlp:       with keep_layers, the MLP's [N, F] intermediates (gate, up, act) are not
//                        kept but recomputed from the kept h2 in the backward ("selective"
//                        recompute: most of a layer's activation bytes for a fifth of its FLOPs).
//   offload_inputs:      without keep_layers, on a GPU: each layer's input goes to pinned host memory
//                        on the side stream as soon as it is written, and comes back one layer ahead
//                        of its backward, so only two [N, C] device buffers hold layer inputs.
//   mlp_frozen:          the MLP's linears are frozen and carry no adapters (LoRA on the attention's
//                        linears: LoraConfig::freezes_mlp); a kept MLP then keeps gate and up only
//                        (model/layer.h MlpKept::products). optim's activation_policy sets it.
struct ActivationPolicy {
  bool keep_layers = true;
  int64_t mlp_shards = 1;
  bool recompute_mlp = false;
  bool offload_inputs = false;
  bool mlp_frozen = false;
};

// What each layer keeps of its MLP under `policy`, for chunks of `rows` rows.
MlpKept mlp_kept(const ActivationPolicy& policy, const LlamaConfig& config, int64_t rows);

// Rows R = N, or N/P under sequence parallelism (the rank's rows).
struct ChunkActivations {
  std::vector<Tensor> stream;              // L+1 tensors [R, C]: stream[l] enters layer l; stream[L] = x_L
                                           // (with offloaded inputs only stream[L] is set: see input())
  std::vector<LayerActivations> layers;    // L, or empty when the policy recomputes layers
  Tensor normed;                           // [R, C] final_norm(x_L)
  RmsNormSaved final_norm;                 // rstd [R]
  ActivationPolicy policy;
  // With policy.offload_inputs: layer l's input is item l of this residency (home in pinned host
  // memory, two device slots), moved at the named points of the layer loops (llama.cpp).
  std::shared_ptr<Residency> offloaded;

  Tensor input(int layer) const;           // the device view of layer `layer`'s input

  // tp: the model's tensor-parallel group (LlamaModel::tensor_parallel()), null for one process;
  // cp: its context-parallel group (R is then the rank's B c/P rows).
  static ChunkActivations allocate(Arena& arena, const LlamaConfig& config, int64_t B, int64_t c, DType dtype,
                                   const ActivationPolicy& policy = {}, const TensorParallelGroup* tp = nullptr,
                                   const ContextParallelGroup* cp = nullptr);
  static size_t bytes(const LlamaConfig& config, int64_t B, int64_t c, DType dtype, const ActivationPolicy& policy = {},
                      const TensorParallelGroup* tp = nullptr, const ContextParallelGroup* cp = nullptr);
};

// Rows per LM-head block: bounds the logits scratch to kLmHeadBlockRows x V.
constexpr int64_t kLmHeadBlockRows = 256;

// A step's per-row losses, kept where the chunks compute them and summed once at the end: a chunk's
// loss read back as it is computed makes the host wait for the device, and behind the device's copy
// engines (a read-back waited up to 10 ms a chunk behind an offloaded store's copies at 128K).
// The sum is what reading each chunk back gave: a chunk's rows summed in order in f64, times its
// weight, the chunks in the order added.
class LossRows {
 public:
  LossRows() = default;  // keeps nothing: what is added is dropped
  // Room for `capacity` rows (f64) in `arena`, on its device; valid while the arena's scope is.
  LossRows(Arena& arena, int64_t capacity);
  void add(const Tensor& rows, double weight);  // rows [N], a float dtype, on the arena's device
  double sum() const;                           // reads the rows back (waits for the device)
  // Every kept row times its chunk's weight, in the order added (the per-token losses of an eval by
  // position); reads the rows back once (waits for the device).
  std::vector<double> values() const;
  bool keeps() const { return rows_.data != nullptr; }

 private:
  Tensor rows_;  // f64 [capacity]
  struct Chunk {
    int64_t offset, rows;
    double weight;
  };
  std::vector<Chunk> chunks_;
  int64_t used_ = 0;
};

// Returns the chunk's loss (0 unless with_loss and keep == nullptr; 0 too when `losses` is given,
// which keeps the rows instead).
// mlp_shards applies when keep == nullptr (with keep, the activations' policy says).
double forward_chunk(ChunkActivations* keep, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                     double normaliser, bool with_loss, Arena& scratch, int64_t mlp_shards = 1,
                     LossRows* losses = nullptr);
// Called by backward_chunk as it finishes parameter gradients: `from` is a flat offset into `grads`
// (table order, params.h) such that this backward adds nothing more at or after it. The backward runs
// the table backwards, so `from` only decreases: the final norm's offset after the LM head and final
// norm (an untied lm_head follows it in the table), layer l's first tensor's after layer l's
// backward, 0 after the embedding's. Called on the host when the work is queued (on a GPU, a
// consumer orders itself after the compute stream). Data parallelism starts reducing a gradient
// bucket here when this is the step's last backward (parallel/data_parallel.h).
using GradsFinalFrom = std::function<void(int64_t from)>;

// Returns the chunk's loss, or adds its rows to `losses` (weighted by loss_weight) and returns 0.
// loss_weight scales the gradient (not the returned loss): SpaCO's k/t. grads_final, when set, is
// told as each part of the gradient is complete for this chunk.
double backward_chunk(const ParamSet& grads, const ChunkActivations& act, KVStore& kv, const LlamaModel& model,
                      const ChunkTokens& chunk, double normaliser, Arena& scratch, double loss_weight = 1.0,
                      const GradsFinalFrom& grads_final = {}, LossRows* losses = nullptr);

// Whether the store holds the chunk's saved layer inputs (kv_store.h: written by a prefill).
bool has_saved_inputs(const KVStore& kv, const ChunkTokens& chunk);

// backward_chunk without a forward pass: each layer's input comes from the store's saved inputs, and
// the layer is recomputed from it just before its backward (skipping what only the next layer reads;
// with saved attention outputs also its attention forward and K/V projections); layer L-1's recompute
// also gives x_L for the LM head. One layer's activations are alive at a time, shaped by `policy`'s
// MLP (selective: gate, up and act recomputed shard by shard in the backward). The same gradient as
// forward_chunk + backward_chunk. Not with sequence parallelism (the store holds a chunk's every row).
double backward_chunk_from_store(const ParamSet& grads, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                                 double normaliser, Arena& scratch, const ActivationPolicy& policy,
                                 double loss_weight = 1.0, const GradsFinalFrom& grads_final = {},
                                 LossRows* losses = nullptr);

// The embedding's normaliser in `dtype` (engine/ops/embedding.h): sqrt(C) for a model that scales its
// embeddings (Gemma 2), rounded as transformers rounds it; 1 otherwise.
double embedding_scale(const LlamaConfig& config, DType dtype);

// Logits of the last position of every sequence of the chunk, [B, V] (sampling, HF comparisons),
// capped as the loss sees them (Gemma 2's final_logit_softcapping).
void chunk_logits(const Tensor& logits, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                  bool all_positions, Arena& scratch);

}  // namespace cw
