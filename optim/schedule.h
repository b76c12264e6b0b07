// Gradient schedules: how one step's loss and gradients are computed from a batch.
//
// Every schedule takes a batch of B token sequences of length T (ids and already-shifted labels) and
// ADDS the gradient of the batch's mean loss into `grads` (so micro-batches accumulate), returning the
// loss. They differ only in what they keep and what they recompute:
//   full    one chunk covering the sequence, every activation kept, one backward. The reference.
//   checkpointed  one chunk covering the sequence keeping only each layer's input (recompute =
//           full): each layer is recomputed just before its backward. Exact, like full.
//   seco    Sequential Chunk-wise Optimization: prefill all chunks keeping only K/V, then for the
//           chunks last to first recompute one chunk and backprop it, relaying dK/dV to earlier
//           tokens through the store's accumulators. Exact: equal to `full` up to rounding.
//   spaco   Sparse Chunk-wise Optimization: seco's prefill, but the reverse sweep visits a sample of
//           t of the k chunks. An estimator; see optim/spaco.cpp's header for what it is unbiased for.
// The loss normaliser is the count of supervised labels (!= -100) in the batch, or a caller-given
// total when a step is split into micro-batches (so accumulation equals one large batch).
#pragma once

#include "engine/memory.h"
#include "model/llama.h"

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cw {

// B sequences of T tokens: labels[b, t] is the id to predict at position t (-100: no loss there).
struct Batch {
  OwnedTensor ids;     // [B, T] i32
  OwnedTensor labels;  // [B, T] i32
  // Its first sequence's index in the step's global batch (a data-parallel rank's slice starts past
  // the other ranks'): LoRA's dropout masks are keyed by it, so ranks draw one process's masks.
  int64_t sequence0 = 0;
  // Packed documents (data.documents): for each sequence, the offsets in [0, T) where its documents
  // start, ascending, the first 0 (a window's first token opens a document even when its text began
  // before the window). A query then attends only keys of its own document (model/documents.h).
  // Empty: every sequence is one document, attention over all earlier tokens.
  std::vector<std::vector<int64_t>> doc_starts = {};
  // With documents: RoPE positions restart at 0 at every document start (data.positions = document,
  // HF's padding-free packing), or count from the sequence's start (absolute).
  bool document_positions = true;
  int64_t B() const { return ids.tensor.size(0); }
  int64_t T() const { return ids.tensor.size(1); }
  int64_t supervised() const;  // count of labels != -100
};

// HF causal-LM convention from B x T ids: labels = ids shifted left by one, the last position -100.
Batch causal_lm_batch(const std::vector<int32_t>& ids, int64_t B, int64_t T);
// From B windows of T+1 ids (training data): inputs the first T, labels the last T.
Batch window_batch(const std::vector<uint32_t>& windows, int64_t B, int64_t T);
// Seeded random ids in [0, vocab).
Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed);
// Packs documents into the batch: doc_starts as given (checked: per sequence ascending in [0, T),
// the first 0), and the label of every position whose target opens the next document set to -100,
// so no token is trained to predict across a document boundary and the packed loss is the sum of the
// documents' own losses.
void set_documents(Batch& batch, std::vector<std::vector<int64_t>> doc_starts, bool document_positions = true);

// The options of a schedule. Their TOML keys ([schedule]), CLI flags, accepted values and help are
// the rows of schedule_option_table() (optim/options.h); the defaults are the ones below.
// chunk and offload_window take "auto" (this value) in a run's options: the planner chooses them
// before the schedule is built (tools/planner/planner.h, resolve_auto_schedule); a schedule never sees it.
inline constexpr int64_t kAuto = -1;

// The four schedules (above), as the code tells them apart.
enum class ScheduleKind { full, checkpointed, seco, spaco };
// Their names in the options (TOML, the command line, JSON), in the enum's order.
std::vector<std::string_view> schedule_names();
std::string_view schedule_name(ScheduleKind kind);
// The kind a name spells; any other name throws one line naming schedule.name and the four names.
ScheduleKind parse_schedule_kind(std::string_view name);

// What a chunk's backward recomputes (for seco/spaco: inside each reverse-sweep chunk): full (keep
// layer inputs only, recompute each layer before its backward) | selective (keep every layer's
// activations but the MLP's [N, F] intermediates) | none (keep everything) | automatic, written
// "auto" (checkpointed: full; the others: none; ScheduleOptions::recompute_mode resolves it).
enum class RecomputeMode { automatic, full, selective, none };
// Their words in the options (TOML, the command line, JSON), in the enum's order: auto | full |
// selective | none.
std::vector<std::string_view> recompute_names();
std::string_view recompute_name(RecomputeMode mode);
// The mode a word spells; any other word throws one line naming schedule.recompute and the four words.
RecomputeMode parse_recompute_mode(std::string_view word);

struct ScheduleOptions {
  // The schedule (schedule.name: the options' readers parse the name once, their writers print
  // schedule_name(kind)).
  ScheduleKind kind = ScheduleKind::full;
  // seco and spaco: the sequence runs in chunks, with a K/V store that outlives a chunk.
  bool chunked() const { return kind == ScheduleKind::seco || kind == ScheduleKind::spaco; }
  // What a chunk's backward recomputes (schedule.recompute; RecomputeMode above).
  RecomputeMode recompute = RecomputeMode::automatic;
  // The mode in force: recompute, with automatic resolved for this schedule (never automatic).
  RecomputeMode recompute_mode() const;
  // schedule.stream_kv's block for T tokens: the chunk (all T for chunk 0); 0 when not streamed.
  int64_t stream_block(int64_t T) const { return stream_kv ? (chunk > 0 ? std::min(chunk, T) : T) : 0; }
  // The reverse sweep is one chunk of all T tokens: full and checkpointed always, seco and spaco with
  // a (backward) chunk of T or more (or 0).
  bool one_backward_chunk(int64_t T) const;
  // One backward chunk with the K/V store on the device (no window below `layers`, not streamed): the
  // store keeps one layer's dK, dV for every layer (model/kv_store.h, layer-local gradients).
  bool layer_local_kv_grads(int64_t T, int64_t layers) const;
  bool offload = false;         // checkpointed, recompute full: the kept layer inputs live in pinned host
                                // memory (GPU), copied out and back on a side stream
  int64_t offload_window = 0;   // seco, spaco: K/V store layers resident on the device; the rest in (pinned)
                                // host memory, moved a layer ahead of use; 0: the whole store on the device
  bool stream_kv = false;       // seco, spaco: the whole store in (pinned) host memory, streamed to the
                                // device one chunk-sized key block at a time (model/kv_store.h): device
                                // memory does not grow with T; needs bwd_chunk = chunk
  bool save_attention = false;  // seco, spaco: the prefill saves every layer's attention output and lse in
                                // the store (offloaded with it), so the reverse sweep does not run the
                                // attention forward again; costs H*D + H values per token and layer
  bool save_inputs = false;     // seco, spaco: the prefill (then over all T) saves every layer's input in the
                                // store (offloaded with it), so a reverse chunk runs no forward pass: each layer
                                // is recomputed from its saved input just before its backward (recompute =
                                // selective also drops the MLP's intermediates); costs C values per token and layer
  int64_t mlp_shards = 1;       // tiled MLP row shards, any schedule: 1 untiled, 0 automatic (ceil(F / C))
  bool cast_layers = false;     // any schedule, bf16 full-parameter training on a GPU: no resident bf16 copy of
                                // the blocks' weights, each block rounded from the f32 master as it runs
                                // (model/layer_cast.h); the training state reads it when it is built
  int64_t chunk = 0;            // prefill chunk length (seco, spaco); 0: the whole sequence
  int64_t bwd_chunk = 0;        // reverse-sweep chunk length; 0: same as chunk
  int64_t keep = 0;             // t: reverse-sweep chunks visited out of k; 0: all (= seco)
  uint64_t seed = 0;            // the chunk sample of step s uses (seed, s)
  bool stratified = false;      // sample supervised and unsupervised chunks in proportion
  bool scale_loss = true;       // visited chunks' loss gradient x k/t
  bool scale_relay = false;     // relay into a visited chunk x k/t per hop ...
  double relay_cap = 0.0;       // ... until the cumulative factor reaches this (0: no cap)
  bool drop_relay = false;      // discard all cross-chunk relay (the chunk-local gradient)

  bool operator==(const ScheduleOptions&) const = default;
  void validate() const;        // the table's rules and the rules between options; throws naming the option
};

struct StepStats {
  double loss = 0;                   // the batch's mean loss (all chunks, also for spaco)
  int64_t supervised = 0;            // labels that carry loss in this batch
  int64_t chunks = 0;                // reverse-sweep chunks (k)
  int64_t chunks_visited = 0;        // of them backpropagated (t)
  size_t activation_high_water = 0;  // bytes: the arena's peak during the step
  size_t kv_bytes = 0;               // bytes of the K/V store and its gradients on the model's device
  size_t kv_host_bytes = 0;          // with offload_window: the store's host copies
  size_t kv_bytes_moved = 0;         // with offload_window: host <-> device bytes copied during the step
};

// What a step needs from outside its process when it is one rank of a data-parallel group
// (parallel/data_parallel.h sets them for a step; empty: one process, nothing called).
struct StepHooks {
  // Given to the step's LAST chunk backward, the one after which no gradient changes (full,
  // checkpointed: the only chunk; seco: the first chunk, which the reverse sweep runs last; spaco: the
  // earliest visited chunk), so the gradient reduction can start while that backward still runs.
  GradsFinalFrom grads_final;
  // Sums a few host values over the ranks, in place (spaco, stratified: the per-chunk counts of
  // supervised labels, so every rank draws its sample from the strata of the global batch).
  std::function<void(std::vector<double>&)> sum_over_ranks;
  // Told as a chunked step advances (seco, spaco): after each prefill chunk ("prefill") and each
  // reverse-sweep chunk backpropagated ("backward"), with the chunks done of the phase's total, so a
  // step of minutes can show where it is (tools/progress.h).
  std::function<void(const char* phase, int64_t done, int64_t total)> progress;
};

class Schedule {
 public:
  explicit Schedule(const ScheduleOptions& options) : options_(options) {}
  virtual ~Schedule() = default;

  // Adds the gradient of the batch's loss into grads (same config and dtype as the model).
  // normaliser 0: the batch's own supervised count. step_index seeds spaco's sample.
  virtual StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser = 0,
                         uint64_t step_index = 0) = 0;
  const ScheduleOptions& options() const { return options_; }
  // The hooks the following steps call (until set again).
  void set_hooks(StepHooks hooks) { hooks_ = std::move(hooks); }
  const StepHooks& hooks() const { return hooks_; }
  Arena& arena() { return arena_; }
  // The schedule's arena, rebuilt on `device` when it is elsewhere (a step on a GPU model plans its
  // activations in device memory).
  Arena& arena_on(Device device);

  static std::unique_ptr<Schedule> create(const ScheduleOptions& options);

 protected:
  ScheduleOptions options_;
  StepHooks hooks_;
  Arena arena_;
};

// Boundaries [0, c, 2c, ..., T] of chunks of length c (the last may be shorter).
std::vector<int64_t> chunk_bounds(int64_t T, int64_t c);

// A batch's ids and labels where a step's chunks run: on a GPU uploaded once (two copies and a wait
// a step, not a chunk's; a third with packed documents), on the CPU the batch's own tensors. Valid while the batch and the arena's
// scope around it are.
struct StepTokens {
  Tensor ids, labels;  // [B, T] i32
  int64_t sequence0 = 0;
  const std::vector<std::vector<int64_t>>* doc_starts = nullptr;  // the batch's packed documents, if any
  bool document_positions = true;
  // On a GPU with packed documents: each position's document start, int32 [B, T], uploaded with the
  // ids so that no layer's attention uploads (and waits for) its own (engine/ops/attention.h).
  Tensor first_keys = {};
  int64_t B() const { return ids.size(0); }
  int64_t T() const { return ids.size(1); }
};
StepTokens step_tokens(const Batch& batch, Arena& arena);
// Tokens [t0, t1) of every sequence: a view of one sequence's tokens, else copies in the arena (on the
// device, with no wait).
ChunkTokens slice_chunk(const StepTokens& tokens, int64_t t0, int64_t t1, Arena& arena,
                        const ContextParallelGroup* cp = nullptr);
// The same from a batch (its step_tokens: on a device arena the whole batch is uploaded each call, so
// a loop over a step's chunks takes step_tokens once instead).
ChunkTokens slice_chunk(const Batch& batch, int64_t t0, int64_t t1, Arena& arena);

}  // namespace cw

namespace cw {
// The batch's mean loss, forward only (chunks of `chunk` tokens; 0: whole sequence). No gradients; the
// model's RoPE tables grow to the batch's length (LlamaModel::ensure_positions), as a step's do.
double batch_loss(LlamaModel& model, const Batch& batch, int64_t chunk, Arena& arena, double normaliser = 0);
// The same with the schedule's chunk and its K/V store placed as its training step places it (an
// offload window, or streamed: model/kv_store.h), for an eval at a length whose store may not fit.
double batch_loss(LlamaModel& model, const Batch& batch, const ScheduleOptions& schedule, Arena& arena);
}  // namespace cw
