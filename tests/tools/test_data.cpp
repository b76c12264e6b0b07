// Token files and their flags, the train/eval split, the window sampler, the byte tokenizer, tokenize
// (text, JSON Lines, chat data) and training batches with documents and a loss mask.
#include "engine/error.h"
#include "engine/ops/lm_head_loss.h"
#include "model/pretokenizer.h"
#include "model/tokenizer.h"
#include "tests/support.h"
#include "tools/data/batches.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace cw {
namespace {

using test::contains;
using test::error_of;
using test::read_text;

namespace fs = std::filesystem;

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
}

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void put_le(std::vector<unsigned char>& out, uint32_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
}

uint32_t get_le32(const std::vector<unsigned char>& b, size_t at) {
  return uint32_t{b[at]} | uint32_t{b[at + 1]} << 8 | uint32_t{b[at + 2]} << 16 | uint32_t{b[at + 3]} << 24;
}

// A shard built by hand (not by our writer), so reader and writer are checked independently.
std::vector<unsigned char> hand_shard(int32_t magic, int32_t version, int32_t count, const std::vector<uint32_t>& ids,
                                      int token_bytes) {
  std::vector<unsigned char> b;
  put_le(b, static_cast<uint32_t>(magic), 4);
  put_le(b, static_cast<uint32_t>(version), 4);
  put_le(b, static_cast<uint32_t>(count), 4);
  b.resize(1024, 0);
  for (uint32_t id : ids) put_le(b, id, token_bytes);
  return b;
}

std::vector<uint32_t> iota_tokens(int64_t n) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 0u);
  return t;
}

}  // namespace

TEST_CASE("token shard: u16 write and read round trip") {
  test::TempDir dir("data");
  const std::string path = dir.file("a.bin");
  const std::vector<uint32_t> ids = {0, 1, 256, 257, 65535, 12345, 7};
  const TokenFileInfo written = write_token_shard(path, ids);
  CHECK(written.token_bytes == 2);

  const auto raw = read_bytes(path);
  REQUIRE(raw.size() == 1024 + 2 * ids.size());
  CHECK(get_le32(raw, 0) == 20240520u);
  CHECK(get_le32(raw, 4) == 1u);
  CHECK(get_le32(raw, 8) == ids.size());
  CHECK(raw[1024 + 2 * 4] == 0xff);  // 65535, little-endian
  CHECK(raw[1024 + 2 * 4 + 1] == 0xff);

  TokenFileInfo info;
  CHECK(read_token_file(path, TokenFormat::shard, 65536, &info) == ids);
  CHECK(info.version == 1);
  CHECK(info.count == static_cast<int64_t>(ids.size()));
  CHECK(info.token_bytes == 2);
  // The temporary file is gone and nothing else was left beside the shard.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++entries;
  CHECK(entries == 1);
}

TEST_CASE("token shard: u32 write and read round trip, overwriting") {
  test::TempDir dir("data");
  const std::string path = dir.file("a.bin");
  write_token_shard(path, std::vector<uint32_t>{1, 2, 3});
  const std::vector<uint32_t> ids = {0, 70000, 65536, 0xfffffffeu, 42};
  const TokenFileInfo written = write_token_shard(path, ids);
  CHECK(written.token_bytes == 4);
  const auto raw = read_bytes(path);
  REQUIRE(raw.size() == 1024 + 4 * ids.size());
  CHECK(get_le32(raw, 0) == 20240801u);
  CHECK(get_le32(raw, 1024 + 4) == 70000u);
  TokenFileInfo info;
  CHECK(read_token_file(path, TokenFormat::shard, kAnyVocab, &info) == ids);
  CHECK(info.version == 7);
  // A hand-made shard with another version is accepted and its version reported.
  write_bytes(path, hand_shard(kShardMagicU32, 2, 2, {5, 99999}, 4));
  CHECK(read_token_file(path, TokenFormat::shard, 100000, &info) == std::vector<uint32_t>{5, 99999});
  CHECK(info.version == 2);
  // An empty shard is a valid file.
  write_token_shard(path, std::vector<uint32_t>{});
  CHECK(read_token_file(path, TokenFormat::shard, 10).empty());
}

TEST_CASE("headerless u16 and u32 token files") {
  test::TempDir dir("data");
  std::vector<unsigned char> b16, b32;
  for (uint32_t id : {3u, 500u, 65535u}) put_le(b16, id, 2);
  for (uint32_t id : {3u, 70000u, 1u}) put_le(b32, id, 4);
  write_bytes(dir.file("x.u16"), b16);
  write_bytes(dir.file("x.u32"), b32);
  CHECK(read_token_file(dir.file("x.u16"), TokenFormat::u16, 65536) == std::vector<uint32_t>{3, 500, 65535});
  CHECK(read_token_file(dir.file("x.u32"), TokenFormat::u32, 70001) == std::vector<uint32_t>{3, 70000, 1});
  CHECK(parse_token_format("u16") == TokenFormat::u16);
  CHECK(parse_token_format("u32") == TokenFormat::u32);
  CHECK(parse_token_format("shard") == TokenFormat::shard);
  CHECK(contains(error_of([] { parse_token_format("u8", "--format"); }), "--format 'u8'"));

  b32.pop_back();  // 11 bytes: not a whole number of u32 ids
  write_bytes(dir.file("odd.u32"), b32);
  const std::string msg = error_of([&] { read_token_file(dir.file("odd.u32"), TokenFormat::u32, 100000); });
  CHECK(contains(msg, dir.file("odd.u32")));
  CHECK(contains(msg, "11 bytes"));
  CHECK(contains(msg, "multiple of 4"));
}

TEST_CASE("token file errors name the file and what is wrong") {
  test::TempDir dir("data");

  SUBCASE("bad magic") {
    const std::string path = dir.file("bad.bin");
    write_bytes(path, hand_shard(12345, 1, 2, {1, 2}, 2));
    const std::string msg = error_of([&] { read_token_file(path, TokenFormat::shard, 100); });
    CHECK(contains(msg, path));
    CHECK(contains(msg, "bad magic 12345"));
    CHECK(contains(msg, "byte offset 0"));
    CHECK(contains(msg, "hint:"));
  }
  SUBCASE("truncated shard") {
    const std::string path = dir.file("short.bin");
    write_token_shard(path, iota_tokens(10));
    fs::resize_file(path, 1024 + 2 * 10 - 2);
    const std::string msg = error_of([&] { TokenDataset::open({path}, {TokenFormat::shard, 100}); });
    CHECK(contains(msg, path));
    CHECK(contains(msg, "size is 1042 bytes, expected 1044"));
    CHECK(contains(msg, "truncated"));
  }
  SUBCASE("too small for the header") {
    const std::string path = dir.file("tiny.bin");
    write_bytes(path, {1, 2, 3});
    const std::string msg = error_of([&] { read_token_file(path, TokenFormat::shard, 100); });
    CHECK(contains(msg, path));
    CHECK(contains(msg, "too small"));
  }
  SUBCASE("id outside the vocabulary: shard") {
    const std::string path = dir.file("big.bin");
    write_token_shard(path, std::vector<uint32_t>{1, 2, 300, 4});
    const std::string msg = error_of([&] { TokenDataset::open({path}, {TokenFormat::shard, 258}); });
    CHECK(contains(msg, path));
    CHECK(contains(msg, "token #2"));
    CHECK(contains(msg, "byte offset 1028"));
    CHECK(contains(msg, "id 300"));
    CHECK(contains(msg, "258"));
    CHECK(contains(msg, "tokenizer/vocab mismatch"));
  }
  SUBCASE("id outside the vocabulary: headerless u32") {
    const std::string path = dir.file("big.u32");
    std::vector<unsigned char> b;
    for (uint32_t id : {1u, 2u, 3u, 9u}) put_le(b, id, 4);
    write_bytes(path, b);
    const std::string msg = error_of([&] { read_token_file(path, TokenFormat::u32, 9); });
    CHECK(contains(msg, "token #3 (byte offset 12) is id 9"));
  }
  SUBCASE("id outside the vocabulary: in memory") {
    CHECK(contains(error_of([] { TokenDataset::from_tokens({1, 5}, 5, "gen"); }), "'gen': token #1 is id 5"));
  }
  SUBCASE("missing file") {
    const std::string path = dir.file("nope.bin");
    const std::string msg = error_of([&] { TokenDataset::open({path}, {TokenFormat::shard, 100}); });
    CHECK(contains(msg, path));
    CHECK(contains(msg, "cannot open"));
  }
  SUBCASE("glob matching nothing") {
    write_token_shard(dir.file("a.bin"), iota_tokens(4));
    const std::string pattern = dir.file("*.tokens");
    const std::string msg = error_of([&] { TokenDataset::open({dir.file("a.bin"), pattern}, {TokenFormat::shard, 100}); });
    CHECK(contains(msg, pattern));
    CHECK(contains(msg, "matches no file"));
  }
  SUBCASE("a file listed twice") {
    write_token_shard(dir.file("a.bin"), iota_tokens(4));
    const std::string msg =
        error_of([&] { TokenDataset::open({dir.file("a.bin"), dir.file("*.bin")}, {TokenFormat::shard, 100}); });
    CHECK(contains(msg, "more than once"));
  }
  SUBCASE("no files") {
    CHECK(contains(error_of([] { TokenDataset::open({}, {TokenFormat::shard, 100}); }), "no token data files"));
  }
}

TEST_CASE("dataset: globs expand sorted, files concatenate in order, windows span files") {
  test::TempDir dir("data");
  write_token_shard(dir.file("b.bin"), std::vector<uint32_t>{10, 11, 12, 13, 14});
  write_token_shard(dir.file("a.bin"), std::vector<uint32_t>{0, 1, 2, 3, 4});
  write_token_shard(dir.file("c.bin"), std::vector<uint32_t>{20, 21, 22, 23, 24});

  const TokenDataset d = TokenDataset::open({dir.file("*.bin")}, {TokenFormat::shard, 100});
  REQUIRE(d.files().size() == 3);
  CHECK(d.files()[0].path == dir.file("a.bin"));
  CHECK(d.files()[1].path == dir.file("b.bin"));
  CHECK(d.files()[2].stream_offset == 10);
  CHECK(d.size() == 15);
  CHECK(d.tokens()[5] == 10);
  CHECK(contains(d.describe(), "and 2 more files"));

  // Literal entries keep their place before a pattern's sorted matches.
  const TokenDataset e = TokenDataset::open({dir.file("c.bin"), dir.file("[ab].bin")}, {TokenFormat::shard, 100});
  CHECK(e.tokens() == std::vector<uint32_t>{20, 21, 22, 23, 24, 0, 1, 2, 3, 4, 10, 11, 12, 13, 14});

  // 15 tokens at T = 4: floor(14 / 4) = 3 windows; window 1 crosses from a.bin into b.bin.
  const WindowSet w = d.windows(4);
  CHECK(w.size() == 3);
  const auto w1 = w.window(1);
  CHECK(std::vector<uint32_t>(w1.begin(), w1.end()) == std::vector<uint32_t>{4, 10, 11, 12, 13});
  const auto w2 = w.window(2);
  CHECK(w2.front() == w1.back());  // consecutive windows share one token
  CHECK(contains(error_of([&] { (void)d.windows(15); }), "fewer than one window of 16"));
}

TEST_CASE("split: eval fraction from the end, disjoint from training") {
  const TokenDataset d = TokenDataset::from_tokens(iota_tokens(101), 101);
  const int64_t T = 10;  // 101 tokens: 10 windows

  const WindowSplit s = split_by_fraction(d, T, 0.2);
  CHECK(s.eval.size() == 2);
  CHECK(s.eval.first_token() == 80);  // the last 2*10+1 tokens
  CHECK(s.eval.window(1).back() == 100);
  CHECK(s.train.size() == 7);  // 80 tokens before the eval stream: floor(79 / 10)
  CHECK(s.train.window(6).back() == 70);
  CHECK(s.train.window(6).back() < s.eval.window(0).front());

  const WindowSplit none = split_by_fraction(d, T, 0.0);
  CHECK(none.train.size() == 10);
  CHECK(none.eval.empty());

  CHECK(split_by_fraction(d, T, 0.01).eval.size() == 1);  // asking for eval gives at least one window
  CHECK(split_by_fraction(d, T, 0.34).eval.size() == 3);  // round(3.4)

  CHECK(contains(error_of([&] { split_by_fraction(d, T, 1.0); }), "outside [0, 1)"));
  CHECK(contains(error_of([&] { split_by_fraction(d, T, 0.9); }), "leaves none for training"));
  const TokenDataset tiny = TokenDataset::from_tokens(iota_tokens(5), 5, "tiny");
  CHECK(contains(error_of([&] { split_by_fraction(tiny, T, 0.1); }), "'tiny' holds 5 tokens"));

  // Eval batches in stream order; the last one may be short.
  const WindowSplit s3 = split_by_fraction(d, T, 0.3);
  REQUIRE(s3.eval.size() == 3);
  CHECK(s3.eval.num_batches(2) == 2);
  const auto b0 = s3.eval.batch_in_order(0, 2), b1 = s3.eval.batch_in_order(1, 2);
  CHECK(b0.size() == 2 * 11);
  CHECK(b1.size() == 1 * 11);
  CHECK(b0[0] == 70);
  CHECK(b0[11] == 80);
  CHECK(b1[0] == 90);
  CHECK(b1[10] == 100);
}

TEST_CASE("split: separate eval files") {
  test::TempDir dir("data");
  write_token_shard(dir.file("train.bin"), iota_tokens(41));
  write_token_shard(dir.file("eval.bin"), iota_tokens(21));
  const TokenDatasetOptions opt{TokenFormat::shard, 100};
  const TokenDataset train = TokenDataset::open({dir.file("train.bin")}, opt);
  const TokenDataset eval = TokenDataset::open({dir.file("eval.bin")}, opt);
  const WindowSplit s = split_by_files(train, eval, 10);
  CHECK(s.train.size() == 4);
  CHECK(s.eval.size() == 2);
  const std::string msg = error_of([&] { split_by_files(train, train, 10); });
  CHECK(contains(msg, "also a training file"));
  CHECK(contains(msg, dir.file("train.bin")));
}

TEST_CASE("window sampler: seeded, every window once per epoch, resumable") {
  const int64_t T = 4, W = 37;
  const TokenDataset d = TokenDataset::from_tokens(iota_tokens(W * T + 1), W * T + 1);
  const WindowSet windows = d.windows(T);
  REQUIRE(windows.size() == W);

  SUBCASE("rows are windows, and the same seed gives the same batches") {
    WindowSampler a(windows, 7), b(windows, 7);
    for (int i = 0; i < 30; ++i) {
      const auto batch = a.next_batch(5);
      REQUIRE(batch.size() == 5 * (T + 1));
      for (int r = 0; r < 5; ++r) {
        const uint32_t first = batch[static_cast<size_t>(r * (T + 1))];
        CHECK(first % T == 0);
        for (int k = 0; k <= T; ++k) CHECK(batch[static_cast<size_t>(r * (T + 1) + k)] == first + k);
      }
      CHECK(batch == b.next_batch(5));
    }
  }
  SUBCASE("a different seed gives a different order") {
    WindowSampler a(windows, 7), b(windows, 8);
    CHECK(a.order() != b.order());
    CHECK(a.next_batch(8) != b.next_batch(8));
  }
  SUBCASE("each epoch visits every window exactly once, in a new order") {
    WindowSampler s(windows, 3);
    std::vector<std::vector<int64_t>> epochs;
    // Batches of 3 do not divide 37: batches straddle the epoch boundaries.
    std::vector<int64_t> drawn;
    for (int i = 0; i < W; ++i) {
      const auto batch = s.next_batch(3);
      for (int r = 0; r < 3; ++r) drawn.push_back(batch[static_cast<size_t>(r * (T + 1))] / T);
    }
    for (int e = 0; e < 3; ++e) {
      std::vector<int64_t> epoch(drawn.begin() + e * W, drawn.begin() + (e + 1) * W);
      epochs.push_back(epoch);
      std::sort(epoch.begin(), epoch.end());
      std::vector<int64_t> all(W);
      std::iota(all.begin(), all.end(), int64_t{0});
      CHECK(epoch == all);
    }
    CHECK(epochs[0] != epochs[1]);
    CHECK(epochs[1] != epochs[2]);
    CHECK(s.state().epoch == 3);
    CHECK(s.state().position == 0);
  }
  SUBCASE("a restored state reproduces the following batches") {
    WindowSampler a(windows, 11);
    for (int i = 0; i < 4; ++i) a.next_batch(5);
    const SamplerState saved = a.state();
    CHECK(saved == SamplerState{11, 0, 20, W});
    std::vector<std::vector<uint32_t>> expected;
    for (int i = 0; i < 15; ++i) expected.push_back(a.next_batch(5));  // crosses into epoch 2

    WindowSampler b(windows, 999);
    const nlohmann::json j = nlohmann::json::parse(saved.to_json().dump());
    b.restore(SamplerState::from_json(j, "ckpt/state.json"));
    CHECK(b.state() == saved);
    for (int i = 0; i < 15; ++i) CHECK(b.next_batch(5) == expected[static_cast<size_t>(i)]);
    CHECK(b.state() == a.state());
  }
  SUBCASE("restore refuses a state from different data or a damaged record") {
    WindowSampler a(windows, 1);
    CHECK(contains(error_of([&] { a.restore(SamplerState{1, 0, 0, W + 1}); }), "saved over 38 training windows"));
    CHECK(contains(error_of([&] { a.restore(SamplerState{1, 0, W, W}); }), "position 37"));
    nlohmann::json j = a.state().to_json();
    j.erase("position");
    const std::string msg = error_of([&] { SamplerState::from_json(j, "ckpt/state.json"); });
    CHECK(contains(msg, "ckpt/state.json"));
    CHECK(contains(msg, "'position'"));
  }
}

TEST_CASE("byte tokenizer: UTF-8 round trip, BOS/EOS, invalid bytes") {
  const ByteTokenizer tok;
  const std::string text = "h\xc3\xa9llo, \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x99\x82\n";  // héllo, 世界 🙂
  const auto ids = tok.encode(text);
  CHECK(ids.size() == text.size());
  CHECK(ids[1] == 0xc3);
  CHECK(ids[2] == 0xa9);
  for (uint32_t id : ids) CHECK(id < 256);
  CHECK(tok.decode(ids) == text);

  std::vector<uint32_t> framed = {ByteTokenizer::kBos};
  tok.encode_into(text, framed);
  framed.push_back(ByteTokenizer::kEos);
  framed.push_back(ByteTokenizer::kBos);
  CHECK(tok.decode(framed) == text);

  CHECK(tok.decode(std::vector<uint32_t>{0xff, 'a', 0xc3}) == std::string("\xff" "a" "\xc3"));
  const std::string msg = error_of([&] { tok.decode(std::vector<uint32_t>{'a', 300}); });
  CHECK(contains(msg, "id 300 at position 1"));

  CHECK(!find_invalid_utf8(text).has_value());
  CHECK(find_invalid_utf8("ab\xc3(") == size_t{2});          // a lead byte without its continuation
  CHECK(find_invalid_utf8("\xc0\x80") == size_t{0});         // overlong NUL
  CHECK(find_invalid_utf8("x\xed\xa0\x80") == size_t{1});    // a UTF-16 surrogate
  CHECK(find_invalid_utf8("a\xe4\xb8") == size_t{1});        // cut off at the end
  CHECK(find_invalid_utf8("\xf4\x90\x80\x80") == size_t{0}); // above U+10FFFF
  CHECK(find_invalid_utf8("\x80") == size_t{0});             // a stray continuation byte
}

TEST_CASE("tokenizer description: recorded and checked") {
  const nlohmann::json j = tokenizer_json();
  CHECK(j.at("name") == "bytes");
  CHECK(j.at("vocab_size") == 258);
  CHECK(j.at("bos_token_id") == 256);
  CHECK(j.at("eos_token_id") == 257);
  (void)ByteTokenizer::from_json(j, "run/tokenizer.json");

  nlohmann::json other = j;
  other["name"] = "gpt2";
  CHECK(contains(error_of([&] { ByteTokenizer::from_json(other, "run/tokenizer.json"); }), "key 'name' is 'gpt2'"));
  other = j;
  other["vocab_size"] = 320;
  const std::string msg = error_of([&] { ByteTokenizer::from_json(other, "run/tokenizer.json"); });
  CHECK(contains(msg, "run/tokenizer.json"));
  CHECK(contains(msg, "key 'vocab_size' is 320"));
  other = j;
  other.erase("eos_token_id");
  CHECK(contains(error_of([&] { ByteTokenizer::from_json(other, "t"); }), "'eos_token_id' is missing"));

  test::TempDir dir("data");
  write_text(dir.file("tokenizer.json"), j.dump(2));
  (void)ByteTokenizer::from_file(dir.file("tokenizer.json"));
  write_text(dir.file("broken.json"), "{\"name\": ");
  CHECK(contains(error_of([&] { ByteTokenizer::from_file(dir.file("broken.json")); }), "not valid JSON"));
}

TEST_CASE("split_documents: whole file or blank-line separated") {
  const std::string text = "p1 l1\np1 l2\n\n  \n\np2\r\n\r\np3";
  const auto docs = split_documents(text, true);
  REQUIRE(docs.size() == 3);
  CHECK(docs[0] == "p1 l1\np1 l2\n");
  CHECK(docs[1] == "p2\r\n");
  CHECK(docs[2] == "p3");
  CHECK(split_documents(text, false) == std::vector<std::string_view>{text});
  CHECK(split_documents("", false).empty());
  CHECK(split_documents("\n \n", true).empty());
}

TEST_CASE("tokenize_files: text files to a shard, end to end") {
  test::TempDir dir("data");
  const std::string a = "Gr\xc3\xbc\xc3\x9f Gott!\n\nZweiter Absatz \xe2\x82\xac.\n";  // Grüß Gott! ... €.
  const std::string b = "plain ascii";
  write_text(dir.file("1.txt"), a);
  write_text(dir.file("2.txt"), b);
  write_text(dir.file("3.txt"), "");
  const ByteTokenizer tok;

  SUBCASE("one document per file") {
    const TokenizeCounts c = tokenize_files({dir.file("*.txt")}, dir.file("out.bin"));
    CHECK(c.files == 3);
    CHECK(c.documents == 2);  // the empty file adds nothing
    CHECK(c.bytes == static_cast<int64_t>(a.size() + b.size()));
    CHECK(c.tokens == c.bytes + 2);
    CHECK(fs::file_size(dir.file("out.bin")) == static_cast<uintmax_t>(1024 + 2 * c.tokens));  // u16 shard

    const TokenDataset d =
        TokenDataset::open({dir.file("out.bin")}, {TokenFormat::shard, ByteTokenizer::kVocabSize});
    CHECK(d.size() == c.tokens);
    CHECK(d.tokens()[0] == ByteTokenizer::kBos);
    CHECK(d.tokens()[a.size() + 1] == ByteTokenizer::kBos);
    CHECK(tok.decode(d.tokens()) == a + b);
    // A model whose vocabulary lacks BOS/EOS is refused at load.
    CHECK(contains(error_of([&] { TokenDataset::open({dir.file("out.bin")}, {TokenFormat::shard, 256}); }),
              "token #0 (byte offset 1024) is id 256"));
  }
  SUBCASE("split on blank lines, with EOS") {
    TokenizeOptions opt;
    opt.split_on_blank_lines = true;
    opt.add_eos = true;
    const TokenizeCounts c = tokenize_files({dir.file("1.txt"), dir.file("2.txt")}, dir.file("out.bin"), opt);
    CHECK(c.files == 2);
    CHECK(c.documents == 3);
    CHECK(c.bytes == static_cast<int64_t>(a.size() - 1 + b.size()));  // the blank separator line is not a document
    CHECK(c.tokens == c.bytes + 2 * 3);
    const std::vector<uint32_t> ids = read_token_file(dir.file("out.bin"), TokenFormat::shard, 258);
    int bos = 0, eos = 0;
    for (uint32_t id : ids) {
      bos += id == ByteTokenizer::kBos;
      eos += id == ByteTokenizer::kEos;
    }
    CHECK(bos == 3);
    CHECK(eos == 3);
    CHECK(ids.back() == ByteTokenizer::kEos);
    CHECK(tok.decode(ids) == "Gr\xc3\xbc\xc3\x9f Gott!\nZweiter Absatz \xe2\x82\xac.\nplain ascii");
  }
  SUBCASE("errors") {
    write_text(dir.file("bad.txt"), std::string("ok\xff\xfe"));
    const std::string msg = error_of([&] { tokenize_files({dir.file("bad.txt")}, dir.file("out.bin")); });
    CHECK(contains(msg, dir.file("bad.txt")));
    CHECK(contains(msg, "invalid UTF-8 at byte offset 2"));
    CHECK(!fs::exists(dir.file("out.bin")));
    TokenizeOptions raw;
    raw.require_utf8 = false;
    CHECK(tokenize_files({dir.file("bad.txt")}, dir.file("out.bin"), raw).tokens == 5);

    CHECK(contains(error_of([&] { tokenize_files({dir.file("3.txt")}, dir.file("none.bin")); }), "hold no document"));
    CHECK(contains(error_of([&] { tokenize_files({dir.file("*.md")}, dir.file("none.bin")); }),
              "text pattern '" + dir.file("*.md") + "' matches no file"));
    CHECK(contains(error_of([&] { tokenize_files({dir.file("missing.txt")}, dir.file("none.bin")); }), "cannot open"));
  }
}

TEST_CASE("window sampler: data-parallel ranks take disjoint slices of the global batch, resumably") {
  const int64_t T = 4, W = 37, B = 3, ranks = 3;
  const TokenDataset d = TokenDataset::from_tokens(iota_tokens(W * T + 1), W * T + 1);
  const WindowSet windows = d.windows(T);
  WindowSampler single(windows, 9);
  std::vector<WindowSampler> rank_samplers(static_cast<size_t>(ranks), WindowSampler(windows, 9));
  // 20 steps of 9 windows straddle epochs of 37 windows.
  for (int step = 0; step < 20; ++step) {
    const std::vector<uint32_t> global = single.next_batch(ranks * B);
    std::vector<uint32_t> joined;
    for (int64_t r = 0; r < ranks; ++r) {
      const std::vector<uint32_t> mine = rank_samplers[static_cast<size_t>(r)].next_rank_batch(B, r, ranks);
      REQUIRE(mine.size() == static_cast<size_t>(B * (T + 1)));
      joined.insert(joined.end(), mine.begin(), mine.end());
    }
    CHECK(joined == global);  // disjoint slices, in rank order: one process's batch of ranks x B
    for (const WindowSampler& s : rank_samplers) CHECK(s.state() == single.state());
  }
  // Resuming any rank from the shared state continues its slice.
  WindowSampler resumed(windows, 1);
  resumed.restore(rank_samplers[1].state());
  CHECK(resumed.next_rank_batch(B, 1, ranks) == rank_samplers[1].next_rank_batch(B, 1, ranks));
  CHECK(contains(error_of([&] { resumed.next_rank_batch(B, 3, ranks); }), "rank 3 of 3 ranks"));
}


// ---- flags files, JSON Lines, chat data, batches with documents and a loss mask ----------------

namespace {

// A flags file built by hand (not by our writer): header values, then the bytes.
std::vector<unsigned char> hand_flags(int32_t magic, int32_t version, int32_t count, int32_t carried,
                                      const std::vector<uint8_t>& bits) {
  std::vector<unsigned char> b;
  for (const int32_t v : {magic, version, count, carried}) put_le(b, static_cast<uint32_t>(v), 4);
  b.resize(1024, 0);
  b.insert(b.end(), bits.begin(), bits.end());
  return b;
}

// The positions of a flags byte stream that have `bit`.
std::vector<int64_t> positions_with(const std::vector<uint8_t>& bits, uint8_t bit) {
  std::vector<int64_t> at;
  for (size_t i = 0; i < bits.size(); ++i)
    if (bits[i] & bit) at.push_back(static_cast<int64_t>(i));
  return at;
}

std::vector<int32_t> labels_of(const Batch& b) {
  const int32_t* l = b.labels.tensor.ptr<int32_t>();
  return {l, l + b.labels.tensor.numel()};
}

}  // namespace

TEST_CASE("token flags: written beside the shard and read back; a shard written without flags removes stale ones") {
  test::TempDir dir("data");
  const std::string shard = dir.file("a.bin"), flags_path = dir.file("a.bin.flags");
  CHECK(token_flags_path(shard) == flags_path);
  const TokenFlags flags{kFlagLoss | kFlagDocStart, {2, 0, 1, 1, 3, 1, 0}};
  const TokenFileInfo info = write_token_shard(shard, std::vector<uint32_t>{5, 6, 7, 8, 5, 9, 9}, 0, &flags);
  CHECK(info.flags_carried == flags.carried);
  CHECK(read_token_flags(flags_path, 7) == flags);
  // The bytes are the documented layout: numpy reads them with two fromfile calls.
  const std::vector<unsigned char> raw = read_bytes(flags_path);
  REQUIRE(raw.size() == 1024 + 7);
  CHECK(get_le32(raw, 0) == static_cast<uint32_t>(kFlagsMagic));
  CHECK(std::string(raw.begin(), raw.begin() + 4) == "CWTF");
  CHECK(get_le32(raw, 4) == 1);
  CHECK(get_le32(raw, 8) == 7);
  CHECK(get_le32(raw, 12) == 3);
  CHECK(std::vector<uint8_t>(raw.begin() + 1024, raw.end()) == flags.bits);
  CHECK(!fs::exists(shard + ".tmp-" + std::to_string(::getpid())));

  // Opened with its flags: every file's bytes at its place in the stream.
  write_token_shard(dir.file("b.bin"), std::vector<uint32_t>{1, 2, 3});  // no flags
  const TokenDataset d = TokenDataset::open({shard, dir.file("b.bin")}, {TokenFormat::shard, 100, true});
  REQUIRE(d.shared_flags() != nullptr);
  CHECK(*d.shared_flags() == std::vector<uint8_t>{2, 0, 1, 1, 3, 1, 0, 0, 0, 0});
  CHECK(d.files()[0].flags_carried == 3);
  CHECK(d.files()[1].flags_carried == 0);
  CHECK(TokenDataset::open({shard}, {TokenFormat::shard, 100}).shared_flags() == nullptr);
  // A glob that matches the shard leaves its flags file out.
  CHECK(TokenDataset::open({dir.file("a.bin*")}, {TokenFormat::shard, 100}).files().size() == 1);

  // Rewritten without flags: the old flags file no longer describes the tokens and goes.
  write_token_shard(shard, std::vector<uint32_t>{1, 2});
  CHECK(!fs::exists(flags_path));
  CHECK(TokenDataset::open({shard}, {TokenFormat::shard, 100, true}).files()[0].flags_carried == 0);
}

TEST_CASE("token flags: a wrong magic, version, count, size or byte is refused naming the file") {
  test::TempDir dir("data");
  const std::string shard = dir.file("s.bin"), path = dir.file("s.bin.flags");
  write_token_shard(shard, std::vector<uint32_t>{1, 2, 3});
  const auto open_error = [&](const std::vector<unsigned char>& bytes) {
    write_bytes(path, bytes);
    return error_of([&] { TokenDataset::open({shard}, {TokenFormat::shard, 100, true}); });
  };
  struct Case {
    const char* what;
    std::vector<unsigned char> bytes;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"magic", hand_flags(20240520, 1, 3, 2, {2, 0, 0}), "bad magic 20240520 at byte offset 0 (expected 1179932483)"},
      {"version", hand_flags(kFlagsMagic, 2, 3, 2, {2, 0, 0}), "version 2, this build reads version 1"},
      {"count", hand_flags(kFlagsMagic, 1, 4, 2, {2, 0, 0, 0}), "is for 4 tokens, its token file holds 3"},
      {"truncated", hand_flags(kFlagsMagic, 1, 3, 2, {2, 0}), "size is 1026 bytes, expected 1027"},
      {"trailing", hand_flags(kFlagsMagic, 1, 3, 2, {2, 0, 0, 0}), "trailing bytes"},
      {"header", {1, 2, 3}, "3 bytes, too small for the 1024-byte header"},
      {"unknown flags", hand_flags(kFlagsMagic, 1, 3, 6, {2, 0, 0}), "header[3] = 6 names unknown flags"},
      {"a bit not carried", hand_flags(kFlagsMagic, 1, 3, 2, {2, 1, 0}),
       "token #1 (byte offset 1025) has flags 0x01, but the header carries only 0x02"},
      {"first token no start", hand_flags(kFlagsMagic, 1, 3, 2, {0, 2, 0}), "the first token does not start a document"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const std::string msg = open_error(c.bytes);
    CHECK(contains(msg, "token flags file '" + path + "'"));
    CHECK(contains(msg, c.message));
    CHECK(contains(msg, "hint:"));
  }
  // Checked whenever the token file is opened, even when its flags are not needed.
  write_bytes(path, hand_flags(kFlagsMagic, 1, 9, 2, std::vector<uint8_t>(9, 2)));
  CHECK(contains(error_of([&] { TokenDataset::open({shard}, {TokenFormat::shard, 100}); }), "is for 9 tokens"));
}

TEST_CASE("tokenize: text files and JSON Lines records make the same documents, their starts in the flags") {
  test::TempDir dir("data");
  const std::vector<std::string> texts = {"Gr\xc3\xbc\xc3\x9f Gott!\nline two\n", "plain \"quoted\" ascii",
                                          "\xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x91\x8b"};
  std::string jsonl;
  std::vector<std::string> text_files;
  for (size_t i = 0; i < texts.size(); ++i) {
    text_files.push_back(dir.file("t" + std::to_string(i) + ".txt"));
    write_text(text_files.back(), texts[i]);
    jsonl += nlohmann::json({{"id", i}, {"body", texts[i]}}).dump() + "\n";
    if (i == 0) jsonl += "\n  \r\n";                  // empty lines are skipped
    if (i == 1) jsonl += R"({"body": ""})" "\n";      // an empty text is no document
  }
  write_text(dir.file("docs.jsonl"), jsonl);
  const ByteTokenizer tok;
  TokenizeOptions eos;
  eos.add_eos = true;
  const TokenizeCounts from_text = tokenize_files(tok, text_files, dir.file("text.bin"), eos);
  const TokenizeCounts from_jsonl = tokenize_jsonl(tok, {dir.file("docs.jsonl")}, dir.file("jsonl.bin"), "body", eos);
  CHECK(from_jsonl.files == 1);
  CHECK(from_jsonl.records == 4);
  CHECK(from_jsonl.documents == 3);
  CHECK(from_jsonl.tokens == from_text.tokens);
  CHECK(from_jsonl.bytes == from_text.bytes);
  const std::vector<uint32_t> ids = read_token_file(dir.file("jsonl.bin"), TokenFormat::shard, 258);
  CHECK(ids == read_token_file(dir.file("text.bin"), TokenFormat::shard, 258));
  CHECK(tok.decode(ids) == texts[0] + texts[1] + texts[2]);
  // Every document starts at its BOS, and the flags say so.
  for (const char* shard : {"text.bin", "jsonl.bin"}) {
    const TokenFlags flags = read_token_flags(dir.file(shard) + ".flags", static_cast<int64_t>(ids.size()));
    CHECK(flags.carried == kFlagDocStart);
    std::vector<int64_t> bos;
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == ByteTokenizer::kBos) bos.push_back(static_cast<int64_t>(i));
    CHECK(positions_with(flags.bits, kFlagDocStart) == bos);
    CHECK(bos.size() == 3);
  }
  CHECK(contains(error_of([&] { tokenize_jsonl(tok, {dir.file("docs.jsonl")}, dir.file("x.bin"), "missing"); }),
                 "line 1: the record has no \"missing\""));
}

TEST_CASE("tokenize --jsonl and --chat-jsonl: every malformed record fails naming file:line, and nothing is written") {
  test::TempDir dir("data");
  const ByteTokenizer tok;
  const std::string good = R"({"text": "fine"})";
  struct Case {
    std::string line, message;
  };
  const std::vector<Case> text_cases = {
      {R"({"text": "unterminated)", "not valid JSON (at column "},
      {"[\"text\"]", "a JSON array, not an object"},
      {"\"just a string\"", "a JSON string, not an object"},
      {R"({"txt": "typo"})", "the record has no \"text\""},
      {R"({"text": 42})", "the record's \"text\" is a JSON number, not a string"},
      {R"({"text": null})", "the record's \"text\" is a JSON null, not a string"},
      {"{\"text\": \"bad \xff byte\"}", "invalid UTF-8 at byte 15 of the line (byte 0xff)"},
      {R"({"text": "lone \ud800 surrogate"})", "not valid JSON"},
  };
  for (const Case& c : text_cases) {
    CAPTURE(c.line);
    const std::string path = dir.file("in.jsonl");
    // The bad record on line 4, after a good one and two empty lines (which count as lines).
    write_text(path, good + "\n\n\n" + c.line + "\n" + good + "\n");
    const std::string msg = error_of([&] { tokenize_jsonl(tok, {path}, dir.file("out.bin")); });
    CHECK(contains(msg, "JSON Lines file '" + path + "' line 4: " + c.message));
    CHECK(contains(msg, "hint:"));
    CHECK(!fs::exists(dir.file("out.bin")));
    CHECK(!fs::exists(dir.file("out.bin.flags")));
  }
  const std::string chat_good = R"({"messages": [{"role": "user", "content": "hi"}]})";
  const std::vector<Case> chat_cases = {
      {R"({"msgs": []})", "the record has no \"messages\""},
      {R"({"messages": []})", "\"messages\" is an empty list, not a list of messages"},
      {R"({"messages": {"role": "user"}})", "\"messages\" is a JSON object, not a list of messages"},
      {R"({"messages": ["hi"]})", "message 1 is a JSON string, not an object"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})", "message 2 has no \"role\""},
      {R"({"messages": [{"role": "user"}]})", "message 1 has no \"content\""},
      {R"({"messages": [{"role": "user", "content": ["a"]}]})", "message 1's \"content\" is a JSON array, not a string"},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "message 1 has role \"tool\", not one of system, user, assistant"},
      {"not json", "not valid JSON"},
  };
  const BpeTokenizer chat_tok = [] {
    BpeDefinition def;
    def.source = "chat vocabulary";
    for (int b = 0; b < 256; ++b) def.tokens.push_back(bytes_to_byte_level(std::string(1, static_cast<char>(b))));
    def.added = {{"<|im_start|>", 256, true}, {"<|im_end|>", 257, true}};
    for (const AddedToken& a : def.added) def.tokens.push_back(a.content);
    def.pretokenizer_patterns = Pretokenizer::named("smollm", "test").patterns();
    def.pretokenizer_name = "smollm";
    def.chat_template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                        "'<|im_end|>' + '\n'}}{% endfor %}";
    return BpeTokenizer(def);
  }();
  for (const Case& c : chat_cases) {
    CAPTURE(c.line);
    const std::string path = dir.file("chat.jsonl");
    write_text(path, chat_good + "\n" + chat_good + "\n" + c.line + "\n");
    const std::string msg = error_of([&] { tokenize_chat_jsonl(chat_tok, {path}, dir.file("out.bin")); });
    CHECK(contains(msg, "JSON Lines file '" + path + "' line 3: " + c.message));
    CHECK(!fs::exists(dir.file("out.bin")));
  }
  CHECK(contains(error_of([&] { tokenize_chat_jsonl(tok, {dir.file("chat.jsonl")}, dir.file("out.bin")); }),
                 "the bytes tokenizer has no chat template"));
  // A SentencePiece tokenizer that prepends U+2581 to each stretch (Llama 2's, Mistral's): its
  // tokens' bytes would not line up with the text, so the assistant's cannot be marked.
  const BpeTokenizer prepending = [] {
    BpeDefinition def;
    def.source = "prepending vocabulary";
    def.byte_fallback = true;
    def.prepend_metaspace = true;
    def.strip_leading_space = true;
    for (int b = 0; b < 256; ++b) def.tokens.push_back(fmt::format("<0x{:02X}>", b));
    def.added = {{"<|im_start|>", 256, true}, {"<|im_end|>", 257, true}};
    for (const AddedToken& a : def.added) def.tokens.push_back(a.content);
    def.pretokenizer_name = "none";
    def.chat_template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                        "'<|im_end|>' + '\n'}}{% endfor %}";
    return BpeTokenizer(def);
  }();
  write_text(dir.file("chat.jsonl"), chat_good + "\n");
  CHECK(contains(error_of([&] { tokenize_chat_jsonl(prepending, {dir.file("chat.jsonl")}, dir.file("out.bin")); }),
                 "puts a U+2581 in front of each stretch of text"));
  CHECK(!fs::exists(dir.file("out.bin")));
  write_text(dir.file("empty.jsonl"), "\n\n");
  CHECK(contains(error_of([&] { tokenize_jsonl(tok, {dir.file("empty.jsonl")}, dir.file("out.bin")); }),
                 "hold no document: 0 records"));
}

namespace {

// A ChatML vocabulary worked out by hand: the bytes (id = byte value), one merge "\n\n" (256), and the
// two markers; the template inserts a default system message, as SmolLM2's does.
BpeTokenizer hand_chat_tokenizer() {
  BpeDefinition def;
  def.source = "hand chat vocabulary";
  for (int b = 0; b < 256; ++b) def.tokens.push_back(bytes_to_byte_level(std::string(1, static_cast<char>(b))));
  const std::string nl = bytes_to_byte_level("\n");
  def.tokens.push_back(nl + nl);
  def.merges = {{nl, nl}};
  def.added = {{"<|im_start|>", 257, true}, {"<|im_end|>", 258, true}};
  for (const AddedToken& a : def.added) def.tokens.push_back(a.content);
  def.pretokenizer_patterns = Pretokenizer::named("smollm", "test").patterns();
  def.pretokenizer_name = "smollm";
  def.bos_id = 257;
  def.chat_template =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe "
      "kind.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
      "'<|im_end|>' + '\\n'}}{% endfor %}";
  return BpeTokenizer(def);
}

}  // namespace

TEST_CASE("tokenize_chat_jsonl: the template's text, one document per conversation, the assistant's tokens marked") {
  test::TempDir dir("data");
  const BpeTokenizer tok = hand_chat_tokenizer();
  write_text(dir.file("chat.jsonl"),
             R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "\n\nA"}]})"
             "\n"
             R"({"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": ""}], "id": 7})"
             "\n");
  const TokenizeCounts c = tokenize_chat_jsonl(tok, {dir.file("chat.jsonl")}, dir.file("chat.bin"));
  CHECK(c.records == 2);
  CHECK(c.documents == 2);
  const uint32_t S = 257, E = 258, NL = '\n', NLNL = 256;
  const auto bytes = [](const std::string& s) { return std::vector<uint32_t>(s.begin(), s.end()); };
  // Conversation 1: the default system turn, the user's, the assistant's; the template's newline after
  // "assistant" and the content's first newline make one token, which straddles the span and is marked.
  std::vector<uint32_t> expected{S};
  std::vector<uint8_t> loss{0};
  const auto add = [&](const std::vector<uint32_t>& ids, uint8_t flag) {
    expected.insert(expected.end(), ids.begin(), ids.end());
    loss.insert(loss.end(), ids.size(), flag);
  };
  add(bytes("system\nBe kind."), 0);
  add({E, NL, S}, 0);
  add(bytes("user\nQ"), 0);
  add({E, NL, S}, 0);
  add(bytes("assistant"), 0);
  add({NLNL, NL, 'A', E}, kFlagLoss);
  add({NL}, 0);
  const size_t second = expected.size();
  // Conversation 2: its own system message (no default); the empty reply's span is <|im_end|> alone.
  add({S}, 0);
  add(bytes("system\nS"), 0);
  add({E, NL, S}, 0);
  add(bytes("assistant\n"), 0);
  add({E}, kFlagLoss);
  add({NL}, 0);
  CHECK(read_token_file(dir.file("chat.bin"), TokenFormat::shard, tok.vocab_size()) == expected);
  const TokenFlags flags = read_token_flags(dir.file("chat.bin.flags"), static_cast<int64_t>(expected.size()));
  CHECK(flags.carried == (kFlagLoss | kFlagDocStart));
  CHECK(positions_with(flags.bits, kFlagDocStart) == std::vector<int64_t>{0, static_cast<int64_t>(second)});
  std::vector<uint8_t> loss_bits(flags.bits.size());
  for (size_t i = 0; i < loss_bits.size(); ++i) loss_bits[i] = flags.bits[i] & kFlagLoss;
  CHECK(loss_bits == loss);
  CHECK(c.loss_tokens == 5);
}

namespace {
// HF transformers' ids and assistant masks of tests/data/chat_conversations.jsonl with SmolLM2's
// tokenizer (tests/data/chat_reference.py), against the tokenizer exported into .models/smollm2/.
const fs::path kSmolLm2Tokenizer = fs::path(CW_SOURCE_ROOT) / ".models" / "smollm2";
const fs::path kChatData = fs::path(CW_SOURCE_ROOT) / "tests" / "data";
}  // namespace

TEST_CASE("tokenize --chat-jsonl: SmolLM2's ids and assistant mask are HF's exactly (needs .models/smollm2)" *
          doctest::skip(!fs::exists(kSmolLm2Tokenizer / "tokenizer.json"))) {
  test::TempDir dir("data");
  const std::string shard = dir.file("chat.bin");
  // Through the command line, as a user runs it.
  const std::string command = fmt::format("'{}' tokenize --chat-jsonl '{}' --tokenizer '{}' --out '{}' > '{}' 2>&1",
                                          test::chunkwise_exe(), (kChatData / "chat_conversations.jsonl").string(),
                                          kSmolLm2Tokenizer.string(), shard, dir.file("log.txt"));
  REQUIRE_MESSAGE(std::system(command.c_str()) == 0, read_text(dir.file("log.txt")));
  const nlohmann::json reference =
      nlohmann::json::parse(read_text((kChatData / "chat_conversations.smollm2.json").string()));
  const std::vector<uint32_t> ids = read_token_file(shard, TokenFormat::shard, 49152);
  const TokenFlags flags = read_token_flags(shard + ".flags", static_cast<int64_t>(ids.size()));
  std::vector<int64_t> starts = positions_with(flags.bits, kFlagDocStart);
  REQUIRE(starts.size() == reference["conversations"].size());
  starts.push_back(static_cast<int64_t>(ids.size()));
  int64_t marked = 0;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    CAPTURE(i);
    const nlohmann::json& conv = reference["conversations"][i];
    const std::vector<uint32_t> got_ids(ids.begin() + starts[i], ids.begin() + starts[i + 1]);
    std::vector<int> got_mask;
    for (int64_t t = starts[i]; t < starts[i + 1]; ++t) got_mask.push_back(flags.bits[static_cast<size_t>(t)] & kFlagLoss);
    CHECK(got_ids == conv["ids"].get<std::vector<uint32_t>>());
    CHECK(got_mask == conv["assistant_mask"].get<std::vector<int>>());
    for (int m : got_mask) marked += m;
  }
  MESSAGE("SmolLM2 chat data against HF: ", starts.size() - 1, " conversations, ", ids.size(), " tokens, ", marked,
          " the assistant's");
  CHECK(contains(read_text(dir.file("log.txt")), fmt::format("{} the assistant's", marked)));
}

TEST_CASE("batches from windows: document starts and labels from the flags at the windows' stream offsets") {
  // Documents start at 0, 5, 8 and 12 of a stream of 17 tokens; the loss mask marks 2-4, 9, 10, 13-16.
  std::vector<uint32_t> tokens(17);
  std::iota(tokens.begin(), tokens.end(), 100u);
  std::vector<uint8_t> bits(17, 0);
  for (int i : {0, 5, 8, 12}) bits[static_cast<size_t>(i)] |= kFlagDocStart;
  for (int i : {2, 3, 4, 9, 10, 13, 14, 15, 16}) bits[static_cast<size_t>(i)] |= kFlagLoss;
  const TokenDataset d = TokenDataset::from_tokens(tokens, 200, "packed", TokenFlags{3, bits});
  const int64_t T = 4;
  const WindowSet set = d.windows(T);  // windows at 0, 4, 8, 12
  REQUIRE(set.size() == 4);
  CHECK(set.window_start(2) == 8);
  const std::vector<int64_t> windows{1, 3, 2};
  constexpr int32_t X = kIgnoreLabel;

  // Plain: the windows' shifted ids, nothing else.
  const Batch plain = batch_of_windows(set, windows, {});
  CHECK(plain.doc_starts.empty());
  CHECK(labels_of(plain) == std::vector<int32_t>{105, 106, 107, 108, 113, 114, 115, 116, 109, 110, 111, 112});

  // Documents: window 1 (tokens 4..8) holds the start at 5, and its last target (8) opens a document:
  // labels 0 (predicting 5) and 3 (predicting 8) are masked. Window 3 (12..16) is one document. Window
  // 2 (8..12) starts at 8 (its first token) and its last target opens the document at 12.
  const Batch docs = batch_of_windows(set, windows, {.documents = true, .document_positions = false});
  CHECK(docs.doc_starts == std::vector<std::vector<int64_t>>{{0, 1}, {0}, {0}});
  CHECK_FALSE(docs.document_positions);
  CHECK(labels_of(docs) == std::vector<int32_t>{X, 106, 107, X, 113, 114, 115, 116, 109, 110, 111, X});
  CHECK(batch_of_windows(set, windows, {.documents = true}).document_positions);

  // Assistant loss: label t kept where token t+1 is marked.
  const Batch assistant = batch_of_windows(set, windows, {.assistant_loss = true});
  CHECK(assistant.doc_starts.empty());
  CHECK(labels_of(assistant) == std::vector<int32_t>{X, X, X, X, 113, 114, 115, 116, 109, 110, X, X});
  CHECK(assistant.supervised() == 6);

  // Both.
  const Batch both = batch_of_windows(set, windows, {.documents = true, .assistant_loss = true});
  CHECK(labels_of(both) == std::vector<int32_t>{X, X, X, X, 113, 114, 115, 116, 109, 110, X, X});
  CHECK(both.doc_starts == docs.doc_starts);

  // The eval order and the sampler give window indices that line up with the id batches.
  CHECK(set.batch_windows(1, 3) == std::vector<int64_t>{3});
  WindowSampler a(set, 5), b(set, 5);
  for (int i = 0; i < 6; ++i) {
    const std::vector<int64_t> w = a.next_batch_windows(3);
    CHECK(labels_of(batch_of_windows(set, w, {})) == labels_of(window_batch(b.next_batch(3), 3, T)));
  }
  CHECK(a.state() == b.state());
}

TEST_CASE("open_training_data: document starts from flags or from the BOS; missing mask or starts name the file") {
  test::TempDir dir("data");
  const std::vector<uint32_t> ids{7, 1, 2, 7, 3, 7, 4, 5};
  write_token_shard(dir.file("plain.bin"), ids);  // no flags: starts only from a marker
  const TokenFlags stored_starts{kFlagDocStart, {2, 0, 0, 0, 0, 0, 2, 0}};
  write_token_shard(dir.file("docs.bin"), ids, 0, &stored_starts);
  const TokenDatasetOptions format{TokenFormat::shard, 100};
  const BatchOptions documents{.documents = true};

  const TokenDataset by_marker = open_training_data({dir.file("plain.bin")}, format, documents, 7, "'t'");
  CHECK(positions_with(*by_marker.shared_flags(), kFlagDocStart) == std::vector<int64_t>{0, 3, 5});
  // Stored starts win over the marker.
  const TokenDataset stored = open_training_data({dir.file("docs.bin")}, format, documents, 7, "'t'");
  CHECK(positions_with(*stored.shared_flags(), kFlagDocStart) == std::vector<int64_t>{0, 6});

  std::string msg = error_of(
      [&] { open_training_data({dir.file("plain.bin")}, format, documents, std::nullopt, "'x.json' (data.tokenizer)"); });
  CHECK(contains(msg, "data.documents = true, but token file '" + dir.file("plain.bin") + "' stores no document starts"));
  CHECK(contains(msg, "the tokenizer 'x.json' (data.tokenizer) has no BOS"));
  CHECK(open_training_data({dir.file("docs.bin")}, format, documents, std::nullopt, "'t'").size() == 8);

  const BatchOptions assistant{.assistant_loss = true};
  msg = error_of([&] { open_training_data({dir.file("docs.bin")}, format, assistant, 7, "'t'"); });
  CHECK(contains(msg, "data.loss = assistant, but token file '" + dir.file("docs.bin") + "' has no loss mask"));
  CHECK(contains(msg, "holds document starts only"));
  CHECK(contains(msg, "set data.loss = all"));
  msg = error_of([&] { open_training_data({dir.file("plain.bin")}, format, assistant, 7, "'t'"); });
  CHECK(contains(msg, "no flags file '" + dir.file("plain.bin.flags") + "' beside it"));
}

}  // namespace cw
