// ZeRO 3 (parallel/zero3.h) on the threads backend, in f64: the shard layout tiles every tensor, the
// ranks against one process (`gradcheck --zero 3 --against single`, every schedule, 2 and 4 ranks, a
// model of four blocks so the buffer pool must gather again), the planner's counts and bytes against
// a run's counters, what a skipped gather or a reduce-scatter replaced by a local copy does to the
// result (the checks fail), the optimizer offloaded on the shard, the shard checkpoints (resume bit
// for bit, consolidation to the whole model), the ranks' results through --gather-dir (a launched
// gradcheck's path) and the refusals.
#include "optim/adamw.h"
#include "parallel/zero3.h"
#include "tests/support.h"
#include "tools/gradcheck.h"
#include "tools/plan.h"
#include "tools/planner/planner.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstring>
#include <fstream>
#include <sstream>

using namespace cw;

namespace {

using test::contains;
using test::max_rel_err;

// tiny with four blocks: more blocks than the pool's two buffers, so passes gather again.
LlamaConfig deep_tiny() {
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.num_hidden_layers = 4;
  return c;
}

std::string write_config(const test::TempDir& dir, const LlamaConfig& c) {
  const std::string path = dir.file("config.json");
  std::ofstream(path) << c.to_json().dump(2);
  return path;
}

ParamSet initial_params(const LlamaConfig& c) {
  ParamSet p(c, DType::f64);
  init_parameters(p, 11, c.initializer_range, /*norm_jitter=*/0.1);
  return p;
}

bool same_bits(const ParamSet& a, const ParamSet& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.flat().data, b.flat().data, a.bytes()) == 0;
}

// Sequences [first, first + count) of a batch.
Batch rows(const Batch& batch, int64_t first, int64_t count) {
  Batch part{OwnedTensor(DType::i32, {count, batch.T()}), OwnedTensor(DType::i32, {count, batch.T()})};
  copy_convert(part.ids, batch.ids.tensor.slice(0, first, count));
  copy_convert(part.labels, batch.labels.tensor.slice(0, first, count));
  part.sequence0 = first;
  return part;
}

// Every schedule, seco with one prefill chunk per backward chunk, with other lengths and with saved
// inputs (a reverse sweep without forwards), spaco visiting half of its chunks.
struct ScheduleCase {
  const char* name;
  ScheduleOptions schedule;
};
std::vector<ScheduleCase> schedule_cases() {
  return {{"full", {.kind = ScheduleKind::full}},
          {"checkpointed", {.kind = ScheduleKind::checkpointed}},
          {"seco", {.kind = ScheduleKind::seco, .chunk = 4}},
          {"seco bwd-chunk", {.kind = ScheduleKind::seco, .chunk = 5, .bwd_chunk = 3}},
          {"seco saved inputs", {.kind = ScheduleKind::seco, .save_inputs = true, .chunk = 4}},
          {"spaco", {.kind = ScheduleKind::spaco, .chunk = 4, .keep = 2, .seed = 3}}};
}

// One micro-batch: rank r's sequences of the batch.
std::vector<Batch> micro(const Batch& batch, int rank) {
  std::vector<Batch> m;
  m.push_back(rows(batch, rank, 1));
  return m;
}

// A communicator that passes every collective through, except the one broken on purpose.
enum class Fault { none, skipped_gather, local_reduce_scatter };
class FaultyComm final : public Communicator {
 public:
  FaultyComm(Communicator& inner, Fault fault) : inner_(inner), fault_(fault) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Device device() const override { return inner_.device(); }
  std::string backend() const override { return inner_.backend(); }
  std::unique_ptr<CommWork> all_reduce(const Tensor& t) override { return inner_.all_reduce(t); }
  std::unique_ptr<CommWork> reduce(const Tensor& t, int root) override { return inner_.reduce(t, root); }
  std::unique_ptr<CommWork> reduce_scatter(const Tensor& out, const Tensor& in) override {
    if (fault_ != Fault::local_reduce_scatter) return inner_.reduce_scatter(out, in);
    copy_convert(out, in.slice(0, rank() * out.numel(), out.numel()));  // this rank's part, unsummed
    return std::make_unique<Done>();
  }
  std::unique_ptr<CommWork> all_gather(const Tensor& out, const Tensor& in) override {
    if (fault_ == Fault::skipped_gather && ++gathers_ % 3 == 0) return std::make_unique<Done>();  // every third
    return inner_.all_gather(out, in);
  }
  std::unique_ptr<CommWork> all_to_all(const Tensor& out, const Tensor& in) override {
    return inner_.all_to_all(out, in);
  }
  std::unique_ptr<CommWork> broadcast(const Tensor& t, int root) override { return inner_.broadcast(t, root); }
  void barrier() override { inner_.barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override { return inner_.split(color, key); }

 private:
  struct Done final : CommWork {
    void wait() override {}
  };
  Communicator& inner_;
  Fault fault_;
  int64_t gathers_ = 0;
};

}  // namespace

TEST_CASE("zero 3 layout: every tensor's elements in exactly one rank's shard, units split evenly") {
  for (const char* preset : {"tiny", "tiny-qwen2", "tiny-qwen3"})
    for (int ranks : {1, 2, 3, 4, 7}) {
      CAPTURE(preset);
      CAPTURE(ranks);
      const LlamaConfig c = LlamaConfig::preset(preset);
      const ShardLayout layout(parameter_table(c), ranks);
      CHECK(layout.layers() == c.num_hidden_layers);
      int64_t total = 0;
      for (size_t u = 0; u < layout.units().size(); ++u) {
        int64_t lengths = 0;
        for (int r = 0; r < ranks; ++r) lengths += layout.length(r, u);
        CHECK(lengths == layout.units()[u].numel);
        CHECK(layout.units()[u].part * ranks >= layout.units()[u].numel);
        CHECK(layout.units()[u].part * (ranks - 1) < layout.units()[u].numel);
        total += lengths;
      }
      CHECK(total == c.parameter_count());
      // Round trip: sharded and assembled again, every element back in place.
      const ParamSet whole = initial_params(c);
      std::vector<ParamSet> shards;
      for (int r = 0; r < ranks; ++r) {
        shards.emplace_back(c, layout.shard_table(r), DType::f64);
        shard_from_whole(shards.back(), layout, r, whole);
      }
      std::vector<const ParamSet*> pointers;
      for (const ParamSet& s : shards) pointers.push_back(&s);
      ParamSet back(c, DType::f64);
      assemble_from_shards(back, layout, pointers);
      CHECK(same_bits(back, whole));
    }
}

// `gradcheck --dp N --zero 3 --seq 16 --batch 4 --schedule ...` on `model`.
GradcheckOptions zero3_check(const std::string& model, const ScheduleOptions& schedule, int64_t dp) {
  GradcheckOptions o;
  o.model = model;
  o.seq = 16;
  o.batch = 4;
  o.schedule = schedule;
  o.parallel.dp = dp;
  o.parallel.zero = 3;
  return o;
}

TEST_CASE("zero 3 gradcheck: DP 2 and 4 against one process, every schedule (f64, <= 1e-12)") {
  const test::TempDir dir("zero3-gradcheck");
  const std::string model = write_config(dir, deep_tiny());
  const std::vector<ScheduleCase> cases = schedule_cases();
  for (const ScheduleCase& c : cases)
    for (int64_t dp : {2, 4}) {
      CAPTURE(c.name);
      CAPTURE(dp);
      const GradcheckOptions o = zero3_check(model, c.schedule, dp);
      std::ostringstream out;
      const int code = run_gradcheck(o, out);
      INFO(out.str());
      CHECK(code == 0);
      CHECK(max_rel_err(out.str()) <= test::kSameMathF64Tol);
      CHECK(contains(out.str(), ": yes\n"));
      CHECK(contains(out.str(), "zero 3: first step"));
      if (o.schedule.one_backward_chunk(o.seq)) CHECK(contains(out.str(), "parameters bitwise identical"));
    }
}

TEST_CASE("zero 3 with LoRA: the base sharded and frozen, the adapters against one process, every schedule (f64, <= 1e-12)") {
  const test::TempDir dir("zero3-lora");
  const std::string model = write_config(dir, deep_tiny());
  for (const ScheduleCase& c : schedule_cases())
    for (int64_t dp : {2, 4}) {
      CAPTURE(c.name);
      CAPTURE(dp);
      GradcheckOptions o = zero3_check(model, c.schedule, dp);
      o.lora.rank = 4;
      o.lora.targets = "q_proj,v_proj,down_proj";
      o.lora.dropout = 0.1;
      std::ostringstream out;
      const int code = run_gradcheck(o, out);
      INFO(out.str());
      CHECK(code == 0);
      CHECK(max_rel_err(out.str()) <= test::kSameMathF64Tol);
      CHECK(contains(out.str(), "adapter parameters checked, the base frozen"));
      CHECK(contains(out.str(), ": yes\n"));
      // The frozen base is gathered but never reduced; the adapters' gradient is one all-reduce.
      CHECK(contains(out.str(), "0 block and 0 outside-block gradient reduce-scatters; "));
      CHECK(contains(out.str(), "zero 3, 1 gradient reductions, 0 launched inside the last backward"));
      // The adapters' gradient is summed over the backward chunks and then all-reduced once, as ZeRO 0
      // does: the same bits as ZeRO 0 with any number of chunks.
      CHECK(contains(out.str(), "zero 3 against zero 0 after 3 steps: parameters bitwise identical"));
    }
}

TEST_CASE("zero 3 gradcheck --gather-dir: the ranks' results through files, as a launched world's, give the same check") {
  // A launched world (one process per GPU, NCCL) hands each rank's gathered gradient, parameters and
  // counts to rank 0 through --gather-dir; thread ranks given the option take the same path.
  const test::TempDir dir("zero3-gather");
  GradcheckOptions o;
  o.model = write_config(dir, deep_tiny());
  o.seq = 16;
  o.batch = 4;
  o.parallel.zero = 3;
  o.optimizer_steps = 2;
  for (const ScheduleCase& c : {schedule_cases()[1], schedule_cases()[2]})  // one backward chunk, and several
    for (int64_t dp : {1, 2}) {  // 1: a launched world of one rank
      CAPTURE(c.name);
      CAPTURE(dp);
      o.schedule = c.schedule;
      o.parallel.dp = dp;
      o.against = "single";
      o.gather_dir.clear();
      std::ostringstream direct, gathered;
      CHECK(run_gradcheck(o, direct) == 0);
      o.gather_dir = (dir.path / fmt::format("{}-dp{}", c.schedule.chunk, dp)).string();
      CHECK(run_gradcheck(o, gathered) == 0);
      INFO(gathered.str());
      CHECK(gathered.str() == direct.str());  // every figure, the counts of gathers and reduce-scatters too
      CHECK(contains(gathered.str(), fmt::format("zero 3: first step, rank 0: {} block gathers",
                                                 c.schedule.one_backward_chunk(o.seq) ? 6 : 30)));  // docs/zero3.md
      CHECK(std::filesystem::exists(std::filesystem::path(o.gather_dir) / "zero3" / fmt::format("rank-{}.safetensors", dp - 1)));
      CHECK(std::filesystem::exists(std::filesystem::path(o.gather_dir) / "zero0" / "rank-0.safetensors"));
    }
}

TEST_CASE("zero 3: the planner's gathers, reduce-scatters and bytes are a run's counters (full-parameter and LoRA)") {
  const std::vector<ScheduleCase> cases = schedule_cases();
  for (const LlamaConfig& c : {LlamaConfig::preset("tiny"), deep_tiny()})
    for (const ScheduleCase& k : cases)
      for (int ranks : {2, 3})
        for (const int64_t lora_rank : {0, 2}) {
        CAPTURE(k.name);
        CAPTURE(c.num_hidden_layers);
        CAPTURE(ranks);
        CAPTURE(lora_rank);
        const LoraConfig lora{.rank = lora_rank};
        const int64_t T = 16;
        const Batch batch = random_batch(ranks, T, c.vocab_size, 5);
        std::vector<Zero3Counts> counts(static_cast<size_t>(ranks));
        size_t shard_bytes = 0, buffer_bytes = 0;  // rank 0's, the largest shard
        run_thread_ranks(ranks, [&](Communicator& comm) {
          ParallelOptions po{.dp = ranks, .zero = 3};
          ShardedDataParallel dp(comm, c, DType::f64, AdamWOptions{}, po, false, lora);
          dp.shards().load(initial_params(c));
          auto schedule = Schedule::create(k.schedule);
          for (int step = 0; step < 2; ++step) {  // the second step starts after an optimizer step
            dp.compute_gradients(*schedule, micro(batch, comm.rank()), static_cast<uint64_t>(step));
            dp.optimizer_step(1e-3);
          }
          counts[static_cast<size_t>(comm.rank())] = dp.step_counts();
          if (comm.rank() == 0) shard_bytes = dp.shards().shard_bytes(), buffer_bytes = dp.shards().buffer_bytes();
        });
        const Zero3Plan p = plan_zero3(c, T, k.schedule, DType::f64, ranks, false, Device::host(), lora);
        if (lora.enabled()) CHECK(p.block_reduce_scatters + p.outside_reduce_scatters == 0);
        CHECK(shard_bytes == p.shard_bytes);
        CHECK(buffer_bytes == p.gathered_buffer_bytes + p.gradient_buffer_bytes);
        for (const Zero3Counts& z : counts) {
          CHECK(z.block_gathers == p.block_gathers);
          CHECK(z.reuses == p.reuses);
          CHECK(z.outside_gathers == p.outside_gathers);
          CHECK(z.block_reduce_scatters == p.block_reduce_scatters);
          CHECK(z.outside_reduce_scatters == p.outside_reduce_scatters);
          CHECK(z.gathered_bytes == p.gathered_bytes);
          CHECK(z.scattered_bytes == p.scattered_bytes);
        }
      }
}

TEST_CASE("zero 3: a skipped gather or a reduce-scatter replaced by a local copy changes the result") {
  const LlamaConfig c = deep_tiny();
  const Batch batch = random_batch(2, 12, c.vocab_size, 5);
  const auto run = [&](Fault fault) {
    std::vector<double> loss(2);
    std::optional<ParamSet> grads;
    run_thread_ranks(2, [&](Communicator& inner) {
      FaultyComm comm(inner, fault);
      ShardedDataParallel dp(comm, c, DType::f64, AdamWOptions{}, ParallelOptions{.dp = 2, .zero = 3});
      dp.shards().load(initial_params(c));
      auto schedule = Schedule::create({.kind = ScheduleKind::seco, .chunk = 4});
      loss[static_cast<size_t>(comm.rank())] = dp.compute_gradients(*schedule, micro(batch, comm.rank()), 0).loss;
      ParamSet whole = dp.shards().gather_whole(dp.shards().grads());
      if (comm.rank() == 0) grads.emplace(std::move(whole));
    });
    return std::make_pair(loss[0], std::move(*grads));
  };
  const auto [loss, grads] = run(Fault::none);
  const auto [skipped_loss, skipped_grads] = run(Fault::skipped_gather);
  CHECK(std::abs(skipped_loss - loss) > 1e-6 * std::abs(loss));
  const auto [local_loss, local_grads] = run(Fault::local_reduce_scatter);
  CHECK(local_loss == loss);  // the forward is untouched
  CHECK(test::compare(local_grads.flat(), grads.flat()).rel > 1e-3);
}

TEST_CASE("zero 3: the optimizer offloaded on the shard gives the bits of the shard's AdamW") {
  const LlamaConfig c = deep_tiny();
  const Batch batch = random_batch(2, 12, c.vocab_size, 5);
  const auto run = [&](bool offload) {
    std::optional<ParamSet> params;
    run_thread_ranks(2, [&](Communicator& comm) {
      ShardedDataParallel dp(comm, c, DType::f64, AdamWOptions{}, ParallelOptions{.dp = 2, .zero = 3}, offload);
      CHECK(dp.shards().optimizer_offloaded() == offload);
      dp.shards().load(initial_params(c));
      auto schedule = Schedule::create({.kind = ScheduleKind::seco, .chunk = 4});
      for (int s = 0; s < 3; ++s) {
        dp.compute_gradients(*schedule, micro(batch, comm.rank()), static_cast<uint64_t>(s));
        dp.clip_gradients(0.5);
        dp.optimizer_step(1e-2);
      }
      ParamSet whole = dp.shards().gather_whole(dp.shards().master());
      if (comm.rank() == 0) params.emplace(std::move(whole));
    });
    return std::move(*params);
  };
  const ParamSet on_device = run(false), offloaded = run(true);
  CHECK(same_bits(offloaded, on_device));
  CHECK(!same_bits(on_device, initial_params(c)));
}

TEST_CASE("zero 3 checkpoints: each rank's shard, a resume bit for bit, the whole model consolidated") {
  const LlamaConfig c = deep_tiny();
  const Batch batch = random_batch(3, 12, c.vocab_size, 5);
  const test::TempDir dir("zero3-checkpoint");
  const auto shard_path = [&](int r) { return dir.file(fmt::format("zero3-rank-{}.safetensors", r)); };
  const ScheduleOptions so{.kind = ScheduleKind::seco, .chunk = 4, .bwd_chunk = 5};
  // Five steps straight, and two steps, a save, a fresh state loading it, three more.
  const auto run = [&](bool resume) {
    std::vector<double> losses;
    std::optional<ParamSet> params, saved;
    run_thread_ranks(3, [&](Communicator& comm) {
      const ParallelOptions po{.dp = 3, .zero = 3};
      auto dp = std::make_unique<ShardedDataParallel>(comm, c, DType::f64, AdamWOptions{}, po);
      dp->shards().load(initial_params(c));
      auto schedule = Schedule::create(so);
      for (int s = 0; s < 5; ++s) {
        if (resume && s == 2) {
          dp->save_shard(shard_path(comm.rank()));
          comm.barrier();
          ParamSet whole = dp->shards().gather_whole(dp->shards().master());
          if (comm.rank() == 0) saved.emplace(std::move(whole));
          dp = std::make_unique<ShardedDataParallel>(comm, c, DType::f64, AdamWOptions{}, po);
          dp->load_shard(shard_path(comm.rank()));
        }
        const double loss = dp->compute_gradients(*schedule, micro(batch, comm.rank()), static_cast<uint64_t>(s)).loss;
        if (comm.rank() == 0) losses.push_back(loss);
        dp->optimizer_step(1e-2);
      }
      ParamSet whole = dp->shards().gather_whole(dp->shards().master());
      if (comm.rank() == 0) params.emplace(std::move(whole));
    });
    return std::make_tuple(losses, std::move(*params), std::move(saved));
  };
  const auto [straight_losses, straight, none] = run(false);
  const auto [resumed_losses, resumed, saved] = run(true);
  CHECK(resumed_losses == straight_losses);
  CHECK(same_bits(resumed, straight));
  // The three shard files make the whole model the ranks held when they were written.
  const ParamSet consolidated = consolidate_shards(c, {shard_path(0), shard_path(1), shard_path(2)});
  REQUIRE(saved.has_value());
  CHECK(same_bits(consolidated, *saved));
  // Gathered unit by unit onto one rank (a sample's path): that rank gets the whole set's bits, the
  // others nothing.
  std::optional<ParamSet> rooted;
  std::array<bool, 3> others_nothing{};
  run_thread_ranks(3, [&](Communicator& comm) {
    ShardedDataParallel dp(comm, c, DType::f64, AdamWOptions{}, ParallelOptions{.dp = 3, .zero = 3});
    dp.shards().load(straight);
    std::optional<ParamSet> mine = dp.shards().gather_whole_to(dp.shards().master(), /*root=*/1);
    if (comm.rank() == 1) rooted = std::move(mine);
    else others_nothing[static_cast<size_t>(comm.rank())] = !mine.has_value();
  });
  REQUIRE(rooted.has_value());
  CHECK(same_bits(*rooted, straight));
  CHECK(others_nothing[0]);
  CHECK(others_nothing[2]);
  // A shard file is one rank's of one world size.
  CHECK_THROWS_WITH_AS(consolidate_shards(c, {shard_path(0), shard_path(1)}),
                       doctest::Contains("not one of 2 ZeRO 3 shards (its metadata says 3 ranks)"), Error);
  // A rank given another rank's shard is refused in one line naming both.
  CHECK_THROWS_WITH_AS(run_thread_ranks(3,
                                        [&](Communicator& comm) {
                                          ShardedDataParallel dp(comm, c, DType::f64, AdamWOptions{},
                                                                 ParallelOptions{.dp = 3, .zero = 3});
                                          dp.load_shard(shard_path((comm.rank() + 1) % 3));
                                        }),
                       doctest::Contains("of 3 (zero 3), but this is rank"), Error);
}

TEST_CASE("zero 3 refusals: with tensor parallelism") {
  ParallelOptions po{.dp = 2, .zero = 3, .tp = 2};
  CHECK_THROWS_WITH_AS(po.validate(), doctest::Contains("parallel.zero = 3 does not combine with parallel.tp = 2"), Error);
}

TEST_CASE("plan --zero 3: Llama-3.1-8B at 64K tokens in 8K chunks on 8 ranks, the figures of docs/zero3.md") {
  PlanOptions po;
  po.model = "llama-3.1-8b";
  po.seq = 65536;
  po.schedule = {.kind = ScheduleKind::seco, .chunk = 8192};
  po.dp = 8;
  po.zero = 3;
  po.device_memory_gib = 140;
  std::ostringstream out;
  CHECK(run_plan(po, out) == 0);
  INFO(out.str());
  // 7 prefill chunks and 8 reverse chunks of 32 blocks, two blocks reused at each of 15 turns.
  CHECK(contains(out.str(), "per step 706 block all-gathers (30 blocks reused from their buffer), 15 of the outside "
                            "unit; 256 block and 8 outside reduce-scatters"));
  CHECK(contains(out.str(), "at NVLink 450 GB/s: 1.160 s"));
  CHECK(contains(out.str(), "shard               14.96"));
  CHECK(!contains(out.str(), "gradients"));  // no whole-model gradient
  // With LoRA on every linear: the frozen base's shard, the same gathers less the blocks a step's
  // first pass still finds from the step before, no reduce-scatter, the adapters' state whole.
  po.lora = {.rank = 16, .targets = "all-linear"};
  std::ostringstream lora_out;
  CHECK(run_plan(po, lora_out) == 0);
  INFO(lora_out.str());
  CHECK(contains(lora_out.str(), "per step 704 block all-gathers (32 blocks reused from their buffer), 15 of the "
                                 "outside unit; 0 block and 0 outside reduce-scatters"));
  CHECK(contains(lora_out.str(), "shard                1.87"));
  CHECK(contains(lora_out.str(), "adapters             0.08"));
  CHECK(!contains(lora_out.str(), "grad buffers"));
  po.optimizer_offload = true;
  CHECK_THROWS_WITH_AS(run_plan(po, out), doctest::Contains("the adapters' optimizer stays on the device"), Error);
  po.optimizer_offload = false;
  po.lora = {};
  po.tp = 2;
  CHECK_THROWS_WITH_AS(run_plan(po, out), doctest::Contains("not with --tp"), Error);
}

TEST_CASE("plan --zero 3 --chunk auto: the choice is made for one rank, where the whole model's state would not fit") {
  // Llama-3.1-8B's whole state (bf16 weights, f32 master, moments and gradient) is 16 bytes a
  // parameter, more than 140 GiB: no chunk fits one process; on 8 ZeRO 3 ranks auto finds one.
  PlanOptions po;
  po.model = "llama-3.1-8b";
  po.seq = 65536;
  po.schedule = {.kind = ScheduleKind::seco, .chunk = kAuto};
  po.device_memory_gib = 140;
  po.host_memory_gib = 1024;
  std::ostringstream whole;
  CHECK_THROWS_WITH_AS(run_plan(po, whole), doctest::Contains("out of memory at every chunk length"), Error);
  po.dp = 8;
  po.zero = 3;
  std::ostringstream rank;
  CHECK(run_plan(po, rank) == 0);
  INFO(rank.str());
  CHECK(contains(rank.str(), "zero 3 over 8 ranks"));
  CHECK(contains(rank.str(), "shard "));
  CHECK(!contains(rank.str(), "cast-layers"));  // a sharded model has no whole master to cast from
  // --longest too: the lengths are tried for one rank.
  po.longest = true;
  po.schedule.chunk = 8192;
  std::ostringstream longest;
  CHECK(run_plan(po, longest) == 0);
  CHECK(contains(longest.str(), "longest: "));
}
