// `chunkwise eval` (tools/eval.h): loss by position against a plain whole-sequence forward (f64,
// chunked and not), bucket edges and token-count lists, window starts, the JSON results and their
// charts; passkey prompts (the key at the depth asked, the length just under the target, the ids as
// the tokenizer makes them, a chat's layout), the scoring, a run on a tiny model; the command line.
// With the real SmolLM2 GGUF in .models/: the model finds the key in a short prompt.
#include "model/checkpoint.h"
#include "tests/support.h"
#include "tests/tools/bpe_fixture.h"
#include "tools/data/tokenizer.h"
#include "tools/eval.h"
#include "tools/train/run_config.h"
#include "tools/train/sample.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace cw {
namespace {

using test::contains;
using test::error_of;
using test::kSmolLm2Gguf;
using test::read_text;
using test::run_cli;
namespace fs = std::filesystem;
using Ids = std::vector<uint32_t>;

// A tiny f64 model over the byte tokenizer's ids.
LlamaConfig tiny_bytes_config() {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.vocab_size = 320;
  cfg.bos_token_id = ByteTokenizer::kBos;
  return cfg;
}

// Seeded ids in [0, vocab).
std::vector<uint32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  const Batch b = random_batch(1, n, vocab, seed);
  std::vector<uint32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<uint32_t>(b.ids.tensor.ptr<int32_t>()[i]));
  return ids;
}

// The reference: the window's logits from one whole-sequence forward, each position's loss
// -log softmax(logits)[target] computed here in f64.
// Flags marking a document start at every `marker` token (what the data path stores, or derives from a BOS).
TokenFlags starts_at(const std::vector<uint32_t>& ids, uint32_t marker) {
  TokenFlags f{kFlagDocStart, std::vector<uint8_t>(ids.size(), 0)};
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == marker) f.bits[i] = kFlagDocStart;
  return f;
}

std::vector<double> reference_losses(LlamaModel& model, std::span<const uint32_t> window) {
  const int64_t T = static_cast<int64_t>(window.size()) - 1, V = model.config().vocab_size;
  model.ensure_positions(T);
  KVStore kv(model.config(), 1, T, DType::f64);
  Arena arena;
  OwnedTensor ids = OwnedTensor::of_shape(DType::i32, std::vector<int64_t>{T});
  for (int64_t t = 0; t < T; ++t) ids.tensor.ptr<int32_t>()[t] = static_cast<int32_t>(window[static_cast<size_t>(t)]);
  ChunkTokens chunk;
  chunk.B = 1;
  chunk.c = T;
  chunk.ids = ids.tensor;
  OwnedTensor logits = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{T, V});
  chunk_logits(logits.tensor, kv, model, chunk, true, arena);
  std::vector<double> out;
  for (int64_t t = 0; t < T; ++t) {
    const double* row = logits.tensor.ptr<double>() + t * V;
    double m = row[0];
    for (int64_t v = 1; v < V; ++v) m = std::max(m, row[v]);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - m);
    out.push_back(m + std::log(sum) - row[window[static_cast<size_t>(t) + 1]]);
  }
  return out;
}


nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t p = text.find(part); p != std::string::npos; p = text.find(part, p + 1)) ++n;
  return n;
}

}  // namespace

TEST_SUITE("eval") {

TEST_CASE("eval: token counts and bucket edges") {
  CHECK(parse_token_counts("1K,4K,16K,64K", "--buckets") == std::vector<int64_t>{1024, 4096, 16384, 65536});
  CHECK(parse_token_counts("100, 2k ,1M", "--lengths") == std::vector<int64_t>{100, 2048, 1048576});
  for (const char* bad : {"", "1K,", "0", "x", "-4", "1.5K", "4K,1K", "1K,1K"}) {
    CAPTURE(bad);
    CHECK(contains(error_of([&] { parse_token_counts(bad, "--buckets"); }), fmt::format("--buckets '{}'", bad)));
  }
  const auto ranges = [](const std::vector<PositionBucket>& b) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const PositionBucket& x : b) out.emplace_back(x.lo, x.hi);
    return out;
  };
  using R = std::vector<std::pair<int64_t, int64_t>>;
  const std::vector<int64_t> edges = {1024, 4096, 16384, 65536};
  // Past the last edge: a final bucket up to T.
  CHECK(ranges(position_buckets(edges, 100000)) == R{{0, 1024}, {1024, 4096}, {4096, 16384}, {16384, 65536}, {65536, 100000}});
  CHECK(ranges(position_buckets(edges, 65536)) == R{{0, 1024}, {1024, 4096}, {4096, 16384}, {16384, 65536}});
  // An edge past T ends its bucket at T, and the ones after it are dropped.
  CHECK(ranges(position_buckets(edges, 8192)) == R{{0, 1024}, {1024, 4096}, {4096, 8192}});
  CHECK(ranges(position_buckets(edges, 4096)) == R{{0, 1024}, {1024, 4096}});
  CHECK(ranges(position_buckets(edges, 500)) == R{{0, 500}});

  std::vector<PositionBucket> b = position_buckets({2, 5}, 8);
  add_window(b, std::vector<double>{1, 3, 10, 10, 10, 0, 2, 4});
  add_window(b, std::vector<double>{3, 1, 1, 1, 1, 6, 4, 2});
  CHECK(b[0].tokens == 4);
  CHECK(b[0].mean_loss() == 2.0);
  CHECK(b[1].tokens == 6);
  CHECK(b[1].mean_loss() == 5.5);
  CHECK(b[2].tokens == 6);
  CHECK(b[2].mean_loss() == 3.0);
  CHECK(std::isnan(PositionBucket{0, 4}.mean_loss()));
  CHECK(contains(error_of([&] { add_window(b, std::vector<double>(7, 0.0)); }), "7 losses for buckets of 8 positions"));
}

TEST_CASE("eval: windows of the stream, or from document starts") {
  std::vector<uint32_t> stream(50, 7);
  for (const size_t at : {0, 3, 12, 13, 30, 41}) stream[at] = 256;  // BOS
  const TokenDataset data = TokenDataset::from_tokens(stream, 320, "stream", starts_at(stream, 256));
  CHECK(window_starts(data, 10, false, 0) == std::vector<int64_t>{0, 10, 20, 30});  // 4 x (10 + 1) fit in 50
  CHECK(window_starts(data, 10, false, 2) == std::vector<int64_t>{0, 10});
  // Documents 0:3, 3:9, 12:1, 13:17, 30:11, 41:9 tokens; 41 has no 11 tokens after it. The longest
  // first: 13, then 30 (clear of 13 by 17), then 3 (clear of 13 by 10); 0 and 12 overlap 3's window.
  CHECK(window_starts(data, 10, true, 0) == std::vector<int64_t>{3, 13, 30});
  CHECK(window_starts(data, 10, true, 1) == std::vector<int64_t>{13});
  CHECK(window_starts(data, 10, true, 2) == std::vector<int64_t>{13, 30});
  // --min-document: only documents of at least 10 tokens open a window (13 and 30).
  CHECK(window_starts(data, 10, true, 0, 10) == std::vector<int64_t>{13, 30});
  CHECK(window_starts(data, 10, true, 0, 17) == std::vector<int64_t>{13});
  CHECK(contains(error_of([&] { window_starts(data, 10, true, 0, 18); }), "no document of --min-document 18 tokens"));
  CHECK(contains(error_of([&] { window_starts(data, 60, false, 0); }), "not one window of --seq 60 + 1"));
  CHECK(contains(error_of([&] { window_starts(data, 60, true, 0); }), "no document start with --seq 60 + 1"));
}

TEST_CASE("eval: --min-document counts only the documents of at least N tokens in their window") {
  // A window of 8 positions: documents at 0 (3 tokens), 3 (5 tokens, the window's end).
  WindowLosses w;
  w.losses = {1, 2, 9, 4, 4, 6, 6, 8};
  w.doc_starts = {0, 3};
  std::vector<PositionBucket> all = position_buckets({2}, 8), long_only = position_buckets({2}, 8);
  add_window(all, w);
  add_window(long_only, w, 4);
  // All: the first document's positions 0, 1 (its last, 2, predicts the next document's first token)
  // and the second's 0..4; only the second with --min-document 4.
  CHECK(all[0].tokens == 4);
  CHECK(all[0].mean_loss() == (1 + 2 + 4 + 4) / 4.0);
  CHECK(all[1].tokens == 3);
  CHECK(long_only[0].tokens == 2);
  CHECK(long_only[0].mean_loss() == 4.0);
  CHECK(long_only[1].tokens == 3);
  CHECK(long_only[1].mean_loss() == (6 + 6 + 8) / 3.0);
  add_window(long_only, w, 6);  // neither document has 6 tokens here
  CHECK(long_only[0].tokens == 2);
}

TEST_CASE("eval: with documents a window's tokens count at their positions in their own documents (f64)") {
  // A window of three documents (marker 256 at 0, 13 and 30): each document's losses equal the
  // document run alone, and the buckets take each token at its position in its document, leaving
  // out every document's last position (its target opens the next one).
  const LlamaConfig cfg = tiny_bytes_config();
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 12, cfg.initializer_range, 0.0);
  constexpr int64_t T = 40;
  std::vector<uint32_t> window = random_ids(T + 1, 256, 5);
  const std::vector<int64_t> starts = {0, 13, 30};
  for (const int64_t s : starts) window[static_cast<size_t>(s)] = 256;
  KVStore kv(cfg, 1, T, DType::f64);
  Arena arena;
  const WindowLosses got = window_losses(model, window, 7, kv, arena, starts_at(window, 256).bits);
  CHECK(got.doc_starts == starts);
  CHECK_FALSE(got.last_target_opens_document);
  std::vector<PositionBucket> buckets = position_buckets({4, 16}, T);
  add_window(buckets, got);
  std::vector<double> sums(buckets.size(), 0.0);
  std::vector<int64_t> counts(buckets.size(), 0);
  for (size_t d = 0; d < starts.size(); ++d) {
    const int64_t begin = starts[d], end = d + 1 < starts.size() ? starts[d + 1] : T;
    // The document alone: its ids and the token after it (the last target, not counted unless last).
    const std::vector<double> alone = reference_losses(model, std::span(window).subspan(begin, end - begin + 1));
    const int64_t counted = end - begin - (d + 1 < starts.size() ? 1 : 0);
    for (int64_t q = 0; q < counted; ++q) {
      CAPTURE(d);
      CAPTURE(q);
      CHECK(std::abs(got.losses[static_cast<size_t>(begin + q)] - alone[static_cast<size_t>(q)]) <= test::kSameMathF64Tol);
      for (size_t b = 0; b < buckets.size(); ++b)
        if (q >= buckets[b].lo && q < buckets[b].hi) sums[b] += alone[static_cast<size_t>(q)], ++counts[b];
    }
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    CAPTURE(b);
    CHECK(buckets[b].tokens == counts[b]);
    CHECK(std::abs(buckets[b].loss_sum - sums[b]) <= 1e-12 * std::max(1.0, sums[b]));
  }
}

TEST_CASE("eval: loss by position is the mean of the per-position losses of a whole-sequence forward (f64)") {
  const LlamaConfig cfg = tiny_bytes_config();
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 11, cfg.initializer_range, 0.0);
  constexpr int64_t T = 40;
  const std::vector<uint32_t> stream = random_ids(3 * T + 5, 258, 3);
  const std::vector<int64_t> starts = {0, T, 2 * T};
  std::vector<std::vector<double>> reference;
  for (const int64_t s : starts) reference.push_back(reference_losses(model, std::span(stream).subspan(s, T + 1)));

  // One window: every position's loss, whatever the chunk (one chunk, 7 with a short last, 1).
  KVStore kv(cfg, 1, T, DType::f64);
  Arena arena;
  for (const int64_t chunk : {int64_t{0}, int64_t{7}, int64_t{1}}) {
    CAPTURE(chunk);
    int64_t chunks_told = 0;
    const std::vector<double> got = window_losses(model, std::span(stream).subspan(T, T + 1), chunk, kv, arena,
                                                  [&](int64_t done, int64_t) { chunks_told = done; });
    CHECK(chunks_told == (chunk == 0 ? 1 : (T + chunk - 1) / chunk));
    REQUIRE(got.size() == static_cast<size_t>(T));
    double worst = 0;
    for (int64_t t = 0; t < T; ++t) worst = std::max(worst, std::abs(got[t] - reference[1][t]));
    CHECK(worst <= test::kSameMathF64Tol);
  }

  // The buckets' means over the three windows.
  const std::vector<int64_t> edges = {4, 16};
  std::ostringstream log;
  const LossByPositionResult r = loss_by_position(model, stream, starts, T, edges, 7, log);
  CHECK(r.windows == 3);
  CHECK(r.seq == T);
  CHECK(r.chunk == 7);
  CHECK(r.device == "cpu");
  CHECK(r.dtype == "f64");
  REQUIRE(r.buckets.size() == 3);  // [0, 4), [4, 16), [16, 40)
  for (const PositionBucket& b : r.buckets) {
    double sum = 0;
    for (const auto& w : reference)
      for (int64_t t = b.lo; t < b.hi; ++t) sum += w[t];
    const double want = sum / double(3 * (b.hi - b.lo));
    CAPTURE(b.lo);
    CHECK(b.tokens == 3 * (b.hi - b.lo));
    CHECK(std::abs(b.mean_loss() - want) <= test::kSameMathF64Tol);
  }
  CHECK(contains(log.str(), "window 1/3: mean loss "));
  CHECK(contains(log.str(), "window 3/3: mean loss "));
}

TEST_CASE("eval: the loss-by-position JSON, its round trip, and the chart of two results") {
  LossByPositionResult r;
  r.model = "m.gguf";
  r.label = "before";
  r.data = {"a.bin", "b.bin"};
  r.device = "cpu";
  r.dtype = "f32";
  r.seq = 8192;
  r.chunk = 4096;
  r.windows = 2;
  r.buckets = position_buckets({1024, 4096}, 8192);
  r.buckets[0].tokens = 2048, r.buckets[0].loss_sum = 2048 * 3.5;
  r.buckets[1].tokens = 6144, r.buckets[1].loss_sum = 6144 * 3.0;
  const nlohmann::json j = r.to_json();
  CHECK(j.at("task") == "loss-by-position");
  CHECK(j.at("model") == "m.gguf");
  CHECK(j.at("data") == nlohmann::json::array({"a.bin", "b.bin"}));
  CHECK(j.at("seq") == 8192);
  CHECK(j.at("chunk") == 4096);
  CHECK(j.at("windows") == 2);
  CHECK(j.at("mean_loss").get<double>() == doctest::Approx((2048 * 3.5 + 6144 * 3.0) / 8192).epsilon(1e-15));
  REQUIRE(j.at("buckets").size() == 3);
  CHECK(j.at("buckets")[0] == nlohmann::json{{"lo", 0}, {"hi", 1024}, {"tokens", 2048}, {"mean_loss", 3.5}});
  CHECK(j.at("buckets")[1] == nlohmann::json{{"lo", 1024}, {"hi", 4096}, {"tokens", 6144}, {"mean_loss", 3.0}});
  CHECK(j.at("buckets")[2].at("mean_loss").is_null());  // no tokens
  const LossByPositionResult back = LossByPositionResult::from_json(j, "r.json");
  CHECK(back.to_json() == j);
  nlohmann::json broken = j;
  broken.erase("seq");
  CHECK(contains(error_of([&] { LossByPositionResult::from_json(broken, "r.json"); }), "r.json: 'seq' is missing"));
  CHECK(contains(error_of([&] { PasskeyResult::from_json(j, "r.json"); }), "r.json: not a passkey result"));

  // Two results, two lines: each bucket at the log2 of its middle, the labels in the legend.
  test::TempDir dir("eval-chart");
  LossByPositionResult after = r;
  after.label = "after";
  after.buckets[1].loss_sum = 6144 * 2.5;
  std::ofstream(dir.file("before.json")) << j.dump();
  std::ofstream(dir.file("after.json")) << after.to_json().dump();
  std::ofstream(dir.file("other.json")) << R"({"task": "something else"})";
  CHECK(is_eval_result(dir.file("before.json")));
  CHECK_FALSE(is_eval_result(dir.file("other.json")));
  const Chart chart = loss_by_position_chart({r, after}, {}, "");
  REQUIRE(chart.panels.size() == 1);
  REQUIRE(chart.panels[0].series.size() == 2);
  const Series& s = chart.panels[0].series[0];
  CHECK(s.label == "before");
  CHECK(chart.panels[0].series[1].label == "after");
  CHECK(s.x == std::vector<double>{std::log2(512.0), std::log2(2560.0), std::log2(6144.0)});
  CHECK(s.y[0] == 3.5);
  CHECK(std::isnan(s.y[2]));
  CHECK(chart.x_ticks.front().label == "512");
  CHECK(chart.x_ticks.back().label == "8K");
  write_eval_chart({dir.file("before.json"), dir.file("after.json")}, {"base", "tuned"}, dir.file("c.svg"), "t");
  const std::string svg = read_text(dir.file("c.svg"));
  CHECK(count_of(svg, "<polyline") == 2);
  CHECK(contains(svg, ">base</text>"));
  CHECK(contains(svg, ">tuned</text>"));
  CHECK(contains(error_of([&] { write_eval_chart({dir.file("before.json")}, {"a", "b"}, dir.file("c.svg"), ""); }),
                 "2 --label for 1 results"));
}

TEST_CASE("passkey: the key at the depth asked, the prompt just under its length, the ids the tokenizer's") {
  const ByteTokenizer bytes;
  const std::string group = kPasskeyFiller;
  const int64_t group_ids = static_cast<int64_t>(group.size()) + 1;  // and the space between groups
  for (const int64_t length : {int64_t{600}, int64_t{2000}}) {
    for (const double depth : {0.0, 0.25, 0.5, 1.0}) {
      CAPTURE(length);
      CAPTURE(depth);
      const PasskeyPrompt p = passkey_prompt(bytes, length, depth, "40213", false);
      const auto n = static_cast<int64_t>(p.ids.size());
      CHECK(n <= length);
      CHECK(n > length - group_ids);
      CHECK(p.groups_before == std::llround(depth * double(p.groups)));
      // The ids: BOS, then the text's bytes.
      const std::string text = passkey_text(p.groups_before, p.groups - p.groups_before, "40213", false);
      Ids want{ByteTokenizer::kBos};
      bytes.encode_into(text, want);
      CHECK(p.ids == want);
      // The key's line after groups_before groups; the question last.
      const size_t key_at = text.find(passkey_line("40213"));
      REQUIRE(key_at != std::string::npos);
      CHECK(count_of(text.substr(0, key_at), group) == static_cast<size_t>(p.groups_before));
      CHECK(count_of(text, group) == static_cast<size_t>(p.groups));
      const double filler_before = double(count_of(text.substr(0, key_at), group));
      CHECK(std::abs(filler_before / double(p.groups) - depth) <= 0.5 / double(p.groups));
      CHECK(text.rfind("What is the pass key? The pass key is") == text.size() - 37);
      CHECK(text.rfind(kPasskeyTask, 0) == 0);
    }
  }
  // A hint far off finds the same prompt.
  const PasskeyPrompt a = passkey_prompt(bytes, 2000, 0.5, "12345", false);
  CHECK(passkey_prompt(bytes, 2000, 0.5, "12345", false, 3).ids == a.ids);
  CHECK(passkey_prompt(bytes, 2000, 0.5, "12345", false, 500).ids == a.ids);
  CHECK(contains(error_of([&] { passkey_prompt(bytes, 100, 0.5, "12345", false); }),
                 "more than the length 100"));

  // A BPE tokenizer: the whole text tokenized at once, as the tokenizer does (digits and all); a chat
  // lays the text out as the user's message and opens the reply with "The pass key is".
  const BpeTokenizer bpe(test::test_bpe());
  const PasskeyPrompt b = passkey_prompt(bpe, 1500, 0.3, "98765", false);
  CHECK(b.ids == bpe.encode(passkey_text(b.groups_before, b.groups - b.groups_before, "98765", false)));
  CHECK(static_cast<int64_t>(b.ids.size()) <= 1500);
  const PasskeyPrompt c = passkey_prompt(bpe, 1500, 0.3, "98765", true);
  const std::string user = passkey_text(c.groups_before, c.groups - c.groups_before, "98765", true);
  CHECK(user.substr(user.size() - 21) == "What is the pass key?");
  Ids chat = bpe.encode("<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\n" + user +
                        "<|im_end|>\n<|im_start|>assistant\n");
  bpe.encode_into("The pass key is", chat);
  CHECK(c.ids == chat);
  CHECK(static_cast<int64_t>(c.ids.size()) <= 1500);
  CHECK(contains(error_of([&] { passkey_prompt(bytes, 1500, 0.3, "98765", true); }), "no chat template"));
}

TEST_CASE("passkey: scoring and depths") {
  CHECK(passkey_correct(" 12345", "12345"));
  CHECK(passkey_correct("12345.", "12345"));
  CHECK(passkey_correct("\n 12345 is the pass key", "12345"));
  CHECK_FALSE(passkey_correct(" 123456", "12345"));  // another number
  CHECK_FALSE(passkey_correct(" 1234", "12345"));
  CHECK_FALSE(passkey_correct(" 54321", "12345"));
  CHECK_FALSE(passkey_correct(" The pass key is 12345", "12345"));  // not at the start
  CHECK_FALSE(passkey_correct("", "12345"));
  CHECK_FALSE(passkey_correct("  ", "12345"));
  CHECK(passkey_depths(1) == std::vector<double>{0.5});
  CHECK(passkey_depths(2) == std::vector<double>{0.0, 1.0});
  const std::vector<double> ten = passkey_depths(10);
  REQUIRE(ten.size() == 10);
  CHECK(ten.front() == 0.0);
  CHECK(ten.back() == 1.0);
  CHECK(ten[3] == doctest::Approx(1.0 / 3).epsilon(1e-15));
  CHECK(contains(error_of([] { passkey_depths(0); }), "--depths 0"));
}

TEST_CASE("passkey: a tiny model's run, its JSON, round trip and heat map") {
  const LlamaConfig cfg = tiny_bytes_config();
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 11, cfg.initializer_range, 0.0);
  const ByteTokenizer bytes;
  PasskeyOptions o;
  o.lengths = {260, 500};  // no filler group, and two (a group is 90 bytes)
  o.depths = 3;
  o.trials = 2;
  o.answer_tokens = 6;
  o.chunk = 100;
  std::ostringstream log;
  PasskeyResult r = passkey(model, bytes, o, log);
  r.label = "tiny";
  REQUIRE(r.cells.size() == 6);
  for (size_t i = 0; i < r.cells.size(); ++i) {
    const PasskeyCell& c = r.cells[i];
    CHECK(c.length == o.lengths[i / 3]);
    CHECK(c.depth == r.depths[i % 3]);
    CHECK(c.trials == 2);
    CHECK(c.correct <= 2);
    CHECK(c.prompt_tokens <= double(c.length));
    CHECK(c.prompt_tokens > double(c.length) - 91);
  }
  CHECK(contains(log.str(), "passkey 260 at depth 0.50: "));
  CHECK(contains(log.str(), "passkey 500 at depth 1.00: "));
  // The same keys and answers again: the run is a function of the model and the seed (keys drawn in
  // order, so a run of the first length alone has the first cells).
  std::ostringstream again;
  PasskeyOptions first = o;
  first.lengths = {260};
  const nlohmann::json cells = r.to_json().at("cells");
  CHECK(passkey(model, bytes, first, again).to_json().at("cells") ==
        nlohmann::json(std::vector<nlohmann::json>(cells.begin(), cells.begin() + 3)));

  const nlohmann::json j = r.to_json();
  CHECK(j.at("task") == "passkey");
  CHECK(j.at("lengths") == nlohmann::json::array({260, 500}));
  CHECK(j.at("depths") == nlohmann::json::array({0.0, 0.5, 1.0}));
  CHECK(j.at("trials") == 2);
  CHECK(j.at("cells").size() == 6);
  CHECK(j.at("cells")[4].at("length") == 500);
  CHECK(j.at("cells")[4].at("depth") == 0.5);
  for (const char* key : {"model", "label", "tokenizer", "device", "dtype", "chat", "seed", "answer_tokens", "chunk",
                          "accuracy"})
    CHECK_MESSAGE(j.contains(key), key);
  CHECK(PasskeyResult::from_json(j, "p.json").to_json() == j);

  // The heat map: a column a length, a row a depth (0% at the top), accuracy in %.
  r.cells[1].correct = 1;  // 260 is column 0; depth 0.5 is row 1
  r.cells[5].correct = 2;  // 500 is column 1; depth 1 is row 2
  const HeatMap map = passkey_heat_map(r, "");
  CHECK(map.columns == std::vector<std::string>{"260", "500"});
  CHECK(map.rows == std::vector<std::string>{"0%", "50%", "100%"});
  CHECK(map.values[1][0] == 50.0);
  CHECK(map.values[2][1] == 100.0);
  CHECK(map.title == "passkey retrieval: tiny");
  CHECK(map.unit == "%");
}

TEST_CASE("chunkwise eval: loss-by-position and passkey on the command line, chart of two results, errors") {
  test::TempDir dir("eval-cli");
  const LlamaConfig cfg = tiny_bytes_config();
  const std::string ckpt = dir.file("ckpt");
  {
    LlamaModel model(cfg, DType::f32);
    init_parameters(model.params(), 5, cfg.initializer_range, 0.0);
    save_checkpoint_weights(model.params(), cfg, ckpt, DType::f32);
  }
  std::string text;
  for (int i = 0; i < 40; ++i) text += "The quick brown fox jumps over the lazy dog. ";
  std::ofstream(dir.file("text.txt")) << text;
  tokenize_files({dir.file("text.txt")}, dir.file("data.bin"));

  std::string out;
  CHECK(run_cli(fmt::format("eval --task loss-by-position --model {} --data {} --seq 600 --buckets 64,256 --chunk 128 "
                            "--device cpu --json {} --label base",
                            ckpt, dir.file("data.bin"), dir.file("a.json")),
                out) == 0);
  CHECK(contains(out, "3 windows of 600 tokens"));
  CHECK(contains(out, "[256, 600)"));
  const nlohmann::json a = read_json(dir.file("a.json"));
  CHECK(a.at("task") == "loss-by-position");
  CHECK(a.at("model") == ckpt);
  CHECK(a.at("label") == "base");
  CHECK(a.at("data") == nlohmann::json::array({dir.file("data.bin")}));
  CHECK(a.at("windows") == 3);
  CHECK(a.at("buckets").size() == 3);
  CHECK(a.at("buckets")[2].at("tokens") == 3 * (600 - 256));
  // --windows and --documents (a window at each document's BOS: one document here).
  CHECK(run_cli(fmt::format("eval --task loss-by-position --model {} --data {} --seq 600 --buckets 64,256 --windows 1 "
                            "--documents --tokenizer bytes --json {} --chart {} --compare {}",
                            ckpt, dir.file("data.bin"), dir.file("b.json"), dir.file("b.svg"), dir.file("a.json")),
                out) == 0);
  CHECK(read_json(dir.file("b.json")).at("windows") == 1);
  CHECK(read_json(dir.file("b.json")).at("documents") == true);
  CHECK(read_json(dir.file("b.json")).at("min_document") == 0);
  // --min-document 600: the one document fills its window, so the result is b's.
  CHECK(run_cli(fmt::format("eval --task loss-by-position --model {} --data {} --seq 600 --buckets 64,256 --windows 1 "
                            "--documents --min-document 600 --tokenizer bytes --json {}",
                            ckpt, dir.file("data.bin"), dir.file("c.json")),
                out) == 0);
  CHECK(read_json(dir.file("c.json")).at("min_document") == 600);
  CHECK(read_json(dir.file("c.json")).at("buckets") == read_json(dir.file("b.json")).at("buckets"));
  CHECK(run_cli(fmt::format("eval --task loss-by-position --model {} --data {} --seq 600 --min-document 100",
                            ckpt, dir.file("data.bin")),
                out) == 2);
  CHECK(contains(out, "--min-document 100 without --documents"));
  CHECK(run_cli(fmt::format("eval --task loss-by-position --model {} --data {} --seq 600 --documents --tokenizer bytes "
                            "--min-document 601",
                            ckpt, dir.file("data.bin")),
                out) == 2);
  CHECK(contains(out, "--min-document 601 is outside [0, --seq 600]"));
  CHECK(count_of(read_text(dir.file("b.svg")), "<polyline") == 2);  // with the earlier result
  CHECK(run_cli(fmt::format("chart {} {} --out {} --label x --label y", dir.file("a.json"), dir.file("b.json"),
                            dir.file("ab.svg")),
                out) == 0);
  CHECK(contains(read_text(dir.file("ab.svg")), ">y</text>"));

  CHECK(run_cli(fmt::format("eval --task passkey --model {} --tokenizer bytes --lengths 320 --depths 2 --trials 1 "
                            "--json {} --chart {}",
                            ckpt, dir.file("p.json"), dir.file("p.svg")),
                out) == 0);
  CHECK(contains(out, "accuracy "));
  CHECK(read_json(dir.file("p.json")).at("cells").size() == 2);
  CHECK(count_of(read_text(dir.file("p.svg")), "<rect class=\"cell\"") == 2);
  CHECK(run_cli(fmt::format("chart {} --out {}", dir.file("p.json"), dir.file("p2.svg")), out) == 0);
  CHECK(read_text(dir.file("p2.svg")) == read_text(dir.file("p.svg")));

  CHECK(run_cli(fmt::format("eval --task passkey --model {} --lengths 320", ckpt), out) == 2);
  CHECK(contains(out, "has no tokenizer"));
  CHECK(run_cli("eval --task perplexity --model tiny", out) == 2);
  CHECK(contains(out, "use --task loss-by-position or --task passkey"));
  CHECK(run_cli("eval --task passkey", out) == 2);
  CHECK(contains(out, "needs --model MODEL or --run DIR"));
  CHECK(run_cli(fmt::format("eval --task loss-by-position --model {} --data {}", ckpt, dir.file("data.bin")), out) == 2);
  CHECK(contains(out, "needs --seq T"));
  CHECK(run_cli(fmt::format("chart {} {} --out {}", dir.file("p.json"), dir.file("a.json"), dir.file("x.svg")), out) == 2);
  CHECK(contains(out, "one passkey result a chart"));
}

TEST_CASE("chunkwise eval --rope: a model's RoPE scaling replaced equals a checkpoint that declares it") {
  test::TempDir dir("eval-rope");
  const LlamaConfig cfg = tiny_bytes_config();
  RunConfig::Rope yarn;
  yarn.type = "yarn";
  yarn.factor = 4;
  yarn.original_max_position_embeddings = 128;
  {
    LlamaModel model(cfg, DType::f32);
    init_parameters(model.params(), 5, cfg.initializer_range, 0.0);
    save_checkpoint_weights(model.params(), cfg, dir.file("plain"), DType::f32);
    save_checkpoint_weights(model.params(), with_rope(cfg, yarn, "test"), dir.file("yarn"), DType::f32);
    LlamaConfig unscaled = cfg;  // the preset's own llama3 scaling taken off
    unscaled.rope_scaling = RopeScaling{};
    save_checkpoint_weights(model.params(), unscaled, dir.file("unscaled"), DType::f32);
  }
  std::string text;
  for (int i = 0; i < 30; ++i) text += "The quick brown fox jumps over the lazy dog. ";
  std::ofstream(dir.file("text.txt")) << text;
  tokenize_files({dir.file("text.txt")}, dir.file("data.bin"));
  const auto buckets = [&](const std::string& model, const std::string& rope, const std::string& json) {
    std::string out;
    const int rc = run_cli(fmt::format("eval --task loss-by-position --model {} --data {} --seq 500 --buckets 64,256 "
                                       "--windows 1 --device cpu --dtype f64 --json {}{}",
                                       dir.file(model), dir.file("data.bin"), dir.file(json), rope),
                           out);
    REQUIRE_MESSAGE(rc == 0, out);
    return read_json(dir.file(json)).at("buckets");
  };
  const nlohmann::json declared = buckets("yarn", "", "declared.json");
  const nlohmann::json replaced =
      buckets("plain", " --rope type=yarn factor=4 original_max_position_embeddings=128", "replaced.json");
  CHECK(replaced == declared);
  CHECK(buckets("plain", "", "plain.json") != declared);  // the scaling changes the losses past 128 positions
  CHECK(buckets("plain", " --rope type=model", "model.json") == buckets("plain", "", "plain2.json"));
  CHECK(buckets("plain", " --rope type=default", "default.json") == buckets("unscaled", "", "unscaled.json"));
  std::string out;
  CHECK(run_cli(fmt::format("eval --task passkey --model {} --tokenizer bytes --lengths 320 --rope factor",
                            dir.file("plain")),
                out) == 2);
  CHECK(contains(out, "--rope 'factor': not KEY=VALUE"));
  CHECK(run_cli(fmt::format("eval --task passkey --model {} --tokenizer bytes --lengths 320 --rope type=yarn",
                            dir.file("plain")),
                out) == 2);
  CHECK(contains(out, "needs rope.factor >= 1"));
  CHECK(run_cli(fmt::format("eval --task passkey --model {} --tokenizer bytes --lengths 320 --rope colour=red",
                            dir.file("plain")),
                out) == 2);
  CHECK(contains(out, "rope.colour"));
}

// ---- the real model, when its GGUF is in .models/ ----

TEST_CASE("passkey: SmolLM2 finds the key in the middle of a prompt of 512 tokens (needs the SmolLM2 GGUF)" *
          doctest::skip(!fs::exists(kSmolLm2Gguf))) {
  ModelSource source;
  source.model = kSmolLm2Gguf.string();
  const LoadedModel m = load_model(source, Device::host(), DType::f32, {}, "evaluate");
  PasskeyOptions o;
  o.lengths = {512};
  o.depths = 1;  // 0.5
  o.trials = 1;
  o.chunk = 200;  // the prompt in three chunks
  std::ostringstream log;
  const PasskeyResult r = passkey(*m.model, *m.tokenizer, o, log);
  MESSAGE(log.str());
  REQUIRE(r.cells.size() == 1);
  CHECK(r.cells[0].prompt_tokens <= 512);
  CHECK(r.cells[0].prompt_tokens > 480);  // short of it by less than a filler group (about 21 tokens)
  CHECK(r.cells[0].correct == 1);
}

}  // TEST_SUITE

}  // namespace cw
