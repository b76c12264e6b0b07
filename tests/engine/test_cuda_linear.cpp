// The GPU linear (cuBLASLt, engine/cuda/linear.cu) and AdamW update (engine/cuda/adamw.cu) beyond the
// op table (test_backend_ops.cpp checks their values against the CPU in f64, poisoning, accumulation
// and repeatability): linear's operand checks, and the bf16 compute copy of AdamW bit for bit.
#include "engine/cuda/runtime.h"
#include "engine/memory.h"
#include "engine/ops/adamw_update.h"
#include "engine/ops/linear.h"
#include "tests/gpu_support.h"

#include <vector>

using namespace cw;
using namespace cw::test;

namespace {
const Device kGpu = Device::gpu(0);
struct Operand {
  OwnedTensor dev;
};
Operand make_operand(DType dtype, int64_t rows, int64_t cols, uint64_t stream) {
  return Operand{make_gpu_input(dtype, {rows, cols}, 4242, stream).dev};
}
}  // namespace

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

TEST_CASE("cuda: linear backward of a frozen weight without its input gives d_x bit for bit" *
          doctest::skip(!cw::test::gpu_ready())) {
  const int64_t N = 64, I = 96, O = 48;
  for (const DType dt : {DType::f32, DType::bf16}) {
    const Operand x = make_operand(dt, N, I, 31), w = make_operand(dt, O, I, 32), dy = make_operand(dt, N, O, 33);
    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      const Operand with = make_operand(dt, N, I, 34), without = make_operand(dt, N, I, 34);
      linear_backward(with.dev, Tensor{}, dy.dev, x.dev, w.dev, mode);
      linear_backward(without.dev, Tensor{}, dy.dev, Tensor{}, w.dev, mode);
      const std::string what = std::string(dtype_name(dt)) + (mode == GradMode::accumulate ? ", accumulate" : "");
      expect_same_bits(with.dev, without.dev, what);
    }
  }
}

TEST_CASE("cuda: adamw_update writes the bf16 compute copy as its f32 master rounded, bit for bit" *
          doctest::skip(!cw::test::gpu_ready())) {
  // More elements than one pass of the grid (4096 blocks x 256 threads) covers, and an odd tail.
  const int64_t n = (int64_t(1) << 21) + 37;
  GpuInput p = make_gpu_input(DType::f32, {n}, 77, 1), g = make_gpu_input(DType::f32, {n}, 77, 2, 0.5);
  OwnedTensor m = on_gpu(DType::f32, {n}), v = on_gpu(DType::f32, {n}), copy = poisoned(DType::bf16, {n});
  gpu::fill(m, 0.0);
  gpu::fill(v, 0.0);
  adamw_update(p.dev, m, v, g.dev, copy, {1e-2, 0.9, 0.95, 1e-8, 0.1, 1});
  OwnedTensor p_back(DType::f32, {n}), copy_back(DType::bf16, {n});
  copy_convert(p_back, p.dev);
  copy_convert(copy_back, copy);
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
