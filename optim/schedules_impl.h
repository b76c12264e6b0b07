// Internal to optim/: constructors of the concrete schedules and the pieces seco and spaco share.
#pragma once

#include "optim/schedule.h"

#include <optional>

namespace cw {

std::unique_ptr<Schedule> make_full_schedule(const ScheduleOptions& o);
std::unique_ptr<Schedule> make_seco_schedule(const ScheduleOptions& o);
std::unique_ptr<Schedule> make_spaco_schedule(const ScheduleOptions& o);

// The K/V store a chunked schedule keeps between steps (rebuilt only when the shape changes).
KVStore& step_store(std::optional<KVStore>& store, const LlamaModel& model, int64_t B, int64_t T);

// Prefill: every chunk of `bounds` forward, nothing kept but K/V. Returns the summed loss when
// with_loss (spaco reports the whole batch's loss although it backprops only some chunks).
double prefill(KVStore& kv, const LlamaModel& model, const Batch& batch, const std::vector<int64_t>& bounds,
               double normaliser, bool with_loss, Arena& arena);

}  // namespace cw
