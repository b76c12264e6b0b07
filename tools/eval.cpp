#include "tools/eval.h"

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/random.h"
#include "optim/chunks.h"
#include "tools/bench_chart.h"
#include "tools/data/batches.h"
#include "tools/data/tokenizer.h"
#include "tools/progress.h"
#include "tools/train/run_dir.h"
#include "tools/train/sample.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>

namespace cw {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr const char* kLossByPosition = "loss-by-position";
constexpr const char* kPasskey = "passkey";

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// "[1K, 4K)": a bucket's positions.
std::string bucket_name(const PositionBucket& b) {
  return fmt::format("[{}, {})", b.lo == 0 ? "0" : token_label(double(b.lo)), token_label(double(b.hi)));
}
}  // namespace

std::vector<int64_t> parse_token_counts(const std::string& list, const std::string& flag) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    std::string item = list.substr(at, comma - at);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    int64_t scale = 1;
    if (!item.empty() && (item.back() == 'K' || item.back() == 'k')) scale = 1024, item.pop_back();
    else if (!item.empty() && (item.back() == 'M' || item.back() == 'm')) scale = 1024 * 1024, item.pop_back();
    const bool digits = !item.empty() && item.size() <= 12 && item.find_first_not_of("0123456789") == std::string::npos;
    const int64_t n = digits ? std::stoll(item) * scale : 0;
    if (n <= 0)
      fail(fmt::format("{} '{}': '{}' is not a token count", flag, list, list.substr(at, comma - at)),
           "give positive integers with an optional K (x 1024) or M, separated by commas, e.g. 1K,4K,16K");
    if (!out.empty() && n <= out.back())
      fail(fmt::format("{} '{}': {} does not come after {}", flag, list, n, out.back()),
           "list the counts in ascending order");
    out.push_back(n);
    at = comma + 1;
  }
  return out;
}

// ---- loss by position ----

double PositionBucket::mean_loss() const { return tokens > 0 ? loss_sum / static_cast<double>(tokens) : kNaN; }

std::vector<PositionBucket> position_buckets(const std::vector<int64_t>& edges, int64_t T) {
  CW_CHECK(T > 0, "position_buckets: T = {}", T);
  std::vector<PositionBucket> buckets;
  int64_t lo = 0;
  for (const int64_t e : edges) {
    CW_CHECK(e > lo, "position_buckets: edges must be positive and ascending ({} after {})", e, lo);
    buckets.push_back({lo, std::min(e, T)});
    lo = e;
    if (lo >= T) return buckets;
  }
  buckets.push_back({lo, T});  // the positions past the last edge
  return buckets;
}

void add_window(std::vector<PositionBucket>& buckets, std::span<const double> losses) {
  CW_CHECK(!buckets.empty() && static_cast<int64_t>(losses.size()) == buckets.back().hi,
           "add_window: {} losses for buckets of {} positions", losses.size(), buckets.empty() ? 0 : buckets.back().hi);
  for (PositionBucket& b : buckets) {
    for (int64_t t = b.lo; t < b.hi; ++t) b.loss_sum += losses[static_cast<size_t>(t)];
    b.tokens += b.hi - b.lo;
  }
}

void add_window(std::vector<PositionBucket>& buckets, const WindowLosses& w, int64_t min_document) {
  if (w.doc_starts.empty()) return add_window(buckets, w.losses);
  const int64_t T = static_cast<int64_t>(w.losses.size());
  for (size_t d = 0; d < w.doc_starts.size(); ++d) {
    const int64_t begin = w.doc_starts[d], end = d + 1 < w.doc_starts.size() ? w.doc_starts[d + 1] : T;
    if (end - begin < min_document) continue;
    // A document's last position predicts the next document's first token: no loss there.
    const int64_t counted = end - (d + 1 < w.doc_starts.size() || w.last_target_opens_document ? 1 : 0);
    for (int64_t t = begin; t < counted; ++t) {
      const int64_t position = t - begin;  // in its own document
      for (PositionBucket& b : buckets)
        if (position >= b.lo && position < b.hi) b.loss_sum += w.losses[static_cast<size_t>(t)], ++b.tokens;
    }
  }
}

std::vector<int64_t> window_starts(const TokenDataset& data, int64_t T, bool documents, int64_t limit,
                                   int64_t min_document) {
  const int64_t n = data.size();
  std::vector<int64_t> starts;
  const auto full = [&] { return limit > 0 && static_cast<int64_t>(starts.size()) >= limit; };
  if (!documents) {
    for (int64_t s = 0; s + T < n && !full(); s += T) starts.push_back(s);
    if (starts.empty())
      fail(fmt::format("{} holds {} tokens: not one window of --seq {} + 1", data.describe(), n, T),
           "lower --seq, or give more data");
    return starts;
  }
  CW_CHECK(data.shared_flags(), "window_starts: documents from token data opened without its flags");
  const std::vector<uint8_t>& flags = *data.shared_flags();
  // Every document start with T+1 tokens after it, with its document's length.
  std::vector<std::pair<int64_t, int64_t>> candidates;  // (start, length)
  for (int64_t s = 0; s < n; ++s) {
    if (!(flags[static_cast<size_t>(s)] & kFlagDocStart)) continue;
    if (!candidates.empty() && candidates.back().second < 0) candidates.back().second = s - candidates.back().first;
    candidates.push_back({s, -1});
  }
  if (!candidates.empty() && candidates.back().second < 0) candidates.back().second = n - candidates.back().first;
  std::erase_if(candidates, [&](const auto& c) { return c.first + T >= n || c.second < min_document; });
  // The longest documents first, so that the deep positions are filled: a document shorter than T
  // leaves the window's rest to the documents after it, each counted at its own positions.
  std::stable_sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& [s, length] : candidates) {
    if (full()) break;
    const bool overlaps = std::any_of(starts.begin(), starts.end(), [&](int64_t a) { return std::abs(a - s) < T; });
    if (!overlaps) starts.push_back(s);
  }
  std::sort(starts.begin(), starts.end());
  if (starts.empty() && min_document > 0)
    fail(fmt::format("{}: no document of --min-document {} tokens with --seq {} + 1 tokens after its start",
                     data.describe(), min_document, T),
         "lower --min-document, or give longer documents");
  if (starts.empty())
    fail(fmt::format("{}: no document start with --seq {} + 1 tokens after it", data.describe(), T),
         "lower --seq, or check --bos-token (the token before each document where the data stores no starts)");
  return starts;
}

std::vector<double> window_losses(LlamaModel& model, std::span<const uint32_t> window, int64_t chunk,
                                  KVStore& kv, Arena& arena, const std::function<void(int64_t, int64_t)>& chunk_done) {
  return window_losses(model, window, chunk, kv, arena, {}, chunk_done).losses;
}

WindowLosses window_losses(LlamaModel& model, std::span<const uint32_t> window, int64_t chunk, KVStore& kv,
                           Arena& arena, std::span<const uint8_t> flags,
                           const std::function<void(int64_t, int64_t)>& chunk_done) {
  const int64_t T = static_cast<int64_t>(window.size()) - 1;
  CW_CHECK(T > 0 && kv.batch() == 1 && kv.tokens() == T, "window_losses: a window of {} ids for a store of {} x {}",
           window.size(), kv.batch(), kv.tokens());
  model.ensure_positions(T);
  Batch batch = window_batch(std::vector<uint32_t>(window.begin(), window.end()), 1, T);
  WindowLosses w;
  if (!flags.empty()) {  // each document attends only itself, its positions from 0 (docs/packed_documents.md)
    CW_CHECK(flags.size() == window.size(), "window_losses: {} flags for a window of {} ids", flags.size(), window.size());
    w.doc_starts.push_back(0);  // the window's first token opens a document
    for (int64_t t = 1; t < T; ++t)
      if (flags[static_cast<size_t>(t)] & kFlagDocStart) w.doc_starts.push_back(t);
    w.last_target_opens_document = flags[static_cast<size_t>(T)] & kFlagDocStart;
    set_documents(batch, {w.doc_starts});
  }
  ArenaScope scope(arena);
  // Normaliser 1: a row's loss is its token's own, in nats.
  LossRows rows(arena, T);
  kv.reset();
  prefill(kv, model, step_tokens(batch, arena), chunk_bounds(T, chunk), 1.0, true, arena, 1, chunk_done, &rows);
  w.losses = rows.values();
  return w;
}

double LossByPositionResult::mean_loss() const {
  double sum = 0;
  int64_t tokens = 0;
  for (const PositionBucket& b : buckets) sum += b.loss_sum, tokens += b.tokens;
  return tokens > 0 ? sum / static_cast<double>(tokens) : kNaN;
}

LossByPositionResult loss_by_position(LlamaModel& model, const std::vector<uint32_t>& tokens,
                                      const std::vector<int64_t>& starts, int64_t T, const std::vector<int64_t>& edges,
                                      int64_t chunk, std::ostream& log, const std::vector<uint8_t>* flags,
                                      int64_t min_document) {
  LossByPositionResult r;
  r.seq = T;
  r.min_document = min_document;
  r.chunk = chunk;
  r.windows = static_cast<int64_t>(starts.size());
  r.device = device_name(model.device());
  r.dtype = dtype_name(model.dtype());
  r.buckets = position_buckets(edges, T);
  model.ensure_positions(T);
  KVStore kv(model.config(), 1, T, model.dtype(), {.device = model.device()});
  Arena arena(model.device());
  StepProgress progress(log, &log == &std::cout && isatty(STDOUT_FILENO), 10, 30, "window");
  const Clock::time_point t0 = Clock::now();
  double last_line = -1;
  for (size_t w = 0; w < starts.size(); ++w) {
    const int64_t s = starts[w];
    CW_CHECK(s >= 0 && s + T < static_cast<int64_t>(tokens.size()), "loss_by_position: window at {} past the {} tokens",
             s, tokens.size());
    progress.start(static_cast<int64_t>(w) + 1, r.windows);
    const WindowLosses window =
        window_losses(model, std::span<const uint32_t>(tokens).subspan(static_cast<size_t>(s), static_cast<size_t>(T + 1)),
                      chunk, kv, arena,
                      flags ? std::span<const uint8_t>(*flags).subspan(static_cast<size_t>(s), static_cast<size_t>(T + 1))
                            : std::span<const uint8_t>(),
                      [&](int64_t done, int64_t total) { progress.update("prefill", done, total); });
    const std::vector<double>& losses = window.losses;
    progress.finish();
    add_window(r.buckets, window, min_document);
    const double elapsed = seconds_since(t0);
    // A line for the first window, then one every 10 s, and the last.
    if (last_line < 0 || elapsed - last_line >= 10 || w + 1 == starts.size()) {
      double sum = 0;
      for (const double l : losses) sum += l;
      log << fmt::format("window {}/{}: mean loss {:.4f} (so far {:.4f}), {:.0f} tokens/s, {}\n", w + 1, starts.size(),
                         sum / static_cast<double>(T), r.mean_loss(), double(T) * double(w + 1) / elapsed,
                         short_duration(elapsed))
          << std::flush;
      last_line = elapsed;
    }
  }
  return r;
}

// ---- passkey ----

std::string passkey_line(const std::string& key) {
  return fmt::format("The pass key is {0}. Remember it. {0} is the pass key.", key);
}

std::string passkey_text(int64_t groups_before, int64_t groups_after, const std::string& key, bool chat) {
  const auto filler = [](int64_t n) {
    std::string s;
    for (int64_t i = 0; i < n; ++i) (s += i ? " " : "") += kPasskeyFiller;
    return s;
  };
  std::string text = kPasskeyTask;
  for (const std::string& part : {filler(groups_before), passkey_line(key), filler(groups_after)})
    if (!part.empty()) text += "\n" + part;
  text += "\n";
  text += kPasskeyQuestion;
  if (!chat) (text += " ") += kPasskeyAnswerStart;
  return text;
}

std::vector<uint32_t> passkey_ids(const Tokenizer& tokenizer, int64_t groups_before, int64_t groups_after,
                                  const std::string& key, bool chat) {
  SampleOptions so;
  so.prompt = passkey_text(groups_before, groups_after, key, chat);
  so.chat = chat;
  std::vector<uint32_t> ids = prompt_ids(tokenizer, so);
  if (chat) tokenizer.encode_into(kPasskeyAnswerStart, ids);  // the reply starts with it
  return ids;
}

PasskeyPrompt passkey_prompt(const Tokenizer& tokenizer, int64_t length, double depth, const std::string& key,
                             bool chat, int64_t groups_hint) {
  CW_CHECK(depth >= 0 && depth <= 1, "passkey_prompt: depth {} is outside [0, 1]", depth);
  const auto before = [&](int64_t n) { return static_cast<int64_t>(std::llround(depth * static_cast<double>(n))); };
  const auto ids_of = [&](int64_t n) { return passkey_ids(tokenizer, before(n), n - before(n), key, chat); };
  const auto size_of = [&](int64_t n) { return static_cast<int64_t>(ids_of(n).size()); };
  const int64_t base = size_of(0);
  if (base > length)
    fail(fmt::format("passkey: the prompt without filler is {} tokens, more than the length {}", base, length),
         "ask for longer --lengths");
  // The largest n whose prompt fits: from a guess, bracket [fits, does not fit), then bisect.
  int64_t guess = groups_hint;
  if (guess <= 0) {
    constexpr int64_t kProbe = 8;
    const int64_t per_group = std::max<int64_t>(1, (size_of(kProbe) - base) / kProbe);
    guess = std::max<int64_t>(0, (length - base) / per_group);
  }
  int64_t lo = 0, hi = -1;  // size_of(lo) <= length < size_of(hi); hi -1: not found yet
  if (size_of(guess) <= length) {
    lo = guess;
    for (int64_t step = 1; hi < 0; step *= 2) (size_of(lo + step) <= length ? lo : hi) = lo + step;
  } else {
    hi = guess;
    for (int64_t step = 1; hi - step > 0; step *= 2) {
      if (size_of(hi - step) <= length) {
        lo = hi - step;
        break;
      }
      hi -= step;
    }
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (size_of(mid) <= length ? lo : hi) = mid;
  }
  return {ids_of(lo), key, lo, before(lo)};
}

bool passkey_correct(const std::string& answer, const std::string& key) {
  const size_t i = answer.find_first_not_of(" \t\r\n");
  if (i == std::string::npos || answer.compare(i, key.size(), key) != 0) return false;
  const size_t after = i + key.size();
  return after >= answer.size() || !std::isdigit(static_cast<unsigned char>(answer[after]));
}

std::vector<double> passkey_depths(int64_t count) {
  if (count < 1) fail(fmt::format("--depths {}: at least one depth", count), "e.g. --depths 10");
  if (count == 1) return {0.5};
  std::vector<double> d;
  for (int64_t i = 0; i < count; ++i) d.push_back(static_cast<double>(i) / static_cast<double>(count - 1));
  return d;
}

double PasskeyResult::accuracy() const {
  int64_t trials_all = 0, correct_all = 0;
  for (const PasskeyCell& c : cells) trials_all += c.trials, correct_all += c.correct;
  return trials_all > 0 ? static_cast<double>(correct_all) / static_cast<double>(trials_all) : 0.0;
}

PasskeyResult passkey(LlamaModel& model, const Tokenizer& tokenizer, const PasskeyOptions& o, std::ostream& log) {
  if (o.trials < 1) fail(fmt::format("--trials {}: at least one trial", o.trials), "e.g. --trials 5");
  if (o.answer_tokens < 5)
    fail(fmt::format("--answer-tokens {}: a key of 5 digits needs 5 tokens at least", o.answer_tokens),
         "e.g. --answer-tokens 8");
  PasskeyResult r;
  r.device = device_name(model.device());
  r.dtype = dtype_name(model.dtype());
  r.chat = o.chat;
  r.trials = o.trials;
  r.answer_tokens = o.answer_tokens;
  r.chunk = o.chunk;
  r.seed = o.seed;
  r.lengths = o.lengths;
  r.depths = passkey_depths(o.depths);
  const int64_t context = model.config().max_position_embeddings;
  if (context > 0 && !o.lengths.empty() && o.lengths.back() > context)
    log << fmt::format("note: lengths past the model's max_position_embeddings ({}) ask it to extrapolate\n", context);
  SampleOptions so;
  so.tokens = o.answer_tokens;
  so.temperature = 0;
  so.chat = o.chat;
  so.prefill_chunk = o.chunk;
  Rng rng(o.seed);
  for (const int64_t length : o.lengths) {
    int64_t groups = 0;  // the last prompt's: the next one's guess
    for (const double depth : r.depths) {
      const Clock::time_point t0 = Clock::now();
      PasskeyCell cell{length, depth};
      std::string answer, key;
      double prompt_tokens = 0;
      for (int64_t t = 0; t < o.trials; ++t) {
        key = fmt::format("{}", 10000 + rng.below(90000));
        const PasskeyPrompt p = passkey_prompt(tokenizer, length, depth, key, o.chat, groups);
        groups = p.groups;
        prompt_tokens += static_cast<double>(p.ids.size());
        answer = generate_from_ids(model, tokenizer, p.ids, so).text;
        cell.correct += passkey_correct(answer, key) ? 1 : 0;
        ++cell.trials;
      }
      cell.prompt_tokens = prompt_tokens / static_cast<double>(cell.trials);
      log << fmt::format("passkey {} at depth {:.2f}: {}/{} correct ({:.0f} prompt tokens, {}); last: {} -> {}\n",
                         token_label(double(length)), depth, cell.correct, cell.trials, cell.prompt_tokens,
                         short_duration(seconds_since(t0)), key,
                         nlohmann::json(answer).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
          << std::flush;
      r.cells.push_back(cell);
    }
  }
  return r;
}

// ---- JSON ----

namespace {
// j[key] as T; fails naming the file and the key.
template <class T>
T field(const nlohmann::json& j, const char* key, const std::string& source) {
  const auto it = j.find(key);
  try {
    if (it != j.end()) return it->get<T>();
  } catch (const nlohmann::json::exception&) {
  }
  fail(fmt::format("{}: '{}' is missing or of the wrong type", source, key),
       "give a result that chunkwise eval --json wrote");
}

// A mean that may be NaN (a bucket without tokens) as JSON: null.
nlohmann::json number_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

double number_from(const nlohmann::json& j, const char* key, const std::string& source) {
  const auto it = j.find(key);
  if (it != j.end() && it->is_null()) return kNaN;
  return field<double>(j, key, source);
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(fmt::format("cannot read '{}'", path), "check the path");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(fmt::format("'{}' is not JSON", path), "give a result that chunkwise eval --json wrote");
  return j;
}

// The "task" of an eval result, "" when there is none.
std::string task_of(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("task") || !j.at("task").is_string()) return "";
  return j.at("task").get<std::string>();
}
}  // namespace

nlohmann::json LossByPositionResult::to_json() const {
  nlohmann::json b = nlohmann::json::array();
  for (const PositionBucket& x : buckets)
    b.push_back({{"lo", x.lo}, {"hi", x.hi}, {"tokens", x.tokens}, {"mean_loss", number_or_null(x.mean_loss())}});
  return {{"task", kLossByPosition}, {"model", model},    {"label", label},   {"data", data},
          {"device", device},        {"dtype", dtype},    {"seq", seq},       {"chunk", chunk},
          {"windows", windows},      {"documents", documents}, {"min_document", min_document},
          {"mean_loss", number_or_null(mean_loss())}, {"buckets", b}};
}

LossByPositionResult LossByPositionResult::from_json(const nlohmann::json& j, const std::string& source) {
  if (task_of(j) != kLossByPosition)
    fail(fmt::format("{}: not a loss-by-position result (task '{}')", source, task_of(j)),
         "give a result of chunkwise eval --task loss-by-position");
  LossByPositionResult r;
  r.model = field<std::string>(j, "model", source);
  r.label = field<std::string>(j, "label", source);
  r.data = field<std::vector<std::string>>(j, "data", source);
  r.device = field<std::string>(j, "device", source);
  r.dtype = field<std::string>(j, "dtype", source);
  r.seq = field<int64_t>(j, "seq", source);
  r.chunk = field<int64_t>(j, "chunk", source);
  r.windows = field<int64_t>(j, "windows", source);
  r.documents = field<bool>(j, "documents", source);
  if (j.contains("min_document")) r.min_document = field<int64_t>(j, "min_document", source);  // results before it: 0
  for (const nlohmann::json& b : field<nlohmann::json>(j, "buckets", source)) {
    PositionBucket x{field<int64_t>(b, "lo", source), field<int64_t>(b, "hi", source), field<int64_t>(b, "tokens", source)};
    x.loss_sum = number_from(b, "mean_loss", source) * static_cast<double>(x.tokens);
    if (x.tokens == 0) x.loss_sum = 0;
    r.buckets.push_back(x);
  }
  return r;
}

nlohmann::json PasskeyResult::to_json() const {
  nlohmann::json c = nlohmann::json::array();
  for (const PasskeyCell& x : cells)
    c.push_back({{"length", x.length},
                 {"depth", x.depth},
                 {"trials", x.trials},
                 {"correct", x.correct},
                 {"accuracy", x.accuracy()},
                 {"prompt_tokens", x.prompt_tokens}});
  return {{"task", kPasskey},   {"model", model},       {"label", label},
          {"tokenizer", tokenizer}, {"device", device}, {"dtype", dtype},
          {"chat", chat},       {"trials", trials},     {"seed", seed},
          {"answer_tokens", answer_tokens}, {"chunk", chunk}, {"lengths", lengths},
          {"depths", depths},   {"accuracy", accuracy()}, {"cells", c}};
}

PasskeyResult PasskeyResult::from_json(const nlohmann::json& j, const std::string& source) {
  if (task_of(j) != kPasskey)
    fail(fmt::format("{}: not a passkey result (task '{}')", source, task_of(j)),
         "give a result of chunkwise eval --task passkey");
  PasskeyResult r;
  r.model = field<std::string>(j, "model", source);
  r.label = field<std::string>(j, "label", source);
  r.tokenizer = field<std::string>(j, "tokenizer", source);
  r.device = field<std::string>(j, "device", source);
  r.dtype = field<std::string>(j, "dtype", source);
  r.chat = field<bool>(j, "chat", source);
  r.trials = field<int64_t>(j, "trials", source);
  r.seed = field<uint64_t>(j, "seed", source);
  r.answer_tokens = field<int64_t>(j, "answer_tokens", source);
  r.chunk = field<int64_t>(j, "chunk", source);
  r.lengths = field<std::vector<int64_t>>(j, "lengths", source);
  r.depths = field<std::vector<double>>(j, "depths", source);
  for (const nlohmann::json& c : field<nlohmann::json>(j, "cells", source))
    r.cells.push_back({field<int64_t>(c, "length", source), field<double>(c, "depth", source),
                       field<int64_t>(c, "trials", source), field<int64_t>(c, "correct", source),
                       field<double>(c, "prompt_tokens", source)});
  if (r.cells.size() != r.lengths.size() * r.depths.size())
    fail(fmt::format("{}: {} cells for {} lengths x {} depths", source, r.cells.size(), r.lengths.size(),
                     r.depths.size()),
         "give a result that chunkwise eval --json wrote");
  return r;
}

// ---- charts ----

Chart loss_by_position_chart(const std::vector<LossByPositionResult>& results, const std::vector<std::string>& labels,
                             const std::string& title) {
  Chart chart;
  chart.title = title.empty() ? "mean loss by position in the window" : title;
  chart.x_label = "position in the window (each bucket at its middle; log2 axis)";
  Panel panel{"mean loss (nats per token)", {}, 320};
  double lo = std::numeric_limits<double>::infinity(), hi = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    Series s{i < labels.size() && !labels[i].empty() ? labels[i] : results[i].label, {}, {}, chart_palette(i), true};
    for (const PositionBucket& b : results[i].buckets) {
      const double middle = 0.5 * double(b.lo + b.hi);
      s.x.push_back(std::log2(middle));
      s.y.push_back(b.mean_loss());
      lo = std::min(lo, middle), hi = std::max(hi, middle);
    }
    panel.series.push_back(std::move(s));
  }
  if (hi > 0) {
    // A tick at every power of two around the middles (every other one past a dozen).
    const int first = static_cast<int>(std::floor(std::log2(lo))), last = static_cast<int>(std::ceil(std::log2(hi)));
    const int every = last - first > 12 ? 2 : 1;
    for (int e = first; e <= last; e += every) chart.x_ticks.push_back({double(e), token_label(std::ldexp(1.0, e))});
  }
  chart.panels = {std::move(panel)};
  return chart;
}

HeatMap passkey_heat_map(const PasskeyResult& r, const std::string& title) {
  HeatMap map;
  map.title = title.empty() ? fmt::format("passkey retrieval: {}", r.label) : title;
  map.x_label = "prompt length (tokens)";
  map.y_label = "depth of the key in the text";
  map.lo = 0;
  map.hi = 100;
  map.unit = "%";
  for (const int64_t length : r.lengths) map.columns.push_back(token_label(double(length)));
  const size_t D = r.depths.size();
  for (size_t j = 0; j < D; ++j) {
    map.rows.push_back(fmt::format("{}%", std::llround(100 * r.depths[j])));
    std::vector<double> row;
    for (size_t i = 0; i < r.lengths.size(); ++i) row.push_back(100 * r.cells[i * D + j].accuracy());
    map.values.push_back(std::move(row));
  }
  return map;
}

bool is_eval_result(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::path(path).extension() != ".json" || !fs::is_regular_file(path)) return false;
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  const std::string task = task_of(j);
  return task == kLossByPosition || task == kPasskey;
}

void write_eval_chart(const std::vector<std::string>& files, const std::vector<std::string>& labels,
                      const std::string& out, const std::string& title) {
  if (files.empty()) fail("chunkwise chart: no eval result to draw", "give one or more .json files of chunkwise eval");
  if (!labels.empty() && labels.size() != files.size())
    fail(fmt::format("chunkwise chart: {} --label for {} results", labels.size(), files.size()),
         "give one --label a result, in the same order, or none (each result's own label)");
  std::vector<nlohmann::json> results;
  for (const std::string& f : files) results.push_back(read_json_file(f));
  if (task_of(results[0]) == kPasskey) {
    if (files.size() > 1)
      fail(fmt::format("chunkwise chart: {} results with the passkey result '{}'", files.size(), files[0]),
           "draw one passkey result a chart (a heat map)");
    PasskeyResult r = PasskeyResult::from_json(results[0], files[0]);
    if (!labels.empty()) r.label = labels[0];
    write_svg(out, passkey_heat_map(r, title));
    return;
  }
  std::vector<LossByPositionResult> lines;
  for (size_t i = 0; i < files.size(); ++i) lines.push_back(LossByPositionResult::from_json(results[i], files[i]));
  write_svg(out, loss_by_position_chart(lines, labels, title));
}

// ---- the command ----

namespace {
// The id of the document marker: --bos-token's (one token of the tokenizer), else the tokenizer's BOS.
uint32_t document_marker(const Tokenizer& tokenizer, const std::string& bos_token) {
  if (bos_token.empty()) {
    if (!tokenizer.bos_id())
      fail(fmt::format("--documents: the {} tokenizer has no BOS", tokenizer.kind()),
           "name the token before each document with --bos-token");
    return *tokenizer.bos_id();
  }
  const std::vector<uint32_t> ids = tokenizer.encode(bos_token);
  if (ids.size() != 1)
    fail(fmt::format("--bos-token '{}' is {} tokens, not one", bos_token, ids.size()),
         "give the text of one special token, e.g. <|endoftext|>");
  return ids[0];
}

void write_result(const std::string& path, const nlohmann::json& j, std::ostream& out) {
  if (path.empty()) return;
  write_text_atomic(path, j.dump(2) + "\n");
  out << "wrote " << path << "\n";
}

int run_loss_by_position(const EvalOptions& o, Device device, DType dtype, std::ostream& out) {
  if (o.data.empty()) fail("--task loss-by-position needs --data FILE...", "give held-out token shards or globs");
  if (o.seq <= 0) fail("--task loss-by-position needs --seq T", "the tokens a window feeds the model, e.g. --seq 65536");
  const std::vector<int64_t> edges = parse_token_counts(o.buckets, "--buckets");
  const LoadedModel m = load_model(o.source, device, dtype, {.weights = false, .tokenizer = o.documents}, "evaluate");
  // With documents, their starts as training reads them: the files' stored starts, else the marker's.
  std::optional<uint32_t> marker;
  if (o.documents && (!o.bos_token.empty() || m.tokenizer->bos_id())) marker = document_marker(*m.tokenizer, o.bos_token);
  const TokenDataset data =
      open_training_data(o.data, {parse_token_format(o.format, "--format"), m.model->config().vocab_size},
                         {.documents = o.documents}, marker, fmt::format("of {} (or --bos-token)", m.name));
  if (o.min_document != 0 && !o.documents)
    fail(fmt::format("--min-document {} without --documents", o.min_document), "add --documents, or drop --min-document");
  if (o.min_document < 0 || o.min_document > o.seq)
    fail(fmt::format("--min-document {} is outside [0, --seq {}]", o.min_document, o.seq),
         "give at most --seq tokens (--seq: every bucket averages the documents that fill a window)");
  const std::vector<int64_t> starts = window_starts(data, o.seq, o.documents, o.windows, o.min_document);
  out << fmt::format("eval loss-by-position: {} on {} ({}), {} windows of {} tokens from {}, chunks of {}\n", m.name,
                     device_name(device), dtype_name(dtype), starts.size(), o.seq, data.describe(),
                     o.chunk > 0 ? std::min(o.chunk, o.seq) : o.seq)
      << std::flush;
  LossByPositionResult r =
      loss_by_position(*m.model, data.tokens(), starts, o.seq, edges, o.chunk, out, data.shared_flags().get(),
                       o.min_document);
  r.model = m.name;
  r.label = o.label.empty() ? m.name : o.label;
  for (const TokenFileInfo& f : data.files()) r.data.push_back(f.path);
  r.documents = o.documents;
  out << fmt::format("{:<18} {:>12} {:>10}\n", "positions", "tokens", "mean loss");
  for (const PositionBucket& b : r.buckets)
    out << fmt::format("{:<18} {:>12} {:>10.4f}\n", bucket_name(b), b.tokens, b.mean_loss());
  out << fmt::format("{:<18} {:>12} {:>10.4f}\n", "all", r.windows * r.seq, r.mean_loss());
  write_result(o.json, r.to_json(), out);
  if (!o.chart.empty()) {
    std::vector<LossByPositionResult> lines;
    for (const std::string& f : o.compare) lines.push_back(LossByPositionResult::from_json(read_json_file(f), f));
    lines.push_back(r);
    write_svg(o.chart, loss_by_position_chart(lines, {}, ""));
    out << "wrote " << o.chart << "\n";
  }
  return 0;
}

int run_passkey(const EvalOptions& o, Device device, DType dtype, std::ostream& out) {
  if (!o.compare.empty()) fail("--compare is for --task loss-by-position", "draw passkey results one at a time");
  PasskeyOptions po;
  po.lengths = parse_token_counts(o.lengths, "--lengths");
  po.depths = o.depths;
  po.trials = o.trials;
  po.seed = o.seed;
  po.chat = o.chat;
  po.answer_tokens = o.answer_tokens;
  po.chunk = o.chunk;
  passkey_depths(po.depths);  // fails before the model loads
  const LoadedModel m = load_model(o.source, device, dtype, {.weights = false, .tokenizer = true}, "evaluate");
  out << fmt::format("eval passkey: {} on {} ({}), {} lengths x {} depths x {} trials{}\n", m.name, device_name(device),
                     dtype_name(dtype), po.lengths.size(), po.depths, po.trials, po.chat ? ", as a chat" : "")
      << std::flush;
  PasskeyResult r = passkey(*m.model, *m.tokenizer, po, out);
  r.model = m.name;
  r.label = o.label.empty() ? m.name : o.label;
  r.tokenizer = m.tokenizer_spec;
  // The table: a row a depth, a column a length, accuracy in %.
  std::string header = fmt::format("{:>6}", "depth");
  for (const int64_t length : r.lengths) header += fmt::format(" {:>6}", token_label(double(length)));
  out << header << "\n";
  for (size_t j = 0; j < r.depths.size(); ++j) {
    std::string row = fmt::format("{:>5}%", std::llround(100 * r.depths[j]));
    for (size_t i = 0; i < r.lengths.size(); ++i)
      row += fmt::format(" {:>5}%", std::llround(100 * r.cells[i * r.depths.size() + j].accuracy()));
    out << row << "\n";
  }
  out << fmt::format("accuracy {:.1f}% over {} trials\n", 100 * r.accuracy(),
                     static_cast<int64_t>(r.cells.size()) * r.trials);
  write_result(o.json, r.to_json(), out);
  if (!o.chart.empty()) {
    write_svg(o.chart, passkey_heat_map(r, ""));
    out << "wrote " << o.chart << "\n";
  }
  return 0;
}
}  // namespace

int run_eval(const EvalOptions& o, std::ostream& out) {
  if (o.task != kLossByPosition && o.task != kPasskey)
    fail(fmt::format("chunkwise eval: --task '{}'", o.task), "use --task loss-by-position or --task passkey");
  if (o.source.model.empty() == o.source.run.empty())
    fail("chunkwise eval needs --model MODEL or --run DIR (one of them)",
         "e.g. chunkwise eval --task passkey --model m.gguf --lengths 1K,2K");
  const Device device = resolve_device(o.device, "--device");
  const DType dtype = resolve_compute_dtype(o.dtype, device, "--dtype", "--device");
  return o.task == kLossByPosition ? run_loss_by_position(o, device, dtype, out) : run_passkey(o, device, dtype, out);
}

}  // namespace cw
