// Text generation with a K/V cache: `chunkwise sample` (from a run's checkpoint or from a model
// directly) and the closing sample of a training run.
//
// The prompt becomes ids (prompt_ids): as a chat, the tokenizer's ChatML template applied to it as
// the user's message (model/chat_template.h); otherwise BOS, where the tokenizer puts one in front
// of a text (Tokenizer::add_bos), and the prompt's ids. They run through the model in chunks of
// prefill_chunk tokens (positions [0, n)), each chunk attending the K/V store the chunks before it
// filled, so a prompt of 64K tokens needs one chunk's activations and the store, not 64K tokens'
// activations; then each new token is one chunk of length 1 at the next position, attending the
// cache. The store holds the prompt's n tokens and the `tokens` to come. Generation ends after
// `tokens` new ids or at a stop id: the tokenizer's EOS, the model config's eos_token_id(s) and, in
// a chat, <|im_end|>. A model on a GPU keeps its store and activations there.
// Sampling: logits of ids the tokenizer cannot produce (a padded vocabulary's extra rows) are
// masked; temperature scales the rest; top-k keeps the k largest; top-p keeps the smallest set
// whose probability reaches p; a seeded Rng draws. temperature 0 is greedy (the first largest
// logit), so its output depends only on the model and the prompt.
#pragma once

#include "model/llama.h"
#include "tools/data/tokenizer.h"
#include "tools/model_io.h"

#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cw {

struct SampleOptions {
  std::string prompt = "The ";
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;      // 0: off
  double top_p = 0.95;     // 1: off
  uint64_t seed = 1;
  bool stop_at_eos = true;
  bool chat = false;                  // the prompt is the user's message of a chat (ChatML)
  std::optional<std::string> system;  // chat: the system message (unset: the template's default, if any)
  int64_t prefill_chunk = 4096;       // prompt tokens a chunk of the prefill; 0: the whole prompt in one
};

// The text of a prompt file (`sample --prompt-file`), as it is: bytes, line ends and all. Fails
// naming the file when it cannot be read.
std::string read_prompt_file(const std::string& path);

// One sequence's decoding state: the model's K/V store for up to `capacity` tokens, filled as ids are
// fed at the next positions. feed runs the ids in chunks of at most `chunk` tokens (0: one chunk),
// each attending the store the chunks before it filled, and returns the logits of the last id fed
// (V values, f64, on the host). The model must outlive the decoder; its RoPE tables grow to
// `capacity` positions (LlamaModel::ensure_positions), the model's cache of positions.
class Decoder {
 public:
  Decoder(LlamaModel& model, int64_t capacity);
  std::vector<double> feed(std::span<const uint32_t> ids, int64_t chunk);
  int64_t position() const { return position_; }  // ids fed so far

 private:
  const LlamaModel& model_;
  KVStore kv_;
  Arena arena_;
  int64_t position_ = 0;
};

// The ids the model is given for options.prompt (see the header comment). Fails for a chat when the
// tokenizer has no ChatML template, and for an empty prompt without BOS (nothing to continue).
std::vector<uint32_t> prompt_ids(const Tokenizer& tokenizer, const SampleOptions& options);

// The ids that end generation (see the header comment), sorted, without repeats.
std::vector<uint32_t> stop_ids(const Tokenizer& tokenizer, const LlamaConfig& config, bool chat);

struct Generation {
  std::vector<uint32_t> prompt;     // the ids the model was given
  std::vector<uint32_t> generated;  // the new ids, without the stop id
  bool stopped = false;             // ended at a stop id rather than after options.tokens ids
  std::string text;                 // the new ids decoded (BPE: invalid UTF-8 replaced, as HF decodes)
  double prefill_seconds = 0;       // the prompt through the model (its logits on the host)
  double decode_seconds = 0;        // the new ids, one forward each
};

// The caller has checked that the tokenizer fits the model (check_tokenizer_fits_model). The model's
// RoPE tables grow to the prompt and the new tokens (Decoder).
Generation generate(LlamaModel& model, const Tokenizer& tokenizer, const SampleOptions& options);
// The same from prompt ids made by the caller (options.prompt is not read; options.chat only adds
// <|im_end|> to the stop ids).
Generation generate_from_ids(LlamaModel& model, const Tokenizer& tokenizer, std::vector<uint32_t> prompt,
                             const SampleOptions& options);

// `chunkwise sample`: the model of `source` (a run's checkpoint with the tokenizer the run recorded,
// or a model with weights: an HF checkpoint directory or a .gguf file; tools/model_io.h) loaded on
// `device` in `dtype` (the prefill and the K/V store there: a prompt of 64K tokens fits one GPU).
Generation sample_from(const ModelSource& source, const SampleOptions& options, Device device = Device::host(),
                       DType dtype = DType::f32);
// The same for `--run DIR [--step N]` (`tokenizer_spec` empty: the run's) and for `--model MODEL`.
Generation sample_from_run(const std::string& run_dir, int64_t step, const SampleOptions& options,
                           const std::string& tokenizer_spec = "", Device device = Device::host(),
                           DType dtype = DType::f32);
Generation sample_from_model(const std::string& model, const SampleOptions& options,
                             const std::string& tokenizer_spec = kModelTokenizer, Device device = Device::host(),
                             DType dtype = DType::f32);

}  // namespace cw
