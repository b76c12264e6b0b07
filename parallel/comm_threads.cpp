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
// split(color, key) is a round too: the last rank to post forms the new groups (members ordered by
// key, then by rank) while it holds the lock, and each rank takes its own from the round. A world and
// every group split from it (a family) share one lock, one condition variable and one failure:
// a rank waiting in one group must be released when a rank of another group fails.
//
// Failure never deadlocks. A rank that throws out of run_thread_ranks' function, a mismatch between
// ranks' calls, or a rank that returns while others wait on a collective it never issued, marks the
// family failed: every pending wait and every later call on every rank, in any of its groups, throws,
// naming the cause. A round whose work is in progress is finished before anyone is released, so no
// thread writes into memory its owner has already left.
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

enum class Op { all_reduce, reduce, reduce_scatter, all_gather, all_to_all, broadcast, barrier, split };

const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce: return "reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::all_to_all: return "all_to_all";
    case Op::broadcast: return "broadcast";
    case Op::barrier: return "barrier";
    case Op::split: return "split";
  }
  return "?";
}

// One rank's part of a collective. all_reduce, reduce and broadcast work in place on `out`; split
// uses only color and key.
struct Post {
  Op op = Op::barrier;
  Tensor out, in;
  int root = 0;
  int color = 0, key = 0;

  std::string describe() const {
    switch (op) {
      case Op::all_reduce: return fmt::format("all_reduce {} [{}]", dtype_name(out.dtype), out.numel());
      case Op::reduce: return fmt::format("reduce {} [{}] to rank {}", dtype_name(out.dtype), out.numel(), root);
      case Op::broadcast: return fmt::format("broadcast {} [{}] from rank {}", dtype_name(out.dtype), out.numel(), root);
      case Op::reduce_scatter:
      case Op::all_gather:
      case Op::all_to_all:
        return fmt::format("{} {} out [{}] in [{}]", op_name(op), dtype_name(out.dtype), out.numel(), in.numel());
      case Op::barrier: return "barrier";
      case Op::split: return "split";
    }
    return "?";
  }
  // The parts every rank must agree on (each rank's out/in ratio is checked when it posts; a split's
  // color and key are the rank's own).
  bool same_collective(const Post& o) const {
    if (op == Op::split || o.op == Op::split) return op == o.op;
    return op == o.op && out.dtype == o.out.dtype && out.numel() == o.out.numel() && in.numel() == o.in.numel() &&
           root == o.root;
  }
};

class ThreadGroup;

// What a split gives one rank: its new group (null for a negative color) and its rank there.
struct SplitPlace {
  ThreadGroup* group = nullptr;
  int rank = -1;
};

struct Round {
  int64_t index = 0;
  std::vector<std::optional<Post>> posts;  // by rank
  int posted = 0;
  bool working = false;   // the last rank to post is doing the round's work, outside the lock
  bool complete = false;  // every rank's outputs hold the result
  std::vector<SplitPlace> split;  // a split round: by rank
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
    case Op::barrier:
    case Op::split: return;  // a split's groups are formed under the lock (ThreadGroup::form_split)
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
    case Op::reduce: {
      const int64_t n = first.out.numel();
      std::vector<char> sum(static_cast<size_t>(n) * elem);
      std::vector<const void*> parts;
      for (const auto& p : posts) parts.push_back(p->out.data);
      sum_into(sum.data(), first.out.dtype, parts, n);
      if (!sum.empty()) std::memcpy(posts[first.root]->out.data, sum.data(), sum.size());
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
    case Op::all_to_all: {  // rank dst's out[src * n, +n) <- rank src's in[dst * n, +n)
      const size_t block = static_cast<size_t>(first.in.numel() / size) * elem;
      for (int dst = 0; dst < size; ++dst)
        for (int src = 0; src < size; ++src)
          if (block)
            std::memcpy(static_cast<char*>(posts[dst]->out.data) + block * src,
                        static_cast<const char*>(posts[src]->in.data) + block * dst, block);
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

std::string describe_members(const std::vector<int>& members) {
  std::string s = "group of world ranks ";
  for (size_t i = 0; i < members.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", members[i]);
  return s + ": ";
}

// A world and the groups split from it: the lock, the condition variable and the failure they share.
struct Family {
  std::mutex mutex;
  std::condition_variable changed;
  std::string failure, hint;                   // non-empty failure: every group is released
  std::vector<std::unique_ptr<ThreadGroup>> groups;  // [0] the world, then each split's groups in creation order
};

class ThreadGroup {
 public:
  // members: the world ranks of this group's ranks 0, 1, ...; world: it is the family's world.
  ThreadGroup(Family& family, std::vector<int> members, bool world)
      : family_(family),
        members_(std::move(members)),
        where_(world ? "" : describe_members(members_)),
        size_(static_cast<int>(members_.size())),
        issued_(static_cast<size_t>(size_), 0),
        finished_(static_cast<size_t>(size_)) {}

  int size() const { return size_; }

  // Posts the rank's next collective; the last rank to post does the round's work before returning
  // (a split's under the lock: it only forms groups).
  std::shared_ptr<Round> post(int rank, Post post) {
    std::unique_lock lock(family_.mutex);
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
        fail_locked(fmt::format("{}collective #{}: rank 0 issued {} but rank {} issued {}", where(), k,
                                round->posts[0]->describe(), q, round->posts[q]->describe()),
                    kSameCollectivesHint);
    throw_if_failed(rank, fmt::format("cannot complete collective #{}", k));
    if (round->posts[0]->op == Op::split) {
      form_split(*round);
    } else {
      round->working = true;
      lock.unlock();
      perform(round->posts);
      lock.lock();
      round->working = false;
    }
    round->complete = true;
    family_.changed.notify_all();
    return round;
  }

  // Blocks until the round is complete; throws if the family failed first. A round in progress is
  // always finished first: its outputs belong to threads that may be about to unwind.
  void wait(int rank, const Round& round) {
    std::unique_lock lock(family_.mutex);
    family_.changed.wait(lock, [&] { return round.complete || (!family_.failure.empty() && !round.working); });
    if (!round.complete) throw_if_failed(rank, fmt::format("collective #{} abandoned", round.index));
  }

  void wait_noexcept(const Round& round) {
    std::unique_lock lock(family_.mutex);
    family_.changed.wait(lock, [&] { return round.complete || (!family_.failure.empty() && !round.working); });
  }

  // World rank `world_rank`'s function threw: release everyone. Returns whether this is the family's
  // first failure (the cause; later failures are its consequences). Call on the world.
  bool rank_failed(int world_rank, const std::string& what) {
    std::lock_guard lock(family_.mutex);
    const bool first = family_.failure.empty();
    if (first) family_.failure = fmt::format("rank {} failed: {}", world_rank, what);
    for (const auto& group : family_.groups) group->mark_finished(world_rank, false);
    family_.changed.notify_all();
    return first;
  }

  // World rank `world_rank`'s function returned: any round of any group it never joined can no longer
  // complete. Call on the world.
  void rank_finished(int world_rank) {
    std::lock_guard lock(family_.mutex);
    for (const auto& group : family_.groups) group->mark_finished(world_rank, true);
    family_.changed.notify_all();
  }

 private:
  // "" for the world; for a split group, which world ranks it holds (so a message places itself).
  const std::string& where() const { return where_; }

  void mark_finished(int world_rank, bool check_open_rounds) {
    for (int q = 0; q < size_; ++q) {
      if (members_[q] != world_rank) continue;
      finished_[q] = true;
      if (check_open_rounds)
        for (const auto& [k, round] : open_)
          if (!round->posts[q]) fail_finished(q, *round);
    }
  }

  // Groups by color (colors < 0: none), members ordered by (key, rank); called with the lock held.
  void form_split(Round& round) {
    std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
    for (int q = 0; q < size_; ++q)
      if (round.posts[q]->color >= 0) by_color[round.posts[q]->color].push_back({round.posts[q]->key, q});
    round.split.assign(static_cast<size_t>(size_), SplitPlace{});
    for (auto& [color, ranks] : by_color) {
      std::sort(ranks.begin(), ranks.end());
      std::vector<int> members;
      for (const auto& [key, q] : ranks) members.push_back(members_[q]);
      family_.groups.push_back(std::make_unique<ThreadGroup>(family_, std::move(members), false));
      for (size_t i = 0; i < ranks.size(); ++i)
        round.split[static_cast<size_t>(ranks[i].second)] = {family_.groups.back().get(), static_cast<int>(i)};
    }
  }

  void throw_if_failed(int rank, const std::string& what) const {
    if (!family_.failure.empty())
      fail(fmt::format("rank {}: {}{}: {}", rank, where(), what, family_.failure), family_.hint);
  }
  void fail_locked(const std::string& message, const std::string& hint) {
    if (family_.failure.empty()) {
      family_.failure = message;
      family_.hint = hint;
    }
    family_.changed.notify_all();
  }
  std::string finished_message(int rank, const Round& round) const {
    for (int q = 0; q < size_; ++q)
      if (round.posts[q])
        return fmt::format("{}rank {} returned after {} collectives, but rank {} issued collective #{} ({})", where(),
                           rank, issued_[rank], q, round.index, round.posts[q]->describe());
    return {};
  }
  void fail_finished(int rank, const Round& round) { fail_locked(finished_message(rank, round), kSameCollectivesHint); }

  Family& family_;
  const std::vector<int> members_;
  const std::string where_;
  const int size_;
  std::vector<int64_t> issued_;                       // per rank: collectives posted so far
  std::map<int64_t, std::shared_ptr<Round>> open_;    // rounds some rank has posted and some has not
  std::vector<bool> finished_;                        // per rank: its function has returned or thrown
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
  std::unique_ptr<CommWork> reduce(const Tensor& t, int root) override {
    check_tensor(t, "reduce", "tensor", true);
    CW_CHECK(root >= 0 && root < size(), "reduce: root {} is not a rank of a group of {}", root, size());
    return start({Op::reduce, t, Tensor{}, root});
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
  std::unique_ptr<CommWork> all_to_all(const Tensor& out, const Tensor& in) override {
    check_tensor(out, "all_to_all", "out", false);
    check_tensor(in, "all_to_all", "in", false);
    check_pair(out, in, "all_to_all", out.numel() == in.numel() && in.numel() % size() == 0,
               "out and in must hold the same elements, a multiple of the group's size");
    const char* o = static_cast<const char*>(out.data);
    const char* i = static_cast<const char*>(in.data);
    CW_CHECK(!(o < i + in.bytes() && i < o + out.bytes()), "all_to_all: out and in overlap (out {}, in {})",
             out.describe(), in.describe());
    return start({Op::all_to_all, out, in, 0});
  }
  std::unique_ptr<CommWork> broadcast(const Tensor& t, int root) override {
    check_tensor(t, "broadcast", "tensor", false);
    CW_CHECK(root >= 0 && root < size(), "broadcast: root {} is not a rank of a group of {}", root, size());
    return start({Op::broadcast, t, Tensor{}, root});
  }
  void barrier() override { start({Op::barrier, Tensor{}, Tensor{}, 0})->wait(); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    Post post{Op::split, Tensor{}, Tensor{}, 0};
    post.color = color < 0 ? -1 : color;
    post.key = key;
    const std::shared_ptr<Round> round = group_.post(rank_, std::move(post));
    group_.wait(rank_, *round);
    const SplitPlace place = round->split[static_cast<size_t>(rank_)];
    if (!place.group) return nullptr;
    return std::make_unique<ThreadCommunicator>(*place.group, place.rank);
  }

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
  Family family;
  std::vector<int> everyone(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) everyone[static_cast<size_t>(r)] = r;
  family.groups.push_back(std::make_unique<ThreadGroup>(family, std::move(everyone), true));
  ThreadGroup& world = *family.groups.front();
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
        ThreadCommunicator comm(world, r);
        fn(comm);
        world.rank_finished(r);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        cause[r] = world.rank_failed(r, e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        cause[r] = world.rank_failed(r, "an exception that is not a std::exception");
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
