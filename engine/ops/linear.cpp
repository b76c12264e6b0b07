#include "engine/ops/linear.h"

#include "engine/ops/cpu_common.h"

namespace cw {

// The contract (engine/ops/linear.h), checked once here for every backend. `y` is out or d_out.
namespace {
void check_operands(const Tensor& x, const Tensor& w, const Tensor& y, const char* what_y) {
  CW_CHECK(x.ndim == 2, "linear x must be [N, I], got {}", x.describe());
  CW_CHECK(w.ndim == 2, "linear weight must be [O, I], got {}", w.describe());
  const int64_t N = x.size(0), I = x.size(1), O = w.size(0);
  check_shape(w, {O, I}, "linear weight");
  check_shape(y, {N, O}, what_y);
  check_dtype(w, x.dtype, "linear weight");
  check_dtype(y, x.dtype, what_y);
  check_packed_same_device({{x, "linear x"}, {w, "linear weight"}, {y, what_y}});
}

// A product's output must not be one of its inputs (the GEMM would read what it has written).
void check_not_aliased(const Tensor& written, const Tensor& read, const char* what) {
  CW_CHECK(written.data != read.data || written.empty(), "linear: {} (a GEMM cannot write one of its inputs)", what);
}
}  // namespace

void linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight) {
  check_operands(x, weight, out, "linear out");
  check_not_aliased(out, x, "out must not alias x");
  check_not_aliased(out, weight, "out must not alias weight");
  CW_DISPATCH_GPU(x, linear_forward(out, x, weight));
  cpu::dispatch_float(x.dtype, "linear_forward", [&](auto zero) {
    using T = decltype(zero);
    cpu::matrix<T>(out).noalias() = cpu::cmatrix<T>(x) * cpu::cmatrix<T>(weight).transpose();
  });
}

void linear_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const Tensor& x_given,
                     const Tensor& weight, GradMode mode) {
  // Without d_weight the input is not read: d_x stands in for its shape, dtype and device.
  CW_CHECK(x_given.data || !d_weight.data, "linear backward: d_weight needs the input x, which is undefined");
  if (!x_given.data && !d_x.data) return;
  const Tensor& x = x_given.data ? x_given : d_x;
  check_operands(x, weight, d_out, "linear d_out");
  if (d_x.data) {
    check_same_shape(d_x, x, "linear d_x", "linear x");
    check_dtype(d_x, x.dtype, "linear d_x");
    check_not_aliased(d_x, d_out, "d_x must not alias d_out");
    check_not_aliased(d_x, weight, "d_x must not alias weight");
    if (x_given.data)
      check_not_aliased(d_x, x, "d_x must not alias x (the d_weight product reads x after d_x is written)");
  }
  if (d_weight.data) {
    check_same_shape(d_weight, weight, "linear d_weight", "linear weight");
    check_dtype(d_weight, accum_dtype(x.dtype), "linear d_weight");
  }
  check_packed_same_device({{x, "linear x"}, NamedTensor::optional(d_x, "linear d_x"),
                            NamedTensor::optional(d_weight, "linear d_weight")});
  CW_DISPATCH_GPU(x, linear_backward(d_x, d_weight, d_out, x, weight, mode));
  cpu::dispatch_float(x.dtype, "linear_backward", [&](auto zero) {
    using T = decltype(zero);
    const auto dy = cpu::cmatrix<T>(d_out);
    if (d_x.data) {
      auto dx = cpu::matrix<T>(d_x);
      if (mode == GradMode::accumulate)
        dx.noalias() += dy * cpu::cmatrix<T>(weight);
      else
        dx.noalias() = dy * cpu::cmatrix<T>(weight);
    }
    if (d_weight.data) {
      cpu::matrix<T>(d_weight).noalias() += dy.transpose() * cpu::cmatrix<T>(x);
    }
  });
}

}  // namespace cw
