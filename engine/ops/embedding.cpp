#include "engine/ops/embedding.h"

#include "engine/ops/cpu_common.h"

#include <cstring>

namespace cw {

namespace {
void check_ids(const Tensor& ids, int64_t vocab) {
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t n = 0; n < ids.numel(); ++n)
    CW_CHECK_HINT(id[n] >= 0 && id[n] < vocab, "check the tokenizer matches the model's vocab_size",
                  "token id {} at row {} is outside the vocabulary [0, {})", id[n], n, vocab);
}
}  // namespace

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table) {
  CW_DISPATCH_GPU(out, embedding_forward(out, ids, table));
  const int64_t N = ids.numel(), C = table.size(1), V = table.size(0);
  check_shape(ids, {N}, "embedding ids");
  check_dtype(ids, DType::i32, "embedding ids");
  check_shape(out, {N, C}, "embedding out");
  check_dtype(out, table.dtype, "embedding out");
  for (const Tensor* t : {&out, &ids, &table}) check_contiguous(*t, "embedding operand");
  cpu::check_cpu(out, "embedding out");
  check_ids(ids, V);
  const size_t row_bytes = static_cast<size_t>(C) * dtype_size(table.dtype);
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(static_cast<char*>(out.data) + n * row_bytes, static_cast<const char*>(table.data) + id[n] * row_bytes,
                row_bytes);
}

void embedding_backward(const Tensor& d_table, const Tensor& d_out, const Tensor& ids) {
  CW_DISPATCH_GPU(d_table, embedding_backward(d_table, d_out, ids));
  const int64_t N = ids.numel(), C = d_table.size(1), V = d_table.size(0);
  check_shape(d_out, {N, C}, "embedding d_out");
  check_dtype(ids, DType::i32, "embedding ids");
  check_dtype(d_out, d_table.dtype, "embedding d_out");
  for (const Tensor* t : {&d_table, &d_out, &ids}) check_contiguous(*t, "embedding operand");
  cpu::check_cpu(d_table, "embedding d_table");
  check_ids(ids, V);
  cpu::dispatch_float(d_table.dtype, "embedding_backward", [&](auto zero) {
    using T = decltype(zero);
    const int32_t* id = ids.ptr<int32_t>();
    for (int64_t n = 0; n < N; ++n) {
      T* dst = d_table.ptr<T>() + id[n] * C;
      const T* src = d_out.ptr<T>() + n * C;
      for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
    }
  });
}

}  // namespace cw
