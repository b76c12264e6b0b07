// The GPU implementations of the engine ops: the same signatures and the same math as the CPU ops
// (see each op's header in engine/ops/); the public op entry points dispatch here when their
// tensors are on a GPU, after checking the op's contract (shapes, dtypes, layout, one device,
// aliasing), so these functions check only their own limits. Included by the op sources only.
//
// GPU dtype rules (DESIGN.md section 6): activations and weights bf16 or f32 (one compute dtype per
// call); statistics (rstd, lse), losses and parameter gradients f32; K/V gradients f32. Arithmetic
// inside kernels is f32. Our kernels are deterministic: no atomics on floating-point sums; reductions
// across rows go through per-block partials in `scratch`, summed in a fixed order. The exceptions
// are the attention backwards that add dQ block by block with f32 atomics: cuDNN's fast engine, and
// our flash kernels' fused backward. The chooser (engine/ops/attention.cpp) runs them only while
// determinism is off (cw::set_deterministic, env CW_DETERMINISTIC=1, `chunkwise train
// --deterministic`); with determinism on, every GPU result is bitwise reproducible.
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

// Attention (engine/ops/attention.h): the GPU kernel families. engine/ops/attention.cpp checks the
// op's contract, chooses the family (choose_attention_kernel) and calls one of these; each checks
// only what is its own. lse is f32; d_k, d_v are f32 and ADDED into.

// Our flash kernels (engine/cuda/attention_flash*.cu): one entry per direction, the family named.
//   wgmma: Hopper warpgroup MMA (sm_90a build, compute capability 9.0), bf16, D 64/128, 16-byte aligned
//   mma:   mma.sync tensor cores (any GPU we build for), bf16, D 64/128, 16-byte aligned
//   simt:  no tensor cores: f32 or bf16, any even D <= 128 (the readable reference and the f32 path)
// The tensor-core backward is fused (dQ summed with f32 atomics) unless `deterministic`, which runs
// the two-kernel form whose every sum has a fixed order.
enum class FlashFamily { wgmma, mma, simt };
bool flash_wgmma_available(int device);
void flash_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, FlashFamily family);
void flash_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch, FlashFamily family,
                              bool deterministic);

// cuDNN fused attention (engine/cuda/attention_cudnn.cu; builds with cuDNN only).
int64_t cudnn_runtime_version();  // cudnnGetVersion() of the library loaded at run time, e.g. 91400
// Whether cuDNN can take these operands in both directions / the forward (and why not).
bool cudnn_attention_supports(const Tensor& q, const Tensor& k, std::string* why_not = nullptr);
bool cudnn_attention_forward_supports(const Tensor& q, const Tensor& k, std::string* why_not = nullptr);
// Whether the backward serves these operands with a plan whose workspace is at most max_workspace
// bytes (builds and caches the plan; honours cw::deterministic()).
bool cudnn_attention_backward_fits(const Tensor& q, const Tensor& k, const Tensor& v, int64_t max_workspace,
                                   std::string* why_not = nullptr);
// Whether the plan of this call is built (never blocks). Where it is not, and plans are built
// ahead (cw::cudnn_plan_threads() > 0) and the K/V are a slice of a longer store, the plan goes to
// the front of the ahead queue (its family behind it) and the answer is false: the chooser runs
// another kernel for this call rather than wait. Other calls: true (they build their plan on use).
bool cudnn_attention_plan_ready(const Tensor& q, const Tensor& k, const Tensor& v, bool backward);
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
