// Context parallelism's exchange of tokens for heads (parallel/context_parallel.h), on the threads
// backend in f64:
//   - each rank's heads (cp_heads_of_rank): shares when the ranks divide the heads, one head on
//     several ranks when the heads divide the ranks; check_context_parallel refuses any other split;
//   - cp_to_heads' forward gives rank r every token of its heads, bitwise, for query heads and K/V
//     heads with and without replicas; cp_to_tokens is its inverse, bitwise;
//   - each map's backward is the adjoint of its forward over the group, and to_heads' backward sums
//     the replicas' gradients (the definition written out, in rank order: bitwise);
//   - bad operands fail with one line.
#include "engine/random.h"
#include "parallel/context_parallel.h"
#include "tests/support.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

using namespace cw;

namespace {

OwnedTensor random_tensor(std::vector<int64_t> shape, uint64_t seed, uint64_t stream) {
  OwnedTensor t = OwnedTensor::of_shape(DType::f64, shape);
  fill_normal(t, seed, stream);
  return t;
}

std::vector<int64_t> shape_of(const Tensor& t) { return {t.shape.begin(), t.shape.begin() + t.ndim}; }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data, b.data, a.bytes()) == 0;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.ptr<double>()[i] * b.ptr<double>()[i];
  return s;
}

// x [B, T, G, D] as each rank's tokens: rank s's [B, n, G, D] holds x[:, s n + i].
std::vector<OwnedTensor> split_tokens(const Tensor& x, int64_t ranks) {
  const int64_t B = x.size(0), T = x.size(1), G = x.size(2), D = x.size(3), n = T / ranks;
  std::vector<OwnedTensor> parts;
  for (int64_t s = 0; s < ranks; ++s) {
    OwnedTensor p = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B, n, G, D});
    copy_convert(p, x.slice(1, s * n, n));
    parts.push_back(std::move(p));
  }
  return parts;
}

struct Shape {
  int64_t B, T, G, D, P;
};

}  // namespace

TEST_CASE("context parallel: each rank's heads, and the splits refused") {
  // Query heads over 4 ranks: two each.
  for (int64_t r = 0; r < 4; ++r) {
    CHECK(cp_heads_of_rank(8, 4, r).first == 2 * r);
    CHECK(cp_heads_of_rank(8, 4, r).count == 2);
  }
  // Two K/V heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1 (the query heads
  // 0-3 of 8 read K/V head 0, as ranks 0 and 1 attend them).
  const int64_t first[] = {0, 0, 1, 1};
  for (int64_t r = 0; r < 4; ++r) {
    CHECK(cp_heads_of_rank(2, 4, r).first == first[r]);
    CHECK(cp_heads_of_rank(2, 4, r).count == 1);
  }
  check_context_parallel(4, 8, 2, 64);
  check_context_parallel(2, 8, 8, 64);
  check_context_parallel(1, 3, 1, 7);
  CHECK(test::contains(test::error_of([] { check_context_parallel(3, 8, 2, 63); }),
                       "context parallelism over 3 ranks: 8 query heads do not split into 3 equal parts"));
  CHECK(test::contains(test::error_of([] { check_context_parallel(4, 12, 6, 64); }),
                       "context parallelism over 4 ranks: 6 K/V heads neither split into 4 equal parts nor divide 4"));
  CHECK(test::contains(test::error_of([] { check_context_parallel(4, 8, 4, 30); }),
                       "context parallelism over 4 ranks: 30 tokens do not split into 4 equal parts"));
}

TEST_CASE("context parallel: to_heads gives each rank every token of its heads, to_tokens undoes it, bitwise") {
  // Query heads (G = 8 or 4 over 1, 2, 4 ranks) and K/V heads with replicas (G = 2 or 1 over 4).
  for (const Shape& s : {Shape{2, 12, 8, 3, 1}, Shape{2, 12, 8, 3, 2}, Shape{1, 8, 4, 5, 4}, Shape{3, 8, 2, 2, 4},
                         Shape{2, 4, 1, 3, 4}, Shape{2, 6, 4, 2, 2}}) {
    CAPTURE(s.G);
    CAPTURE(s.P);
    const OwnedTensor x = random_tensor({s.B, s.T, s.G, s.D}, 11, static_cast<uint64_t>(s.P * 16 + s.G));
    const std::vector<OwnedTensor> tokens = split_tokens(x, s.P);
    std::vector<OwnedTensor> heads(static_cast<size_t>(s.P)), back(static_cast<size_t>(s.P));
    run_thread_ranks(static_cast<int>(s.P), [&](Communicator& comm) {
      const int r = comm.rank();
      const HeadRange mine = cp_heads_of_rank(s.G, s.P, r);
      heads[r] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{s.B, s.T, mine.count, s.D});
      fill(heads[r], NAN);
      cp_to_heads_forward(comm, tokens[r], heads[r]);
      if (s.G % s.P == 0) {  // no replicas: to_tokens is the inverse
        back[r] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{s.B, s.T / s.P, s.G, s.D});
        fill(back[r], NAN);
        cp_to_tokens_forward(comm, heads[r], back[r]);
      }
    });
    for (int64_t r = 0; r < s.P; ++r) {
      CAPTURE(r);
      const HeadRange mine = cp_heads_of_rank(s.G, s.P, r);
      OwnedTensor expected = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{s.B, s.T, mine.count, s.D});
      copy_convert(expected, x.tensor.slice(2, mine.first, mine.count));
      CHECK(same_bits(heads[r], expected));
      if (s.G % s.P == 0) CHECK(same_bits(back[r], tokens[r]));
    }
  }
}

TEST_CASE("context parallel: each backward is its forward's adjoint; to_heads' backward sums the replicas") {
  for (const Shape& s : {Shape{2, 8, 8, 3, 2}, Shape{2, 8, 8, 3, 4}, Shape{2, 8, 2, 3, 4}, Shape{1, 12, 1, 4, 3},
                         Shape{2, 8, 4, 2, 1}}) {
    CAPTURE(s.G);
    CAPTURE(s.P);
    const uint64_t seed = static_cast<uint64_t>(100 + s.P * 16 + s.G);
    const std::vector<OwnedTensor> x = split_tokens(random_tensor({s.B, s.T, s.G, s.D}, seed, 1), s.P);
    std::vector<OwnedTensor> y, fx(static_cast<size_t>(s.P)), fty(static_cast<size_t>(s.P));
    for (int64_t r = 0; r < s.P; ++r)
      y.push_back(random_tensor({s.B, s.T, cp_heads_of_rank(s.G, s.P, r).count, s.D}, seed, 2 + static_cast<uint64_t>(r)));
    std::vector<OwnedTensor> gx(static_cast<size_t>(s.P)), gty(static_cast<size_t>(s.P));
    run_thread_ranks(static_cast<int>(s.P), [&](Communicator& comm) {
      const int r = comm.rank();
      fx[r] = OwnedTensor::of_shape(DType::f64, shape_of(y[r]));
      cp_to_heads_forward(comm, x[r], fx[r]);
      fty[r] = OwnedTensor::of_shape(DType::f64, shape_of(x[r]));
      fill(fty[r], NAN);
      cp_to_heads_backward(comm, y[r], fty[r]);
      if (s.G % s.P == 0) {  // to_tokens: heads -> tokens, adjoint to_heads
        gx[r] = OwnedTensor::of_shape(DType::f64, shape_of(x[r]));
        cp_to_tokens_forward(comm, y[r], gx[r]);
        gty[r] = OwnedTensor::of_shape(DType::f64, shape_of(y[r]));
        cp_to_tokens_backward(comm, x[r], gty[r]);
      }
    });
    double lhs = 0, rhs = 0, lhs2 = 0, rhs2 = 0;
    for (int64_t r = 0; r < s.P; ++r) {
      lhs += dot(fx[r], y[r]);
      rhs += dot(x[r], fty[r]);
      if (s.G % s.P == 0) {
        lhs2 += dot(gx[r], x[r]);
        rhs2 += dot(y[r], gty[r]);
      }
    }
    CHECK(std::abs(lhs - rhs) <= 1e-13 * std::max(1.0, std::abs(rhs)));
    CHECK(std::abs(lhs2 - rhs2) <= 1e-13 * std::max(1.0, std::abs(rhs2)));
    // The backward written out: token i of rank t, head j, is the sum over the ranks q holding head j
    // of their gradient at token t n + i, in rank order.
    const int64_t n = s.T / s.P;
    for (int64_t t = 0; t < s.P; ++t)
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < s.G; ++j)
            for (int64_t d = 0; d < s.D; ++d) {
              double sum = 0;
              bool first = true;
              for (int64_t q = 0; q < s.P; ++q) {
                const HeadRange h = cp_heads_of_rank(s.G, s.P, q);
                if (j < h.first || j >= h.first + h.count) continue;
                const double v = y[q].tensor.ptr<double>()[((b * s.T + t * n + i) * h.count + (j - h.first)) * s.D + d];
                sum = first ? v : sum + v;
                first = false;
              }
              const double got = fty[t].tensor.ptr<double>()[((b * n + i) * s.G + j) * s.D + d];
              if (got != sum) {
                FAIL_CHECK("to_heads' backward at rank " << t << " b " << b << " token " << i << " head " << j << ": "
                                                           << got << " against " << sum);
                return;
              }
            }
  }
}

TEST_CASE("context parallel: operands that do not fit the exchange fail with one line") {
  run_thread_ranks(2, [&](Communicator& comm) {
    OwnedTensor tokens = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 4, 4, 2});
    OwnedTensor heads = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 8, 2, 2});
    OwnedTensor wrong = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 8, 4, 2});
    OwnedTensor f32 = OwnedTensor::of_shape(DType::f32, std::vector<int64_t>{1, 8, 2, 2});
    OwnedTensor odd = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{1, 4, 3, 2});
    CHECK(test::contains(test::error_of([&] { cp_to_heads_forward(comm, tokens, wrong); }),
                         fmt::format("cp_to_heads_forward: rank {} of 2 holds [1, 8, 2, 2] heads", comm.rank())));
    CHECK(test::contains(test::error_of([&] { cp_to_heads_forward(comm, tokens, f32); }),
                         "cp_to_heads_forward: tokens are f64 but heads f32"));
    CHECK(test::contains(test::error_of([&] { cp_to_heads_forward(comm, odd, heads); }),
                         "context parallelism over 2 ranks: 3 heads neither split into 2 equal parts nor divide 2"));
    CHECK(test::contains(test::error_of([&] { cp_to_tokens_forward(comm, heads, tokens.tensor.view({1, 4, 1, 8})); }),
                         "cp_to_tokens_forward: the 1 heads of f64 cpu [1, 4, 1, 8] do not split over 2 ranks"));
    // Still in step after the refusals (none issued a collective).
    cp_to_heads_forward(comm, tokens, heads);
  });
}
