// The MLP's gated units, act(gate) * up: SwiGLU (engine/ops/swiglu.h, act = silu) and GeGLU
// (engine/ops/geglu.h, act = gelu with the tanh approximation). They share their contract and their
// CPU backward, which differ only in the activation's value and slope; the GPU's are one kernel
// template (engine/cuda/elementwise.cu).
#include "engine/ops/geglu.h"
#include "engine/ops/swiglu.h"

#include "engine/ops/cpu_common.h"

#include <cmath>
#include <string>

namespace cw {

namespace {
// The contract, checked once here for every backend: every operand of gate's shape and dtype,
// contiguous, on gate's device. `op` names the unit in the errors ("swiglu", "geglu").
void check_operands(const std::string& op, std::initializer_list<NamedTensor> operands) {
  const Tensor& gate = *operands.begin()->tensor;
  for (const NamedTensor& o : operands) {
    check_same_shape(*o.tensor, gate, o.name, (op + " gate").c_str());
    check_dtype(*o.tensor, gate.dtype, o.name);
  }
  check_packed_same_device(operands);
}

void check_backward_operands(const std::string& op, const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out,
                             const Tensor& gate, const Tensor& up) {
  check_operands(op, {{gate, (op + " gate").c_str()},
                      {up, (op + " up").c_str()},
                      {d_out, (op + " d_out").c_str()},
                      {d_gate, (op + " d_gate").c_str()},
                      {d_up, (op + " d_up").c_str()}});
  CW_CHECK(d_gate.data != d_up.data || d_gate.empty(), "{}_backward: d_gate aliases d_up (they must be different buffers)",
           op);
}

// An activation's value and slope at one element.
template <class T> struct ValueSlope {
  T value, slope;
};

// d_up = d_out act(gate), d_gate = d_out up act'(gate), overwritten or added per `mode`, on the CPU.
// act(x) gives {act(x), act'(x)}; `flops` is the estimate of one element's work that decides threading.
template <class T, class Act>
void cpu_gated_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                        const Tensor& up, GradMode mode, double flops, Act act) {
  const T* g = gate.ptr<T>();
  const T* u = up.ptr<T>();
  const T* dy = d_out.ptr<T>();
  T* dg = d_gate.ptr<T>();
  T* du = d_up.ptr<T>();
  const bool acc = mode == GradMode::accumulate;
#pragma omp parallel for schedule(static) if (cpu::worth_threads(flops * gate.numel()))
  for (int64_t i = 0; i < gate.numel(); ++i) {
    const ValueSlope<T> a = act(g[i]);
    const T dgi = dy[i] * u[i] * a.slope;
    const T dui = dy[i] * a.value;
    dg[i] = acc ? dg[i] + dgi : dgi;
    du[i] = acc ? du[i] + dui : dui;
  }
}

// silu(x) = x sigmoid(x); silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))).
template <class T> ValueSlope<T> silu(T x) {
  const T sig = T(1) / (T(1) + std::exp(-x));
  return {x * sig, sig * (T(1) + x * (T(1) - sig))};
}

// The tanh approximation's constants: sqrt(2/pi) and the cubic term's weight (PyTorch's
// gelu(approximate='tanh'), transformers' gelu_pytorch_tanh).
constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;
constexpr double kCubic = 0.044715;

// gelu(x) = x/2 (1 + tanh(u(x))), u(x) = k0 (x + k1 x^3); its slope by the product rule, tanh' =
// 1 - tanh^2, u' = k0 (1 + 3 k1 x^2).
template <class T> ValueSlope<T> gelu_tanh(T x) {
  const T t = std::tanh(T(kSqrt2OverPi) * (x + T(kCubic) * x * x * x));
  return {T(0.5) * x * (T(1) + t),
          T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(kSqrt2OverPi) * (T(1) + T(3 * kCubic) * x * x)};
}
}  // namespace

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_operands("swiglu", {{gate, "swiglu gate"}, {up, "swiglu up"}, {out, "swiglu out"}});
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
  check_backward_operands("swiglu", d_gate, d_up, d_out, gate, up);
  CW_DISPATCH_GPU(gate, swiglu_backward(d_gate, d_up, d_out, gate, up, mode));
  cpu::dispatch_float(gate.dtype, "swiglu_backward", [&](auto zero) {
    using T = decltype(zero);
    cpu_gated_backward<T>(d_gate, d_up, d_out, gate, up, mode, 20.0, silu<T>);
  });
}

void geglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_operands("geglu", {{gate, "geglu gate"}, {up, "geglu up"}, {out, "geglu out"}});
  CW_DISPATCH_GPU(gate, geglu_forward(out, gate, up));
  cpu::dispatch_float(gate.dtype, "geglu_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    T* y = out.ptr<T>();
#pragma omp parallel for schedule(static) if (cpu::worth_threads(20.0 * gate.numel()))
    for (int64_t i = 0; i < gate.numel(); ++i) y[i] = gelu_tanh(g[i]).value * u[i];
  });
}

void geglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                    const Tensor& up, GradMode mode) {
  check_backward_operands("geglu", d_gate, d_up, d_out, gate, up);
  CW_DISPATCH_GPU(gate, geglu_backward(d_gate, d_up, d_out, gate, up, mode));
  cpu::dispatch_float(gate.dtype, "geglu_backward", [&](auto zero) {
    using T = decltype(zero);
    cpu_gated_backward<T>(d_gate, d_up, d_out, gate, up, mode, 30.0, gelu_tanh<T>);
  });
}

}  // namespace cw
