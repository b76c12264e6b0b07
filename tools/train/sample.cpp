#include "tools/train/sample.h"

#include "engine/random.h"
#include "model/checkpoint.h"
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
}  // namespace

std::string generate(const LlamaModel& model, const ByteTokenizer& tokenizer, const SampleOptions& o) {
  const LlamaConfig& cf = model.config();
  std::vector<uint32_t> ids{static_cast<uint32_t>(ByteTokenizer::kBos)};
  tokenizer.encode_into(o.prompt, ids);
  const int64_t total = static_cast<int64_t>(ids.size()) + o.tokens;
  const_cast<LlamaModel&>(model).ensure_positions(total);
  KVStore kv(cf, 1, total, model.dtype(), false);
  Arena arena;
  Rng rng(o.seed);
  const int64_t usable = std::min<int64_t>(cf.vocab_size, ByteTokenizer::kVocabSize);
  std::vector<uint32_t> generated;
  int64_t pos = 0;
  std::vector<uint32_t> pending = ids;
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
    const int32_t next = draw(std::move(lv), o, usable, rng);
    pos += c;
    if (o.stop_at_eos && next == ByteTokenizer::kEos) break;
    generated.push_back(static_cast<uint32_t>(next));
    pending = {static_cast<uint32_t>(next)};
  }
  return tokenizer.decode(generated);
}

std::string sample_from_run(const std::string& dir, int64_t step, const SampleOptions& o) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) fail(fmt::format("run directory '{}' does not exist", dir), "pass the --run-dir of a training run");
  RunDirectory rd(dir);
  std::optional<CheckpointRef> ref;
  std::vector<std::string> skipped;
  ref = step > 0 ? rd.find(step) : rd.latest_complete(&skipped);
  if (!ref)
    fail(step > 0 ? fmt::format("run '{}' has no complete checkpoint of step {}", dir, step)
                  : fmt::format("run '{}' has no complete checkpoint", dir),
         "train first, or pick a step that was saved");
  const ByteTokenizer tok = ByteTokenizer::from_file((fs::path(dir) / "tokenizer.json").string());
  if (fs::exists(fs::path(ref->path) / "adapter_config.json")) {
    // A LoRA run: its adapters on the base it trained on (model.source of the checkpoint's run.toml).
    const RunConfig rc = RunConfig::from_file((fs::path(ref->path) / "run.toml").string());
    LlamaConfig cf = LlamaConfig::resolve(rc.model.source);
    if (rc.model.tie_embeddings) cf.tie_word_embeddings = *rc.model.tie_embeddings;
    const LlamaModel model = load_with_adapter(cf, rc.model.source, ref->path, DType::f32, rc.model.init_seed);
    return generate(model, tok, o);
  }
  const LlamaConfig cf = LlamaConfig::from_file((fs::path(ref->path) / "config.json").string());
  LlamaModel model(cf, DType::f32);
  load_checkpoint_weights(model.params(), ref->path);
  return generate(model, tok, o);
}

}  // namespace cw
