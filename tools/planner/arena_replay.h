// The schedule's arena over one training step on a GPU, replayed request by request without memory
// (engine/memory.cpp's block, tail and scope rules): the prefill chunk and the backward chunk that
// attends the most keys, each layer's buffers and each op's scratch.
#pragma once

#include "engine/dtype.h"
#include "model/config.h"
#include "model/lora.h"
#include "optim/schedule.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cw {

// One step of `schedule` for B sequences of T tokens in `dtype`.
struct StepArenaInputs {
  const LlamaConfig& config;
  int64_t B = 1, T = 0;
  const ScheduleOptions& schedule;
  DType dtype = DType::bf16;
  const LoraConfig& lora;
};

struct StepArena {
  std::vector<size_t> blocks;            // the blocks it holds after the step
  std::vector<std::string> block_lines;  // each block as CW_ARENA_LOG describes it
  // The largest attention backward workspace counted (cuDNN's, for the head reduction of GQA): bench
  // and train raise the engine's workspace budget to it.
  size_t attention_workspace = 0;
  size_t reserved() const;
};

StepArena replay_step_arena(const StepArenaInputs& in);

}  // namespace cw
