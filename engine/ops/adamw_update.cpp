#include "engine/ops/adamw_update.h"

#include "chunkwise_config.h"
#include "engine/ops/cpu_common.h"

#include <cmath>

#if CW_HAVE_CUDA
namespace cw::gpu {
// engine/cuda/adamw.cu: the f32 kernel (param, moments and grad f32; compute_copy bf16 or undefined).
void adamw_update(const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad,
                  const Tensor& compute_copy, const AdamWHyper& h);
}  // namespace cw::gpu
#endif

namespace cw {
namespace {

void check_hyper(const AdamWHyper& h) {
  const auto in_unit = [](double b) { return std::isfinite(b) && b >= 0.0 && b < 1.0; };
  CW_CHECK(std::isfinite(h.lr) && h.lr >= 0.0, "adamw_update: learning rate {} must be finite and >= 0", h.lr);
  CW_CHECK(in_unit(h.beta1), "adamw_update: beta1 = {} is not in [0, 1)", h.beta1);
  CW_CHECK(in_unit(h.beta2), "adamw_update: beta2 = {} is not in [0, 1)", h.beta2);
  CW_CHECK(std::isfinite(h.eps) && h.eps > 0.0, "adamw_update: eps = {} must be positive", h.eps);
  CW_CHECK(std::isfinite(h.weight_decay) && h.weight_decay >= 0.0, "adamw_update: weight_decay = {} must be >= 0",
           h.weight_decay);
  CW_CHECK(h.step >= 1, "adamw_update: step = {} must be >= 1 (the number of the step being taken)", h.step);
}

// The update of one tensor: optim/adamw.cpp's loop, element for element and in the same order.
// P is the parameter/state type, G the gradient type. The operands never overlap (restrict) and
// nothing branches, so the compiler vectorises it (the project builds with -fno-math-errno, which
// lets sqrt vectorise; IEEE division and square root round the same either way).
template <class P, class G>
void update(P* __restrict p, P* __restrict m, P* __restrict v, const G* __restrict g, int64_t n, double b1, double b2,
            double bc1, double bc2, double eps, double lr, double wd) {
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]);
    const double mi = b1 * static_cast<double>(m[i]) + (1.0 - b1) * gi;
    const double vi = b2 * static_cast<double>(v[i]) + (1.0 - b2) * gi * gi;
    const double pi = static_cast<double>(p[i]);
    const double mhat = mi / bc1, vhat = vi / bc2;
    m[i] = static_cast<P>(mi);
    v[i] = static_cast<P>(vi);
    p[i] = static_cast<P>(pi - lr * (mhat / (std::sqrt(vhat) + eps) + wd * pi));
  }
}

// copy = bf16(p) (from f64 via f32, as copy_convert rounds), as a second pass without branches.
template <class P>
void round_to_bf16(const P* __restrict p, bf16* __restrict copy, int64_t n) {
  for (int64_t i = 0; i < n; ++i) copy[i] = bf16::from_float(static_cast<float>(p[i]));
}

template <class P>
void update_cpu(const Tensor& p, const Tensor& m, const Tensor& v, const Tensor& g, const Tensor& copy,
                const AdamWHyper& h) {
  const double b1 = h.beta1, b2 = h.beta2;
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
  if (g.dtype == DType::f64)
    update(p.ptr<P>(), m.ptr<P>(), v.ptr<P>(), g.ptr<double>(), p.numel(), b1, b2, bc1, bc2, h.eps, h.lr,
           h.weight_decay);
  else
    update(p.ptr<P>(), m.ptr<P>(), v.ptr<P>(), g.ptr<float>(), p.numel(), b1, b2, bc1, bc2, h.eps, h.lr,
           h.weight_decay);
  if (copy.data) round_to_bf16(p.ptr<P>(), copy.ptr<bf16>(), p.numel());
}

}  // namespace

void adamw_update(const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad,
                  const Tensor& compute_copy, const AdamWHyper& h) {
  // The contract (engine/ops/adamw_update.h), checked once here for every backend; the dtypes each
  // backend implements are its own (below for the CPU, engine/cuda/adamw.cu for the GPU).
  check_hyper(h);
  check_same_shape(exp_avg, param, "adamw_update exp_avg", "adamw_update param");
  check_same_shape(exp_avg_sq, param, "adamw_update exp_avg_sq", "adamw_update param");
  check_same_shape(grad, param, "adamw_update grad", "adamw_update param");
  check_dtype(exp_avg, param.dtype, "adamw_update exp_avg");
  check_dtype(exp_avg_sq, param.dtype, "adamw_update exp_avg_sq");
  if (compute_copy.data) {
    check_same_shape(compute_copy, param, "adamw_update compute_copy", "adamw_update param");
    check_dtype(compute_copy, DType::bf16, "adamw_update compute_copy");
  }
  check_packed_same_device({{param, "adamw_update param"}, {exp_avg, "adamw_update exp_avg"},
                            {exp_avg_sq, "adamw_update exp_avg_sq"}, {grad, "adamw_update grad"},
                            NamedTensor::optional(compute_copy, "adamw_update compute_copy")});
  if (param.numel() == 0) return;

  if (!param.device.is_cpu()) {
#if CW_HAVE_CUDA
    gpu::adamw_update(param, exp_avg, exp_avg_sq, grad, compute_copy, h);
    return;
#else
    fail(fmt::format("adamw_update: param is on {} but this build has no CUDA", device_name(param.device)),
         "rebuild with CUDA, or keep the optimizer state on the CPU");
#endif
  }

  CW_CHECK(param.dtype == DType::f32 || param.dtype == DType::f64, "adamw_update: param must be f32 or f64, got {}",
           dtype_name(param.dtype));
  CW_CHECK(grad.dtype == DType::f32 || grad.dtype == DType::f64, "adamw_update: grad must be f32 or f64, got {}",
           dtype_name(grad.dtype));
  if (param.dtype == DType::f64)
    update_cpu<double>(param, exp_avg, exp_avg_sq, grad, compute_copy, h);
  else
    update_cpu<float>(param, exp_avg, exp_avg_sq, grad, compute_copy, h);
}

}  // namespace cw
