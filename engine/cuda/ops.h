// The GPU implementations of the engine ops: the same signatures and the same math as the CPU ops
// (see each op's header in engine/ops/); the public op entry points dispatch here when their
// tensors are on a GPU. Included by the op sources only.
//
// GPU dtype rules (DESIGN.md section 6): activations and weights bf16 or f32 (one compute dtype per
// call); statistics (rstd, lse), losses and parameter gradients f32; K/V gradients f32. Arithmetic
// inside kernels is f32. Kernels are deterministic: no atomics on floating-point sums; reductions
// across rows go through per-block partials in `scratch`, summed in a fixed order.
#pragma once

#include "engine/memory.h"
#include "engine/ops/rmsnorm.h"
#include "engine/tensor.h"

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

}  // namespace cw::gpu
