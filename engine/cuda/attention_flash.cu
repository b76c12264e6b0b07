// Our own fused flash-style attention on the GPU: forward and backward of the op in
// engine/ops/attention.h (chunk-against-cache causal attention with grouped K/V heads).
//
// The math (per batch b, query head h, its K/V head g = h / (H / Hkv); query i sits at position
// p + i and sees keys j <= p + i, j < S = p + c):
//   s_ij = scale q_i . k_j,   lse_i = log sum_j exp(s_ij),   P_ij = exp(s_ij - lse_i),
//   out_i = sum_j P_ij v_j;
//   Delta_i = d_out_i . out_i,  dP_ij = d_out_i . v_j,  dS_ij = P_ij (dP_ij - Delta_i),
//   d_q_i = scale sum_j dS_ij k_j  (overwrite or accumulate),
//   d_k_j += scale sum_{h in group, i} dS_ij q_i,   d_v_j += sum_{h in group, i} P_ij d_out_i.
// Shapes: q, out, d_q, d_out [B, c, H, D] contiguous; k, v [B, S, Hkv, D] and d_k, d_v (f32, same
// shape) with any batch stride and a packed [S, Hkv, D] inner part. lse [B, H, c] f32, natural log.
// d_k, d_v are always ADDED into over all S keys (SeCO accumulates them over chunks).
//
// Online softmax (both paths): keys are visited in blocks; each query row keeps its running max m,
// its running sum l = sum_j exp(s_ij - m) and its unnormalised output o = sum_j exp(s_ij - m) v_j.
// A block with a larger max m' rescales l and o by exp(m - m') before adding its own terms, so after
// the last block out = o / l and lse = m + log l, without ever holding a row of scores. The backward
// recomputes P from q, k and the saved lse (nothing of size c x S is stored).
//
// Three families, named per call by the chooser:
//  * Tensor-core families (mma, wgmma): bf16 at head dim 64 or 128 with 16-byte aligned operands. FlashAttention-2
//    structure on mma.sync.m16n8k16 (bf16 inputs, f32 accumulation), ldmatrix from XOR-swizzled
//    shared memory (16-byte chunk c of row r stored at chunk c ^ (r & 7), so the 8 rows one ldmatrix
//    phase reads fall in 8 different bank groups) and cp.async double buffering: the next K/V (or
//    Q/dO) block is in flight while the current one is multiplied.
//      forward:  a CTA owns BR queries of one head; each warp owns MT x 16 query rows, keeps the
//                scores, the softmax state and O in registers; key blocks past the causal
//                diagonal are never visited, and only blocks that straddle it (or the end of the
//                keys) are masked.
//      backward: (a) delta_tc_kernel: Delta = rowsum(d_out * out) into f32 scratch [B, H, c];
//                (b) dK/dV: a CTA per (b, K/V head, block of 16 NW keys); each warp owns 16 keys
//                    and holds their dK, dV in registers while it loops over every (head of the
//                    group, query block) that can see those keys, computing S^T = K Q^T,
//                    dP^T = V dO^T, P^T, dS^T and the two products dV += P^T dO, dK += dS^T Q.
//                    At the end each element of d_k, d_v is read, added to and written by exactly
//                    one thread: the add is deterministic.
//                (c) dQ: a CTA per (b, head, query block) loops over the visible key blocks,
//                    recomputing S and dP, and accumulates dQ += dS K in registers; d_q is written
//                    once (overwrite or accumulate).
//                Two forms of (b) + (c), chosen by the caller's `deterministic`:
//                 * deterministic (two kernels, as above): the dQ kernel recomputes S and dP
//                   (7 products per tile instead of 5: 1.4x the matmul FLOPs, the exponentials
//                   twice) so that every sum has a fixed order and d_q is bitwise reproducible;
//                 * fused (the default, like FlashAttention-2): one dK/dV kernel of 8 warps
//                   (128 keys) also writes each step's dS^T tile to shared memory and, after a
//                   barrier, computes dQ += dS K for the tile (5 products per tile), adding it into
//                   an f32 [B, c, H, D] accumulator with 8-byte atomics (zeroed by the Delta
//                   kernel); dq_convert_kernel then writes d_q = scale * accumulator. The atomics
//                   add in a timing-dependent order: d_q varies in its last bits run to run (d_k,
//                   d_v keep one writer per element and stay bitwise reproducible).
//    The wgmma family (attention_flash_hopper.cu) runs the same algorithm and tiles' roles on
//    Hopper's warpgroup MMA; the chooser (engine/ops/attention.cpp) names the family per call.
//  * SIMT family: f32 (any even head dim up to 128) and bf16 at other head dims (the model
//    presets use 6 and 32) or with unaligned operands. Same online-softmax algorithm in plain f32
//    arithmetic, tiled through shared memory; it is the readable reference of the algorithm and the
//    f32 exactness path (expf/logf, not the approximate exp2 of the tensor-core path).
//
// Determinism: the forward, the generic path and the deterministic backward use no atomics (every
// sum has a fixed order given the shapes and the path); the fused backward's d_q does (above).
// Scratch: the backward's Delta [B, H, c] f32 and the fused backward's dQ accumulator [B, c, H, D]
// f32 come from `scratch` in an ArenaScope (later users of the arena launch on the same stream,
// after these kernels). Everything runs on current_stream(device).
#include "engine/cuda/attention_flash.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>

namespace cw::gpu {
namespace {
using namespace flash;

// ------------------------------------------------------------------------------------------------
// Delta_i = d_out_i . out_i, one warp per (b, i, h) row, f32 sums in a fixed shuffle order.
// ------------------------------------------------------------------------------------------------
constexpr int kDeltaWarps = 8;

template <class T> __global__ void delta_kernel(const Operands<T> a, const Problem pr) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kDeltaWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int64_t rows = static_cast<int64_t>(pr.B) * pr.c * pr.H;
  if (row >= rows) return;
  const T* o = a.out + row * pr.D;
  const T* dy = a.d_out + row * pr.D;
  float sum = 0.0f;
  for (int d = lane; d < pr.D; d += 32) sum += to_f32(o[d]) * to_f32(dy[d]);
  for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (lane == 0) {
    const int h = static_cast<int>(row % pr.H);
    const int64_t bi = row / pr.H;
    const int i = static_cast<int>(bi % pr.c), b = static_cast<int>(bi / pr.c);
    a.delta[stat_offset(pr, b, h, i)] = sum;
  }
}

// The tensor-core path's Delta (bf16, D = 64 or 128, 16-byte aligned rows): D / 8 threads per row,
// one 16-byte load of out and of d_out each, summed in a fixed shuffle order; the same threads zero
// the row of the fused backward's dQ accumulator.
template <int D> __global__ void delta_tc_kernel(const Operands<__nv_bfloat16> a, const Problem pr) {
  constexpr int kLanes = D / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / kLanes, rows = static_cast<int64_t>(pr.B) * pr.c * pr.H;
  const int part = static_cast<int>(idx % kLanes);
  const bool valid = row < rows;  // no early return: every lane takes part in the shuffles
  float sum = 0.0f;
  if (valid) {
    Vec16<__nv_bfloat16> o, dy;
    o.load(a.out + row * D + part * 8);
    dy.load(a.d_out + row * D + part * 8);
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += o.get(k) * dy.get(k);
  }
#pragma unroll
  for (int s = kLanes / 2; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (!valid) return;
  if (a.dq_accum != nullptr) {
    float4* z = reinterpret_cast<float4*>(a.dq_accum + row * D + part * 8);
    z[0] = z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if (part == 0) {
    const int h = static_cast<int>(row % pr.H);
    const int64_t bi = row / pr.H;
    const int i = static_cast<int>(bi % pr.c), b = static_cast<int>(bi / pr.c);
    a.delta[stat_offset(pr, b, h, i)] = sum;
  }
}

// ------------------------------------------------------------------------------------------------
// Generic SIMT path. A CTA of 128 threads owns a tile of kGenRows queries (forward, dQ) or
// kGenKeys keys (dK/dV). Each key (or query) tile is staged in shared memory as f32; the score
// tile kGenRows x kGenKeys is computed into shared memory (4 entries per thread, each a full dot
// product over D), then each thread updates the outputs it owns. K rows are padded to D + 1 floats
// so that the 32 lanes reading 32 different keys at the same d hit 32 different banks.
// ------------------------------------------------------------------------------------------------
constexpr int kGenThreads = 128;
constexpr int kGenRows = 16;                              // query rows per tile
constexpr int kGenKeys = 32;                              // keys per tile
constexpr int kGenRowThreads = kGenThreads / kGenRows;    // 8 threads share a query row
constexpr int kGenRowDims = 128 / kGenRowThreads;         // dims per thread (D <= 128)

// f(n, d) for the head dims d this thread owns in its row (d = part + n kGenRowThreads < D; n
// indexes the thread's register array).
template <class F> __device__ __forceinline__ void for_row_dims(int part, int D, F&& f) {
#pragma unroll
  for (int n = 0; n < kGenRowDims; ++n) {
    const int d = part + n * kGenRowThreads;
    if (d < D) f(n, d);
  }
}
constexpr int kGenKeyThreads = kGenThreads / kGenKeys;    // 4 threads share a key (dK/dV)
constexpr int kGenKeyDims = 128 / kGenKeyThreads;
constexpr int kGenScoreStride = kGenKeys + 1;
constexpr int kGenEntries = kGenRows * kGenKeys / kGenThreads;  // score entries per thread

size_t generic_forward_smem(int D) {
  return sizeof(float) * (kGenRows * D + kGenKeys * (D + 1) + kGenKeys * D + kGenRows * kGenScoreStride);
}
size_t generic_dq_smem(int D) {
  return sizeof(float) * (2 * kGenRows * D + 2 * kGenKeys * (D + 1) + kGenRows * kGenScoreStride);
}
size_t generic_dkdv_smem(int D) {
  return sizeof(float) * (2 * kGenRows * D + 2 * kGenKeys * (D + 1) + 2 * kGenRows * kGenScoreStride + 2 * kGenRows);
}

// rows x D of a [.., rows, .., D] operand into shared f32 (row stride `ld` floats); rows past
// `valid` become zeros.
template <class T>
__device__ void stage_rows(float* dst, int ld, const T* src, int64_t src_row, int rows, int valid, int D) {
  for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    dst[r * ld + d] = r < valid ? to_f32(src[r * src_row + d]) : 0.0f;
  }
}

// Forward: grid (query tiles, H, B).
template <class T> __global__ void __launch_bounds__(kGenThreads) generic_forward_kernel(const Operands<T> a, const Problem pr) {
  extern __shared__ float smem[];
  const int D = pr.D;
  float* sQ = smem;                          // [kGenRows][D]
  float* sK = sQ + kGenRows * D;             // [kGenKeys][D + 1]
  float* sV = sK + kGenKeys * (D + 1);       // [kGenKeys][D]
  float* sS = sV + kGenKeys * D;             // [kGenRows][kGenScoreStride]: scaled scores
  const int i0 = blockIdx.x * kGenRows, h = blockIdx.y, b = blockIdx.z, g = h / pr.group;
  const int tid = threadIdx.x, row = tid / kGenRowThreads, part = tid % kGenRowThreads;
  const T* kb = a.k + b * pr.k_batch + static_cast<int64_t>(g) * D;
  const T* vb = a.v + b * pr.v_batch + static_cast<int64_t>(g) * D;
  stage_rows(sQ, D, a.q + q_offset(pr, b, i0, h), pr.q_row, kGenRows, pr.c - i0, D);

  // The keys the tile's last valid query sees; later keys are masked for every row.
  const int key_end = min(pr.S, pr.p + min(i0 + kGenRows, pr.c));
  float o[kGenRowDims] = {};
  float m = -kInf, l = 0.0f;
  for (int j0 = 0; j0 < key_end; j0 += kGenKeys) {
    __syncthreads();  // the previous tile's sK, sV, sS are no longer read
    stage_rows(sK, D + 1, kb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    stage_rows(sV, D, vb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    __syncthreads();
    for (int n = 0; n < kGenEntries; ++n) {
      const int e = tid + n * kGenThreads, r = e / kGenKeys, jj = e % kGenKeys, j = j0 + jj;
      float s = -kInf;  // masked: key after the query's position, or past the end
      if (j <= pr.p + i0 + r && j < pr.S) {
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += sQ[r * D + d] * sK[jj * (D + 1) + d];
        s = dot * pr.scale;
      }
      sS[r * kGenScoreStride + jj] = s;
    }
    __syncthreads();
    // Online softmax of this row; the kGenRowThreads threads of the row repeat the scalar part.
    const float* srow = sS + row * kGenScoreStride;
    float m_new = m;
    for (int jj = 0; jj < kGenKeys; ++jj) m_new = fmaxf(m_new, srow[jj]);
    const float m_use = m_new == -kInf ? 0.0f : m_new;  // a row with nothing visible yet stays empty
    const float correction = expf(m - m_use);          // exp(-inf) = 0 on the first visible block
    l *= correction;
#pragma unroll
    for (int n = 0; n < kGenRowDims; ++n) o[n] *= correction;
    for (int jj = 0; jj < kGenKeys; ++jj) {
      const float pj = expf(srow[jj] - m_use);
      l += pj;
      for_row_dims(part, D, [&](int n, int d) { o[n] += pj * sV[jj * D + d]; });
    }
    m = m_new;
  }
  const int i = i0 + row;
  if (i >= pr.c) return;
  T* out = a.o + q_offset(pr, b, i, h);
  for_row_dims(part, D, [&](int n, int d) { out[d] = from_f32<T>(o[n] / l); });
  if (part == 0) a.lse[stat_offset(pr, b, h, i)] = m + logf(l);
}

// dQ: grid (query tiles, H, B). dq_i = scale sum_j P_ij (dP_ij - Delta_i) k_j.
template <class T> __global__ void __launch_bounds__(kGenThreads) generic_dq_kernel(const Operands<T> a, const Problem pr) {
  extern __shared__ float smem[];
  const int D = pr.D;
  float* sQ = smem;                          // [kGenRows][D]
  float* sdO = sQ + kGenRows * D;            // [kGenRows][D]
  float* sK = sdO + kGenRows * D;            // [kGenKeys][D + 1]
  float* sV = sK + kGenKeys * (D + 1);       // [kGenKeys][D + 1]
  float* sdS = sV + kGenKeys * (D + 1);      // [kGenRows][kGenScoreStride]
  const int i0 = blockIdx.x * kGenRows, h = blockIdx.y, b = blockIdx.z, g = h / pr.group;
  const int tid = threadIdx.x, row = tid / kGenRowThreads, part = tid % kGenRowThreads;
  const T* kb = a.k + b * pr.k_batch + static_cast<int64_t>(g) * D;
  const T* vb = a.v + b * pr.v_batch + static_cast<int64_t>(g) * D;
  stage_rows(sQ, D, a.q + q_offset(pr, b, i0, h), pr.q_row, kGenRows, pr.c - i0, D);
  stage_rows(sdO, D, a.d_out + q_offset(pr, b, i0, h), pr.q_row, kGenRows, pr.c - i0, D);

  const int key_end = min(pr.S, pr.p + min(i0 + kGenRows, pr.c));
  float dq[kGenRowDims] = {};
  for (int j0 = 0; j0 < key_end; j0 += kGenKeys) {
    __syncthreads();
    stage_rows(sK, D + 1, kb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    stage_rows(sV, D + 1, vb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    __syncthreads();
    for (int n = 0; n < kGenEntries; ++n) {
      const int e = tid + n * kGenThreads, r = e / kGenKeys, jj = e % kGenKeys, j = j0 + jj, i = i0 + r;
      float ds = 0.0f;  // masked entries have P = 0, hence dS = 0
      if (i < pr.c && j <= pr.p + i && j < pr.S) {
        float s = 0.0f, dp = 0.0f;
        for (int d = 0; d < D; ++d) {
          s += sQ[r * D + d] * sK[jj * (D + 1) + d];
          dp += sdO[r * D + d] * sV[jj * (D + 1) + d];
        }
        const float p = expf(s * pr.scale - a.lse[stat_offset(pr, b, h, i)]);
        ds = p * (dp - a.delta[stat_offset(pr, b, h, i)]);
      }
      sdS[r * kGenScoreStride + jj] = ds;
    }
    __syncthreads();
    for (int jj = 0; jj < kGenKeys; ++jj) {
      const float ds = sdS[row * kGenScoreStride + jj];
      for_row_dims(part, D, [&](int n, int d) { dq[n] += ds * sK[jj * (D + 1) + d]; });
    }
  }
  const int i = i0 + row;
  if (i >= pr.c) return;
  T* d_q = a.o + q_offset(pr, b, i, h);
  for_row_dims(part, D, [&](int n, int d) {
    d_q[d] = from_f32<T>((pr.accumulate ? to_f32(d_q[d]) : 0.0f) + pr.scale * dq[n]);
  });
}

// dK/dV: grid (key tiles, Hkv, B). Thread (key = tid / 4, dims part, part + 4, ...) owns its dK and
// dV elements over every (head of the group, query tile) that can see the key tile, in a fixed order.
template <class T> __global__ void __launch_bounds__(kGenThreads) generic_dkdv_kernel(const Operands<T> a, const Problem pr) {
  extern __shared__ float smem[];
  const int D = pr.D;
  float* sK = smem;                          // [kGenKeys][D + 1]
  float* sV = sK + kGenKeys * (D + 1);       // [kGenKeys][D + 1]
  float* sQ = sV + kGenKeys * (D + 1);       // [kGenRows][D]
  float* sdO = sQ + kGenRows * D;            // [kGenRows][D]
  float* sP = sdO + kGenRows * D;            // [kGenRows][kGenScoreStride]
  float* sdS = sP + kGenRows * kGenScoreStride;
  float* sLse = sdS + kGenRows * kGenScoreStride;  // [kGenRows]
  float* sDelta = sLse + kGenRows;                 // [kGenRows]
  const int j0 = blockIdx.x * kGenKeys, g = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, key = tid / kGenKeyThreads, part = tid % kGenKeyThreads;
  stage_rows(sK, D + 1, a.k + b * pr.k_batch + j0 * pr.kv_row + static_cast<int64_t>(g) * D, pr.kv_row, kGenKeys,
             pr.S - j0, D);
  stage_rows(sV, D + 1, a.v + b * pr.v_batch + j0 * pr.kv_row + static_cast<int64_t>(g) * D, pr.kv_row, kGenKeys,
             pr.S - j0, D);

  float dk[kGenKeyDims] = {}, dv[kGenKeyDims] = {};
  // Query i sees key j iff i >= j - p: the first query tile that sees key j0.
  const int first_tile = max(0, j0 - pr.p) / kGenRows * kGenRows;
  for (int h = g * pr.group; h < (g + 1) * pr.group; ++h) {
    for (int i0 = first_tile; i0 < pr.c; i0 += kGenRows) {
      __syncthreads();  // the previous tile is no longer read
      stage_rows(sQ, D, a.q + q_offset(pr, b, i0, h), pr.q_row, kGenRows, pr.c - i0, D);
      stage_rows(sdO, D, a.d_out + q_offset(pr, b, i0, h), pr.q_row, kGenRows, pr.c - i0, D);
      if (tid < kGenRows) {
        const bool ok = i0 + tid < pr.c;
        sLse[tid] = ok ? a.lse[stat_offset(pr, b, h, i0 + tid)] : 0.0f;
        sDelta[tid] = ok ? a.delta[stat_offset(pr, b, h, i0 + tid)] : 0.0f;
      }
      __syncthreads();
      for (int n = 0; n < kGenEntries; ++n) {
        const int e = tid + n * kGenThreads, r = e / kGenKeys, jj = e % kGenKeys, j = j0 + jj, i = i0 + r;
        float p = 0.0f, ds = 0.0f;
        if (i < pr.c && j <= pr.p + i && j < pr.S) {
          float s = 0.0f, dp = 0.0f;
          for (int d = 0; d < D; ++d) {
            s += sQ[r * D + d] * sK[jj * (D + 1) + d];
            dp += sdO[r * D + d] * sV[jj * (D + 1) + d];
          }
          p = expf(s * pr.scale - sLse[r]);
          ds = p * (dp - sDelta[r]);
        }
        sP[r * kGenScoreStride + jj] = p;
        sdS[r * kGenScoreStride + jj] = ds;
      }
      __syncthreads();
      for (int r = 0; r < kGenRows; ++r) {
        const float p = sP[r * kGenScoreStride + key], ds = sdS[r * kGenScoreStride + key];
#pragma unroll
        for (int n = 0; n < kGenKeyDims; ++n) {
          const int d = part + n * kGenKeyThreads;
          if (d < D) {
            dv[n] += p * sdO[r * D + d];
            dk[n] += ds * sQ[r * D + d];
          }
        }
      }
    }
  }
  const int j = j0 + key;
  if (j >= pr.S) return;
  float* d_k = a.d_k + b * pr.dk_batch + j * pr.kv_row + static_cast<int64_t>(g) * D;
  float* d_v = a.d_v + b * pr.dv_batch + j * pr.kv_row + static_cast<int64_t>(g) * D;
#pragma unroll
  for (int n = 0; n < kGenKeyDims; ++n) {
    const int d = part + n * kGenKeyThreads;
    if (d < D) {
      d_k[d] += pr.scale * dk[n];
      d_v[d] += dv[n];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core path (bf16, D = 64 or 128): PTX wrappers.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// acc (16x8 f32) += A (16x16 bf16, row) * B (16x8 bf16, col).
__device__ __forceinline__ void mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols), a2 (row g, cols 2t+8, +9), a3 (g+8, 2t+8).
//   B 16x8:  b0 (rows 2t, 2t+1, col g), b1 (rows 2t+8, 2t+9, col g).
//   C 16x8:  c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1).
// So the accumulators of two neighbouring 8-column tiles are, packed to bf16 pairs, exactly the A
// fragment of the next product (P and dS feed P V, dS K, P^T dO, dS^T Q without a trip through
// shared memory).
//
// A tile is ROWS x D bf16 in shared memory, row-major, its 16-byte chunks XOR-swizzled.
template <int D> __device__ __forceinline__ int swz(int row, int chunk) { return row * D + ((chunk ^ (row & 7)) << 3); }

// ldmatrix lane addressing. Every tile row used below starts at a multiple of 8, so row & 7 is
// lane & 7 in all three forms.
//  A operand (16 rows x 16 cols at (row0, kstep)): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15).
template <int D> __device__ __forceinline__ uint32_t a_addr(const bf16_t* tile, int row0, int kstep, int lane) {
  return smem_addr(tile + swz<D>(row0 + (lane & 7) + ((lane >> 3) & 1) * 8, kstep * 2 + (lane >> 4)));
}
//  B operand from rows = n (keys or queries), cols = k (head dim): two 8-row n-tiles starting at
//  n0, one kstep; r0, r1 = b0, b1 of tile n0; r2, r3 = b0, b1 of tile n0 + 8.
template <int D> __device__ __forceinline__ uint32_t bn_addr(const bf16_t* tile, int n0, int kstep, int lane) {
  return smem_addr(tile + swz<D>(n0 + (lane >> 4) * 8 + (lane & 7), kstep * 2 + ((lane >> 3) & 1)));
}
//  B operand from rows = k (keys or queries), cols = n (head dim), with .trans: 16 rows at k0,
//  two 8-col n-tiles starting at chunk pair dpair; r0, r1 = b0, b1 of the first, r2, r3 of the second.
template <int D> __device__ __forceinline__ uint32_t bk_addr(const bf16_t* tile, int k0, int dpair, int lane) {
  return smem_addr(tile + swz<D>(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, dpair * 2 + (lane >> 4)));
}

// ROWS x D rows of a bf16 operand (row stride `ld`) into a swizzled tile; rows at or past `valid`
// are zero-filled (`base`, a valid address, stands in for them).
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(bf16_t* tile, const bf16_t* src, int64_t ld, int valid, const bf16_t* base) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int n = 0; n < (ROWS * kChunks + THREADS - 1) / THREADS; ++n) {
    const int idx = threadIdx.x + n * THREADS;
    if (ROWS * kChunks % THREADS == 0 || idx < ROWS * kChunks) {
      const int r = idx / kChunks, ch = idx % kChunks;
      const bool ok = r < valid;
      cp_async16(smem_addr(tile + swz<D>(r, ch)), ok ? src + r * ld + ch * 8 : base, ok);
    }
  }
}

// A (16 x 16) fragments of a 16-row tile slice for every kstep of D: a[ks].
template <int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[D / 16][4], const bf16_t* tile, int row0, int lane) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) ldsm_x4(a[ks], a_addr<D>(tile, row0, ks, lane));
}

// acc[16 x N] += A[16 x D] * Bt^T where Bt is an N x D tile (rows = n): S = Q K^T and friends.
// A comes from registers (a_regs) or, when FROM_SMEM, from the tile `a_tile` at row a_row0.
template <int D, int N, bool FROM_SMEM>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], const uint32_t (&a_regs)[FROM_SMEM ? 1 : D / 16][4],
                                        const bf16_t* a_tile, int a_row0, const bf16_t* bt, int lane) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    if constexpr (FROM_SMEM) {
      ldsm_x4(a, a_addr<D>(a_tile, a_row0, ks, lane));
    } else {
#pragma unroll
      for (int x = 0; x < 4; ++x) a[x] = a_regs[ks][x];
    }
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(b, bn_addr<D>(bt, np * 16, ks, lane));
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x D] += X[16 x K] * Bk where X is given as f32 accumulators of K / 8 n-tiles (packed to
// bf16 here) and Bk is a K x D tile (rows = k): O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <int D, int K>
__device__ __forceinline__ void mma_xb(float (&acc)[D / 8][4], const float (&x)[K / 8][4], const bf16_t* bk, int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    a_frag_from_acc(a, x, kk);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_x4_trans(b, bk_addr<D>(bk, kk * 16, dp, lane));
      mma(acc[2 * dp], a, b[0], b[1]);
      mma(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core forward. CTA: NW warps, BR = NW * MT * 16 queries of one (b, h); key blocks of BC.
// Shared memory: Q tile, then two stages of K and V tiles.
// ------------------------------------------------------------------------------------------------
template <int D, int NW, int MT, int BC> struct TcForward {
  static constexpr int kThreads = NW * 32, kRows = NW * MT * 16;
  static constexpr int kSmem = (kRows + 4 * BC) * D * static_cast<int>(sizeof(bf16_t));
  // Q fragments stay in registers when they are small; otherwise they are re-read per key block.
  static constexpr bool kQInRegs = MT * D <= 128;
};

template <int D, int NW, int MT, int BC>
__global__ void __launch_bounds__(NW * 32) tc_forward_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcForward<D, NW, MT, BC>;
  constexpr int BR = Cfg::kRows, NT = BC / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sK = sQ + BR * D;      // [2][BC * D]
  bf16_t* sV = sK + 2 * BC * D;  // [2][BC * D]
  const Block blk = query_block_of(pr, BR);
  const int qb = blk.block, h = blk.head, b = blk.b, g = h / pr.group;
  const int q0 = qb * BR, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wrow = warp * MT * 16;  // the warp's first row in the tile
  const bf16_t* kg = a.k + b * pr.k_batch + g * D;
  const bf16_t* vg = a.v + b * pr.v_batch + g * D;

  const int key_end = min(pr.S, pr.p + q0 + BR);  // keys visible to the tile's last row
  const int nkb = (key_end + BC - 1) / BC;
  load_tile<D, BR, Cfg::kThreads>(sQ, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
  load_tile<D, BC, Cfg::kThreads>(sK, kg, pr.kv_row, pr.S, a.k);
  load_tile<D, BC, Cfg::kThreads>(sV, vg, pr.kv_row, pr.S, a.v);
  cp_async_commit();

  float o[MT][DT][4] = {};
  float m[MT][2], l[MT][2];  // running max (base-2 domain) and this thread's part of the running sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -kInf, l[mt][0] = l[mt][1] = 0.0f;
  uint32_t qf[MT][Cfg::kQInRegs ? D / 16 : 1][4];

  for (int kb = 0; kb < nkb; ++kb) {
    cp_async_wait_all();
    __syncthreads();  // block kb has landed for everyone, and nobody still reads block kb - 1's stage
    if (kb + 1 < nkb) {
      const int k1 = (kb + 1) * BC, st = (kb + 1) & 1;
      load_tile<D, BC, Cfg::kThreads>(sK + st * BC * D, kg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.k);
      load_tile<D, BC, Cfg::kThreads>(sV + st * BC * D, vg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.v);
    }
    cp_async_commit();
    const bf16_t* cK = sK + (kb & 1) * BC * D;
    const bf16_t* cV = sV + (kb & 1) * BC * D;
    if constexpr (Cfg::kQInRegs) {
      if (kb == 0)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_frags<D>(qf[mt], sQ, wrow + mt * 16, lane);
    }

    float s[MT][NT][4] = {};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_abt<D, BC, !Cfg::kQInRegs>(s[mt], qf[mt], sQ, wrow + mt * 16, cK, lane);

    // Only blocks that cross the diagonal of the tile (or the end of the keys) need the mask.
    const int k0 = kb * BC;
    const bool masked = k0 + BC - 1 > pr.p + q0 || k0 + BC > pr.S;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int qpos = pr.p + q0 + wrow + mt * 16 + (lane >> 2) + hh * 8;  // the row's position
        float mx = -kInf;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mt][nt][2 * hh + e] * pr.scale_log2;
            const int key = k0 + nt * 8 + 2 * t + e;
            if (masked && (key > qpos || key >= pr.S)) x = -kInf;
            s[mt][nt][2 * hh + e] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a quad share a row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][hh], mx);
        const float m_use = m_new == -kInf ? 0.0f : m_new;
        const float correction = fast_exp2(m[mt][hh] - m_use);
        m[mt][hh] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(s[mt][nt][2 * hh + e] - m_use);
            s[mt][nt][2 * hh + e] = pv;
            sum += pv;
          }
        l[mt][hh] = l[mt][hh] * correction + sum;  // quad-reduced once, at the end
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[mt][dt][2 * hh] *= correction, o[mt][dt][2 * hh + 1] *= correction;
      }
      mma_xb<D, BC>(o[mt], s[mt], cV, lane);
    }
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float sum = l[mt][hh];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int i = q0 + wrow + mt * 16 + (lane >> 2) + hh * 8;
      if (i >= pr.c) continue;
      const float inv = 1.0f / sum;
      bf16_t* out = a.o + q_offset(pr, b, i, h) + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<uint32_t*>(out + dt * 8) = pack_bf16(o[mt][dt][2 * hh] * inv, o[mt][dt][2 * hh + 1] * inv);
      if (t == 0) a.lse[stat_offset(pr, b, h, i)] = (m[mt][hh] + log2f(sum)) * kLn2;
    }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core dK/dV. CTA: NW warps, BC = NW * 16 keys of one (b, g); query blocks of BR, double
// buffered (Q, dO, lse, Delta). Warp w owns keys [16 w, 16 w + 16) of the block.
// FUSED_DQ (the non-deterministic backward): each step also writes its dS^T tile (bf16, keys x
// queries) to shared memory and, after a second barrier, all warps compute the tile's dQ
// contribution dS (BR x BC) K (BC x D) together (fused_dq_tile) and add it into the f32
// accumulator with 8-byte atomics.
// ------------------------------------------------------------------------------------------------
template <int D, int NW, int BR, bool FUSED_DQ> struct TcDkdv {
  static constexpr int kThreads = NW * 32, kKeys = NW * 16;
  static constexpr int kDsBytes = FUSED_DQ ? kKeys * BR * static_cast<int>(sizeof(bf16_t)) : 0;
  static constexpr int kSmem = (2 * kKeys + 4 * BR) * D * static_cast<int>(sizeof(bf16_t)) + 4 * BR * 4 + kDsBytes;
  static constexpr bool kKVInRegs = D <= 64;  // the warp's K and V fragments in registers
  static_assert(!FUSED_DQ || BR % 64 == 0, "the dS^T tile's swizzle needs rows of 8+ 16-byte chunks");
};

// dQ rows [q0, q0 + BR) of head h += dS K for one step's tile: sdS is the BC x BR dS^T tile
// (keys-major, swizzled), sK the CTA's BC x D keys. The BR x D output is cut into 16-row x
// DQN-column units dealt round-robin to the warps; each unit reads its dS fragments with
// ldmatrix.trans (matrix m of the x4 covers query half m & 1 and key half m >> 1).
template <class Cfg, int D, int BR>
__device__ __forceinline__ void fused_dq_tile(const Operands<bf16_t>& a, const Problem& pr, const bf16_t* sdS,
                                              const bf16_t* sK, int b, int h, int q0, int warp, int lane) {
  constexpr int BC = Cfg::kKeys, NW = Cfg::kThreads / 32;
  // Units of 16 query rows x DQN head-dim columns: at least one per warp where the tile allows.
  constexpr int DQN = (BR / 16) * D / NW >= 64 ? 64 : ((BR / 16) * D / NW >= 32 ? 32 : 16);
  constexpr int UNIT_COLS = D / DQN, UNITS = (BR / 16) * UNIT_COLS;
  static_assert(D % DQN == 0 && BR % 16 == 0, "dQ units must tile the BR x D output");
  const int t = lane & 3;
#pragma unroll 1
  for (int unit = warp; unit < UNITS; unit += NW) {
    const int row0 = unit / UNIT_COLS * 16, col0 = unit % UNIT_COLS * DQN;
    float dq[DQN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t af[4];
      ldsm_x4_trans(af, smem_addr(sdS + swz<BR>(kk * 16 + ((lane >> 4) & 1) * 8 + (lane & 7),
                                                row0 / 8 + ((lane >> 3) & 1))));
#pragma unroll
      for (int dp = 0; dp < DQN / 16; ++dp) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, bk_addr<D>(sK, kk * 16, col0 / 16 + dp, lane));
        mma(dq[2 * dp], af, bf[0], bf[1]);
        mma(dq[2 * dp + 1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = q0 + row0 + (lane >> 2) + hh * 8;
      if (i >= pr.c) continue;
      float* acc = a.dq_accum + q_offset(pr, b, i, h) + col0 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DQN / 8; ++dt) atomic_add2(acc + dt * 8, dq[dt][2 * hh], dq[dt][2 * hh + 1]);
    }
  }
}

template <int D, int NW, int BR, bool FUSED_DQ>
__global__ void __launch_bounds__(NW * 32) tc_dkdv_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcDkdv<D, NW, BR, FUSED_DQ>;
  constexpr int BC = Cfg::kKeys, NQ = BR / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sK = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sV = sK + BC * D;
  bf16_t* sQ = sV + BC * D;    // [2][BR * D]
  bf16_t* sdO = sQ + 2 * BR * D;  // [2][BR * D]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * BR * D);  // [2][BR]
  float* sDelta = sLse + 2 * BR;                              // [2][BR]
  bf16_t* sdS = reinterpret_cast<bf16_t*>(sDelta + 2 * BR);   // FUSED_DQ: [BC keys][BR queries], swizzled
  const Block blk = key_block_of(pr);
  const int kb = blk.block, g = blk.head, b = blk.b;
  const int k0 = kb * BC, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wkey = warp * 16;

  load_tile<D, BC, Cfg::kThreads>(sK, a.k + b * pr.k_batch + k0 * pr.kv_row + g * D, pr.kv_row, pr.S - k0, a.k);
  load_tile<D, BC, Cfg::kThreads>(sV, a.v + b * pr.v_batch + k0 * pr.kv_row + g * D, pr.kv_row, pr.S - k0, a.v);
  // Query i sees key j iff i >= j - p; every key block has at least one query (k0 < S = p + c).
  const int nqb = (pr.c + BR - 1) / BR, qb_first = max(0, k0 - pr.p) / BR, nq = nqb - qb_first;
  const int steps = pr.group * nq;  // (head, query block) pairs, in a fixed order
  auto issue = [&](int step, int stage) {
    const int h = g * pr.group + step / nq, q0 = (qb_first + step % nq) * BR;
    load_tile<D, BR, Cfg::kThreads>(sQ + stage * BR * D, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
    load_tile<D, BR, Cfg::kThreads>(sdO + stage * BR * D, a.d_out + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0,
                                    a.d_out);
    for (int r = threadIdx.x; r < BR; r += Cfg::kThreads) {
      const bool ok = q0 + r < pr.c;
      const int64_t off = ok ? stat_offset(pr, b, h, q0 + r) : 0;
      cp_async4(smem_addr(sLse + stage * BR + r), a.lse + off, ok);
      cp_async4(smem_addr(sDelta + stage * BR + r), a.delta + off, ok);
    }
  };
  issue(0, 0);
  cp_async_commit();

  float dk[DT][4] = {}, dv[DT][4] = {};
  uint32_t kf[Cfg::kKVInRegs ? D / 16 : 1][4], vf[Cfg::kKVInRegs ? D / 16 : 1][4];
  for (int step = 0; step < steps; ++step) {
    cp_async_wait_all();
    __syncthreads();
    if (step + 1 < steps) issue(step + 1, (step + 1) & 1);
    cp_async_commit();
    if constexpr (Cfg::kKVInRegs) {
      if (step == 0) {
        load_a_frags<D>(kf, sK, wkey, lane);
        load_a_frags<D>(vf, sV, wkey, lane);
      }
    }
    const int stage = step & 1, q0 = (qb_first + step % nq) * BR;
    const bf16_t* cQ = sQ + stage * BR * D;
    const bf16_t* cdO = sdO + stage * BR * D;

    float st[NQ][4] = {}, dpt[NQ][4] = {};  // S^T and dP^T: 16 keys x BR queries
    mma_abt<D, BR, !Cfg::kKVInRegs>(st, kf, sK, wkey, cQ, lane);
    mma_abt<D, BR, !Cfg::kKVInRegs>(dpt, vf, sV, wkey, cdO, lane);

    const bool masked = k0 + BC - 1 > pr.p + q0 || q0 + BR > pr.c || k0 + BC > pr.S;
    probs_and_score_grads_t(st, dpt, sLse + stage * BR, sDelta + stage * BR, pr, k0 + wkey, q0, masked, lane);
    if constexpr (FUSED_DQ) {
      // The warp's 16 rows of dS^T, rounded to bf16 as the dK product rounds them. Free to
      // overwrite: every warp finished reading the previous step's tile before the loop's barrier.
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(sdS + swz<BR>(wkey + (lane >> 2) + hh * 8, nt) + 2 * t) =
              pack_bf16(dpt[nt][2 * hh], dpt[nt][2 * hh + 1]);
    }
    mma_xb<D, BR>(dv, st, cdO, lane);
    mma_xb<D, BR>(dk, dpt, cQ, lane);
    if constexpr (FUSED_DQ) {
      __syncthreads();  // the whole BC x BR dS^T tile is in shared memory
      fused_dq_tile<Cfg, D, BR>(a, pr, sdS, sK, b, g * pr.group + step / nq, q0, warp, lane);
    }
  }

  add_key_grads<D>(a, pr, b, g, k0 + wkey, dk, dv, lane);
}

// ------------------------------------------------------------------------------------------------
// Tensor-core dQ. CTA: NW warps, BR = NW * 16 queries of one (b, h); key blocks of BC, double
// buffered. dQ = scale sum_j dS_ij k_j with dS recomputed from Q, K, V, dO, lse, Delta.
// ------------------------------------------------------------------------------------------------
template <int D, int NW, int BC> struct TcDq {
  static constexpr int kThreads = NW * 32, kRows = NW * 16;
  static constexpr int kSmem = (2 * kRows + 4 * BC) * D * static_cast<int>(sizeof(bf16_t));
  static constexpr bool kInRegs = D <= 64;  // Q and dO fragments in registers
};

template <int D, int NW, int BC>
__global__ void __launch_bounds__(NW * 32) tc_dq_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcDq<D, NW, BC>;
  constexpr int BR = Cfg::kRows, NT = BC / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sdO = sQ + BR * D;
  bf16_t* sK = sdO + BR * D;     // [2][BC * D]
  bf16_t* sV = sK + 2 * BC * D;  // [2][BC * D]
  const Block blk = query_block_of(pr, BR);
  const int qb = blk.block, h = blk.head, b = blk.b, g = h / pr.group;
  const int q0 = qb * BR, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wrow = warp * 16;
  const bf16_t* kg = a.k + b * pr.k_batch + g * D;
  const bf16_t* vg = a.v + b * pr.v_batch + g * D;

  const int key_end = min(pr.S, pr.p + q0 + BR);
  const int nkb = (key_end + BC - 1) / BC;
  load_tile<D, BR, Cfg::kThreads>(sQ, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
  load_tile<D, BR, Cfg::kThreads>(sdO, a.d_out + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.d_out);
  load_tile<D, BC, Cfg::kThreads>(sK, kg, pr.kv_row, pr.S, a.k);
  load_tile<D, BC, Cfg::kThreads>(sV, vg, pr.kv_row, pr.S, a.v);
  cp_async_commit();

  float lse2[2], delta[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    lse2[hh] = i < pr.c ? a.lse[stat_offset(pr, b, h, i)] * kLog2e : 0.0f;
    delta[hh] = i < pr.c ? a.delta[stat_offset(pr, b, h, i)] : 0.0f;
  }
  float dq[DT][4] = {};
  uint32_t qf[Cfg::kInRegs ? D / 16 : 1][4], df[Cfg::kInRegs ? D / 16 : 1][4];
  for (int kb = 0; kb < nkb; ++kb) {
    cp_async_wait_all();
    __syncthreads();
    if (kb + 1 < nkb) {
      const int k1 = (kb + 1) * BC, st = (kb + 1) & 1;
      load_tile<D, BC, Cfg::kThreads>(sK + st * BC * D, kg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.k);
      load_tile<D, BC, Cfg::kThreads>(sV + st * BC * D, vg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.v);
    }
    cp_async_commit();
    if constexpr (Cfg::kInRegs) {
      if (kb == 0) {
        load_a_frags<D>(qf, sQ, wrow, lane);
        load_a_frags<D>(df, sdO, wrow, lane);
      }
    }
    const bf16_t* cK = sK + (kb & 1) * BC * D;
    const bf16_t* cV = sV + (kb & 1) * BC * D;
    float s[NT][4] = {}, dp[NT][4] = {};
    mma_abt<D, BC, !Cfg::kInRegs>(s, qf, sQ, wrow, cK, lane);
    mma_abt<D, BC, !Cfg::kInRegs>(dp, df, sdO, wrow, cV, lane);
    const int k0 = kb * BC;
    const bool masked = k0 + BC - 1 > pr.p + q0 || k0 + BC > pr.S;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e >> 1, key = k0 + nt * 8 + 2 * t + (e & 1);
        const int qpos = pr.p + q0 + wrow + (lane >> 2) + hh * 8;
        float p = fast_exp2(s[nt][e] * pr.scale_log2 - lse2[hh]);
        if (masked && (key > qpos || key >= pr.S)) p = 0.0f;
        s[nt][e] = p * (dp[nt][e] - delta[hh]);  // dS
      }
    mma_xb<D, BC>(dq, s, cK, lane);
  }

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    if (i >= pr.c) continue;
    bf16_t* d_q = a.o + q_offset(pr, b, i, h) + 2 * t;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) write_d_q_pair(d_q + dt * 8, pr, dq[dt][2 * hh], dq[dt][2 * hh + 1]);
  }
}

// ------------------------------------------------------------------------------------------------
// The fused backward's last pass: d_q = scale * accumulator (+ d_q when accumulating), four
// elements per thread and iteration (d_q is 16-byte aligned with D a multiple of 64 on this path).
// ------------------------------------------------------------------------------------------------
__global__ void dq_convert_kernel(const float* __restrict__ acc, bf16_t* d_q, int64_t quads, float scale,
                                  bool accumulate) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 x = reinterpret_cast<const float4*>(acc)[i];
    float v[4] = {scale * x.x, scale * x.y, scale * x.z, scale * x.w};
    uint2* dst = reinterpret_cast<uint2*>(d_q) + i;
    if (accumulate) {
      const uint2 old = *dst;
      const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&old.x);
      const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&old.y);
      v[0] += __low2float(lo), v[1] += __high2float(lo), v[2] += __low2float(hi), v[3] += __high2float(hi);
    }
    *dst = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
  }
}

// ------------------------------------------------------------------------------------------------
// Launchers.
// ------------------------------------------------------------------------------------------------
template <int D, int NW, int MT, int BC>
void launch_tc_forward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcForward<D, NW, MT, BC>;
  launch_tiled<Cfg>(tc_forward_kernel<D, NW, MT, BC>, pr.c, Cfg::kRows, pr.H, a, pr, stream);
}

template <int D, int NW, int BR, bool FUSED_DQ>
void launch_tc_dkdv(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcDkdv<D, NW, BR, FUSED_DQ>;
  launch_tiled<Cfg>(tc_dkdv_kernel<D, NW, BR, FUSED_DQ>, pr.S, Cfg::kKeys, pr.Hkv, a, pr, stream);
}

template <int D, int NW, int BC>
void launch_tc_dq(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcDq<D, NW, BC>;
  launch_tiled<Cfg>(tc_dq_kernel<D, NW, BC>, pr.c, Cfg::kRows, pr.H, a, pr, stream);
}

void launch_dq_convert(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  const int64_t quads = static_cast<int64_t>(pr.B) * pr.c * pr.H * pr.D / 4;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((quads + 255) / 256, 65535));
  dq_convert_kernel<<<grid, 256, 0, stream>>>(a.dq_accum, a.o, quads, pr.scale, pr.accumulate);
  CW_KERNEL_CHECK();
}

void launch_delta_tc(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(pr.B) * pr.c * pr.H * (pr.D / 8);
  if (pr.D == 64) delta_tc_kernel<64><<<blocks_for(threads, 256), 256, 0, stream>>>(a, pr);
  else delta_tc_kernel<128><<<blocks_for(threads, 256), 256, 0, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}

template <class T> void launch_delta(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(pr.B) * pr.c * pr.H;
  delta_kernel<T><<<blocks_for(rows, kDeltaWarps), kDeltaWarps * 32, 0, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}

template <class T> void launch_generic_forward(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  const size_t smem = generic_forward_smem(pr.D);
  set_smem(generic_forward_kernel<T>, smem);
  const dim3 grid((pr.c + kGenRows - 1) / kGenRows, pr.H, pr.B);
  generic_forward_kernel<T><<<grid, kGenThreads, smem, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}

template <class T> void launch_generic_backward(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  const size_t dkdv_smem = generic_dkdv_smem(pr.D), dq_smem = generic_dq_smem(pr.D);
  set_smem(generic_dkdv_kernel<T>, dkdv_smem);
  set_smem(generic_dq_kernel<T>, dq_smem);
  generic_dkdv_kernel<T><<<dim3((pr.S + kGenKeys - 1) / kGenKeys, pr.Hkv, pr.B), kGenThreads, dkdv_smem, stream>>>(
      a, pr);
  CW_KERNEL_CHECK();
  generic_dq_kernel<T><<<dim3((pr.c + kGenRows - 1) / kGenRows, pr.H, pr.B), kGenThreads, dq_smem, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}

// The tile shapes of the tensor-core path, chosen by timing the candidates on an H100 at
// B = 1, S = c = 8192 (H = 32, Hkv = 8 at D = 64; H = 24, Hkv = 8 at D = 128; RESULTS.md).
//   forward D = 64:  4 warps x 16 rows (BR 64), BC 64    D = 128: 4 warps x 32 rows (BR 128), BC 64
//   dK/dV:           4 warps x 16 keys (BC 64), BR 64    dQ:      4 warps x 16 rows (BR 64), BC 64
//   fused dK/dV/dQ:  8 warps x 16 keys (BC 128), BR 64, dQ inline after a second barrier, 8-byte atomics
void tc_forward(const Operands<bf16_t>& a, const Problem& pr, bool wgmma, cudaStream_t stream) {
  if (wgmma) return wgmma_forward(a, pr, stream);
  if (pr.D == 64) return launch_tc_forward<64, 4, 1, 64>(a, pr, stream);
  launch_tc_forward<128, 4, 2, 64>(a, pr, stream);
}
// One head dim's backward kernels (the same tiles at D 64 and 128); tc_backward picks D.
template <int D> void tc_backward_at(const Operands<bf16_t>& a, const Problem& pr, bool wgmma, cudaStream_t stream) {
  if (wgmma) {
    wgmma_backward(a, pr, stream);
    if (a.dq_accum != nullptr) launch_dq_convert(a, pr, stream);
    return;
  }
  if (a.dq_accum != nullptr) {  // fused: one pass over the tiles, dQ by atomics, then d_q from the sums
    launch_tc_dkdv<D, 8, 64, true>(a, pr, stream);
    return launch_dq_convert(a, pr, stream);
  }
  launch_tc_dkdv<D, 4, 64, false>(a, pr, stream);
  launch_tc_dq<D, 4, 64>(a, pr, stream);
}
void tc_backward(const Operands<bf16_t>& a, const Problem& pr, bool wgmma, cudaStream_t stream) {
  if (pr.D == 64) tc_backward_at<64>(a, pr, wgmma, stream);
  else tc_backward_at<128>(a, pr, wgmma, stream);
}

// ------------------------------------------------------------------------------------------------
// Operand checks and dispatch.
// ------------------------------------------------------------------------------------------------
const char* family_name(FlashFamily f) {
  return f == FlashFamily::wgmma ? "wgmma" : f == FlashFamily::mma ? "mma" : "simt";
}

void check_kv_layout(const Tensor& t, int64_t Hkv, int64_t D, const char* what) {
  CW_CHECK(t.stride[1] == Hkv * D && t.stride[2] == D && t.stride[3] == 1 && t.stride[0] >= t.size(1) * Hkv * D,
           "flash attention {} {}: the [S, Hkv, D] part must be packed (only the batch stride may be larger)", what,
           t.describe());
}

Problem check_common(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                     double scale) {
  CW_CHECK(q.ndim == 4 && k.ndim == 4, "flash attention: q {} and k {} must be [B, c, H, D] and [B, S, Hkv, D]",
           q.describe(), k.describe());
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  CW_CHECK(S >= c, "flash attention: {} queries but only {} keys (keys must cover [0, p + c))", c, S);
  CW_CHECK(Hkv > 0 && H % Hkv == 0, "flash attention: {} query heads not a multiple of {} K/V heads", H, Hkv);
  CW_CHECK(D > 0 && D % 2 == 0 && D <= 128, "flash attention: head dim {} must be even and at most 128", D);
  CW_CHECK(q.dtype == DType::f32 || q.dtype == DType::bf16, "flash attention: q is {}; the GPU computes in f32 or bf16",
           dtype_name(q.dtype));
  check_shape(k, {B, S, Hkv, D}, "flash attention k");
  check_same_shape(v, k, "flash attention v", "flash attention k");
  check_same_shape(out, q, "flash attention out", "flash attention q");
  check_shape(saved.lse, {B, H, c}, "flash attention saved lse");
  check_dtype(saved.lse, DType::f32, "flash attention saved lse (f32 on the GPU)");
  for (const Tensor* t : {&k, &v, &out}) check_dtype(*t, q.dtype, "flash attention k/v/out");
  check_contiguous(q, "flash attention q");
  check_contiguous(out, "flash attention out");
  check_contiguous(saved.lse, "flash attention saved lse");
  check_kv_layout(k, Hkv, D, "k");
  check_kv_layout(v, Hkv, D, "v");
  for (const Tensor* t : {&q, &k, &v, &out, &saved.lse})
    check_device_operand(*t, q, "flash attention q/k/v/out/lse", "attention q", /*contiguous=*/false);
  // Grids: (query or key blocks of at least 16) x heads x batch CTAs in one dimension (tensor-core
  // path), blocks x H x B (generic path).
  CW_CHECK((S + 15) / 16 * H * B < (int64_t(1) << 31) && B < 65536 && H < 65536 && S < (int64_t(1) << 30),
           "flash attention: shapes q {} k {} are too large for the grid", q.describe(), k.describe());
  Problem pr{};
  pr.B = static_cast<int>(B), pr.c = static_cast<int>(c), pr.H = static_cast<int>(H);
  pr.Hkv = static_cast<int>(Hkv), pr.D = static_cast<int>(D), pr.S = static_cast<int>(S);
  pr.p = static_cast<int>(S - c), pr.group = static_cast<int>(H / Hkv);
  pr.q_row = H * D, pr.kv_row = Hkv * D;
  pr.k_batch = k.stride[0], pr.v_batch = v.stride[0];
  pr.scale = static_cast<float>(scale), pr.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  return pr;
}

bool aligned(const Tensor& t, size_t bytes) { return reinterpret_cast<uintptr_t>(t.data) % bytes == 0; }

// The tensor-core path needs bf16, D = 64 or 128, and 16-byte aligned rows for cp.async.
bool tensor_core_path(const Problem& pr, DType dtype, std::initializer_list<const Tensor*> bf16_operands) {
  if (dtype != DType::bf16 || (pr.D != 64 && pr.D != 128) || pr.k_batch % 8 != 0 || pr.v_batch % 8 != 0) return false;
  for (const Tensor* t : bf16_operands)
    if (!aligned(*t, 16)) return false;
  return true;
}

}  // namespace

bool flash_wgmma_available(int device) {
  if (!wgmma_built()) return false;
  // Asked on every attention call: the answer per device is kept (-1: not asked yet).
  static std::atomic<int> known[64] = {};
  static std::once_flag init;
  std::call_once(init, [] { for (auto& k : known) k.store(-1); });
  if (device >= 0 && device < 64 && known[device].load() >= 0) return known[device].load() == 1;
  int major = 0, minor = 0;
  CW_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CW_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const bool hopper = major == 9 && minor == 0;
  if (device >= 0 && device < 64) known[device].store(hopper ? 1 : 0);
  return hopper;
}

void flash_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, FlashFamily family) {
  const Problem pr = check_common(out, saved, q, k, v, scale);
  if (pr.B == 0 || pr.c == 0 || pr.H == 0) return;
  cudaStream_t stream = current_stream(q.device.index);
  if (family != FlashFamily::simt) {
    CW_CHECK(tensor_core_path(pr, q.dtype, {&q, &k, &v, &out}),
             "flash attention ({}): needs bf16, head dim 64 or 128 and 16-byte aligned operands", family_name(family));
    const Operands<bf16_t> a{static_cast<const bf16_t*>(q.data), static_cast<const bf16_t*>(k.data),
                             static_cast<const bf16_t*>(v.data), nullptr, nullptr, static_cast<bf16_t*>(out.data),
                             static_cast<float*>(saved.lse.data), nullptr, nullptr, nullptr};
    return tc_forward(a, pr, family == FlashFamily::wgmma, stream);
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Operands<T> a{static_cast<const T*>(q.data), static_cast<const T*>(k.data), static_cast<const T*>(v.data),
                        nullptr, nullptr, static_cast<T*>(out.data), static_cast<float*>(saved.lse.data), nullptr,
                        nullptr, nullptr};
    launch_generic_forward(a, pr, stream);
  };
  if (q.dtype == DType::bf16) run(bf16_t{});
  else run(float{});
}

void flash_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch, FlashFamily family,
                              bool deterministic) {
  Problem pr = check_common(out, saved, q, k, v, scale);
  check_same_shape(d_q, q, "flash attention d_q", "flash attention q");
  check_same_shape(d_out, q, "flash attention d_out", "flash attention q");
  check_dtype(d_q, q.dtype, "flash attention d_q");
  check_dtype(d_out, q.dtype, "flash attention d_out");
  check_contiguous(d_q, "flash attention d_q");
  check_contiguous(d_out, "flash attention d_out");
  for (const Tensor* t : {&d_k, &d_v}) {
    check_same_shape(*t, k, "flash attention d_k/d_v", "flash attention k");
    check_dtype(*t, DType::f32, "flash attention d_k/d_v (f32 on the GPU)");
    check_kv_layout(*t, pr.Hkv, pr.D, "d_k/d_v");
  }
  for (const Tensor* t : {&d_q, &d_out, &d_k, &d_v})
    check_device_operand(*t, q, "flash attention d_q/d_out/d_k/d_v", "attention q", /*contiguous=*/false);
  CW_CHECK(scratch.device() == q.device, "flash attention backward: scratch is on {}, the operands on {}",
           device_name(scratch.device()), device_name(q.device));
  if (pr.B == 0 || pr.c == 0 || pr.H == 0) return;
  pr.dk_batch = d_k.stride[0], pr.dv_batch = d_v.stride[0];
  pr.accumulate = mode == GradMode::accumulate;
  cudaStream_t stream = current_stream(q.device.index);
  ArenaScope scope(scratch);
  float* delta = scratch.alloc(DType::f32, {pr.B, pr.H, pr.c}).ptr<float>();

  const bool tc = family != FlashFamily::simt;
  CW_CHECK(!tc || (tensor_core_path(pr, q.dtype, {&q, &k, &v, &out, &d_out, &d_q}) && aligned(d_k, 8) &&
                   aligned(d_v, 8) && pr.dk_batch % 2 == 0 && pr.dv_batch % 2 == 0),
           "flash attention ({}): needs bf16, head dim 64 or 128 and aligned operands", family_name(family));
  auto operands = [&](auto tag) {
    using T = decltype(tag);
    return Operands<T>{static_cast<const T*>(q.data), static_cast<const T*>(k.data), static_cast<const T*>(v.data),
                       static_cast<const T*>(out.data), static_cast<const T*>(d_out.data), static_cast<T*>(d_q.data),
                       static_cast<float*>(saved.lse.data), delta, static_cast<float*>(d_k.data),
                       static_cast<float*>(d_v.data)};
  };
  if (q.dtype == DType::bf16) {
    Operands<bf16_t> a = operands(bf16_t{});
    // Without the determinism switch the tensor-core path fuses dQ into the dK/dV pass (f32
    // atomics into [B, c, H, D] scratch, zeroed by the Delta kernel).
    if (tc && !deterministic) a.dq_accum = scratch.alloc(DType::f32, {pr.B, pr.c, pr.H, pr.D}).ptr<float>();
    if (tc) {
      launch_delta_tc(a, pr, stream);
      return tc_backward(a, pr, family == FlashFamily::wgmma, stream);
    }
    launch_delta(a, pr, stream);
    launch_generic_backward(a, pr, stream);
  } else {
    const Operands<float> a = operands(float{});
    launch_delta(a, pr, stream);
    launch_generic_backward(a, pr, stream);
  }
}

}  // namespace cw::gpu
