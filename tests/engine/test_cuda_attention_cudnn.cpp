// cuDNN fused attention (engine/cuda/attention_cudnn.cu) beyond the op table (test_backend_ops.cpp
// runs it, deterministic and not, against the CPU in f64 with poisoning,
// accumulation into K/V-store slices and repeatability): the backward's workspace against a budget,
// and what it says where it does not serve.
#include "chunkwise_config.h"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/ops/attention.h"
#include "engine/random.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

using namespace cw;
using namespace cw::test;

#if CW_HAVE_CUDNN

namespace {
// The tests call the cuDNN entry points directly, whatever CW_ATTENTION says.
void opt_in() {}
}  // namespace

TEST_CASE("cuda: cudnn attention backward states its workspace against a budget" *
          doctest::skip(!cw::test::gpu_ready())) {
  // `automatic` takes the cuDNN backward only where its plan's workspace fits the budget. The fast
  // engine (f32 dQ accumulator, the graph in the frontend library's arrangement) stages nothing of
  // size c x S: at 2048 tokens and 8 heads it needs at most the per-query-head f32 dK/dV of its
  // GQA head reduction (B H S D 4 bytes = 4 MiB), so it must fit 16 MiB, where the older
  // arrangements wanted B H c S 4 bytes = 128 MiB (32 GiB at 16K tokens and 32 heads). The
  // deterministic engine stages dS (bf16, B H c S 2 bytes = 64 MiB here): a 16 MiB budget must
  // say no, and why; 1 GiB yes.
  const int64_t c = 2048, H = 8, Hkv = 2, D = 64;
  OwnedTensor q = OwnedTensor::on(gpu0(), DType::bf16, {1, c, H, D}), k = OwnedTensor::on(gpu0(), DType::bf16, {1, c, Hkv, D});
  std::string why;
  opt_in();
  if (!gpu::cudnn_attention_supports(q, k, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  {
    DeterminismScope scope(false);
    CHECK_MESSAGE(gpu::cudnn_attention_backward_fits(q, k, k, int64_t{16} << 20, &why), why);
  }
  {
    DeterminismScope scope(true);
    why.clear();
    CHECK_FALSE(gpu::cudnn_attention_backward_fits(q, k, k, int64_t{16} << 20, &why));
    CHECK_MESSAGE(why.find("workspace") != std::string::npos, why);
    CHECK_MESSAGE(gpu::cudnn_attention_backward_fits(q, k, k, int64_t{1} << 30, &why), why);
  }
}

TEST_CASE("cuda: cudnn attention says why it does not serve f32, odd head dims and large head dims" *
          doctest::skip(!cw::test::gpu_ready())) {
  std::string why;
  opt_in();
  OwnedTensor q32 = OwnedTensor::on(gpu0(), DType::f32, {1, 8, 2, 64}), k32 = OwnedTensor::on(gpu0(), DType::f32, {1, 8, 2, 64});
  CHECK_FALSE(gpu::cudnn_attention_supports(q32, k32, &why));
  CHECK(!why.empty());
  OwnedTensor q_odd = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 60}), k_odd = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 60});
  CHECK_FALSE(gpu::cudnn_attention_supports(q_odd, k_odd, &why));
  OwnedTensor q_big = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 256}), k_big = OwnedTensor::on(gpu0(), DType::bf16, {1, 8, 2, 256});
  CHECK_FALSE(gpu::cudnn_attention_supports(q_big, k_big, &why));
  CHECK(!why.empty());
}

#else

TEST_CASE("cuda: cudnn attention (this build has no cuDNN)" * doctest::skip(true)) {}

#endif
