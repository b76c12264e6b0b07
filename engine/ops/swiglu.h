// SwiGLU gate of the Llama MLP (the projections around it are linear ops).
//   forward:  out = silu(gate) * up,  silu(g) = g * sigmoid(g)
//   backward: d_up   = d_out * silu(gate)
//             d_gate = d_out * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
//             (both overwritten or both accumulated)
// Shapes: gate, up, out, d_* [N, F], one dtype, contiguous, on one device; d_gate and d_up are
// different buffers. Saves nothing: the backward reads gate and up.
// Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/tensor.h"

namespace cw {

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                     const Tensor& up, GradMode mode);

}  // namespace cw
