#include "model/shard.h"

#include "engine/error.h"

#include <fmt/format.h>

namespace cw {

LlamaConfig tp_shard_config(const LlamaConfig& c, int64_t tp) {
  if (tp < 1) fail(fmt::format("parallel.tp must be >= 1, got {}", tp));
  auto divides = [&](int64_t value, const char* key) {
    if (value % tp != 0)
      fail(fmt::format("parallel.tp = {} does not divide {} = {}: every rank needs whole heads and an equal "
                       "share of the FFN",
                       tp, key, value),
           "pick a parallel.tp (--tp) that divides num_attention_heads, num_key_value_heads and intermediate_size");
  };
  divides(c.num_attention_heads, "num_attention_heads");
  divides(c.num_key_value_heads, "num_key_value_heads");
  divides(c.intermediate_size, "intermediate_size");
  LlamaConfig s = c;
  s.num_attention_heads /= tp;
  s.num_key_value_heads /= tp;
  s.intermediate_size /= tp;
  return s;
}

int64_t tp_rows(const TensorParallelGroup* tp, int64_t N) {
  if (!tp || !tp->sequence_parallel()) return N;
  if (N % tp->size() != 0)
    fail(fmt::format("sequence parallelism splits a chunk's {} tokens (batch x chunk length) over parallel.tp = {} "
                     "ranks, which does not divide them",
                     N, tp->size()),
         "choose --seq/--chunk/--bwd-chunk/--batch so that batch x every chunk's length is a multiple of parallel.tp, "
         "or turn parallel.sequence_parallel off");
  return N / tp->size();
}

Tensor tp_local_rows(const TensorParallelGroup* tp, const Tensor& all) {
  const int64_t rows = tp_rows(tp, all.size(0));
  return rows == all.size(0) ? all : all.slice(0, tp->rank() * rows, rows);
}

}  // namespace cw
