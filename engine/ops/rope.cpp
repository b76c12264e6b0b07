#include "engine/ops/rope.h"

#include "engine/ops/cpu_common.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace cw {

std::string rope_type_name(RopeScaling::Type type) {
  switch (type) {
    case RopeScaling::Type::none: return "default";
    case RopeScaling::Type::linear: return "linear";
    case RopeScaling::Type::llama3: return "llama3";
    case RopeScaling::Type::yarn: return "yarn";
    case RopeScaling::Type::dynamic: return "dynamic";
  }
  return "unknown";
}

namespace {
// theta^(-2i/D), i in [0, D/2).
std::vector<double> plain_inv_freq(int64_t head_dim, double theta) {
  std::vector<double> inv(static_cast<size_t>(head_dim / 2));
  for (int64_t i = 0; i < head_dim / 2; ++i)
    inv[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  return inv;
}

void scale_llama3(std::vector<double>& inv, const RopeScaling& s) {
  const double low_wavelen = static_cast<double>(s.original_max_position) / s.low_freq_factor;
  const double high_wavelen = static_cast<double>(s.original_max_position) / s.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen > low_wavelen) {
      f /= s.factor;  // low frequency: stretched fully
    } else if (wavelen >= high_wavelen) {
      // between the two thresholds: blend the stretched and the original frequency
      const double smooth = (static_cast<double>(s.original_max_position) / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f = (1.0 - smooth) * f / s.factor + smooth * f;
    }  // high frequency: unchanged
  }
}

// YaRN's ramp, as _compute_yarn_parameters: the dimension d at which a wavelength fits `rotations`
// times into the original context, d = D ln(original / (rotations 2 pi)) / (2 ln theta); frequencies
// below low (fast rotations) keep their value, above high they are divided by the factor, the ramp
// blends linearly in between.
void scale_yarn(std::vector<double>& inv, int64_t head_dim, double theta, const RopeScaling& s) {
  const double D = static_cast<double>(head_dim), original = static_cast<double>(s.original_max_position);
  auto correction_dim = [&](double rotations) {
    return D * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, D - 1.0);
  if (low == high) high += 0.001;  // HF's guard against a zero-width ramp
  for (size_t i = 0; i < inv.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    inv[i] = inv[i] / s.factor * ramp + inv[i] * (1.0 - ramp);
  }
}

// yarn's get_mscale: 0.1 m ln(scale) + 1, and 1 for no stretch.
double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }
}  // namespace

std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& s, int64_t seq_len) {
  CW_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope head_dim {} must be even", head_dim);
  switch (s.type) {
    case RopeScaling::Type::none: return plain_inv_freq(head_dim, theta);
    case RopeScaling::Type::linear: {
      std::vector<double> inv = plain_inv_freq(head_dim, theta);
      for (double& f : inv) f /= s.factor;
      return inv;
    }
    case RopeScaling::Type::llama3: {
      std::vector<double> inv = plain_inv_freq(head_dim, theta);
      scale_llama3(inv, s);
      return inv;
    }
    case RopeScaling::Type::yarn: {
      std::vector<double> inv = plain_inv_freq(head_dim, theta);
      scale_yarn(inv, head_dim, theta, s);
      return inv;
    }
    case RopeScaling::Type::dynamic: {
      CW_CHECK(head_dim > 2, "dynamic RoPE needs head_dim > 2, got {}", head_dim);
      const double original = static_cast<double>(s.original_max_position);
      const double n = std::max(static_cast<double>(seq_len), original);
      const double D = static_cast<double>(head_dim);
      return plain_inv_freq(head_dim, theta * std::pow(s.factor * n / original - (s.factor - 1.0), D / (D - 2.0)));
    }
  }
  fail("rope_inv_freq: unknown RoPE scaling type");
}

double rope_attention_factor(const RopeScaling& s) {
  if (s.type != RopeScaling::Type::yarn) return 1.0;
  if (s.attention_factor) return *s.attention_factor;
  // HF's test is Python truthiness: an absent or zero mscale counts as not given.
  if (s.mscale.value_or(0.0) != 0.0 && s.mscale_all_dim.value_or(0.0) != 0.0)
    return yarn_mscale(s.factor, *s.mscale) / yarn_mscale(s.factor, *s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

void rope_tables(const Tensor& cos, const Tensor& sin, int64_t head_dim, double theta, const RopeScaling& scaling) {
  const int64_t P = cos.size(0), half = head_dim / 2;
  check_shape(cos, {P, half}, "rope cos table");
  check_shape(sin, {P, half}, "rope sin table");
  const std::vector<double> inv = rope_inv_freq(head_dim, theta, scaling, P);
  const double a = rope_attention_factor(scaling);
  cpu::dispatch_float(cos.dtype, "rope_tables", [&](auto zero) {
    using T = decltype(zero);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p) * inv[i];
        cos.ptr<T>()[p * half + i] = static_cast<T>(a * std::cos(angle));
        sin.ptr<T>()[p * half + i] = static_cast<T>(a * std::sin(angle));
      }
  });
}

bool rope_tables_serve(const RopeScaling& scaling, int64_t rows, int64_t n) {
  if (rows < n) return false;
  if (scaling.type != RopeScaling::Type::dynamic) return true;
  return rows == n || rows <= scaling.original_max_position;
}

// The contract (engine/ops/rope.h), checked once here for every backend. y is out or d_x, x is x or d_out.
namespace {
// A rope operand's layout: H D packed per token, or a column slice of wider token rows (token pitch P).
void check_token_rows(const Tensor& t, const char* what) {
  const int64_t T = t.size(1), H = t.size(2), D = t.size(3), P = t.stride[1];
  CW_CHECK(t.data != nullptr || t.numel() == 0, "{} has no data", what);
  CW_CHECK(t.stride[3] == 1 && t.stride[2] == D && P >= H * D && (t.stride[0] == T * P || t.size(0) == 1),
           "{} {}: must be [B, T, H, D] packed, or a column slice of wider token rows (strides [T P, P, D, 1])",
           what, t.describe());
}

void check_operands(const Tensor& y, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0,
                    const char* what_y, const char* what_x) {
  CW_CHECK(x.ndim == 4, "{} must be [B, T, H, D], got {}", what_x, x.describe());
  check_same_shape(y, x, what_y, what_x);
  const int64_t T = x.size(1), half = x.size(3) / 2;
  CW_CHECK(x.size(3) % 2 == 0, "rope head dim {} must be even", x.size(3));
  check_shape(cos, {-1, half}, "rope cos table");
  check_same_shape(sin, cos, "rope sin table", "rope cos table");
  CW_CHECK(pos0 >= 0 && pos0 + T <= cos.size(0), "rope positions [{}, {}) exceed the table of {} positions", pos0,
           pos0 + T, cos.size(0));
  check_dtype(y, x.dtype, what_y);
  check_dtype(cos, accum_dtype(x.dtype), "rope cos table");
  check_dtype(sin, accum_dtype(x.dtype), "rope sin table");
  check_packed_same_device({{cos, "rope cos table"}, {sin, "rope sin table"}});
  check_same_device(x, cos, what_x, "rope cos table");
  check_same_device(y, cos, what_y, "rope cos table");
  check_token_rows(x, what_x);
  check_token_rows(y, what_y);
  CW_CHECK(y.data != x.data || y.stride == x.stride, "{} aliases {} with other strides", what_y, what_x);
}

// Rotates every head of x by +angle (sign = 1) or -angle (sign = -1) into y; y may alias x.
template <class T>
void rotate(T* y, int64_t py, const T* x, int64_t px, const Tensor& shape, const T* cos, const T* sin, int64_t pos0,
            T sign, bool accumulate) {
  const int64_t B = shape.size(0), Tn = shape.size(1), H = shape.size(2), D = shape.size(3), half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const T* c = cos + (pos0 + t) * half;
      const T* s = sin + (pos0 + t) * half;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t bx = (b * Tn + t) * px + h * D, by = (b * Tn + t) * py + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = x[bx + i], x2 = x[bx + i + half];
          const T y1 = x1 * c[i] - sign * x2 * s[i];
          const T y2 = x2 * c[i] + sign * x1 * s[i];
          if (accumulate) {
            y[by + i] += y1;
            y[by + i + half] += y2;
          } else {
            y[by + i] = y1;
            y[by + i + half] = y2;
          }
        }
      }
    }
}
}  // namespace

void rope_forward(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0) {
  check_operands(out, x, cos, sin, pos0, "rope out", "rope in");
  CW_DISPATCH_GPU(x, rope_forward(out, x, cos, sin, pos0));
  cpu::dispatch_float(x.dtype, "rope_forward", [&](auto zero) {
    using T = decltype(zero);
    rotate<T>(out.ptr<T>(), out.stride[1], x.ptr<T>(), x.stride[1], x, cos.ptr<T>(), sin.ptr<T>(), pos0, T(1), false);
  });
}

void rope_backward(const Tensor& d_x, const Tensor& d_out, const Tensor& cos, const Tensor& sin, int64_t pos0,
                   GradMode mode) {
  check_operands(d_x, d_out, cos, sin, pos0, "rope d_x", "rope d_out");
  CW_CHECK(mode == GradMode::overwrite || d_x.data != d_out.data,
           "rope_backward: d_x aliases d_out, so it cannot also accumulate");
  CW_DISPATCH_GPU(d_out, rope_backward(d_x, d_out, cos, sin, pos0, mode));
  cpu::dispatch_float(d_out.dtype, "rope_backward", [&](auto zero) {
    using T = decltype(zero);
    rotate<T>(d_x.ptr<T>(), d_x.stride[1], d_out.ptr<T>(), d_out.stride[1], d_out, cos.ptr<T>(), sin.ptr<T>(), pos0,
              T(-1), mode == GradMode::accumulate);
  });
}

}  // namespace cw
