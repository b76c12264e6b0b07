// cuDNN fused attention (the `cudnn` family of engine/ops/attention.h) through the cuDNN graph
// backend API: one operation graph per direction, in the arrangement the cuDNN frontend library
// builds for SDPA, so that cuDNN's specialized fused-attention engine serves it.
//   Computes the op's math: chunk-against-cache causal attention with grouped K/V heads (query i of
//   the chunk at position p + i sees keys j <= p + i of the S = p + c keys: the mask is aligned
//   BOTTOM-RIGHT), out and lse forward; d_q (overwrite or accumulate) and d_k, d_v (always ADDED)
//   backward. Unmasked (AttentionMask::none, a streamed key block): the same graphs without the
//   mask, any S >= 1, one exact plan per shape.
//   Operands (no copies): q, out, d_q, d_out [B, c, H, D] bf16 contiguous, as cuDNN tensors
//   (B, H, c, D) with strides (c H D, D, H D, 1); k, v [B, S, Hkv, D] bf16 with batch stride kb as
//   (B, Hkv, S, D) with strides (kb, D, Hkv D, 1) (K^T: dims (B, Hkv, D, S), strides (kb, D, 1, Hkv D));
//   cuDNN broadcasts Hkv < H heads itself. lse [B, H, c] f32 is the stats tensor (B, H, c, 1).
//   D a multiple of 8 up to 128, 16-byte aligned operands, cuDNN >= 9.3 (bottom-right causal
//   masks in the fused engine), compute capability 8.0+.
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
//   Saved: nothing beyond lse. Accumulates: cuDNN overwrites its outputs, so dK, dV (bf16) go to
//   packed scratch and add_kv_kernel adds them into the caller's f32 d_k, d_v (any batch stride);
//   in accumulate mode d_q comes to scratch too and add_q_kernel adds it. No atomics of ours.
//   Plans: built once per shape (device, direction, B, H, Hkv, c, D, K/V batch strides,
//   determinism, and the key extent below) and cached; among the heuristics' configurations (each
//   followed by its WORKSPACE-knob siblings) the first within kWorkspaceLimit is taken, else the one
//   needing least. One cudnnHandle per device on gpu::current_stream(device); workspace from the
//   `scratch` arena. CW_CUDNN_VERBOSE=1 describes each plan on stderr, with its build time;
//   cw::attention_plan_stats() counts plans and build seconds (a plan costs ~0.1-0.2 s to build).
//   Key extent: a plan per S would make a SeCO step build one plan per chunk offset in each
//   direction. So where the K/V operands are a slice of a longer store (batch stride = cap Hkv D
//   with cap > S: SeCO's K/V store, cap = T) the plan is built for the store's extent cap and
//   shared by every S: the graph then carries the frontend's padding mask, seq_len_q = c and
//   seq_len_kv = S as device int32 tensors [B, 1, 1, 1] (filled by fill_lengths_kernel, also the
//   matmuls' M/N/K overrides), and the bottom-right mask reads its offset S - c from them: keys in
//   [S, cap) are masked, and the engine bounds its key loop by seq_len_kv, so it does not read
//   them (the GPU test holds it to that with NaN in those rows). Only for S a multiple of
//   kSharedAlign (every key tile the engine reads then lies inside [0, S): whatever the store
//   holds past S, garbage or NaN, is never touched, and P V never meets 0 x NaN) and cuDNN >= 9.10;
//   not for the deterministic backward (its dS workspace grows with the extent). Keys that fill
//   the store (S = cap, as every packed K/V has) keep their exact plan, so which plan a call runs
//   depends on the call alone. A SeCO step then builds two plans per direction and chunk length
//   (the shared one and the exact one of the chunk with S = T). Shared plans are used only when
//   selected (cw::set_cudnn_plans(shared), env CW_CUDNN_PLANS=shared; the default is exact: the
//   padded kernel is slower in steady state); otherwise, or when cuDNN refuses a shared graph, a
//   plan per S.
//   Plans built ahead (cw::cudnn_plan_threads(), engine.h): an exact plan missed by a call whose K/V
//   are a slice of a longer store queues its family (the same chunk length c at every offset of
//   the store, both directions, in sweep order, behind the family's two shared plans) for worker
//   threads, each with its own cudnnHandle; get_plan waits for a plan a worker is building and
//   builds one still queued itself. A call whose exact plan is not built yet runs the shared plan
//   when that is built (it stands in), else the chooser runs it on flash; the backward whose keys
//   fill the store waits for its own (cudnn_attention_plan_ready says why).
//   The prefix apart (cw::cudnn_splits_prefix: exact plans, a chunk of c >= 64 queries with p >= c
//   keys before it) runs as two graphs, the chunk against [0, p) unmasked and against its own [p, S) causal with
//   p = 0 (the square case, whose engine skips the tiles above the diagonal; the bottom-right mask
//   is computed on every tile). Forward: the own block's out and lse into the caller's, the prefix's
//   beside them, merged (attention_merge, bf16 in place). Backward: each part given the whole row's out and lse,
//   its dK, dV added into its own rows, the prefix's dQ added to the own block's. With grouped K/V heads
//   the prefix's backward runs stacked (cw::cudnn_stack_gqa, Shape::stacked): unmasked, the G query
//   heads of a K/V head are one head of G c rows, so q, out and d_out are copied head-major
//   [B, H, c, D] (lse and Delta [B, H, c] already are), cuDNN sums dK, dV over all G c rows in its
//   own kernel (no per-query-head dK, dV and no reduction pass over G p rows), and the head-major dQ
//   is added back transposed. Its plan is a
//   split plan holding the two parts' plans, each cached under its own shape (the own block's is
//   also the plan of the chunk at p = 0), so the queue, stand-ins and readiness above treat it as
//   one plan; its scratch is taken once for both parts, laid out as one graph's.
//   Chosen by the chooser (engine/ops/attention.cpp) for bf16 forwards it serves, and for backwards
//   when determinism is off and the plan's workspace fits the budget; forced (CW_ATTENTION=cudnn)
//   the deterministic form serves the determinism switch.
#include "chunkwise_config.h"
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/scratch.h"

#include <cudnn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace cw::gpu {
namespace {

[[noreturn]] void raise_cudnn(cudnnStatus_t s, const char* expr, const char* file, int line) {
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  detail::raise(expr, file, line,
                CW_FORMAT("cuDNN error {} ({}){}{}", static_cast<int>(s), cudnnGetErrorString(s),
                          last[0] ? ": " : "", last));
}

// Every cuDNN call: the status name and cuDNN's own last error message become the cw::Error.
#define CW_CUDNN_CHECK(expr)                                                                  \
  do {                                                                                        \
    const cudnnStatus_t cw_dnn_st_ = (expr);                                                  \
    if (cw_dnn_st_ != CUDNN_STATUS_SUCCESS) raise_cudnn(cw_dnn_st_, #expr, __FILE__, __LINE__); \
  } while (0)

constexpr int64_t kMinCudnnVersion = 90300;  // bottom-right causal masks in the fused engine
constexpr int64_t kMaxHeadDim = 128;
constexpr int64_t kAlignment = 16;  // bytes; every real tensor's base and non-unit strides
// Plans needing more workspace than this are taken only when no configuration needs less.
constexpr int64_t kWorkspaceLimit = int64_t{256} << 20;
// Shared plans (one per store extent, the header says why): only for key counts that are a
// multiple of this, a multiple of every key tile the fused engines use (64 or 128 keys), so that no
// tile the engine reads reaches past the S real keys; and only from this cuDNN on (9.0-9.9 wanted
// a second padding select in the backward, which this file does not build).
constexpr int64_t kSharedAlign = 256;
constexpr int64_t kMinSharedVersion = 91000;

// ---------------------------------------------------------------------------------------------
// Backend descriptors.

// One backend descriptor, destroyed with its owner.
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  explicit Desc(cudnnBackendDescriptorType_t type) { CW_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d)); }
  ~Desc() {
    if (d) cudnnBackendDestroyDescriptor(d);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
};

void set_attr(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
              int64_t count, const void* value) {
  CW_CUDNN_CHECK(cudnnBackendSetAttribute(d, name, type, count, value));
}
void set_desc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
  set_attr(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
}

using Dims = std::array<int64_t, 4>;

// Packed row-major strides of a 4-d shape.
Dims packed_strides(const Dims& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

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

// ---------------------------------------------------------------------------------------------
// Problem shapes, graphs and plans.

// Tensor UIDs of the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kSkv, kSq, kDO, kDQ, kDK, kDV, kDelta = 15, kDQAccum, kOne,
  kSeqLenQ, kSeqLenKv  // shared plans: the real query and key counts, int32 [B, 1, 1, 1] on the device
};

// A plan's problem. S is the key extent of the graph: the call's key count for an exact plan, the
// store's capacity for a shared one (`shared`: the call's key count comes at run time, masked by
// the graph's padding mask).
struct Shape {
  int device;
  bool backward;
  int64_t B, H, Hkv, c, S, D, k_batch_stride, v_batch_stride;
  bool deterministic = false;  // backward: the direct-dQ form, only configurations without the non-determinism note
  bool shared = false;         // S is the store's extent; seq_len_q/seq_len_kv tensors give the real lengths
  bool causal = true;          // false: no mask, every query sees all S keys (a streamed key block)
  bool split = false;          // exact, causal, c >= 64, p >= c: the prefix apart (two graphs; splits() below)
  // A split backward with grouped K/V heads: its prefix runs stacked (cw::cudnn_stack_gqa). On that
  // prefix part itself: each K/V head's G query heads stacked into one head of G c rows (H = Hkv here),
  // q, out, d_out, d_q and dQ packed head-major [B, H, c, D], no mask (rows in any order are the same
  // problem).
  bool stacked = false;
  auto key() const {
    return std::tie(device, backward, B, H, Hkv, c, S, D, k_batch_stride, v_batch_stride, deterministic, shared,
                    causal, split, stacked);
  }
  bool operator<(const Shape& o) const { return key() < o.key(); }
  bool operator==(const Shape& o) const { return key() == o.key(); }
  int64_t p() const { return S - c; }  // exact plans only
  bool dq_accum() const { return backward && !deterministic; }  // the fast backward form
  bool gqa() const { return H != Hkv; }
  std::string form() const {
    const std::string keys = shared ? CW_FORMAT(", shared by every S <= {} (padding mask)", S)
                             : split  ? (stacked ? ", prefix apart (its query heads stacked)" : ", prefix apart")
                             : causal ? ""
                             : stacked ? ", unmasked, query heads stacked per K/V head"
                                       : ", unmasked";
    if (!backward) return "forward" + keys;
    return std::string(dq_accum() ? "backward, dQ=f32 accumulator" : "backward, dQ=direct") +
           (gqa() ? ", GQA head reduction in the graph" : "") + keys;
  }
};

// Whether a causal shape runs with its prefix apart (engine.h cudnn_splits_prefix: at least as many
// keys before the chunk as it has queries, the range measured: docs/performance.md, "GPU ops against
// torch"; exact plans only, as shared plans are for the fewest plans, not the fastest).
bool splits(const Shape& sh) { return !sh.shared && sh.causal && cw::cudnn_splits_prefix(sh.c, sh.S); }
// Sets whether `sh` (an exact shape) runs with its prefix apart, and that prefix's backward stacked.
void set_split(Shape& sh) {
  sh.split = splits(sh);
  sh.stacked = sh.split && sh.backward && cw::cudnn_stacks_gqa(sh.c, sh.S, sh.H, sh.Hkv);
}
// Its parts, with the call's K/V batch strides (the store's): the chunk's queries against the p keys
// before it, unmasked (stacked: H = Hkv heads of G c rows); and against its own c keys, causal (p = 0:
// the square case).
Shape prefix_part(Shape sh) {
  const int64_t p = sh.p();
  sh.S = p;
  sh.causal = false;
  sh.split = false;
  if (sh.stacked) {
    sh.c *= sh.H / sh.Hkv;
    sh.H = sh.Hkv;
  }
  return sh;
}
Shape own_part(Shape sh) {
  sh.S = sh.c;
  sh.split = false;
  sh.stacked = false;
  return sh;
}

struct Plan {
  std::vector<std::unique_ptr<Desc>> descs;  // the graph's descriptors (kept alive with the plan)
  std::unique_ptr<Desc> engine_cfg, plan;
  std::vector<std::unique_ptr<Desc>> cfg_parts;  // engine/knob descriptors of a built configuration
  int64_t workspace = 0;  // a split plan: the larger of its parts'
  std::string info;  // engine index, notes, form
  // A split plan (Shape::split) has no graph of its own: it runs its parts, the plans of the unmasked
  // prefix [0, p) and of the causal own block [p, S) (cached under their own shapes, like any plan;
  // kept here only where another thread filed the same part first).
  const Plan* prefix = nullptr;
  const Plan* own = nullptr;
  std::unique_ptr<Plan> kept_prefix, kept_own;
};

struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::map<Shape, std::unique_ptr<Plan>> plans;
  std::map<Shape, std::string> rejected;  // shapes cuDNN could not serve, with its reasons
  std::set<Shape> building;               // being built now, by a worker or a caller
};

std::mutex g_mutex;  // guards everything below (plans are immutable once built)
std::condition_variable g_plan_done;  // a build finished (a plan, a refusal, or an abandoned build)
std::map<int, DeviceState> g_devices;
AttentionPlanStats g_stats;  // every build, all devices (cw::attention_plan_stats)
std::deque<Shape> g_ahead;   // plans to build ahead, in the order calls are expected to need them
std::set<Shape> g_ahead_set;

DeviceState& device_state(int device) {
  DeviceState& st = g_devices[device];
  if (!st.handle) {
    cudaStream_t stream = current_stream(device);  // also makes `device` current
    CW_CUDNN_CHECK(cudnnCreate(&st.handle));
    CW_CUDNN_CHECK(cudnnSetStream(st.handle, stream));
  }
  return st;
}

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

  // P = exp(S - lse). Exact plans mask S before the subtraction (the arrangement this file has
  // always used); shared plans after it, as the frontend orders a padding-masked backward.
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

bool verbose();

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

std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const Shape& sh, std::string* why, bool ahead);
const Plan* part_plan(cudnnHandle_t handle, const Shape& part, std::unique_ptr<Plan>* keep, std::string* why,
                      bool ahead);

// A split shape's plan: its two parts' plans (part_plan), nullptr where cuDNN serves either not.
std::unique_ptr<Plan> build_split_plan(cudnnHandle_t handle, const Shape& sh, std::string* why, bool ahead) {
  auto plan = std::make_unique<Plan>();
  std::string reasons;
  plan->prefix = part_plan(handle, prefix_part(sh), &plan->kept_prefix, &reasons, ahead);
  if (plan->prefix) plan->own = part_plan(handle, own_part(sh), &plan->kept_own, &reasons, ahead);
  if (!plan->prefix || !plan->own) {
    *why = CW_FORMAT("the {} was refused: {}", plan->prefix ? "own block" : "prefix", reasons);
    return nullptr;
  }
  plan->workspace = std::max(plan->prefix->workspace, plan->own->workspace);
  plan->info = CW_FORMAT("prefix apart: keys [0, {}) on {}; own block on {}", sh.p(), plan->prefix->info,
                         plan->own->info);
  return plan;
}

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
  static const bool v = env_switch("CW_CUDNN_VERBOSE", "CW_CUDNN_VERBOSE=1 describes each cuDNN attention plan on stderr");
  return v;
}
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Files a finished build (lock held): the plan, or cuDNN's reasons; wakes whoever waits for it.
const Plan* file_build(DeviceState& st, const Shape& sh, std::unique_ptr<Plan> plan, const std::string& reasons,
                       double seconds, bool ahead) {
  st.building.erase(sh);
  g_plan_done.notify_all();
  const bool split = plan && plan->own;  // its parts were counted where they were built
  if (!split) g_stats.seconds += seconds;
  const std::string what = CW_FORMAT("cuDNN attention {} plan B={} H={} Hkv={} c={} S={} D={}{}{}{}",
                                     sh.backward ? "backward" : "forward", sh.B, sh.H, sh.Hkv, sh.c, sh.S, sh.D,
                                     sh.shared ? " (shared)" : "", split ? " (prefix apart)" : "",
                                     ahead ? " (ahead)" : "");
  if (!plan) {
    ++g_stats.refused;
    if (verbose()) std::fprintf(stderr, "%s: refused in %.3f s: %s\n", what.c_str(), seconds, reasons.c_str());
    st.rejected.emplace(sh, reasons);
    return nullptr;
  }
  const Plan* p = plan.get();
  if (!split) {
    ++g_stats.built;
    if (ahead) ++g_stats.built_ahead;
  }
  if (verbose()) std::fprintf(stderr, "%s: built in %.3f s: %s\n", what.c_str(), seconds, p->info.c_str());
  st.plans.emplace(sh, std::move(plan));
  return p;
}

// The plan of one part of a split call: the one filed under its shape, else built here with `handle`
// and filed (a part is an ordinary shape: the own block is also the plan of the chunk at p = 0). Where
// another thread is building the same part meanwhile, this copy is kept in *keep instead.
const Plan* part_plan(cudnnHandle_t handle, const Shape& part, std::unique_ptr<Plan>* keep, std::string* why,
                      bool ahead) {
  {
    std::lock_guard lock(g_mutex);
    DeviceState& st = g_devices[part.device];
    if (auto it = st.plans.find(part); it != st.plans.end()) return it->second.get();
    if (auto it = st.rejected.find(part); it != st.rejected.end()) {
      *why = it->second;
      return nullptr;
    }
  }
  const Clock::time_point t0 = Clock::now();
  std::string reasons;
  std::unique_ptr<Plan> plan = build_plan(handle, part, &reasons, ahead);
  const double seconds = seconds_since(t0);
  std::lock_guard lock(g_mutex);
  DeviceState& st = g_devices[part.device];
  if (st.building.count(part) || st.plans.count(part) || st.rejected.count(part)) {
    g_stats.seconds += seconds;
    if (!plan) *why = reasons;
    *keep = std::move(plan);
    return keep->get();
  }
  const Plan* p = file_build(st, part, std::move(plan), reasons, seconds, ahead);
  if (!p) *why = reasons;
  return p;
}

// The worker threads that build plans ahead; started with the first plan queued, stopped (each
// finishing the build in hand) when the process exits.
class AheadBuilders {
 public:
  ~AheadBuilders() { stop(); }
  // Drops the queue and joins the workers (each finishing the build in hand); a later queue starts
  // them again.
  void stop() {
    {
      std::lock_guard lock(g_mutex);
      stop_ = true;
      g_ahead.clear();
      g_ahead_set.clear();
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    std::lock_guard lock(g_mutex);
    stop_ = false;
  }
  // Lock held. Starts the workers if none run yet.
  void wake(int threads) {
    while (static_cast<int>(threads_.size()) < threads) threads_.emplace_back([this] { work(); });
    work_.notify_all();
  }

 private:
  void work() {
    std::map<int, cudnnHandle_t> handles;  // this thread's, one per device (never shared between threads, never destroyed)
    std::unique_lock lock(g_mutex);
    for (;;) {
      work_.wait(lock, [this] { return stop_ || !g_ahead.empty(); });
      if (stop_) break;
      const Shape sh = g_ahead.front();
      g_ahead.pop_front();
      g_ahead_set.erase(sh);
      DeviceState& st = g_devices[sh.device];
      if (st.plans.count(sh) || st.rejected.count(sh) || st.building.count(sh)) continue;
      st.building.insert(sh);
      lock.unlock();
      std::unique_ptr<Plan> plan;
      std::string reasons;
      const Clock::time_point t0 = Clock::now();
      bool built = true;
      try {
        cudnnHandle_t& h = handles[sh.device];
        if (!h) {
          CW_CUDA_CHECK(cudaSetDevice(sh.device));
          CW_CUDNN_CHECK(cudnnCreate(&h));
        }
        CW_CUDA_CHECK(cudaSetDevice(sh.device));
        plan = build_plan(h, sh, &reasons, true);
      } catch (const std::exception&) {
        built = false;  // a caller that needs this plan builds it and sees the error itself
      }
      const double seconds = seconds_since(t0);
      lock.lock();
      if (built) {
        file_build(st, sh, std::move(plan), reasons, seconds, true);
      } else {
        st.building.erase(sh);
        g_plan_done.notify_all();
      }
    }
    // The handles stay: the plans built with them outlive this thread (like each device's handle).
  }

  std::vector<std::thread> threads_;
  std::condition_variable work_;
  bool stop_ = false;  // guarded by g_mutex
};

AheadBuilders& ahead_builders() {
  static AheadBuilders b;
  return b;
}

int64_t runtime_version();
Shape widened(Shape sh, int64_t extent);

// Lock held. After a call missed the exact plan `sh`: where its K/V are a slice [0, S) of a longer
// store, queues the plans of the same chunk length at the store's other offsets S' = S + j c, both
// directions: the two whose keys fill the store first, then this direction in its sweep order
// (forward: S' rising, as the prefill runs; backward: falling, as the reverse sweep), then the
// other direction in its own.
void queue_family(const Shape& sh) {
  const int threads = cw::cudnn_plan_threads();
  if (threads == 0 || sh.shared || !sh.causal) return;
  const int64_t row = sh.Hkv * sh.D;
  if (row <= 0 || sh.k_batch_stride % row != 0 || sh.v_batch_stride % row != 0) return;
  const int64_t extent = std::min(sh.k_batch_stride, sh.v_batch_stride) / row;
  if (extent <= sh.S) return;
  const int64_t top = sh.S + (extent - sh.S) / sh.c * sh.c, bottom = sh.S - (sh.S - sh.c) / sh.c * sh.c;
  auto queue = [&](bool backward, int64_t S) {
    Shape s = sh;
    s.backward = backward;
    s.S = S;
    s.deterministic = backward && cw::deterministic();
    set_split(s);
    DeviceState& st = g_devices[s.device];
    if (st.plans.count(s) || st.rejected.count(s) || st.building.count(s) || !g_ahead_set.insert(s).second) return;
    g_ahead.push_back(s);
  };
  auto sweep = [&](bool backward) {
    if (backward)
      for (int64_t S = top; S >= bottom; S -= sh.c) queue(true, S);
    else
      for (int64_t S = bottom; S <= top; S += sh.c) queue(false, S);
  };
  // First the sweep's first chunk, whose keys fill the store: its backward waits for its plan
  // (cudnn_attention_plan_ready says why), and its forward runs just before it.
  if (top == extent) {
    queue(true, extent);
    queue(false, extent);
  }
  if (sh.backward) {
    for (int64_t S = sh.S - sh.c; S >= bottom; S -= sh.c) queue(true, S);
  } else {
    for (int64_t S = sh.S + sh.c; S <= top; S += sh.c) queue(false, S);
  }
  sweep(!sh.backward);
  sweep(sh.backward);  // the offsets of this direction on the other side of S
  // In front of all: the family's two shared plans, which stand in for the exact ones until those
  // are built (resolve_plan), where every offset of the family qualifies for one.
  if (cw::cudnn_plans() == CudnnPlans::exact && runtime_version() >= kMinSharedVersion && sh.c % kSharedAlign == 0 &&
      bottom % kSharedAlign == 0 && extent <= std::numeric_limits<int32_t>::max()) {
    for (bool backward : {true, false}) {
      if (backward && cw::deterministic()) continue;
      Shape wide = widened(sh, extent);
      wide.backward = backward;
      wide.deterministic = false;
      DeviceState& st = g_devices[wide.device];
      if (st.plans.count(wide) || st.rejected.count(wide) || st.building.count(wide)) continue;
      if (!g_ahead_set.insert(wide).second) g_ahead.erase(std::find(g_ahead.begin(), g_ahead.end(), wide));
      g_ahead.push_front(wide);  // the forward ends up first: the prefill needs it first
    }
  }
  if (!g_ahead.empty()) ahead_builders().wake(threads);
}

// The cached plan for `sh`, built on first use; nullptr (with cuDNN's reasons) if cuDNN cannot serve it.
const Plan* get_plan(const Shape& sh, std::string* why) {
  std::unique_lock lock(g_mutex);
  DeviceState& st = device_state(sh.device);
  for (;;) {
    if (auto it = st.plans.find(sh); it != st.plans.end()) return it->second.get();
    if (auto it = st.rejected.find(sh); it != st.rejected.end()) {
      if (why) *why = it->second;
      return nullptr;
    }
    if (!st.building.count(sh)) break;
    const Clock::time_point t0 = Clock::now();  // a worker builds it: wait for that build
    g_plan_done.wait(lock);
    g_stats.waited_seconds += seconds_since(t0);
  }
  // Not built, not in hand anywhere: build it here (dropped from the queue if it was there), after
  // queueing the rest of its family for the workers.
  if (g_ahead_set.erase(sh)) g_ahead.erase(std::find(g_ahead.begin(), g_ahead.end(), sh));
  st.building.insert(sh);
  queue_family(sh);
  lock.unlock();
  current_stream(sh.device);  // make the device current for the build
  std::string reasons;
  const Clock::time_point t0 = Clock::now();
  std::unique_ptr<Plan> plan;
  try {
    plan = build_plan(st.handle, sh, &reasons, false);
  } catch (...) {
    lock.lock();
    st.building.erase(sh);
    g_plan_done.notify_all();
    throw;
  }
  const double seconds = seconds_since(t0);
  lock.lock();
  const Plan* p = file_build(st, sh, std::move(plan), reasons, seconds, false);
  if (!p && why) *why = reasons;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Checks.

int64_t runtime_version() { return static_cast<int64_t>(cudnnGetVersion()); }

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlignment == 0; }

// Static conditions of the fused path (cheap; no plan is built). Empty string: served.
std::string static_reason(const Tensor& q, const Tensor& k, bool causal = true) {
  const int64_t v = runtime_version();
  if (v < kMinCudnnVersion)
    return CW_FORMAT("the cuDNN library loaded at run time is version {}; bottom-right causal fused attention "
                     "needs {} or newer",
                     v, kMinCudnnVersion);
  if (q.device.is_cpu() || k.device.is_cpu()) return "operands are not on a GPU";
  if (q.dtype != DType::bf16 || k.dtype != DType::bf16)
    return CW_FORMAT("dtype {} (the cuDNN path takes bf16 only)", dtype_name(q.dtype));
  if (q.ndim != 4 || k.ndim != 4) return "q and k must be 4-d";
  const int64_t D = q.size(3), H = q.size(2), Hkv = k.size(2), c = q.size(1), S = k.size(1);
  if (D % 8 != 0 || D > kMaxHeadDim || D <= 0)
    return CW_FORMAT("head dim {} (cuDNN needs a multiple of 8 up to {})", D, kMaxHeadDim);
  if (k.size(3) != D || k.size(0) != q.size(0)) return "q and k shapes disagree";
  if (Hkv <= 0 || H % Hkv != 0) return "query heads not a multiple of K/V heads";
  if (c <= 0 || S <= 0 || (causal && S < c)) return causal ? "needs 1 <= c <= S" : "needs c >= 1 and S >= 1";
  // The engine cuDNN picks for one query row gives out and lse that differ in the last bits from one
  // call to the next (masked, unmasked, D 32 to 128, determinism on: docs/decisions.md, "One query row
  // goes to flash").
  if (c == 1) return "one query (cuDNN's engine for a single row is not reproducible bit for bit; flash serves it)";
  if (!q.contiguous()) return "q is not contiguous";
  if (k.stride[1] != Hkv * D || k.stride[2] != D || k.stride[3] != 1) return "k's [S, Hkv, D] is not packed";
  if (k.stride[0] % 8 != 0 || !aligned(k.data) || !aligned(q.data))
    return "operands not 16-byte aligned (K/V batch stride must be a multiple of 8 elements)";
  int major = 0;
  CW_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device.index));
  if (major < 8) return CW_FORMAT("compute capability {}.x (cuDNN fused attention needs 8.0+)", major);
  return "";
}

Shape shape_of(const Tensor& q, const Tensor& k, const Tensor& v, bool backward, bool causal = true) {
  Shape sh{q.device.index, backward,   q.size(0), q.size(2),   k.size(2), q.size(1),
           k.size(1),      q.size(3),  k.stride[0], v.stride[0], backward && cw::deterministic()};
  sh.causal = causal;
  set_split(sh);
  return sh;
}

// The key extent of a shared plan that can serve these operands (the store's capacity, read off the
// K/V batch strides: a slice [0, S) of a [B, cap, Hkv, D] store), or 0 where only an exact plan can.
int64_t shareable_extent(const Tensor& k, const Tensor& v, bool backward, bool causal) {
  if (!causal) return 0;  // an unmasked block has one shape: its exact plan serves every block
  if (runtime_version() < kMinSharedVersion) return 0;
  if (backward && cw::deterministic()) return 0;  // its dS workspace would grow to c x extent
  const int64_t S = k.size(1), row = k.size(2) * k.size(3);
  if (S % kSharedAlign != 0 || k.stride[0] % row != 0 || v.stride[0] % row != 0) return 0;
  const int64_t extent = std::min(k.stride[0], v.stride[0]) / row;
  return extent > S && extent <= std::numeric_limits<int32_t>::max() ? extent : 0;
}

// The shared plan's shape for an exact shape `sh` whose operands allow one (extent > 0).
Shape widened(Shape sh, int64_t extent) {
  sh.S = extent;
  sh.shared = true;
  sh.split = false;
  sh.stacked = false;
  return sh;
}

// Lock held. With exact plans built ahead: the shared plan that stands in for the exact plan `sh`
// while a worker has not built it yet (so the call runs on cuDNN rather than flash), or nullptr
// where the exact plan is there, or no shared plan is built.
const Plan* stand_in(DeviceState& st, const Shape& sh, int64_t extent) {
  if (extent <= 0 || cw::cudnn_plans() != CudnnPlans::exact || cw::cudnn_plan_threads() == 0 ||
      st.plans.count(sh) || st.rejected.count(sh))
    return nullptr;
  const auto it = st.plans.find(widened(sh, extent));
  return it == st.plans.end() ? nullptr : it->second.get();
}

// The plan a call runs, *sh receiving its shape: in shared mode the shared plan where the call
// qualifies and cuDNN builds it; in exact mode the exact plan, or while it is still being built
// ahead the family's shared plan if that is built; else the exact one (nullptr, with cuDNN's
// reasons, where none exists). With determinism on no plan stands in (no backward qualifies for a
// shared plan) and calls wait for their own, so which plan runs depends only on the call.
const Plan* resolve_plan(const Tensor& q, const Tensor& k, const Tensor& v, bool backward, Shape* sh,
                         std::string* why, bool causal) {
  *sh = shape_of(q, k, v, backward, causal);
  if (const int64_t extent = shareable_extent(k, v, backward, causal); extent > 0) {
    const Shape wide = widened(*sh, extent);
    if (cw::cudnn_plans() == CudnnPlans::shared) {
      if (const Plan* plan = get_plan(wide, nullptr)) {
        *sh = wide;
        return plan;
      }
    } else {
      std::lock_guard lock(g_mutex);
      if (const Plan* plan = stand_in(device_state(sh->device), *sh, extent)) {
        *sh = wide;
        return plan;
      }
    }
  }
  return get_plan(*sh, why);
}

// A call is about to run `plan`, of shape `sh` (counted here, once a call; resolve_plan also answers
// the chooser's workspace check): a shared plan in exact mode standing in for the call's own, or a
// split plan.
void count_run(const Shape& sh, const Plan& plan) {
  const bool stood_in = sh.shared && cw::cudnn_plans() == CudnnPlans::exact;
  if (!stood_in && !plan.own) return;
  std::lock_guard lock(g_mutex);
  ++(stood_in ? g_stats.stood_in : g_stats.split);
  if (!stood_in && sh.stacked) ++g_stats.stacked;
}

// What is cuDNN's own on top of the op's contract (engine/ops/attention.cpp checks shapes, dtypes,
// layouts and devices before any backend runs): the static conditions, a V batch stride that keeps
// rows 16-byte aligned, and 16-byte aligned operands.
void check_operands(const Tensor& q, const Tensor& k, const Tensor& v, std::initializer_list<const Tensor*> others,
                    bool causal) {
  const std::string why = static_reason(q, k, causal);
  CW_CHECK(why.empty(), "cuDNN attention cannot take q {} k {}: {}", q.describe(), k.describe(), why);
  CW_CHECK(v.stride[0] % 8 == 0, "cuDNN attention: v {} needs a batch stride that is a multiple of 8", v.describe());
  for (const Tensor* t : others)
    CW_CHECK(aligned(t->data), "cuDNN attention: operand {} is not 16-byte aligned", t->describe());
}

// Runs `plan` on the operands of the variant pack, with its workspace `ws` (at least plan.workspace
// bytes; a split plan's parts share the larger of theirs: workspace()).
void execute(const Plan& plan, int device, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs, void* ws) {
  cudnnHandle_t handle;
  {
    std::lock_guard lock(g_mutex);
    handle = device_state(device).handle;
  }
  current_stream(device);  // makes the device current
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()),
           ptrs.data());
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  CW_CUDNN_CHECK(cudnnBackendFinalize(pack.d));
  CW_CUDNN_CHECK(cudnnBackendExecute(handle, plan.plan->d, pack.d));
}

// ---------------------------------------------------------------------------------------------
// Adding the scratch gradients into the caller's buffers.

constexpr int kAddThreads = 256;

// dst[b, r] += src[b, r] for r < row (row = S Hkv D elements per batch entry; dst f32 with batch
// stride dst_bs, src bf16 with batch stride src_bs, a multiple of 8: a shared plan's scratch holds
// its extent's rows, of which the first S are the call's). blockIdx.y = b, blockIdx.z picks the
// (K, V) pair. Each thread
// adds 8 consecutive elements (row is a multiple of 8: D is); with kVec (every row start 16-byte
// aligned) through 16-byte loads and stores, so the pass runs at memory speed.
template <bool kVec>
__global__ void add_kv_kernel(float* dk, float* dv, const __nv_bfloat16* sk, const __nv_bfloat16* sv, int64_t row,
                              int64_t src_bs, int64_t dk_bs, int64_t dv_bs) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= row) return;
  const int64_t b = blockIdx.y;
  float* d = (blockIdx.z == 0 ? dk + b * dk_bs : dv + b * dv_bs) + i;
  const __nv_bfloat16* s = (blockIdx.z == 0 ? sk : sv) + b * src_bs + i;
  if constexpr (kVec) {
    float v[8];
    const uint4 raw = *reinterpret_cast<const uint4*>(s);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[2 * j] = __low2float(h[j]), v[2 * j + 1] = __high2float(h[j]);
    float4* d4 = reinterpret_cast<float4*>(d);
    float4 lo = d4[0], hi = d4[1];
    lo.x += v[0], lo.y += v[1], lo.z += v[2], lo.w += v[3];
    hi.x += v[4], hi.y += v[5], hi.z += v[6], hi.w += v[7];
    d4[0] = lo;
    d4[1] = hi;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] += to_f32(s[j]);
  }
}

void launch_add_kv(const Tensor& d_k, const Tensor& d_v, const void* sk, const void* sv, int64_t B, int64_t row,
                   int64_t src_bs, cudaStream_t stream) {
  const dim3 grid(blocks_for(row / 8, kAddThreads), static_cast<unsigned>(B), 2);
  auto row_aligned = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (t.size(0) == 1 || t.stride[0] % 4 == 0);
  };
  float *dk = static_cast<float*>(d_k.data), *dv = static_cast<float*>(d_v.data);
  const auto *s_k = static_cast<const __nv_bfloat16*>(sk), *s_v = static_cast<const __nv_bfloat16*>(sv);
  if (row_aligned(d_k) && row_aligned(d_v))
    add_kv_kernel<true><<<grid, kAddThreads, 0, stream>>>(dk, dv, s_k, s_v, row, src_bs, d_k.stride[0], d_v.stride[0]);
  else
    add_kv_kernel<false><<<grid, kAddThreads, 0, stream>>>(dk, dv, s_k, s_v, row, src_bs, d_k.stride[0], d_v.stride[0]);
}

// d_q += src, both bf16 [n] packed; the sum is formed in f32 and rounded once.
__global__ void add_q_kernel(__nv_bfloat16* dq, const __nv_bfloat16* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dq[i] = __float2bfloat16_rn(__bfloat162float(dq[i]) + __bfloat162float(src[i]));
}

// A stacked prefix's operands (Shape::stacked): dst[b, h, t, :] = src[b, t, h, :] for q, out and d_out
// (blockIdx.y picks one), [B, c, H, D] bf16 packed into [B, H, c, D]; each thread moves 8 elements
// (D is a multiple of 8, operands 16-byte aligned).
struct HeadsMajorCopies {
  const __nv_bfloat16* src[3];
  __nv_bfloat16* dst[3];
};
__global__ void heads_major_kernel(HeadsMajorCopies copies, int64_t B, int64_t c, int64_t H, int64_t D) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, per_row = D / 8;
  if (i >= B * H * c * per_row) return;
  const int64_t d8 = i % per_row, t = i / per_row % c, h = i / per_row / c % H, b = i / per_row / c / H;
  const int64_t from = ((b * c + t) * H + h) * D + d8 * 8;
  *reinterpret_cast<uint4*>(copies.dst[blockIdx.y] + i * 8) =
      *reinterpret_cast<const uint4*>(copies.src[blockIdx.y] + from);
}

// dq[b, t, h, :] += src[b, h, t, :] (a stacked prefix's head-major dQ), the sum formed in f32 and
// rounded once; 8 elements a thread.
__global__ void add_q_heads_kernel(__nv_bfloat16* dq, const __nv_bfloat16* src, int64_t B, int64_t c, int64_t H,
                                   int64_t D) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, per_row = D / 8;
  if (i >= B * c * H * per_row) return;
  const int64_t d8 = i % per_row, h = i / per_row % H, t = i / per_row / H % c, b = i / per_row / H / c;
  const int64_t from = ((b * H + h) * c + t) * D + d8 * 8;
  uint4 acc = *reinterpret_cast<const uint4*>(dq + i * 8);
  const uint4 add = *reinterpret_cast<const uint4*>(src + from);
  __nv_bfloat162* a = reinterpret_cast<__nv_bfloat162*>(&acc);
  const __nv_bfloat162* s = reinterpret_cast<const __nv_bfloat162*>(&add);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    a[j] = __floats2bfloat162_rn(__low2float(a[j]) + __low2float(s[j]), __high2float(a[j]) + __high2float(s[j]));
  *reinterpret_cast<uint4*>(dq + i * 8) = acc;
}

// seq_len_q[b] = c, seq_len_kv[b] = S: the real counts a shared plan masks with.
__global__ void fill_lengths_kernel(int32_t* seq_len_q, int32_t* seq_len_kv, int64_t B, int32_t c, int32_t S) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < B) {
    seq_len_q[b] = c;
    seq_len_kv[b] = S;
  }
}

// What the mask reads at run time: the lowest float its selects write (masked graphs only). Exact
// plans with p > 0: the by-value int32 offsets of the bottom-right mask, row + S - c (none for p = 0). Shared plans: the length tensors, in `scratch`
// (the caller's scope releases them after the call).
struct MaskOperands {
  int32_t s = 0, c = 0;
  float lowest = std::numeric_limits<float>::lowest();
  bool masked = true;  // an unmasked graph has no select, so its variant pack must not name kNegInf
  bool scalars = false;
  void* seq_len_q = nullptr;
  void* seq_len_kv = nullptr;

  MaskOperands(const Shape& sh, int64_t S, Arena& scratch, cudaStream_t stream)
      : s(static_cast<int32_t>(S)),
        c(static_cast<int32_t>(sh.c)),
        masked(sh.causal || sh.shared),
        scalars(!sh.shared && sh.causal && sh.p() > 0) {
    if (!sh.shared) return;
    seq_len_q = scratch.alloc_bytes(static_cast<size_t>(sh.B) * sizeof(int32_t));
    seq_len_kv = scratch.alloc_bytes(static_cast<size_t>(sh.B) * sizeof(int32_t));
    fill_lengths_kernel<<<blocks_for(sh.B, kAddThreads), kAddThreads, 0, stream>>>(
        static_cast<int32_t*>(seq_len_q), static_cast<int32_t*>(seq_len_kv), sh.B, c, s);
    CW_KERNEL_CHECK();
  }
  void add_to(std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
    if (masked) {
      uids.push_back(kNegInf);
      ptrs.push_back(&lowest);
    }
    if (scalars) {
      uids.insert(uids.end(), {kSkv, kSq});
      ptrs.insert(ptrs.end(), {&s, &c});
    }
    if (seq_len_q) {
      uids.insert(uids.end(), {kSeqLenQ, kSeqLenKv});
      ptrs.insert(ptrs.end(), {seq_len_q, seq_len_kv});
    }
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points.

int64_t cudnn_runtime_version() { return runtime_version(); }

bool cudnn_attention_plan_ready(const Tensor& q, const Tensor& k, const Tensor& v, bool backward, bool causal) {
  if (!causal || cw::cudnn_plan_threads() == 0 || cw::cudnn_plans() == CudnnPlans::shared ||
      !static_reason(q, k).empty())
    return true;  // an unmasked block's one plan is built on its first use
  const Shape sh = shape_of(q, k, v, backward);
  const int64_t row = sh.Hkv * sh.D;
  const bool slice = row > 0 && std::min(sh.k_batch_stride, sh.v_batch_stride) / row > sh.S;
  const int64_t extent = shareable_extent(k, v, backward, causal);
  std::lock_guard lock(g_mutex);
  DeviceState& st = device_state(sh.device);
  if (st.plans.count(sh) || st.rejected.count(sh)) return true;
  // A worker builds it. The backward whose keys fill the store (a sweep's first chunk) waits for it:
  // it is the step's largest attention scratch, so it lays out the scratch arena's blocks; run on
  // flash, the first step would shape them for a smaller call and the next step, on cuDNN, would
  // add a block for its workspace (1 GiB at 128K), beyond what the planner counts. Other calls run
  // on the family's shared plan meanwhile, if it is built (resolve_plan), else on flash.
  if (st.building.count(sh)) return (backward && !slice) || stand_in(st, sh, extent) != nullptr;
  if (!slice) return true;  // built on use
  // First in the queue (it is needed now), then the rest of its family, the shared plans first.
  if (!g_ahead_set.insert(sh).second) g_ahead.erase(std::find(g_ahead.begin(), g_ahead.end(), sh));
  g_ahead.push_front(sh);
  queue_family(sh);
  ahead_builders().wake(cw::cudnn_plan_threads());
  return stand_in(st, sh, extent) != nullptr;
}

void cudnn_stop_plan_threads() { ahead_builders().stop(); }

AttentionPlanStats cudnn_plan_stats() {
  std::lock_guard lock(g_mutex);
  return g_stats;
}

namespace {
// What both directions share: the static rules, then shapes cuDNN already rejected in `direction`.
bool supports(const Tensor& q, const Tensor& k, bool backward, std::string* why_not, bool causal) {
  std::string why = static_reason(q, k, causal);
  if (why.empty()) {
    // Shapes cuDNN already rejected are not offered again.
    std::lock_guard lock(g_mutex);
    auto it = g_devices.find(q.device.index);
    if (it != g_devices.end()) {
      const Shape sh = shape_of(q, k, k, backward, causal);
      if (auto r = it->second.rejected.find(sh); r != it->second.rejected.end())
        why = "cuDNN rejected this shape: " + r->second;
    }
  }
  if (why_not) *why_not = why;
  return why.empty();
}
}  // namespace

bool cudnn_attention_supports(const Tensor& q, const Tensor& k, std::string* why_not, bool causal) {
  return supports(q, k, false, why_not, causal) && supports(q, k, true, why_not, causal);
}


bool cudnn_attention_forward_supports(const Tensor& q, const Tensor& k, std::string* why_not, bool causal) {
  return supports(q, k, false, why_not, causal);
}

bool cudnn_attention_backward_fits(const Tensor& q, const Tensor& k, const Tensor& v, int64_t max_workspace,
                                   std::string* why_not, bool causal) {
  if (!supports(q, k, true, why_not, causal)) return false;
  std::string why;
  Shape sh{};
  const Plan* plan = resolve_plan(q, k, v, true, &sh, &why, causal);
  if (plan == nullptr) {
    if (why_not) *why_not = "cuDNN has no backward plan: " + why;
    return false;
  }
  if (plan->workspace > max_workspace) {
    if (why_not)
      *why_not = CW_FORMAT("cuDNN's backward plan wants {} MiB of workspace (limit {} MiB): {}",
                           plan->workspace >> 20, max_workspace >> 20, plan->info);
    return false;
  }
  return true;
}

namespace {
// A plan's workspace from `scratch` (nullptr for none); a split plan's is the larger of its parts'.
void* workspace(const Plan& plan, Arena& scratch) {
  return plan.workspace > 0 ? scratch.alloc_bytes(static_cast<size_t>(plan.workspace)) : nullptr;
}

// One graph's forward: out and lse of q against k, v under `plan` of shape `sh`.
void run_forward(const Plan& plan, const Shape& sh, const Tensor& out, const Tensor& lse, const Tensor& q,
                 const Tensor& k, const Tensor& v, float* scale, void* ws, Arena& scratch) {
  MaskOperands m(sh, k.size(1), scratch, current_stream(sh.device));
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data, k.data, v.data, out.data, lse.data, scale};
  m.add_to(uids, ptrs);
  execute(plan, sh.device, uids, ptrs, ws);
}

// A split backward's workspace: its parts' larger, but no less than its family's shared plan's where
// that is built. In a first step that plan stands in for calls whose own are still being built, with
// a workspace over the store's whole extent; the store-filling call, which comes first and lays out
// the scratch arena, takes that much too, so the stand-ins reuse its block (as with one graph, whose
// workspace at S = T is the shared plan's) instead of adding one beside it.
int64_t split_backward_workspace(const Shape& sh, const Plan& plan) {
  const int64_t row = sh.Hkv * sh.D;
  if (!plan.own || sh.deterministic || row <= 0 || sh.k_batch_stride % row != 0 || sh.v_batch_stride % row != 0)
    return plan.workspace;
  Shape wide = widened(sh, std::min(sh.k_batch_stride, sh.v_batch_stride) / row);
  std::lock_guard lock(g_mutex);
  const auto& plans = device_state(sh.device).plans;
  const auto it = plans.find(wide);
  return it == plans.end() ? plan.workspace : std::max(plan.workspace, it->second->workspace);
}

// One graph of a backward: the keys [k0, k1) of the call under `plan` of shape `sh` (the whole call,
// or a part of a split one).
struct BackwardPart {
  const Plan* plan;
  const Shape* sh;
  int64_t k0, k1;
};
}  // namespace

void cudnn_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, Arena& scratch, bool causal) {
  check_operands(q, k, v, {&v, &out, &saved.lse}, causal);
  Shape sh{};
  std::string why;
  const Plan* plan = resolve_plan(q, k, v, false, &sh, &why, causal);
  CW_CHECK(plan != nullptr, "cuDNN has no fused attention plan for q {} k {}:\n{}", q.describe(), k.describe(), why);
  count_run(sh, *plan);
  ArenaScope scope(scratch);
  float scale_f = static_cast<float>(scale);
  if (!plan->own) return run_forward(*plan, sh, out, saved.lse, q, k, v, &scale_f, workspace(*plan, scratch), scratch);
  // The prefix apart: the own block's out and lse straight into the caller's, the prefix's beside
  // them, then merged into the caller's.
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), p = k.size(1) - c;
  const cw::CudnnForwardScratch bytes = cw::cudnn_attention_forward_scratch({B, c, p + c, H, k.size(2), D}, true);
  const Tensor prefix_out(scratch.alloc_bytes(bytes.prefix_out), DType::bf16, q.device, {B, c, H, D});
  const Tensor prefix_lse(scratch.alloc_bytes(bytes.prefix_lse), DType::f32, q.device, {B, H, c});
  void* ws = workspace(*plan, scratch);
  run_forward(*plan->own, own_part(sh), out, saved.lse, q, k.slice(1, p, c), v.slice(1, p, c), &scale_f, ws, scratch);
  run_forward(*plan->prefix, prefix_part(sh), prefix_out, prefix_lse, q, k.slice(1, 0, p), v.slice(1, 0, p), &scale_f,
              ws, scratch);
  gpu::attention_merge(out, saved.lse, prefix_out, prefix_lse);
}

void cudnn_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch, bool causal) {
  check_operands(q, k, v, {&v, &out, &saved.lse, &d_q, &d_out}, causal);
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  const int64_t row = Hkv * D;
  const int dev = q.device.index;
  cudaStream_t stream = current_stream(dev);
  ArenaScope scope(scratch);

  Shape sh{};
  std::string why;
  const Plan* plan = resolve_plan(q, k, v, true, &sh, &why, causal);
  CW_CHECK(plan != nullptr, "cuDNN has no fused attention backward plan for q {} k {}:\n{}", q.describe(),
           k.describe(), why);
  count_run(sh, *plan);
  // One graph over all S keys, or with the prefix apart its own block [p, S) and then the prefix
  // [0, p), each given the whole row's out and lse (its P is then its share of the row: attention.h).
  std::vector<BackwardPart> parts;
  const Shape own_sh = plan->own ? own_part(sh) : Shape{}, prefix_sh = plan->own ? prefix_part(sh) : Shape{};
  if (plan->own)
    parts = {{plan->own, &own_sh, S - c, S}, {plan->prefix, &prefix_sh, 0, S - c}};
  else
    parts = {{plan, &sh, 0, S}};

  // The scratch, for all parts at once (so a split call lays out the arena as one graph does): the
  // f32 dQ accumulator first, so that it sits at the same scratch address call after call (the
  // tests' second backward then catches an accumulator left unzeroed); cuDNN's dK, dV, packed per
  // part over its plan's key extent (sh.S, the store's for a shared plan; rows past the call's keys
  // are left as cuDNN leaves them and never read); dQ; Delta; the workspace. Their sizes are
  // engine/scratch.h's, which the memory planner replays.
  int64_t extent = 0;
  for (const BackwardPart& part : parts) extent += part.sh->S;
  const bool accumulate = mode == GradMode::accumulate;
  const cw::CudnnBackwardScratch bytes = cw::cudnn_attention_backward_scratch(
      {B, c, S, H, Hkv, D}, extent, sh.dq_accum(), accumulate, parts.size() > 1, prefix_sh.stacked);
  void* dq_accum = nullptr;
  const size_t dq_accum_bytes = bytes.dq_accum;
  if (sh.dq_accum()) dq_accum = scratch.alloc_bytes(dq_accum_bytes);
  const Tensor dk_s(scratch.alloc_bytes(bytes.dk), DType::bf16, q.device, {B * extent * row});
  const Tensor dv_s(scratch.alloc_bytes(bytes.dv), DType::bf16, q.device, {B * extent * row});
  const Tensor dq_s = accumulate ? Tensor(scratch.alloc_bytes(bytes.dq), DType::bf16, q.device, {B, c, H, D}) : d_q;
  const Tensor dq_prefix =
      parts.size() > 1 ? Tensor(scratch.alloc_bytes(bytes.dq_prefix), DType::bf16, q.device, {B, c, H, D}) : Tensor{};
  // cuDNN writes Delta here; poisoned (NaN) so that an engine reading it instead would show in
  // every gradient.
  const Tensor delta(scratch.alloc_bytes(bytes.delta), DType::f32, q.device, {B, H, c});
  CW_CUDA_CHECK(cudaMemsetAsync(delta.data, 0xff, static_cast<size_t>(B * H * c) * sizeof(float), stream));
  // A stacked prefix reads q, out, d_out head-major (its lse and Delta [B, H, c] already are): copies.
  const bool stacked = prefix_sh.stacked;  // false without a prefix part (prefix_sh is then empty)
  HeadsMajorCopies heads{};
  if (stacked) {
    const Tensor* from[3] = {&q, &out, &d_out};
    for (int i = 0; i < 3; ++i) {
      heads.src[i] = static_cast<const __nv_bfloat16*>(from[i]->data);
      heads.dst[i] = static_cast<__nv_bfloat16*>(scratch.alloc_bytes(bytes.head_major));
    }
    heads_major_kernel<<<dim3(blocks_for(B * H * c * D / 8, kAddThreads), 3), kAddThreads, 0, stream>>>(heads, B, c,
                                                                                                        H, D);
    CW_KERNEL_CHECK();
  }
  const int64_t ws_bytes = split_backward_workspace(sh, *plan);
  void* ws = ws_bytes > 0 ? scratch.alloc_bytes(static_cast<size_t>(ws_bytes)) : nullptr;
  CW_CHECK(B <= 65535, "cuDNN attention: {} batch entries exceed the grid", B);

  float scale_f = static_cast<float>(scale), one = 1.0f;
  int64_t offset = 0;  // elements of dk_s, dv_s taken by the parts before
  for (size_t i = 0; i < parts.size(); ++i) {
    const BackwardPart& part = parts[i];
    const int64_t keys = part.k1 - part.k0;
    const Tensor kp = k.slice(1, part.k0, keys), vp = v.slice(1, part.k0, keys);
    void* dk = static_cast<__nv_bfloat16*>(dk_s.data) + offset;
    void* dv = static_cast<__nv_bfloat16*>(dv_s.data) + offset;
    offset += B * part.sh->S * row;
    const Tensor& dq = i == 0 ? dq_s : dq_prefix;
    // cuDNN 9.6 and newer zero the accumulator themselves; older versions add into what they get.
    if (dq_accum && runtime_version() < 90600) CW_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, dq_accum_bytes, stream));
    MaskOperands m(*part.sh, keys, scratch, stream);
    std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kDelta, kOne};
    const bool heads_major = part.sh->stacked;
    std::vector<void*> ptrs{heads_major ? heads.dst[0] : q.data,
                            kp.data,
                            vp.data,
                            heads_major ? heads.dst[1] : out.data,
                            heads_major ? heads.dst[2] : d_out.data,
                            saved.lse.data,
                            dq.data,
                            dk,
                            dv,
                            &scale_f,
                            delta.data,
                            &one};
    if (dq_accum) {
      uids.push_back(kDQAccum);
      ptrs.push_back(dq_accum);
    }
    m.add_to(uids, ptrs);
    execute(*part.plan, dev, uids, ptrs, ws);
    // d_k += dK, d_v += dV over the part's keys (batch strides honoured).
    launch_add_kv(d_k.slice(1, part.k0, keys), d_v.slice(1, part.k0, keys), dk, dv, B, keys * row,
                  part.sh->S * row, stream);
    CW_KERNEL_CHECK();
  }
  // d_q += dQ in accumulate mode; the prefix's dQ added to the own block's (head-major if stacked).
  const int64_t n = q.numel();
  auto* dq_out = static_cast<__nv_bfloat16*>(d_q.data);
  auto add_q = [&](const Tensor& add) {
    add_q_kernel<<<blocks_for(n, kAddThreads), kAddThreads, 0, stream>>>(
        dq_out, static_cast<const __nv_bfloat16*>(add.data), n);
    CW_KERNEL_CHECK();
  };
  if (accumulate) add_q(dq_s);
  if (plan->own && !stacked) add_q(dq_prefix);
  if (stacked) {
    add_q_heads_kernel<<<blocks_for(n / 8, kAddThreads), kAddThreads, 0, stream>>>(
        dq_out, static_cast<const __nv_bfloat16*>(dq_prefix.data), B, c, H, D);
    CW_KERNEL_CHECK();
  }
}

}  // namespace cw::gpu
