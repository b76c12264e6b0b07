// The GPU AdamW update of one tensor (engine/ops/adamw_update.h has the math and the contract; the
// public op checks the operands and dispatches here for device tensors).
//   param, exp_avg, exp_avg_sq, grad  f32 [n];  compute_copy  bf16 [n] or undefined
// Arithmetic is f32: the hyperparameters and the bias corrections 1 - b^t are computed in f64 on
// the host and rounded to f32 once; each element then follows optim/adamw.cpp's formula order
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g;  mhat = m / bc1;  vhat = v / bc2;
//   p = p - lr (mhat / (sqrt(vhat) + eps) + wd p)
// with IEEE sqrtf and division (nvcc may fuse multiply-adds; that is fixed at compile time, so the
// result is still the same bits on every run). The bf16 copy is the updated f32 master rounded to
// nearest even (__float2bfloat16_rn, the same rounding as cw::bf16::from_float).
// One thread per element in a grid-stride loop, no reductions and no atomics: deterministic.
#include "engine/cuda/common.cuh"
#include "engine/cuda/runtime.h"
#include "engine/ops/adamw_update.h"

#include <algorithm>
#include <cmath>

namespace cw::gpu {
namespace {

struct AdamWF32 {
  float b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, lr, wd;
};

__global__ void adamw_kernel(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                             const float* __restrict__ g, __nv_bfloat16* __restrict__ copy, int64_t n, AdamWF32 h) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float gi = g[i];
    const float mi = h.b1 * m[i] + h.one_minus_b1 * gi;
    const float vi = h.b2 * v[i] + h.one_minus_b2 * gi * gi;
    const float pi = p[i];
    const float mhat = mi / h.bc1, vhat = vi / h.bc2;
    const float pn = pi - h.lr * (mhat / (sqrtf(vhat) + h.eps) + h.wd * pi);
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
    if (copy) copy[i] = __float2bfloat16_rn(pn);
  }
}


}  // namespace

void adamw_update(const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad,
                  const Tensor& compute_copy, const AdamWHyper& h) {
  // The public op (engine/ops/adamw_update.cpp) has checked the contract (shapes, the moments in the
  // param's dtype, a bf16 copy, layout, device); this kernel's own limit is f32 master weights and
  // gradients (exp_avg and exp_avg_sq follow the param).
  check_dtype(param, DType::f32, "adamw_update param (the GPU master weights are f32)");
  check_dtype(grad, DType::f32, "adamw_update grad (GPU parameter gradients are f32)");
  const int64_t n = param.numel();
  if (n == 0) return;

  const double t = static_cast<double>(h.step);
  AdamWF32 k;
  k.b1 = static_cast<float>(h.beta1);
  k.one_minus_b1 = static_cast<float>(1.0 - h.beta1);
  k.b2 = static_cast<float>(h.beta2);
  k.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  k.bc1 = static_cast<float>(1.0 - std::pow(h.beta1, t));
  k.bc2 = static_cast<float>(1.0 - std::pow(h.beta2, t));
  k.eps = static_cast<float>(h.eps);
  k.lr = static_cast<float>(h.lr);
  k.wd = static_cast<float>(h.weight_decay);

  const int device = param.device.index;
  DeviceGuard guard(device);
  constexpr int kThreads = 256;
  const unsigned blocks = std::min<unsigned>(blocks_for(n, kThreads), 4096u);
  adamw_kernel<<<blocks, kThreads, 0, current_stream(device)>>>(
      static_cast<float*>(param.data), static_cast<float*>(exp_avg.data), static_cast<float*>(exp_avg_sq.data),
      static_cast<const float*>(grad.data), static_cast<__nv_bfloat16*>(compute_copy.data), n, k);
  CW_KERNEL_CHECK();
}

}  // namespace cw::gpu
