// Internal to engine/cuda: the one cuBLASLt matmul every GPU GEMM goes through (engine/cuda/linear.cu).
//
// Column-major, as cuBLASLt sees buffers (a row-major [R, C] matrix with row stride C is the
// column-major [C, R] matrix with leading dimension C; linear.cu's header works the mapping through):
//   D[m, n] (cd) = alpha op(A)[m, k] (ab) · op(B)[k, n] (ab) + beta D,   f32 accumulation, f32 alpha/beta.
// ab: bf16 or f32 (f32 without TF32); cd: ab or f32. Plans (descriptor, layouts, algorithm) are
// cached per shape, transposes, leading dimensions, dtypes and pointer-alignment class, so a repeated
// call never re-queries the heuristic and gives the same bits. Runs on gpu::current_stream(device).
// `dst` is the tensor behind D (for k == 0, where the product is empty: D = beta D). alpha is a scalar
// of the call, not of the plan (LoRA's scale rides on it: engine/cuda/lora_linear.cu).
#pragma once

#include "engine/tensor.h"

#include <cstdint>

namespace cw::gpu {

void matmul(int device, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, const void* A, int64_t lda,
            const void* B, int64_t ldb, void* D, int64_t ldd, DType ab, DType cd, float beta, const Tensor& dst,
            float alpha = 1.0f);

}  // namespace cw::gpu
