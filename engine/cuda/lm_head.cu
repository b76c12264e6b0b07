// The LM head fused with cross-entropy on the GPU (the math of engine/ops/lm_head_loss.h):
//   logits[n, :] = x[n, :] Wᵀ                        x [N, C], W [V, C] (compute dtype T: bf16 or f32)
//   lse[n]       = log sum_v exp(logits[n, v])        f32
//   row_loss[n]  = (lse[n] - logits[n, label[n]]) / normaliser,  0 where label[n] = -100     f32
//   G[n, v]      = (softmax(logits[n])[v] - [v == label[n]]) / normaliser,  0 rows where ignored
//   d_x  = G W     [N, C] T    (GradMode overwrite: beta 0, accumulate: beta 1)
//   d_W += Gᵀ x    [V, C] f32  (always accumulated: beta 1)
// labels [N] i32 on the device. Saved for the backward: lse (f32 [N]).
// A final-logit cap (Gemma 2, cap > 0): the row kernel reads each stored logit as z = cap tanh(z / cap)
// in f32 (the stored logits stay uncapped) and multiplies G by 1 - (z / cap)^2; softcap_logits caps
// a logits tensor in place (lm_head_logits).
//
// The [N, V] logits never exist in full. Rows go in blocks; per block of R rows:
//   1. logits_blk [R, V] (T, in scratch) = x_blk Wᵀ                 gpu::matmul, f32 accumulation
//   2. one CUDA block per row (softmax_xent_kernel): an online max / sum-of-exponentials pass over
//      the row in f32 (16-byte vector loads) gives lse and the loss; a second pass overwrites the
//      row in place with G, rounded once to T. The backward (not fused) skips the first pass and
//      reads the saved lse.
//   3. d_W += Gᵀ x_blk (f32 output, beta 1), then d_x_blk = G W (beta 0 or 1)   gpu::matmul
// Forward only: steps 1 and 2's first pass. Backward: 1, 2's second pass, 3 (logits recomputed).
// Fused: all of it in one pass, so the logits GEMM runs once per training step instead of twice.
//
// GEMM mapping (cuBLASLt is column-major; linear.cu's header works the mapping through, with
// linear's I = C and O = V): a row-major [R, K] buffer with row stride ld is the column-major
// [K, R] matrix with leading dimension ld. op() is T (transposed) or N:
//   logits: Lc[V, R] (ld Vp) = Wcᵀ · Xc    m = V, n = R, k = C;  A = W (ld C, op T),     B = x_blk (ld C, op N)
//   d_W:    dWc[C, V] += Xc · Gcᵀ          m = C, n = V, k = R;  A = x_blk (ld C, op N), B = G (ld Vp, op T)
//   d_x:    dXc[C, R] = Wc · Gc            m = C, n = R, k = V;  A = W (ld C, op N),     B = G (ld Vp, op N)
//
// Row block: the GPU ignores the CPU's block_rows (256: far too small to fill the GPU) and picks
// R = min(N, 2048, 512 MiB / (Vp * sizeof(T))) rounded down to a multiple of 64 rows (at least 64;
// cw::lm_head_block_rows in engine.h). The logits scratch is then at most 512 MiB (R x Vp x sizeof(T);
// only a vocabulary above 4M tokens would push a 64-row block past it). At V = 128256 that is
// R = 2048 rows in bf16 (501 MiB), 1024 rows in f32 (501 MiB). The 2048 cap is for small vocabularies:
// beyond 2048 rows the block GEMMs (2048 x V x C) already fill the GPU and larger blocks only cost
// memory. Vp is V rounded up to a 16-byte multiple of T elements (8 bf16 / 4 f32): every logits
// row then starts 16-byte aligned, so the row kernel always takes 16-byte vector loads; the padding
// columns are never written by the GEMM, never read as logits (masked), written as 0 in G and never
// read by the later GEMMs (their k / n is V).
// Extra device memory per call: the logits block and 8 bytes for the label check, in one allocation
// from `scratch` (engine/scratch.h lm_head_scratch_bytes), and gpu::matmul's 32 MiB cuBLASLt workspace (allocated once per process, shared
// with every GEMM).
//
// Cost at N = 8192, C = 2048, V = 128256, bf16 (4 blocks of 2048 rows): 3 GEMMs of 4.3 TFLOP each,
// about 20 ms at cuBLASLt's 600-650 TFLOP/s on an H100, and the row kernel's 1.5 GB of logits traffic
// per block (fused: read, read, write), well under 1 ms per block since the GEMM leaves part of the
// block in L2: the GEMMs are the op's time. Extra device memory at N = 32768: 534 MiB (the 501 MiB
// logits block and the 32 MiB cuBLASLt workspace), where unfused logits in f32 take 16 GiB and
// torch's F.linear + F.cross_entropy 54 GiB. Measured against torch: docs/performance.md, "GPU ops
// against torch" (the LM head row).
//
// Precision: GEMMs accumulate in f32 (f32 mode without TF32: the exactness-check mode); the logits
// are stored in T (bf16 in bf16 mode, like any bf16 linear output); lse, the loss and G are
// computed in f32 from them, and G is rounded once to T. exp is exp2f on a pre-scaled argument (2
// ulp), log is logf.
//
// Labels: every call checks on the device that each label is in [0, V) or -100, before any
// output is touched: a small kernel records the first bad row (integer atomicMin) and the host
// reads that word back once per call. This is the op's one host synchronisation (it waits for the
// work queued before the call, not for the LM head itself); a bad label raises a cw::Error naming
// the row and the value, and leaves every output (d_W included) as it was.
//
// Determinism: the row kernel's reductions follow a fixed thread layout (a function of V only) and
// a fixed shuffle tree; no floating-point atomics; every GEMM goes through gpu::matmul's cached
// plans (one fixed algorithm per shape) on one stream; d_W accumulates block after block in row
// order. Same inputs, same shapes, same bits. The fused op gives the same bits as forward then
// backward (the same row-kernel code, the same f32 lse value, the same GEMM plans; the tests check it).
//
// Aliasing: d_x must not alias x (each block's x rows are read by its d_W GEMM; the op entry checks it). Scratch memory
// is handed back on return while kernels may still run; anything that reuses the arena launches on
// the same stream, after them. Everything runs on current_stream(device) of x's device.
#include "engine/cuda/common.cuh"
#include "engine/cuda/gemm.cuh"
#include "engine/cuda/ops.h"
#include "engine/engine.h"
#include "engine/scratch.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

namespace cw::gpu {

namespace {

// Row kernel: up to 512 threads per row, each issuing kUnroll 16-byte loads before using them (at
// V = 128256 bf16: 16032 vectors per row, 512 threads, about 8 iterations; 4 resident blocks per SM
// keep 128 KB of loads in flight per SM, enough to cover DRAM latency).
constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;
constexpr float kLog2e = 1.4426950408889634f;

// (m, s) <- the pair describing both sets: max M, and sum of exp(z - M) over both.
// An empty set is (-inf, 0).
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;  // both empty
  s = s * exp2f((m - M) * kLog2e) + s2 * exp2f((m2 - M) * kLog2e);
  m = M;
}

// Combines every thread's (m, s) over the block (blockDim.x a multiple of 32) through a fixed
// shuffle tree; every thread returns the block's pair. `sm`, `ss` hold 32 floats each.
__device__ __forceinline__ void block_max_sum(float& m, float& s, float* sm, float* ss) {
  for (int o = 16; o > 0; o >>= 1) combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sm[warp] = m, ss[warp] = s;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    float wm = lane < warps ? sm[lane] : -INFINITY, ws = lane < warps ? ss[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
      combine(wm, ws, __shfl_xor_sync(0xffffffffu, wm, o), __shfl_xor_sync(0xffffffffu, ws, o));
    if (lane == 0) sm[0] = wm, ss[0] = ws;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
}

// A stored logit as the loss reads it: capped when cap > 0 (tanhf: a few ulps, as the CPU's tanh).
__device__ __forceinline__ float capped(float z, float cap) { return cap > 0.0f ? cap * tanhf(z / cap) : z; }

// Visits this thread's 16-byte vectors of a row of nvec vectors (tid, tid + nt, ...): kUnroll
// loads in flight before any is used, then f(vector, index of its first element) for each.
template <int kUnroll, class Vt, class T, class F>
__device__ __forceinline__ void for_row_vectors(const T* row, int nvec, int tid, int nt, F&& f) {
  for (int base = tid; base < nvec; base += kUnroll * nt) {
    Vt v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * nt;
      if (i < nvec) v[u].load(row + static_cast<int64_t>(i) * Vt::kN);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * nt;
      if (i < nvec) f(v[u], static_cast<int64_t>(i) * Vt::kN);
    }
  }
}

// One block per row r of the logits block (row stride ld, a multiple of the vector width; columns
// [V, ld) are padding). Thread t owns the row's vectors t + j * blockDim.x (kUnroll loads in flight).
//   kStats: lse over the row (online max / sum in f32), written to lse_out (if given); row_loss.
//           Rows with an ignored label skip it when no lse is wanted (the fused op).
//   !kStats: lse comes from lse_in (the backward).
//   kGrad:  the row is overwritten in place with G (0 for ignored rows and for the padding).
template <class T, bool kStats, bool kGrad>
__global__ void __launch_bounds__(kMaxThreads)
    softmax_xent_kernel(T* logits, int64_t ld, int64_t V, const int32_t* labels, float* row_loss, float* lse_out,
                        const float* lse_in, float inv_norm, float cap) {
  using Vt = Vec16<T>;
  constexpr int kN = Vt::kN;
  __shared__ float red_m[32], red_s[32];
  const int64_t r = blockIdx.x;
  T* row = logits + r * ld;
  const int32_t label = labels[r];
  // Labels were validated before this launch; the range test only keeps a stray one in bounds.
  const bool supervised = label >= 0 && label < V;
  const int nvec = static_cast<int>(ld / kN);
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);

  float lse = 0.0f;
  if constexpr (kStats) {
    if (supervised || lse_out != nullptr) {
      // Read before any thread overwrites the row with G (after the reduction's barriers).
      const float z_label = (tid == 0 && supervised) ? capped(to_f32(row[label]), cap) : 0.0f;
      float m = -INFINITY, s = 0.0f;
      for_row_vectors<kUnroll, Vt>(row, nvec, tid, nt, [&](const Vt& v, int64_t e0) {
        const int valid = V - e0 < kN ? static_cast<int>(V - e0) : kN;
        float lm = -INFINITY;
#pragma unroll
        for (int k = 0; k < kN; ++k)
          if (k < valid) lm = fmaxf(lm, capped(v.get(k), cap));
        if (lm > m) {  // rescale the running sum to the new maximum
          s *= exp2f((m - lm) * kLog2e);
          m = lm;
        }
#pragma unroll
        for (int k = 0; k < kN; ++k)
          if (k < valid) s += exp2f((capped(v.get(k), cap) - m) * kLog2e);
      });
      block_max_sum(m, s, red_m, red_s);
      lse = m + logf(s);
      if (tid == 0) {
        if (lse_out) lse_out[r] = lse;
        if (row_loss) row_loss[r] = supervised ? (lse - z_label) * inv_norm : 0.0f;
      }
    } else if (tid == 0 && row_loss) {
      row_loss[r] = 0.0f;
    }
  } else {
    lse = lse_in[r];
  }

  if constexpr (kGrad) {
    if (!supervised) {
      const Vt zero{};
      for (int i = tid; i < nvec; i += nt) zero.store(row + static_cast<int64_t>(i) * kN);
      return;
    }
    // Each vector is read (kUnroll in flight) and then overwritten in place by its own thread.
    for_row_vectors<kUnroll, Vt>(row, nvec, tid, nt, [&](const Vt& v, int64_t e0) {
      float g[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int64_t e = e0 + k;
        const float z = capped(v.get(k), cap);
        g[k] = e < V ? exp2f((z - lse) * kLog2e) * inv_norm : 0.0f;
        if (e == label) g[k] -= inv_norm;
        if (cap > 0.0f) g[k] *= 1.0f - (z / cap) * (z / cap);  // dz / d(x Wᵀ)
      }
      Vt::pack(g).store(row + e0);
    });
  }
}

// first_bad = the smallest row whose label is neither -100 nor in [0, V) (left as is when none).
__global__ void check_labels_kernel(const int32_t* labels, int64_t N, int64_t V, unsigned long long* first_bad) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const int32_t l = labels[n];
    if (l != kIgnoreLabel && (l < 0 || l >= V)) atomicMin(first_bad, static_cast<unsigned long long>(n));
  }
}

// Threads per row for nvec vectors: enough that one kUnroll group covers the row, in whole warps,
// at most kMaxThreads. A function of V and T only, so the reduction order is too.
int row_threads(int64_t nvec) {
  const int64_t t = (nvec + kUnroll - 1) / kUnroll;
  return static_cast<int>(std::clamp<int64_t>((t + 31) / 32 * 32, 32, kMaxThreads));
}

// Rows per block (see the header; engine.h computes it, so the memory planner uses the same rule).
int64_t block_rows_for(int64_t N, int64_t ld, size_t elem_bytes) { return lm_head_block_rows(N, ld, elem_bytes); }

// Raises when a label is neither -100 nor in [0, V). `first_bad` is 8 bytes of device scratch.
// Waits for the stream (see the header).
void validate_labels(const Tensor& labels, int64_t V, unsigned long long* first_bad, cudaStream_t stream) {
  const int64_t N = labels.size(0);
  CW_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), stream));
  const unsigned blocks = std::min<unsigned>(blocks_for(N, 256), 1024u);
  check_labels_kernel<<<blocks, 256, 0, stream>>>(dptr<const int32_t>(labels), N, V, first_bad);
  CW_KERNEL_CHECK();
  unsigned long long bad = 0;
  CW_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  CW_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad == ULLONG_MAX) return;
  int32_t value = 0;
  CW_CUDA_CHECK(cudaMemcpyAsync(&value, dptr<const int32_t>(labels) + bad, sizeof(value), cudaMemcpyDeviceToHost,
                                stream));
  CW_CUDA_CHECK(cudaStreamSynchronize(stream));
  fail(CW_FORMAT("lm_head label {} at row {} is outside [0, {}) and is not -100 (ignored)", value, bad, V),
       "labels are token ids of the model's vocabulary, or -100 for positions without a loss");
}

// One pass over row blocks (see the header). row_loss / lse_out written when given; lse_in read
// instead of computing the statistics (the backward); d_x / d_w computed when given.
template <class T>
void run(const Tensor* row_loss, const Tensor* lse_out, const Tensor* lse_in, const Tensor* d_x, const Tensor* d_w,
         const Tensor& x, const Tensor& w, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
         double softcap) {
  const int device = x.device.index;
  const int64_t N = x.size(0), C = x.size(1), V = w.size(0);
  if (N == 0) return;
  const bool stats = lse_in == nullptr, grad = d_x != nullptr || d_w != nullptr;
  if (!stats && !grad) return;  // a backward with no gradient wanted
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);

  constexpr int kN = Vec16<T>::kN;
  const DType dt = x.dtype;
  const int64_t ld = cw::lm_head_logits_ld(V, sizeof(T));  // kN elements a 16-byte vector
  const int64_t rows_max = block_rows_for(N, ld, sizeof(T));
  const int threads = row_threads(ld / kN);
  const float inv_norm = static_cast<float>(1.0 / normaliser), cap = static_cast<float>(softcap);
  const float beta_dx = mode == GradMode::accumulate ? 1.0f : 0.0f;
  const size_t elem = sizeof(T);

  // One scratch allocation: the logits block, then the label check's word (16-byte aligned: ld * elem
  // is a multiple of 16), so the arena never splits the call over two blocks.
  ArenaScope scope(scratch);
  const size_t block_bytes = static_cast<size_t>(rows_max * ld) * elem;
  char* mem = static_cast<char*>(scratch.alloc_bytes(cw::lm_head_scratch_bytes(x.device, N, V, elem, rows_max)));
  void* block = mem;
  validate_labels(labels, V, reinterpret_cast<unsigned long long*>(mem + block_bytes), stream);
  float* loss_p = row_loss ? dptr<float>(*row_loss) : nullptr;
  float* lse_p = lse_out ? dptr<float>(*lse_out) : nullptr;
  const float* lse_in_p = lse_in ? dptr<const float>(*lse_in) : nullptr;
  for (int64_t n0 = 0; n0 < N; n0 += rows_max) {
    const int64_t rows = std::min(rows_max, N - n0);
    const Tensor logits(block, dt, x.device, {rows, ld});
    const void* x_blk = static_cast<const char*>(x.data) + static_cast<size_t>(n0 * C) * elem;
    // Lc[V, R] = Wcᵀ · Xc
    matmul(device, V, rows, C, /*trans_a=*/true, /*trans_b=*/false, w.data, C, x_blk, C, block, ld, dt, dt, 0.0f,
           logits);
    const unsigned grid = static_cast<unsigned>(rows);
    T* lp = static_cast<T*>(block);
    const int32_t* lab = dptr<const int32_t>(labels) + n0;
    float* loss_blk = loss_p ? loss_p + n0 : nullptr;
    float* lse_blk = lse_p ? lse_p + n0 : nullptr;
    const float* lse_in_blk = lse_in_p ? lse_in_p + n0 : nullptr;
    if (stats && grad)
      softmax_xent_kernel<T, true, true><<<grid, threads, 0, stream>>>(lp, ld, V, lab, loss_blk, lse_blk, nullptr,
                                                                       inv_norm, cap);
    else if (stats)
      softmax_xent_kernel<T, true, false><<<grid, threads, 0, stream>>>(lp, ld, V, lab, loss_blk, lse_blk, nullptr,
                                                                        inv_norm, cap);
    else
      softmax_xent_kernel<T, false, true><<<grid, threads, 0, stream>>>(lp, ld, V, lab, nullptr, nullptr, lse_in_blk,
                                                                        inv_norm, cap);
    CW_KERNEL_CHECK();
    if (d_w) {
      // dWc[C, V] += Xc · Gcᵀ  (f32)
      matmul(device, C, V, rows, /*trans_a=*/false, /*trans_b=*/true, x_blk, C, block, ld, d_w->data, C, dt,
             DType::f32, 1.0f, *d_w);
    }
    if (d_x) {
      // dXc[C, R] = Wc · Gc
      const Tensor dx_blk = d_x->slice(0, n0, rows);
      matmul(device, C, rows, V, /*trans_a=*/false, /*trans_b=*/false, w.data, C, block, ld, dx_blk.data, C, dt, dt,
             beta_dx, dx_blk);
    }
  }
}

// z = cap tanh(z / cap) over n logits in place, each rounded once to T.
template <class T> __global__ void softcap_kernel(T* z, int64_t n, float cap) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    z[i] = from_f32<T>(capped(to_f32(z[i]), cap));
}

}  // namespace

// The op's contract (shapes, dtypes, layout, device, aliasing) is checked by the public entry
// (engine/ops/lm_head_loss.cpp); what is checked here is this backend's own: bf16 or f32
// (dispatch_compute), the labels' range (on the device, validate_labels).

void lm_head_loss_forward(const Tensor& row_loss, const LmHeadSaved& saved, const Tensor& x, const Tensor& weight,
                          const Tensor& labels, double normaliser, Arena& scratch,
                          int64_t /*block_rows: the CPU's; the GPU picks its own*/, double softcap) {
  const Tensor* lse = saved.lse.data ? &saved.lse : nullptr;
  dispatch_compute(x.dtype, "lm_head_loss_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run<T>(&row_loss, lse, nullptr, nullptr, nullptr, x, weight, labels, normaliser, GradMode::overwrite, scratch,
           softcap);
  });
}

void lm_head_loss_backward(const Tensor& d_x, const Tensor& d_weight, const LmHeadSaved& saved, const Tensor& x,
                           const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode,
                           Arena& scratch, int64_t /*block_rows*/, double softcap) {
  const Tensor* dx = d_x.data ? &d_x : nullptr;
  const Tensor* dw = d_weight.data ? &d_weight : nullptr;
  dispatch_compute(x.dtype, "lm_head_loss_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run<T>(nullptr, nullptr, &saved.lse, dx, dw, x, weight, labels, normaliser, mode, scratch, softcap);
  });
}

void lm_head_loss_fused(const Tensor& row_loss, const Tensor& d_x, const Tensor& d_weight, const Tensor& x,
                        const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
                        int64_t /*block_rows*/, double softcap) {
  const Tensor* dx = d_x.data ? &d_x : nullptr;
  const Tensor* dw = d_weight.data ? &d_weight : nullptr;
  dispatch_compute(x.dtype, "lm_head_loss_fused", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run<T>(&row_loss, nullptr, nullptr, dx, dw, x, weight, labels, normaliser, mode, scratch, softcap);
  });
}

void softcap_logits(const Tensor& logits, double softcap) {
  const int64_t n = logits.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(logits.device.index);
  dispatch_compute(logits.dtype, "lm_head_logits", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks_for(n, 256), 65536));
    softcap_kernel<T><<<grid, 256, 0, stream>>>(dptr<T>(logits), n, static_cast<float>(softcap));
    CW_KERNEL_CHECK();
  });
}

}  // namespace cw::gpu
