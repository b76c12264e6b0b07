// Fuzz target: an HF config.json (LlamaConfig::from_file, model/config.h), which parses the JSON
// and validates every field. from_file is the entry point that owns the JSON errors, so the bytes go
// to a scratch file.
#include <nlohmann/json.hpp>

#include "model/config.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  const std::string path = fuzz::write_scratch_file("config.json", {reinterpret_cast<const char*>(data), size});
  fuzz::refuse_quietly([&] {
    const LlamaConfig config = LlamaConfig::from_file(path);
    // What the engine computes from an accepted config must not overflow.
    (void)config.parameter_count();
    (void)config.to_json().dump();
  });
  return 0;
}
