// The test runner: doctest's own command line (`chunkwise-tests --help` lists the filters:
// -tc="name*", -ts=suite, -s for successful checks, --duration=true). Every failed check fails the
// run. Before the tests, one line says whether the GPU tests run or are skipped, and why.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "chunkwise_config.h"
#include "engine/engine.h"
#include "tests/gpu_support.h"

#include <cstdio>

int main(int argc, char** argv) {
  if (!CW_HAVE_CUDA)
    std::printf("GPU tests: not built (this build has no CUDA)\n");
  else if (!cw::test::gpu_ready())
    std::printf("GPU tests: SKIPPED: no GPU visible on this machine (they run on the GPU machine: tools/gpu-check)\n");
  else
    std::printf("GPU tests: running on %d GPU(s)\n", cw::gpu::device_count());
  if (CW_HAVE_CUDA && !CW_HAVE_NCCL)
    std::printf("NCCL tests: SKIPPED: this build has no NCCL\n");
  else if (CW_HAVE_NCCL && cw::test::gpu_ready() && cw::gpu::device_count() < 2)
    std::printf("NCCL tests across 2 GPUs: SKIPPED: one GPU visible\n");
  std::fflush(stdout);
  const cw::BackgroundWorkScope background;  // stopped before the static destructors run
  doctest::Context context(argc, argv);
  return context.run();
}
