// cuDNN fused attention (the `cudnn` family of engine/ops/attention.h): the entry points
// (engine/cuda/ops.h). attention_cudnn_graphs.cu builds a call's graphs and finds their plans,
// attention_cudnn_plans.cu caches the plans and says which one a call runs; this file checks what
// cuDNN serves, runs the plans, and adds their outputs into the caller's buffers.
//   Computes the op's math: chunk-against-cache causal attention with grouped K/V heads (query i of
//   the chunk at position p + i sees keys j <= p + i of the S = p + c keys: the mask is aligned
//   BOTTOM-RIGHT), out and lse forward; d_q (overwrite or accumulate) and d_k, d_v (always ADDED)
//   backward. Unmasked (AttentionMask::none, a streamed key block): the same graphs without the
//   mask, any S >= 1, one exact plan per shape.
//   Operands (no copies): q, out, d_q, d_out [B, c, H, D] bf16 contiguous, as cuDNN tensors
//   (B, H, c, D) with strides (c H D, D, H D, 1); k, v [B, S, Hkv, D] bf16 with batch stride kb as
//   (B, Hkv, S, D) with strides (kb, D, Hkv D, 1) (K^T: dims (B, Hkv, D, S), strides (kb, D, 1, Hkv D));
//   cuDNN broadcasts Hkv < H heads itself. lse [B, H, c] f32 is the stats tensor (B, H, c, 1).
//   D a multiple of 8 up to 128, 16-byte aligned operands, cuDNN >= 9.3 (bottom-right causal
//   masks in the fused engine), compute capability 8.0+.
//   Saved: nothing beyond lse. Accumulates: cuDNN overwrites its outputs, so dK, dV (bf16) go to
//   packed scratch and add_kv_kernel adds them into the caller's f32 d_k, d_v (any batch stride);
//   in accumulate mode d_q comes to scratch too and add_q_kernel adds it. No atomics of ours.
//   Workspace and scratch come from the caller's `scratch` arena.
//   The prefix apart (a split plan, attention_cudnn_plans.cu) runs as two graphs, the chunk against
//   [0, p) unmasked and against its own [p, S) causal with p = 0 (the square case, whose engine
//   skips the tiles above the diagonal; the bottom-right mask is computed on every tile). Forward: the
//   own block's out and lse into the caller's, the prefix's beside them, merged (attention_merge,
//   bf16 in place). Backward: each part given the whole row's out and lse, its dK, dV added into its
//   own rows, the prefix's dQ added to the own block's. With grouped K/V heads the prefix's backward
//   runs stacked (cw::cudnn_stack_gqa, Shape::stacked): unmasked, the G query heads of a K/V head are
//   one head of G c rows, so q, out and d_out are copied head-major [B, H, c, D] (lse and Delta
//   [B, H, c] already are), cuDNN sums dK, dV over all G c rows in its own kernel (no per-query-head
//   dK, dV and no reduction pass over G p rows), and the head-major dQ is added back transposed. The
//   scratch is taken once for both parts, laid out as one graph's.
//   Chosen by the chooser (engine/ops/attention.cpp) for bf16 forwards it serves, and for backwards
//   when determinism is off and the plan's workspace fits the budget; forced (CW_ATTENTION=cudnn)
//   the deterministic form serves the determinism switch.
#include "engine/cuda/attention_cudnn.cuh"

#include "chunkwise_config.h"
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/scratch.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace cw::gpu::cudnn_attention {
namespace {
bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlignment == 0; }
}  // namespace

[[noreturn]] void raise_cudnn(cudnnStatus_t s, const char* expr, const char* file, int line) {
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  detail::raise(expr, file, line,
                CW_FORMAT("cuDNN error {} ({}){}{}", static_cast<int>(s), cudnnGetErrorString(s),
                          last[0] ? ": " : "", last));
}

std::string static_reason(const Tensor& q, const Tensor& k, bool causal) {
  const int64_t v = runtime_version();
  if (v < kMinCudnnVersion)
    return CW_FORMAT("the cuDNN library loaded at run time is version {}; bottom-right causal fused attention "
                     "needs {} or newer",
                     v, kMinCudnnVersion);
  if (q.device.is_cpu() || k.device.is_cpu()) return "operands are not on a GPU";
  if (q.dtype != DType::bf16 || k.dtype != DType::bf16)
    return CW_FORMAT("dtype {} (the cuDNN path takes bf16 only)", dtype_name(q.dtype));
  if (q.ndim != 4 || k.ndim != 4) return "q and k must be 4-d";
  const int64_t D = q.size(3), H = q.size(2), Hkv = k.size(2), c = q.size(1), S = k.size(1);
  if (D % 8 != 0 || D > kMaxHeadDim || D <= 0)
    return CW_FORMAT("head dim {} (cuDNN needs a multiple of 8 up to {})", D, kMaxHeadDim);
  if (k.size(3) != D || k.size(0) != q.size(0)) return "q and k shapes disagree";
  if (Hkv <= 0 || H % Hkv != 0) return "query heads not a multiple of K/V heads";
  if (c <= 0 || S <= 0 || (causal && S < c)) return causal ? "needs 1 <= c <= S" : "needs c >= 1 and S >= 1";
  // The engine cuDNN picks for one query row gives out and lse that differ in the last bits from one
  // call to the next (seen masked and unmasked, D 32 to 128, determinism on).
  if (c == 1) return "one query (cuDNN's engine for a single row is not reproducible bit for bit; flash serves it)";
  if (!q.contiguous()) return "q is not contiguous";
  if (k.stride[1] != Hkv * D || k.stride[2] != D || k.stride[3] != 1) return "k's [S, Hkv, D] is not packed";
  if (k.stride[0] % 8 != 0 || !aligned(k.data) || !aligned(q.data))
    return "operands not 16-byte aligned (K/V batch stride must be a multiple of 8 elements)";
  int major = 0;
  CW_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device.index));
  if (major < 8) return CW_FORMAT("compute capability {}.x (cuDNN fused attention needs 8.0+)", major);
  return "";
}

namespace {

// What is cuDNN's own on top of the op's contract (engine/ops/attention.cpp checks shapes, dtypes,
// layouts and devices before any backend runs): the static conditions, a V batch stride that keeps
// rows 16-byte aligned, and 16-byte aligned operands.
void check_operands(const Tensor& q, const Tensor& k, const Tensor& v, std::initializer_list<const Tensor*> others,
                    bool causal) {
  const std::string why = static_reason(q, k, causal);
  CW_CHECK(why.empty(), "cuDNN attention cannot take q {} k {}: {}", q.describe(), k.describe(), why);
  CW_CHECK(v.stride[0] % 8 == 0, "cuDNN attention: v {} needs a batch stride that is a multiple of 8", v.describe());
  for (const Tensor* t : others)
    CW_CHECK(aligned(t->data), "cuDNN attention: operand {} is not 16-byte aligned", t->describe());
}

// Runs `plan` on the operands of the variant pack, with its workspace `ws` (at least plan.workspace
// bytes; a split plan's parts share the larger of theirs: workspace()).
void execute(const Plan& plan, int device, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs, void* ws) {
  const cudnnHandle_t handle = device_handle(device);
  current_stream(device);  // makes the device current
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()),
           ptrs.data());
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  CW_CUDNN_CHECK(cudnnBackendFinalize(pack.d));
  CW_CUDNN_CHECK(cudnnBackendExecute(handle, plan.plan->d, pack.d));
}

// ---------------------------------------------------------------------------------------------
// Adding the scratch gradients into the caller's buffers.

constexpr int kAddThreads = 256;

// dst[b, r] += src[b, r] for r < row (row = S Hkv D elements per batch entry; dst f32 with batch
// stride dst_bs, src bf16 with batch stride src_bs, a multiple of 8: a shared plan's scratch holds
// its extent's rows, of which the first S are the call's). blockIdx.y = b, blockIdx.z picks the
// (K, V) pair. Each thread
// adds 8 consecutive elements (row is a multiple of 8: D is); with kVec (every row start 16-byte
// aligned) through 16-byte loads and stores, so the pass runs at memory speed.
template <bool kVec>
__global__ void add_kv_kernel(float* dk, float* dv, const __nv_bfloat16* sk, const __nv_bfloat16* sv, int64_t row,
                              int64_t src_bs, int64_t dk_bs, int64_t dv_bs) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= row) return;
  const int64_t b = blockIdx.y;
  float* d = (blockIdx.z == 0 ? dk + b * dk_bs : dv + b * dv_bs) + i;
  const __nv_bfloat16* s = (blockIdx.z == 0 ? sk : sv) + b * src_bs + i;
  if constexpr (kVec) {
    float v[8];
    const uint4 raw = *reinterpret_cast<const uint4*>(s);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[2 * j] = __low2float(h[j]), v[2 * j + 1] = __high2float(h[j]);
    float4* d4 = reinterpret_cast<float4*>(d);
    float4 lo = d4[0], hi = d4[1];
    lo.x += v[0], lo.y += v[1], lo.z += v[2], lo.w += v[3];
    hi.x += v[4], hi.y += v[5], hi.z += v[6], hi.w += v[7];
    d4[0] = lo;
    d4[1] = hi;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] += to_f32(s[j]);
  }
}

void launch_add_kv(const Tensor& d_k, const Tensor& d_v, const void* sk, const void* sv, int64_t B, int64_t row,
                   int64_t src_bs, cudaStream_t stream) {
  const dim3 grid(blocks_for(row / 8, kAddThreads), static_cast<unsigned>(B), 2);
  auto row_aligned = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (t.size(0) == 1 || t.stride[0] % 4 == 0);
  };
  float *dk = static_cast<float*>(d_k.data), *dv = static_cast<float*>(d_v.data);
  const auto *s_k = static_cast<const __nv_bfloat16*>(sk), *s_v = static_cast<const __nv_bfloat16*>(sv);
  if (row_aligned(d_k) && row_aligned(d_v))
    add_kv_kernel<true><<<grid, kAddThreads, 0, stream>>>(dk, dv, s_k, s_v, row, src_bs, d_k.stride[0], d_v.stride[0]);
  else
    add_kv_kernel<false><<<grid, kAddThreads, 0, stream>>>(dk, dv, s_k, s_v, row, src_bs, d_k.stride[0], d_v.stride[0]);
}

// d_q += src, both bf16 [n] packed; the sum is formed in f32 and rounded once.
__global__ void add_q_kernel(__nv_bfloat16* dq, const __nv_bfloat16* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dq[i] = __float2bfloat16_rn(__bfloat162float(dq[i]) + __bfloat162float(src[i]));
}

// A stacked prefix's operands (Shape::stacked): dst[b, h, t, :] = src[b, t, h, :] for q, out and d_out
// (blockIdx.y picks one), [B, c, H, D] bf16 packed into [B, H, c, D]; each thread moves 8 elements
// (D is a multiple of 8, operands 16-byte aligned).
struct HeadsMajorCopies {
  const __nv_bfloat16* src[3];
  __nv_bfloat16* dst[3];
};
__global__ void heads_major_kernel(HeadsMajorCopies copies, int64_t B, int64_t c, int64_t H, int64_t D) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, per_row = D / 8;
  if (i >= B * H * c * per_row) return;
  const int64_t d8 = i % per_row, t = i / per_row % c, h = i / per_row / c % H, b = i / per_row / c / H;
  const int64_t from = ((b * c + t) * H + h) * D + d8 * 8;
  *reinterpret_cast<uint4*>(copies.dst[blockIdx.y] + i * 8) =
      *reinterpret_cast<const uint4*>(copies.src[blockIdx.y] + from);
}

// dq[b, t, h, :] += src[b, h, t, :] (a stacked prefix's head-major dQ), the sum formed in f32 and
// rounded once; 8 elements a thread.
__global__ void add_q_heads_kernel(__nv_bfloat16* dq, const __nv_bfloat16* src, int64_t B, int64_t c, int64_t H,
                                   int64_t D) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, per_row = D / 8;
  if (i >= B * c * H * per_row) return;
  const int64_t d8 = i % per_row, h = i / per_row % H, t = i / per_row / H % c, b = i / per_row / H / c;
  const int64_t from = ((b * H + h) * c + t) * D + d8 * 8;
  uint4 acc = *reinterpret_cast<const uint4*>(dq + i * 8);
  const uint4 add = *reinterpret_cast<const uint4*>(src + from);
  __nv_bfloat162* a = reinterpret_cast<__nv_bfloat162*>(&acc);
  const __nv_bfloat162* s = reinterpret_cast<const __nv_bfloat162*>(&add);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    a[j] = __floats2bfloat162_rn(__low2float(a[j]) + __low2float(s[j]), __high2float(a[j]) + __high2float(s[j]));
  *reinterpret_cast<uint4*>(dq + i * 8) = acc;
}

// seq_len_q[b] = c, seq_len_kv[b] = S: the real counts a shared plan masks with.
__global__ void fill_lengths_kernel(int32_t* seq_len_q, int32_t* seq_len_kv, int64_t B, int32_t c, int32_t S) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < B) {
    seq_len_q[b] = c;
    seq_len_kv[b] = S;
  }
}

// What the mask reads at run time: the lowest float its selects write (masked graphs only). Exact
// plans with p > 0: the by-value int32 offsets of the bottom-right mask, row + S - c (none for p = 0). Shared plans: the length tensors, in `scratch`
// (the caller's scope releases them after the call).
struct MaskOperands {
  int32_t s = 0, c = 0;
  float lowest = std::numeric_limits<float>::lowest();
  bool masked = true;  // an unmasked graph has no select, so its variant pack must not name kNegInf
  bool scalars = false;
  void* seq_len_q = nullptr;
  void* seq_len_kv = nullptr;

  MaskOperands(const Shape& sh, int64_t S, Arena& scratch, cudaStream_t stream)
      : s(static_cast<int32_t>(S)),
        c(static_cast<int32_t>(sh.c)),
        masked(sh.causal || sh.shared),
        scalars(!sh.shared && sh.causal && sh.p() > 0) {
    if (!sh.shared) return;
    seq_len_q = scratch.alloc_bytes(static_cast<size_t>(sh.B) * sizeof(int32_t));
    seq_len_kv = scratch.alloc_bytes(static_cast<size_t>(sh.B) * sizeof(int32_t));
    fill_lengths_kernel<<<blocks_for(sh.B, kAddThreads), kAddThreads, 0, stream>>>(
        static_cast<int32_t*>(seq_len_q), static_cast<int32_t*>(seq_len_kv), sh.B, c, s);
    CW_KERNEL_CHECK();
  }
  void add_to(std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
    if (masked) {
      uids.push_back(kNegInf);
      ptrs.push_back(&lowest);
    }
    if (scalars) {
      uids.insert(uids.end(), {kSkv, kSq});
      ptrs.insert(ptrs.end(), {&s, &c});
    }
    if (seq_len_q) {
      uids.insert(uids.end(), {kSeqLenQ, kSeqLenKv});
      ptrs.insert(ptrs.end(), {seq_len_q, seq_len_kv});
    }
  }
};

}  // namespace
}  // namespace cw::gpu::cudnn_attention

namespace cw::gpu {
using namespace cudnn_attention;

int64_t cudnn_runtime_version() { return runtime_version(); }

namespace {
// What both directions share: the static rules, then shapes cuDNN already rejected in `direction`.
bool supports(const Tensor& q, const Tensor& k, bool backward, std::string* why_not, bool causal) {
  std::string why = static_reason(q, k, causal);
  if (why.empty()) {
    // Shapes cuDNN already rejected are not offered again.
    if (const std::optional<std::string> r = refusal(shape_of(q, k, k, backward, causal)))
      why = "cuDNN rejected this shape: " + *r;
  }
  if (why_not) *why_not = why;
  return why.empty();
}
}  // namespace

bool cudnn_attention_supports(const Tensor& q, const Tensor& k, std::string* why_not, bool causal) {
  return supports(q, k, false, why_not, causal) && supports(q, k, true, why_not, causal);
}

bool cudnn_attention_forward_supports(const Tensor& q, const Tensor& k, std::string* why_not, bool causal) {
  return supports(q, k, false, why_not, causal);
}

bool cudnn_attention_backward_fits(const Tensor& q, const Tensor& k, const Tensor& v, int64_t max_workspace,
                                   std::string* why_not, bool causal) {
  if (!supports(q, k, true, why_not, causal)) return false;
  std::string why;
  Shape sh{};
  const Plan* plan = resolve_plan(q, k, v, true, &sh, &why, causal);
  if (plan == nullptr) {
    if (why_not) *why_not = "cuDNN has no backward plan: " + why;
    return false;
  }
  if (plan->workspace > max_workspace) {
    if (why_not)
      *why_not = CW_FORMAT("cuDNN's backward plan wants {} MiB of workspace (limit {} MiB): {}",
                           plan->workspace >> 20, max_workspace >> 20, plan->info);
    return false;
  }
  return true;
}

namespace {
// A plan's workspace from `scratch` (nullptr for none); a split plan's is the larger of its parts'.
void* workspace(const Plan& plan, Arena& scratch) {
  return plan.workspace > 0 ? scratch.alloc_bytes(static_cast<size_t>(plan.workspace)) : nullptr;
}

// One graph's forward: out and lse of q against k, v under `plan` of shape `sh`.
void run_forward(const Plan& plan, const Shape& sh, const Tensor& out, const Tensor& lse, const Tensor& q,
                 const Tensor& k, const Tensor& v, float* scale, void* ws, Arena& scratch) {
  MaskOperands m(sh, k.size(1), scratch, current_stream(sh.device));
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data, k.data, v.data, out.data, lse.data, scale};
  m.add_to(uids, ptrs);
  execute(plan, sh.device, uids, ptrs, ws);
}

// One graph of a backward: the keys [k0, k1) of the call under `plan` of shape `sh` (the whole call,
// or a part of a split one).
struct BackwardPart {
  const Plan* plan;
  const Shape* sh;
  int64_t k0, k1;
};
}  // namespace

void cudnn_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, Arena& scratch, bool causal) {
  check_operands(q, k, v, {&v, &out, &saved.lse}, causal);
  Shape sh{};
  std::string why;
  const Plan* plan = resolve_plan(q, k, v, false, &sh, &why, causal);
  CW_CHECK(plan != nullptr, "cuDNN has no fused attention plan for q {} k {}:\n{}", q.describe(), k.describe(), why);
  count_run(sh, *plan);
  ArenaScope scope(scratch);
  float scale_f = static_cast<float>(scale);
  if (!plan->own) return run_forward(*plan, sh, out, saved.lse, q, k, v, &scale_f, workspace(*plan, scratch), scratch);
  // The prefix apart: the own block's out and lse straight into the caller's, the prefix's beside
  // them, then merged into the caller's.
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), p = k.size(1) - c;
  const cw::CudnnForwardScratch bytes = cw::cudnn_attention_forward_scratch({B, c, p + c, H, k.size(2), D}, true);
  const Tensor prefix_out(scratch.alloc_bytes(bytes.prefix_out), DType::bf16, q.device, {B, c, H, D});
  const Tensor prefix_lse(scratch.alloc_bytes(bytes.prefix_lse), DType::f32, q.device, {B, H, c});
  void* ws = workspace(*plan, scratch);
  run_forward(*plan->own, own_part(sh), out, saved.lse, q, k.slice(1, p, c), v.slice(1, p, c), &scale_f, ws, scratch);
  run_forward(*plan->prefix, prefix_part(sh), prefix_out, prefix_lse, q, k.slice(1, 0, p), v.slice(1, 0, p), &scale_f,
              ws, scratch);
  gpu::attention_merge(out, saved.lse, prefix_out, prefix_lse);
}

void cudnn_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch, bool causal) {
  check_operands(q, k, v, {&v, &out, &saved.lse, &d_q, &d_out}, causal);
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  const int64_t row = Hkv * D;
  const int dev = q.device.index;
  cudaStream_t stream = current_stream(dev);
  ArenaScope scope(scratch);

  Shape sh{};
  std::string why;
  const Plan* plan = resolve_plan(q, k, v, true, &sh, &why, causal);
  CW_CHECK(plan != nullptr, "cuDNN has no fused attention backward plan for q {} k {}:\n{}", q.describe(),
           k.describe(), why);
  count_run(sh, *plan);
  // One graph over all S keys, or with the prefix apart its own block [p, S) and then the prefix
  // [0, p), each given the whole row's out and lse (its P is then its share of the row: attention.h).
  std::vector<BackwardPart> parts;
  const Shape own_sh = plan->own ? own_part(sh) : Shape{}, prefix_sh = plan->own ? prefix_part(sh) : Shape{};
  if (plan->own)
    parts = {{plan->own, &own_sh, S - c, S}, {plan->prefix, &prefix_sh, 0, S - c}};
  else
    parts = {{plan, &sh, 0, S}};

  // The scratch, for all parts at once (so a split call lays out the arena as one graph does): the
  // f32 dQ accumulator first, so that it sits at the same scratch address call after call (the
  // tests' second backward then catches an accumulator left unzeroed); cuDNN's dK, dV, packed per
  // part over its plan's key extent (sh.S, the store's for a shared plan; rows past the call's keys
  // are left as cuDNN leaves them and never read); dQ; Delta; the workspace. Their sizes are
  // engine/scratch.h's, which the memory planner replays.
  int64_t extent = 0;
  for (const BackwardPart& part : parts) extent += part.sh->S;
  const bool accumulate = mode == GradMode::accumulate;
  const cw::CudnnBackwardScratch bytes = cw::cudnn_attention_backward_scratch(
      {B, c, S, H, Hkv, D}, extent, sh.dq_accum(), accumulate, parts.size() > 1, prefix_sh.stacked);
  void* dq_accum = nullptr;
  const size_t dq_accum_bytes = bytes.dq_accum;
  if (sh.dq_accum()) dq_accum = scratch.alloc_bytes(dq_accum_bytes);
  const Tensor dk_s(scratch.alloc_bytes(bytes.dk), DType::bf16, q.device, {B * extent * row});
  const Tensor dv_s(scratch.alloc_bytes(bytes.dv), DType::bf16, q.device, {B * extent * row});
  const Tensor dq_s = accumulate ? Tensor(scratch.alloc_bytes(bytes.dq), DType::bf16, q.device, {B, c, H, D}) : d_q;
  const Tensor dq_prefix =
      parts.size() > 1 ? Tensor(scratch.alloc_bytes(bytes.dq_prefix), DType::bf16, q.device, {B, c, H, D}) : Tensor{};
  // cuDNN writes Delta here; poisoned (NaN) so that an engine reading it instead would show in
  // every gradient.
  const Tensor delta(scratch.alloc_bytes(bytes.delta), DType::f32, q.device, {B, H, c});
  CW_CUDA_CHECK(cudaMemsetAsync(delta.data, 0xff, static_cast<size_t>(B * H * c) * sizeof(float), stream));
  // A stacked prefix reads q, out, d_out head-major (its lse and Delta [B, H, c] already are): copies.
  const bool stacked = prefix_sh.stacked;  // false without a prefix part (prefix_sh is then empty)
  HeadsMajorCopies heads{};
  if (stacked) {
    const Tensor* from[3] = {&q, &out, &d_out};
    for (int i = 0; i < 3; ++i) {
      heads.src[i] = static_cast<const __nv_bfloat16*>(from[i]->data);
      heads.dst[i] = static_cast<__nv_bfloat16*>(scratch.alloc_bytes(bytes.head_major));
    }
    heads_major_kernel<<<dim3(blocks_for(B * H * c * D / 8, kAddThreads), 3), kAddThreads, 0, stream>>>(heads, B, c,
                                                                                                        H, D);
    CW_KERNEL_CHECK();
  }
  const int64_t ws_bytes = split_backward_workspace(sh, *plan);
  void* ws = ws_bytes > 0 ? scratch.alloc_bytes(static_cast<size_t>(ws_bytes)) : nullptr;
  CW_CHECK(B <= 65535, "cuDNN attention: {} batch entries exceed the grid", B);

  float scale_f = static_cast<float>(scale), one = 1.0f;
  int64_t offset = 0;  // elements of dk_s, dv_s taken by the parts before
  for (size_t i = 0; i < parts.size(); ++i) {
    const BackwardPart& part = parts[i];
    const int64_t keys = part.k1 - part.k0;
    const Tensor kp = k.slice(1, part.k0, keys), vp = v.slice(1, part.k0, keys);
    void* dk = static_cast<__nv_bfloat16*>(dk_s.data) + offset;
    void* dv = static_cast<__nv_bfloat16*>(dv_s.data) + offset;
    offset += B * part.sh->S * row;
    const Tensor& dq = i == 0 ? dq_s : dq_prefix;
    // cuDNN 9.6 and newer zero the accumulator themselves; older versions add into what they get.
    if (dq_accum && runtime_version() < 90600) CW_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, dq_accum_bytes, stream));
    MaskOperands m(*part.sh, keys, scratch, stream);
    std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kDelta, kOne};
    const bool heads_major = part.sh->stacked;
    std::vector<void*> ptrs{heads_major ? heads.dst[0] : q.data,
                            kp.data,
                            vp.data,
                            heads_major ? heads.dst[1] : out.data,
                            heads_major ? heads.dst[2] : d_out.data,
                            saved.lse.data,
                            dq.data,
                            dk,
                            dv,
                            &scale_f,
                            delta.data,
                            &one};
    if (dq_accum) {
      uids.push_back(kDQAccum);
      ptrs.push_back(dq_accum);
    }
    m.add_to(uids, ptrs);
    execute(*part.plan, dev, uids, ptrs, ws);
    // d_k += dK, d_v += dV over the part's keys (batch strides honoured).
    launch_add_kv(d_k.slice(1, part.k0, keys), d_v.slice(1, part.k0, keys), dk, dv, B, keys * row,
                  part.sh->S * row, stream);
    CW_KERNEL_CHECK();
  }
  // d_q += dQ in accumulate mode; the prefix's dQ added to the own block's (head-major if stacked).
  const int64_t n = q.numel();
  auto* dq_out = static_cast<__nv_bfloat16*>(d_q.data);
  auto add_q = [&](const Tensor& add) {
    add_q_kernel<<<blocks_for(n, kAddThreads), kAddThreads, 0, stream>>>(
        dq_out, static_cast<const __nv_bfloat16*>(add.data), n);
    CW_KERNEL_CHECK();
  };
  if (accumulate) add_q(dq_s);
  if (plan->own && !stacked) add_q(dq_prefix);
  if (stacked) {
    add_q_heads_kernel<<<blocks_for(n / 8, kAddThreads), kAddThreads, 0, stream>>>(
        dq_out, static_cast<const __nv_bfloat16*>(dq_prefix.data), B, c, H, D);
    CW_KERNEL_CHECK();
  }
}

}  // namespace cw::gpu
