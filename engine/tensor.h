// chunkwise engine: the Tensor view.
//
// A Tensor never owns memory: it is a data pointer, a dtype, a device, up to four dimensions and
// their strides in elements. Memory is owned by buffers and arenas (engine/memory.h). Views are
// cheap to copy and pass by value. Ops require contiguous tensors unless their header says
// otherwise (attention accepts K/V whose batch stride is larger than a packed one, so a slice of
// the K/V store can be passed without a copy).
#pragma once

#include "engine/dtype.h"
#include "engine/error.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace cw {

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  Tensor() = default;
  // A packed (row-major contiguous) view of `data`.
  Tensor(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  template <class Container>
  static Tensor packed(void* data, DType dtype, Device device, const Container& shape_list) {
    Tensor t;
    t.data = data;
    t.dtype = dtype;
    t.device = device;
    t.set_packed_shape(shape_list.begin(), shape_list.end());
    return t;
  }

  int64_t size(int dim) const;
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool contiguous() const;
  bool defined() const { return data != nullptr || numel() == 0; }
  bool empty() const { return numel() == 0; }

  // The typed pointer; throws if T does not match the dtype.
  template <class T> T* ptr() const {
    CW_CHECK(dtype == dtype_of<T>(), "tensor of dtype {} read as {}", dtype_name(dtype), dtype_name(dtype_of<T>()));
    return static_cast<T*>(data);
  }

  // [start, start+len) along dim; strides unchanged.
  Tensor slice(int dim, int64_t start, int64_t len) const;
  // A packed view with a new shape of the same element count (requires contiguous).
  Tensor view(std::initializer_list<int64_t> new_shape) const;
  // Collapses all leading dimensions: [a, b, ..., z] -> [a*b*..., z] (requires contiguous).
  Tensor flat_rows() const;

  std::string describe() const;  // "f32 cpu [2, 16, 64]"

 private:
  template <class It> void set_packed_shape(It begin, It end) {
    ndim = 0;
    for (It it = begin; it != end; ++it) {
      CW_CHECK(ndim < kMaxDims, "at most {} dimensions", kMaxDims);
      CW_CHECK(*it >= 0, "negative dimension {}", static_cast<int64_t>(*it));
      shape[ndim++] = static_cast<int64_t>(*it);
    }
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      stride[d] = s;
      s *= shape[d];
    }
  }
};

// Checks used at every public op entry (they stay on in release builds).
void check_shape(const Tensor& t, std::initializer_list<int64_t> expected, const char* what);
void check_same_shape(const Tensor& a, const Tensor& b, const char* what_a, const char* what_b);
void check_dtype(const Tensor& t, DType expected, const char* what);
void check_contiguous(const Tensor& t, const char* what);
void check_same_device(const Tensor& a, const Tensor& b, const char* what_a, const char* what_b);

// An op's operand in the list checks below: the tensor and its name in messages ("rmsnorm weight").
// A null tensor is an optional operand the call does not pass (a skipped gradient): it is skipped.
struct NamedTensor {
  const Tensor* tensor;
  const char* name;
  NamedTensor(const Tensor& t, const char* n) : tensor(&t), name(n) {}
  NamedTensor(const Tensor* t, const char* n) : tensor(t), name(n) {}
  // An optional operand: given when it has data (a Tensor{} passed for a gradient not wanted is not).
  static NamedTensor optional(const Tensor& t, const char* n) { return {t.data != nullptr ? &t : nullptr, n}; }
};
// Every operand on the device of the first (which must be given): what lets an op entry dispatch on
// one tensor's device.
void check_same_device(std::initializer_list<NamedTensor> operands);
// Every operand with its data (a pointer, or no elements), contiguous, and on the device of the first.
void check_packed_same_device(std::initializer_list<NamedTensor> operands);

// How an op writes an input gradient: overwrite the buffer, or add into it (the residual stream,
// and any gradient that several consumers feed). Parameter gradients always accumulate.
enum class GradMode : uint8_t { overwrite, accumulate };

}  // namespace cw
