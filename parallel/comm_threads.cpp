// The threads backend of parallel/comm.h: every rank is a thread of this process, tensors live in
// host memory.
//
// The ranks' k-th collective calls form round k. Each call posts the rank's tensors into the round
// and returns; the rank that posts last checks that every rank issued the same collective (kind,
// dtype, element counts, root) and then does the whole round's work for all ranks: sums are taken
// element by element in rank order, ((x0 + x1) + x2) + ..., into scratch memory first (the outputs
// may alias the inputs), then copied to every rank's output. So every rank gets the same bits, and
// they are the bits of a serial rank-ordered sum, whatever order the threads arrived in.
//
// Failure never deadlocks. A rank that throws out of run_thread_ranks' function, a mismatch between
// ranks' calls, or a rank that returns while others wait on a collective it never issued, marks the
// group failed: every pending wait and every later call on every rank throws, naming the cause. A
// round whose work is in progress is finished before anyone is released, so no thread writes into
// memory its owner has already left.
#include "parallel/comm.h"

#include "engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace cw {
namespace {

enum class Op { all_reduce, reduce_scatter, all_gather, broadcast, barrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
    case Op::barrier: return "barrier";
  }
  return "?";
}

// One rank's part of a collective. all_reduce and broadcast work in place on `out`.
struct Post {
  Op op = Op::barrier;
  Tensor out, in;
  int root = 0;

  std::string describe() const {
    switch (op) {
      case Op::all_reduce: return fmt::format("all_reduce {} [{}]", dtype_name(out.dtype), out.numel());
      case Op::broadcast: return fmt::format("broadcast {} [{}] from rank {}", dtype_name(out.dtype), out.numel(), root);
      case Op::reduce_scatter:
      case Op::all_gather:
        return fmt::format("{} {} out [{}] in [{}]", op_name(op), dtype_name(out.dtype), out.numel(), in.numel());
      case Op::barrier: return "barrier";
    }
    return "?";
  }
  // The parts every rank must agree on (each rank's out/in ratio is checked when it posts).
  bool same_collective(const Post& o) const {
    return op == o.op && out.dtype == o.out.dtype && out.numel() == o.out.numel() && in.numel() == o.in.numel() &&
           root == o.root;
  }
};

struct Round {
  int64_t index = 0;
  std::vector<std::optional<Post>> posts;  // by rank
  int posted = 0;
  bool working = false;   // the last rank to post is doing the round's work, outside the lock
  bool complete = false;  // every rank's outputs hold the result
};

template <class T> void rank_ordered_sum(T* acc, const std::vector<const T*>& parts, int64_t n) {
  if (n == 0) return;
  std::memcpy(acc, parts[0], static_cast<size_t>(n) * sizeof(T));  // starting from 0 + x0 would turn -0 into +0
  for (size_t r = 1; r < parts.size(); ++r) {
    const T* x = parts[r];
    for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
  }
}

void sum_into(void* acc, DType dtype, const std::vector<const void*>& parts, int64_t n) {
  if (dtype == DType::f64) {
    std::vector<const double*> p;
    for (const void* x : parts) p.push_back(static_cast<const double*>(x));
    rank_ordered_sum(static_cast<double*>(acc), p, n);
  } else {
    std::vector<const float*> p;
    for (const void* x : parts) p.push_back(static_cast<const float*>(x));
    rank_ordered_sum(static_cast<float*>(acc), p, n);
  }
}

// A round's work, once every rank has posted; touches only the posted tensors and its own scratch.
void perform(const std::vector<std::optional<Post>>& posts) {
  const int size = static_cast<int>(posts.size());
  const Post& first = *posts[0];
  const size_t elem = dtype_size(first.out.dtype);
  switch (first.op) {
    case Op::barrier: return;
    case Op::all_reduce: {
      const int64_t n = first.out.numel();
      std::vector<char> sum(static_cast<size_t>(n) * elem);
      std::vector<const void*> parts;
      for (const auto& p : posts) parts.push_back(p->out.data);
      sum_into(sum.data(), first.out.dtype, parts, n);
      for (const auto& p : posts)
        if (!sum.empty()) std::memcpy(p->out.data, sum.data(), sum.size());
      return;
    }
    case Op::reduce_scatter: {
      const int64_t n = first.out.numel();
      const size_t shard_bytes = static_cast<size_t>(n) * elem;
      std::vector<char> sums(shard_bytes * static_cast<size_t>(size));
      for (int dst = 0; dst < size; ++dst) {
        std::vector<const void*> parts;
        for (const auto& p : posts) parts.push_back(static_cast<const char*>(p->in.data) + shard_bytes * dst);
        sum_into(sums.data() + shard_bytes * dst, first.out.dtype, parts, n);
      }
      for (int dst = 0; dst < size; ++dst)
        if (shard_bytes) std::memcpy(posts[dst]->out.data, sums.data() + shard_bytes * dst, shard_bytes);
      return;
    }
    case Op::all_gather: {
      const size_t shard_bytes = static_cast<size_t>(first.in.numel()) * elem;
      std::vector<char> gathered(shard_bytes * static_cast<size_t>(size));
      for (int src = 0; src < size; ++src)
        if (shard_bytes) std::memcpy(gathered.data() + shard_bytes * src, posts[src]->in.data, shard_bytes);
      for (const auto& p : posts)
        if (!gathered.empty()) std::memcpy(p->out.data, gathered.data(), gathered.size());
      return;
    }
    case Op::broadcast: {
      const std::vector<char> value(static_cast<const char*>(posts[first.root]->out.data),
                                    static_cast<const char*>(posts[first.root]->out.data) + first.out.bytes());
      for (const auto& p : posts)
        if (!value.empty()) std::memcpy(p->out.data, value.data(), value.size());
      return;
    }
  }
}

const char* kSameCollectivesHint =
    "every rank must issue the same collectives, in the same order, with the same dtypes and element counts";

class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), issued_(static_cast<size_t>(size), 0), finished_(static_cast<size_t>(size)) {}

  int size() const { return size_; }

  // Posts the rank's next collective; the last rank to post does the round's work before returning.
  std::shared_ptr<Round> post(int rank, Post post) {
    std::unique_lock lock(mutex_);
    throw_if_failed(rank, fmt::format("cannot start {}", post.describe()));
    const int64_t k = issued_[rank]++;
    std::shared_ptr<Round>& slot = open_[k];
    if (!slot) {
      slot = std::make_shared<Round>();
      slot->index = k;
      slot->posts.resize(static_cast<size_t>(size_));
    }
    std::shared_ptr<Round> round = slot;
    round->posts[rank] = std::move(post);
    ++round->posted;
    for (int q = 0; q < size_; ++q)
      if (finished_[q] && !round->posts[q]) fail_finished(q, *round);
    if (round->posted < size_) return round;

    open_.erase(k);  // every rank has posted: nobody looks this round up again
    for (int q = 1; q < size_; ++q)
      if (!round->posts[q]->same_collective(*round->posts[0]))
        fail_locked(fmt::format("collective #{}: rank 0 issued {} but rank {} issued {}", k, round->posts[0]->describe(),
                                q, round->posts[q]->describe()),
                    kSameCollectivesHint);
    throw_if_failed(rank, fmt::format("cannot complete collective #{}", k));
    round->working = true;
    lock.unlock();
    perform(round->posts);
    lock.lock();
    round->working = false;
    round->complete = true;
    changed_.notify_all();
    return round;
  }

  // Blocks until the round is complete; throws if the group failed first. A round in progress is
  // always finished first: its outputs belong to threads that may be about to unwind.
  void wait(int rank, const Round& round) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return round.complete || (!failure_.empty() && !round.working); });
    if (!round.complete) throw_if_failed(rank, fmt::format("collective #{} abandoned", round.index));
  }

  void wait_noexcept(const Round& round) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return round.complete || (!failure_.empty() && !round.working); });
  }

  // The rank's function threw: release everyone. Returns whether this is the group's first failure
  // (the cause; later failures are its consequences).
  bool rank_failed(int rank, const std::string& what) {
    std::lock_guard lock(mutex_);
    const bool first = failure_.empty();
    if (first) failure_ = fmt::format("rank {} failed: {}", rank, what);
    finished_[rank] = true;
    changed_.notify_all();
    return first;
  }

  // The rank's function returned: any round it never joined can no longer complete.
  void rank_finished(int rank) {
    std::lock_guard lock(mutex_);
    finished_[rank] = true;
    for (const auto& [k, round] : open_)
      if (!round->posts[rank]) fail_finished(rank, *round);
    changed_.notify_all();
  }

  bool failed() const {
    std::lock_guard lock(mutex_);
    return !failure_.empty();
  }

 private:
  void throw_if_failed(int rank, const std::string& what) const {
    if (!failure_.empty()) fail(fmt::format("rank {}: {}: {}", rank, what, failure_), hint_);
  }
  void fail_locked(const std::string& message, const std::string& hint) {
    if (failure_.empty()) {
      failure_ = message;
      hint_ = hint;
    }
    changed_.notify_all();
  }
  std::string finished_message(int rank, const Round& round) const {
    for (int q = 0; q < size_; ++q)
      if (round.posts[q])
        return fmt::format("rank {} returned after {} collectives, but rank {} issued collective #{} ({})", rank,
                           issued_[rank], q, round.index, round.posts[q]->describe());
    return {};
  }
  void fail_finished(int rank, const Round& round) { fail_locked(finished_message(rank, round), kSameCollectivesHint); }

  const int size_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<int64_t> issued_;                       // per rank: collectives posted so far
  std::map<int64_t, std::shared_ptr<Round>> open_;    // rounds some rank has posted and some has not
  std::vector<bool> finished_;                        // per rank: its function has returned or thrown
  std::string failure_, hint_;                        // non-empty: the group is released
};

class ThreadWork final : public CommWork {
 public:
  ThreadWork(ThreadGroup& group, int rank, std::shared_ptr<Round> round)
      : group_(group), rank_(rank), round_(std::move(round)) {}
  ~ThreadWork() override {
    if (!waited_) group_.wait_noexcept(*round_);
  }
  void wait() override {
    if (waited_) return;
    group_.wait(rank_, *round_);
    waited_ = true;
  }

 private:
  ThreadGroup& group_;
  int rank_;
  std::shared_ptr<Round> round_;
  bool waited_ = false;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  Device device() const override { return Device::host(); }
  std::string backend() const override { return "threads"; }

  std::unique_ptr<CommWork> all_reduce(const Tensor& t) override {
    check_tensor(t, "all_reduce", "tensor", true);
    return start({Op::all_reduce, t, Tensor{}, 0});
  }
  std::unique_ptr<CommWork> reduce_scatter(const Tensor& out, const Tensor& in) override {
    check_tensor(out, "reduce_scatter", "out", true);
    check_tensor(in, "reduce_scatter", "in", true);
    check_pair(out, in, "reduce_scatter", in.numel() == out.numel() * size(), "in must hold size x out's elements");
    return start({Op::reduce_scatter, out, in, 0});
  }
  std::unique_ptr<CommWork> all_gather(const Tensor& out, const Tensor& in) override {
    check_tensor(out, "all_gather", "out", false);
    check_tensor(in, "all_gather", "in", false);
    check_pair(out, in, "all_gather", out.numel() == in.numel() * size(), "out must hold size x in's elements");
    return start({Op::all_gather, out, in, 0});
  }
  std::unique_ptr<CommWork> broadcast(const Tensor& t, int root) override {
    check_tensor(t, "broadcast", "tensor", false);
    CW_CHECK(root >= 0 && root < size(), "broadcast: root {} is not a rank of a group of {}", root, size());
    return start({Op::broadcast, t, Tensor{}, root});
  }
  void barrier() override { start({Op::barrier, Tensor{}, Tensor{}, 0})->wait(); }

 private:
  std::unique_ptr<CommWork> start(Post post) {
    return std::make_unique<ThreadWork>(group_, rank_, group_.post(rank_, std::move(post)));
  }
  static void check_tensor(const Tensor& t, const char* op, const char* what, bool summed) {
    CW_CHECK(t.device.is_cpu(), "{}: the threads backend holds host tensors; {} is {}", op, what, t.describe());
    CW_CHECK(t.contiguous(), "{}: {} must be contiguous, got {}", op, what, t.describe());
    CW_CHECK(t.defined(), "{}: {} has no data", op, what);
    if (summed)
      CW_CHECK(t.dtype == DType::f64 || t.dtype == DType::f32, "{}: the threads backend sums f64 or f32; {} is {}", op,
               what, t.describe());
  }
  static void check_pair(const Tensor& out, const Tensor& in, const char* op, bool sizes_ok, const char* rule) {
    CW_CHECK(out.dtype == in.dtype, "{}: out is {} but in is {}", op, out.describe(), in.describe());
    CW_CHECK(sizes_ok, "{}: {} (out {}, in {})", op, rule, out.describe(), in.describe());
  }

  ThreadGroup& group_;
  int rank_;
};

}  // namespace

void run_thread_ranks(int size, const std::function<void(Communicator&)>& fn) {
  CW_CHECK(size >= 1, "run_thread_ranks: a group needs at least one rank, got {}", size);
  ThreadGroup group(size);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<char> cause(static_cast<size_t>(size), 0);  // not vector<bool>: ranks write their own element concurrently
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  // The ranks share the caller's CPU threads: each rank's kernels get an equal part of them (one each
  // when there are more ranks than cores). Each rank opening a team of all of them would put
  // size x cores threads on the cores, and every parallel loop would wait for descheduled threads.
  const int kernel_threads = std::max(1, cpu_threads() / size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      const CpuThreadsScope shared_cores(kernel_threads);
      try {
        ThreadCommunicator comm(group, r);
        fn(comm);
        group.rank_finished(r);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        cause[r] = group.rank_failed(r, e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        cause[r] = group.rank_failed(r, "an exception that is not a std::exception");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // The cause first: the exception that failed the group (the others were released by it).
  for (int r = 0; r < size; ++r)
    if (cause[r]) std::rethrow_exception(errors[r]);
  for (int r = 0; r < size; ++r)
    if (errors[r]) std::rethrow_exception(errors[r]);
}

}  // namespace cw
