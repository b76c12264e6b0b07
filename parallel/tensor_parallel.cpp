#include "parallel/tensor_parallel.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace cw {

namespace {
// all = [rows_0; ...; rows_P-1]: the same trailing shape, P times the rows, both contiguous.
void check_rows(const Communicator& comm, const Tensor& all, const Tensor& rows, const char* op) {
  CW_CHECK(all.contiguous() && rows.contiguous(), "{}: tensors must be contiguous ({} and {})", op, all.describe(),
           rows.describe());
  CW_CHECK(all.dtype == rows.dtype && all.ndim == rows.ndim && all.ndim >= 1, "{}: {} against {}", op, all.describe(),
           rows.describe());
  CW_CHECK(all.size(0) == rows.size(0) * comm.size(), "{}: {} rows for {} ranks of {} rows", op, all.size(0),
           comm.size(), rows.size(0));
  for (int d = 1; d < all.ndim; ++d)
    CW_CHECK(all.size(d) == rows.size(d), "{}: {} against {}", op, all.describe(), rows.describe());
}
}  // namespace

void copy_to_tp_backward(Communicator& comm, const Tensor& d_x) {
  CW_CHECK(d_x.contiguous(), "copy_to_tp_backward: {} must be contiguous", d_x.describe());
  comm.all_reduce(d_x)->wait();
}

void reduce_from_tp_forward(Communicator& comm, const Tensor& x) {
  CW_CHECK(x.contiguous(), "reduce_from_tp_forward: {} must be contiguous", x.describe());
  comm.all_reduce(x)->wait();
}

void gather_from_sp_forward(Communicator& comm, const Tensor& all, const Tensor& rows) {
  check_rows(comm, all, rows, "gather_from_sp_forward");
  comm.all_gather(all, rows)->wait();
}

void gather_from_sp_backward(Communicator& comm, const Tensor& d_rows, const Tensor& d_all) {
  check_rows(comm, d_all, d_rows, "gather_from_sp_backward");
  comm.reduce_scatter(d_rows, d_all)->wait();
}

void scatter_to_sp_forward(Communicator& comm, const Tensor& rows, const Tensor& all) {
  check_rows(comm, all, rows, "scatter_to_sp_forward");
  comm.reduce_scatter(rows, all)->wait();
}

void scatter_to_sp_backward(Communicator& comm, const Tensor& d_all, const Tensor& d_rows) {
  check_rows(comm, d_all, d_rows, "scatter_to_sp_backward");
  comm.all_gather(d_all, d_rows)->wait();
}

// ---- ActivationBuffer ----

namespace {
const char* slot_name(TpSlot slot) {
  switch (slot) {
    case TpSlot::gathered_input: return "gathered_input";
    case TpSlot::gathered_grad: return "gathered_grad";
    case TpSlot::partial_sum: return "partial_sum";
  }
  return "?";
}
}  // namespace

Tensor ActivationBuffer::acquire(TpSlot slot, DType dtype, std::initializer_list<int64_t> shape) {
  const size_t i = static_cast<size_t>(slot);
  CW_CHECK(!lent_[i], "the tensor-parallel buffer's slot {} is lent already (each slot has one user at a time)",
           slot_name(slot));
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  if (slots_[i].bytes() < bytes) {
    slots_[i] = Buffer();  // free the smaller one first: the high-water mark is the largest, not the sum
    slots_[i] = Buffer(bytes, device_);
  }
  lent_[i] = true;
  requested_bytes_ += bytes;
  largest_request_ = std::max(largest_request_, bytes);
  ++requests_;
  return Tensor::packed(slots_[i].data(), dtype, device_, shape);
}

void ActivationBuffer::release(TpSlot slot) {
  const size_t i = static_cast<size_t>(slot);
  CW_CHECK(lent_[i], "the tensor-parallel buffer's slot {} released but not lent", slot_name(slot));
  lent_[i] = false;
}

size_t ActivationBuffer::capacity_bytes() const {
  size_t n = 0;
  for (const Buffer& b : slots_) n += b.bytes();
  return n;
}

// ---- TensorParallel ----

TensorParallel::TensorParallel(Communicator& comm, const TensorParallelOptions& options)
    : comm_(comm), options_(options), buffer_(comm.device()) {
  if (options.regather && !options.sequence_parallel)
    fail("parallel.tp_regather needs parallel.sequence_parallel: without it no activation is gathered, so there is "
         "nothing to gather again",
         "set parallel.sequence_parallel = true (--sequence-parallel) or tp_regather = false");
}

// ---- parameters ----

namespace {
// A column-parallel linear's bias is split with its rows (Qwen2's q, k, v biases).
bool column_parallel(ParamRole linear) {
  return linear == ParamRole::wq || linear == ParamRole::wk || linear == ParamRole::wv || linear == ParamRole::w_gate ||
         linear == ParamRole::w_up || linear == ParamRole::q_bias || linear == ParamRole::k_bias ||
         linear == ParamRole::v_bias;
}
bool row_parallel(ParamRole linear) { return linear == ParamRole::wo || linear == ParamRole::w_down; }
}  // namespace

int tp_split_dim(const ParamSpec& spec) {
  switch (spec.role) {
    case ParamRole::lora_a: return row_parallel(spec.adapts) ? 1 : -1;  // A [r, in]: in is split for o, down
    case ParamRole::lora_b: return column_parallel(spec.adapts) ? 0 : -1;  // B [out, r]: out for q, k, v, gate, up
    default: return column_parallel(spec.role) ? 0 : row_parallel(spec.role) ? 1 : -1;
  }
}

bool tp_partial_gradient(const ParamSpec& spec) {
  return (spec.is_adapter() && tp_split_dim(spec) < 0) || spec.role == ParamRole::q_norm || spec.role == ParamRole::k_norm;
}

namespace {
// Rank `rank`'s block of a full tensor along the split dimension (the whole tensor when replicated).
Tensor block_of(const Tensor& full, const ParamSpec& spec, int rank, int size) {
  const int dim = tp_split_dim(spec);
  if (dim < 0) return full;
  const int64_t n = full.size(dim) / size;
  return full.slice(dim, rank * n, n);
}

void check_pair(const ParamSet& full, const ParamSet& shard, int rank, int size) {
  CW_CHECK(size >= 1 && rank >= 0 && rank < size, "tensor-parallel rank {} of {}", rank, size);
  CW_CHECK(full.size() == shard.size(), "full model of {} tensors against a shard of {}", full.size(), shard.size());
  for (size_t i = 0; i < full.size(); ++i) {
    const ParamSpec& f = full.specs()[i];
    const ParamSpec& s = shard.specs()[i];
    const int dim = tp_split_dim(f);
    bool ok = f.role == s.role && f.shape.size() == s.shape.size();
    for (size_t d = 0; ok && d < f.shape.size(); ++d)
      ok = f.shape[d] == (static_cast<int>(d) == dim ? s.shape[d] * size : s.shape[d]);
    CW_CHECK(ok, "{}: a shard of {} ranks does not fit the full tensor (not a tp_shard_config shard?)", f.name, size);
  }
}
}  // namespace

void shard_parameters(const ParamSet& shard, const ParamSet& full, int rank, int size) {
  check_pair(full, shard, rank, size);
  for (size_t i = 0; i < full.size(); ++i)
    copy_convert(shard[i], block_of(full[i], full.specs()[i], rank, size));
}

void unshard_parameters(const ParamSet& full, const ParamSet& shard, int rank, int size, bool with_replicated) {
  check_pair(full, shard, rank, size);
  for (size_t i = 0; i < full.size(); ++i) {
    const ParamSpec& spec = full.specs()[i];
    if (tp_split_dim(spec) >= 0 || with_replicated) copy_convert(block_of(full[i], spec, rank, size), shard[i]);
  }
}

void gather_parameters(const ParamSet& full, const ParamSet& shard, Communicator& comm) {
  const int P = comm.size();
  check_pair(full, shard, comm.rank(), P);
  CW_CHECK(shard.device() == comm.device(), "gather_parameters: the shard is on {}, the communicator's tensors on {}",
           device_name(shard.device()), device_name(comm.device()));
  for (size_t i = 0; i < full.size(); ++i) {
    const ParamSpec& spec = full.specs()[i];
    const Tensor mine = shard[i];
    if (tp_split_dim(spec) < 0) {
      copy_convert(full[i], mine);
      continue;
    }
    const int64_t n = mine.numel();
    const OwnedTensor gathered = OwnedTensor::on(comm.device(), mine.dtype, {P * n});
    comm.all_gather(gathered, mine.view({n}))->wait();
    OwnedTensor host = OwnedTensor::of_shape(mine.dtype, std::vector<int64_t>{P * n});
    copy_convert(host, gathered);  // after the gather: wait() ordered the device's stream behind it
    // Split ones are linears' weights [out, in] or their biases [out].
    CW_CHECK(mine.ndim == 1 || mine.ndim == 2, "gather_parameters: {} is not a matrix or a vector", full.specs()[i].name);
    for (int r = 0; r < P; ++r) {
      const Tensor block = host.tensor.slice(0, r * n, n);
      copy_convert(block_of(full[i], spec, r, P), mine.ndim == 1 ? block : block.view({mine.size(0), mine.size(1)}));
    }
  }
}

void reduce_replicated_gradients(const ParamSet& grads, TensorParallel& tp, int64_t begin, int64_t end) {
  if (tp.size() == 1) return;
  if (end < 0) end = grads.numel();
  CW_CHECK(0 <= begin && begin <= end && end <= grads.numel(), "reduce_replicated_gradients: range [{}, {}) of {}",
           begin, end, grads.numel());
  // Every collective is issued before the first wait, so a backend may run them together.
  std::vector<std::unique_ptr<CommWork>> pending;
  const Tensor flat = grads.flat();
  int64_t offset = 0;  // of tensor i in the flat vector (table order)
  for (size_t i = 0; i < grads.size(); offset += grads.specs()[i].numel(), ++i) {
    const ParamSpec& spec = grads.specs()[i];
    // Split tensors: each rank's own. Replicated ones: whole on every rank, unless each rank saw only
    // its rows (sequence parallelism) or its part of the linear (an adapter's replicated half).
    if (tp_split_dim(spec) >= 0 || !(tp.sequence_parallel() || tp_partial_gradient(spec))) continue;
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + grads.specs()[i].numel());
    if (lo < hi) pending.push_back(tp.communicator().all_reduce(flat.slice(0, lo, hi - lo)));
  }
  for (auto& w : pending) w->wait();
}

}  // namespace cw
