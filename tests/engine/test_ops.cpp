// Every op: fp64 finite-difference gradients (L = <R, out>), the accumulate/overwrite contract,
// and the properties the schedules rely on (chunked attention equals whole-sequence attention,
// the LM head's blocks do not change the result).
#include "engine/ops/attention.h"
#include "engine/ops/embedding.h"
#include "engine/ops/linear.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/ops/residual.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "engine/random.h"
#include "tests/engine/fd_check.h"

#include <cmath>
#include <numbers>

using namespace cw;
using namespace cw::test;

namespace {
// f32 copies of f64 inputs, for "f32 against f64" checks.
OwnedTensor to_f32(const Tensor& t) {
  OwnedTensor o = OwnedTensor::of_shape(DType::f32, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim));
  copy_convert(o, t);
  return o;
}
// Rounding of f32 ops on O(1) data with reductions over tens of terms.
constexpr double kF32VsF64Tol = 1e-5;
}  // namespace

TEST_CASE("embedding: lookup, scatter-add backward, id checks") {
  OwnedTensor table = randn({7, 5}, 1);
  OwnedTensor ids(DType::i32, {4});
  const int32_t idv[4] = {3, 0, 3, 6};
  for (int i = 0; i < 4; ++i) ids.tensor.ptr<int32_t>()[i] = idv[i];
  OwnedTensor out(DType::f64, {4, 5}), R = randn({4, 5}, 2), d_table(DType::f64, {7, 5});
  embedding_forward(out, ids, table);
  CHECK(out.tensor.ptr<double>()[2 * 5 + 1] == table.tensor.ptr<double>()[3 * 5 + 1]);
  embedding_backward(d_table, R, ids);
  check_gradients({{"table", table, d_table}}, [&] {
    embedding_forward(out, ids, table);
    return inner(out, R);
  });
  ids.tensor.ptr<int32_t>()[1] = 7;
  CHECK_THROWS_AS(embedding_forward(out, ids, table), Error);
}

TEST_CASE("rmsnorm: gradients of x and w; accumulate adds; f32 tracks f64") {
  const int64_t N = 5, C = 8;
  OwnedTensor x = randn({N, C}, 3), w = randn({C}, 4, 0.3, 1.0), R = randn({N, C}, 5);
  OwnedTensor out(DType::f64, {N, C}), rstd(DType::f64, {N}), dx(DType::f64, {N, C}), dw(DType::f64, {C});
  Arena scratch_;
  rmsnorm_forward(out, {rstd}, x, w, 1e-5);
  rmsnorm_backward(dx, dw, R, {rstd}, x, w, GradMode::overwrite, scratch_);
  check_gradients({{"x", x, dx}, {"w", w, dw}}, [&] {
    rmsnorm_forward(out, {rstd}, x, w, 1e-5);
    return inner(out, R);
  });
  // accumulate: a second backward adds the same again
  OwnedTensor dx2(DType::f64, {N, C}), dw2(DType::f64, {C});
  copy_convert(dx2, dx);
  rmsnorm_backward(dx2, dw2, R, {rstd}, x, w, GradMode::accumulate, scratch_);
  for (int64_t i = 0; i < N * C; ++i) CHECK(dx2.tensor.ptr<double>()[i] == doctest::Approx(2 * dx.tensor.ptr<double>()[i]));
  // f32 (recompute the f64 forward: the finite-difference loop left a perturbed one in `out`)
  rmsnorm_forward(out, {rstd}, x, w, 1e-5);
  OwnedTensor x32 = to_f32(x), w32 = to_f32(w), out32(DType::f32, {N, C}), rstd32(DType::f32, {N});
  rmsnorm_forward(out32, {rstd32}, x32, w32, 1e-5);
  CHECK(compare(out32, out).rel < kF32VsF64Tol);
}

TEST_CASE("linear: y = x W^T and its gradients") {
  OwnedTensor x = randn({4, 6}, 6), W = randn({3, 6}, 7), R = randn({4, 3}, 8);
  OwnedTensor y(DType::f64, {4, 3}), dx(DType::f64, {4, 6}), dW(DType::f64, {3, 6});
  linear_forward(y, x, W);
  double y01 = 0;
  for (int i = 0; i < 6; ++i) y01 += x.tensor.ptr<double>()[i] * W.tensor.ptr<double>()[6 + i];
  CHECK(y.tensor.ptr<double>()[1] == doctest::Approx(y01).epsilon(1e-14));
  linear_backward(dx, dW, R, x, W, GradMode::overwrite);
  check_gradients({{"x", x, dx}, {"W", W, dW}}, [&] {
    linear_forward(y, x, W);
    return inner(y, R);
  });
  CHECK_THROWS_AS(linear_forward(y, x, R), Error);  // shape mismatch is caught
}

TEST_CASE("rope: llama3 frequencies, rotation, offset, gradient") {
  // llama3 scaling: high frequencies unchanged, low ones divided by the factor, the middle blended.
  RopeScaling s{RopeScaling::Type::llama3, 8.0, 1.0, 4.0, 8192};
  const std::vector<double> plain = rope_inv_freq(128, 500000.0, RopeScaling{});
  const std::vector<double> scaled = rope_inv_freq(128, 500000.0, s);
  CHECK(scaled[0] == plain[0]);                              // wavelength 2 pi < 8192 / 4
  CHECK(scaled[63] == doctest::Approx(plain[63] / 8.0));     // wavelength > 8192
  for (size_t i = 0; i < 64; ++i) {
    const double wl = 2 * std::numbers::pi / plain[i];
    if (wl >= 2048 && wl <= 8192) {
      CHECK(scaled[i] < plain[i]);
      CHECK(scaled[i] > plain[i] / 8.0);
    }
  }
  const int64_t B = 2, T = 5, H = 3, D = 8, P = 16;
  OwnedTensor cos(DType::f64, {P, D / 2}), sin(DType::f64, {P, D / 2});
  rope_tables(cos, sin, D, 10000.0, RopeScaling{RopeScaling::Type::llama3, 4.0, 1.0, 4.0, 8});
  OwnedTensor x = randn({B, T, H, D}, 9), R = randn({B, T, H, D}, 10), y(DType::f64, {B, T, H, D}),
              dx(DType::f64, {B, T, H, D});
  const int64_t pos0 = 7;
  rope_forward(y, x, cos, sin, pos0);
  // A rotation keeps each pair's norm.
  double nx = 0, ny = 0;
  for (int64_t i = 0; i < x.tensor.numel(); ++i) {
    nx += x.tensor.ptr<double>()[i] * x.tensor.ptr<double>()[i];
    ny += y.tensor.ptr<double>()[i] * y.tensor.ptr<double>()[i];
  }
  CHECK(ny == doctest::Approx(nx).epsilon(1e-13));
  rope_backward(dx, R, cos, sin, pos0, GradMode::overwrite);
  check_gradients({{"x", x, dx}}, [&] {
    rope_forward(y, x, cos, sin, pos0);
    return inner(y, R);
  });
  // In place equals out of place.
  OwnedTensor z(DType::f64, {B, T, H, D});
  copy_convert(z, x);
  rope_forward(z, z, cos, sin, pos0);
  rope_forward(y, x, cos, sin, pos0);
  CHECK(compare(z, y).rel == 0.0);
  CHECK_THROWS_AS(rope_forward(y, x, cos, sin, 12), Error);  // positions past the table
}

TEST_CASE("attention: chunk against cache, GQA, gradients added into dK/dV") {
  const int64_t B = 2, H = 4, Hkv = 2, D = 4, p = 5, c = 3, S = p + c;
  const double scale = 1.0 / std::sqrt(double(D));
  OwnedTensor q = randn({B, c, H, D}, 11), k = randn({B, S, Hkv, D}, 12), v = randn({B, S, Hkv, D}, 13);
  OwnedTensor R = randn({B, c, H, D}, 14), out(DType::f64, {B, c, H, D}), lse(DType::f64, {B, H, c});
  Arena scratch;
  attention_forward(out, {lse}, q, k, v, scale, scratch);
  OwnedTensor dq(DType::f64, {B, c, H, D}), dk = randn({B, S, Hkv, D}, 15), dv = randn({B, S, Hkv, D}, 16);
  OwnedTensor dk0(DType::f64, {B, S, Hkv, D}), dv0(DType::f64, {B, S, Hkv, D});
  copy_convert(dk0, dk);  // what the buffers held before: the op must add to it
  copy_convert(dv0, dv);
  attention_backward(dq, dk, dv, R, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch);
  OwnedTensor dk_added(DType::f64, {B, S, Hkv, D}), dv_added(DType::f64, {B, S, Hkv, D});
  for (int64_t i = 0; i < dk.tensor.numel(); ++i) {
    dk_added.tensor.ptr<double>()[i] = dk.tensor.ptr<double>()[i] - dk0.tensor.ptr<double>()[i];
    dv_added.tensor.ptr<double>()[i] = dv.tensor.ptr<double>()[i] - dv0.tensor.ptr<double>()[i];
  }
  check_gradients({{"q", q, dq}, {"k", k, dk_added}, {"v", v, dv_added}}, [&] {
    attention_forward(out, {lse}, q, k, v, scale, scratch);
    return inner(out, R);
  });

  // The chunk's rows equal the last c rows of full causal attention over all S queries.
  OwnedTensor qfull = randn({B, S, H, D}, 17), ofull(DType::f64, {B, S, H, D}), lfull(DType::f64, {B, H, S});
  attention_forward(ofull, {lfull}, qfull, k, v, scale, scratch);
  OwnedTensor qlast(DType::f64, {B, c, H, D}), olast(DType::f64, {B, c, H, D});
  copy_convert(qlast, qfull.tensor.slice(1, p, c));
  attention_forward(olast, {lse}, qlast, k, v, scale, scratch);
  OwnedTensor expect(DType::f64, {B, c, H, D});
  copy_convert(expect, ofull.tensor.slice(1, p, c));
  CHECK(compare(olast, expect).rel < kSameMathF64Tol);

  // K/V given as a slice of a larger store (batch stride > packed) gives the same result.
  OwnedTensor store(DType::f64, {B, S + 4, Hkv, D});
  copy_convert(store.tensor.slice(1, 0, S), k);
  OwnedTensor out2(DType::f64, {B, c, H, D});
  OwnedTensor vstore(DType::f64, {B, S + 4, Hkv, D});
  copy_convert(vstore.tensor.slice(1, 0, S), v);
  attention_forward(out2, {lse}, q, store.tensor.slice(1, 0, S), vstore.tensor.slice(1, 0, S), scale, scratch);
  attention_forward(out, {lse}, q, k, v, scale, scratch);
  CHECK(compare(out2, out).rel == 0.0);

  // f32 against f64.
  OwnedTensor q32 = to_f32(q), k32 = to_f32(k), v32 = to_f32(v), o32(DType::f32, {B, c, H, D}), l32(DType::f32, {B, H, c});
  attention_forward(o32, {l32}, q32, k32, v32, scale, scratch);
  CHECK(compare(o32, out).rel < kF32VsF64Tol);
  CHECK(scratch.in_use() == 0);  // scratch returned as found
}

TEST_CASE("swiglu: gradients of gate and up") {
  OwnedTensor g = randn({3, 7}, 18, 2.0), u = randn({3, 7}, 19), R = randn({3, 7}, 20);
  OwnedTensor y(DType::f64, {3, 7}), dg(DType::f64, {3, 7}), du(DType::f64, {3, 7});
  swiglu_forward(y, g, u);
  const double g0 = g.tensor.ptr<double>()[0];
  CHECK(y.tensor.ptr<double>()[0] == doctest::Approx(g0 / (1 + std::exp(-g0)) * u.tensor.ptr<double>()[0]));
  swiglu_backward(dg, du, R, g, u, GradMode::overwrite);
  check_gradients({{"gate", g, dg}, {"up", u, du}}, [&] {
    swiglu_forward(y, g, u);
    return inner(y, R);
  });
}

TEST_CASE("residual and accumulate") {
  OwnedTensor x = randn({2, 3}, 21), d = randn({2, 3}, 22), y(DType::f64, {2, 3});
  residual_forward(y, x, d);
  CHECK(y.tensor.ptr<double>()[4] == x.tensor.ptr<double>()[4] + d.tensor.ptr<double>()[4]);
  OwnedTensor dx(DType::f64, {2, 3}), dd = randn({2, 3}, 23), dd0(DType::f64, {2, 3});
  copy_convert(dd0, dd);
  residual_backward(dx, GradMode::overwrite, dd, GradMode::accumulate, y);
  CHECK(dx.tensor.ptr<double>()[1] == y.tensor.ptr<double>()[1]);
  CHECK(dd.tensor.ptr<double>()[1] == dd0.tensor.ptr<double>()[1] + y.tensor.ptr<double>()[1]);
  accumulate(dx, y);
  CHECK(dx.tensor.ptr<double>()[1] == 2 * y.tensor.ptr<double>()[1]);
  CHECK_THROWS_AS(residual_backward(y, GradMode::accumulate, Tensor{}, GradMode::overwrite, y), Error);
}

TEST_CASE("lm head + cross-entropy: loss, gradients, blocks, ignored labels") {
  const int64_t N = 7, C = 5, V = 11;
  OwnedTensor x = randn({N, C}, 24), W = randn({V, C}, 25), labels(DType::i32, {N});
  const int32_t lab[N] = {3, -100, 0, 10, 4, -100, 7};
  for (int64_t n = 0; n < N; ++n) labels.tensor.ptr<int32_t>()[n] = lab[n];
  const double normaliser = 5.0;
  Arena scratch;
  OwnedTensor row(DType::f64, {N}), lse(DType::f64, {N});
  lm_head_loss_forward(row, {lse}, x, W, labels, normaliser, scratch, 3);
  // Against the plain formula with full logits.
  double expect_total = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (lab[n] == -100) {
      CHECK(row.tensor.ptr<double>()[n] == 0.0);
      continue;
    }
    std::vector<double> z(V);
    double m = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      z[v] = 0;
      for (int64_t c = 0; c < C; ++c) z[v] += x.tensor.ptr<double>()[n * C + c] * W.tensor.ptr<double>()[v * C + c];
      m = std::max(m, z[v]);
    }
    double s = 0;
    for (double zv : z) s += std::exp(zv - m);
    const double l = (m + std::log(s) - z[lab[n]]) / normaliser;
    CHECK(row.tensor.ptr<double>()[n] == doctest::Approx(l).epsilon(1e-13));
    expect_total += l;
  }
  auto total = [&] {
    lm_head_loss_forward(row, {lse}, x, W, labels, normaliser, scratch, 3);
    double t = 0;
    for (int64_t n = 0; n < N; ++n) t += row.tensor.ptr<double>()[n];
    return t;
  };
  CHECK(total() == doctest::Approx(expect_total).epsilon(1e-13));
  OwnedTensor dx(DType::f64, {N, C}), dW(DType::f64, {V, C});
  lm_head_loss_backward(dx, dW, {lse}, x, W, labels, normaliser, GradMode::overwrite, scratch, 3);
  check_gradients({{"x", x, dx}, {"W", W, dW}}, total);
  // The fused pass and other block sizes give the same numbers.
  total();  // the finite-difference loop left a perturbed forward in `row`
  for (int64_t block : {1, 4, 100}) {
    OwnedTensor row2(DType::f64, {N}), dx2(DType::f64, {N, C}), dW2(DType::f64, {V, C});
    lm_head_loss_fused(row2, dx2, dW2, x, W, labels, normaliser, GradMode::overwrite, scratch, block);
    CHECK(compare(dx2, dx).rel < kSameMathF64Tol);
    CHECK(compare(dW2, dW).rel < kSameMathF64Tol);
    CHECK(compare(row2, row).rel < kSameMathF64Tol);
  }
  labels.tensor.ptr<int32_t>()[0] = V;
  CHECK_THROWS_AS(lm_head_loss_forward(row, {lse}, x, W, labels, normaliser, scratch), Error);
  CHECK(scratch.in_use() == 0);
}
