// Internal to engine/cuda: what the flash attention families share. The families (one file each)
// compute the op of engine/ops/attention.h; attention_flash.cu checks the operands and runs the one
// the chooser named.
//   Math (batch b, query head h, its K/V head g = h / group; query i at position p + i sees keys
//   j <= p + i of the S = p + c keys, and with a sliding window of W keys only those with
//   j > p + i - W, and with packed documents only those with j >= first_b(i), the start of its
//   document; an unmasked call has p >= S, so only the window masks it):
//     s_ij = scale q_i . k_j,  lse_i = log sum_j exp(s_ij),  P_ij = exp(s_ij - lse_i),  out_i = sum_j P_ij v_j;
//     Delta_i = d_out_i . out_i,  dS_ij = P_ij (d_out_i . v_j - Delta_i),
//   (with a score cap, which the SIMT and mma families take: s_ij = cap tanh(scale q_i . k_j / cap),
//   and dS_ij is multiplied by that map's slope 1 - tanh^2 before the two products below),
//     d_q_i = scale sum_j dS_ij k_j (overwrite or accumulate),
//     d_k_j += scale sum_{h in group, i} dS_ij q_i,  d_v_j += sum_{h in group, i} P_ij d_out_i.
//   Layouts: q, out, d_q, d_out [B, c, H, D] contiguous; k, v [B, S, Hkv, D] and d_k, d_v (f32) with
//   any batch stride and a packed [S, Hkv, D] part; lse, Delta [B, H, c] f32 (natural log).
//   Algorithm (every family): online softmax over key blocks (running max m, sum l and unnormalised
//   o rescaled by exp(m - m') when the max grows; out = o / l, lse = m + log l); the backward
//   recomputes P from q, k and lse, so nothing of size c x S is ever stored.
// This header: the problem description, the operand pointers, the PTX and fragment helpers the two
// tensor-core families share, the CTA-to-block mapping, a dK/dV CTA's steps and their row statistics'
// loads, the launch helper and each family's entry points.
#pragma once

#include "engine/cuda/common.cuh"

#include <cstdint>

namespace cw::gpu::flash {

using bf16_t = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = __builtin_huge_valf();

// Everything the kernels need to index the operands (all strides in elements).
struct Problem {
  int B, c, H, Hkv, D, S, p, group;  // group = H / Hkv query heads per K/V head
  int64_t q_row;                     // H * D: between consecutive queries (q, out, d_q, d_out)
  int64_t kv_row;                    // Hkv * D: between consecutive keys (k, v, d_k, d_v)
  int64_t k_batch, v_batch, dk_batch, dv_batch;
  float scale;                       // softmax scale
  float scale_log2;                  // scale * log2(e): scores in the base-2 domain
  bool accumulate;                   // d_q: add into it instead of overwriting
  int window;                        // W: query i sees keys j > p + i - W as well; 0: no window
  // Packed documents (causal calls only): doc_first[b * doc_pitch + i] is the first key of query i's
  // document, ascending in i for each b; nullptr: one document. Query i sees keys j >= it as well.
  // The pitch lets a chunk read its columns of the step's [B, T] table in place.
  const int* doc_first;
  int64_t doc_pitch;
  float softcap;                     // the score cap (SIMT and mma families); 0: none
  float scale_over_cap;              // scale / softcap: the tensor-core kernels' tanh argument per raw score
  float cap_log2;                    // softcap * log2(e): their capped score in the base-2 domain
};

// A scaled score through the score cap: cap tanh(s / cap) and the map's slope 1 - tanh(s / cap)^2
// (the factor of dS). Without a cap, s and 1.
struct CappedScore {
  float s, slope;
};
__device__ __forceinline__ CappedScore cap_score(const Problem& pr, float s) {
  if (pr.softcap == 0.0f) return {s, 1.0f};
  const float t = tanhf(s / pr.softcap);
  return {pr.softcap * t, 1.0f - t * t};
}

// The keys a query sees besides causality: the sliding window (0 < W < p + c, check_common; 0:
// none) and its document (doc_first). Every family masks per element with key_visible and skips the
// key blocks left of a query tile's first visible key (first_visible_key: the tile's first row has
// the earliest, as both bounds ascend with the row), and the query blocks past the last row that sees
// a key block (rows_seeing_end); a block that holds a key left of its last row's first visible key
// (cuts_block) takes the per-element mask like a block on the causal diagonal. A row that sees no key
// at all (only in an unmasked windowed block) ends with l = 0: out 0, lse -inf.
// The first key of the document of chunk row `row` of sequence b (rows past the chunk: its last row's).
__device__ __forceinline__ int document_first_key(const Problem& pr, int b, int row) {
  return pr.doc_first[b * pr.doc_pitch + min(max(row, 0), pr.c - 1)];
}
__device__ __forceinline__ bool key_visible(const Problem& pr, int b, int key, int qpos) {
  return key <= qpos && (pr.window == 0 || key > qpos - pr.window) &&
         (pr.doc_first == nullptr || key >= document_first_key(pr, b, qpos - pr.p));
}
// The first key the query at position qpos sees.
__device__ __forceinline__ int first_visible_key(const Problem& pr, int b, int qpos) {
  const int in_window = pr.window > 0 ? max(0, qpos - pr.window + 1) : 0;
  return pr.doc_first ? max(in_window, document_first_key(pr, b, qpos - pr.p)) : in_window;
}
// One past the last chunk row that sees key `key` (c with neither bound): the window's last row, and
// the first row of a later document (a binary search of doc_first, which ascends).
__device__ __forceinline__ int rows_seeing_end(const Problem& pr, int b, int key) {
  int end = pr.window > 0 ? min(pr.c, key - pr.p + pr.window) : pr.c;
  if (pr.doc_first) {
    int lo = 0, hi = end;  // the first row in [0, end) whose document starts past key, else end
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (document_first_key(pr, b, mid) > key) hi = mid;
      else lo = mid + 1;
    }
    end = lo;
  }
  return end;
}
// Whether the key block starting at k0 holds a key left of the first visible key of the query at
// qpos_last (the tile's last position; earlier rows' first keys are no later).
__device__ __forceinline__ bool cuts_block(const Problem& pr, int b, int k0, int qpos_last) {
  return (pr.window > 0 && k0 <= qpos_last - pr.window) ||
         (pr.doc_first != nullptr && k0 < document_first_key(pr, b, qpos_last - pr.p));
}

// The steps of a dK/dV CTA over the keys [k0, k0 + BC): every (head of the K/V group, block of BR
// queries seeing one of the keys) in a fixed order, step s at head g group + s / nq and query block
// qb_first + s % nq. Query i sees key j iff i >= j - p (and, with a window or documents, i <
// rows_seeing_end): a causal call's key block has at least one query (k0 < S = p + c); with a window
// an unmasked block's keys may have none (no step: its dK, dV add 0).
struct KeyBlockSteps {
  int qb_first, nq, count;
  __device__ __forceinline__ int head(const Problem& pr, int g, int step) const { return g * pr.group + step / nq; }
  __device__ __forceinline__ int q0(int step, int BR) const { return (qb_first + step % nq) * BR; }
};
__device__ __forceinline__ KeyBlockSteps key_block_steps(const Problem& pr, int b, int k0, int BC, int BR) {
  const int nqb = (rows_seeing_end(pr, b, k0 + BC - 1) + BR - 1) / BR, qb_first = max(0, k0 - pr.p) / BR;
  const int nq = max(0, nqb - qb_first);
  return {qb_first, nq, pr.group * nq};
}

template <class T> struct Operands {
  const T* q;
  const T* k;
  const T* v;
  const T* out;    // backward only
  const T* d_out;  // backward only
  T* o;            // forward: out; backward: d_q
  float* lse;      // forward writes, backward reads
  float* delta;    // backward: Delta [B, H, c]
  float* d_k;
  float* d_v;
  float* dq_accum = nullptr;  // fused backward: f32 [B, c, H, D] sums of dS K (unscaled); delta_tc_kernel zeroes it
};

__device__ __forceinline__ int64_t q_offset(const Problem& pr, int b, int i, int h) {
  return ((static_cast<int64_t>(b) * pr.c + i) * pr.H + h) * pr.D;
}
__device__ __forceinline__ int64_t stat_offset(const Problem& pr, int b, int h, int i) {
  return (static_cast<int64_t>(b) * pr.H + h) * pr.c + i;
}

// PTX wrappers shared by the tensor-core kernels.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, bypassing L1; when !valid nothing is read and the 16 bytes are zeroed
// (rows past the end of q or k must be zeros, not garbage: 0 x NaN would poison the products).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// A dK/dV step's lse and Delta of head h's rows [q0, q0 + BR) into shared memory (rows past the chunk
// read nothing and are zeroed), THREADS threads taking a row each in turn.
template <int BR, int THREADS>
__device__ __forceinline__ void load_row_stats(float* sLse, float* sDelta, const float* lse, const float* delta,
                                               const Problem& pr, int b, int h, int q0) {
  for (int r = threadIdx.x; r < BR; r += THREADS) {
    const bool ok = q0 + r < pr.c;
    const int64_t off = ok ? stat_offset(pr, b, h, q0 + r) : 0;
    cp_async4(smem_addr(sLse + r), lse + off, ok);
    cp_async4(smem_addr(sDelta + r), delta + off, ok);
  }
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// 2^x on the special-function unit (about 2 ulp; exp2(-inf) = 0): the bf16 path's exponential.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// tanh x = 1 - 2 / (e^2x + 1) through fast_exp2: within about 1e-7 of tanh absolutely. The hardware's
// tanh.approx is off by up to 2^-11 relatively, which a cap of 50 would turn into 0.03 of a score.
// The argument is clamped at 40 (tanh is 1 in f32 long before), so e^2x stays finite.
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.0f - __fdividef(2.0f, fast_exp2(fminf(x, 40.0f) * (2.0f * kLog2e)) + 1.0f);
}
// A tensor-core kernel's raw score q . k in the base-2 domain of its softmax: scale log2(e) s, or
// with the cap (CAP) cap log2(e) tanh(scale s / cap), `slope` then the cap's 1 - tanh^2 (the factor of
// dS; 1 without the cap).
template <bool CAP> __device__ __forceinline__ float score_log2(const Problem& pr, float s, float& slope) {
  if constexpr (CAP) {
    const float t = fast_tanh(s * pr.scale_over_cap);
    slope = 1.0f - t * t;
    return pr.cap_log2 * t;
  } else {
    slope = 1.0f;
    return s * pr.scale_log2;
  }
}

// dQ accumulator += X, two neighbouring f32: one 8-byte vector atomic where the GPU has it (sm_90
// on), two 4-byte atomics before.
__device__ __forceinline__ void atomic_add2(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#else
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#endif
}

// The bf16 A fragment (mma.m16n8k16 layout, which wgmma's register A shares) of k-step kk of a
// product whose left operand is held as f32 accumulators of 8-column tiles: tiles 2kk and 2kk + 1.
// P and dS go from the score accumulators into P V, dS K, P^T dO and dS^T Q this way.
template <int NT>
__device__ __forceinline__ void a_frag_from_acc(uint32_t (&f)[4], const float (&x)[NT][4], int kk) {
  f[0] = pack_bf16(x[2 * kk][0], x[2 * kk][1]);
  f[1] = pack_bf16(x[2 * kk][2], x[2 * kk][3]);
  f[2] = pack_bf16(x[2 * kk + 1][0], x[2 * kk + 1][1]);
  f[3] = pack_bf16(x[2 * kk + 1][2], x[2 * kk + 1][3]);
}

// d_q[0..1] = scale * (x, y), or += when the problem accumulates (bf16 d_q, one writer per element).
__device__ __forceinline__ void write_d_q_pair(bf16_t* d_q, const Problem& pr, float x, float y) {
  x *= pr.scale, y *= pr.scale;
  uint32_t* dst = reinterpret_cast<uint32_t*>(d_q);
  if (pr.accumulate) {
    const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(dst);
    x += __low2float(old), y += __high2float(old);
  }
  *dst = pack_bf16(x, y);
}

// The end of a dK/dV kernel: a warp's 16 keys (rows key0 + lane / 4, + 8; COLS columns of the head
// dim D from col0, in the accumulator layout) are added into the caller's f32 d_k (times the softmax
// scale) and d_v. One writer per element: the add is deterministic.
template <int D, int COLS = D>
__device__ __forceinline__ void add_key_grads(const Operands<bf16_t>& a, const Problem& pr, int b, int g, int key0,
                                              const float (&dk)[COLS / 8][4], const float (&dv)[COLS / 8][4], int lane,
                                              int col0 = 0) {
  const int t = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = key0 + (lane >> 2) + hh * 8;
    if (key >= pr.S) continue;
    float* d_k = a.d_k + b * pr.dk_batch + key * pr.kv_row + g * D + col0 + 2 * t;
    float* d_v = a.d_v + b * pr.dv_batch + key * pr.kv_row + g * D + col0 + 2 * t;
#pragma unroll
    for (int dt = 0; dt < COLS / 8; ++dt) {
      float2 x = *reinterpret_cast<float2*>(d_k + dt * 8);
      x.x += pr.scale * dk[dt][2 * hh], x.y += pr.scale * dk[dt][2 * hh + 1];
      *reinterpret_cast<float2*>(d_k + dt * 8) = x;
      float2 y = *reinterpret_cast<float2*>(d_v + dt * 8);
      y.x += dv[dt][2 * hh], y.y += dv[dt][2 * hh + 1];
      *reinterpret_cast<float2*>(d_v + dt * 8) = y;
    }
  }
}

// The elementwise middle of a dK/dV step, shared by the mma.sync and wgmma kernels. A warp holds
// S^T and dP^T for its 16 keys (rows key0 + lane / 4, + 8) against the NQ * 8 queries of a block
// starting at q0, in the accumulator layout of mma.m16n8k16; lse and delta are the block's rows in
// shared memory. In place: st becomes P^T = exp(scale S^T - lse), dpt becomes
// dS^T = P^T (dP^T - Delta) (with the cap, P^T = exp(cap tanh(scale S^T / cap) - lse) and dS^T times
// the cap's slope); entries past the causal diagonal, left of the window or of the query's document,
// or past the ends of the sequence are 0 (set, not multiplied: exp of a row's lse -inf is inf).
template <int NQ, bool CAP = false>
__device__ __forceinline__ void probs_and_score_grads_t(float (&st)[NQ][4], float (&dpt)[NQ][4], const float* lse,
                                                        const float* delta, const Problem& pr, int b, int key0,
                                                        int q0, bool masked, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = nt * 8 + 2 * t + (e & 1);  // query within the block
      const int key = key0 + (lane >> 2) + (e >> 1) * 8;
      float slope;
      float p = fast_exp2(score_log2<CAP>(pr, st[nt][e], slope) - lse[col] * kLog2e);
      if (masked && (!key_visible(pr, b, key, pr.p + q0 + col) || q0 + col >= pr.c || key >= pr.S)) p = 0.0f;
      st[nt][e] = p;
      dpt[nt][e] = p * (dpt[nt][e] - delta[col]) * slope;
    }
}

// Which block a CTA of the tensor-core kernels owns. The grid is one-dimensional and ordered
// longest work first across all heads and sequences (the dynamic CTA scheduler then packs the
// short blocks into the tail): query blocks from the last (it sees the most keys) to the first,
// key blocks from the first (seen by the most queries) to the last; heads and batch vary fastest,
// so the heads of one K/V group run side by side and share its K/V tiles in L2.
struct Block {
  int block, head, b;
};
__device__ __forceinline__ Block query_block_of(const Problem& pr, int rows) {
  const int nqb = (pr.c + rows - 1) / rows, r = static_cast<int>(blockIdx.x) / pr.H;
  return {nqb - 1 - r / pr.B, static_cast<int>(blockIdx.x) % pr.H, r % pr.B};
}
__device__ __forceinline__ Block key_block_of(const Problem& pr) {
  const int r = static_cast<int>(blockIdx.x) / pr.Hkv;
  return {r / pr.B, static_cast<int>(blockIdx.x) % pr.Hkv, r % pr.B};
}

template <class Kernel> void set_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) CW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            static_cast<int>(bytes)));
}

// One tiled kernel over `tiles` tiles of its dimension (queries or keys) per (batch, head) pair:
// the tile config supplies the threads and the dynamic shared memory.
template <class Cfg, class Kernel>
void launch_tiled(Kernel kernel, int64_t extent, int64_t tile, int64_t heads, const Operands<bf16_t>& a,
                  const Problem& pr, cudaStream_t stream) {
  set_smem(kernel, Cfg::kSmem);
  const unsigned grid = static_cast<unsigned>((extent + tile - 1) / tile * heads * pr.B);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}


// ---- The families' entry points (the caller has checked the operands and built `pr`) ----
// SIMT (attention_flash_simt.cu), T = float or bf16_t; the backward computes Delta itself.
template <class T> void simt_forward(const Operands<T>& a, const Problem& pr, cudaStream_t stream);
template <class T> void simt_backward(const Operands<T>& a, const Problem& pr, cudaStream_t stream);
// The tensor-core backwards run after the shared Delta pass (attention_flash.cu) and write d_k,
// d_v; with a.dq_accum (zeroed by that pass) they add dS K into it by atomics and the caller
// converts it to d_q; without, they write d_q themselves in a fixed order (bitwise repeatable).
// mma.sync (attention_flash_mma.cu): bf16, D 64, 128 or 256, with or without the score cap.
void mma_forward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream);
void mma_backward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream);
// wgmma (attention_flash_wgmma.cu): the same operands and results on Hopper's warpgroup MMA, D 64
// or 128, no score cap.
// wgmma_built(): this build compiled them (gpu_arch 90a); the caller checks that the device is
// compute capability 9.0.
bool wgmma_built();
void wgmma_forward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream);
void wgmma_backward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream);

}  // namespace cw::gpu::flash
