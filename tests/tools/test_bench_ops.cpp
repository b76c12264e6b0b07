// `chunkwise bench-ops` (tools/bench_ops.h): its flags are checked on any machine; on a GPU a small
// run times every row, the chunk-attention rows (one masked call, the streamed store's blocks, the call
// with its earlier keys apart) included.
#include "tests/gpu_support.h"
#include "tools/bench_ops.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

using namespace cw;

TEST_CASE("bench-ops --chunk-attention refuses a shape whose keys are not whole chunks, on any machine") {
  BenchOpsOptions o;
  o.chunk_attention = {"4096:1000"};
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_bench_ops(o, out), doctest::Contains("expected CHUNK:KEYS"), Error);
}

// Each "A:B[:C]" option, malformed, refused before anything runs: the option and what it expects named.
TEST_CASE("bench-ops refuses a malformed shape of each row option, on any machine") {
  struct Case {
    const char* option;
    std::string spec;
    const char* expected;
  };
  const Case cases[] = {
      {"--chunk-attention", "4096", "expected CHUNK:KEYS"},
      {"--chunk-attention", "4096:x", "expected CHUNK:KEYS"},
      {"--chunk-attention", "4096:8192:1", "expected CHUNK:KEYS"},
      {"--chunk-attention", "4096:8192x", "expected CHUNK:KEYS"},
      {"--linears", "512", "expected OUT:IN"},
      {"--linears", ":2048", "expected OUT:IN"},
      {"--linears", "512:2048:", "expected OUT:IN"},
      {"--linears", "0:2048", "expected OUT:IN"},
      {"--attention-shapes", "8:4", "expected HEADS:KV_HEADS:HEAD_DIM"},
      {"--attention-shapes", "8:4:256:1", "expected HEADS:KV_HEADS:HEAD_DIM"},
      {"--attention-shapes", "8:x:256", "expected HEADS:KV_HEADS:HEAD_DIM"},
      {"--attention-shapes", "8:3:64", "expected HEADS:KV_HEADS:HEAD_DIM"},
      {"--attention-shapes", "8:4:255", "expected HEADS:KV_HEADS:HEAD_DIM"},
      {"--attention-shapes", "8:4:256 ", "expected HEADS:KV_HEADS:HEAD_DIM"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.option);
    CAPTURE(c.spec);
    BenchOpsOptions o;
    const std::string option = c.option;
    if (option == "--chunk-attention") o.chunk_attention = {c.spec};
    if (option == "--linears") o.linears = {c.spec};
    if (option == "--attention-shapes") o.attention_shapes = {c.spec};
    std::ostringstream out;
    const std::string message = test::error_of([&] { run_bench_ops(o, out); });
    CHECK(message.find(option + " '" + c.spec + "'") != std::string::npos);
    CHECK(message.find(c.expected) != std::string::npos);
  }
}

TEST_CASE("bench-ops --kv-heads refuses a count that does not divide the query heads, on any machine") {
  BenchOpsOptions o;
  o.heads = 32, o.kv_heads = 5;
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(run_bench_ops(o, out), doctest::Contains("must divide --heads 32"), Error);
}

TEST_CASE("cuda: bench-ops times every row of a small run, chunk attention in one call, in blocks and with the prefix apart" *
          doctest::skip(!test::gpu_ready())) {
  test::TempDir dir("bench-ops");
  BenchOpsOptions o;
  o.tokens = 256, o.hidden = 128, o.ffn = 256, o.heads = 4, o.kv_heads = 2, o.head_dim = 64, o.vocab = 512;
  o.repeat = 1;
  o.attention_tokens = {256};
  o.lm_head_tokens = {256};
  o.chunk_attention = {"64:64", "64:256"};
  o.json = dir.file("ops.json");
  std::ostringstream out;
  run_bench_ops(o, out);
  const nlohmann::json rows = nlohmann::json::parse(std::ifstream(o.json));
  int chunk_rows = 0;
  for (const auto& r : rows) {
    INFO(r.dump());
    const std::string status = r.value("status", "ok");
    // A cuDNN that cannot take a shape says so ("unsupported"); nothing may fail.
    CHECK(status != "error");
    if (r.value("kind", "") == "chunk_attention") {
      ++chunk_rows;
      CHECK(status == "ok");
      CHECK(r["ms"].get<double>() > 0);
    }
  }
  CHECK(chunk_rows == 12);  // two shapes x forward, backward x one call, blocked, split
}
