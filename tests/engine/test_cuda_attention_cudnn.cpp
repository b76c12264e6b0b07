// cuDNN fused attention (engine/cuda/attention_cudnn.cu) against the CPU op computed in f64 on the
// same inputs.
//
// Pattern of tests/engine/test_cuda_ops.cpp: inputs drawn in f64, rounded to bf16 on the host; the
// rounded tensor is uploaded (the GPU's input) and widened back to f64 (the reference's input), so
// both sides see identical values. Overwritten outputs (out, lse, d_q in overwrite mode) are
// poisoned with NaN; d_k, d_v (always ADDED into) and d_q in accumulate mode start from random
// values and are compared with the reference's sum. K/V are slices of a larger store where the
// case says so (batch stride > S Hkv D): the gap between batch entries must come back untouched.
// Cases: p = 0 (full causal), chunk against cache (c < S, p > 0, sizes not multiples of 64/128:
// the bottom-right mask), GQA ratios 1 and 4, head dims 64 and 128, B = 2 with padded K/V batch
// stride. On machines where cudnn_attention_supports() says no (no cuDNN 9.3+, an old GPU) the cases
// are skipped with the reason printed. Two backward engines: by default cuDNN's flash engine (dQ
// summed with f32 atomics into an accumulator), and with gpu::set_deterministic(true) only
// deterministic engine configurations; both are checked against f64, and the deterministic one for
// bitwise repeatability.
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

// bf16 outputs (out, d_q): rounding the result once costs up to 2^-9 relative per element, and
// cuDNN's flash kernels round P and dS to bf16 before their second matmuls (as every bf16 flash
// attention does), which adds errors of the same order averaged over the keys; measured relative
// L2 errors are a few 1e-3. 2e-2 leaves a margin of several.
constexpr double kBf16OutTol = 2e-2;
// f32 gradients d_k, d_v: the matmul inputs (P^T, dS^T) are bf16-rounded inside cuDNN, so these
// carry the same bf16-level error as d_q even though they are stored in f32 (or, where cuDNN only
// writes bf16 dK/dV, are rounded to bf16 once more before our f32 add).
constexpr double kGradTol = 2e-2;
// lse (f32): a log-sum-exp of f32 scores accumulated from exact bf16 products; its relative error
// is ~1e-6 of a value of order log(S) + max score. Allowing 1e-4 still catches any masking or
// scaling mistake (a wrong mask or base-2 log changes lse by O(1)).
constexpr double kLseTol = 1e-4;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr uint64_t kSeed = 5150;

using Input = GpuInput;
Input make_input(DType dt, const std::vector<int64_t>& shape, uint64_t stream, double std = 1.0) {
  return make_gpu_input(dt, shape, kSeed, stream, std);
}
void expect_close(const Tensor& dev, const Tensor& ref, double tol, const char* what) {
  expect_close_gpu(dev, ref, tol, what);
}

// A K/V store of `store_len` >= S positions per batch entry; the op sees the [B, S, Hkv, D] slice at
// positions [0, S) (batch stride store_len Hkv D, larger than packed when store_len > S).
struct Store {
  Input full;  // [B, store_len, Hkv, D]
  Tensor slice(bool dev) const { return (dev ? full.dev.tensor : full.ref.tensor).slice(1, 0, S); }
  int64_t S;
};

Store make_store(DType dt, int64_t B, int64_t store_len, int64_t S, int64_t Hkv, int64_t D, uint64_t stream,
                 double std = 1.0) {
  return Store{make_input(dt, {B, store_len, Hkv, D}, stream, std), S};
}

struct Case {
  int64_t B, c, S, H, Hkv, D, store_len;
};

void run_case(const Case& cs) {
  const int64_t B = cs.B, c = cs.c, S = cs.S, H = cs.H, Hkv = cs.Hkv, D = cs.D;
  INFO("B=", B, " c=", c, " S=", S, " (p=", S - c, ") H=", H, " Hkv=", Hkv, " D=", D, " store_len=", cs.store_len);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Input q = make_input(DType::bf16, {B, c, H, D}, 1);
  Store k = make_store(DType::bf16, B, cs.store_len, S, Hkv, D, 2), v = make_store(DType::bf16, B, cs.store_len, S, Hkv, D, 3);
  Input d_out = make_input(DType::bf16, {B, c, H, D}, 4);

  std::string why;
  opt_in();
  if (!gpu::cudnn_attention_supports(q.dev, k.slice(true), &why)) {
    MESSAGE("cuDNN fused attention not available here, case skipped: ", why);
    return;
  }
  Arena scratch(gpu0());
  Arena host_scratch;

  // forward
  OwnedTensor out = OwnedTensor::on(gpu0(), DType::bf16, {B, c, H, D}), lse = OwnedTensor::on(gpu0(), DType::f32, {B, H, c});
  gpu::fill(out, kNaN);
  gpu::fill(lse, kNaN);
  gpu::cudnn_attention_forward(out, {lse}, q.dev, k.slice(true), v.slice(true), scale, scratch);
  CHECK(scratch.in_use() == 0);
  OwnedTensor out64(DType::f64, {B, c, H, D}), lse64(DType::f64, {B, H, c});
  attention_forward(out64, {lse64}, q.ref, k.slice(false), v.slice(false), scale, host_scratch);
  expect_close(out, out64, kBf16OutTol, "out");
  expect_close(lse, lse64, kLseTol, "lse (natural-log log-sum-exp of the scaled, masked scores)");

  // backward, overwrite: both sides use the GPU's out and lse (as training does), so the check
  // isolates the backward. d_k/d_v are slices of stores pre-filled with random values (the op adds;
  // the gap between batch entries must stay as it was).
  const OwnedTensor out_used = fetch(out), lse_used = fetch(lse);
  OwnedTensor d_q = OwnedTensor::on(gpu0(), DType::bf16, {B, c, H, D});
  gpu::fill(d_q, kNaN);
  Store d_k = make_store(DType::f32, B, cs.store_len, S, Hkv, D, 5, 0.1);
  Store d_v = make_store(DType::f32, B, cs.store_len, S, Hkv, D, 6, 0.1);
  gpu::cudnn_attention_backward(d_q, d_k.slice(true), d_v.slice(true), d_out.dev, {lse}, q.dev, k.slice(true),
                                v.slice(true), out, scale, GradMode::overwrite, scratch);
  CHECK(scratch.in_use() == 0);
  OwnedTensor d_q64(DType::f64, {B, c, H, D});
  attention_backward(d_q64, d_k.slice(false), d_v.slice(false), d_out.ref, {lse_used}, q.ref, k.slice(false),
                     v.slice(false), out_used, scale, GradMode::overwrite, host_scratch);
  expect_close(d_q, d_q64, kBf16OutTol, "d_q (overwrite)");
  // The whole stores: the slices got the sums, the rest (positions >= S) is untouched.
  expect_close(d_k.full.dev, d_k.full.ref, kGradTol, "d_k += (whole store)");
  expect_close(d_v.full.dev, d_v.full.ref, kGradTol, "d_v += (whole store)");
  if (cs.store_len > S) {
    const OwnedTensor got = fetch(d_k.full.dev);
    const Tensor tail_got = got.tensor.slice(1, S, cs.store_len - S), tail_ref = d_k.full.ref.tensor.slice(1, S, cs.store_len - S);
    bool same = true;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < cs.store_len - S; ++s)
        for (int64_t i = 0; i < Hkv * D; ++i) {
          const int64_t off_got = b * tail_got.stride[0] + s * tail_got.stride[1] + i;
          same = same && tail_got.ptr<double>()[off_got] == tail_ref.ptr<double>()[off_got];
        }
    CHECK_MESSAGE(same, "d_k store beyond the slice was modified");
  }

  // backward, accumulate: d_q starts from random values and gets the gradient added.
  Input d_q_acc = make_input(DType::bf16, {B, c, H, D}, 7);
  gpu::cudnn_attention_backward(d_q_acc.dev, d_k.slice(true), d_v.slice(true), d_out.dev, {lse}, q.dev, k.slice(true),
                                v.slice(true), out, scale, GradMode::accumulate, scratch);
  attention_backward(d_q_acc.ref, d_k.slice(false), d_v.slice(false), d_out.ref, {lse_used}, q.ref, k.slice(false),
                     v.slice(false), out_used, scale, GradMode::accumulate, host_scratch);
  expect_close(d_q_acc.dev, d_q_acc.ref, kBf16OutTol, "d_q (accumulate)");
  expect_close(d_k.full.dev, d_k.full.ref, kGradTol, "d_k += (second backward)");
  expect_close(d_v.full.dev, d_v.full.ref, kGradTol, "d_v += (second backward)");
}

}  // namespace

TEST_CASE("cuda: cudnn attention, full causal (p = 0), MHA and GQA, head dims 64 and 128" *
          doctest::skip(!cw::test::gpu_ready())) {
  for (bool det : {false, true}) {
    INFO((det ? "deterministic engine" : "fast engine (atomic dQ)"));
    DeterminismScope scope(det);
    run_case({1, 96, 96, 4, 4, 64, 96});     // MHA, D 64
    run_case({2, 77, 77, 8, 2, 128, 80});    // GQA 4, D 128, padded K/V batch stride
  }
}

TEST_CASE("cuda: cudnn attention, chunk against cache (bottom-right causal mask)" *
          doctest::skip(!cw::test::gpu_ready())) {
  for (bool det : {false, true}) {
    INFO((det ? "deterministic engine" : "fast engine (atomic dQ)"));
    DeterminismScope scope(det);
    run_case({2, 50, 173, 8, 2, 64, 181});   // GQA 4, p = 123, padded store
    run_case({1, 64, 200, 2, 2, 128, 200});  // MHA, D 128, p = 136
    run_case({2, 100, 300, 4, 1, 64, 301});  // GQA 4 (one K/V head), p = 200
    run_case({1, 1, 130, 4, 1, 64, 130});    // a single query at position 129
  }
}

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

TEST_CASE("cuda: cudnn attention backward is bitwise repeatable when determinism is asked" *
          doctest::skip(!cw::test::gpu_ready())) {
  DeterminismScope scope(true);
  const int64_t B = 1, c = 128, S = 384, H = 8, Hkv = 2, D = 64;
  Input q = make_input(DType::bf16, {B, c, H, D}, 11), k = make_input(DType::bf16, {B, S, Hkv, D}, 12),
        v = make_input(DType::bf16, {B, S, Hkv, D}, 13), d_out = make_input(DType::bf16, {B, c, H, D}, 14);
  std::string why;
  opt_in();
  if (!gpu::cudnn_attention_supports(q.dev, k.dev, &why)) {
    MESSAGE("cuDNN fused attention not available here, skipped: ", why);
    return;
  }
  Arena scratch(gpu0());
  const double scale = 0.125;
  OwnedTensor out = OwnedTensor::on(gpu0(), DType::bf16, {B, c, H, D}), lse = OwnedTensor::on(gpu0(), DType::f32, {B, H, c});
  gpu::cudnn_attention_forward(out, {lse}, q.dev, k.dev, v.dev, scale, scratch);
  std::vector<OwnedTensor> got;
  for (int rep = 0; rep < 2; ++rep) {
    OwnedTensor d_q = OwnedTensor::on(gpu0(), DType::bf16, {B, c, H, D});
    OwnedTensor d_k = OwnedTensor::on(gpu0(), DType::f32, {B, S, Hkv, D}), d_v = OwnedTensor::on(gpu0(), DType::f32, {B, S, Hkv, D});
    gpu::fill(d_k, 0);
    gpu::fill(d_v, 0);
    gpu::cudnn_attention_backward(d_q, d_k, d_v, d_out.dev, {lse}, q.dev, k.dev, v.dev, out, scale, GradMode::overwrite,
                                  scratch);
    got.push_back(fetch(d_q));
    got.push_back(fetch(d_k));
    got.push_back(fetch(d_v));
  }
  for (int i = 0; i < 3; ++i) {
    INFO("gradient ", i, " (d_q, d_k, d_v)");
    CHECK(std::memcmp(got[static_cast<size_t>(i)].tensor.data, got[static_cast<size_t>(i) + 3].tensor.data,
                      got[static_cast<size_t>(i)].tensor.bytes()) == 0);
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
