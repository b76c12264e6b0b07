#include "engine/error.h"

namespace cw {

namespace {
std::string compose(const std::string& expression, const std::string& where, const std::string& message,
                    const std::string& hint) {
  std::string s = message;
  if (!expression.empty()) s += fmt::format(" [check `{}` failed at {}]", expression, where);
  if (!hint.empty()) s += fmt::format(" (hint: {})", hint);
  return s;
}
}  // namespace

Error::Error(std::string expression, std::string where, std::string message, std::string hint)
    : std::runtime_error(compose(expression, where, message, hint)),
      expression_(std::move(expression)),
      where_(std::move(where)),
      message_(std::move(message)),
      hint_(std::move(hint)) {}

void fail(const std::string& message, const std::string& hint) { throw Error("", "", message, hint); }

namespace detail {
void raise(const char* expression, const char* file, int line, std::string message, std::string hint) {
  throw Error(expression, fmt::format("{}:{}", file, line), std::move(message), std::move(hint));
}
}  // namespace detail

}  // namespace cw
