// GPU tests: declared as TEST_CASE("cuda: ..." * doctest::skip(!cw::test::gpu_ready())), so on a
// machine without a GPU they are counted as skipped, and the runner says why at the start.
#pragma once

#include "engine/cuda/runtime.h"

namespace cw::test {

inline bool gpu_ready() {
  static const bool ready = gpu::available();
  return ready;
}

}  // namespace cw::test
