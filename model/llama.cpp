#include "model/llama.h"

#include "engine/ops/embedding.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/trace.h"

#include <cmath>

namespace cw {

LlamaModel::LlamaModel(const LlamaConfig& config, DType dtype, Device device, TensorParallelGroup* tp,
                       const LoraConfig& lora, bool cast_layers)
    : full_config_(config),
      tp_(tp),
      config_(tp ? tp_shard_config(config, tp->size()) : config),
      dtype_(dtype),
      device_(device),
      params_(cast_layers ? ParamSet(config_, outside_blocks(parameter_table(config_)), dtype, device)
                          : ParamSet(config_, dtype, device)),
      lora_(lora),
      cast_layers_(cast_layers) {
  full_config_.validate("model config");
  lora_.validate();
  CW_CHECK(!(cast_layers && lora_.enabled()),
           "schedule.cast_layers rounds the blocks from master weights, which a LoRA base does not have: set "
           "cast_layers = false with lora.rank > 0");
  if (lora_.enabled()) {
    adapters_.emplace(config_, lora_parameter_table(config_, lora_), dtype, device);
    init_lora_parameters(*adapters_, lora_.seed);
  }
  ensure_positions(256);
}

LlamaModel::LlamaModel(const LlamaConfig& config, DType dtype, Device device, ParameterShards& shards,
                       const LoraConfig& lora)
    : full_config_(config), tp_(nullptr), config_(config), dtype_(dtype), device_(device), lora_(lora),
      cast_layers_(false), shards_(&shards) {
  full_config_.validate("model config");
  lora_.validate();
  if (lora_.enabled()) {
    adapters_.emplace(config_, lora_parameter_table(config_, lora_), dtype, device);
    init_lora_parameters(*adapters_, lora_.seed);
  }
  ensure_positions(256);
}

ParamSet& LlamaModel::adapters() {
  CW_CHECK(adapters_, "the model has no LoRA adapters (lora.rank is 0)");
  return *adapters_;
}
const ParamSet& LlamaModel::adapters() const {
  CW_CHECK(adapters_, "the model has no LoRA adapters (lora.rank is 0)");
  return *adapters_;
}

ModelWeights LlamaModel::weights() const {
  if (shards_) return shards_->outside();  // its blocks come one at a time, through layer(l)
  ModelWeights w = params_.weights();
  if (adapters_) {
    const ModelWeights a = adapters_->weights();
    for (size_t l = 0; l < a.layers.size(); ++l) w.layers[l].lora = a.layers[l].lora;
  }
  return w;
}

LayerWeights LlamaModel::layer(int l) const {
  CW_CHECK(!cast_layers_ || cast_, "the model casts its blocks from master weights it has not been given "
                                   "(LlamaModel::cast_layers_from)");
  LayerWeights w = shards_ ? shards_->block(l) : cast_ ? cast_->layer(l) : params_.layer(l);
  if (adapters_) w.lora = adapters_->layer(l).lora;
  return w;
}

std::vector<ParamSpec> LlamaModel::trainable_table() const {
  if (adapters_) return adapters_->specs();
  return cast_layers_ || shards_ ? parameter_table(config_) : params_.specs();
}

void LlamaModel::cast_layers_from(const ParamSet& master) {
  CW_CHECK(cast_layers_, "cast_layers_from: the model was built with its blocks resident (cast_layers = false)");
  CW_CHECK(same_table(master.specs(), parameter_table(config_)) && master.device() == device_,
           "cast_layers_from: the master must hold the model's whole table on its device");
  cast_ = std::make_unique<LayerCast>(master, dtype_);
}

void LlamaModel::master_changed() {
  if (cast_) cast_->invalidate();
}

void LlamaModel::set_context_parallel(ContextParallelGroup* cp) {
  CW_CHECK_HINT(!cp || !tp_, "give parallel.cp or parallel.tp", "context parallelism with tensor parallelism is not implemented");
  CW_CHECK_HINT(!cp || !shards_, "give parallel.cp without parallel.zero = 3",
                "context parallelism with sharded parameters (ZeRO 3) is not implemented");
  if (cp) cp_attention_config(config_, cp->size());  // the heads must split over the group: says so here
  cp_ = cp;
}

LlamaConfig LlamaModel::store_config() const { return cp_ ? cp_attention_config(config_, cp_->size()) : config_; }

LoraRuntime LlamaModel::lora_runtime() const {
  if (!adapters_) return {};
  LoraRuntime r;
  r.scale = lora_.scale();
  if (dropout_round_) {
    r.dropout = lora_.dropout;
    r.lora_seed = lora_.seed;
    r.round = *dropout_round_;
  }
  return r;
}

namespace {
// The adapters' runtime for one chunk: the model's, keyed by the chunk's sequences in the global batch.
LoraRuntime chunk_lora_runtime(const LlamaModel& model, const ChunkTokens& chunk) {
  LoraRuntime r = model.lora_runtime();
  r.sequence0 = chunk.sequence0;
  return r;
}
}  // namespace

void LlamaModel::ensure_positions(int64_t n) {
  const int64_t rows = rope_cos_.tensor.ndim == 2 ? rope_cos_.tensor.size(0) : 0;
  // Grown for a longer sequence; with dynamic scaling also rebuilt for another length above the
  // original one, whose frequencies differ (n rows are a sequence of n tokens: rope_tables).
  if (rope_tables_serve(config_.rope_scaling, rows, n)) return;
  const int64_t half = config_.head_dim / 2;
  if (device_.is_cpu()) {
    rope_cos_ = OwnedTensor(dtype_, {n, half});
    rope_sin_ = OwnedTensor(dtype_, {n, half});
    rope_tables(rope_cos_, rope_sin_, config_.head_dim, config_.rope_theta, config_.rope_scaling);
    return;
  }
  // GPU: computed on the host in f64, stored as f32 whatever the compute dtype.
  OwnedTensor cos_host(DType::f64, {n, half}), sin_host(DType::f64, {n, half});
  rope_tables(cos_host, sin_host, config_.head_dim, config_.rope_theta, config_.rope_scaling);
  rope_cos_ = OwnedTensor::on(device_, DType::f32, {n, half});
  rope_sin_ = OwnedTensor::on(device_, DType::f32, {n, half});
  copy_convert(rope_cos_, cos_host);
  copy_convert(rope_sin_, sin_host);
}

Tensor ChunkActivations::input(int layer) const {
  if (!offloaded) return stream[static_cast<size_t>(layer)];
  const Tensor& x_L = stream.back();
  return Tensor(offloaded->device(layer, 0), x_L.dtype, x_L.device, {x_L.size(0), x_L.size(1)});
}

MlpKept mlp_kept(const ActivationPolicy& policy, const LlamaConfig& cf, int64_t rows) {
  if (resolve_mlp_shards(policy.mlp_shards, cf, rows) != 1 || policy.recompute_mlp) return MlpKept::input;
  return policy.mlp_frozen ? MlpKept::products : MlpKept::all;
}

ChunkActivations ChunkActivations::allocate(Arena& arena, const LlamaConfig& cf, int64_t B, int64_t c, DType dt,
                                            const ActivationPolicy& policy, const TensorParallelGroup* tp,
                                            const ContextParallelGroup* cp) {
  ChunkActivations a;
  a.policy = policy;
  const int64_t N = B * cp_rank_tokens(cp, c), R = tp_rows(tp, N), C = cf.hidden_size, L = cf.num_hidden_layers;
  const MlpKept mlp = mlp_kept(policy, cf, N);
  if (policy.offload_inputs) {
    CW_CHECK(!policy.keep_layers, "offloading layer inputs needs a policy that keeps only layer inputs");
    a.stream.assign(static_cast<size_t>(L), Tensor{});
    a.stream.push_back(arena.alloc(dt, {R, C}));  // x_L stays on the device for the final norm
    a.offloaded = std::make_shared<Residency>(arena.device(), std::vector<size_t>{a.stream.back().bytes()},
                                              static_cast<int>(L), 2, "input layer");
  } else {
    for (int64_t l = 0; l <= L; ++l) a.stream.push_back(arena.alloc(dt, {R, C}));
  }
  if (policy.keep_layers)
    for (int64_t l = 0; l < L; ++l) a.layers.push_back(LayerActivations::allocate(arena, cf, B, c, dt, mlp, tp, cp));
  a.normed = arena.alloc(dt, {R, C});
  a.final_norm.rstd = arena.alloc(accum_dtype(dt), {R});
  return a;
}

size_t ChunkActivations::bytes(const LlamaConfig& cf, int64_t B, int64_t c, DType dt, const ActivationPolicy& policy,
                               const TensorParallelGroup* tp, const ContextParallelGroup* cp) {
  const int64_t rows = B * cp_rank_tokens(cp, c);
  const size_t R = static_cast<size_t>(tp_rows(tp, rows)), C = static_cast<size_t>(cf.hidden_size);
  const MlpKept mlp = mlp_kept(policy, cf, rows);
  // Recomputing layers still needs one layer's activations at a time.
  const size_t layers = policy.keep_layers ? static_cast<size_t>(cf.num_hidden_layers) : 1;
  const size_t streams = policy.offload_inputs ? 3 : static_cast<size_t>(cf.num_hidden_layers) + 1;
  return layers * LayerActivations::bytes(cf, B, c, dt, mlp, tp, cp) + (streams + 1) * R * C * dtype_size(dt) +
         R * dtype_size(accum_dtype(dt));
}

double embedding_scale(const LlamaConfig& cf, DType dtype) {
  if (!cf.scale_embeddings) return 1.0;
  // transformers' normaliser is a float32 tensor of sqrt(C), cast to the weights' dtype before the
  // product (Gemma2TextScaledWordEmbedding): sqrt(3584) = 59.87 is 59.75 in bf16. In f64 the exact root.
  const double root = std::sqrt(static_cast<double>(cf.hidden_size));
  switch (dtype) {
    case DType::f64: return root;
    case DType::f32: return static_cast<float>(root);
    case DType::bf16: return bf16::from_float(static_cast<float>(root)).to_float();
    case DType::i32: break;
  }
  fail(fmt::format("embedding_scale: {} is no float dtype", dtype_name(dtype)));
}

namespace {
// Runs embedding and the blocks, leaving x_L in stream.back(); stream tensors either kept or scratch.
void run_blocks(ChunkActivations& a, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk, bool keep,
                Arena& scratch, int64_t mlp_shards) {
  const LlamaConfig& cf = model.config();
  const ModelWeights w = model.weights();
  // A store with saved attention outputs makes a forward that keeps activations the reverse sweep's
  // recompute (kv_store.h): it reads the chunk's saved outputs and writes nothing. A chunk the
  // prefill did not reach (seco's last) has none: its forward computes them.
  const bool recompute = keep && kv.has_outputs() && chunk.pos0 + chunk.c <= kv.outputs_written();
  const BlockContext ctx{cf, model.rope_cos(), model.rope_sin(), chunk.B, chunk.c, chunk.pos0, scratch, mlp_shards,
                         recompute, model.tensor_parallel(), chunk_lora_runtime(model, chunk), chunk.doc_starts,
                         chunk.document_positions, chunk.first_keys, model.context_parallel()};
  // Layer activations are kept only when the policy allocated them; otherwise just the stream is.
  const bool keep_layers = keep && !a.layers.empty();
  Residency* off = keep ? a.offloaded.get() : nullptr;
  const int64_t t0 = chunk.pos0, t1 = chunk.pos0 + chunk.c;
  const int L = cf.num_hidden_layers;
  const KVStore::Use use = recompute ? KVStore::Use::recompute : KVStore::Use::forward;
  // With offloaded inputs, layer l's input takes a device slot before it is written (waiting for the
  // copy out of that slot's previous input) and goes home once written, while layer l runs.
  auto claim = [&](int l) {
    if (!off) return;
    off->fetch(l, {});
    off->ready(l);
  };
  claim(0);
  embedding_forward(a.input(0), tp_local_rows(model.tensor_parallel(), chunk.ids), w.embedding,
                    embedding_scale(cf, model.dtype()));
  for (int l = 0; l < L; ++l) {
    const size_t li = static_cast<size_t>(l);
    TraceScope traced(keep ? "layer {layer} recompute" : "layer {layer} forward",
                      {{"layer", l}, {"t0", t0}, {"t1", t1}});
    if (off) {
      off->store(l, {{0, 0, a.stream.back().bytes()}});
      if (l + 1 < L) claim(l + 1);
    }
    kv.begin_layer(l, use, t0, t1);
    if (kv.has_inputs() && use == KVStore::Use::forward)  // saved for the reverse sweep (kv_store.h); not under CP
      copy_convert(kv.inputs(l, t0, t1), a.input(l).view({chunk.B, chunk.c, cf.hidden_size}));
    const LayerWeights w_l = model.layer(l);
    model.prefetch_layer(l + 1);
    block_forward(l + 1 < L ? a.input(l + 1) : a.stream.back(), keep_layers ? &a.layers[li] : nullptr, a.input(l),
                  w_l, kv, l, ctx);
    kv.end_layer(l, use, t0, t1);
  }
  rmsnorm_forward(a.normed, a.final_norm, a.stream.back(), w.final_norm, cf.rms_norm_eps, cf.norm_weight_offset);
}

// Activations for a forward that keeps nothing, in scratch: the blocks ping-pong between two
// residual-stream buffers, plus the final norm's output and statistics.
// R rows: the chunk's N, or the rank's N/P under sequence parallelism.
ChunkActivations transient_activations(const LlamaModel& model, int64_t R, Arena& scratch) {
  const LlamaConfig& cf = model.config();
  ChunkActivations a;
  const Tensor ping = scratch.alloc(model.dtype(), {R, cf.hidden_size});
  const Tensor pong = scratch.alloc(model.dtype(), {R, cf.hidden_size});
  for (int64_t l = 0; l <= cf.num_hidden_layers; ++l) a.stream.push_back(l % 2 == 0 ? ping : pong);
  a.normed = scratch.alloc(model.dtype(), {R, cf.hidden_size});
  a.final_norm.rstd = scratch.alloc(accum_dtype(model.dtype()), {R});
  return a;
}

// The sum of per-row losses (any float dtype), accumulated in f64 in row order.
double sum_rows(const Tensor& row_loss) {
  OwnedTensor row64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{row_loss.numel()});
  copy_convert(row64, row_loss);
  double sum = 0;
  for (int64_t n = 0; n < row_loss.numel(); ++n) sum += row64.tensor.ptr<double>()[n];
  return sum;
}

// The chunk's loss times `weight` from the per-row losses this process computed: under sequence
// parallelism the rank's rows, all-gathered first so every rank has all N rows in the one-process
// order. Kept in `losses` (returning 0) when given, else summed here.
double chunk_loss(const Tensor& row_loss, int64_t N, TensorParallelGroup* tp, Arena& scratch, double weight,
                  LossRows* losses) {
  ArenaScope scope(scratch);
  Tensor rows = row_loss;
  if (tp && tp->sequence_parallel()) {
    rows = scratch.alloc(row_loss.dtype, {N});
    tp->gather_from_sp_forward(rows, row_loss);
  }
  if (!losses) return sum_rows(rows) * weight;
  losses->add(rows, weight);
  return 0.0;
}

// Hands the sharded model's outside tensors back when a pass ends, also when it throws.
class OutsideRelease {
 public:
  explicit OutsideRelease(const LlamaModel& model) : model_(model) {}
  ~OutsideRelease() { model_.release_outside(); }
  OutsideRelease(const OutsideRelease&) = delete;
  OutsideRelease& operator=(const OutsideRelease&) = delete;

 private:
  const LlamaModel& model_;
};

// The rows a rank holds of a chunk: B c, or under context parallelism its c/P tokens of each sequence.
int64_t chunk_rows(const LlamaModel& model, const ChunkTokens& chunk) {
  return chunk.B * cp_rank_tokens(model.context_parallel(), chunk.c);
}

void check_chunk(const LlamaModel& model, const ChunkTokens& chunk, const KVStore& kv) {
  const int64_t N = chunk_rows(model, chunk);
  CW_CHECK(!(model.context_parallel() && kv.has_inputs()),
           "saved layer inputs hold every token of a chunk, not a context-parallel rank's share");
  check_shape(chunk.ids, {N}, "chunk ids");
  if (chunk.labels.data) check_shape(chunk.labels, {N}, "chunk labels");
  CW_CHECK(chunk.pos0 + chunk.c <= kv.tokens(), "chunk [{}, {}) beyond the K/V store's {} tokens", chunk.pos0,
           chunk.pos0 + chunk.c, kv.tokens());
  CW_CHECK(chunk.B == kv.batch(), "chunk batch {} but K/V store batch {}", chunk.B, kv.batch());
  CW_CHECK(model.rope_cos().size(0) >= chunk.pos0 + chunk.c, "RoPE tables cover {} positions, chunk needs {}",
           model.rope_cos().size(0), chunk.pos0 + chunk.c);
  tp_rows(model.tensor_parallel(), N);  // sequence parallelism: N must split evenly over the ranks
}
}  // namespace

LossRows::LossRows(Arena& arena, int64_t capacity) : rows_(arena.alloc(DType::f64, {capacity})) {}

void LossRows::add(const Tensor& rows, double weight) {
  if (!keeps()) return;
  const int64_t n = rows.numel();
  CW_CHECK(used_ + n <= rows_.numel(), "loss rows: {} more rows do not fit the {} kept for the step ({} used)", n,
           rows_.numel(), used_);
  copy_convert(rows_.slice(0, used_, n), rows.view({n}));
  chunks_.push_back({used_, n, weight});
  used_ += n;
}

double LossRows::sum() const {
  if (used_ == 0) return 0.0;
  OwnedTensor host = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{used_});
  copy_convert(host.tensor, rows_.slice(0, 0, used_));
  double total = 0;
  for (const Chunk& c : chunks_) total += sum_rows(host.tensor.slice(0, c.offset, c.rows)) * c.weight;
  return total;
}

std::vector<double> LossRows::values() const {
  std::vector<double> out(static_cast<size_t>(used_));
  if (used_ == 0) return out;
  copy_convert(Tensor(out.data(), DType::f64, Device::host(), {used_}), rows_.slice(0, 0, used_));
  for (const Chunk& c : chunks_)
    for (int64_t i = c.offset; i < c.offset + c.rows; ++i) out[static_cast<size_t>(i)] *= c.weight;
  return out;
}

double forward_chunk(ChunkActivations* keep, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                     double normaliser, bool with_loss, Arena& scratch, int64_t mlp_shards, LossRows* losses) {
  check_chunk(model, chunk, kv);
  const int64_t N = chunk_rows(model, chunk);
  if (keep) {
    run_blocks(*keep, kv, model, chunk, true, scratch, keep->policy.mlp_shards);
    return 0.0;
  }
  ArenaScope scope(scratch);
  TensorParallelGroup* tp = model.tensor_parallel();
  const int64_t R = tp_rows(tp, N);
  ChunkActivations a = transient_activations(model, R, scratch);
  // A forward that keeps nothing is a whole pass: sharded outside tensors go back when it ends (one
  // that keeps its activations is followed by its backward, which reads them too).
  OutsideRelease release(model);
  run_blocks(a, kv, model, chunk, false, scratch, mlp_shards);
  if (!with_loss) return 0.0;
  CW_CHECK(chunk.labels.data, "forward_chunk with_loss needs labels");
  TraceScope traced("lm head + loss", {{"t0", chunk.pos0}, {"t1", chunk.pos0 + chunk.c}});
  Tensor row_loss = scratch.alloc(accum_dtype(model.dtype()), {R});
  lm_head_loss_forward(row_loss, LmHeadSaved{}, a.normed, model.weights().lm_head, tp_local_rows(tp, chunk.labels),
                       normaliser, scratch, kLmHeadBlockRows, model.config().final_logit_softcapping);
  return chunk_loss(row_loss, N, tp, scratch, 1.0, losses);
}

namespace {
// What backward_chunk and backward_chunk_from_store share: the checks, the block context, the
// gradient's completion points (flat offsets into `grads`, table order: layer l's first tensor, and
// the first tensor after the blocks: the final norm and an untied head; the end of an adapters' set,
// which has nothing there) and the LM head's and embedding's backward.
class ChunkBackward {
 public:
  ChunkBackward(const ParamSet& grads, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                double normaliser, Arena& scratch, const ActivationPolicy& policy, double loss_weight,
                const GradsFinalFrom& grads_final, LossRows* losses)
      : cf(model.config()), model(model), chunk(chunk), scratch(scratch), normaliser(normaliser),
        loss_weight(loss_weight), grads_final(grads_final), losses(losses), tp(model.tensor_parallel()),
        N(chunk_rows(model, chunk)), R(tp_rows(tp, N)), t0(chunk.pos0), t1(chunk.pos0 + chunk.c), w(model.weights()),
        shards(model.gradient_shards()), release(model), g(shards ? shards->outside_grads() : grads.weights()),
        ctx{cf, model.rope_cos(), model.rope_sin(), chunk.B, chunk.c, chunk.pos0, scratch, policy.mlp_shards,
            kv.has_outputs(), tp, chunk_lora_runtime(model, chunk), chunk.doc_starts, chunk.document_positions,
            chunk.first_keys, model.context_parallel()},
        mlp(mlp_kept(policy, cf, N)),
        row_loss(scratch.alloc(accum_dtype(model.dtype()), {R})),
        d_x(scratch.alloc(model.dtype(), {R, cf.hidden_size})) {
    check_chunk(model, chunk, kv);
    CW_CHECK(chunk.labels.data, "backward_chunk needs labels");
    CW_CHECK(loss_weight > 0, "loss weight {} must be positive", loss_weight);
    CW_CHECK(shards ? grads.size() == 0 : same_table(grads.specs(), model.trainable_table()),
             "backward_chunk: the gradients must have the table of the model's trainable parameters ({} tensors{}), "
             "got {} tensors", shards ? 0 : model.trainable_table().size(),
             shards ? ": none, the sharded model lends its own" : model.has_adapters() ? ": its LoRA adapters" : "",
             grads.size());
    layer_start_.assign(static_cast<size_t>(cf.num_hidden_layers), -1);
    int64_t offset = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      const ParamSpec& spec = grads.specs()[i];
      if (spec.layer >= 0 && layer_start_[static_cast<size_t>(spec.layer)] < 0)
        layer_start_[static_cast<size_t>(spec.layer)] = offset;
      offset += spec.numel();
      if (spec.layer >= 0 || spec.role == ParamRole::embedding) after_blocks_ = offset;
    }
  }

  // LM head and loss, fused (the loss for reporting, the gradient scaled by loss_weight), then the
  // final norm's backward: d_x, the gradient of x_L.
  void head(const Tensor& normed, const RmsNormSaved& final_norm, const Tensor& x_L) {
    TraceScope traced("lm head + loss", {{"t0", t0}, {"t1", t1}});
    ArenaScope scope(scratch);
    Tensor d_normed = scratch.alloc(model.dtype(), {R, cf.hidden_size});
    const double grad_normaliser = normaliser / loss_weight;
    lm_head_loss_fused(row_loss, d_normed, g.lm_head, normed, w.lm_head, tp_local_rows(tp, chunk.labels),
                       grad_normaliser, GradMode::overwrite, scratch, kLmHeadBlockRows, cf.final_logit_softcapping);
    // row_loss was divided by grad_normaliser; the loss reported is the unweighted one.
    if (losses) chunk_loss(row_loss, N, tp, scratch, loss_weight, losses);
    rmsnorm_backward(d_x, g.final_norm, d_normed, final_norm, x_L, w.final_norm, GradMode::overwrite, scratch,
                     cf.norm_weight_offset);
    traced.end();
    finished_from(after_blocks_);  // the final norm and an untied head (a tied one is the embedding)
  }

  // Block l's gradients, added into by its backward: the whole set's, or a sharded model's buffer.
  LayerWeights layer_grads(int l) const { return shards ? shards->block_grads(l) : g.layers[static_cast<size_t>(l)]; }

  void layer_done(int l) const {
    if (shards) shards->block_grads_done(l);
    if (layer_start_[static_cast<size_t>(l)] >= 0) finished_from(layer_start_[static_cast<size_t>(l)]);
  }

  // The embedding's backward; the chunk's loss (read back here without `losses`, once the whole
  // backward is queued: read after the head, the GPU would idle while the host queues the first layers).
  double finish() {
    if (g.embedding.data)
      embedding_backward(g.embedding, d_x, tp_local_rows(tp, chunk.ids), embedding_scale(cf, model.dtype()));
    if (shards) shards->outside_grads_done();
    finished_from(0);
    return losses ? 0.0 : chunk_loss(row_loss, N, tp, scratch, loss_weight, nullptr);
  }

  const LlamaConfig& cf;
  const LlamaModel& model;
  const ChunkTokens& chunk;
  Arena& scratch;
  const double normaliser, loss_weight;
  const GradsFinalFrom& grads_final;
  LossRows* const losses;
  TensorParallelGroup* const tp;
  const int64_t N, R, t0, t1;
  const ModelWeights w;
  ParameterShards* const shards;  // a sharded full-parameter model's (null: the gradients are `grads`)
  const OutsideRelease release;   // the outside tensors go back when the backward ends
  const ModelWeights g;  // a frozen tensor (every base tensor under LoRA) has an undefined gradient: the ops skip it
  const BlockContext ctx;
  const MlpKept mlp;
  // Scratch for the whole backward (the caller's scope): the rows' losses [R] and d_x [R, C], the
  // gradient of the residual stream as it runs down the layers.
  const Tensor row_loss, d_x;

 private:
  void finished_from(int64_t from) const {
    if (grads_final) grads_final(from);
  }
  std::vector<int64_t> layer_start_;
  int64_t after_blocks_ = 0;
};
}  // namespace

double backward_chunk(const ParamSet& grads, const ChunkActivations& a, KVStore& kv, const LlamaModel& model,
                      const ChunkTokens& chunk, double normaliser, Arena& scratch, double loss_weight,
                      const GradsFinalFrom& grads_final, LossRows* losses) {
  ArenaScope scope(scratch);
  ChunkBackward b(grads, kv, model, chunk, normaliser, scratch, a.policy, loss_weight, grads_final, losses);
  const LlamaConfig& cf = b.cf;
  const Tensor& d_x = b.d_x;
  b.head(a.normed, a.final_norm, a.stream.back());
  Residency* off = a.offloaded.get();
  // Offloaded inputs come back one layer ahead: layer l-1's while layer l runs its backward.
  auto bring = [&](int l) {
    if (!off || l < 0) return;
    const bool resident = off->resident(l);
    off->fetch(l, resident ? std::vector<Residency::Span>{} : std::vector<Residency::Span>{{0, 0, a.stream.back().bytes()}});
  };
  for (int l = cf.num_hidden_layers - 1; l >= 0; --l) {
    const size_t li = static_cast<size_t>(l);
    TraceScope traced("layer {layer} backward", {{"layer", l}, {"t0", b.t0}, {"t1", b.t1}});
    if (off) {
      bring(l);
      off->ready(l);
      bring(l - 1);  // into the other slot, after this layer's backward is queued before it
    }
    kv.begin_layer(l, KVStore::Use::backward, b.t0, b.t1);
    const LayerWeights w_l = model.layer(l);
    model.prefetch_layer(l - 1);
    if (!a.layers.empty()) {
      block_backward(d_x, b.layer_grads(l), a.layers[li], a.input(l), w_l, kv, l, b.ctx);
    } else {
      // Checkpointed: recompute this layer's activations from its kept input (not its output: only
      // the next layer reads it), then its backward. The recompute rewrites the layer's K/V of this
      // chunk in the store with the same values.
      ArenaScope layer_scope(scratch);
      LayerActivations la = LayerActivations::allocate(scratch, cf, chunk.B, chunk.c, model.dtype(), b.mlp, b.tp,
                                                       model.context_parallel());
      block_forward(Tensor{}, &la, a.input(l), w_l, kv, l, b.ctx);
      block_backward(d_x, b.layer_grads(l), la, a.input(l), w_l, kv, l, b.ctx);
    }
    kv.end_layer(l, KVStore::Use::backward, b.t0, b.t1);
    b.layer_done(l);
  }
  return b.finish();
}

bool has_saved_inputs(const KVStore& kv, const ChunkTokens& chunk) {
  return kv.has_inputs() && chunk.pos0 + chunk.c <= kv.inputs_written();
}

double backward_chunk_from_store(const ParamSet& grads, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                                 double normaliser, Arena& scratch, const ActivationPolicy& policy, double loss_weight,
                                 const GradsFinalFrom& grads_final, LossRows* losses) {
  CW_CHECK(has_saved_inputs(kv, chunk), "backward_chunk_from_store: the layer inputs of tokens [{}, {}) were not saved "
           "by a prefill (it reached {})", chunk.pos0, chunk.pos0 + chunk.c, kv.has_inputs() ? kv.inputs_written() : 0);
  CW_CHECK(!(model.tensor_parallel() && model.tensor_parallel()->sequence_parallel()),
           "saved layer inputs hold every row of a chunk, not a sequence-parallel rank's share");
  ArenaScope scope(scratch);
  ChunkBackward b(grads, kv, model, chunk, normaliser, scratch, policy, loss_weight, grads_final, losses);
  const LlamaConfig& cf = b.cf;
  const int64_t C = cf.hidden_size, L = cf.num_hidden_layers;
  // Layer l's input as the blocks take it, [N, C]: one sequence's rows are the store's own; several
  // sequences' (batch stride T) are copied together.
  auto input = [&](int l) {
    const Tensor x = kv.inputs(l, b.t0, b.t1);
    if (chunk.B == 1) return Tensor(x.data, x.dtype, x.device, {b.N, C});
    const Tensor packed = scratch.alloc(x.dtype, {chunk.B, chunk.c, C});
    copy_convert(packed, x);
    return packed.view({b.N, C});
  };
  for (int l = static_cast<int>(L) - 1; l >= 0; --l) {
    kv.begin_layer(l, KVStore::Use::backward, b.t0, b.t1);
    const LayerWeights w_l = model.layer(l);
    model.prefetch_layer(l - 1);
    ArenaScope layer_scope(scratch);
    const Tensor x_in = input(l);
    LayerActivations la = LayerActivations::allocate(scratch, cf, chunk.B, chunk.c, model.dtype(), b.mlp, b.tp);
    if (l == L - 1) {
      // The last layer's recompute also gives x_L, which the LM head reads.
      ArenaScope head_scope(scratch);
      TraceScope traced("layer {layer} recompute", {{"layer", l}, {"t0", b.t0}, {"t1", b.t1}});
      const Tensor x_L = scratch.alloc(model.dtype(), {b.R, C});
      block_forward(x_L, &la, x_in, w_l, kv, l, b.ctx);
      const Tensor normed = scratch.alloc(model.dtype(), {b.R, C});
      const RmsNormSaved final_norm{scratch.alloc(accum_dtype(model.dtype()), {b.R})};
      rmsnorm_forward(normed, final_norm, x_L, b.w.final_norm, cf.rms_norm_eps, cf.norm_weight_offset);
      traced.end();
      b.head(normed, final_norm, x_L);
    }
    TraceScope traced("layer {layer} backward", {{"layer", l}, {"t0", b.t0}, {"t1", b.t1}});
    if (l < L - 1) block_forward(Tensor{}, &la, x_in, w_l, kv, l, b.ctx);
    block_backward(b.d_x, b.layer_grads(l), la, x_in, w_l, kv, l, b.ctx);
    kv.end_layer(l, KVStore::Use::backward, b.t0, b.t1);
    b.layer_done(l);
  }
  return b.finish();
}

void chunk_logits(const Tensor& logits, KVStore& kv, const LlamaModel& model, const ChunkTokens& chunk,
                  bool all_positions, Arena& scratch) {
  CW_CHECK(!model.context_parallel(), "chunk_logits: a context-parallel rank holds only its share of the chunk's tokens");
  check_chunk(model, chunk, kv);
  const LlamaConfig& cf = model.config();
  const int64_t N = chunk.B * chunk.c, C = cf.hidden_size;
  ArenaScope scope(scratch);
  TensorParallelGroup* tp = model.tensor_parallel();
  ChunkActivations a = transient_activations(model, tp_rows(tp, N), scratch);
  OutsideRelease release(model);
  run_blocks(a, kv, model, chunk, false, scratch, 1);
  if (tp && tp->sequence_parallel()) {  // every rank returns the logits of all rows
    const Tensor all = scratch.alloc(model.dtype(), {N, C});
    tp->gather_from_sp_forward(all, a.normed);
    a.normed = all;
  }
  const Tensor head = model.weights().lm_head;
  if (all_positions) {
    check_shape(logits, {N, cf.vocab_size}, "logits");
    lm_head_logits(logits, a.normed, head, cf.final_logit_softcapping);
    return;
  }
  check_shape(logits, {chunk.B, cf.vocab_size}, "logits");
  Tensor last = scratch.alloc(model.dtype(), {chunk.B, C});
  for (int64_t b = 0; b < chunk.B; ++b)
    copy_convert(last.slice(0, b, 1), a.normed.slice(0, (b + 1) * chunk.c - 1, 1));
  lm_head_logits(logits, last, head, cf.final_logit_softcapping);
}

}  // namespace cw
