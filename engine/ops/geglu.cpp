#include "engine/ops/geglu.h"

#include "engine/ops/cpu_common.h"

#include <cmath>

namespace cw {

// The contract (engine/ops/geglu.h), checked once here for every backend: every operand of gate's
// shape and dtype, contiguous, on gate's device.
namespace {
void check_operands(std::initializer_list<NamedTensor> operands) {
  const Tensor& gate = *operands.begin()->tensor;
  for (const NamedTensor& o : operands) {
    check_same_shape(*o.tensor, gate, o.name, "geglu gate");
    check_dtype(*o.tensor, gate.dtype, o.name);
  }
  check_packed_same_device(operands);
}

// The tanh approximation's constants: sqrt(2/pi) and the cubic term's weight (PyTorch's
// gelu(approximate='tanh'), transformers' gelu_pytorch_tanh).
constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;
constexpr double kCubic = 0.044715;
}  // namespace

void geglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_operands({{gate, "geglu gate"}, {up, "geglu up"}, {out, "geglu out"}});
  CW_DISPATCH_GPU(gate, geglu_forward(out, gate, up));
  cpu::dispatch_float(gate.dtype, "geglu_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    T* y = out.ptr<T>();
#pragma omp parallel for schedule(static) if (cpu::worth_threads(20.0 * gate.numel()))
    for (int64_t i = 0; i < gate.numel(); ++i) {
      const T t = std::tanh(T(kSqrt2OverPi) * (g[i] + T(kCubic) * g[i] * g[i] * g[i]));
      y[i] = T(0.5) * g[i] * (T(1) + t) * u[i];
    }
  });
}

void geglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                    const Tensor& up, GradMode mode) {
  check_operands({{gate, "geglu gate"}, {up, "geglu up"}, {d_out, "geglu d_out"}, {d_gate, "geglu d_gate"},
                  {d_up, "geglu d_up"}});
  CW_CHECK(d_gate.data != d_up.data || d_gate.empty(),
           "geglu_backward: d_gate aliases d_up (they must be different buffers)");
  CW_DISPATCH_GPU(gate, geglu_backward(d_gate, d_up, d_out, gate, up, mode));
  cpu::dispatch_float(gate.dtype, "geglu_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    const T* dy = d_out.ptr<T>();
    T* dg = d_gate.ptr<T>();
    T* du = d_up.ptr<T>();
    const bool acc = mode == GradMode::accumulate;
#pragma omp parallel for schedule(static) if (cpu::worth_threads(30.0 * gate.numel()))
    for (int64_t i = 0; i < gate.numel(); ++i) {
      const T x = g[i], t = std::tanh(T(kSqrt2OverPi) * (x + T(kCubic) * x * x * x));
      const T gelu = T(0.5) * x * (T(1) + t);
      // d/dx of x/2 (1 + tanh(u(x))): the product rule, tanh' = 1 - tanh^2, u' = k0 (1 + 3 k1 x^2).
      const T slope = T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(kSqrt2OverPi) * (T(1) + T(3 * kCubic) * x * x);
      const T dgi = dy[i] * u[i] * slope;
      const T dui = dy[i] * gelu;
      dg[i] = acc ? dg[i] + dgi : dgi;
      du[i] = acc ? du[i] + dui : dui;
    }
  });
}

}  // namespace cw
