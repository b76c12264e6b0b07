// Tokenizers: text <-> token ids. One small interface (`Tokenizer`) and BPE (`BpeTokenizer`), in the
// byte-level form of the GPT-2 / Llama 3 / SmolLM / Qwen families and the SentencePiece form of
// Gemma 2, Llama 2 and Mistral 7B v0.1 (below); the demo's byte tokenizer implements the same
// interface in tools/data/tokenizer.h.
//
// Byte-level BPE, as HF `tokenizers` runs it (ids identical to it: tools/data/tokenizer_vs_hf.py):
//   1. Added tokens (special ones such as <|im_start|>, and any other added token) are cut out of the
//      text first: at the leftmost position where one occurs, the longest one there becomes its id.
//      As in HF, this is done twice: the tokens marked `normalized: false` (all special tokens in
//      practice) are matched on the raw text; each stretch between them is then normalized (step 2)
//      and the tokens marked `normalized: true` are matched on it, by their own normalized text.
//   2. The normalizer: none (GPT-2, Llama 3, SmolLM) or Unicode NFC (Qwen2, Qwen2.5, Qwen3; applied
//      with utf8proc, see `nfc_normalize`). A tokenizer.json with any other normalizer (NFD, NFKC,
//      NFKD, Lowercase, Strip, Replace, Prepend, BertNormalizer, ...) is refused.
//   3. The text between them is cut into pieces by the pre-tokenizer (model/pretokenizer.h).
//   4. Each piece's UTF-8 bytes become symbols: GPT-2's byte-to-unicode map gives every byte a
//      printable character (bytes that are printable themselves map to themselves; the other 68 to
//      U+0100 upwards). A vocabulary normally holds a token for each of those 256 one-character
//      strings, so any byte sequence can be encoded; a byte without one is dropped (or becomes the
//      unknown token where one is set), exactly as HF does. SmolLM2's lacks 21: 0xC0, 0xC1 and
//      0xF5-0xFF (never in UTF-8), 0xF1, 0xF2 (planes 4-12, unassigned) and six control characters.
//   5. BPE: while two adjacent symbols form a pair in the merge list, merge the pair of lowest rank
//      (the leftmost among equals); the merged symbol is the token of their concatenation. With
//      `ignore_merges` (Llama 3), a piece that is a token as a whole is that token without merging.
//   Pieces recur (" the", " of"), so their ids are cached.
// decode concatenates the tokens' bytes (a token's characters mapped back through the byte map; a
// token holding a character outside the map, which only an added token can, gives its UTF-8 text),
// so decode(encode(s)) == s for every byte string s whose bytes all have tokens (with NFC: and that is
// already in NFC, as ASCII is). A decoded byte string need not be valid UTF-8 (one token may hold half
// a character); `replace_invalid_utf8` makes text of it as HF's decode does.
//
// SentencePiece-style BPE (tokenizer.json's model.byte_fallback, as HF `tokenizers` runs it; ids
// identical to it: tests/data/spm_style_tokenizers.py). The same steps with three differences:
//   - the normalizer writes "▁" (U+2581) for every space (Replace), and with Prepend (Llama 2,
//     Mistral) one more "▁" in front of each stretch between added tokens that is not empty; there is
//     no pre-tokenizer, so a stretch is one piece;
//   - the symbols BPE starts from are the piece's characters, each its own token; a character
//     without one falls back to the tokens of its UTF-8 bytes, <0x00> ... <0xFF> (byte_fallback),
//     and to the unknown token where one of those is missing;
//   - decode writes a token's text with "▁" as a space and a byte token as its byte; with the
//     decoder's Strip(" ", 1, 0) (Llama 2, Mistral) the text's first space goes (the prepended one).
//
// A SentencePiece vocabulary in a GGUF file (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma)
// has scores, not merges; llama.cpp merges, at each step, the adjacent pair whose joined text is the
// token of the highest score, the leftmost among equal scores. `from_gguf` states that as merges:
// every split of a token into two tokens is a merge into it, ranked by the token's score, equal
// scores sharing a rank (BpeDefinition::scores), which the BPE loop applies leftmost first. One
// difference remains: a character without a token falls back to its bytes before merging (HF's rule,
// above), where llama.cpp keeps it and lets it merge by text; no vocabulary SentencePiece trains
// lacks the characters of its own pieces, so the ids are the same (tests/data/spm_gguf_reference.py,
// an independent implementation of llama.cpp's loop).
//
// Loaders: an HF tokenizer.json (`from_tokenizer_json`) and GGUF metadata (`from_gguf`, a plain
// struct that the GGUF reader fills). Each checks its file's structure and produces a `BpeDefinition`
// (plain vocabulary, merges, added tokens, pre-tokenizer); the constructor checks the vocabulary
// itself (duplicates, merges of unknown tokens, ids out of range). A malformed input fails with one
// line naming the file and what is wrong.
// Tests: tests/model/test_tokenizer.cpp; against HF on real vocabularies: tools/data/tokenizer_vs_hf.py.
#pragma once

#include "model/pretokenizer.h"

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace cw {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // "bytes", "bpe": what a run directory records as the tokenizer's kind.
  virtual std::string kind() const = 0;
  // Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  // The token that starts a document (written before each document of a shard) and the one that
  // ends it, where the tokenizer has them.
  virtual std::optional<uint32_t> bos_id() const = 0;
  virtual std::optional<uint32_t> eos_id() const = 0;
  // Whether the model expects BOS in front of a prompt (what HF's tokenizer(text) adds): the text
  // generation tools put it there.
  virtual bool add_bos() const = 0;

  // Appends the ids of `text` to `out`; adds no BOS/EOS of its own.
  virtual void encode_into(std::string_view text, std::vector<uint32_t>& out) const = 0;
  std::vector<uint32_t> encode(std::string_view text) const;
  // The bytes of the ids; fails on an id outside the vocabulary, naming its position.
  virtual std::string decode(std::span<const uint32_t> ids) const = 0;

  // A description for a run directory's record (kind, vocab_size, bos/eos ids, source).
  virtual nlohmann::json to_json() const = 0;
};

// ---- GPT-2's byte-to-unicode map ----

// The character (a code point) standing for byte b in byte-level vocabularies: b itself for
// '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF; the other 68 bytes, in increasing order, map to
// U+0100, U+0101, ... (so the space 0x20 is U+0120 'Ġ' and the newline 0x0A is U+010A 'Ċ').
uint32_t byte_to_unicode(uint8_t byte);
// The inverse: the byte a code point stands for, or -1 if it stands for none.
int byte_from_unicode(uint32_t code_point);
// The byte-level spelling of raw bytes (each byte's character, UTF-8 encoded), and back: nullopt
// when `token` holds a character that stands for no byte or is not valid UTF-8.
std::string bytes_to_byte_level(std::string_view bytes);
std::optional<std::string> byte_level_to_bytes(std::string_view token);

// `bytes` with every maximal invalid UTF-8 subsequence replaced by U+FFFD (Unicode's "substitution
// of maximal subparts", what Rust's String::from_utf8_lossy and Python's errors="replace" do, and so
// what HF's ByteLevel decoder returns).
std::string replace_invalid_utf8(std::string_view bytes);

// `bytes` in Unicode Normalization Form C (utf8proc: canonical decomposition, then canonical
// composition), what HF's NFC normalizer does to a string. HF's input is always valid UTF-8; here each
// maximal valid stretch is normalized on its own and invalid bytes are kept as they are, so a valid
// input gives exactly NFC and any byte string still encodes (byte-level BPE takes every byte).
std::string nfc_normalize(std::string_view bytes);

// ---- the plain inputs of a BPE tokenizer ----

struct AddedToken {
  std::string content;  // the text that stands for the token (not byte-level encoded)
  uint32_t id = 0;
  bool special = true;  // decode(..., skip_special) leaves special tokens out
  // HF's `normalized`: matched on the normalized text by its normalized content, after the tokens
  // without it have been matched on the raw text (only differs where there is a normalizer).
  bool normalized = false;
};

enum class Normalizer { none, nfc };

struct BpeDefinition {
  std::string source;                  // the file it came from, for messages
  std::vector<std::string> tokens;     // by id: byte-level spelling (GPT-2 map) of each token
  std::vector<std::pair<std::string, std::string>> merges;  // by rank: the two tokens merged
  // A SentencePiece-style vocabulary's scores, by id (then `merges` is empty): the constructor derives
  // the merges from them (above). Empty: merge i has rank i.
  std::vector<double> scores;
  std::vector<AddedToken> added;       // each also in `tokens` at its id, with the same text
  std::vector<std::string> pretokenizer_patterns;
  std::string pretokenizer_name;       // "smollm", or "tokenizer.json" for patterns read from one
  bool ignore_merges = false;
  Normalizer normalizer = Normalizer::none;  // applied to the text before pre-tokenization
  // The token for a byte the vocabulary has no token for (none: such a byte is dropped, as HF does);
  // with fuse_unk, a run of such bytes gives one.
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  // SentencePiece-style BPE (see the top of this file): tokens spelled as text with "▁" for the space,
  // the byte tokens <0x00> ... <0xFF>; spaces become "▁" before encoding, with prepend_metaspace a
  // "▁" goes in front of each stretch; decoding drops the text's first space with strip_leading_space.
  bool byte_fallback = false;
  bool prepend_metaspace = false;
  bool strip_leading_space = false;
  std::optional<uint32_t> bos_id, eos_id, pad_id;
  bool add_bos = false;       // a prompt starts with BOS (see Tokenizer::add_bos)
  std::string chat_template;  // the model's Jinja chat template, kept for tools that format chats
};

// What a GGUF file says of its tokenizer (the keys named beside each field); the GGUF reader fills
// it, `BpeTokenizer::from_gguf` checks it.
struct GgufTokenizerMetadata {
  std::string source;                       // the .gguf path, for messages
  std::string model;                        // tokenizer.ggml.model: "gpt2" for byte-level BPE,
                                            // "llama" for a SentencePiece vocabulary
  std::string pre;                          // tokenizer.ggml.pre: the pre-tokenizer's name
  std::vector<std::string> tokens;          // tokenizer.ggml.tokens
  std::vector<std::string> merges;          // tokenizer.ggml.merges: "left right"
  std::vector<int32_t> token_type;          // tokenizer.ggml.token_type (may be empty): 1 normal,
                                            // 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
  std::vector<double> scores;               // tokenizer.ggml.scores ("llama": each token's score)
  std::optional<uint32_t> unknown_token_id; // tokenizer.ggml.unknown_token_id
  std::optional<uint32_t> bos_token_id;     // tokenizer.ggml.bos_token_id
  std::optional<uint32_t> eos_token_id;     // tokenizer.ggml.eos_token_id
  std::optional<uint32_t> padding_token_id; // tokenizer.ggml.padding_token_id
  std::optional<bool> add_bos_token;        // tokenizer.ggml.add_bos_token (llama.cpp's default: true
                                            // for "llama", false for "gpt2")
  std::optional<bool> add_space_prefix;     // tokenizer.ggml.add_space_prefix ("llama"; default true):
                                            // a U+2581 in front of each stretch, dropped in decoding
  std::string chat_template;                // tokenizer.chat_template
};

// ---- byte-level BPE ----

class BpeTokenizer final : public Tokenizer {
 public:
  // Checks everything (see the .cpp's validate) and builds the tables; fails naming def.source.
  explicit BpeTokenizer(BpeDefinition def);
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer() override;
  // An HF tokenizer.json: model.vocab, model.merges ("a b" strings or [a, b] pairs), added_tokens,
  // normalizer (null, NFC, or a Sequence of NFC only), pre_tokenizer (ByteLevel, Split with behavior
  // Isolated, Digits, Sequence of them); or, with model.byte_fallback, the SentencePiece pipeline
  // (normalizer Replace(" ", "▁") after an optional Prepend("▁"), no pre_tokenizer, the decoder
  // Replace("▁", " "), ByteFallback, Fuse and an optional Strip(" ", 1, 0)); and whether
  // its post_processor (TemplateProcessing, alone or in a Sequence) puts the BOS token first; with
  // tokenizer_config.json beside it, its bos_token, eos_token, pad_token, add_bos_token and
  // chat_template.
  static BpeTokenizer from_tokenizer_json(const std::string& path);
  static BpeTokenizer from_tokenizer_json_text(const std::string& text, const std::string& source,
                                               const nlohmann::json* tokenizer_config = nullptr);
  // GGUF metadata; unknown (2), control (3) and user-defined (4) tokens are the added tokens. "gpt2": byte-level
  // BPE with its merges and pre-tokenizer; "llama": a SentencePiece vocabulary with scores (above).
  static BpeTokenizer from_gguf(const GgufTokenizerMetadata& meta);
  // A .gguf file's tokenizer.* metadata (model/gguf.h reads it) through from_gguf.
  static BpeTokenizer from_gguf_file(const std::string& path);

  std::string kind() const override { return "bpe"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  std::optional<uint32_t> bos_id() const override { return bos_id_; }
  std::optional<uint32_t> eos_id() const override { return eos_id_; }
  std::optional<uint32_t> pad_id() const { return pad_id_; }
  bool add_bos() const override { return add_bos_; }
  const std::string& chat_template() const { return chat_template_; }
  void encode_into(std::string_view text, std::vector<uint32_t>& out) const override;
  // Special tokens come out as their text.
  std::string decode(std::span<const uint32_t> ids) const override { return decode(ids, false); }
  std::string decode(std::span<const uint32_t> ids, bool skip_special) const;
  nlohmann::json to_json() const override;

  // The tokenizer as HF files: tokenizer.json (the whole vocabulary, merges by rank, added tokens,
  // the pre-tokenizer as one Split (Isolated) per pattern then ByteLevel without its regex, a
  // ByteLevel decoder, a TemplateProcessing post-processor that puts BOS first when add_bos) and
  // tokenizer_config.json (bos/eos/pad tokens, add_bos_token, chat_template,
  // PreTrainedTokenizerFast). from_tokenizer_json reads them back to the same ids, and HF
  // `tokenizers` / transformers' AutoTokenizer load them (tests/model/test_tokenizer.cpp,
  // tools/bench/run_vs_hf.py). A run directory and its checkpoints carry them.
  nlohmann::json hf_tokenizer_json() const;
  nlohmann::json hf_tokenizer_config_json() const;

  // The id of a token given by its text (an added token's content, or a byte-level spelling).
  std::optional<uint32_t> token_id(std::string_view text) const;
  // The token's byte-level spelling (added tokens: their content).
  const std::string& token_text(uint32_t id) const;
  const Pretokenizer& pretokenizer() const { return pretokenizer_; }
  const std::string& source() const { return source_; }
  int64_t num_merges() const { return static_cast<int64_t>(merge_count_); }
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  Normalizer normalizer() const { return normalizer_; }
  // Whether byte b has a token of its own (if not, encode drops it or gives the unknown token).
  bool has_byte_token(uint8_t b) const { return byte_token_[b] != kNoToken; }
  bool byte_fallback() const { return byte_fallback_; }
  // SentencePiece's Prepend (a U+2581 in front of each stretch) or the decoder's Strip: then a
  // token's decoded bytes do not line up with the text's (the prepended U+2581 stands for no
  // character of it).
  bool shifts_text() const { return prepend_metaspace_ || strip_leading_space_; }

 private:
  struct Merge {
    uint32_t rank, merged_id;
    uint32_t order;  // its place in the definition's list (ranks may repeat), for writing it back
  };
  static uint64_t pair_key(uint32_t left, uint32_t right) { return uint64_t{left} << 32 | right; }
  // The ids of one pre-tokenized piece (cached).
  void encode_piece(std::string_view piece, std::vector<uint32_t>& out) const;
  void bpe(std::string_view piece, std::vector<uint32_t>& out) const;
  // One set of added tokens matched together (HF's split_trie, split_normalized_trie): the texts
  // with their ids, longest first.
  struct AddedMatcher {
    std::vector<std::pair<std::string, uint32_t>> texts;
    std::array<bool, 256> first_byte{};
    // The leftmost-longest text in text[from..): its position and index in texts, or npos.
    std::pair<size_t, size_t> find(std::string_view text, size_t from) const;
  };
  // A stretch between raw-matched added tokens: normalize, cut out the normalized-matched added
  // tokens, pre-tokenize and encode the rest.
  void encode_stretch(std::string_view text, std::vector<uint32_t>& out) const;
  // The normalizer's output for a stretch (NFC, or SentencePiece's "▁" for the space); `text` itself
  // when there is none (then `storage` is left empty).
  std::string_view normalize(std::string_view text, std::string& storage) const;
  // The symbols BPE starts from: one per byte (byte-level) or per character with byte fallback.
  template <class Push> void initial_symbols(std::string_view piece, Push&& push) const;
  void encode_pieces(std::string_view text, std::vector<uint32_t>& out) const;
  // The merges of a SentencePiece-style vocabulary, from its scores (by id).
  void merges_from_scores(const std::vector<double>& scores);

  std::string source_;
  std::vector<std::string> token_text_;   // byte-level spelling, by id
  std::vector<std::string> token_bytes_;  // what decode writes, by id
  std::vector<bool> special_;             // by id
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>> id_of_text_;
  std::unordered_map<uint64_t, Merge> merges_;
  size_t merge_count_ = 0;
  static constexpr uint32_t kNoToken = UINT32_MAX;
  // The id of each byte's token, or kNoToken: byte-level, its one-character token; SentencePiece-style,
  // <0xXX>.
  std::array<uint32_t, 256> byte_token_{};
  bool byte_fallback_ = false, prepend_metaspace_ = false, strip_leading_space_ = false;
  std::optional<uint32_t> unk_id_;
  bool fuse_unk_ = false;
  std::vector<AddedToken> added_;           // as given
  AddedMatcher raw_added_;                  // normalized == false: matched on the raw text
  AddedMatcher normalized_added_;           // normalized == true: their normalized text
  Normalizer normalizer_ = Normalizer::none;
  Pretokenizer pretokenizer_;
  bool ignore_merges_ = false;
  std::optional<uint32_t> bos_id_, eos_id_, pad_id_;
  bool add_bos_ = false;
  std::string chat_template_;

  // Piece -> ids, shared by the threads that encode (see the .cpp).
  struct PieceCache;
  std::unique_ptr<PieceCache> cache_;
};

}  // namespace cw
