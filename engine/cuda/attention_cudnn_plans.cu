// cuDNN fused attention: the plan cache, the plans built ahead on host threads, and which plan a
// call runs (the graphs and their plans: attention_cudnn_graphs.cu; the calls: attention_cudnn.cu).
//   Plans: built once per shape (device, direction, B, H, Hkv, c, D, K/V batch strides,
//   determinism, and the key extent below) and cached, with the shapes cuDNN refused. One
//   cudnnHandle per device on gpu::current_stream(device) runs the calls; each worker thread builds
//   with its own. cw::attention_plan_stats() counts plans and build seconds (a plan costs ~0.1-0.2 s
//   to build).
//   Key extent: a plan per S would make a SeCO step build one plan per chunk offset in each
//   direction. So where the K/V operands are a slice of a longer store (batch stride = cap Hkv D
//   with cap > S: SeCO's K/V store, cap = T) a shared plan is built for the store's extent cap and
//   serves every S: its graph masks the keys in [S, cap) (attention_cudnn_graphs.cu), and the
//   engine bounds its key loop by S, so it does not read them (the GPU test holds it to that with
//   NaN in those rows). Only for S a multiple of kSharedAlign (every key tile the engine reads then
//   lies inside [0, S): whatever the store holds past S, garbage or NaN, is never touched, and P V
//   never meets 0 x NaN) and cuDNN >= 9.10; not for the deterministic backward (its dS workspace
//   grows with the extent). Keys that fill the store (S = cap, as every packed K/V has) keep their
//   exact plan. A call runs its shared plan only when shared plans are selected
//   (cw::set_cudnn_plans(shared), as the tests do; the default is exact: the padded kernel is slower
//   in steady state), or when it stands in (below); otherwise, or when cuDNN refuses a shared
//   graph, its exact plan.
//   Plans built ahead (cw::cudnn_plan_threads(), engine.h): an exact plan missed by a call whose K/V
//   are a slice of a longer store queues its family (the same chunk length c at every offset of
//   the store, both directions, in sweep order, behind the family's two shared plans) for worker
//   threads, each with its own cudnnHandle; get_plan waits for a plan a worker is building and
//   builds one still queued itself. A call whose exact plan is not built yet runs the shared plan
//   when that is built (it stands in: the default path of a first step, which thus runs on cuDNN
//   rather than flash), else the chooser runs it on flash; the backward whose keys fill the store
//   waits for its own (cudnn_attention_plan_ready says why). With determinism on no plan stands in,
//   so which plan a call runs depends on the call alone.
//   Split plans (the prefix apart: cw::cudnn_splits_prefix, exact plans, a chunk of c >= 64 queries
//   with p >= c keys before it): a split plan holds its two parts' plans (prefix_part, own_part),
//   each cached under its own shape (the own block's is also the plan of the chunk at p = 0), so the
//   queue, stand-ins and readiness above treat it as one plan.
#include "engine/cuda/attention_cudnn.cuh"

#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace cw::gpu::cudnn_attention {
namespace {

// Whether a causal shape runs with its prefix apart (engine.h cudnn_splits_prefix: at least as many
// keys before the chunk as it has queries, the range where the split was measured faster; exact
// plans only, as shared plans are for the fewest plans, not the fastest).
bool splits(const Shape& sh) { return !sh.shared && sh.causal && cw::cudnn_splits_prefix(sh.c, sh.S); }
// Sets whether `sh` (an exact shape) runs with its prefix apart, and that prefix's backward stacked.
void set_split(Shape& sh) {
  sh.split = splits(sh);
  sh.stacked = sh.split && sh.backward && cw::cudnn_stacks_gqa(sh.c, sh.S, sh.H, sh.Hkv);
}

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

}  // namespace

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

Shape shape_of(const Tensor& q, const Tensor& k, const Tensor& v, bool backward, bool causal) {
  Shape sh{q.device.index, backward,   q.size(0), q.size(2),   k.size(2), q.size(1),
           k.size(1),      q.size(3),  k.stride[0], v.stride[0], backward && cw::deterministic()};
  sh.causal = causal;
  set_split(sh);
  return sh;
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

std::optional<std::string> refusal(const Shape& sh) {
  std::lock_guard lock(g_mutex);
  auto it = g_devices.find(sh.device);  // a device not seen yet has refused nothing (no state made here)
  if (it == g_devices.end()) return std::nullopt;
  if (auto r = it->second.rejected.find(sh); r != it->second.rejected.end()) return r->second;
  return std::nullopt;
}

cudnnHandle_t device_handle(int device) {
  std::lock_guard lock(g_mutex);
  return device_state(device).handle;
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

}  // namespace cw::gpu::cudnn_attention

namespace cw::gpu {
using namespace cudnn_attention;

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

}  // namespace cw::gpu
