// Internal to engine/cuda: check macros, the current stream, element conversions, launch helpers,
// 16-byte vector access (Vec16) and the device guard. (Operands are checked by the public op entries
// in engine/ops/ before they dispatch here.)
#pragma once

#include "engine/error.h"
#include "engine/tensor.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// A tensor's data as T* (T a device element type: float, __nv_bfloat16, int32_t, ...).
template <class T> T* dptr(const Tensor& t) { return static_cast<T*>(t.data); }

// 16-byte aligned: the condition for one 128-bit load or store.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(std::type_identity<T>{}) with T = float or __nv_bfloat16 for the compute dtype; any other
// dtype is a clear error naming the op.
template <class F> void dispatch_compute(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: f(std::type_identity<float>{}); return;
    case DType::bf16: f(std::type_identity<__nv_bfloat16>{}); return;
    default:
      fail(CW_FORMAT("{} on the GPU supports f32 and bf16, not {}", op, dtype_name(dtype)),
           "choose --dtype bf16 or f32 for GPU runs");
  }
}

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

// Helpers that use the macros above.
namespace cw::gpu {

// 16 bytes of T (4 f32 or 8 bf16) held as raw 32-bit words. Loads and stores are single 128-bit
// accesses (the address must be 16-byte aligned); get(k) widens element k to f32 exactly (a bf16
// is the top half of an f32), pack() rounds each f32 to T once (round to nearest even, the same as
// from_f32). Call get/pack with indices that are constants after unrolling so the words stay in
// registers.
template <class T> struct Vec16 {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
  uint32_t w[4];

  __device__ __forceinline__ void load(const T* p) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
  }
  // Through the read-only cache: only for data no thread writes during the kernel (the weight).
  __device__ __forceinline__ void load_ro(const T* p) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
  }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]); }
  __device__ __forceinline__ float get(int k) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[k]);
    } else {
      return __uint_as_float((k & 1) ? (w[k >> 1] & 0xffff0000u) : (w[k >> 1] << 16));
    }
  }
  __device__ __forceinline__ static Vec16 pack(const float* v) {
    Vec16 r;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 4) {
        r.w[i] = __float_as_uint(v[i]);
      } else {
        const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i]));
        const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1]));
        r.w[i] = lo | (hi << 16);
      }
    }
    return r;
  }
};

// Makes `device` current for the scope (kernel launches and cuBLASLt calls go to the current
// device's context) and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    CW_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) CW_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_ = 0, previous_ = 0;
};

}  // namespace cw::gpu
