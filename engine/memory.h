// chunkwise engine: owning memory.
//
// HostBuffer owns one aligned host allocation. Arena hands out tensors from memory it owns by bump
// allocation; mark()/reset() release everything allocated after a mark (ArenaScope does it on
// scope exit). Ops never allocate: a layer or a schedule plans its buffers in an arena, and an op
// that needs scratch space takes an Arena and returns it as it found it. The arena records its
// high-water mark, which is how the tests show that SeCO's activation memory does not grow with the
// sequence length.
//
// On the CPU an arena grows by adding blocks (existing tensors never move); a fixed capacity can be
// set to make an over-plan an error instead.
#pragma once

#include "engine/tensor.h"

#include <cstddef>
#include <memory>
#include <vector>

namespace cw {

// One owning allocation, zero-filled: 64-byte aligned host memory (from 1 MiB on, an anonymous
// mapping whose pages the kernel zeroes when first touched), or device memory from the GPU's caching
// pool (engine/cuda/runtime.h).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes, Device device = Device::host());
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  // The whole buffer as a packed tensor of the given dtype and shape (element count must fit).
  Tensor as(DType dtype, std::initializer_list<int64_t> shape) const;

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_{};
};
using HostBuffer = Buffer;  // most owners are host buffers; the name says so where it matters

// A tensor together with the memory it views.
struct OwnedTensor {
  HostBuffer buffer;
  Tensor tensor;

  OwnedTensor() = default;
  OwnedTensor(DType dtype, std::initializer_list<int64_t> shape);
  static OwnedTensor on(Device device, DType dtype, std::initializer_list<int64_t> shape);
  template <class Container> static OwnedTensor of_shape(DType dtype, const Container& shape) {
    OwnedTensor o;
    int64_t n = 1;
    for (auto s : shape) n *= s;
    o.buffer = HostBuffer(static_cast<size_t>(n) * dtype_size(dtype));
    o.tensor = Tensor::packed(o.buffer.data(), dtype, Device::host(), shape);
    return o;
  }
  operator const Tensor&() const { return tensor; }
};

class Arena {
 public:
  struct Mark {
    size_t block = 0;
    size_t offset = 0;
    size_t in_use = 0;
  };

  // block_bytes: size of each block the arena adds; max_bytes: 0 = unbounded.
  explicit Arena(size_t block_bytes = size_t(64) << 20, size_t max_bytes = 0);
  // An arena of device memory (blocks from the GPU's caching pool).
  // block_bytes 0: 64 MiB on the host, 256 MiB on a GPU (a long chunk's [N, F] tensors are hundreds
  // of MiB, and a request that does not fit the current block's tail leaves that tail unused until
  // the next reset).
  explicit Arena(Device device, size_t block_bytes = 0, size_t max_bytes = 0);
  Device device() const { return device_; }

  Tensor alloc(DType dtype, std::initializer_list<int64_t> shape);
  void* alloc_bytes(size_t bytes);

  Mark mark() const { return {current_, offset_, in_use_}; }
  void reset(const Mark& m);

  size_t in_use() const { return in_use_; }          // bytes handed out and not yet released
  size_t high_water() const { return high_water_; }  // largest in_use() seen
  void reset_high_water() { high_water_ = in_use_; }
  size_t reserved() const;                           // bytes held from the system

 private:
  size_t block_bytes_, max_bytes_;
  Device device_{};
  std::vector<Buffer> blocks_;
  size_t current_ = 0, offset_ = 0, in_use_ = 0, high_water_ = 0;
};

// CW_ARENA_LOG=1: each block an arena adds is a line on stderr (arena_block_line: its index and size,
// the request that needed it, the block tails the request skipped, the bytes in use before it);
// `chunkwise plan` prints its replay's blocks the same way, so the two can be compared line by line.
bool arena_log();
std::string arena_block_line(size_t index, size_t block_bytes, size_t request, size_t lost, size_t in_use);

// Releases on scope exit everything the arena handed out inside the scope.
class ArenaScope {
 public:
  explicit ArenaScope(Arena& a) : arena_(a), mark_(a.mark()) {}
  ~ArenaScope() { arena_.reset(mark_); }
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  Arena& arena_;
  Arena::Mark mark_;
};

// Fills a tensor of any dtype with one value (used to poison outputs and zero accumulators).
// Host or device.
void fill(const Tensor& t, double value);
// Copies between tensors of the same shape, converting dtype (f64/f32/bf16; i32 only to i32).
// bf16 is rounded to nearest even. Host or device, either direction (device rules: runtime.h).
void copy_convert(const Tensor& dst, const Tensor& src);

// Columns [col0, col0 + H D) of `rows` [B T, P] as [B, T, H, D] heads with token stride P: a column
// slice of wider rows (the fused Q/K/V projection's q, k or v heads, model/layer.cpp), which RoPE
// takes as it is (engine/ops/rope.h).
Tensor head_columns(const Tensor& rows, int64_t col0, int64_t B, int64_t T, int64_t H, int64_t D);
// copy_convert of [B, T, H, D] heads one sequence at a time, as [T, H D] rows: for heads strided in
// their token dimension (head_columns) on one side and a K/V store's slice (strided by sequence) on
// the other; a GPU copy takes a stride in the first dimension only.
void copy_heads(const Tensor& dst, const Tensor& src);

}  // namespace cw

namespace cw {
// Multiplies every element of a (possibly strided) CPU tensor by factor.
void scale_inplace(const Tensor& t, double factor);
// The sum of squares of every element of a contiguous tensor (f64, f32 or bf16; host or device),
// accumulated in f64 in a fixed order, so the same input gives the same bits; a NaN or inf in the
// input shows in the result. Waits for a device result.
double sum_squares(const Tensor& t);
}  // namespace cw
