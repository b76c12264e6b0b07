// Internal to engine/cuda: check macros, the current stream, element conversions, launch helpers.
#pragma once

#include "engine/error.h"
#include "engine/tensor.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace cw::gpu {

// The stream every op of `device` launches on (created on first use).
cudaStream_t current_stream(int device = 0);

[[noreturn]] void raise_cuda(cudaError_t e, const char* expr, const char* file, int line);
[[noreturn]] void raise_cublas(cublasStatus_t s, const char* expr, const char* file, int line);

// bf16 is stored as raw bits in host code (cw::bf16) and as __nv_bfloat16 in kernels: same layout.
template <class T> struct DeviceType { using type = T; };
template <> struct DeviceType<bf16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(double x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

inline unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace cw::gpu

#define CW_CUDA_CHECK(expr)                                                          \
  do {                                                                               \
    const cudaError_t cw_err_ = (expr);                                              \
    if (cw_err_ != cudaSuccess) ::cw::gpu::raise_cuda(cw_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define CW_CUBLAS_CHECK(expr)                                                             \
  do {                                                                                    \
    const cublasStatus_t cw_st_ = (expr);                                                 \
    if (cw_st_ != CUBLAS_STATUS_SUCCESS) ::cw::gpu::raise_cublas(cw_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: a bad configuration shows here, not at some later call.
#define CW_KERNEL_CHECK() CW_CUDA_CHECK(cudaGetLastError())
