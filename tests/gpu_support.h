// GPU tests: declared as TEST_CASE("cuda: ..." * doctest::skip(!cw::test::gpu_ready())), so on a
// machine without a GPU they are counted as skipped, and the runner says why at the start.
//
// The helpers every GPU op test shares: inputs drawn in f64, rounded to the device dtype on the
// host, uploaded (the GPU's input) and widened back to f64 (the reference's input), so both sides
// see identical values; outputs poisoned with NaN before a run so unwritten elements are caught;
// results fetched back as f64 and compared with the f64 reference (relative L2 error, worst element
// reported); bitwise comparisons of two device results in their own dtype.
#pragma once

#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/random.h"
#include "engine/tensor.h"
#include "tests/support.h"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace cw::test {

inline bool gpu_ready() {
  static const bool ready = gpu::available();
  return ready;
}

inline Device gpu0() { return Device::gpu(0); }

inline std::vector<int64_t> shape_of(const Tensor& t) { return {t.shape.begin(), t.shape.begin() + t.ndim}; }

// A packed device tensor of any shape on GPU 0 (OwnedTensor::on takes an initializer list only).
inline OwnedTensor on_gpu(DType dt, const std::vector<int64_t>& shape) {
  OwnedTensor t;
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  t.buffer = Buffer(static_cast<size_t>(n) * dtype_size(dt), gpu0());
  t.tensor = Tensor::packed(t.buffer.data(), dt, gpu0(), shape);
  return t;
}

// An input: random values rounded to `dt`, as an f64 host tensor (the reference's input) and a
// device tensor of dtype dt holding exactly the same values.
struct GpuInput {
  OwnedTensor ref;  // f64, host
  OwnedTensor dev;  // dt, GPU 0
};

inline GpuInput make_gpu_input(DType dt, const std::vector<int64_t>& shape, uint64_t seed, uint64_t stream,
                               double std = 1.0, double mean = 0.0) {
  OwnedTensor f64 = OwnedTensor::of_shape(DType::f64, shape);
  fill_normal(f64, seed, stream, mean, std);
  OwnedTensor rounded = OwnedTensor::of_shape(dt, shape);
  copy_convert(rounded, f64);  // round to dt (nearest even)
  copy_convert(f64, rounded);  // the reference sees the rounded values
  GpuInput in{std::move(f64), on_gpu(dt, shape)};
  gpu::copy_convert(in.dev, rounded);
  return in;
}

// A device tensor every element of which is NaN.
inline OwnedTensor poisoned(DType dt, const std::vector<int64_t>& shape) {
  OwnedTensor t = on_gpu(dt, shape);
  gpu::fill(t, std::numeric_limits<double>::quiet_NaN());
  return t;
}

// A device tensor copied back to the host as f64 (exact for f32 and bf16; waits for the GPU, so a
// failed kernel surfaces here at the latest).
inline OwnedTensor fetch(const Tensor& dev) {
  OwnedTensor h = OwnedTensor::of_shape(DType::f64, shape_of(dev));
  gpu::copy_convert(h, dev);
  return h;
}

// The GPU result `dev` (fetched here) against the f64 reference `ref`.
inline void expect_close_gpu(const Tensor& dev, const Tensor& ref, double tol, const std::string& what) {
  const OwnedTensor got = fetch(dev);
  const Worst w = compare(got, ref);
  INFO(what, ": ", w.str(), " (tolerance ", tol, ")");
  CHECK(w.rel <= tol);
}

// Two host tensors hold the same bytes (device tensors: expect_same_bits).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  CW_CHECK(a.device.is_cpu() && b.device.is_cpu(),
           "same_bits reads host memory: compare device tensors with expect_same_bits");
  return a.bytes() == b.bytes() && std::memcmp(a.data, b.data, a.bytes()) == 0;
}

// Two device tensors hold bitwise the same values, compared in their own dtype's bytes.
inline void expect_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  OwnedTensor ha = OwnedTensor::of_shape(a.dtype, shape_of(a)), hb = OwnedTensor::of_shape(b.dtype, shape_of(b));
  gpu::copy_convert(ha, a);
  gpu::copy_convert(hb, b);
  INFO(what);
  CHECK(same_bits(ha, hb));
}

// Sets cw::deterministic() for one scope and restores what it was.
struct DeterminismScope : SettingScope<bool> {
  explicit DeterminismScope(bool on) : SettingScope(cw::deterministic, cw::set_deterministic, on) {}
};

// Forces the attention kernel family (cw::set_attention_kernel) for one scope and restores the setting.
struct AttentionKernelScope : SettingScope<AttentionKernel> {
  explicit AttentionKernelScope(AttentionKernel k) : SettingScope(cw::attention_kernel, cw::set_attention_kernel, k) {}
};

}  // namespace cw::test
