// The attention op on the CPU (math and contract: engine/ops/attention.h), f64 and f32 through Eigen.
// Query rows go in blocks of kQueryBlock against the keys they see between them (with a sliding
// window, only those), so scratch is O(block x S) per thread, never c x S. A score cap (Gemma 2)
// goes through the same two score blocks: the backward recomputes the capped scores and turns them
// into P and dS element by element (capped_score_gradients). The public entry
// (engine/ops/attention.cpp) has checked the operands.
#include "engine/cpu/attention.h"

#include "engine/engine.h"
#include "engine/ops/cpu_common.h"
#include "engine/scratch.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace cw::cpu {

namespace {
constexpr int64_t kQueryBlock = kCpuAttentionQueryBlock;  // query rows per score block: bounds scratch to 64 x S

// p: the first query's position relative to the first key; unmasked, S (past every key) or the
// window's distance, so the causal rule "key j <= p + i" holds for every pair. W: the sliding window
// (0: none), the rule "key j > p + i - W" beside it. softcap: the scores' cap (0: none).
struct Dims {
  int64_t B, c, H, D, S, Hkv, p, W;
  double softcap;
  // Query i sees keys [first_key(i), key_end(i)) (an empty range for a row of an unmasked block
  // that lies wholly past its window).
  int64_t key_end(int64_t i) const { return std::min(S, p + i + 1); }
  int64_t first_key(int64_t i) const { return W > 0 ? std::clamp<int64_t>(p + i - W + 1, 0, S) : 0; }
};
Dims dims_of(const Tensor& q, const Tensor& k, bool causal, const AttentionWindow& window, double softcap) {
  const int64_t p = causal ? k.size(1) - q.size(1) : window.size > 0 ? window.distance : k.size(1);
  return {q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(2), p, window.size, softcap};
}

// The keys [lo, hi) the query rows [i0, i0 + rows) see between them: every row's range lies inside
// (both ends grow with the row), so a score block spans hi - lo keys, at most W + rows - 1 with a
// window.
struct KeySpan {
  int64_t lo, hi;
  int64_t n() const { return hi - lo; }
};
KeySpan keys_of(const Dims& d, int64_t i0, int64_t rows) {
  const int64_t lo = d.first_key(i0), hi = d.key_end(i0 + rows - 1);
  return {std::min(lo, hi), hi};
}

// The scores s = scale q . k of a block of query rows against the block's keys (K holding those
// keys) into S; under a cap, s = cap tanh(scale q . k / cap) (Gemma 2's attn_logit_softcapping).
template <class T, class KeyRows>
void scores(MatrixMap<T> S, const ConstMatrixMap<T>& Q, const KeyRows& K, T scale, const Dims& d) {
  S.noalias() = (Q * K.transpose()) * scale;
  if (d.softcap > 0) {
    const T cap = T(d.softcap);
    S = ((S.array() / cap).tanh() * cap).matrix();
  }
}

// Scores of query rows [i0, i0+rows) against the block's keys [ks.lo, ks.hi) of one (batch, head),
// K holding those keys: P holds exp(s - lse) (with lse computed here when `compute_lse`), zero where
// masked. A row that sees no key is all zero, its lse -inf.
template <class T, class KeyRows>
void probabilities(MatrixMap<T> P, const ConstMatrixMap<T>& Q, const KeyRows& K, T scale, const Dims& d, int64_t i0,
                   const KeySpan& ks, T* lse, bool compute_lse) {
  const int64_t rows = P.rows(), keys = P.cols();
  scores<T>(P, Q, K, scale, d);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lo = d.first_key(i0 + r) - ks.lo, hi = d.key_end(i0 + r) - ks.lo;  // not masked: [lo, hi)
    if (lo >= hi) {
      if (compute_lse) lse[r] = -std::numeric_limits<T>::infinity();
      P.row(r).setZero();
      continue;
    }
    auto row = P.row(r).segment(lo, hi - lo).array();
    if (compute_lse) {
      const T m = row.maxCoeff();
      lse[r] = m + std::log((row - m).exp().sum());  // Eigen's exp is vectorised
    }
    row = (row - lse[r]).exp();
    P.row(r).head(lo).setZero();
    P.row(r).tail(keys - hi).setZero();
  }
}

// The backward's P and dS under a score cap, in the two score blocks the backward has: P first holds
// the capped scores s = cap tanh(u), u = scale q . k / cap, and dS holds dP = dO Vᵀ; each element then
// becomes p = exp(s - lse) and dS = p (dP - Delta) (1 - (s / cap)^2): the softmax's gradient with
// respect to s times the cap's derivative, ds / d(scale q . k) = 1 - tanh(u)^2. Zero where masked.
template <class T, class KeyRows, class ValueRows>
void capped_score_gradients(MatrixMap<T> P, MatrixMap<T> dS, const ConstMatrixMap<T>& Q, const KeyRows& K,
                            const ConstMatrixMap<T>& dO, const ConstMatrixMap<T>& O, const ValueRows& V, T scale,
                            const Dims& d, int64_t i0, const KeySpan& ks, const T* lse) {
  const int64_t rows = P.rows(), keys = P.cols();
  const T cap = T(d.softcap);
  scores<T>(P, Q, K, scale, d);
  dS.noalias() = dO * V.transpose();  // dP
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lo = d.first_key(i0 + r) - ks.lo, hi = d.key_end(i0 + r) - ks.lo;  // not masked: [lo, hi)
    if (lo >= hi) {
      P.row(r).setZero();
      dS.row(r).setZero();
      continue;
    }
    const T delta = dO.row(r).dot(O.row(r));
    for (int64_t j = lo; j < hi; ++j) {
      const T s = P(r, j), p = std::exp(s - lse[r]), t = s / cap;
      dS(r, j) = p * (dS(r, j) - delta) * (T(1) - t * t);
      P(r, j) = p;
    }
    P.row(r).head(lo).setZero();
    P.row(r).tail(keys - hi).setZero();
    dS.row(r).head(lo).setZero();
    dS.row(r).tail(keys - hi).setZero();
  }
}

// Scratch for one thread: one or two score blocks of up to kQueryBlock x S.
template <class T> struct ThreadScratch {
  T* a;
  T* b;
};

// The requests engine/scratch.h exports (cpu_attention_scratch), one or two per thread.
template <class T>
std::vector<ThreadScratch<T>> thread_scratch(Arena& scratch, DType dtype, int64_t c, int64_t S, bool two) {
  const std::vector<size_t> requests = cpu_attention_scratch(c, S, dtype, two);
  std::vector<ThreadScratch<T>> out(static_cast<size_t>(max_threads()));
  size_t i = 0;
  for (auto& t : out) {
    t.a = static_cast<T*>(scratch.alloc_bytes(requests[i++]));
    t.b = two ? static_cast<T*>(scratch.alloc_bytes(requests[i++])) : nullptr;
  }
  return out;
}
}  // namespace

size_t attention_scratch_bytes(int64_t c, int64_t S, DType dtype, bool backward) {
  size_t n = 0;
  for (const size_t bytes : cpu_attention_scratch(c, S, dtype, backward))
    n += (bytes + kMemoryAlignBytes - 1) / kMemoryAlignBytes * kMemoryAlignBytes;  // the arena's alignment
  return n;
}

void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch, bool causal, const AttentionWindow& window,
                       double softcap) {
  const Dims d = dims_of(q, k, causal, window, softcap);
  dispatch_float(q.dtype, "attention_forward", [&](auto zero) {
    using T = decltype(zero);
    ArenaScope scope(scratch);
    const auto per_thread = thread_scratch<T>(scratch, q.dtype, d.c, d.S, false);
    const int64_t group = d.H / d.Hkv, row_stride = d.H * d.D, kv_row_stride = d.Hkv * d.D;
    // Threads take whole (sequence, K/V group) pairs: their outputs are disjoint, so the result does
    // not depend on the thread count or order.
#pragma omp parallel for schedule(static) if (worth_threads(2.0 * d.B * d.H * d.c * d.S * d.D))
    for (int64_t bg = 0; bg < d.B * d.Hkv; ++bg)
      for (int64_t h = (bg % d.Hkv) * group; h < (bg % d.Hkv + 1) * group; ++h) {
        const int64_t b = bg / d.Hkv, g = bg % d.Hkv;
        T* score_block = per_thread[static_cast<size_t>(thread_index())].a;
        const auto K = cmatrix<T>(k.ptr<T>() + b * k.stride[0] + g * d.D, d.S, d.D, kv_row_stride);
        const auto V = cmatrix<T>(v.ptr<T>() + b * v.stride[0] + g * d.D, d.S, d.D, kv_row_stride);
        for (int64_t i0 = 0; i0 < d.c; i0 += kQueryBlock) {
          const int64_t rows = std::min(kQueryBlock, d.c - i0);
          const KeySpan ks = keys_of(d, i0, rows);
          const int64_t q_off = ((b * d.c + i0) * d.H + h) * d.D;
          T* lse = saved.lse.ptr<T>() + (b * d.H + h) * d.c + i0;
          auto O = matrix<T>(out.ptr<T>() + q_off, rows, d.D, row_stride);
          if (ks.n() == 0) {  // rows of an unmasked block wholly past their windows
            O.setZero();
            std::fill(lse, lse + rows, -std::numeric_limits<T>::infinity());
            continue;
          }
          const auto Q = cmatrix<T>(q.ptr<T>() + q_off, rows, d.D, row_stride);
          auto P = matrix<T>(score_block, rows, ks.n(), ks.n());
          probabilities<T>(P, Q, K.middleRows(ks.lo, ks.n()), T(scale), d, i0, ks, lse, true);
          O.noalias() = P * V.middleRows(ks.lo, ks.n());
        }
      }
  });
}

void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch, bool causal,
                        const AttentionWindow& window, double softcap) {
  const Dims d = dims_of(q, k, causal, window, softcap);
  dispatch_float(q.dtype, "attention_backward", [&](auto zero) {
    using T = decltype(zero);
    ArenaScope scope(scratch);
    const auto per_thread = thread_scratch<T>(scratch, q.dtype, d.c, d.S, true);
    const int64_t group = d.H / d.Hkv, row_stride = d.H * d.D, kv_row_stride = d.Hkv * d.D;
    // As in the forward: a (sequence, K/V group) pair per thread, so each dK/dV row has one writer
    // and its heads add into it in a fixed order.
#pragma omp parallel for schedule(static) if (worth_threads(2.0 * d.B * d.H * d.c * d.S * d.D))
    for (int64_t bg = 0; bg < d.B * d.Hkv; ++bg)
      for (int64_t h = (bg % d.Hkv) * group; h < (bg % d.Hkv + 1) * group; ++h) {
        const int64_t b = bg / d.Hkv, g = bg % d.Hkv;
        T* p_block = per_thread[static_cast<size_t>(thread_index())].a;
        T* dp_block = per_thread[static_cast<size_t>(thread_index())].b;
        const auto K = cmatrix<T>(k.ptr<T>() + b * k.stride[0] + g * d.D, d.S, d.D, kv_row_stride);
        const auto V = cmatrix<T>(v.ptr<T>() + b * v.stride[0] + g * d.D, d.S, d.D, kv_row_stride);
        auto dK = matrix<T>(d_k.ptr<T>() + b * d_k.stride[0] + g * d.D, d.S, d.D, kv_row_stride);
        auto dV = matrix<T>(d_v.ptr<T>() + b * d_v.stride[0] + g * d.D, d.S, d.D, kv_row_stride);
        for (int64_t i0 = 0; i0 < d.c; i0 += kQueryBlock) {
          const int64_t rows = std::min(kQueryBlock, d.c - i0);
          const KeySpan ks = keys_of(d, i0, rows);
          const int64_t q_off = ((b * d.c + i0) * d.H + h) * d.D;
          auto dQ = matrix<T>(d_q.ptr<T>() + q_off, rows, d.D, row_stride);
          if (ks.n() == 0) {  // rows that see no key here: no gradient to give or take
            if (mode == GradMode::overwrite) dQ.setZero();
            continue;
          }
          const auto Q = cmatrix<T>(q.ptr<T>() + q_off, rows, d.D, row_stride);
          const auto O = cmatrix<T>(out.ptr<T>() + q_off, rows, d.D, row_stride);
          const auto dO = cmatrix<T>(d_out.ptr<T>() + q_off, rows, d.D, row_stride);
          const auto Kb = K.middleRows(ks.lo, ks.n());
          auto P = matrix<T>(p_block, rows, ks.n(), ks.n());
          auto dS = matrix<T>(dp_block, rows, ks.n(), ks.n());
          T* lse = saved.lse.ptr<T>() + (b * d.H + h) * d.c + i0;
          if (d.softcap > 0) {
            capped_score_gradients<T>(P, dS, Q, Kb, dO, O, V.middleRows(ks.lo, ks.n()), T(scale), d, i0, ks, lse);
          } else {
            probabilities<T>(P, Q, Kb, T(scale), d, i0, ks, lse, false);
            dS.noalias() = dO * V.middleRows(ks.lo, ks.n()).transpose();  // dP
            for (int64_t r = 0; r < rows; ++r) {
              const T delta = dO.row(r).dot(O.row(r));
              dS.row(r) = (P.row(r).array() * (dS.row(r).array() - delta)).matrix();
            }
          }
          if (mode == GradMode::accumulate)
            dQ.noalias() += (dS * Kb) * T(scale);
          else
            dQ.noalias() = (dS * Kb) * T(scale);
          dK.middleRows(ks.lo, ks.n()).noalias() += (dS.transpose() * Q) * T(scale);
          dV.middleRows(ks.lo, ks.n()).noalias() += P.transpose() * dO;
        }
      }
  });
}

void attention_merge(const Tensor& acc, const Tensor& lse_acc, const Tensor& out_b, const Tensor& lse_b) {
  const int64_t B = acc.size(0), c = acc.size(1), H = acc.size(2), D = acc.size(3);
  dispatch_float(out_b.dtype, "attention_merge", [&](auto zero) {
    using T = decltype(zero);  // the CPU computes in f64 or f32, its own accumulation dtype
    T* o = acc.ptr<T>();
    T* l = lse_acc.ptr<T>();
    const T* ob = out_b.ptr<T>();
    const T* lb = lse_b.ptr<T>();
#pragma omp parallel for schedule(static) if (worth_threads(4.0 * double(B * c * H * D)))
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t i = 0; i < c; ++i) {
        const int64_t b = bh / H, h = bh % H, s = bh * c + i;
        const T m = std::max(l[s], lb[s]);
        const T wa = std::exp(l[s] - m), wb = std::exp(lb[s] - m), sum = wa + wb;
        T* row = o + ((b * c + i) * H + h) * D;
        const T* row_b = ob + ((b * c + i) * H + h) * D;
        for (int64_t x = 0; x < D; ++x) row[x] = (wa * row[x] + wb * row_b[x]) / sum;
        l[s] = m + std::log(sum);
      }
  });
}

}  // namespace cw::cpu
