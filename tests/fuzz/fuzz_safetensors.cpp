// Fuzz target: a safetensors file's header (model/safetensors.h): the 8-byte length, the JSON
// header and every entry's dtype, shape and byte range against the file's size. The reader only
// opens paths, so the bytes go to a scratch file.
#include "model/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  const std::string path =
      fuzz::write_scratch_file("model.safetensors", {reinterpret_cast<const char*>(data), size});
  fuzz::refuse_quietly([&] {
    const SafetensorsReader file(path);
    // Looking every entry up by name checks the index built beside the sorted entries.
    for (const SafetensorsEntry& e : file.entries()) {
      if (file.find(e.name) == nullptr) __builtin_trap();
    }
  });
  return 0;
}
