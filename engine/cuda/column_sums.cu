// The fixed-order sum of row-block partials (engine/cuda/column_sums.cuh).
#include "engine/cuda/column_sums.cuh"

#include "engine/cuda/common.cuh"

namespace cw::gpu {

namespace {

constexpr int kCols = 32;   // columns per block: one warp's coalesced read of a partials row
constexpr int kLanes = 16;  // row blocks summed in parallel per column, then added in lane order

__global__ void __launch_bounds__(kCols * kLanes)
    add_partial_sums_kernel(float* d, const float* partials, int64_t row_blocks, int64_t C) {
  __shared__ float lane_sum[kLanes][kCols];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  float s = 0.0f;
  if (c < C) {
    for (int64_t b = threadIdx.y; b < row_blocks; b += kLanes) s += partials[b * C + c];
  }
  lane_sum[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
#pragma unroll
    for (int l = 0; l < kLanes; ++l) t += lane_sum[l][threadIdx.x];
    d[c] += t;
  }
}

}  // namespace

void add_partial_sums(float* d, const float* partials, int64_t row_blocks, int64_t C, cudaStream_t stream) {
  if (C == 0) return;
  add_partial_sums_kernel<<<blocks_for(C, kCols), dim3(kCols, kLanes), 0, stream>>>(d, partials, row_blocks, C);
  CW_KERNEL_CHECK();
}

}  // namespace cw::gpu
