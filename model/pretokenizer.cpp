#include "model/pretokenizer.h"

#include "engine/error.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fmt/format.h>

namespace cw {

const char* const kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kDigitsSplitRegex = R"(\p{N})";
// Llama 3's with single digits: Qwen2's tokenizer.json and llama.cpp's qwen2 pre-tokenizer.
const char* const kQwen2SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";
// DeepSeek Coder's tokenizer.json: line breaks, letter runs, punctuation runs (each with the space
// before it), CJK and Hangul runs, then every digit alone.
const std::vector<const char*> kDeepseekCoderSplitRegexes = {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)",
                                                             R"([\x{4e00}-\x{9fa5}\x{0800}-\x{4e00}\x{ac00}-\x{d7ff}]+)",
                                                             R"(\p{N})"};

namespace {

struct NamedPretokenizer {
  const char* name;
  std::vector<const char*> patterns;
  bool ignore_merges = false;  // llama.cpp's llama3 type: a piece that is a token is taken whole
};

const std::vector<NamedPretokenizer>& named_pretokenizers() {
  // Every name llama.cpp's converter writes for one of these regexes (llama.cpp groups them into
  // pre-tokenizer types, each with one set of regexes); "gpt2" is GPT-2's HF name.
  static const std::vector<NamedPretokenizer> table = {
      {"gpt2", {kGpt2SplitRegex}},
      {"gpt-2", {kGpt2SplitRegex}},
      {"phi-2", {kGpt2SplitRegex}},
      {"mpt", {kGpt2SplitRegex}},
      {"olmo", {kGpt2SplitRegex}},
      {"llama-bpe", {kLlama3SplitRegex}, true},
      {"llama3", {kLlama3SplitRegex}, true},
      {"llama-v3", {kLlama3SplitRegex}, true},
      {"falcon3", {kLlama3SplitRegex}, true},
      {"dbrx", {kLlama3SplitRegex}},
      {"smaug-bpe", {kLlama3SplitRegex}},
      {"smollm", {kDigitsSplitRegex, kGpt2SplitRegex}},
      {"starcoder", {kDigitsSplitRegex, kGpt2SplitRegex}},
      {"refact", {kDigitsSplitRegex, kGpt2SplitRegex}},
      {"codeshell", {kDigitsSplitRegex, kGpt2SplitRegex}},
      {"qwen2", {kQwen2SplitRegex}},
      {"deepseek-r1-qwen", {kQwen2SplitRegex}},
      {"stablelm2", {kQwen2SplitRegex}},
      {"deepseek-coder", kDeepseekCoderSplitRegexes},
  };
  return table;
}

// Per-thread match state: the match data (one ovector pair is all a split needs: the patterns'
// groups are never read) and a JIT stack larger than PCRE2's 32 KB default, so a long run of
// whitespace against \s+(?!\S) cannot exhaust it.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  ThreadMatchState() {
    if (!data || !jit_stack || !context) fail("pre-tokenizer: out of memory creating PCRE2 match state");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~ThreadMatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof buffer);
  return n < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<const char*>(buffer));
}

}  // namespace

struct Pretokenizer::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Compiled() { pcre2_code_free(code); }
};

Pretokenizer::Pretokenizer(std::vector<std::string> patterns, std::string name, const std::string& source)
    : name_(std::move(name)), patterns_(std::move(patterns)) {
  for (const std::string& pattern : patterns_) {
    auto compiled = std::make_unique<Compiled>();
    int error = 0;
    PCRE2_SIZE offset = 0;
    compiled->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (!compiled->code)
      fail(fmt::format("{}: pre-tokenizer regex '{}' does not compile: {} at offset {}", source, pattern,
                       pcre2_message(error), offset),
           "the tokenizer file is damaged or uses a regex syntax PCRE2 does not know");
    // Without JIT (a platform PCRE2 has no JIT for) the interpreter gives the same matches, slower.
    compiled->jit = pcre2_jit_compile(compiled->code, PCRE2_JIT_COMPLETE) == 0;
    compiled_.push_back(std::move(compiled));
  }
}

Pretokenizer::Pretokenizer(Pretokenizer&&) noexcept = default;
Pretokenizer& Pretokenizer::operator=(Pretokenizer&&) noexcept = default;
Pretokenizer::~Pretokenizer() = default;

Pretokenizer Pretokenizer::named(const std::string& name, const std::string& source) {
  for (const NamedPretokenizer& entry : named_pretokenizers())
    if (name == entry.name)
      return Pretokenizer(std::vector<std::string>(entry.patterns.begin(), entry.patterns.end()), name, source);
  std::string known;
  for (const std::string& n : known_names()) known += (known.empty() ? "" : ", ") + n;
  fail(fmt::format("{}: pre-tokenizer '{}' is not one this build knows ({})", source, name, known),
       "add its regexes to model/pretokenizer.cpp, or use the model's HF tokenizer.json, which spells them out");
}

bool Pretokenizer::named_ignores_merges(const std::string& name) {
  for (const NamedPretokenizer& entry : named_pretokenizers())
    if (name == entry.name) return entry.ignore_merges;
  return false;
}

std::vector<std::string> Pretokenizer::known_names() {
  std::vector<std::string> names;
  for (const NamedPretokenizer& entry : named_pretokenizers()) names.emplace_back(entry.name);
  return names;
}

void Pretokenizer::split_into(std::string_view text, std::vector<std::string_view>& pieces) const {
  const size_t first = pieces.size();
  if (!text.empty()) pieces.push_back(text);
  if (compiled_.empty()) return;
  ThreadMatchState& state = thread_match_state();
  std::vector<std::string_view> next;
  // Step by step over the pieces of the previous step (those from `first` on in `pieces`).
  for (const auto& step : compiled_) {
    next.clear();
    for (size_t p = first; p < pieces.size(); ++p) {
      const std::string_view piece = pieces[p];
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
      size_t gap_begin = 0, start = 0;
      while (start < piece.size()) {
        const int rc =
            step->jit ? pcre2_jit_match(step->code, subject, piece.size(), start, 0, state.data, state.context)
                      : pcre2_match(step->code, subject, piece.size(), start, 0, state.data, state.context);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        // rc == 0: the ovector (one pair) is too small for the pattern's groups; the match is fine.
        if (rc < 0)
          fail(fmt::format("pre-tokenizer '{}': matching failed: {}", name_, pcre2_message(rc)),
               "the text may hold a pathological run for this regex; split it into smaller documents");
        const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
        const size_t match_begin = ovector[0], match_end = ovector[1];
        if (match_begin > gap_begin) next.push_back(piece.substr(gap_begin, match_begin - gap_begin));
        if (match_end > match_begin) {
          next.push_back(piece.substr(match_begin, match_end - match_begin));
          start = match_end;
        } else {
          // An empty match (none of our patterns has one, but a tokenizer.json may): step over one
          // character so the scan advances, keeping that character in the gap.
          start = match_end + 1;
          while (start < piece.size() && (static_cast<unsigned char>(piece[start]) & 0xc0) == 0x80) ++start;
        }
        gap_begin = std::max(gap_begin, match_end);
      }
      if (gap_begin < piece.size()) next.push_back(piece.substr(gap_begin));
    }
    pieces.resize(first);
    pieces.insert(pieces.end(), next.begin(), next.end());
  }
}

std::vector<std::string_view> Pretokenizer::split(std::string_view text) const {
  std::vector<std::string_view> pieces;
  split_into(text, pieces);
  return pieces;
}

}  // namespace cw
