// chunkwise engine: the one error type and the checks that raise it.
//
// Every failure in the project is a cw::Error carrying the failed expression, file:line, a message
// (from us or from the library that failed: CUDA, cuBLAS, cuDNN, NCCL all go through check helpers
// built on this) and, for failures a user can fix, a hint saying what to do. Checks stay on in
// release builds: a shape mismatch must never become a silent out-of-bounds read.
#pragma once

#include <stdexcept>
#include <string>

#ifndef __CUDACC__
#include <fmt/format.h>
// CW_FORMAT: fmt::format with its compile-time checked format strings.
#define CW_FORMAT(...) ::fmt::format(__VA_ARGS__)
#else
// nvcc's front end cannot compile fmt (its compile-time format checks), so CUDA sources never
// include it: there, the same "{}" messages are formatted at run time by format_runtime below.
#include <sstream>
#include <vector>
namespace cw::detail {
// Replaces each "{...}" with the next argument (format specs are ignored: CUDA sources use plain
// "{}"), "{{" and "}}" with braces.
template <class... Args> std::string format_runtime(const char* format, const Args&... args) {
  std::vector<std::string> texts;
  (
      [&] {
        std::ostringstream os;
        os << args;
        texts.push_back(os.str());
      }(),
      ...);
  std::string out;
  size_t next = 0;
  for (const char* p = format; *p; ++p) {
    if (p[0] == '{' && p[1] == '{') {
      out += '{';
      ++p;
    } else if (p[0] == '}' && p[1] == '}') {
      out += '}';
      ++p;
    } else if (p[0] == '{') {
      while (*p && *p != '}') ++p;
      if (next < texts.size()) out += texts[next++];
      if (!*p) break;
    } else {
      out += *p;
    }
  }
  return out;
}
}  // namespace cw::detail
#define CW_FORMAT(...) ::cw::detail::format_runtime(__VA_ARGS__)
#endif

namespace cw {

class Error : public std::runtime_error {
 public:
  Error(std::string expression, std::string where, std::string message, std::string hint);

  const std::string& expression() const { return expression_; }
  const std::string& where() const { return where_; }
  const std::string& message() const { return message_; }
  const std::string& hint() const { return hint_; }

 private:
  std::string expression_, where_, message_, hint_;
};

// A user-facing error with no failed expression: bad file, bad flag, bad config key. The message
// names the file or key; the hint says what to do.
[[noreturn]] void fail(const std::string& message, const std::string& hint = "");

namespace detail {
[[noreturn]] void raise(const char* expression, const char* file, int line, std::string message,
                        std::string hint = "");
}  // namespace detail

}  // namespace cw

// CW_CHECK(cond, fmt, args...): throws cw::Error naming the expression, file:line and the message.
#define CW_CHECK(cond, ...)                                                            \
  do {                                                                                 \
    if (!(cond)) ::cw::detail::raise(#cond, __FILE__, __LINE__, CW_FORMAT(__VA_ARGS__)); \
  } while (0)

// CW_CHECK_HINT(cond, hint, fmt, args...): as CW_CHECK, with what the user should do about it.
#define CW_CHECK_HINT(cond, hint, ...)                                                         \
  do {                                                                                         \
    if (!(cond)) ::cw::detail::raise(#cond, __FILE__, __LINE__, CW_FORMAT(__VA_ARGS__), hint); \
  } while (0)
