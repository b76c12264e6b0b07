// GPU elementwise ops: rotary position embedding, the SwiGLU gate, the residual connection and
// gradient accumulation (the math of engine/ops/rope.h, swiglu.h and residual.h).
//
// Dtypes: activations and gradients in the compute dtype T (f32 or bf16, one per call); the rope
// cos/sin tables are f32 on the device for either compute dtype; accumulate() also takes an f32
// destination with a T source (a gradient summed in f32). Arithmetic is f32; every output element is
// rounded to its dtype once.
//
// Launch shapes: one thread per element (per rotated pair for rope), 256 threads per block, a
// grid-stride loop over int64 indices with at most kMaxBlocks blocks. Loads are scalar and coalesced;
// a faster version would use 16-byte vector loads when the pointers and sizes allow (this is where
// it would go: the loops below are memory bound).
//
// Determinism: every output element is computed by one thread from its own inputs; no reductions,
// no atomics, so the results are bitwise reproducible. Aliasing: each thread reads all of an
// element's inputs before writing it, and no pointer is __restrict__, so in-place calls (rope
// out == x, residual out == x) are safe.
// Nothing synchronises; everything runs on current_stream(device) of the operands' device.
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"

#include <algorithm>
#include <type_traits>

namespace cw::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(blocks_for(n, kThreads), kMaxBlocks)); }

// Calls f(std::type_identity<T>{}) with T = float or __nv_bfloat16 for the compute dtype.
template <class F> void dispatch_compute(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: f(std::type_identity<float>{}); return;
    case DType::bf16: f(std::type_identity<__nv_bfloat16>{}); return;
    default:
      fail(CW_FORMAT("{} on the GPU supports f32 and bf16, not {}", op, dtype_name(dtype)),
           "choose --dtype bf16 or f32 for GPU runs");
  }
}

// A contiguous tensor on a GPU, on the same device as `ref`.
void check_gpu(const Tensor& t, const Tensor& ref, const char* what) {
  CW_CHECK(!t.device.is_cpu(), "{} is on {}; the GPU op needs it on a GPU", what, device_name(t.device));
  check_same_device(t, ref, what, "the op's first operand");
  check_contiguous(t, what);
}

template <class T> T* dptr(const Tensor& t) { return static_cast<T*>(t.data); }

#define CW_GRID_STRIDE(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------------------------------------
// RoPE: y[.., j] = x1 cos - sign x2 sin; y[.., j + half] = x2 cos + sign x1 sin (x1 = x[.., j],
// x2 = x[.., j + half]); sign = +1 forward, -1 backward (the transpose rotation). One thread per
// pair (j, j + half) of one head of one token; y may alias x.
template <class T>
__global__ void rope_kernel(T* y, const T* x, const float* cos, const float* sin, int64_t pairs, int64_t Tn,
                            int64_t H, int64_t half, int64_t pos0, float sign, bool accumulate) {
  CW_GRID_STRIDE(i, pairs) {
    const int64_t j = i % half;
    const int64_t row = i / half;         // (b * Tn + t) * H + h
    const int64_t t = (row / H) % Tn;
    const int64_t base = row * 2 * half;
    const int64_t p = (pos0 + t) * half + j;
    const float c = cos[p], s = sin[p];
    const float x1 = to_f32(x[base + j]), x2 = to_f32(x[base + j + half]);
    float y1 = x1 * c - sign * x2 * s;
    float y2 = x2 * c + sign * x1 * s;
    if (accumulate) {
      y1 = to_f32(y[base + j]) + y1;
      y2 = to_f32(y[base + j + half]) + y2;
    }
    y[base + j] = from_f32<T>(y1);
    y[base + j + half] = from_f32<T>(y2);
  }
}

void check_rope(const Tensor& y, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0,
                const char* op) {
  check_same_shape(y, x, "rope out / d_x", "rope in / d_out");
  CW_CHECK(x.ndim == 4, "{}: input must be [B, T, H, D], got {}", op, x.describe());
  CW_CHECK(x.size(3) % 2 == 0, "{}: head dim {} must be even", op, x.size(3));
  const int64_t Tn = x.size(1), half = x.size(3) / 2;
  check_shape(cos, {-1, half}, "rope cos table");
  check_same_shape(sin, cos, "rope sin table", "rope cos table");
  CW_CHECK(pos0 >= 0 && pos0 + Tn <= cos.size(0), "{}: positions [{}, {}) exceed the table of {} positions", op,
           pos0, pos0 + Tn, cos.size(0));
  check_dtype(y, x.dtype, "rope out / d_x");
  check_dtype(cos, DType::f32, "rope cos table (f32 on the GPU)");
  check_dtype(sin, DType::f32, "rope sin table (f32 on the GPU)");
  check_gpu(x, x, "rope in / d_out");
  check_gpu(y, x, "rope out / d_x");
  check_gpu(cos, x, "rope cos table");
  check_gpu(sin, x, "rope sin table");
}

void rope_launch(const Tensor& y, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0, float sign,
                 bool accumulate, const char* op) {
  const int64_t pairs = x.numel() / 2;
  if (pairs == 0) return;
  const int64_t Tn = x.size(1), H = x.size(2), half = x.size(3) / 2;
  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rope_kernel<T><<<grid_for(pairs), kThreads, 0, stream>>>(dptr<T>(y), dptr<const T>(x), dptr<const float>(cos),
                                                            dptr<const float>(sin), pairs, Tn, H, half, pos0, sign,
                                                            accumulate);
    CW_KERNEL_CHECK();
  });
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: out = silu(g) u. expf (not __expf) keeps f32 results within a few ulps of the CPU.
template <class T> __global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, int64_t n) {
  CW_GRID_STRIDE(i, n) {
    const float g = to_f32(gate[i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    out[i] = from_f32<T>(g * sig * to_f32(up[i]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* d_gate, T* d_up, const T* d_out, const T* gate, const T* up, int64_t n,
                                       bool accumulate) {
  CW_GRID_STRIDE(i, n) {
    const float g = to_f32(gate[i]), u = to_f32(up[i]), dy = to_f32(d_out[i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    const float silu = g * sig;
    float dg = dy * u * sig * (1.0f + g * (1.0f - sig));
    float du = dy * silu;
    if (accumulate) {
      dg = to_f32(d_gate[i]) + dg;
      du = to_f32(d_up[i]) + du;
    }
    d_gate[i] = from_f32<T>(dg);
    d_up[i] = from_f32<T>(du);
  }
}

void check_same_all(std::initializer_list<const Tensor*> ts, const char* op) {
  const Tensor& first = **ts.begin();
  for (const Tensor* t : ts) {
    check_same_shape(*t, first, op, "its first operand");
    check_dtype(*t, first.dtype, op);
    check_gpu(*t, first, op);
  }
}

// ---------------------------------------------------------------------------------------------
// dst = (accumulate ? dst : 0) + a (+ b when given), in the CPU's order; D may be f32 with S bf16.
template <class D, class S>
__global__ void add_kernel(D* dst, const S* a, const S* b, int64_t n, bool accumulate) {
  CW_GRID_STRIDE(i, n) {
    float v = accumulate ? to_f32(dst[i]) : 0.0f;
    v += to_f32(a[i]);
    if (b) v += to_f32(b[i]);
    dst[i] = from_f32<D>(v);
  }
}

// Checks and launches dst (op)= a (+ b). dst's dtype is a's, or f32 when `f32_dst_ok` (accumulate).
void add(const Tensor& dst, bool accumulate, const Tensor& a, const Tensor* b, bool f32_dst_ok, const char* op) {
  check_same_shape(dst, a, op, "its source");
  CW_CHECK(dst.dtype == a.dtype || (f32_dst_ok && dst.dtype == DType::f32),
           "{}: destination dtype {} with source dtype {} (allowed: the same dtype, or an f32 destination)", op,
           dtype_name(dst.dtype), dtype_name(a.dtype));
  check_gpu(a, a, op);
  check_gpu(dst, a, op);
  if (b) {
    check_same_shape(*b, a, op, "its second source");
    check_dtype(*b, a.dtype, op);
    check_gpu(*b, a, op);
  }
  const int64_t n = a.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(a.device.index);
  dispatch_compute(a.dtype, op, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* pb = b ? dptr<const S>(*b) : nullptr;
    if (dst.dtype == a.dtype) {
      add_kernel<S, S><<<grid_for(n), kThreads, 0, stream>>>(dptr<S>(dst), dptr<const S>(a), pb, n, accumulate);
    } else {
      add_kernel<float, S><<<grid_for(n), kThreads, 0, stream>>>(dptr<float>(dst), dptr<const S>(a), pb, n,
                                                                 accumulate);
    }
    CW_KERNEL_CHECK();
  });
}

#undef CW_GRID_STRIDE

}  // namespace

void rope_forward(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0) {
  check_rope(out, x, cos, sin, pos0, "rope_forward");
  rope_launch(out, x, cos, sin, pos0, 1.0f, false, "rope_forward");
}

void rope_backward(const Tensor& d_x, const Tensor& d_out, const Tensor& cos, const Tensor& sin, int64_t pos0,
                   GradMode mode) {
  check_rope(d_x, d_out, cos, sin, pos0, "rope_backward");
  CW_CHECK(mode == GradMode::overwrite || d_x.data != d_out.data, "rope_backward: accumulate needs d_x != d_out");
  rope_launch(d_x, d_out, cos, sin, pos0, -1.0f, mode == GradMode::accumulate, "rope_backward");
}

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_same_all({&gate, &up, &out}, "swiglu_forward");
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(gate.device.index);
  dispatch_compute(gate.dtype, "swiglu_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_forward_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(dptr<T>(out), dptr<const T>(gate),
                                                                   dptr<const T>(up), n);
    CW_KERNEL_CHECK();
  });
}

void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                     const Tensor& up, GradMode mode) {
  check_same_all({&gate, &up, &d_out, &d_gate, &d_up}, "swiglu_backward");
  CW_CHECK(d_gate.data != d_up.data || d_gate.empty(), "swiglu_backward: d_gate and d_up must be different buffers");
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(gate.device.index);
  dispatch_compute(gate.dtype, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_backward_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(
        dptr<T>(d_gate), dptr<T>(d_up), dptr<const T>(d_out), dptr<const T>(gate), dptr<const T>(up), n,
        mode == GradMode::accumulate);
    CW_KERNEL_CHECK();
  });
}

void residual_forward(const Tensor& out, const Tensor& x, const Tensor& delta) {
  add(out, false, x, &delta, false, "residual_forward");
}

void residual_backward(const Tensor& d_x, GradMode mode_x, const Tensor& d_delta, GradMode mode_delta,
                       const Tensor& d_out) {
  if (d_x.data == d_out.data) {
    // The stream's gradient buffer is passed straight through: nothing to write.
    CW_CHECK(mode_x == GradMode::overwrite, "residual_backward: d_x aliases d_out, so it cannot also accumulate");
  } else {
    add(d_x, mode_x == GradMode::accumulate, d_out, nullptr, false, "residual_backward d_x");
  }
  if (d_delta.data) add(d_delta, mode_delta == GradMode::accumulate, d_out, nullptr, false, "residual_backward d_delta");
}

void accumulate(const Tensor& dst, const Tensor& src) { add(dst, true, src, nullptr, true, "accumulate"); }

}  // namespace cw::gpu
