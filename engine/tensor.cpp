#include "engine/tensor.h"

#include <fmt/format.h>

namespace cw {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f64: return "f64";
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "f64" || name == "float64") return DType::f64;
  if (name == "f32" || name == "float32") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  fail(fmt::format("unknown dtype '{}'", name), "use one of f64, f32, bf16");
}

std::string device_name(Device d) { return d.kind == Device::cpu ? "cpu" : fmt::format("cuda:{}", d.index); }

Tensor::Tensor(void* data_, DType dtype_, Device device_, std::initializer_list<int64_t> shape_list)
    : data(data_), dtype(dtype_), device(device_) {
  set_packed_shape(shape_list.begin(), shape_list.end());
}

int64_t Tensor::size(int dim) const {
  if (dim < 0) dim += ndim;
  CW_CHECK(dim >= 0 && dim < ndim, "dimension {} of a {}-d tensor", dim, ndim);
  return shape[dim];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool Tensor::contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

Tensor Tensor::slice(int dim, int64_t start, int64_t len) const {
  if (dim < 0) dim += ndim;
  CW_CHECK(dim >= 0 && dim < ndim, "slice of dimension {} of a {}-d tensor", dim, ndim);
  CW_CHECK(start >= 0 && len >= 0 && start + len <= shape[dim], "slice [{}, {}) of dimension {} of size {}",
           start, start + len, dim, shape[dim]);
  Tensor t = *this;
  t.data = static_cast<char*>(data) + static_cast<size_t>(start * stride[dim]) * dtype_size(dtype);
  t.shape[dim] = len;
  return t;
}

Tensor Tensor::view(std::initializer_list<int64_t> new_shape) const {
  CW_CHECK(contiguous(), "view of a non-contiguous tensor {}", describe());
  Tensor t(data, dtype, device, new_shape);
  CW_CHECK(t.numel() == numel(), "view {} of {} elements as {} elements", t.describe(), numel(), t.numel());
  return t;
}

Tensor Tensor::flat_rows() const {
  CW_CHECK(ndim >= 1, "flat_rows of a 0-d tensor");
  const int64_t cols = shape[ndim - 1];
  return view({cols == 0 ? 0 : numel() / cols, cols});
}

std::string Tensor::describe() const {
  std::string s = fmt::format("{} {} [", dtype_name(dtype), device_name(device));
  for (int d = 0; d < ndim; ++d) s += fmt::format("{}{}", d ? ", " : "", shape[d]);
  return s + "]";
}

void check_shape(const Tensor& t, std::initializer_list<int64_t> expected, const char* what) {
  bool ok = static_cast<int>(expected.size()) == t.ndim;
  int d = 0;
  for (int64_t e : expected) {
    if (ok && e >= 0 && t.shape[d] != e) ok = false;  // a negative entry matches any size
    ++d;
  }
  if (!ok) {
    std::string want = "[";
    d = 0;
    for (int64_t e : expected) want += fmt::format("{}{}", d++ ? ", " : "", e < 0 ? std::string("*") : std::to_string(e));
    ::cw::detail::raise("shape", __FILE__, __LINE__, fmt::format("{} has shape {}, expected {}]", what, t.describe(), want));
  }
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* what_a, const char* what_b) {
  bool ok = a.ndim == b.ndim;
  for (int d = 0; ok && d < a.ndim; ++d) ok = a.shape[d] == b.shape[d];
  CW_CHECK(ok, "{} {} and {} {} differ in shape", what_a, a.describe(), what_b, b.describe());
}

void check_dtype(const Tensor& t, DType expected, const char* what) {
  CW_CHECK(t.dtype == expected, "{} has dtype {}, expected {}", what, dtype_name(t.dtype), dtype_name(expected));
}

void check_contiguous(const Tensor& t, const char* what) {
  CW_CHECK(t.contiguous(), "{} {} must be contiguous", what, t.describe());
}

void check_same_device(const Tensor& a, const Tensor& b, const char* what_a, const char* what_b) {
  CW_CHECK(a.device == b.device, "{} is on {} but {} is on {}", what_a, device_name(a.device), what_b,
           device_name(b.device));
}

void check_same_device(std::initializer_list<NamedTensor> operands) {
  const NamedTensor& first = *operands.begin();
  for (const NamedTensor& o : operands)
    if (o.tensor != nullptr) check_same_device(*o.tensor, *first.tensor, o.name, first.name);
}

void check_packed_same_device(std::initializer_list<NamedTensor> operands) {
  for (const NamedTensor& o : operands) {
    if (o.tensor == nullptr) continue;
    CW_CHECK(o.tensor->defined(), "{} {} has no data", o.name, o.tensor->describe());
    check_contiguous(*o.tensor, o.name);
  }
  check_same_device(operands);
}

}  // namespace cw
