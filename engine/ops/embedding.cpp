#include "engine/ops/embedding.h"

#include "engine/ops/cpu_common.h"

#include <cmath>
#include <cstring>

namespace cw {

namespace {
// The contract (engine/ops/embedding.h), checked once here for every backend; `rows` is out or d_out.
void check_operands(const Tensor& rows, const Tensor& ids, const Tensor& table, const char* what_rows,
                    const char* what_table) {
  CW_CHECK(ids.ndim == 1, "embedding ids must be [N], got {}", ids.describe());
  CW_CHECK(table.ndim == 2, "{} must be [V, C], got {}", what_table, table.describe());
  check_dtype(ids, DType::i32, "embedding ids");
  check_shape(rows, {ids.size(0), table.size(1)}, what_rows);
  check_packed_same_device({{table, what_table}, {rows, what_rows}, {ids, "embedding ids"}});
}

// Host ids only (the GPU's are validated by the caller before upload: engine/cuda/embedding.cu).
void check_ids(const Tensor& ids, int64_t vocab) {
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t n = 0; n < ids.numel(); ++n)
    CW_CHECK_HINT(id[n] >= 0 && id[n] < vocab, "check the tokenizer matches the model's vocab_size",
                  "embedding: token id {} at row {} is outside the vocabulary [0, {})", id[n], n, vocab);
}
}  // namespace

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table, double scale) {
  check_operands(out, ids, table, "embedding out", "embedding table");
  check_dtype(out, table.dtype, "embedding out");
  CW_CHECK(std::isfinite(scale), "embedding scale {} must be finite", scale);
  CW_DISPATCH_GPU(out, embedding_forward(out, ids, table, scale));
  const int64_t N = ids.numel(), C = table.size(1), V = table.size(0);
  check_ids(ids, V);
  const int32_t* id = ids.ptr<int32_t>();
  if (scale == 1.0) {  // a copy of the rows, whatever the dtype
    const size_t row_bytes = static_cast<size_t>(C) * dtype_size(table.dtype);
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(static_cast<char*>(out.data) + n * row_bytes,
                  static_cast<const char*>(table.data) + id[n] * row_bytes, row_bytes);
    return;
  }
  cpu::dispatch_float(table.dtype, "embedding_forward", [&](auto zero) {
    using T = decltype(zero);
    const T s = T(scale);
    for (int64_t n = 0; n < N; ++n) {
      const T* src = table.ptr<T>() + id[n] * C;
      T* dst = out.ptr<T>() + n * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = s * src[c];
    }
  });
}

void embedding_backward(const Tensor& d_table, const Tensor& d_out, const Tensor& ids, double scale) {
  check_operands(d_out, ids, d_table, "embedding d_out", "embedding d_table");
  check_dtype(d_table, accum_dtype(d_out.dtype), "embedding d_table");
  CW_CHECK(std::isfinite(scale), "embedding scale {} must be finite", scale);
  CW_DISPATCH_GPU(d_table, embedding_backward(d_table, d_out, ids, scale));
  const int64_t N = ids.numel(), C = d_table.size(1), V = d_table.size(0);
  check_ids(ids, V);
  cpu::dispatch_float(d_out.dtype, "embedding_backward", [&](auto zero) {
    using T = decltype(zero);
    const int32_t* id = ids.ptr<int32_t>();
    const T s = T(scale);
    for (int64_t n = 0; n < N; ++n) {
      T* dst = d_table.ptr<T>() + id[n] * C;
      const T* src = d_out.ptr<T>() + n * C;
      for (int64_t c = 0; c < C; ++c) dst[c] += s * src[c];
    }
  });
}

}  // namespace cw
