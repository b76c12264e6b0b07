// Internal to tools/planner: one step as the planner's parts see it (memory.cpp, time_model.cpp,
// plan_step.cpp), its settings resolved once.
#pragma once

#include "engine/dtype.h"
#include "model/config.h"
#include "model/lora.h"
#include "optim/schedule.h"
#include "tools/planner/planner.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cw {

inline constexpr double kGiB = double(size_t(1) << 30);

// The schedules with a prefill and a reverse sweep of chunks.
inline bool chunked(const ScheduleOptions& o) { return o.chunked(); }

// Whether the blocks can be cast from the master as they run (schedule.cast_layers; optim/training.h
// says why): bf16 compute beside an f32 master on the device, so neither LoRA (no master for the
// base) nor the optimizer offloaded (the master on the host).
inline bool can_cast_layers(DType dtype, const LoraConfig& lora, bool optimizer_offload) {
  return dtype == DType::bf16 && !lora.enabled() && !optimizer_offload;
}

struct StepPlan {
  const LlamaConfig& cf;
  int64_t B, T;
  const ScheduleOptions& o;
  DType dtype;
  const LoraConfig& lora;
  bool optimizer_offload;
  const std::vector<std::vector<int64_t>>& doc_starts;
  Device device;
  size_t e, acc;               // bytes of the compute and accumulation dtypes
  int64_t chunk, bwd_chunk;    // the prefill's and the reverse sweep's chunk lengths (T when not chunked)
  int64_t prefill_end;         // the prefill's tokens: seco leaves its last reverse chunk out
  bool saved, inputs;          // the store keeps attention outputs, layer inputs
  bool streamed, windowed;     // the store streamed in key blocks, or a window of its layers offloaded
  bool serial_copies;          // a window of one layer: its copies cannot run ahead of the compute
  bool cast;                   // the blocks cast from the master as they run
  bool streamed_optimizer;     // the offloaded optimizer's state streams through the device
  int64_t cp;                  // context-parallel ranks (1: none): the plan is one rank's
  LlamaConfig store;           // the K/V store's config: cf, or under context parallelism the rank's heads
};

// Fills the report's device and host memory by category (memory.cpp).
void plan_memory(const StepPlan& s, PlanReport& r);
// Fills the report's time by category, its step time, FLOPs, K/V bytes moved and casts (time_model.cpp).
void plan_time(const StepPlan& s, PlanReport& r);
// Context parallelism (s.cp > 1): the rank's all-to-alls and the bytes they and the gradient's
// all-reduce move a step (context_parallel.cpp).
void plan_context_parallel(const StepPlan& s, PlanReport& r);

}  // namespace cw
