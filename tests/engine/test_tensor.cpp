// Tensor views, arenas, bf16 rounding, the error type.
#include "engine/error.h"
#include "engine/memory.h"
#include "engine/random.h"
#include "engine/tensor.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>

using namespace cw;

TEST_CASE("tensor views: shape, strides, slices, checks") {
  OwnedTensor t(DType::f32, {2, 3, 4});
  CHECK(t.tensor.numel() == 24);
  CHECK(t.tensor.contiguous());
  CHECK(t.tensor.stride[0] == 12);
  Tensor s = t.tensor.slice(1, 1, 2);
  CHECK(s.shape[1] == 2);
  CHECK_FALSE(s.contiguous());
  CHECK(static_cast<float*>(s.data) == t.tensor.ptr<float>() + 4);
  CHECK(t.tensor.view({6, 4}).size(0) == 6);
  CHECK_THROWS_AS(t.tensor.view({5, 4}), Error);
  CHECK_THROWS_AS(s.view({8}), Error);
  CHECK_THROWS_AS(t.tensor.ptr<double>(), Error);
  CHECK_THROWS_AS(t.tensor.slice(2, 3, 2), Error);
  CHECK_THROWS_AS(check_shape(t, {2, 3, 5}, "x"), Error);
  CHECK_NOTHROW(check_shape(t, {2, -1, 4}, "x"));
}

TEST_CASE("errors carry the expression, the place and the hint") {
  try {
    CW_CHECK_HINT(1 + 1 == 3, "do better arithmetic", "sum was {}", 2);
    FAIL("no throw");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("sum was 2") != std::string::npos);
    CHECK(what.find("1 + 1 == 3") != std::string::npos);
    CHECK(what.find("test_tensor.cpp") != std::string::npos);
    CHECK(what.find("do better arithmetic") != std::string::npos);
  }
}

TEST_CASE("arena: bump allocation, reset, high-water mark") {
  Arena a(1024);
  const size_t before = a.in_use();
  {
    ArenaScope scope(a);
    Tensor x = a.alloc(DType::f64, {10});
    Tensor y = a.alloc(DType::f32, {300});  // needs a second block
    CHECK(x.data != y.data);
    CHECK(a.in_use() >= 80 + 1200);
  }
  CHECK(a.in_use() == before);
  CHECK(a.high_water() >= 1280);
  a.reset_high_water();
  CHECK(a.high_water() == a.in_use());
  Arena bounded(1024, 512);
  CHECK_THROWS_AS(bounded.alloc(DType::f64, {100}), Error);
}

TEST_CASE("bf16 conversion rounds to nearest even and keeps specials") {
  CHECK(bf16::from_float(1.0f).bits == 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(bf16::from_float(1.0f + 0x1.0p-8f).bits == 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  CHECK(bf16::from_float(1.0f + 3 * 0x1.0p-8f).bits == 0x3f82);
  CHECK(bf16::from_float(1.0f + 0x1.0p-8f + 0x1.0p-20f).bits == 0x3f81);  // above halfway: up
  CHECK(bf16::from_float(-2.5f).to_float() == -2.5f);
  CHECK(std::isinf(bf16::from_float(std::numeric_limits<float>::infinity()).to_float()));
  CHECK(std::isnan(bf16::from_float(std::numeric_limits<float>::quiet_NaN()).to_float()));
  CHECK(std::isnan(bf16::from_float(std::bit_cast<float>(0x7f800001u)).to_float()));  // signalling NaN stays NaN
  // The largest finite float rounds to infinity, as IEEE round-to-nearest demands.
  CHECK(std::isinf(bf16::from_float(std::numeric_limits<float>::max()).to_float()));
  OwnedTensor f(DType::f32, {3}), b(DType::bf16, {3}), back(DType::f32, {3});
  f.tensor.ptr<float>()[0] = 3.14159f;
  f.tensor.ptr<float>()[1] = -1e-3f;
  f.tensor.ptr<float>()[2] = 65504.f;
  copy_convert(b, f);
  copy_convert(back, b);
  for (int i = 0; i < 3; ++i)
    CHECK(std::abs(back.tensor.ptr<float>()[i] - f.tensor.ptr<float>()[i]) <= std::abs(f.tensor.ptr<float>()[i]) * 0x1.0p-8f);
}

TEST_CASE("random numbers are order-independent and roughly normal") {
  CHECK(normal01(1, 2, 3) == normal01(1, 2, 3));
  CHECK(normal01(1, 2, 3) != normal01(1, 2, 4));
  double sum = 0, sum_sq = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const double z = normal01(7, 0, static_cast<uint64_t>(i));
    sum += z;
    sum_sq += z * z;
  }
  CHECK(std::abs(sum / n) < 0.05);
  CHECK(std::abs(sum_sq / n - 1.0) < 0.05);
  Rng r(3);
  int counts[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4000; ++i) counts[r.below(4)]++;
  for (int c : counts) CHECK(std::abs(c - 1000) < 150);
}

TEST_CASE("random fills on threads give element i the value (seed, stream, i) names, in every dtype") {
  const int64_t n = (1 << 17) + 3;  // above the threads' threshold, not a multiple of any thread count
  const OwnedTensor d(DType::f64, {n}), f(DType::f32, {n}), b(DType::bf16, {n});
  for (const Tensor& t : {d.tensor, f.tensor, b.tensor}) fill_normal(t, 11, 4, 0.5, 2.0);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double z = 0.5 + 2.0 * normal01(11, 4, static_cast<uint64_t>(i));
    wrong += d.tensor.ptr<double>()[i] != z;
    wrong += f.tensor.ptr<float>()[i] != static_cast<float>(z);
    wrong += b.tensor.ptr<bf16>()[i].bits != bf16::from_float(static_cast<float>(z)).bits;
  }
  CHECK(wrong == 0);
}
