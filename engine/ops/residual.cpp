#include "engine/ops/residual.h"

#include "engine/ops/cpu_common.h"

namespace cw {

namespace {
// dst = (acc ? dst : 0) + a (+ b when given); all contiguous, same shape and dtype.
void add(const Tensor& dst, bool acc, const Tensor& a, const Tensor* b, const char* op) {
  check_same_shape(dst, a, op, "operand");
  check_dtype(dst, a.dtype, op);
  check_contiguous(dst, op);
  check_contiguous(a, op);
  cpu::check_cpu(dst, op);
  cpu::check_cpu(a, op);
  if (b) {
    check_same_shape(*b, a, op, "operand");
    check_dtype(*b, a.dtype, op);
    check_contiguous(*b, op);
  }
  cpu::dispatch_float(a.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    T* y = dst.ptr<T>();
    const T* pa = a.ptr<T>();
    const T* pb = b ? b->ptr<T>() : nullptr;
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; ++i) y[i] = (acc ? y[i] : T(0)) + pa[i] + (pb ? pb[i] : T(0));
  });
}
}  // namespace

void residual_forward(const Tensor& out, const Tensor& x, const Tensor& delta) {
  CW_DISPATCH_GPU(x, residual_forward(out, x, delta));
  add(out, false, x, &delta, "residual_forward");
}

void residual_backward(const Tensor& d_x, GradMode mode_x, const Tensor& d_delta, GradMode mode_delta,
                       const Tensor& d_out) {
  CW_DISPATCH_GPU(d_out, residual_backward(d_x, mode_x, d_delta, mode_delta, d_out));
  if (d_x.data == d_out.data) {
    // The stream's gradient buffer is passed straight through: nothing to write.
    CW_CHECK(mode_x == GradMode::overwrite, "residual_backward: d_x aliases d_out, so it cannot also accumulate");
  } else {
    add(d_x, mode_x == GradMode::accumulate, d_out, nullptr, "residual_backward d_x");
  }
  if (d_delta.data) add(d_delta, mode_delta == GradMode::accumulate, d_out, nullptr, "residual_backward d_delta");
}

void accumulate(const Tensor& dst, const Tensor& src) {
  CW_DISPATCH_GPU(dst, accumulate(dst, src));
  add(dst, true, src, nullptr, "accumulate");
}

}  // namespace cw
