// GPU RMSNorm forward and backward (the math of engine/ops/rmsnorm.h).
// The weight enters every kernel as (offset + w) in f32: offset 0 for Llama's norm, 1 for Gemma's.
//
// Dtypes: x, w, out, d_out, d_x in the compute dtype T (f32 or bf16); saved rstd [N] f32; d_weight
// [C] f32 and always accumulated, or undefined (a frozen norm: only d_x). Arithmetic is f32; each T
// output is rounded once.
//
// Memory traffic (the floor these kernels aim at): the forward reads x once and writes out once
// (+ rstd, N floats); the backward reads x and d_out once and writes d_x once (+ reads d_x in
// accumulate mode), plus the d_weight partials (row_blocks x C f32, written once and read once:
// 512 x C x 8 bytes, a few percent of the row traffic at realistic N). w is C elements, read from
// L1/L2.
//
// Two paths, chosen on the host per call:
//   Vector path (the fast one): every pointer 16-byte aligned and C a multiple of the vector width
//     kN (8 bf16 or 4 f32 = 16 bytes), and C <= kN * kVecs * max threads (forward 32768 bf16 /
//     16384 f32; backward 8192). Each row is split into 16-byte
//     vectors; thread t of a row's block owns vectors t, t + threads, ..., t + (kVecs - 1) threads
//     (a warp's access is 512 contiguous bytes: coalesced, one 128-bit instruction per vector) and
//     keeps them in registers (as raw 16-byte words, converted to f32 on use), so x is read from
//     global memory once: sum of squares, block reduction, then scale and write from registers.
//     `threads` = C / kN / kVecs rounded up to a warp, a function of C only (kVecs: forward 4
//     vectors; backward 16 elements, i.e. 2 bf16 or 4 f32 vectors).
//     forward: one block per row (grid = N). Small blocks (64 or 128 threads for C = 2048) let up
//       to 32 rows be resident per SM, i.e. tens of KB of loads in flight per SM, which is what it
//       takes to cover the DRAM latency; blocks are short, so the tail of the grid is short too.
//     backward: one fused kernel. Block b owns the fixed row range [b * rows_per_block, +rows_per_
//       block) (rows_per_block = max(4, ceil(N / 512)): a function of N only, at most 512 blocks,
//       so the partials stay small; at C = 2048, 128-thread blocks of 99 (bf16) / 127 (f32)
//       registers fit 5 / 4 per SM, so all 512 are resident at once on 132 SMs: one wave). For each row
//       it loads x and d_out once into registers (the next row's loads are issued before this
//       row's reduction, so loads stay in flight across the barrier), reduces sum_c d_out w x,
//       writes d_x from registers, and adds d_out x r into per-thread f32 d_weight accumulators
//       (its columns, rows in order). At the end it writes partials[b, its columns] (vector
//       stores). So x and d_out are read once in total for both d_x and d_weight.
//   Scalar path (odd C, unaligned views, huge C): the original kernels: one block of kRowThreads
//     (256) threads per row striding over the columns with scalar coalesced loads (the row is read
//     twice; the second read mostly hits L1/L2); the d_weight partials by a separate kernel with
//     one thread per column and rows_per_block = max(64, ceil(N / 65535)) rows per block, run
//     before the d_x kernel.
//   Both paths then add the partials' sums over row blocks into d_weight with add_partial_sums
//     (engine/cuda/column_sums.cuh: 16 lanes per column, each summing row blocks in order, then
//     the lanes in order; enough blocks and threads to keep the loads of a 512 x C array in
//     flight; the order is fixed).
// rstd = 1 / sqrtf(mean + eps) with IEEE division and square root (not rsqrtf), so f32 results
// track the CPU to a few ulps.
// Determinism: every sum has a fixed order that depends only on N, C and the path (not on the GPU or
// on timing): block reductions go through a fixed shuffle tree over a block size that is a function
// of C, rows_per_block is a function of N, and there are no atomics. Results are bitwise
// reproducible on a given GPU architecture and build for the same shapes and the same path (the
// path depends on C and on the operands' 16-byte alignment).
// Aliasing: out must not alias x (the op entry checks it). d_x may alias d_out: on the scalar path the
// d_weight partials are computed before d_x is written; on the vector path each d_x row is written
// only by the block that owns the row, after the row's block reduction, which is a barrier that
// every thread reaches only after it has loaded its part of that row of d_out and x (and the next
// row's prefetch only touches a row no thread has written yet). No pointer is __restrict__.
// Scratch: the partials come from `scratch` (a GPU arena) inside an ArenaScope; the arena's memory
// is handed back when this function returns, while the kernels may still be running. That is safe
// because everything that later reuses the arena launches on the same stream, after these kernels.
// Nothing synchronises; everything runs on current_stream(device) of x's device.
#include "engine/cuda/column_sums.cuh"
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace cw::gpu {

namespace {

constexpr int kRowThreads = 256;  // threads per row block (a multiple of 32, at most 1024)
constexpr int kColThreads = 256;  // columns per block in the d_weight kernels
constexpr int64_t kMinRowsPerBlock = 64;
constexpr int64_t kMaxRowBlocks = 65535;  // gridDim.y limit
// Vector path: 16-byte vectors per thread kept in registers (so at most kVecs * max threads vectors
// per row), and the fixed row blocking of the fused backward.
constexpr int kFwdVecs = 4;                  // forward: 4 vectors (64 bytes of x) per thread
// Backward: 16 elements per thread (4 f32 or 2 bf16 vectors) each of x, d_out, the next row's x
// and d_out, and w, plus 16 f32 d_weight sums: ~100-130 registers per thread. Capping its blocks
// at 512 threads lets it use up to 128 registers without spilling; so the vector backward takes
// C <= 16 * 512 = 8192.
constexpr int kBwdElems = 16;
constexpr int kBwdMaxThreads = 512;
constexpr int kFwdMaxThreads = 1024;
constexpr int64_t kVecMinRowsPerBlock = 4;   // backward rows per block: at least this many
constexpr int64_t kVecTargetRowBlocks = 512; // ... and at most about this many row blocks

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

// Forward, vector path: one block of `threads` (= blockDim.x) per row; thread t owns the row's
// vectors t + j * threads, j < kVecs (those < nvec = C / kN), loaded once into registers.
template <class T, int kVecs>
__global__ void __launch_bounds__(kFwdMaxThreads)
    rmsnorm_forward_vec_kernel(T* y, float* rstd, const T* x, const T* w, int64_t C, int nvec, float eps,
                               float offset) {
  using V = Vec16<T>;
  constexpr int kN = V::kN;
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const T* xr = x + n * C;
  T* yr = y + n * C;
  V xv[kVecs], wv[kVecs];
  // Issue every load (x from DRAM, w from L1/L2) before the reduction so they are in flight together.
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
    if (v < nvec) {
      xv[j].load(xr + static_cast<int64_t>(v) * kN);
      wv[j].load_ro(w + static_cast<int64_t>(v) * kN);
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
    if (v < nvec) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float a = xv[j].get(k);
        sum_sq += a * a;
      }
    }
  }
  sum_sq = block_sum(sum_sq, red);
  const float r = 1.0f / sqrtf(sum_sq / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
    if (v < nvec) {
      float o[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) o[k] = xv[j].get(k) * r * (offset + wv[j].get(k));
      V::pack(o).store(yr + static_cast<int64_t>(v) * kN);
    }
  }
}

// Backward, vector path, fused: block b owns rows [b * rows_per_block, min(N, +rows_per_block)) and,
// in each, thread t owns vectors t + j * threads (as in the forward). Per row: d_x (overwrite or
// accumulate) from registers, and d_out x r added into the thread's f32 accumulators in row order;
// at the end partials[b, c] = those sums for the thread's columns.
template <class T, int kVecs>
__global__ void __launch_bounds__(kBwdMaxThreads)
    rmsnorm_backward_vec_kernel(T* dx, float* partials, const T* dy, const T* x, const T* w, const float* rstd,
                                int64_t N, int64_t C, int nvec, int64_t rows_per_block, bool accumulate,
                                float offset) {
  using V = Vec16<T>;
  constexpr int kN = V::kN;
  __shared__ float red[32];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;  // < N: row_blocks = ceil(N / rpb)
  const int64_t n1 = n0 + rows_per_block < N ? n0 + rows_per_block : N;
  const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);

  V wv[kVecs], xc[kVecs], dc[kVecs];  // weight; this row's x and d_out
  float acc[kVecs][kN];               // d_weight sums of this block's rows, the thread's columns
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = tid + j * nthreads;
#pragma unroll
    for (int k = 0; k < kN; ++k) acc[j][k] = 0.0f;
    if (v < nvec) {
      const int64_t off = n0 * C + static_cast<int64_t>(v) * kN;
      wv[j].load_ro(w + static_cast<int64_t>(v) * kN);
      xc[j].load(x + off);
      dc[j].load(dy + off);
    }
  }

  for (int64_t n = n0; n < n1; ++n) {
    // Prefetch the next row of the block (no thread has written it: d_x rows are written only after
    // their own reduction barrier), so its loads overlap this row's reduction and stores.
    V xn[kVecs], dn[kVecs];
    const bool has_next = n + 1 < n1;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int v = tid + j * nthreads;
      if (has_next && v < nvec) {
        const int64_t off = (n + 1) * C + static_cast<int64_t>(v) * kN;
        xn[j].load(x + off);
        dn[j].load(dy + off);
      }
    }
    const float r = rstd[n];
    float dot = 0.0f;  // sum_c d_out w x; times r / C below gives mean_c(g xhat)
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int v = tid + j * nthreads;
      if (v < nvec) {
#pragma unroll
        for (int k = 0; k < kN; ++k) dot += dc[j].get(k) * (offset + wv[j].get(k)) * xc[j].get(k);
      }
    }
    dot = block_sum(dot, red);  // also a barrier: the block has read this row of d_out before any d_x write
    const float mean_dot = dot * r / static_cast<float>(C);
    T* dxr = dx + n * C;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int v = tid + j * nthreads;
      if (v < nvec) {
        V old;
        if (accumulate) old.load(dxr + static_cast<int64_t>(v) * kN);
        float o[kN];
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          const float xk = xc[j].get(k), dyk = dc[j].get(k);
          const float xhat = xk * r;
          float g = r * (dyk * (offset + wv[j].get(k)) - xhat * mean_dot);
          if (accumulate) g = old.get(k) + g;
          o[k] = g;
          acc[j][k] += dyk * (xk * r);
        }
        V::pack(o).store(dxr + static_cast<int64_t>(v) * kN);
      }
    }
    if (has_next) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) xc[j] = xn[j], dc[j] = dn[j];
    }
  }

  // partials row b: 16-byte aligned (partials base aligned, C a multiple of kN >= 4 floats).
  float* pr = partials + static_cast<int64_t>(blockIdx.x) * C;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = tid + j * nthreads;
    if (v < nvec) {
#pragma unroll
      for (int q = 0; q < kN / 4; ++q) {
        *reinterpret_cast<float4*>(pr + static_cast<int64_t>(v) * kN + 4 * q) =
            make_float4(acc[j][4 * q], acc[j][4 * q + 1], acc[j][4 * q + 2], acc[j][4 * q + 3]);
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_forward_kernel(T* y, float* rstd, const T* x, const T* w, int64_t C, float eps, float offset) {
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
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    yr[c] = from_f32<T>(to_f32(xr[c]) * r * (offset + to_f32(w[c])));
}

// d_x[n,:] = r (g - xhat mean_c(g xhat)), g = d_out (offset + w), xhat = x r; overwrite or accumulate.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_backward_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const float* rstd, int64_t C,
                               bool accumulate, float offset) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const T* xr = x + n * C;
  const T* dyr = dy + n * C;
  T* dxr = dx + n * C;
  const float r = rstd[n];
  float dot = 0.0f;  // sum_c d_out w x; times r / C below gives mean_c(g xhat)
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dot += to_f32(dyr[c]) * (offset + to_f32(w[c])) * to_f32(xr[c]);
  dot = block_sum(dot, red);  // also a barrier: every thread has read its d_out before any d_x write
  const float mean_dot = dot * r / static_cast<float>(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = to_f32(xr[c]) * r;
    float g = r * (to_f32(dyr[c]) * (offset + to_f32(w[c])) - xhat * mean_dot);
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

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; }

// Threads per row block on the vector path for nvec vectors per row and `vecs` per thread: enough
// threads to cover the row, rounded up to a warp; 0 when that exceeds max_threads (the row does
// not fit in registers: use the scalar path).
int vec_threads(int64_t nvec, int vecs, int max_threads) {
  const int64_t t = (nvec + vecs - 1) / vecs;
  if (t > max_threads) return 0;
  return static_cast<int>(std::max<int64_t>(32, (t + 31) / 32 * 32));
}

}  // namespace

// The op's contract (shapes, dtypes, layout, device, aliasing) is checked by the public entry
// (engine/ops/rmsnorm.cpp); what is checked here is this backend's own: f32 or bf16, the grid.
void rmsnorm_forward(const Tensor& out, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight, double eps,
                     double weight_offset) {
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0) return;
  CW_CHECK(N <= 0x7fffffff, "rmsnorm_forward: {} rows exceed the grid", N);
  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, "rmsnorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kN = Vec16<T>::kN;
    const int threads = C % kN == 0 ? vec_threads(C / kN, kFwdVecs, kFwdMaxThreads) : 0;
    if (threads > 0 && aligned16(out) && aligned16(x) && aligned16(weight)) {
      rmsnorm_forward_vec_kernel<T, kFwdVecs><<<static_cast<unsigned>(N), threads, 0, stream>>>(
          dptr<T>(out), dptr<float>(saved.rstd), dptr<const T>(x), dptr<const T>(weight), C,
          static_cast<int>(C / kN), static_cast<float>(eps), static_cast<float>(weight_offset));
    } else {
      rmsnorm_forward_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
          dptr<T>(out), dptr<float>(saved.rstd), dptr<const T>(x), dptr<const T>(weight), C,
          static_cast<float>(eps), static_cast<float>(weight_offset));
    }
    CW_KERNEL_CHECK();
  });
}

void rmsnorm_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const RmsNormSaved& saved,
                      const Tensor& x, const Tensor& weight, GradMode mode, Arena& scratch, double weight_offset) {
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0 || C == 0) return;  // nothing to add to d_weight, no d_x rows
  CW_CHECK(N <= 0x7fffffff, "rmsnorm_backward: {} rows exceed the grid", N);

  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, "rmsnorm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kN = Vec16<T>::kN;
    constexpr int kBwdVecs = kBwdElems / kN;
    const int threads = C % kN == 0 ? vec_threads(C / kN, kBwdVecs, kBwdMaxThreads) : 0;
    const bool vec = threads > 0 && aligned16(d_x) && aligned16(d_out) && aligned16(x) && aligned16(weight);

    // Row blocks of the d_weight partials: a function of N (and the path) only, so the summation
    // order is too.
    const int64_t rows_per_block =
        vec ? std::max(kVecMinRowsPerBlock, (N + kVecTargetRowBlocks - 1) / kVecTargetRowBlocks)
            : std::max(kMinRowsPerBlock, (N + kMaxRowBlocks - 1) / kMaxRowBlocks);
    const int64_t row_blocks = (N + rows_per_block - 1) / rows_per_block;

    ArenaScope scope(scratch);
    const Tensor partials = scratch.alloc(DType::f32, {row_blocks, C});

    if (vec && aligned16(partials)) {
      // One pass: d_x and the partials from a single read of x and d_out. A frozen norm (no
      // d_weight) still gets its partials written, a small [row_blocks, C] scratch, and not summed:
      // the one-pass kernel stays the one fast path.
      rmsnorm_backward_vec_kernel<T, kBwdVecs><<<static_cast<unsigned>(row_blocks), threads, 0, stream>>>(
          dptr<T>(d_x), dptr<float>(partials), dptr<const T>(d_out), dptr<const T>(x), dptr<const T>(weight),
          dptr<const float>(saved.rstd), N, C, static_cast<int>(C / kN), rows_per_block,
          mode == GradMode::accumulate, static_cast<float>(weight_offset));
      CW_KERNEL_CHECK();
      if (d_weight.data) {
        add_partial_sums(dptr<float>(d_weight), dptr<const float>(partials), row_blocks, C, stream);
      }
    } else {
      const unsigned col_blocks = blocks_for(C, kColThreads);
      // d_weight first: it reads d_out and x, which d_x may alias.
      if (d_weight.data) {
        rmsnorm_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(row_blocks)), kColThreads, 0, stream>>>(
            dptr<float>(partials), dptr<const T>(d_out), dptr<const T>(x), dptr<const float>(saved.rstd), N, C,
            rows_per_block);
        CW_KERNEL_CHECK();
        add_partial_sums(dptr<float>(d_weight), dptr<const float>(partials), row_blocks, C, stream);
      }
      rmsnorm_backward_dx_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
          dptr<T>(d_x), dptr<const T>(d_out), dptr<const T>(x), dptr<const T>(weight), dptr<const float>(saved.rstd),
          C, mode == GradMode::accumulate, static_cast<float>(weight_offset));
      CW_KERNEL_CHECK();
    }
  });
}

}  // namespace cw::gpu
