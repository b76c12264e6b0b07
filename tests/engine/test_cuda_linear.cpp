// The GPU linear (cuBLASLt, engine/cuda/linear.cu) and the AdamW update op (engine/ops/adamw_update.h,
// GPU kernel in engine/cuda/adamw.cu) against the CPU ops.
//
// Linear: every GPU result is compared with the CPU f64 op run on the same inputs, i.e. on the
// random values after rounding them to the GPU dtype, so the only differences left are the GPU's
// own roundings. Overwritten outputs are poisoned with NaN first (a missed element shows as NaN);
// accumulated outputs start from a known random value and must equal that value plus the product.
// The public ops (engine/ops/linear.h) are called: tensors on a GPU dispatch to engine/cuda.
//
// The "cuda:" cases are skipped on a machine without a GPU; the last case (the CPU AdamW op against
// a hand computation) runs everywhere.
#include "engine/cuda/runtime.h"
#include "engine/memory.h"
#include "engine/ops/adamw_update.h"
#include "engine/ops/linear.h"
#include "engine/random.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using namespace cw;
using namespace cw::test;

namespace {

const Device kGpu = Device::gpu(0);
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// f32 (no TF32): each output is an f32 accumulation of I (forward), O (d_x) or N (d_weight) exact
// products; its rounding error against f64 grows like eps_f32 * sqrt(terms) in the relative L2
// sense, about 1e-6 at 2048 terms.
constexpr double kF32Tol = 1e-5;
// bf16 activations/gradients: the f32 accumulation is rounded once to bf16 (relative error at most
// 2^-9 per element, about 1e-3 in L2).
constexpr double kBf16OutTol = 1e-2;
// bf16 inputs with an f32 d_weight: products of bf16 values are exact in f32, so only the f32
// accumulation error remains; the bound is loose on purpose (a bf16 rounding would be ~1e-3).
constexpr double kBf16GradWTol = 1e-3;
// AdamW: the GPU kernel computes in f32, the CPU op in f64 rounded to f32 once per step; they
// differ by a few f32 ulps after 3 steps.
constexpr double kAdamWTol = 1e-6;

std::vector<int64_t> shape_of(const Tensor& t) { return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim); }

// Any tensor (GPU or CPU, any float dtype) as a host f64 copy.
OwnedTensor to_host64(const Tensor& t) {
  OwnedTensor h = OwnedTensor::of_shape(DType::f64, shape_of(t));
  copy_convert(h, t);
  return h;
}

// The raw bytes of a GPU tensor.
std::vector<unsigned char> bytes_of(const Tensor& t) {
  OwnedTensor h = OwnedTensor::of_shape(t.dtype, shape_of(t));
  copy_convert(h, t);
  const auto* p = static_cast<const unsigned char*>(h.tensor.data);
  return std::vector<unsigned char>(p, p + h.tensor.bytes());
}

// A random normal [rows, cols] matrix rounded to `dtype`: `ref` holds the rounded values in f64 on
// the host (the CPU reference's input), `dev` the same values in `dtype` on the GPU.
struct Operand {
  OwnedTensor ref;
  OwnedTensor dev;
};

Operand make_operand(DType dtype, int64_t rows, int64_t cols, uint64_t stream) {
  Operand o;
  o.ref = OwnedTensor(DType::f64, {rows, cols});
  fill_normal(o.ref, 4242, stream);
  OwnedTensor rounded(dtype, {rows, cols});
  copy_convert(rounded, o.ref);
  copy_convert(o.ref, rounded);
  o.dev = OwnedTensor::on(kGpu, dtype, {rows, cols});
  copy_convert(o.dev, rounded);
  return o;
}

void check_close(const char* what, const Tensor& gpu_result, const Tensor& reference, double tol) {
  const OwnedTensor got = to_host64(gpu_result);
  const Worst w = compare(got, reference);
  INFO(what, ": ", w.str());
  CHECK(w.rel < tol);  // a NaN (an element never written) fails here
}

// Forward, backward (d_x overwrite + d_weight accumulate), d_x accumulate with d_weight skipped,
// and d_weight accumulate with d_x skipped, all against the CPU f64 op.
void check_linear(DType dtype, int64_t N, int64_t I, int64_t O, double tol_act, double tol_dw) {
  INFO(dtype_name(dtype), " N=", N, " I=", I, " O=", O);
  const Operand x = make_operand(dtype, N, I, 1), w = make_operand(dtype, O, I, 2), dy = make_operand(dtype, N, O, 3);

  // forward: out = x Wᵀ
  OwnedTensor out = OwnedTensor::on(kGpu, dtype, {N, O});
  gpu::fill(out, kNaN);
  linear_forward(out, x.dev, w.dev);
  OwnedTensor out_ref(DType::f64, {N, O});
  linear_forward(out_ref, x.ref, w.ref);
  check_close("forward out", out, out_ref, tol_act);

  // backward: d_x overwritten (poisoned first), d_weight (f32) accumulated onto a random start
  OwnedTensor dx = OwnedTensor::on(kGpu, dtype, {N, I});
  gpu::fill(dx, kNaN);
  Operand dw = make_operand(DType::f32, O, I, 4);  // dw.ref: the start value, then the running reference
  OwnedTensor dx_ref(DType::f64, {N, I});
  linear_backward(dx, dw.dev, dy.dev, x.dev, w.dev, GradMode::overwrite);
  linear_backward(dx_ref, dw.ref, dy.ref, x.ref, w.ref, GradMode::overwrite);
  check_close("d_x (overwrite)", dx, dx_ref, tol_act);
  check_close("d_weight (start + d_outᵀ x)", dw.dev, dw.ref, tol_dw);

  // d_x accumulated onto a random start (dtype), d_weight skipped
  Operand dx_acc = make_operand(dtype, N, I, 5);
  linear_backward(dx_acc.dev, Tensor{}, dy.dev, x.dev, w.dev, GradMode::accumulate);
  linear_backward(dx_acc.ref, Tensor{}, dy.ref, x.ref, w.ref, GradMode::accumulate);
  check_close("d_x (accumulate)", dx_acc.dev, dx_acc.ref, tol_act);

  // d_weight accumulated a second time, d_x skipped: start + 2 d_outᵀ x
  linear_backward(Tensor{}, dw.dev, dy.dev, x.dev, w.dev, GradMode::overwrite);
  linear_backward(Tensor{}, dw.ref, dy.ref, x.ref, w.ref, GradMode::overwrite);
  check_close("d_weight (start + 2 d_outᵀ x)", dw.dev, dw.ref, tol_dw);
}

// Forward and backward twice on the same buffers; the bytes must be identical.
void check_deterministic(DType dtype, int64_t N, int64_t I, int64_t O) {
  INFO(dtype_name(dtype), " N=", N, " I=", I, " O=", O);
  const Operand x = make_operand(dtype, N, I, 11), w = make_operand(dtype, O, I, 12), dy = make_operand(dtype, N, O, 13);
  OwnedTensor out = OwnedTensor::on(kGpu, dtype, {N, O});
  OwnedTensor dx = OwnedTensor::on(kGpu, dtype, {N, I});
  OwnedTensor dw = OwnedTensor::on(kGpu, DType::f32, {O, I});
  std::vector<unsigned char> first[3], second[3];
  for (auto* run : {first, second}) {
    gpu::fill(out, kNaN);
    gpu::fill(dx, kNaN);
    gpu::fill(dw, 0.0);
    linear_forward(out, x.dev, w.dev);
    linear_backward(dx, dw, dy.dev, x.dev, w.dev, GradMode::overwrite);
    run[0] = bytes_of(out);
    run[1] = bytes_of(dx);
    run[2] = bytes_of(dw);
  }
  CHECK(first[0] == second[0]);
  CHECK(first[1] == second[1]);
  CHECK(first[2] == second[2]);
}

}  // namespace

TEST_CASE("cuda: linear f32 (no TF32) matches the f64 CPU op" * doctest::skip(!cw::test::gpu_ready())) {
  check_linear(DType::f32, 37, 203, 61, kF32Tol, kF32Tol);
  check_linear(DType::f32, 1, 1, 1, kF32Tol, kF32Tol);
  check_linear(DType::f32, 1024, 2048, 2048, kF32Tol, kF32Tol);
}

TEST_CASE("cuda: linear bf16 matches the f64 CPU op; d_weight accumulates in f32" * doctest::skip(!cw::test::gpu_ready())) {
  check_linear(DType::bf16, 37, 203, 61, kBf16OutTol, kBf16GradWTol);
  check_linear(DType::bf16, 1, 1, 1, kBf16OutTol, kBf16GradWTol);
  check_linear(DType::bf16, 1024, 2048, 2048, kBf16OutTol, kBf16GradWTol);
}

TEST_CASE("cuda: linear is bitwise deterministic" * doctest::skip(!cw::test::gpu_ready())) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    check_deterministic(dtype, 37, 203, 61);
    check_deterministic(dtype, 1024, 2048, 2048);
  }
}

TEST_CASE("cuda: linear rejects bad operands" * doctest::skip(!cw::test::gpu_ready())) {
  const int64_t N = 4, I = 6, O = 3;
  const Operand x = make_operand(DType::bf16, N, I, 21), w = make_operand(DType::bf16, O, I, 22),
                dy = make_operand(DType::bf16, N, O, 23);
  OwnedTensor out_bad_shape = OwnedTensor::on(kGpu, DType::bf16, {N, O + 1});
  CHECK_THROWS_AS(linear_forward(out_bad_shape, x.dev, w.dev), Error);
  OwnedTensor out_f32 = OwnedTensor::on(kGpu, DType::f32, {N, O});
  CHECK_THROWS_AS(linear_forward(out_f32, x.dev, w.dev), Error);  // one compute dtype per call
  OwnedTensor w_host(DType::bf16, {O, I});
  OwnedTensor out = OwnedTensor::on(kGpu, DType::bf16, {N, O});
  CHECK_THROWS_AS(linear_forward(out, x.dev, w_host), Error);  // weight on the CPU
  OwnedTensor dw_bf16 = OwnedTensor::on(kGpu, DType::bf16, {O, I});
  CHECK_THROWS_AS(linear_backward(Tensor{}, dw_bf16, dy.dev, x.dev, w.dev, GradMode::overwrite), Error);  // d_weight f32
  OwnedTensor dx_bad = OwnedTensor::on(kGpu, DType::bf16, {N, I + 1});
  CHECK_THROWS_AS(linear_backward(dx_bad, Tensor{}, dy.dev, x.dev, w.dev, GradMode::overwrite), Error);
}

TEST_CASE("cuda: adamw_update kernel matches the CPU op (f32, 3 steps) and writes the bf16 copy" *
          doctest::skip(!cw::test::gpu_ready())) {
  // More elements than one pass of the grid (4096 blocks x 256 threads) covers, and an odd tail.
  const int64_t n = (int64_t(1) << 21) + 37;
  OwnedTensor p_cpu(DType::f32, {n}), m_cpu(DType::f32, {n}), v_cpu(DType::f32, {n}), g(DType::f32, {n});
  fill_normal(p_cpu, 77, 1);
  OwnedTensor p_gpu = OwnedTensor::on(kGpu, DType::f32, {n}), m_gpu = OwnedTensor::on(kGpu, DType::f32, {n}),
              v_gpu = OwnedTensor::on(kGpu, DType::f32, {n}), g_gpu = OwnedTensor::on(kGpu, DType::f32, {n}),
              copy_gpu = OwnedTensor::on(kGpu, DType::bf16, {n});
  copy_convert(p_gpu, p_cpu);
  gpu::fill(m_gpu, 0.0);  // the CPU moments start at 0 (zero-filled buffers)
  gpu::fill(v_gpu, 0.0);
  gpu::fill(copy_gpu, kNaN);

  for (int64_t t = 1; t <= 3; ++t) {
    fill_normal(g, 77, 10 + static_cast<uint64_t>(t), 0.0, 0.5);
    copy_convert(g_gpu, g);
    const AdamWHyper h{1e-2 * static_cast<double>(t), 0.9, 0.95, 1e-8, 0.1, t};
    adamw_update(p_cpu, m_cpu, v_cpu, g, Tensor{}, h);
    // Step 2 leaves the copy out (the kernel must not write it); steps 1 and 3 write it.
    adamw_update(p_gpu, m_gpu, v_gpu, g_gpu, t == 2 ? Tensor{} : copy_gpu.tensor, h);
  }
  struct Pair {
    const char* what;
    const Tensor& got;
    const Tensor& want;
  };
  for (const Pair& c : {Pair{"param", p_gpu, p_cpu}, Pair{"exp_avg", m_gpu, m_cpu}, Pair{"exp_avg_sq", v_gpu, v_cpu}}) {
    const OwnedTensor want64 = to_host64(c.want);
    check_close(c.what, c.got, want64, kAdamWTol);
  }

  // The bf16 copy is the GPU's updated f32 master rounded to nearest even, bit for bit.
  OwnedTensor p_back(DType::f32, {n}), copy_back(DType::bf16, {n});
  copy_convert(p_back, p_gpu);
  copy_convert(copy_back, copy_gpu);
  int64_t mismatches = 0, first_bad = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (bf16::from_float(p_back.tensor.ptr<float>()[i]).bits != copy_back.tensor.ptr<bf16>()[i].bits) {
      if (first_bad < 0) first_bad = i;
      ++mismatches;
    }
  }
  INFO("first mismatch at #", first_bad);
  CHECK(mismatches == 0);
}
