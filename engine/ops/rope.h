// Rotary position embedding, HF "rotate_half" convention (the two halves of each head are paired,
// not interleaved pairs).
//   angle(pos, i) = pos * inv_freq[i],  i in [0, D/2)
//   forward:  out[.., i]       = x[.., i] cos - x[.., i + D/2] sin
//             out[.., i + D/2] = x[.., i + D/2] cos + x[.., i] sin
//   backward: the transpose rotation (angle -> -angle), d_x overwritten or accumulated.
// Token t of a [B, T, H, D] tensor sits at position pos0 + t for every sequence of the batch (a chunk
// that starts at pos0). Shapes: x, out [B, T, H, D]; cos, sin tables [P, D/2] with P >= pos0 + T, in
// accum_dtype(x.dtype) (f32 for bf16); on one device. The tables are contiguous; x and out (d_out and
// d_x) each either contiguous or a column slice of wider token rows, strides [T P, P, D, 1] with
// P >= H D (the q or k heads of a fused QKV projection's [N, (H + 2 Hkv) D] output). out may alias x
// (in place, the same strides); d_x may alias d_out when overwriting. Saves nothing.
//
// inv_freq[i] = theta^(-2i/D), optionally rescaled: "linear" divides by factor; "llama3" (Llama 3.1)
// divides low frequencies (wavelength > original_max / low_freq_factor) by factor, keeps high ones
// (wavelength < original_max / high_freq_factor) and blends in between. Tables are computed in f64.
// Tested in tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/tensor.h"

#include <string>
#include <vector>

namespace cw {

struct RopeScaling {
  enum class Type { none, linear, llama3 };
  Type type = Type::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling);
// Fills cos and sin [P, D/2] (f64 or f32) for positions 0..P-1.
void rope_tables(const Tensor& cos, const Tensor& sin, int64_t head_dim, double theta, const RopeScaling& scaling);

void rope_forward(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0);
void rope_backward(const Tensor& d_x, const Tensor& d_out, const Tensor& cos, const Tensor& sin, int64_t pos0,
                   GradMode mode);

}  // namespace cw
