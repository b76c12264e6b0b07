// The residual connection and plain gradient accumulation.
//   residual_forward:  out = x + delta            (out may alias x: the stream updated in place)
//   residual_backward: d_x (op)= d_out; d_delta (op)= d_out, each with its own mode (the op's
//                      explicit backward; model/layer.cpp passes d_x through in place instead)
//   accumulate:        dst += src                 (gradient sums: a schedule adding a chunk's result)
// Shapes and dtypes: every operand of the source's (x, d_out, src) shape and dtype, contiguous, on
// one device; accumulate's dst may also be accum_dtype(src.dtype) (bf16 gradients summed in f32).
// d_x aliasing d_out only with d_x's mode overwrite (a pass-through). Saves nothing.
// Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/tensor.h"

namespace cw {

void residual_forward(const Tensor& out, const Tensor& x, const Tensor& delta);
void residual_backward(const Tensor& d_x, GradMode mode_x, const Tensor& d_delta, GradMode mode_delta,
                       const Tensor& d_out);
void accumulate(const Tensor& dst, const Tensor& src);

}  // namespace cw
