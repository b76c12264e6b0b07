// GPU RMSNorm forward and backward (the math of engine/ops/rmsnorm.h).
//
// Dtypes: x, w, out, d_out, d_x in the compute dtype T (f32 or bf16); saved rstd [N] f32; d_weight
// [C] f32 and always accumulated. Arithmetic is f32; each T output is rounded once.
//
// Launch shapes:
//   forward, backward d_x: one block of kRowThreads (256) threads per row; the threads stride over
//     the row's C columns (coalesced scalar loads) and reduce through warp shuffles and a 32-float
//     shared array. rstd = 1 / sqrtf(mean + eps) with IEEE division and square root (not rsqrtf),
//     so f32 results track the CPU to a few ulps. A faster version would use 16-byte vector loads
//     and keep the row in registers between the reduction and the write (here the row is read
//     twice; the second read mostly hits L1/L2).
//   backward d_weight: two kernels. The first gives each block kColThreads columns (one thread per
//     column) and a fixed range of `rows_per_block` rows, which it sums in row order into
//     partials[block_row, c] (scratch, f32 [num_row_blocks, C]); the second has one thread per
//     column summing the partials over row blocks in order and adding the total into d_weight.
//     A faster version would fuse the partial sums into the d_x kernel (one read of x and d_out).
// Determinism: every sum has a fixed order that depends only on N and C (not on the GPU or on
// timing): block reductions go through a fixed shuffle tree, rows_per_block is a function of N, and
// there are no atomics. Results are bitwise reproducible on a given GPU architecture and build.
// Aliasing: out must not alias x (as on the CPU). In the backward the d_weight partials are computed
// before d_x is written, so d_x may alias d_out (each d_x row is written only after the block has
// read the whole row of d_out for its reduction).
// Scratch: the partials come from `scratch` (a GPU arena) inside an ArenaScope; the arena's memory
// is handed back when this function returns, while the kernels may still be running. That is safe
// because everything that later reuses the arena launches on the same stream, after these kernels.
// Nothing synchronises; everything runs on current_stream(device) of x's device.
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"

#include <algorithm>
#include <type_traits>

namespace cw::gpu {

namespace {

constexpr int kRowThreads = 256;  // threads per row block (a multiple of 32, at most 1024)
constexpr int kColThreads = 256;  // columns per block in the d_weight kernels
constexpr int64_t kMinRowsPerBlock = 64;
constexpr int64_t kMaxRowBlocks = 65535;  // gridDim.y limit

template <class F> void dispatch_compute(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: f(std::type_identity<float>{}); return;
    case DType::bf16: f(std::type_identity<__nv_bfloat16>{}); return;
    default:
      fail(CW_FORMAT("{} on the GPU supports f32 and bf16, not {}", op, dtype_name(dtype)),
           "choose --dtype bf16 or f32 for GPU runs");
  }
}

void check_gpu(const Tensor& t, const Tensor& ref, const char* what) {
  CW_CHECK(!t.device.is_cpu(), "{} is on {}; the GPU op needs it on a GPU", what, device_name(t.device));
  check_same_device(t, ref, what, "rmsnorm x");
  check_contiguous(t, what);
}

template <class T> T* dptr(const Tensor& t) { return static_cast<T*>(t.data); }

// Sum of v over the block (blockDim.x a multiple of 32), returned to every thread. `shared` holds
// 32 floats. The order of additions is fixed by the thread layout, so the result is deterministic.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    float w = lane < warps ? shared[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    if (lane == 0) shared[0] = w;
  }
  __syncthreads();
  const float total = shared[0];
  __syncthreads();  // shared may be reused by a following block_sum
  return total;
}

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_forward_kernel(T* y, float* rstd, const T* x, const T* w, int64_t C, float eps) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const T* xr = x + n * C;
  T* yr = y + n * C;
  float sum_sq = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float v = to_f32(xr[c]);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, red);
  const float r = 1.0f / sqrtf(sum_sq / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) yr[c] = from_f32<T>(to_f32(xr[c]) * r * to_f32(w[c]));
}

// d_x[n,:] = r (g - xhat mean_c(g xhat)), g = d_out w, xhat = x r; overwrite or accumulate.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_backward_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const float* rstd, int64_t C,
                               bool accumulate) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const T* xr = x + n * C;
  const T* dyr = dy + n * C;
  T* dxr = dx + n * C;
  const float r = rstd[n];
  float dot = 0.0f;  // sum_c d_out w x; times r / C below gives mean_c(g xhat)
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += to_f32(dyr[c]) * to_f32(w[c]) * to_f32(xr[c]);
  dot = block_sum(dot, red);  // also a barrier: every thread has read its d_out before any d_x write
  const float mean_dot = dot * r / static_cast<float>(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = to_f32(xr[c]) * r;
    float g = r * (to_f32(dyr[c]) * to_f32(w[c]) - xhat * mean_dot);
    if (accumulate) g = to_f32(dxr[c]) + g;
    dxr[c] = from_f32<T>(g);
  }
}

// partials[blockIdx.y, c] = sum over rows [blockIdx.y * rows_per_block, +rows_per_block) of d_out x r.
template <class T>
__global__ void __launch_bounds__(kColThreads)
    rmsnorm_dw_partial_kernel(float* partials, const T* dy, const T* x, const float* rstd, int64_t N, int64_t C,
                              int64_t rows_per_block) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t n1 = n0 + rows_per_block < N ? n0 + rows_per_block : N;
  float s = 0.0f;
  for (int64_t n = n0; n < n1; ++n) s += to_f32(dy[n * C + c]) * (to_f32(x[n * C + c]) * rstd[n]);
  partials[static_cast<int64_t>(blockIdx.y) * C + c] = s;
}

// d_weight[c] += sum_b partials[b, c], b in order.
__global__ void __launch_bounds__(kColThreads)
    sum_partials_kernel(float* dw, const float* partials, int64_t row_blocks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int64_t b = 0; b < row_blocks; ++b) s += partials[b * C + c];
  dw[c] += s;
}

void check_operands(const Tensor& y, const RmsNormSaved& saved, const Tensor& x, const Tensor& w, const char* op) {
  CW_CHECK(x.ndim == 2, "{}: x must be [N, C], got {}", op, x.describe());
  const int64_t N = x.size(0), C = x.size(1);
  check_shape(y, {N, C}, "rmsnorm out / d_x");
  check_shape(w, {C}, "rmsnorm weight");
  check_shape(saved.rstd, {N}, "rmsnorm saved rstd");
  check_dtype(y, x.dtype, "rmsnorm out / d_x");
  check_dtype(w, x.dtype, "rmsnorm weight");
  check_dtype(saved.rstd, DType::f32, "rmsnorm saved rstd (f32 on the GPU)");
  check_gpu(x, x, "rmsnorm x");
  check_gpu(y, x, "rmsnorm out / d_x");
  check_gpu(w, x, "rmsnorm weight");
  check_gpu(saved.rstd, x, "rmsnorm saved rstd");
}

}  // namespace

void rmsnorm_forward(const Tensor& out, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight, double eps) {
  check_operands(out, saved, x, weight, "rmsnorm_forward");
  CW_CHECK(out.data != x.data || out.empty(), "rmsnorm_forward: out must not alias x (the backward reads x)");
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0) return;
  CW_CHECK(N <= 0x7fffffff, "rmsnorm_forward: {} rows exceed the grid", N);
  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, "rmsnorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rmsnorm_forward_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        dptr<T>(out), dptr<float>(saved.rstd), dptr<const T>(x), dptr<const T>(weight), C, static_cast<float>(eps));
    CW_KERNEL_CHECK();
  });
}

void rmsnorm_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const RmsNormSaved& saved,
                      const Tensor& x, const Tensor& weight, GradMode mode, Arena& scratch) {
  check_operands(d_x, saved, x, weight, "rmsnorm_backward");
  check_same_shape(d_out, x, "rmsnorm d_out", "rmsnorm x");
  check_same_shape(d_weight, weight, "rmsnorm d_weight", "rmsnorm weight");
  check_dtype(d_out, x.dtype, "rmsnorm d_out");
  check_dtype(d_weight, DType::f32, "rmsnorm d_weight (f32 on the GPU)");
  check_gpu(d_out, x, "rmsnorm d_out");
  check_gpu(d_weight, x, "rmsnorm d_weight");
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0 || C == 0) return;  // nothing to add to d_weight, no d_x rows
  CW_CHECK(N <= 0x7fffffff, "rmsnorm_backward: {} rows exceed the grid", N);

  // Row blocks of the d_weight partials: a function of N only (so the summation order is too).
  const int64_t rows_per_block = std::max(kMinRowsPerBlock, (N + kMaxRowBlocks - 1) / kMaxRowBlocks);
  const int64_t row_blocks = (N + rows_per_block - 1) / rows_per_block;
  const unsigned col_blocks = blocks_for(C, kColThreads);

  ArenaScope scope(scratch);
  const Tensor partials = scratch.alloc(DType::f32, {row_blocks, C});
  CW_CHECK(partials.device == x.device, "rmsnorm_backward: the scratch arena is on {} but x is on {}",
           device_name(partials.device), device_name(x.device));

  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, "rmsnorm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // d_weight first: it reads d_out and x, which d_x may alias.
    rmsnorm_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(row_blocks)), kColThreads, 0, stream>>>(
        dptr<float>(partials), dptr<const T>(d_out), dptr<const T>(x), dptr<const float>(saved.rstd), N, C,
        rows_per_block);
    CW_KERNEL_CHECK();
    sum_partials_kernel<<<col_blocks, kColThreads, 0, stream>>>(dptr<float>(d_weight), dptr<const float>(partials),
                                                                row_blocks, C);
    CW_KERNEL_CHECK();
    rmsnorm_backward_dx_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        dptr<T>(d_x), dptr<const T>(d_out), dptr<const T>(x), dptr<const T>(weight), dptr<const float>(saved.rstd), C,
        mode == GradMode::accumulate);
    CW_KERNEL_CHECK();
  });
}

}  // namespace cw::gpu
