#include "tools/train/sample.h"

#include "engine/random.h"
#include "model/chat_template.h"
#include "tools/model_io.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <numeric>

namespace cw {

namespace {
int32_t draw(std::vector<double> logits, const SampleOptions& o, int64_t usable, Rng& rng) {
  logits.resize(static_cast<size_t>(usable));  // ids past the tokenizer's vocabulary never come out
  if (o.temperature <= 0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = order.size();
  if (o.top_k > 0) keep = std::min(keep, static_cast<size_t>(o.top_k));
  const double m = logits[order[0]];
  std::vector<double> p(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += p[i] = std::exp((logits[order[i]] - m) / o.temperature);
  if (o.top_p < 1.0) {
    double acc = 0;
    for (size_t i = 0; i < keep; ++i) {
      acc += p[i] / sum;
      if (acc >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
    p.resize(keep);
    sum = std::accumulate(p.begin(), p.end(), 0.0);
  }
  double u = rng.uniform() * sum;
  for (size_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u <= 0) return order[i];
  }
  return order[keep - 1];
}

// The tokenizer's chat template as ChatML; fails for a tokenizer without one.
ChatMlTemplate chat_template_of(const Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(&tokenizer);
  if (!bpe)
    fail(fmt::format("--chat: the {} tokenizer has no chat template", tokenizer.kind()),
         "chat with a model whose tokenizer has one (a GGUF file, or tokenizer_config.json with chat_template)");
  return ChatMlTemplate::recognise(bpe->chat_template(), fmt::format("tokenizer '{}'", bpe->source()));
}

// The id of a ChatML marker, which must be one token of the tokenizer.
uint32_t marker_id(const Tokenizer& tokenizer, const char* marker) {
  const std::vector<uint32_t> ids = tokenizer.encode(marker);
  if (ids.size() != 1)
    fail(fmt::format("--chat: {} is not one token of the tokenizer (it encodes to {} ids)", marker, ids.size()),
         "the chat template is ChatML but the vocabulary lacks its special tokens; the two do not belong together");
  return ids[0];
}
}  // namespace

std::vector<uint32_t> prompt_ids(const Tokenizer& tokenizer, const SampleOptions& o) {
  if (o.chat) {
    const ChatMlTemplate chat = chat_template_of(tokenizer);
    marker_id(tokenizer, ChatMlTemplate::kStart);
    marker_id(tokenizer, ChatMlTemplate::kEnd);
    std::vector<ChatMessage> messages;
    if (o.system) messages.push_back({"system", *o.system});
    messages.push_back({"user", o.prompt});
    // A chat template spells out every special token itself: nothing is added in front.
    return tokenizer.encode(chat.render(messages, /*add_generation_prompt=*/true));
  }
  if (o.system) fail("--system is for a chat", "add --chat, or put the text into --prompt");
  std::vector<uint32_t> ids;
  if (tokenizer.add_bos() && tokenizer.bos_id()) ids.push_back(*tokenizer.bos_id());
  tokenizer.encode_into(o.prompt, ids);
  if (ids.empty())
    fail("the prompt is empty and the tokenizer puts no BOS in front of a text: there is nothing to continue",
         "give a prompt (--prompt TEXT, sample.prompt)");
  return ids;
}

std::vector<uint32_t> stop_ids(const Tokenizer& tokenizer, const LlamaConfig& config, bool chat) {
  std::vector<uint32_t> ids;
  if (tokenizer.eos_id()) ids.push_back(*tokenizer.eos_id());
  for (const int64_t id : config.eos_token_ids)
    if (id >= 0 && id < tokenizer.vocab_size()) ids.push_back(static_cast<uint32_t>(id));
  if (chat) ids.push_back(marker_id(tokenizer, ChatMlTemplate::kEnd));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

std::string read_prompt_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fmt::format("cannot read the prompt file '{}'", path), "check the path");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Decoder::Decoder(LlamaModel& model, int64_t capacity)
    : model_(model),
      kv_(model.config(), 1, capacity, model.dtype(), {.device = model.device()}),
      arena_(model.device()) {
  // The RoPE tables are the model's cache of positions, grown for the longest sequence asked.
  model.ensure_positions(capacity);
}

std::vector<double> Decoder::feed(std::span<const uint32_t> ids, int64_t chunk) {
  const int64_t n = static_cast<int64_t>(ids.size()), V = model_.config().vocab_size;
  CW_CHECK(n > 0, "Decoder::feed: no ids");
  CW_CHECK(position_ + n <= kv_.tokens(), "Decoder::feed: {} ids at position {} overrun the store's {} tokens", n,
           position_, kv_.tokens());
  const int64_t c = chunk > 0 ? chunk : n;
  std::vector<double> last(static_cast<size_t>(V));
  for (int64_t t0 = 0; t0 < n; t0 += c) {
    ArenaScope scope(arena_);
    const int64_t len = std::min(c, n - t0);
    OwnedTensor host_ids = OwnedTensor::of_shape(DType::i32, std::vector<int64_t>{len});
    for (int64_t i = 0; i < len; ++i) host_ids.tensor.ptr<int32_t>()[i] = static_cast<int32_t>(ids[t0 + i]);
    ChunkTokens tokens;
    tokens.B = 1;
    tokens.c = len;
    tokens.pos0 = position_;
    tokens.ids = arena_.alloc(DType::i32, {len});
    copy_convert(tokens.ids, host_ids.tensor);
    if (t0 + len < n) {
      // Not the last chunk: only its K/V are wanted, written into the store.
      forward_chunk(nullptr, kv_, model_, tokens, 1.0, false, arena_);
    } else {
      const Tensor logits = arena_.alloc(model_.dtype(), {1, V});
      chunk_logits(logits, kv_, model_, tokens, false, arena_);
      copy_convert(Tensor(last.data(), DType::f64, Device::host(), {1, V}), logits);
    }
    position_ += len;
  }
  return last;
}

Generation generate(LlamaModel& model, const Tokenizer& tokenizer, const SampleOptions& o) {
  return generate_from_ids(model, tokenizer, prompt_ids(tokenizer, o), o);
}

Generation generate_from_ids(LlamaModel& model, const Tokenizer& tokenizer, std::vector<uint32_t> prompt,
                             const SampleOptions& o) {
  const LlamaConfig& cf = model.config();
  // The callers check the pair with check_tokenizer_fits_model, naming both; here it is an invariant.
  CW_CHECK(tokenizer.vocab_size() <= cf.vocab_size, "tokenizer of {} ids for a model of vocab_size {}",
           tokenizer.vocab_size(), cf.vocab_size);
  Generation g;
  g.prompt = std::move(prompt);
  if (o.tokens <= 0) return g;
  const std::vector<uint32_t> stops = o.stop_at_eos ? stop_ids(tokenizer, cf, o.chat) : std::vector<uint32_t>{};
  Decoder decoder(model, static_cast<int64_t>(g.prompt.size()) + o.tokens);
  Rng rng(o.seed);
  const int64_t usable = std::min<int64_t>(cf.vocab_size, tokenizer.vocab_size());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<double> logits = decoder.feed(g.prompt, o.prefill_chunk);
  const auto t1 = std::chrono::steady_clock::now();
  g.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  for (int64_t n = 0; n < o.tokens; ++n) {
    const auto next = static_cast<uint32_t>(draw(std::move(logits), o, usable, rng));
    if (std::binary_search(stops.begin(), stops.end(), next)) {
      g.stopped = true;
      break;
    }
    g.generated.push_back(next);
    if (n + 1 < o.tokens) logits = decoder.feed(std::span<const uint32_t>(&next, 1), 1);
  }
  g.decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  g.text = tokenizer.decode(g.generated);
  if (dynamic_cast<const BpeTokenizer*>(&tokenizer)) g.text = replace_invalid_utf8(g.text);
  return g;
}

Generation sample_from(const ModelSource& source, const SampleOptions& o, Device device, DType dtype) {
  const LoadedModel m = load_model(source, device, dtype, {}, "sample from");
  return generate(*m.model, *m.tokenizer, o);
}

Generation sample_from_run(const std::string& dir, int64_t step, const SampleOptions& o,
                           const std::string& tokenizer_spec, Device device, DType dtype) {
  return sample_from({.run = dir, .step = step, .tokenizer = tokenizer_spec}, o, device, dtype);
}

Generation sample_from_model(const std::string& spec, const SampleOptions& o, const std::string& tokenizer_spec,
                             Device device, DType dtype) {
  return sample_from({.model = spec, .tokenizer = tokenizer_spec}, o, device, dtype);
}

}  // namespace cw
