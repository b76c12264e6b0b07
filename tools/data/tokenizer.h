// Tokenizers for the tools: the byte tokenizer (the demo's, which needs no vocabulary file),
// `load_tokenizer` (a tokenizer by name or file: "bytes", an HF tokenizer.json or a directory holding
// one, a .gguf model), and `chunkwise tokenize`: `tokenize_files` (text files), `tokenize_jsonl`
// (JSON Lines of text records) and `tokenize_chat_jsonl` (JSON Lines of conversations, with the loss
// mask of the assistant's tokens), each writing one llm.c shard and its flags file.
//
// The byte tokenizer:
// Ids 0..255 are the bytes of the text (id = byte value); BOS = 256 and EOS = 257. The vocabulary
// size is 258. The demo model's embedding has more rows (its config pads the vocabulary up to a
// multiple of 64 for the matmul shapes); that padding belongs to the model config, not here: ids
// 258 and up are never produced, and decode refuses them.
//
// encode copies bytes, so every text round-trips exactly, whatever its encoding. decode
// concatenates the bytes of the ids and skips BOS/EOS; it does not repair invalid UTF-8 (an
// untrained model can emit any byte sequence): such sequences come out as the bytes themselves.
//
// tokenize_files turns text files into one llm.c shard (tools/data/tokens.h) with any tokenizer. A
// document is one file, or, with split_on_blank_lines, each run of non-blank lines of a file (a blank
// line is empty or holds only spaces, tabs and CRs). Each document becomes BOS, the ids of its text
// exactly as in the file (line ends included), and optionally EOS. The shard holds uint16 ids when
// the vocabulary has at most 65536 tokens, else uint32. Files with no document (empty, or only blank lines when
// splitting) contribute nothing. Inputs are checked to be UTF-8 unless the option is turned off, so
// a binary file passed by mistake fails by name instead of becoming training data. Beside the shard
// goes its flags file (tools/data/tokens.h) marking where each document starts, so training finds
// the documents without relying on the BOS id (which --bos-token may have changed, and which the
// text may hold too, as a literal special token).
//
// JSON Lines (tokenize_jsonl): each line of a file is one record, a JSON object whose string field
// `field` ("text") is one document, written exactly as a text file's document (BOS, ids, optional
// EOS); a record whose text is empty contributes nothing. Empty lines (nothing but spaces, tabs and
// CRs) are skipped, so a file may end in blank lines. A line that is not valid UTF-8, not JSON, not
// an object, or lacks the field or holds a non-string in it fails naming the file and the line
// number; nothing is written then (the shard is written atomically, at the end).
//
// Chat (tokenize_chat_jsonl): each record is {"messages": [{"role": ..., "content": ...}, ...]} (other
// keys are ignored), roles system, user or assistant, at least one message. A conversation is
// rendered with the tokenizer's chat template (model/chat_template.h: the ChatML family; a chat that
// does not start with a system message gets the template's default one, as HF's templates insert it)
// and encoded as one text, without BOS: the template spells out every special token itself, as HF's
// apply_chat_template(tokenize=True) does. Each conversation is one document (its first token a
// document start in the flags) and the loss mask marks the assistant's tokens: those of each
// assistant message's content and its closing <|im_end|>, not the "<|im_start|>assistant\n" before
// it nor the newline after it. A token that straddles the edge of that span (the template's newline
// merged with a newline that opens the content) is marked. That is what HF's
// apply_chat_template(..., return_assistant_tokens_mask=True) marks with a ChatML template whose
// assistant content and <|im_end|> lie in a {% generation %} block; SmolLM2's own template has none
// (HF marks nothing with it), so the reference (tests/data/chat_reference.py) adds that block.
#pragma once

#include "model/tokenizer.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cw {

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr uint32_t kBos = 256;
  static constexpr uint32_t kEos = 257;
  static constexpr int64_t kVocabSize = 258;
  static constexpr const char* kName = "bytes";

  std::string kind() const override { return kName; }
  int64_t vocab_size() const override { return kVocabSize; }
  std::optional<uint32_t> bos_id() const override { return kBos; }
  std::optional<uint32_t> eos_id() const override { return kEos; }
  // Every document of a shard starts with BOS, so a prompt does too.
  bool add_bos() const override { return true; }
  // Appends the ids of `text` to `out`.
  void encode_into(std::string_view text, std::vector<uint32_t>& out) const override;
  // Skips BOS and EOS; fails on an id outside the vocabulary, naming its position.
  std::string decode(std::span<const uint32_t> ids) const override;

  // What a run directory records: {"name": "bytes", "vocab_size": 258, "bos_token_id": 256,
  // "eos_token_id": 257, ...}.
  nlohmann::json to_json() const override;
  // Checks a recorded description; fails naming `source` and the key that does not match.
  static ByteTokenizer from_json(const nlohmann::json& j, const std::string& source);
  static ByteTokenizer from_file(const std::string& path);
};

// A tokenizer by its spec: "bytes" (the byte tokenizer); an HF tokenizer.json, or a directory
// holding one (with tokenizer_config.json beside it for BOS/EOS); a run directory's tokenizer record
// of the byte tokenizer ({"name": "bytes", ...}); a .gguf model (its tokenizer metadata). Anything
// else fails naming the spec and what was expected.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

// ByteTokenizer().to_json().
nlohmann::json tokenizer_json();

// What "model" stands for in data.tokenizer and --tokenizer: the tokenizer of the model itself.
constexpr const char* kModelTokenizer = "model";

// A tokenizer spec with "model" replaced by `model_source` when that has a tokenizer (a .gguf file,
// or a directory holding tokenizer.json: an HF checkpoint, a run's checkpoint); other specs are
// returned unchanged. `key` names the setting in the error ("data.tokenizer", "--tokenizer").
std::string resolve_tokenizer_spec(const std::string& spec, const std::string& model_source, const std::string& key);

// A model's embedding may have more rows than its tokenizer has tokens (padding to a multiple of up
// to 1024 rows, as Megatron-style vocabularies do), never fewer: every id the tokenizer makes must
// be a row. Anything else means the two belong to different models. Fails naming both sizes, the
// tokenizer spec and the model; the hint names `key`, the setting that picked the tokenizer.
constexpr int64_t kVocabPaddingMultiple = 1024;
void check_tokenizer_fits_model(const Tokenizer& tokenizer, const std::string& tokenizer_spec, int64_t model_vocab,
                                const std::string& model_name, const std::string& key);

// The files (name, content) that record a tokenizer in a directory so that load_tokenizer(dir)
// gives it back: for the byte tokenizer its description as tokenizer.json; for BPE the HF files
// (tokenizer.json, tokenizer_config.json: BpeTokenizer::hf_tokenizer_json), which HF
// transformers loads too. A run directory keeps a copy rather than the path it came from, so it
// stays usable when the source moves or the model cache is cleared, and on another machine.
std::vector<std::pair<std::string, std::string>> tokenizer_files(const Tokenizer& tokenizer);
// The HF files alone (none for the byte tokenizer, which HF has no form of): what an exported
// checkpoint carries beside config.json and model.safetensors.
std::vector<std::pair<std::string, std::string>> hf_tokenizer_files(const Tokenizer& tokenizer);

// The byte offset where `text` stops being well-formed UTF-8 (a bad lead byte, a missing or stray
// continuation byte, an overlong form, a surrogate, or a code point above U+10FFFF), or none.
std::optional<size_t> find_invalid_utf8(std::string_view text);

// The documents of one file's text, as views into it (see the header comment).
std::vector<std::string_view> split_documents(std::string_view text, bool split_on_blank_lines);

struct TokenizeOptions {
  bool split_on_blank_lines = false;  // one document per paragraph instead of per file
  bool add_eos = false;               // EOS after each document (BOS before each is always written)
  bool require_utf8 = true;
  // The tokens written before / after each document, by their text (e.g. "<|endoftext|>"); empty:
  // the tokenizer's own BOS / EOS. A tokenizer without one needs it named here.
  std::string bos_token, eos_token;
};

struct TokenizeCounts {
  int64_t files = 0;      // input files read
  int64_t records = 0;    // JSON Lines: records read (empty lines are none)
  int64_t documents = 0;  // documents written (text: BOS written)
  int64_t bytes = 0;      // text bytes tokenized (document bytes; blank separator lines excluded)
  int64_t tokens = 0;     // ids in the shard
  int64_t loss_tokens = 0;  // chat: tokens the loss mask marks (the assistant's)
};

// Reads the inputs (paths or glob patterns, in order) and writes one shard atomically. Fails naming
// the file for an unreadable or non-UTF-8 input, and when the inputs hold no document at all.
TokenizeCounts tokenize_files(const std::vector<std::string>& inputs, const std::string& output_shard,
                              const TokenizeOptions& options = {});
TokenizeCounts tokenize_files(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                              const std::string& output_shard, const TokenizeOptions& options = {});
// JSON Lines of text records, one document each from the string field `field` (see the header
// comment). options.split_on_blank_lines does not apply (a record is one document); the input is
// always checked to be UTF-8 (JSON is).
TokenizeCounts tokenize_jsonl(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                              const std::string& output_shard, const std::string& field = "text",
                              const TokenizeOptions& options = {});
// JSON Lines of conversations, rendered with the tokenizer's chat template, with the loss mask of
// the assistant's tokens (see the header comment). Fails for a tokenizer without a ChatML template.
TokenizeCounts tokenize_chat_jsonl(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                                   const std::string& output_shard);

// `chunkwise encode`: the ids of each line of a text file, one line of space-separated ids per
// input line (lines end at '\n', which is not encoded; a last line without one counts; no BOS/EOS).
// With another `separator` (`--separator`), the pieces between its occurrences instead, each with its
// own newlines (a file of test texts such as llama.cpp's vocabulary tests, where one ends every text).
// Returns the number of lines (pieces).
int64_t encode_lines(const Tokenizer& tokenizer, const std::string& text_file, std::ostream& out,
                     std::string_view separator = "\n");

// `chunkwise encode --bench N` (a benchmark, not a test): encodes the lines of the file as
// encode_lines does, `passes` times on this thread, timing only the encoding (not reading, not
// printing). Prints one JSON object: lines, bytes, tokens, and per pass seconds, tokens/s and MB/s
// (the first pass starts with an empty piece cache, later ones find it warm).
void bench_encode(const Tokenizer& tokenizer, const std::string& text_file, int passes, std::ostream& out);

}  // namespace cw
