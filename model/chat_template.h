// Chat templates without a Jinja engine: the ChatML family, recognised in a model's template text
// (tokenizer.chat_template in a GGUF file, chat_template in tokenizer_config.json) and applied.
//
// ChatML lays out each message as
//     <|im_start|>{role}\n{content}<|im_end|>\n
// and a generation prompt as <|im_start|>assistant\n. A template is taken for ChatML when it holds
// both <|im_start|> and <|im_end|>; any other template is refused (naming its source), since
// rendering it without evaluating its Jinja would be a guess.
//
// Many ChatML templates (SmolLM2's, Qwen2's) insert a default system message when the chat does not
// start with one. That default is recognised as the literal text between "<|im_start|>system" plus
// a newline (written as such or as the escape \n) and the next <|im_end|>, when that text is plain
// (no unescaped quote, brace or '+': not an expression that inserts a message's content). Jinja string
// escapes in it (\n, \t, \', \", \\) are undone.
// Tests: tests/model/test_chat_template.cpp.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace cw {

struct ChatMessage {
  std::string role;  // system, user, assistant
  std::string content;
};

class ChatMlTemplate {
 public:
  static constexpr const char* kStart = "<|im_start|>";
  static constexpr const char* kEnd = "<|im_end|>";

  // Recognises ChatML in `jinja`; `source` names where the template came from, for the error.
  static ChatMlTemplate recognise(const std::string& jinja, const std::string& source);

  // The system message the template inserts when a chat starts without one, if any.
  const std::optional<std::string>& default_system() const { return default_system_; }

  // The messages laid out as ChatML (the default system message first when the first message is
  // not a system one and the template has a default), then, with add_generation_prompt, the start
  // of the assistant's turn.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

 private:
  std::optional<std::string> default_system_;
};

}  // namespace cw
