#include "model/cp_group.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <algorithm>

namespace cw {

bool cp_splits_chunks(int64_t cp, int64_t seq, int64_t chunk, int64_t bwd_chunk) {
  const auto splits = [&](int64_t c) { return c <= 0 || c >= seq || c % cp == 0; };
  return seq % cp == 0 && splits(chunk) && splits(bwd_chunk);
}

LlamaConfig cp_attention_config(const LlamaConfig& c, int64_t cp) {
  if (cp < 1) fail(fmt::format("parallel.cp must be >= 1, got {}", cp));
  const char* hint = "pick a parallel.cp (--cp) that divides num_attention_heads, and that divides "
                     "num_key_value_heads or that it divides";
  if (c.num_attention_heads % cp != 0)
    fail(fmt::format("parallel.cp = {} does not divide num_attention_heads = {}: every rank attends whole heads", cp,
                     c.num_attention_heads),
         hint);
  if (c.num_key_value_heads % cp != 0 && cp % c.num_key_value_heads != 0)
    fail(fmt::format("parallel.cp = {} neither divides num_key_value_heads = {} nor is a multiple of it: a rank's "
                     "query heads must read whole K/V heads of their own",
                     cp, c.num_key_value_heads),
         hint);
  LlamaConfig s = c;
  s.num_attention_heads /= cp;
  s.num_key_value_heads = std::max<int64_t>(1, c.num_key_value_heads / cp);
  return s;
}

int64_t cp_rank_tokens(const ContextParallelGroup* cp, int64_t c) {
  if (!cp) return c;
  CW_CHECK_HINT(c % cp->size() == 0, "give a chunk length (and sequence length) that parallel.cp divides",
                "context parallelism over {} ranks: a chunk of {} tokens does not split into {} equal parts",
                cp->size(), c, cp->size());
  return c / cp->size();
}

}  // namespace cw
