// The GPU elementwise and row ops (engine/cuda/elementwise.cu, rmsnorm.cu, embedding.cu) against the
// CPU ops computed in f64 on the same inputs.
//
// Every check follows one pattern: random inputs are drawn in f64, rounded to the compute dtype
// (f32 or bf16) on the host, and that rounded tensor is both uploaded (the GPU's input) and widened
// back to f64 (the reference's input), so the two sides see identical values. Outputs the op
// overwrites are poisoned with NaN first: an element the kernel fails to write stays NaN, and NaN
// makes the relative error NaN, which fails every `<=` check. Outputs the op accumulates into are
// pre-filled with known random values and compared against the reference's sum. Results are
// compared by relative L2 error (cw::test::compare) with the tolerances below; runs are repeated to
// check that results are bitwise reproducible.
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/ops/embedding.h"
#include "engine/ops/residual.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "engine/random.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace cw;
using namespace cw::test;

namespace {

// f32 against f64: f32 arithmetic (relative rounding 6e-8 per operation) over reductions of up to
// a few thousand terms, plus f32 rope tables and expf within a few ulps: errors stay near 1e-6.
// Also used for f32 outputs of bf16 runs (rstd, d_weight, embedding d_table, f32 accumulation):
// those are f32 sums of exactly representable bf16 inputs.
constexpr double kGpuF32Tol = 1e-5;
// bf16 against f64: bf16 keeps 8 significant bits, so rounding an output once costs up to 2^-9
// (about 2e-3) relative per element; arithmetic inside the kernels is f32. 2e-2 leaves a margin of
// about ten for the few places where the rounding of an accumulated value adds to it.
constexpr double kGpuBf16Tol = 2e-2;

constexpr DType kDtypes[] = {DType::f32, DType::bf16};
constexpr uint64_t kSeed = 4242;

double tol_for(DType dt) { return dt == DType::bf16 ? kGpuBf16Tol : kGpuF32Tol; }

using Input = GpuInput;
Input make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0, double mean = 0.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std, mean);
}
void expect_close(const Tensor& dev, const Tensor& ref, double tol, const char* what) {
  expect_close_gpu(dev, ref, tol, what);
}

}  // namespace

TEST_CASE("cuda: poisoned outputs fail the comparison" * doctest::skip(!cw::test::gpu_ready())) {
  // The premise of every test below: an unwritten (NaN) element makes the check fail.
  for (DType dt : kDtypes) {
    INFO(dtype_name(dt));
    Input x = make_input(dt, {3, 5}, 90);
    OwnedTensor p = poisoned(dt, {3, 5});
    const OwnedTensor got = fetch(p);
    CHECK(std::isnan(got.tensor.ptr<double>()[7]));
    CHECK_FALSE(compare(got, x.ref).rel <= kGpuBf16Tol);
    CHECK(compare(fetch(x.dev), x.ref).rel == 0);  // the upload is exact
  }
}

TEST_CASE("cuda: rmsnorm forward and backward match the CPU; d_weight accumulates; deterministic" *
          doctest::skip(!cw::test::gpu_ready())) {
  struct Size {
    int64_t N, C;
  };
  // C = 203: not a multiple of 32 or 4; N = 300: several d_weight row blocks, the last one partial;
  // 512 x 2048: a realistic layer.
  for (const Size sz : {Size{37, 203}, Size{300, 64}, Size{512, 2048}}) {
    for (DType dt : kDtypes) {
      const int64_t N = sz.N, C = sz.C;
      const double tol = tol_for(dt), eps = 1e-5;
      INFO(dtype_name(dt), " N=", N, " C=", C);
      Input x = make_input(dt, {N, C}, 1), w = make_input(dt, {C}, 2, 0.3, 1.0), dy = make_input(dt, {N, C}, 3);
      Arena scratch(gpu0());
      Arena host_scratch;

      // forward
      OwnedTensor out = poisoned(dt, {N, C}), rstd = poisoned(DType::f32, {N});
      gpu::rmsnorm_forward(out, {rstd}, x.dev, w.dev, eps);
      OwnedTensor out64(DType::f64, {N, C}), rstd64(DType::f64, {N});
      rmsnorm_forward(out64, {rstd64}, x.ref, w.ref, eps);
      expect_close(out, out64, tol, "out");
      expect_close(rstd, rstd64, kGpuF32Tol, "rstd");
      OwnedTensor out2 = poisoned(dt, {N, C}), rstd2 = poisoned(DType::f32, {N});
      gpu::rmsnorm_forward(out2, {rstd2}, x.dev, w.dev, eps);
      expect_same_bits(out, out2, "forward out is reproducible");
      expect_same_bits(rstd, rstd2, "forward rstd is reproducible");

      // backward, overwrite: d_x poisoned, d_weight starts from random values and is added to.
      // Both sides use the GPU's rstd, so the check isolates the backward.
      const OwnedTensor rstd_used = fetch(rstd);
      Input dw = make_input(DType::f32, {C}, 4);
      OwnedTensor dx = poisoned(dt, {N, C});
      gpu::rmsnorm_backward(dx, dw.dev, dy.dev, {rstd}, x.dev, w.dev, GradMode::overwrite, scratch);
      CHECK(scratch.in_use() == 0);  // scratch handed back as found
      OwnedTensor dx64(DType::f64, {N, C});
      rmsnorm_backward(dx64, dw.ref, dy.ref, {rstd_used}, x.ref, w.ref, GradMode::overwrite, host_scratch);
      expect_close(dx, dx64, tol, "d_x (overwrite)");
      expect_close(dw.dev, dw.ref, kGpuF32Tol, "d_weight += (first backward)");

      // backward, accumulate: d_x starts from random values; d_weight is added to a second time.
      Input dx_acc = make_input(dt, {N, C}, 5);
      gpu::rmsnorm_backward(dx_acc.dev, dw.dev, dy.dev, {rstd}, x.dev, w.dev, GradMode::accumulate, scratch);
      rmsnorm_backward(dx_acc.ref, dw.ref, dy.ref, {rstd_used}, x.ref, w.ref, GradMode::accumulate, host_scratch);
      expect_close(dx_acc.dev, dx_acc.ref, tol, "d_x (accumulate)");
      expect_close(dw.dev, dw.ref, kGpuF32Tol, "d_weight += (second backward)");

      // determinism: the same backward from the same starting d_weight, twice
      Input dwa = make_input(DType::f32, {C}, 6), dwb = make_input(DType::f32, {C}, 6);
      OwnedTensor dxa = poisoned(dt, {N, C}), dxb = poisoned(dt, {N, C});
      gpu::rmsnorm_backward(dxa, dwa.dev, dy.dev, {rstd}, x.dev, w.dev, GradMode::overwrite, scratch);
      gpu::rmsnorm_backward(dxb, dwb.dev, dy.dev, {rstd}, x.dev, w.dev, GradMode::overwrite, scratch);
      expect_same_bits(dxa, dx, "d_x is reproducible");
      expect_same_bits(dxb, dx, "d_x is reproducible (again)");
      expect_same_bits(dwa.dev, dwb.dev, "d_weight is reproducible");

      // d_x may alias d_out (overwrite): the d_weight partials read d_out before d_x is written
      Input dy_alias = make_input(dt, {N, C}, 3), dwc = make_input(DType::f32, {C}, 6);
      gpu::rmsnorm_backward(dy_alias.dev, dwc.dev, dy_alias.dev, {rstd}, x.dev, w.dev, GradMode::overwrite, scratch);
      expect_same_bits(dy_alias.dev, dx, "d_x in place of d_out");
      expect_same_bits(dwc.dev, dwa.dev, "d_weight with d_x in place of d_out");
    }
  }
}

TEST_CASE("cuda: rmsnorm rejects host operands and wrong dtypes" * doctest::skip(!cw::test::gpu_ready())) {
  Input x = make_input(DType::f32, {4, 8}, 1), w = make_input(DType::f32, {8}, 2), dy = make_input(DType::f32, {4, 8}, 3);
  OwnedTensor out = poisoned(DType::f32, {4, 8}), rstd = poisoned(DType::f32, {4});
  OwnedTensor rstd_bf16 = poisoned(DType::bf16, {4}), dw_bf16 = poisoned(DType::bf16, {8}), dw = poisoned(DType::f32, {8});
  OwnedTensor host_out(DType::f32, {4, 8});
  Arena scratch(gpu0());
  CHECK_THROWS_AS(gpu::rmsnorm_forward(host_out, {rstd}, x.dev, w.dev, 1e-5), Error);
  CHECK_THROWS_AS(gpu::rmsnorm_forward(out, {rstd_bf16}, x.dev, w.dev, 1e-5), Error);
  CHECK_THROWS_AS(gpu::rmsnorm_forward(out, {rstd}, x.dev, dy.dev, 1e-5), Error);  // weight of the wrong shape
  CHECK_THROWS_AS(gpu::rmsnorm_forward(x.dev, {rstd}, x.dev, w.dev, 1e-5), Error);  // out aliases x
  CHECK_THROWS_AS(gpu::rmsnorm_backward(out, dw_bf16, dy.dev, {rstd}, x.dev, w.dev, GradMode::overwrite, scratch),
                  Error);  // d_weight must be f32
  Input x64 = make_input(DType::f64, {4, 8}, 1), w64 = make_input(DType::f64, {8}, 2);
  OwnedTensor out64 = poisoned(DType::f64, {4, 8});
  CHECK_THROWS_AS(gpu::rmsnorm_forward(out64, {rstd}, x64.dev, w64.dev, 1e-5), Error);  // no f64 compute on the GPU
}

TEST_CASE("cuda: rope forward and backward match the CPU, in place and out of place" *
          doctest::skip(!cw::test::gpu_ready())) {
  const int64_t B = 2, T = 37, H = 3, P = 64, pos0 = 5;
  for (const int64_t D : {int64_t(10), int64_t(128)}) {  // half = 5 (odd), and a realistic head
    // Tables in f64 for the reference; f32 on the GPU (for either compute dtype).
    OwnedTensor cos64(DType::f64, {P, D / 2}), sin64(DType::f64, {P, D / 2});
    rope_tables(cos64, sin64, D, 10000.0, RopeScaling{RopeScaling::Type::llama3, 4.0, 1.0, 4.0, 16});
    OwnedTensor cos = OwnedTensor::on(gpu0(), DType::f32, {P, D / 2}), sin = OwnedTensor::on(gpu0(), DType::f32, {P, D / 2});
    gpu::copy_convert(cos, cos64);
    gpu::copy_convert(sin, sin64);
    for (DType dt : kDtypes) {
      const double tol = tol_for(dt);
      INFO(dtype_name(dt), " D=", D);
      Input x = make_input(dt, {B, T, H, D}, 7), dy = make_input(dt, {B, T, H, D}, 8);

      // forward, out of place
      OwnedTensor out = poisoned(dt, {B, T, H, D});
      gpu::rope_forward(out, x.dev, cos, sin, pos0);
      OwnedTensor out64(DType::f64, {B, T, H, D});
      rope_forward(out64, x.ref, cos64, sin64, pos0);
      expect_close(out, out64, tol, "rope out");
      // in place: the same bits
      Input xi = make_input(dt, {B, T, H, D}, 7);
      gpu::rope_forward(xi.dev, xi.dev, cos, sin, pos0);
      expect_same_bits(xi.dev, out, "rope in place");

      // backward, overwrite
      OwnedTensor dx = poisoned(dt, {B, T, H, D});
      gpu::rope_backward(dx, dy.dev, cos, sin, pos0, GradMode::overwrite);
      OwnedTensor dx64(DType::f64, {B, T, H, D});
      rope_backward(dx64, dy.ref, cos64, sin64, pos0, GradMode::overwrite);
      expect_close(dx, dx64, tol, "rope d_x (overwrite)");
      // backward, accumulate onto random values
      Input dx_acc = make_input(dt, {B, T, H, D}, 9);
      gpu::rope_backward(dx_acc.dev, dy.dev, cos, sin, pos0, GradMode::accumulate);
      rope_backward(dx_acc.ref, dy.ref, cos64, sin64, pos0, GradMode::accumulate);
      expect_close(dx_acc.dev, dx_acc.ref, tol, "rope d_x (accumulate)");
      // backward in place of d_out (overwrite)
      Input dyi = make_input(dt, {B, T, H, D}, 8);
      gpu::rope_backward(dyi.dev, dyi.dev, cos, sin, pos0, GradMode::overwrite);
      expect_same_bits(dyi.dev, dx, "rope backward in place");
      // determinism
      OwnedTensor out2 = poisoned(dt, {B, T, H, D});
      gpu::rope_forward(out2, x.dev, cos, sin, pos0);
      expect_same_bits(out2, out, "rope forward is reproducible");

      // errors: accumulate in place, positions past the table, tables not f32
      CHECK_THROWS_AS(gpu::rope_backward(dyi.dev, dyi.dev, cos, sin, pos0, GradMode::accumulate), Error);
      CHECK_THROWS_AS(gpu::rope_forward(out, x.dev, cos, sin, P - T + 1), Error);
      OwnedTensor cos_bf16 = poisoned(DType::bf16, {P, D / 2});
      CHECK_THROWS_AS(gpu::rope_forward(out, x.dev, cos_bf16, cos_bf16, pos0), Error);
    }
  }
}

TEST_CASE("cuda: swiglu forward and backward match the CPU" * doctest::skip(!cw::test::gpu_ready())) {
  struct Size {
    int64_t N, F;
  };
  for (const Size sz : {Size{37, 203}, Size{64, 1376}}) {
    for (DType dt : kDtypes) {
      const int64_t N = sz.N, F = sz.F;
      const double tol = tol_for(dt);
      INFO(dtype_name(dt), " N=", N, " F=", F);
      Input g = make_input(dt, {N, F}, 10, 2.0), u = make_input(dt, {N, F}, 11), dy = make_input(dt, {N, F}, 12);

      OwnedTensor out = poisoned(dt, {N, F});
      gpu::swiglu_forward(out, g.dev, u.dev);
      OwnedTensor out64(DType::f64, {N, F});
      swiglu_forward(out64, g.ref, u.ref);
      expect_close(out, out64, tol, "swiglu out");

      OwnedTensor dg = poisoned(dt, {N, F}), du = poisoned(dt, {N, F});
      gpu::swiglu_backward(dg, du, dy.dev, g.dev, u.dev, GradMode::overwrite);
      OwnedTensor dg64(DType::f64, {N, F}), du64(DType::f64, {N, F});
      swiglu_backward(dg64, du64, dy.ref, g.ref, u.ref, GradMode::overwrite);
      expect_close(dg, dg64, tol, "swiglu d_gate (overwrite)");
      expect_close(du, du64, tol, "swiglu d_up (overwrite)");

      Input dg_acc = make_input(dt, {N, F}, 13), du_acc = make_input(dt, {N, F}, 14);
      gpu::swiglu_backward(dg_acc.dev, du_acc.dev, dy.dev, g.dev, u.dev, GradMode::accumulate);
      swiglu_backward(dg_acc.ref, du_acc.ref, dy.ref, g.ref, u.ref, GradMode::accumulate);
      expect_close(dg_acc.dev, dg_acc.ref, tol, "swiglu d_gate (accumulate)");
      expect_close(du_acc.dev, du_acc.ref, tol, "swiglu d_up (accumulate)");

      OwnedTensor dg2 = poisoned(dt, {N, F}), du2 = poisoned(dt, {N, F});
      gpu::swiglu_backward(dg2, du2, dy.dev, g.dev, u.dev, GradMode::overwrite);
      expect_same_bits(dg2, dg, "swiglu d_gate is reproducible");
      expect_same_bits(du2, du, "swiglu d_up is reproducible");
    }
  }
}

TEST_CASE("cuda: residual and accumulate match the CPU, with the alias rules" * doctest::skip(!cw::test::gpu_ready())) {
  const int64_t N = 37, C = 203;
  for (DType dt : kDtypes) {
    const double tol = tol_for(dt);
    INFO(dtype_name(dt));
    Input x = make_input(dt, {N, C}, 20), delta = make_input(dt, {N, C}, 21), dy = make_input(dt, {N, C}, 22);

    // forward, out of place and in place (out aliases x)
    OwnedTensor out = poisoned(dt, {N, C});
    gpu::residual_forward(out, x.dev, delta.dev);
    OwnedTensor out64(DType::f64, {N, C});
    residual_forward(out64, x.ref, delta.ref);
    expect_close(out, out64, tol, "residual out");
    Input xi = make_input(dt, {N, C}, 20);
    gpu::residual_forward(xi.dev, xi.dev, delta.dev);
    expect_same_bits(xi.dev, out, "residual in place");

    // backward: d_x overwritten, d_delta accumulated onto random values
    OwnedTensor dx = poisoned(dt, {N, C});
    Input dd = make_input(dt, {N, C}, 23);
    gpu::residual_backward(dx, GradMode::overwrite, dd.dev, GradMode::accumulate, dy.dev);
    OwnedTensor dx64(DType::f64, {N, C});
    residual_backward(dx64, GradMode::overwrite, dd.ref, GradMode::accumulate, dy.ref);
    expect_close(dx, dx64, tol, "residual d_x (overwrite)");
    expect_close(dd.dev, dd.ref, tol, "residual d_delta (accumulate)");

    // backward: d_x accumulated onto random values, d_delta overwritten
    Input dx_acc = make_input(dt, {N, C}, 24);
    OwnedTensor dd_over = poisoned(dt, {N, C});
    gpu::residual_backward(dx_acc.dev, GradMode::accumulate, dd_over, GradMode::overwrite, dy.dev);
    OwnedTensor dd_over64(DType::f64, {N, C});
    residual_backward(dx_acc.ref, GradMode::accumulate, dd_over64, GradMode::overwrite, dy.ref);
    expect_close(dx_acc.dev, dx_acc.ref, tol, "residual d_x (accumulate)");
    expect_close(dd_over, dd_over64, tol, "residual d_delta (overwrite)");

    // d_x aliases d_out: passed through untouched; d_delta still written. No d_delta: skipped.
    Input dyi = make_input(dt, {N, C}, 22);
    OwnedTensor dd2 = poisoned(dt, {N, C});
    gpu::residual_backward(dyi.dev, GradMode::overwrite, dd2, GradMode::overwrite, dyi.dev);
    expect_same_bits(dyi.dev, dy.dev, "d_out untouched when d_x aliases it");
    expect_same_bits(dd2, dy.dev, "d_delta = d_out");
    OwnedTensor dx3 = poisoned(dt, {N, C});
    gpu::residual_backward(dx3, GradMode::overwrite, Tensor{}, GradMode::overwrite, dy.dev);
    expect_same_bits(dx3, dy.dev, "d_x = d_out without d_delta");
    CHECK_THROWS_AS(gpu::residual_backward(dyi.dev, GradMode::accumulate, Tensor{}, GradMode::overwrite, dyi.dev),
                    Error);

    // accumulate: dst of the compute dtype
    Input dst = make_input(dt, {N, C}, 25);
    gpu::accumulate(dst.dev, x.dev);
    accumulate(dst.ref, x.ref);
    expect_close(dst.dev, dst.ref, tol, "accumulate (same dtype)");
    // accumulate: f32 dst with a compute-dtype source (f32 arithmetic, f32 result)
    Input dst32 = make_input(DType::f32, {N, C}, 26);
    gpu::accumulate(dst32.dev, x.dev);
    gpu::accumulate(dst32.dev, delta.dev);
    accumulate(dst32.ref, x.ref);
    accumulate(dst32.ref, delta.ref);
    expect_close(dst32.dev, dst32.ref, kGpuF32Tol, "accumulate (f32 destination)");
  }
  // a bf16 destination with an f32 source is not a gradient sum: refused
  Input d16 = make_input(DType::bf16, {4, 5}, 27), s32 = make_input(DType::f32, {4, 5}, 28);
  CHECK_THROWS_AS(gpu::accumulate(d16.dev, s32.dev), Error);
  OwnedTensor host(DType::f32, {4, 5});
  CHECK_THROWS_AS(gpu::accumulate(host, s32.dev), Error);
}

TEST_CASE("cuda: embedding lookup and deterministic scatter-add backward match the CPU" *
          doctest::skip(!cw::test::gpu_ready())) {
  struct Size {
    int64_t N, V, C;
  };
  for (const Size sz : {Size{37, 50, 203}, Size{512, 1000, 2048}}) {
    const int64_t N = sz.N, V = sz.V, C = sz.C;
    // ids with many repeats (the backward must sum them), including the first and last rows
    OwnedTensor ids_host(DType::i32, {N});
    for (int64_t n = 0; n < N; ++n) ids_host.tensor.ptr<int32_t>()[n] = static_cast<int32_t>((n * n * 13 + 5) % 17);
    ids_host.tensor.ptr<int32_t>()[0] = static_cast<int32_t>(V - 1);
    ids_host.tensor.ptr<int32_t>()[N - 1] = 0;
    OwnedTensor ids = OwnedTensor::on(gpu0(), DType::i32, {N});
    gpu::copy_convert(ids, ids_host);
    for (DType dt : kDtypes) {
      INFO(dtype_name(dt), " N=", N, " V=", V, " C=", C);
      Input table = make_input(dt, {V, C}, 30), dy = make_input(dt, {N, C}, 31);

      // forward: a copy, so exact
      OwnedTensor out = poisoned(dt, {N, C});
      gpu::embedding_forward(out, ids, table.dev);
      OwnedTensor out64(DType::f64, {N, C});
      embedding_forward(out64, ids_host, table.ref);
      const OwnedTensor got = fetch(out);
      const Worst w = compare(got, out64);
      INFO("embedding out: ", w.str());
      CHECK(w.rel == 0);

      // backward into an f32 d_table holding random values (it accumulates)
      Input dtab = make_input(DType::f32, {V, C}, 32);
      gpu::embedding_backward(dtab.dev, dy.dev, ids);
      embedding_backward(dtab.ref, dy.ref, ids_host);
      expect_close(dtab.dev, dtab.ref, kGpuF32Tol, "embedding d_table +=");
      // a second backward adds again
      gpu::embedding_backward(dtab.dev, dy.dev, ids);
      embedding_backward(dtab.ref, dy.ref, ids_host);
      expect_close(dtab.dev, dtab.ref, kGpuF32Tol, "embedding d_table += (twice)");
      // determinism: from the same start, the same bits
      Input da = make_input(DType::f32, {V, C}, 33), db = make_input(DType::f32, {V, C}, 33);
      gpu::embedding_backward(da.dev, dy.dev, ids);
      gpu::embedding_backward(db.dev, dy.dev, ids);
      expect_same_bits(da.dev, db.dev, "embedding d_table is reproducible");
    }
  }
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
  Input table = make_input(DType::f32, {V, C}, 40), dy = make_input(DType::f32, {N, C}, 41);

  OwnedTensor out = poisoned(DType::f32, {N, C});
  gpu::fill(out, 0.0);
  gpu::embedding_forward(out, ids, table.dev);
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
  gpu::embedding_backward(dtab, dy.dev, ids);
  OwnedTensor expect(DType::f64, {V, C});  // zero-filled
  const double* d = dy.ref.tensor.ptr<double>();
  for (int64_t c = 0; c < C; ++c)
    expect.tensor.ptr<double>()[2 * C + c] = static_cast<double>(static_cast<float>(d[0 * C + c]) + static_cast<float>(d[3 * C + c]));
  CHECK(compare(fetch(dtab), expect).rel == 0);

  // operand checks: ids on the host, a bf16 d_table, a wrong output shape
  OwnedTensor dtab_bf16 = poisoned(DType::bf16, {V, C}), out_bad = poisoned(DType::f32, {N + 1, C});
  CHECK_THROWS_AS(gpu::embedding_forward(out, ids_host, table.dev), Error);
  CHECK_THROWS_AS(gpu::embedding_backward(dtab_bf16, dy.dev, ids), Error);
  CHECK_THROWS_AS(gpu::embedding_forward(out_bad, ids, table.dev), Error);
}

TEST_CASE("cuda: sum_squares matches the CPU f64 sum in f32, bf16 and f64, and repeats bitwise" *
          doctest::skip(!cw::test::gpu_ready())) {
  // The squares of the (rounded) inputs are summed in f64 on both sides; only the order differs,
  // so 1e-12 relative is far above the difference and far below any dropped or doubled element
  // (one of 2^20 + 37 terms is ~1e-6 of the sum).
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    INFO("dtype ", dtype_name(dt));
    const int64_t n = (int64_t{1} << 20) + 37;
    Input x = make_input(dt, {n}, 60);
    double expect = 0.0;
    for (int64_t i = 0; i < n; ++i) expect += x.ref.tensor.ptr<double>()[i] * x.ref.tensor.ptr<double>()[i];
    const double got = gpu::sum_squares(x.dev);
    CHECK(std::abs(got - expect) <= 1e-12 * expect);
    CHECK(gpu::sum_squares(x.dev) == got);
  }
}
