// Context parallelism's exchange of tokens for heads (parallel/context_parallel.h), on the threads
// backend in f64:
//   - each rank's heads (cp_heads_of_rank): shares when the ranks divide the heads, one head on
//     several ranks when the heads divide the ranks; cp_attention_config and cp_rank_tokens refuse any
//     other split, naming the key;
//   - cp_to_heads' forward gives rank r every token of its heads, bitwise, for query heads and K/V
//     heads with and without replicas; cp_to_tokens is its inverse, bitwise;
//   - each map's backward is the adjoint of its forward over the group, and to_heads' backward sums
//     the replicas' gradients (the definition written out, in rank order: bitwise);
//   - bad operands fail with one line;
//   - a decoder block over P ranks, each holding c/P tokens of each sequence, equals one process's
//     block over two chunks run as SeCO runs them (prefill, then each chunk recomputed and
//     backpropagated from the last): outputs, input gradients and the parameter gradients summed
//     over the ranks, within 1e-12 in f64, for Llama (K/V heads shared out and replicated), Qwen2's
//     biases, Qwen3's per-head norms, Gemma 2's caps, window and post-norms, and LoRA with dropout on
//     every linear (the masks keyed by each token's position, so every rank draws one process's);
//   - `gradcheck --cp P` (the model's chunks, every schedule): the loss, the first step's gradients
//     and the parameters after three AdamW steps against one process within 1e-12, every rank
//     holding bitwise the same parameters; and the combinations not implemented refused in one line.
#include "engine/ops/rope.h"
#include "engine/random.h"
#include "model/kv_store.h"
#include "model/layer.h"
#include "model/llama.h"
#include "model/lora.h"
#include "model/params.h"
#include "parallel/context_parallel.h"
#include "tests/support.h"
#include "tools/gradcheck.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

using namespace cw;

namespace {

OwnedTensor random_tensor(std::vector<int64_t> shape, uint64_t seed, uint64_t stream) {
  OwnedTensor t = OwnedTensor::of_shape(DType::f64, shape);
  fill_normal(t, seed, stream);
  return t;
}

std::vector<int64_t> shape_of(const Tensor& t) { return {t.shape.begin(), t.shape.begin() + t.ndim}; }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data, b.data, a.bytes()) == 0;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.ptr<double>()[i] * b.ptr<double>()[i];
  return s;
}

// x [B, T, G, D] as each rank's tokens: rank s's [B, n, G, D] holds x[:, s n + i].
std::vector<OwnedTensor> split_tokens(const Tensor& x, int64_t ranks) {
  const int64_t B = x.size(0), T = x.size(1), G = x.size(2), D = x.size(3), n = T / ranks;
  std::vector<OwnedTensor> parts;
  for (int64_t s = 0; s < ranks; ++s) {
    OwnedTensor p = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B, n, G, D});
    copy_convert(p, x.slice(1, s * n, n));
    parts.push_back(std::move(p));
  }
  return parts;
}

struct Shape {
  int64_t B, T, G, D, P;
};

}  // namespace

TEST_CASE("context parallel: each rank's heads, and the splits refused") {
  // Query heads over 4 ranks: two each.
  for (int64_t r = 0; r < 4; ++r) {
    CHECK(cp_heads_of_rank(8, 4, r).first == 2 * r);
    CHECK(cp_heads_of_rank(8, 4, r).count == 2);
  }
  // Two K/V heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1 (the query heads
  // 0-3 of 8 read K/V head 0, as ranks 0 and 1 attend them).
  const int64_t first[] = {0, 0, 1, 1};
  for (int64_t r = 0; r < 4; ++r) {
    CHECK(cp_heads_of_rank(2, 4, r).first == first[r]);
    CHECK(cp_heads_of_rank(2, 4, r).count == 1);
  }
  LlamaConfig cf = LlamaConfig::preset("tiny-tp");  // 8 heads, 4 K/V heads
  CHECK(cp_attention_config(cf, 4).num_attention_heads == 2);
  CHECK(cp_attention_config(cf, 4).num_key_value_heads == 1);
  CHECK(cp_attention_config(cf, 8).num_key_value_heads == 1);  // each K/V head on two ranks
  CHECK(cp_attention_config(cf, 2).num_key_value_heads == 2);
  CHECK(test::contains(test::error_of([&] { cp_attention_config(cf, 3); }),
                       "parallel.cp = 3 does not divide num_attention_heads = 8"));
  cf.num_attention_heads = 12;
  cf.num_key_value_heads = 6;
  CHECK(test::contains(test::error_of([&] { cp_attention_config(cf, 4); }),
                       "parallel.cp = 4 neither divides num_key_value_heads = 6 nor is a multiple of it"));
  run_thread_ranks(4, [](Communicator& comm) {
    ContextParallel group(comm);
    CHECK(cp_rank_tokens(&group, 32) == 8);
    CHECK(cp_rank_tokens(nullptr, 30) == 30);
    CHECK(test::contains(test::error_of([&] { cp_rank_tokens(&group, 30); }),
                         "context parallelism over 4 ranks: a chunk of 30 tokens does not split into 4 equal parts"));
  });
}

TEST_CASE("context parallel: to_heads gives each rank every token of its heads, to_tokens undoes it, bitwise") {
  // Query heads (G = 8 or 4 over 1, 2, 4 ranks) and K/V heads with replicas (G = 2 or 1 over 4).
  for (const Shape& s : {Shape{2, 12, 8, 3, 1}, Shape{2, 12, 8, 3, 2}, Shape{1, 8, 4, 5, 4}, Shape{3, 8, 2, 2, 4},
                         Shape{2, 4, 1, 3, 4}, Shape{2, 6, 4, 2, 2}}) {
    CAPTURE(s.G);
    CAPTURE(s.P);
    const OwnedTensor x = random_tensor({s.B, s.T, s.G, s.D}, 11, static_cast<uint64_t>(s.P * 16 + s.G));
    const std::vector<OwnedTensor> tokens = split_tokens(x, s.P);
    std::vector<OwnedTensor> heads(static_cast<size_t>(s.P)), back(static_cast<size_t>(s.P));
    run_thread_ranks(static_cast<int>(s.P), [&](Communicator& comm) {
      const int r = comm.rank();
      const HeadRange mine = cp_heads_of_rank(s.G, s.P, r);
      heads[r] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{s.B, s.T, mine.count, s.D});
      fill(heads[r], NAN);
      cp_to_heads_forward(comm, tokens[r], heads[r]);
      if (s.G % s.P == 0) {  // no replicas: to_tokens is the inverse
        back[r] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{s.B, s.T / s.P, s.G, s.D});
        fill(back[r], NAN);
        cp_to_tokens_forward(comm, heads[r], back[r]);
      }
    });
    for (int64_t r = 0; r < s.P; ++r) {
      CAPTURE(r);
      const HeadRange mine = cp_heads_of_rank(s.G, s.P, r);
      OwnedTensor expected = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{s.B, s.T, mine.count, s.D});
      copy_convert(expected, x.tensor.slice(2, mine.first, mine.count));
      CHECK(same_bits(heads[r], expected));
      if (s.G % s.P == 0) CHECK(same_bits(back[r], tokens[r]));
    }
  }
}

TEST_CASE("context parallel: each backward is its forward's adjoint; to_heads' backward sums the replicas") {
  for (const Shape& s : {Shape{2, 8, 8, 3, 2}, Shape{2, 8, 8, 3, 4}, Shape{2, 8, 2, 3, 4}, Shape{1, 12, 1, 4, 3},
                         Shape{2, 8, 4, 2, 1}}) {
    CAPTURE(s.G);
    CAPTURE(s.P);
    const uint64_t seed = static_cast<uint64_t>(100 + s.P * 16 + s.G);
    const std::vector<OwnedTensor> x = split_tokens(random_tensor({s.B, s.T, s.G, s.D}, seed, 1), s.P);
    std::vector<OwnedTensor> y, fx(static_cast<size_t>(s.P)), fty(static_cast<size_t>(s.P));
    for (int64_t r = 0; r < s.P; ++r)
      y.push_back(random_tensor({s.B, s.T, cp_heads_of_rank(s.G, s.P, r).count, s.D}, seed, 2 + static_cast<uint64_t>(r)));
    std::vector<OwnedTensor> gx(static_cast<size_t>(s.P)), gty(static_cast<size_t>(s.P));
    run_thread_ranks(static_cast<int>(s.P), [&](Communicator& comm) {
      const int r = comm.rank();
      fx[r] = OwnedTensor::of_shape(DType::f64, shape_of(y[r]));
      cp_to_heads_forward(comm, x[r], fx[r]);
      fty[r] = OwnedTensor::of_shape(DType::f64, shape_of(x[r]));
      fill(fty[r], NAN);
      cp_to_heads_backward(comm, y[r], fty[r]);
      if (s.G % s.P == 0) {  // to_tokens: heads -> tokens, adjoint to_heads
        gx[r] = OwnedTensor::of_shape(DType::f64, shape_of(x[r]));
        cp_to_tokens_forward(comm, y[r], gx[r]);
        gty[r] = OwnedTensor::of_shape(DType::f64, shape_of(y[r]));
        cp_to_tokens_backward(comm, x[r], gty[r]);
      }
    });
    double lhs = 0, rhs = 0, lhs2 = 0, rhs2 = 0;
    for (int64_t r = 0; r < s.P; ++r) {
      lhs += dot(fx[r], y[r]);
      rhs += dot(x[r], fty[r]);
      if (s.G % s.P == 0) {
        lhs2 += dot(gx[r], x[r]);
        rhs2 += dot(y[r], gty[r]);
      }
    }
    CHECK(std::abs(lhs - rhs) <= 1e-13 * std::max(1.0, std::abs(rhs)));
    CHECK(std::abs(lhs2 - rhs2) <= 1e-13 * std::max(1.0, std::abs(rhs2)));
    // The backward written out: token i of rank t, head j, is the sum over the ranks q holding head j
    // of their gradient at token t n + i, in rank order.
    const int64_t n = s.T / s.P;
    for (int64_t t = 0; t < s.P; ++t)
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < s.G; ++j)
            for (int64_t d = 0; d < s.D; ++d) {
              double sum = 0;
              bool first = true;
              for (int64_t q = 0; q < s.P; ++q) {
                const HeadRange h = cp_heads_of_rank(s.G, s.P, q);
                if (j < h.first || j >= h.first + h.count) continue;
                const double v = y[q].tensor.ptr<double>()[((b * s.T + t * n + i) * h.count + (j - h.first)) * s.D + d];
                sum = first ? v : sum + v;
                first = false;
              }
              const double got = fty[t].tensor.ptr<double>()[((b * n + i) * s.G + j) * s.D + d];
              if (got != sum) {
                FAIL_CHECK("to_heads' backward at rank " << t << " b " << b << " token " << i << " head " << j << ": "
                                                           << got << " against " << sum);
                return;
              }
            }
  }
}

TEST_CASE("context parallel: operands that do not fit the exchange fail with one line") {
  run_thread_ranks(2, [&](Communicator& comm) {
    OwnedTensor tokens = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 4, 4, 2});
    OwnedTensor heads = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 8, 2, 2});
    OwnedTensor wrong = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 8, 4, 2});
    OwnedTensor f32 = OwnedTensor::of_shape(DType::f32, std::vector<int64_t>{1, 8, 2, 2});
    OwnedTensor odd = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 4, 3, 2});
    CHECK(test::contains(test::error_of([&] { cp_to_heads_forward(comm, tokens, wrong); }),
                         fmt::format("cp_to_heads_forward: rank {} of 2 holds [1, 8, 2, 2] heads", comm.rank())));
    CHECK(test::contains(test::error_of([&] { cp_to_heads_forward(comm, tokens, f32); }),
                         "cp_to_heads_forward: tokens are f64 but heads f32"));
    CHECK(test::contains(test::error_of([&] { cp_to_heads_forward(comm, odd, heads); }),
                         "context parallelism over 2 ranks: 3 heads neither split into 2 equal parts nor divide 2"));
    CHECK(test::contains(test::error_of([&] { cp_to_tokens_forward(comm, heads, tokens.tensor.view({1, 4, 1, 8})); }),
                         "cp_to_tokens_forward: the 1 heads of f64 cpu [1, 4, 1, 8] do not split over 2 ranks"));
    // Still in step after the refusals (none issued a collective).
    cp_to_heads_forward(comm, tokens, heads);
  });
}

namespace {

// Rows [B * n, C] of x [B, T, C]: tokens [t0, t0 + n) of each sequence, packed.
OwnedTensor token_rows(const Tensor& x, int64_t t0, int64_t n) {
  OwnedTensor rows = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{x.size(0) * n, x.size(2)});
  copy_convert(rows.tensor.view({x.size(0), n, x.size(2)}), x.slice(1, t0, n));
  return rows;
}

double rel_err(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    num = std::max(num, std::abs(got.ptr<double>()[i] - want.ptr<double>()[i]));
    den = std::max(den, std::abs(want.ptr<double>()[i]));
  }
  return num / std::max(den, 1e-300);
}

// One layer's block over the two chunks [0, c), [c, 2c) of B sequences, run as SeCO runs it: chunk
// 0's forward keeping nothing (the prefill writes its K, V), chunk 1's forward kept and its backward,
// then chunk 0's forward kept (the recompute) and its backward. x and dy: [B, 2c, C], the block's
// input and the gradient of its output. The rank holds tokens [k c + r c/P, +c/P) of chunk k (all of
// them without a group). out: chunk 1's output rows; dx: each chunk's input gradient rows.
struct BlockRun {
  OwnedTensor out, dx0, dx1;
};
BlockRun run_block(const LlamaModel& model, const ParamSet& grads, const Tensor& x, const Tensor& dy, int64_t c,
                   ContextParallelGroup* cp) {
  const LlamaConfig& cf = model.config();
  const int64_t B = x.size(0), C = cf.hidden_size, P = cp ? cp->size() : 1, ct = c / P, r0 = cp ? cp->rank() * ct : 0;
  const int64_t half = cf.head_dim / 2;
  OwnedTensor cos = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{2 * c, half});
  OwnedTensor sin = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{2 * c, half});
  rope_tables(cos, sin, cf.head_dim, cf.rope_theta, cf.rope_scaling);
  KVStore kv(cp ? cp_attention_config(cf, P) : cf, B, 2 * c, DType::f64, {.with_grads = true});
  Arena arena, scratch;
  const LayerWeights w = model.layer(0), g = grads.weights().layers[0];
  auto context = [&](int64_t chunk) {
    return BlockContext{.config = cf, .rope_cos = cos, .rope_sin = sin, .B = B, .c = c, .pos0 = chunk * c,
                        .scratch = scratch, .lora = model.lora_runtime(), .cp = cp};
  };
  BlockRun run;
  const OwnedTensor x0 = token_rows(x, r0, ct), x1 = token_rows(x, c + r0, ct);
  OwnedTensor prefill_out = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B * ct, C});
  block_forward(prefill_out, nullptr, x0, w, kv, 0, context(0));
  for (int64_t chunk : {1, 0}) {
    const OwnedTensor& xin = chunk == 1 ? x1 : x0;
    LayerActivations a = LayerActivations::allocate(arena, cf, B, c, DType::f64, MlpKept::all, nullptr, cp);
    OwnedTensor out = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B * ct, C});
    block_forward(out, &a, xin, w, kv, 0, context(chunk));
    OwnedTensor d = token_rows(dy, chunk * c + r0, ct);
    block_backward(d, g, a, xin, w, kv, 0, context(chunk));
    if (chunk == 1) {
      run.out = std::move(out);
      run.dx1 = std::move(d);
    } else {
      run.dx0 = std::move(d);
    }
  }
  return run;
}

}  // namespace

TEST_CASE("context parallel: a block over P ranks equals one process's block, SeCO's two chunks, f64") {
  struct Case {
    const char* preset;
    int P;
    bool lora;  // adapters of rank 2 on every linear, dropout 0.25 (masks keyed by each token's position)
  };
  for (const Case& k : {Case{"tiny-tp", 2, false}, Case{"tiny-tp", 4, false}, Case{"tiny-tp", 8, false},
                        Case{"tiny-qwen2", 2, false}, Case{"tiny-qwen3", 4, false}, Case{"tiny-gemma2", 2, false},
                        Case{"tiny-tp", 4, true}}) {
    CAPTURE(std::string(k.preset));
    CAPTURE(k.P);
    CAPTURE(k.lora);
    const LlamaConfig cf = LlamaConfig::preset(k.preset);
    const int64_t B = 2, c = 8, C = cf.hidden_size, P = k.P, ct = c / P;
    LoraConfig lora;
    if (k.lora) lora = {.rank = 2, .alpha = 4.0, .dropout = 0.25, .targets = "all-linear", .seed = 5};
    LlamaModel model(cf, DType::f64, Device::host(), nullptr, lora);
    fill_normal(model.params().flat(), 7, 1, 0.0, 0.3);
    if (k.lora) {
      fill_normal(model.adapters().flat(), 7, 4, 0.0, 0.3);  // B is zero as PEFT starts it: give it signal
      model.set_dropout_round(3);
    }
    const OwnedTensor x = random_tensor({B, 2 * c, C}, 7, 2), dy = random_tensor({B, 2 * c, C}, 7, 3);

    auto gradient_set = [&] { return ParamSet::like(model.trainable(), DType::f64); };
    const ParamSet grads = gradient_set();
    const BlockRun one = run_block(model, grads, x, dy, c, nullptr);

    std::vector<ParamSet> rank_grads;
    for (int64_t r = 0; r < P; ++r) rank_grads.push_back(gradient_set());
    std::vector<BlockRun> runs(static_cast<size_t>(P));
    run_thread_ranks(static_cast<int>(P), [&](Communicator& comm) {
      ContextParallel group(comm);
      runs[comm.rank()] = run_block(model, rank_grads[comm.rank()], x, dy, c, &group);
    });

    double worst = 0;
    for (int64_t r = 0; r < P; ++r) {
      CAPTURE(r);
      // The one process's rows of the rank's tokens: rows b c + r ct + t of its [B c, C] tensors.
      auto mine = [&](const OwnedTensor& all) {
        return token_rows(all.tensor.view({B, c, C}), r * ct, ct);
      };
      worst = std::max({worst, rel_err(runs[r].out, mine(one.out)), rel_err(runs[r].dx1, mine(one.dx1)),
                        rel_err(runs[r].dx0, mine(one.dx0))});
    }
    // Each rank's parameter gradients are its tokens' share: summed over the ranks, one process's.
    OwnedTensor summed = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{grads.numel()});
    copy_convert(summed, rank_grads[0].flat());
    for (int64_t r = 1; r < P; ++r)
      for (int64_t i = 0; i < grads.numel(); ++i) summed.tensor.ptr<double>()[i] += rank_grads[r].flat().ptr<double>()[i];
    const double grad_err = rel_err(summed, grads.flat());
    INFO("outputs and input gradients: " << worst << ", parameter gradients: " << grad_err);
    CHECK(worst <= 1e-12);
    CHECK(grad_err <= 1e-12);
    const Tensor flat = grads.flat();  // the gradients carry signal
    CHECK(dot(flat, flat) > 0);
  }
}

namespace {

GradcheckOptions cp_gradcheck(const char* model, int64_t cp, ScheduleKind kind, int64_t chunk = 0, int64_t bwd_chunk = 0) {
  GradcheckOptions o;
  o.model = model;
  o.seq = 16;
  o.batch = 2;
  o.parallel.cp = cp;
  o.schedule.kind = kind;
  o.schedule.chunk = chunk;
  o.schedule.bwd_chunk = bwd_chunk;
  return o;
}

}  // namespace

TEST_CASE("context parallel: gradcheck --cp P equals one process under every schedule, f64") {
  std::vector<GradcheckOptions> cases;
  for (int64_t cp : {2, 4, 8}) {  // tiny-tp: 8 heads, 4 K/V heads (at 8 ranks two ranks hold each)
    cases.push_back(cp_gradcheck("tiny-tp", cp, ScheduleKind::full));
    cases.push_back(cp_gradcheck("tiny-tp", cp, ScheduleKind::seco, 8, cp == 8 ? 8 : 4));
  }
  cases.push_back(cp_gradcheck("tiny", 2, ScheduleKind::checkpointed));
  cases.back().schedule.recompute = RecomputeMode::selective;
  cases.push_back(cp_gradcheck("tiny", 2, ScheduleKind::spaco, 4));
  cases.back().schedule.keep = 2;
  cases.push_back(cp_gradcheck("tiny", 2, ScheduleKind::seco, 8, 4));
  cases.back().schedule.save_attention = true;
  cases.back().schedule.mlp_shards = 3;
  cases.push_back(cp_gradcheck("tiny-qwen2", 2, ScheduleKind::seco, 8, 4));
  cases.push_back(cp_gradcheck("tiny-qwen3", 4, ScheduleKind::seco, 8, 4));
  cases.push_back(cp_gradcheck("tiny-gemma2", 2, ScheduleKind::seco, 8, 4));
  cases.push_back(cp_gradcheck("tiny-mistral", 2, ScheduleKind::seco, 8, 4));
  cases.push_back(cp_gradcheck("tiny-tp", 4, ScheduleKind::seco, 8, 4));  // LoRA, dropout on every linear
  cases.back().lora = {.rank = 4, .alpha = 8.0, .dropout = 0.1, .targets = "all-linear", .seed = 3};
  for (ScheduleKind kind : {ScheduleKind::full, ScheduleKind::seco}) {  // with data parallelism: 2 x 2 ranks
    cases.push_back(cp_gradcheck("tiny-tp", 2, kind, kind == ScheduleKind::seco ? 8 : 0, kind == ScheduleKind::seco ? 4 : 0));
    cases.back().parallel.dp = 2;
    cases.back().batch = 4;
  }
  cases.push_back(cp_gradcheck("tiny-tp", 2, ScheduleKind::seco, 8, 4));  // LoRA with dropout, 3 x 2 ranks
  cases.back().parallel.dp = 3;
  cases.back().batch = 3;
  cases.back().lora = {.rank = 4, .alpha = 8.0, .dropout = 0.1, .targets = "all-linear", .seed = 3};
  for (const GradcheckOptions& o : cases) {
    CAPTURE(o.model);
    CAPTURE(o.parallel.cp);
    CAPTURE(std::string(schedule_name(o.schedule.kind)));
    CAPTURE(o.lora.rank);
    std::ostringstream out;
    const int rc = run_gradcheck(o, out);
    INFO(out.str());
    CHECK(rc == 0);
    CHECK(test::max_rel_err(out.str()) <= test::kSameMathF64Tol);
    CHECK(test::contains(out.str(), "ranks hold bitwise the same parameters: yes"));
    CHECK(test::contains(out.str(), fmt::format("context parallel: {} ranks (threads)", o.parallel.cp)));
  }
}

TEST_CASE("context parallel: gradcheck --cp refuses what it does not implement, in one line") {
  struct Refused {
    GradcheckOptions options;
    const char* message;
  };
  std::vector<Refused> table;
  table.push_back({cp_gradcheck("tiny", 3, ScheduleKind::full), "parallel.cp = 3 does not divide num_attention_heads = 4"});
  table.push_back({cp_gradcheck("tiny", 2, ScheduleKind::seco, 5), "--cp 2 splits every chunk's tokens into equal parts"});
  table.push_back({cp_gradcheck("tiny", 2, ScheduleKind::full), "gradcheck --cp with --zero is not implemented"});
  table.back().options.parallel.zero = 1;
  table.back().options.parallel.dp = 2;
  table.push_back({cp_gradcheck("tiny", 2, ScheduleKind::full), "--cp with --documents is not implemented"});
  table.back().options.documents = {8, 8};
  table.push_back({cp_gradcheck("tiny", 2, ScheduleKind::full), "--cp compares its ranks with one process"});
  table.back().options.against = "full";
  table.push_back({cp_gradcheck("tiny", 2, ScheduleKind::seco, 8), "a context-parallel rank holds only its share"});
  table.back().options.schedule.save_inputs = true;
  for (const Refused& r : table) {
    CAPTURE(r.message);
    std::ostringstream out;
    const std::string error = test::message_of([&] { run_gradcheck(r.options, out); });
    CHECK(test::contains(error, r.message));
    CHECK(error.find('\n') == std::string::npos);
  }
}
