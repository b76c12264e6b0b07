// Data parallelism (parallel/data_parallel.h) on the threads backend, in f64 on the tiny model: ranks
// against one process on the global batch (every schedule, DP = 2 and 3, ZeRO 0/1/2, through
// `gradcheck --against single`), the normaliser when the ranks' label counts differ, micro-batch
// accumulation, the buckets launched from inside the last backward (all-reduces, and ZeRO 2's reduces
// to each shard's owner), and the sharded AdamW.
#include "engine/random.h"
#include "optim/adamw.h"
#include "optim/training.h"
#include "parallel/data_parallel.h"
#include "tests/support.h"
#include "tools/gradcheck.h"

#include <cstring>
#include <sstream>

using namespace cw;

namespace {

using test::contains;

using test::max_rel_err;

bool same_bits(const ParamSet& a, const ParamSet& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.flat().data, b.flat().data, a.bytes()) == 0;
}

LlamaConfig tiny() { return LlamaConfig::preset("tiny"); }

ParamSet initial_params(const LlamaConfig& c) {
  ParamSet p(c, DType::f64);
  init_parameters(p, 11, c.initializer_range, /*norm_jitter=*/0.1);
  return p;
}

// Sequences [first, first + count) of a batch.
Batch rows(const Batch& batch, int64_t first, int64_t count) {
  Batch part{OwnedTensor(DType::i32, {count, batch.T()}), OwnedTensor(DType::i32, {count, batch.T()})};
  copy_convert(part.ids, batch.ids.tensor.slice(0, first, count));
  copy_convert(part.labels, batch.labels.tensor.slice(0, first, count));
  return part;
}

// A batch whose rows carry very different numbers of supervised labels: row b keeps only its last
// 1 + 3 b labels, so a rank's mean over its own tokens is not its share of the global mean.
Batch uneven_batch(int64_t B, int64_t T, int64_t vocab) {
  Batch b = random_batch(B, T, vocab, 5);
  int32_t* labels = b.labels.tensor.ptr<int32_t>();
  for (int64_t s = 0; s < B; ++s)
    for (int64_t t = 0; t + 1 + 3 * s < T; ++t) labels[s * T + t] = -100;
  return b;
}

}  // namespace

TEST_CASE("data parallel gradcheck: DP 2 and 3 against one process, every schedule, ZeRO 0/1/2 (f64, <= 1e-12)") {
  struct Case {
    const char* name;
    ScheduleOptions schedule;
  };
  std::vector<Case> cases = {{"full", {.kind = ScheduleKind::full}},
                             {"checkpointed", {.kind = ScheduleKind::checkpointed}},
                             {"seco", {.kind = ScheduleKind::seco, .chunk = 5, .bwd_chunk = 3}},
                             {"spaco", {.kind = ScheduleKind::spaco, .chunk = 4, .keep = 2, .seed = 3}},
                             {"spaco stratified", {.kind = ScheduleKind::spaco, .chunk = 4, .keep = 2, .seed = 3, .stratified = true}}};
  for (const Case& c : cases)
    for (int64_t dp : {2, 3})
      for (int64_t zero : {0, 1, 2}) {
        CAPTURE(c.name);
        CAPTURE(dp);
        CAPTURE(zero);
        GradcheckOptions o;
        o.seq = 16;
        o.batch = 6;
        o.schedule = c.schedule;
        o.parallel.dp = dp;
        o.parallel.zero = zero;
        o.parallel.bucket_mb = 0.01;  // about 10 buckets over the tiny model
        std::ostringstream out;
        const int code = run_gradcheck(o, out);
        INFO(out.str());
        CHECK(code == 0);
        CHECK(max_rel_err(out.str()) <= test::kSameMathF64Tol);
        CHECK(contains(out.str(), ": yes\n"));  // the ranks hold the same bits
        if (zero > 0) CHECK(contains(out.str(), "parameters bitwise identical"));
      }
}

TEST_CASE("data parallel gradcheck: tied embeddings, and the errors of its flags") {
  GradcheckOptions o;
  o.batch = 4;
  o.tie_embeddings = 1;
  o.schedule = {.kind = ScheduleKind::seco, .chunk = 4};
  o.parallel.dp = 2;
  o.parallel.zero = 2;
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 0);
  INFO(out.str());
  CHECK(max_rel_err(out.str()) <= test::kSameMathF64Tol);

  const auto error_of = [](GradcheckOptions g) {
    std::ostringstream sink;
    try {
      run_gradcheck(g, sink);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  GradcheckOptions odd = o;
  odd.batch = 3;
  CHECK(contains(error_of(odd), "--batch 3 is not divisible by --dp 2"));
  GradcheckOptions against_full = o;
  against_full.against = "full";
  CHECK(contains(error_of(against_full), "they need --against single"));
  GradcheckOptions bad_zero = o;
  bad_zero.parallel.zero = 4;
  CHECK(contains(error_of(bad_zero), "parallel.zero must be in [0, 3]"));
}

TEST_CASE("data parallel: the loss is normalised by the global label count, micro-batches accumulate once") {
  const LlamaConfig c = tiny();
  const ParamSet init = initial_params(c);
  const int64_t B = 4, T = 12;
  const Batch global = uneven_batch(B, T, c.vocab_size);
  ScheduleOptions so{.kind = ScheduleKind::seco, .chunk = 5};

  // One process: two micro-batches of two sequences each, normalised by the step's total.
  TrainingState single(c, DType::f64, Device::host(), AdamWOptions{});
  single.load_master(init);
  auto schedule = Schedule::create(so);
  const Batch first = rows(global, 0, 2), second = rows(global, 2, 2);
  const double total = static_cast<double>(global.supervised());
  double single_loss = schedule->step(single.model(), first, single.grads(), total, 7).loss;
  single_loss += schedule->step(single.model(), second, single.grads(), total, 8).loss;

  // Two ranks, each with two micro-batches of one sequence: rank r takes sequences r and 2 + r, so
  // micro-batch m of the two ranks together is the single process's micro-batch m.
  std::vector<DataParallelStep> steps(2);
  std::vector<ParamSet> grads(2);
  run_thread_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    TrainingState st(c, DType::f64, Device::host(), AdamWOptions{});
    st.load_master(init);
    DataParallel dp(comm, st, ParallelOptions{.dp = 2, .bucket_mb = 0.005});
    auto rank_schedule = Schedule::create(so);
    std::vector<Batch> micro;
    micro.push_back(rows(global, r, 1));
    micro.push_back(rows(global, 2 + r, 1));
    steps[static_cast<size_t>(r)] = dp.compute_gradients(*rank_schedule, micro, 7);
    grads[static_cast<size_t>(r)] = ParamSet(c, DType::f64);
    copy_params(grads[static_cast<size_t>(r)], st.grads());
  });
  CHECK(steps[0].supervised == global.supervised());
  CHECK(steps[0].loss == steps[1].loss);
  CHECK(std::abs(steps[0].loss - single_loss) <= test::kSameMathF64Tol * std::abs(single_loss));
  CHECK(same_bits(grads[0], grads[1]));
  const test::Worst w = test::compare(grads[0].flat(), single.grads().flat());
  INFO(w.str());
  CHECK(w.rel <= test::kSameMathF64Tol);
  // Every bucket was launched from inside the last micro-batch's last backward, none before it.
  CHECK(steps[0].buckets > 5);
  CHECK(steps[0].buckets_in_backward == steps[0].buckets);
}

TEST_CASE("data parallel: ZeRO 2 reduces each bucket to its shard's owner from inside the last backward") {
  // 5 ranks (the tiny model's 12264 parameters do not split evenly: the last shard holds the
  // remainder), buckets small enough that several fall in each shard and some straddle a boundary.
  const LlamaConfig c = tiny();
  const ParamSet init = initial_params(c);
  const Batch global = uneven_batch(10, 12, c.vocab_size);
  const ScheduleOptions so{.kind = ScheduleKind::seco, .chunk = 5};
  const int n = 5;
  std::vector<DataParallelStep> steps(n * 2);
  std::vector<ParamSet> grads(n * 2);
  std::vector<int64_t> begin(n), end(n);
  for (const int64_t zero : {0, 2})
    run_thread_ranks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      TrainingState st(c, DType::f64, Device::host(), AdamWOptions{}, {.full_optimizer = zero == 0});
      st.load_master(init);
      DataParallel dp(comm, st, ParallelOptions{.dp = n, .zero = zero, .bucket_mb = 0.004});
      auto schedule = Schedule::create(so);
      const size_t i = static_cast<size_t>(zero == 0 ? r : n + r);
      std::vector<Batch> micro;
      micro.push_back(rows(global, 2 * r, 2));
      steps[i] = dp.compute_gradients(*schedule, micro, 3);
      grads[i] = ParamSet(c, DType::f64);
      copy_params(grads[i], st.grads());
      begin[static_cast<size_t>(r)] = dp.shard_begin(r);
      end[static_cast<size_t>(r)] = dp.shard_end(r);
    });
  REQUIRE(init.numel() % n != 0);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    const DataParallelStep& plain = steps[static_cast<size_t>(r)];
    const DataParallelStep& sharded = steps[static_cast<size_t>(n + r)];
    // Every reduction launched inside the backward; the shard boundaries cut buckets, so there are more.
    CHECK(sharded.buckets_in_backward == sharded.buckets);
    CHECK(sharded.buckets > plain.buckets);
    CHECK(plain.buckets > 2 * n);
    CHECK(sharded.loss == plain.loss);
    // The rank's shard of the reduced gradient: the bits of zero 0's all-reduce (rank-ordered sums).
    const size_t b = static_cast<size_t>(begin[r]), e = static_cast<size_t>(end[r]);
    CHECK(std::memcmp(grads[static_cast<size_t>(n + r)].flat().ptr<double>() + b,
                      grads[static_cast<size_t>(r)].flat().ptr<double>() + b, (e - b) * sizeof(double)) == 0);
  }
}

TEST_CASE("schedules: the last backward reports offsets that only decrease, and the gradient at and after each is final") {
  const LlamaConfig c = tiny();
  LlamaModel model(c, DType::f64);
  copy_params(model.params(), initial_params(c));
  const Batch batch = random_batch(2, 16, c.vocab_size, 8);
  const std::vector<ScheduleOptions> schedules = {{.kind = ScheduleKind::full},
                                                  {.kind = ScheduleKind::checkpointed},
                                                  {.kind = ScheduleKind::seco, .chunk = 5, .bwd_chunk = 3},
                                                  {.kind = ScheduleKind::spaco, .chunk = 4, .keep = 2, .seed = 1}};
  for (const ScheduleOptions& so : schedules) {
    CAPTURE(schedule_name(so.kind));
    auto schedule = Schedule::create(so);
    ParamSet grads(c, DType::f64);
    std::vector<int64_t> offsets;
    std::vector<std::vector<double>> snapshots;  // the gradient when each offset was reported
    StepHooks hooks;
    hooks.grads_final = [&](int64_t from) {
      offsets.push_back(from);
      const double* g = grads.flat().ptr<double>();
      snapshots.emplace_back(g, g + grads.numel());
    };
    schedule->set_hooks(hooks);
    schedule->step(model, batch, grads, 0, 4);
    // One report after the head and final norm, one per layer, one after the embedding.
    REQUIRE(offsets.size() == static_cast<size_t>(c.num_hidden_layers) + 2);
    CHECK(offsets.back() == 0);
    const double* final_grads = grads.flat().ptr<double>();
    for (size_t k = 0; k < offsets.size(); ++k) {
      CAPTURE(k);
      if (k > 0) CHECK(offsets[k] < offsets[k - 1]);
      const size_t from = static_cast<size_t>(offsets[k]);
      CHECK(std::memcmp(snapshots[k].data() + from, final_grads + from,
                        (snapshots[k].size() - from) * sizeof(double)) == 0);
    }
  }
}

TEST_CASE("AdamWShard: shards that tile the vector give the bits of one AdamW; save and load") {
  const LlamaConfig c = tiny();
  ParamSet whole = initial_params(c), sharded = initial_params(c);
  ParamSet g(c, DType::f64);
  const AdamWOptions options{.weight_decay = 0.05};
  AdamW adamw(whole, options);
  // Cuts in the middle of tensors (and one empty shard).
  const std::vector<int64_t> cuts = {0, 1000, 1000, 5001, 9999, whole.numel()};
  std::vector<AdamWShard> shards;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) shards.emplace_back(sharded, cuts[i], cuts[i + 1], options);
  for (int step = 0; step < 3; ++step) {
    fill_normal(g.flat(), 40 + static_cast<uint64_t>(step), 0, 0.0, 0.02);
    adamw.step(whole, g, 1e-2);
    for (AdamWShard& s : shards) s.step(sharded, g, 1e-2);
  }
  CHECK(same_bits(whole, sharded));

  test::TempDir dir("adamw-shard");
  shards[2].save(dir.file("shard.safetensors"));
  AdamWShard restored(sharded, cuts[2], cuts[3], options);
  restored.load(dir.file("shard.safetensors"));
  CHECK(restored.steps() == 3);
  CHECK(std::memcmp(restored.exp_avg_sq().data, shards[2].exp_avg_sq().data, shards[2].exp_avg_sq().bytes()) == 0);
  AdamWShard other_range(sharded, cuts[3], cuts[4], options);
  std::string err;
  try {
    other_range.load(dir.file("shard.safetensors"));
  } catch (const Error& e) {
    err = e.what();
  }
  CHECK(contains(err, "optimizer shard covers [1000, 5001)"));
  CHECK(contains(err, "same parallel.dp and parallel.zero"));
}
