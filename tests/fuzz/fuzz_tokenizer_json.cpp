// Fuzz target: an HF tokenizer.json (BpeTokenizer::from_tokenizer_json_text, model/tokenizer.h),
// in memory. A tokenizer that loads also encodes and decodes a fixed text, so tables built from a
// strange but accepted file are used once.
#include <nlohmann/json.hpp>

#include "model/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  fuzz::refuse_quietly([&] {
    const BpeTokenizer tokenizer = BpeTokenizer::from_tokenizer_json_text(fuzz::as_text(data, size), "tokenizer.json");
    std::vector<uint32_t> ids;
    tokenizer.encode_into("Hello world, 12345 <|endoftext|>\n\xc3\xa9t\xc3\xa9 \xff", ids);
    (void)tokenizer.decode(ids);
  });
  return 0;
}
