#include "tools/data/tokenizer.h"

#include "engine/error.h"
#include "model/gguf_llama.h"
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
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(fmt::format("tokenizer description '{}': not valid JSON at byte offset {}", path, e.byte),
         "the file is damaged; restore it or re-create the run");
  }
  return from_json(j, path);
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
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(fmt::format("tokenizer file '{}': not valid JSON at byte offset {}", spec, e.byte),
         "the file is damaged; download it again");
  }
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

TokenizeCounts tokenize_files(const Tokenizer& tokenizer, const std::vector<std::string>& inputs,
                              const std::string& output_shard, const TokenizeOptions& options) {
  const uint32_t bos = document_token(tokenizer, options.bos_token, tokenizer.bos_id(), "BOS", "--bos-token");
  const std::optional<uint32_t> eos =
      options.add_eos ? std::optional(document_token(tokenizer, options.eos_token, tokenizer.eos_id(), "EOS",
                                                     "--eos-token"))
                      : std::nullopt;
  TokenizeCounts counts;
  std::vector<uint32_t> ids;
  for (const std::string& path : expand_token_paths(inputs, "text")) {
    const std::string text = read_whole_file(path, "text");
    if (options.require_utf8) {
      if (const auto bad = find_invalid_utf8(text))
        fail(fmt::format("text file '{}': invalid UTF-8 at byte offset {} (byte 0x{:02x})", path, *bad,
                         static_cast<unsigned char>(text[*bad])),
             "convert the file to UTF-8 (e.g. with iconv), or turn the UTF-8 check off to tokenize its bytes as "
             "they are");
    }
    ++counts.files;
    for (std::string_view doc : split_documents(text, options.split_on_blank_lines)) {
      ids.push_back(bos);
      tokenizer.encode_into(doc, ids);
      if (eos) ids.push_back(*eos);
      ++counts.documents;
      counts.bytes += static_cast<int64_t>(doc.size());
    }
  }
  if (counts.documents == 0)
    fail(fmt::format("text inputs ('{}'{}) hold no document: every file is empty{}", inputs.front(),
                     inputs.size() > 1 ? fmt::format(" and {} more", inputs.size() - 1) : std::string(),
                     options.split_on_blank_lines ? " or blank" : ""),
         "give text files with content");
  counts.tokens = static_cast<int64_t>(ids.size());
  write_token_shard(output_shard, ids, tokenizer.vocab_size());
  return counts;
}

int64_t encode_lines(const Tokenizer& tokenizer, const std::string& text_file, std::ostream& out) {
  const std::string text = read_whole_file(text_file, "text");
  int64_t lines = 0;
  std::vector<uint32_t> ids;
  std::string line_out;
  for (size_t pos = 0; pos < text.size(); ++lines) {
    const size_t nl = text.find('\n', pos);
    const size_t end = nl == std::string::npos ? text.size() : nl;
    ids.clear();
    tokenizer.encode_into(std::string_view(text).substr(pos, end - pos), ids);
    line_out.clear();
    for (size_t i = 0; i < ids.size(); ++i) fmt::format_to(std::back_inserter(line_out), "{}{}", i ? " " : "", ids[i]);
    line_out.push_back('\n');
    out << line_out;
    pos = end + 1;
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
