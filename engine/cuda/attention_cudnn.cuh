// cuDNN fused attention: what its three files share (an internal header of engine/cuda).
//   attention_cudnn.cu         the entry points (engine/cuda/ops.h): what cuDNN serves, the runs of a
//                              plan, and our passes around them
//   attention_cudnn_graphs.cu  the operation graphs of a Shape and the search for their execution plan
//   attention_cudnn_plans.cu   the plan cache, the plans built ahead on host threads, and which plan a
//                              call runs
// Here: the cuDNN check, the limits, the owned backend descriptor, the variant pack's tensor UIDs, a
// plan's problem (Shape) and its plan (Plan), and the functions one file offers the others.
#pragma once

#include "engine/error.h"
#include "engine/tensor.h"

#include <cudnn.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace cw::gpu::cudnn_attention {

// A failed cuDNN call as a cw::Error: the status name and cuDNN's own last error message.
[[noreturn]] void raise_cudnn(cudnnStatus_t s, const char* expr, const char* file, int line);

// Every cuDNN call: the status name and cuDNN's own last error message become the cw::Error.
#define CW_CUDNN_CHECK(expr)                                                                  \
  do {                                                                                        \
    const cudnnStatus_t cw_dnn_st_ = (expr);                                                  \
    if (cw_dnn_st_ != CUDNN_STATUS_SUCCESS)                                                   \
      ::cw::gpu::cudnn_attention::raise_cudnn(cw_dnn_st_, #expr, __FILE__, __LINE__);         \
  } while (0)

constexpr int64_t kMinCudnnVersion = 90300;  // bottom-right causal masks in the fused engine
constexpr int64_t kMaxHeadDim = 128;
constexpr int64_t kAlignment = 16;  // bytes; every real tensor's base and non-unit strides
// Plans needing more workspace than this are taken only when no configuration needs less.
constexpr int64_t kWorkspaceLimit = int64_t{256} << 20;
// Shared plans (one per store extent: attention_cudnn_plans.cu says why): only for key counts that
// are a multiple of this, a multiple of every key tile the fused engines use (64 or 128 keys), so
// that no tile the engine reads reaches past the S real keys; and only from this cuDNN on (9.0-9.9
// wanted a second padding select in the backward, which attention_cudnn_graphs.cu does not build).
constexpr int64_t kSharedAlign = 256;
constexpr int64_t kMinSharedVersion = 91000;

// cudnnGetVersion() of the library loaded at run time, e.g. 91400.
inline int64_t runtime_version() { return static_cast<int64_t>(cudnnGetVersion()); }

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

inline void set_attr(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                     int64_t count, const void* value) {
  CW_CUDNN_CHECK(cudnnBackendSetAttribute(d, name, type, count, value));
}
inline void set_desc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
  set_attr(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
}

using Dims = std::array<int64_t, 4>;

// Packed row-major strides of a 4-d shape.
inline Dims packed_strides(const Dims& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

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
  bool split = false;          // exact, causal, c >= 64, p >= c: the prefix apart (two graphs; attention_cudnn_plans.cu)
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

// ---- attention_cudnn_graphs.cu ----
// Builds the graph of `sh` and finds an execution plan for it; nullptr (with the reason in *why)
// where cuDNN does not serve it. A split shape gets a split plan (build_split_plan), or where cuDNN
// refuses a part, the one graph. `ahead`: built by a worker (for the statistics).
std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const Shape& sh, std::string* why, bool ahead);
// CW_CUDNN_VERBOSE=1 (engine/env.h): each plan described on stderr, with its build time.
bool verbose();

// ---- attention_cudnn_plans.cu ----
// A split shape's plan: its two parts' plans, each cached under its own shape; nullptr where cuDNN
// serves either not.
std::unique_ptr<Plan> build_split_plan(cudnnHandle_t handle, const Shape& sh, std::string* why, bool ahead);
// The parts of a split shape: the chunk's queries against the p keys before it, unmasked (stacked:
// H = Hkv heads of G c rows); and against its own c keys, causal (p = 0: the square case).
Shape prefix_part(Shape sh);
Shape own_part(Shape sh);
// The plan a call runs, *sh receiving its shape (the exact plan, or a shared one standing in or
// selected); nullptr, with cuDNN's reasons, where none exists.
const Plan* resolve_plan(const Tensor& q, const Tensor& k, const Tensor& v, bool backward, Shape* sh,
                         std::string* why, bool causal);
// Counts a call about to run `plan` of shape `sh` in the plan statistics (stand-ins, splits).
void count_run(const Shape& sh, const Plan& plan);
// The exact shape of a call (split and stacked as the settings say).
Shape shape_of(const Tensor& q, const Tensor& k, const Tensor& v, bool backward, bool causal = true);
// The reasons cuDNN gave for refusing `sh`, or nullopt where it has not refused it.
std::optional<std::string> refusal(const Shape& sh);
// The cudnnHandle of calls on `device` (on its compute stream).
cudnnHandle_t device_handle(int device);
// The workspace a backward of shape `sh` takes for `plan`.
int64_t split_backward_workspace(const Shape& sh, const Plan& plan);

// ---- attention_cudnn.cu ----
// Static conditions of the fused path (cheap; no plan is built). Empty string: served.
std::string static_reason(const Tensor& q, const Tensor& k, bool causal = true);

}  // namespace cw::gpu::cudnn_attention
