#include "engine/ops/lm_head_loss.h"

#include "engine/ops/cpu_common.h"
#include "engine/ops/linear.h"
#include "engine/scratch.h"

#include <algorithm>
#include <cmath>

namespace cw {

// The contract (engine/ops/lm_head_loss.h), checked once here for every backend.
namespace {
// x [N, C] and W [V, C] (V > 0) in one dtype, labels [N] i32; the optional outputs: row_loss, lse
// [N] and d_W [V, C] in accum_dtype(x.dtype), d_x [N, C] in x's (not aliasing x: the d_W product
// reads x); all contiguous on x's device, the scratch arena too.
void check_operands(const Tensor& x, const Tensor& w, const Tensor& labels, double normaliser, int64_t block_rows,
                    double softcap, const Arena& scratch, const Tensor* row_loss, const Tensor* lse, const Tensor* d_x,
                    const Tensor* d_w) {
  CW_CHECK(x.ndim == 2, "lm_head x must be [N, C], got {}", x.describe());
  CW_CHECK(w.ndim == 2, "lm_head weight must be [V, C], got {}", w.describe());
  const int64_t N = x.size(0), C = x.size(1);
  check_shape(w, {-1, C}, "lm_head weight");
  CW_CHECK(w.size(0) > 0, "lm_head weight has an empty vocabulary ({})", w.describe());
  check_shape(labels, {N}, "lm_head labels");
  check_dtype(labels, DType::i32, "lm_head labels");
  check_dtype(w, x.dtype, "lm_head weight");
  CW_CHECK(normaliser > 0, "lm_head loss normaliser {} must be positive (the count of supervised tokens)", normaliser);
  CW_CHECK(block_rows > 0, "lm_head block_rows {} must be positive", block_rows);
  CW_CHECK(softcap >= 0 && std::isfinite(softcap), "lm_head logit cap {} must be positive and finite (0: none)",
           softcap);
  const DType accum = accum_dtype(x.dtype);
  if (row_loss) {
    check_shape(*row_loss, {N}, "lm_head row_loss");
    check_dtype(*row_loss, accum, "lm_head row_loss");
  }
  if (lse) {
    check_shape(*lse, {N}, "lm_head saved lse");
    check_dtype(*lse, accum, "lm_head saved lse");
  }
  if (d_x) {
    check_same_shape(*d_x, x, "lm_head d_x", "lm_head x");
    check_dtype(*d_x, x.dtype, "lm_head d_x");
    CW_CHECK(d_x->data != x.data || x.empty(), "lm_head d_x must not alias x (the d_W product reads x)");
  }
  if (d_w) {
    check_same_shape(*d_w, w, "lm_head d_weight", "lm_head weight");
    check_dtype(*d_w, accum, "lm_head d_weight");
  }
  check_packed_same_device({{x, "lm_head x"}, {w, "lm_head weight"}, {labels, "lm_head labels"},
                            {row_loss, "lm_head row_loss"}, {lse, "lm_head saved lse"}, {d_x, "lm_head d_x"},
                            {d_w, "lm_head d_weight"}});
  CW_CHECK(scratch.device() == x.device, "lm_head scratch arena is on {} but x is on {}",
           device_name(scratch.device()), device_name(x.device));
}

// Host labels (the GPU checks its own on the device: engine/cuda/lm_head.cu).
void check_labels(const Tensor& labels, int64_t V) {
  const int32_t* lab = labels.ptr<int32_t>();
  for (int64_t n = 0; n < labels.numel(); ++n)
    CW_CHECK_HINT(lab[n] == kIgnoreLabel || (lab[n] >= 0 && lab[n] < V),
                  "labels are token ids of the model's vocabulary, or -100 for positions without a loss",
                  "lm_head label {} at row {} is outside [0, {}) and is not -100 (ignored)", lab[n], n, V);
}

// z = cap tanh(z / cap) over a block of logits (softcap > 0).
template <class T> void cap_logits(cpu::MatrixMap<T> Z, double softcap) {
  const T cap = T(softcap);
  Z = ((Z.array() / cap).tanh() * cap).matrix();
}

// One pass over row blocks. Writes row_loss / lse when given; with want_grad, turns each block's
// logits into G and applies d_x and d_W. With `lse_in`, the lse is read instead of computed. Under a
// cap the block's logits are capped before everything else, and G gets the cap's derivative.
template <class T>
void run(const Tensor* row_loss, const Tensor* lse_out, const Tensor* lse_in, const Tensor* d_x, const Tensor* d_w,
         const Tensor& x, const Tensor& w, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
         int64_t block_rows, double softcap) {
  const int64_t N = x.size(0), C = x.size(1), V = w.size(0);
  ArenaScope scope(scratch);
  // One block of logits, min(block_rows, N) x V (engine/scratch.h lm_head_scratch_bytes).
  T* logits_block = static_cast<T*>(scratch.alloc_bytes(lm_head_scratch_bytes(x.device, N, V, sizeof(T), block_rows)));
  const auto W = cpu::cmatrix<T>(w);
  const int32_t* lab = labels.ptr<int32_t>();
  const T inv_norm = T(1.0 / normaliser);
  for (int64_t n0 = 0; n0 < N; n0 += block_rows) {
    const int64_t rows = std::min(block_rows, N - n0);
    const auto X = cpu::cmatrix<T>(x.ptr<T>() + n0 * C, rows, C, C);
    auto Z = cpu::matrix<T>(logits_block, rows, V, V);
    Z.noalias() = X * W.transpose();
    if (softcap > 0) cap_logits<T>(Z, softcap);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      T lse;
      if (lse_in) {
        lse = lse_in->ptr<T>()[n];
      } else {
        const T m = Z.row(r).maxCoeff();
        lse = m + std::log((Z.row(r).array() - m).exp().sum());
        if (lse_out) lse_out->ptr<T>()[n] = lse;
      }
      const bool supervised = lab[n] != kIgnoreLabel;
      if (row_loss) row_loss->ptr<T>()[n] = supervised ? (lse - Z(r, lab[n])) * inv_norm : T(0);
      if (d_x || d_w) {
        if (!supervised) {
          Z.row(r).setZero();
        } else if (softcap > 0) {
          // G = (softmax(z) - onehot) / normaliser times dz/d(x Wᵀ) = 1 - (z / cap)^2, from the capped z.
          const T cap = T(softcap), z_label = Z(r, lab[n]);
          Z.row(r) = ((Z.row(r).array() - lse).exp() * inv_norm * (T(1) - (Z.row(r).array() / cap).square())).matrix();
          Z(r, lab[n]) -= inv_norm * (T(1) - (z_label / cap) * (z_label / cap));
        } else {
          Z.row(r) = ((Z.row(r).array() - lse).exp() * inv_norm).matrix();
          Z(r, lab[n]) -= inv_norm;
        }
      }
    }
    if (d_x) {
      auto dX = cpu::matrix<T>(d_x->ptr<T>() + n0 * C, rows, C, C);
      if (mode == GradMode::accumulate)
        dX.noalias() += Z * W;
      else
        dX.noalias() = Z * W;
    }
    if (d_w) cpu::matrix<T>(*d_w).noalias() += Z.transpose() * X;
  }
}

}  // namespace

void lm_head_loss_forward(const Tensor& row_loss, const LmHeadSaved& saved, const Tensor& x, const Tensor& weight,
                          const Tensor& labels, double normaliser, Arena& scratch, int64_t block_rows,
                          double softcap) {
  const Tensor* lse = saved.lse.data ? &saved.lse : nullptr;
  check_operands(x, weight, labels, normaliser, block_rows, softcap, scratch, &row_loss, lse, nullptr, nullptr);
  CW_DISPATCH_GPU(x, lm_head_loss_forward(row_loss, saved, x, weight, labels, normaliser, scratch, block_rows,
                                          softcap));
  check_labels(labels, weight.size(0));
  cpu::dispatch_float(x.dtype, "lm_head_loss_forward", [&](auto zero) {
    run<decltype(zero)>(&row_loss, lse, nullptr, nullptr, nullptr, x, weight, labels, normaliser, GradMode::overwrite,
                        scratch, block_rows, softcap);
  });
}

void lm_head_loss_backward(const Tensor& d_x, const Tensor& d_weight, const LmHeadSaved& saved, const Tensor& x,
                           const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode,
                           Arena& scratch, int64_t block_rows, double softcap) {
  const Tensor* dx = d_x.data ? &d_x : nullptr;
  const Tensor* dw = d_weight.data ? &d_weight : nullptr;
  check_operands(x, weight, labels, normaliser, block_rows, softcap, scratch, nullptr, &saved.lse, dx, dw);
  CW_DISPATCH_GPU(x, lm_head_loss_backward(d_x, d_weight, saved, x, weight, labels, normaliser, mode, scratch,
                                           block_rows, softcap));
  check_labels(labels, weight.size(0));
  cpu::dispatch_float(x.dtype, "lm_head_loss_backward", [&](auto zero) {
    run<decltype(zero)>(nullptr, nullptr, &saved.lse, dx, dw, x, weight, labels, normaliser, mode, scratch, block_rows,
                        softcap);
  });
}

void lm_head_loss_fused(const Tensor& row_loss, const Tensor& d_x, const Tensor& d_weight, const Tensor& x,
                        const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
                        int64_t block_rows, double softcap) {
  const Tensor* dx = d_x.data ? &d_x : nullptr;
  const Tensor* dw = d_weight.data ? &d_weight : nullptr;
  check_operands(x, weight, labels, normaliser, block_rows, softcap, scratch, &row_loss, nullptr, dx, dw);
  CW_DISPATCH_GPU(x, lm_head_loss_fused(row_loss, d_x, d_weight, x, weight, labels, normaliser, mode, scratch,
                                        block_rows, softcap));
  check_labels(labels, weight.size(0));
  cpu::dispatch_float(x.dtype, "lm_head_loss_fused", [&](auto zero) {
    run<decltype(zero)>(&row_loss, nullptr, nullptr, dx, dw, x, weight, labels, normaliser, mode, scratch, block_rows,
                        softcap);
  });
}

void lm_head_logits(const Tensor& logits, const Tensor& x, const Tensor& weight, double softcap) {
  CW_CHECK(x.ndim == 2 && weight.ndim == 2, "lm_head_logits x {} and weight {} must be [N, C] and [V, C]",
           x.describe(), weight.describe());
  check_shape(weight, {-1, x.size(1)}, "lm_head_logits weight");
  check_shape(logits, {x.size(0), weight.size(0)}, "lm_head_logits logits");
  check_dtype(weight, x.dtype, "lm_head_logits weight");
  check_dtype(logits, x.dtype, "lm_head_logits logits");
  check_packed_same_device({{x, "lm_head_logits x"}, {weight, "lm_head_logits weight"},
                            {logits, "lm_head_logits logits"}});
  CW_CHECK(softcap >= 0 && std::isfinite(softcap), "lm_head_logits cap {} must be positive and finite (0: none)",
           softcap);
  linear_forward(logits, x, weight);
  if (softcap == 0.0) return;
  CW_DISPATCH_GPU(x, softcap_logits(logits, softcap));
  cpu::dispatch_float(x.dtype, "lm_head_logits", [&](auto zero) {
    using T = decltype(zero);
    cap_logits<T>(cpu::matrix<T>(logits), softcap);
  });
}

}  // namespace cw
