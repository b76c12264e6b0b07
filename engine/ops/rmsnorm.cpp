#include "engine/ops/rmsnorm.h"

#include "engine/ops/cpu_common.h"

#include <cmath>

namespace cw {

// The contract (engine/ops/rmsnorm.h), checked once here for every backend.
namespace {
void check_forward_operands(const Tensor& out, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight,
                            const char* what_out) {
  CW_CHECK(x.ndim == 2, "rmsnorm x must be [N, C], got {}", x.describe());
  const int64_t N = x.size(0), C = x.size(1);
  check_shape(out, {N, C}, what_out);
  check_shape(weight, {C}, "rmsnorm weight");
  check_shape(saved.rstd, {N}, "rmsnorm saved rstd");
  check_dtype(out, x.dtype, what_out);
  check_dtype(weight, x.dtype, "rmsnorm weight");
  check_dtype(saved.rstd, accum_dtype(x.dtype), "rmsnorm saved rstd");
  check_packed_same_device({{x, "rmsnorm x"}, {out, what_out}, {weight, "rmsnorm weight"}, {saved.rstd, "rmsnorm saved rstd"}});
}
}  // namespace

void rmsnorm_forward(const Tensor& out, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight, double eps,
                     double weight_offset) {
  check_forward_operands(out, saved, x, weight, "rmsnorm out");
  CW_CHECK(out.data != x.data || out.empty(), "rmsnorm_forward: out must not alias x (the backward reads x)");
  CW_DISPATCH_GPU(x, rmsnorm_forward(out, saved, x, weight, eps, weight_offset));
  cpu::dispatch_float(x.dtype, "rmsnorm_forward", [&](auto zero) {
    using T = decltype(zero);
    const int64_t N = x.size(0), C = x.size(1);
    const T* xp = x.ptr<T>();
    const T* w = weight.ptr<T>();
    T* y = out.ptr<T>();
    T* rstd = saved.rstd.ptr<T>();
    const T o = T(weight_offset);
    for (int64_t n = 0; n < N; ++n) {
      const T* row = xp + n * C;
      T sum_sq = 0;
      for (int64_t c = 0; c < C; ++c) sum_sq += row[c] * row[c];
      const T r = T(1) / std::sqrt(sum_sq / T(C) + T(eps));
      rstd[n] = r;
      for (int64_t c = 0; c < C; ++c) y[n * C + c] = row[c] * r * (o + w[c]);
    }
  });
}

void rmsnorm_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const RmsNormSaved& saved,
                      const Tensor& x, const Tensor& weight, GradMode mode, Arena& scratch, double weight_offset) {
  check_forward_operands(d_x, saved, x, weight, "rmsnorm d_x");
  check_same_shape(d_out, x, "rmsnorm d_out", "rmsnorm x");
  check_dtype(d_out, x.dtype, "rmsnorm d_out");
  if (d_weight.data) {
    check_same_shape(d_weight, weight, "rmsnorm d_weight", "rmsnorm weight");
    check_dtype(d_weight, accum_dtype(x.dtype), "rmsnorm d_weight");
  }
  check_packed_same_device({{x, "rmsnorm x"}, {d_out, "rmsnorm d_out"}, NamedTensor::optional(d_weight, "rmsnorm d_weight")});
  CW_CHECK(scratch.device() == x.device, "rmsnorm_backward: the scratch arena is on {} but x is on {}",
           device_name(scratch.device()), device_name(x.device));
  CW_DISPATCH_GPU(x, rmsnorm_backward(d_x, d_weight, d_out, saved, x, weight, mode, scratch, weight_offset));
  // The CPU needs no scratch. d_x may alias d_out: each element of d_out is read before its d_x is written.
  cpu::dispatch_float(x.dtype, "rmsnorm_backward", [&](auto zero) {
    using T = decltype(zero);
    const int64_t N = x.size(0), C = x.size(1);
    const T* xp = x.ptr<T>();
    const T* w = weight.ptr<T>();
    const T* dy = d_out.ptr<T>();
    const T* rstd = saved.rstd.ptr<T>();
    T* dx = d_x.ptr<T>();
    T* dw = d_weight.data ? d_weight.ptr<T>() : nullptr;
    const T o = T(weight_offset);
    for (int64_t n = 0; n < N; ++n) {
      const T r = rstd[n];
      const T* xr = xp + n * C;
      const T* dyr = dy + n * C;
      // mean_c(g * xhat), the projection of g onto xhat that normalisation removes
      T dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += dyr[c] * (o + w[c]) * xr[c] * r;
      const T mean_dot = dot / T(C);
      T* dxr = dx + n * C;
      for (int64_t c = 0; c < C; ++c) {
        const T xhat = xr[c] * r, dy_c = dyr[c];
        const T g = r * (dy_c * (o + w[c]) - xhat * mean_dot);
        if (dw) dw[c] += dy_c * xhat;
        dxr[c] = (mode == GradMode::accumulate ? dxr[c] : T(0)) + g;
      }
    }
  });
}

}  // namespace cw
