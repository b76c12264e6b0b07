// A small byte-level BPE for the tools' tests (sample, eval): English merges, ChatML markers and a
// chat template, so prompts, chats and stop ids can be tested without a model file.
#pragma once

#include "model/tokenizer.h"

#include <fmt/format.h>

namespace cw::test {

// A byte-level BPE of 1100 tokens: the 256 byte symbols, a few merges of English, <|endoftext|>,
// the ChatML markers, and fillers up to 1100, so that the byte tokenizer (258 tokens, padding up to
// 1024 accepted) does not fit a model made for it.
constexpr int64_t kBpeVocab = 1100;

inline BpeDefinition test_bpe() {
  BpeDefinition def;
  def.source = "test BPE";
  for (int b = 0; b < 256; ++b) def.tokens.push_back(bytes_to_byte_level(std::string(1, static_cast<char>(b))));
  def.merges = {{"t", "h"}, {"th", "e"}, {"Ġ", "t"}, {"Ġt", "h"}, {"Ġth", "e"}, {"o", "x"}, {"Ġ", "f"}, {"Ġf", "ox"}};
  for (const auto& [l, r] : def.merges) def.tokens.push_back(l + r);
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    def.added.push_back({special, static_cast<uint32_t>(def.tokens.size()), true});
    def.tokens.push_back(special);
  }
  while (static_cast<int64_t>(def.tokens.size()) < kBpeVocab) {
    def.added.push_back({fmt::format("<filler {}>", def.tokens.size()), static_cast<uint32_t>(def.tokens.size()), false});
    def.tokens.push_back(def.added.back().content);
  }
  def.pretokenizer_patterns = Pretokenizer::named("smollm", "test").patterns();
  def.pretokenizer_name = "smollm";
  def.bos_id = 264;  // <|endoftext|>
  def.eos_id = 266;  // <|im_end|>
  def.chat_template =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
      "You are a test.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  return def;
}

}  // namespace cw::test
