// `chunkwise bench-ops`: our GPU ops timed on one shape set (a benchmark, not a test).
//
// Each op runs on fresh random data (never zeros) after a warm-up; the figure is the median of
// `repeat` runs timed with CUDA events. Memory-bound ops report the bytes they must move (inputs
// read once, outputs written once) per second and that rate as a share of a device-to-device copy
// measured in the same run; GEMMs report TFLOP/s. tools/bench/ops_vs_torch.py runs this and torch's
// equivalents on the same shapes and prints both side by side.
#pragma once

#include <iosfwd>
#include <string>

namespace cw {

struct BenchOpsOptions {
  int64_t tokens = 8192;   // N rows
  int64_t hidden = 2048;   // C
  int64_t ffn = 8192;      // F
  int64_t heads = 32, kv_heads = 8, head_dim = 64;
  int64_t vocab = 128256;  // embedding table rows
  std::string dtype = "bf16";
  int repeat = 20;
  std::string json;        // also write the results as JSON here
};

void run_bench_ops(const BenchOpsOptions& options, std::ostream& out);

}  // namespace cw
