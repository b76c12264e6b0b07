#include "tools/train/sample.h"

#include "engine/random.h"
#include "model/chat_template.h"
#include "model/checkpoint.h"
#include "model/gguf_llama.h"
#include "optim/schedule.h"
#include "tools/model_io.h"
#include "tools/train/run_config.h"
#include "tools/train/run_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

namespace cw {

namespace fs = std::filesystem;

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

Generation generate(const LlamaModel& model, const Tokenizer& tokenizer, const SampleOptions& o) {
  const LlamaConfig& cf = model.config();
  // The callers check the pair with check_tokenizer_fits_model, naming both; here it is an invariant.
  CW_CHECK(tokenizer.vocab_size() <= cf.vocab_size, "tokenizer of {} ids for a model of vocab_size {}",
           tokenizer.vocab_size(), cf.vocab_size);
  Generation g;
  g.prompt = prompt_ids(tokenizer, o);
  const std::vector<uint32_t> stops = o.stop_at_eos ? stop_ids(tokenizer, cf, o.chat) : std::vector<uint32_t>{};
  const int64_t total = static_cast<int64_t>(g.prompt.size()) + o.tokens;
  const_cast<LlamaModel&>(model).ensure_positions(total);
  KVStore kv(cf, 1, total, model.dtype(), false);
  Arena arena;
  Rng rng(o.seed);
  const int64_t usable = std::min<int64_t>(cf.vocab_size, tokenizer.vocab_size());
  int64_t pos = 0;
  std::vector<uint32_t> pending = g.prompt;
  for (int64_t n = 0; n < o.tokens; ++n) {
    ArenaScope scope(arena);
    const int64_t c = static_cast<int64_t>(pending.size());
    ChunkTokens chunk;
    chunk.B = 1;
    chunk.c = c;
    chunk.pos0 = pos;
    chunk.ids = arena.alloc(DType::i32, {c});
    for (int64_t i = 0; i < c; ++i) chunk.ids.ptr<int32_t>()[i] = static_cast<int32_t>(pending[static_cast<size_t>(i)]);
    OwnedTensor logits(model.dtype(), {1, cf.vocab_size});
    chunk_logits(logits, kv, model, chunk, false, arena);
    OwnedTensor l64(DType::f64, {1, cf.vocab_size});
    copy_convert(l64, logits);
    std::vector<double> lv(l64.tensor.ptr<double>(), l64.tensor.ptr<double>() + cf.vocab_size);
    const auto next = static_cast<uint32_t>(draw(std::move(lv), o, usable, rng));
    pos += c;
    if (std::binary_search(stops.begin(), stops.end(), next)) {
      g.stopped = true;
      break;
    }
    g.generated.push_back(next);
    pending = {next};
  }
  g.text = tokenizer.decode(g.generated);
  if (dynamic_cast<const BpeTokenizer*>(&tokenizer)) g.text = replace_invalid_utf8(g.text);
  return g;
}

Generation sample_from_run(const std::string& dir, int64_t step, const SampleOptions& o,
                           const std::string& tokenizer_spec) {
  if (!fs::is_directory(dir)) fail(fmt::format("run directory '{}' does not exist", dir), "pass the --run-dir of a training run");
  RunDirectory rd(dir);
  std::optional<CheckpointRef> ref;
  std::vector<std::string> skipped;
  ref = step > 0 ? rd.find(step) : rd.latest_complete(&skipped);
  if (!ref)
    fail(step > 0 ? fmt::format("run '{}' has no complete checkpoint of step {}", dir, step)
                  : fmt::format("run '{}' has no complete checkpoint", dir),
         "train first, or pick a step that was saved");
  // The run directory holds a copy of the tokenizer it was trained with (train.cpp writes it).
  const std::string spec = tokenizer_spec.empty() ? dir : resolve_tokenizer_spec(tokenizer_spec, ref->path, "--tokenizer");
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(spec);
  if (fs::exists(fs::path(ref->path) / "adapter_config.json")) {
    // A LoRA run: its adapters on the base it trained on (model.source of the checkpoint's run.toml).
    const RunConfig rc = RunConfig::from_file((fs::path(ref->path) / "run.toml").string());
    const LlamaConfig cf = rc.model_config();
    check_tokenizer_fits_model(*tokenizer, spec, cf.vocab_size, rc.model.source, "--tokenizer");
    const LlamaModel model = load_with_adapter(cf, rc.model.source, ref->path, DType::f32, rc.model.init_seed);
    return generate(model, *tokenizer, o);
  }
  const LlamaConfig cf = LlamaConfig::from_file((fs::path(ref->path) / "config.json").string());
  LlamaModel model(cf, DType::f32);
  load_checkpoint_weights(model.params(), ref->path);
  check_tokenizer_fits_model(*tokenizer, spec, cf.vocab_size, ref->path, "--tokenizer");
  return generate(model, *tokenizer, o);
}

Generation sample_from_model(const std::string& spec, const SampleOptions& o, const std::string& tokenizer_spec) {
  if (!is_gguf_file(spec) && !is_checkpoint_dir(spec))
    fail(fmt::format("--model '{}' has no weights to sample from (a preset or config.json is a random model)", spec),
         "give an HF checkpoint directory (config.json + model.safetensors) or a .gguf file");
  const LlamaConfig cf = LlamaConfig::resolve(spec);
  LlamaModel model(cf, DType::f32);
  if (is_gguf_file(spec))
    load_gguf_weights(model.params(), GgufReader(spec));
  else
    load_checkpoint_weights(model.params(), spec);
  const std::string resolved = resolve_tokenizer_spec(tokenizer_spec, spec, "--tokenizer");
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(resolved);
  check_tokenizer_fits_model(*tokenizer, resolved, cf.vocab_size, spec, "--tokenizer");
  return generate(model, *tokenizer, o);
}

}  // namespace cw
