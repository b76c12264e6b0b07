// Linear (y = x Wᵀ, no bias) on the GPU through cuBLASLt: the math of engine/ops/linear.h.
//   forward:  out[N, O] (T)          = x[N, I] (T) · W[O, I]ᵀ (T)
//   backward: d_x[N, I] (T)          = d_out[N, O] · W[O, I]          (overwrite: beta 0, accumulate: beta 1)
//             d_W[O, I] (f32)       += d_out[N, O]ᵀ · x[N, I]         (always accumulates: beta 1)
// T is bf16 (CUDA_R_16BF) or f32 (CUDA_R_32F), one T per call; the accumulation is f32 in every case
// (CUBLAS_COMPUTE_32F, f32 alpha/beta). f32 deliberately does NOT use CUBLAS_COMPUTE_32F_FAST_TF32:
// f32 is the exactness-check mode and must stay IEEE f32. d_W takes A/B in T and C/D in f32 (bf16
// inputs with an f32 output are a supported cuBLASLt combination), so the parameter gradient is
// never rounded to bf16. Either gradient may be undefined (Tensor{}): it is skipped.
//
// Row-major to column-major. cuBLASLt is column-major: a row-major [R, C] matrix with row stride C
// is, to cuBLASLt, the column-major [C, R] matrix (its transpose) with leading dimension C. Writing
// Xc = Xᵀ ([I, N], ld I), Wc = Wᵀ ([I, O], ld I), Yc = Yᵀ ([O, N], ld O) for the buffers as cuBLASLt
// sees them, each product is D[m, n] = op(A)[m, k] · op(B)[k, n] with:
//   forward   Y = X Wᵀ      <=>  Yᵀ  = W Xᵀ        <=>  Yc  = Wcᵀ · Xc
//             A = W buffer  (layout [I, O], ld I), transA = T;  B = X buffer (layout [I, N], ld I), transB = N
//             m = O, n = N, k = I; C = D = out buffer (layout [O, N], ld O)
//   d_x       dX = dY W     <=>  dXᵀ = Wᵀ dYᵀ      <=>  dXc = Wc · dYc
//             A = W buffer  (layout [I, O], ld I), transA = N;  B = dY buffer (layout [O, N], ld O), transB = N
//             m = I, n = N, k = O; C = D = d_x buffer (layout [I, N], ld I)
//   d_W       dW += dYᵀ X   <=>  dWᵀ += Xᵀ dY      <=>  dWc += Xc · dYcᵀ
//             A = X buffer  (layout [I, N], ld I), transA = N;  B = dY buffer (layout [O, N], ld O), transB = T
//             m = I, n = O, k = N; C = D = d_W buffer (layout [I, O], ld I), f32
// (A layout describes the matrix as stored, before op(): rows x cols = k x m when transA = T.)
//
// Resources: one cuBLASLt handle per device and one 32 MiB workspace per device (from the caching
// pool, gpu::device_alloc), both created on first use and kept for the life of the process. Every
// call runs on gpu::current_stream(device), so calls on one device are serialised and never share
// the workspace concurrently.
//
// Plans: the matmul descriptor, the three layouts and the algorithm chosen by
// cublasLtMatmulAlgoGetHeuristic are cached per (device, m, n, k, transposes, leading dimensions,
// dtypes, pointer-alignment class of A/B/C/D) in a small map; a repeated call reuses them and never
// re-queries the heuristic. Pointer alignment is part of the key because algorithms may require
// aligned buffers (the heuristic is told the real alignment, capped at 256 bytes; pool allocations
// are always 256-byte aligned, so in practice one problem shape gets one plan).
//
// Determinism: for a given plan cuBLASLt runs one fixed algorithm, and every split-K reduction
// scheme it may pick is ordered (INPLACE serialises the parts through counters; COMPUTE_TYPE and
// OUTPUT_TYPE reduce the workspace in a separate fixed-order step), with no floating-point atomics.
// Because the heuristic is asked once and its answer reused, and all work goes to the device's one
// stream with its own workspace, the same inputs give the same bits on every call
// (tests/engine/test_cuda_linear.cpp checks it).
#include "engine/cuda/common.cuh"
#include "engine/cuda/gemm.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace cw::gpu {
namespace {

constexpr size_t kWorkspaceBytes = cw::kCublasWorkspaceBytes;


struct DeviceContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};

// One matmul configuration, ready to run.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // D uses c's layout (same dtype/shape)
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
};

// (device, m, n, k, transA, transB, lda, ldb, ldc, AB dtype, CD dtype, align A, B, C, D, tuned)
using PlanKey = std::array<int64_t, 16>;

std::mutex g_mutex;                                   // guards the two maps below
std::map<int, DeviceContext> g_devices;               // never erased: handles live for the process
std::map<PlanKey, std::unique_ptr<Plan>> g_plans;     // never erased: plans are reused forever

// Called with g_mutex held and `device` current.
DeviceContext& device_context(int device) {
  auto it = g_devices.find(device);
  if (it != g_devices.end()) return it->second;
  DeviceContext ctx;
  CW_CUBLAS_CHECK(cublasLtCreate(&ctx.handle));
  ctx.workspace = device_alloc(kWorkspaceBytes, device);
  return g_devices.emplace(device, ctx).first->second;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    default: break;
  }
  CW_CHECK(false, "linear (GPU): dtype {} has no cuBLASLt mapping here", dtype_name(t));
  return CUDA_R_32F;
}

// The largest power of two dividing the address, capped at 256 (cuBLASLt's default assumption).
uint32_t alignment_of(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a /= 2;
  return a;
}

void set_pref_u32(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, uint32_t v) {
  CW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v)));
}

// ---- Tuning (engine.h, gemm_tuning) ----
constexpr int kTuneCandidates = 8;
constexpr size_t kTuneMaxOutputBytes = size_t(512) << 20;
GemmTuneStats g_tune_stats;  // guarded by g_mutex

// Tuning is on where asked for and results need not be reproducible.
bool tuning_on() { return gemm_tuning() && !deterministic(); }

// The fastest of cuBLASLt's `found` candidates for `plan`, timed on the call's own operands: each runs
// once untimed, then three times timed (median_ms), its median counting.
// The output D is the call's: where the call accumulates (beta != 0) its contents wait in host memory
// and are put back, so the call sees what it would have; an output over kTuneMaxOutputBytes keeps
// the heuristic's first answer (index 0). Candidates cuBLASLt refuses to run are passed over.
int fastest(DeviceContext& ctx, int device, const Plan& plan, const cublasLtMatmulHeuristicResult_t* results,
            int found, const void* A, const void* B, void* D, size_t d_bytes, float beta) {
  if (d_bytes > kTuneMaxOutputBytes) return 0;
  cudaStream_t stream = current_stream(device);
  std::vector<char> saved;
  if (beta != 0.0f) {
    saved.resize(d_bytes);
    CW_CUDA_CHECK(cudaMemcpyAsync(saved.data(), D, d_bytes, cudaMemcpyDeviceToHost, stream));
  }
  const float alpha = 1.0f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo, size_t ws) {
    return cublasLtMatmul(ctx.handle, plan.desc, &alpha, A, plan.a, B, plan.b, &beta, D, plan.c, D, plan.c, &algo,
                          ctx.workspace, ws, stream);
  };
  std::vector<float> best_ms(static_cast<size_t>(found), -1.0f);
  for (int i = 0; i < found; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[i];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > kWorkspaceBytes) continue;
    if (run(r.algo, r.workspaceSize) != CUBLAS_STATUS_SUCCESS) continue;
    best_ms[static_cast<size_t>(i)] = static_cast<float>(
        median_ms([&] { CW_CUBLAS_CHECK(run(r.algo, r.workspaceSize)); }, device, /*warmup=*/0, /*repeat=*/3));
  }
  if (!saved.empty()) {
    CW_CUDA_CHECK(cudaMemcpyAsync(D, saved.data(), d_bytes, cudaMemcpyHostToDevice, stream));
    CW_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  int chosen = best_ms[0] >= 0 ? 0 : -1;
  for (int i = 1; i < found; ++i)
    if (best_ms[static_cast<size_t>(i)] >= 0 && (chosen < 0 || best_ms[static_cast<size_t>(i)] < best_ms[static_cast<size_t>(chosen)]))
      chosen = i;
  if (chosen < 0) return 0;  // none ran: the real call reports why
  g_tune_stats.plans += 1;
  g_tune_stats.changed += chosen != 0;
  if (best_ms[0] >= 0) {
    g_tune_stats.first_ms += best_ms[0];
    g_tune_stats.chosen_ms += best_ms[static_cast<size_t>(chosen)];
  }
  return chosen;
}

// D[m, n] (cd) = alpha op(A)[m, k] (ab) · op(B)[k, n] (ab) + beta C, column-major, C = D in place.
// m, n, k > 0. Returns the cached plan, building it on first use (g_mutex held, device current).
const Plan& get_plan(DeviceContext& ctx, int device, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b,
                     int64_t lda, int64_t ldb, int64_t ldc, DType ab, DType cd, const void* A, const void* B,
                     void* C, float beta) {
  const uint32_t al_a = alignment_of(A), al_b = alignment_of(B), al_c = alignment_of(C);
  const bool tune = tuning_on();
  const PlanKey key = {device, m, n, k, trans_a, trans_b, lda, ldb, ldc, static_cast<int64_t>(ab),
                       static_cast<int64_t>(cd), al_a, al_b, al_c, al_c, tune};
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return *it->second;

  auto plan = std::make_unique<Plan>();
  // Descriptor: f32 accumulation and f32 alpha/beta (host pointers, the default pointer mode).
  CW_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  CW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // Layouts as stored (column-major rows x cols, before op()).
  const uint64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const uint64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  CW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(ab), a_rows, a_cols, lda));
  CW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(ab), b_rows, b_cols, ldb));
  CW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, cuda_type(cd), static_cast<uint64_t>(m),
                                             static_cast<uint64_t>(n), ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  CW_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  std::array<cublasLtMatmulHeuristicResult_t, kTuneCandidates> results{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS) {
    try {
      set_pref_u32(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a);
      set_pref_u32(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b);
      set_pref_u32(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c);
      set_pref_u32(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c);
    } catch (...) {
      cublasLtMatmulPreferenceDestroy(pref);
      throw;
    }
    st = cublasLtMatmulAlgoGetHeuristic(ctx.handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                        tune ? kTuneCandidates : 1, results.data(), &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  CW_CUBLAS_CHECK(st);
  CW_CHECK(found > 0 && results[0].state == CUBLAS_STATUS_SUCCESS,
           "linear (GPU): cuBLASLt has no algorithm for m={} n={} k={} op(A)={} op(B)={} A/B {} C/D {} "
           "(alignment A {} B {} C {} bytes)",
           m, n, k, trans_a ? "T" : "N", trans_b ? "T" : "N", dtype_name(ab), dtype_name(cd), al_a, al_b, al_c);
  int chosen = 0;
  if (tune && found > 1) chosen = fastest(ctx, device, *plan, results.data(), found, A, B, C, ldc * n * dtype_size(cd), beta);
  const cublasLtMatmulHeuristicResult_t& result = results[static_cast<size_t>(chosen)];
  CW_CHECK(result.workspaceSize <= kWorkspaceBytes, "linear (GPU): cuBLASLt algorithm wants {} bytes of workspace",
           result.workspaceSize);
  plan->algo = result.algo;
  plan->workspace_bytes = result.workspaceSize;
  return *g_plans.emplace(key, std::move(plan)).first->second;
}

}  // namespace

GemmTuneStats gemm_tune_stats() {
  std::lock_guard<std::mutex> lock(g_mutex);
  GemmTuneStats s = g_tune_stats;
  s.on = tuning_on();
  return s;
}

// The one matmul entry (declared in engine/cuda/gemm.cuh): D = alpha op(A) op(B) + beta D on `dst`'s
// device and stream. `dst` is the tensor behind D (used for the k == 0 case, where the product is
// empty and D = beta D).
void matmul(int device, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, const void* A, int64_t lda,
            const void* B, int64_t ldb, void* D, int64_t ldd, DType ab, DType cd, float beta, const Tensor& dst,
            float alpha) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty sum: overwrite gives zeros, accumulate leaves D unchanged
    if (beta == 0.0f) gpu::fill(dst, 0.0);
    return;
  }
  DeviceGuard guard(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceContext& ctx = device_context(device);
  const Plan& plan = get_plan(ctx, device, m, n, k, trans_a, trans_b, lda, ldb, ldd, ab, cd, A, B, D, beta);
  CW_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.desc, &alpha, A, plan.a, B, plan.b, &beta, D, plan.c, D, plan.c,
                                 &plan.algo, ctx.workspace, plan.workspace_bytes, current_stream(device)));
}

Tensor cublas_workspace(int device) {
  DeviceGuard guard(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  return Tensor(device_context(device).workspace, DType::i32, Device::gpu(device),
                {static_cast<int64_t>(kWorkspaceBytes / 4)});
}

namespace {
// The op's contract (shapes, dtypes, layout, device, aliasing) is checked by the public entry
// (engine/ops/linear.cpp); what is checked here is this backend's own: cuBLASLt runs bf16 or f32.
void check_compute_dtype(const Tensor& x) {
  CW_CHECK(x.dtype == DType::bf16 || x.dtype == DType::f32, "linear x: the GPU linear takes bf16 or f32, got {}",
           dtype_name(x.dtype));
}
}  // namespace

void linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight) {
  check_compute_dtype(x);
  const int device = x.device.index;
  const int64_t N = x.size(0), I = x.size(1), O = weight.size(0);
  // Yc[O, N] = Wcᵀ · Xc  (see the header)
  matmul(device, O, N, I, /*trans_a=*/true, /*trans_b=*/false, weight.data, I, x.data, I, out.data, O, x.dtype, x.dtype,
         0.0f, out);
}

// x's data is read only for d_weight (without it the caller may pass d_x for x's shape).
void linear_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const Tensor& x,
                     const Tensor& weight, GradMode mode) {
  check_compute_dtype(x);
  const int device = x.device.index;
  const int64_t N = x.size(0), I = x.size(1), O = weight.size(0);
  if (d_x.data) {
    // dXc[I, N] = Wc · dYc
    matmul(device, I, N, O, /*trans_a=*/false, /*trans_b=*/false, weight.data, I, d_out.data, O, d_x.data, I, x.dtype,
           x.dtype, mode == GradMode::accumulate ? 1.0f : 0.0f, d_x);
  }
  if (d_weight.data) {
    // dWc[I, O] += Xc · dYcᵀ
    matmul(device, I, O, N, /*trans_a=*/false, /*trans_b=*/true, x.data, I, d_out.data, O, d_weight.data, I, x.dtype,
           DType::f32, 1.0f, d_weight);
  }
}

}  // namespace cw::gpu
