// Attention with a document mask (engine/ops/attention.h, attention_forward_documents /
// attention_backward_documents) and with a sliding window (AttentionWindow), in f64 on the CPU: the
// forward against the masked softmax written out here, the backward against finite differences of
// L = <R, out>, the spans a chunk splits into, and the operand checks; a window's unmasked blocks
// whose rows see none of their keys, merged; Gemma 2's score cap with each of these, and block by block. The schedules' packed documents are checked against
// documents run one by one in tests/optim/test_documents.cpp, the schedules' windows against full
// backprop in tests/optim/test_schedules.cpp; the GPU kernels against this in the op table.
#include "engine/ops/attention.h"
#include "tests/engine/fd_check.h"

#include <cmath>
#include <functional>
#include <limits>

using namespace cw;
using namespace cw::test;

namespace {
// A fourth-order stencil in f64 with h = 1e-3 leaves ~1e-10 of truncation and rounding.
constexpr double kFdTol = 1e-8;
// Forwards written two ways agree to rounding.
constexpr double kForwardTol = 1e-13;
// A gradient that is zero by the math, computed as a difference of two sums of O(1) terms; and the
// finite differences of a loss of O(10) that does not depend on the input (1e-15 / h per element).
constexpr double kZeroGradTol = 1e-13;
constexpr double kFdNoise = 1e-9;

struct Shape {
  int64_t B = 2, c = 6, p = 5, H = 4, Hkv = 2, D = 8;
  int64_t S() const { return p + c; }
};

// A call's random operands: queries and d_out [B, c, H, D], keys and values [B, S, Hkv, D], drawn
// with seeds seed, seed + 1, seed + 2 (k, v) and seed + 3 (d_out).
struct Draws {
  OwnedTensor q, k, v, d_out;
};
Draws draw(const Shape& s, uint64_t seed) {
  return {randn({s.B, s.c, s.H, s.D}, seed), randn({s.B, s.S(), s.Hkv, s.D}, seed + 1),
          randn({s.B, s.S(), s.Hkv, s.D}, seed + 2), randn({s.B, s.c, s.H, s.D}, seed + 3)};
}

// out[b, i, h] = sum_j P v_j over keys j in [start(p + i), p + i] of sequence b, written out; with a
// sliding window of W keys (0: none) over j in [max(start(p + i), p + i - W + 1), p + i]; with a score
// cap (0: none) each score s becomes cap tanh(s / cap) before the softmax.
OwnedTensor masked_reference(const Shape& s, const OwnedTensor& q, const OwnedTensor& k, const OwnedTensor& v,
                             const std::vector<std::vector<int64_t>>& starts, double scale, int64_t window = 0,
                             double softcap = 0.0) {
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D});
  const double* Q = q.tensor.ptr<double>();
  const double* K = k.tensor.ptr<double>();
  const double* V = v.tensor.ptr<double>();
  double* O = out.tensor.ptr<double>();
  const int64_t S = s.S(), group = s.H / s.Hkv;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t i = 0; i < s.c; ++i) {
      const int64_t t = s.p + i;
      int64_t first = 0;
      for (const int64_t st : starts[static_cast<size_t>(b)])
        if (st <= t) first = st;
      if (window > 0) first = std::max(first, t - window + 1);
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t g = h / group;
        std::vector<double> score;
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = first; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < s.D; ++d)
            dot += Q[((b * s.c + i) * s.H + h) * s.D + d] * K[((b * S + j) * s.Hkv + g) * s.D + d];
          score.push_back(softcap > 0 ? softcap * std::tanh(scale * dot / softcap) : scale * dot);
          top = std::max(top, score.back());
        }
        double sum = 0;
        for (double& e : score) sum += (e = std::exp(e - top));
        for (int64_t d = 0; d < s.D; ++d) {
          double acc = 0;
          for (int64_t j = first; j <= t; ++j) acc += score[static_cast<size_t>(j - first)] * V[((b * S + j) * s.Hkv + g) * s.D + d];
          O[((b * s.c + i) * s.H + h) * s.D + d] = acc / sum;
        }
      }
    }
  return out;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.ptr<double>()[i] - b.ptr<double>()[i]));
  return m;
}

double l2(const std::vector<double>& a) {
  double sum = 0;
  for (const double x : a) sum += x * x;
  return std::sqrt(sum);
}

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The backward of L = <r, out> against finite differences of `loss` (which runs the forward): d_q
// overwritten, d_k and d_v added into a random prefill by `backward(d_q, d_k, d_v)`.
void check_backward(const Shape& s, OwnedTensor& q, OwnedTensor& k, OwnedTensor& v,
                    const std::function<double()>& loss,
                    const std::function<void(const Tensor&, const Tensor&, const Tensor&)>& backward) {
  loss();
  OwnedTensor d_q(DType::f64, {s.B, s.c, s.H, s.D}), d_k = randn({s.B, s.S(), s.Hkv, s.D}, 15),
              d_v = randn({s.B, s.S(), s.Hkv, s.D}, 16);
  OwnedTensor k_before(DType::f64, {s.B, s.S(), s.Hkv, s.D}), v_before(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  copy_convert(k_before, d_k);
  copy_convert(v_before, d_v);
  backward(d_q, d_k, d_v);
  auto check = [&](OwnedTensor& x, const Tensor& analytic, const OwnedTensor* before, const char* what) {
    std::vector<int64_t> offsets(static_cast<size_t>(x.tensor.numel()));
    for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = static_cast<int64_t>(i);
    const std::vector<double> fd = numeric_gradient(x.tensor.ptr<double>(), offsets, loss);
    std::vector<double> got(offsets.size());
    for (size_t i = 0; i < got.size(); ++i)
      got[i] = analytic.ptr<double>()[i] - (before ? before->tensor.ptr<double>()[i] : 0.0);
    INFO(std::string(what));
    // An input the loss does not depend on (q and k under a window of one key: out_i = v_i) has a
    // zero gradient: the differences are rounding noise (L's rounding over h) and so is the analytic
    // gradient (the softmax's Jacobian as a difference of two sums); neither is relative to the other.
    const bool zero = l2(fd) <= kFdNoise;
    if (zero) CHECK(l2(got) <= kZeroGradTol);
    else CHECK(rel_l2(got, fd) <= kFdTol);
  };
  check(q, d_q, nullptr, "d_q");
  check(k, d_k, &k_before, "d_k (added)");
  check(v, d_v, &v_before, "d_v (added)");
}
}  // namespace

TEST_CASE("attention documents: a chunk splits into spans at the document starts inside it") {
  // Sequence 0: documents at 0, 3, 7, 9 (chunk [5, 11) meets the ones from 3, 7 and 9); sequence 1:
  // one document from 0 and one from 8; a start past the chunk is ignored.
  const std::vector<std::vector<int64_t>> starts{{0, 3, 7, 9, 20}, {0, 8}};
  const std::vector<DocumentSpan> spans = document_spans(starts, 2, 5, 6);
  REQUIRE(spans.size() == 5);
  CHECK((spans[0].b == 0 && spans[0].q0 == 0 && spans[0].q1 == 2 && spans[0].k0 == 3));
  CHECK((spans[1].b == 0 && spans[1].q0 == 2 && spans[1].q1 == 4 && spans[1].k0 == 7));
  CHECK((spans[2].b == 0 && spans[2].q0 == 4 && spans[2].q1 == 6 && spans[2].k0 == 9));
  CHECK((spans[3].b == 1 && spans[3].q0 == 0 && spans[3].q1 == 3 && spans[3].k0 == 0));
  CHECK((spans[4].b == 1 && spans[4].q0 == 3 && spans[4].q1 == 6 && spans[4].k0 == 8));
  CHECK_THROWS_WITH_AS(document_spans({{1, 4}, {0}}, 2, 0, 4), doctest::Contains("must start at 0"), Error);
  CHECK_THROWS_WITH_AS(document_spans({{0, 4, 4}, {0}}, 2, 0, 8), doctest::Contains("must ascend"), Error);
  CHECK_THROWS_WITH_AS(document_spans({{0}}, 2, 0, 8), doctest::Contains("for 1 sequences"), Error);
}

TEST_CASE("attention documents: the step's first keys hold each position's document start") {
  // What a step uploads once for the one-call kernels (optim/schedule.h StepTokens): position t of
  // sequence b holds the last document start <= t; a start at or past T is ignored.
  const std::vector<std::vector<int64_t>> starts{{0, 3, 7, 9, 20}, {0, 8}};
  Arena arena;
  const Tensor first = document_first_keys(starts, 11, arena);
  REQUIRE(first.dtype == DType::i32);
  REQUIRE((first.size(0) == 2 && first.size(1) == 11));
  const std::vector<int32_t> want{0, 0, 0, 3, 3, 3, 3, 7, 7, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8};
  const int32_t* got = first.ptr<int32_t>();
  CHECK(std::vector<int32_t>(got, got + 22) == want);
}

TEST_CASE("attention documents: f64 forward against the masked softmax, backward against finite differences") {
  const Shape s;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  // One-token documents, a document that began before the chunk, one inside it, one at its last query.
  const std::vector<std::vector<int64_t>> starts{{0, 3, 7, 8, 10}, {0, 5}};
  auto [q, k, v, r] = draw(s, 11);
  Arena scratch;
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
  auto forward = [&] {
    attention_forward_documents(out, {lse}, q, k, v, starts, scale, scratch);
    return inner(out, r);
  };
  forward();
  CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale)) <= kForwardTol);
  check_backward(s, q, k, v, forward, [&](const Tensor& d_q, const Tensor& d_k, const Tensor& d_v) {
    attention_backward_documents(d_q, d_k, d_v, r, {lse}, q, k, v, out, starts, scale, GradMode::overwrite, scratch);
  });
}

TEST_CASE("attention window: f64 forward against the windowed softmax, alone and with documents; backward against "
          "finite differences") {
  // Chunk [5, 11) against keys [0, 11): windows shorter than the chunk, as long, longer than the keys.
  const Shape s;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  const std::vector<std::vector<int64_t>> one_document{{0}, {0}}, documents{{0, 3, 7, 8, 10}, {0, 2}};
  for (const int64_t window : {1, 3, 6, 9, 20})
    for (const bool with_documents : {false, true}) {
      CAPTURE(window);
      CAPTURE(with_documents);
      const auto& starts = with_documents ? documents : one_document;
      auto [q, k, v, r] = draw(s, 31);
      Arena scratch;
      OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
      auto forward = [&] {
        if (with_documents)
          attention_forward_documents(out, {lse}, q, k, v, starts, scale, scratch, window);
        else
          attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::causal, {window});
        return inner(out, r);
      };
      forward();
      CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale, window)) <= kForwardTol);
      // The window bites: without it the output is another, unless the window holds every query's keys
      // (at most 9 with these documents: sequence 1's query at 10 in the document from 2).
      if (window < (with_documents ? 9 : s.S()))
        CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale)) > 1e-3);
      check_backward(s, q, k, v, forward, [&](const Tensor& d_q, const Tensor& d_k, const Tensor& d_v) {
        if (with_documents)
          attention_backward_documents(d_q, d_k, d_v, r, {lse}, q, k, v, out, starts, scale, GradMode::overwrite,
                                       scratch, window);
        else
          attention_backward(d_q, d_k, d_v, r, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch,
                             AttentionMask::causal, {window});
      });
    }
}

TEST_CASE("attention window: keys before the window are neither read nor given gradient; the call on the window's "
          "keys alone is the same, bit for bit") {
  // Chunk [5, 11), window 3: the first query sees keys [3, 5], so keys [0, 3) are outside every window.
  const Shape s;
  const int64_t window = 3, first = s.p - window + 1;
  const double scale = 0.4;
  auto [q, k, v, r] = draw(s, 41);
  Arena scratch;
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
  attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::causal, {window});
  // The same call on views of keys [first, p + c) (what the K/V store passes under a window).
  const auto keys_from = [&](const Tensor& t) { return t.slice(1, first, s.S() - first); };
  OwnedTensor out2(DType::f64, {s.B, s.c, s.H, s.D}), lse2(DType::f64, {s.B, s.H, s.c});
  attention_forward(out2, {lse2}, q, keys_from(k), keys_from(v), scale, scratch, AttentionMask::causal, {window});
  CHECK(max_abs_diff(out, out2) == 0.0);
  CHECK(max_abs_diff(lse, lse2) == 0.0);
  // Keys outside every window made NaN change nothing; their dK, dV rows stay as they were.
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t x = 0; x < first * s.Hkv * s.D; ++x)
      k.tensor.ptr<double>()[b * s.S() * s.Hkv * s.D + x] = v.tensor.ptr<double>()[b * s.S() * s.Hkv * s.D + x] =
          std::numeric_limits<double>::quiet_NaN();
  attention_forward(out2, {lse2}, q, k, v, scale, scratch, AttentionMask::causal, {window});
  CHECK(max_abs_diff(out, out2) == 0.0);
  OwnedTensor d_q(DType::f64, {s.B, s.c, s.H, s.D}), d_k(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              d_v(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  fill(d_k, 7.0);
  fill(d_v, 7.0);
  attention_backward(d_q, d_k, d_v, r, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch,
                     AttentionMask::causal, {window});
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t x = 0; x < s.S() * s.Hkv * s.D; ++x) {
      const bool before = x < first * s.Hkv * s.D;
      const double dk = d_k.tensor.ptr<double>()[b * s.S() * s.Hkv * s.D + x];
      if (before) CHECK(dk == 7.0);
      else CHECK(std::isfinite(dk));
    }
}

TEST_CASE("attention window: an unmasked block some of whose rows see none of its keys merges into the one call") {
  // Chunk [8, 14) with a window of 6: the block of keys [0, 8) holds the window's older keys of the
  // first queries only (query 8 sees [3, 8], query 13 sees [8, 13]: none of the block). Those rows
  // get lse -inf and out 0; merged with the causal call on the chunk's own keys, the result is the
  // one call's, and the blocks' backwards sum to its gradients.
  const Shape s{.B = 2, .c = 6, .p = 8, .H = 4, .Hkv = 2, .D = 8};
  const int64_t window = 6;
  const double scale = 0.35;
  auto [q, k, v, r] = draw(s, 51);
  Arena scratch;
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
  attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::causal, {window});
  const auto rows = [&](const Tensor& t, int64_t r0, int64_t n) { return t.slice(1, r0, n); };
  OwnedTensor acc(DType::f64, {s.B, s.c, s.H, s.D}), acc_lse(DType::f64, {s.B, s.H, s.c});
  OwnedTensor block(DType::f64, {s.B, s.c, s.H, s.D}), block_lse(DType::f64, {s.B, s.H, s.c});
  attention_forward(acc, {acc_lse}, q, rows(k, s.p, s.c), rows(v, s.p, s.c), scale, scratch, AttentionMask::causal,
                    {window});
  attention_forward(block, {block_lse}, q, rows(k, 0, s.p), rows(v, 0, s.p), scale, scratch, AttentionMask::none,
                    {window, s.p});
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const double last = block_lse.tensor.ptr<double>()[(b * s.H + h) * s.c + s.c - 1];
      CHECK((std::isinf(last) && last < 0));
    }
  attention_merge(acc, acc_lse, block, block_lse);
  CHECK(max_abs_diff(acc, out) <= kForwardTol);
  CHECK(max_abs_diff(acc_lse, lse) <= kForwardTol);
  // Backward in two blocks with the merged out and lse: dQ summed, dK, dV each block's rows.
  OwnedTensor d_q(DType::f64, {s.B, s.c, s.H, s.D}), d_k(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              d_v(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  fill(d_k, 0.0);
  fill(d_v, 0.0);
  attention_backward(d_q, d_k, d_v, r, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch,
                     AttentionMask::causal, {window});
  OwnedTensor e_q(DType::f64, {s.B, s.c, s.H, s.D}), e_k(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              e_v(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  fill(e_k, 0.0);
  fill(e_v, 0.0);
  attention_backward(e_q, rows(e_k, s.p, s.c), rows(e_v, s.p, s.c), r, {lse}, q, rows(k, s.p, s.c),
                     rows(v, s.p, s.c), out, scale, GradMode::overwrite, scratch, AttentionMask::causal, {window});
  attention_backward(e_q, rows(e_k, 0, s.p), rows(e_v, 0, s.p), r, {lse}, q, rows(k, 0, s.p), rows(v, 0, s.p), out,
                     scale, GradMode::accumulate, scratch, AttentionMask::none, {window, s.p});
  CHECK(max_abs_diff(e_q, d_q) <= kForwardTol);
  CHECK(max_abs_diff(e_k, d_k) <= kForwardTol);
  CHECK(max_abs_diff(e_v, d_v) <= kForwardTol);
  // An unmasked block's queries must sit past its keys.
  CHECK_THROWS_WITH_AS(attention_forward(block, {block_lse}, q, rows(k, 0, s.p), rows(v, 0, s.p), scale, scratch,
                                         AttentionMask::none, {window, s.p - 1}),
                       doctest::Contains("window distance"), Error);
}

TEST_CASE("attention softcap: f64 forward against the capped softmax written out, alone, in a window and with "
          "documents; backward against finite differences; the blocks of a prefix merge into the one call") {
  // Caps of 0.5 and 2 against scores of about unit size (tanh far from linear), and 50 (Gemma 2's,
  // nearly the identity here: the cap must still be applied, not dropped).
  const Shape s;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  const std::vector<std::vector<int64_t>> one_document{{0}, {0}}, documents{{0, 3, 7, 8, 10}, {0, 2}};
  for (const double cap : {0.5, 2.0, 50.0})
    for (const int64_t window : {0, 4})
      for (const bool with_documents : {false, true}) {
        CAPTURE(cap);
        CAPTURE(window);
        CAPTURE(with_documents);
        const auto& starts = with_documents ? documents : one_document;
        auto [q, k, v, r] = draw(s, 61);
        Arena scratch;
        OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
        auto forward = [&] {
          if (with_documents)
            attention_forward_documents(out, {lse}, q, k, v, starts, scale, scratch, window, cap);
          else
            attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::causal, {window}, cap);
          return inner(out, r);
        };
        forward();
        CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale, window, cap)) <= kForwardTol);
        // The cap bites: without it the output is another (by far less at a cap of 50).
        CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale, window)) > (cap < 10 ? 1e-2 : 1e-6));
        check_backward(s, q, k, v, forward, [&](const Tensor& d_q, const Tensor& d_k, const Tensor& d_v) {
          if (with_documents)
            attention_backward_documents(d_q, d_k, d_v, r, {lse}, q, k, v, out, starts, scale, GradMode::overwrite,
                                         scratch, window, cap);
          else
            attention_backward(d_q, d_k, d_v, r, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch,
                               AttentionMask::causal, {window}, cap);
        });
      }
  // The streamed store's order under a cap: the chunk [5, 11) against its own keys, then the unmasked
  // block [0, 5) merged; the backward of each block with the combined out and lse sums to the one call's.
  const double cap = 0.5;
  auto [q, k, v, r] = draw(s, 71);
  Arena scratch;
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
  attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::causal, {}, cap);
  const auto rows = [&](const Tensor& t, int64_t r0, int64_t n) { return t.slice(1, r0, n); };
  OwnedTensor acc(DType::f64, {s.B, s.c, s.H, s.D}), acc_lse(DType::f64, {s.B, s.H, s.c});
  OwnedTensor block(DType::f64, {s.B, s.c, s.H, s.D}), block_lse(DType::f64, {s.B, s.H, s.c});
  attention_forward(acc, {acc_lse}, q, rows(k, s.p, s.c), rows(v, s.p, s.c), scale, scratch, AttentionMask::causal, {},
                    cap);
  attention_forward(block, {block_lse}, q, rows(k, 0, s.p), rows(v, 0, s.p), scale, scratch, AttentionMask::none, {},
                    cap);
  attention_merge(acc, acc_lse, block, block_lse);
  CHECK(max_abs_diff(acc, out) <= kForwardTol);
  CHECK(max_abs_diff(acc_lse, lse) <= kForwardTol);
  OwnedTensor d_q(DType::f64, {s.B, s.c, s.H, s.D}), d_k(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              d_v(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  fill(d_k, 0.0);
  fill(d_v, 0.0);
  attention_backward(d_q, d_k, d_v, r, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch,
                     AttentionMask::causal, {}, cap);
  OwnedTensor e_q(DType::f64, {s.B, s.c, s.H, s.D}), e_k(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              e_v(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  fill(e_k, 0.0);
  fill(e_v, 0.0);
  attention_backward(e_q, rows(e_k, s.p, s.c), rows(e_v, s.p, s.c), r, {lse}, q, rows(k, s.p, s.c),
                     rows(v, s.p, s.c), out, scale, GradMode::overwrite, scratch, AttentionMask::causal, {}, cap);
  attention_backward(e_q, rows(e_k, 0, s.p), rows(e_v, 0, s.p), r, {lse}, q, rows(k, 0, s.p), rows(v, 0, s.p), out,
                     scale, GradMode::accumulate, scratch, AttentionMask::none, {}, cap);
  CHECK(max_abs_diff(e_q, d_q) <= kForwardTol);
  CHECK(max_abs_diff(e_k, d_k) <= kForwardTol);
  CHECK(max_abs_diff(e_v, d_v) <= kForwardTol);
  // A cap must be positive and finite (0: none).
  CHECK_THROWS_WITH_AS(attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::causal, {}, -1.0),
                       doctest::Contains("score cap"), Error);
}

TEST_CASE("attention documents: one document a sequence is the plain causal call, bit for bit") {
  const Shape s;
  const double scale = 0.3;
  OwnedTensor q = randn({s.B, s.c, s.H, s.D}, 21), k = randn({s.B, s.S(), s.Hkv, s.D}, 22),
              v = randn({s.B, s.S(), s.Hkv, s.D}, 23);
  Arena scratch;
  OwnedTensor a(DType::f64, {s.B, s.c, s.H, s.D}), la(DType::f64, {s.B, s.H, s.c});
  OwnedTensor b(DType::f64, {s.B, s.c, s.H, s.D}), lb(DType::f64, {s.B, s.H, s.c});
  attention_forward(a, {la}, q, k, v, scale, scratch);
  attention_forward_documents(b, {lb}, q, k, v, {{0}, {0}}, scale, scratch);
  CHECK(max_abs_diff(a, b) == 0.0);
  CHECK(max_abs_diff(la, lb) == 0.0);
}

TEST_CASE("attention documents: the prefix block by block (own keys, then earlier blocks merged) equals one call") {
  // The streamed store's order (model/kv_residency.h): the chunk against its own keys with the starts
  // inside it, then each earlier block through attention_merge_documents_block; the backward per
  // block given the combined out and lse. Chunk [9, 15) of 15 keys in blocks of 3: sequence 0's
  // documents begin at 0, 4, 10 and 12 (the chunk's first begun in block 1, cut by the block edge at
  // 6), sequence 1's at 0 and 14 (its first reaches every block); a document of one token at 14.
  Shape s;
  s.c = 6;
  s.p = 9;
  const int64_t block = 3;
  const double scale = 0.4;
  const std::vector<std::vector<int64_t>> starts{{0, 4, 10, 12}, {0, 14}};
  auto [q, k, v, d_out] = draw(s, 31);
  Arena scratch;
  // One call over all keys.
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
  attention_forward_documents(out, {lse}, q, k, v, starts, scale, scratch);
  OwnedTensor d_q(DType::f64, {s.B, s.c, s.H, s.D}), d_k(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              d_v(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  attention_backward_documents(d_q, d_k, d_v, d_out, {lse}, q, k, v, out, starts, scale, GradMode::overwrite,
                               scratch);

  // Block by block: the own keys [9, 15) first, the starts counted from 9 (0: the documents begun before).
  const std::vector<std::vector<int64_t>> local{{0, 1, 3}, {0, 5}};
  const auto keys = [&](const OwnedTensor& t, int64_t k0, int64_t n) { return t.tensor.slice(1, k0, n); };
  OwnedTensor out_b(DType::f64, {s.B, s.c, s.H, s.D}), lse_b(DType::f64, {s.B, s.H, s.c});
  attention_forward_documents(out_b, {lse_b}, q, keys(k, s.p, s.c), keys(v, s.p, s.c), local, scale, scratch);
  for (int64_t k0 = 0; k0 < s.p; k0 += block)
    attention_merge_documents_block(out_b, lse_b, q, keys(k, k0, block), keys(v, k0, block), s.p, k0, starts, scale,
                                    scratch);
  CHECK(max_abs_diff(out_b, out) <= kForwardTol);
  CHECK(max_abs_diff(lse_b, lse) <= kForwardTol);
  CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale)) <= kForwardTol);

  OwnedTensor dq_b(DType::f64, {s.B, s.c, s.H, s.D}), dk_b(DType::f64, {s.B, s.S(), s.Hkv, s.D}),
              dv_b(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  attention_backward_documents(dq_b, keys(dk_b, s.p, s.c), keys(dv_b, s.p, s.c), d_out, {lse}, q, keys(k, s.p, s.c),
                               keys(v, s.p, s.c), out, local, scale, GradMode::overwrite, scratch);
  for (int64_t k0 = 0; k0 < s.p; k0 += block)
    attention_backward_documents_block(dq_b, keys(dk_b, k0, block), keys(dv_b, k0, block), d_out, {lse}, q,
                                       keys(k, k0, block), keys(v, k0, block), out, s.p, k0, starts, scale, scratch);
  CHECK(max_abs_diff(dq_b, d_q) <= kForwardTol);
  CHECK(max_abs_diff(dk_b, d_k) <= kForwardTol);
  CHECK(max_abs_diff(dv_b, d_v) <= kForwardTol);
  // Sequence 0's keys before its document at 4 get no gradient (sequence 1 reads every block).
  for (int64_t i = 0; i < 4 * s.Hkv * s.D; ++i) CHECK(dk_b.tensor.ptr<double>()[i] == 0.0);
  // A block that ends past the chunk's position is refused.
  CHECK_THROWS_WITH_AS(attention_merge_documents_block(out_b, lse_b, q, keys(k, 8, 3), keys(v, 8, 3), s.p, 8, starts,
                                                       scale, scratch),
                       doctest::Contains("must precede the chunk"), Error);
}
