#include "engine/ops/lora_linear.h"

#include "engine/ops/cpu_common.h"

#include <cmath>

namespace cw {

uint32_t lora_dropout_threshold(double p) {
  CW_CHECK(p >= 0.0 && p < 1.0, "lora_linear: dropout probability {} must be in [0, 1)", p);
  return static_cast<uint32_t>(std::floor(p * 4294967296.0));  // p < 1, so below 2^32
}

// The contract (engine/ops/lora_linear.h), checked once here for every backend. `y` is out or d_out.
namespace {
void check_operands(const Tensor& x, const Tensor& w, const LoraAdapter& ad, const Tensor& y, const char* what_y,
                    const Arena& scratch) {
  CW_CHECK(x.ndim == 2, "lora_linear x must be [N, I], got {}", x.describe());
  CW_CHECK(w.ndim == 2, "lora_linear weight must be [O, I], got {}", w.describe());
  CW_CHECK(ad.a.ndim == 2, "lora_linear A must be [r, I], got {}", ad.a.describe());
  const int64_t N = x.size(0), I = x.size(1), O = w.size(0), r = ad.a.size(0);
  CW_CHECK(r >= 1, "lora_linear: the adapter's rank must be >= 1, A is {}", ad.a.describe());
  check_shape(w, {O, I}, "lora_linear weight");
  check_shape(ad.a, {r, I}, "lora_linear A");
  check_shape(ad.b, {O, r}, "lora_linear B");
  check_shape(y, {N, O}, what_y);
  check_dtype(w, x.dtype, "lora_linear weight");
  check_dtype(ad.a, x.dtype, "lora_linear A");
  check_dtype(ad.b, x.dtype, "lora_linear B");
  check_dtype(y, x.dtype, what_y);
  check_packed_same_device({{x, "lora_linear x"}, {w, "lora_linear weight"}, {ad.a, "lora_linear A"},
                            {ad.b, "lora_linear B"}, {y, what_y}});
  CW_CHECK(std::isfinite(ad.scale), "lora_linear: scale {} must be finite", ad.scale);
  lora_dropout_threshold(ad.dropout.p);
  CW_CHECK(ad.dropout.seq_rows >= 1 && ad.dropout.pos0 >= 0 && ad.dropout.row0 >= 0,
           "lora_linear: dropout rows per sequence {} (>= 1), pos0 {} and row0 {} (>= 0)", ad.dropout.seq_rows,
           ad.dropout.pos0, ad.dropout.row0);
  CW_CHECK(scratch.device() == x.device, "lora_linear: the scratch arena is on {} but x is on {}",
           device_name(scratch.device()), device_name(x.device));
}

// A product's output must not be one of its inputs (the GEMM would read what it has written).
void check_not_aliased(const Tensor& written, const Tensor& read, const char* what) {
  CW_CHECK(written.data != read.data || written.empty(), "lora_linear: {} (a GEMM cannot write one of its inputs)",
           what);
}

// dst (=|+=) drop(src): src's elements kept by the mask, scaled by 1 / (1 - p) (see the header).
template <class T>
void apply_dropout(const Tensor& dst, const Tensor& src, const LoraDropout& d, bool accumulate) {
  const int64_t N = src.size(0), I = src.size(1);
  const uint32_t threshold = lora_dropout_threshold(d.p);
  const T inv_keep = T(1) / (T(1) - T(d.p));
  const T* s = src.ptr<T>();
  T* o = dst.ptr<T>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t m = d.row0 + n;
    const uint64_t key = lora_dropout_row_key(d.seed, d.sequence0 + m / d.seq_rows, d.pos0 + m % d.seq_rows);
    for (int64_t i = 0; i < I; ++i) {
      const T v = lora_dropout_keeps(key, d.column0 + i, threshold) ? s[n * I + i] * inv_keep : T(0);
      o[n * I + i] = accumulate ? o[n * I + i] + v : v;
    }
  }
}

// drop(x): x itself without dropout, else a scratch copy with the mask applied.
template <class T> Tensor dropped_input(const Tensor& x, const LoraDropout& d, Arena& scratch) {
  if (d.p == 0.0) return x;
  const Tensor xd = scratch.alloc(x.dtype, {x.size(0), x.size(1)});
  apply_dropout<T>(xd, x, d, false);
  return xd;
}
}  // namespace

void lora_linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight, const LoraAdapter& adapter,
                         Arena& scratch) {
  check_operands(x, weight, adapter, out, "lora_linear out", scratch);
  for (const auto& [read, what] : {std::pair{&x, "out must not alias x"}, {&weight, "out must not alias the weight"},
                                   {&adapter.a, "out must not alias A"}, {&adapter.b, "out must not alias B"}})
    check_not_aliased(out, *read, what);
  CW_DISPATCH_GPU(x, lora_linear_forward(out, x, weight, adapter, scratch));
  cpu::dispatch_float(x.dtype, "lora_linear_forward", [&](auto zero) {
    using T = decltype(zero);
    ArenaScope scope(scratch);
    const Tensor xd = dropped_input<T>(x, adapter.dropout, scratch);
    const Tensor u = scratch.alloc(x.dtype, {x.size(0), adapter.a.size(0)});
    cpu::matrix<T>(u).noalias() = cpu::cmatrix<T>(xd) * cpu::cmatrix<T>(adapter.a).transpose();
    auto y = cpu::matrix<T>(out);
    y.noalias() = cpu::cmatrix<T>(x) * cpu::cmatrix<T>(weight).transpose();
    y.noalias() += (T(adapter.scale) * cpu::cmatrix<T>(u)) * cpu::cmatrix<T>(adapter.b).transpose();
  });
}

void lora_linear_backward(const Tensor& d_x, const Tensor& d_a, const Tensor& d_b, const Tensor& d_out,
                          const Tensor& x, const Tensor& weight, const LoraAdapter& adapter, GradMode mode,
                          Arena& scratch) {
  check_operands(x, weight, adapter, d_out, "lora_linear d_out", scratch);
  if (d_x.data) {
    check_same_shape(d_x, x, "lora_linear d_x", "lora_linear x");
    check_dtype(d_x, x.dtype, "lora_linear d_x");
    for (const auto& [read, what] :
         {std::pair{&d_out, "d_x must not alias d_out"}, {&weight, "d_x must not alias the weight"},
          {&adapter.a, "d_x must not alias A"}, {&adapter.b, "d_x must not alias B"},
          {&x, "d_x must not alias x (the adapter's gradients read x after d_x is written)"}})
      check_not_aliased(d_x, *read, what);
  }
  const DType acc = accum_dtype(x.dtype);
  if (d_a.data) {
    check_same_shape(d_a, adapter.a, "lora_linear d_A", "lora_linear A");
    check_dtype(d_a, acc, "lora_linear d_A");
  }
  if (d_b.data) {
    check_same_shape(d_b, adapter.b, "lora_linear d_B", "lora_linear B");
    check_dtype(d_b, acc, "lora_linear d_B");
  }
  check_packed_same_device({{x, "lora_linear x"}, {d_out, "lora_linear d_out"},
                            NamedTensor::optional(d_x, "lora_linear d_x"), NamedTensor::optional(d_a, "lora_linear d_A"),
                            NamedTensor::optional(d_b, "lora_linear d_B")});
  CW_DISPATCH_GPU(x, lora_linear_backward(d_x, d_a, d_b, d_out, x, weight, adapter, mode, scratch));
  cpu::dispatch_float(x.dtype, "lora_linear_backward", [&](auto zero) {
    using T = decltype(zero);
    ArenaScope scope(scratch);
    const int64_t N = x.size(0), I = x.size(1), r = adapter.a.size(0);
    const T s = T(adapter.scale);
    const auto dy = cpu::cmatrix<T>(d_out);
    const Tensor xd = dropped_input<T>(x, adapter.dropout, scratch);
    // g = s d_out B: the gradient of u, scaled (every product below that uses it wants the scale).
    const Tensor g = scratch.alloc(x.dtype, {N, r});
    cpu::matrix<T>(g).noalias() = (s * dy) * cpu::cmatrix<T>(adapter.b);
    if (d_b.data) {
      const Tensor u = scratch.alloc(x.dtype, {N, r});  // u = drop(x) Aᵀ, recomputed
      cpu::matrix<T>(u).noalias() = cpu::cmatrix<T>(xd) * cpu::cmatrix<T>(adapter.a).transpose();
      cpu::matrix<T>(d_b).noalias() += (s * dy.transpose()) * cpu::cmatrix<T>(u);
    }
    if (d_a.data) cpu::matrix<T>(d_a).noalias() += cpu::cmatrix<T>(g).transpose() * cpu::cmatrix<T>(xd);
    if (d_x.data) {
      auto dx = cpu::matrix<T>(d_x);
      if (mode == GradMode::accumulate)
        dx.noalias() += dy * cpu::cmatrix<T>(weight);
      else
        dx.noalias() = dy * cpu::cmatrix<T>(weight);
      if (adapter.dropout.p == 0.0) {
        dx.noalias() += cpu::cmatrix<T>(g) * cpu::cmatrix<T>(adapter.a);
      } else {
        const Tensor ga = scratch.alloc(x.dtype, {N, I});  // the gradient of drop(x), before the mask
        cpu::matrix<T>(ga).noalias() = cpu::cmatrix<T>(g) * cpu::cmatrix<T>(adapter.a);
        apply_dropout<T>(d_x, ga, adapter.dropout, true);
      }
    }
  });
}

}  // namespace cw
