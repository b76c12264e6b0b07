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
