// Our flash attention kernels (engine/cuda/attention_flash*.cu) against the CPU attention op
// (engine/ops/attention.cpp) computed in f64 on the same inputs.
//
// Pattern (as in test_cuda_ops.cpp): inputs are drawn in f64, rounded to the compute dtype on the
// host, uploaded, and widened back to f64 for the reference, so both sides see identical values.
// Outputs the kernels overwrite (out, lse, d_q in overwrite mode) are poisoned with NaN first, so an
// unwritten element fails the comparison. d_k, d_v are slices of larger f32 buffers pre-filled with
// random values: the check compares what the kernel ADDED (buffer after minus buffer before) with
// the reference gradient over the whole buffer, so a missing add, an overwrite, or a write to rows
// past S (which must stay untouched) all fail. The backward reference takes the GPU's own out and
// lse (fetched), so the backward is checked in isolation from the forward's rounding.
// K and V of the B = 2 cases are slices [0, S) of a [B, T, Hkv, D] store with T > S: their batch
// stride is larger than packed, as the K/V store's is in SeCO.
#include "engine/cuda/ops.h"
#include "engine/engine.h"

#include <optional>
#include "engine/cuda/runtime.h"
#include "engine/ops/attention.h"
#include "engine/random.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

using namespace cw;
using namespace cw::test;

namespace {

// f32 against f64: f32 products and sums over at most a few thousand terms (D-long dot products,
// S-long softmax sums and P V sums) and expf/logf within a few ulps: about 1e-6 relative.
constexpr double kFlashF32Tol = 1e-5;
// bf16 against f64. Outputs in bf16 (out, d_q) are rounded once: up to 2^-9 relative per element.
// The tensor-core path also rounds P and dS to bf16 before the P V, dS K, P^T dO and dS^T Q
// products (as FlashAttention does), each term carrying up to 2^-9 relative error; over many terms
// the relative L2 error stays at a few 1e-3. 2e-2 leaves a margin of several times. This bound
// also covers the f32 d_k, d_v of bf16 runs (built from the rounded P and dS).
constexpr double kFlashBf16Tol = 2e-2;
// lse is f32 in every run and is computed from exactly representable inputs in f32 arithmetic; the
// tensor-core path uses the approximate base-2 exponential (about 2 ulp) and log2f: errors near 1e-6.
constexpr double kFlashLseTol = 1e-5;

constexpr uint64_t kSeed = 777;

using Input = GpuInput;
Input make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std);
}

// after - before, elementwise (f64 host tensors of one shape).
OwnedTensor difference(const Tensor& after, const Tensor& before) {
  OwnedTensor d = OwnedTensor::of_shape(DType::f64, shape_of(after));
  for (int64_t i = 0; i < after.numel(); ++i)
    d.tensor.ptr<double>()[i] = after.ptr<double>()[i] - before.ptr<double>()[i];
  return d;
}

void expect_close(const Tensor& got, const Tensor& ref, double tol, const char* what) {
  const Worst w = compare(got, ref);
  INFO(what, ": ", w.str(), " (tolerance ", tol, ")");
  CHECK(w.rel <= tol);
}

struct Case {
  int64_t B, c, S, H, Hkv, D;
  int64_t T;  // K/V store length (T > S: k, v, d_k, d_v are slices with a larger batch stride)
};

// Everything one case needs: inputs, outputs and their references.
struct Problem {
  Case cs;
  DType dt;
  double scale;
  Input q, k_store, v_store, d_out;
  Tensor k_dev, v_dev, k_ref, v_ref;  // slices [0, S) of the stores

  Problem(const Case& c, DType dtype)
      : cs(c),
        dt(dtype),
        scale(1.0 / std::sqrt(static_cast<double>(c.D))),
        q(make_input(dtype, std::vector<int64_t>{c.B, c.c, c.H, c.D}, 1)),
        k_store(make_input(dtype, std::vector<int64_t>{c.B, c.T, c.Hkv, c.D}, 2)),
        v_store(make_input(dtype, std::vector<int64_t>{c.B, c.T, c.Hkv, c.D}, 3)),
        d_out(make_input(dtype, std::vector<int64_t>{c.B, c.c, c.H, c.D}, 4)) {
    k_dev = k_store.dev.tensor.slice(1, 0, c.S);
    v_dev = v_store.dev.tensor.slice(1, 0, c.S);
    k_ref = k_store.ref.tensor.slice(1, 0, c.S);
    v_ref = v_store.ref.tensor.slice(1, 0, c.S);
  }
};

std::string describe(const Case& c, DType dt) {
  return std::string(dtype_name(dt)) + " B=" + std::to_string(c.B) + " c=" + std::to_string(c.c) +
         " S=" + std::to_string(c.S) + " H=" + std::to_string(c.H) + " Hkv=" + std::to_string(c.Hkv) +
         " D=" + std::to_string(c.D) + " T=" + std::to_string(c.T);
}

// Forward, backward (overwrite, then accumulate), and repeatability of both, for one case, with
// cw::deterministic() set to `deterministic`. Everything is bitwise repeatable except d_q of the
// fused tensor-core backward (deterministic off, bf16, D 64/128), whose f32 atomics may add in any
// order: there d_q must agree with the first run to within its rounding.
void check_case(const Case& cs, DType dt, bool deterministic = true) {
  INFO(describe(cs, dt), deterministic ? " deterministic" : " fused (atomic dQ)");
  DeterminismScope determinism(deterministic);
  // Our flash kernels: the family a caller forced, else the best flash family for the call.
  AttentionKernelScope kernels(attention_kernel() == AttentionKernel::automatic ? AttentionKernel::flash
                                                                                 : attention_kernel());
  const bool atomic_dq = !deterministic && dt == DType::bf16 && (cs.D == 64 || cs.D == 128);
  const bool bf16 = dt == DType::bf16;
  const double tol = bf16 ? kFlashBf16Tol : kFlashF32Tol;
  Problem pb(cs, dt);
  Arena scratch(gpu0());
  Arena host_scratch;
  const int64_t B = cs.B, c = cs.c, H = cs.H, Hkv = cs.Hkv, D = cs.D, T = cs.T, S = cs.S;

  // forward
  OwnedTensor out = poisoned(dt, {B, c, H, D}), lse = poisoned(DType::f32, {B, H, c});
  attention_forward(out, {lse}, pb.q.dev, pb.k_dev, pb.v_dev, pb.scale, scratch);
  OwnedTensor out64(DType::f64, {B, c, H, D}), lse64(DType::f64, {B, H, c});
  attention_forward(out64, {lse64}, pb.q.ref, pb.k_ref, pb.v_ref, pb.scale, host_scratch);
  const OwnedTensor out_got = fetch(out), lse_got = fetch(lse);
  expect_close(out_got, out64, tol, "out");
  expect_close(lse_got, lse64, kFlashLseTol, "lse");
  OwnedTensor out2 = poisoned(dt, {B, c, H, D}), lse2 = poisoned(DType::f32, {B, H, c});
  attention_forward(out2, {lse2}, pb.q.dev, pb.k_dev, pb.v_dev, pb.scale, scratch);
  expect_same_bits(out, out2, "forward out is reproducible");
  expect_same_bits(lse, lse2, "forward lse is reproducible");

  // backward, overwrite: d_q poisoned; d_k, d_v slices of randomly pre-filled f32 stores.
  Input dk_store = make_input(DType::f32, std::vector<int64_t>{B, T, Hkv, D}, 5);
  Input dv_store = make_input(DType::f32, std::vector<int64_t>{B, T, Hkv, D}, 6);
  const OwnedTensor dk_before = fetch(dk_store.dev), dv_before = fetch(dv_store.dev);
  const Tensor dk_dev = dk_store.dev.tensor.slice(1, 0, S), dv_dev = dv_store.dev.tensor.slice(1, 0, S);
  OwnedTensor dq = poisoned(dt, {B, c, H, D});
  attention_backward(dq, dk_dev, dv_dev, pb.d_out.dev, {lse}, pb.q.dev, pb.k_dev, pb.v_dev, out, pb.scale,
                                GradMode::overwrite, scratch);
  CHECK(scratch.in_use() == 0);  // scratch handed back as found
  // The reference starts from the same stores and uses the GPU's out and lse.
  OwnedTensor dq64(DType::f64, {B, c, H, D});
  attention_backward(dq64, dk_store.ref.tensor.slice(1, 0, S), dv_store.ref.tensor.slice(1, 0, S), pb.d_out.ref,
                     {lse_got}, pb.q.ref, pb.k_ref, pb.v_ref, out_got, pb.scale, GradMode::overwrite, host_scratch);
  expect_close(fetch(dq), dq64, tol, "d_q (overwrite)");
  const OwnedTensor dk_after = fetch(dk_store.dev), dv_after = fetch(dv_store.dev);
  expect_close(difference(dk_after, dk_before), difference(dk_store.ref, dk_before), tol, "d_k added (first)");
  expect_close(difference(dv_after, dv_before), difference(dv_store.ref, dv_before), tol, "d_v added (first)");

  // backward, accumulate: d_q starts from random values; d_k, d_v are added to a second time.
  Input dq_acc = make_input(dt, std::vector<int64_t>{B, c, H, D}, 7);
  attention_backward(dq_acc.dev, dk_dev, dv_dev, pb.d_out.dev, {lse}, pb.q.dev, pb.k_dev, pb.v_dev, out,
                                pb.scale, GradMode::accumulate, scratch);
  attention_backward(dq_acc.ref, dk_store.ref.tensor.slice(1, 0, S), dv_store.ref.tensor.slice(1, 0, S), pb.d_out.ref,
                     {lse_got}, pb.q.ref, pb.k_ref, pb.v_ref, out_got, pb.scale, GradMode::accumulate, host_scratch);
  expect_close(fetch(dq_acc.dev), dq_acc.ref, tol, "d_q (accumulate)");
  expect_close(difference(fetch(dk_store.dev), dk_before), difference(dk_store.ref, dk_before), tol,
               "d_k added (twice)");
  expect_close(difference(fetch(dv_store.dev), dv_before), difference(dv_store.ref, dv_before), tol,
               "d_v added (twice)");

  // determinism: the same backward from the same starting d_k, d_v, twice
  Input dka = make_input(DType::f32, std::vector<int64_t>{B, T, Hkv, D}, 8);
  Input dkb = make_input(DType::f32, std::vector<int64_t>{B, T, Hkv, D}, 8);
  Input dva = make_input(DType::f32, std::vector<int64_t>{B, T, Hkv, D}, 9);
  Input dvb = make_input(DType::f32, std::vector<int64_t>{B, T, Hkv, D}, 9);
  OwnedTensor dqa = poisoned(dt, {B, c, H, D}), dqb = poisoned(dt, {B, c, H, D});
  attention_backward(dqa, dka.dev.tensor.slice(1, 0, S), dva.dev.tensor.slice(1, 0, S), pb.d_out.dev,
                                {lse}, pb.q.dev, pb.k_dev, pb.v_dev, out, pb.scale, GradMode::overwrite, scratch);
  attention_backward(dqb, dkb.dev.tensor.slice(1, 0, S), dvb.dev.tensor.slice(1, 0, S), pb.d_out.dev,
                                {lse}, pb.q.dev, pb.k_dev, pb.v_dev, out, pb.scale, GradMode::overwrite, scratch);
  if (atomic_dq) {
    // Different addition orders round the f32 sums differently before the bf16 rounding of d_q:
    // at most an ulp of bf16 (2^-8 relative) in a few elements.
    const OwnedTensor dq_first = fetch(dq);
    expect_close(fetch(dqa), dq_first, 4e-3, "d_q repeats to within bf16 rounding");
    expect_close(fetch(dqb), dq_first, 4e-3, "d_q repeats to within bf16 rounding (again)");
  } else {
    expect_same_bits(dqa, dq, "d_q is reproducible");
    expect_same_bits(dqb, dq, "d_q is reproducible (again)");
  }
  expect_same_bits(dka.dev, dkb.dev, "d_k is reproducible");
  expect_same_bits(dva.dev, dvb.dev, "d_v is reproducible");
}

// The shapes every dtype/path runs: full causal (p = 0), chunk against cache (p > 0, sizes that are
// no multiple of any tile), decode (c = 1), GQA ratio 1 and 4, B = 2 with K/V slices of a longer store.
std::vector<Case> cases_for(int64_t D) {
  return {
      Case{1, 77, 77, 4, 4, D, 77},      // p = 0, GQA 1
      Case{1, 130, 1000, 4, 1, D, 1000}, // c < S: p = 870, GQA 4, 130 and 1000 not multiples of the tiles
      Case{1, 1, 300, 4, 4, D, 300},     // decode
      Case{2, 45, 150, 8, 2, D, 200},    // B = 2, K/V batch stride 200 rows (> S = 150), GQA 4
  };
}

}  // namespace

TEST_CASE("cuda: flash attention f32 (generic path) matches the CPU in f64" * doctest::skip(!cw::test::gpu_ready())) {
  for (const int64_t D : {6, 32, 128})
    for (const Case& cs : cases_for(D)) check_case(cs, DType::f32);
}

TEST_CASE("cuda: flash attention bf16 tensor-core path (head dim 64, 128) matches the CPU in f64" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Both kernel families (the mma.sync kernels everywhere; the wgmma kernels where the GPU and the
  // build have them) and, in each, both backwards: the deterministic two-kernel one and the fused
  // one with atomic dQ.
  std::vector<AttentionKernel> families{AttentionKernel::flash_mma};
  if (gpu::flash_wgmma_available(0)) families.push_back(AttentionKernel::flash_wgmma);
  else MESSAGE("the wgmma kernels need an sm_90a build on a compute capability 9.0 GPU: only mma.sync is checked");
  for (const AttentionKernel family : families) {
    INFO("kernels: " << attention_kernel_name(family));
    AttentionKernelScope forced(family);
    for (const bool deterministic : {true, false}) {
      for (const int64_t D : {64, 128})
        for (const Case& cs : cases_for(D)) check_case(cs, DType::bf16, deterministic);
      // p = 0 with several query and key blocks of the tensor-core tiles, the last ones partial.
      check_case(Case{1, 300, 300, 2, 2, 64, 300}, DType::bf16, deterministic);
      check_case(Case{1, 300, 300, 2, 1, 128, 300}, DType::bf16, deterministic);
      // A chunk against a longer cache, GQA 2: query blocks that start inside a key block.
      check_case(Case{1, 520, 700, 4, 2, 128, 700}, DType::bf16, deterministic);
      check_case(Case{1, 520, 700, 4, 2, 64, 700}, DType::bf16, deterministic);
    }
  }
}

TEST_CASE("cuda: flash attention bf16 generic path (head dim 32, 6) matches the CPU in f64" *
          doctest::skip(!cw::test::gpu_ready())) {
  for (const Case& cs : cases_for(32)) check_case(cs, DType::bf16);
  check_case(Case{1, 20, 50, 2, 1, 6, 50}, DType::bf16);
}

TEST_CASE("cuda: attention dispatcher falls back to flash for f32; forcing flash gives the flash kernel's bits" *
          doctest::skip(!cw::test::gpu_ready())) {
  const Case cs{2, 33, 70, 4, 2, 32, 90};
  Problem pb(cs, DType::f32);
  Arena scratch(gpu0());
  const int64_t B = cs.B, c = cs.c, H = cs.H, D = cs.D, S = cs.S, Hkv = cs.Hkv;
  // The generic flash kernel forced: the reference bits.
  std::optional<AttentionKernelScope> simt(std::in_place, AttentionKernel::flash_simt);
  OwnedTensor out = poisoned(DType::f32, {B, c, H, D}), lse = poisoned(DType::f32, {B, H, c});
  attention_forward(out, {lse}, pb.q.dev, pb.k_dev, pb.v_dev, pb.scale, scratch);
  OwnedTensor dq = poisoned(DType::f32, {B, c, H, D});
  OwnedTensor dk = OwnedTensor::on(gpu0(), DType::f32, {B, S, Hkv, D}), dv = OwnedTensor::on(gpu0(), DType::f32, {B, S, Hkv, D});
  gpu::fill(dk, 0.0);
  gpu::fill(dv, 0.0);
  attention_backward(dq, dk, dv, pb.d_out.dev, {lse}, pb.q.dev, pb.k_dev, pb.v_dev, out, pb.scale,
                                GradMode::overwrite, scratch);

  simt.reset();
  auto through_dispatcher = [&](const char* what) {
    INFO(what);
    OwnedTensor out2 = poisoned(DType::f32, {B, c, H, D}), lse2 = poisoned(DType::f32, {B, H, c});
    attention_forward(out2, {lse2}, pb.q.dev, pb.k_dev, pb.v_dev, pb.scale, scratch);
    expect_same_bits(out2, out, "out");
    expect_same_bits(lse2, lse, "lse");
    OwnedTensor dq2 = poisoned(DType::f32, {B, c, H, D});
    OwnedTensor dk2 = OwnedTensor::on(gpu0(), DType::f32, {B, S, Hkv, D});
    OwnedTensor dv2 = OwnedTensor::on(gpu0(), DType::f32, {B, S, Hkv, D});
    gpu::fill(dk2, 0.0);
    gpu::fill(dv2, 0.0);
    attention_backward(dq2, dk2, dv2, pb.d_out.dev, {lse2}, pb.q.dev, pb.k_dev, pb.v_dev, out2, pb.scale,
                            GradMode::overwrite, scratch);
    expect_same_bits(dq2, dq, "d_q");
    expect_same_bits(dk2, dk, "d_k");
    expect_same_bits(dv2, dv, "d_v");
  };
  // With CW_ATTENTION unset the choice is automatic, and automatic takes flash for f32.
  {
    AttentionKernelScope automatic(AttentionKernel::automatic);
    through_dispatcher("automatic");
    CHECK(choose_attention_kernel(attention_call(pb.q.dev, pb.k_dev, pb.v_dev, out), attention_flags()).kernel ==
          AttentionKernel::flash_simt);
  }
  AttentionKernelScope flash(AttentionKernel::flash);
  through_dispatcher("flash forced");
}

TEST_CASE("cuda: flash attention rejects bad operands" * doctest::skip(!cw::test::gpu_ready())) {
  Arena scratch(gpu0());
  const double scale = 0.25;
  auto dev = [](DType dt, std::initializer_list<int64_t> s) { return poisoned(dt, s); };
  OwnedTensor q = dev(DType::f32, {1, 4, 4, 8}), k = dev(DType::f32, {1, 6, 2, 8}), v = dev(DType::f32, {1, 6, 2, 8});
  OwnedTensor out = dev(DType::f32, {1, 4, 4, 8}), lse = dev(DType::f32, {1, 4, 4});
  OwnedTensor lse_bf16 = dev(DType::bf16, {1, 4, 4}), k_bf16 = dev(DType::bf16, {1, 6, 2, 8});
  OwnedTensor k3 = dev(DType::f32, {1, 6, 3, 8}), v3 = dev(DType::f32, {1, 6, 3, 8});
  OwnedTensor k_short = dev(DType::f32, {1, 3, 2, 8}), v_short = dev(DType::f32, {1, 3, 2, 8});
  OwnedTensor q_odd = dev(DType::f32, {1, 4, 4, 7}), k_odd = dev(DType::f32, {1, 6, 2, 7}), v_odd = dev(DType::f32, {1, 6, 2, 7});
  OwnedTensor out_odd = dev(DType::f32, {1, 4, 4, 7});
  OwnedTensor host_q(DType::f32, {1, 4, 4, 8});
  CHECK_THROWS_AS(attention_forward(out, {lse_bf16}, q, k, v, scale, scratch), Error);  // lse must be f32
  CHECK_THROWS_AS(attention_forward(out, {lse}, q, k_bf16, v, scale, scratch), Error);  // mixed dtypes
  CHECK_THROWS_AS(attention_forward(out, {lse}, q, k3, v3, scale, scratch), Error);     // 4 % 3 heads
  CHECK_THROWS_AS(attention_forward(out, {lse}, q, k_short, v_short, scale, scratch), Error);  // S < c
  CHECK_THROWS_AS(attention_forward(out_odd, {lse}, q_odd, k_odd, v_odd, scale, scratch), Error);  // odd D
  CHECK_THROWS_AS(attention_forward(out, {lse}, host_q, k, v, scale, scratch), Error);  // host operand
  // d_k must be f32 and shaped like k
  OwnedTensor dq = dev(DType::f32, {1, 4, 4, 8}), dk = dev(DType::f32, {1, 6, 2, 8}), dv = dev(DType::f32, {1, 6, 2, 8});
  CHECK_THROWS_AS(attention_backward(dq, k_bf16, dv, q, {lse}, q, k, v, out, scale, GradMode::overwrite,
                                                scratch),
                  Error);
  CHECK_THROWS_AS(attention_backward(dq, dk, k3, q, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch),
                  Error);
  // a K/V slice whose inner part is not packed (a slice along the head axis)
  OwnedTensor k_wide = dev(DType::f32, {1, 6, 4, 8});
  CHECK_THROWS_AS(attention_forward(out, {lse}, q, k_wide.tensor.slice(2, 0, 2), v, scale, scratch), Error);
}
