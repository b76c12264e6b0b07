// Shared by the planner's tests (test_plan.cpp: the memory and time model against the recorded runs;
// test_plan_auto.cpp: what auto chooses): the models planned and the schedules written briefly.
#pragma once

#include "model/config.h"
#include "model/lora.h"
#include "optim/schedule.h"

#include <string>

namespace cw::test {

// A schedule in one line: its name, chunk, recompute (both as the options spell them), MLP shards and
// whether the kept inputs are offloaded.
inline ScheduleOptions sched(const std::string& name, int64_t chunk = 0, const std::string& recompute = "auto",
                             int64_t mlp_shards = 1, bool offload = false) {
  ScheduleOptions o;
  o.kind = parse_schedule_kind(name);
  o.chunk = chunk;
  o.recompute = parse_recompute_mode(recompute);
  o.mlp_shards = mlp_shards;
  o.offload = offload;
  return o;
}

// seco with chunk and offload window left to the planner (auto).
inline ScheduleOptions auto_seco() {
  ScheduleOptions o = sched("seco", kAuto);
  o.offload_window = kAuto;
  return o;
}

// With the prefill's attention outputs saved, optionally the K/V store offloaded with a window.
inline ScheduleOptions saved(ScheduleOptions o, int64_t offload_window = 0) {
  o.save_attention = true;
  o.offload_window = offload_window;
  return o;
}

inline const LlamaConfig& one_b() {
  static const LlamaConfig c = LlamaConfig::preset("llama-3.2-1b");
  return c;
}

inline const LlamaConfig& eight_b_config() {
  static const LlamaConfig c = LlamaConfig::preset("llama-3.1-8b");
  return c;
}

// The SeCO paper's adapters: rank 8, alpha 16 (the default), on q_proj and v_proj.
inline LoraConfig paper_lora() {
  LoraConfig l;
  l.rank = 8;
  l.alpha = 16;
  l.targets = "q_proj,v_proj";
  return l;
}

}  // namespace cw::test
