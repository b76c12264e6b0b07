// The second stage of a deterministic column sum, shared by the backward kernels that reduce a
// gradient over rows (RMSNorm's d_weight, a bias's d_bias): each first writes
// partials[b, c] = the sum of column c over its fixed row block b (rows [b * rows_per_block, ...)),
// then add_partial_sums adds those partials into the f32 gradient:
//   d[c] += sum over b < row_blocks of partials[b, c]
// in an order fixed by (row_blocks, C) alone: lane l of a block sums b = l, l + kLanes, ... in order,
// then lane 0 adds the lane sums in lane order. Each warp reads 32 consecutive floats of one partials
// row (coalesced). No atomics, so the result is bitwise reproducible across runs and GPUs.
// Shapes: partials [row_blocks, C] f32 (row-major), d [C] f32, accumulated. Runs on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cw::gpu {

void add_partial_sums(float* d, const float* partials, int64_t row_blocks, int64_t C, cudaStream_t stream);

}  // namespace cw::gpu
