// Attention with a document mask (engine/ops/attention.h, attention_forward_documents /
// attention_backward_documents), in f64 on the CPU: the forward against the masked softmax written out
// here, the backward against finite differences of L = <R, out>, the spans a chunk splits into, and
// the operand checks. The schedules' packed documents are checked against documents run one by one in
// tests/optim/test_documents.cpp; the GPU kernels against this in the op table.
#include "engine/ops/attention.h"
#include "tests/engine/fd_check.h"

#include <cmath>
#include <limits>

using namespace cw;
using namespace cw::test;

namespace {
// A fourth-order stencil in f64 with h = 1e-3 leaves ~1e-10 of truncation and rounding.
constexpr double kFdTol = 1e-8;
// Forwards written two ways agree to rounding.
constexpr double kForwardTol = 1e-13;

struct Shape {
  int64_t B = 2, c = 6, p = 5, H = 4, Hkv = 2, D = 8;
  int64_t S() const { return p + c; }
};

// out[b, i, h] = sum_j P v_j over keys j in [start(p + i), p + i] of sequence b, written out.
OwnedTensor masked_reference(const Shape& s, const OwnedTensor& q, const OwnedTensor& k, const OwnedTensor& v,
                             const std::vector<std::vector<int64_t>>& starts, double scale) {
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
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t g = h / group;
        std::vector<double> score;
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = first; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < s.D; ++d)
            dot += Q[((b * s.c + i) * s.H + h) * s.D + d] * K[((b * S + j) * s.Hkv + g) * s.D + d];
          score.push_back(scale * dot);
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

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
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

TEST_CASE("attention documents: f64 forward against the masked softmax, backward against finite differences") {
  const Shape s;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  // One-token documents, a document that began before the chunk, one inside it, one at its last query.
  const std::vector<std::vector<int64_t>> starts{{0, 3, 7, 8, 10}, {0, 5}};
  OwnedTensor q = randn({s.B, s.c, s.H, s.D}, 11), k = randn({s.B, s.S(), s.Hkv, s.D}, 12),
              v = randn({s.B, s.S(), s.Hkv, s.D}, 13), r = randn({s.B, s.c, s.H, s.D}, 14);
  Arena scratch;
  OwnedTensor out(DType::f64, {s.B, s.c, s.H, s.D}), lse(DType::f64, {s.B, s.H, s.c});
  auto forward = [&] {
    attention_forward_documents(out, {lse}, q, k, v, starts, scale, scratch);
    return inner(out, r);
  };
  forward();
  CHECK(max_abs_diff(out, masked_reference(s, q, k, v, starts, scale)) <= kForwardTol);

  // Backward: d_q overwritten, d_k and d_v added into a random prefill.
  OwnedTensor d_q(DType::f64, {s.B, s.c, s.H, s.D}), d_k = randn({s.B, s.S(), s.Hkv, s.D}, 15),
              d_v = randn({s.B, s.S(), s.Hkv, s.D}, 16);
  OwnedTensor k_before(DType::f64, {s.B, s.S(), s.Hkv, s.D}), v_before(DType::f64, {s.B, s.S(), s.Hkv, s.D});
  copy_convert(k_before, d_k);
  copy_convert(v_before, d_v);
  attention_backward_documents(d_q, d_k, d_v, r, {lse}, q, k, v, out, starts, scale, GradMode::overwrite, scratch);
  auto check = [&](OwnedTensor& x, const Tensor& analytic, const OwnedTensor* before, const char* what) {
    std::vector<int64_t> offsets(static_cast<size_t>(x.tensor.numel()));
    for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = static_cast<int64_t>(i);
    const std::vector<double> fd = numeric_gradient(x.tensor.ptr<double>(), offsets, forward);
    std::vector<double> got(offsets.size());
    for (size_t i = 0; i < got.size(); ++i)
      got[i] = analytic.ptr<double>()[i] - (before ? before->tensor.ptr<double>()[i] : 0.0);
    INFO(what);
    CHECK(rel_l2(got, fd) <= kFdTol);
  };
  check(q, d_q, nullptr, "d_q");
  check(k, d_k, &k_before, "d_k (added)");
  check(v, d_v, &v_before, "d_v (added)");
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
  OwnedTensor q = randn({s.B, s.c, s.H, s.D}, 31), k = randn({s.B, s.S(), s.Hkv, s.D}, 32),
              v = randn({s.B, s.S(), s.Hkv, s.D}, 33), d_out = randn({s.B, s.c, s.H, s.D}, 34);
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
