// Tensor parallelism (parallel/tensor_parallel.h, model/shard.h), ranks as threads of the CPU
// communicator, f64:
//   - each paired op's backward is the adjoint of its forward over the group, and the forwards do
//     what the header says (bitwise: gathers copy, sums are the rank-ordered sums);
//   - the reusable buffer lends a slot to one user at a time and grows to the largest request;
//   - sharding and unsharding parameters are inverse;
//   - gradients of TP = 2 and 4 ranks, with and without sequence parallelism and the regathered
//     all-gather, under full, checkpointed and seco (and selective recompute, a tiled MLP, saved
//     attention, tied embeddings) equal one process's to 1e-12 (`gradcheck --against single`);
//   - under sequence parallelism each rank's replicated gradients are its rows' share (summing
//     them over the ranks gives one process's), and every rank's K/V store holds 1/P of the heads;
//   - regather keeps 2 (N - N/P) C values per layer fewer until the backward, exactly;
//   - TP x DP = 2 x 2 (parallel/grid.h: groups split from the world) equals one process under full,
//     checkpointed and seco, with and without sequence parallelism, ZeRO 0/1/2 (gradcheck --dp 2 --tp 2);
//   - Qwen2's q/k/v biases split with their rows, Qwen3's replicated per-head norms summed, Llama's
//     replicated o_proj bias;
//   - bad input fails with one line naming the option.
#include "engine/random.h"
#include "model/llama.h"
#include "optim/options.h"
#include "parallel/grid.h"
#include "parallel/tensor_parallel.h"
#include "tests/support.h"
#include "tools/gradcheck.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

using namespace cw;

namespace {

// Two computations of the same f64 inner product, summed in different orders.
constexpr double kAdjointTol = 1e-13;

OwnedTensor random_tensor(std::vector<int64_t> shape, uint64_t seed, uint64_t stream) {
  OwnedTensor t = OwnedTensor::of_shape(DType::f64, shape);
  fill_normal(t, seed, stream);
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  REQUIRE(a.numel() == b.numel());
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.ptr<double>()[i] * b.ptr<double>()[i];
  return s;
}

double sum_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

void check_adjoint(double lhs, double rhs, const char* op) {
  INFO(op << ": <f(x), y> = " << lhs << ", <x, f*(y)> = " << rhs);
  CHECK(std::abs(lhs - rhs) <= kAdjointTol * std::max(1.0, std::abs(rhs)));
}

using test::max_rel_err;

// gradcheck of the tiny TP model, 2 x 16 tokens, over `tp` ranks, with schedule `name` (seco in
// chunks of 8, backward chunks of 4).
GradcheckOptions tiny_tp_gradcheck(const char* name, int64_t tp = 2) {
  GradcheckOptions o;
  o.model = "tiny-tp";
  o.seq = 16;
  o.batch = 2;
  o.schedule.kind = parse_schedule_kind(name);
  if (o.schedule.kind == ScheduleKind::seco) {
    o.schedule.chunk = 8;
    o.schedule.bwd_chunk = 4;
  }
  o.parallel.tp = tp;
  return o;
}

// Runs gradcheck (the parallel run against one process) and requires it to pass with the gradients
// the same math as one process's (1e-12); its report, for further checks.
std::string same_as_one_process(const GradcheckOptions& o) {
  std::ostringstream out;
  const int rc = run_gradcheck(o, out);
  INFO(out.str());
  CHECK(rc == 0);
  CHECK(max_rel_err(out.str()) <= test::kSameMathF64Tol);
  return out.str();
}

// What one rank of a TP step leaves behind.
struct RankRun {
  std::optional<ParamSet> grads;
  StepStats stats;
  size_t buffer_capacity = 0, buffer_requested = 0;
};

// The schedule on P thread ranks, each with its shard of `full`; reduce: the replicated gradients'
// TP reduction after the step (what an optimizer step does).
std::vector<RankRun> run_tp(const LlamaModel& full, const Batch& batch, const ScheduleOptions& so, int P,
                            const TensorParallelOptions& tpo, bool reduce) {
  std::vector<RankRun> runs(static_cast<size_t>(P));
  run_thread_ranks(P, [&](Communicator& comm) {
    TensorParallel group(comm, tpo);
    LlamaModel shard(full.full_config(), DType::f64, Device::host(), &group);
    shard_parameters(shard.params(), full.params(), comm.rank(), P);
    RankRun& r = runs[static_cast<size_t>(comm.rank())];
    r.grads.emplace(shard.config(), DType::f64);
    r.stats = Schedule::create(so)->step(shard, batch, *r.grads);
    if (reduce) reduce_replicated_gradients(*r.grads, group);
    r.buffer_capacity = group.buffer().capacity_bytes();
    r.buffer_requested = group.buffer().requested_bytes();
  });
  return runs;
}

struct Reference {
  LlamaModel model;
  Batch batch;
  Reference(const std::string& preset, int64_t B, int64_t T)
      : model(LlamaConfig::preset(preset), DType::f64), batch(random_batch(B, T, model.config().vocab_size, 7)) {
    init_parameters(model.params(), 11, model.config().initializer_range, 0.1);
  }
};

}  // namespace

TEST_CASE("tensor parallel: every paired op's backward is its forward's adjoint over the group") {
  const int64_t n = 3, C = 5;  // rows per rank, width
  for (int P : {1, 2, 3, 4}) {
    CAPTURE(P);
    // Per rank: <f(x), y> and <x, f*(y)>, summed on the main thread.
    std::vector<double> copy_l(P), copy_r(P), reduce_l(P), reduce_r(P), gather_l(P), gather_r(P), scatter_l(P),
        scatter_r(P);
    std::vector<char> gather_exact(P, 0);
    const OwnedTensor x_rep = random_tensor({P * n, C}, 1, 999);  // a replicated input: the same on every rank
    const OwnedTensor y_rep = random_tensor({P * n, C}, 2, 999);
    run_thread_ranks(P, [&](Communicator& comm) {
      const int r = comm.rank();
      const uint64_t s = static_cast<uint64_t>(r);
      // copy_to_tp: f(x)_r = x (x replicated), f*(y) = sum_r y_r.
      {
        const OwnedTensor y = random_tensor({P * n, C}, 3, s);
        copy_l[r] = dot(x_rep, y);
        OwnedTensor d = random_tensor({P * n, C}, 3, s);
        copy_to_tp_backward(comm, d);
        copy_r[r] = r == 0 ? dot(x_rep, d) : 0.0;  // a replicated result counts once
      }
      // reduce_from_tp: f(x) = sum_r x_r (replicated), f*(y)_r = y.
      {
        OwnedTensor x = random_tensor({P * n, C}, 4, s);
        reduce_l[r] = dot(x, y_rep);  // y's part, before the in-place sum overwrites x
        reduce_from_tp_forward(comm, x);
        reduce_r[r] = r == 0 ? dot(x, y_rep) : 0.0;
        std::swap(reduce_l[r], reduce_r[r]);  // lhs is <f(x), y>
      }
      // gather_from_sp: f(x)_s = [x_0; ...; x_P-1] on every rank s, f*(y)_r = rows_r(sum_s y_s).
      {
        const OwnedTensor x = random_tensor({n, C}, 5, s);
        OwnedTensor all = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{P * n, C});
        gather_from_sp_forward(comm, all, x);
        gather_exact[r] = std::memcmp(all.tensor.slice(0, r * n, n).data, x.tensor.data, x.tensor.bytes()) == 0;
        const OwnedTensor y = random_tensor({P * n, C}, 6, s);
        gather_l[r] = dot(all, y);
        OwnedTensor d_rows = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n, C});
        gather_from_sp_backward(comm, d_rows, y);
        gather_r[r] = dot(x, d_rows);
      }
      // scatter_to_sp: f(x)_r = rows_r(sum_s x_s), f*(y)_s = [y_0; ...; y_P-1] on every rank s.
      {
        const OwnedTensor x = random_tensor({P * n, C}, 7, s);
        OwnedTensor rows = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n, C});
        scatter_to_sp_forward(comm, rows, x);
        const OwnedTensor y = random_tensor({n, C}, 8, s);
        scatter_l[r] = dot(rows, y);
        OwnedTensor d_all = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{P * n, C});
        scatter_to_sp_backward(comm, d_all, y);
        scatter_r[r] = dot(x, d_all);
      }
    });
    check_adjoint(sum_of(copy_l), sum_of(copy_r), "copy_to_tp");
    check_adjoint(sum_of(reduce_l), sum_of(reduce_r), "reduce_from_tp");
    check_adjoint(sum_of(gather_l), sum_of(gather_r), "gather_from_sp");
    check_adjoint(sum_of(scatter_l), sum_of(scatter_r), "scatter_to_sp");
    for (int r = 0; r < P; ++r) CHECK(gather_exact[r]);
  }
}

TEST_CASE("tensor parallel: the paired ops check their shapes") {
  run_thread_ranks(2, [&](Communicator& comm) {
    OwnedTensor rows(DType::f64, {3, 4}), wrong(DType::f64, {5, 4});
    CHECK_THROWS_WITH_AS(gather_from_sp_forward(comm, wrong, rows), doctest::Contains("5 rows for 2 ranks of 3 rows"),
                         Error);
  });
}

TEST_CASE("tensor parallel: the reusable buffer lends each slot once and grows to the largest request") {
  ActivationBuffer buffer(Device::host());
  const Tensor a = buffer.acquire(TpSlot::partial_sum, DType::f64, {4, 8});
  CHECK_THROWS_WITH_AS(buffer.acquire(TpSlot::partial_sum, DType::f64, {4, 8}), doctest::Contains("lent already"),
                       Error);
  const Tensor b = buffer.acquire(TpSlot::gathered_input, DType::f64, {2, 8});  // another slot: fine
  CHECK(a.data != b.data);
  buffer.release(TpSlot::partial_sum);
  buffer.release(TpSlot::gathered_input);
  CHECK_THROWS_WITH_AS(buffer.release(TpSlot::gathered_input), doctest::Contains("not lent"), Error);
  const Tensor c = buffer.acquire(TpSlot::partial_sum, DType::f64, {2, 8});  // smaller: the same memory
  CHECK(c.data == a.data);
  buffer.release(TpSlot::partial_sum);
  buffer.acquire(TpSlot::partial_sum, DType::f64, {8, 8});  // larger: grows
  buffer.release(TpSlot::partial_sum);
  CHECK(buffer.capacity_bytes() == (64 + 16) * sizeof(double));
  CHECK(buffer.requests() == 4);
  CHECK(buffer.requested_bytes() == (32 + 16 + 16 + 64) * sizeof(double));
  CHECK(buffer.largest_request() == 64 * sizeof(double));
}

TEST_CASE("tensor parallel: sharding and unsharding the parameters are inverse") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny-tp");
  ParamSet full(cfg, DType::f64), back(cfg, DType::f64);
  init_parameters(full, 3, 0.5, 0.1);
  for (int P : {1, 2, 4}) {
    back.zero();
    const LlamaConfig shard_cfg = tp_shard_config(cfg, P);
    CHECK(shard_cfg.num_attention_heads * P == cfg.num_attention_heads);
    CHECK(shard_cfg.num_key_value_heads * P == cfg.num_key_value_heads);
    CHECK(shard_cfg.intermediate_size * P == cfg.intermediate_size);
    for (int r = 0; r < P; ++r) {
      ParamSet shard(shard_cfg, DType::f64);
      shard_parameters(shard, full, r, P);
      // Rank r's q rows are its heads' rows of the full q.
      const Tensor q = shard.get("model.layers.1.self_attn.q_proj.weight");
      CHECK(std::memcmp(q.data, full.get("model.layers.1.self_attn.q_proj.weight").slice(0, r * q.size(0), q.size(0)).data,
                        q.bytes()) == 0);
      unshard_parameters(back, shard, r, P, r == 0);
    }
    CHECK(std::memcmp(back.flat().data, full.flat().data, full.bytes()) == 0);
  }
}

TEST_CASE("tensor parallel: TP = 2 and 4 equal one process to 1e-12 (gradcheck --against single)") {
  struct Schedule {
    const char* name;
    int64_t chunk, bwd_chunk;
  };
  // batch 2 x 16 tokens; seco's chunks (6, 6, 4 prefill; 4 x 4 reverse) keep B x c divisible by 4.
  const Schedule schedules[] = {{"full", 0, 0}, {"checkpointed", 0, 0}, {"seco", 6, 4}};
  const std::pair<bool, bool> modes[] = {{false, false}, {true, false}, {true, true}};  // (sequence parallel, regather)
  for (int64_t tp : {2, 4})
    for (const Schedule& s : schedules)
      for (const auto& [sp, regather] : modes) {
        GradcheckOptions o = tiny_tp_gradcheck(s.name, tp);
        o.schedule.chunk = s.chunk;
        o.schedule.bwd_chunk = s.bwd_chunk;
        o.parallel.sequence_parallel = sp;
        o.parallel.tp_regather = regather;
        CAPTURE(tp);
        CAPTURE(s.name);
        CAPTURE(sp);
        CAPTURE(regather);
        const std::string out = same_as_one_process(o);
        CHECK(out.find("the replicated tensors on every TP rank): yes") != std::string::npos);
      }
}

TEST_CASE("tensor parallel: qwen2's biases split with their rows, qwen3's per-head norms summed, llama's o_proj bias") {
  // tiny-tp's shape as each family: the q/k/v biases are column-parallel like their weights; q_norm and
  // k_norm are replicated and each rank's gradient is its heads' part, which the step sums.
  test::TempDir dir("tp-qwen");
  // Llama's attention_bias adds o_proj's bias, replicated: whole on every rank, or under sequence
  // parallelism each rank's rows' share, summed.
  for (const ModelFamily family : {ModelFamily::qwen2, ModelFamily::qwen3, ModelFamily::llama}) {
    LlamaConfig c = LlamaConfig::preset("tiny-tp");
    c.family = family;
    c.attention_bias = family != ModelFamily::qwen3;
    c.o_bias = family == ModelFamily::llama;
    c.qk_norm = family == ModelFamily::qwen3;
    c.rope_scaling = {};
    const std::string path = dir.file(std::string(model_family_name(family)) + ".json");
    std::ofstream(path) << c.to_json().dump();
    for (const int64_t tp : {2, 4})
      for (const char* schedule : {"full", "seco"})
        for (const bool sp : {false, true}) {
          GradcheckOptions o = tiny_tp_gradcheck(schedule, tp);
          o.model = path;
          if (o.schedule.kind == ScheduleKind::seco) o.schedule.chunk = 6;
          o.parallel.sequence_parallel = sp;
          CAPTURE(model_family_name(family));
          CAPTURE(tp);
          CAPTURE(schedule);
          CAPTURE(sp);
          const std::string out = same_as_one_process(o);
          CHECK(out.find("the replicated tensors on every TP rank): yes") != std::string::npos);
        }
  }
}

TEST_CASE("tensor parallel and data parallel: mistral's sliding window (gradcheck --tp 2, --dp 2, --dp 2 --tp 2)") {
  // tiny-tp's shape as Mistral with a window of 5 keys on 16 tokens: each rank attends its heads
  // through the window (seco in chunks of 8 and 4 against it), and the replicated tensors agree.
  test::TempDir dir("tp-mistral");
  LlamaConfig c = LlamaConfig::preset("tiny-tp");
  c.family = ModelFamily::mistral;
  c.rope_scaling = {};
  c.sliding_window = 5;
  const std::string path = dir.file("mistral.json");
  std::ofstream(path) << c.to_json().dump();
  for (const auto& [tp, dp] : {std::pair<int64_t, int64_t>{2, 1}, {1, 2}, {2, 2}})
    for (const char* schedule : {"full", "seco"})
      for (const bool sp : {false, true}) {
        if (sp && tp == 1) continue;
        GradcheckOptions o = tiny_tp_gradcheck(schedule, tp);
        o.model = path;
        o.parallel.dp = dp;
        o.batch = 2 * dp;
        o.parallel.sequence_parallel = sp;
        CAPTURE(tp);
        CAPTURE(dp);
        CAPTURE(schedule);
        CAPTURE(sp);
        same_as_one_process(o);
      }
}

TEST_CASE("tensor parallel and data parallel: gemma 2's block (gradcheck --tp 2, --tp 4, --dp 2 --tp 2)") {
  // tiny-tp's shape as Gemma 2: the post-norms run on the rank's rows of the sums over the ranks (the
  // o_proj and down_proj outputs after reduce_from_tp or scatter_to_sp), replicated as the other norms
  // are; layer 0 slides through a window of 5 keys, both layers cap their scores; the logits capped.
  test::TempDir dir("tp-gemma2");
  LlamaConfig c = LlamaConfig::preset("tiny-gemma2");
  const LlamaConfig shape = LlamaConfig::preset("tiny-tp");
  c.hidden_size = shape.hidden_size;
  c.intermediate_size = shape.intermediate_size;
  c.num_attention_heads = shape.num_attention_heads;
  c.num_key_value_heads = shape.num_key_value_heads;
  c.head_dim = shape.head_dim;
  c.query_pre_attn_scalar = 6;
  const std::string path = dir.file("gemma2.json");
  std::ofstream(path) << c.to_json().dump();
  for (const auto& [tp, dp] : {std::pair<int64_t, int64_t>{2, 1}, {4, 1}, {2, 2}})
    for (const char* schedule : {"full", "seco"})
      for (const bool sp : {false, true}) {
        GradcheckOptions o = tiny_tp_gradcheck(schedule, tp);
        o.model = path;
        o.parallel.dp = dp;
        o.batch = 2 * dp;
        o.parallel.sequence_parallel = sp;
        CAPTURE(tp);
        CAPTURE(dp);
        CAPTURE(schedule);
        CAPTURE(sp);
        const std::string out = same_as_one_process(o);
        CHECK(out.find("the replicated tensors on every TP rank): yes") != std::string::npos);
      }
}

TEST_CASE("tensor parallel: selective recompute, a tiled MLP, saved attention and tied embeddings") {
  struct Case {
    const char* name;
    const char* schedule;
    RecomputeMode recompute;
    int64_t mlp_shards;
    bool save_attention;
    int tie;
  };
  const Case cases[] = {
      {"selective", "seco", RecomputeMode::selective, 1, false, -1},
      {"tiled MLP", "checkpointed", RecomputeMode::automatic, 2, false, -1},
      {"saved attention", "seco", RecomputeMode::automatic, 1, true, -1},
      {"tied embeddings", "seco", RecomputeMode::automatic, 1, false, 1},
  };
  for (const Case& c : cases)
    for (const bool regather : {false, true}) {
      GradcheckOptions o = tiny_tp_gradcheck(c.schedule);
      o.tie_embeddings = c.tie;
      o.schedule.recompute = c.recompute;
      o.schedule.mlp_shards = c.mlp_shards;
      o.schedule.save_attention = c.save_attention;
      o.parallel.sequence_parallel = true;
      o.parallel.tp_regather = regather;
      CAPTURE(c.name);
      CAPTURE(regather);
      same_as_one_process(o);
    }
}

TEST_CASE("tensor parallel: seco with saved layer inputs; not with sequence parallelism") {
  // Without sequence parallelism every rank holds every row of the residual stream, so the store's
  // saved inputs are the same on each and each layer's recompute from them runs the rank's heads.
  GradcheckOptions o = tiny_tp_gradcheck("seco");
  o.schedule.save_inputs = true;
  for (const bool saved : {false, true}) {
    CAPTURE(saved);
    o.schedule.save_attention = saved;
    same_as_one_process(o);
  }
  // With it a rank holds its share of a chunk's rows, which depends on the chunking: refused.
  o.parallel.sequence_parallel = true;
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("sequence parallelism"), Error);
}

TEST_CASE("tensor parallel: under sequence parallelism each rank's replicated gradients are its rows' share") {
  Reference ref("tiny-tp", 2, 8);
  ScheduleOptions so;
  so.kind = ScheduleKind::seco;
  so.chunk = 4;
  ParamSet single(ref.model.config(), DType::f64);
  const StepStats single_stats = Schedule::create(so)->step(ref.model, ref.batch, single);
  const int P = 2;
  const std::vector<RankRun> runs = run_tp(ref.model, ref.batch, so, P, {true, false}, /*reduce=*/false);
  for (size_t i = 0; i < single.size(); ++i) {
    const ParamSpec& spec = single.specs()[i];
    if (tp_split_dim(spec) >= 0) continue;
    CAPTURE(spec.name);
    OwnedTensor sum = OwnedTensor::of_shape(DType::f64, spec.shape);
    fill(sum, 0.0);
    for (const RankRun& r : runs) {
      const test::Worst alone = test::compare((*r.grads)[i], single[i]);
      CHECK(alone.rel > 1e-3);  // one rank's rows alone are far from the whole gradient
      for (int64_t k = 0; k < sum.tensor.numel(); ++k) sum.tensor.ptr<double>()[k] += (*r.grads)[i].ptr<double>()[k];
    }
    CHECK(test::compare(sum, single[i]).rel <= test::kSameMathF64Tol);
  }
  // The loss is every row's (all-gathered), and each rank's K/V store holds its 1/P of the K/V heads.
  for (const RankRun& r : runs) {
    CHECK(std::abs(r.stats.loss - single_stats.loss) <= test::kSameMathF64Tol * single_stats.loss);
    CHECK(r.stats.kv_bytes * P == single_stats.kv_bytes);
  }
}

TEST_CASE("tensor parallel: regather keeps 2 (N - N/P) C values per layer fewer until the backward") {
  Reference ref("tiny-tp", 2, 16);
  ScheduleOptions so;  // full: every layer's activations kept for the backward
  const int P = 2;
  const std::vector<RankRun> kept = run_tp(ref.model, ref.batch, so, P, {true, false}, true);
  const std::vector<RankRun> regathered = run_tp(ref.model, ref.batch, so, P, {true, true}, true);
  const LlamaConfig& cf = ref.model.config();
  const int64_t N = 2 * 16, R = N / P;
  const size_t saved = static_cast<size_t>(cf.num_hidden_layers * 2 * (N - R) * cf.hidden_size) * sizeof(double);
  for (int r = 0; r < P; ++r) {
    CAPTURE(r);
    CHECK(kept[r].stats.activation_high_water - regathered[r].stats.activation_high_water == saved);
    // The buffer holds at most three [N, C] tensors, however many seams lent them.
    CHECK(regathered[r].buffer_capacity <= 3 * static_cast<size_t>(N * cf.hidden_size) * sizeof(double));
    CHECK(regathered[r].buffer_requested > kept[r].buffer_requested);  // the regathers
  }
  // The same gradients either way (the regather recomputes the same all-gather).
  for (int r = 0; r < P; ++r)
    CHECK(std::memcmp((*kept[r].grads).flat().data, (*regathered[r].grads).flat().data, kept[r].grads->bytes()) == 0);
}

TEST_CASE("tensor parallel: bad input fails with one line naming the option") {
  const LlamaConfig tiny = LlamaConfig::preset("tiny");  // 4 heads, 2 K/V heads, FFN 40
  CHECK_THROWS_WITH_AS(tp_shard_config(tiny, 4), doctest::Contains("parallel.tp = 4 does not divide num_key_value_heads = 2"),
                       Error);
  CHECK_THROWS_WITH_AS(tp_shard_config(tiny, 3), doctest::Contains("num_attention_heads"), Error);
  ParallelOptions po;
  po.tp_regather = true;
  CHECK_THROWS_WITH_AS(po.validate(), doctest::Contains("parallel.tp_regather needs parallel.sequence_parallel"), Error);
  po = {};
  po.tp = 0;
  CHECK_THROWS_WITH_AS(po.validate(), doctest::Contains("parallel.tp must be in [1, 65536]"), Error);
  // Sequence parallelism with a chunk of 2 x 3 tokens over 4 ranks.
  GradcheckOptions o;
  o.model = "tiny-tp";
  o.seq = 12;
  o.batch = 2;
  o.schedule.kind = ScheduleKind::seco;
  o.schedule.chunk = 3;
  o.parallel.tp = 4;
  o.parallel.sequence_parallel = true;
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("does not divide them"), Error);
  o.parallel.sequence_parallel = false;  // without it any chunk works
  CHECK(run_gradcheck(o, out) == 0);
}

TEST_CASE("tensor parallel x data parallel = 2 x 2 equals one process to 1e-12, ZeRO 0/1/2 (gradcheck --against single)") {
  // World rank w = d * 2 + t on the grid of parallel/grid.h: DP rank d takes half the batch, TP rank
  // t holds its shard; gradients, loss and the parameters after 3 AdamW steps against one process.
  struct Schedule {
    const char* name;
    int64_t chunk, bwd_chunk;
  };
  const Schedule schedules[] = {{"full", 0, 0}, {"checkpointed", 0, 0}, {"seco", 6, 4}};
  for (const Schedule& s : schedules)
    for (const bool sp : {false, true})
      for (const int64_t zero : {0, 1, 2}) {
        GradcheckOptions o;
        o.model = "tiny-tp";
        o.seq = 16;
        o.batch = 4;
        o.schedule.kind = parse_schedule_kind(s.name);
        o.schedule.chunk = s.chunk;
        o.schedule.bwd_chunk = s.bwd_chunk;
        o.parallel.dp = 2;
        o.parallel.tp = 2;
        o.parallel.zero = zero;
        o.parallel.sequence_parallel = sp;
        o.parallel.tp_regather = sp;
        o.parallel.bucket_mb = 0.01;
        CAPTURE(s.name);
        CAPTURE(sp);
        CAPTURE(zero);
        const std::string out = same_as_one_process(o);
        CHECK(out.find("the replicated tensors on every TP rank): yes") != std::string::npos);
        if (zero > 0) CHECK(out.find("parameters bitwise identical") != std::string::npos);
      }
}

TEST_CASE("tensor parallel x data parallel: a world that is not dp x tp ranks, and tp not dividing the heads") {
  std::string err;
  try {
    run_thread_ranks(3, [](Communicator& world) { ParallelGrid grid(world, 2, 2); });
  } catch (const Error& e) {
    err = e.what();
  }
  CHECK(err.find("parallel.dp = 2 x parallel.tp = 2 is 4 ranks, but 3 were started") != std::string::npos);
  GradcheckOptions o;
  o.model = "tiny-tp";
  o.batch = 2;
  o.parallel.dp = 2;
  o.parallel.tp = 3;
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_gradcheck(o, out), doctest::Contains("parallel.tp = 3 does not divide num_attention_heads"),
                       Error);
}
