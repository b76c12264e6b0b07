// GeGLU, the gate of Gemma's MLP: GELU with the tanh approximation (transformers' gelu_pytorch_tanh)
// in place of SwiGLU's silu (engine/ops/swiglu.h; the projections around it are linear ops).
//   forward:  out = gelu(gate) * up,  gelu(g) = g/2 (1 + tanh(u)),  u = k0 (g + k1 g^3),
//             k0 = sqrt(2/pi), k1 = 0.044715
//   backward: d_up   = d_out * gelu(gate)
//             d_gate = d_out * up * gelu'(gate),
//             gelu'(g) = (1 + tanh(u)) / 2 + g/2 (1 - tanh(u)^2) k0 (1 + 3 k1 g^2)
//             (both overwritten or both accumulated)
// Shapes: gate, up, out, d_* [N, F], one dtype, contiguous, on one device; d_gate and d_up are
// different buffers. Saves nothing: the backward reads gate and up.
// Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/tensor.h"

namespace cw {

void geglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
void geglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                    const Tensor& up, GradMode mode);

}  // namespace cw
