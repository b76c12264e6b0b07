// Linear map without bias, weights stored [out, in] as in HF: y = x Wᵀ.
//   forward:  out[n, o] = sum_i x[n, i] * W[o, i]
//   backward: d_x = d_out W            (overwrite or accumulate)
//             d_W += d_outᵀ x          (always accumulates)
// Shapes: x, d_x [N, I]; W, d_W [O, I]; out, d_out [N, O]. Saves nothing (the backward reads x, for d_W only).
// Either gradient may be skipped by passing an undefined Tensor{} (a frozen weight, or the first
// layer's input). Without d_W, x may be undefined too: d_x alone reads only d_out and W (a frozen
// linear need not keep its input). Tested in tests/engine/test_backend_ops.cpp (the op table) and
// tests/engine/test_ops.cpp (d_x without x).
#pragma once

#include "engine/tensor.h"

namespace cw {

void linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight);
void linear_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const Tensor& x,
                     const Tensor& weight, GradMode mode);

}  // namespace cw
