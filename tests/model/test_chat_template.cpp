// Chat templates (model/chat_template.h): ChatML recognised in real templates' text, its default
// system message found or not, the exact layout rendered, other templates refused.
#include "engine/error.h"
#include "model/chat_template.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <string>

namespace cw {
namespace {

using test::contains;
using test::error_of;

// SmolLM2-135M-Instruct's template as its GGUF file stores it (tokenizer.chat_template): the newlines
// inside the Jinja strings are real newline characters.
const std::string kSmolLm2Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n"
    "' + message['content'] + '<|im_end|>' + '\n"
    "'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
    "' }}{% endif %}";

// A Qwen2-style template as a tokenizer_config.json holds it once parsed: the newlines are Jinja
// escapes (backslash, n), and the default system message is inserted by a separate branch.
const std::string kEscapedTemplate =
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You\\'re "
    "helpful.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + "
    "'\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- endif %}";

TEST_CASE("chat template: SmolLM2's ChatML, its default system message, the exact layout") {
  const ChatMlTemplate t = ChatMlTemplate::recognise(kSmolLm2Template, "SmolLM2.gguf");
  REQUIRE(t.default_system());
  CHECK(*t.default_system() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  // What transformers' apply_chat_template(messages, add_generation_prompt=True) gives for this template.
  CHECK(t.render({{"user", "What is 2 + 2?"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n");
  // A chat that starts with its own system message gets no default.
  CHECK(t.render({{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}}, false) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n");
  CHECK(t.render({}, true) == "<|im_start|>assistant\n");  // the default comes with the first message only
}

TEST_CASE("chat template: escaped newlines, an expression rather than a default, and no default at all") {
  const ChatMlTemplate escaped = ChatMlTemplate::recognise(kEscapedTemplate, "tokenizer_config.json");
  REQUIRE(escaped.default_system());
  CHECK(*escaped.default_system() == "You are Qwen, created by Alibaba Cloud. You're helpful.");
  CHECK(escaped.render({{"user", "x"}}, true) ==
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You're helpful.<|im_end|>\n"
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");

  // Only the message loop: no default system message.
  const std::string plain =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  const ChatMlTemplate t = ChatMlTemplate::recognise(plain, "plain");
  CHECK_FALSE(t.default_system());
  CHECK(t.render({{"user", "x"}}, true) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");

  // A system turn whose text is an expression is no default.
  const ChatMlTemplate expression = ChatMlTemplate::recognise(
      "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}", "expression");
  CHECK_FALSE(expression.default_system());
}

TEST_CASE("chat template: other templates and none are refused, naming the source") {
  const std::string llama3 =
      "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
      "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}";
  const std::string e = error_of([&] { ChatMlTemplate::recognise(llama3, "Llama-3.2-1B/tokenizer_config.json"); });
  CHECK(contains(e, "Llama-3.2-1B/tokenizer_config.json: the chat template is not ChatML"));
  CHECK(contains(e, "chunkwise applies ChatML templates only"));
  CHECK(contains(error_of([&] { ChatMlTemplate::recognise("", "x.gguf"); }), "x.gguf has no chat template"));
  CHECK(contains(error_of([&] { ChatMlTemplate::recognise("{{ '<|im_start|>' }}", "half"); }), "not ChatML"));
}

}  // namespace
}  // namespace cw
