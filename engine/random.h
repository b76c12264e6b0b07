// chunkwise engine: seeded, order-independent random numbers.
//
// Counter-based: the value at (seed, stream, index) is a pure function of the three, so a parameter
// tensor is initialised the same whatever order tensors are visited in, on any device, and a test's
// random inputs do not depend on what ran before. splitmix64 mixing; normals by Box-Muller from two
// uniforms.
#pragma once

#include "engine/tensor.h"

#include <cstdint>

// A function compiled for the host and, in CUDA sources, for the device too: the same bits on both.
#if defined(__CUDACC__)
#define CW_HOST_DEVICE __host__ __device__
#else
#define CW_HOST_DEVICE
#endif

namespace cw {

// splitmix64's finaliser: a bijection of 64-bit words whose every output bit depends on every input
// bit. Inline for host and device, so a GPU kernel hashes exactly as the CPU does (LoRA's dropout
// masks, engine/ops/lora_linear.h).
CW_HOST_DEVICE inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in (0, 1), never exactly 0 or 1.
double uniform01(uint64_t seed, uint64_t stream, uint64_t index);
double normal01(uint64_t seed, uint64_t stream, uint64_t index);

// Fills a CPU tensor (f64/f32/bf16) with mean + std * N(0,1), element i from (seed, stream, i).
void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean = 0.0, double std = 1.0);
// Fills with uniform values in [lo, hi).
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi);

// A small sequential generator for choices (SpaCO's chunk sample, data shuffling). Its whole state
// is one 64-bit counter, so it can be saved in a checkpoint and restored exactly.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : seed_(seed) {}
  uint64_t next_u64() { return mix64(seed_ ^ mix64(counter_++)); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n);
  double uniform() { return uniform01(seed_, 0x5eed, counter_++); }
  uint64_t counter() const { return counter_; }
  void set_counter(uint64_t c) { counter_ = c; }
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_, counter_ = 0;
};

}  // namespace cw
