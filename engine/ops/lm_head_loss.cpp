#include "engine/ops/lm_head_loss.h"

#include "engine/ops/cpu_common.h"

#include <algorithm>
#include <cmath>

namespace cw {

namespace {
void check_operands(const Tensor& x, const Tensor& w, const Tensor& labels, double normaliser, int64_t block_rows) {
  const int64_t N = x.size(0), C = x.size(1);
  check_shape(x, {N, C}, "lm_head x");
  check_shape(w, {-1, C}, "lm_head weight");
  check_shape(labels, {N}, "lm_head labels");
  check_dtype(labels, DType::i32, "lm_head labels");
  check_dtype(w, x.dtype, "lm_head weight");
  for (const Tensor* t : {&x, &w, &labels}) {
    check_contiguous(*t, "lm_head operand");
    cpu::check_cpu(*t, "lm_head operand");
  }
  CW_CHECK(normaliser > 0, "lm_head loss normaliser {} must be positive (the count of supervised tokens)", normaliser);
  CW_CHECK(block_rows > 0, "lm_head block_rows {} must be positive", block_rows);
  const int64_t V = w.size(0);
  const int32_t* lab = labels.ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    CW_CHECK_HINT(lab[n] == kIgnoreLabel || (lab[n] >= 0 && lab[n] < V), "labels are token ids or -100",
                  "label {} at row {} is outside [0, {})", lab[n], n, V);
}

// One pass over row blocks. Writes row_loss / lse when given; with want_grad, turns each block's
// logits into G and applies d_x and d_W. With `lse_in`, the lse is read instead of computed.
template <class T>
void run(const Tensor* row_loss, const Tensor* lse_out, const Tensor* lse_in, const Tensor* d_x, const Tensor* d_w,
         const Tensor& x, const Tensor& w, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
         int64_t block_rows) {
  const int64_t N = x.size(0), C = x.size(1), V = w.size(0);
  ArenaScope scope(scratch);
  const int64_t rows_max = std::min(block_rows, std::max<int64_t>(N, 1));
  T* logits_block = scratch.alloc(x.dtype, {rows_max * V}).template ptr<T>();
  const auto W = cpu::cmatrix<T>(w);
  const int32_t* lab = labels.ptr<int32_t>();
  const T inv_norm = T(1.0 / normaliser);
  for (int64_t n0 = 0; n0 < N; n0 += block_rows) {
    const int64_t rows = std::min(block_rows, N - n0);
    const auto X = cpu::cmatrix<T>(x.ptr<T>() + n0 * C, rows, C, C);
    auto Z = cpu::matrix<T>(logits_block, rows, V, V);
    Z.noalias() = X * W.transpose();
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
        if (supervised) {
          Z.row(r) = ((Z.row(r).array() - lse).exp() * inv_norm).matrix();
          Z(r, lab[n]) -= inv_norm;
        } else {
          Z.row(r).setZero();
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

void check_outputs(const Tensor* row_loss, const Tensor* lse, const Tensor* d_x, const Tensor* d_w, const Tensor& x,
                   const Tensor& w) {
  const int64_t N = x.size(0);
  for (const Tensor* t : {row_loss, lse}) {
    if (!t) continue;
    check_shape(*t, {N}, "lm_head row_loss/lse");
    check_dtype(*t, accum_dtype(x.dtype), "lm_head row_loss/lse");
    check_contiguous(*t, "lm_head row_loss/lse");
  }
  if (d_x) {
    check_same_shape(*d_x, x, "lm_head d_x", "lm_head x");
    check_dtype(*d_x, x.dtype, "lm_head d_x");
    check_contiguous(*d_x, "lm_head d_x");
  }
  if (d_w) {
    check_same_shape(*d_w, w, "lm_head d_weight", "lm_head weight");
    check_dtype(*d_w, x.dtype, "lm_head d_weight");
    check_contiguous(*d_w, "lm_head d_weight");
  }
}
}  // namespace

void lm_head_loss_forward(const Tensor& row_loss, const LmHeadSaved& saved, const Tensor& x, const Tensor& weight,
                          const Tensor& labels, double normaliser, Arena& scratch, int64_t block_rows) {
  CW_DISPATCH_GPU(x, lm_head_loss_forward(row_loss, saved, x, weight, labels, normaliser, scratch, block_rows));
  check_operands(x, weight, labels, normaliser, block_rows);
  const Tensor* lse = saved.lse.data ? &saved.lse : nullptr;
  check_outputs(&row_loss, lse, nullptr, nullptr, x, weight);
  cpu::dispatch_float(x.dtype, "lm_head_loss_forward", [&](auto zero) {
    run<decltype(zero)>(&row_loss, lse, nullptr, nullptr, nullptr, x, weight, labels, normaliser, GradMode::overwrite,
                        scratch, block_rows);
  });
}

void lm_head_loss_backward(const Tensor& d_x, const Tensor& d_weight, const LmHeadSaved& saved, const Tensor& x,
                           const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode,
                           Arena& scratch, int64_t block_rows) {
  CW_DISPATCH_GPU(x, lm_head_loss_backward(d_x, d_weight, saved, x, weight, labels, normaliser, mode, scratch,
                                           block_rows));
  check_operands(x, weight, labels, normaliser, block_rows);
  const Tensor* dx = d_x.data ? &d_x : nullptr;
  const Tensor* dw = d_weight.data ? &d_weight : nullptr;
  check_outputs(nullptr, &saved.lse, dx, dw, x, weight);
  cpu::dispatch_float(x.dtype, "lm_head_loss_backward", [&](auto zero) {
    run<decltype(zero)>(nullptr, nullptr, &saved.lse, dx, dw, x, weight, labels, normaliser, mode, scratch, block_rows);
  });
}

void lm_head_loss_fused(const Tensor& row_loss, const Tensor& d_x, const Tensor& d_weight, const Tensor& x,
                        const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
                        int64_t block_rows) {
  CW_DISPATCH_GPU(x, lm_head_loss_fused(row_loss, d_x, d_weight, x, weight, labels, normaliser, mode, scratch,
                                        block_rows));
  check_operands(x, weight, labels, normaliser, block_rows);
  const Tensor* dx = d_x.data ? &d_x : nullptr;
  const Tensor* dw = d_weight.data ? &d_weight : nullptr;
  check_outputs(&row_loss, nullptr, dx, dw, x, weight);
  cpu::dispatch_float(x.dtype, "lm_head_loss_fused", [&](auto zero) {
    run<decltype(zero)>(&row_loss, nullptr, nullptr, dx, dw, x, weight, labels, normaliser, mode, scratch, block_rows);
  });
}

}  // namespace cw
