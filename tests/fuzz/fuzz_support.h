// What every fuzz target shares: where a parser that only reads paths gets its file, and the one
// outcome a bad input may have besides success.
//
// A parser meets a malformed input by throwing cw::Error (engine/error.h): that is the refusal the
// project promises, so a target catches it and returns. Anything else reaching libFuzzer is a
// finding: another exception (std::bad_alloc, a nlohmann::json or std::out_of_range escaping) ends in
// std::terminate, and a signal, an AddressSanitizer or UBSan report or an allocation above
// -malloc_limit_mb stops the run with the input that caused it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "engine/error.h"

namespace cw::fuzz {

// The fuzzer's bytes as text (the parsers that take text take std::string).
inline std::string as_text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// A directory of this process's own (mkdtemp under $TMPDIR, else /tmp), created on first use and
// removed at exit, so that parallel fuzzing jobs never read each other's files.
const std::string& scratch_dir();

// Writes `bytes` to scratch_dir()/name (replacing it) and returns its path; aborts if the write
// fails, since a target that cannot write its input would test nothing.
std::string write_scratch_file(const std::string& name, std::string_view bytes);

// Runs `parse`; a cw::Error is the expected refusal of a bad input and ends the input quietly.
template <class Parse> void refuse_quietly(Parse&& parse) {
  try {
    parse();
  } catch (const cw::Error&) {
  }
}

}  // namespace cw::fuzz
