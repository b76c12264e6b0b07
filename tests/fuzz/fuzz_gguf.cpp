// Fuzz target: a GGUF file's header, metadata and tensor table (model/gguf.h), then what chunkwise
// reads from that metadata: the model's config (model/gguf_llama.h) and its tokenizer
// (BpeTokenizer::from_gguf_file). The reader only opens paths, so the bytes go to a scratch file.
#include "model/gguf.h"
#include "model/gguf_llama.h"
#include "model/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  const std::string path = fuzz::write_scratch_file("model.gguf", {reinterpret_cast<const char*>(data), size});
  fuzz::refuse_quietly([&] {
    const GgufReader file(path);
    // Each reading of the metadata refuses on its own, so a bad config does not hide the tokenizer.
    fuzz::refuse_quietly([&] { (void)llama_config_from_gguf(file); });
    fuzz::refuse_quietly([&] { (void)BpeTokenizer::from_gguf_file(path); });
  });
  return 0;
}
