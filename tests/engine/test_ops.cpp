// The CPU ops: what the op table (test_backend_ops.cpp: gradients against finite differences, f32
// against f64, every GPU kernel against f64) does not express. The f64 forwards, the reference for
// everything else, against formulas written out here; the properties the schedules rely on (chunked
// attention equals whole-sequence attention, a K/V slice equals packed K/V, rope in place); and the
// operand checks.
#include "engine/ops/attention.h"
#include "engine/ops/embedding.h"
#include "engine/ops/linear.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/ops/residual.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "engine/random.h"
#include "tests/engine/fd_check.h"

#include <cmath>
#include <cstring>
#include <numbers>

using namespace cw;
using namespace cw::test;

TEST_CASE("ops: f64 forwards against formulas written out") {
  const auto at = [](const OwnedTensor& t, int64_t i) { return t.tensor.ptr<double>()[i]; };
  // embedding: out[n] = table[ids[n]]
  OwnedTensor table = randn({7, 5}, 1), ids(DType::i32, {2}), e(DType::f64, {2, 5});
  ids.tensor.ptr<int32_t>()[0] = 3, ids.tensor.ptr<int32_t>()[1] = 6;
  embedding_forward(e, ids, table);
  CHECK(at(e, 5 + 1) == at(table, 6 * 5 + 1));
  // rmsnorm: x w / sqrt(mean x^2 + eps)
  OwnedTensor x = randn({2, 6}, 2), w = randn({6}, 3, 0.3, 1.0), y(DType::f64, {2, 6}), rstd(DType::f64, {2});
  rmsnorm_forward(y, {rstd}, x, w, 1e-5);
  double ms = 0;
  for (int i = 6; i < 12; ++i) ms += at(x, i) * at(x, i) / 6;
  CHECK(at(y, 6 + 4) == doctest::Approx(at(x, 6 + 4) * at(w, 4) / std::sqrt(ms + 1e-5)).epsilon(1e-14));
  // linear: y = x W^T
  OwnedTensor W = randn({3, 6}, 4), z(DType::f64, {2, 3});
  linear_forward(z, x, W);
  double z01 = 0;
  for (int i = 0; i < 6; ++i) z01 += at(x, i) * at(W, 6 + i);
  CHECK(at(z, 1) == doctest::Approx(z01).epsilon(1e-14));
  // swiglu: silu(g) u
  OwnedTensor u = randn({2, 6}, 5), s(DType::f64, {2, 6});
  swiglu_forward(s, x, u);
  CHECK(at(s, 8) == doctest::Approx(at(x, 8) / (1 + std::exp(-at(x, 8))) * at(u, 8)).epsilon(1e-14));
  // residual: x + delta
  OwnedTensor r(DType::f64, {2, 6});
  residual_forward(r, x, s);
  CHECK(at(r, 4) == at(x, 4) + at(s, 4));
}

TEST_CASE("rope: llama3 frequencies; a rotation; in place equals out of place; the table bounds") {
  // llama3 scaling: high frequencies unchanged, low ones divided by the factor, the middle blended.
  RopeScaling s{RopeScaling::Type::llama3, 8.0, 1.0, 4.0, 8192};
  const std::vector<double> plain = rope_inv_freq(128, 500000.0, RopeScaling{});
  const std::vector<double> scaled = rope_inv_freq(128, 500000.0, s);
  CHECK(scaled[0] == plain[0]);                           // wavelength 2 pi < 8192 / 4
  CHECK(scaled[63] == doctest::Approx(plain[63] / 8.0));  // wavelength > 8192
  for (size_t i = 0; i < 64; ++i) {
    const double wl = 2 * std::numbers::pi / plain[i];
    if (wl >= 2048 && wl <= 8192) {
      CHECK(scaled[i] < plain[i]);
      CHECK(scaled[i] > plain[i] / 8.0);
    }
  }
  const int64_t B = 2, T = 5, H = 3, D = 8, P = 16, pos0 = 7;
  OwnedTensor cos(DType::f64, {P, D / 2}), sin(DType::f64, {P, D / 2});
  rope_tables(cos, sin, D, 10000.0, RopeScaling{RopeScaling::Type::llama3, 4.0, 1.0, 4.0, 8});
  OwnedTensor x = randn({B, T, H, D}, 9), y(DType::f64, {B, T, H, D});
  rope_forward(y, x, cos, sin, pos0);
  CHECK(sum_squares(y) == doctest::Approx(sum_squares(x)).epsilon(1e-13));  // a rotation keeps norms
  OwnedTensor z(DType::f64, {B, T, H, D});
  copy_convert(z, x);
  rope_forward(z, z, cos, sin, pos0);
  CHECK(compare(z, y).rel == 0.0);
  CHECK_THROWS_AS(rope_forward(y, x, cos, sin, 12), Error);  // positions past the table
}

TEST_CASE("rope: heads that are a column slice of wider rows give the packed heads' values, in and out of place") {
  const int64_t B = 2, T = 5, H = 3, D = 8, P = 16, pos0 = 4, W = 3 * H * D + 8, col0 = H * D + 4;
  OwnedTensor cos(DType::f64, {P, D / 2}), sin(DType::f64, {P, D / 2});
  rope_tables(cos, sin, D, 10000.0, RopeScaling{});
  OwnedTensor rows = randn({B * T, W}, 31), x(DType::f64, {B, T, H, D});
  const Tensor xs = head_columns(rows, col0, B, T, H, D);
  copy_convert(x, xs);
  OwnedTensor want(DType::f64, {B, T, H, D}), back(DType::f64, {B, T, H, D});
  rope_forward(want, x, cos, sin, pos0);
  rope_backward(back, x, cos, sin, pos0, GradMode::overwrite);
  // strided in, packed out; packed in, strided out; strided in place; backward accumulating into strided
  OwnedTensor got(DType::f64, {B, T, H, D}), out_rows(DType::f64, {B * T, W}), unpacked(DType::f64, {B, T, H, D});
  rope_forward(got, xs, cos, sin, pos0);
  CHECK(compare(got, want).rel == 0.0);
  fill(out_rows, 7.0);
  const Tensor os = head_columns(out_rows, col0, B, T, H, D);
  rope_forward(os, x, cos, sin, pos0);
  copy_convert(unpacked, os);
  CHECK(compare(unpacked, want).rel == 0.0);
  CHECK(out_rows.tensor.ptr<double>()[0] == 7.0);  // the columns outside the slice untouched
  CHECK(out_rows.tensor.ptr<double>()[W - 1] == 7.0);
  rope_backward(os, os, cos, sin, pos0, GradMode::overwrite);  // rotates back: os holds x again to rounding
  copy_convert(unpacked, os);
  CHECK(compare(unpacked, x).rel < 1e-15);
  copy_convert(os, x);
  rope_forward(os, os, cos, sin, pos0);
  copy_convert(unpacked, os);
  CHECK(compare(unpacked, want).rel == 0.0);
  fill(out_rows, 0.0);
  rope_backward(os, x, cos, sin, pos0, GradMode::accumulate);
  copy_convert(unpacked, os);
  CHECK(compare(unpacked, back).rel == 0.0);
  // Any other layout is refused, naming the operand.
  Tensor bad = xs;
  bad.stride[2] = D + 1;
  CHECK_THROWS_WITH_AS(rope_forward(got, bad, cos, sin, pos0), doctest::Contains("rope in"), Error);
}

TEST_CASE("attention: a chunk equals the last rows of whole-sequence attention; a K/V slice equals packed K/V") {
  const int64_t B = 2, H = 4, Hkv = 2, D = 4, p = 5, c = 3, S = p + c;
  const double scale = 1.0 / std::sqrt(double(D));
  OwnedTensor k = randn({B, S, Hkv, D}, 12), v = randn({B, S, Hkv, D}, 13), lse(DType::f64, {B, H, c});
  Arena scratch;
  OwnedTensor qfull = randn({B, S, H, D}, 17), ofull(DType::f64, {B, S, H, D}), lfull(DType::f64, {B, H, S});
  attention_forward(ofull, {lfull}, qfull, k, v, scale, scratch);
  OwnedTensor qlast(DType::f64, {B, c, H, D}), olast(DType::f64, {B, c, H, D}), expect(DType::f64, {B, c, H, D});
  copy_convert(qlast, qfull.tensor.slice(1, p, c));
  attention_forward(olast, {lse}, qlast, k, v, scale, scratch);
  copy_convert(expect, ofull.tensor.slice(1, p, c));
  CHECK(compare(olast, expect).rel < kSameMathF64Tol);

  OwnedTensor kstore(DType::f64, {B, S + 4, Hkv, D}), vstore(DType::f64, {B, S + 4, Hkv, D}), out2(DType::f64, {B, c, H, D});
  copy_convert(kstore.tensor.slice(1, 0, S), k);
  copy_convert(vstore.tensor.slice(1, 0, S), v);
  attention_forward(out2, {lse}, qlast, kstore.tensor.slice(1, 0, S), vstore.tensor.slice(1, 0, S), scale, scratch);
  CHECK(compare(out2, olast).rel == 0.0);
}

// A chunk of c queries against p earlier keys and its own, f64, GQA 2: the operands (seeds seed..seed+3),
// and out, lse, d_q and zeroed d_k, d_v for a call to fill.
struct ChunkOperands {
  static constexpr int64_t B = 2, H = 4, Hkv = 2, D = 4, p = 11, c = 5, S = p + c;
  const double scale = 1.0 / std::sqrt(double(D));
  OwnedTensor q, k, v, d_out, out, lse, d_q, d_k, d_v;
  explicit ChunkOperands(uint64_t seed)
      : q(randn({B, c, H, D}, seed)), k(randn({B, S, Hkv, D}, seed + 1)), v(randn({B, S, Hkv, D}, seed + 2)),
        d_out(randn({B, c, H, D}, seed + 3)), out(DType::f64, {B, c, H, D}), lse(DType::f64, {B, H, c}),
        d_q(DType::f64, {B, c, H, D}), d_k(DType::f64, {B, S, Hkv, D}), d_v(DType::f64, {B, S, Hkv, D}) {
    fill(d_k, 0.0);
    fill(d_v, 0.0);
  }
};

TEST_CASE("attention census: each call counted under its direction, kernel and reason, with its model flops") {
  ChunkOperands o(31);
  const int64_t B = o.B, H = o.H, D = o.D, p = o.p, c = o.c, S = o.S;
  const double scale = o.scale;
  Arena scratch;
  auto [q, k, v, d_out, out, lse, d_q, d_k, d_v] = std::tie(o.q, o.k, o.v, o.d_out, o.out, o.lse, o.d_q, o.d_k, o.d_v);
  reset_attention_census();
  attention_forward(out, {lse}, q, k, v, scale, scratch);
  attention_forward(out, {lse}, q, k, v, scale, scratch);
  attention_forward(out, {lse}, q, k, v, scale, scratch, AttentionMask::none);
  attention_backward(d_q, d_k, d_v, d_out, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch);
  const auto census = attention_census();
  REQUIRE(census.size() == 2);
  // Causal bottom-right: c (S - c) prefix pairs and c (c + 1) / 2 of the chunk's own; unmasked: c S.
  const double causal_pairs = double(c * p + c * (c + 1) / 2), all_pairs = double(c * S);
  const double per_pair = 4.0 * B * H * D;
  CHECK_FALSE(census[0].backward);
  CHECK(census[0].kernel == AttentionKernel::cpu);
  CHECK(census[0].calls == 3);
  CHECK(census[0].flops == doctest::Approx(per_pair * (2 * causal_pairs + all_pairs)));
  CHECK(census[0].reason == "the operands are on the CPU");
  CHECK(census[1].backward);
  CHECK(census[1].calls == 1);
  CHECK(census[1].flops == doctest::Approx(2.5 * per_pair * causal_pairs));
  const std::string text = attention_census_text(census, "in the test");
  CHECK(text.find("attention in the test: forward on cpu: 3 calls, ") != std::string::npos);
  CHECK(text.find("% of the flops (the operands are on the CPU)\n") != std::string::npos);
  CHECK(std::count(text.begin(), text.end(), '\n') == 2);
  reset_attention_census();
  CHECK(attention_census().empty());
}

TEST_CASE("attention in key blocks: the chunk's own keys causal, the prefix unmasked, merged, equals one call; so do "
          "the blocks' backwards given the merged out and lse") {
  ChunkOperands o(21);
  const int64_t B = o.B, H = o.H, Hkv = o.Hkv, D = o.D, p = o.p, c = o.c, S = o.S;
  const double scale = o.scale;
  Arena scratch;
  auto [q, k, v, d_out, out, lse, d_q, d_k, d_v] = std::tie(o.q, o.k, o.v, o.d_out, o.out, o.lse, o.d_q, o.d_k, o.d_v);
  // One call over keys [0, p + c).
  attention_forward(out, {lse}, q, k, v, scale, scratch);
  attention_backward(d_q, d_k, d_v, d_out, {lse}, q, k, v, out, scale, GradMode::overwrite, scratch);

  // Blocks: the chunk's own keys [p, p + c) causal (bottom-right with S = c), then the prefix in
  // unmasked blocks of 4, 4 and 3 keys, each merged into the running output and lse.
  const std::vector<std::pair<int64_t, int64_t>> prefix = {{0, 4}, {4, 8}, {8, 11}};
  OwnedTensor acc(DType::f64, {B, c, H, D}), acc_lse(DType::f64, {B, H, c});
  attention_forward(acc, {acc_lse}, q, k.tensor.slice(1, p, c), v.tensor.slice(1, p, c), scale, scratch);
  for (const auto& [k0, k1] : prefix) {
    OwnedTensor ob(DType::f64, {B, c, H, D}), lb(DType::f64, {B, H, c});
    attention_forward(ob, {lb}, q, k.tensor.slice(1, k0, k1 - k0), v.tensor.slice(1, k0, k1 - k0), scale, scratch,
                      AttentionMask::none);
    attention_merge(acc, acc_lse, ob, lb);
  }
  CHECK(compare(acc, out).rel < kSameMathF64Tol);
  CHECK(compare(acc_lse, lse).rel < kSameMathF64Tol);

  // Backward per block with the merged out and lse: dQ summed over the blocks, each block's dK, dV.
  OwnedTensor bq(DType::f64, {B, c, H, D}), bk(DType::f64, {B, S, Hkv, D}), bv(DType::f64, {B, S, Hkv, D});
  fill(bk, 0.0);
  fill(bv, 0.0);
  attention_backward(bq, bk.tensor.slice(1, p, c), bv.tensor.slice(1, p, c), d_out, {acc_lse}, q,
                     k.tensor.slice(1, p, c), v.tensor.slice(1, p, c), acc, scale, GradMode::overwrite, scratch);
  for (const auto& [k0, k1] : prefix)
    attention_backward(bq, bk.tensor.slice(1, k0, k1 - k0), bv.tensor.slice(1, k0, k1 - k0), d_out, {acc_lse}, q,
                       k.tensor.slice(1, k0, k1 - k0), v.tensor.slice(1, k0, k1 - k0), acc, scale,
                       GradMode::accumulate, scratch, AttentionMask::none);
  CHECK(compare(bq, d_q).rel < kSameMathF64Tol);
  CHECK(compare(bk, d_k).rel < kSameMathF64Tol);
  CHECK(compare(bv, d_v).rel < kSameMathF64Tol);

  // The contract: an unmasked call takes any number of keys; a causal one needs keys for its queries.
  OwnedTensor o1(DType::f64, {B, c, H, D}), l1(DType::f64, {B, H, c});
  CHECK_THROWS_WITH_AS(attention_forward(o1, {l1}, q, k.tensor.slice(1, 0, 3), v.tensor.slice(1, 0, 3), scale, scratch),
                       doctest::Contains("keys must cover"), Error);
  CHECK_THROWS_WITH_AS(attention_merge(acc, acc_lse, o1, l1.tensor.slice(2, 0, 2)), doctest::Contains("lse_b"), Error);
}

TEST_CASE("lm head + cross-entropy: the loss against the formula with full logits") {
  const int64_t N = 7, C = 5, V = 11;
  OwnedTensor x = randn({N, C}, 24), W = randn({V, C}, 25), labels(DType::i32, {N});
  const int32_t lab[N] = {3, -100, 0, 10, 4, -100, 7};
  for (int64_t n = 0; n < N; ++n) labels.tensor.ptr<int32_t>()[n] = lab[n];
  const double normaliser = 5.0;
  Arena scratch;
  OwnedTensor row(DType::f64, {N}), lse(DType::f64, {N});
  lm_head_loss_forward(row, {lse}, x, W, labels, normaliser, scratch, 3);
  for (int64_t n = 0; n < N; ++n) {
    if (lab[n] == kIgnoreLabel) {
      CHECK(row.tensor.ptr<double>()[n] == 0.0);
      continue;
    }
    std::vector<double> z(V);
    double m = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      z[v] = 0;
      for (int64_t c = 0; c < C; ++c) z[v] += x.tensor.ptr<double>()[n * C + c] * W.tensor.ptr<double>()[v * C + c];
      m = std::max(m, z[v]);
    }
    double s = 0;
    for (double zv : z) s += std::exp(zv - m);
    CHECK(row.tensor.ptr<double>()[n] == doctest::Approx((m + std::log(s) - z[lab[n]]) / normaliser).epsilon(1e-13));
  }
}

TEST_CASE("ops: the aliases the headers allow give the out-of-place bits (cpu)") {
  // rmsnorm's d_x may alias d_out (the layers write the stream's gradient in place); residual's out
  // may alias x. The CPU reads each element before its output is written.
  const auto as = [](DType dt, const OwnedTensor& f64) {
    OwnedTensor t = OwnedTensor::of_shape(dt, std::vector<int64_t>(f64.tensor.shape.begin(),
                                                                    f64.tensor.shape.begin() + f64.tensor.ndim));
    copy_convert(t, f64);
    return t;
  };
  const auto same_bits = [](const Tensor& a, const Tensor& b) { return std::memcmp(a.data, b.data, a.bytes()) == 0; };
  for (const DType dt : {DType::f64, DType::f32}) {
    INFO(std::string(dtype_name(dt)));
    const int64_t N = 5, C = 12;
    OwnedTensor x = as(dt, randn({N, C}, 1)), w = as(dt, randn({C}, 2, 0.3, 1.0)), y(dt, {N, C}), rstd(dt, {N});
    rmsnorm_forward(y, {rstd}, x, w, 1e-5);
    Arena scratch;
    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      const char* mode_name = mode == GradMode::overwrite ? "overwrite" : "accumulate";
      INFO(mode_name);
      // d_x starts as d_out's values on both sides, so accumulate adds into the same numbers.
      OwnedTensor dy = as(dt, randn({N, C}, 3)), dx = as(dt, randn({N, C}, 3)), in_place = as(dt, randn({N, C}, 3));
      OwnedTensor dw = as(dt, randn({C}, 5)), dw_in_place = as(dt, randn({C}, 5));
      rmsnorm_backward(dx, dw, dy, {rstd}, x, w, mode, scratch);
      rmsnorm_backward(in_place, dw_in_place, in_place, {rstd}, x, w, mode, scratch);
      CHECK(same_bits(in_place, dx));
      CHECK(same_bits(dw_in_place, dw));
    }
    OwnedTensor delta = as(dt, randn({N, C}, 6)), sum(dt, {N, C}), x_in_place = as(dt, randn({N, C}, 1));
    residual_forward(sum, x, delta);
    residual_forward(x_in_place, x_in_place, delta);
    CHECK(same_bits(x_in_place, sum));
  }
}

TEST_CASE("linear backward of a frozen weight needs no input: d_x without x is d_x with it, bit for bit") {
  OwnedTensor x = randn({5, 6}, 61), W = randn({4, 6}, 62), dy = randn({5, 4}, 63);
  for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
    OwnedTensor with = randn({5, 6}, 64), without = randn({5, 6}, 64);
    linear_backward(with, Tensor{}, dy, x, W, mode);
    linear_backward(without, Tensor{}, dy, Tensor{}, W, mode);
    CHECK(std::memcmp(with.tensor.data, without.tensor.data, with.tensor.bytes()) == 0);
  }
  OwnedTensor dW(DType::f64, {4, 6});
  CHECK_THROWS_WITH_AS(linear_backward(Tensor{}, dW, dy, Tensor{}, W, GradMode::overwrite),
                       doctest::Contains("d_weight needs the input x"), Error);
  OwnedTensor dx_bad(DType::f64, {5, 7});
  CHECK_THROWS_AS(linear_backward(dx_bad, Tensor{}, dy, Tensor{}, W, GradMode::overwrite), Error);
}

TEST_CASE("ops: bad operands are a clear error") {
  OwnedTensor table = randn({7, 5}, 1), ids(DType::i32, {1}), e(DType::f64, {1, 5});
  ids.tensor.ptr<int32_t>()[0] = 7;
  CHECK_THROWS_AS(embedding_forward(e, ids, table), Error);  // id past the table
  OwnedTensor x = randn({4, 6}, 6), W = randn({3, 6}, 7), R = randn({4, 3}, 8), y(DType::f64, {4, 3});
  CHECK_THROWS_AS(linear_forward(y, x, R), Error);  // shape mismatch
  CHECK_THROWS_AS(residual_backward(y, GradMode::accumulate, Tensor{}, GradMode::overwrite, y), Error);  // d_x aliases d_out
  OwnedTensor labels(DType::i32, {4}), row(DType::f64, {4}), lse(DType::f64, {4}), Wv = randn({11, 6}, 9);
  labels.tensor.ptr<int32_t>()[0] = 11;
  Arena scratch;
  CHECK_THROWS_AS(lm_head_loss_forward(row, {lse}, x, Wv, labels, 1.0, scratch), Error);  // label past V
  CHECK(scratch.in_use() == 0);
}
