// Embedding lookup, optionally times a constant (Gemma's sqrt(C) normaliser).
//   forward:  out[n, :] = s * table[ids[n], :]
//   backward: d_table[ids[n], :] += s * d_out[n, :]   (accumulates; rows visited in order n = 0..N-1,
//             so the result is deterministic)
// scale s: 1 for Llama (a plain copy of the rows); Gemma's caller passes sqrt(C) rounded to the
// table's dtype, as transformers multiplies by its normaliser cast to the weights' dtype. Each
// output element is the product rounded once.
// Shapes: ids [N] i32, table [V, C], out / d_out [N, C]. Dtypes: out the table's; d_table
// accum_dtype(d_out.dtype) (f32 for bf16). All contiguous, on one device. Saves nothing. Host ids
// are checked to lie in [0, V); device ids must be checked by the caller before the upload (a bad
// one gives a NaN row and adds nothing). Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/tensor.h"

namespace cw {

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table, double scale = 1.0);
void embedding_backward(const Tensor& d_table, const Tensor& d_out, const Tensor& ids, double scale = 1.0);

}  // namespace cw
