#include "engine/ops/bias.h"

#include "engine/ops/cpu_common.h"

namespace cw {

// The contract (engine/ops/bias.h), checked once here for every backend.
void bias_forward(const Tensor& out, const Tensor& x, const Tensor& bias) {
  CW_CHECK(x.ndim == 2, "bias x must be [N, O], got {}", x.describe());
  const int64_t N = x.size(0), O = x.size(1);
  check_shape(out, {N, O}, "bias out");
  check_shape(bias, {O}, "bias b");
  check_dtype(out, x.dtype, "bias out");
  check_dtype(bias, x.dtype, "bias b");
  check_packed_same_device({{x, "bias x"}, {out, "bias out"}, {bias, "bias b"}});
  CW_DISPATCH_GPU(x, bias_forward(out, x, bias));
  cpu::dispatch_float(x.dtype, "bias_forward", [&](auto zero) {
    using T = decltype(zero);
    // Row by row, each element read before it is written: out may alias x.
    const T* b = bias.ptr<T>();
    for (int64_t n = 0; n < N; ++n) {
      const T* xr = x.ptr<T>() + n * O;
      T* yr = out.ptr<T>() + n * O;
      for (int64_t o = 0; o < O; ++o) yr[o] = xr[o] + b[o];
    }
  });
}

void bias_backward(const Tensor& d_bias, const Tensor& d_out, Arena& scratch) {
  CW_CHECK(d_out.ndim == 2, "bias d_out must be [N, O], got {}", d_out.describe());
  check_shape(d_bias, {d_out.size(1)}, "bias d_b");
  check_dtype(d_bias, accum_dtype(d_out.dtype), "bias d_b");
  check_packed_same_device({{d_out, "bias d_out"}, {d_bias, "bias d_b"}});
  CW_CHECK(scratch.device() == d_out.device, "bias_backward: the scratch arena is on {} but d_out is on {}",
           device_name(scratch.device()), device_name(d_out.device));
  CW_DISPATCH_GPU(d_out, bias_backward(d_bias, d_out, scratch));
  cpu::dispatch_float(d_out.dtype, "bias_backward", [&](auto zero) {
    using T = decltype(zero);
    // Rows summed in order, into the gradient's own accumulation.
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(d_bias.ptr<T>(), d_out.size(1)) +=
        cpu::cmatrix<T>(d_out).colwise().sum();
  });
}

}  // namespace cw
