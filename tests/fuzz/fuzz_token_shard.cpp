// Fuzz target: a token shard (tools/data/tokens.h): the llm.c header (magic, version, count) checked
// against the file's size, then every id read and checked against a vocabulary; the same bytes as
// a token flags file (its header and flag bits). The readers only open paths, so the bytes go to
// scratch files.
#include "tests/fuzz/fuzz_support.h"
#include "tools/data/tokens.h"

namespace {
// Larger than 2^16, so both the uint16 and the uint32 shard layouts can hold valid ids.
constexpr int64_t kVocabSize = 128256;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cw;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string shard = fuzz::write_scratch_file("train.bin", bytes);
  fuzz::refuse_quietly([&] { (void)inspect_token_file(shard, TokenFormat::shard); });
  fuzz::refuse_quietly([&] { (void)read_token_file(shard, TokenFormat::shard, kVocabSize); });
  const std::string flags = fuzz::write_scratch_file("flags.bin", bytes);
  fuzz::refuse_quietly([&] { (void)read_token_flags(flags); });
  return 0;
}
