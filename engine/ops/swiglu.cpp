#include "engine/ops/swiglu.h"

#include "engine/ops/cpu_common.h"

#include <cmath>

namespace cw {

// The contract (engine/ops/swiglu.h), checked once here for every backend: every operand of gate's
// shape and dtype, contiguous, on gate's device.
namespace {
void check_operands(std::initializer_list<NamedTensor> operands) {
  const Tensor& gate = *operands.begin()->tensor;
  for (const NamedTensor& o : operands) {
    check_same_shape(*o.tensor, gate, o.name, "swiglu gate");
    check_dtype(*o.tensor, gate.dtype, o.name);
  }
  check_packed_same_device(operands);
}
}  // namespace

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_operands({{gate, "swiglu gate"}, {up, "swiglu up"}, {out, "swiglu out"}});
  CW_DISPATCH_GPU(gate, swiglu_forward(out, gate, up));
  cpu::dispatch_float(gate.dtype, "swiglu_forward", [&](auto zero) {
    using T = decltype(zero);
    using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
    const Eigen::Map<const Array> g(gate.ptr<T>(), gate.numel()), u(up.ptr<T>(), up.numel());
    Eigen::Map<Array>(out.ptr<T>(), out.numel()) = g / (T(1) + (-g).exp()) * u;  // vectorised exp
  });
}

void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                     const Tensor& up, GradMode mode) {
  check_operands({{gate, "swiglu gate"}, {up, "swiglu up"}, {d_out, "swiglu d_out"}, {d_gate, "swiglu d_gate"},
                  {d_up, "swiglu d_up"}});
  CW_CHECK(d_gate.data != d_up.data || d_gate.empty(),
           "swiglu_backward: d_gate aliases d_up (they must be different buffers)");
  CW_DISPATCH_GPU(gate, swiglu_backward(d_gate, d_up, d_out, gate, up, mode));
  cpu::dispatch_float(gate.dtype, "swiglu_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    const T* dy = d_out.ptr<T>();
    T* dg = d_gate.ptr<T>();
    T* du = d_up.ptr<T>();
    const bool acc = mode == GradMode::accumulate;
#pragma omp parallel for schedule(static) if (cpu::worth_threads(20.0 * gate.numel()))
    for (int64_t i = 0; i < gate.numel(); ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      const T silu = g[i] * sig;
      const T dgi = dy[i] * u[i] * sig * (T(1) + g[i] * (T(1) - sig));
      const T dui = dy[i] * silu;
      dg[i] = acc ? dg[i] + dgi : dgi;
      du[i] = acc ? du[i] + dui : dui;
    }
  });
}

}  // namespace cw
