// The GPU elementwise and row ops (engine/cuda/elementwise.cu, rmsnorm.cu, embedding.cu) beyond the
// op table (test_backend_ops.cpp checks their values, poisoning, accumulation and repeatability):
// in-place and aliased operands give the out-of-place bits, invalid device ids stay in bounds,
// the public ops' operand checks on device tensors (the contract, engine/ops/*.cpp, and the GPU's own
// limits such as no f64), sum_squares.
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/ops/embedding.h"
#include "engine/ops/residual.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/random.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

using namespace cw;
using namespace cw::test;

namespace {
constexpr uint64_t kSeed = 4242;
GpuInput make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0, double mean = 0.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std, mean);
}
// RoPE's cos and sin tables [P, D/2] on the GPU in f32, computed in f64.
std::pair<OwnedTensor, OwnedTensor> gpu_rope_tables(int64_t P, int64_t D) {
  OwnedTensor cos64(DType::f64, {P, D / 2}), sin64(DType::f64, {P, D / 2});
  rope_tables(cos64, sin64, D, 10000.0, RopeScaling{});
  std::pair<OwnedTensor, OwnedTensor> tables{on_gpu(DType::f32, {P, D / 2}), on_gpu(DType::f32, {P, D / 2})};
  gpu::copy_convert(tables.first, cos64);
  gpu::copy_convert(tables.second, sin64);
  return tables;
}
}  // namespace

TEST_CASE("cuda: in-place and aliased operands give the out-of-place bits" * doctest::skip(!cw::test::gpu_ready())) {
  const int64_t B = 2, T = 37, H = 3, D = 10, P = 64, pos0 = 5, N = 37, C = 203;
  const auto [cos, sin] = gpu_rope_tables(P, D);
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(std::string(dtype_name(dt)));
    GpuInput x = make_input(dt, {B, T, H, D}, 7), xi = make_input(dt, {B, T, H, D}, 7);
    CHECK(compare(fetch(x.dev), x.ref).rel == 0);  // the upload is exact
    // rope forward and backward in place
    OwnedTensor y = poisoned(dt, {B, T, H, D});
    gpu::rope_forward(y, x.dev, cos, sin, pos0);
    gpu::rope_forward(xi.dev, xi.dev, cos, sin, pos0);
    expect_same_bits(xi.dev, y, "rope in place");
    GpuInput dyi = make_input(dt, {B, T, H, D}, 7);
    gpu::rope_backward(y, x.dev, cos, sin, pos0, GradMode::overwrite);
    gpu::rope_backward(dyi.dev, dyi.dev, cos, sin, pos0, GradMode::overwrite);
    expect_same_bits(dyi.dev, y, "rope backward in place");
    CHECK_THROWS_AS(rope_backward(dyi.dev, dyi.dev, cos, sin, pos0, GradMode::accumulate), Error);

    // rmsnorm: d_x may alias d_out (the d_w partials read d_out before d_x is written)
    GpuInput a = make_input(dt, {N, C}, 1), w = make_input(dt, {C}, 2, 0.3, 1.0), dy = make_input(dt, {N, C}, 3);
    GpuInput dy_alias = make_input(dt, {N, C}, 3), dwa = make_input(DType::f32, {C}, 6), dwb = make_input(DType::f32, {C}, 6);
    OwnedTensor out = poisoned(dt, {N, C}), rstd = poisoned(DType::f32, {N}), dx = poisoned(dt, {N, C});
    Arena scratch(gpu0());
    gpu::rmsnorm_forward(out, {rstd}, a.dev, w.dev, 1e-5, 0.0);
    gpu::rmsnorm_backward(dx, dwa.dev, dy.dev, {rstd}, a.dev, w.dev, GradMode::overwrite, scratch, 0.0);
    gpu::rmsnorm_backward(dy_alias.dev, dwb.dev, dy_alias.dev, {rstd}, a.dev, w.dev, GradMode::overwrite, scratch,
                          0.0);
    expect_same_bits(dy_alias.dev, dx, "rmsnorm d_x in place of d_out");
    expect_same_bits(dwb.dev, dwa.dev, "rmsnorm d_w with d_x in place of d_out");

    // residual: out may alias x; d_x aliasing d_out passes it through; d_delta may be skipped
    GpuInput ai = make_input(dt, {N, C}, 1);
    gpu::residual_forward(out, a.dev, dy.dev);
    gpu::residual_forward(ai.dev, ai.dev, dy.dev);
    expect_same_bits(ai.dev, out, "residual in place");
    GpuInput dyr = make_input(dt, {N, C}, 3);
    OwnedTensor dd = poisoned(dt, {N, C}), dx2 = poisoned(dt, {N, C});
    gpu::residual_backward(dyr.dev, GradMode::overwrite, dd, GradMode::overwrite, dyr.dev);
    expect_same_bits(dyr.dev, dy.dev, "d_out untouched when d_x aliases it");
    expect_same_bits(dd, dy.dev, "d_delta = d_out");
    gpu::residual_backward(dx2, GradMode::overwrite, Tensor{}, GradMode::overwrite, dy.dev);
    expect_same_bits(dx2, dy.dev, "d_x = d_out without d_delta");
    CHECK_THROWS_AS(residual_backward(dyr.dev, GradMode::accumulate, Tensor{}, GradMode::overwrite, dyr.dev), Error);
  }
}

TEST_CASE("cuda: rope on a column slice of wider rows gives the packed heads' bits" * doctest::skip(!cw::test::gpu_ready())) {
  // The fused Q/K/V projection's rows (model/layer.cpp): the q heads at column 0, k at H D; a head dim
  // of 64 takes the vector path, 10 the scalar one.
  for (const int64_t D : {int64_t{64}, int64_t{10}}) {
    const int64_t B = 2, T = 37, H = 4, Hkv = 2, P = 64, pos0 = 5, W = (H + 2 * Hkv) * D;
    const auto [cos, sin] = gpu_rope_tables(P, D);
    for (DType dt : {DType::f32, DType::bf16}) {
      INFO(dtype_name(dt), " D ", D);
      GpuInput rows = make_input(dt, {B * T, W}, 11);
      for (const auto& [col0, heads] : {std::pair{int64_t{0}, H}, std::pair{H * D, Hkv}}) {
        const Tensor xs = head_columns(rows.dev, col0, B, T, heads, D);
        OwnedTensor x = on_gpu(dt, {B, T, heads, D}), want = on_gpu(dt, {B, T, heads, D}), got = on_gpu(dt, {B, T, heads, D});
        copy_heads(x, xs);
        rope_forward(want, x, cos, sin, pos0);
        rope_forward(got, xs, cos, sin, pos0);
        CHECK(compare(fetch(got), fetch(want)).rel == 0);
        OwnedTensor out_rows = on_gpu(dt, {B * T, W});
        fill(out_rows, 0.0);
        const Tensor os = head_columns(out_rows, col0, B, T, heads, D);
        rope_backward(want, x, cos, sin, pos0, GradMode::overwrite);
        rope_backward(os, x, cos, sin, pos0, GradMode::overwrite);
        copy_heads(got, os);
        CHECK(compare(fetch(got), fetch(want)).rel == 0);
        copy_heads(os, x);
        rope_forward(os, os, cos, sin, pos0);  // in place on the slice
        rope_forward(want, x, cos, sin, pos0);
        copy_heads(got, os);
        CHECK(compare(fetch(got), fetch(want)).rel == 0);
      }
    }
  }
}

TEST_CASE("cuda: rmsnorm, rope and accumulate reject bad operands" * doctest::skip(!cw::test::gpu_ready())) {
  GpuInput x = make_input(DType::f32, {4, 8}, 1), w = make_input(DType::f32, {8}, 2), dy = make_input(DType::f32, {4, 8}, 3);
  OwnedTensor out = poisoned(DType::f32, {4, 8}), rstd = poisoned(DType::f32, {4});
  OwnedTensor rstd_bf16 = poisoned(DType::bf16, {4}), dw_bf16 = poisoned(DType::bf16, {8});
  OwnedTensor host_out(DType::f32, {4, 8});
  Arena scratch(gpu0());
  CHECK_THROWS_AS(rmsnorm_forward(host_out, {rstd}, x.dev, w.dev, 1e-5), Error);
  CHECK_THROWS_AS(rmsnorm_forward(out, {rstd_bf16}, x.dev, w.dev, 1e-5), Error);
  CHECK_THROWS_AS(rmsnorm_forward(out, {rstd}, x.dev, dy.dev, 1e-5), Error);  // weight of the wrong shape
  CHECK_THROWS_AS(rmsnorm_forward(x.dev, {rstd}, x.dev, w.dev, 1e-5), Error);  // out aliases x
  CHECK_THROWS_AS(rmsnorm_backward(out, dw_bf16, dy.dev, {rstd}, x.dev, w.dev, GradMode::overwrite, scratch),
                  Error);  // d_weight must be f32
  // f64 operands keep the contract (rstd in f64 too) but the GPU has no f64 kernel: its own limit.
  GpuInput x64 = make_input(DType::f64, {4, 8}, 1), w64 = make_input(DType::f64, {8}, 2);
  OwnedTensor out64 = poisoned(DType::f64, {4, 8}), rstd64 = poisoned(DType::f64, {4});
  CHECK_THROWS_WITH_AS(rmsnorm_forward(out64, {rstd64}, x64.dev, w64.dev, 1e-5),
                       doctest::Contains("rmsnorm_forward on the GPU supports f32 and bf16, not f64"), Error);
  // rope: positions past the table; tables not f32
  const int64_t P = 8, D = 8;
  GpuInput rx = make_input(DType::f32, {1, 4, 2, D}, 4);
  OwnedTensor ry = poisoned(DType::f32, {1, 4, 2, D}), cos = poisoned(DType::f32, {P, D / 2});
  OwnedTensor cos_bf16 = poisoned(DType::bf16, {P, D / 2});
  CHECK_THROWS_AS(rope_forward(ry, rx.dev, cos, cos, P - 4 + 1), Error);
  CHECK_THROWS_AS(rope_forward(ry, rx.dev, cos_bf16, cos_bf16, 0), Error);
  // accumulate: a bf16 destination with an f32 source is not a gradient sum; a host destination
  GpuInput d16 = make_input(DType::bf16, {4, 5}, 27), s32 = make_input(DType::f32, {4, 5}, 28);
  CHECK_THROWS_AS(accumulate(d16.dev, s32.dev), Error);
  OwnedTensor host(DType::f32, {4, 5});
  CHECK_THROWS_AS(accumulate(host, s32.dev), Error);
}

TEST_CASE("cuda: embedding guards against invalid device ids and checks operands" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Device ids are validated by the caller before upload; a bad one that gets through must not
  // touch memory out of bounds: its output row is NaN and the backward skips it.
  const int64_t V = 6, C = 7, N = 4;
  const int32_t idv[N] = {2, -1, 6, 2};
  OwnedTensor ids_host(DType::i32, {N});
  for (int64_t n = 0; n < N; ++n) ids_host.tensor.ptr<int32_t>()[n] = idv[n];
  OwnedTensor ids = OwnedTensor::on(gpu0(), DType::i32, {N});
  gpu::copy_convert(ids, ids_host);
  GpuInput table = make_input(DType::f32, {V, C}, 40), dy = make_input(DType::f32, {N, C}, 41);

  OwnedTensor out = poisoned(DType::f32, {N, C});
  gpu::fill(out, 0.0);
  gpu::embedding_forward(out, ids, table.dev, 1.0);
  const OwnedTensor got = fetch(out);
  const double* o = got.tensor.ptr<double>();
  const double* t = table.ref.tensor.ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    CHECK(o[0 * C + c] == t[2 * C + c]);
    CHECK(std::isnan(o[1 * C + c]));
    CHECK(std::isnan(o[2 * C + c]));
    CHECK(o[3 * C + c] == t[2 * C + c]);
  }

  OwnedTensor dtab = OwnedTensor::on(gpu0(), DType::f32, {V, C});
  gpu::fill(dtab, 0.0);
  gpu::embedding_backward(dtab, dy.dev, ids, 1.0);
  OwnedTensor expect(DType::f64, {V, C});  // zero-filled
  const double* d = dy.ref.tensor.ptr<double>();
  for (int64_t c = 0; c < C; ++c)
    expect.tensor.ptr<double>()[2 * C + c] = static_cast<double>(static_cast<float>(d[0 * C + c]) + static_cast<float>(d[3 * C + c]));
  CHECK(compare(fetch(dtab), expect).rel == 0);

  // operand checks: ids on the host, a bf16 d_table, a wrong output shape
  OwnedTensor dtab_bf16 = poisoned(DType::bf16, {V, C}), out_bad = poisoned(DType::f32, {N + 1, C});
  CHECK_THROWS_AS(embedding_forward(out, ids_host, table.dev), Error);
  CHECK_THROWS_AS(embedding_backward(dtab_bf16, dy.dev, ids), Error);
  CHECK_THROWS_AS(embedding_forward(out_bad, ids, table.dev), Error);
}

TEST_CASE("cuda: sum_squares matches the CPU f64 sum in f32, bf16 and f64, and repeats bitwise" *
          doctest::skip(!cw::test::gpu_ready())) {
  // The squares of the (rounded) inputs are summed in f64 on both sides; only the order differs,
  // so 1e-12 relative is far above the difference and far below any dropped or doubled element
  // (one of 2^20 + 37 terms is ~1e-6 of the sum).
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    INFO("dtype ", dtype_name(dt));
    const int64_t n = (int64_t{1} << 20) + 37;
    GpuInput x = make_input(dt, {n}, 60);
    double expect = 0.0;
    for (int64_t i = 0; i < n; ++i) expect += x.ref.tensor.ptr<double>()[i] * x.ref.tensor.ptr<double>()[i];
    const double got = gpu::sum_squares(x.dev);
    CHECK(std::abs(got - expect) <= 1e-12 * expect);
    CHECK(gpu::sum_squares(x.dev) == got);
  }
}

TEST_CASE("cuda: the device memory limit returns cached blocks first, then refuses naming the limit" *
          doctest::skip(!cw::test::gpu_ready())) {
  const Device g = gpu0();
  release_cached(g);
  const size_t base = pool_stats(g).in_use, mib = size_t{1} << 20;
  DeviceMemoryLimitScope limit(g, base + 48 * mib);
  CHECK(device_memory_limit(g) == base + 48 * mib);
  {
    Buffer a(32 * mib, g);  // in use 32 MiB: under the limit
    CHECK(pool_stats(g).in_use >= base + 32 * mib);
    CHECK_THROWS_WITH_AS(Buffer(32 * mib, g), doctest::Contains("device memory limit"), Error);
  }
  // a's block is cached now; a different size class needs room: the cached block goes back first.
  Buffer b(40 * mib, g);
  CHECK(pool_stats(g).in_use + pool_stats(g).cached <= base + 48 * mib);
}

TEST_CASE("cuda: pinned blocks, huge-page mapped (2 MiB and more) or not, carry copies both ways bit for bit" *
          doctest::skip(!cw::test::gpu_ready())) {
  // engine/cuda/runtime.cu pinned_alloc: blocks of 2 MiB and more are anonymous mappings page-locked
  // with cudaHostRegister, smaller ones cudaHostAlloc's; a reused block keeps working.
  const Device gpu = Device::gpu(0);
  for (const size_t bytes : {size_t(4096) + 12, (size_t(2) << 20) + 4096 * 3 + 40, (size_t(7) << 20) + 8}) {
    CAPTURE(bytes);
    for (int round = 0; round < 2; ++round) {
      StagingBuffer host(bytes, gpu);
      REQUIRE(host.data() != nullptr);
      auto* h = static_cast<unsigned char*>(host.data());
      for (size_t i = 0; i < bytes; ++i) h[i] = static_cast<unsigned char>((i * 131 + bytes + size_t(round)) % 251);
      const std::vector<unsigned char> want(h, h + bytes);
      void* dev = gpu::device_alloc(bytes, 0);
      host_wait_for_copy(copy_async(dev, host.data(), bytes, gpu, /*to_host=*/false), gpu);
      std::fill(h, h + bytes, static_cast<unsigned char>(0));
      host_wait_for_copy(copy_async(host.data(), dev, bytes, gpu, /*to_host=*/true), gpu);
      gpu::device_free(dev, 0);
      CHECK(std::equal(want.begin(), want.end(), h));
    }
  }
}
