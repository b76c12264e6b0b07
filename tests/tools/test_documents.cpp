// Packed documents through every schedule: `gradcheck --documents L1,... --against separate` (the packed
// batch's loss and gradients against each document run alone, summed) within 1e-12 in f64, for chunks
// that start, end and straddle document boundaries, a document longer than the chunk, one-token
// documents, a batch whose sequences are cut differently and the K/V store streamed in blocks; with
// absolute positions the schedules agree with full, and full agrees with finite differences.
#include "model/llama.h"
#include "optim/schedule.h"
#include "tests/support.h"
#include "tools/bench_model.h"
#include "tools/gradcheck.h"

#include <cmath>
#include <sstream>

using namespace cw;

namespace {
// Exactness in f64: the schedules reorder sums, nothing more.
constexpr double kExactTol = 1e-12;

using test::max_rel_err;

struct Case {
  const char* name;
  std::vector<int64_t> documents;  // lengths summing to the sequence
  int64_t batch = 1;
  ScheduleOptions schedule;
};

ScheduleOptions named(const char* name, int64_t chunk = 0, int64_t bwd_chunk = 0) {
  ScheduleOptions s;
  s.kind = parse_schedule_kind(name);
  s.chunk = chunk;
  s.bwd_chunk = bwd_chunk;
  return s;
}

std::vector<Case> cases() {
  const std::vector<int64_t> mixed{10, 1, 20, 1, 11, 21};  // 64 tokens: one-token documents among them
  std::vector<Case> c;
  c.push_back({"full", mixed, 2, named("full")});
  ScheduleOptions ckpt = named("checkpointed");
  ckpt.recompute = RecomputeMode::full;
  c.push_back({"checkpointed", mixed, 1, ckpt});
  c.push_back({"seco, chunk 7 / bwd 5 (boundaries inside chunks)", mixed, 2, named("seco", 7, 5)});
  c.push_back({"seco, chunk 8 (a document longer than a chunk)", {40, 24}, 1, named("seco", 8)});
  c.push_back({"seco, chunks ending on document starts", {16, 16, 32}, 1, named("seco", 16)});
  c.push_back({"seco, one-token documents", {1, 1, 1, 5, 1, 1, 54}, 2, named("seco", 4, 3)});
  ScheduleOptions saved = named("seco", 8, 8);
  saved.save_attention = true;
  saved.save_inputs = true;
  c.push_back({"seco, saved attention outputs and layer inputs", mixed, 2, saved});
  ScheduleOptions selective = named("seco", 9);
  selective.recompute = RecomputeMode::selective;
  selective.mlp_shards = 3;
  c.push_back({"seco, selective recompute, tiled MLP", mixed, 1, selective});
  ScheduleOptions window = named("seco", 8);
  window.offload_window = 1;
  c.push_back({"seco, K/V store offloaded (window 1)", mixed, 2, window});
  c.push_back({"spaco visiting every chunk", mixed, 1, named("spaco", 8)});
  // The K/V store streamed in blocks of the chunk: a chunk reads only the blocks its documents reach.
  ScheduleOptions streamed = named("seco", 8);
  streamed.stream_kv = true;
  c.push_back({"seco, K/V store streamed (blocks of 8)", mixed, 2, streamed});
  c.push_back({"seco, streamed, a document over five blocks", {40, 24}, 1, streamed});
  ScheduleOptions streamed_saved = streamed;
  streamed_saved.chunk = streamed_saved.bwd_chunk = 6;
  streamed_saved.save_attention = true;
  c.push_back({"seco, streamed blocks of 6, saved attention outputs", {1, 1, 1, 5, 1, 1, 54}, 2, streamed_saved});
  ScheduleOptions streamed_spaco = named("spaco", 8);
  streamed_spaco.stream_kv = true;
  c.push_back({"spaco visiting every chunk, streamed", mixed, 1, streamed_spaco});
  return c;
}
}  // namespace

TEST_CASE("documents: every schedule equals the documents run one by one (f64, 1e-12)") {
  for (const Case& k : cases()) {
    GradcheckOptions o;
    o.model = "tiny";
    o.seq = 64;
    o.batch = k.batch;
    o.schedule = k.schedule;
    o.documents = k.documents;
    o.against = "separate";
    std::ostringstream out;
    INFO(k.name);
    const int rc = run_gradcheck(o, out);
    INFO(out.str());
    CHECK(rc == 0);
    CHECK(max_rel_err(out.str()) <= kExactTol);
  }
}

TEST_CASE("documents: the mask changes the gradient (the oracle can fail); restarted positions do not") {
  // The same ids and labels with and without the mask: different gradients, so a schedule that
  // dropped the mask would fail the check against separate documents. With the mask, RoPE positions
  // restarting at each document or running on give the same scores (a rotary score depends only on
  // the difference of the two positions, and both lie in one document): equal to rounding.
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 31, cfg.initializer_range, 0.1);
  auto grad_of = [&](bool mask, bool document_positions) {
    Batch batch = random_batch(1, 32, cfg.vocab_size, 32);
    set_documents(batch, {{0, 12}}, document_positions);  // the labels masked alike in all three
    if (!mask) batch.doc_starts.clear();
    ParamSet grads = ParamSet::like(model.params(), DType::f64);
    Schedule::create(named("full"))->step(model, batch, grads);
    std::vector<double> g(static_cast<size_t>(grads.numel()));
    copy_convert(Tensor(g.data(), DType::f64, Device::host(), {grads.numel()}), grads.flat());
    return g;
  };
  const std::vector<double> packed = grad_of(true, true), absolute = grad_of(true, false),
                            unmasked = grad_of(false, true);
  auto rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
    return std::sqrt(num / den);
  };
  CHECK(rel(unmasked, packed) > 1e-3);
  CHECK(rel(absolute, packed) <= kExactTol);
}

TEST_CASE("documents: absolute positions against separate documents; full against finite differences") {
  GradcheckOptions o;
  o.model = "tiny";
  o.seq = 48;
  o.batch = 2;
  o.documents = {5, 30, 13};
  o.positions = "absolute";
  o.schedule = named("seco", 7, 5);
  o.against = "separate";
  std::ostringstream out;
  CHECK(run_gradcheck(o, out) == 0);
  INFO(out.str());
  CHECK(max_rel_err(out.str()) <= kExactTol);

  GradcheckOptions f = o;
  f.seq = 16;
  f.batch = 1;
  f.documents = {6, 10};
  f.positions = "document";
  f.schedule = named("full");
  f.against = "fd";
  std::ostringstream fd;
  CHECK(run_gradcheck(f, fd) == 0);
  INFO(fd.str());
  CHECK(max_rel_err(fd.str()) <= 1e-7);
}

TEST_CASE("documents: bad lengths are refused naming the flag") {
  GradcheckOptions o;
  o.seq = 16;
  o.documents = {6, 6};
  o.against = "separate";
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("sum to 12, but --seq is 16"), Error);
  o.documents = {16, 0};
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("a document of 0 tokens"), Error);
  o.documents = {};
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("--against separate"), Error);
}

TEST_CASE("documents: bench --documents cuts sequences as asked") {
  const auto fixed = bench_document_starts("8", 2, 20, 1);
  CHECK(fixed == std::vector<std::vector<int64_t>>{{0, 8, 16}, {0, 8, 16}});
  const auto drawn = bench_document_starts("3:5", 3, 100, 7);
  for (const auto& row : drawn) {
    REQUIRE(row.front() == 0);
    for (size_t i = 1; i < row.size(); ++i) CHECK((row[i] - row[i - 1] >= 3 && row[i] - row[i - 1] <= 5));
    CHECK(row.back() >= 95);
  }
  CHECK(drawn == bench_document_starts("3:5", 3, 100, 7));  // a function of the seed
  CHECK(drawn != bench_document_starts("3:5", 3, 100, 8));
  CHECK_THROWS_WITH_AS(bench_document_starts("8k", 1, 16, 1), doctest::Contains("--documents '8k'"), Error);
  CHECK_THROWS_WITH_AS(bench_document_starts("9:4", 1, 16, 1), doctest::Contains("LO <= HI"), Error);
}

TEST_CASE("documents: a streamed store with a sliding window is refused naming both") {
  // The streamed store's document blocks (attention_merge_documents_block) take no window: the
  // combination is refused before a wrong sum, in one line naming the window and the store.
  GradcheckOptions o;
  o.model = "tiny-mistral";
  o.seq = 24;
  o.documents = {10, 14};
  o.schedule = named("seco", 8);
  o.schedule.stream_kv = true;
  o.against = "separate";
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("sliding_window"), Error);
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("schedule.stream_kv"), Error);
}
