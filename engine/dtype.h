// chunkwise engine: element types and devices.
//
// f64 is the exactness reference (CPU only), f32 the check precision, bf16 the GPU compute
// precision, i32 token ids and labels. bf16 is stored as its 16 raw bits; conversion from f32 rounds
// to nearest, ties to even, and keeps NaN a (quiet) NaN.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace cw {

enum class DType : uint8_t { f64, f32, bf16, i32 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: return 8;
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::i32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t);
// Parses "f64" / "float64", "f32" / "float32", "bf16" / "bfloat16"; throws naming the text otherwise.
DType parse_dtype(const std::string& name);

struct Device {
  enum Kind : uint8_t { cpu, cuda };
  Kind kind = cpu;
  int index = 0;

  static Device host() { return {cpu, 0}; }
  static Device gpu(int i = 0) { return {cuda, i}; }
  bool is_cpu() const { return kind == cpu; }
  bool operator==(const Device&) const = default;
};

std::string device_name(Device d);

// bfloat16: the upper 16 bits of an IEEE binary32.
struct bf16 {
  uint16_t bits = 0;

  static bf16 from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bf16 out;
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      out.bits = static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN stays NaN (quiet bit set)
      return out;
    }
    // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate.
    const uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    out.bits = static_cast<uint16_t>(u >> 16);
    return out;
  }
  float to_float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// The C++ type behind a dtype, for templated CPU kernels.
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }

// The precision statistics and accumulators use for a compute dtype: f64 stays f64, everything else
// accumulates in f32 (softmax log-sum-exp, RMS statistics, KV gradients, losses).
inline DType accum_dtype(DType compute) { return compute == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace cw
