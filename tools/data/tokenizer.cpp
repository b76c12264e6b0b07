#include "tools/data/tokenizer.h"

#include "engine/error.h"
#include "model/chat_template.h"
#include "model/gguf_llama.h"
#include "model/json_fields.h"
#include "tools/data/tokens.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <ostream>
#include <memory>

namespace cw {

namespace {

std::string read_whole_file(const std::string& path, const char* what) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) fail(fmt::format("{} file '{}': cannot open: {}", what, path, std::strerror(errno)), "check the path");
  std::string text;
  char buffer[1 << 16];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, f.get())) > 0) text.append(buffer, got);
  if (std::ferror(f.get()))
    fail(fmt::format("{} file '{}': read failed after {} bytes", what, path, text.size()),
         "check that it is a readable regular file");
  return text;
}

bool is_blank_line(std::string_view line) {
  for (char c : line)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n' && c != '\f' && c != '\v') return false;
  return true;
}

// Fails naming `source` and `key` unless j[key] is the integer `expected`.
void expect_integer(const nlohmann::json& j, const char* key, int64_t expected, const std::string& source) {
  if (!j.contains(key) || !j.at(key).is_number_integer())
    fail(fmt::format("tokenizer description '{}': key '{}' is missing or not an integer", source, key),
         "the run directory's tokenizer record is damaged; restore it or re-create the run");
  if (j.at(key).get<int64_t>() != expected)
    fail(fmt::format("tokenizer description '{}': key '{}' is {}, the byte tokenizer's is {}", source, key,
                     j.at(key).get<int64_t>(), expected),
         "the run was made with a different tokenizer; use data and a model of the same tokenizer");
}

}  // namespace

void ByteTokenizer::encode_into(std::string_view text, std::vector<uint32_t>& out) const {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(std::span<const uint32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (id != kBos && id != kEos) {
      fail(fmt::format("byte tokenizer: id {} at position {} is not a token (vocabulary size {})", id, i,
                       kVocabSize),
           "the model's padded vocabulary rows are not tokens; mask logits of ids >= 258 before sampling");
    }
  }
  return text;
}

nlohmann::json ByteTokenizer::to_json() const {
  return {{"name", kName},
          {"vocab_size", kVocabSize},
          {"bos_token_id", kBos},
          {"eos_token_id", kEos},
          {"description", "byte-level: ids 0-255 are the UTF-8 bytes of the text, 256 is BOS, 257 is EOS"}};
}

nlohmann::json tokenizer_json() { return ByteTokenizer().to_json(); }

ByteTokenizer ByteTokenizer::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object())
    fail(fmt::format("tokenizer description '{}' is not a JSON object", source),
         "the run directory's tokenizer record is damaged; restore it or re-create the run");
  if (!j.contains("name") || !j.at("name").is_string())
    fail(fmt::format("tokenizer description '{}': key 'name' is missing or not a string", source),
         "the run directory's tokenizer record is damaged; restore it or re-create the run");
  const std::string name = j.at("name").get<std::string>();
  if (name != kName)
    fail(fmt::format("tokenizer description '{}': key 'name' is '{}', but this build knows only '{}'", source, name,
                     kName),
         "the run was made with a different tokenizer; use data and a model of the byte tokenizer");
  expect_integer(j, "vocab_size", kVocabSize, source);
  expect_integer(j, "bos_token_id", kBos, source);
  expect_integer(j, "eos_token_id", kEos, source);
  return ByteTokenizer();
}

ByteTokenizer ByteTokenizer::from_file(const std::string& path) {
  const std::string text = read_whole_file(path, "tokenizer description");
  return from_json(json_parse(text, fmt::format("tokenizer description '{}'", path),
                               "the file is damaged; restore it or re-create the run"),
                   path);
}

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if ((c >> 5) == 0x6) {
      len = 2, cp = c & 0x1f, min = 0x80;
    } else if ((c >> 4) == 0xe) {
      len = 3, cp = c & 0x0f, min = 0x800;
    } else if ((c >> 3) == 0x1e) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;  // a continuation byte with no lead, or 0xf8..0xff
    }
    if (len > n - i) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return i;
      cp = cp << 6 | (s[i + k] & 0x3f);
    }
    // Overlong forms would give one character two encodings; surrogates are UTF-16's, not characters.
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += len;
  }
  return std::nullopt;
}

std::vector<std::string_view> split_documents(std::string_view text, bool split_on_blank_lines) {
  std::vector<std::string_view> docs;
  if (!split_on_blank_lines) {
    if (!text.empty()) docs.push_back(text);
    return docs;
  }
  size_t doc_begin = std::string_view::npos, doc_end = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    const size_t end = nl == std::string_view::npos ? text.size() : nl + 1;  // the line, its '\n' included
    if (is_blank_line(text.substr(pos, end - pos))) {
      if (doc_begin != std::string_view::npos) docs.push_back(text.substr(doc_begin, doc_end - doc_begin));
      doc_begin = std::string_view::npos;
    } else {
      if (doc_begin == std::string_view::npos) doc_begin = pos;
      doc_end = end;
    }
    pos = end;
  }
  if (doc_begin != std::string_view::npos) docs.push_back(text.substr(doc_begin, doc_end - doc_begin));
  return docs;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  namespace fs = std::filesystem;
  if (spec == ByteTokenizer::kName) return std::make_unique<ByteTokenizer>();
  const fs::path path(spec);
  if (path.extension() == ".gguf") return std::make_unique<BpeTokenizer>(BpeTokenizer::from_gguf_file(spec));
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path json = path / "tokenizer.json";
    if (!fs::exists(json, ec))
      fail(fmt::format("tokenizer directory '{}' holds no tokenizer.json", spec),
           "pass a directory with an HF tokenizer.json, the file itself, a .gguf model, or 'bytes'");
    return load_tokenizer(json.string());
  }
  if (!fs::exists(path, ec))
    fail(fmt::format("tokenizer '{}': no such file or directory", spec),
         "pass 'bytes', an HF tokenizer.json, a directory holding one, or a .gguf model");
  // A run directory's record of the byte tokenizer is also named tokenizer.json: tell them apart.
  const std::string text = read_whole_file(spec, "tokenizer");
  const nlohmann::json j = json_parse(text, fmt::format("tokenizer file '{}'", spec), "the file is damaged; download it again");
  if (j.is_object() && j.contains("name") && !j.contains("model"))
    return std::make_unique<ByteTokenizer>(ByteTokenizer::from_json(j, spec));
  return std::make_unique<BpeTokenizer>(BpeTokenizer::from_tokenizer_json(spec));
}

std::string resolve_tokenizer_spec(const std::string& spec, const std::string& model_source, const std::string& key) {
  namespace fs = std::filesystem;
  if (spec != kModelTokenizer) return spec;
  std::error_code ec;
  // A .gguf name that is not there still goes to the GGUF reader, whose error names the file.
  if (is_gguf_file(model_source) || fs::path(model_source).extension() == ".gguf" ||
      fs::exists(fs::path(model_source) / "tokenizer.json", ec))
    return model_source;
  fail(fmt::format("{} = \"{}\" but the model '{}' has no tokenizer (not a .gguf file, nor a directory holding "
                   "tokenizer.json)",
                   key, kModelTokenizer, model_source),
       fmt::format("set {} to \"bytes\", an HF tokenizer.json or a .gguf file", key));
}

void check_tokenizer_fits_model(const Tokenizer& tokenizer, const std::string& tokenizer_spec, int64_t model_vocab,
                                const std::string& model_name, const std::string& key) {
  const int64_t tokens = tokenizer.vocab_size();
  const int64_t padded = (tokens + kVocabPaddingMultiple - 1) / kVocabPaddingMultiple * kVocabPaddingMultiple;
  if (model_vocab >= tokens && model_vocab <= padded) return;
  fail(fmt::format("the tokenizer '{}' has {} tokens but the model '{}' has vocab_size {}: they belong to "
                   "different models",
                   tokenizer_spec, tokens, model_name, model_vocab),
       fmt::format("set {} to \"{}\" (the model's own tokenizer), or use a model made for this tokenizer", key,
                   kModelTokenizer));
}

std::vector<std::pair<std::string, std::string>> hf_tokenizer_files(const Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(&tokenizer);
  if (!bpe) return {};
  return {{"tokenizer.json", bpe->hf_tokenizer_json().dump() + "\n"},
          {"tokenizer_config.json", bpe->hf_tokenizer_config_json().dump(2) + "\n"}};
}

std::vector<std::pair<std::string, std::string>> tokenizer_files(const Tokenizer& tokenizer) {
  if (dynamic_cast<const BpeTokenizer*>(&tokenizer)) return hf_tokenizer_files(tokenizer);
  return {{"tokenizer.json", tokenizer.to_json().dump(2) + "\n"}};
}

TokenizeCounts tokenize_files(const std::vector<std::string>& inputs, const std::string& output_shard,
                              const TokenizeOptions& options) {
  return tokenize_files(ByteTokenizer(), inputs, output_shard, options);
}

namespace {

// The id of the document token named by `text`, or else the tokenizer's own; fails when neither exists.
uint32_t document_token(const Tokenizer& tokenizer, const std::string& text, std::optional<uint32_t> own,
                        const char* which, const char* flag) {
  if (text.empty()) {
    if (!own)
      fail(fmt::format("the tokenizer ({}) has no {} token", tokenizer.kind(), which),
           fmt::format("name the token to write with {} (e.g. {} \"<|endoftext|>\")", flag, flag));
    return *own;
  }
  // A token's text encodes to exactly that token when it is an added (special) token.
  const std::vector<uint32_t> ids = tokenizer.encode(text);
  if (ids.size() != 1)
    fail(fmt::format("{} '{}' is not one token of the tokenizer ({}): it encodes to {} ids", flag, text,
                     tokenizer.kind(), ids.size()),
         "name a special token of the tokenizer, e.g. <|endoftext|>");
  return ids[0];
}

}  // namespace

namespace {

// The shard tokenize builds: the ids and, one byte each, their flags (tools/data/tokens.h).
struct ShardBuilder {
  std::vector<uint32_t> ids;
  TokenFlags flags;

  explicit ShardBuilder(uint8_t carried) { flags.carried = carried; }
  // Appends one document: its ids, the first flagged as a document start; `loss`, if not empty, has
  // one flag per id (kFlagLoss or 0).
  void add_document(std::span<const uint32_t> doc, std::span<const uint8_t> loss = {}) {
    CW_CHECK(!doc.empty() && (loss.empty() || loss.size() == doc.size()), "a document of {} ids, {} loss flags",
             doc.size(), loss.size());
    const size_t first = ids.size();
    ids.insert(ids.end(), doc.begin(), doc.end());
    if (loss.empty())
      flags.bits.resize(ids.size(), 0);
    else
      flags.bits.insert(flags.bits.end(), loss.begin(), loss.end());
    flags.bits[first] |= kFlagDocStart;
  }
  void write(const std::string& path, const Tokenizer& tokenizer) const {
    write_token_shard(path, ids, tokenizer.vocab_size(), &flags);
  }
};

// The tokens written around each text document (tokenize_files, tokenize_jsonl).
struct DocumentTokens {
  uint32_t bos;
  std::optional<uint32_t> eos;

  DocumentTokens(const Tokenizer& tokenizer, const TokenizeOptions& options)
      : bos(document_token(tokenizer, options.bos_token, tokenizer.bos_id(), "BOS", "--bos-token")),
        eos(options.add_eos ? std::optional(document_token(tokenizer, options.eos_token, tokenizer.eos_id(), "EOS",
                                                           "--eos-token"))
                            : std::nullopt) {}
  // BOS, the text's ids, EOS if asked for.
  void append(const Tokenizer& tokenizer, std::string_view text, ShardBuilder& shard, TokenizeCounts& counts) const {
    std::vector<uint32_t> doc{bos};
    tokenizer.encode_into(text, doc);
    if (eos) doc.push_back(*eos);
    shard.add_document(doc);
    ++counts.documents;
    counts.bytes += static_cast<int64_t>(text.size());
  }
};

[[noreturn]] void fail_no_documents(const char* kind, const std::vector<std::string>& inputs, const std::string& why,
                                    const char* hint) {
  fail(fmt::format("{} inputs ('{}'{}) hold no document: {}", kind, inputs.front(),
                   inputs.size() > 1 ? fmt::format(" and {} more", inputs.size() - 1) : std::string(), why),
       hint);
}

}  // namespace

TokenizeCounts tokenize_files(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                              const std::string& output_shard, const TokenizeOptions& options) {
  const DocumentTokens around(tokenizer, options);
  TokenizeCounts counts;
  ShardBuilder shard(kFlagDocStart);
  for (const std::string& path : expand_token_paths(inputs, "text")) {
    const std::string text = read_whole_file(path, "text");
    if (options.require_utf8) {
      if (const auto bad = find_invalid_utf8(text))
        fail(fmt::format("text file '{}': invalid UTF-8 at byte offset {} (byte 0x{:02x})", path, *bad,
                         static_cast<unsigned char>(text[*bad])),
             "convert the file to UTF-8 (e.g. with iconv), or give chunkwise tokenize --keep-invalid-utf8 to "
             "tokenize its bytes as they are");
    }
    ++counts.files;
    for (std::string_view doc : split_documents(text, options.split_on_blank_lines))
      around.append(tokenizer, doc, shard, counts);
  }
  if (counts.documents == 0)
    fail_no_documents("text", inputs,
                      options.split_on_blank_lines ? "every file is empty or blank" : "every file is empty",
                      "give text files with content");
  counts.tokens = static_cast<int64_t>(shard.ids.size());
  shard.write(output_shard, tokenizer);
  return counts;
}

namespace {

// One line of a JSON Lines file, for errors: where it is and, in the hint, what a record looks like.
struct RecordLine {
  const std::string& path;
  int64_t number;
  const char* example;

  std::string where() const { return fmt::format("JSON Lines file '{}' line {}", path, number); }
  std::string hint() const {
    return fmt::format("each line must be one JSON object such as {}; fix or remove line {} (empty lines are skipped)",
                       example, number);
  }
};

// Calls visit(record, line) for each record of a JSON Lines file: each line that is not empty,
// checked to be UTF-8 and one JSON object.
template <class Visit>
void for_each_record(const std::string& path, const char* example, Visit visit) {
  const std::string text = read_whole_file(path, "JSON Lines");
  int64_t number = 0;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size());
    const std::string_view line = std::string_view(text).substr(pos, nl - pos);
    pos = nl + 1;
    const RecordLine at{path, ++number, example};
    if (is_blank_line(line)) continue;
    if (const auto bad = find_invalid_utf8(line))
      fail(fmt::format("{}: invalid UTF-8 at byte {} of the line (byte 0x{:02x})", at.where(), *bad + 1,
                       static_cast<unsigned char>(line[*bad])),
           "JSON Lines files are UTF-8: convert the file (e.g. with iconv), or fix the line");
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // parse_error, or out_of_range for a number like 1e400: nlohmann's byte offset when it has one.
      const auto* parse = dynamic_cast<const nlohmann::json::parse_error*>(&e);
      fail(parse ? fmt::format("{}: not valid JSON (at column {})", at.where(), parse->byte)
                 : fmt::format("{}: not valid JSON (a number out of range)", at.where()),
           at.hint());
    }
    if (!record.is_object())
      fail(fmt::format("{}: a JSON {}, not an object", at.where(), record.type_name()), at.hint());
    visit(record, at);
  }
}

// The string at object[key] (`what` names the object: "the record", "message 2"); fails naming the
// line when it is missing or not a string.
const std::string& string_field(const nlohmann::json& object, const std::string& key, const RecordLine& at,
                                const std::string& what) {
  const auto it = object.find(key);
  if (it == object.end()) fail(fmt::format("{}: {} has no \"{}\"", at.where(), what, key), at.hint());
  if (!it->is_string())
    fail(fmt::format("{}: {}'s \"{}\" is a JSON {}, not a string", at.where(), what, key, it->type_name()), at.hint());
  return it->get_ref<const std::string&>();
}

}  // namespace

TokenizeCounts tokenize_jsonl(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                              const std::string& output_shard, const std::string& field,
                              const TokenizeOptions& options) {
  if (field.empty()) fail("--field is empty", "name the records' text field, e.g. --field text");
  const DocumentTokens around(tokenizer, options);
  const std::string example = nlohmann::json({{field, "..."}}).dump();
  TokenizeCounts counts;
  ShardBuilder shard(kFlagDocStart);
  for (const std::string& path : expand_token_paths(inputs, "JSON Lines")) {
    ++counts.files;
    for_each_record(path, example.c_str(), [&](const nlohmann::json& record, const RecordLine& at) {
      ++counts.records;
      const std::string& text = string_field(record, field, at, "the record");
      if (!text.empty()) around.append(tokenizer, text, shard, counts);
    });
  }
  if (counts.documents == 0)
    fail_no_documents("JSON Lines", inputs, fmt::format("{} records, none with text in \"{}\"", counts.records, field),
                      "give JSON Lines files whose records hold text in the field --field names");
  counts.tokens = static_cast<int64_t>(shard.ids.size());
  shard.write(output_shard, tokenizer);
  return counts;
}

namespace {

// A conversation rendered: the text and the byte spans [begin, end) of what the loss trains on.
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant_spans;
};

// The chat as the template renders it, with each assistant message's content and closing <|im_end|>
// as a span. A message's turn is found as the text render() adds for it after a system message (so
// that no default system message comes with it); the default, if the template inserts one, is what
// precedes the turns. The turns laid end to end must give render()'s text exactly.
RenderedChat render_chat(const ChatMlTemplate& chat, const std::vector<ChatMessage>& messages) {
  RenderedChat r{chat.render(messages, /*add_generation_prompt=*/false), {}};
  const std::vector<ChatMessage> lead{{"system", ""}};
  const size_t lead_size = chat.render(lead, false).size();
  std::vector<std::string> turns;
  size_t turns_size = 0;
  for (const ChatMessage& m : messages) {
    std::vector<ChatMessage> pair = lead;
    pair.push_back(m);
    turns.push_back(chat.render(pair, false).substr(lead_size));
    turns_size += turns.back().size();
  }
  CW_CHECK(turns_size <= r.text.size(), "chat template: the turns rendered one by one are longer than the chat");
  size_t at = r.text.size() - turns_size;  // after the default system message, if any
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& turn = turns[i];
    CW_CHECK(r.text.compare(at, turn.size(), turn) == 0, "chat template: message {} is not rendered on its own", i);
    if (messages[i].role == "assistant") {
      // ChatML: <|im_start|>assistant\n{content}<|im_end|>\n; the span is {content}<|im_end|>.
      const std::string tail = messages[i].content + ChatMlTemplate::kEnd + "\n";
      CW_CHECK(turn.size() >= tail.size() && turn.compare(turn.size() - tail.size(), tail.size(), tail) == 0,
               "chat template: an assistant turn does not end with its content, {} and a newline",
               ChatMlTemplate::kEnd);
      r.assistant_spans.emplace_back(at + turn.size() - tail.size(), at + turn.size() - 1);
    }
    at += turn.size();
  }
  return r;
}

// Kept for each token of `ids`, the encoding of `r.text`: kFlagLoss where the token's bytes meet an
// assistant span. A token's bytes are those it decodes to, laid end to end from the text's start;
// they cover the text exactly unless the tokenizer dropped a byte it has no token for (then the
// tokens cannot be lined up with the spans: an error naming the line).
std::vector<uint8_t> assistant_mask(const Tokenizer& tokenizer, const RenderedChat& r, std::span<const uint32_t> ids,
                                    const RecordLine& at) {
  std::vector<uint8_t> mask(ids.size(), 0);
  size_t begin = 0, span = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const size_t end = begin + tokenizer.decode(ids.subspan(i, 1)).size();
    while (span < r.assistant_spans.size() && r.assistant_spans[span].second <= begin) ++span;
    if (span < r.assistant_spans.size() && r.assistant_spans[span].first < end) mask[i] = kFlagLoss;
    begin = end;
  }
  if (begin != r.text.size())
    fail(fmt::format("{}: the tokenizer has no token for some bytes of the conversation (its {} tokens spell {} of "
                     "its {} bytes), so the assistant's tokens cannot be found",
                     at.where(), ids.size(), begin, r.text.size()),
         "use the model's own tokenizer, or remove the characters it cannot encode");
  return mask;
}

// The ChatML template of the tokenizer, whose markers must be single tokens of it.
ChatMlTemplate chat_template_for(const Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(&tokenizer);
  if (!bpe || bpe->chat_template().empty())
    fail(fmt::format("--chat-jsonl: the {} tokenizer has no chat template", tokenizer.kind()),
         "give the chat model's tokenizer with --tokenizer (its .gguf file, or a directory with tokenizer.json and a "
         "tokenizer_config.json holding chat_template)");
  ChatMlTemplate chat = ChatMlTemplate::recognise(bpe->chat_template(), fmt::format("tokenizer '{}'", bpe->source()));
  for (const char* marker : {ChatMlTemplate::kStart, ChatMlTemplate::kEnd})
    if (tokenizer.encode(marker).size() != 1)
      fail(fmt::format("--chat-jsonl: {} is not one token of the tokenizer '{}'", marker, bpe->source()),
           "the chat template is ChatML but the vocabulary lacks its special tokens; the two do not belong together");
  return chat;
}

// The messages of a chat record, checked.
std::vector<ChatMessage> chat_messages(const nlohmann::json& record, const RecordLine& at) {
  const auto it = record.find("messages");
  if (it == record.end()) fail(fmt::format("{}: the record has no \"messages\"", at.where()), at.hint());
  if (!it->is_array() || it->empty())
    fail(fmt::format("{}: \"messages\" is {}, not a list of messages", at.where(),
                     it->is_array() ? "an empty list" : fmt::format("a JSON {}", it->type_name())),
         at.hint());
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < it->size(); ++i) {
    const nlohmann::json& m = (*it)[i];
    const std::string what = fmt::format("message {}", i + 1);
    if (!m.is_object()) fail(fmt::format("{}: {} is a JSON {}, not an object", at.where(), what, m.type_name()), at.hint());
    ChatMessage message{string_field(m, "role", at, what), string_field(m, "content", at, what)};
    if (message.role != "system" && message.role != "user" && message.role != "assistant")
      fail(fmt::format("{}: {} has role \"{}\", not one of system, user, assistant", at.where(), what, message.role),
           at.hint());
    messages.push_back(std::move(message));
  }
  return messages;
}

}  // namespace

TokenizeCounts tokenize_chat_jsonl(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                                   const std::string& output_shard) {
  const ChatMlTemplate chat = chat_template_for(tokenizer);
  // The assistant's tokens are found by laying each token's decoded bytes end to end over the text
  // (assistant_mask): a tokenizer that prepends a U+2581 to each stretch (Llama 2's, Mistral's) would
  // shift them.
  if (const auto* bpe = dynamic_cast<const BpeTokenizer*>(&tokenizer); bpe && bpe->shifts_text())
    fail(fmt::format("tokenize --chat-jsonl: the tokenizer '{}' puts a U+2581 in front of each stretch of text (the "
                     "SentencePiece Prepend of Llama 2 and Mistral), so its tokens cannot be lined up with the "
                     "conversation's characters to mark the assistant's",
                     bpe->source()),
         "mark the assistant's tokens with HF's apply_chat_template(..., return_assistant_tokens_mask=True)");
  const char* example = R"({"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]})";
  TokenizeCounts counts;
  ShardBuilder shard(kFlagDocStart | kFlagLoss);
  std::vector<uint32_t> ids;
  for (const std::string& path : expand_token_paths(inputs, "JSON Lines")) {
    ++counts.files;
    for_each_record(path, example, [&](const nlohmann::json& record, const RecordLine& at) {
      ++counts.records;
      const RenderedChat r = render_chat(chat, chat_messages(record, at));
      ids.clear();
      tokenizer.encode_into(r.text, ids);
      const std::vector<uint8_t> mask = assistant_mask(tokenizer, r, ids, at);
      shard.add_document(ids, mask);
      counts.loss_tokens += std::count(mask.begin(), mask.end(), kFlagLoss);
      ++counts.documents;
      counts.bytes += static_cast<int64_t>(r.text.size());
    });
  }
  if (counts.documents == 0)
    fail_no_documents("JSON Lines", inputs, "every file is empty", "give JSON Lines files with one conversation per line");
  counts.tokens = static_cast<int64_t>(shard.ids.size());
  shard.write(output_shard, tokenizer);
  return counts;
}

int64_t encode_lines(const Tokenizer& tokenizer, const std::string& text_file, std::ostream& out,
                     std::string_view separator) {
  if (separator.empty())
    fail("encode --separator '': the separator is empty", "give the text that ends each piece, or leave it out for lines");
  const std::string text = read_whole_file(text_file, "text");
  int64_t lines = 0;
  std::vector<uint32_t> ids;
  std::string line_out;
  for (size_t pos = 0; pos < text.size(); ++lines) {
    const size_t found = text.find(separator, pos);
    const size_t end = found == std::string::npos ? text.size() : found;
    ids.clear();
    tokenizer.encode_into(std::string_view(text).substr(pos, end - pos), ids);
    line_out.clear();
    for (size_t i = 0; i < ids.size(); ++i) fmt::format_to(std::back_inserter(line_out), "{}{}", i ? " " : "", ids[i]);
    line_out.push_back('\n');
    out << line_out;
    pos = end + separator.size();
  }
  if (!out) fail(fmt::format("encode: writing the ids of '{}' failed", text_file), "check the output's disk space");
  return lines;
}

void bench_encode(const Tokenizer& tokenizer, const std::string& text_file, int passes, std::ostream& out) {
  if (passes < 1) fail(fmt::format("encode --bench {}: the number of passes must be at least 1", passes));
  const std::string text = read_whole_file(text_file, "text");
  std::vector<std::string_view> lines;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size());
    lines.push_back(std::string_view(text).substr(pos, nl - pos));
    pos = nl + 1;
  }
  int64_t bytes = 0;
  for (std::string_view line : lines) bytes += static_cast<int64_t>(line.size());
  nlohmann::json report = {{"file", text_file}, {"lines", lines.size()}, {"bytes", bytes}};
  nlohmann::json timings = nlohmann::json::array();
  std::vector<uint32_t> ids;
  int64_t tokens = 0;
  for (int pass = 0; pass < passes; ++pass) {
    tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::string_view line : lines) {
      ids.clear();
      tokenizer.encode_into(line, ids);
      tokens += static_cast<int64_t>(ids.size());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    timings.push_back({{"seconds", seconds},
                       {"tokens_per_s", static_cast<double>(tokens) / seconds},
                       {"mb_per_s", static_cast<double>(bytes) / 1e6 / seconds}});
  }
  report["tokens"] = tokens;
  report["passes"] = timings;
  out << report.dump() << "\n";
}

}  // namespace cw
