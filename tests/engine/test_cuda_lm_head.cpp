// The GPU LM head fused with cross-entropy (engine/cuda/lm_head.cu) beyond the op table
// (test_backend_ops.cpp checks forward, backward and fused against the CPU in f64, with poisoning,
// accumulation and repeatability): the fused pass gives the bits of forward + backward, a missing
// saved lse or gradient changes no bits, bad labels are a clear error that leaves the outputs alone,
// operand checks. Called through the public ops (device tensors dispatch to the GPU).
//
// Row blocks: the GPU picks its own rows per block (lm_head.cu: at most 2048, fewer only when the
// logits block would pass 512 MiB). With V = 96, N = 4133 therefore runs as blocks of 2048, 2048 and
// 37 rows: more than one block, the last one partial; its labels make rows [2048, 4096) ignored,
// i.e. the whole second block.
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/random.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace cw;
using namespace cw::test;

namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16};
constexpr uint64_t kSeed = 7171;
constexpr int64_t kCpuBlockRows = 256;  // the block_rows argument: the CPU's; the GPU picks its own

using Input = GpuInput;
Input make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std);
}
// Labels on the host and the device: pseudo-random ids in [0, V) with the first and last ids
// present, every 7th row ignored, plus rows [ignore_from, ignore_to) ignored.
struct Labels {
  OwnedTensor host, dev;
  double supervised = 0;
};
Labels make_labels(int64_t N, int64_t V, int64_t ignore_from = 0, int64_t ignore_to = 0) {
  Labels l{OwnedTensor(DType::i32, {N}), OwnedTensor::on(gpu0(), DType::i32, {N})};
  Rng rng(kSeed + static_cast<uint64_t>(V));
  int32_t* p = l.host.tensor.ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    p[n] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
    if (n % 7 == 3 || (n >= ignore_from && n < ignore_to)) p[n] = kIgnoreLabel;
  }
  p[0] = 0;
  if (N > 1) p[N - 1] = static_cast<int32_t>(V - 1);
  for (int64_t n = 0; n < N; ++n) l.supervised += p[n] != kIgnoreLabel ? 1 : 0;
  gpu::copy_convert(l.dev, l.host);
  return l;
}

void upload_labels(Labels& l) { gpu::copy_convert(l.dev, l.host); }

}  // namespace

TEST_CASE("cuda: lm_head loss: fused = forward + backward bitwise; ignored rows 0; no saved lse, or one gradient alone, changes no bits" *
          doctest::skip(!cw::test::gpu_ready())) {
  // 4133 x 96: three GPU row blocks (2048, 2048, 37), the second wholly ignored (see the header).
  const int64_t N = 4133, C = 64, V = 96;
  for (DType dt : kDtypes) {
    INFO(std::string(dtype_name(dt)));
    Input x = make_input(dt, {N, C}, 1), w = make_input(dt, {V, C}, 2, 2.0 / std::sqrt(double(C)));
    Labels lab = make_labels(N, V, 2048, 4096);
    const double norm = lab.supervised;
    Arena scratch(gpu0());
    OwnedTensor loss = poisoned(DType::f32, {N}), lse = poisoned(DType::f32, {N});
    lm_head_loss_forward(loss, {lse}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows);
    OwnedTensor loss_nolse = poisoned(DType::f32, {N});
    lm_head_loss_forward(loss_nolse, LmHeadSaved{}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows);
    expect_same_bits(loss_nolse, loss, "row_loss without a saved lse");
    const OwnedTensor got = fetch(loss);
    bool ignored_zero = true;
    for (int64_t n = 0; n < N; ++n)
      if (lab.host.tensor.ptr<int32_t>()[n] == kIgnoreLabel) ignored_zero &= got.tensor.ptr<double>()[n] == 0.0;
    CHECK(ignored_zero);  // ignored rows: exactly 0
    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      INFO((mode == GradMode::overwrite ? "overwrite" : "accumulate"));
      // the same starting d_x (accumulate) and d_W on both sides
      Input dx_b = make_input(dt, {N, C}, 5, 1e-3), dw_b = make_input(DType::f32, {V, C}, 4, 1e-3);
      Input dx_f = make_input(dt, {N, C}, 5, 1e-3), dw_f = make_input(DType::f32, {V, C}, 4, 1e-3);
      lm_head_loss_backward(dx_b.dev, dw_b.dev, {lse}, x.dev, w.dev, lab.dev, norm, mode, scratch, kCpuBlockRows);
      OwnedTensor loss_f = poisoned(DType::f32, {N});
      lm_head_loss_fused(loss_f, dx_f.dev, dw_f.dev, x.dev, w.dev, lab.dev, norm, mode, scratch, kCpuBlockRows);
      CHECK(scratch.in_use() == 0);
      expect_same_bits(loss_f, loss, "fused row_loss = forward row_loss");
      expect_same_bits(dx_f.dev, dx_b.dev, "fused d_x = backward d_x");
      expect_same_bits(dw_f.dev, dw_b.dev, "fused d_W = backward d_W");
      // one gradient at a time
      Input dx_only = make_input(dt, {N, C}, 5, 1e-3), dw_only = make_input(DType::f32, {V, C}, 4, 1e-3);
      lm_head_loss_backward(dx_only.dev, Tensor{}, {lse}, x.dev, w.dev, lab.dev, norm, mode, scratch, kCpuBlockRows);
      expect_same_bits(dx_only.dev, dx_b.dev, "d_x without d_W");
      OwnedTensor loss_w = poisoned(DType::f32, {N});
      lm_head_loss_fused(loss_w, Tensor{}, dw_only.dev, x.dev, w.dev, lab.dev, norm, mode, scratch, kCpuBlockRows);
      expect_same_bits(dw_only.dev, dw_f.dev, "fused d_W without d_x");
      expect_same_bits(loss_w, loss, "fused row_loss without d_x");
    }
  }
}

TEST_CASE("cuda: lm_head loss rejects bad labels with a clear error and leaves the outputs alone" *
          doctest::skip(!cw::test::gpu_ready())) {
  const int64_t N = 300, C = 16, V = 50;
  for (DType dt : kDtypes) {
    INFO(std::string(dtype_name(dt)));
    Input x = make_input(dt, {N, C}, 11), w = make_input(dt, {V, C}, 12, 0.5);
    Labels lab = make_labels(N, V);
    Arena scratch(gpu0());
    OwnedTensor loss = poisoned(DType::f32, {N}), lse = poisoned(DType::f32, {N}), dx = poisoned(dt, {N, C});
    Input dw = make_input(DType::f32, {V, C}, 13);
    Input dw_before = make_input(DType::f32, {V, C}, 13);

    for (const int32_t bad : {static_cast<int32_t>(V), int32_t{-1}, int32_t{-101}}) {
      INFO("bad label ", bad);
      lab.host.tensor.ptr<int32_t>()[123] = bad;
      lab.host.tensor.ptr<int32_t>()[200] = bad;  // the first bad row is the one reported
      upload_labels(lab);
      std::string message;
      try {
        lm_head_loss_forward(loss, {lse}, x.dev, w.dev, lab.dev, lab.supervised, scratch, kCpuBlockRows);
      } catch (const Error& e) {
        message = e.what();
      }
      INFO("message: ", message);
      CHECK(message.find("label " + std::to_string(bad) + " at row 123") != std::string::npos);
      CHECK(message.find("-100") != std::string::npos);
      CHECK_THROWS_AS(lm_head_loss_backward(dx, dw.dev, {lse}, x.dev, w.dev, lab.dev, lab.supervised,
                                            GradMode::overwrite, scratch, kCpuBlockRows),
                      Error);
      CHECK_THROWS_AS(lm_head_loss_fused(loss, dx, dw.dev, x.dev, w.dev, lab.dev, lab.supervised, GradMode::overwrite,
                                         scratch, kCpuBlockRows),
                      Error);
      CHECK(scratch.in_use() == 0);
      expect_same_bits(dw.dev, dw_before.dev, "d_W untouched after a bad label");
      const OwnedTensor l = fetch(loss);
      CHECK(std::isnan(l.tensor.ptr<double>()[0]));  // row_loss untouched (still poisoned)
    }
    // all labels valid again (an ignored row included): it runs
    lab.host.tensor.ptr<int32_t>()[123] = kIgnoreLabel;
    lab.host.tensor.ptr<int32_t>()[200] = 7;
    upload_labels(lab);
    lm_head_loss_fused(loss, dx, dw.dev, x.dev, w.dev, lab.dev, lab.supervised, GradMode::overwrite, scratch,
                       kCpuBlockRows);
    const OwnedTensor l = fetch(loss);
    CHECK(std::isfinite(l.tensor.ptr<double>()[0]));
    CHECK(l.tensor.ptr<double>()[123] == 0.0);
  }
}

TEST_CASE("cuda: lm_head loss checks its operands" * doctest::skip(!cw::test::gpu_ready())) {
  const int64_t N = 8, C = 16, V = 24;
  Input x = make_input(DType::bf16, {N, C}, 21), w = make_input(DType::bf16, {V, C}, 22);
  Labels lab = make_labels(N, V);
  Arena scratch(gpu0());
  Arena host_arena;
  OwnedTensor loss = poisoned(DType::f32, {N}), lse = poisoned(DType::f32, {N}), dx = poisoned(DType::bf16, {N, C});
  OwnedTensor dw = poisoned(DType::f32, {V, C}), dw_bf16 = poisoned(DType::bf16, {V, C});
  OwnedTensor lse_bf16 = poisoned(DType::bf16, {N}), loss_short = poisoned(DType::f32, {N - 1});
  const double norm = lab.supervised;
  // labels on the host
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse}, x.dev, w.dev, lab.host, norm, scratch, kCpuBlockRows), Error);
  // parameter gradient not f32; lse not f32; row_loss of the wrong length
  CHECK_THROWS_AS(lm_head_loss_backward(dx, dw_bf16, {lse}, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                                        kCpuBlockRows),
                  Error);
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse_bf16}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows), Error);
  CHECK_THROWS_AS(lm_head_loss_forward(loss_short, {lse}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows), Error);
  // weight of another dtype or width; a non-positive normaliser; a host scratch arena
  Input w32 = make_input(DType::f32, {V, C}, 22), w_narrow = make_input(DType::bf16, {V, C - 1}, 22);
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse}, x.dev, w32.dev, lab.dev, norm, scratch, kCpuBlockRows), Error);
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse}, x.dev, w_narrow.dev, lab.dev, norm, scratch, kCpuBlockRows),
                  Error);
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse}, x.dev, w.dev, lab.dev, 0.0, scratch, kCpuBlockRows), Error);
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse}, x.dev, w.dev, lab.dev, norm, host_arena, kCpuBlockRows), Error);
  // d_x aliasing x
  CHECK_THROWS_AS(lm_head_loss_fused(loss, x.dev, dw, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                                     kCpuBlockRows),
                  Error);
  // f64 operands keep the contract (row_loss and lse in f64 too) but the GPU has no f64 kernel: its own limit
  Input x64 = make_input(DType::f64, {N, C}, 21), w64 = make_input(DType::f64, {V, C}, 22);
  OwnedTensor loss64 = poisoned(DType::f64, {N}), lse64 = poisoned(DType::f64, {N});
  CHECK_THROWS_WITH_AS(lm_head_loss_forward(loss64, {lse64}, x64.dev, w64.dev, lab.dev, norm, scratch, kCpuBlockRows),
                       doctest::Contains("lm_head_loss_forward on the GPU supports f32 and bf16, not f64"), Error);
}
