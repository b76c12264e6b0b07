// Flash attention, SIMT family (flash_simt): the op of engine/ops/attention.h without tensor cores.
//   Computes: out, lse (forward); Delta, then d_q (overwrite or accumulate) and d_k, d_v (always
//   added) (backward), by the online softmax stated in attention_flash.cuh.
//   Operands: f32 or bf16, any even head dim D <= 256, no alignment needs beyond the element's.
//   Score cap (Problem::softcap, Gemma 2's attn_logit_softcapping): each scaled score passes through
//   cap tanh(s / cap) before the mask and softmax; the backward multiplies dS by 1 - tanh^2 (tanhf
//   here; the mma family computes the same map through its exponential, score_log2).
//   Arithmetic: f32 throughout with expf/logf/tanhf (the f32 exactness path and the readable
//   reference of the algorithm); no atomics: every sum has a fixed order, so results are bitwise
//   repeatable.
//   Kernels: delta_kernel (one warp per row), forward (query tiles of 16), dK/dV (key tiles of 32,
//   one writer per d_k/d_v element), dQ (query tiles of 16); 128 threads a CTA. Each thread keeps
//   its share of a row (or key) in registers sized for the largest head dim it serves: kernels
//   instantiated for D <= 128 and for D <= 256, so that the common head dims do not pay the large
//   ones' registers.
//   Chosen by the chooser when no tensor-core family takes the call (f32, head dims other than 64,
//   128 and 256, unaligned operands) or when forced (CW_ATTENTION=flash-simt).
#include "engine/cuda/attention_flash.cuh"

namespace cw::gpu::flash {
namespace {

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
constexpr int kGenKeyThreads = kGenThreads / kGenKeys;    // 4 threads share a key (dK/dV)
// Dims per thread for head dims up to kMaxD: of a query row, of a key.
template <int kMaxD> constexpr int kRowDims = kMaxD / kGenRowThreads;
template <int kMaxD> constexpr int kKeyDims = kMaxD / kGenKeyThreads;

// f(n, d) for the head dims d this thread owns in its row (d = part + n kGenRowThreads < D; n
// indexes the thread's register array).
template <int kMaxD, class F> __device__ __forceinline__ void for_row_dims(int part, int D, F&& f) {
#pragma unroll
  for (int n = 0; n < kRowDims<kMaxD>; ++n) {
    const int d = part + n * kGenRowThreads;
    if (d < D) f(n, d);
  }
}
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
template <class T, int kMaxD>
__global__ void __launch_bounds__(kGenThreads) generic_forward_kernel(const Operands<T> a, const Problem pr) {
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

  // The keys the tile's last valid query sees; later keys are masked for every row. With a window or
  // documents, the tiles of keys wholly left of the first row's first visible key are skipped.
  const int key_end = min(pr.S, pr.p + min(i0 + kGenRows, pr.c));
  float o[kRowDims<kMaxD>] = {};
  float m = -kInf, l = 0.0f;
  for (int j0 = first_visible_key(pr, b, pr.p + i0) / kGenKeys * kGenKeys; j0 < key_end; j0 += kGenKeys) {
    __syncthreads();  // the previous tile's sK, sV, sS are no longer read
    stage_rows(sK, D + 1, kb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    stage_rows(sV, D, vb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    __syncthreads();
    for (int n = 0; n < kGenEntries; ++n) {
      const int e = tid + n * kGenThreads, r = e / kGenKeys, jj = e % kGenKeys, j = j0 + jj;
      float s = -kInf;  // masked: key after the query's position, left of its window or document, or past the end
      if (key_visible(pr, b, j, pr.p + i0 + r) && j < pr.S) {
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += sQ[r * D + d] * sK[jj * (D + 1) + d];
        s = cap_score(pr, dot * pr.scale).s;
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
    for (int n = 0; n < kRowDims<kMaxD>; ++n) o[n] *= correction;
    for (int jj = 0; jj < kGenKeys; ++jj) {
      const float pj = expf(srow[jj] - m_use);
      l += pj;
      for_row_dims<kMaxD>(part, D, [&](int n, int d) { o[n] += pj * sV[jj * D + d]; });
    }
    m = m_new;
  }
  const int i = i0 + row;
  if (i >= pr.c) return;
  T* out = a.o + q_offset(pr, b, i, h);
  // l = 0: a row that saw no key (an unmasked block left of its window): out 0, lse -inf.
  for_row_dims<kMaxD>(part, D, [&](int n, int d) { out[d] = from_f32<T>(l > 0.0f ? o[n] / l : 0.0f); });
  if (part == 0) a.lse[stat_offset(pr, b, h, i)] = m + logf(l);
}

// dQ: grid (query tiles, H, B). dq_i = scale sum_j P_ij (dP_ij - Delta_i) k_j (times the cap's slope).
template <class T, int kMaxD>
__global__ void __launch_bounds__(kGenThreads) generic_dq_kernel(const Operands<T> a, const Problem pr) {
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
  float dq[kRowDims<kMaxD>] = {};
  for (int j0 = first_visible_key(pr, b, pr.p + i0) / kGenKeys * kGenKeys; j0 < key_end; j0 += kGenKeys) {
    __syncthreads();
    stage_rows(sK, D + 1, kb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    stage_rows(sV, D + 1, vb + j0 * pr.kv_row, pr.kv_row, kGenKeys, pr.S - j0, D);
    __syncthreads();
    for (int n = 0; n < kGenEntries; ++n) {
      const int e = tid + n * kGenThreads, r = e / kGenKeys, jj = e % kGenKeys, j = j0 + jj, i = i0 + r;
      float ds = 0.0f;  // masked entries have P = 0, hence dS = 0
      if (i < pr.c && key_visible(pr, b, j, pr.p + i) && j < pr.S) {
        float s = 0.0f, dp = 0.0f;
        for (int d = 0; d < D; ++d) {
          s += sQ[r * D + d] * sK[jj * (D + 1) + d];
          dp += sdO[r * D + d] * sV[jj * (D + 1) + d];
        }
        const CappedScore cs = cap_score(pr, s * pr.scale);
        const float p = expf(cs.s - a.lse[stat_offset(pr, b, h, i)]);
        ds = p * (dp - a.delta[stat_offset(pr, b, h, i)]) * cs.slope;
      }
      sdS[r * kGenScoreStride + jj] = ds;
    }
    __syncthreads();
    for (int jj = 0; jj < kGenKeys; ++jj) {
      const float ds = sdS[row * kGenScoreStride + jj];
      for_row_dims<kMaxD>(part, D, [&](int n, int d) { dq[n] += ds * sK[jj * (D + 1) + d]; });
    }
  }
  const int i = i0 + row;
  if (i >= pr.c) return;
  T* d_q = a.o + q_offset(pr, b, i, h);
  for_row_dims<kMaxD>(part, D, [&](int n, int d) {
    d_q[d] = from_f32<T>((pr.accumulate ? to_f32(d_q[d]) : 0.0f) + pr.scale * dq[n]);
  });
}

// dK/dV: grid (key tiles, Hkv, B). Thread (key = tid / 4, dims part, part + 4, ...) owns its dK and
// dV elements over every (head of the group, query tile) that can see the key tile, in a fixed order.
template <class T, int kMaxD>
__global__ void __launch_bounds__(kGenThreads) generic_dkdv_kernel(const Operands<T> a, const Problem pr) {
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

  float dk[kKeyDims<kMaxD>] = {}, dv[kKeyDims<kMaxD>] = {};
  // Query i sees key j iff i >= j - p: the first query tile that sees key j0. With a window or
  // documents, the queries from row_end on see none of the tile's keys (their windows or documents
  // start past its last key).
  const int first_tile = max(0, j0 - pr.p) / kGenRows * kGenRows;
  const int row_end = rows_seeing_end(pr, b, j0 + kGenKeys - 1);
  for (int h = g * pr.group; h < (g + 1) * pr.group; ++h) {
    for (int i0 = first_tile; i0 < row_end; i0 += kGenRows) {
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
        if (i < pr.c && key_visible(pr, b, j, pr.p + i) && j < pr.S) {
          float s = 0.0f, dp = 0.0f;
          for (int d = 0; d < D; ++d) {
            s += sQ[r * D + d] * sK[jj * (D + 1) + d];
            dp += sdO[r * D + d] * sV[jj * (D + 1) + d];
          }
          const CappedScore cs = cap_score(pr, s * pr.scale);
          p = expf(cs.s - sLse[r]);
          ds = p * (dp - sDelta[r]) * cs.slope;
        }
        sP[r * kGenScoreStride + jj] = p;
        sdS[r * kGenScoreStride + jj] = ds;
      }
      __syncthreads();
      for (int r = 0; r < kGenRows; ++r) {
        const float p = sP[r * kGenScoreStride + key], ds = sdS[r * kGenScoreStride + key];
#pragma unroll
        for (int n = 0; n < kKeyDims<kMaxD>; ++n) {
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
  for (int n = 0; n < kKeyDims<kMaxD>; ++n) {
    const int d = part + n * kGenKeyThreads;
    if (d < D) {
      d_k[d] += pr.scale * dk[n];
      d_v[d] += dv[n];
    }
  }
}

template <class T, int kMaxD> void simt_forward_at(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  const size_t smem = generic_forward_smem(pr.D);
  set_smem(generic_forward_kernel<T, kMaxD>, smem);
  const dim3 grid((pr.c + kGenRows - 1) / kGenRows, pr.H, pr.B);
  generic_forward_kernel<T, kMaxD><<<grid, kGenThreads, smem, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}

template <class T, int kMaxD> void simt_backward_at(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(pr.B) * pr.c * pr.H;
  delta_kernel<T><<<blocks_for(rows, kDeltaWarps), kDeltaWarps * 32, 0, stream>>>(a, pr);
  CW_KERNEL_CHECK();
  const size_t dkdv_smem = generic_dkdv_smem(pr.D), dq_smem = generic_dq_smem(pr.D);
  set_smem(generic_dkdv_kernel<T, kMaxD>, dkdv_smem);
  set_smem(generic_dq_kernel<T, kMaxD>, dq_smem);
  generic_dkdv_kernel<T, kMaxD>
      <<<dim3((pr.S + kGenKeys - 1) / kGenKeys, pr.Hkv, pr.B), kGenThreads, dkdv_smem, stream>>>(a, pr);
  CW_KERNEL_CHECK();
  generic_dq_kernel<T, kMaxD><<<dim3((pr.c + kGenRows - 1) / kGenRows, pr.H, pr.B), kGenThreads, dq_smem, stream>>>(
      a, pr);
  CW_KERNEL_CHECK();
}

}  // namespace

// Head dims up to 128 take the kernels sized for 128 (the registers of most models' heads); up to
// 256 (Gemma 2's), the larger ones.
template <class T> void simt_forward(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.D <= 128) simt_forward_at<T, 128>(a, pr, stream);
  else simt_forward_at<T, 256>(a, pr, stream);
}

template <class T> void simt_backward(const Operands<T>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.D <= 128) simt_backward_at<T, 128>(a, pr, stream);
  else simt_backward_at<T, 256>(a, pr, stream);
}

template void simt_forward<float>(const Operands<float>&, const Problem&, cudaStream_t);
template void simt_forward<bf16_t>(const Operands<bf16_t>&, const Problem&, cudaStream_t);
template void simt_backward<float>(const Operands<float>&, const Problem&, cudaStream_t);
template void simt_backward<bf16_t>(const Operands<bf16_t>&, const Problem&, cudaStream_t);

}  // namespace cw::gpu::flash
