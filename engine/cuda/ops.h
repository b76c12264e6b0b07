// The GPU implementations of the engine ops: the same signatures and the same math as the CPU ops
// (see each op's header in engine/ops/); the public op entry points dispatch here when their
// tensors are on a GPU. Included by the op sources only.
//
// GPU dtype rules (DESIGN.md section 6): activations and weights bf16 or f32 (one compute dtype per
// call); statistics (rstd, lse), losses and parameter gradients f32; K/V gradients f32. Arithmetic
// inside kernels is f32. Our kernels are deterministic: no atomics on floating-point sums; reductions
// across rows go through per-block partials in `scratch`, summed in a fixed order. The exceptions
// are the attention backwards that add dQ block by block with f32 atomics: cuDNN's fast engine, and
// our flash kernel's fused backward. They run only while determinism is not requested
// (set_deterministic, env CW_DETERMINISTIC=1, `chunkwise train --deterministic`; cuDNN's also needs
// its workspace to fit the budget, engine/cuda/attention.cu); with determinism on, every GPU result
// is bitwise reproducible.
#pragma once

#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/ops/rmsnorm.h"
#include "engine/tensor.h"

#include <string>

namespace cw::gpu {

// Elementwise and row ops (engine/cuda/elementwise.cu, engine/cuda/rmsnorm.cu, engine/cuda/embedding.cu).
void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table);
void embedding_backward(const Tensor& d_table, const Tensor& d_out, const Tensor& ids);  // d_table f32
void rmsnorm_forward(const Tensor& out, const RmsNormSaved& saved, const Tensor& x, const Tensor& weight, double eps);
void rmsnorm_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const RmsNormSaved& saved,
                      const Tensor& x, const Tensor& weight, GradMode mode, Arena& scratch);  // d_weight f32
void rope_forward(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0);
void rope_backward(const Tensor& d_x, const Tensor& d_out, const Tensor& cos, const Tensor& sin, int64_t pos0,
                   GradMode mode);
void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                     const Tensor& up, GradMode mode);
void residual_forward(const Tensor& out, const Tensor& x, const Tensor& delta);
void residual_backward(const Tensor& d_x, GradMode mode_x, const Tensor& d_delta, GradMode mode_delta,
                       const Tensor& d_out);
void accumulate(const Tensor& dst, const Tensor& src);  // dst (f32 or the compute dtype) += src

// Linear through cuBLASLt (engine/cuda/linear.cu): bf16 or f32 operands, f32 accumulation;
// d_weight is f32 and accumulated (beta = 1). f32 runs without TF32 (exact-mode checks).
void linear_forward(const Tensor& out, const Tensor& x, const Tensor& weight);
void linear_backward(const Tensor& d_x, const Tensor& d_weight, const Tensor& d_out, const Tensor& x,
                     const Tensor& weight, GradMode mode);

// Attention (engine/ops/attention.h). The entry points pick an implementation (engine/cuda/attention.cu):
// cuDNN's fused attention where it serves (bf16, head dim a multiple of 8 up to 128, a cuDNN that
// knows bottom-right causal masks), else our own flash-style kernel. lse is f32; d_k, d_v are f32
// and ADDED into.
enum class AttentionImpl { automatic, cudnn, flash };
void set_attention_impl(AttentionImpl impl);   // process-wide; automatic by default (env CW_ATTENTION)
AttentionImpl attention_impl();
const char* attention_impl_name(AttentionImpl impl);
// Bitwise-reproducible gradients (process-wide; off by default, env CW_DETERMINISTIC=1 turns it on).
// Off: the attention backward may use cuDNN's engine or our fused flash backward, both with atomic
// dQ sums (rounding order varies run to run, values agree to f32 rounding). On: only deterministic
// kernels (our two-kernel flash backward).
void set_deterministic(bool on);
bool deterministic();
void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch);
void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch);

// Our own fused flash-style kernels (engine/cuda/attention_flash.cu): any even head dim up to 128 in
// f32 and bf16; tensor cores for bf16 at head dim 64 and 128.
void flash_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, Arena& scratch);
void flash_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch);

// Which tensor-core kernels our flash attention runs for bf16 at head dim 64 and 128 (process-wide;
// env CW_FLASH_KERNELS=auto|wgmma|mma): `wgmma` the Hopper kernels (engine/cuda/attention_flash_hopper.cu:
// warpgroup MMA, builds for sm_90a on compute capability 9.0), `mma` the FlashAttention-2 style
// mma.sync kernels (any GPU), `automatic` wgmma wherever it runs. Both families have the forward,
// the fused backward (dQ by atomics) and the deterministic two-kernel backward.
enum class FlashKernels { automatic, wgmma, mma };
void set_flash_kernels(FlashKernels kernels);
FlashKernels flash_kernels();
bool flash_wgmma_available(int device);

// cuDNN fused attention through the graph backend API (engine/cuda/attention_cudnn.cu; only in builds
// with cuDNN). cudnn_attention_supports says whether these operands can take this path (and why not).
bool cudnn_attention_supports(const Tensor& q, const Tensor& k, std::string* why_not = nullptr);
// The forward alone (its output and lse are what the flash backward reads, so `automatic` may pair a
// cuDNN forward with the flash backward).
bool cudnn_attention_forward_supports(const Tensor& q, const Tensor& k, std::string* why_not = nullptr);
// Whether the backward serves these operands with a plan whose workspace is at most max_workspace
// bytes (builds and caches the plan; honours deterministic()).
bool cudnn_attention_backward_fits(const Tensor& q, const Tensor& k, const Tensor& v, int64_t max_workspace,
                                   std::string* why_not = nullptr);
// Autotuning (off by default; env CW_CUDNN_AUTOTUNE=1 turns it on at start): a plan built while it
// is on times every engine configuration cuDNN offers within 256 MiB of workspace (each knob a few
// values) on its first call and keeps the fastest for the process. On the H100 the heuristics'
// first choice was the fastest for every attention shape we timed; the switch is for other GPUs
// and cuDNN versions.
void set_cudnn_autotune(bool on);
bool cudnn_autotune();
void cudnn_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, Arena& scratch);
void cudnn_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch);

// LM head fused with cross-entropy (engine/cuda/lm_head.cu; math in engine/ops/lm_head_loss.h).
// x, weight in the compute dtype (bf16 or f32); row_loss, lse f32; d_weight f32 (accumulated);
// d_x in the compute dtype. block_rows is the CPU's block; the GPU picks its own, larger row block
// (bounded logits scratch; see lm_head.cu).
void lm_head_loss_forward(const Tensor& row_loss, const LmHeadSaved& saved, const Tensor& x, const Tensor& weight,
                          const Tensor& labels, double normaliser, Arena& scratch, int64_t block_rows);
void lm_head_loss_backward(const Tensor& d_x, const Tensor& d_weight, const LmHeadSaved& saved, const Tensor& x,
                           const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode,
                           Arena& scratch, int64_t block_rows);
void lm_head_loss_fused(const Tensor& row_loss, const Tensor& d_x, const Tensor& d_weight, const Tensor& x,
                        const Tensor& weight, const Tensor& labels, double normaliser, GradMode mode, Arena& scratch,
                        int64_t block_rows);

}  // namespace cw::gpu
