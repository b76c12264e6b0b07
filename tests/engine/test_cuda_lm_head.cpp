// The GPU LM head fused with cross-entropy (engine/cuda/lm_head.cu) against the CPU op in f64
// (engine/ops/lm_head_loss.h), called through the public ops (device tensors dispatch to the GPU).
//
// Pattern of tests/engine/test_cuda_ops.cpp: inputs drawn in f64 and rounded to the compute dtype
// (f32 or bf16); the rounded values are uploaded (the GPU's input) and widened back to f64 (the
// reference's input). Overwritten outputs (row_loss, lse, d_x in overwrite mode) are poisoned with
// NaN; accumulated outputs (d_W always, d_x in accumulate mode) start from random values of the
// gradient's own size (so a dropped or doubled accumulation shows in the relative error) and are
// compared with the reference's sum. The reference backward uses the GPU's lse (widened), which
// isolates the backward from the forward's rounding. Comparison: relative L2 (cw::test::compare).
//
// Row blocks: the GPU picks its own rows per block (lm_head.cu: at most 2048, fewer only when the
// logits block would pass 512 MiB). With V = 96, N = 4133 therefore runs as blocks of 2048, 2048 and
// 37 rows: more than one block, the last one partial; its labels make rows [2048, 4096) ignored,
// i.e. the whole second block (and, were the block smaller, still whole blocks).
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

// f32 mode against f64: f32 GEMMs without TF32 (relative L2 error ~ eps_f32 * sqrt(terms), about
// 1e-6 for a few thousand terms), f32 log-sum-exp with exp2f (2 ulp), G rounded to f32 once.
constexpr double kLmF32Tol = 1e-5;
// bf16 mode against f64: the logits are stored in bf16 (2^-9 relative each) before the f32
// log-sum-exp, G is rounded to bf16 before the two gradient GEMMs, and d_x is rounded to bf16
// once: each costs about 2e-3 relative; 2e-2 leaves a margin of about five. The f32 outputs of a
// bf16 run (row_loss, lse, d_W) carry the same bf16 roundings of their inputs, so they share it.
constexpr double kLmBf16Tol = 2e-2;

constexpr DType kDtypes[] = {DType::f32, DType::bf16};
constexpr uint64_t kSeed = 7171;
constexpr int64_t kCpuBlockRows = 256;  // the block_rows argument: the CPU's; the GPU picks its own

double tol_for(DType dt) { return dt == DType::bf16 ? kLmBf16Tol : kLmF32Tol; }

using Input = GpuInput;
Input make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std);
}
void expect_close(const Tensor& dev, const Tensor& ref, double tol, const std::string& what) {
  expect_close_gpu(dev, ref, tol, what);
}

double rms(const Tensor& t) {  // f64 host tensor
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += t.ptr<double>()[i] * t.ptr<double>()[i];
  return t.numel() > 0 ? std::sqrt(s / static_cast<double>(t.numel())) : 0.0;
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

TEST_CASE("cuda: lm_head loss forward, backward and fused match the CPU in f64; fused = forward + backward "
          "bitwise; deterministic" *
          doctest::skip(!cw::test::gpu_ready())) {
  struct Size {
    int64_t N, C, V, ignore_from, ignore_to;
  };
  // 37 x 101: one block; V = 101 is no multiple of the 16-byte vector (the logits rows are padded).
  // 4133 x 96: three blocks (2048, 2048, 37) with the second fully ignored (see the header).
  // 64 x 20011: long rows: 512-thread row blocks looping over the row several times, V odd.
  for (const Size sz : {Size{37, 64, 101, 0, 0}, Size{4133, 64, 96, 2048, 4096}, Size{64, 64, 20011, 0, 0}}) {
    for (DType dt : kDtypes) {
      const int64_t N = sz.N, C = sz.C, V = sz.V;
      const double tol = tol_for(dt);
      INFO(dtype_name(dt), " N=", N, " C=", C, " V=", V);
      // W of scale 2 / sqrt(C): logits of standard deviation about 2, a softmax far from uniform.
      Input x = make_input(dt, {N, C}, 1), w = make_input(dt, {V, C}, 2, 2.0 / std::sqrt(double(C)));
      Labels lab = make_labels(N, V, sz.ignore_from, sz.ignore_to);
      const double norm = lab.supervised;
      Arena scratch(gpu0());
      Arena host_scratch;

      // forward: row_loss and lse against the reference
      OwnedTensor loss = poisoned(DType::f32, {N}), lse = poisoned(DType::f32, {N});
      lm_head_loss_forward(loss, {lse}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows);
      CHECK(scratch.in_use() == 0);  // scratch handed back as found
      OwnedTensor loss64(DType::f64, {N}), lse64(DType::f64, {N});
      lm_head_loss_forward(loss64, {lse64}, x.ref, w.ref, lab.host, norm, host_scratch);
      expect_close(loss, loss64, tol, "row_loss");
      expect_close(lse, lse64, tol, "lse");
      {
        const OwnedTensor got = fetch(loss);
        double total = 0, total64 = 0;
        bool ignored_zero = true;
        for (int64_t n = 0; n < N; ++n) {
          total += got.tensor.ptr<double>()[n];
          total64 += loss64.tensor.ptr<double>()[n];
          if (lab.host.tensor.ptr<int32_t>()[n] == kIgnoreLabel) ignored_zero &= got.tensor.ptr<double>()[n] == 0.0;
        }
        INFO("mean loss ", total, " vs ", total64);
        CHECK(std::abs(total - total64) <= tol * std::abs(total64));
        CHECK(ignored_zero);
      }
      // forward without a saved lse: the same loss
      OwnedTensor loss_nolse = poisoned(DType::f32, {N});
      lm_head_loss_forward(loss_nolse, LmHeadSaved{}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows);
      expect_same_bits(loss_nolse, loss, "row_loss without a saved lse");
      OwnedTensor loss2 = poisoned(DType::f32, {N}), lse2 = poisoned(DType::f32, {N});
      lm_head_loss_forward(loss2, {lse2}, x.dev, w.dev, lab.dev, norm, scratch, kCpuBlockRows);
      expect_same_bits(loss2, loss, "forward row_loss is reproducible");
      expect_same_bits(lse2, lse, "forward lse is reproducible");

      // The reference gradients from zero, for the scale of the accumulators' starting values.
      const OwnedTensor lse_used = fetch(lse);
      OwnedTensor dx0(DType::f64, {N, C}), dw0(DType::f64, {V, C});
      lm_head_loss_backward(dx0, dw0, {lse_used}, x.ref, w.ref, lab.host, norm, GradMode::overwrite, host_scratch);
      const double sx = rms(dx0), sw = rms(dw0);
      REQUIRE(sx > 0);
      REQUIRE(sw > 0);

      // backward, overwrite: d_x poisoned, d_W accumulated onto random values
      OwnedTensor dx = poisoned(dt, {N, C});
      Input dw = make_input(DType::f32, {V, C}, 4, sw);
      lm_head_loss_backward(dx, dw.dev, {lse}, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                            kCpuBlockRows);
      CHECK(scratch.in_use() == 0);
      OwnedTensor dx64(DType::f64, {N, C});
      lm_head_loss_backward(dx64, dw.ref, {lse_used}, x.ref, w.ref, lab.host, norm, GradMode::overwrite,
                            host_scratch);
      expect_close(dx, dx64, tol, "d_x (overwrite)");
      expect_close(dw.dev, dw.ref, tol, "d_W += (first backward)");

      // backward, accumulate: d_x from random values; d_W added to a second time
      Input dx_acc = make_input(dt, {N, C}, 5, sx);
      lm_head_loss_backward(dx_acc.dev, dw.dev, {lse}, x.dev, w.dev, lab.dev, norm, GradMode::accumulate, scratch,
                            kCpuBlockRows);
      lm_head_loss_backward(dx_acc.ref, dw.ref, {lse_used}, x.ref, w.ref, lab.host, norm, GradMode::accumulate,
                            host_scratch);
      expect_close(dx_acc.dev, dx_acc.ref, tol, "d_x (accumulate)");
      expect_close(dw.dev, dw.ref, tol, "d_W += (second backward)");

      // fused, overwrite: against the reference's fused op (which computes its own lse)
      OwnedTensor loss_f = poisoned(DType::f32, {N}), dx_f = poisoned(dt, {N, C});
      Input dw_f = make_input(DType::f32, {V, C}, 6, sw);
      lm_head_loss_fused(loss_f, dx_f, dw_f.dev, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                         kCpuBlockRows);
      CHECK(scratch.in_use() == 0);
      OwnedTensor loss_f64(DType::f64, {N}), dx_f64(DType::f64, {N, C});
      lm_head_loss_fused(loss_f64, dx_f64, dw_f.ref, x.ref, w.ref, lab.host, norm, GradMode::overwrite, host_scratch);
      expect_close(loss_f, loss_f64, tol, "fused row_loss");
      expect_close(dx_f, dx_f64, tol, "fused d_x (overwrite)");
      expect_close(dw_f.dev, dw_f.ref, tol, "fused d_W +=");

      // fused = forward + backward, bitwise: same loss, same d_x, same d_W from the same start
      expect_same_bits(loss_f, loss, "fused row_loss = forward row_loss");
      expect_same_bits(dx_f, dx, "fused d_x = backward d_x");
      Input dw_b = make_input(DType::f32, {V, C}, 6, sw);
      OwnedTensor dx_b = poisoned(dt, {N, C});
      lm_head_loss_backward(dx_b, dw_b.dev, {lse}, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                            kCpuBlockRows);
      expect_same_bits(dw_f.dev, dw_b.dev, "fused d_W = backward d_W");
      // ... and in accumulate mode: fused onto the same start as the accumulate backward above
      Input dx_acc_f = make_input(dt, {N, C}, 5, sx), dw_acc_f = make_input(DType::f32, {V, C}, 4, sw);
      Input dw_acc_b = make_input(DType::f32, {V, C}, 4, sw);
      OwnedTensor loss_acc_f = poisoned(DType::f32, {N}), dx_scratch = poisoned(dt, {N, C});
      lm_head_loss_backward(dx_scratch, dw_acc_b.dev, {lse}, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                            kCpuBlockRows);  // dw_acc_b: one backward, as dw before the accumulate call
      lm_head_loss_fused(loss_acc_f, dx_acc_f.dev, dw_acc_b.dev, x.dev, w.dev, lab.dev, norm, GradMode::accumulate,
                         scratch, kCpuBlockRows);
      expect_same_bits(dx_acc_f.dev, dx_acc.dev, "fused d_x (accumulate) = backward d_x (accumulate)");
      expect_same_bits(dw_acc_b.dev, dw.dev, "fused d_W after a backward = two backwards");

      // repeatability of the fused op
      OwnedTensor loss_r = poisoned(DType::f32, {N}), dx_r = poisoned(dt, {N, C});
      Input dw_r = make_input(DType::f32, {V, C}, 6, sw);
      lm_head_loss_fused(loss_r, dx_r, dw_r.dev, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                         kCpuBlockRows);
      expect_same_bits(loss_r, loss_f, "fused row_loss is reproducible");
      expect_same_bits(dx_r, dx_f, "fused d_x is reproducible");
      expect_same_bits(dw_r.dev, dw_f.dev, "fused d_W is reproducible");

      // one gradient at a time: the same bits as with both
      OwnedTensor dx_only = poisoned(dt, {N, C});
      lm_head_loss_backward(dx_only, Tensor{}, {lse}, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                            kCpuBlockRows);
      expect_same_bits(dx_only, dx, "d_x without d_W");
      Input dw_only = make_input(DType::f32, {V, C}, 6, sw);
      OwnedTensor loss_w = poisoned(DType::f32, {N});
      lm_head_loss_fused(loss_w, Tensor{}, dw_only.dev, x.dev, w.dev, lab.dev, norm, GradMode::overwrite, scratch,
                         kCpuBlockRows);
      expect_same_bits(dw_only.dev, dw_f.dev, "fused d_W without d_x");
      expect_same_bits(loss_w, loss_f, "fused row_loss without d_x");
    }
  }
}

TEST_CASE("cuda: lm_head loss rejects bad labels with a clear error and leaves the outputs alone" *
          doctest::skip(!cw::test::gpu_ready())) {
  const int64_t N = 300, C = 16, V = 50;
  for (DType dt : kDtypes) {
    INFO(dtype_name(dt));
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
  // no f64 compute on the GPU
  Input x64 = make_input(DType::f64, {N, C}, 21), w64 = make_input(DType::f64, {V, C}, 22);
  CHECK_THROWS_AS(lm_head_loss_forward(loss, {lse}, x64.dev, w64.dev, lab.dev, norm, scratch, kCpuBlockRows), Error);
}
