// cuDNN fused attention (engine/cuda/attention_cudnn.cu) beyond the op table (test_backend_ops.cpp
// runs it, deterministic and not, against the CPU in f64 with poisoning,
// accumulation into K/V-store slices and repeatability): the backward's workspace against a budget,
// what it says where it does not serve, the shared plans (one per K/V store extent): their
// results against the exact plans' and the CPU's across many chunk offsets, with the store's rows
// past the call's keys poisoned, and how many plans a sweep of offsets builds; and the calls run with
// their earlier keys apart (cudnn_split_prefix) against the CPU and against one masked graph.
#include "chunkwise_config.h"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/ops/attention.h"
#include "engine/ops/residual.h"
#include "engine/random.h"
#include "engine/scratch.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

using namespace cw;
using namespace cw::test;

#if CW_HAVE_CUDNN

namespace {
// The tests call the cuDNN entry points directly, whatever CW_ATTENTION says.
void opt_in() {}
}  // namespace

TEST_CASE("cuda: cudnn attention backward states its workspace against a budget" *
          doctest::skip(!cw::test::gpu_ready())) {
  // `automatic` takes the cuDNN backward only where its plan's workspace fits the budget. The fast
  // engine (f32 dQ accumulator, the graph in the frontend library's arrangement) stages nothing of
  // size c x S: at 2048 tokens and 8 heads it needs at most the per-query-head f32 dK/dV of its
  // GQA head reduction (B H S D 4 bytes = 4 MiB), so it must fit 16 MiB, where the older
  // arrangements wanted B H c S 4 bytes = 128 MiB (32 GiB at 16K tokens and 32 heads). The
  // deterministic engine stages dS (bf16, B H c S 2 bytes = 64 MiB here): a 16 MiB budget must
  // say no, and why; 1 GiB yes.
  const int64_t c = 2048, H = 8, Hkv = 2, D = 64;
  OwnedTensor q = OwnedTensor::on(gpu0(), DType::bf16, {1, c, H, D}), k = OwnedTensor::on(gpu0(), DType::bf16, {1, c, Hkv, D});
  std::string why;
  opt_in();
  if (!gpu::cudnn_attention_supports(q, k, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  {
    DeterminismScope scope(false);
    CHECK_MESSAGE(gpu::cudnn_attention_backward_fits(q, k, k, int64_t{16} << 20, &why), why);
  }
  {
    DeterminismScope scope(true);
    why.clear();
    CHECK_FALSE(gpu::cudnn_attention_backward_fits(q, k, k, int64_t{16} << 20, &why));
    CHECK_MESSAGE(why.find("workspace") != std::string::npos, why);
    CHECK_MESSAGE(gpu::cudnn_attention_backward_fits(q, k, k, int64_t{1} << 30, &why), why);
  }
}

TEST_CASE("cuda: cudnn attention backward's workspace is engine/scratch.h's, which the planner counts" *
          doctest::skip(!cw::test::gpu_ready())) {
  // The planner replays cudnn_attention_backward_workspace for every backward: with grouped heads the
  // per-query-head dK and dV of every key in bf16 (B H S D x 4 bytes) and 256 bytes. One graph (the
  // chunk's own keys) asks for that staging and at most the 256 bytes more; a call with its earlier
  // keys apart, or without grouped heads, for no more than the figure.
  struct Shape {
    int64_t c, S, H, Hkv;
  };
  for (const Shape sh : {Shape{512, 512, 8, 2}, Shape{256, 1024, 8, 2}, Shape{512, 512, 8, 8}}) {
    const int64_t D = 64;
    CAPTURE(sh.c);
    CAPTURE(sh.S);
    CAPTURE(sh.Hkv);
    OwnedTensor q = OwnedTensor::on(gpu0(), DType::bf16, {1, sh.c, sh.H, D});
    OwnedTensor k = OwnedTensor::on(gpu0(), DType::bf16, {1, sh.S, sh.Hkv, D});
    std::string why;
    if (!gpu::cudnn_attention_supports(q, k, &why)) {
      MESSAGE("cuDNN fused attention not available here, skipped: ", why);
      return;
    }
    DeterminismScope scope(false);
    const AttentionDims d{1, sh.c, sh.S, sh.H, sh.Hkv, D};
    const int64_t planned = static_cast<int64_t>(cudnn_attention_backward_workspace(d));
    CHECK_MESSAGE(gpu::cudnn_attention_backward_fits(q, k, k, planned, &why), why);
    if (sh.c == sh.S && sh.H != sh.Hkv) CHECK_FALSE(gpu::cudnn_attention_backward_fits(q, k, k, planned - 257, &why));
  }
}

TEST_CASE("cuda: cudnn attention says why it does not serve f32, odd head dims, large head dims and one query" *
          doctest::skip(!cw::test::gpu_ready())) {
  std::string why;
  opt_in();
  OwnedTensor q32 = OwnedTensor::on(gpu0(), DType::f32, {1, 8, 2, 64}), k32 = OwnedTensor::on(gpu0(), DType::f32, {1, 8, 2, 64});
  CHECK_FALSE(gpu::cudnn_attention_supports(q32, k32, &why));
  CHECK(!why.empty());
  OwnedTensor q_odd = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 60}), k_odd = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 60});
  CHECK_FALSE(gpu::cudnn_attention_supports(q_odd, k_odd, &why));
  OwnedTensor q_big = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 256}), k_big = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 256});
  CHECK_FALSE(gpu::cudnn_attention_supports(q_big, k_big, &why));
  CHECK(!why.empty());
  // One query row (a token at a time): cuDNN's engine for it is not reproducible bit for bit.
  OwnedTensor q_one = OwnedTensor::on(gpu0(), DType::bf16, {1, 1, 2, 64}), k_one = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 64});
  CHECK_FALSE(gpu::cudnn_attention_supports(q_one, k_one, &why));
  CHECK(why.find("one query") != std::string::npos);
}

namespace {

// Set cw::cudnn_plans(), cw::cudnn_split_prefix(), cw::cudnn_plan_threads() for one scope, restoring
// what they were.
struct CudnnPlansScope : SettingScope<CudnnPlans> {
  explicit CudnnPlansScope(CudnnPlans plans) : SettingScope(cw::cudnn_plans, cw::set_cudnn_plans, plans) {}
};
struct SplitPrefixScope : SettingScope<bool> {
  explicit SplitPrefixScope(bool on) : SettingScope(cw::cudnn_split_prefix, cw::set_cudnn_split_prefix, on) {}
};
struct StackGqaScope : SettingScope<bool> {
  explicit StackGqaScope(bool on) : SettingScope(cw::cudnn_stack_gqa, cw::set_cudnn_stack_gqa, on) {}
};
struct PlanThreadsScope : SettingScope<int> {
  explicit PlanThreadsScope(int threads) : SettingScope(cw::cudnn_plan_threads, cw::set_cudnn_plan_threads, threads) {}
};

// bf16 operands and bf16 outputs against f64 (the op table's bf16 tolerance).
constexpr double kBf16Tol = 2e-2;
// A shared plan against the exact plan on the same bf16 inputs: the same math in another engine
// variant, so they differ by a few bf16 roundings at most, well inside the f64 tolerance.
constexpr double kSharedVsExactTol = 1e-2;
// Shared plans need cuDNN 9.10 (attention_cudnn.cu, kMinSharedVersion).
bool shared_plans_possible() { return gpu::cudnn_runtime_version() >= 91000; }

// One chunk of c queries against a K/V store of T positions: q, d_out [B, c, H, D] and the stores
// [B, T, Hkv, D] in bf16 on the GPU and in f64 on the host (the same values).
struct Chunked {
  int64_t B, c, H, Hkv, D, T;
  double scale;
  GpuInput q, d_out, k_store, v_store;
  Chunked(int64_t B_, int64_t c_, int64_t H_, int64_t Hkv_, int64_t D_, int64_t T_, uint64_t seed)
      : B(B_), c(c_), H(H_), Hkv(Hkv_), D(D_), T(T_), scale(1.0 / std::sqrt(static_cast<double>(D_))),
        q(make_gpu_input(DType::bf16, {B_, c_, H_, D_}, seed, 1)),
        d_out(make_gpu_input(DType::bf16, {B_, c_, H_, D_}, seed, 2)),
        k_store(make_gpu_input(DType::bf16, {B_, T_, Hkv_, D_}, seed, 3)),
        v_store(make_gpu_input(DType::bf16, {B_, T_, Hkv_, D_}, seed, 4)) {}
};

// What one forward + backward on the GPU gave, fetched as f64: out, lse, d_q, and the whole
// d_k, d_v stores (T rows; the op adds into [0, S) of zeroed stores).
struct GpuResult {
  OwnedTensor out, lse, d_q, d_k, d_v;
};

GpuResult run_gpu(const Chunked& ch, int64_t S) {
  const int64_t B = ch.B, c = ch.c, H = ch.H, Hkv = ch.Hkv, D = ch.D, T = ch.T;
  Arena scratch(gpu0());
  const Tensor k = ch.k_store.dev.tensor.slice(1, 0, S), v = ch.v_store.dev.tensor.slice(1, 0, S);
  OwnedTensor out = poisoned(DType::bf16, {B, c, H, D}), lse = poisoned(DType::f32, {B, H, c});
  gpu::cudnn_attention_forward(out, {lse}, ch.q.dev, k, v, ch.scale, scratch);
  OwnedTensor d_q = poisoned(DType::bf16, {B, c, H, D});
  OwnedTensor d_k = OwnedTensor::on(gpu0(), DType::f32, {B, T, Hkv, D}), d_v = OwnedTensor::on(gpu0(), DType::f32, {B, T, Hkv, D});
  gpu::fill(d_k, 0.0);
  gpu::fill(d_v, 0.0);
  gpu::cudnn_attention_backward(d_q, d_k.tensor.slice(1, 0, S), d_v.tensor.slice(1, 0, S), ch.d_out.dev, {lse},
                                ch.q.dev, k, v, out, ch.scale, GradMode::overwrite, scratch);
  return {fetch(out), fetch(lse), fetch(d_q), fetch(d_k), fetch(d_v)};
}

// The CPU in f64 on the same values: out, lse, d_q, and d_k, d_v over [0, S).
struct CpuResult {
  OwnedTensor out, lse, d_q, d_k, d_v;
};

CpuResult run_cpu(const Chunked& ch, int64_t S) {
  const int64_t B = ch.B, c = ch.c, H = ch.H, Hkv = ch.Hkv, D = ch.D;
  Arena scratch;
  const Tensor k = ch.k_store.ref.tensor.slice(1, 0, S), v = ch.v_store.ref.tensor.slice(1, 0, S);
  using Shape = std::vector<int64_t>;
  CpuResult r{OwnedTensor::of_shape(DType::f64, Shape{B, c, H, D}), OwnedTensor::of_shape(DType::f64, Shape{B, H, c}),
              OwnedTensor::of_shape(DType::f64, Shape{B, c, H, D}), OwnedTensor::of_shape(DType::f64, Shape{B, S, Hkv, D}),
              OwnedTensor::of_shape(DType::f64, Shape{B, S, Hkv, D})};
  attention_forward(r.out, {r.lse}, ch.q.ref, k, v, ch.scale, scratch);
  fill(r.d_k, 0.0);
  fill(r.d_v, 0.0);
  attention_backward(r.d_q, r.d_k, r.d_v, ch.d_out.ref, {r.lse}, ch.q.ref, k, v, r.out, ch.scale, GradMode::overwrite,
                     scratch);
  return r;
}

void expect_close_f64(const Tensor& got, const Tensor& ref, double tol, const std::string& what) {
  const Worst w = compare(got, ref);
  INFO(what, ": ", w.str(), " (tolerance ", tol, ")");
  CHECK(w.rel <= tol);
}

// Every element of rows [S, T) of a fetched [B, T, Hkv, D] store is zero: the op added nothing there.
bool untouched_past(const Tensor& store, int64_t S) {
  const int64_t B = store.size(0), T = store.size(1), row = store.size(2) * store.size(3);
  const double* d = static_cast<const double*>(store.data);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = S * row; i < T * row; ++i)
      if (d[b * T * row + i] != 0.0) return false;
  return true;
}

// A GPU run against the CPU's in f64 over the call's S keys, and nothing added to the stores past them.
void expect_matches_cpu(const GpuResult& r, const CpuResult& ref, int64_t S, const std::string& n) {
  expect_close_f64(r.out, ref.out, kBf16Tol, n + " out");
  expect_close_f64(r.lse, ref.lse, kBf16Tol, n + " lse");
  expect_close_f64(r.d_q, ref.d_q, kBf16Tol, n + " d_q");
  expect_close_f64(r.d_k.tensor.slice(1, 0, S), ref.d_k, kBf16Tol, n + " d_k");
  expect_close_f64(r.d_v.tensor.slice(1, 0, S), ref.d_v, kBf16Tol, n + " d_v");
  CHECK_MESSAGE(untouched_past(r.d_k, S), n, ": d_k changed past the call's keys");
  CHECK_MESSAGE(untouched_past(r.d_v, S), n, ": d_v changed past the call's keys");
}

// Two GPU runs of the same call by different plans, over its S keys.
void expect_runs_close(const GpuResult& a, const GpuResult& b, int64_t S, const std::string& n) {
  expect_close_f64(a.out, b.out, kSharedVsExactTol, n + ": out");
  expect_close_f64(a.lse, b.lse, kSharedVsExactTol, n + ": lse");
  expect_close_f64(a.d_q, b.d_q, kSharedVsExactTol, n + ": d_q");
  expect_close_f64(a.d_k.tensor.slice(1, 0, S), b.d_k.tensor.slice(1, 0, S), kSharedVsExactTol, n + ": d_k");
  expect_close_f64(a.d_v.tensor.slice(1, 0, S), b.d_v.tensor.slice(1, 0, S), kSharedVsExactTol, n + ": d_v");
}

}  // namespace

TEST_CASE("cuda: cudnn shared plans agree with exact plans and the CPU across chunk offsets" *
          doctest::skip(!cw::test::gpu_ready())) {
  // GQA (4 query heads on 2 K/V heads), two sequences, a chunk of 384 queries (not a power of two)
  // against a store of 2048 positions. Key counts below 2048 that are multiples of 256 run the
  // shared plan (extent 2048); the others (S = 2048, 461, 384) their exact one. The store's rows past S hold NaN while
  // each call runs, so a plan that read a key it should not would show NaN in every result.
  DeterminismScope fast(false);
  Chunked ch(2, 384, 4, 2, 64, 2048, 4242);
  std::string why;
  if (!gpu::cudnn_attention_supports(ch.q.dev, ch.k_store.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  if (!shared_plans_possible()) MESSAGE("cuDNN ", gpu::cudnn_runtime_version(), " < 9.10: every call here runs an exact plan");
  // Decreasing S, so that poisoning [S, T) spoils no key a later call reads.
  for (const int64_t S : {int64_t{2048}, int64_t{1792}, int64_t{1280}, int64_t{768}, int64_t{512}, int64_t{461},
                          int64_t{384}}) {
    CAPTURE(S);
    for (int64_t b = 0; b < ch.B; ++b)
      for (const GpuInput* store : {&ch.k_store, &ch.v_store})
        if (S < ch.T) gpu::fill(store->dev.tensor.slice(0, b, 1).slice(1, S, ch.T - S), std::numeric_limits<double>::quiet_NaN());
    const CpuResult ref = run_cpu(ch, S);
    GpuResult shared, exact;
    {
      CudnnPlansScope scope(CudnnPlans::shared);
      shared = run_gpu(ch, S);
    }
    {
      CudnnPlansScope scope(CudnnPlans::exact);
      exact = run_gpu(ch, S);
    }
    expect_matches_cpu(shared, ref, S, "shared");
    expect_matches_cpu(exact, ref, S, "exact");
    expect_runs_close(shared, exact, S, "shared against exact");
  }
}

TEST_CASE("cuda: cudnn shared plans: a sweep of chunk offsets builds one plan per direction" *
          doctest::skip(!cw::test::gpu_ready())) {
  // A shape family no other test uses (the plan cache lives as long as the process): one sequence,
  // 6 query heads on 3 K/V heads, chunks of 512 against a store of 4096. The forward sweeps p up
  // (the prefill), the backward down (the reverse sweep). Shared: each direction builds one plan
  // of the store's extent for S < 4096 and the exact plan of S = 4096 (keys that fill the store
  // keep their exact plan). Exact: one plan per call.
  DeterminismScope fast(false);
  const int64_t c = 512, T = 4096;
  const Chunked ch(1, c, 6, 3, 64, T, 99);
  std::string why;
  if (!gpu::cudnn_attention_supports(ch.q.dev, ch.k_store.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  if (!shared_plans_possible()) {
    MESSAGE("cuDNN ", gpu::cudnn_runtime_version(), " < 9.10 has no shared plans; skipped");
    return;
  }
  auto sweep = [&](int64_t chunk_len, int64_t calls) {
    Chunked run(1, chunk_len, 6, 3, 64, T, 99);
    Arena scratch(gpu0());
    OwnedTensor out = OwnedTensor::on(gpu0(), DType::bf16, {1, chunk_len, 6, 64}),
                lse = OwnedTensor::on(gpu0(), DType::f32, {1, 6, chunk_len}),
                d_q = OwnedTensor::on(gpu0(), DType::bf16, {1, chunk_len, 6, 64});
    OwnedTensor d_k = OwnedTensor::on(gpu0(), DType::f32, {1, T, 3, 64}), d_v = OwnedTensor::on(gpu0(), DType::f32, {1, T, 3, 64});
    gpu::fill(d_k, 0.0);
    gpu::fill(d_v, 0.0);
    const AttentionPlanStats before = attention_plan_stats();
    for (int64_t i = 0; i < calls; ++i) {
      const int64_t S = (i + 1) * chunk_len;
      gpu::cudnn_attention_forward(out, {lse}, run.q.dev, run.k_store.dev.tensor.slice(1, 0, S),
                                   run.v_store.dev.tensor.slice(1, 0, S), run.scale, scratch);
    }
    const AttentionPlanStats mid = attention_plan_stats();
    for (int64_t i = calls - 1; i >= 0; --i) {
      const int64_t S = (i + 1) * chunk_len;
      const Tensor k = run.k_store.dev.tensor.slice(1, 0, S), v = run.v_store.dev.tensor.slice(1, 0, S);
      gpu::cudnn_attention_forward(out, {lse}, run.q.dev, k, v, run.scale, scratch);
      gpu::cudnn_attention_backward(d_q, d_k.tensor.slice(1, 0, S), d_v.tensor.slice(1, 0, S), run.d_out.dev, {lse},
                                    run.q.dev, k, v, out, run.scale, GradMode::overwrite, scratch);
    }
    synchronize(gpu0());
    const AttentionPlanStats after = attention_plan_stats();
    MESSAGE("chunk ", chunk_len, ", ", calls, " offsets: ", mid.built - before.built, " forward and ",
            after.built - mid.built, " backward plans built in ", after.seconds - before.seconds, " s");
    CHECK_MESSAGE(after.refused == before.refused, "cuDNN refused a shared graph; CW_CUDNN_VERBOSE=1 prints why");
    return std::make_pair(mid.built - before.built, after.built - mid.built);
  };
  {
    CudnnPlansScope scope(CudnnPlans::shared);
    const auto [forward, backward] = sweep(c, T / c);
    CHECK(forward == 2);
    CHECK(backward == 2);
  }
  {
    CudnnPlansScope scope(CudnnPlans::exact);
    PlanThreadsScope no_ahead(0);  // plans built ahead would build the family's other offsets too
    const auto [forward, backward] = sweep(256, 4);  // another chunk length: a family of its own
    CHECK(forward == 4);
    CHECK(backward == 4);
  }
}

TEST_CASE("cuda: cudnn exact plans built ahead serve a sweep of chunk offsets as the CPU does" *
          doctest::skip(!cw::test::gpu_ready())) {
  // A family no other test builds: 6 query heads on 2 K/V heads, chunks of 320 against a store of
  // 2560. The prefill's first call builds its plan and queues the other 15 of the family (8
  // offsets, both directions) for 4 threads; the sweeps then run every offset forward (rising) and
  // backward (falling), each against the CPU in f64, so a plan built on a worker's cuDNN handle
  // and run on the compute stream's must give the right answers. How many were built ahead
  // depends on timing; that some were, and that the family built each plan once, does not.
  DeterminismScope fast(false);
  CudnnPlansScope exact(CudnnPlans::exact);
  PlanThreadsScope threads(4);
  const int64_t c = 320, T = 2560;
  Chunked ch(1, c, 6, 2, 64, T, 777);
  std::string why;
  if (!gpu::cudnn_attention_supports(ch.q.dev, ch.k_store.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  const AttentionPlanStats before = attention_plan_stats();
  for (int64_t S = c; S <= T; S += c) {
    CAPTURE(S);
    Arena scratch(gpu0());
    OwnedTensor out = poisoned(DType::bf16, {1, c, 6, 64}), lse = poisoned(DType::f32, {1, 6, c});
    gpu::cudnn_attention_forward(out, {lse}, ch.q.dev, ch.k_store.dev.tensor.slice(1, 0, S),
                                 ch.v_store.dev.tensor.slice(1, 0, S), ch.scale, scratch);
    const CpuResult ref = run_cpu(ch, S);
    expect_close_f64(fetch(out), ref.out, kBf16Tol, "out");
    expect_close_f64(fetch(lse), ref.lse, kBf16Tol, "lse");
  }
  for (int64_t S = T; S >= c; S -= c) {
    CAPTURE(S);
    const GpuResult r = run_gpu(ch, S);
    const CpuResult ref = run_cpu(ch, S);
    expect_close_f64(r.d_q, ref.d_q, kBf16Tol, "d_q");
    expect_close_f64(r.d_k.tensor.slice(1, 0, S), ref.d_k, kBf16Tol, "d_k");
    expect_close_f64(r.d_v.tensor.slice(1, 0, S), ref.d_v, kBf16Tol, "d_v");
  }
  synchronize(gpu0());
  const AttentionPlanStats after = attention_plan_stats();
  MESSAGE("chunk ", c, ", store ", T, ": ", after.built - before.built, " plans built, ", after.built_ahead - before.built_ahead,
          " of them ahead; calls waited ", after.waited_seconds - before.waited_seconds, " s of ",
          after.seconds - before.seconds, " s of build time");
  CHECK(after.built - before.built == 2 * T / c);
  CHECK(after.built_ahead > before.built_ahead);
  CHECK(after.refused == before.refused);
}

TEST_CASE("cuda: automatic attention runs flash while a store slice's cuDNN plan is built ahead" *
          doctest::skip(!cw::test::gpu_ready())) {
  // A fresh family (5 query heads on 1 K/V head, chunks of 192 against a store of 1536): the
  // chooser must not wait for its plan. The first ask queues the plan (and its family) and answers
  // flash, with the reason; once the workers have built it, cuDNN. The call itself is right either
  // way (against the CPU in f64). With determinism on the chooser never falls back.
  DeterminismScope fast(false);
  CudnnPlansScope exact(CudnnPlans::exact);
  PlanThreadsScope threads(2);
  const int64_t c = 192, T = 1536, S = 768;
  Chunked ch(1, c, 5, 1, 64, T, 31337);
  std::string why;
  if (!gpu::cudnn_attention_supports(ch.q.dev, ch.k_store.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  const Tensor k = ch.k_store.dev.tensor.slice(1, 0, S), v = ch.v_store.dev.tensor.slice(1, 0, S);
  OwnedTensor out = poisoned(DType::bf16, {1, c, 5, 64}), lse = poisoned(DType::f32, {1, 5, c});
  const AttentionCall call = attention_call(ch.q.dev, k, v, out);
  const AttentionChoice first = choose_attention_kernel(call, {AttentionKernel::automatic, false});
  CHECK_MESSAGE(first.kernel != AttentionKernel::cudnn, first.reason);
  CHECK_MESSAGE(first.reason.find("built ahead") != std::string::npos, first.reason);
  {
    DeterminismScope det(true);
    const AttentionChoice d = choose_attention_kernel(call, {AttentionKernel::automatic, true});
    CHECK_MESSAGE(d.reason.find("built ahead") == std::string::npos, d.reason);
  }
  Arena scratch(gpu0());
  attention_forward(out, {lse}, ch.q.dev, k, v, ch.scale, scratch);  // whichever kernel it takes now
  const CpuResult ref = run_cpu(ch, S);
  expect_close_f64(fetch(out), ref.out, kBf16Tol, "out");
  bool ready = false;
  for (int i = 0; i < 400 && !ready; ++i) {
    ready = gpu::cudnn_attention_plan_ready(ch.q.dev, k, v, false);
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE_MESSAGE(ready, "the plan was not built ahead within 20 s");
  const AttentionChoice later = choose_attention_kernel(call, {AttentionKernel::automatic, false});
  CHECK_MESSAGE(later.kernel == AttentionKernel::cudnn, later.reason);
}

TEST_CASE("cuda: a family's shared plans stand in for its exact plans while those are built ahead" *
          doctest::skip(!cw::test::gpu_ready())) {
  // A family no other test builds: 8 query heads on 2 K/V heads, chunks of 256 (a multiple of the
  // shared plans' alignment) against a store of 2048. Its two shared plans are built first (shared
  // mode); then, in exact mode with one worker building the exact plans ahead, every call of a
  // prefill sweep whose keys are a slice of the store is taken by cuDNN (the shared plan standing
  // in where its own is not built yet), and a reverse sweep's results all match the CPU in f64.
  if (!shared_plans_possible()) {
    MESSAGE("cuDNN ", gpu::cudnn_runtime_version(), " has no shared plans (9.10+), skipped");
    return;
  }
  DeterminismScope fast(false);
  const int64_t c = 256, T = 2048, H = 8, Hkv = 2, D = 64;
  Chunked ch(1, c, H, Hkv, D, T, 4242);
  std::string why;
  if (!gpu::cudnn_attention_supports(ch.q.dev, ch.k_store.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  {
    CudnnPlansScope shared(CudnnPlans::shared);
    run_gpu(ch, 2 * c);  // builds the family's shared forward and backward plans
  }
  CudnnPlansScope exact(CudnnPlans::exact);
  PlanThreadsScope threads(1);
  const AttentionPlanStats before = attention_plan_stats();
  std::vector<std::pair<int64_t, GpuResult>> results;
  // The GPU calls first, quickly, so that most run before the worker has built their own plans.
  // The store-filling call (S = T) has no shared plan; its forward runs flash while a worker builds
  // its own plan, so the chooser is asked about the others.
  for (int64_t S = c; S < T; S += c) {
    CAPTURE(S);
    const Tensor k = ch.k_store.dev.tensor.slice(1, 0, S), v = ch.v_store.dev.tensor.slice(1, 0, S);
    OwnedTensor out(DType::bf16, {1, c, H, D});
    const AttentionChoice choice =
        choose_attention_kernel(attention_call(ch.q.dev, k, v, out), {AttentionKernel::automatic, false});
    CHECK_MESSAGE(choice.kernel == AttentionKernel::cudnn, choice.reason);
  }
  for (int64_t S = T; S >= c; S -= c) results.emplace_back(S, run_gpu(ch, S));
  synchronize(gpu0());
  const AttentionPlanStats after = attention_plan_stats();
  MESSAGE("chunk ", c, ", store ", T, ": ", after.stood_in - before.stood_in, " calls on a shared plan, ",
          after.built - before.built, " exact plans built meanwhile");
  CHECK(after.stood_in > before.stood_in);
  CHECK(after.refused == before.refused);
  for (const auto& [S, r] : results) {
    CAPTURE(S);
    expect_matches_cpu(r, run_cpu(ch, S), S, "reverse sweep");
  }
}

TEST_CASE("cuda: cudnn runs a chunk's earlier keys apart as the CPU does in f64, and as one masked graph does" *
          doctest::skip(!cw::test::gpu_ready())) {
  // A family no other test builds: two sequences, 6 query heads on 2 K/V heads, chunks of 256 against
  // a store of 2048, exact plans built on use. Calls with p = c, 3c and 7c earlier keys run with the
  // prefix apart (two graphs each way, counted by the plan statistics), its backward with the query
  // heads stacked per K/V head and not, and as one masked graph; each against the CPU in f64, the
  // store's rows past S poisoned, and against each other. Then the backward in accumulate mode (d_q
  // added to what it held) and in the deterministic form, both stacked.
  DeterminismScope fast(false);
  CudnnPlansScope exact(CudnnPlans::exact);
  PlanThreadsScope none(0);
  StackGqaScope stack(true);
  const int64_t B = 2, c = 256, H = 6, Hkv = 2, D = 64, T = 2048;
  Chunked ch(B, c, H, Hkv, D, T, 5150);
  std::string why;
  if (!gpu::cudnn_attention_supports(ch.q.dev, ch.k_store.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  // Falling S, so that poisoning [S, T) spoils no key a later call reads.
  for (const int64_t S : {T, 4 * c, 2 * c}) {
    CAPTURE(S);
    for (int64_t b = 0; b < B; ++b)
      for (const GpuInput* store : {&ch.k_store, &ch.v_store})
        if (S < T) gpu::fill(store->dev.tensor.slice(0, b, 1).slice(1, S, T - S), std::numeric_limits<double>::quiet_NaN());
    const CpuResult ref = run_cpu(ch, S);
    GpuResult apart, per_head, one;
    {
      SplitPrefixScope on(true);
      const AttentionPlanStats before = attention_plan_stats();
      apart = run_gpu(ch, S);
      CHECK(attention_plan_stats().split - before.split == 2);  // the forward and the backward
      CHECK(attention_plan_stats().stacked - before.stacked == 1);  // the backward's prefix
    }
    {
      SplitPrefixScope on(true);
      StackGqaScope per_query_head(false);
      const AttentionPlanStats before = attention_plan_stats();
      per_head = run_gpu(ch, S);
      CHECK(attention_plan_stats().split - before.split == 2);
      CHECK(attention_plan_stats().stacked == before.stacked);
    }
    {
      SplitPrefixScope off(false);
      const AttentionPlanStats before = attention_plan_stats();
      one = run_gpu(ch, S);
      CHECK(attention_plan_stats().split == before.split);
    }
    expect_matches_cpu(apart, ref, S, "prefix apart, stacked");
    expect_matches_cpu(per_head, ref, S, "prefix apart, per query head");
    expect_matches_cpu(one, ref, S, "one graph");
    expect_runs_close(apart, one, S, "apart against one graph");
    expect_runs_close(apart, per_head, S, "stacked against per query head");
  }
  SplitPrefixScope on(true);
  const int64_t S = 2 * c;  // the store's rows past it hold NaN from the loop above
  const CpuResult ref = run_cpu(ch, S);
  {
    // Accumulate: d_q holds x before the backward and x + dQ after it.
    const Tensor k = ch.k_store.dev.tensor.slice(1, 0, S), v = ch.v_store.dev.tensor.slice(1, 0, S);
    Arena scratch(gpu0());
    OwnedTensor out = poisoned(DType::bf16, {B, c, H, D}), lse = poisoned(DType::f32, {B, H, c});
    gpu::cudnn_attention_forward(out, {lse}, ch.q.dev, k, v, ch.scale, scratch);
    GpuInput x = make_gpu_input(DType::bf16, {B, c, H, D}, 5150, 9);
    OwnedTensor d_k = OwnedTensor::on(gpu0(), DType::f32, {B, T, Hkv, D}), d_v = OwnedTensor::on(gpu0(), DType::f32, {B, T, Hkv, D});
    gpu::fill(d_k, 0.0);
    gpu::fill(d_v, 0.0);
    gpu::cudnn_attention_backward(x.dev, d_k.tensor.slice(1, 0, S), d_v.tensor.slice(1, 0, S), ch.d_out.dev, {lse},
                                  ch.q.dev, k, v, out, ch.scale, GradMode::accumulate, scratch);
    OwnedTensor want = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B, c, H, D});
    copy_convert(want, x.ref);
    accumulate(want, ref.d_q);
    expect_close_f64(fetch(x.dev), want, kBf16Tol, "accumulated d_q");
    expect_close_f64(fetch(d_k).tensor.slice(1, 0, S), ref.d_k, kBf16Tol, "d_k beside an accumulated d_q");
  }
  {
    DeterminismScope det(true);
    const AttentionPlanStats before = attention_plan_stats();
    expect_matches_cpu(run_gpu(ch, S), ref, S, "deterministic, prefix apart");
    CHECK(attention_plan_stats().split - before.split == 2);
    CHECK(attention_plan_stats().stacked - before.stacked == 1);
  }
}

#else

TEST_CASE("cuda: cudnn attention (this build has no cuDNN)" * doctest::skip(true)) {}

#endif
