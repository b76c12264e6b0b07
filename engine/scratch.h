// chunkwise engine: the scratch each backend's ops take from the caller's arena, request by request
// in the order they take it. The ops size their requests with these functions, and the memory
// planner (tools/planner) replays the same requests, so the two cannot drift apart; a CPU step's
// arena is held to the replay byte for byte (tests/tools/planner/test_arena_replay.cpp). A request is its
// bytes; the arena rounds each up to kMemoryAlignBytes (engine.h).
//
// The engine's other sizes (the arena's blocks, the device pool's size classes, cuBLASLt's
// workspace, the GPU LM head's row block) are in engine.h.
#pragma once

#include "engine/dtype.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cw {

// One attention call: B sequences of c queries in H heads of D dims against S keys in Hkv heads.
struct AttentionDims {
  int64_t B = 0, c = 0, S = 0, H = 0, Hkv = 0, D = 0;
};

// ---- Attention on the CPU (engine/cpu/attention.cpp) ----
// Query rows go in blocks of kCpuAttentionQueryBlock against all S keys: each of the max_threads()
// threads takes one score block of min(64, c) x S elements of `dtype` forward, two backward (P and
// dP), each its own request.
inline constexpr int64_t kCpuAttentionQueryBlock = 64;
size_t cpu_attention_score_block_bytes(int64_t c, int64_t S, DType dtype);
std::vector<size_t> cpu_attention_scratch(int64_t c, int64_t S, DType dtype, bool backward);

// ---- Attention through cuDNN (engine/cuda/attention_cudnn.cu), bf16 ----
// The forward with a chunk's earlier keys apart (cudnn_splits_prefix): the prefix's output bf16
// [B, c, H, D] and lse f32 [B, H, c], merged into the call's afterwards; then the plan's workspace.
// One graph takes its workspace alone.
struct CudnnForwardScratch {
  size_t prefix_out = 0, prefix_lse = 0;  // 0: one graph
};
CudnnForwardScratch cudnn_attention_forward_scratch(const AttentionDims& d, bool split);

// The backward, all at once for its parts, in this order, then the workspace.
struct CudnnBackwardScratch {
  size_t dq_accum = 0;    // f32 [B, c, H, D]: the fast (non-deterministic) form's dQ accumulator
  size_t dk = 0, dv = 0;  // bf16 [B, extent, Hkv, D] each: cuDNN's dK, dV over its plans' key extents
  size_t dq = 0;          // bf16 [B, c, H, D]: dQ when the call accumulates into d_q (0: written in place)
  size_t dq_prefix = 0;   // bf16 [B, c, H, D]: the prefix's dQ, with the prefix apart
  size_t delta = 0;       // f32 [B, H, c]
  size_t head_major = 0;  // bf16 [B, H, c, D]: each of Q, O, dO copied head-major for a stacked prefix
  int head_major_copies = 0;
  // The requests in the order the backward takes them, the workspace last.
  std::vector<size_t> requests(size_t workspace) const;
};
// extent: the keys its plans span (S with exact plans; a shared plan's, the store's whole extent).
// dq_accum: determinism off; accumulate: GradMode::accumulate; split and stacked: cudnn_splits_prefix
// and cudnn_stacks_gqa of the call.
CudnnBackwardScratch cudnn_attention_backward_scratch(const AttentionDims& d, int64_t extent, bool dq_accum,
                                                      bool accumulate, bool split, bool stacked);
// The workspace cuDNN's backward plans ask for, as measured: with grouped K/V heads cuDNN stages the
// per-query-head dK and dV of all S keys in bf16 for its head reduction, and asks 256 bytes more
// (Llama-3.2-1B at 256K keys: 2 GiB and 256 bytes); without, the 256 bytes. The engine takes each
// plan's own figure and raises its workspace budget to this one (raise_attention_workspace_budget);
// a GPU test holds the plans to it (tests/engine/test_cuda_attention_cudnn.cpp).
size_t cudnn_attention_backward_workspace(const AttentionDims& d);

// ---- Attention through the flash kernels (engine/cuda/attention_flash.cu) ----
// The backward: Delta f32 [B, H, c]; with the tensor-core kernels and determinism off also the f32
// dQ accumulator [B, c, H, D]. The forward takes none.
std::vector<size_t> flash_attention_backward_scratch(const AttentionDims& d, bool tensor_cores, bool deterministic);

// ---- The LM head with its loss (engine/ops/lm_head_loss.h) ----
// One request a call: the logits of one row block. On the CPU min(block_rows, N) rows (at least one)
// of V logits; on a GPU lm_head_block_rows(N, ld) rows (engine.h) of ld = lm_head_logits_ld(V)
// logits, and the label check's 8 bytes after them.
int64_t lm_head_logits_ld(int64_t V, size_t elem_bytes);  // V rounded up to a 16-byte row
size_t lm_head_scratch_bytes(Device device, int64_t N, int64_t V, size_t elem_bytes, int64_t block_rows);

}  // namespace cw
