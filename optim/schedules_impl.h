// Internal to optim/: constructors of the concrete schedules and the pieces seco and spaco share.
#pragma once

#include "optim/schedule.h"

#include <optional>

namespace cw {

std::unique_ptr<Schedule> make_full_schedule(const ScheduleOptions& o);
std::unique_ptr<Schedule> make_seco_schedule(const ScheduleOptions& o);
std::unique_ptr<Schedule> make_spaco_schedule(const ScheduleOptions& o);

// The K/V store a chunked schedule keeps between steps (rebuilt only when the shape changes).
// offload_window > 0 (and below the layer count): the store's layers live in host memory with that many
// on the device; host memory is checked first (a clear error, never a swap storm).
KVStore& step_store(std::optional<KVStore>& store, const LlamaModel& model, int64_t B, int64_t T,
                    int64_t offload_window = 0, bool attention_outputs = false);
void check_host_memory(const LlamaModel& model, int64_t B, int64_t T, bool attention_outputs = false);

// Prefill: every chunk of `bounds` forward, nothing kept but K/V. Returns the summed loss when
// with_loss (spaco reports the whole batch's loss although it backprops only some chunks).
double prefill(KVStore& kv, const LlamaModel& model, const Batch& batch, const std::vector<int64_t>& bounds,
               double normaliser, bool with_loss, Arena& arena, int64_t mlp_shards);

// The activation policy a schedule's options ask for (checkpointed with recompute = full keeps
// layer inputs only; every schedule may tile the MLP).
ActivationPolicy activation_policy(const ScheduleOptions& o);

// The step's loss normaliser: the caller's total over micro-batches, else the batch's own count of
// supervised labels (at least 1, so a batch with none gives loss 0 and no gradient).
double step_normaliser(const Batch& batch, double given);

// Tokens [t0, t1) of every sequence: recompute the chunk through all layers keeping its
// activations (against the store's K/V of [0, t0)), then backprop its loss, adding parameter
// gradients into `grads` and K/V gradients into the store. Returns the chunk's loss. Everything it
// allocates is released on return. loss_weight scales the gradient (spaco's k/t).
double backprop_chunk(KVStore& kv, const LlamaModel& model, const Batch& batch, int64_t t0, int64_t t1,
                      const ParamSet& grads, double normaliser, Arena& arena, const ActivationPolicy& policy,
                      double loss_weight = 1.0);

}  // namespace cw
