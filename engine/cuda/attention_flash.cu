// Flash attention, host side: the entry points gpu::flash_attention_forward/backward (engine/cuda/ops.h)
// check the kernels' own limits, build the Problem and run the family the chooser named (FlashFamily):
//   simt   attention_flash_simt.cu    f32/bf16, even D <= 256, the score cap
//   mma    attention_flash_mma.cu     bf16, D 64/128/256, the score cap, mma.sync (sm_80+)
//   wgmma  attention_flash_wgmma.cu   bf16, D 64/128, warpgroup MMA (sm_90a builds on CC 9.0)
// The two tensor-core families share the passes around their backward kernels, defined here:
// Delta = rowsum(d_out * out) first (which also zeroes the f32 dQ accumulator when determinism is
// off), and d_q = scale * accumulator last (the fused backward's dQ sums).
// Scratch: Delta [B, H, c] f32 and, for the fused tensor-core backward, the dQ accumulator
// [B, c, H, D] f32 come from `scratch` in an ArenaScope (every later user of the arena launches on
// the same stream). Everything runs on current_stream(device).
#include "engine/cuda/attention_flash.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/scratch.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>

namespace cw::gpu {
namespace {
using namespace flash;

// The tensor-core path's Delta (bf16, D = 64, 128 or 256, 16-byte aligned rows): D / 8 threads per row,
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
void launch_dq_convert(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  const int64_t quads = static_cast<int64_t>(pr.B) * pr.c * pr.H * pr.D / 4;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((quads + 255) / 256, 65535));
  dq_convert_kernel<<<grid, 256, 0, stream>>>(a.dq_accum, a.o, quads, pr.scale, pr.accumulate);
  CW_KERNEL_CHECK();
}
// attention_merge: one warp per row of D values (acc's [B, c, H] rows, lanes across D, so a warp
// reads and writes its row's contiguous bytes). Every lane reads the row's two lse values; lane 0
// writes the merged one after the warp has read them. The accumulator is f32 (block by block) or
// bf16 (cuDNN's split forward merging its two parts' outputs in place, attention_cudnn.cu).
template <class Acc, class T>
__global__ void attention_merge_kernel(Acc* __restrict__ acc, float* __restrict__ lse_acc, const T* __restrict__ out_b,
                                       const float* __restrict__ lse_b, int64_t rows, int c, int H, int D) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t h = r % H, bi = r / H, i = bi % c, b = bi / c;
    const int64_t s = (b * H + h) * c + i;  // lse is [B, H, c]
    const float la = lse_acc[s], lb = lse_b[s], m = fmaxf(la, lb);
    const float wa = expf(la - m), wb = expf(lb - m), sum = wa + wb;
    Acc* row = acc + r * D;
    const T* row_b = out_b + r * D;
    for (int x = lane; x < D; x += 32) row[x] = from_f32<Acc>((wa * to_f32(row[x]) + wb * to_f32(row_b[x])) / sum);
    __syncwarp();
    if (lane == 0) lse_acc[s] = m + logf(sum);
  }
}

void launch_delta_tc(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(pr.B) * pr.c * pr.H * (pr.D / 8);
  if (pr.D == 64) delta_tc_kernel<64><<<blocks_for(threads, 256), 256, 0, stream>>>(a, pr);
  else if (pr.D == 128) delta_tc_kernel<128><<<blocks_for(threads, 256), 256, 0, stream>>>(a, pr);
  else delta_tc_kernel<256><<<blocks_for(threads, 256), 256, 0, stream>>>(a, pr);
  CW_KERNEL_CHECK();
}

// ------------------------------------------------------------------------------------------------
// Operand checks and dispatch.
// ------------------------------------------------------------------------------------------------
const char* family_name(FlashFamily f) {
  return f == FlashFamily::wgmma ? "wgmma" : f == FlashFamily::mma ? "mma" : "simt";
}

// The op's contract (shapes, GQA, dtypes, layouts, devices) is checked by the public entry
// (engine/ops/attention.cpp); what is checked here is the flash kernels' own: f32 or bf16, an even
// head dim of at most 256, the grid; the tensor-core families' head dims, alignment and cap below.
Problem check_common(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal,
                     AttentionWindow window, const Tensor& doc_first, double softcap) {
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  CW_CHECK(D > 0 && D % 2 == 0 && D <= 256, "flash attention: head dim {} must be even and at most 256", D);
  CW_CHECK(softcap >= 0 && std::isfinite(softcap), "flash attention: a score cap of {} (positive and finite; 0: none)",
           softcap);
  CW_CHECK(q.dtype == DType::f32 || q.dtype == DType::bf16, "flash attention: q is {}; the GPU computes in f32 or bf16",
           dtype_name(q.dtype));
  // Grids: (query or key blocks of at least 16) x heads x batch CTAs in one dimension (tensor-core
  // path), blocks x H x B (generic path).
  CW_CHECK((S + 15) / 16 * H * B < (int64_t(1) << 31) && B < 65536 && H < 65536 && S < (int64_t(1) << 30),
           "flash attention: shapes q {} k {} are too large for the grid", q.describe(), k.describe());
  Problem pr{};
  pr.B = static_cast<int>(B), pr.c = static_cast<int>(c), pr.H = static_cast<int>(H);
  pr.Hkv = static_cast<int>(Hkv), pr.D = static_cast<int>(D), pr.S = static_cast<int>(S);
  // The first query's position relative to the first key: unmasked, S, past every key, so the
  // kernels' causal rule (key <= p + row) admits every pair and only the key count bounds the tiles.
  pr.p = static_cast<int>(causal ? S - c : S), pr.group = static_cast<int>(H / Hkv);
  // The window as the kernels apply it, key j > p + i - W. Causal: the call's own positions. An
  // unmasked block's queries sit `distance` (>= S) past its first key; only distance - W matters
  // there (the causal rule admits every key), so the kernels see p = S and W' = W - (distance - S),
  // and W' = 1 when no query sees any key (p - 1 >= S - 1 then masks all, as distance - W does). A
  // window of p + c keys or more hides nothing: none (which also keeps every sum below in int).
  int64_t W = window.size;
  if (W > 0 && !causal) W = std::max<int64_t>(1, W - (window.distance - S));
  pr.window = W > 0 && W < pr.p + c ? static_cast<int>(W) : 0;
  // Packed documents: each row's first key, int32 [B, c] on the operands' device (a causal call's),
  // rows contiguous, sequences `stride[0]` apart (a chunk's columns of the step's table).
  if (doc_first.data != nullptr) {
    CW_CHECK(causal && doc_first.dtype == DType::i32 && doc_first.ndim == 2 && doc_first.size(0) == B &&
                 doc_first.size(1) == c && doc_first.stride[1] == 1 && doc_first.stride[0] >= c &&
                 doc_first.device == q.device,
             "flash attention: doc_first must be a causal call's int32 [{}, {}] with contiguous rows on {}, got {}",
             B, c, device_name(q.device), doc_first.describe());
    pr.doc_first = static_cast<const int*>(doc_first.data);
    pr.doc_pitch = doc_first.stride[0];
  }
  pr.q_row = H * D, pr.kv_row = Hkv * D;
  pr.k_batch = k.stride[0], pr.v_batch = v.stride[0];
  pr.scale = static_cast<float>(scale), pr.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  pr.softcap = static_cast<float>(softcap);
  if (softcap > 0) {
    pr.scale_over_cap = static_cast<float>(scale / softcap);
    pr.cap_log2 = static_cast<float>(softcap * 1.4426950408889634);
  }
  return pr;
}

bool aligned(const Tensor& t, size_t bytes) { return reinterpret_cast<uintptr_t>(t.data) % bytes == 0; }

// The tensor-core families need a shape their kernels are instantiated for (the chooser's rules,
// engine/ops/attention.h: mma bf16 at D = 64, 128 or 256 with the score cap or without, wgmma bf16
// at D = 64 or 128 without it) and 16-byte aligned rows for cp.async.
bool tensor_core_path(FlashFamily family, const Problem& pr, DType dtype,
                      std::initializer_list<const Tensor*> bf16_operands) {
  const AttentionShape shape{dtype, pr.D, pr.window > 0, pr.softcap > 0.0f};
  const bool takes = family == FlashFamily::mma ? mma_flash_takes_shape(shape) : wgmma_flash_takes_shape(shape);
  if (!takes || pr.k_batch % 8 != 0 || pr.v_batch % 8 != 0) return false;
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
                             const Tensor& v, double scale, FlashFamily family, bool causal,
                             AttentionWindow window, const Tensor& doc_first, double softcap) {
  const Problem pr = check_common(q, k, v, scale, causal, window, doc_first, softcap);
  if (pr.B == 0 || pr.c == 0 || pr.H == 0) return;
  cudaStream_t stream = current_stream(q.device.index);
  if (family != FlashFamily::simt) {
    CW_CHECK(tensor_core_path(family, pr, q.dtype, {&q, &k, &v, &out}),
             "flash attention ({}): needs bf16, 16-byte aligned operands and head dim 64 or 128 (mma: also 256; "
             "wgmma: no score cap)",
             family_name(family));
    const Operands<bf16_t> a{static_cast<const bf16_t*>(q.data), static_cast<const bf16_t*>(k.data),
                             static_cast<const bf16_t*>(v.data), nullptr, nullptr, static_cast<bf16_t*>(out.data),
                             static_cast<float*>(saved.lse.data), nullptr, nullptr, nullptr};
    if (family == FlashFamily::wgmma) return wgmma_forward(a, pr, stream);
    return mma_forward(a, pr, stream);
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Operands<T> a{static_cast<const T*>(q.data), static_cast<const T*>(k.data), static_cast<const T*>(v.data),
                        nullptr, nullptr, static_cast<T*>(out.data), static_cast<float*>(saved.lse.data), nullptr,
                        nullptr, nullptr};
    simt_forward(a, pr, stream);
  };
  if (q.dtype == DType::bf16) run(bf16_t{});
  else run(float{});
}

void flash_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch, FlashFamily family,
                              bool deterministic, bool causal, AttentionWindow window, const Tensor& doc_first,
                              double softcap) {
  Problem pr = check_common(q, k, v, scale, causal, window, doc_first, softcap);
  if (pr.B == 0 || pr.c == 0 || pr.H == 0) return;
  pr.dk_batch = d_k.stride[0], pr.dv_batch = d_v.stride[0];
  pr.accumulate = mode == GradMode::accumulate;
  cudaStream_t stream = current_stream(q.device.index);
  ArenaScope scope(scratch);
  const bool tc = family != FlashFamily::simt;
  // Delta, then with the fused dQ below its accumulator (engine/scratch.h, which the planner replays).
  const std::vector<size_t> bytes =
      cw::flash_attention_backward_scratch({pr.B, pr.c, pr.S, pr.H, pr.Hkv, pr.D}, tc, deterministic);
  float* delta = static_cast<float*>(scratch.alloc_bytes(bytes[0]));

  CW_CHECK(!tc || (tensor_core_path(family, pr, q.dtype, {&q, &k, &v, &out, &d_out, &d_q}) && aligned(d_k, 8) &&
                   aligned(d_v, 8) && pr.dk_batch % 2 == 0 && pr.dv_batch % 2 == 0),
           "flash attention ({}): needs bf16, aligned operands and head dim 64 or 128 (mma: also 256; wgmma: no "
           "score cap)",
           family_name(family));
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
    if (tc && !deterministic) a.dq_accum = static_cast<float*>(scratch.alloc_bytes(bytes[1]));
    if (!tc) return simt_backward(a, pr, stream);
    launch_delta_tc(a, pr, stream);
    if (family == FlashFamily::wgmma) wgmma_backward(a, pr, stream);
    else mma_backward(a, pr, stream);
    if (a.dq_accum != nullptr) launch_dq_convert(a, pr, stream);
  } else {
    simt_backward(operands(float{}), pr, stream);
  }
}

void attention_merge(const Tensor& acc, const Tensor& lse_acc, const Tensor& out_b, const Tensor& lse_b) {
  CW_CHECK(out_b.dtype == DType::f32 || out_b.dtype == DType::bf16, "attention_merge: out_b is {}; the GPU merges f32 or bf16",
           dtype_name(out_b.dtype));
  CW_CHECK(acc.dtype == DType::f32 || (acc.dtype == DType::bf16 && out_b.dtype == DType::bf16),
           "attention_merge: acc is {} with out_b {}; the GPU accumulates in f32, or in bf16 from bf16",
           dtype_name(acc.dtype), dtype_name(out_b.dtype));
  const int64_t B = acc.size(0), c = acc.size(1), H = acc.size(2), D = acc.size(3), rows = B * H * c;
  if (rows == 0) return;
  cudaStream_t stream = current_stream(acc.device.index);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((rows + 7) / 8, 65535));  // 8 warps a block
  float* l = static_cast<float*>(lse_acc.data);
  const float* lb = static_cast<const float*>(lse_b.data);
  const auto* b16 = static_cast<const bf16_t*>(out_b.data);
  if (acc.dtype == DType::bf16)
    attention_merge_kernel<<<grid, 256, 0, stream>>>(static_cast<bf16_t*>(acc.data), l, b16, lb, rows, int(c), int(H),
                                                     int(D));
  else if (out_b.dtype == DType::bf16)
    attention_merge_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(acc.data), l, b16, lb, rows, int(c), int(H),
                                                     int(D));
  else
    attention_merge_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(acc.data), l,
                                                     static_cast<const float*>(out_b.data), lb, rows, int(c), int(H),
                                                     int(D));
  CW_KERNEL_CHECK();
}

}  // namespace cw::gpu
