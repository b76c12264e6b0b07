// Finite differences for the fp64 gradient checks (the CPU runner of tests/engine/test_backend_ops.cpp).
//
// The loss is L = sum_o <R_o, out_o> for fixed random R_o (so d_out_o = R_o). For every element of
// every checked input, the derivative is estimated with the fourth-order central stencil
//   (-L(x + 2h) + 8 L(x + h) - 8 L(x - h) + L(x - 2h)) / 12h
// and the analytic gradient must agree to kFiniteDifferenceTol in relative L2 norm per input.
#pragma once

#include "engine/random.h"
#include "tests/support.h"

#include <functional>
#include <vector>

namespace cw::test {

// dL/dx[offsets[k]] for every k, by the stencil above; x[offsets[k]] is perturbed in place and
// restored. loss() recomputes the forward from the current inputs and returns L.
inline std::vector<double> numeric_gradient(double* x, const std::vector<int64_t>& offsets,
                                            const std::function<double()>& loss, double h = 1e-3) {
  std::vector<double> g;
  g.reserve(offsets.size());
  for (const int64_t i : offsets) {
    const double x0 = x[i];
    auto at = [&](double d) {
      x[i] = x0 + d;
      return loss();
    };
    g.push_back((-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h));
    x[i] = x0;
  }
  return g;
}

// <a, b> of two contiguous f64 tensors of one size.
inline double inner(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.ptr<double>()[i] * b.ptr<double>()[i];
  return s;
}

inline OwnedTensor randn(std::initializer_list<int64_t> shape, uint64_t stream, double std = 1.0, double mean = 0.0) {
  OwnedTensor t(DType::f64, shape);
  fill_normal(t, 2024, stream, mean, std);
  return t;
}

}  // namespace cw::test
