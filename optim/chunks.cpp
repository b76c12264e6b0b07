// The chunk machinery and the step frame (see chunks.h), and batch_loss, a prefill with loss.
#include "optim/chunks.h"

#include "engine/residency.h"
#include "engine/trace.h"

#include <algorithm>

namespace cw {

std::vector<int64_t> chunk_bounds(int64_t T, int64_t c) {
  if (c <= 0 || c > T) c = T;
  std::vector<int64_t> b;
  for (int64_t t = 0; t < T; t += c) b.push_back(t);
  b.push_back(T);
  return b;
}

StepTokens step_tokens(const Batch& batch, Arena& arena) {
  StepTokens st;
  st.sequence0 = batch.sequence0;
  if (!batch.doc_starts.empty()) st.doc_starts = &batch.doc_starts;
  st.document_positions = batch.document_positions;
  if (arena.device().is_cpu()) {
    st.ids = batch.ids.tensor;
    st.labels = batch.labels.tensor;
    return st;
  }
  st.ids = arena.alloc(DType::i32, {batch.B(), batch.T()});
  st.labels = arena.alloc(DType::i32, {batch.B(), batch.T()});
  copy_convert(st.ids, batch.ids.tensor);
  copy_convert(st.labels, batch.labels.tensor);
  if (st.doc_starts) st.first_keys = document_first_keys(batch.doc_starts, batch.T(), arena);
  return st;
}

ChunkTokens slice_chunk(const StepTokens& tokens, int64_t t0, int64_t t1, Arena& arena,
                        const ContextParallelGroup* cp) {
  const int64_t B = tokens.B(), c = t1 - t0;
  // The ids and labels of the rank's tokens: all c of each sequence, or under context parallelism its
  // n = c/P from t0 + r n (ChunkTokens' B, c and pos0 stay the chunk's).
  const int64_t n = cp_rank_tokens(cp, c), first = t0 + (cp ? cp->rank() * n : 0);
  ChunkTokens ct;
  ct.B = B;
  ct.c = c;
  ct.pos0 = t0;
  ct.sequence0 = tokens.sequence0;
  ct.doc_starts = tokens.doc_starts;
  ct.document_positions = tokens.document_positions;
  ct.first_keys = tokens.first_keys;
  if (B == 1) {  // one sequence: its tokens [first, first + n) are contiguous
    auto from = [&](const Tensor& t) { return Tensor(t.ptr<int32_t>() + first, DType::i32, t.device, {n}); };
    ct.ids = from(tokens.ids);
    ct.labels = from(tokens.labels);
    return ct;
  }
  ct.ids = arena.alloc(DType::i32, {B * n});
  ct.labels = arena.alloc(DType::i32, {B * n});
  copy_convert(ct.ids.view({B, n}), tokens.ids.slice(1, first, n));
  copy_convert(ct.labels.view({B, n}), tokens.labels.slice(1, first, n));
  return ct;
}

ChunkTokens slice_chunk(const Batch& batch, int64_t t0, int64_t t1, Arena& arena) {
  return slice_chunk(step_tokens(batch, arena), t0, t1, arena);
}

ActivationPolicy activation_policy(const ScheduleOptions& o, const LoraConfig& lora) {
  const bool checkpointed = o.kind == ScheduleKind::checkpointed;
  ActivationPolicy p;
  const RecomputeMode mode = o.recompute_mode();
  p.keep_layers = mode != RecomputeMode::full;
  p.mlp_shards = o.mlp_shards;
  p.recompute_mlp = mode == RecomputeMode::selective;
  p.offload_inputs = checkpointed && o.offload;
  p.mlp_frozen = lora.freezes_mlp();
  return p;
}

double prefill(KVStore& kv, const LlamaModel& model, const StepTokens& tokens, const std::vector<int64_t>& bounds,
               double normaliser, bool with_loss, Arena& arena, int64_t mlp_shards,
               const std::function<void(int64_t, int64_t)>& chunk_done, LossRows* losses) {
  double loss = 0;
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    {
      TraceScope traced("prefill chunk {chunk}",
                        {{"chunk", static_cast<int64_t>(i)}, {"t0", bounds[i]}, {"t1", bounds[i + 1]}});
      ArenaScope scope(arena);
      const ChunkTokens chunk = slice_chunk(tokens, bounds[i], bounds[i + 1], arena, model.context_parallel());
      loss += forward_chunk(nullptr, kv, model, chunk, normaliser, with_loss, arena, mlp_shards, losses);
    }
    if (chunk_done) chunk_done(static_cast<int64_t>(i) + 1, chunks);
  }
  return loss;
}

double backprop_chunk(KVStore& kv, const LlamaModel& model, const StepTokens& tokens, int64_t t0, int64_t t1,
                      const ParamSet& grads, double normaliser, Arena& arena, const ActivationPolicy& policy,
                      double loss_weight, const GradsFinalFrom& grads_final, LossRows* losses) {
  ArenaScope scope(arena);
  const ChunkTokens chunk = slice_chunk(tokens, t0, t1, arena, model.context_parallel());
  if (has_saved_inputs(kv, chunk))
    return backward_chunk_from_store(grads, kv, model, chunk, normaliser, arena, policy, loss_weight, grads_final,
                                     losses);
  ChunkActivations act = ChunkActivations::allocate(arena, model.config(), tokens.B(), chunk.c, model.dtype(), policy,
                                                    model.tensor_parallel(), model.context_parallel());
  forward_chunk(&act, kv, model, chunk, normaliser, false, arena);
  return backward_chunk(grads, act, kv, model, chunk, normaliser, arena, loss_weight, grads_final, losses);
}

namespace {
// The loss normaliser: the caller's total over micro-batches, else the batch's own count of
// supervised labels (at least 1, so a batch with none gives loss 0 and no gradient).
double step_normaliser(double given, int64_t supervised) {
  return given > 0 ? given : std::max<double>(1.0, static_cast<double>(supervised));
}

// A window of every layer is no offload.
int64_t effective_window(const LlamaModel& model, int64_t offload_window) {
  return offload_window >= model.config().num_hidden_layers ? 0 : offload_window;
}

// Pinned memory cannot be swapped: an offloaded store must leave the system a margin (a clear error,
// never a swap storm).
void check_host_memory(const LlamaModel& model, int64_t B, int64_t T, const KVStoreOptions& store) {
  const size_t need = KVStore::host_bytes_needed(model.store_config(), B, T, model.dtype(), store);
  const size_t have = host_memory_available();
  if (have > 0 && double(need) > kPinnableHostShare * double(have))
    fail(fmt::format("the K/V store with offload needs {:.1f} GiB of host memory for {} x {} tokens; {:.1f} GiB are "
                     "available",
                     double(need) / double(1ull << 30), B, T, double(have) / double(1ull << 30)),
         "lower --seq or --batch, or free host memory (schedule.offload_window keeps only the window on the device)");
}

// RoPE positions for the batch's T tokens, then the schedule's K/V store for B x T, kept between steps
// (rebuilt only when the shape, dtype or options change) and reset. The options place it (an
// offload window, streamed: the store's modes, model/kv_store.h) and say what else it keeps.
KVStore& step_store(std::optional<KVStore>& store, LlamaModel& model, int64_t B, int64_t T, KVStoreOptions wanted) {
  model.ensure_positions(T);
  if (wanted.layer_inputs && model.context_parallel())
    fail("schedule.save_inputs keeps every token of a chunk's layer inputs; a context-parallel rank holds only its "
         "share of a chunk's tokens",
         "set schedule.save_inputs = false, or run without context parallelism");
  if (wanted.layer_inputs && model.tensor_parallel() && model.tensor_parallel()->sequence_parallel())
    fail("schedule.save_inputs keeps every row of a chunk's layer inputs; under sequence parallelism a rank holds only "
         "its share of a chunk's rows, which depends on the chunking",
         "set schedule.save_inputs = false, or parallel.sequence_parallel = false");
  wanted.offload_window = effective_window(model, wanted.offload_window);
  if (!store || store->batch() != B || store->tokens() != T || store->dtype() != model.dtype() ||
      !(store->options() == wanted)) {
    store.reset();  // free the old store before allocating the new one
    if (wanted.offload_window > 0 || wanted.stream_block > 0) check_host_memory(model, B, T, wanted);
    store.emplace(model.store_config(), B, T, model.dtype(), wanted);
  }
  store->reset();
  return *store;
}

// The store a step of these options keeps for the batch's B x T tokens, with gradient accumulators.
KVStoreOptions step_store_options(const ScheduleOptions& o, const LlamaModel& model, int64_t T) {
  return {.with_grads = true,
          .device = model.device(),
          .offload_window = o.offload_window,
          .stream_block = o.stream_block(T),
          .attention_outputs = o.save_attention,
          .layer_inputs = o.save_inputs,
          .layer_local_grads = o.layer_local_kv_grads(T, model.config().num_hidden_layers)};
}

// The schedule's arena on the model's device, its high-water mark from now.
Arena& step_arena(Schedule& schedule, Device device) {
  Arena& arena = schedule.arena_on(device);
  arena.reset_high_water();
  return arena;
}
}  // namespace

StepFrame::StepFrame(Schedule& schedule, std::optional<KVStore>& store, LlamaModel& model, const Batch& batch,
                     double normaliser, uint64_t step_index)
    : options(schedule.options()),
      model(model),
      batch(batch),
      supervised(batch.supervised()),
      norm(step_normaliser(normaliser, supervised)),
      kv(step_store(store, model, batch.B(), batch.T(), step_store_options(options, model, batch.T()))),
      arena(step_arena(schedule, model.device())),
      tokens_scope_(arena),
      tokens(step_tokens(batch, arena)),
      losses_(arena, batch.B() * batch.T()),
      hooks(schedule.hooks()),
      policy_(activation_policy(options, model.lora())),
      moved_before_(kv.bytes_moved()),
      dropout_round_(model, step_index) {}

void StepFrame::prefill(bool with_loss, int64_t until) {
  if (until < 0) until = batch.T();
  if (until == 0) return;
  // The same boundaries as a prefill of all T tokens (chunks start at multiples of options.chunk).
  std::function<void(int64_t, int64_t)> chunk_done;
  if (hooks.progress) chunk_done = [this](int64_t done, int64_t total) { hooks.progress("prefill", done, total); };
  cw::prefill(kv, model, tokens, chunk_bounds(until, options.chunk), norm, with_loss, arena, options.mlp_shards,
              chunk_done, &losses_);
}

std::vector<int64_t> StepFrame::sweep_bounds() const {
  return chunk_bounds(batch.T(), options.bwd_chunk > 0 ? options.bwd_chunk : options.chunk);
}

int64_t StepFrame::sweep_chunk_index(int64_t t0) const {
  const int64_t c = options.bwd_chunk > 0 ? options.bwd_chunk : options.chunk;
  return c <= 0 || c > batch.T() ? 0 : t0 / c;  // as chunk_bounds splits
}

void StepFrame::backprop(int64_t t0, int64_t t1, const ParamSet& grads, double loss_weight, bool last,
                         bool count_loss) {
  {
    TraceScope traced("backprop chunk {chunk}", {{"chunk", sweep_chunk_index(t0)}, {"t0", t0}, {"t1", t1}});
    LossRows dropped;
    backprop_chunk(kv, model, tokens, t0, t1, grads, norm, arena, policy_, loss_weight,
                   last ? hooks.grads_final : GradsFinalFrom{}, count_loss ? &losses_ : &dropped);
  }
  ++backprops_done_;
  if (hooks.progress) hooks.progress("backward", backprops_done_, std::max(backprops, backprops_done_));
}

StepStats StepFrame::finish(int64_t chunks, int64_t visited) const {
  StepStats st;
  st.loss = losses_.sum();
  st.supervised = supervised;
  st.chunks = chunks;
  st.chunks_visited = visited;
  st.activation_high_water = arena.high_water();
  st.kv_bytes = kv.bytes();
  st.kv_host_bytes = kv.host_bytes();
  st.kv_bytes_moved = kv.bytes_moved() - moved_before_;
  return st;
}

namespace {
double loss_through_store(LlamaModel& model, const Batch& batch, int64_t chunk, Arena& arena, double normaliser,
                          int64_t offload_window, int64_t stream_block) {
  const double norm = step_normaliser(normaliser, batch.supervised());
  model.ensure_positions(batch.T());
  const KVStoreOptions placed{.device = model.device(),
                              .offload_window = effective_window(model, offload_window),
                              .stream_block = stream_block};
  if (placed.offload_window > 0 || placed.stream_block > 0) check_host_memory(model, batch.B(), batch.T(), placed);
  KVStore kv(model.store_config(), batch.B(), batch.T(), model.dtype(), placed);
  ArenaScope scope(arena);
  return prefill(kv, model, step_tokens(batch, arena), chunk_bounds(batch.T(), chunk), norm, true, arena, 1);
}
}  // namespace

double batch_loss(LlamaModel& model, const Batch& batch, int64_t chunk, Arena& arena, double normaliser) {
  return loss_through_store(model, batch, chunk, arena, normaliser, 0, 0);
}

double batch_loss(LlamaModel& model, const Batch& batch, const ScheduleOptions& schedule, Arena& arena) {
  return loss_through_store(model, batch, schedule.chunk, arena, 0, schedule.offload_window,
                            schedule.stream_block(batch.T()));
}

}  // namespace cw
