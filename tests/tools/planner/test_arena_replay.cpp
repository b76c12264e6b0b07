// The planner's replay of the schedule's arena (tools/planner/arena_replay.h) against a real step's
// arena on the CPU, over a grid of schedules, chunkings, recompute policies, saved attention outputs
// and layer inputs, streamed and windowed stores, LoRA, batches of 1 and 2, two dtypes and a few
// tiny shapes: the arena's peak (StepStats::activation_high_water) and the blocks it holds are the
// replay's, byte for byte, with the arena's default block and with a block small enough that
// requests skip tails and take blocks of their own. The plan's K/V store on the CPU is the store's.
//
// What only a GPU can check: the GPU's own scratch (cuDNN's and the flash kernels' attention, the GPU
// LM head's block, the batch's upload), the caching pool's size classes and everything outside the
// arena (cuBLASLt's workspace, the CUDA context); they come from engine/scratch.h and engine.h, which
// the GPU code allocates by.
#include "tests/support.h"
#include "tools/planner/arena_replay.h"
#include "tools/planner/planner.h"

#include "parallel/comm.h"
#include "parallel/context_parallel.h"
#include "model/cp_group.h"

#include "engine/engine.h"
#include "model/llama.h"
#include "model/lora.h"
#include "optim/schedule.h"

#include <algorithm>
#include <string>
#include <vector>

using namespace cw;

namespace {
// An arena block smaller than one chunk's buffers at these shapes: requests cross block tails, and
// the larger ones (the LM head's logits, a layer's [N, F] tensors) take blocks of their own.
constexpr size_t kSmallBlock = size_t(4) << 10;

// A schedule in one line, its name and recompute mode as the options spell them.
ScheduleOptions schedule(const std::string& name, int64_t chunk = 0, const std::string& recompute = "auto") {
  ScheduleOptions o;
  o.kind = parse_schedule_kind(name);
  o.chunk = chunk;
  o.recompute = parse_recompute_mode(recompute);
  return o;
}

LoraConfig adapters(const std::string& targets, double dropout) {
  LoraConfig l;
  l.rank = 3;
  l.alpha = 6;
  l.targets = targets;
  l.dropout = dropout;
  l.seed = 5;
  return l;
}

struct Shape {
  const char* name;
  LlamaConfig config;
};

// The tiny preset (grouped K/V heads 2:1, FFN wider than the model), its multi-head form, a shape
// whose FFN is three times the width (automatic MLP shards: 3), and the Qwen presets (biases add no
// scratch; the per-head norms keep the raw q, k and take normed copies when fused), Mistral's
// window (the attention calls' scratch follows the window's keys, not all earlier ones) and Gemma 2
// (layers of two windows, post-norms).
std::vector<Shape> shapes() {
  LlamaConfig tiny = LlamaConfig::preset("tiny");
  LlamaConfig mha = tiny;
  mha.num_key_value_heads = mha.num_attention_heads;
  LlamaConfig wide = LlamaConfig::preset("tiny-tp");
  wide.intermediate_size = 3 * wide.hidden_size;
  wide.num_hidden_layers = 3;
  return {{"tiny", tiny},
          {"tiny, multi-head", mha},
          {"wide FFN, 3 layers", wide},
          {"qwen2 (q/k/v biases)", LlamaConfig::preset("tiny-qwen2")},
          {"qwen3 (per-head q/k norms)", LlamaConfig::preset("tiny-qwen3")},
          {"mistral (a window of 5 keys: each chunk's calls against its window's keys)", LlamaConfig::preset("tiny-mistral")},
          {"gemma2 (a sliding and a global layer, whose calls' scratch differs; the post-norms' outputs kept, their "
           "scratch, and the recompute's W_down product)",
           LlamaConfig::preset("tiny-gemma2")}};
}

struct Case {
  std::string name;
  ScheduleOptions schedule;
  int64_t T = 24;
};

std::vector<Case> schedules() {
  std::vector<Case> cases;
  const auto add = [&](const std::string& name, ScheduleOptions o, int64_t T = 24) { cases.push_back({name, o, T}); };
  add("full", schedule("full"));
  ScheduleOptions tiled = schedule("full");
  tiled.mlp_shards = 2;
  add("full, 2 MLP shards", tiled);
  add("checkpointed", schedule("checkpointed"));
  add("checkpointed, selective", schedule("checkpointed", 0, "selective"));
  ScheduleOptions automatic = schedule("checkpointed", 0, "selective");
  automatic.mlp_shards = 0;
  add("checkpointed, selective, automatic MLP shards", automatic);
  ScheduleOptions offloaded = schedule("checkpointed", 0, "full");
  offloaded.offload = true;
  add("checkpointed, inputs offloaded", offloaded);
  add("seco, chunk 8", schedule("seco", 8));
  add("seco, chunk 10 (a shorter last chunk)", schedule("seco", 10));
  add("seco, one chunk", schedule("seco", 24));
  add("seco, chunk 8, recompute full", schedule("seco", 8, "full"));
  add("seco, chunk 8, selective", schedule("seco", 8, "selective"));
  ScheduleOptions bwd = schedule("seco", 12);
  bwd.bwd_chunk = 6;
  add("seco, prefill 12, reverse 6", bwd);
  ScheduleOptions longer_bwd = schedule("seco", 6);
  longer_bwd.bwd_chunk = 9;
  add("seco, prefill 6, reverse 9", longer_bwd);
  ScheduleOptions saved = schedule("seco", 8);
  saved.save_attention = true;
  add("seco, chunk 8, saved attention", saved);
  ScheduleOptions saved_full = schedule("seco", 10, "full");
  saved_full.save_attention = true;
  add("seco, chunk 10, saved attention, recompute full", saved_full);
  ScheduleOptions inputs = schedule("seco", 8);
  inputs.save_inputs = true;
  add("seco, chunk 8, saved inputs", inputs);
  ScheduleOptions both = schedule("seco", 10, "selective");
  both.save_inputs = true;
  both.save_attention = true;
  add("seco, chunk 10, saved inputs and attention, selective", both);
  ScheduleOptions windowed = schedule("seco", 8);
  windowed.offload_window = 1;
  windowed.save_attention = true;
  add("seco, chunk 8, window of 1 layer, saved attention", windowed);
  ScheduleOptions streamed = schedule("seco", 8);
  streamed.stream_kv = true;
  add("seco, chunk 8, streamed store", streamed);
  ScheduleOptions streamed_saved = schedule("seco", 10, "full");
  streamed_saved.stream_kv = true;
  streamed_saved.save_attention = true;
  add("seco, chunk 10, streamed store, saved attention, recompute full", streamed_saved);
  add("spaco, chunk 8, every chunk", schedule("spaco", 8));
  ScheduleOptions spaco_inputs = schedule("spaco", 8, "selective");
  spaco_inputs.save_inputs = true;
  spaco_inputs.keep = 3;
  add("spaco, chunk 8, 3 of 3, saved inputs, selective", spaco_inputs);
  add("seco, chunk 64, 256 tokens", schedule("seco", 64), 256);
  add("full, 80 tokens (two query blocks)", schedule("full"), 80);
  return cases;
}

struct Adapters {
  const char* name;
  LoraConfig lora;
};

std::vector<Adapters> lora_variants() {
  return {{"", {}},
          {", LoRA on q, v (the MLP frozen)", adapters("q_proj,v_proj", 0.0)},
          {", LoRA on every linear, dropout 0.1", adapters("all-linear", 0.1)}};
}

// One step of the case on the CPU in `dtype`, its arena with blocks of `block` bytes, against the
// replay of the same step.
void check_step(const LlamaConfig& cf, const ScheduleOptions& o, int64_t B, int64_t T, DType dtype,
                const LoraConfig& lora, size_t block, const std::string& label) {
  CAPTURE(label);
  LlamaModel model(cf, dtype, Device::host(), nullptr, lora);
  init_parameters(model.params(), 3, cf.initializer_range);
  ParamSet grads(cf, model.trainable_table(), dtype);
  const Batch batch = random_batch(B, T, cf.vocab_size, 11);
  const std::unique_ptr<Schedule> s = Schedule::create(o);
  s->arena() = Arena(Device::host(), block);
  const StepStats st = s->step(model, batch, grads);
  const StepArena replay = replay_step_arena({cf, B, T, o, dtype, lora, Device::host(), block});
  CHECK(replay.high_water == st.activation_high_water);
  CHECK(replay.reserved() == s->arena().reserved());
  if (block != kHostArenaBlockBytes) return;
  // The plan on the CPU: its activations are the arena's blocks (the offloaded inputs' slots beside
  // them), its K/V store the store's bytes.
  const PlanReport plan = plan_step(cf, B, T, o, dtype, 1024, lora, false, {}, Device::host());
  size_t kv = 0, activations = 0;
  for (const auto& [name, bytes] : plan.device) {
    if (name == "kv") kv = bytes;
    if (name == "activations") activations = bytes;
  }
  size_t slots = 0;
  for (const size_t bytes : replay.input_slots) slots += bytes;
  CHECK(kv == st.kv_bytes);
  CHECK(activations == s->arena().reserved() + slots);
  CHECK(plan.context_bytes == 0);
}
}  // namespace

TEST_CASE("planner: the replayed arena is a CPU step's own, byte for byte, over a grid of schedules") {
  int steps = 0;
  for (const Shape& shape : shapes())
    for (const Case& c : schedules())
      for (const Adapters& a : lora_variants())
        for (const int64_t B : {1, 2})
          for (const size_t block : {kHostArenaBlockBytes, kSmallBlock}) {
            // Both dtypes on the tiny shape; f32 alone on the others (the replay is dtype-blind).
            const bool tiny = std::string(shape.name) == "tiny";
            const std::vector<DType> dtypes = tiny ? std::vector<DType>{DType::f64, DType::f32} : std::vector<DType>{DType::f32};
            for (const DType dtype : dtypes) {
              const std::string label = fmt::format("{}: {}{}, B {}, T {}, {}, arena blocks of {} bytes", shape.name,
                                                    c.name, a.name, B, c.T, dtype_name(dtype), block);
              check_step(shape.config, c.schedule, B, c.T, dtype, a.lora, block, label);
              ++steps;
            }
          }
  MESSAGE(steps, " steps checked");
}

namespace {
// A rank's context-parallel group that counts its exchanges and the bytes each puts on the link: of
// its buffer (P blocks, the heads-side tensor's size) all but the rank's own block.
class CountingGroup final : public ContextParallelGroup {
 public:
  explicit CountingGroup(Communicator& comm) : inner_(comm) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void to_heads_forward(const Tensor& x, const Tensor& y) override { count(y), inner_.to_heads_forward(x, y); }
  void to_heads_backward(const Tensor& dy, const Tensor& dx) override { count(dy), inner_.to_heads_backward(dy, dx); }
  void to_tokens_forward(const Tensor& x, const Tensor& y) override { count(x), inner_.to_tokens_forward(x, y); }
  void to_tokens_backward(const Tensor& dy, const Tensor& dx) override { count(dx), inner_.to_tokens_backward(dy, dx); }
  int64_t calls = 0;
  double bytes = 0;

 private:
  void count(const Tensor& heads) {
    ++calls;
    bytes += double(heads.bytes()) * double(size() - 1) / double(size());
  }
  ContextParallel inner_;
};
}  // namespace

TEST_CASE("planner: under context parallelism the replayed arena is each rank's own, byte for byte, the plan's K/V "
          "store its heads', and its all-to-alls the step's") {
  struct CpCase {
    const char* name;
    const char* preset;
    int cp;
    ScheduleOptions schedule;
    LoraConfig lora;
  };
  ScheduleOptions saved = schedule("seco", 8);
  saved.save_attention = true;
  saved.bwd_chunk = 4;
  ScheduleOptions tiled = schedule("checkpointed", 0, "selective");
  tiled.mlp_shards = 3;
  const std::vector<CpCase> cases = {
      {"tiny-tp, 2 ranks, seco chunk 8", "tiny-tp", 2, schedule("seco", 8), {}},
      {"tiny-tp, 8 ranks (K/V heads replicated), full", "tiny-tp", 8, schedule("full"), {}},
      {"tiny, 4 ranks, seco recompute full", "tiny", 4, schedule("seco", 8, "full"), {}},
      {"tiny, 2 ranks, seco saved attention, bwd chunk 4", "tiny", 2, saved, {}},
      {"tiny, 2 ranks, checkpointed selective, tiled MLP", "tiny", 2, tiled, {}},
      {"tiny-qwen3, 2 ranks, seco, LoRA with dropout", "tiny-qwen3", 2, schedule("seco", 8), adapters("all-linear", 0.1)},
      {"tiny-gemma2, 2 ranks, spaco", "tiny-gemma2", 2, schedule("spaco", 8), {}},
  };
  const int64_t B = 2, T = 24;
  for (const CpCase& c : cases) {
    CAPTURE(std::string(c.name));
    const LlamaConfig cf = LlamaConfig::preset(c.preset);
    std::vector<StepStats> stats(static_cast<size_t>(c.cp));
    std::vector<size_t> reserved(static_cast<size_t>(c.cp));
    std::vector<int64_t> calls(static_cast<size_t>(c.cp));
    std::vector<double> bytes(static_cast<size_t>(c.cp));
    run_thread_ranks(c.cp, [&](Communicator& comm) {
      LlamaModel model(cf, DType::f32, Device::host(), nullptr, c.lora);
      init_parameters(model.params(), 3, cf.initializer_range);
      CountingGroup group(comm);
      model.set_context_parallel(&group);
      ParamSet grads(cf, model.trainable_table(), DType::f32);
      const std::unique_ptr<Schedule> s = Schedule::create(c.schedule);
      stats[comm.rank()] = s->step(model, random_batch(B, T, cf.vocab_size, 11), grads);
      reserved[comm.rank()] = s->arena().reserved();
      calls[comm.rank()] = group.calls;
      bytes[comm.rank()] = group.bytes;
    });
    StepArenaInputs in{cf, B, T, c.schedule, DType::f32, c.lora, Device::host()};
    in.cp = c.cp;
    // The CPU attention's scratch is per kernel thread: a rank's share of the cores (run_thread_ranks).
    const CpuThreadsScope rank_threads(std::max(1, cpu_threads() / c.cp));
    const StepArena replay = replay_step_arena(in);
    MemoryBudget budget(1024);
    budget.cp_ranks = c.cp;
    const PlanReport plan = plan_step(cf, B, T, c.schedule, DType::f32, budget, c.lora, false, {}, Device::host());
    size_t kv = 0;
    for (const auto& [name, bytes] : plan.device)
      if (name == "kv") kv = bytes;
    for (int r = 0; r < c.cp; ++r) {
      CAPTURE(r);
      CHECK(replay.high_water == stats[r].activation_high_water);
      CHECK(replay.reserved() == reserved[r]);
      CHECK(kv == stats[r].kv_bytes);
      CHECK(plan.cp_all_to_alls == calls[r]);
      CHECK(plan.cp_exchange_bytes == doctest::Approx(bytes[r]).epsilon(1e-12));
    }
    CHECK(plan.cp == c.cp);
  }
}

TEST_CASE("planner: the replay takes the device's scratch: the GPU's differs from the CPU's where their ops do") {
  // The same step planned for a GPU adds the batch's upload (ids and labels), takes cuDNN's attention
  // scratch instead of the CPU's score blocks (at a head dim cuDNN takes, a multiple of 8; tiny's 6
  // goes to the flash kernels, which need no workspace), and the GPU LM head's block of up to 2048
  // rows instead of the CPU's 256.
  LlamaConfig cf = LlamaConfig::preset("tiny");
  const ScheduleOptions o = schedule("seco", 64);
  CHECK(replay_step_arena({cf, 1, 256, o, DType::bf16, {}, Device::gpu(0), 0}).attention_workspace == 0);
  cf.head_dim = 8;
  const StepArena cpu = replay_step_arena({cf, 1, 256, o, DType::f32, {}, Device::host(), 0});
  const StepArena gpu = replay_step_arena({cf, 1, 256, o, DType::bf16, {}, Device::gpu(0), 0});
  CHECK(cpu.attention_workspace == 0);
  CHECK(gpu.attention_workspace == size_t(2 * 256 * 4 * 8) * 2 + 256);  // B H S D staged twice in bf16, and 256
  CHECK(gpu.blocks.front() == kDeviceArenaBlockBytes);
  CHECK(cpu.blocks.front() == kHostArenaBlockBytes);
}
