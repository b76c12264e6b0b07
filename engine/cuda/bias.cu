// GPU bias of a linear, forward and backward (the math of engine/ops/bias.h).
//
// Dtypes: x, out, b, d_out in the compute dtype T (f32 or bf16); d_bias f32, accumulated. Arithmetic
// is f32; each output element is rounded once.
//
// forward: one thread per element in a grid-stride loop; out may alias x (each thread reads its
//   element before writing it). Memory bound: x read once, out written once, b from L1/L2.
// backward: the column sums of d_out [N, O] in two kernels with a fixed order, as rmsnorm.cu sums
//   d_weight: partials[blk, o] = the sum of rows [blk * rows_per_block, +rows_per_block) (one thread
//   per column, consecutive threads on consecutive columns: coalesced), then d_bias[o] += the
//   partials' sum over blk by add_partial_sums (engine/cuda/column_sums.cuh). rows_per_block =
//   max(64, ceil(N / kMaxRowBlocks)): a function of N only, so the result is bitwise reproducible;
//   no atomics.
// Scratch: the partials [row_blocks, O] f32 from `scratch` inside an ArenaScope (released when this
// returns, safe because later users of the arena launch on the same stream).
// Nothing synchronises; everything runs on current_stream(device) of the operands' device.
#include "engine/cuda/column_sums.cuh"
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"

#include <algorithm>
#include <cstdint>

namespace cw::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;
constexpr int64_t kMaxRowBlocks = 512;
constexpr int64_t kMinRowsPerBlock = 64;

template <class T>
__global__ void bias_forward_kernel(T* out, const T* x, const T* b, int64_t n, int64_t O) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_f32<T>(to_f32(x[i]) + to_f32(b[i % O]));
}

template <class T>
__global__ void bias_partial_kernel(float* partials, const T* dy, int64_t N, int64_t O, int64_t rows_per_block) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= O) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t n1 = n0 + rows_per_block < N ? n0 + rows_per_block : N;
  float s = 0.0f;
  for (int64_t n = n0; n < n1; ++n) s += to_f32(dy[n * O + o]);
  partials[static_cast<int64_t>(blockIdx.y) * O + o] = s;
}

}  // namespace

// The op's contract is checked by the public entry (engine/ops/bias.cpp); here only this backend's
// own limits: f32 or bf16, the grid.
void bias_forward(const Tensor& out, const Tensor& x, const Tensor& bias) {
  const int64_t n = x.numel(), O = x.size(1);
  if (n == 0) return;
  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, "bias_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(blocks_for(n, kThreads), kMaxBlocks));
    bias_forward_kernel<T><<<blocks, kThreads, 0, stream>>>(dptr<T>(out), dptr<const T>(x), dptr<const T>(bias), n, O);
    CW_KERNEL_CHECK();
  });
}

void bias_backward(const Tensor& d_bias, const Tensor& d_out, Arena& scratch) {
  const int64_t N = d_out.size(0), O = d_out.size(1);
  if (N == 0 || O == 0) return;
  cudaStream_t stream = current_stream(d_out.device.index);
  const int64_t rows_per_block = std::max(kMinRowsPerBlock, (N + kMaxRowBlocks - 1) / kMaxRowBlocks);
  const int64_t row_blocks = (N + rows_per_block - 1) / rows_per_block;
  ArenaScope scope(scratch);
  const Tensor partials = scratch.alloc(DType::f32, {row_blocks, O});
  dispatch_compute(d_out.dtype, "bias_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const dim3 grid(blocks_for(O, kThreads), static_cast<unsigned>(row_blocks));
    bias_partial_kernel<T><<<grid, kThreads, 0, stream>>>(dptr<float>(partials), dptr<const T>(d_out), N, O,
                                                         rows_per_block);
    CW_KERNEL_CHECK();
  });
  add_partial_sums(dptr<float>(d_bias), dptr<const float>(partials), row_blocks, O, stream);
}

}  // namespace cw::gpu
