// One AdamW step on one tensor, as an engine op (the GPU optimizer's per-tensor update; the math is
// optim/adamw.h's). For every element i, at step t = h.step (t >= 1, the step being taken):
//   m     = b1 m + (1 - b1) g
//   v     = b2 v + (1 - b2) g^2
//   mhat  = m / (1 - b1^t)                 bias correction: m and v start at 0
//   vhat  = v / (1 - b2^t)
//   p     = p - lr (mhat / (sqrt(vhat) + eps) + wd p)
// Decoupled weight decay: wd uses p before the update and is not fed through m and v. The caller
// passes weight_decay = 0 for tensors that are not decayed (norm gains, embeddings by default).
//
// Shapes and dtypes (all the same shape, contiguous, on one device):
//   param       the master weights, updated in place: f32 or f64 on the CPU, f32 on the GPU
//   exp_avg     m, exp_avg_sq  v: the param's dtype, updated in place
//   grad        f32 or f64 on the CPU (may differ from the param's dtype); f32 on the GPU
//   compute_copy  bf16, or undefined (Tensor{}): when given, receives the updated param rounded to
//               bf16 (nearest even), i.e. the GPU's compute weights (from an f64 param via f32, as
//               copy_convert rounds)
//
// CPU: one loop (vectorised; no threads: callers split a large vector, optim/adamw_offload.h),
// arithmetic in f64 in exactly optim/adamw.cpp's order, each result rounded once to the state dtype:
// the same inputs give the same bits as AdamW::step.
// GPU (engine/cuda/adamw.cu): the same formula in f32 arithmetic (hyperparameters and the bias
// corrections are computed in f64 on the host and rounded to f32), one element per thread in a
// grid-stride loop; no reductions, so it is deterministic. It agrees with the CPU op to f32 rounding
// (tests/engine/test_cuda_linear.cpp).
#pragma once

#include "engine/tensor.h"

#include <cstdint>

namespace cw {

struct AdamWHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;  // t >= 1: the number of this step (1 for the first)
};

// Checks the hyperparameters (finite lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0, step >= 1)
// and the operands, then updates param, exp_avg, exp_avg_sq (and compute_copy) in place.
void adamw_update(const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad,
                  const Tensor& compute_copy, const AdamWHyper& h);

}  // namespace cw
