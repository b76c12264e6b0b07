#include "engine/ops/linear.h"

#include "engine/ops/cpu_common.h"

namespace cw {

namespace {
void check_operands(const Tensor& x, const Tensor& w, const Tensor& y, const char* what_y) {
  const int64_t N = x.size(0), I = x.size(1), O = w.size(0);
  check_shape(x, {N, I}, "linear x");
  check_shape(w, {O, I}, "linear weight");
  check_shape(y, {N, O}, what_y);
  for (const Tensor* t : {&x, &w, &y}) {
    check_contiguous(*t, "linear operand");
    cpu::check_cpu(*t, "linear operand");
    check_dtype(*t, x.dtype, "linear operand");
  }
}
}  // namespace

void linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight) {
  CW_DISPATCH_GPU(x, linear_forward(out, x, weight));
  check_operands(x, weight, out, "linear out");
  cpu::dispatch_float(x.dtype, "linear_forward", [&](auto zero) {
    using T = decltype(zero);
    cpu::matrix<T>(out).noalias() = cpu::cmatrix<T>(x) * cpu::cmatrix<T>(weight).transpose();
  });
}

void linear_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const Tensor& x,
                     const Tensor& weight, GradMode mode) {
  CW_DISPATCH_GPU(x, linear_backward(d_x, d_weight, d_out, x, weight, mode));
  check_operands(x, weight, d_out, "linear d_out");
  if (d_x.data) check_same_shape(d_x, x, "linear d_x", "linear x");
  if (d_weight.data) check_same_shape(d_weight, weight, "linear d_weight", "linear weight");
  cpu::dispatch_float(x.dtype, "linear_backward", [&](auto zero) {
    using T = decltype(zero);
    const auto dy = cpu::cmatrix<T>(d_out);
    if (d_x.data) {
      check_dtype(d_x, x.dtype, "linear d_x");
      auto dx = cpu::matrix<T>(d_x);
      if (mode == GradMode::accumulate)
        dx.noalias() += dy * cpu::cmatrix<T>(weight);
      else
        dx.noalias() = dy * cpu::cmatrix<T>(weight);
    }
    if (d_weight.data) {
      check_dtype(d_weight, x.dtype, "linear d_weight");
      cpu::matrix<T>(d_weight).noalias() += dy.transpose() * cpu::cmatrix<T>(x);
    }
  });
}

}  // namespace cw
