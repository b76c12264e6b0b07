// The `full` schedule: plain backprop over the whole sequence, every activation kept. The reference
// that seco must reproduce exactly; also the fastest when the sequence fits. `checkpointed` is the
// same pass keeping only each layer's input and recomputing each layer before its backward (the
// activation policy of the options; see model/layer.h).
//
//   One chunk, tokens [0, T): forward keeping the activations, then backward. The K/V store only
//   carries the chunk's own K/V from its forward to its backward.
#include "optim/chunks.h"

namespace cw {

namespace {
class FullSchedule : public Schedule {
 public:
  using Schedule::Schedule;

  StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser,
                 uint64_t step_index) override {
    StepFrame f(*this, store_, model, batch, normaliser, step_index);
    f.backprop(0, batch.T(), grads, 1.0, /*last=*/true);
    return f.finish(/*chunks=*/1, /*visited=*/1);
  }

 private:
  std::optional<KVStore> store_;
};
}  // namespace

std::unique_ptr<Schedule> make_full_schedule(const ScheduleOptions& o) { return std::make_unique<FullSchedule>(o); }

}  // namespace cw
