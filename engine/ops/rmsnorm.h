// RMSNorm (Zhang & Sennrich 2019), as in Llama; Gemma's with a weight offset o = 1.
//   forward:  r[n] = 1 / sqrt(mean_c x[n,c]^2 + eps);  out[n,c] = x[n,c] * r[n] * (o + w[c])
//   backward: g = d_out * (o + w);  xhat = x * r
//             d_x[n,:] = r[n] * (g[n,:] - xhat[n,:] * mean_c(g[n,c] * xhat[n,c]))   (overwrite or accumulate)
//             d_w[c]  += sum_n d_out[n,c] * xhat[n,c]                                 (always accumulates)
// Shapes: x, out, d_out, d_x [N, C]; w, d_w [C]. Dtypes: out, w, d_out, d_x x's; saved.rstd and
// d_w accum_dtype(x.dtype) (f32 for bf16). All contiguous, on x's device (scratch too).
// Saved: rstd (so the backward needs no reduction over C to recompute it). out must not alias x;
// d_x may alias d_out. d_weight may be skipped (an undefined Tensor{}: a frozen norm, as under LoRA).
// weight_offset o: 0 for Llama's norm (the weight is the scale); 1 for Gemma's, whose weight is
// stored as the scale's difference from 1 (zero-initialised, transformers' Gemma2RMSNorm computes
// x r (1 + w) in f32). The offset is added in the kernels' arithmetic dtype (f32 for bf16), so a
// bf16 weight near 0 keeps its precision. d_w is the same for every offset.
// Scratch: the GPU backward sums d_w over rows through per-block partials taken from `scratch`
// (deterministic, no atomics); the CPU ignores it.
// Tested in tests/engine/test_backend_ops.cpp (the op table: f64 finite differences, f32 against f64,
// every GPU kernel against CPU f64).
#pragma once

#include "engine/memory.h"
#include "engine/tensor.h"

namespace cw {

struct RmsNormSaved {
  Tensor rstd;  // [N], accum_dtype(x.dtype)
};

void rmsnorm_forward(const Tensor& out, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight, double eps,
                     double weight_offset = 0.0);
void rmsnorm_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const RmsNormSaved& saved,
                      const Tensor& x, const Tensor& weight, GradMode mode, Arena& scratch,
                      double weight_offset = 0.0);

}  // namespace cw
