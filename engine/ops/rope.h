// Rotary position embedding, HF "rotate_half" convention (the two halves of each head are paired,
// not interleaved pairs).
//   angle(pos, i) = pos * inv_freq[i],  i in [0, D/2);  cos = a cos(angle), sin = a sin(angle) from the
//   tables, a the attention factor (1 but for yarn)
//   forward:  out[.., i]       = x[.., i] cos - x[.., i + D/2] sin
//             out[.., i + D/2] = x[.., i + D/2] cos + x[.., i] sin
//   backward: the transpose (angle -> -angle, the same a), d_x overwritten or accumulated.
// Token t of a [B, T, H, D] tensor sits at position pos0 + t for every sequence of the batch (a chunk
// that starts at pos0). Shapes: x, out [B, T, H, D]; cos, sin tables [P, D/2] with P >= pos0 + T, in
// accum_dtype(x.dtype) (f32 for bf16); on one device. The tables are contiguous; x and out (d_out and
// d_x) each either contiguous or a column slice of wider token rows, strides [T P, P, D, 1] with
// P >= H D (the q or k heads of a fused QKV projection's [N, (H + 2 Hkv) D] output). out may alias x
// (in place, the same strides); d_x may alias d_out when overwriting. Saves nothing.
//
// inv_freq[i] = theta^(-2i/D), optionally rescaled as HF transformers' modeling_rope_utils.py does
// (transformers 5.24: _compute_linear_scaling_rope_parameters, _compute_llama3_parameters,
// _compute_yarn_parameters, _compute_dynamic_ntk_parameters), in f64 where HF computes in f32:
//   linear   inv_freq / factor.
//   llama3   (Llama 3.1) low frequencies (wavelength > original_max / low_freq_factor) / factor, high
//            ones (wavelength < original_max / high_freq_factor) kept, a blend in between.
//   yarn     (YaRN) per frequency a ramp r_i between extrapolation (inv_freq) and interpolation
//            (inv_freq / factor): inv_freq (1 - r_i) + inv_freq / factor r_i, r_i = clamp((i - low) /
//            (high - low), 0, 1), with low, high the dimensions at which a wavelength fits beta_fast and
//            beta_slow times into original_max (floored / ceiled when truncate), clamped to [0, D - 1].
//            cos and sin are multiplied by the attention factor (q.k by its square): attention_factor
//            when given, else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both
//            are given (non-zero), else get_mscale(factor, 1); get_mscale(s, m) = 0.1 m ln(s) + 1, and 1
//            for s <= 1.
//   dynamic  (dynamic NTK) for a sequence of n tokens, theta is replaced by
//            theta (factor n' / original_max - (factor - 1))^(D / (D - 2)), n' = max(n, original_max),
//            where original_max is the model's max_position_embeddings (HF uses that key, not
//            original_max_position_embeddings, for dynamic). The frequencies depend on n: a table is
//            built for one sequence length, its row count (rope_tables), as HF's forward over n tokens
//            computes them. Sampling builds the table for the prompt and the tokens it may generate
//            together, so every position uses that final length's frequencies: HF's forward over the
//            whole text, not its generate() with a cache, which recomputes the frequencies as the length
//            grows and keeps the keys cached under the earlier ones. Training with dynamic trains the function
//            of HF's forward over the batch's T tokens (the tables of length T; packed documents with
//            document positions still use T, where HF would take the largest position + 1).
// Tested in tests/engine/test_rope_scaling.cpp (against values from transformers' own functions,
// tests/data/rope_scaling_reference.py) and tests/engine/test_backend_ops.cpp (the op table).
#pragma once

#include "engine/tensor.h"

#include <optional>
#include <string>
#include <vector>

namespace cw {

struct RopeScaling {
  enum class Type { none, linear, llama3, yarn, dynamic };
  Type type = Type::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  int64_t original_max_position = 8192;  // llama3, yarn; dynamic: the model's max_position_embeddings
  double beta_fast = 32.0;  // yarn: frequencies turning more times over original_max are kept
  double beta_slow = 1.0;   // yarn: those turning fewer times are divided by factor
  std::optional<double> attention_factor = std::nullopt;  // yarn: as given; unset: from factor and mscale
  std::optional<double> mscale = std::nullopt;            // yarn: as given (HF uses the two only when
  std::optional<double> mscale_all_dim = std::nullopt;    // both are non-zero)
  bool truncate = true;                  // yarn: floor / ceil the correction range

  bool operator==(const RopeScaling&) const = default;
};

// The scaling's name as HF's rope_type spells it: default, linear, llama3, yarn, dynamic.
std::string rope_type_name(RopeScaling::Type type);

// inv_freq [D/2] for a sequence of seq_len tokens (used by dynamic only; 0: its original length).
std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling, int64_t seq_len = 0);
// What cos and sin are multiplied by: yarn's attention factor, 1 for every other type.
double rope_attention_factor(const RopeScaling& scaling);
// Fills cos and sin [P, D/2] (f64 or f32) for positions 0..P-1: attention_factor cos(p inv_freq),
// attention_factor sin(p inv_freq), for a sequence of P tokens (dynamic's length).
void rope_tables(const Tensor& cos, const Tensor& sin, int64_t head_dim, double theta, const RopeScaling& scaling);
// Whether tables of `rows` positions serve a sequence of n tokens: rows >= n, and for dynamic the
// frequencies of n are those the table was built with (both at most the original length, or rows == n).
bool rope_tables_serve(const RopeScaling& scaling, int64_t rows, int64_t n);

void rope_forward(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0);
void rope_backward(const Tensor& d_x, const Tensor& d_out, const Tensor& cos, const Tensor& sin, int64_t pos0,
                   GradMode mode);

}  // namespace cw
