#include "engine/random.h"

#include <cmath>
#include <numbers>

namespace cw {

double uniform01(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = mix64(mix64(seed ^ mix64(stream)) ^ index);
  return (static_cast<double>(h >> 11) + 0.5) * 0x1.0p-53;  // 53 random bits, centred: in (0, 1)
}

double normal01(uint64_t seed, uint64_t stream, uint64_t index) {
  const double u1 = uniform01(seed, stream, 2 * index);
  const double u2 = uniform01(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

namespace {
template <class F> void fill_with(const Tensor& t, F&& value) {
  CW_CHECK(t.device.is_cpu(), "random fill of a {} tensor: fill on the host and copy", device_name(t.device));
  check_contiguous(t, "random fill target");
  const int64_t n = t.numel();
  // Element i depends on (seed, stream, i) alone, so the threads give the one-thread bits; an 8B
  // model's 8e9 draws take minutes on one core.
  constexpr int64_t kWorthThreads = 1 << 16;
  const auto fill_as = [&](auto* p, auto convert) {
#pragma omp parallel for schedule(static) if (n >= kWorthThreads)
    for (int64_t i = 0; i < n; ++i) p[i] = convert(value(i));
  };
  switch (t.dtype) {
    case DType::f64: return fill_as(t.ptr<double>(), [](double x) { return x; });
    case DType::f32: return fill_as(t.ptr<float>(), [](double x) { return static_cast<float>(x); });
    case DType::bf16: return fill_as(t.ptr<bf16>(), [](double x) { return bf16::from_float(static_cast<float>(x)); });
    case DType::i32: fail("random fill of an i32 tensor", "use Rng::below for ids");
  }
}
}  // namespace

void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std) {
  fill_with(t, [&](int64_t i) { return mean + std * normal01(seed, stream, static_cast<uint64_t>(i)); });
}

void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi) {
  fill_with(t, [&](int64_t i) { return lo + (hi - lo) * uniform01(seed, stream, static_cast<uint64_t>(i)); });
}

uint64_t Rng::below(uint64_t n) {
  CW_CHECK(n > 0, "Rng::below(0)");
  // Rejection sampling keeps the choice exactly uniform.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = next_u64();
  while (x >= limit);
  return x % n;
}

}  // namespace cw
