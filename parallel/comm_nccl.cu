// The NCCL communicator (contract in comm_nccl.h).
//
// Threads: the caller's thread issues collectives; the watchdog's thread polls their events and
// NCCL's asynchronous error, and aborts. NCCL allows one thread in a communicator at a time, so
// every NCCL call on it takes nccl_mutex_. The communicator is non-blocking (config.blocking = 0):
// a call may return ncclInProgress, and is complete (its kernels queued on the stream) once
// ncclCommGetAsyncError says ncclSuccess; the mutex is released between those polls, so an abort
// never waits behind a call.
// Layering: like every file above engine/, this one sees only the public engine (engine.h gives the
// compute stream as an opaque handle); the CUDA runtime calls it makes itself are for its events and
// the current device, checked by its own macro below.
#include "parallel/comm_nccl.h"

#include "engine/engine.h"
#include "engine/memory.h"
#include "parallel/watchdog.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

namespace cw {

bool nccl_available() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kFailureHint =
    "every rank must issue the same collectives in the same order with the same sizes; the other ranks' "
    "output says whether one of them died; CHUNKWISE_COMM_TIMEOUT_S sets the timeout; NCCL_DEBUG=WARN shows NCCL's view";

[[noreturn]] void raise_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  detail::raise(expr, file, line, CW_FORMAT("CUDA: {}: {}", cudaGetErrorName(e), cudaGetErrorString(e)));
}

#define CW_COMM_CUDA_CHECK(expr)                                                        \
  do {                                                                                  \
    const cudaError_t cw_cuda_e_ = (expr);                                              \
    if (cw_cuda_e_ != cudaSuccess) raise_cuda(cw_cuda_e_, #expr, __FILE__, __LINE__);   \
  } while (0)

// Makes `device` current for the scope and restores the previous one after.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    CW_COMM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) CW_COMM_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~CurrentDevice() {
    if (changed_) cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

[[noreturn]] void raise_nccl(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  const char* hint = (r == ncclSystemError || r == ncclRemoteError)
                         ? "a peer process or the network failed: check every rank's output (NCCL_DEBUG=WARN shows more)"
                         : "NCCL_DEBUG=WARN shows NCCL's reason";
  detail::raise(expr, file, line,
                CW_FORMAT("NCCL: {}{}{}", ncclGetErrorString(r), (last && *last) ? ": " : "", last ? last : ""), hint);
}

// An NCCL call that must return success, or in-progress on a non-blocking communicator.
#define CW_NCCL_CHECK(comm, expr)                                                                   \
  do {                                                                                              \
    const ncclResult_t cw_nccl_r_ = (expr);                                                         \
    if (cw_nccl_r_ != ncclSuccess && cw_nccl_r_ != ncclInProgress)                                   \
      raise_nccl(cw_nccl_r_, comm, #expr, __FILE__, __LINE__);                                      \
  } while (0)

ncclDataType_t nccl_dtype(DType dtype, const char* op) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f64: return ncclFloat64;
    default:
      fail(CW_FORMAT("{}: the NCCL communicator sums f32, bf16 and f64 tensors, not {}", op, dtype_name(dtype)),
           "convert the tensor first");
  }
}

// The CUDA event recorded after one collective on the compute stream; shared by the CommWork and
// the watchdog (which may still poll it after the CommWork is gone).
class CollectiveEvent {
 public:
  // On `device`: an event must belong to the device of the stream it is recorded on.
  explicit CollectiveEvent(int device) {
    CurrentDevice current(device);
    CW_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CollectiveEvent() { cudaEventDestroy(event_); }
  CollectiveEvent(const CollectiveEvent&) = delete;
  CollectiveEvent& operator=(const CollectiveEvent&) = delete;

  void record(cudaStream_t stream) {
    CW_COMM_CUDA_CHECK(cudaEventRecord(event_, stream));
    state_.store(kRecorded, std::memory_order_release);
  }
  // The collective was never queued (its NCCL call failed): nothing to wait for.
  void abandon() { state_.store(kAbandoned, std::memory_order_release); }

  // Thread-safe. A CUDA error counts as done: the host's next CUDA check reports it.
  bool done() const {
    const int s = state_.load(std::memory_order_acquire);
    if (s != kRecorded) return s == kAbandoned;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is no error: keep it out of this thread's last-error state
      return false;
    }
    return true;
  }
  cudaEvent_t get() const { return event_; }

 private:
  static constexpr int kPending = 0, kRecorded = 1, kAbandoned = 2;
  cudaEvent_t event_ = nullptr;
  std::atomic<int> state_{kPending};
};

class NcclWork final : public CommWork {
 public:
  NcclWork(std::shared_ptr<CollectiveEvent> event, cudaStream_t stream, const Watchdog& watchdog)
      : event_(std::move(event)), stream_(stream), watchdog_(watchdog) {}
  ~NcclWork() override {
    if (!waited_) cudaStreamWaitEvent(stream_, event_->get(), 0);  // no throwing from a destructor
  }
  void wait() override {
    if (waited_) return;
    waited_ = true;
    watchdog_.throw_if_failed();
    CW_COMM_CUDA_CHECK(cudaStreamWaitEvent(stream_, event_->get(), 0));
  }

 private:
  std::shared_ptr<CollectiveEvent> event_;
  cudaStream_t stream_;
  const Watchdog& watchdog_;  // the communicator's: a CommWork never outlives its communicator
  bool waited_ = false;
};

// The work of a collective over zero elements.
class CompletedWork final : public CommWork {
 public:
  void wait() override {}
};

// Polls a communicator being created (ncclCommInitRankConfig, ncclCommSplit) until it is ready
// (true) or the deadline passes (false); throws the error it reports instead.
bool wait_until_ready(ncclComm_t comm, Clock::time_point deadline) {
  auto pause = std::chrono::microseconds(5);
  for (;;) {
    ncclResult_t state = ncclInProgress;
    CW_NCCL_CHECK(comm, ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return true;
    if (state != ncclInProgress) raise_nccl(state, comm, "ncclCommGetAsyncError(comm, &state)", __FILE__, __LINE__);
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

Clock::time_point deadline_after(Seconds s) { return Clock::now() + std::chrono::duration_cast<Clock::duration>(s); }

// The launcher's path: rank 0 creates an ncclUniqueId, the TCP bootstrap hands it to every rank, and
// ncclCommInitRankConfig (non-blocking) runs until ready. Aborts the communicator on any failure.
// `device` is current.
ncclComm_t init_from_launch(const LaunchInfo& info, int device, const NcclOptions& options) {
  ncclUniqueId id{};
  std::vector<uint8_t> blob;
  if (info.rank == 0) {
    CW_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
    blob.assign(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof(id));
  }
  blob = exchange_bootstrap_blob(info, std::move(blob), options.bootstrap_timeout);
  CW_CHECK(blob.size() == sizeof(id), "rank {}: the bootstrap delivered {} bytes, an ncclUniqueId has {}", info.rank,
           blob.size(), sizeof(id));
  std::memcpy(&id, blob.data(), sizeof(id));

  CW_COMM_CUDA_CHECK(cudaSetDevice(device));  // ncclCommInitRank binds the communicator to the current device
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, info.world_size, id, info.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    raise_nccl(r, nullptr, "ncclCommInitRankConfig(&comm, info.world_size, id, info.rank, &config)", __FILE__, __LINE__);
  }
  bool ready = false;
  try {
    ready = wait_until_ready(comm, deadline_after(options.bootstrap_timeout));
  } catch (...) {
    ncclCommAbort(comm);
    throw;
  }
  if (!ready) {
    ncclCommAbort(comm);
    fail(CW_FORMAT("ncclCommInitRank on rank {} of {} (GPU {}) did not complete within {} s", info.rank,
                   info.world_size, device, options.bootstrap_timeout.count()),
         "every rank passed the bootstrap, so one failed or hung since: its output says why; "
         "CHUNKWISE_BOOTSTRAP_TIMEOUT_S sets the wait");
  }
  return comm;
}

int comm_query(ncclComm_t comm, ncclResult_t (*query)(const ncclComm_t, int*), const char* what) {
  int value = 0;
  const ncclResult_t r = query(comm, &value);
  if (r != ncclSuccess) raise_nccl(r, comm, what, __FILE__, __LINE__);
  return value;
}

class NcclCommunicator final : public Communicator {
 public:
  // Adopts `comm`, ready (made by init_from_launch or a split), on GPU `device`: aborts it when the
  // setup here fails.
  NcclCommunicator(ncclComm_t comm, int device, const NcclOptions& options)
      : rank_(comm_query(comm, ncclCommUserRank, "ncclCommUserRank")),
        size_(comm_query(comm, ncclCommCount, "ncclCommCount")),
        device_(device),
        exit_on_failure_(options.exit_on_failure),
        collective_timeout_(options.collective_timeout),
        options_(options),
        comm_(comm) {
    try {
      // The ops' stream; this also makes the device current for this thread.
      stream_ = static_cast<cudaStream_t>(compute_stream(Device::gpu(device_)));
      scratch_ = Buffer(sizeof(float), Device::gpu(device_));
      CW_COMM_CUDA_CHECK(cudaMemsetAsync(scratch_.data(), 0, scratch_.bytes(), stream_));
      watchdog_ = std::make_unique<Watchdog>(
          options.collective_timeout,
          WatchdogHooks{[this](const std::string& failure) { on_failure(failure); },
                        [this] { return async_error(); },
                        [device = device_] { cudaSetDevice(device); }},
          kFailureHint);
    } catch (...) {
      ncclCommAbort(comm_);
      throw;
    }
  }

  ~NcclCommunicator() override {
    // Destroyed while an error unwinds: this rank will issue nothing more and its peers may wait on it, so
    // abort at once rather than wait up to the collective timeout for a clean finalize.
    const bool unwinding = std::uncaught_exceptions() > 0;
    if (!unwinding) {
      try {
        if (!watchdog_->failed()) watchdog_->wait_all();  // let issued collectives finish, under the watchdog
      } catch (const std::exception&) {
        // the watchdog fired: the communicator is aborted below
      }
    }
    watchdog_.reset();  // its thread must not touch the communicator while it goes away
    std::lock_guard lock(nccl_mutex_);
    if (aborted_) return;
    cudaSetDevice(device_);  // already current unless the caller moved on (the constructor made it so)
    if (unwinding) {
      ncclCommAbort(comm_);
      return;
    }
    // Finalize (flushes this rank's operations), bounded like a collective; an abort if it fails or hangs.
    ncclResult_t state = ncclCommFinalize(comm_);
    const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(collective_timeout_);
    while (state == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    }
    if (state == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::gpu(device_); }
  std::string backend() const override { return "nccl"; }

  std::unique_ptr<CommWork> all_reduce(const Tensor& t) override {
    check_operand(t, "all_reduce", "t");
    const ncclDataType_t dtype = nccl_dtype(t.dtype, "all_reduce");
    const size_t n = static_cast<size_t>(t.numel());
    return issue(describe("all_reduce", t), n, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(t.data, t.data, n, dtype, ncclSum, comm, stream);
    });
  }

  std::unique_ptr<CommWork> reduce(const Tensor& t, int root) override {
    check_operand(t, "reduce", "t");
    CW_CHECK(root >= 0 && root < size_, "reduce: root {} is not a rank of {}", root, size_);
    const ncclDataType_t dtype = nccl_dtype(t.dtype, "reduce");
    const size_t n = static_cast<size_t>(t.numel());
    return issue(describe(CW_FORMAT("reduce to rank {}", root).c_str(), t), n, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclReduce(t.data, t.data, n, dtype, ncclSum, root, comm, stream);
    });
  }

  std::unique_ptr<CommWork> reduce_scatter(const Tensor& out, const Tensor& in) override {
    check_operand(out, "reduce_scatter", "out");
    check_operand(in, "reduce_scatter", "in");
    check_pair(out, in, "reduce_scatter", in.numel() == size_ * out.numel(), "in has size x out's elements");
    // In place is allowed in NCCL's form only: out is rank's slice of in.
    check_alias(out, in, "reduce_scatter", static_cast<const char*>(in.data) + rank_ * out.bytes() == out.data,
                "out must be in's slice [rank * n, +n)");
    const ncclDataType_t dtype = nccl_dtype(in.dtype, "reduce_scatter");
    const size_t n = static_cast<size_t>(out.numel());
    return issue(describe("reduce_scatter", in), n, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclReduceScatter(in.data, out.data, n, dtype, ncclSum, comm, stream);
    });
  }

  std::unique_ptr<CommWork> all_gather(const Tensor& out, const Tensor& in) override {
    check_operand(out, "all_gather", "out");
    check_operand(in, "all_gather", "in");
    check_pair(out, in, "all_gather", out.numel() == size_ * in.numel(), "out has size x in's elements");
    check_alias(out, in, "all_gather", static_cast<const char*>(out.data) + rank_ * in.bytes() == in.data,
                "in must be out's slice [rank * n, +n)");
    const ncclDataType_t dtype = nccl_dtype(in.dtype, "all_gather");
    const size_t n = static_cast<size_t>(in.numel());
    return issue(describe("all_gather", out), n, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllGather(in.data, out.data, n, dtype, comm, stream);
    });
  }

  // NCCL has no all-to-all of its own: one send and one receive per peer, grouped into one operation.
  std::unique_ptr<CommWork> all_to_all(const Tensor& out, const Tensor& in) override {
    check_operand(out, "all_to_all", "out");
    check_operand(in, "all_to_all", "in");
    check_pair(out, in, "all_to_all", out.numel() == in.numel() && in.numel() % size_ == 0,
               "out and in have the same elements, a multiple of the group's size");
    check_alias(out, in, "all_to_all", false, "not allowed");
    const ncclDataType_t dtype = nccl_dtype(in.dtype, "all_to_all");
    const size_t n = static_cast<size_t>(in.numel() / size_);
    const size_t block = n * dtype_size(in.dtype);
    return issue(describe("all_to_all", in), n, [&](ncclComm_t comm, cudaStream_t stream) {
      ncclResult_t r = ncclGroupStart();
      for (int peer = 0; peer < size_ && r == ncclSuccess; ++peer) {
        r = ncclSend(static_cast<const char*>(in.data) + block * peer, n, dtype, peer, comm, stream);
        if (r == ncclSuccess) r = ncclRecv(static_cast<char*>(out.data) + block * peer, n, dtype, peer, comm, stream);
      }
      const ncclResult_t end = ncclGroupEnd();  // always closes the group, even after a failed call in it
      return r != ncclSuccess ? r : end;
    });
  }

  std::unique_ptr<CommWork> broadcast(const Tensor& t, int root) override {
    check_operand(t, "broadcast", "t");
    CW_CHECK(root >= 0 && root < size_, "broadcast: root {} is not a rank of {}", root, size_);
    const ncclDataType_t dtype = nccl_dtype(t.dtype, "broadcast");
    const size_t n = static_cast<size_t>(t.numel());
    return issue(describe(CW_FORMAT("broadcast from rank {}", root).c_str(), t), n,
                 [&](ncclComm_t comm, cudaStream_t stream) {
                   return ncclBroadcast(t.data, t.data, n, dtype, root, comm, stream);
                 });
  }

  void barrier() override {
    auto event = std::make_shared<CollectiveEvent>(device_);
    const Tensor one = scratch_.as(DType::f32, {1});
    issue_with(CW_FORMAT("barrier on rank {} of {} (GPU {})", rank_, size_, device_), event,
               [&](ncclComm_t comm, cudaStream_t stream) {
                 return ncclAllReduce(one.data, one.data, 1, ncclFloat32, ncclSum, comm, stream);
               });
    watchdog_->wait([&event] { return event->done(); });
  }

  // ncclCommSplit, non-blocking like every communicator here: the new one is polled until ready
  // within the bootstrap timeout (a rank that never calls the split shows up there).
  std::unique_ptr<Communicator> split(int color, int key) override {
    CurrentDevice current(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    ncclResult_t r;
    {
      std::lock_guard lock(nccl_mutex_);
      throw_if_aborted();
      r = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      if (child != nullptr) ncclCommAbort(child);
      raise_nccl(r, comm_, "ncclCommSplit(comm_, color, key, &child, &config)", __FILE__, __LINE__);
    }
    const Clock::time_point deadline = deadline_after(options_.bootstrap_timeout);
    bool ready = false;
    try {
      // The split is a call on this communicator (complete once it is no longer in progress), and
      // the new one initialises on its own.
      ready = finish_in_progress(deadline) && (child == nullptr || wait_until_ready(child, deadline));
    } catch (...) {
      if (child != nullptr) ncclCommAbort(child);
      throw;
    }
    if (!ready) {
      if (child != nullptr) ncclCommAbort(child);
      fail(CW_FORMAT("ncclCommSplit (color {}, key {}) on rank {} of {} (GPU {}) did not complete within {} s", color,
                     key, rank_, size_, device_, options_.bootstrap_timeout.count()),
           "every rank of the communicator must call split at the same point; CHUNKWISE_BOOTSTRAP_TIMEOUT_S sets "
           "the wait");
    }
    if (child == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(child, device_, options_);
  }

 private:
  std::string describe(const char* op, const Tensor& t) const {
    return CW_FORMAT("{} of {} x {} on rank {} of {} (GPU {})", op, t.numel(), dtype_name(t.dtype), rank_, size_,
                     device_);
  }

  void check_operand(const Tensor& t, const char* op, const char* name) const {
    CW_CHECK(t.device == Device::gpu(device_), "{}: {} is on {}, the communicator on {}", op, name,
             device_name(t.device), device_name(Device::gpu(device_)));
    CW_CHECK(t.defined(), "{}: {} has no data", op, name);
    check_contiguous(t, name);
  }

  void check_pair(const Tensor& out, const Tensor& in, const char* op, bool sizes_ok, const char* rule) const {
    CW_CHECK(out.dtype == in.dtype, "{}: out is {}, in is {}", op, dtype_name(out.dtype), dtype_name(in.dtype));
    CW_CHECK(sizes_ok, "{}: out has {} elements, in {}, the world size is {} ({})", op, out.numel(), in.numel(), size_,
             rule);
  }

  void check_alias(const Tensor& out, const Tensor& in, const char* op, bool nccl_in_place, const char* rule) const {
    const char* o = static_cast<const char*>(out.data);
    const char* i = static_cast<const char*>(in.data);
    const bool overlap = o < i + in.bytes() && i < o + out.bytes();
    CW_CHECK(!overlap || nccl_in_place, "{}: out and in overlap; in place, {}", op, rule);
  }

  // Throws the watchdog's failure once the communicator was aborted (call with nccl_mutex_ held).
  void throw_if_aborted() const {
    if (aborted_) fail(watchdog_ ? watchdog_->failure() : "the NCCL communicator was aborted", kFailureHint);
  }

  // Polls until the last call is no longer in progress (true), or the deadline passes (false).
  // Throws the call's error, or the watchdog's failure once it aborted the communicator.
  bool finish_in_progress(Clock::time_point deadline) {
    auto pause = std::chrono::microseconds(5);
    for (;;) {
      {
        std::lock_guard lock(nccl_mutex_);
        throw_if_aborted();
        ncclResult_t state = ncclInProgress;
        CW_NCCL_CHECK(comm_, ncclCommGetAsyncError(comm_, &state));
        if (state == ncclSuccess) return true;
        if (state != ncclInProgress) raise_nccl(state, comm_, "ncclCommGetAsyncError(comm_, &state)", __FILE__, __LINE__);
      }
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  template <class Call> std::unique_ptr<CommWork> issue(const std::string& what, size_t count, Call&& call) {
    // Nothing to move: every rank has the same count, so every rank skips NCCL alike.
    if (count == 0) return std::make_unique<CompletedWork>();
    auto event = std::make_shared<CollectiveEvent>(device_);
    issue_with(what, event, call);
    return std::make_unique<NcclWork>(event, stream_, *watchdog_);
  }

  // Watches the collective from now (its enqueue included), queues it, records its event.
  template <class Call> void issue_with(const std::string& what, const std::shared_ptr<CollectiveEvent>& event, Call&& call) {
    CurrentDevice current(device_);
    watchdog_->watch(what, [event] { return event->done(); });
    try {
      ncclResult_t r;
      {
        std::lock_guard lock(nccl_mutex_);
        throw_if_aborted();
        r = call(comm_, stream_);
        CW_NCCL_CHECK(comm_, r);
      }
      // In progress: the watchdog's timeout bounds the wait (it aborts, and the poll then throws).
      if (r == ncclInProgress) finish_in_progress(Clock::time_point::max());
      event->record(stream_);
    } catch (...) {
      event->abandon();
      throw;
    }
  }

  // Watchdog thread: abort, then (by default) end the process with the error.
  void on_failure(const std::string& failure) {
    {
      std::lock_guard lock(nccl_mutex_);
      if (!aborted_) ncclCommAbort(comm_);
      aborted_ = true;
    }
    if (exit_on_failure_) {
      std::fprintf(stderr, "chunkwise: rank %d of %d: %s (hint: %s)\n", rank_, size_, failure.c_str(), kFailureHint);
      std::fflush(stderr);
      std::_Exit(1);
    }
  }

  // Watchdog thread: NCCL's asynchronous error, "" while there is none.
  std::string async_error() {
    std::lock_guard lock(nccl_mutex_);
    if (aborted_) return "";
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state == ncclSuccess || state == ncclInProgress)
      return "";
    const char* last = ncclGetLastError(comm_);
    return CW_FORMAT("NCCL reported an error on rank {} of {} (GPU {}): {}{}{}", rank_, size_, device_,
                     ncclGetErrorString(state), (last && *last) ? ": " : "", last ? last : "");
  }

  const int rank_, size_, device_;
  const bool exit_on_failure_;
  const Seconds collective_timeout_;
  const NcclOptions options_;  // what a split's communicator is made with
  cudaStream_t stream_ = nullptr;
  Buffer scratch_;  // the barrier's one f32
  std::mutex nccl_mutex_;  // one thread in NCCL at a time (the caller's, or the watchdog's)
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;  // guarded by nccl_mutex_
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const LaunchInfo& info, int device, const NcclOptions& options) {
  const int visible = static_cast<int>(list_gpus().size());
  CW_CHECK_HINT(device >= 0 && device < visible,
                "run one process per GPU, each with its own local rank (torchrun --nproc-per-node <= GPUs), or "
                "set CUDA_VISIBLE_DEVICES",
                "rank {} of {}: GPU {} does not exist ({} visible)", info.rank, info.world_size, device, visible);
  compute_stream(Device::gpu(device));  // makes the device current for this thread, as the ops expect
  return std::make_unique<NcclCommunicator>(init_from_launch(info, device, options), device, options);
}

}  // namespace cw
