// The `seco` schedule (Sequential Chunk-wise Optimization, Li et al. 2025).
//
//   1. Prefill: chunks of `chunk` tokens, first to last, through all layers with nothing saved but
//      each layer's post-RoPE K and V, written into the store.
//   2. Reverse sweep: chunks of `bwd_chunk` tokens, last to first. For chunk [s, e): recompute it
//      through all layers keeping its activations (attending the stored K/V of [0, s)), then backprop
//      its loss. Each layer's attention backward ADDS dK/dV for keys [0, e) into the store's
//      accumulators; the chunk's own K/V gradient is read from the accumulator over [s, e), which by
//      now holds its local part plus the contributions of every later chunk (they ran first), and is
//      carried through RoPE and the K/V projections. Then tokens [s, T) are released.
// Why it is exact: a token's K/V depend only on tokens at or before it, so every path from a loss to
// a parameter either stays inside a chunk or crosses into earlier tokens through K/V — and those
// crossings are exactly what the accumulators carry. The prefill and backward chunk sizes are
// independent for the same reason (the store can be re-split at any boundary).
// Memory: one chunk's activations at a time (O(bwd_chunk)), plus the store, which grows with T.
#include "optim/schedules_impl.h"

namespace cw {

namespace {
class SecoSchedule : public Schedule {
 public:
  using Schedule::Schedule;

  StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser, uint64_t) override {
    StepStats st;
    st.supervised = batch.supervised();
    const double norm = step_normaliser(batch, normaliser);
    const int64_t B = batch.B(), T = batch.T();
    model.ensure_positions(T);
    KVStore& kv = step_store(store_, model, B, T, options_.offload_window, options_.save_attention);
    const size_t moved_before = kv.bytes_moved();
    arena_on(model.device()).reset_high_water();
    prefill(kv, model, batch, chunk_bounds(T, options_.chunk), norm, false, arena_, options_.mlp_shards);
    const std::vector<int64_t> bounds = chunk_bounds(T, options_.bwd_chunk > 0 ? options_.bwd_chunk : options_.chunk);
    for (size_t i = bounds.size() - 1; i-- > 0;) {
      st.loss += backprop_chunk(kv, model, batch, bounds[i], bounds[i + 1], grads, norm, arena_,
                                activation_policy(options_));
      kv.release_from(bounds[i]);
    }
    st.chunks = st.chunks_visited = static_cast<int64_t>(bounds.size()) - 1;
    st.activation_high_water = arena_.high_water();
    st.kv_bytes = kv.bytes();
    st.kv_host_bytes = kv.host_bytes();
    st.kv_bytes_moved = kv.bytes_moved() - moved_before;
    return st;
  }

 private:
  std::optional<KVStore> store_;
};
}  // namespace

std::unique_ptr<Schedule> make_seco_schedule(const ScheduleOptions& o) { return std::make_unique<SecoSchedule>(o); }

}  // namespace cw
