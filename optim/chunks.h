// Internal to optim/: the chunk machinery every schedule is built from, the frame a step runs in, and
// the constructors of the concrete schedules.
//
// Chunk machinery: a chunk is tokens [t0, t1) of every sequence of the batch (chunk_bounds and
// slice_chunk, declared in schedule.h). `prefill` runs chunks forward keeping nothing but their K/V
// in the store; `backprop_chunk` recomputes one chunk keeping its activations and backprops its loss,
// the attention backward adding dK/dV of keys [0, t1) into the store's accumulators and the chunk's
// own K/V gradient read back from them (the relay from later chunks included).
//
// StepFrame: what every step does before and after its algorithm. Constructed, it counts the batch's
// labels, fixes the loss normaliser, extends the RoPE tables to T, takes the schedule's K/V store
// (rebuilt only when the shape changes, zeroed) and its arena on the model's device with the
// high-water mark reset, and sets the model's dropout round to the step index for the step (LoRA's
// dropout masks: every chunk of the step, prefill, recompute and backward, sees the same masks);
// finish() fills in StepStats (loss, chunks, the arena's peak, the store's bytes and what it moved
// to and from the host during the step).
#pragma once

#include "optim/schedule.h"

#include <optional>

namespace cw {

std::unique_ptr<Schedule> make_full_schedule(const ScheduleOptions& o);
std::unique_ptr<Schedule> make_seco_schedule(const ScheduleOptions& o);
std::unique_ptr<Schedule> make_spaco_schedule(const ScheduleOptions& o);

// The activation policy a schedule's options ask for (recompute = full keeps layer inputs only,
// selective drops the MLP's intermediates; every schedule may tile the MLP), for a model with `lora`'s
// adapters (a frozen MLP keeps gate and up only).
ActivationPolicy activation_policy(const ScheduleOptions& o, const LoraConfig& lora = {});

// Prefill: every chunk of `bounds` forward, nothing kept but K/V. Returns the summed loss when
// with_loss (spaco reports the whole batch's loss although it backprops only some chunks), or keeps
// the rows in `losses` when given (and returns 0).
// chunk_done (if set) is told (chunks done, chunks) after each.
double prefill(KVStore& kv, const LlamaModel& model, const StepTokens& tokens, const std::vector<int64_t>& bounds,
               double normaliser, bool with_loss, Arena& arena, int64_t mlp_shards,
               const std::function<void(int64_t, int64_t)>& chunk_done = {}, LossRows* losses = nullptr);

// Tokens [t0, t1) of every sequence: recompute the chunk through all layers keeping its
// activations (against the store's K/V of [0, t0)), then backprop its loss, adding parameter
// gradients into `grads` and K/V gradients into the store. Returns the chunk's loss (or keeps its
// rows in `losses`, returning 0). Everything it
// allocates is released on return. loss_weight scales the gradient (spaco's k/t); grads_final is
// told as parts of the gradient are complete (model/llama.h), set for a step's last chunk only.
double backprop_chunk(KVStore& kv, const LlamaModel& model, const StepTokens& tokens, int64_t t0, int64_t t1,
                      const ParamSet& grads, double normaliser, Arena& arena, const ActivationPolicy& policy,
                      double loss_weight = 1.0, const GradsFinalFrom& grads_final = {}, LossRows* losses = nullptr);

class StepFrame {
 public:
  // `store` is the schedule's, kept between steps; the options' offload_window places it.
  StepFrame(Schedule& schedule, std::optional<KVStore>& store, LlamaModel& model, const Batch& batch,
            double normaliser, uint64_t step_index);

  // The prefill chunks (options.chunk) of tokens [0, until) forward into the store (until < 0: all
  // T); with_loss: their losses are the step's.
  void prefill(bool with_loss, int64_t until = -1);
  // The reverse sweep's chunk boundaries (options.bwd_chunk, else options.chunk).
  std::vector<int64_t> sweep_bounds() const;
  // The index of the reverse-sweep chunk that starts at t0 (for traces).
  int64_t sweep_chunk_index(int64_t t0) const;
  // backprop_chunk of tokens [t0, t1) under the options' activation policy; count_loss: its loss is
  // the step's (spaco reports its prefill's instead).
  // last: this is the step's last chunk backward, so the schedule's grads_final hook is given to it.
  // Each call is reported to the hooks' progress as one of `backprops` (set by the schedule).
  void backprop(int64_t t0, int64_t t1, const ParamSet& grads, double loss_weight = 1.0, bool last = false,
                bool count_loss = true);
  int64_t backprops = 0;
  // The step's statistics: `chunks` reverse-sweep chunks of which `visited` were backpropagated; the
  // loss, the sum of the losses counted (read back here, once a step).
  StepStats finish(int64_t chunks, int64_t visited) const;

  const ScheduleOptions& options;
  const LlamaModel& model;
  const Batch& batch;
  const int64_t supervised;  // labels that carry loss
  const double norm;         // the loss normaliser
  KVStore& kv;
  Arena& arena;

 private:
  ArenaScope tokens_scope_;  // the tokens' device copies, for the step

 public:
  const StepTokens tokens;  // the batch's ids and labels where the chunks run (uploaded once a step)

 private:
  LossRows losses_;  // the losses counted, summed by finish()

 public:
  const StepHooks& hooks;

 private:
  const ActivationPolicy policy_;
  int64_t backprops_done_ = 0;
  const size_t moved_before_;  // the store's host <-> device bytes before the step
  DropoutRoundScope dropout_round_;
};

}  // namespace cw
