// Text generation with a K/V cache: `chunkwise sample` and the demo's closing sample.
//
// The prompt is encoded and run through the model as one chunk (positions [0, n)), filling the K/V
// store; then each new token is one chunk of length 1 at the next position, attending the cache.
// Sampling: logits of ids the tokenizer cannot produce are masked; temperature scales the rest;
// top-k keeps the k largest; top-p keeps the smallest set whose probability reaches p; a seeded Rng
// draws. temperature 0 is greedy.
#pragma once

#include "model/llama.h"
#include "tools/data/tokenizer.h"

#include <string>

namespace cw {

struct SampleOptions {
  std::string prompt = "The ";
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;      // 0: off
  double top_p = 0.95;     // 1: off
  uint64_t seed = 1;
  bool stop_at_eos = true;
};

// The generated continuation (without the prompt).
std::string generate(const LlamaModel& model, const ByteTokenizer& tokenizer, const SampleOptions& options);

// `chunkwise sample --run DIR [--step N]`: loads the checkpoint (latest complete, or step N).
std::string sample_from_run(const std::string& run_dir, int64_t step, const SampleOptions& options);

}  // namespace cw
