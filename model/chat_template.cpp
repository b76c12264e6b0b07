#include "model/chat_template.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <string_view>

namespace cw {

namespace {

// Jinja's string escapes undone; nullopt for an escape that is not one of the simple ones.
std::optional<std::string> unescape(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      out.push_back(text[i]);
      continue;
    }
    if (++i == text.size()) return std::nullopt;
    switch (text[i]) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case '\'': case '"': case '\\': out.push_back(text[i]); break;
      default: return std::nullopt;
    }
  }
  return out;
}

// Whether `text` lies inside one Jinja string literal: no unescaped quote (which would close it and
// open an expression), brace or '+'.
bool plain_literal(std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\') ++i;
    else if (std::string_view("'\"{}+").find(text[i]) != std::string_view::npos) return false;
  }
  return true;
}

// The default system message's text (see the header), if the template has one.
std::optional<std::string> find_default_system(std::string_view jinja) {
  const std::string_view opener = "<|im_start|>system";
  for (size_t at = jinja.find(opener); at != std::string_view::npos; at = jinja.find(opener, at + 1)) {
    size_t begin = at + opener.size();
    if (jinja.substr(begin, 1) == "\n") begin += 1;
    else if (jinja.substr(begin, 2) == "\\n") begin += 2;
    else continue;
    const size_t end = jinja.find(ChatMlTemplate::kEnd, begin);
    if (end == std::string_view::npos) return std::nullopt;
    const std::string_view text = jinja.substr(begin, end - begin);
    if (!plain_literal(text)) continue;  // an expression that inserts a message, not a default
    return unescape(text);
  }
  return std::nullopt;
}

}  // namespace

ChatMlTemplate ChatMlTemplate::recognise(const std::string& jinja, const std::string& source) {
  if (jinja.empty())
    fail(fmt::format("{} has no chat template", source),
         "pass the prompt already formatted for the model, without --chat");
  if (jinja.find(kStart) == std::string::npos || jinja.find(kEnd) == std::string::npos)
    fail(fmt::format("{}: the chat template is not ChatML (it has no {} ... {}); chunkwise applies ChatML "
                     "templates only",
                     source, kStart, kEnd),
         "pass the prompt already formatted for the model, without --chat");
  ChatMlTemplate t;
  t.default_system_ = find_default_system(jinja);
  return t;
}

std::string ChatMlTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string out;
  const auto turn = [&](const std::string& role, const std::string& content) {
    out += fmt::format("{}{}\n{}{}\n", kStart, role, content, kEnd);
  };
  // As the templates do it: inside their loop over messages, at the first one.
  if (default_system_ && !messages.empty() && messages.front().role != "system") turn("system", *default_system_);
  for (const ChatMessage& m : messages) turn(m.role, m.content);
  if (add_generation_prompt) out += fmt::format("{}assistant\n", kStart);
  return out;
}

}  // namespace cw
