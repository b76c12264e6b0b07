// GPU elementwise ops: rotary position embedding, the SwiGLU and GeGLU gates, the residual connection
// and gradient accumulation (the math of engine/ops/rope.h, swiglu.h, geglu.h and residual.h).
//
// Dtypes: activations and gradients in the compute dtype T (f32 or bf16, one per call); the rope
// cos/sin tables are f32 on the device for either compute dtype; accumulate() also takes an f32
// destination with a T source (a gradient summed in f32). Arithmetic is f32; every output element is
// rounded to its dtype once.
//
// Memory traffic: every kernel here is memory bound, and each reads its inputs and writes its
// outputs exactly once (swiglu and geglu forward: 2 reads + 1 write per element; backward: 3 reads
// (+2 in accumulate mode) + 2 writes; residual: 2 + 1; rope: 1 (+1) + 1, plus the f32 cos/sin rows, which
// are shared by all heads of a token and come from L2).
//
// Launch shapes: 256 threads per block, a grid-stride loop over int64 indices with at most
// kMaxBlocks blocks (65536 x 256 = 16M threads: one or a few iterations per thread at realistic
// sizes, thousands of loads in flight per SM, enough to fill all 132 SMs of an H100). Two paths,
// chosen on the host per call:
//   Vector path: every pointer 16-byte aligned. One thread per 16-byte vector of the narrowest
//     dtype (8 bf16 or 4 f32 elements; an f32 destination of a bf16 source takes two 16-byte
//     accesses), one 128-bit load or store per access, coalesced. The gates, residual and accumulate run
//     over n / kN vectors and then the n % kN tail elements with scalar accesses in the same kernel
//     (so any n works). rope also needs half = D / 2 to be a multiple of kN: one thread loads kN
//     elements of each half of a head (x[j .. j+kN) and x[half+j .. half+j+kN)) and the matching
//     kN cos/sin values (f32, 16-byte aligned since half is a multiple of kN).
//   Scalar path (unaligned views, rope with half not a multiple of kN, e.g. D = 10): one thread per
//     element (per rotated pair for rope), scalar coalesced loads.
// Both paths compute every element with the same f32 expression and round it once, so they give
// the same bits.
//
// Determinism: every output element is computed by one thread from its own inputs; no reductions,
// no atomics, so the results are bitwise reproducible. Aliasing: each thread reads all of an
// element's inputs before writing it, and no pointer is __restrict__, so in-place calls (rope
// out == x, residual out == x) are safe.
// Nothing synchronises; everything runs on current_stream(device) of the operands' device.
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace cw::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(blocks_for(n, kThreads), kMaxBlocks)); }

// N consecutive elements of T (N a multiple of Vec16<T>::kN, p 16-byte aligned) to/from f32.
template <int N, class T> __device__ __forceinline__ void load_f32(const T* p, float (&v)[N]) {
  constexpr int kN = Vec16<T>::kN;
  static_assert(N % kN == 0);
#pragma unroll
  for (int m = 0; m < N / kN; ++m) {
    Vec16<T> q;
    q.load(p + m * kN);
#pragma unroll
    for (int k = 0; k < kN; ++k) v[m * kN + k] = q.get(k);
  }
}
template <int N, class T> __device__ __forceinline__ void store_f32(T* p, const float (&v)[N]) {
  constexpr int kN = Vec16<T>::kN;
  static_assert(N % kN == 0);
#pragma unroll
  for (int m = 0; m < N / kN; ++m) Vec16<T>::pack(v + m * kN).store(p + m * kN);
}
// Read-only f32 table rows (rope cos/sin: nothing writes them during the kernel).
template <int N> __device__ __forceinline__ void load_f32_ro(const float* p, float (&v)[N]) {
  static_assert(N % 4 == 0);
#pragma unroll
  for (int m = 0; m < N / 4; ++m) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p) + m);
    v[4 * m] = q.x, v[4 * m + 1] = q.y, v[4 * m + 2] = q.z, v[4 * m + 3] = q.w;
  }
}

#define CW_GRID_STRIDE(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------------------------------------
// RoPE: y[.., j] = x1 cos - sign x2 sin; y[.., j + half] = x2 cos + sign x1 sin (x1 = x[.., j],
// x2 = x[.., j + half]); sign = +1 forward, -1 backward (the transpose rotation). One thread per
// pair (j, j + half) of one head of one token; y may alias x. px, py: the token strides of x and y
// (H D when packed; more for a column slice of wider rows, engine/ops/rope.h).
template <class T>
__global__ void rope_kernel(T* y, int64_t py, const T* x, int64_t px, const float* cos, const float* sin,
                            int64_t pairs, int64_t Tn, int64_t H, int64_t half, int64_t pos0, float sign,
                            bool accumulate) {
  CW_GRID_STRIDE(i, pairs) {
    const int64_t j = i % half;
    const int64_t row = i / half;         // (b * Tn + t) * H + h
    const int64_t token = row / H, h = row - token * H;
    const int64_t t = token % Tn;
    const int64_t bx = token * px + h * 2 * half, by = token * py + h * 2 * half;
    const int64_t p = (pos0 + t) * half + j;
    const float c = cos[p], s = sin[p];
    const float x1 = to_f32(x[bx + j]), x2 = to_f32(x[bx + j + half]);
    float y1 = x1 * c - sign * x2 * s;
    float y2 = x2 * c + sign * x1 * s;
    if (accumulate) {
      y1 = to_f32(y[by + j]) + y1;
      y2 = to_f32(y[by + j + half]) + y2;
    }
    y[by + j] = from_f32<T>(y1);
    y[by + j + half] = from_f32<T>(y2);
  }
}

// Vector path: one thread per (row, j) with j a multiple of kN: elements [j, j + kN) of the first
// half and [half + j, half + j + kN) of the second half of one head of one token. Requires half %
// kN == 0 and x, y, cos, sin 16-byte aligned. Same per-element expression as rope_kernel. I is the
// index type: uint32_t when the whole tensor has < 2^31 elements (cheaper divisions), else int64_t.
template <class T, class I>
__global__ void rope_vec_kernel(T* y, int64_t py, const T* x, int64_t px, const float* cos, const float* sin, I items,
                                I Tn, I H, I half, int64_t pos0, float sign, bool accumulate) {
  constexpr int kN = Vec16<T>::kN;
  const I per_row = half / kN;  // vectors per half-head
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += static_cast<I>(gridDim.x) * blockDim.x) {
    const I row = i / per_row;  // (b * Tn + t) * H + h
    const I j = (i - row * per_row) * kN;
    const I token = row / H, h = row - token * H;
    const I t = token % Tn;
    const int64_t bx = static_cast<int64_t>(token) * px + static_cast<int64_t>(h) * 2 * half;
    const int64_t by = static_cast<int64_t>(token) * py + static_cast<int64_t>(h) * 2 * half;
    const int64_t p = (pos0 + static_cast<int64_t>(t)) * half + j;
    float x1[kN], x2[kN], c[kN], s[kN];
    load_f32(x + bx + j, x1);
    load_f32(x + bx + half + j, x2);
    load_f32_ro(cos + p, c);
    load_f32_ro(sin + p, s);
    float y1[kN], y2[kN];
    if (accumulate) {
      load_f32(y + by + j, y1);
      load_f32(y + by + half + j, y2);
    }
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      float a = x1[k] * c[k] - sign * x2[k] * s[k];
      float b = x2[k] * c[k] + sign * x1[k] * s[k];
      if (accumulate) {
        a = y1[k] + a;
        b = y2[k] + b;
      }
      y1[k] = a;
      y2[k] = b;
    }
    store_f32(y + by + j, y1);
    store_f32(y + by + half + j, y2);
  }
}

void rope_launch(const Tensor& y, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0, float sign,
                 bool accumulate, const char* op) {
  const int64_t pairs = x.numel() / 2;
  if (pairs == 0) return;
  const int64_t Tn = x.size(1), H = x.size(2), half = x.size(3) / 2;
  const int64_t px = x.stride[1], py = y.stride[1];  // token strides (engine/ops/rope.cpp checked the layout)
  cudaStream_t stream = current_stream(x.device.index);
  dispatch_compute(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kN = Vec16<T>::kN;
    if (half % kN == 0 && px % kN == 0 && py % kN == 0 && aligned16(y.data) && aligned16(x.data) &&
        aligned16(cos.data) && aligned16(sin.data)) {
      const int64_t items = pairs / kN;
      if (x.numel() < (int64_t{1} << 31)) {
        // i < 2^31 and i + stride < 2^31 + 2^24: no uint32_t overflow.
        using I = uint32_t;
        rope_vec_kernel<T, I><<<grid_for(items), kThreads, 0, stream>>>(
            dptr<T>(y), py, dptr<const T>(x), px, dptr<const float>(cos), dptr<const float>(sin), static_cast<I>(items),
            static_cast<I>(Tn), static_cast<I>(H), static_cast<I>(half), pos0, sign, accumulate);
      } else {
        rope_vec_kernel<T, int64_t><<<grid_for(items), kThreads, 0, stream>>>(
            dptr<T>(y), py, dptr<const T>(x), px, dptr<const float>(cos), dptr<const float>(sin), items, Tn, H, half, pos0,
            sign, accumulate);
      }
    } else {
      rope_kernel<T><<<grid_for(pairs), kThreads, 0, stream>>>(dptr<T>(y), py, dptr<const T>(x), px, dptr<const float>(cos),
                                                              dptr<const float>(sin), pairs, Tn, H, half, pos0, sign,
                                                              accumulate);
    }
    CW_KERNEL_CHECK();
  });
}

// ---------------------------------------------------------------------------------------------
// The gated linear units: out = act(g) u with its gradients d_gate = dy u act'(g), d_up = dy act(g),
// for the two gates (engine/ops/swiglu.h, geglu.h). One kernel template serves both: the gate is a
// type with value(g, u) and grads(g, u, dy, dg, du).
// SwiGLU: act = silu(g) = g sig(g), act' = sig (1 + g (1 - sig)). expf (not __expf) keeps f32
// results within a few ulps of the CPU.
struct SiluGate {
  __device__ __forceinline__ static float value(float g, float u) {
    const float sig = 1.0f / (1.0f + expf(-g));
    return g * sig * u;
  }
  __device__ __forceinline__ static void grads(float g, float u, float dy, float& dg, float& du) {
    const float sig = 1.0f / (1.0f + expf(-g));
    dg = dy * u * sig * (1.0f + g * (1.0f - sig));
    du = dy * (g * sig);
  }
};
// GeGLU: act = g/2 (1 + tanh(k0 (g + k1 g^3))) (GELU's tanh approximation), act' = (1 + t)/2 +
// g/2 (1 - t^2) k0 (1 + 3 k1 g^2). tanhf (not a fast approximation) keeps f32 results within a few
// ulps of the CPU.
struct GeluTanhGate {
  static constexpr float kSqrt2OverPi = 0.7978845608028654f;
  static constexpr float kCubic = 0.044715f;
  __device__ __forceinline__ static float tanh_of(float g) { return tanhf(kSqrt2OverPi * (g + kCubic * g * g * g)); }
  __device__ __forceinline__ static float value(float g, float u) { return 0.5f * g * (1.0f + tanh_of(g)) * u; }
  __device__ __forceinline__ static void grads(float g, float u, float dy, float& dg, float& du) {
    const float t = tanh_of(g);
    const float slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * g * g);
    dg = dy * u * slope;
    du = dy * (0.5f * g * (1.0f + t));
  }
};

template <class Gate, class T> __global__ void glu_forward_kernel(T* out, const T* gate, const T* up, int64_t n) {
  CW_GRID_STRIDE(i, n) out[i] = from_f32<T>(Gate::value(to_f32(gate[i]), to_f32(up[i])));
}

// Vector path: one thread per kN elements (all pointers 16-byte aligned), then the n % kN tail.
template <class Gate, class T> __global__ void glu_forward_vec_kernel(T* out, const T* gate, const T* up, int64_t n) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t nv = n / kN;
  CW_GRID_STRIDE(i, nv) {
    float g[kN], u[kN], o[kN];
    load_f32(gate + i * kN, g);
    load_f32(up + i * kN, u);
#pragma unroll
    for (int k = 0; k < kN; ++k) o[k] = Gate::value(g[k], u[k]);
    store_f32(out + i * kN, o);
  }
  CW_GRID_STRIDE(r, n - nv * kN) {
    const int64_t i = nv * kN + r;
    out[i] = from_f32<T>(Gate::value(to_f32(gate[i]), to_f32(up[i])));
  }
}

// The backward of element i, one scalar at a time (the unaligned kernel and the vector kernel's tail).
template <class Gate, class T>
__device__ __forceinline__ void glu_backward_at(int64_t i, T* d_gate, T* d_up, const T* d_out, const T* gate,
                                                const T* up, bool accumulate) {
  float dg, du;
  Gate::grads(to_f32(gate[i]), to_f32(up[i]), to_f32(d_out[i]), dg, du);
  if (accumulate) {
    dg = to_f32(d_gate[i]) + dg;
    du = to_f32(d_up[i]) + du;
  }
  d_gate[i] = from_f32<T>(dg);
  d_up[i] = from_f32<T>(du);
}

template <class Gate, class T>
__global__ void glu_backward_kernel(T* d_gate, T* d_up, const T* d_out, const T* gate, const T* up, int64_t n,
                                    bool accumulate) {
  CW_GRID_STRIDE(i, n) glu_backward_at<Gate>(i, d_gate, d_up, d_out, gate, up, accumulate);
}

template <class Gate, class T>
__global__ void glu_backward_vec_kernel(T* d_gate, T* d_up, const T* d_out, const T* gate, const T* up, int64_t n,
                                        bool accumulate) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t nv = n / kN;
  CW_GRID_STRIDE(i, nv) {
    float g[kN], u[kN], dy[kN], dg[kN], du[kN];
    load_f32(gate + i * kN, g);
    load_f32(up + i * kN, u);
    load_f32(d_out + i * kN, dy);
    if (accumulate) {
      load_f32(d_gate + i * kN, dg);
      load_f32(d_up + i * kN, du);
    }
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      float a, b;
      Gate::grads(g[k], u[k], dy[k], a, b);
      if (accumulate) {
        a = dg[k] + a;
        b = du[k] + b;
      }
      dg[k] = a;
      du[k] = b;
    }
    store_f32(d_gate + i * kN, dg);
    store_f32(d_up + i * kN, du);
  }
  CW_GRID_STRIDE(r, n - nv * kN) glu_backward_at<Gate>(nv * kN + r, d_gate, d_up, d_out, gate, up, accumulate);
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

// Vector path: kN = the source's 16-byte width (an f32 destination of a bf16 source takes two
// 16-byte accesses per 8 elements); then the n % kN tail. dst may alias a (residual in place).
template <class D, class S>
__global__ void add_vec_kernel(D* dst, const S* a, const S* b, int64_t n, bool accumulate) {
  constexpr int kN = Vec16<S>::kN;
  const int64_t nv = n / kN;
  CW_GRID_STRIDE(i, nv) {
    float v[kN], av[kN];
    if (accumulate) {
      load_f32(dst + i * kN, v);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) v[k] = 0.0f;
    }
    load_f32(a + i * kN, av);
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] += av[k];
    if (b) {
      float bv[kN];
      load_f32(b + i * kN, bv);
#pragma unroll
      for (int k = 0; k < kN; ++k) v[k] += bv[k];
    }
    store_f32(dst + i * kN, v);
  }
  CW_GRID_STRIDE(r, n - nv * kN) {
    const int64_t i = nv * kN + r;
    float v = accumulate ? to_f32(dst[i]) : 0.0f;
    v += to_f32(a[i]);
    if (b) v += to_f32(b[i]);
    dst[i] = from_f32<D>(v);
  }
}

// Launches dst (op)= a (+ b). dst's dtype is a's, or f32 (accumulate: the op entry allows it).
void add(const Tensor& dst, bool accumulate, const Tensor& a, const Tensor* b, const char* op) {
  const int64_t n = a.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(a.device.index);
  dispatch_compute(a.dtype, op, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* pb = b ? dptr<const S>(*b) : nullptr;
    const bool vec = aligned16(dst.data) && aligned16(a.data) && aligned16(pb);  // nullptr is aligned
    const unsigned grid_v = grid_for(std::max<int64_t>(n / Vec16<S>::kN, 1));
    if (dst.dtype == a.dtype) {
      if (vec) {
        add_vec_kernel<S, S><<<grid_v, kThreads, 0, stream>>>(dptr<S>(dst), dptr<const S>(a), pb, n, accumulate);
      } else {
        add_kernel<S, S><<<grid_for(n), kThreads, 0, stream>>>(dptr<S>(dst), dptr<const S>(a), pb, n, accumulate);
      }
    } else {
      if (vec) {
        add_vec_kernel<float, S><<<grid_v, kThreads, 0, stream>>>(dptr<float>(dst), dptr<const S>(a), pb, n,
                                                                  accumulate);
      } else {
        add_kernel<float, S><<<grid_for(n), kThreads, 0, stream>>>(dptr<float>(dst), dptr<const S>(a), pb, n,
                                                                   accumulate);
      }
    }
    CW_KERNEL_CHECK();
  });
}

#undef CW_GRID_STRIDE

}  // namespace

// The ops' contracts (shapes, dtypes, layout, device, aliasing) are checked by the public entries
// (engine/ops/rope.cpp, gated_units.cpp, residual.cpp); what is checked here is this backend's own: f32
// or bf16 (dispatch_compute).
void rope_forward(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t pos0) {
  rope_launch(out, x, cos, sin, pos0, 1.0f, false, "rope_forward");
}

void rope_backward(const Tensor& d_x, const Tensor& d_out, const Tensor& cos, const Tensor& sin, int64_t pos0,
                   GradMode mode) {
  rope_launch(d_x, d_out, cos, sin, pos0, -1.0f, mode == GradMode::accumulate, "rope_backward");
}

namespace {
template <class Gate>
void glu_forward(const Tensor& out, const Tensor& gate, const Tensor& up, const char* what) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(gate.device.index);
  dispatch_compute(gate.dtype, what, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (aligned16(out.data) && aligned16(gate.data) && aligned16(up.data)) {
      glu_forward_vec_kernel<Gate, T><<<grid_for(std::max<int64_t>(n / Vec16<T>::kN, 1)), kThreads, 0, stream>>>(
          dptr<T>(out), dptr<const T>(gate), dptr<const T>(up), n);
    } else {
      glu_forward_kernel<Gate, T><<<grid_for(n), kThreads, 0, stream>>>(dptr<T>(out), dptr<const T>(gate),
                                                                        dptr<const T>(up), n);
    }
    CW_KERNEL_CHECK();
  });
}

template <class Gate>
void glu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate, const Tensor& up,
                  GradMode mode, const char* what) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream(gate.device.index);
  dispatch_compute(gate.dtype, what, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (aligned16(d_gate.data) && aligned16(d_up.data) && aligned16(d_out.data) && aligned16(gate.data) &&
        aligned16(up.data)) {
      glu_backward_vec_kernel<Gate, T><<<grid_for(std::max<int64_t>(n / Vec16<T>::kN, 1)), kThreads, 0, stream>>>(
          dptr<T>(d_gate), dptr<T>(d_up), dptr<const T>(d_out), dptr<const T>(gate), dptr<const T>(up), n,
          mode == GradMode::accumulate);
    } else {
      glu_backward_kernel<Gate, T><<<grid_for(n), kThreads, 0, stream>>>(
          dptr<T>(d_gate), dptr<T>(d_up), dptr<const T>(d_out), dptr<const T>(gate), dptr<const T>(up), n,
          mode == GradMode::accumulate);
    }
    CW_KERNEL_CHECK();
  });
}
}  // namespace

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  glu_forward<SiluGate>(out, gate, up, "swiglu_forward");
}

void swiglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                     const Tensor& up, GradMode mode) {
  glu_backward<SiluGate>(d_gate, d_up, d_out, gate, up, mode, "swiglu_backward");
}

void geglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  glu_forward<GeluTanhGate>(out, gate, up, "geglu_forward");
}

void geglu_backward(const Tensor& d_gate, const Tensor& d_up, const Tensor& d_out, const Tensor& gate,
                    const Tensor& up, GradMode mode) {
  glu_backward<GeluTanhGate>(d_gate, d_up, d_out, gate, up, mode, "geglu_backward");
}

void residual_forward(const Tensor& out, const Tensor& x, const Tensor& delta) {
  add(out, false, x, &delta, "residual_forward");
}

void residual_backward(const Tensor& d_x, GradMode mode_x, const Tensor& d_delta, GradMode mode_delta,
                       const Tensor& d_out) {
  // d_x aliasing d_out: the stream's gradient buffer is passed straight through, nothing to write.
  if (d_x.data != d_out.data) add(d_x, mode_x == GradMode::accumulate, d_out, nullptr, "residual_backward d_x");
  if (d_delta.data) add(d_delta, mode_delta == GradMode::accumulate, d_out, nullptr, "residual_backward d_delta");
}

void accumulate(const Tensor& dst, const Tensor& src) { add(dst, true, src, nullptr, "accumulate"); }

}  // namespace cw::gpu
