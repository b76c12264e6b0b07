// Finite-difference gradient checks for single ops in f64.
//
// The loss is L = <R, out> for a fixed random R (so d_out = R). For every element of every checked
// input, the derivative is estimated with the fourth-order central stencil
//   (-L(x + 2h) + 8 L(x + h) - 8 L(x - h) + L(x - 2h)) / 12h
// and the analytic gradient must agree to kFiniteDifferenceTol in relative L2 norm per input.
#pragma once

#include "tests/support.h"

#include <functional>
#include <vector>

namespace cw::test {

struct Checked {
  const char* name;
  Tensor input;     // f64, contiguous; perturbed in place
  Tensor analytic;  // its analytic gradient (same shape)
};

inline double inner(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.ptr<double>()[i] * b.ptr<double>()[i];
  return s;
}

// loss(): recomputes the forward from the current inputs and returns L.
inline void check_gradients(const std::vector<Checked>& inputs, const std::function<double()>& loss, double h = 1e-3) {
  for (const Checked& c : inputs) {
    OwnedTensor numeric = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>(c.input.shape.begin(), c.input.shape.begin() + c.input.ndim));
    double* x = c.input.ptr<double>();
    for (int64_t i = 0; i < c.input.numel(); ++i) {
      const double x0 = x[i];
      auto at = [&](double d) {
        x[i] = x0 + d;
        return loss();
      };
      numeric.tensor.ptr<double>()[i] = (-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h);
      x[i] = x0;
    }
    const Worst w = compare(c.analytic, numeric);
    INFO(c.name, ": ", w.str());
    CHECK(w.rel <= kFiniteDifferenceTol);
  }
}

inline OwnedTensor randn(std::initializer_list<int64_t> shape, uint64_t stream, double std = 1.0, double mean = 0.0) {
  OwnedTensor t(DType::f64, shape);
  fill_normal(t, 2024, stream, mean, std);
  return t;
}

}  // namespace cw::test
