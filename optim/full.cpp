// The `full` schedule: plain backprop over the whole sequence, every activation kept. The reference
// that seco must reproduce exactly; also the fastest when the sequence fits. `checkpointed` is the
// same pass keeping only each layer's input and recomputing each layer before its backward.
#include "optim/schedules_impl.h"

namespace cw {

KVStore& step_store(std::optional<KVStore>& store, const LlamaModel& model, int64_t B, int64_t T,
                    int64_t offload_window, bool attention_outputs) {
  const int64_t window = offload_window >= model.config().num_hidden_layers ? 0 : offload_window;
  if (!store || store->batch() != B || store->tokens() != T || store->dtype() != model.dtype() ||
      !(store->device() == model.device()) || store->offload_window() != window ||
      store->has_outputs() != attention_outputs) {
    store.reset();  // free the old store before allocating the new one
    if (window > 0) check_host_memory(model, B, T, attention_outputs);
    store.emplace(model.config(), B, T, model.dtype(), true, model.device(), window, attention_outputs);
  }
  store->reset();
  return *store;
}

void check_host_memory(const LlamaModel& model, int64_t B, int64_t T, bool attention_outputs) {
  const size_t need = KVStore::host_bytes_needed(model.config(), B, T, model.dtype(), true, attention_outputs);
  const size_t have = host_memory_available();
  // Pinned memory cannot be swapped: leave the system a margin rather than risk a swap storm.
  if (have > 0 && need > have / 10 * 9)
    fail(fmt::format("the K/V store with offload needs {:.1f} GiB of host memory for {} x {} tokens; {:.1f} GiB are "
                     "available",
                     double(need) / double(1ull << 30), B, T, double(have) / double(1ull << 30)),
         "lower --seq or --batch, or free host memory (schedule.offload_window keeps only the window on the device)");
}

ActivationPolicy activation_policy(const ScheduleOptions& o) {
  const bool checkpointed = o.name == "checkpointed";
  ActivationPolicy p;
  p.keep_layers = !(checkpointed && o.recompute == "full");
  p.mlp_shards = o.mlp_shards;
  p.recompute_mlp = checkpointed && o.recompute == "selective";
  p.offload_inputs = checkpointed && o.offload;
  return p;
}

double prefill(KVStore& kv, const LlamaModel& model, const Batch& batch, const std::vector<int64_t>& bounds,
               double normaliser, bool with_loss, Arena& arena, int64_t mlp_shards) {
  double loss = 0;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    ArenaScope scope(arena);
    const ChunkTokens chunk = slice_chunk(batch, bounds[i], bounds[i + 1], arena);
    loss += forward_chunk(nullptr, kv, model, chunk, normaliser, with_loss, arena, mlp_shards);
  }
  return loss;
}

double step_normaliser(const Batch& batch, double given) {
  return given > 0 ? given : std::max<double>(1.0, static_cast<double>(batch.supervised()));
}

double backprop_chunk(KVStore& kv, const LlamaModel& model, const Batch& batch, int64_t t0, int64_t t1,
                      const ParamSet& grads, double normaliser, Arena& arena, const ActivationPolicy& policy,
                      double loss_weight) {
  ArenaScope scope(arena);
  const ChunkTokens chunk = slice_chunk(batch, t0, t1, arena);
  ChunkActivations act = ChunkActivations::allocate(arena, model.config(), batch.B(), chunk.c, model.dtype(), policy);
  forward_chunk(&act, kv, model, chunk, normaliser, false, arena);
  return backward_chunk(grads, act, kv, model, chunk, normaliser, arena, loss_weight);
}

namespace {
class FullSchedule : public Schedule {
 public:
  using Schedule::Schedule;

  StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser, uint64_t) override {
    StepStats st;
    st.supervised = batch.supervised();
    const double norm = step_normaliser(batch, normaliser);
    model.ensure_positions(batch.T());
    KVStore& kv = step_store(store_, model, batch.B(), batch.T());
    arena_on(model.device()).reset_high_water();
    st.loss = backprop_chunk(kv, model, batch, 0, batch.T(), grads, norm, arena_, activation_policy(options_));
    st.chunks = st.chunks_visited = 1;
    st.activation_high_water = arena_.high_water();
    st.kv_bytes = kv.bytes();
    return st;
  }

 private:
  std::optional<KVStore> store_;
};
}  // namespace

std::unique_ptr<Schedule> make_full_schedule(const ScheduleOptions& o) { return std::make_unique<FullSchedule>(o); }

}  // namespace cw
