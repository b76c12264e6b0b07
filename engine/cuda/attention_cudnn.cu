// cuDNN fused attention (flash-style SDPA) through the cuDNN graph BACKEND API.
//
// The math is the op's (engine/ops/attention.h): chunk-against-cache causal attention with grouped
// K/V heads. The c queries of a chunk sit at positions [p, p + c) and see keys j <= p + i of the
// S = p + c keys: a causal mask aligned BOTTOM-RIGHT (for c < S it differs from the top-left mask
// that p = 0 gives).
//   forward:  s_ij = scale q_i . k_j (masked), lse_i = log sum_j exp(s_ij), out_i = sum_j P_ij v_j
//   backward: Delta_i = d_out_i . out_i, dS_ij = P_ij (d_out_i . v_j - Delta_i),
//             d_q = scale dS K (overwrite or accumulate), d_k += scale dS^T Q, d_v += P^T d_out.
//
// Why graphs of generic operations. cuDNN serves fused attention from a "specialized runtime
// fusion engine" that it selects when the operation graph has the SDPA shape, built from generic
// backend operations (this is what the cudnn-frontend library builds internally; we do not use or
// copy that library, only the documented backend API). cuDNN 9.19's dedicated
// CUDNN_BACKEND_OPERATION_SDPA_FWD/BWD descriptors (attributes: Q, K, V, O, stats, scale, block
// mask, page tables, sequence lengths) have no causal attribute at all, and the system cuDNN on the
// GPU machine is 9.14, so the generic graph is the portable way to state an exact bottom-right mask:
//   forward:  S = Q K^T (f32) -> S * scale -> causal mask -> softmax as
//             max = reduce_max(S), E = exp(S - max), sum = reduce_add(E),
//             stats = max + log(sum)  [our lse: natural-log log-sum-exp of the scaled, masked scores]
//             P = E / sum -> O = P V
//   backward: Delta = 1 * reduce_add(dO * O) (a real f32 tensor, written by cuDNN); S as above;
//             P = exp(S - stats); dV = P^T dO; dP = dO V^T; dS = (dP - Delta) * P * scale;
//             dK = dS^T Q; dQ = dS reshape(K^T) into a plain f32 accumulator, cast to bf16 dQ;
//             for GQA, dK and dV per query head (bf16, virtual) reduced to the K/V heads.
//   causal mask: row = GEN_INDEX(axis 2), col = GEN_INDEX(axis 3) (int32), row' = row + S - c
//             (two by-value int32 scalars; absent for p = 0, where both alignments agree),
//             keep = (row' >= col), S = BINARY_SELECT(keep ? S : lowest float).
// The exact rules cuDNN's pattern matcher applies to intermediate data types (which virtual tensors
// must be bf16, whether dK/dV may be f32, whether GQA dK/dV come straight from the matmul or through
// an explicit head reduction, whether Delta must live in memory) are not all documented, so each
// graph is described by a few switches (GraphVariant) and the plan builder tries a short ordered
// list of variants, keeping the first that cuDNN finalizes. With CW_CUDNN_VERBOSE=1 in the
// environment each plan built is described on stderr (engine, numerical notes, workspace, variant);
// when every variant fails, the error carries cuDNN's message for each.
//
// Layouts (no copies): q, out, d_q, d_out [B, c, H, D] are cuDNN tensors (B, H, c, D) with strides
// (c H D, D, H D, 1); k, v [B, S, Hkv, D] with batch stride kb are (B, Hkv, S, D) with strides
// (kb, D, Hkv D, 1), K^T for Q K^T is (B, Hkv, D, S) with strides (kb, D, 1, Hkv D); cuDNN takes K/V
// with fewer heads than Q directly (grouped-query attention: query head h reads K/V head
// h / (H / Hkv)). lse [B, H, c] f32 is the stats tensor (B, H, c, 1).
// Backward with GQA: cuDNN's matmuls broadcast the Hkv K/V heads to the H query heads, and a
// matmul's output has the broadcast shape, so dK/dV come out per query head. In the frontend form
// a bf16 virtual per-query-head tensor is reduced to the Hkv heads inside the graph; in the older
// forms (where that reduction with an f32 intermediate gave wrong dK/dV) they come out per query
// head ([B, S, H, D] scratch) and add_kv_grouped_kernel sums each group in a fixed order. A fallback
// variant copies K/V to H heads first.
// Delta = rowsum(dO * O) is a real f32 tensor of the backward graph: written by cuDNN in the
// frontend form, filled by delta_kernel before cuDNN runs in the others (see STATUS).
// Backward outputs: cuDNN overwrites its outputs, while the op ADDS d_k, d_v into the caller's f32
// buffers (which may have any batch stride). So cuDNN writes dK, dV into packed scratch
// (bf16: the one dK/dV type whose values the device run validated, dV within 2.4e-3; f32 outputs are
// accepted by cuDNN's graph check but are only a fallback variant) and add_kv_kernel adds both into
// d_k, d_v in f32 honouring the batch strides. d_q (bf16) is written directly in overwrite mode;
// in accumulate mode cuDNN writes scratch and add_q_kernel adds it (two bf16 roundings).
//
// Plans: building one (heuristics, then NVRTC compilation inside cuDNN) takes from tens of ms to
// seconds, so finalized execution plans are cached per (device, direction, B, H, Hkv, c, S, D, K/V
// batch strides, dtype); p = S - c is part of the shape, so each chunk offset of a chunked
// schedule gets its own plan once. The per-call path looks the plan up, fills a variant pack
// (device pointers; the scale and the mask offsets are by-value scalars read from host memory at
// execute time) and executes. One cudnnHandle per device, bound to gpu::current_stream(device).
// Workspace comes from the `scratch` arena (inside an ArenaScope; safe to hand back before the
// kernels finish because all later users of the arena launch on the same stream).
// Backward forms and determinism. Two forms of dQ = dS K: into an f32 accumulator (then cast to
// bf16 dQ), or straight into dQ. The accumulator form is the fast one (8K tokens, 32 heads, D 64:
// 1.82 ms against 2.64) but adds dQ with atomics without carrying cuDNN's non-determinism note, so
// with cw::deterministic() only the direct form is built (and configurations carrying the note are
// skipped). Workspace: built as above (GraphVariant::frontend_form, the arrangement the cuDNN
// frontend library uses), the accumulator form needs only the GQA head reduction's per-query-head
// f32 staging (B H S D 4 bytes); every other arrangement we tried (Delta straight out of the
// reduction, a second K tensor for dQ, cuDNN's reordered accumulator layout) made cuDNN 9.14 pick a
// configuration staging the f32 scores of all c x S pairs (B H c S 4 bytes: 32 GiB at 16K tokens
// and 32 heads), with no knob to avoid it. The direct form stages dS (bf16, B H c S 2 bytes). Among
// the configurations the heuristics offer, the first needing at most kWorkspaceLimit is taken, else
// the one needing least (timed on the H100: the heuristics' first is also the fastest, the others
// 2-2.5x slower). The chooser (engine/ops/attention.cpp) decides whether `automatic` may spend it.
// The add kernels are elementwise (no atomics).
// STATUS (H100, 2026-11-21, cuDNN 9.14): forward and backward pass the GPU tests against the f64 CPU
// op (tests/engine/test_cuda_attention_cudnn.cpp: MHA and GQA 4, head dims 64 and 128, c < S with
// sizes not multiples of the tiles, a padded K/V batch stride; d_q overwrite and accumulate, d_k/d_v
// added; both backward forms), and the deterministic backward is bitwise repeatable. What made it
// right: in the older graph forms the engines READ the graph's Delta tensor rather than computing
// it (a zero Delta gave dQ/dK ~15% off), so delta_kernel fills it first; in the frontend form cuDNN
// writes Delta itself (we poison it with NaN before the call, so a read-only engine would show) and
// zeroes its own accumulator (cuDNN >= 9.6; the tests' second backward on the same scratch would
// catch a stale one). GQA dK/dV through the in-graph head reduction in the frontend form; per query
// head, summed by us, in the others.
// Speed at 8K tokens (ops_vs_torch.py, same call): forward 0.57 ms (D 64) / 0.68 ms (D 128), at or
// above torch's cuDNN backend (cuDNN 9.19 inside torch); backward 1.80 / 2.14 ms against torch's
// 1.80 / 2.12 (cuDNN's engine alone 1.75 / 2.06; the rest is the dK/dV add and per-call setup).
// Version: bottom-right causal attention through the fused engine needs cuDNN >= 9.3 (the
// frontend's support check for bottom-right causal masks; earlier 9.x versions only fuse top-left
// masks); we require a 9.x runtime at least that new (cudnnGetVersion() at run time).
#include "chunkwise_config.h"
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"

#include <cudnn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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

}  // namespace

}  // namespace cw::gpu

// Every cuDNN call: the status name and cuDNN's own last error message become the cw::Error.
#define CW_CUDNN_CHECK(expr)                                                                  \
  do {                                                                                        \
    const cudnnStatus_t cw_dnn_st_ = (expr);                                                  \
    if (cw_dnn_st_ != CUDNN_STATUS_SUCCESS) ::cw::gpu::raise_cudnn(cw_dnn_st_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace cw::gpu {

namespace {

constexpr int64_t kMinCudnnVersion = 90300;  // bottom-right causal masks in the fused engine
constexpr int64_t kMaxHeadDim = 128;
constexpr int64_t kAlignment = 16;  // bytes; every real tensor's base and non-unit strides
// Plans needing more workspace than this are taken only when no configuration needs less.
constexpr int64_t kWorkspaceLimit = int64_t{256} << 20;

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
  // A real tensor whose memory layout belongs to cuDNN (reordering F16x16: the engine's own tile
  // order); only cuDNN reads or writes it, so only its size matters to us.
  cudnnBackendDescriptor_t reordered_tensor(int64_t uid, cudnnDataType_t dt, const Dims& dims, const Dims& strides) {
    return make_tensor(uid, dt, dims, strides, false, false, CUDNN_TENSOR_REORDERING_F16x16);
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
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set_attr(mm.d, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    CW_CUDNN_CHECK(cudnnBackendFinalize(mm.d));
    Desc& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    set_desc(op.d, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.d);
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
                                       bool is_virtual, bool by_value,
                                       cudnnBackendTensorReordering_t reorder = CUDNN_TENSOR_REORDERING_NONE) {
    Desc& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    set_attr(t.d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set_attr(t.d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    set_attr(t.d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    set_attr(t.d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    const int64_t align = kAlignment;
    set_attr(t.d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set_attr(t.d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) set_attr(t.d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    if (reorder != CUDNN_TENSOR_REORDERING_NONE)
      set_attr(t.d, CUDNN_ATTR_TENSOR_REORDERING_MODE, CUDNN_TYPE_TENSOR_REORDERING_MODE, 1, &reorder);
    CW_CUDNN_CHECK(cudnnBackendFinalize(t.d));
    return t.d;
  }

  cudnnHandle_t handle_;
  std::vector<std::unique_ptr<Desc>> descs_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = 1000;
};

// ---------------------------------------------------------------------------------------------
// Problem shapes, graph variants and the plans.

// Tensor UIDs of the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kSkv, kSq, kDO, kDQ, kDK, kDV, kKForDQ, kDelta, kDQAccum, kOne
};

struct Shape {
  int device;
  bool backward;
  int64_t B, H, Hkv, c, S, D, k_batch_stride, v_batch_stride;
  bool deterministic = false;  // backward: only engine configurations without the non-determinism note
  auto key() const {
    return std::tie(device, backward, B, H, Hkv, c, S, D, k_batch_stride, v_batch_stride, deterministic);
  }
  bool operator<(const Shape& o) const { return key() < o.key(); }
  int64_t p() const { return S - c; }
};

// The switches of a graph (see the top of the file: the undocumented parts of the pattern).
struct GraphVariant {
  bool mask_one_add = false;  // row + p in one by-value add instead of row + S - c
  bool p_f32 = false;         // the probabilities feeding the P V / P^T dO matmul stay f32 (else bf16)
  bool dkv_f32 = true;        // backward: dK/dV scratch in f32 (else bf16)
  bool delta_in_memory = false;  // backward: Delta = rowsum(dO * O) a real f32 tensor (else virtual)
  bool ds_f32 = false;        // backward: dS stays f32 into its matmuls (else bf16)
  bool gqa_reduce = false;    // backward, GQA: per-query-head dK/dV, then an explicit head reduction
  bool dq_accum = false;      // backward: dQ = dS K into an f32 accumulator (cuDNN's layout), then a cast
  bool gqa_expand = false;    // backward, GQA: K/V copied to H heads first (else the matmuls broadcast
                              // the Hkv heads); dK/dV come out per query head either way
  // backward: the arrangement the cuDNN frontend library builds for the same math: Delta written
  // by a unit-scale pointwise op after the row reduction (cuDNN then computes it in its own
  // pre-pass), dQ = dS K reading K as a reshape of the K^T operand of Q K^T (one K tensor in the
  // graph), the f32 dQ accumulator in plain [B, H, c, D] layout, per-query-head dK/dV for a head
  // reduction in bf16. Measured on the H100 (cuDNN 9.14): the only arrangement whose fast
  // (accumulator) engine needs no c x S workspace (256 bytes instead of B H c S 4: 32 GiB at 16K
  // tokens and 32 heads); each switch alone either keeps the big workspace or is refused for some
  // shapes.
  bool frontend_form = false;
  std::string str() const {
    std::string s;
    s += dq_accum ? "dQ=f32 accumulator," : "dQ=direct,";
    s += mask_one_add ? "mask=row+p" : "mask=row+S-c";
    s += p_f32 ? ",P=f32" : ",P=bf16";
    s += dkv_f32 ? ",dKV=f32" : ",dKV=bf16";
    s += delta_in_memory ? ",Delta=memory" : ",Delta=virtual";
    s += ds_f32 ? ",dS=f32" : ",dS=bf16";
    s += gqa_reduce ? ",gqa=reduce" : gqa_expand ? ",gqa=expanded K/V" : ",gqa=broadcast K/V";
    if (frontend_form) s += ",frontend form";
    return s;
  }
};

// One finalized way to run a graph: its configuration and execution plan.
struct Alternative {
  std::unique_ptr<Desc> engine_cfg, plan;
  std::vector<std::unique_ptr<Desc>> cfg_parts;  // engine/knob descriptors `engine_cfg` refers to
  int64_t workspace = 0;
  std::string what;  // engine index and knobs
};

struct Plan {
  std::vector<std::unique_ptr<Desc>> descs;  // the graph's descriptors (kept alive with the plan)
  std::unique_ptr<Desc> engine_cfg, plan;
  std::vector<std::unique_ptr<Desc>> cfg_parts;  // engine/knob descriptors of a built configuration
  int64_t workspace = 0;
  // With CW_CUDNN_AUTOTUNE=1: the other configurations within kWorkspaceLimit, timed against the
  // chosen one on the first call (then cleared).
  std::vector<Alternative> alternatives;
  std::string what;  // engine index and knobs of the chosen configuration
  bool nondeterministic = false;  // the engine carries cuDNN's non-determinism note (atomic dQ sums)
  GraphVariant variant;
  std::string info;  // engine index, notes, variant
};

struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::map<Shape, std::unique_ptr<Plan>> plans;
  std::map<Shape, std::string> rejected;  // shapes no variant could serve, with cuDNN's reasons
  // The variant that last served each (direction, determinism, head dim), tried first for a new
  // shape: a chunked schedule builds one plan per chunk offset and should not re-try the variants
  // cuDNN rejected for the previous one.
  std::map<std::tuple<bool, bool, int64_t>, size_t> preferred;
};

std::mutex g_mutex;  // guards g_devices (plans are immutable once built)
std::map<int, DeviceState> g_devices;

DeviceState& device_state(int device) {
  DeviceState& st = g_devices[device];
  if (!st.handle) {
    cudaStream_t stream = current_stream(device);  // also makes `device` current
    CW_CUDNN_CHECK(cudnnCreate(&st.handle));
    CW_CUDNN_CHECK(cudnnSetStream(st.handle, stream));
  }
  return st;
}

// Applies the causal mask to the scaled scores `s`; returns the masked scores.
cudnnBackendDescriptor_t build_mask(GraphBuilder& g, const Shape& sh, const GraphVariant& v,
                                    cudnnBackendDescriptor_t s) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S};
  cudnnBackendDescriptor_t row = g.virt(CUDNN_DATA_INT32, sdims);
  cudnnBackendDescriptor_t col = g.virt(CUDNN_DATA_INT32, sdims);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, row, nullptr, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, col, nullptr, 3);
  if (sh.p() > 0) {  // bottom-right: query row i is at position p + i
    if (v.mask_one_add) {
      cudnnBackendDescriptor_t shifted = g.virt(CUDNN_DATA_INT32, sdims);
      g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, row, g.scalar(kSkv, CUDNN_DATA_INT32), shifted);
      row = shifted;
    } else {
      cudnnBackendDescriptor_t plus = g.virt(CUDNN_DATA_INT32, sdims);
      cudnnBackendDescriptor_t shifted = g.virt(CUDNN_DATA_INT32, sdims);
      g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, row, g.scalar(kSkv, CUDNN_DATA_INT32), plus);
      g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, plus, g.scalar(kSq, CUDNN_DATA_INT32), shifted);
      row = shifted;
    }
  }
  cudnnBackendDescriptor_t keep = g.virt(CUDNN_DATA_BOOLEAN, sdims);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_INT32, row, col, keep);
  cudnnBackendDescriptor_t masked = g.virt(CUDNN_DATA_FLOAT, sdims);
  // BINARY_SELECT: y = t ? x : b.
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, g.scalar(kNegInf, CUDNN_DATA_FLOAT), masked, keep);
  return masked;
}

Dims q_strides(const Shape& sh) { return {sh.c * sh.H * sh.D, sh.D, sh.H * sh.D, 1}; }

// The K/V operands as the graph sees them: the caller's [B, S, Hkv, D] (batch strides as given), or
// for an expanding GQA backward the packed [B, S, H, D] copies in scratch.
struct KvView {
  int64_t heads, k_batch_stride, v_batch_stride;
};
KvView kv_view(const Shape& sh, const GraphVariant& v) {
  if (v.gqa_expand && sh.H != sh.Hkv) return {sh.H, sh.S * sh.H * sh.D, sh.S * sh.H * sh.D};
  return {sh.Hkv, sh.k_batch_stride, sh.v_batch_stride};
}
Dims kv_dims(const Shape& sh, const KvView& kv) { return {sh.B, kv.heads, sh.S, sh.D}; }
Dims kv_t_dims(const Shape& sh, const KvView& kv) { return {sh.B, kv.heads, sh.D, sh.S}; }
Dims kv_strides(const KvView& kv, int64_t batch_stride, int64_t D) { return {batch_stride, D, kv.heads * D, 1}; }
Dims kv_t_strides(const KvView& kv, int64_t batch_stride, int64_t D) { return {batch_stride, D, 1, kv.heads * D}; }

// S = scale * Q K^T, causally masked (shared by both directions).
// *kt_out (if given) receives the K^T operand.
cudnnBackendDescriptor_t build_scores(GraphBuilder& g, const Shape& sh, const GraphVariant& v,
                                      cudnnBackendDescriptor_t q, cudnnBackendDescriptor_t* kt_out = nullptr) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S};
  const KvView kv = kv_view(sh, v);
  cudnnBackendDescriptor_t kt =
      g.tensor(kK, CUDNN_DATA_BFLOAT16, kv_t_dims(sh, kv), kv_t_strides(kv, kv.k_batch_stride, sh.D));
  cudnnBackendDescriptor_t s = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.matmul(q, kt, s);
  if (kt_out) *kt_out = kt;
  cudnnBackendDescriptor_t scaled = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, g.scalar(kScale, CUDNN_DATA_FLOAT), scaled);
  return build_mask(g, sh, v, scaled);
}

cudnnBackendDescriptor_t build_forward(GraphBuilder& g, const Shape& sh, const GraphVariant& v) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S}, rdims{sh.B, sh.H, sh.c, 1};
  cudnnBackendDescriptor_t q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, {sh.B, sh.H, sh.c, sh.D}, q_strides(sh));
  cudnnBackendDescriptor_t s = build_scores(g, sh, v, q);
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
  cudnnBackendDescriptor_t p = g.virt(v.p_f32 ? CUDNN_DATA_FLOAT : CUDNN_DATA_BFLOAT16, sdims);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, sum, p);
  const KvView kv = kv_view(sh, v);
  cudnnBackendDescriptor_t vt =
      g.tensor(kV, CUDNN_DATA_BFLOAT16, kv_dims(sh, kv), kv_strides(kv, kv.v_batch_stride, sh.D));
  cudnnBackendDescriptor_t o = g.tensor(kO, CUDNN_DATA_BFLOAT16, {sh.B, sh.H, sh.c, sh.D}, q_strides(sh));
  g.matmul(p, vt, o);
  return g.finish();
}

// dX = A^T-shaped matmul producing a K/V-shaped gradient into packed scratch: per query head (H
// heads; for GQA the caller sums each group), or, with gqa_reduce, per query head followed by a
// reduction to the Hkv heads inside the graph.
void kv_grad(GraphBuilder& g, const Shape& sh, const GraphVariant& v, cudnnBackendDescriptor_t a,
             cudnnBackendDescriptor_t b, int64_t uid) {
  const cudnnDataType_t dt = v.dkv_f32 ? CUDNN_DATA_FLOAT : CUDNN_DATA_BFLOAT16;
  const int64_t heads = v.gqa_reduce ? sh.Hkv : sh.H;  // scratch [B, S, heads, D] packed
  cudnnBackendDescriptor_t out =
      g.tensor(uid, dt, {sh.B, heads, sh.S, sh.D}, {sh.S * heads * sh.D, sh.D, heads * sh.D, 1});
  if (v.gqa_reduce && sh.H != sh.Hkv) {
    cudnnBackendDescriptor_t full = g.virt(v.frontend_form ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT, {sh.B, sh.H, sh.S, sh.D});
    g.matmul(a, b, full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
  } else {
    g.matmul(a, b, out);
  }
}

cudnnBackendDescriptor_t build_backward(GraphBuilder& g, const Shape& sh, const GraphVariant& v) {
  const Dims sdims{sh.B, sh.H, sh.c, sh.S}, rdims{sh.B, sh.H, sh.c, 1}, qdims{sh.B, sh.H, sh.c, sh.D};
  const Dims tdims{sh.B, sh.H, sh.S, sh.c}, tstrides{sh.H * sh.c * sh.S, sh.c * sh.S, 1, sh.S};
  const cudnnDataType_t bf = CUDNN_DATA_BFLOAT16;
  cudnnBackendDescriptor_t q = g.tensor(kQ, bf, qdims, q_strides(sh));
  cudnnBackendDescriptor_t o = g.tensor(kO, bf, qdims, q_strides(sh));
  cudnnBackendDescriptor_t d_o = g.tensor(kDO, bf, qdims, q_strides(sh));
  cudnnBackendDescriptor_t stats = g.tensor(kStats, CUDNN_DATA_FLOAT, rdims, {sh.H * sh.c, sh.c, 1, 1});

  // Delta = rowsum(dO * O)
  cudnnBackendDescriptor_t d_o_o = g.virt(CUDNN_DATA_FLOAT, qdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, d_o_o);
  cudnnBackendDescriptor_t delta = nullptr;
  if (v.frontend_form) {
    cudnnBackendDescriptor_t sum = g.virt(CUDNN_DATA_FLOAT, rdims);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, sum);
    delta = g.tensor(kDelta, CUDNN_DATA_FLOAT, rdims, {sh.H * sh.c, sh.c, 1, 1});
    g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, sum, g.scalar(kOne, CUDNN_DATA_FLOAT), delta);
  } else {
    delta = v.delta_in_memory ? g.tensor(kDelta, CUDNN_DATA_FLOAT, rdims, {sh.H * sh.c, sh.c, 1, 1})
                              : g.virt(CUDNN_DATA_FLOAT, rdims);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, delta);
  }

  // P = exp(S - lse)
  cudnnBackendDescriptor_t kt = nullptr;
  cudnnBackendDescriptor_t s = build_scores(g, sh, v, q, &kt);
  cudnnBackendDescriptor_t centred = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s, stats, centred);
  cudnnBackendDescriptor_t p = g.virt(v.p_f32 ? CUDNN_DATA_FLOAT : bf, sdims);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, nullptr, p);

  // dV = P^T dO
  cudnnBackendDescriptor_t p_t = g.virt(bf, tdims, tstrides);
  g.reshape(p, p_t);
  kv_grad(g, sh, v, p_t, d_o, kDV);

  // dS = P * (dO V^T - Delta) * scale
  const KvView kv = kv_view(sh, v);
  cudnnBackendDescriptor_t v_t = g.tensor(kV, bf, kv_t_dims(sh, kv), kv_t_strides(kv, kv.v_batch_stride, sh.D));
  cudnnBackendDescriptor_t dp = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.matmul(d_o, v_t, dp);
  cudnnBackendDescriptor_t dp_centred = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, delta, dp_centred);
  cudnnBackendDescriptor_t ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centred, p, ds_unscaled);
  cudnnBackendDescriptor_t ds = g.virt(v.ds_f32 ? CUDNN_DATA_FLOAT : bf, sdims);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, g.scalar(kScale, CUDNN_DATA_FLOAT), ds);

  // dK = dS^T Q
  cudnnBackendDescriptor_t ds_t = g.virt(bf, tdims, tstrides);
  g.reshape(ds, ds_t);
  kv_grad(g, sh, v, ds_t, q, kDK);

  // dQ = dS K
  cudnnBackendDescriptor_t k = nullptr;
  if (v.frontend_form) {
    k = g.virt(bf, kv_dims(sh, kv), kv_strides(kv, kv.k_batch_stride, sh.D));
    g.reshape(kt, k);
  } else {
    k = g.tensor(kKForDQ, bf, kv_dims(sh, kv), kv_strides(kv, kv.k_batch_stride, sh.D));
  }
  cudnnBackendDescriptor_t dq = g.tensor(kDQ, bf, qdims, q_strides(sh));
  if (v.dq_accum) {
    // Each key block's dS K is added into an f32 accumulator in cuDNN's own tile order (zeroed by
    // us before the call), then cast to dQ. Measured on the H100 (cuDNN 9.14, 8K tokens, 32 heads,
    // D 64): 1.96 ms against 2.64 ms for the direct form, but not deterministic, and like the
    // direct form every engine cuDNN offers stages the scores of all c x S pairs in f32 in its
    // workspace (B H c S 4 bytes: 8 GiB there; no engine offers a workspace knob).
    cudnnBackendDescriptor_t acc =
        v.frontend_form ? g.tensor(kDQAccum, CUDNN_DATA_FLOAT, qdims, packed_strides(qdims))
                         : g.reordered_tensor(kDQAccum, CUDNN_DATA_FLOAT, qdims, q_strides(sh));
    g.matmul(ds, k, acc);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, acc, nullptr, dq);
  } else {
    g.matmul(ds, k, dq);
  }
  return g.finish();
}

std::vector<GraphVariant> variants_for(const Shape& sh) {
  std::vector<GraphVariant> out;
  if (!sh.backward) {
    for (bool one_add : {false, true}) {
      if (one_add && sh.p() == 0) continue;  // no offset at all for p = 0
      for (bool p_f32 : {false, true}) {
        GraphVariant v;
        v.mask_one_add = one_add;
        v.p_f32 = p_f32;
        out.push_back(v);
      }
    }
    return out;
  }
  // Backward: Delta must be a real tensor (with a virtual Delta the engines accept the graph and
  // then fault at run time, on 9.14 and 9.19 alike); bf16 dK/dV first (the only dK/dV type the
  // device run validated); the f32 dQ accumulator form first (faster); for GQA, K/V heads
  // broadcast by the matmuls before K/V expanded to H heads in scratch (see
  // cudnn_attention_backward); dK/dV per query head either way.
  const bool gqa = sh.H != sh.Hkv;
  // First the frontend library's arrangement (see GraphVariant::frontend_form): for GQA with the
  // head reduction inside the graph, then with per-query-head dK/dV summed by us.
  for (bool reduce : {true, false}) {
    if (reduce && !gqa) continue;
    GraphVariant v;
    v.frontend_form = true;
    v.dq_accum = !sh.deterministic;
    v.gqa_reduce = reduce;
    v.dkv_f32 = false;
    v.delta_in_memory = true;
    v.p_f32 = true;
    v.ds_f32 = v.dq_accum;
    out.push_back(v);
  }
  // Then the arrangements earlier cuDNN versions served (each needs the c x S workspace on 9.14).
  for (bool dq_accum : {true, false}) {
    // The accumulator form's engine adds dQ with atomics but does not carry cuDNN's
    // non-determinism note (measured: repeated runs differ), so a deterministic backward never
    // builds it.
    if (dq_accum && sh.deterministic) continue;
    for (bool expand : {false, true}) {  // GQA: broadcast K/V heads first (no copies), then expanded
      if (expand && !gqa) continue;
      for (bool dkv_f32 : {false, true})
        for (bool p_f32 : {true, false})
          for (bool ds_f32 : {dq_accum, !dq_accum}) {  // the accumulator form as in its engine: dS f32
            GraphVariant v;
            v.dq_accum = dq_accum;
            v.gqa_expand = expand;
            v.dkv_f32 = dkv_f32;
            v.delta_in_memory = true;
            v.p_f32 = p_f32;
            v.ds_f32 = ds_f32;
            out.push_back(v);
          }
    }
  }
  return out;
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
bool autotune();
constexpr size_t kMaxAlternatives = 32;  // configurations timed per plan with CW_CUDNN_AUTOTUNE

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
// siblings with the other values of the engine's WORKSPACE knob where it has one: cuDNN's fused
// attention backward engine stages the score gradients in a c x S workspace by default (8 GiB at
// 8K tokens and 32 heads) and also runs without it, the choice being that knob.
// With `autotune`, the siblings cover every knob of the engine (a few values each), for timing.
std::vector<std::unique_ptr<Candidate>> candidates(cudnnBackendDescriptor_t graph, bool autotune, std::string* errors) {
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
            (type != CUDNN_KNOB_TYPE_WORKSPACE && !autotune))
          continue;
        cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, CUDNN_TYPE_INT64, 1, &n, &lo);
        cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, CUDNN_TYPE_INT64, 1, &n, &hi);
        cudnnBackendGetAttribute(info->d, CUDNN_ATTR_KNOB_INFO_STRIDE, CUDNN_TYPE_INT64, 1, &n, &stride);
        stride = std::max<int64_t>(stride, 1);
        const int max_tries = type == CUDNN_KNOB_TYPE_WORKSPACE ? 4 : 8;
        for (int64_t value = lo, tries = 0; value <= hi && tries < max_tries; value += stride, ++tries) {
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

// Builds the graph of one variant and finds an execution plan for it; nullptr (with the reason in
// *why) where cuDNN does not serve the variant. Candidates are finalized in order; the first that
// honours the determinism policy and needs at most kWorkspaceLimit bytes of workspace wins; if
// none fits the limit, the one with the smallest workspace (still correct, just memory-hungry).
std::unique_ptr<Plan> try_variant(cudnnHandle_t handle, const Shape& sh, const GraphVariant& v, std::string* why) {
  auto plan = std::make_unique<Plan>();
  plan->variant = v;
  GraphBuilder g(handle);
  cudnnBackendDescriptor_t graph = nullptr;
  try {
    graph = sh.backward ? build_backward(g, sh, v) : build_forward(g, sh, v);
  } catch (const Error& e) {
    *why = std::string("graph: ") + e.what();
    return nullptr;
  }
  plan->descs = g.take();

  std::string errors, tried;
  const bool tune = autotune();
  std::unique_ptr<Candidate> best;
  std::unique_ptr<Desc> best_plan;
  int64_t best_ws = 0;
  bool best_nondet = false;
  std::string best_notes;
  for (auto& c : candidates(graph, tune, &errors)) {
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
    if (tune && best && best_ws <= kWorkspaceLimit && ws <= kWorkspaceLimit) {
      if (plan->alternatives.size() < kMaxAlternatives) {
        Alternative alt;
        alt.engine_cfg = std::move(c->cfg);
        alt.cfg_parts = std::move(c->parts);
        alt.plan = std::move(ep);
        alt.workspace = ws;
        alt.what = CW_FORMAT("engine {} knobs {}", c->engine, knobs_str(c->knobs));
        plan->alternatives.push_back(std::move(alt));
      }
      continue;
    }
    if (!best || ws < best_ws) {
      best = std::move(c);
      best_plan = std::move(ep);
      best_ws = ws;
      best_nondet = nondet;
      best_notes = notes;
    }
    if (best_ws <= kWorkspaceLimit && !tune) break;
  }
  if (!best) {
    *why = errors.empty() ? "no engine" : errors;
    return nullptr;
  }
  plan->workspace = best_ws;
  plan->nondeterministic = best_nondet;
  plan->plan = std::move(best_plan);
  plan->engine_cfg = std::move(best->cfg);
  plan->cfg_parts = std::move(best->parts);
  plan->what = CW_FORMAT("engine {} knobs {}", best->engine, knobs_str(best->knobs));
  plan->info = CW_FORMAT("engine {} knobs {} ({}; notes {}); workspace {} bytes; {}{}", best->engine,
                         knobs_str(best->knobs), best->source, best_notes, best_ws, v.str(),
                         verbose() ? "\n  candidates:" + tried : "");
  return plan;
}

bool verbose() {
  static const bool v = env_switch("CW_CUDNN_VERBOSE", "CW_CUDNN_VERBOSE=1 describes each cuDNN attention plan on stderr");
  return v;
}
std::atomic<bool>& autotune_switch() {
  static std::atomic<bool> on{env_switch(
      "CW_CUDNN_AUTOTUNE", "CW_CUDNN_AUTOTUNE=1 times every cuDNN attention configuration on a plan's first call")};
  return on;
}
bool autotune() { return autotune_switch().load(); }

// The cached plan for `sh`, built on first use; nullptr (with cuDNN's reasons) if no variant works.
const Plan* get_plan(const Shape& sh, std::string* why) {
  std::lock_guard lock(g_mutex);
  DeviceState& st = device_state(sh.device);
  if (auto it = st.plans.find(sh); it != st.plans.end()) return it->second.get();
  if (auto it = st.rejected.find(sh); it != st.rejected.end()) {
    if (why) *why = it->second;
    return nullptr;
  }
  current_stream(sh.device);  // make the device current for the build
  std::string reasons;
  std::vector<GraphVariant> variants = variants_for(sh);
  // Diagnostic: CW_CUDNN_ATTENTION_VARIANT=i tries only variant i of the list.
  if (const char* e = std::getenv("CW_CUDNN_ATTENTION_VARIANT"); e != nullptr && *e != '\0') {
    const size_t i = static_cast<size_t>(std::atoi(e));
    if (i < variants.size()) variants = {variants[i]};
  }
  std::vector<size_t> order(variants.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto family = std::make_tuple(sh.backward, sh.deterministic, sh.D);
  if (auto it = st.preferred.find(family); it != st.preferred.end() && it->second < order.size())
    std::rotate(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(it->second),
                order.begin() + static_cast<std::ptrdiff_t>(it->second) + 1);
  for (const size_t vi : order) {
    const GraphVariant& v = variants[vi];
    std::string r;
    if (auto plan = try_variant(st.handle, sh, v, &r)) {
      st.preferred[family] = vi;
      const Plan* p = plan.get();
      std::string tail;
      if (!reasons.empty()) {
        tail = "\n  after rejected variants:\n";
        tail += reasons;
      }
      if (verbose())
        std::fprintf(stderr, "cuDNN attention %s plan B=%lld H=%lld Hkv=%lld c=%lld S=%lld D=%lld: %s%s\n",
                     sh.backward ? "backward" : "forward", static_cast<long long>(sh.B), static_cast<long long>(sh.H),
                     static_cast<long long>(sh.Hkv), static_cast<long long>(sh.c), static_cast<long long>(sh.S),
                     static_cast<long long>(sh.D), p->info.c_str(), tail.c_str());
      st.plans.emplace(sh, std::move(plan));
      return p;
    }
    reasons += "[" + v.str() + "]" + r + "\n";
  }
  st.rejected.emplace(sh, reasons);
  if (why) *why = reasons;
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Checks.

int64_t runtime_version() { return static_cast<int64_t>(cudnnGetVersion()); }

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlignment == 0; }

// Static conditions of the fused path (cheap; no plan is built). Empty string: served.
std::string static_reason(const Tensor& q, const Tensor& k) {
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
  if (c <= 0 || S < c) return "needs 1 <= c <= S";
  if (!q.contiguous()) return "q is not contiguous";
  if (k.stride[1] != Hkv * D || k.stride[2] != D || k.stride[3] != 1) return "k's [S, Hkv, D] is not packed";
  if (k.stride[0] % 8 != 0 || !aligned(k.data) || !aligned(q.data))
    return "operands not 16-byte aligned (K/V batch stride must be a multiple of 8 elements)";
  int major = 0;
  CW_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device.index));
  if (major < 8) return CW_FORMAT("compute capability {}.x (cuDNN fused attention needs 8.0+)", major);
  return "";
}

Shape shape_of(const Tensor& q, const Tensor& k, const Tensor& v, bool backward) {
  return Shape{q.device.index, backward,   q.size(0), q.size(2),   k.size(2), q.size(1),
               k.size(1),      q.size(3),  k.stride[0], v.stride[0], backward && cw::deterministic()};
}

void check_gpu_operand(const Tensor& t, const Tensor& q, const char* what) {
  check_device_operand(t, q, what, "attention q", /*contiguous=*/false);
  CW_CHECK(aligned(t.data), "cuDNN attention: {} is not 16-byte aligned", what);
}

// The operand checks of the op (engine/ops/attention.cpp), for device tensors.
void check_common(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const AttentionSaved& saved) {
  std::string why = static_reason(q, k);
  CW_CHECK(why.empty(), "cuDNN attention cannot take q {} k {}: {}", q.describe(), k.describe(), why);
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  check_same_shape(v, k, "attention v", "attention k");
  check_same_shape(out, q, "attention out", "attention q");
  check_shape(saved.lse, {B, H, c}, "attention saved lse");
  check_dtype(saved.lse, DType::f32, "attention saved lse");
  check_dtype(v, DType::bf16, "attention v");
  check_dtype(out, DType::bf16, "attention out");
  check_contiguous(out, "attention out");
  check_contiguous(saved.lse, "attention saved lse");
  CW_CHECK(v.stride[1] == Hkv * D && v.stride[2] == D && v.stride[3] == 1 && v.stride[0] % 8 == 0,
           "attention v {}: [S, Hkv, D] must be packed and the batch stride a multiple of 8", v.describe());
  (void)S;
  for (const Tensor* t : {&k, &v, &out, &saved.lse}) check_gpu_operand(*t, q, "attention operand");
}

// Mean ms of three runs of execution plan `ep` after one untimed run; `reset` (if any) before each.
float time_plan(cudnnHandle_t handle, cudnnBackendDescriptor_t ep, cudnnBackendDescriptor_t pack, cudaStream_t stream,
                const std::function<void()>& reset) {
  auto run = [&] {
    if (reset) reset();
    CW_CUDNN_CHECK(cudnnBackendExecute(handle, ep, pack));
  };
  cudaEvent_t start, stop;
  CW_CUDA_CHECK(cudaEventCreate(&start));
  CW_CUDA_CHECK(cudaEventCreate(&stop));
  run();
  CW_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < 3; ++r) run();
  CW_CUDA_CHECK(cudaEventRecord(stop, stream));
  CW_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CW_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 3;
}

// Times the plan's configuration and its alternatives on the operands of `pack` (every output of
// the graph is overwritten, so the runs may repeat; `reset` restores what a run consumes), keeps
// the fastest in `plan` and drops the rest. Called with g_mutex held.
void autotune_plan(Plan& plan, cudnnHandle_t handle, cudnnBackendDescriptor_t pack, cudaStream_t stream,
                   const std::function<void()>& reset) {
  float best_ms = time_plan(handle, plan.plan->d, pack, stream, reset);
  std::string table = CW_FORMAT("  {} (heuristics' choice): {} ms", plan.what, best_ms);
  size_t best = plan.alternatives.size();
  for (size_t i = 0; i < plan.alternatives.size(); ++i) {
    const float ms = time_plan(handle, plan.alternatives[i].plan->d, pack, stream, reset);
    table += CW_FORMAT("\n  {}: {} ms", plan.alternatives[i].what, ms);
    if (ms < best_ms) best_ms = ms, best = i;
  }
  if (best < plan.alternatives.size()) {
    Alternative& alt = plan.alternatives[best];
    std::swap(plan.engine_cfg, alt.engine_cfg);
    std::swap(plan.plan, alt.plan);
    std::swap(plan.cfg_parts, alt.cfg_parts);
    std::swap(plan.workspace, alt.workspace);
    std::swap(plan.what, alt.what);
    plan.info = plan.what + " (autotuned); " + plan.info;
  }
  if (verbose())
    std::fprintf(stderr, "cuDNN attention autotune (%zu configurations): kept %s, %.4f ms\n%s\n",
                 plan.alternatives.size() + 1, plan.what.c_str(), static_cast<double>(best_ms), table.c_str());
  plan.alternatives.clear();
}

// Runs `plan` on the operands of the variant pack. With CW_CUDNN_AUTOTUNE=1 the first call of a
// plan first tunes it on these operands (autotune_plan; `reset` restores what a run consumes, here
// the dQ accumulator where we zero it).
void execute(const Plan& cplan, int device, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs,
             Arena& scratch, const std::function<void()>& reset = {}) {
  ArenaScope scope(scratch);
  cudnnHandle_t handle;
  {
    std::lock_guard lock(g_mutex);
    handle = device_state(device).handle;
  }
  // Plans are immutable once tuned; the tuning itself (first call only) changes one under g_mutex.
  Plan& plan = const_cast<Plan&>(cplan);
  std::unique_lock tune_lock(g_mutex, std::defer_lock);
  if (!plan.alternatives.empty()) tune_lock.lock();
  const bool tuning = tune_lock.owns_lock() && !plan.alternatives.empty();  // another call may have tuned it
  int64_t ws_bytes = plan.workspace;
  if (tuning)
    for (const Alternative& alt : plan.alternatives) ws_bytes = std::max(ws_bytes, alt.workspace);
  void* ws = nullptr;
  if (ws_bytes > 0) {
    CW_CHECK(scratch.device() == Device::gpu(device), "cuDNN attention: the scratch arena is on {}, not cuda:{}",
             device_name(scratch.device()), device);
    ws = scratch.alloc_bytes(static_cast<size_t>(ws_bytes));
  }
  cudaStream_t stream = current_stream(device);  // also makes the device current
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()),
           ptrs.data());
  set_attr(pack.d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  CW_CUDNN_CHECK(cudnnBackendFinalize(pack.d));
  if (tuning) {
    autotune_plan(plan, handle, pack.d, stream, reset);
    if (reset) reset();
  }
  CW_CUDNN_CHECK(cudnnBackendExecute(handle, plan.plan->d, pack.d));
}

// ---------------------------------------------------------------------------------------------
// Adding the scratch gradients into the caller's buffers.

constexpr int kAddThreads = 256;

// dst[b, r] += src[b, r] for r < row (row = S Hkv D elements per batch entry; dst batch stride
// dst_bs, src packed). blockIdx.y = b, blockIdx.z picks the (K, V) pair. Each thread adds 8
// consecutive elements (row is a multiple of 8: D is); with kVec (every row start 16-byte aligned)
// through 16-byte loads and stores: the pass moves 10 bytes an element (bf16 in, f32 in and out)
// and at head dim 128 is about a twentieth of the backward, so it runs at memory speed.
template <class S, bool kVec>
__global__ void add_kv_kernel(float* dk, float* dv, const S* sk, const S* sv, int64_t row, int64_t dk_bs,
                              int64_t dv_bs) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= row) return;
  const int64_t b = blockIdx.y;
  float* d = (blockIdx.z == 0 ? dk + b * dk_bs : dv + b * dv_bs) + i;
  const S* s = (blockIdx.z == 0 ? sk : sv) + b * row + i;
  if constexpr (kVec) {
    float v[8];
    if constexpr (sizeof(S) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(s);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[2 * j] = __low2float(h[j]), v[2 * j + 1] = __high2float(h[j]);
    } else {
      const float4 a = reinterpret_cast<const float4*>(s)[0], c = reinterpret_cast<const float4*>(s)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
    }
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

template <class S>
void launch_add_kv(const Tensor& d_k, const Tensor& d_v, const void* sk, const void* sv, int64_t B, int64_t row,
                   cudaStream_t stream) {
  const dim3 grid(blocks_for(row / 8, kAddThreads), static_cast<unsigned>(B), 2);
  auto row_aligned = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (t.size(0) == 1 || t.stride[0] % 4 == 0);
  };
  float *dk = static_cast<float*>(d_k.data), *dv = static_cast<float*>(d_v.data);
  const S *s_k = static_cast<const S*>(sk), *s_v = static_cast<const S*>(sv);
  if (row_aligned(d_k) && row_aligned(d_v))
    add_kv_kernel<S, true><<<grid, kAddThreads, 0, stream>>>(dk, dv, s_k, s_v, row, d_k.stride[0], d_v.stride[0]);
  else
    add_kv_kernel<S, false><<<grid, kAddThreads, 0, stream>>>(dk, dv, s_k, s_v, row, d_k.stride[0], d_v.stride[0]);
}

// GQA backward: K/V [B, S, Hkv, D] (batch stride kv_bs) copied to packed [B, S, H, D], query head h
// reading K/V head h / g. One thread per 8 bf16 (16 bytes; D is a multiple of 8).
__global__ void expand_kv_kernel(uint4* dst, const __nv_bfloat16* src, int64_t B, int64_t S, int64_t H, int64_t Hkv,
                                 int64_t D, int64_t kv_bs) {
  const int64_t vecs = B * S * H * D / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  const int64_t e = i * 8, d = e % D, h = (e / D) % H, s = (e / (D * H)) % S, b = e / (D * H * S);
  const int64_t g = H / Hkv;
  dst[i] = *reinterpret_cast<const uint4*>(src + b * kv_bs + (s * Hkv + h / g) * D + d);
}

// d_k[b, s, kh, :] += sum_{r < g} dK[b, s, kh g + r, :] (and the same for V): the per-query-head
// gradients of the expanded backward summed over each group in a fixed order (deterministic), then
// added in f32. Scratch packed [B, S, Hkv g, D]; d_k/d_v batch strides honoured. blockIdx.z picks K/V.
template <class S>
__global__ void add_kv_grouped_kernel(float* dk, float* dv, const S* sk, const S* sv, int64_t B, int64_t Sn,
                                      int64_t Hkv, int64_t D, int64_t g, int64_t dk_bs, int64_t dv_bs) {
  const int64_t per_batch = Sn * Hkv * D;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= per_batch) return;
  const int64_t b = blockIdx.y, d = i % D, kh = (i / D) % Hkv, s = i / (D * Hkv);
  const S* src = (blockIdx.z == 0 ? sk : sv) + ((b * Sn + s) * Hkv * g + kh * g) * D + d;
  float sum = 0.0f;
  for (int64_t r = 0; r < g; ++r) sum += to_f32(src[r * D]);
  float* dst = blockIdx.z == 0 ? dk + b * dk_bs : dv + b * dv_bs;
  dst[i] += sum;
}

// Delta[b, h, i] = sum_d dO[b, i, h, d] O[b, i, h, d] in f32: one warp per (b, i, h) row, a fixed
// shuffle order. Written before cuDNN runs: the engines read the graph's in-memory Delta tensor.
__global__ void delta_kernel(float* delta, const __nv_bfloat16* d_o, const __nv_bfloat16* o, int64_t B, int64_t c,
                             int64_t H, int64_t D) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (row >= B * c * H) return;
  float sum = 0.0f;
  for (int64_t d = lane; d < D; d += 32)
    sum += __bfloat162float(d_o[row * D + d]) * __bfloat162float(o[row * D + d]);
  for (int k = 16; k > 0; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
  if (lane == 0) {
    const int64_t h = row % H, i = (row / H) % c, b = row / (H * c);
    delta[(b * H + h) * c + i] = sum;
  }
}

// d_q += src, both bf16 [n] packed; the sum is formed in f32 and rounded once.
__global__ void add_q_kernel(__nv_bfloat16* dq, const __nv_bfloat16* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dq[i] = __float2bfloat16_rn(__bfloat162float(dq[i]) + __bfloat162float(src[i]));
}

// The by-value int32 offsets of the bottom-right mask (none for p = 0): row + S - c, or row + p.
struct MaskScalars {
  int32_t first = 0, second = 0;
  bool any = false, two = false;
  MaskScalars(const Shape& sh, const GraphVariant& v) {
    any = sh.p() > 0;
    two = !v.mask_one_add;
    first = static_cast<int32_t>(v.mask_one_add ? sh.p() : sh.S);
    second = static_cast<int32_t>(sh.c);
  }
  void add_to(std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
    if (!any) return;
    uids.push_back(kSkv);
    ptrs.push_back(&first);
    if (two) {
      uids.push_back(kSq);
      ptrs.push_back(&second);
    }
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points.

namespace {
// What both directions share: the static rules, then shapes cuDNN already rejected in `direction`.
bool supports(const Tensor& q, const Tensor& k, bool backward, std::string* why_not) {
  std::string why = static_reason(q, k);
  if (why.empty()) {
    // Shapes cuDNN already rejected (every variant) are not offered again.
    std::lock_guard lock(g_mutex);
    auto it = g_devices.find(q.device.index);
    if (it != g_devices.end()) {
      const Shape sh = shape_of(q, k, k, backward);
      if (auto r = it->second.rejected.find(sh); r != it->second.rejected.end())
        why = "cuDNN rejected this shape: " + r->second;
    }
  }
  if (why_not) *why_not = why;
  return why.empty();
}
}  // namespace

bool cudnn_attention_supports(const Tensor& q, const Tensor& k, std::string* why_not) {
  return supports(q, k, false, why_not) && supports(q, k, true, why_not);
}

void set_cudnn_autotune(bool on) { autotune_switch().store(on); }
bool cudnn_autotune() { return autotune(); }

bool cudnn_attention_forward_supports(const Tensor& q, const Tensor& k, std::string* why_not) {
  return supports(q, k, false, why_not);
}

bool cudnn_attention_backward_fits(const Tensor& q, const Tensor& k, const Tensor& v, int64_t max_workspace,
                                   std::string* why_not) {
  if (!supports(q, k, true, why_not)) return false;
  std::string why;
  const Shape sh = shape_of(q, k, v, true);
  const Plan* plan = get_plan(sh, &why);
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

void cudnn_attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, Arena& scratch) {
  check_common(q, k, v, out, saved);
  const Shape sh = shape_of(q, k, v, false);
  std::string why;
  const Plan* plan = get_plan(sh, &why);
  CW_CHECK(plan != nullptr, "cuDNN has no fused attention plan for q {} k {}:\n{}", q.describe(), k.describe(), why);
  float scale_f = static_cast<float>(scale), neg = std::numeric_limits<float>::lowest();
  MaskScalars m(sh, plan->variant);
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  std::vector<void*> ptrs{q.data, k.data, v.data, out.data, saved.lse.data, &scale_f, &neg};
  m.add_to(uids, ptrs);
  execute(*plan, sh.device, uids, ptrs, scratch);
}

void cudnn_attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                              const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, double scale, GradMode mode, Arena& scratch) {
  check_common(q, k, v, out, saved);
  check_same_shape(d_q, q, "attention d_q", "attention q");
  check_same_shape(d_out, q, "attention d_out", "attention q");
  check_dtype(d_q, DType::bf16, "attention d_q");
  check_dtype(d_out, DType::bf16, "attention d_out");
  check_contiguous(d_q, "attention d_q");
  check_contiguous(d_out, "attention d_out");
  check_gpu_operand(d_q, q, "attention d_q");
  check_gpu_operand(d_out, q, "attention d_out");
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  for (const Tensor* t : {&d_k, &d_v}) {
    check_same_shape(*t, k, "attention d_k/d_v", "attention k");
    check_dtype(*t, DType::f32, "attention d_k/d_v");
    CW_CHECK(t->stride[1] == Hkv * D && t->stride[2] == D && t->stride[3] == 1,
             "attention d_k/d_v {}: the [S, Hkv, D] part must be packed", t->describe());
    CW_CHECK(!t->device.is_cpu() && t->device == q.device, "attention d_k/d_v {} must be on {}", t->describe(),
             device_name(q.device));
  }
  const int dev = q.device.index;
  cudaStream_t stream = current_stream(dev);
  ArenaScope scope(scratch);
  CW_CHECK(scratch.device() == q.device, "cuDNN attention: the scratch arena is on {}, not {}",
           device_name(scratch.device()), device_name(q.device));

  const Shape sh = shape_of(q, k, v, true);
  std::string why;
  const Plan* plan = get_plan(sh, &why);
  CW_CHECK(plan != nullptr, "cuDNN has no fused attention backward plan for q {} k {}:\n{}", q.describe(),
           k.describe(), why);

  // The f32 dQ accumulator first, so that it sits at the same scratch address call after call
  // (the tests' second backward then catches an accumulator left unzeroed).
  const GraphVariant& variant = plan->variant;
  void* dq_accum = nullptr;
  std::function<void()> zero_accum;
  if (variant.dq_accum) {
    const size_t bytes = static_cast<size_t>(B * c * H * D) * sizeof(float);
    dq_accum = scratch.alloc_bytes(bytes);
    // cuDNN 9.6 and newer zero the frontend form's accumulator themselves (the frontend library
    // stopped doing it there); older versions and the other forms add into what they are given.
    if (!variant.frontend_form || runtime_version() < 90600) {
      zero_accum = [=] { CW_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, bytes, stream)); };
      zero_accum();
    }
  }

  // GQA: dK/dV come out per query head (a matmul's output has the broadcast shape) unless the
  // graph reduces the heads itself, and the add kernel then sums each group in a fixed order.
  // Where cuDNN only served the graph with K/V expanded to H heads, they are copied to scratch
  // first (B S H D bf16 each, at memory speed).
  const int64_t g = H / Hkv;
  Tensor k_used = k, v_used = v;
  if (g > 1 && variant.gqa_expand) {
    k_used = scratch.alloc(DType::bf16, {B, S, H, D});
    v_used = scratch.alloc(DType::bf16, {B, S, H, D});
    const int64_t vecs = B * S * H * D / 8;
    expand_kv_kernel<<<blocks_for(vecs, kAddThreads), kAddThreads, 0, stream>>>(
        static_cast<uint4*>(k_used.data), static_cast<const __nv_bfloat16*>(k.data), B, S, H, Hkv, D, k.stride[0]);
    CW_KERNEL_CHECK();
    expand_kv_kernel<<<blocks_for(vecs, kAddThreads), kAddThreads, 0, stream>>>(
        static_cast<uint4*>(v_used.data), static_cast<const __nv_bfloat16*>(v.data), B, S, H, Hkv, D, v.stride[0]);
    CW_KERNEL_CHECK();
  }
  const bool per_query_head = g > 1 && !variant.gqa_reduce;
  const int64_t Hs = per_query_head ? H : Hkv;  // heads of the scratch dK/dV
  const DType kv_dt = variant.dkv_f32 ? DType::f32 : DType::bf16;
  const Tensor dk_s = scratch.alloc(kv_dt, {B, S, Hs, D}), dv_s = scratch.alloc(kv_dt, {B, S, Hs, D});
  const bool accumulate = mode == GradMode::accumulate;
  const Tensor dq_s = accumulate ? scratch.alloc(DType::bf16, {B, c, H, D}) : d_q;
  const Tensor delta = scratch.alloc(DType::f32, {B, H, c});
  if (variant.frontend_form) {
    // cuDNN computes Delta itself in this form and writes it here; poisoned (NaN) so that an engine
    // reading it instead would show in every gradient.
    CW_CUDA_CHECK(cudaMemsetAsync(delta.data, 0xff, static_cast<size_t>(B * H * c) * sizeof(float), stream));
  } else {
    // The older forms' engines read Delta from memory: computed here first.
    delta_kernel<<<blocks_for(B * c * H * 32, kAddThreads), kAddThreads, 0, stream>>>(
        static_cast<float*>(delta.data), static_cast<const __nv_bfloat16*>(d_out.data),
        static_cast<const __nv_bfloat16*>(out.data), B, c, H, D);
    CW_KERNEL_CHECK();
  }

  float scale_f = static_cast<float>(scale), neg = std::numeric_limits<float>::lowest();
  MaskScalars m(sh, plan->variant);
  float one = 1.0f;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kNegInf, kDelta};
  std::vector<void*> ptrs{q.data,    k_used.data, v_used.data, out.data, d_out.data, saved.lse.data,
                          dq_s.data, dk_s.data,   dv_s.data,   &scale_f, &neg,       delta.data};
  if (!variant.frontend_form) {
    uids.push_back(kKForDQ);
    ptrs.push_back(k_used.data);
  } else {
    uids.push_back(kOne);
    ptrs.push_back(&one);
  }
  if (dq_accum) {
    uids.push_back(kDQAccum);
    ptrs.push_back(dq_accum);
  }
  m.add_to(uids, ptrs);
  execute(*plan, dev, uids, ptrs, scratch, zero_accum);

  // d_k += dK, d_v += dV (group sums for GQA; batch strides honoured), then d_q += dQ in accumulate mode.
  const int64_t row = S * Hkv * D;
  CW_CHECK(B <= 65535, "cuDNN attention: {} batch entries exceed the grid", B);
  if (!per_query_head) {
    if (kv_dt == DType::f32)
      launch_add_kv<float>(d_k, d_v, dk_s.data, dv_s.data, B, row, stream);
    else
      launch_add_kv<__nv_bfloat16>(d_k, d_v, dk_s.data, dv_s.data, B, row, stream);
  } else {
    const dim3 grid(blocks_for(row, kAddThreads), static_cast<unsigned>(B), 2);
    if (kv_dt == DType::f32) {
      add_kv_grouped_kernel<float><<<grid, kAddThreads, 0, stream>>>(
          static_cast<float*>(d_k.data), static_cast<float*>(d_v.data), static_cast<const float*>(dk_s.data),
          static_cast<const float*>(dv_s.data), B, S, Hkv, D, g, d_k.stride[0], d_v.stride[0]);
    } else {
      add_kv_grouped_kernel<__nv_bfloat16><<<grid, kAddThreads, 0, stream>>>(
          static_cast<float*>(d_k.data), static_cast<float*>(d_v.data),
          static_cast<const __nv_bfloat16*>(dk_s.data), static_cast<const __nv_bfloat16*>(dv_s.data), B, S, Hkv, D,
          g, d_k.stride[0], d_v.stride[0]);
    }
  }
  CW_KERNEL_CHECK();
  if (accumulate) {
    const int64_t n = q.numel();
    add_q_kernel<<<blocks_for(n, kAddThreads), kAddThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(d_q.data), static_cast<const __nv_bfloat16*>(dq_s.data), n);
    CW_KERNEL_CHECK();
  }
}

}  // namespace cw::gpu
