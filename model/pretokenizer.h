// The pre-tokenizer of byte-level BPE: text cut into pieces by regular expressions before BPE.
//
// A pre-tokenizer is a sequence of split steps. Each step takes every piece the previous step made
// (the first takes the whole text) and cuts it at the matches of its pattern: the matches and the
// gaps between them both become pieces, in order, and empty pieces are dropped (HF `tokenizers`'
// Split with behavior "Isolated"). The pieces therefore always tile the text exactly; BPE never
// merges across a piece boundary.
//
// The patterns are PCRE2 regular expressions compiled in UTF mode with Unicode properties (\s, \p{L},
// \p{N} as Unicode defines them) and JIT-compiled. Invalid UTF-8 in the text never matches anything
// (PCRE2_MATCH_INVALID_UTF), so it lands in a gap piece of its own and is still encoded, byte by byte.
//
// Named pre-tokenizers (the values of GGUF's `tokenizer.ggml.pre` that this build knows; the regexes
// are those of the HF tokenizer.json files of these models; the other names on a line are those
// llama.cpp gives the same regexes):
//   gpt2       GPT-2's ByteLevel regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//              (also gpt-2, phi-2, mpt, olmo)
//   llama-bpe  Llama 3's Split regex (case-insensitive contractions, digits in groups of up to three,
//              newlines kept with the whitespace before them) (also llama3, llama-v3, falcon3, dbrx,
//              smaug-bpe)
//   qwen2      Llama 3's regex with every digit a piece of its own (\p{N} for \p{N}{1,3}): Qwen2, Qwen2.5,
//              Qwen3 (llama.cpp writes "qwen2" for all three) (also deepseek-r1-qwen, stablelm2)
//   smollm     every digit a piece of its own (\p{N}: HF's Digits(individual_digits)), then GPT-2's regex
//              (SmolLM, SmolLM2, StarCoder: HF Sequence[Digits, ByteLevel]) (also starcoder, refact,
//              codeshell)
//   deepseek-coder  DeepSeek Coder's steps: line breaks, letter runs and punctuation runs (each with
//              the whitespace character before it), CJK and Hangul runs, then every digit alone
// llama.cpp's vocabulary tests (its models/ggml-vocab-*.gguf with their .inp and .out) check these
// against llama.cpp's ids: tools/data/llama_cpp_vocab_check.py.
// Tested in tests/model/test_tokenizer.cpp; agreement with HF on real vocabularies:
// tools/data/tokenizer_vs_hf.py.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cw {

// The regexes of the named pre-tokenizers above.
extern const char* const kGpt2SplitRegex;
extern const char* const kLlama3SplitRegex;
extern const char* const kDigitsSplitRegex;
extern const char* const kQwen2SplitRegex;

class Pretokenizer {
 public:
  // Compiles each pattern; a pattern PCRE2 rejects fails naming `source`, the pattern and the offset.
  Pretokenizer(std::vector<std::string> patterns, std::string name, const std::string& source);
  // A named pre-tokenizer (see the header comment); an unknown name fails naming `source` and the
  // names this build knows.
  static Pretokenizer named(const std::string& name, const std::string& source);
  // Whether a BPE vocabulary with this named pre-tokenizer takes a piece that is a token whole
  // (ignore_merges): llama.cpp's rule for its llama3 type, which a GGUF file does not record.
  static bool named_ignores_merges(const std::string& name);
  static std::vector<std::string> known_names();

  Pretokenizer(Pretokenizer&&) noexcept;
  Pretokenizer& operator=(Pretokenizer&&) noexcept;
  ~Pretokenizer();

  // Appends the pieces of `text` to `pieces`, in order: views into `text` that tile it. Thread-safe.
  void split_into(std::string_view text, std::vector<std::string_view>& pieces) const;
  std::vector<std::string_view> split(std::string_view text) const;

  const std::string& name() const { return name_; }
  const std::vector<std::string>& patterns() const { return patterns_; }

 private:
  struct Compiled;

  std::string name_;
  std::vector<std::string> patterns_;
  std::vector<std::unique_ptr<Compiled>> compiled_;
};

}  // namespace cw
