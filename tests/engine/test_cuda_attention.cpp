// Our flash attention kernels (engine/cuda/attention_flash*.cu) beyond the op table
// (test_backend_ops.cpp runs every kernel family, deterministic and not, against the CPU in f64 with
// poisoning, accumulation into K/V-store slices and repeatability): the dispatcher's choice for f32
// gives the forced kernel's bits, and bad operands are a clear error.
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

constexpr uint64_t kSeed = 777;

using Input = GpuInput;
Input make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std);
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

}  // namespace

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

TEST_CASE("cuda: attention_merge equals the CPU's in f64 for any head dim and batch (f32 and bf16 blocks)" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Head dims below, at and between multiples of the warp's 32 lanes; rows not a multiple of a block.
  const int64_t B = 2, c = 37, H = 3;
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const int64_t D : {8, 40, 64, 96, 128}) {
      INFO(dtype_name(dt), " D ", D);
      const Input acc = make_gpu_input(DType::f32, {B, c, H, D}, kSeed, 40), out_b = make_input(dt, {B, c, H, D}, 41);
      const Input lse = make_gpu_input(DType::f32, {B, H, c}, kSeed, 42, 2.0),
                  lse_b = make_gpu_input(DType::f32, {B, H, c}, kSeed, 43, 2.0);
      OwnedTensor acc_ref = OwnedTensor::of_shape(DType::f64, shape_of(acc.ref)),
                  lse_ref = OwnedTensor::of_shape(DType::f64, shape_of(lse.ref));
      copy_convert(acc_ref, acc.ref);
      copy_convert(lse_ref, lse.ref);
      attention_merge(acc_ref, lse_ref, out_b.ref, lse_b.ref);
      attention_merge(acc.dev, lse.dev, out_b.dev, lse_b.dev);
      expect_close_gpu(acc.dev, acc_ref, 1e-5, "merged acc");
      expect_close_gpu(lse.dev, lse_ref, 1e-5, "merged lse");
    }
  }
}

TEST_CASE("cuda: attention in key blocks (the chunk's keys causal, the prefix unmasked, merged on the GPU) matches "
          "one CPU f64 call, forward and backward" * doctest::skip(!cw::test::gpu_ready())) {
  // The shape of a SeCO chunk against a streamed prefix: c = 200 queries at p = 700, the prefix in
  // blocks of 256, 256 and 188 keys (no multiples of the tiles), GQA 2.
  const int64_t B = 1, c = 200, p = 700, S = p + c, H = 4, Hkv = 2;
  const std::vector<std::pair<int64_t, int64_t>> prefix = {{0, 256}, {256, 512}, {512, 700}};
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const int64_t D : {64, 128}) {
      INFO(dtype_name(dt), " D ", D);
      const double scale = 1.0 / std::sqrt(double(D));
      const Input q = make_input(dt, {B, c, H, D}, 11), k = make_input(dt, {B, S, Hkv, D}, 12),
                  v = make_input(dt, {B, S, Hkv, D}, 13), d_out = make_input(dt, {B, c, H, D}, 14);
      // The reference: one CPU call over keys [0, p + c) in f64.
      Arena host;
      OwnedTensor out(DType::f64, {B, c, H, D}), lse(DType::f64, {B, H, c}), d_q(DType::f64, {B, c, H, D});
      OwnedTensor d_k(DType::f64, {B, S, Hkv, D}), d_v(DType::f64, {B, S, Hkv, D});
      fill(d_k, 0.0);
      fill(d_v, 0.0);
      attention_forward(out, {lse}, q.ref, k.ref, v.ref, scale, host);
      attention_backward(d_q, d_k, d_v, d_out.ref, {lse}, q.ref, k.ref, v.ref, out, scale, GradMode::overwrite, host);

      // The blocks on the GPU, automatic kernel choice (bf16: cuDNN for both masks; f32: flash).
      Arena scratch(gpu0());
      const auto keys = [&](const Input& x, int64_t k0, int64_t k1) { return x.dev.tensor.slice(1, k0, k1 - k0); };
      OwnedTensor acc = on_gpu(DType::f32, {B, c, H, D}), acc_lse = on_gpu(DType::f32, {B, H, c});
      OwnedTensor own = poisoned(dt, {B, c, H, D});
      attention_forward(own, {acc_lse}, q.dev, keys(k, p, S), keys(v, p, S), scale, scratch);
      gpu::copy_convert(acc, own);
      for (const auto& [k0, k1] : prefix) {
        OwnedTensor ob = poisoned(dt, {B, c, H, D}), lb = poisoned(DType::f32, {B, H, c});
        attention_forward(ob, {lb}, q.dev, keys(k, k0, k1), keys(v, k0, k1), scale, scratch, AttentionMask::none);
        attention_merge(acc, acc_lse, ob, lb);
      }
      const double tol = dt == DType::f32 ? 1e-5 : 2e-2;
      expect_close_gpu(acc, out, tol, "merged out");
      expect_close_gpu(acc_lse, lse, dt == DType::f32 ? 1e-5 : 1e-3, "merged lse");

      OwnedTensor merged = on_gpu(dt, {B, c, H, D}), bq = poisoned(dt, {B, c, H, D});
      gpu::copy_convert(merged, acc);
      OwnedTensor bk = on_gpu(DType::f32, {B, S, Hkv, D}), bv = on_gpu(DType::f32, {B, S, Hkv, D});
      gpu::fill(bk, 0.0);
      gpu::fill(bv, 0.0);
      attention_backward(bq, bk.tensor.slice(1, p, c), bv.tensor.slice(1, p, c), d_out.dev, {acc_lse}, q.dev,
                         keys(k, p, S), keys(v, p, S), merged, scale, GradMode::overwrite, scratch);
      for (const auto& [k0, k1] : prefix)
        attention_backward(bq, bk.tensor.slice(1, k0, k1 - k0), bv.tensor.slice(1, k0, k1 - k0), d_out.dev, {acc_lse},
                           q.dev, keys(k, k0, k1), keys(v, k0, k1), merged, scale, GradMode::accumulate, scratch,
                           AttentionMask::none);
      expect_close_gpu(bq, d_q, tol, "d_q summed over the blocks");
      expect_close_gpu(bk, d_k, tol, "d_k");
      expect_close_gpu(bv, d_v, tol, "d_v");
    }
  }
}
