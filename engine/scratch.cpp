#include "engine/scratch.h"

#include "engine/engine.h"
#include "engine/ops/cpu_common.h"

#include <algorithm>

namespace cw {

namespace {
size_t count(int64_t n) { return static_cast<size_t>(n); }
constexpr size_t kBf16 = 2, kF32 = 4;
// cuDNN asks this much workspace of a backward plan that stages nothing (measured).
constexpr size_t kCudnnMinimumWorkspace = 256;
// The GPU LM head's label check: one 64-bit word after the logits.
constexpr size_t kLabelCheckBytes = 8;
}  // namespace

size_t cpu_attention_score_block_bytes(int64_t c, int64_t S, DType dtype) {
  return count(std::min(kCpuAttentionQueryBlock, c) * S) * dtype_size(dtype);
}

std::vector<size_t> cpu_attention_scratch(int64_t c, int64_t S, DType dtype, bool backward) {
  const size_t per_thread = backward ? 2 : 1;
  return std::vector<size_t>(count(cpu::max_threads()) * per_thread, cpu_attention_score_block_bytes(c, S, dtype));
}

CudnnForwardScratch cudnn_attention_forward_scratch(const AttentionDims& d, bool split) {
  if (!split) return {};
  return {count(d.B * d.c * d.H * d.D) * kBf16, count(d.B * d.H * d.c) * kF32};
}

CudnnBackwardScratch cudnn_attention_backward_scratch(const AttentionDims& d, int64_t extent, bool dq_accum,
                                                      bool accumulate, bool split, bool stacked) {
  const size_t q = count(d.B * d.c * d.H * d.D);
  CudnnBackwardScratch s;
  s.dq_accum = dq_accum ? q * kF32 : 0;
  s.dk = s.dv = count(d.B * extent * d.Hkv * d.D) * kBf16;
  s.dq = accumulate ? q * kBf16 : 0;
  s.dq_prefix = split ? q * kBf16 : 0;
  s.delta = count(d.B * d.H * d.c) * kF32;
  s.head_major = stacked ? q * kBf16 : 0;
  s.head_major_copies = stacked ? 3 : 0;
  return s;
}

std::vector<size_t> CudnnBackwardScratch::requests(size_t workspace) const {
  std::vector<size_t> r;
  if (dq_accum) r.push_back(dq_accum);
  r.push_back(dk);
  r.push_back(dv);
  if (dq) r.push_back(dq);
  if (dq_prefix) r.push_back(dq_prefix);
  r.push_back(delta);
  for (int i = 0; i < head_major_copies; ++i) r.push_back(head_major);
  if (workspace) r.push_back(workspace);
  return r;
}

size_t cudnn_attention_backward_workspace(const AttentionDims& d) {
  const bool grouped = d.H != d.Hkv;
  return (grouped ? 2 * count(d.B * d.H * d.S * d.D) * kBf16 : 0) + kCudnnMinimumWorkspace;
}

std::vector<size_t> flash_attention_backward_scratch(const AttentionDims& d, bool tensor_cores, bool deterministic) {
  std::vector<size_t> r{count(d.B * d.H * d.c) * kF32};
  if (tensor_cores && !deterministic) r.push_back(count(d.B * d.c * d.H * d.D) * kF32);
  return r;
}

int64_t lm_head_logits_ld(int64_t V, size_t elem_bytes) {
  const int64_t per_16_bytes = static_cast<int64_t>(16 / elem_bytes);
  return (V + per_16_bytes - 1) / per_16_bytes * per_16_bytes;
}

size_t lm_head_scratch_bytes(Device device, int64_t N, int64_t V, size_t elem_bytes, int64_t block_rows) {
  if (device.is_cpu()) return count(std::min(block_rows, std::max<int64_t>(N, 1)) * V) * elem_bytes;
  const int64_t ld = lm_head_logits_ld(V, elem_bytes);
  return count(lm_head_block_rows(N, ld, elem_bytes) * ld) * elem_bytes + kLabelCheckBytes;
}

}  // namespace cw
