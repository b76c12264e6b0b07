// engine/ops/adamw_update.h on the CPU: the AdamW update op against a hand computation. (The GPU
// kernel is checked against this CPU op in tests/engine/test_backend_ops.cpp.)
#include "engine/memory.h"
#include "engine/ops/adamw_update.h"
#include "tests/support.h"

#include <cmath>

using namespace cw;
using namespace cw::test;

TEST_CASE("adamw_update: the CPU op against a hand computation (2 elements)") {
  // Step 1 from zero moments: m = (1 - b1) g, v = (1 - b2) g^2, mhat = g, vhat = g^2, so
  // p1 = p0 - lr (g / (|g| + eps) + wd p0).
  const double lr = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  OwnedTensor p(DType::f64, {2}), m(DType::f64, {2}), v(DType::f64, {2}), g(DType::f64, {2});
  double* pp = p.tensor.ptr<double>();
  double* mp = m.tensor.ptr<double>();
  double* vp = v.tensor.ptr<double>();
  double* gp = g.tensor.ptr<double>();
  pp[0] = 1.0, pp[1] = -2.0;
  gp[0] = 0.5, gp[1] = -0.25;
  adamw_update(p, m, v, g, Tensor{}, {lr, b1, b2, eps, wd, 1});
  CHECK(mp[0] == doctest::Approx(0.05).epsilon(1e-14));
  CHECK(mp[1] == doctest::Approx(-0.025).epsilon(1e-14));
  CHECK(vp[0] == doctest::Approx(0.001 * 0.25).epsilon(1e-12));
  CHECK(vp[1] == doctest::Approx(0.001 * 0.0625).epsilon(1e-12));
  const double p1_0 = 1.0 - 0.1 * (0.5 / (0.5 + 1e-8) + 0.01 * 1.0);
  const double p1_1 = -2.0 - 0.1 * (-0.25 / (0.25 + 1e-8) + 0.01 * -2.0);
  CHECK(pp[0] == doctest::Approx(p1_0).epsilon(1e-12));  // 0.899000002
  CHECK(pp[1] == doctest::Approx(p1_1).epsilon(1e-12));  // -1.898000004
  CHECK(pp[0] == doctest::Approx(0.899000002).epsilon(1e-9));

  // Step 2 with g = (0.1, 0.3): bias corrections 1 - b^2.
  gp[0] = 0.1, gp[1] = 0.3;
  const double m0[2] = {mp[0], mp[1]}, v0[2] = {vp[0], vp[1]}, p0[2] = {pp[0], pp[1]};
  adamw_update(p, m, v, g, Tensor{}, {lr, b1, b2, eps, wd, 2});
  for (int i = 0; i < 2; ++i) {
    const double mi = 0.9 * m0[i] + 0.1 * gp[i], vi = 0.999 * v0[i] + 0.001 * gp[i] * gp[i];
    const double mhat = mi / (1 - 0.81), vhat = vi / (1 - 0.999 * 0.999);
    CHECK(mp[i] == doctest::Approx(mi).epsilon(1e-12));
    CHECK(vp[i] == doctest::Approx(vi).epsilon(1e-12));
    CHECK(pp[i] == doctest::Approx(p0[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * p0[i])).epsilon(1e-12));
  }

  // f32 master with an f64 gradient and a bf16 compute copy: the copy is the rounded f32 master.
  OwnedTensor p32(DType::f32, {2}), m32(DType::f32, {2}), v32(DType::f32, {2}), c16(DType::bf16, {2});
  p32.tensor.ptr<float>()[0] = 1.0f, p32.tensor.ptr<float>()[1] = -2.0f;
  gp[0] = 0.5, gp[1] = -0.25;
  adamw_update(p32, m32, v32, g, c16, {lr, b1, b2, eps, wd, 1});
  CHECK(p32.tensor.ptr<float>()[0] == doctest::Approx(p1_0).epsilon(1e-7));  // f64 arithmetic, one f32 rounding
  CHECK(p32.tensor.ptr<float>()[1] == doctest::Approx(p1_1).epsilon(1e-7));
  for (int i = 0; i < 2; ++i)
    CHECK(c16.tensor.ptr<bf16>()[i].bits == bf16::from_float(p32.tensor.ptr<float>()[i]).bits);

  // Bad hyperparameters and operands are rejected.
  CHECK_THROWS_AS(adamw_update(p, m, v, g, Tensor{}, {lr, b1, b2, eps, wd, 0}), Error);   // step 0
  CHECK_THROWS_AS(adamw_update(p, m, v, g, Tensor{}, {-1.0, b1, b2, eps, wd, 1}), Error); // lr < 0
  OwnedTensor g3(DType::f64, {3});
  CHECK_THROWS_AS(adamw_update(p, m, v, g3, Tensor{}, {lr, b1, b2, eps, wd, 1}), Error);  // shape
  CHECK_THROWS_AS(adamw_update(p, m32, v, g, Tensor{}, {lr, b1, b2, eps, wd, 1}), Error); // moment dtype
}
