#include "engine/memory.h"

#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/env.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

namespace cw {

namespace {
constexpr size_t kAlign = kMemoryAlignBytes;  // one cache line; also what AVX-512 loads like
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Host buffers from this size on are anonymous mappings: the kernel hands them out zero-filled and
// page-aligned, and backs a page only when it is first touched. Zeroing them with memset instead
// would touch every page up front: an arena's 64 MiB first block costs ~16K page faults even when a
// tiny model uses a few kilobytes of it (the CPU test suite spent most of its time there).
constexpr size_t kMappedBytes = size_t(1) << 20;
bool mapped(size_t bytes) { return round_up(bytes) >= kMappedBytes; }
}  // namespace

Buffer::Buffer(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (!device.is_cpu()) {
    data_ = gpu::device_alloc(round_up(bytes), device.index);
    gpu::device_memset_zero(data_, round_up(bytes), device.index);
    return;
  }
  if (mapped(bytes)) {
    void* p = mmap(nullptr, round_up(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : p;
    // Transparent huge pages where the kernel has them: first touches, and page-locking for copies
    // (the offloaded optimizer's master and moments), fault a 512th as many pages.
    if (data_) madvise(data_, round_up(bytes), MADV_HUGEPAGE);
  } else {
    data_ = std::aligned_alloc(kAlign, round_up(bytes));
    if (data_) std::memset(data_, 0, round_up(bytes));
  }
  CW_CHECK_HINT(data_ != nullptr, "reduce the sequence length, batch or model size",
                "out of host memory allocating {} bytes", bytes);
}

Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), device_(o.device_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::release() {
  if (!data_) return;
  if (device_.is_cpu() && mapped(bytes_))
    munmap(data_, round_up(bytes_));
  else if (device_.is_cpu())
    std::free(data_);
  else
    gpu::device_free(data_, device_.index);
  data_ = nullptr;
}

Buffer::~Buffer() { release(); }

Tensor Buffer::as(DType dtype, std::initializer_list<int64_t> shape) const {
  Tensor t(data_, dtype, device_, shape);
  CW_CHECK(t.bytes() <= bytes_, "view {} needs {} bytes of a {}-byte buffer", t.describe(), t.bytes(), bytes_);
  return t;
}

OwnedTensor::OwnedTensor(DType dtype, std::initializer_list<int64_t> shape) {
  Tensor probe(nullptr, dtype, Device::host(), shape);
  buffer = HostBuffer(probe.bytes());
  tensor = Tensor(buffer.data(), dtype, Device::host(), shape);
}

OwnedTensor OwnedTensor::on(Device device, DType dtype, std::initializer_list<int64_t> shape) {
  OwnedTensor o;
  Tensor probe(nullptr, dtype, device, shape);
  o.buffer = Buffer(probe.bytes(), device);
  o.tensor = Tensor(o.buffer.data(), dtype, device, shape);
  return o;
}

Arena::Arena(size_t block_bytes, size_t max_bytes) : block_bytes_(block_bytes), max_bytes_(max_bytes) {}

Arena::Arena(Device device, size_t block_bytes, size_t max_bytes)
    : block_bytes_(block_bytes != 0 ? block_bytes : (device.is_cpu() ? kHostArenaBlockBytes : kDeviceArenaBlockBytes)),
      max_bytes_(max_bytes), device_(device) {}

bool arena_log() {
  static const bool on = env::flag(env::kArenaLog);
  return on;
}

std::string arena_block_line(size_t index, size_t block_bytes, size_t request, size_t lost, size_t in_use) {
  return fmt::format("arena block {}: {:.1f} MiB for a request of {:.2f} MiB ({:.2f} MiB of tails left unused "
                     "on the way; {:.1f} MiB in use before it)",
                     index, double(block_bytes) / double(1 << 20), double(request) / double(1 << 20),
                     double(lost) / double(1 << 20), double(in_use) / double(1 << 20));
}

void* Arena::alloc_bytes(size_t bytes) {
  const size_t need = round_up(bytes == 0 ? 1 : bytes);
  if (max_bytes_ != 0) {
    CW_CHECK_HINT(in_use_ + need <= max_bytes_, "plan a larger arena or use a smaller chunk",
                  "arena of {} bytes exhausted: {} in use, {} more requested", max_bytes_, in_use_, need);
  }
  // Move to the next block that can hold the request, adding one when none is left.
  const size_t in_use_before = in_use_;
  while (current_ < blocks_.size() && offset_ + need > blocks_[current_].bytes()) {
    in_use_ += blocks_[current_].bytes() - offset_;  // the tail of a block is lost until reset
    ++current_;
    offset_ = 0;
  }
  if (current_ == blocks_.size()) {
    blocks_.emplace_back(std::max(block_bytes_, need), device_);
    offset_ = 0;
    if (arena_log())
      fmt::print(stderr, "{}\n",
                 arena_block_line(blocks_.size() - 1, blocks_.back().bytes(), need, in_use_ - in_use_before, in_use_before));
  }
  void* p = static_cast<char*>(blocks_[current_].data()) + offset_;
  offset_ += need;
  in_use_ += need;
  if (in_use_ > high_water_) high_water_ = in_use_;
  return p;
}

Tensor Arena::alloc(DType dtype, std::initializer_list<int64_t> shape) {
  Tensor probe(nullptr, dtype, device_, shape);
  return Tensor(alloc_bytes(probe.bytes()), dtype, device_, shape);
}

void Arena::reset(const Mark& m) {
  CW_CHECK(m.in_use <= in_use_, "arena reset to a mark taken after the current state");
  current_ = m.block;
  offset_ = m.offset;
  in_use_ = m.in_use;
}

size_t Arena::reserved() const {
  size_t total = 0;
  for (const auto& b : blocks_) total += b.bytes();
  return total;
}

namespace {
template <class F> void for_each_index(const Tensor& t, F&& f) {
  // Visits every element offset (in elements) of a strided tensor in row-major order.
  if (t.numel() == 0) return;
  std::array<int64_t, Tensor::kMaxDims> idx{};
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.stride[d];
    f(i, off);
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

double load(const Tensor& t, int64_t off) {
  switch (t.dtype) {
    case DType::f64: return static_cast<const double*>(t.data)[off];
    case DType::f32: return static_cast<const float*>(t.data)[off];
    case DType::bf16: return static_cast<const bf16*>(t.data)[off].to_float();
    case DType::i32: return static_cast<const int32_t*>(t.data)[off];
  }
  return 0;
}

void store(const Tensor& t, int64_t off, double v) {
  switch (t.dtype) {
    case DType::f64: static_cast<double*>(t.data)[off] = v; break;
    // f64 -> f32 -> bf16: double rounding cannot differ from direct rounding here because every
    // bf16 source in the engine is at most f32-precise.
    case DType::f32: static_cast<float*>(t.data)[off] = static_cast<float>(v); break;
    case DType::bf16: static_cast<bf16*>(t.data)[off] = bf16::from_float(static_cast<float>(v)); break;
    case DType::i32: static_cast<int32_t*>(t.data)[off] = static_cast<int32_t>(v); break;
  }
}
}  // namespace

void fill(const Tensor& t, double value) {
  if (!t.device.is_cpu()) return gpu::fill(t, value);
  for_each_index(t, [&](int64_t, int64_t off) { store(t, off, value); });
}

void copy_convert(const Tensor& dst, const Tensor& src) {
  check_same_shape(dst, src, "copy destination", "copy source");
  if (!dst.device.is_cpu() || !src.device.is_cpu()) return gpu::copy_convert(dst, src);
  CW_CHECK((dst.dtype == DType::i32) == (src.dtype == DType::i32), "cannot convert {} to {}", dtype_name(src.dtype),
           dtype_name(dst.dtype));
  if (dst.dtype == src.dtype && dst.contiguous() && src.contiguous()) {
    std::memcpy(dst.data, src.data, dst.bytes());
    return;
  }
  // Two strided walks in the same row-major order; offsets of dst recomputed alongside.
  std::vector<int64_t> dst_offsets;
  dst_offsets.reserve(static_cast<size_t>(dst.numel()));
  for_each_index(dst, [&](int64_t, int64_t off) { dst_offsets.push_back(off); });
  for_each_index(src, [&](int64_t i, int64_t off) { store(dst, dst_offsets[static_cast<size_t>(i)], load(src, off)); });
}

Tensor head_columns(const Tensor& rows, int64_t col0, int64_t B, int64_t T, int64_t H, int64_t D) {
  CW_CHECK(rows.ndim == 2 && rows.contiguous() && rows.size(0) == B * T && col0 >= 0 && col0 + H * D <= rows.size(1),
           "head_columns: [{}, {}) of {} as [{}, {}, {}, {}] heads is not a column slice of packed rows", col0,
           col0 + H * D, rows.describe(), B, T, H, D);
  Tensor t = rows;
  t.data = static_cast<char*>(rows.data) + col0 * static_cast<int64_t>(dtype_size(rows.dtype));
  t.ndim = 4;
  t.shape = {B, T, H, D};
  t.stride = {T * rows.size(1), rows.size(1), D, 1};
  return t;
}

void copy_heads(const Tensor& dst, const Tensor& src) {
  check_same_shape(dst, src, "copy_heads destination", "copy_heads source");
  CW_CHECK(dst.ndim == 4, "copy_heads takes [B, T, H, D] heads, got {}", dst.describe());
  const int64_t B = dst.size(0), T = dst.size(1), W = dst.size(2) * dst.size(3);
  auto rows_of = [&](const Tensor& t, int64_t b) {
    CW_CHECK(t.stride[3] == 1 && t.stride[2] == t.size(3), "copy_heads: {} is not [B, T, H, D] with packed heads",
             t.describe());
    Tensor r = t.slice(0, b, 1);
    r.ndim = 2;
    r.shape = {T, W, 0, 0};
    r.stride = {t.stride[1], 1, 0, 0};
    return r;
  };
  for (int64_t b = 0; b < B; ++b) copy_convert(rows_of(dst, b), rows_of(src, b));
}

}  // namespace cw

namespace cw {
void scale_inplace(const Tensor& t, double factor) {
  if (!t.device.is_cpu()) return gpu::scale_inplace(t, factor);
  for_each_index(t, [&](int64_t, int64_t off) { store(t, off, load(t, off) * factor); });
}
}  // namespace cw

namespace cw {
double sum_squares(const Tensor& t) {
  check_contiguous(t, "sum_squares input");
  if (!t.device.is_cpu()) return gpu::sum_squares(t);
  double s = 0.0;
  const auto add = [&](auto* x) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double d = static_cast<double>(x[i]);
      s += d * d;
    }
  };
  switch (t.dtype) {
    case DType::f64: add(t.ptr<double>()); break;
    case DType::f32: add(t.ptr<float>()); break;
    case DType::bf16:
      for (int64_t i = 0; i < t.numel(); ++i) {
        const double d = static_cast<double>(t.ptr<bf16>()[i].to_float());
        s += d * d;
      }
      break;
    default: fail(fmt::format("sum_squares takes a float tensor, not {}", dtype_name(t.dtype)));
  }
  return s;
}
}  // namespace cw
