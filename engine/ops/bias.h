// The bias of a linear, y = x Wᵀ + b: added to the linear's output, and its gradient.
//   forward:  out[n, o] = x[n, o] + b[o]          (out may alias x: the bias added in place)
//   backward: d_b[o] += sum_n d_out[n, o]         (always accumulates; d_x = d_out needs no call)
// Shapes: x, out, d_out [N, O]; b, d_b [O]. Dtypes: out, b, d_out x's; d_b accum_dtype(x.dtype) (f32
// for bf16). All contiguous, on x's device (scratch too). Saves nothing.
// Scratch: the GPU backward sums over rows through per-block partials [row blocks, O] f32 taken from
// `scratch` (a fixed order: deterministic, no atomics); the CPU ignores it.
// Tested in tests/engine/test_backend_ops.cpp (the op table: f64 finite differences, f32 against f64,
// the GPU against CPU f64).
#pragma once

#include "engine/memory.h"
#include "engine/tensor.h"

namespace cw {

void bias_forward(const Tensor& out, const Tensor& x, const Tensor& bias);
void bias_backward(const Tensor& d_bias, const Tensor& d_out, Arena& scratch);

}  // namespace cw
