// The `seco` schedule (Sequential Chunk-wise Optimization, Li et al. 2025).
//
//   1. Prefill: chunks of `chunk` tokens, first to last, through all layers with nothing saved but
//      each layer's post-RoPE K and V, written into the store; up to the start of the reverse
//      sweep's last chunk, which nothing before it attends: step 2 runs its forward first anyway
//      (one chunk: no prefill at all, the step is a plain forward and backward).
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
// With schedule.save_inputs the prefill runs over all T and also keeps each layer's input, and step 2
// runs no chunk forward: each layer is recomputed from its saved input just before its backward
// (model/llama.h backward_chunk_from_store).
// With schedule.save_attention the prefill also keeps each layer's attention output and lse in the
// store, and step 2's recompute reads them instead of attending again (model/kv_store.h): the same
// values, one attention forward fewer per token.
#include "optim/chunks.h"

namespace cw {

namespace {
class SecoSchedule : public Schedule {
 public:
  using Schedule::Schedule;

  StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser,
                 uint64_t step_index) override {
    StepFrame f(*this, store_, model, batch, normaliser, step_index);
    const std::vector<int64_t> b = f.sweep_bounds();
    f.backprops = static_cast<int64_t>(b.size()) - 1;
    // 1. K/V of the tokens before the last chunk; with saved inputs of every chunk, so that no reverse
    // chunk runs a forward pass.
    f.prefill(/*with_loss=*/false, /*until=*/options_.save_inputs ? batch.T() : b[b.size() - 2]);
    for (size_t i = b.size() - 1; i-- > 0;) {  // 2. chunks last to first
      // Reads dK/dV relayed by later chunks, adds its own; chunk 0 is the step's last backward.
      f.backprop(b[i], b[i + 1], grads, 1.0, /*last=*/i == 0);
      f.kv.release_from(b[i]);
    }
    const int64_t k = static_cast<int64_t>(b.size()) - 1;
    return f.finish(/*chunks=*/k, /*visited=*/k);
  }

 private:
  std::optional<KVStore> store_;
};
}  // namespace

std::unique_ptr<Schedule> make_seco_schedule(const ScheduleOptions& o) { return std::make_unique<SecoSchedule>(o); }

}  // namespace cw
