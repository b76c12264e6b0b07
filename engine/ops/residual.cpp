#include "engine/ops/residual.h"

#include "engine/ops/cpu_common.h"

namespace cw {

namespace {
// The contract (engine/ops/residual.h), checked once here for every backend: dst (op)= src (+ src2),
// every operand of src's shape, contiguous, on src's device; dst of src's dtype, or of
// accum_dtype(src.dtype) where `accum_dst` (a gradient summed in f32); src2 of src's dtype.
void check_add(NamedTensor dst, NamedTensor src, NamedTensor src2, bool accum_dst) {
  const Tensor& d = *dst.tensor;
  const Tensor& s = *src.tensor;
  check_same_shape(d, s, dst.name, src.name);
  CW_CHECK(d.dtype == s.dtype || (accum_dst && d.dtype == accum_dtype(s.dtype)),
           "{} has dtype {} with {} {} (allowed: the same dtype{})", dst.name, dtype_name(d.dtype), src.name,
           dtype_name(s.dtype), accum_dst ? fmt::format(", or {}", dtype_name(accum_dtype(s.dtype))) : "");
  if (src2.tensor != nullptr) {
    check_same_shape(*src2.tensor, s, src2.name, src.name);
    check_dtype(*src2.tensor, s.dtype, src2.name);
  }
  check_packed_same_device({src, dst, src2});
}

// CPU: dst = (acc ? dst : 0) + a (+ b when given), in a's dtype (the CPU's accum_dtype is the dtype itself).
void add(const Tensor& dst, bool acc, const Tensor& a, const Tensor* b, const char* op) {
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
  check_add({out, "residual out"}, {x, "residual x"}, {delta, "residual delta"}, false);
  CW_DISPATCH_GPU(x, residual_forward(out, x, delta));
  add(out, false, x, &delta, "residual_forward");
}

void residual_backward(const Tensor& d_x, GradMode mode_x, const Tensor& d_delta, GradMode mode_delta,
                       const Tensor& d_out) {
  // d_x aliasing d_out: the stream's gradient buffer is passed straight through, nothing to write.
  const bool pass_through = d_x.data == d_out.data;
  CW_CHECK(!pass_through || mode_x == GradMode::overwrite,
           "residual_backward: d_x aliases d_out, so it cannot also accumulate");
  check_add({d_x, "residual d_x"}, {d_out, "residual d_out"}, NamedTensor::optional(d_delta, "residual d_delta"), false);
  CW_DISPATCH_GPU(d_out, residual_backward(d_x, mode_x, d_delta, mode_delta, d_out));
  if (!pass_through) add(d_x, mode_x == GradMode::accumulate, d_out, nullptr, "residual_backward d_x");
  if (d_delta.data) add(d_delta, mode_delta == GradMode::accumulate, d_out, nullptr, "residual_backward d_delta");
}

void accumulate(const Tensor& dst, const Tensor& src) {
  check_add({dst, "accumulate dst"}, {src, "accumulate src"}, {nullptr, ""}, true);
  CW_DISPATCH_GPU(dst, accumulate(dst, src));
  add(dst, true, src, nullptr, "accumulate");
}

}  // namespace cw
