#include "parallel/data_parallel.h"

#include "engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace cw {

DataParallel::DataParallel(Communicator& comm, TrainingState& state, const ParallelOptions& options, TensorParallel* tp)
    : comm_(comm),
      state_(state),
      tp_(tp),
      zero_(static_cast<int>(options.zero)),
      cp_(static_cast<int>(options.cp)),
      numel_(state.grads().numel()),
      shard_len_(state.grads().numel() / comm.size()) {
  options.validate();
  CW_CHECK(comm.device() == state.device(), "data parallel: the communicator's tensors live on {} but the model is on {}",
           device_name(comm.device()), device_name(state.device()));
  CW_CHECK(options.dp * options.cp == comm.size(),
           "data parallel: parallel.dp x parallel.cp = {} x {} but the communicator has {} ranks", options.dp,
           options.cp, comm.size());
  CW_CHECK(!tp || state.model().tensor_parallel() == tp,
           "data parallel: the model must be built with the tensor-parallel group it is given");
  CW_CHECK(shard_len_ >= 1, "data parallel: {} parameters cannot be sharded over {} ranks", numel_, comm.size());
  CW_CHECK(state.has_full_optimizer() == (zero_ == 0),
           "data parallel: the training state must keep the whole AdamW state exactly when parallel.zero = 0 (zero is {})",
           zero_);
  if (zero_ >= 1) optimizer_shard_.emplace(state.master(), shard_begin(rank()), shard_end(rank()), state.adamw_options());
  // Buckets from the end of the vector: the order in which the backward completes the gradient.
  // ZeRO 2 also cuts them at the shard boundaries, so that each lies in one owner's shard and is
  // reduced to it.
  const double elements = options.bucket_mb * double(1 << 20) / static_cast<double>(dtype_size(state.grads().dtype()));
  const int64_t bucket = std::max<int64_t>(1, static_cast<int64_t>(elements));
  for (int64_t end = numel_; end > 0;) {
    int64_t begin = std::max<int64_t>(0, end - bucket);
    int owner = -1;
    if (zero_ == 2) {
      owner = std::min(comm.size() - 1, static_cast<int>((end - 1) / shard_len_));  // the shard holding end - 1
      begin = std::max(begin, shard_begin(owner));
    }
    buckets_.push_back({begin, end, owner});
    end = begin;
  }
}

int64_t DataParallel::shard_begin(int r) const { return static_cast<int64_t>(r) * shard_len_; }
int64_t DataParallel::shard_end(int r) const { return r == size() - 1 ? numel_ : static_cast<int64_t>(r + 1) * shard_len_; }

Tensor DataParallel::even_part(const ParamSet& set) const { return set.flat().slice(0, 0, shard_len_ * size()); }
Tensor DataParallel::remainder(const ParamSet& set) const {
  return set.flat().slice(0, shard_len_ * size(), numel_ - shard_len_ * size());
}
Tensor DataParallel::own_shard(const ParamSet& set) const {
  return set.flat().slice(0, shard_begin(rank()), shard_end(rank()) - shard_begin(rank()));
}

void DataParallel::sum_over_ranks(std::vector<double>& values) { sum_host_values(comm_, values); }

void DataParallel::launch_ready(int64_t from) {
  const Tensor flat = state_.grads().flat();
  for (; next_bucket_ < buckets_.size() && buckets_[next_bucket_].begin >= from; ++next_bucket_) {
    const Bucket& b = buckets_[next_bucket_];
    const Tensor part = flat.slice(0, b.begin, b.end - b.begin);
    pending_.push_back(b.owner < 0 ? comm_.all_reduce(part) : comm_.reduce(part, b.owner));
    if (in_backward_) ++launched_in_backward_;
  }
}

void DataParallel::finish_reduction() {
  launch_ready(0);  // whatever the last backward did not report (none when it reported its end)
  for (auto& work : pending_) work->wait();
  pending_.clear();
  if (tp_)
    reduce_replicated_gradients(state_.grads(), *tp_, zero_ == 2 ? shard_begin(rank()) : 0,
                                zero_ == 2 ? shard_end(rank()) : numel_);
}

DataParallelStep DataParallel::compute_gradients(Schedule& schedule, const std::vector<Batch>& micro,
                                                 uint64_t step_index) {
  CW_CHECK(!micro.empty(), "data parallel: a step needs at least one micro-batch");
  state_.grads().zero();
  // 1. The global count of supervised labels: every rank's normaliser (a context-parallel group's
  // shared micro-batches counted by its first rank).
  std::vector<double> count{0.0};
  if (rank() % cp_ == 0)
    for (const Batch& b : micro) count[0] += static_cast<double>(b.supervised());
  sum_over_ranks(count);

  DataParallelStep out;
  out.supervised = static_cast<int64_t>(count[0]);
  const StepHooks given = schedule.hooks();  // the caller's progress hook stays; the rest are this step's
  StepHooks hooks;
  hooks.progress = given.progress;
  hooks.sum_over_ranks = [this](std::vector<double>& v) { sum_over_ranks(v); };
  next_bucket_ = 0;
  launched_in_backward_ = 0;
  pending_.clear();
  double loss = 0;
  try {
    for (size_t m = 0; m < micro.size(); ++m) {
      // 2-3. Only the last micro-batch's last backward completes the gradient: it carries the hook.
      if (m + 1 == micro.size()) {
        hooks.grads_final = [this](int64_t from) { launch_ready(from); };
        in_backward_ = true;
      }
      schedule.set_hooks(hooks);
      out.stats = schedule.step(state_.model(), micro[m], state_.grads(), count[0], step_index + m);
      loss += out.stats.loss;
    }
  } catch (...) {
    schedule.set_hooks(given);
    in_backward_ = false;
    throw;
  }
  schedule.set_hooks(given);
  in_backward_ = false;
  finish_reduction();
  out.buckets = static_cast<int64_t>(next_bucket_);
  out.buckets_in_backward = launched_in_backward_;
  // 4. The global mean loss: the sum of the ranks' shares.
  std::vector<double> total{loss};
  sum_over_ranks(total);
  out.loss = total[0];
  return out;
}

double DataParallel::gradient_norm() {
  const bool split = tp_ && tp_->size() > 1;
  if (zero_ < 2 && !split) return grad_global_norm(state_.grads());  // reduced whole on every rank: the same bits
  // Squares of the rank's part (zero 2: its shard; else everything), split tensors apart from
  // replicated ones when TP ranks hold the split ones' other parts.
  const ParamSet& g = state_.grads();
  const int64_t begin = zero_ == 2 ? shard_begin(rank()) : 0, end = zero_ == 2 ? shard_end(rank()) : numel_;
  std::vector<double> squares{0.0, 0.0};  // split, replicated
  int64_t offset = 0;
  for (size_t i = 0; i < g.size(); offset += g.specs()[i].numel(), ++i) {
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + g.specs()[i].numel());
    if (lo < hi) squares[split && tp_split_dim(g.specs()[i]) < 0 ? 1 : 0] += sum_squares(g.flat().slice(0, lo, hi - lo));
  }
  if (zero_ == 2) sum_over_ranks(squares);  // every shard of this TP shard's vector
  if (split) {  // every TP rank's split tensors; the replicated ones once
    std::vector<double> split_squares{squares[0]};
    sum_host_values(tp_->communicator(), split_squares);
    squares[0] = split_squares[0];
  }
  return std::sqrt(squares[0] + squares[1]);
}

double DataParallel::clip_gradients(double max_norm) {
  const double norm = gradient_norm();
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm)
    scale_inplace(zero_ < 2 ? state_.grads().flat() : own_shard(state_.grads()), max_norm / norm);
  return norm;
}

void DataParallel::optimizer_step(double lr) {
  if (zero_ == 0) {
    state_.optimizer_step(lr);
    return;
  }
  // The shard of the master weights from the shard of the reduced gradient, then every rank's shard
  // to every rank (in place), then the compute copy from the whole master weights.
  optimizer_shard_->step(state_.master(), state_.grads(), lr);
  const ParamSet& master = state_.master();
  const Tensor even = even_part(master);
  std::vector<std::unique_ptr<CommWork>> works;
  works.push_back(comm_.all_gather(even, even.slice(0, rank() * shard_len_, shard_len_)));
  if (numel_ > shard_len_ * size()) works.push_back(comm_.broadcast(remainder(master), size() - 1));
  for (auto& w : works) w->wait();
  state_.sync_compute_copy();
}

size_t DataParallel::optimizer_bytes() const { return optimizer_shard_ ? optimizer_shard_->bytes() : state_.master().bytes() * 2; }

}  // namespace cw
