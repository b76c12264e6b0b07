// The schedule's arena over one training step, replayed request by request without memory: every
// buffer the model's chunk and layer code takes from it (model/llama.cpp, model/layer.cpp,
// optim/chunks.cpp, model/kv_store.cpp's streamed attention), and the scratch of each op as its
// backend exports it (engine/scratch.h, engine.h). On the CPU the replay's peak is the arena's own,
// byte for byte (tests/tools/planner/test_arena_replay.cpp).
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

// engine/memory.cpp's Arena without memory: the same block choice, tails and scopes. A request that
// does not fit the current block's tail moves on to the next block, the tail lost until a reset; a
// request larger than a block gets a block of its own.
class ArenaReplay {
 public:
  struct Mark {
    size_t block = 0, offset = 0, in_use = 0;
  };
  explicit ArenaReplay(size_t block_bytes) : block_bytes_(block_bytes) {}
  void alloc(size_t bytes);
  Mark mark() const { return {current_, offset_, in_use_}; }
  void reset(const Mark& m);
  size_t in_use() const { return in_use_; }
  size_t high_water() const { return high_water_; }  // Arena::high_water
  const std::vector<size_t>& blocks() const { return blocks_; }
  // Where to describe each block it adds (engine/memory.h arena_block_line), or nowhere.
  void log_blocks_to(std::vector<std::string>* log) { log_ = log; }

 private:
  size_t block_bytes_;
  std::vector<size_t> blocks_;
  size_t current_ = 0, offset_ = 0, in_use_ = 0, high_water_ = 0;
  std::vector<std::string>* log_ = nullptr;
};

// One step of `schedule` for B sequences of T tokens in `dtype` on `device` (a CPU or a GPU: their
// ops take different scratch; a GPU's attention is cuDNN's for bf16 and the flash kernels' for f32,
// as the engine chooses by default). block_bytes: the arena's block; 0: its default on `device`.
struct StepArenaInputs {
  const LlamaConfig& config;
  int64_t B = 1, T = 0;
  const ScheduleOptions& schedule;
  DType dtype = DType::bf16;
  const LoraConfig& lora;
  Device device = Device::gpu(0);
  size_t block_bytes = 0;
  bool documents = false;  // packed documents: on a GPU the step's [B, T] document starts (StepTokens)
  // Context parallelism (model/cp_group.h): one rank of cp, holding c/cp tokens of each chunk and
  // attending H/cp of the heads.
  int64_t cp = 1;
};

struct StepArena {
  size_t high_water = 0;                // the arena's peak in use (StepStats::activation_high_water)
  std::vector<size_t> blocks;           // the blocks it holds after the step (Arena::reserved is their sum)
  std::vector<std::string> block_lines;  // each block as CW_ARENA_LOG describes it
  // Device buffers of the step outside the arena: the checkpointed offload's two input slots
  // (engine/residency.h), each its own allocation.
  std::vector<size_t> input_slots;
  // The largest attention backward workspace replayed (cuDNN's, for the head reduction of GQA): bench
  // and train raise the engine's workspace budget to it. 0 on the CPU.
  size_t attention_workspace = 0;
  size_t reserved() const;
};

// The step's arena: the tokens and loss rows it keeps for the step, then every prefill chunk and
// every chunk of the reverse sweep in the order the schedule runs them (spaco: every chunk, the
// worst case of its sample), each layer's scratch once (the layers of a chunk take the same). A chunk
// whose requests are bounded by those of one replayed before it is skipped: it cannot change the
// arena (arena_replay.cpp says why), so a step of a thousand chunks replays a few.
StepArena replay_step_arena(const StepArenaInputs& in);

}  // namespace cw
