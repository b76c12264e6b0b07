// A frozen linear with a LoRA adapter on the GPU: the math of engine/ops/lora_linear.h, as five
// cuBLASLt products (engine/cuda/gemm.cuh, the one matmul linear.cu runs) and, with dropout, one
// elementwise mask kernel. T is bf16 or f32, one per call; every product accumulates in f32.
//   forward:  out[N, O]  = x Wᵀ                         (beta 0)
//             u[N, r]    = drop(x) Aᵀ                   (scratch, T)
//             out       += s · u Bᵀ                     (alpha s, beta 1)
//   backward: g[N, r]    = s · d_out B                  (alpha s, scratch T)
//             d_B[O, r] += s · d_outᵀ u                 (u recomputed; alpha s, beta 1, f32)
//             d_A[r, I] += gᵀ drop(x)                   (beta 1, f32)
//             d_x        = d_out W                      (beta 0 or 1 by the mode)
//             d_x       += g A                          (beta 1), or with dropout: t = g A (scratch),
//                                                       then d_x += drop(t) by the mask kernel
// Each product is one of linear.cu's three forms (its header works the row-major to column-major
// mapping through): "forward" Y = X Wᵀ, "d_x" dX = dY W, "d_W" dW += dYᵀ X, with the adapter
// matrices in W's place. With T = bf16, u and g are rounded to bf16 before their next product, as a
// bf16 PEFT model rounds the output of lora_A; the parameter gradients stay f32.
// The mask kernel regenerates drop() from (seed, sequence, position, column) with the header's
// inline hash, so its bits equal the CPU's: one thread per element, f32 arithmetic, each output
// element rounded once; no reductions, so it is deterministic. Cost: a pass over [N, I] (and the
// [N, I] scratch) per dropout application: zero when dropout is off.
#include "engine/cuda/common.cuh"
#include "engine/cuda/gemm.cuh"
#include "engine/cuda/ops.h"
#include "engine/ops/lora_linear.h"

#include <algorithm>

namespace cw::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// dst (=|+=) drop(src) over [N, I] (see engine/ops/lora_linear.h for the mask).
template <class T>
__global__ void dropout_kernel(T* dst, const T* src, int64_t N, int64_t I, uint64_t seed, int64_t seq_rows,
                               int64_t pos0, int64_t row0, int64_t column0, int64_t sequence0, uint32_t threshold,
                               float inv_keep, bool accumulate) {
  const int64_t total = N * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = e / I, i = e - n * I, m = row0 + n;
    const uint64_t key = lora_dropout_row_key(seed, sequence0 + m / seq_rows, pos0 + m % seq_rows);
    float v = lora_dropout_keeps(key, column0 + i, threshold) ? to_f32(src[e]) * inv_keep : 0.0f;
    if (accumulate) v += to_f32(dst[e]);
    dst[e] = from_f32<T>(v);
  }
}

void dropout(const Tensor& dst, const Tensor& src, const LoraDropout& d, bool accumulate) {
  const int64_t N = src.size(0), I = src.size(1);
  if (N == 0 || I == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(blocks_for(N * I, kThreads), kMaxBlocks));
  const uint32_t threshold = lora_dropout_threshold(d.p);
  const float inv_keep = static_cast<float>(1.0 / (1.0 - d.p));
  dispatch_compute(src.dtype, "lora_linear dropout", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dropout_kernel<T><<<blocks, kThreads, 0, current_stream(src.device.index)>>>(
        dptr<T>(dst), dptr<const T>(src), N, I, d.seed, d.seq_rows, d.pos0, d.row0, d.column0, d.sequence0, threshold,
        inv_keep, accumulate);
    CW_KERNEL_CHECK();
  });
}

// linear.cu's three products, with alpha and beta. x [N, I], w [O, I] (row-major), y [N, O].
// Y (= beta Y +) alpha X Wᵀ
void product_forward(const Tensor& y, const Tensor& x, const Tensor& w, float alpha, float beta) {
  const int64_t N = x.size(0), I = x.size(1), O = w.size(0);
  matmul(x.device.index, O, N, I, /*trans_a=*/true, /*trans_b=*/false, w.data, I, x.data, I, y.data, O, x.dtype,
         x.dtype, beta, y, alpha);
}
// dX (= beta dX +) alpha dY W, with dY [N, O], W [O, I], dX [N, I]
void product_d_x(const Tensor& d_x, const Tensor& d_y, const Tensor& w, float alpha, float beta) {
  const int64_t N = d_y.size(0), O = w.size(0), I = w.size(1);
  matmul(d_y.device.index, I, N, O, /*trans_a=*/false, /*trans_b=*/false, w.data, I, d_y.data, O, d_x.data, I,
         d_y.dtype, d_y.dtype, beta, d_x, alpha);
}
// dW (f32) += alpha dYᵀ X, with dY [N, O], X [N, I], dW [O, I]
void product_d_w(const Tensor& d_w, const Tensor& d_y, const Tensor& x, float alpha) {
  const int64_t N = x.size(0), I = x.size(1), O = d_y.size(1);
  matmul(x.device.index, I, O, N, /*trans_a=*/false, /*trans_b=*/true, x.data, I, d_y.data, O, d_w.data, I, x.dtype,
         DType::f32, 1.0f, d_w, alpha);
}

void check_compute_dtype(const Tensor& x) {
  CW_CHECK(x.dtype == DType::bf16 || x.dtype == DType::f32,
           "lora_linear x: the GPU linear takes bf16 or f32, got {}", dtype_name(x.dtype));
}

// drop(x): x itself without dropout, else a masked copy in scratch.
Tensor dropped_input(const Tensor& x, const LoraDropout& d, Arena& scratch) {
  if (d.p == 0.0) return x;
  const Tensor xd = scratch.alloc(x.dtype, {x.size(0), x.size(1)});
  dropout(xd, x, d, false);
  return xd;
}

}  // namespace

void lora_linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight, const LoraAdapter& adapter,
                         Arena& scratch) {
  check_compute_dtype(x);
  ArenaScope scope(scratch);
  const float s = static_cast<float>(adapter.scale);
  product_forward(out, x, weight, 1.0f, 0.0f);
  const Tensor xd = dropped_input(x, adapter.dropout, scratch);
  const Tensor u = scratch.alloc(x.dtype, {x.size(0), adapter.a.size(0)});
  product_forward(u, xd, adapter.a, 1.0f, 0.0f);
  product_forward(out, u, adapter.b, s, 1.0f);
}

void lora_linear_backward(const Tensor& d_x, const Tensor& d_a, const Tensor& d_b, const Tensor& d_out,
                          const Tensor& x, const Tensor& weight, const LoraAdapter& adapter, GradMode mode,
                          Arena& scratch) {
  check_compute_dtype(x);
  ArenaScope scope(scratch);
  const int64_t N = x.size(0), r = adapter.a.size(0);
  const float s = static_cast<float>(adapter.scale);
  const Tensor xd = dropped_input(x, adapter.dropout, scratch);
  const Tensor g = scratch.alloc(x.dtype, {N, r});
  product_d_x(g, d_out, adapter.b, s, 0.0f);  // g = s d_out B
  if (d_b.data) {
    const Tensor u = scratch.alloc(x.dtype, {N, r});
    product_forward(u, xd, adapter.a, 1.0f, 0.0f);
    product_d_w(d_b, d_out, u, s);
  }
  if (d_a.data) product_d_w(d_a, g, xd, 1.0f);
  if (d_x.data) {
    product_d_x(d_x, d_out, weight, 1.0f, mode == GradMode::accumulate ? 1.0f : 0.0f);
    if (adapter.dropout.p == 0.0) {
      product_d_x(d_x, g, adapter.a, 1.0f, 1.0f);
    } else {
      const Tensor ga = scratch.alloc(x.dtype, {N, x.size(1)});
      product_d_x(ga, g, adapter.a, 1.0f, 0.0f);
      dropout(d_x, ga, adapter.dropout, true);
    }
  }
}

}  // namespace cw::gpu
