// The byte-level BPE tokenizer (model/tokenizer.h, model/pretokenizer.h) on a small hand-made
// vocabulary whose ids are worked out by hand; its loaders and their errors; the tools built on it
// (load_tokenizer, chunkwise encode, tokenize into shards); and, where the exported SmolLM2
// tokenizer is present, ids equal to HF tokenizers' on tests/data/tokenizer_corpus.txt; and a
// Qwen2-style tokenizer.json (NFC) trained with HF tokenizers, against its ids (tests/data/).
#include "engine/error.h"
#include "engine/random.h"
#include "model/pretokenizer.h"
#include "model/tokenizer.h"
#include "tests/model/gguf_builder.h"
#include "tests/support.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>

namespace cw {
namespace {

using test::contains;
using test::error_of;
using test::kSmolLm2Gguf;
using test::read_text;

namespace fs = std::filesystem;
using Ids = std::vector<uint32_t>;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
}

std::string byte_symbol(uint8_t b) { return bytes_to_byte_level(std::string(1, static_cast<char>(b))); }

// The hand-made vocabulary: ids 0..255 are the bytes (id = byte value), then the merges' results in
// rank order, then four added tokens. Ids of the merged tokens:
constexpr uint32_t kLl = 256, kHe = 257, kHell = 258, kHello = 259, kSpaceW = 260, kOr = 261, kSpaceWor = 262,
                   kLd = 263, kSpaceWorld = 264, kBc = 265, kAb = 266, kAa = 267, kTwelve = 268;
constexpr uint32_t kX = 269, kXY = 270, kEnd = 271, kHi = 272;
const std::vector<std::pair<std::string, std::string>> kMerges = {
    {"l", "l"},        {"h", "e"},    {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"},  {"o", "r"}, {"Ġw", "or"},
    {"l", "d"},        {"Ġwor", "ld"}, {"b", "c"},   {"a", "b"},    {"a", "a"}, {"1", "2"}};

BpeDefinition small_definition(const std::string& pretokenizer = "smollm") {
  BpeDefinition def;
  def.source = "small vocabulary";
  for (int b = 0; b < 256; ++b) def.tokens.push_back(byte_symbol(static_cast<uint8_t>(b)));
  for (const auto& [l, r] : kMerges) def.tokens.push_back(l + r);
  def.merges = kMerges;
  def.added = {{"<x>", kX, true}, {"<x><y>", kXY, true}, {"<|endoftext|>", kEnd, true}, {"hi!", kHi, false}};
  for (const AddedToken& a : def.added) def.tokens.push_back(a.content);
  const Pretokenizer named = Pretokenizer::named(pretokenizer, "test");
  def.pretokenizer_patterns = named.patterns();
  def.pretokenizer_name = pretokenizer;
  def.bos_id = kEnd;
  def.eos_id = kEnd;
  return def;
}

// The same vocabulary as an HF tokenizer.json (merges as "a b" strings or as [a, b] pairs).
nlohmann::json small_tokenizer_json(bool pair_merges) {
  const BpeDefinition def = small_definition();
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t id = 0; id < kX; ++id) vocab[def.tokens[id]] = id;
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [l, r] : def.merges)
    merges.push_back(pair_merges ? nlohmann::json::array({l, r}) : nlohmann::json(l + " " + r));
  nlohmann::json added = nlohmann::json::array();
  for (const AddedToken& a : def.added)
    added.push_back({{"id", a.id}, {"content", a.content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", a.special}});
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Digits"}, {"individual_digits", true}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}}}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"byte_fallback", false},
            {"ignore_merges", false}, {"vocab", vocab}, {"merges", merges}}}};
}

TEST_CASE("tokenizer: GPT-2's byte-to-unicode map") {
  CHECK(byte_to_unicode('a') == 'a');
  CHECK(byte_to_unicode('!') == '!');
  CHECK(byte_to_unicode(0xff) == 0xff);
  CHECK(byte_to_unicode(0x00) == 0x100);
  CHECK(byte_to_unicode(' ') == 0x120);   // 'Ġ'
  CHECK(byte_to_unicode('\n') == 0x10a);  // 'Ċ'
  CHECK(byte_to_unicode(0x7f) == 0x121);  // the 34th byte that does not map to itself
  CHECK(byte_to_unicode(0xad) == 0x143);  // the 68th and last
  for (int b = 0; b < 256; ++b) CHECK(byte_from_unicode(byte_to_unicode(static_cast<uint8_t>(b))) == b);
  CHECK(byte_from_unicode(0x144) == -1);
  CHECK(byte_from_unicode(' ') == -1);  // the space is spelled 'Ġ'
  CHECK(bytes_to_byte_level(" hi\n") == "Ġhi\xc4\x8a");
  CHECK(byte_level_to_bytes("Ġhi\xc4\x8a") == std::optional<std::string>(" hi\n"));
  CHECK_FALSE(byte_level_to_bytes("a b"));     // a plain space stands for no byte
  CHECK_FALSE(byte_level_to_bytes("\xc4"));    // not UTF-8
}

TEST_CASE("tokenizer: invalid UTF-8 replaced as HF's decode does (maximal subparts)") {
  // Each expectation is what Python's bytes.decode("utf-8", "replace") returns.
  const std::string fffd = "\xef\xbf\xbd";
  CHECK(replace_invalid_utf8("plain, caf\xc3\xa9 \xf0\x9f\x98\x80") == "plain, caf\xc3\xa9 \xf0\x9f\x98\x80");
  CHECK(replace_invalid_utf8("\xff") == fffd);
  CHECK(replace_invalid_utf8("a\xe2\x82") == "a" + fffd);             // a 3-byte sequence cut short: one
  CHECK(replace_invalid_utf8("\xe2\x82" "A") == fffd + "A");
  CHECK(replace_invalid_utf8("\xf0\x9f\x98") == fffd);
  CHECK(replace_invalid_utf8("\xed\xa0\x80") == fffd + fffd + fffd);  // a surrogate: each byte
  CHECK(replace_invalid_utf8("\xc0\xaf") == fffd + fffd);             // overlong: each byte
  CHECK(replace_invalid_utf8("\xf4\x90\x80\x80") == fffd + fffd + fffd + fffd);  // above U+10FFFF
  CHECK(replace_invalid_utf8("\x80" "b\xc3") == fffd + "b" + fffd);
}

TEST_CASE("tokenizer: named pre-tokenizers split as HF's regexes do") {
  using Pieces = std::vector<std::string_view>;
  const Pretokenizer gpt2 = Pretokenizer::named("gpt2", "test");
  CHECK(gpt2.split("Hello world's 123  x\n") == Pieces{"Hello", " world", "'s", " 123", " ", " x", "\n"});
  CHECK(gpt2.split("  a\t\tb!!") == Pieces{" ", " a", "\t", "\t", "b", "!!"});
  const Pretokenizer smollm = Pretokenizer::named("smollm", "test");
  CHECK(smollm.split("a 123x") == Pieces{"a", " ", "1", "2", "3", "x"});
  CHECK(smollm.split("²½") == Pieces{"²", "½"});  // \p{N}, not only 0-9
  const Pretokenizer llama3 = Pretokenizer::named("llama-bpe", "test");
  CHECK(llama3.split("I'M 12345 ok\n\n  x") == Pieces{"I", "'M", " ", "123", "45", " ok", "\n\n", " ", " x"});
  // Invalid UTF-8 never matches: it is a gap of its own, kept, so no byte is lost.
  CHECK(gpt2.split("ab\xff" "cd \xc3") == Pieces{"ab", "\xff", "cd", " ", "\xc3"});
  CHECK(gpt2.split("").empty());
  CHECK(contains(error_of([] { Pretokenizer::named("qwen9", "m.gguf"); }), "m.gguf: pre-tokenizer 'qwen9' is not one"));
  // DeepSeek Coder's: line breaks, letters and punctuation with the space before them, CJK runs, digits.
  CHECK(Pretokenizer::named("deepseek-coder", "test").split("Hi 12 \u4e16\u754c\n!!") ==
        Pieces{"Hi", " ", "1", "2", " ", "\u4e16\u754c", "\n", "!!"});
  // llama.cpp's other names for the same regexes (its pre-tokenizer types).
  const std::vector<std::pair<const char*, std::vector<const char*>>> aliases = {
      {"gpt2", {"gpt-2", "phi-2", "mpt", "olmo"}},
      {"llama-bpe", {"llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"}},
      {"smollm", {"starcoder", "refact", "codeshell"}},
      {"qwen2", {"deepseek-r1-qwen", "stablelm2"}},
  };
  for (const auto& [name, others] : aliases)
    for (const char* other : others) {
      CAPTURE(other);
      CHECK(Pretokenizer::named(other, "test").patterns() == Pretokenizer::named(name, "test").patterns());
    }
  CHECK(contains(error_of([] { Pretokenizer({"(a"}, "x", "t.json"); }),
            "t.json: pre-tokenizer regex '(a' does not compile"));
}

TEST_CASE("tokenizer: BPE ids of known strings on a hand-made vocabulary") {
  const BpeTokenizer tok(small_definition());
  CHECK(tok.vocab_size() == 273);
  CHECK(tok.num_merges() == 13);
  CHECK(tok.encode("hello world") == Ids{kHello, kSpaceWorld});
  CHECK(tok.encode("hello") == Ids{kHello});
  CHECK(tok.encode("hell") == Ids{kHell});
  CHECK(tok.encode("held") == Ids{kHe, kLd});          // "h e" (rank 1), then "l d" (rank 7)
  CHECK(tok.encode("abc") == Ids{'a', kBc});           // "b c" (rank 9) before "a b" (rank 10)
  CHECK(tok.encode("aaa") == Ids{kAa, 'a'});           // equal ranks: the leftmost first
  CHECK(tok.encode("aaaa") == Ids{kAa, kAa});
  CHECK(tok.encode("12") == Ids{'1', '2'});            // smollm: every digit alone, "1 2" never applies
  CHECK(BpeTokenizer(small_definition("gpt2")).encode("12") == Ids{kTwelve});
  CHECK(tok.encode(" w") == Ids{kSpaceW});
  CHECK(tok.encode("é") == Ids{0xc3, 0xa9});           // bytes of the UTF-8
  CHECK(tok.encode("").empty());
  // Added tokens: cut out first, longest at the leftmost position, whatever the pre-tokenizer.
  CHECK(tok.encode("<x><y>z<x>") == Ids{kXY, 'z', kX});
  CHECK(tok.encode("<x>y") == Ids{kX, 'y'});
  CHECK(tok.encode("hello<|endoftext|>hello") == Ids{kHello, kEnd, kHello});
  CHECK(tok.encode("oh hi!") == Ids{'o', 'h', ' ', kHi});
  CHECK(tok.encode("<|endoftext|") == Ids{'<', '|', 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x', 't', '|'});
  // Encoding the same text again (from the piece cache) gives the same ids.
  CHECK(tok.encode("hello world hello world") == Ids{kHello, kSpaceWorld, ' ', kHello, kSpaceWorld});
}

TEST_CASE("tokenizer: decode gives the bytes back, for any byte string") {
  const BpeTokenizer tok(small_definition());
  CHECK(tok.decode(Ids{kHello, kSpaceWorld}) == "hello world");
  CHECK(tok.decode(Ids{kXY, 'z', kEnd}) == "<x><y>z<|endoftext|>");
  CHECK(tok.decode(Ids{kXY, 'z', kEnd, kHi}, /*skip_special=*/true) == "zhi!");  // hi! is not special
  CHECK(contains(error_of([&] { tok.decode(Ids{1, 273}); }), "id 273 at position 1 is not a token"));
  // Random byte strings (invalid UTF-8 included) drawn from an alphabet that hits the merges, the
  // added tokens and the pre-tokenizer's classes.
  const std::string alphabet = std::string("helowrdabc12 \t\n<x>y|!i\xff\xc3\xa9\xe2\x82\xac") + '\0';
  Rng rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s;
    const uint64_t len = rng.below(40);
    for (uint64_t i = 0; i < len; ++i)
      s.push_back(trial % 2 ? alphabet[rng.below(alphabet.size())] : static_cast<char>(rng.below(256)));
    const Ids ids = tok.encode(s);
    REQUIRE_MESSAGE(tok.decode(ids) == s, "trial ", trial);
  }
}

TEST_CASE("tokenizer: bytes without a token are dropped, or become the unknown token, as HF does") {
  BpeDefinition def = small_definition();
  def.tokens['x'] = "<no-x>";  // the vocabulary lacks the token of byte 'x'
  const BpeTokenizer drops(def);
  CHECK_FALSE(drops.has_byte_token('x'));
  CHECK(drops.has_byte_token('y'));
  CHECK(drops.encode("axb") == Ids{kAb});  // dropped, and its neighbours merge across the gap
  CHECK(drops.encode("<x>") == Ids{kX});   // added tokens are matched as text, before the bytes
  def.unk_token = "<x>";
  CHECK(BpeTokenizer(def).encode("axxb") == Ids{'a', kX, kX, 'b'});
  def.fuse_unk = true;
  CHECK(BpeTokenizer(def).encode("axxb") == Ids{'a', kX, 'b'});
  def.unk_token = "<nope>";
  CHECK(contains(error_of([&] { BpeTokenizer{def}; }), "the unknown token '<nope>' is not in the vocabulary"));
}

TEST_CASE("tokenizer: ignore_merges takes a piece that is a token as a whole (Llama 3)") {
  BpeDefinition def = small_definition();
  def.tokens.push_back("abc");  // a token no merge makes
  CHECK(BpeTokenizer(def).encode("abc") == Ids{'a', kBc});
  def.ignore_merges = true;
  CHECK(BpeTokenizer(def).encode("abc") == Ids{273});
  CHECK(BpeTokenizer(def).encode("aaa") == Ids{kAa, 'a'});  // not a token: merged as usual
}

// The strings below are spelled in bytes: "e\xcc\x81" is e + U+0301 COMBINING ACUTE ACCENT.
TEST_CASE("tokenizer: NFC composes as HF's NFC normalizer does (utf8proc)") {
  CHECK(nfc_normalize("e\xcc\x81") == "\xc3\xa9");                                // e + U+0301 -> U+00E9
  CHECK(nfc_normalize("A\xcc\x8a") == "\xc3\x85");                                // A + U+030A -> U+00C5
  CHECK(nfc_normalize("\xe2\x84\xab") == "\xc3\x85");                             // U+212B ANGSTROM SIGN -> U+00C5
  CHECK(nfc_normalize("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8") == "\xea\xb0\x81");  // jamo G A G -> U+AC01
  CHECK(nfc_normalize("\xe1\x84\x80\xe1\x85\xa1") == "\xea\xb0\x80");              // jamo G A -> U+AC00
  // Marks put in canonical order: U+0323 (class 220) before U+0302 (class 230), then composed.
  CHECK(nfc_normalize("a\xcc\x82\xcc\xa3") == "\xe1\xba\xad");                    // -> U+1EAD
  // Already NFC: unchanged, compatibility characters included (U+FB01 'fi' is NFKC's business).
  const std::string already = "Caf\xc3\xa9 \xea\xb0\x81 \xef\xac\x81 \xe2\x84\x83 \xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d";
  CHECK(nfc_normalize(already) == already);
  CHECK(nfc_normalize("plain ASCII\n") == "plain ASCII\n");
  CHECK(nfc_normalize(std::string("a\0b", 3)) == std::string("a\0b", 3));
  CHECK(nfc_normalize("").empty());
  // Invalid UTF-8: each valid stretch is normalized, invalid bytes stay; nothing composes across them.
  CHECK(nfc_normalize("\xff" "e\xcc\x81\xfe") == "\xff\xc3\xa9\xfe");
  CHECK(nfc_normalize("e\xff\xcc\x81") == "e\xff\xcc\x81");
  CHECK(nfc_normalize("e\xcc") == "e\xcc");

  // The tokenizer: with NFC, decomposed text gives the ids of the same text pre-composed; without a
  // normalizer (SmolLM2, Llama 3) it gives the decomposed bytes' ids.
  BpeDefinition def = small_definition();
  const BpeTokenizer plain(def);
  def.normalizer = Normalizer::nfc;
  const BpeTokenizer nfc(def);
  const std::string decomposed = "Cafe\xcc\x81 \xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 \xe2\x84\xab hello";
  const std::string composed = "Caf\xc3\xa9 \xea\xb0\x81 \xc3\x85 hello";
  CHECK(nfc.encode(decomposed) == plain.encode(composed));
  CHECK(nfc.encode(composed) == plain.encode(composed));
  CHECK(plain.encode(decomposed) != plain.encode(composed));
  CHECK(nfc.encode("e\xcc\x81") == Ids{0xc3, 0xa9});
  CHECK(plain.encode("e\xcc\x81") == Ids{'e', 0xcc, 0x81});
  CHECK(nfc.encode(already) == plain.encode(already));
  // Invalid UTF-8 still encodes byte for byte around the normalized stretches.
  CHECK(nfc.encode("\xff" "e\xcc\x81") == Ids{0xff, 0xc3, 0xa9});
  CHECK(nfc.decode(nfc.encode("x\xf0\x9f\xcc\x81")) == "x\xf0\x9f\xcc\x81");
}

TEST_CASE("tokenizer: with a normalizer, added tokens are matched as HF matches them") {
  // HF cuts out the `normalized: false` added tokens (special ones) on the raw text, normalizes each
  // stretch between them on its own, then finds the `normalized: true` ones in it by their NFC text.
  constexpr uint32_t kAcute = 273;
  BpeDefinition def = small_definition();
  def.normalizer = Normalizer::nfc;
  AddedToken acute{"e\xcc\x81!", kAcute, false};  // written decomposed
  acute.normalized = true;
  def.added.push_back(acute);
  def.tokens.push_back(acute.content);
  const BpeTokenizer nfc(def);
  CHECK(nfc.encode("e<x>\xcc\x81") == Ids{'e', kX, 0xcc, 0x81});  // nothing composes across <x>
  CHECK(nfc.encode("\xc3\xa9!") == Ids{kAcute});
  CHECK(nfc.encode("e\xcc\x81!") == Ids{kAcute});
  CHECK(nfc.encode("<x>e\xcc\x81!hi!") == Ids{kX, kAcute, kHi});
  def.normalizer = Normalizer::none;
  const BpeTokenizer plain(def);
  CHECK(plain.encode("e\xcc\x81!") == Ids{kAcute});
  CHECK(plain.encode("\xc3\xa9!") == Ids{0xc3, 0xa9, '!'});

  // Written as tokenizer.json and read back: the normalizer and each token's flag survive.
  const nlohmann::json j = nfc.hf_tokenizer_json();
  CHECK(j.at("normalizer") == nlohmann::json{{"type", "NFC"}});
  const BpeTokenizer back = BpeTokenizer::from_tokenizer_json_text(j.dump(), "nfc tokenizer.json");
  CHECK(back.normalizer() == Normalizer::nfc);
  for (const std::string text : {"\xc3\xa9!", "e<x>\xcc\x81", "Cafe\xcc\x81 <|endoftext|>\xe2\x84\xab"})
    CHECK(back.encode(text) == nfc.encode(text));
  CHECK(plain.hf_tokenizer_json().at("normalizer").is_null());
}

TEST_CASE("tokenizer: loaded from an HF tokenizer.json and from GGUF metadata, the same ids") {
  const BpeTokenizer reference(small_definition());
  const std::string text = "hello world, <x><y> abc 12 aaa <|endoftext|>hi! \xc3\xa9\xff";
  test::TempDir dir("tokenizer-json");
  for (bool pairs : {false, true}) {
    CAPTURE(pairs);
    const std::string path = dir.file(pairs ? "pairs.json" : "strings.json");
    write_text(path, small_tokenizer_json(pairs).dump());
    const BpeTokenizer tok = BpeTokenizer::from_tokenizer_json(path);
    CHECK(tok.encode(text) == reference.encode(text));
    CHECK(tok.pretokenizer().name() == "smollm");  // its patterns are the named ones
    CHECK_FALSE(tok.bos_id());                      // no tokenizer_config.json beside it
  }
  // A directory holding tokenizer.json and tokenizer_config.json: BOS and EOS from the latter.
  write_text(dir.file("tokenizer.json"), small_tokenizer_json(false).dump());
  write_text(dir.file("tokenizer_config.json"),
             R"({"bos_token": "<x>", "eos_token": {"content": "<|endoftext|>", "special": true},
                 "pad_token": null, "chat_template": "{{ messages }}"})");
  const std::unique_ptr<Tokenizer> loaded = load_tokenizer(dir.path.string());
  CHECK(loaded->kind() == "bpe");
  CHECK(loaded->bos_id() == std::optional<uint32_t>(kX));
  CHECK(loaded->eos_id() == std::optional<uint32_t>(kEnd));
  CHECK_FALSE(dynamic_cast<const BpeTokenizer&>(*loaded).pad_id());
  CHECK(dynamic_cast<const BpeTokenizer&>(*loaded).chat_template() == "{{ messages }}");
  CHECK(loaded->encode(text) == reference.encode(text));
  write_text(dir.file("tokenizer_config.json"), R"({"bos_token": "<s>"})");
  CHECK(contains(error_of([&] { load_tokenizer(dir.path.string()); }), "bos_token '<s>' is not a token"));

  GgufTokenizerMetadata meta;
  meta.source = "small.gguf";
  meta.model = "gpt2";
  meta.pre = "smollm";
  meta.tokens = small_definition().tokens;
  for (const auto& [l, r] : kMerges) meta.merges.push_back(l + " " + r);
  meta.token_type.assign(meta.tokens.size(), 1);
  meta.token_type[kX] = meta.token_type[kXY] = meta.token_type[kEnd] = 3;  // control
  meta.token_type[kHi] = 4;                                                 // user-defined
  meta.bos_token_id = kEnd;
  meta.padding_token_id = kX;
  meta.chat_template = "{% for m in messages %}{{ m }}{% endfor %}";
  const BpeTokenizer from_gguf = BpeTokenizer::from_gguf(meta);
  CHECK(from_gguf.pad_id() == std::optional<uint32_t>(kX));
  CHECK(from_gguf.chat_template() == meta.chat_template);
  CHECK(from_gguf.encode(text) == reference.encode(text));
  CHECK(from_gguf.decode(Ids{kX, kHi}, true) == "hi!");  // control tokens are special, user-defined not
  CHECK(from_gguf.bos_id() == std::optional<uint32_t>(kEnd));
  // ignore_merges by the pre-tokenizer's name, as llama.cpp sets it (its llama3 type only).
  const std::vector<std::pair<const char*, bool>> ignores = {{"llama-bpe", true}, {"llama3", true},
                                                             {"llama-v3", true},  {"falcon3", true},
                                                             {"dbrx", false},     {"smaug-bpe", false},
                                                             {"gpt-2", false}};
  for (const auto& [pre, ignore] : ignores) {
    CAPTURE(pre);
    meta.pre = pre;
    CHECK(BpeTokenizer::from_gguf(meta).hf_tokenizer_json().at("model").at("ignore_merges") == ignore);
  }
}

// Writes `files` (name, content) into `dir`.
void write_files(const fs::path& dir, const std::vector<std::pair<std::string, std::string>>& files) {
  fs::create_directories(dir);
  for (const auto& [name, text] : files) write_text((dir / name).string(), text);
}

TEST_CASE("tokenizer: written as HF files (tokenizer.json, tokenizer_config.json) and read back, the same tokenizer") {
  const std::string text = "hello world, <x><y> abc 12 aaa <|endoftext|>hi! \xc3\xa9\xff\n\n  x";
  test::TempDir dir("tokenizer-hf-out");
  for (const char* pretokenizer : {"smollm", "llama-bpe", "gpt2"}) {
    for (bool add_bos : {false, true}) {
      CAPTURE(pretokenizer);
      CAPTURE(add_bos);
      BpeDefinition def = small_definition(pretokenizer);
      def.ignore_merges = std::string(pretokenizer) == "llama-bpe";
      def.pad_id = kX;
      def.add_bos = add_bos;
      def.unk_token = "<x>";
      def.chat_template = "{{ '<|im_start|>' }}";
      const BpeTokenizer original(def);
      const fs::path out = dir.path / fmt::format("{}-{}", pretokenizer, add_bos);
      write_files(out, tokenizer_files(original));
      CHECK(fs::exists(out / "tokenizer.json"));
      CHECK(fs::exists(out / "tokenizer_config.json"));
      const std::unique_ptr<Tokenizer> loaded = load_tokenizer(out.string());
      const auto& back = dynamic_cast<const BpeTokenizer&>(*loaded);
      CHECK(back.encode(text) == original.encode(text));
      CHECK(back.decode(original.encode(text)) == original.decode(original.encode(text)));
      CHECK(back.vocab_size() == original.vocab_size());
      CHECK(back.num_merges() == original.num_merges());
      CHECK(back.pretokenizer().name() == pretokenizer);
      CHECK(back.pretokenizer().patterns() == original.pretokenizer().patterns());
      CHECK(back.bos_id() == original.bos_id());
      CHECK(back.eos_id() == original.eos_id());
      CHECK(back.pad_id() == original.pad_id());
      CHECK(back.add_bos() == add_bos);
      CHECK(back.chat_template() == def.chat_template);
      CHECK(back.decode(Ids{kX, kHi}, true) == "hi!");  // special or not, as before
      // What HF reads besides: the post-processor puts BOS first exactly when add_bos.
      const nlohmann::json j = original.hf_tokenizer_json();
      CHECK(j.at("post_processor").is_null() == !add_bos);
      CHECK(j.at("model").at("ignore_merges") == def.ignore_merges);
      CHECK(j.at("model").at("unk_token") == "<x>");
    }
  }
  // The byte tokenizer's record is its description, which load_tokenizer also reads back; HF has no
  // form of it, so a checkpoint carries none.
  write_files(dir.path / "bytes", tokenizer_files(ByteTokenizer()));
  CHECK(load_tokenizer((dir.path / "bytes").string())->kind() == "bytes");
  CHECK(hf_tokenizer_files(ByteTokenizer()).empty());
}

TEST_CASE("tokenizer: BOS in front of a prompt, as the model's files say") {
  CHECK(ByteTokenizer().add_bos());
  CHECK_FALSE(BpeTokenizer(small_definition()).add_bos());
  // Llama 3's tokenizer.json puts BOS first through a TemplateProcessing post-processor (in a Sequence).
  test::TempDir dir("tokenizer-bos");
  nlohmann::json j = small_tokenizer_json(false);
  j["post_processor"] = nlohmann::json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}},
                                                {"Sequence": {"id": "A", "type_id": 0}}]}]})");
  write_text(dir.file("tokenizer.json"), j.dump());
  write_text(dir.file("tokenizer_config.json"), R"({"bos_token": "<x>"})");
  CHECK(load_tokenizer(dir.path.string())->add_bos());
  write_text(dir.file("tokenizer_config.json"), R"({"bos_token": "<|endoftext|>"})");  // another token first
  CHECK_FALSE(load_tokenizer(dir.path.string())->add_bos());
  j["post_processor"] = nullptr;
  write_text(dir.file("tokenizer.json"), j.dump());
  write_text(dir.file("tokenizer_config.json"), R"({"bos_token": "<x>", "add_bos_token": true})");
  CHECK(load_tokenizer(dir.path.string())->add_bos());
  // GGUF: tokenizer.ggml.add_bos_token.
  GgufTokenizerMetadata meta;
  meta.source = "small.gguf";
  meta.model = "gpt2";
  meta.pre = "smollm";
  meta.tokens = small_definition().tokens;
  meta.add_bos_token = true;
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(meta); }), "small.gguf: a prompt is to start with BOS"));
  meta.bos_token_id = kEnd;
  CHECK(BpeTokenizer::from_gguf(meta).add_bos());
}

TEST_CASE("tokenizer and model: the vocabularies must fit; \"model\" is the model's own tokenizer") {
  const ByteTokenizer bytes;
  check_tokenizer_fits_model(bytes, "bytes", 258, "m", "k");
  check_tokenizer_fits_model(bytes, "bytes", 320, "m", "k");   // the demo model pads to a multiple of 64
  check_tokenizer_fits_model(bytes, "bytes", 1024, "m", "k");  // padding up to a multiple of 1024 is accepted
  CHECK(error_of([&] { check_tokenizer_fits_model(bytes, "bytes", 49152, "smollm2.gguf", "data.tokenizer"); }) ==
        "the tokenizer 'bytes' has 258 tokens but the model 'smollm2.gguf' has vocab_size 49152: they belong to "
        "different models (hint: set data.tokenizer to \"model\" (the model's own tokenizer), or use a model made "
        "for this tokenizer)");
  CHECK(contains(error_of([&] { check_tokenizer_fits_model(bytes, "bytes", 257, "m", "k"); }), "has vocab_size 257"));

  test::TempDir dir("tokenizer-model");
  CHECK(resolve_tokenizer_spec("bytes", "small", "data.tokenizer") == "bytes");
  CHECK(resolve_tokenizer_spec("x/tokenizer.json", "small", "data.tokenizer") == "x/tokenizer.json");
  CHECK(resolve_tokenizer_spec("model", "some/model.gguf", "data.tokenizer") == "some/model.gguf");
  write_files(dir.path / "ckpt", tokenizer_files(BpeTokenizer(small_definition())));
  CHECK(resolve_tokenizer_spec("model", dir.file("ckpt"), "--tokenizer") == dir.file("ckpt"));
  CHECK(contains(error_of([&] { resolve_tokenizer_spec("model", "small", "data.tokenizer"); }),
            "data.tokenizer = \"model\" but the model 'small' has no tokenizer"));
}

TEST_CASE("tokenizer: malformed tokenizer.json files fail with one clear line") {
  test::TempDir dir("tokenizer-bad");
  const auto error_for = [&](const nlohmann::json& j) {
    const std::string path = dir.file("tokenizer.json");
    write_text(path, j.dump());
    return error_of([&] { BpeTokenizer::from_tokenizer_json(path); });
  };
  const nlohmann::json good = small_tokenizer_json(false);
  auto j = good;
  j.erase("model");
  CHECK(contains(error_for(j), "tokenizer.json: key 'model' is missing"));
  j = good;
  j["model"]["merges"].push_back("he zz");
  CHECK(contains(error_for(j), "merge 13 ('he zz'): its right part 'zz' is not in the vocabulary"));
  j = good;
  j["model"]["merges"].push_back("h l");
  CHECK(contains(error_for(j), "merge 13 ('h l'): its result 'hl' is not in the vocabulary"));
  j = good;
  j["model"]["merges"][2] = "hell";
  CHECK(contains(error_for(j), "model.merges[2] is 'hell', not two tokens separated by one space"));
  j = good;
  j["model"]["merges"][2] = nlohmann::json::array({"he"});
  CHECK(contains(error_for(j), "model.merges[2] is neither"));
  j = good;
  j["model"]["merges"].push_back("l l");
  CHECK(contains(error_for(j), "merge 13 ('l l') repeats an earlier merge"));
  j = good;
  j["model"]["vocab"].erase("ll");
  CHECK(contains(error_for(j), "no token has id 256"));
  j = good;
  j["model"]["vocab"]["zz"] = 5;
  CHECK(contains(error_for(j), "model.vocab gives id 5 to both"));
  j = good;
  j["model"]["vocab"]["zz"] = -1;
  CHECK(contains(error_for(j), "model.vocab['zz'] is not an id"));
  j = good;
  j["model"]["type"] = "WordPiece";
  CHECK(contains(error_for(j), "model.type is 'WordPiece', not 'BPE'"));
  // byte_fallback (SentencePiece-style) with the byte-level file's normalizer, pre-tokenizer or decoder.
  j = good;
  j["model"]["byte_fallback"] = true;
  CHECK(contains(error_for(j), "model.byte_fallback without a normalizer: the spaces would not become U+2581"));
  j["normalizer"] = nlohmann::json::parse(R"({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})");
  CHECK(contains(error_for(j), "with model.byte_fallback the decoder is {\"type\":\"ByteLevel\"}, not the SentencePiece "
                               "one"));
  j["decoder"] = nlohmann::json::parse(R"({"type": "Sequence", "decoders": [{"type": "Replace", "pattern":
      {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]})");
  CHECK(contains(error_for(j), "with model.byte_fallback the pre_tokenizer is 'Sequence'"));
  j["normalizer"] = nlohmann::json::parse(R"({"type": "Replace", "pattern": {"String": " "}, "content": "_"})");
  CHECK(contains(error_for(j), "with model.byte_fallback the normalizer is {"));
  // Normalizers: none or NFC (alone or a Sequence of NFC only) are applied; any other is refused by type.
  for (const char* type : {"NFD", "NFKC", "NFKD", "Lowercase", "Strip", "Replace", "Prepend", "BertNormalizer"}) {
    CAPTURE(type);
    j = good;
    j["normalizer"] = {{"type", type}};
    const std::string message = error_for(j);
    CHECK(contains(message, fmt::format("tokenizer.json: normalizer.type is '{}', a normalizer this build does not "
                                        "apply", type)));
    CHECK(contains(message, "encode this model's text with HF tokenizers"));
  }
  j = good;
  j["normalizer"] = nlohmann::json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]})");
  CHECK(contains(error_for(j), "tokenizer.json: normalizer is a Sequence of [NFC, Lowercase]; "
                               "normalizer.normalizers[1].type 'Lowercase' is a normalizer this build does not apply"));
  j = good;
  j["normalizer"] = {{"type", "Sequence"}};
  CHECK(contains(error_for(j), "normalizer.normalizers is missing or not a list"));
  for (const char* accepted : {R"({"type": "NFC"})", R"({"type": "Sequence", "normalizers": [{"type": "NFC"}]})",
                               R"({"type": "Sequence", "normalizers": []})"}) {
    CAPTURE(accepted);
    j = good;
    j["normalizer"] = nlohmann::json::parse(accepted);
    const BpeTokenizer tok = BpeTokenizer::from_tokenizer_json_text(j.dump(), "tokenizer.json");
    CHECK(tok.normalizer() == (j["normalizer"].contains("normalizers") && j["normalizer"]["normalizers"].empty()
                                   ? Normalizer::none
                                   : Normalizer::nfc));
  }
  j = good;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  CHECK(contains(error_for(j), "pre_tokenizer is a 'Whitespace' pre-tokenizer"));
  j = good;
  j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", true}};
  CHECK(contains(error_for(j), "the pre-tokenizer has no ByteLevel step"));
  j = good;
  j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "Digits"}});
  CHECK(contains(error_for(j), "pre_tokenizer.pretokenizers[2] ('Digits') comes after ByteLevel"));
  j = good;
  j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true;
  CHECK(contains(error_for(j), "add_prefix_space is true"));
  j = good;
  j["pre_tokenizer"] = nlohmann::json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Removed"}, {"type": "ByteLevel"}]})");
  CHECK(contains(error_for(j), "pre_tokenizer.pretokenizers[0].behavior is 'Removed'"));
  j = good;
  j["added_tokens"][0]["lstrip"] = true;
  CHECK(contains(error_for(j), "added_tokens[0].lstrip is true"));
  j = good;
  j["added_tokens"][0].erase("content");
  CHECK(contains(error_for(j), "tokenizer.json: \"added_tokens[0].content\" is missing"));
  j = good;
  j["decoder"] = {{"type", "Metaspace"}};
  CHECK(contains(error_for(j), "decoder is 'Metaspace', not ByteLevel"));
  j = good;
  for (int b = 0; b < 200; ++b) j["model"]["vocab"].erase(byte_symbol(static_cast<uint8_t>(b)));
  j["model"]["merges"] = nlohmann::json::array();
  for (int b = 0; b < 200; ++b) j["model"]["vocab"][fmt::format("<f{}>", b)] = b;
  CHECK(contains(error_for(j), "tokens for only 56 of the 256 byte characters"));
  write_text(dir.file("broken.json"), "{\"model\": ");
  CHECK(contains(error_of([&] { BpeTokenizer::from_tokenizer_json(dir.file("broken.json")); }), "not valid JSON"));
  CHECK(contains(error_of([&] { BpeTokenizer::from_tokenizer_json(dir.file("absent.json")); }), "cannot open"));
}

// One row per malformation of a valid tokenizer.json, and a fragment of the one line that must refuse
// it: an id past what the file defines is a gap, found without sizing a table by the id.
TEST_CASE("tokenizer: malformed tokenizer.json values are refused naming the key, as a table") {
  test::TempDir dir("tokenizer-table");
  struct Row {
    const char* what;
    std::function<void(nlohmann::json&)> mutate;
    const char* fragment;
  };
  const std::vector<Row> table = {
      {"a vocab id 2^31 - 1", [](auto& j) { j["model"]["vocab"]["zz"] = (int64_t{1} << 31) - 1; },
       "(the ids go up to 2147483647)"},
      {"a vocab id 2^26", [](auto& j) { j["model"]["vocab"]["zz"] = int64_t{1} << 26; },
       "(the ids go up to 67108864)"},
      {"a vocab id 2^31", [](auto& j) { j["model"]["vocab"]["zz"] = int64_t{1} << 31; },
       "model.vocab['zz'] is not an id"},
      {"an added id 2^31 - 1", [](auto& j) { j["added_tokens"][0]["id"] = (int64_t{1} << 31) - 1; },
       "(the ids go up to 2147483647)"},
      {"a normalizer 5", [](auto& j) { j["normalizer"] = 5; }, "it has a normalizer (the integer 5)"},
      {"a pre-tokenizer 5", [](auto& j) { j["pre_tokenizer"] = 5; },
       "tokenizer.json: \"pre_tokenizer\" must be an object, found the integer 5"},
      {"a step's type a number", [](auto& j) { j["pre_tokenizer"]["pretokenizers"][0]["type"] = 7; },
       "tokenizer.json: \"pre_tokenizer.pretokenizers[0].type\" must be a string, found the integer 7"},
      {"byte_fallback a string", [](auto& j) { j["model"]["byte_fallback"] = "no"; },
       "tokenizer.json: \"model.byte_fallback\" must be true or false, found a string \"no\""},
      {"a decoder list", [](auto& j) { j["decoder"] = nlohmann::json::array({1}); },
       "tokenizer.json: \"decoder\" must be an object, found an array of 1"},
      {"an added token's content a number", [](auto& j) { j["added_tokens"][1]["content"] = 3; },
       "tokenizer.json: \"added_tokens[1].content\" must be a string, found the integer 3"},
  };
  for (const Row& row : table) {
    CAPTURE(row.what);
    nlohmann::json j = small_tokenizer_json(false);
    row.mutate(j);
    const std::string path = dir.file("tokenizer.json");
    write_text(path, j.dump());
    const std::string message = test::message_of([&] { BpeTokenizer::from_tokenizer_json(path); });
    INFO("message: ", message);
    CHECK(contains(message, path));
    CHECK(contains(message, row.fragment));
    CHECK(!contains(message, "unexpected error"));
    CHECK(!contains(message, "json.exception"));
  }
  // A number out of double's range is invalid JSON to the parser: refused naming the file.
  const std::string path = dir.file("tokenizer.json");
  write_text(path, R"({"model": {"vocab": {"a": 1e400}}})");
  const std::string message = test::message_of([&] { BpeTokenizer::from_tokenizer_json(path); });
  CHECK(contains(message, "tokenizer.json: not valid JSON"));
  CHECK(!contains(message, "json.exception"));
}

TEST_CASE("tokenizer: a definition with scores derives its merges; scores beside merges, of another count or not finite are refused") {
  BpeDefinition def = small_definition();
  def.merges.clear();
  def.scores.assign(def.tokens.size(), 0.0);
  for (size_t id = 256; id < def.tokens.size(); ++id) def.scores[id] = -double(id);  // the list's order
  const BpeTokenizer from_scores(def);
  CHECK(from_scores.num_merges() >= static_cast<int64_t>(kMerges.size()));
  CHECK(from_scores.encode("hello world") == BpeTokenizer(small_definition()).encode("hello world"));
  const auto refusal = [](BpeDefinition d) { return error_of([&] { BpeTokenizer{std::move(d)}; }); };
  BpeDefinition both = def;
  both.merges = kMerges;
  CHECK(contains(refusal(both), "small vocabulary: the vocabulary has scores, from which the merges come, and 13 merges besides"));
  BpeDefinition short_scores = def;
  short_scores.scores.pop_back();
  CHECK(contains(refusal(short_scores), "small vocabulary: 272 scores for 273 tokens"));
  BpeDefinition nan_score = def;
  nan_score.scores[260] = std::nan("");
  CHECK(contains(refusal(nan_score), "small vocabulary: the score of token 260"));
}

TEST_CASE("tokenizer: malformed GGUF metadata fails with one clear line") {
  GgufTokenizerMetadata good;
  good.source = "m.gguf";
  good.model = "gpt2";
  good.pre = "gpt2";
  good.tokens = small_definition().tokens;
  for (const auto& [l, r] : kMerges) good.merges.push_back(l + " " + r);
  auto m = good;
  m.model = "t5";
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "m.gguf: tokenizer.ggml.model is 't5'"));
  // A SentencePiece vocabulary ("llama"): scores, one a token, finite; no merges of its own.
  m = good;
  m.model = "llama";
  m.merges.clear();
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "tokenizer.ggml.scores has 0 entries for 273 tokens"));
  m.scores.assign(m.tokens.size(), -1.0);
  CHECK_NOTHROW(BpeTokenizer::from_gguf(m));
  m.scores[7] = std::nan("");
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "tokenizer.ggml.scores[7]"));
  m.scores[7] = -1.0;
  m.unknown_token_id = 273;
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "unknown_token_id = 273 is outside the vocabulary"));
  m.unknown_token_id.reset();
  m.merges = {"a b"};
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "also has 1 tokenizer.ggml.merges"));
  m = good;
  m.pre = "";
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "tokenizer.ggml.pre is missing"));
  m = good;
  m.pre = "deepseek-llm";
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }),
            "pre-tokenizer 'deepseek-llm' is not one this build knows"));
  m = good;
  m.token_type = {1, 1};
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "token_type has 2 entries for 273 tokens"));
  m = good;
  m.merges.push_back("x");
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "tokenizer.ggml.merges[13] is 'x'"));
  m = good;
  m.eos_token_id = 273;
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "the EOS id 273 is outside the vocabulary of 273"));
  m = good;
  m.tokens[270] = m.tokens[5];
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "appears twice, as ids 5 and 270"));
  m = good;
  m.tokens.clear();
  CHECK(contains(error_of([&] { BpeTokenizer::from_gguf(m); }), "tokenizer.ggml.tokens is missing or empty"));
}

TEST_CASE("tokenizer: load_tokenizer, chunkwise encode and tokenize with a BPE tokenizer") {
  test::TempDir dir("tokenizer-tools");
  write_text(dir.file("tokenizer.json"), small_tokenizer_json(true).dump());
  CHECK(load_tokenizer("bytes")->kind() == "bytes");
  write_text(dir.file("record.json"), ByteTokenizer().to_json().dump());  // a run directory's record
  CHECK(load_tokenizer(dir.file("record.json"))->kind() == "bytes");
  CHECK(contains(error_of([&] { load_tokenizer(dir.file("missing")); }), "no such file or directory"));
  write_text(dir.file("m.gguf"), "not a gguf file");  // read by model/gguf.h, which names the file
  const std::string gguf_error = error_of([&] { load_tokenizer(dir.file("m.gguf")); });
  CHECK(contains(gguf_error, dir.file("m.gguf")));
  fs::create_directories(dir.path / "empty");
  CHECK(contains(error_of([&] { load_tokenizer(dir.file("empty")); }), "holds no tokenizer.json"));

  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.file("tokenizer.json"));
  write_text(dir.file("lines.txt"), "hello world\n\nabc<x>\n12");  // the last line has no newline
  std::ostringstream out;
  CHECK(encode_lines(*tok, dir.file("lines.txt"), out) == 4);
  CHECK(out.str() == fmt::format("{} {}\n\n97 {} {}\n49 50\n", kHello, kSpaceWorld, kBc, kX));
  // --separator: the pieces between its occurrences, each keeping its newlines; a final one ends the
  // last piece rather than starting an empty one.
  write_text(dir.file("pieces.txt"), "hello world\n==\n\nabc<x>\n12\n==\n");
  const auto ids_line = [&](std::string_view piece) {
    std::vector<uint32_t> ids;
    tok->encode_into(piece, ids);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += fmt::format("{}{}", i ? " " : "", ids[i]);
    return line + "\n";
  };
  std::ostringstream pieces;
  CHECK(encode_lines(*tok, dir.file("pieces.txt"), pieces, "\n==\n") == 2);
  CHECK(pieces.str() == ids_line("hello world") + ids_line("\nabc<x>\n12"));
  CHECK(contains(error_of([&] {
                   std::ostringstream o;
                   encode_lines(*tok, dir.file("pieces.txt"), o, "");
                 }),
                 "the separator is empty"));

  // Shards: BOS (named, since this tokenizer.json has no config beside it) before each document.
  write_text(dir.file("a.txt"), "hello world");
  CHECK(contains(error_of([&] { tokenize_files(*tok, {dir.file("a.txt")}, dir.file("a.bin")); }),
            "has no BOS token"));
  TokenizeOptions options;
  options.bos_token = "<|endoftext|>";
  options.add_eos = true;
  options.eos_token = "<x>";
  const TokenizeCounts counts = tokenize_files(*tok, {dir.file("a.txt")}, dir.file("a.bin"), options);
  CHECK(counts.tokens == 4);
  TokenFileInfo info;
  CHECK(read_token_file(dir.file("a.bin"), TokenFormat::shard, tok->vocab_size(), &info) ==
        Ids{kEnd, kHello, kSpaceWorld, kX});
  CHECK(info.token_bytes == 2);
  options.bos_token = "hello world";
  CHECK(contains(error_of([&] { tokenize_files(*tok, {dir.file("a.txt")}, dir.file("a.bin"), options); }),
            "--bos-token 'hello world' is not one token"));

  // A vocabulary of more than 65536 tokens writes uint32 ids, even when these ids are small.
  BpeDefinition big = small_definition();
  for (int i = 0; i < 70000; ++i) big.tokens.push_back(fmt::format("<filler {}>", i));
  const BpeTokenizer big_tok(std::move(big));
  tokenize_files(big_tok, {dir.file("a.txt")}, dir.file("big.bin"));
  CHECK(read_token_file(dir.file("big.bin"), TokenFormat::shard, big_tok.vocab_size(), &info) ==
        Ids{kEnd, kHello, kSpaceWorld});
  CHECK(info.token_bytes == 4);
  const std::string raw = read_text(dir.file("big.bin"));
  uint32_t magic = 0;
  for (int i = 3; i >= 0; --i) magic = magic << 8 | static_cast<unsigned char>(raw[static_cast<size_t>(i)]);
  CHECK(magic == static_cast<uint32_t>(kShardMagicU32));
}

// The SmolLM2 tokenizer exported from its GGUF (tools/data/gguf_to_tokenizer_json.py) into
// .models/smollm2/, and HF tokenizers' ids of the corpus (tools/data/tokenizer_vs_hf.py --write-ids).
const fs::path kSmolLm2Dir = fs::path(CW_SOURCE_ROOT) / ".models" / "smollm2";
const fs::path kCorpus = fs::path(CW_SOURCE_ROOT) / "tests" / "data" / "tokenizer_corpus.txt";
const fs::path kCorpusIds = fs::path(CW_SOURCE_ROOT) / "tests" / "data" / "tokenizer_corpus.smollm2.ids";

// HF's ids of the corpus against `tok`'s, line by line.
void check_corpus_against_hf(const Tokenizer& tok, const char* what) {
  std::ostringstream out;
  const int64_t lines = encode_lines(tok, kCorpus.string(), out);
  std::istringstream got(out.str()), expected(read_text(kCorpusIds.string()));
  std::string got_line, expected_line;
  int64_t compared = 0;
  while (std::getline(expected, expected_line)) {
    REQUIRE(std::getline(got, got_line));
    CHECK_MESSAGE(got_line == expected_line, "corpus line ", compared + 1);
    ++compared;
  }
  CHECK(compared == lines);
  MESSAGE("SmolLM2 (", std::string(what), ") against HF tokenizers: ", compared, " corpus lines compared");
}

TEST_CASE("tokenizer: SmolLM2's vocabulary gives HF's ids on the corpus (needs .models/smollm2)" *
          doctest::skip(!fs::exists(kSmolLm2Dir / "tokenizer.json"))) {
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(kSmolLm2Dir.string());
  CHECK(tok->vocab_size() == 49152);
  CHECK(tok->bos_id() == std::optional<uint32_t>(1));  // <|im_start|>, from tokenizer_config.json
  check_corpus_against_hf(*tok, "tokenizer.json");
}

// The same vocabulary read straight from the model's GGUF metadata (model/gguf.h).
TEST_CASE("tokenizer: SmolLM2's GGUF gives HF's ids on the corpus (needs .models/SmolLM2-135M-Instruct.Q4_1.gguf)" *
          doctest::skip(!fs::exists(kSmolLm2Gguf))) {
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(kSmolLm2Gguf.string());
  CHECK(tok->vocab_size() == 49152);
  CHECK_FALSE(tok->add_bos());  // tokenizer.ggml.add_bos_token is false, as HF's SmolLM2 tokenizer
  check_corpus_against_hf(*tok, "GGUF");

  // Written as HF files (what a run directory and its checkpoints keep) and read back: the same ids.
  test::TempDir dir("tokenizer-smollm2-hf");
  write_files(dir.path, tokenizer_files(*tok));
  const std::unique_ptr<Tokenizer> back = load_tokenizer(dir.path.string());
  CHECK(back->bos_id() == std::optional<uint32_t>(1));
  CHECK(back->eos_id() == std::optional<uint32_t>(2));
  CHECK(dynamic_cast<const BpeTokenizer&>(*back).chat_template() ==
        dynamic_cast<const BpeTokenizer&>(*tok).chat_template());
  check_corpus_against_hf(*back, "GGUF, written as tokenizer.json and read back");
}

// A tokenizer.json with Qwen2's pipeline (Qwen2, Qwen2.5, Qwen3: normalizer NFC; a Split with Qwen2's
// regex, then ByteLevel without its regex; <|endoftext|>, <|im_start|>, <|im_end|>) on a small
// vocabulary trained with HF tokenizers, and HF's ids of the corpus and of lines written decomposed
// (NFD, conjoining jamo, U+212B, marks out of order, special tokens among combining marks): all made by
// tests/data/qwen_style_tokenizer.py.
const fs::path kData = fs::path(CW_SOURCE_ROOT) / "tests" / "data";
const fs::path kQwenStyleJson = kData / "qwen_style_tokenizer.json";
const fs::path kDecomposed = kData / "tokenizer_corpus_decomposed.txt";

// The lines of a file as encode_lines cuts them (at '\n' only, a final '\n' ending the last line).
std::vector<std::string> lines_of(const fs::path& path) {
  const std::string text = read_text(path);
  std::vector<std::string> lines;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size());
    lines.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return lines;
}

// Ids as a line of an .ids file.
std::string ids_text(const Ids& ids) {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) text += ' ';
    text += std::to_string(ids[i]);
  }
  return text;
}

TEST_CASE("tokenizer: SentencePiece-style tokenizer.json files (Gemma's, Llama 2's pipelines) give HF's ids") {
  // tests/data/spm_style_tokenizers.py: byte fallback, spaces as U+2581, no pre-tokenizer; the Llama 2
  // style prepends U+2581 to every stretch between added tokens and strips the first space when
  // decoding. Vocabularies trained on the corpus with a limited alphabet: rarer characters go through
  // the byte tokens.
  struct Style {
    const char* name;
    bool prepend;
    const char* bos;
  };
  for (const Style style : {Style{"gemma_style", false, "<bos>"}, Style{"llama2_style", true, "<s>"}}) {
    CAPTURE(style.name);
    const std::string json_path = (kData / fmt::format("{}_tokenizer.json", style.name)).string();
    const BpeTokenizer tok = BpeTokenizer::from_tokenizer_json(json_path);
    CHECK(tok.byte_fallback());
    CHECK(tok.pretokenizer().name() == "none");
    REQUIRE(tok.token_id("<0x0A>").has_value());
    CHECK(tok.decode(Ids{*tok.token_id("<0x0A>")}) == "\n");
    CHECK(tok.token_id(style.bos).has_value());
    // The written files read back as the same tokenizer (a checkpoint carries them).
    const BpeTokenizer back =
        BpeTokenizer::from_tokenizer_json_text(tok.hf_tokenizer_json().dump(), "written tokenizer.json");
    CHECK(back.byte_fallback());
    int64_t compared = 0, fallback = 0;
    for (const std::string name : {"tokenizer_corpus", "tokenizer_special_lines"}) {
      const std::vector<std::string> lines = lines_of(kData / fmt::format("{}.txt", name));
      const std::vector<std::string> expected = lines_of(kData / fmt::format("{}.{}.ids", name, style.name));
      REQUIRE(lines.size() == expected.size());
      std::vector<std::string> decoded;
      if (name == std::string("tokenizer_special_lines"))
        decoded = lines_of(kData / fmt::format("{}.{}.decoded", name, style.name));
      for (size_t i = 0; i < lines.size(); ++i) {
        CAPTURE(name);
        CAPTURE(i + 1);  // the line number
        const Ids ids = tok.encode(lines[i]);
        CHECK(ids_text(ids) == expected[i]);
        CHECK(back.encode(lines[i]) == ids);
        // HF's decode: the line itself for the corpus (the script checks), its recorded text for the
        // lines with special tokens (where the Llama 2 style's prepended U+2581 come back as spaces).
        CHECK(tok.decode(ids) == (decoded.empty() ? lines[i] : decoded[i]));
        for (uint32_t id : ids) fallback += tok.token_text(id).starts_with("<0x");
        ++compared;
      }
    }
    CHECK(compared == 58 + 6);
    CHECK(fallback > 100);  // the byte fallback is exercised
    // By hand: a space and a character without a token of its own. "a ☃": U+2581 for the space (with
    // Prepend one more in front), then the snowman's three UTF-8 bytes as byte tokens.
    const Ids snow = tok.encode("a \xe2\x98\x83");
    REQUIRE(snow.size() >= 3);
    const Ids tail(snow.end() - 3, snow.end());
    CHECK(tail == Ids{*tok.token_id("<0xE2>"), *tok.token_id("<0x98>"), *tok.token_id("<0x83>")});
    CHECK(tok.token_text(snow.front()).starts_with(style.prepend ? "\xe2\x96\x81" : "a"));
  }
}

// tests/data/spm_gguf_vocab.<style>.g<G>.json: GGUF metadata of a SentencePiece vocabulary (tokens,
// scores, types; no merges), as tests/data/spm_gguf_reference.py writes it.
GgufTokenizerMetadata sentencepiece_metadata(const std::string& style, int group) {
  std::ifstream in(kData / fmt::format("spm_gguf_vocab.{}.g{}.json", style, group));
  REQUIRE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  GgufTokenizerMetadata meta;
  meta.source = fmt::format("{} (g{})", style, group);
  meta.model = "llama";
  meta.tokens = j.at("tokens").get<std::vector<std::string>>();
  meta.scores = j.at("scores").get<std::vector<double>>();
  meta.token_type = j.at("token_type").get<std::vector<int32_t>>();
  meta.add_space_prefix = j.at("add_space_prefix").get<bool>();
  meta.unknown_token_id = j.at("unknown_token_id").get<uint32_t>();
  meta.bos_token_id = j.at("bos_token_id").get<uint32_t>();
  meta.eos_token_id = j.at("eos_token_id").get<uint32_t>();
  return meta;
}

TEST_CASE("tokenizer: a SentencePiece vocabulary from GGUF metadata (scores, no merges) gives llama.cpp's ids") {
  // The ids of tests/data/spm_gguf_reference.py's implementation of llama.cpp's loop (the pair whose
  // joined text is the token of the highest score, the leftmost among equal scores). With distinct
  // scores they are HF's ids of the same vocabulary's tokenizer.json; with scores shared by groups of
  // 64 tokens the leftmost rule decides, and 12 and 14 lines of them differ from HF's.
  for (const char* style : {"gemma_style", "llama2_style"}) {
    for (const int group : {1, 64}) {
      CAPTURE(style);
      CAPTURE(group);
      const GgufTokenizerMetadata meta = sentencepiece_metadata(style, group);
      const BpeTokenizer tok = BpeTokenizer::from_gguf(meta);
      CHECK(tok.byte_fallback());
      CHECK(tok.add_bos());  // llama.cpp's default for a SentencePiece vocabulary with a BOS token
      CHECK(tok.bos_id() == meta.bos_token_id);
      CHECK(tok.shifts_text() == *meta.add_space_prefix);
      int64_t compared = 0, differ_from_hf = 0;
      for (const std::string name : {"tokenizer_corpus", "tokenizer_special_lines"}) {
        const std::vector<std::string> lines = lines_of(kData / fmt::format("{}.txt", name));
        const std::vector<std::string> expected = lines_of(kData / fmt::format("{}.{}.gguf-g{}.ids", name, style, group));
        const std::vector<std::string> hf = lines_of(kData / fmt::format("{}.{}.ids", name, style));
        REQUIRE(lines.size() == expected.size());
        for (size_t i = 0; i < lines.size(); ++i) {
          CAPTURE(name);
          CAPTURE(i + 1);
          const Ids ids = tok.encode(lines[i]);
          CHECK(ids_text(ids) == expected[i]);
          if (name == std::string("tokenizer_corpus")) CHECK(tok.decode(ids) == lines[i]);
          differ_from_hf += expected[i] != hf[i];
          ++compared;
        }
      }
      CHECK(compared == 58 + 6);
      CHECK(differ_from_hf == (group == 1 ? 0 : std::string(style) == "gemma_style" ? 12 : 14));
    }
  }
}

TEST_CASE("tokenizer: SentencePiece merges by score, equal scores leftmost first, from a .gguf file") {
  // By hand: "abc" with the tokens ab and bc. ab's score above bc's: ab, then c; below: a, then bc;
  // equal: the leftmost pair, ab. Written as a .gguf file and read back (tokenizer.ggml.scores,
  // token_type, add_space_prefix false, add_bos_token false).
  struct Case {
    float ab, bc;
    std::vector<std::string> pieces;
  };
  const std::vector<std::string> tokens = {"<unk>", "a", "b", "c", "ab", "bc"};
  test::TempDir dir("spm-gguf");
  for (const Case& c : {Case{-1, -2, {"ab", "c"}}, Case{-2, -1, {"a", "bc"}}, Case{-1, -1, {"ab", "c"}}}) {
    CAPTURE(c.ab);
    CAPTURE(c.bc);
    test::GgufBuilder b;
    b.str("general.architecture", "llama");
    b.str("tokenizer.ggml.model", "llama");
    b.strings("tokenizer.ggml.tokens", tokens);
    std::string scores = test::raw<uint32_t>(6) + test::raw<uint64_t>(tokens.size());
    for (const float score : {0.0f, 0.0f, 0.0f, 0.0f, c.ab, c.bc}) scores += test::raw(score);
    b.kv("tokenizer.ggml.scores", 9, scores);
    std::string types = test::raw<uint32_t>(5) + test::raw<uint64_t>(tokens.size());
    for (const int32_t type : {2, 1, 1, 1, 1, 1}) types += test::raw(type);
    b.kv("tokenizer.ggml.token_type", 9, types);
    b.kv("tokenizer.ggml.add_space_prefix", 7, test::raw<uint8_t>(0));
    b.kv("tokenizer.ggml.add_bos_token", 7, test::raw<uint8_t>(0));
    b.u32("tokenizer.ggml.unknown_token_id", 0);
    const std::string path = test::write_file(dir, "spm.gguf", b.bytes());
    const BpeTokenizer tok = BpeTokenizer::from_gguf_file(path);
    CHECK_FALSE(tok.add_bos());
    CHECK_FALSE(tok.shifts_text());
    std::vector<std::string> pieces;
    for (uint32_t id : tok.encode("abc")) pieces.push_back(tok.token_text(id));
    CHECK(pieces == c.pieces);
    CHECK(tok.encode("<unk>") == Ids{0});  // the unknown token, matched in the text
    // A tokenizer.json written from it keeps the merges in rank order (HF then breaks the tie by it).
    const BpeTokenizer back = BpeTokenizer::from_tokenizer_json_text(tok.hf_tokenizer_json().dump(), "written");
    CHECK(back.encode("abc") == tok.encode("abc"));
  }
}

TEST_CASE("tokenizer: a Qwen2-style tokenizer.json (NFC, Qwen2's regex) gives HF's ids, decomposed text included") {
  const BpeTokenizer tok = BpeTokenizer::from_tokenizer_json(kQwenStyleJson.string());
  CHECK(tok.normalizer() == Normalizer::nfc);
  CHECK(tok.pretokenizer().name() == "qwen2");  // its Split regex is the named one
  CHECK(tok.vocab_size() == 800);
  CHECK(tok.token_id("<|im_end|>") == std::optional<uint32_t>(2));

  // Every line's ids (as text, so that a failure shows both lists) against HF's.
  int64_t compared = 0;
  for (const std::string name : {"tokenizer_corpus", "tokenizer_corpus_decomposed"}) {
    const std::vector<std::string> lines = lines_of(kData / fmt::format("{}.txt", name));
    const std::vector<std::string> expected = lines_of(kData / fmt::format("{}.qwen_style.ids", name));
    REQUIRE(lines.size() == expected.size());
    for (size_t i = 0; i < lines.size(); ++i) {
      CAPTURE(name);
      CAPTURE(i + 1);  // the line number
      const Ids ids = tok.encode(lines[i]);
      CHECK(ids_text(ids) == expected[i]);
      CHECK(tok.decode(ids) == nfc_normalize(lines[i]));  // HF's decode gives NFC(line) (the script checks)
      ++compared;
    }
  }
  CHECK(compared == 58 + 15);

  // Decomposed lines encode as their NFC forms; the same vocabulary without the normalizer encodes
  // their raw bytes, which HF's ids are not (so the comparison above can fail).
  nlohmann::json j = nlohmann::json::parse(read_text(kQwenStyleJson));
  j["normalizer"] = nullptr;
  const BpeTokenizer plain = BpeTokenizer::from_tokenizer_json_text(j.dump(), "qwen_style_tokenizer.json without NFC");
  CHECK(plain.normalizer() == Normalizer::none);
  const std::vector<std::string> decomposed = lines_of(kDecomposed);
  const std::vector<std::string> expected = lines_of(kData / "tokenizer_corpus_decomposed.qwen_style.ids");
  REQUIRE(decomposed.size() == 15);
  for (size_t i = 0; i < decomposed.size(); ++i) {
    CAPTURE(i + 1);
    const std::string composed = nfc_normalize(decomposed[i]);
    CHECK(composed != decomposed[i]);
    CHECK(tok.encode(decomposed[i]) == tok.encode(composed));
    CHECK(plain.encode(composed) == tok.encode(composed));
    CHECK(ids_text(plain.encode(decomposed[i])) != expected[i]);
  }
  // One by hand: "Cafe\u0301 au lait" is "Caf\u00e9 au lait"'s tokens, not those of "e" + U+0301.
  CHECK(decomposed[0] == "Cafe\xcc\x81 au lait");
  CHECK(tok.encode(decomposed[0]) == tok.encode("Caf\xc3\xa9 au lait"));
  CHECK(tok.encode("e\xcc\x81") == tok.encode("\xc3\xa9"));
  const std::optional<uint32_t> e_acute = tok.token_id("\xc3\x83\xc2\xa9");  // "Ã©": é as one token
  REQUIRE(e_acute);
  CHECK(tok.encode("\xc3\xa9") == Ids{*e_acute});
  MESSAGE("Qwen2-style tokenizer against HF tokenizers: ", compared, " lines compared");
}

}  // namespace
}  // namespace cw
