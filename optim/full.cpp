// The `full` schedule: plain backprop over the whole sequence, every activation kept. The reference
// that seco must reproduce exactly; also the fastest when the sequence fits. `checkpointed` is the
// same pass keeping only each layer's input and recomputing each layer before its backward.
#include "optim/schedules_impl.h"

namespace cw {

KVStore& step_store(std::optional<KVStore>& store, const LlamaModel& model, int64_t B, int64_t T) {
  if (!store || store->batch() != B || store->tokens() != T || store->dtype() != model.dtype() ||
      !(store->device() == model.device())) {
    store.reset();  // free the old store before allocating the new one
    store.emplace(model.config(), B, T, model.dtype(), true, model.device());
  }
  store->reset();
  return *store;
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
