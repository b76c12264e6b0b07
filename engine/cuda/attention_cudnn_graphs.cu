// cuDNN fused attention: the operation graphs of a plan's problem (Shape) and the search for their
// execution plan, through the cuDNN graph backend API: one graph per direction, in the arrangement the
// cuDNN frontend library builds for SDPA, so that cuDNN's specialized fused-attention engine serves
// it. The plans are cached in attention_cudnn_plans.cu and run in attention_cudnn.cu.
//   Forward graph: S = Q K^T (f32) * scale, masked (GEN_INDEX row/col; row + S - c for p > 0 from
//   two by-value int32 scalars; keep = row >= col; BINARY_SELECT to the lowest float); max, exp,
//   sum; stats = max + log(sum) (our lse); P = E / sum (bf16) and O = P V.
//   Backward graph: Delta = 1 * rowsum(dO * O), a real f32 tensor that cuDNN writes; S as above;
//   P = exp(S - stats); dV = P^T dO; dS = (dO V^T - Delta) P scale; dK = dS^T Q; dQ = dS K with K
//   a reshape of the K^T operand; for GQA, dK/dV per query head (bf16, virtual) reduced to the Hkv
//   heads in the graph. Two forms of dQ:
//     fast (determinism off): into a plain f32 accumulator, then cast to bf16 dQ. Its engine sums
//       with atomics (not flagged by cuDNN's non-determinism note) and needs O(S) workspace.
//     deterministic (cw::deterministic()): straight into dQ; engine configurations carrying the
//       non-determinism note are skipped. Its workspace holds dS (bf16, B H c S 2 bytes).
//   Shared plans (Shape::shared: S is the K/V store's extent, attention_cudnn_plans.cu says when):
//   the graph carries the frontend's padding mask, seq_len_q = c and seq_len_kv = S as device int32
//   tensors [B, 1, 1, 1] (filled by attention_cudnn.cu's fill_lengths_kernel, also the matmuls'
//   M/N/K overrides), and the bottom-right mask reads its offset S - c from them: keys in [S, cap)
//   are masked, and the engine bounds its key loop by seq_len_kv, so it does not read them.
//   Unmasked (Shape::causal false, a streamed key block or a split call's prefix): the same graphs
//   without the mask; stacked (Shape::stacked), q, out, d_out and dQ head-major [B, H, c, D].
//   Plans: among the heuristics' configurations (each followed by its WORKSPACE-knob siblings) the
//   first within kWorkspaceLimit is taken, else the one needing least. CW_CUDNN_VERBOSE=1 describes
//   each plan on stderr, with the candidates tried.
#include "engine/cuda/attention_cudnn.cuh"

#include "engine/env.h"
#include "engine/error.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace cw::gpu::cudnn_attention {
namespace {

// The descriptors of one operation graph, kept alive as long as its plan.
class GraphBuilder {
 public:
  explicit GraphBuilder(cudnnHandle_t handle) : handle_(handle) {}

  // A real (non-virtual) tensor, bound to a device pointer in the variant pack.
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dt, const Dims& dims, const Dims& strides) {
    return make_tensor(uid, dt, dims, strides, false, false);
  }
  // A by-value scalar: the variant pack points at host memory holding the value.
  cudnnBackendDescriptor_t scalar(int64_t uid, cudnnDataType_t dt) {
    return make_tensor(uid, dt, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }
  // An intermediate the fused kernel keeps on chip.
  cudnnBackendDescriptor_t virt(cudnnDataType_t dt, const Dims& dims, const Dims& strides) {
    return make_tensor(next_virtual_++, dt, dims, strides, true, false);
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t dt, const Dims& dims) { return virt(dt, dims, packed_strides(dims)); }

  // y = mode(x [, b [, t]]); GEN_INDEX takes an axis.
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t t = nullptr,
                 int64_t axis = -1) {
    Desc& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set_attr(pw.d, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set_attr(pw.d, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (axis >= 0) set_attr(pw.d, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    CW_CUDNN_CHECK(cudnnBackendFinalize(pw.d));
    Desc& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_desc(op.d, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.d);
    set_desc(op.d, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) set_desc(op.d, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) set_desc(op.d, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    set_desc(op.d, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    finalize_op(op);
  }
  // c = a b; the optional overrides are [B, 1, 1, 1] int32 tensors giving the real M, N or K per
  // batch entry (the padding-mask form: the engine bounds its loops by them).
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              cudnnBackendDescriptor_t m_override = nullptr, cudnnBackendDescriptor_t n_override = nullptr,
              cudnnBackendDescriptor_t k_override = nullptr) {
    Desc& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set_attr(mm.d, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    CW_CUDNN_CHECK(cudnnBackendFinalize(mm.d));
    Desc& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.d);
    if (m_override) set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override);
    if (n_override) set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override);
    if (k_override) set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override);
    finalize_op(op);
  }
  // y = reduce(x) over the dimensions where y has extent 1 (or fewer heads).
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc& rd = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set_attr(rd.d, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    set_attr(rd.d, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    CW_CUDNN_CHECK(cudnnBackendFinalize(rd.d));
    Desc& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set_desc(op.d, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd.d);
    set_desc(op.d, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    set_desc(op.d, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    finalize_op(op);
  }
  // y is x with other dimensions/strides (a transpose view).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set_desc(op.d, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    set_desc(op.d, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    finalize_op(op);
  }

  // Finalizes the operation graph; returns it.
  cudnnBackendDescriptor_t finish() {
    Desc& g = keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set_attr(g.d, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    set_attr(g.d, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
             ops_.data());
    CW_CUDNN_CHECK(cudnnBackendFinalize(g.d));
    return g.d;
  }

  std::vector<std::unique_ptr<Desc>> take() { return std::move(descs_); }

 private:
  Desc& keep(cudnnBackendDescriptorType_t type) {
    descs_.push_back(std::make_unique<Desc>(type));
    return *descs_.back();
  }
  void finalize_op(Desc& op) {
    CW_CUDNN_CHECK(cudnnBackendFinalize(op.d));
    ops_.push_back(op.d);
  }
  cudnnBackendDescriptor_t make_tensor(int64_t uid, cudnnDataType_t dt, const Dims& dims, const Dims& strides,
                                       bool is_virtual, bool by_value) {
    Desc& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    set_attr(t.d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set_attr(t.d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    set_attr(t.d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    set_attr(t.d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    const int64_t align = kAlignment;
    set_attr(t.d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set_attr(t.d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) set_attr(t.d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    CW_CUDNN_CHECK(cudnnBackendFinalize(t.d));
    return t.d;
  }

  cudnnHandle_t handle_;
  std::vector<std::unique_ptr<Desc>> descs_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = 1000;
};

// The real query and key counts of a shared plan: int32 [B, 1, 1, 1] device tensors (both null
// for an exact plan, whose counts are its dimensions).
struct Lengths {
  cudnnBackendDescriptor_t q = nullptr, kv = nullptr;
};

Lengths make_lengths(GraphBuilder& g, const Shape& sh) {
  if (!sh.shared) return {};
  const Dims dims{sh.B, 1, 1, 1}, strides{1, 1, 1, 1};
  return {g.tensor(kSeqLenQ, CUDNN_DATA_INT32, dims, strides), g.tensor(kSeqLenKv, CUDNN_DATA_INT32, dims, strides)};
}

// The padding mask of a shared plan (the frontend's arrangement): scores of rows >= seq_len_q or
// keys >= seq_len_kv become the lowest float.
cudnnBackendDescriptor_t padding_mask(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t s, const Lengths& len) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S};
  cudnnBackendDescriptor_t row = g.virt(CUDNN_DATA_INT32, sdims), col = g.virt(CUDNN_DATA_INT32, sdims);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, row, nullptr, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, col, nullptr, 3);
  cudnnBackendDescriptor_t row_in = g.virt(CUDNN_DATA_BOOLEAN, sdims), col_in = g.virt(CUDNN_DATA_BOOLEAN, sdims);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, len.q, row_in);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, len.kv, col_in);
  cudnnBackendDescriptor_t inside = g.virt(CUDNN_DATA_BOOLEAN, sdims);
  g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_in, col_in, inside);
  cudnnBackendDescriptor_t masked = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, g.scalar(kNegInf, CUDNN_DATA_FLOAT), masked, inside);
  return masked;
}

// The causal mask, aligned bottom-right: keep = row + (keys - queries) >= col, the counts from the
// length tensors (shared plans) or from two by-value int32 scalars (exact plans with p > 0; for
// p = 0 both alignments agree and no offset is needed).
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t s, const Lengths& len) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S};
  cudnnBackendDescriptor_t row = g.virt(CUDNN_DATA_INT32, sdims);
  cudnnBackendDescriptor_t col = g.virt(CUDNN_DATA_INT32, sdims);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, row, nullptr, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, col, nullptr, 3);
  if (len.kv || sh.p() > 0) {
    cudnnBackendDescriptor_t keys = len.kv ? len.kv : g.scalar(kSkv, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t queries = len.q ? len.q : g.scalar(kSq, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t plus = g.virt(CUDNN_DATA_INT32, sdims);
    cudnnBackendDescriptor_t shifted = g.virt(CUDNN_DATA_INT32, sdims);
    g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, row, keys, plus);
    g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, plus, queries, shifted);
    row = shifted;
  }
  cudnnBackendDescriptor_t keep = g.virt(CUDNN_DATA_BOOLEAN, sdims);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_INT32, row, col, keep);
  cudnnBackendDescriptor_t masked = g.virt(CUDNN_DATA_FLOAT, sdims);
  // BINARY_SELECT: y = t ? x : b.
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, g.scalar(kNegInf, CUDNN_DATA_FLOAT), masked, keep);
  return masked;
}

// Every mask the plan applies to the scores `s`; returns the masked scores.
cudnnBackendDescriptor_t build_mask(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t s, const Lengths& len) {
  if (len.kv) s = padding_mask(g, sh, s, len);
  return sh.causal ? causal_mask(g, sh, s, len) : s;
}

Dims q_strides(const Shape& sh) {
  if (sh.stacked) return packed_strides({sh.B, sh.H, sh.c, sh.D});  // head-major copies (Shape::stacked)
  return {sh.c * sh.H * sh.D, sh.D, sh.H * sh.D, 1};
}
// K/V as the graph sees the caller's [B, S, Hkv, D] (batch strides as given), and transposed.
Dims kv_dims(const Shape& sh) { return {sh.B, sh.Hkv, sh.S, sh.D}; }
Dims kv_t_dims(const Shape& sh) { return {sh.B, sh.Hkv, sh.D, sh.S}; }
Dims kv_strides(const Shape& sh, int64_t batch_stride) { return {batch_stride, sh.D, sh.Hkv * sh.D, 1}; }
Dims kv_t_strides(const Shape& sh, int64_t batch_stride) { return {batch_stride, sh.D, 1, sh.Hkv * sh.D}; }

// S = scale * Q K^T (shared by both directions), masked unless `masked` is false. *kt_out (if
// given) receives K^T.
cudnnBackendDescriptor_t build_scores(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t q, const Lengths& len,
                                      cudnnBackendDescriptor_t* kt_out = nullptr, bool masked = true) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S};
  cudnnBackendDescriptor_t kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, kv_t_dims(sh), kv_t_strides(sh, sh.k_batch_stride));
  cudnnBackendDescriptor_t s = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.matmul(q, kt, s, len.q, len.kv);
  if (kt_out) *kt_out = kt;
  cudnnBackendDescriptor_t scaled = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, g.scalar(kScale, CUDNN_DATA_FLOAT), scaled);
  return masked ? build_mask(g, sh, scaled, len) : scaled;
}

cudnnBackendDescriptor_t build_forward(GraphBuilder& g, const Shape& sh) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S}, rdims{sh.B, sh.H, sh.c, 1};
  const Lengths len = make_lengths(g, sh);
  cudnnBackendDescriptor_t q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, {sh.B, sh.H, sh.c, sh.D}, q_strides(sh));
  cudnnBackendDescriptor_t s = build_scores(g, sh, q, len);
  cudnnBackendDescriptor_t mx = g.virt(CUDNN_DATA_FLOAT, rdims);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, mx);
  cudnnBackendDescriptor_t centred = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s, mx, centred);
  cudnnBackendDescriptor_t e = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, nullptr, e);
  cudnnBackendDescriptor_t sum = g.virt(CUDNN_DATA_FLOAT, rdims);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  cudnnBackendDescriptor_t log_sum = g.virt(CUDNN_DATA_FLOAT, rdims);
  g.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, sum, nullptr, log_sum);
  cudnnBackendDescriptor_t stats = g.tensor(kStats, CUDNN_DATA_FLOAT, rdims, {sh.H * sh.c, sh.c, 1, 1});
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, mx, log_sum, stats);
  cudnnBackendDescriptor_t p = g.virt(CUDNN_DATA_BFLOAT16, sdims);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, sum, p);
  cudnnBackendDescriptor_t vt = g.tensor(kV, CUDNN_DATA_BFLOAT16, kv_dims(sh), kv_strides(sh, sh.v_batch_stride));
  cudnnBackendDescriptor_t o = g.tensor(kO, CUDNN_DATA_BFLOAT16, {sh.B, sh.H, sh.c, sh.D}, q_strides(sh));
  g.matmul(p, vt, o, len.q, nullptr, len.kv);
  return g.finish();
}

// A K/V-shaped gradient a b into packed bf16 scratch [B, S, Hkv, D]; for GQA the matmul's output
// has the H query heads (broadcast shape), reduced to the Hkv heads inside the graph.
void kv_grad(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, int64_t uid,
             const Lengths& len) {
  cudnnBackendDescriptor_t out = g.tensor(uid, CUDNN_DATA_BFLOAT16, {sh.B, sh.Hkv, sh.S, sh.D},
                                          {sh.S * sh.Hkv * sh.D, sh.D, sh.Hkv * sh.D, 1});
  if (sh.gqa()) {
    cudnnBackendDescriptor_t full = g.virt(CUDNN_DATA_BFLOAT16, {sh.B, sh.H, sh.S, sh.D});
    g.matmul(a, b, full, len.kv, nullptr, len.q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
  } else {
    g.matmul(a, b, out, len.kv, nullptr, len.q);
  }
}

cudnnBackendDescriptor_t build_backward(GraphBuilder& g, const Shape& sh) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S}, rdims{sh.B, sh.H, sh.c, 1}, qdims{sh.B, sh.H, sh.c, sh.D};
  const Dims tdims{sh.B, sh.H, sh.S, sh.c}, tstrides{sh.H * sh.c * sh.S, sh.c * sh.S, 1, sh.S};
  const cudnnDataType_t bf = CUDNN_DATA_BFLOAT16;
  const Lengths len = make_lengths(g, sh);
  cudnnBackendDescriptor_t q = g.tensor(kQ, bf, qdims, q_strides(sh));
  cudnnBackendDescriptor_t o = g.tensor(kO, bf, qdims, q_strides(sh));
  cudnnBackendDescriptor_t d_o = g.tensor(kDO, bf, qdims, q_strides(sh));
  cudnnBackendDescriptor_t stats = g.tensor(kStats, CUDNN_DATA_FLOAT, rdims, {sh.H * sh.c, sh.c, 1, 1});

  // Delta = 1 * rowsum(dO * O): the unit scale after the reduction makes cuDNN compute Delta in its
  // own pre-pass and write it to the real tensor (with Delta straight out of the reduction the
  // engines read it instead, and the fast form needs the c x S workspace).
  cudnnBackendDescriptor_t d_o_o = g.virt(CUDNN_DATA_FLOAT, qdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, d_o_o);
  cudnnBackendDescriptor_t sum = g.virt(CUDNN_DATA_FLOAT, rdims);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, sum);
  cudnnBackendDescriptor_t delta = g.tensor(kDelta, CUDNN_DATA_FLOAT, rdims, {sh.H * sh.c, sh.c, 1, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, sum, g.scalar(kOne, CUDNN_DATA_FLOAT), delta);

  // P = exp(S - lse). Exact plans mask S before the subtraction; shared plans after it, as the
  // frontend orders a padding-masked backward.
  cudnnBackendDescriptor_t kt = nullptr;
  cudnnBackendDescriptor_t s = build_scores(g, sh, q, len, &kt, !sh.shared);
  cudnnBackendDescriptor_t centred = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s, stats, centred);
  if (sh.shared) centred = build_mask(g, sh, centred, len);
  cudnnBackendDescriptor_t p = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, nullptr, p);

  // dV = P^T dO
  cudnnBackendDescriptor_t p_t = g.virt(bf, tdims, tstrides);
  g.reshape(p, p_t);
  kv_grad(g, sh, p_t, d_o, kDV, len);

  // dS = P * (dO V^T - Delta) * scale
  cudnnBackendDescriptor_t v_t = g.tensor(kV, bf, kv_t_dims(sh), kv_t_strides(sh, sh.v_batch_stride));
  cudnnBackendDescriptor_t dp = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.matmul(d_o, v_t, dp, len.q, len.kv);
  cudnnBackendDescriptor_t dp_centred = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, delta, dp_centred);
  cudnnBackendDescriptor_t ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centred, p, ds_unscaled);
  cudnnBackendDescriptor_t ds = g.virt(sh.dq_accum() ? CUDNN_DATA_FLOAT : bf, sdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, g.scalar(kScale, CUDNN_DATA_FLOAT), ds);

  // dK = dS^T Q
  cudnnBackendDescriptor_t ds_t = g.virt(bf, tdims, tstrides);
  g.reshape(ds, ds_t);
  kv_grad(g, sh, ds_t, q, kDK, len);

  // dQ = dS K, K read as a reshape of the K^T operand (one K tensor in the graph).
  cudnnBackendDescriptor_t k = g.virt(bf, kv_dims(sh), kv_strides(sh, sh.k_batch_stride));
  g.reshape(kt, k);
  cudnnBackendDescriptor_t dq = g.tensor(kDQ, bf, qdims, q_strides(sh));
  if (sh.dq_accum()) {
    // Each key block's dS K is added into the plain [B, H, c, D] f32 accumulator, then cast to dQ.
    cudnnBackendDescriptor_t acc = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, qdims, packed_strides(qdims));
    g.matmul(ds, k, acc, len.q, nullptr, len.kv);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, acc, nullptr, dq);
  } else {
    g.matmul(ds, k, dq, len.q, nullptr, len.kv);
  }
  return g.finish();
}

std::string numerical_notes(cudnnBackendDescriptor_t engine, bool* nondeterministic) {
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  int64_t n = 0;
  *nondeterministic = false;
  if (cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               static_cast<int64_t>(notes.size()), &n, notes.data()) != CUDNN_STATUS_SUCCESS)
    return "?";
  static const char* names[] = {"tensor_core", "down_convert_inputs", "reduced_precision_reduction", "fft",
                                "nondeterministic", "winograd", "winograd4", "winograd6", "winograd13",
                                "strict_nan_prop"};
  std::string s;
  for (int64_t i = 0; i < n; ++i) {
    const int id = static_cast<int>(notes[static_cast<size_t>(i)]);
    if (id == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) *nondeterministic = true;
    if (!s.empty()) s += "|";
    s += id >= 0 && id < 10 ? names[id] : "?";
  }
  return s.empty() ? "none" : s;
}

std::string last_cudnn_error() {
  char msg[1024] = {0};
  cudnnGetLastErrorString(msg, sizeof(msg));
  return msg;
}

// Descriptor arrays the backend hands out: `count` fresh descriptors of `type` filled by attribute
// `name` of `d` (the backend API needs them created before it can fill them).
std::vector<std::unique_ptr<Desc>> get_descs(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                                             cudnnBackendDescriptorType_t type) {
  std::vector<std::unique_ptr<Desc>> out;
  int64_t count = 0;
  if (cudnnBackendGetAttribute(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return out;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    out.push_back(std::make_unique<Desc>(type));
    raw.push_back(out.back()->d);
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()) != CUDNN_STATUS_SUCCESS)
    return {};
  out.resize(static_cast<size_t>(std::min(got, count)));
  return out;
}

using Knobs = std::vector<std::pair<cudnnBackendKnobType_t, int64_t>>;

Knobs knob_choices(cudnnBackendDescriptor_t cfg) {
  Knobs k;
  for (const auto& c : get_descs(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)) {
    cudnnBackendKnobType_t type{};
    int64_t value = 0, n = 0;
    if (cudnnBackendGetAttribute(c->d, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &n, &type) ==
            CUDNN_STATUS_SUCCESS &&
        cudnnBackendGetAttribute(c->d, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &n, &value) ==
            CUDNN_STATUS_SUCCESS)
      k.emplace_back(type, value);
  }
  return k;
}

std::string knobs_str(const Knobs& k) {
  std::string s;
  for (const auto& [type, value] : k) s += CW_FORMAT("{}{}={}", s.empty() ? "" : ",", static_cast<int>(type), value);
  return s.empty() ? "-" : s;
}

// One way cuDNN could run a graph: an engine configuration (from the heuristics, or one of them
// with its workspace knob changed) and, once finalized, its execution plan.
struct Candidate {
  std::unique_ptr<Desc> cfg;
  std::vector<std::unique_ptr<Desc>> parts;  // the engine and knob descriptors `cfg` refers to
  int64_t engine = -1;
  Knobs knobs;
  std::string source;
};

// A configuration of engine `index` with the given knob choices; nullptr where cuDNN refuses it.
std::unique_ptr<Candidate> make_config(cudnnBackendDescriptor_t graph, int64_t index, const Knobs& knobs,
                                       std::string source) {
  auto c = std::make_unique<Candidate>();
  c->engine = index;
  c->knobs = knobs;
  c->source = std::move(source);
  auto engine = std::make_unique<Desc>(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  if (cudnnBackendSetAttribute(engine->d, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                               &graph) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendSetAttribute(engine->d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &index) !=
          CUDNN_STATUS_SUCCESS ||
      cudnnBackendFinalize(engine->d) != CUDNN_STATUS_SUCCESS)
    return nullptr;
  std::vector<cudnnBackendDescriptor_t> choices;
  for (const auto& [type, value] : knobs) {
    auto kc = std::make_unique<Desc>(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
    if (cudnnBackendSetAttribute(kc->d, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type) !=
            CUDNN_STATUS_SUCCESS ||
        cudnnBackendSetAttribute(kc->d, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &value) !=
            CUDNN_STATUS_SUCCESS ||
        cudnnBackendFinalize(kc->d) != CUDNN_STATUS_SUCCESS)
      return nullptr;
    choices.push_back(kc->d);
    c->parts.push_back(std::move(kc));
  }
  c->cfg = std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  if (cudnnBackendSetAttribute(c->cfg->d, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &engine->d) !=
          CUDNN_STATUS_SUCCESS ||
      (!choices.empty() &&
       cudnnBackendSetAttribute(c->cfg->d, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                static_cast<int64_t>(choices.size()), choices.data()) != CUDNN_STATUS_SUCCESS) ||
      cudnnBackendFinalize(c->cfg->d) != CUDNN_STATUS_SUCCESS)
    return nullptr;
  c->parts.push_back(std::move(engine));
  return c;
}

// The heuristics' configurations for `graph` (mode A, then the fallback list), each followed by its
// siblings with the other values of the engine's WORKSPACE knob where it has one (an engine may
// stage the score gradients in a c x S workspace or run without it, the choice being that knob).
std::vector<std::unique_ptr<Candidate>> candidates(cudnnBackendDescriptor_t graph, std::string* errors) {
  std::vector<std::unique_ptr<Candidate>> out;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    set_desc(heur.d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    set_attr(heur.d, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (cudnnStatus_t st = cudnnBackendFinalize(heur.d); st != CUDNN_STATUS_SUCCESS) {
      *errors += CW_FORMAT(" heuristics({}): {} {};", static_cast<int>(mode), cudnnGetErrorString(st), last_cudnn_error());
      continue;
    }
    auto cfgs = get_descs(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    if (cfgs.empty()) *errors += CW_FORMAT(" heuristics({}): no configs ({});", static_cast<int>(mode), last_cudnn_error());
    for (size_t i = 0; i < cfgs.size(); ++i) {
      auto c = std::make_unique<Candidate>();
      c->source = CW_FORMAT("heuristic mode {} config {} of {}", static_cast<int>(mode), i, cfgs.size());
      c->knobs = knob_choices(cfgs[i]->d);
      Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
      int64_t n = 0;
      std::vector<std::unique_ptr<Desc>> infos;
      if (cudnnBackendGetAttribute(cfgs[i]->d, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                                   &engine.d) == CUDNN_STATUS_SUCCESS) {
        cudnnBackendGetAttribute(engine.d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &c->engine);
        infos = get_descs(engine.d, CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR);
      }
      c->cfg = std::move(cfgs[i]);
      const int64_t index = c->engine;
      const Knobs base = c->knobs;
      const std::string source = c->source;
      out.push_back(std::move(c));
      for (const auto& info : infos) {
        cudnnBackendKnobType_t type{};
        int64_t lo = 0, hi = 0, stride = 1;
        if (cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &n, &type) !=
                CUDNN_STATUS_SUCCESS ||
            type != CUDNN_KNOB_TYPE_WORKSPACE)
          continue;
        cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, CUDNN_TYPE_INT64, 1, &n, &lo);
        cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, CUDNN_TYPE_INT64, 1, &n, &hi);
        cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_STRIDE, CUDNN_TYPE_INT64, 1, &n, &stride);
        stride = std::max<int64_t>(stride, 1);
        for (int64_t value = lo, tries = 0; value <= hi && tries < 4; value += stride, ++tries) {
          Knobs k = base;
          auto it = std::find_if(k.begin(), k.end(), [type](const auto& kv) { return kv.first == type; });
          if (it != k.end() && it->second == value) continue;  // the heuristic's own choice
          if (it != k.end())
            it->second = value;
          else
            k.emplace_back(type, value);
          if (auto alt = make_config(graph, index, k,
                                     source + CW_FORMAT(", knob {}={}", static_cast<int>(type), value)))
            out.push_back(std::move(alt));
        }
      }
    }
  }
  return out;
}

}  // namespace

// Builds the graph of `sh` and finds an execution plan for it; nullptr (with the reason in *why)
// where cuDNN does not serve it. A split shape gets a split plan (build_split_plan), or where cuDNN
// refuses a part, the one graph. Candidates are finalized in order; the first that honours the
// determinism policy and needs at most kWorkspaceLimit bytes of workspace wins; if none fits the
// limit, the one with the smallest workspace (still correct, just memory-hungry). `ahead`: built by
// a worker (for the statistics).
std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const Shape& sh, std::string* why, bool ahead) {
  std::string split_refused;
  if (sh.split) {
    if (std::unique_ptr<Plan> plan = build_split_plan(handle, sh, &split_refused, ahead)) return plan;
    split_refused = "with the prefix apart, " + split_refused + "; as one graph: ";
  }
  auto plan = std::make_unique<Plan>();
  GraphBuilder g(handle);
  cudnnBackendDescriptor_t graph = nullptr;
  try {
    graph = sh.backward ? build_backward(g, sh) : build_forward(g, sh);
  } catch (const Error& e) {
    *why = split_refused + "graph: " + e.what();
    return nullptr;
  }
  plan->descs = g.take();

  std::string errors, tried;
  std::unique_ptr<Candidate> best;
  std::unique_ptr<Desc> best_plan;
  int64_t best_ws = 0;
  std::string best_notes;
  for (auto& c : candidates(graph, &errors)) {
    Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    int64_t n = 0;
    bool nondet = false;
    std::string notes = "?";
    if (cudnnBackendGetAttribute(c->cfg->d, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                                 &engine.d) == CUDNN_STATUS_SUCCESS)
      notes = numerical_notes(engine.d, &nondet);
    if (sh.deterministic && nondet) {
      tried += CW_FORMAT("\n    engine {} knobs {} ({}): skipped, non-deterministic", c->engine, knobs_str(c->knobs), c->source);
      continue;
    }
    auto ep = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set_attr(ep->d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    set_desc(ep->d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, c->cfg->d);
    if (cudnnStatus_t st = cudnnBackendFinalize(ep->d); st != CUDNN_STATUS_SUCCESS) {
      errors += CW_FORMAT(" engine {} knobs {}: {} {};", c->engine, knobs_str(c->knobs), cudnnGetErrorString(st),
                          last_cudnn_error());
      continue;
    }
    int64_t ws = 0;
    CW_CUDNN_CHECK(cudnnBackendGetAttribute(ep->d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws));
    tried += CW_FORMAT("\n    engine {} knobs {} ({}; notes {}): workspace {} bytes", c->engine, knobs_str(c->knobs),
                       c->source, notes, ws);
    if (!best || ws < best_ws) {
      best = std::move(c);
      best_plan = std::move(ep);
      best_ws = ws;
      best_notes = notes;
    }
    if (best_ws <= kWorkspaceLimit) break;
  }
  if (!best) {
    *why = split_refused + (errors.empty() ? "no engine" : errors);
    return nullptr;
  }
  plan->workspace = best_ws;
  plan->plan = std::move(best_plan);
  plan->engine_cfg = std::move(best->cfg);
  plan->cfg_parts = std::move(best->parts);
  plan->info = CW_FORMAT("engine {} knobs {} ({}; notes {}); workspace {} bytes; {}{}", best->engine,
                         knobs_str(best->knobs), best->source, best_notes, best_ws, sh.form(),
                         verbose() ? "\n  candidates:" + tried : "");
  return plan;
}

bool verbose() {
  static const bool v = env::flag(env::kCudnnVerbose);
  return v;
}

}  // namespace cw::gpu::cudnn_attention
