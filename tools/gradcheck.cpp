#include "tools/gradcheck.h"

#include "engine/random.h"
#include "model/checkpoint.h"
#include "tools/model_io.h"
#include "model/safetensors.h"
#include "parallel/tensor_parallel.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>

namespace cw {

namespace {
Batch load_batch(const GradcheckOptions& o, int64_t vocab) {
  if (o.tokens_file.empty()) return random_batch(o.batch, o.seq, vocab, o.seed + 1);
  return read_token_batch(o.tokens_file, o.batch, o.seq, vocab);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += fmt::format("{}{}", i ? ", " : "", s[i]);
  return r + "]";
}

// Gradient of the batch loss under a schedule, into a fresh zeroed ParamSet.
StepStats gradients(const ScheduleOptions& so, LlamaModel& model, const Batch& batch, const ParamSet& grads) {
  auto schedule = Schedule::create(so);
  return schedule->step(model, batch, grads);
}

double dot(const Tensor& a, const Tensor& b) {
  OwnedTensor a64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{a.numel()});
  OwnedTensor b64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{b.numel()});
  copy_convert(a64, a.view({a.numel()}));
  copy_convert(b64, b.view({b.numel()}));
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a64.tensor.ptr<double>()[i] * b64.tensor.ptr<double>()[i];
  return s;
}

// One row per tensor: rel_err = ||a - b|| / ||b|| and the worst element, then the loss; returns the
// worst rel_err. `ref_name` names the reference in the header.
double compare_gradients(std::ostream& out, const ParamSet& grads, double loss, const ParamSet& ref_grads,
                         double ref_loss, const std::string& ref_name) {
  double max_rel = 0;
  out << fmt::format("{:<48} {:<14} {:>13} {:>10} {:>28}\n", "tensor", "shape", fmt::format("||g_{}||", ref_name),
                     "rel_err", fmt::format("worst element (ours / {})", ref_name));
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor a = grads[i], b = ref_grads[i];
    OwnedTensor a64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{a.numel()});
    OwnedTensor b64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{b.numel()});
    copy_convert(a64, a.view({a.numel()}));
    copy_convert(b64, b.view({b.numel()}));
    double num = 0, den = 0, worst_abs = -1, wa = 0, wb = 0;
    for (int64_t k = 0; k < a.numel(); ++k) {
      const double x = a64.tensor.ptr<double>()[k], y = b64.tensor.ptr<double>()[k];
      num += (x - y) * (x - y);
      den += y * y;
      if (std::abs(x - y) > worst_abs) {
        worst_abs = std::abs(x - y);
        wa = x;
        wb = y;
      }
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    max_rel = std::max(max_rel, rel);
    out << fmt::format("{:<48} {:<14} {:>13.6e} {:>10.3e} {:>28}\n", grads.specs()[i].name,
                       shape_str(grads.specs()[i].shape), std::sqrt(den), rel, fmt::format("{:.6e} / {:.6e}", wa, wb));
  }
  const double loss_rel = std::abs(loss - ref_loss) / std::max(std::abs(ref_loss), 1e-300);
  max_rel = std::max(max_rel, loss_rel);
  out << fmt::format("{:<48} {:<14} {:>13.6e} {:>10.3e} {:>28}\n", "loss", "[]", std::abs(ref_loss), loss_rel,
                     fmt::format("{:.10e} / {:.10e}", loss, ref_loss));
  return max_rel;
}

// What one tensor-parallel rank leaves behind for the comparison.
struct RankResult {
  std::optional<ParamSet> grads;  // the rank's shard of the gradients
  StepStats stats;
  size_t buffer_high_water = 0, buffer_requested = 0, buffer_largest = 0;
  int64_t buffer_requests = 0;
};

// The schedule on P = parallel.tp thread ranks, each with its shard of `model` (same values), then
// the ranks' gradients assembled into `grads` (full shapes). Returns the step's loss (rank 0's; every
// rank's must agree, checked bitwise like the replicated gradients). Prints one line per rank.
double tensor_parallel_gradients(const GradcheckOptions& o, const LlamaModel& model, const Batch& batch,
                                 const ParamSet& grads, std::ostream& out) {
  const int P = static_cast<int>(o.parallel.tp);
  const TensorParallelOptions tpo{o.parallel.sequence_parallel, o.parallel.tp_regather};
  std::vector<RankResult> ranks(static_cast<size_t>(P));
  run_thread_ranks(P, [&](Communicator& comm) {
    TensorParallel group(comm, tpo);
    LlamaModel shard(model.full_config(), model.dtype(), Device::host(), &group);
    shard_parameters(shard.params(), model.params(), comm.rank(), P);
    RankResult& r = ranks[static_cast<size_t>(comm.rank())];
    r.grads.emplace(shard.config(), model.dtype());
    r.stats = gradients(o.schedule, shard, batch, *r.grads);
    reduce_replicated_gradients(*r.grads, group);  // the optimizer step's TP reduction
    r.buffer_high_water = group.buffer().capacity_bytes();
    r.buffer_requested = group.buffer().requested_bytes();
    r.buffer_largest = group.buffer().largest_request();
    r.buffer_requests = group.buffer().requests();
  });
  bool replicas_agree = true;
  for (int r = 0; r < P; ++r) {
    const RankResult& rr = ranks[static_cast<size_t>(r)];
    unshard_parameters(grads, *rr.grads, r, P, /*with_replicated=*/r == 0);
    for (size_t i = 0; i < grads.size(); ++i)
      if (tp_split_dim(grads.specs()[i].role) < 0 &&
          std::memcmp((*rr.grads)[i].data, (*ranks[0].grads)[i].data, (*rr.grads)[i].bytes()) != 0)
        replicas_agree = false;
    replicas_agree = replicas_agree && rr.stats.loss == ranks[0].stats.loss;
    out << fmt::format("tp rank {}: activations high-water {} B; reusable buffer high-water {} B (largest request {} "
                       "B) for {} requests of {} B in all\n",
                       r, rr.stats.activation_high_water, rr.buffer_high_water, rr.buffer_largest, rr.buffer_requests,
                       rr.buffer_requested);
  }
  out << fmt::format("replicated gradients and loss bitwise equal on every tp rank: {}\n", replicas_agree ? "yes" : "NO");
  if (!replicas_agree) fail("tensor-parallel ranks disagree on a replicated gradient or the loss");
  return ranks[0].stats.loss;
}
}  // namespace

int run_gradcheck(const GradcheckOptions& o, std::ostream& out) {
  o.schedule.validate();
  o.parallel.validate();
  LlamaConfig config = LlamaConfig::resolve(o.model);
  if (o.tie_embeddings >= 0) config.tie_word_embeddings = o.tie_embeddings == 1;
  const DType dtype = parse_dtype(o.dtype);
  if (dtype == DType::bf16) fail("gradcheck runs in f64 or f32 on the CPU", "use --dtype f64");
  if (o.seq < 2 || o.batch < 1) fail(fmt::format("gradcheck needs --seq >= 2 and --batch >= 1 (got {} and {})", o.seq, o.batch));
  const std::string against =
      !o.against.empty() ? o.against : o.parallel.tp > 1 ? "single" : o.schedule.name == "full" ? "fd" : "full";
  if (against != "fd" && against != "full" && against != "single")
    fail(fmt::format("unknown --against '{}'", against), "use fd, full or single");
  if (o.parallel.tp > 1 && against != "single")
    fail(fmt::format("--tp {} checks the tensor-parallel ranks against one process", o.parallel.tp),
         "use --against single (the default with --tp)");
  const double tol = o.tol >= 0 ? o.tol : (against == "fd" ? 1e-7 : (dtype == DType::f64 ? 1e-12 : 1e-5));

  LlamaModel model(config, dtype);
  load_or_init(model, o.model, o.seed, o.norm_jitter);
  const Batch batch = load_batch(o, config.vocab_size);

  if (against == "single") {
    if (!o.save_grads.empty()) fail("--save-grads writes the gradients of --against fd or full", "drop --save-grads");
    out << fmt::format("gradcheck: model {} ({} parameters, {} layers, tied={}), dtype {}, batch {} x {} tokens, "
                       "schedule {} (chunk {}, bwd chunk {}), tp {} (sequence parallel {}, regather {}) against single\n",
                       o.model, config.parameter_count(), config.num_hidden_layers, config.tie_word_embeddings,
                       o.dtype, o.batch, o.seq, o.schedule.name, o.schedule.chunk, o.schedule.bwd_chunk, o.parallel.tp,
                       o.parallel.sequence_parallel, o.parallel.tp_regather);
    ParamSet grads(config, dtype), ref_grads(config, dtype);
    const double loss = tensor_parallel_gradients(o, model, batch, grads, out);
    const StepStats ref_st = gradients(o.schedule, model, batch, ref_grads);
    const double max_rel = compare_gradients(out, grads, loss, ref_grads, ref_st.loss, "single");
    out << fmt::format("max_rel_err={:.3e}\n", max_rel);
    if (max_rel > tol) {
      out << fmt::format("FAIL: max_rel_err {:.3e} exceeds --tol {:.1e}\n", max_rel, tol);
      return 1;
    }
    return 0;
  }

  ParamSet grads(config, dtype);
  const StepStats st = gradients(o.schedule, model, batch, grads);
  out << fmt::format("gradcheck: model {} ({} parameters, {} layers, tied={}), dtype {}, batch {} x {} tokens, "
                     "schedule {} (chunk {}, bwd chunk {}, visited {}/{}), against {}\n",
                     o.model, config.parameter_count(), config.num_hidden_layers, config.tie_word_embeddings, o.dtype,
                     o.batch, o.seq, o.schedule.name, o.schedule.chunk, o.schedule.bwd_chunk, st.chunks_visited,
                     st.chunks, against);
  double max_rel = 0;
  Arena arena;
  if (against == "fd") {
    out << fmt::format("{:<48} {:<14} {:>13} {:>13} {:>10}\n", "tensor", "shape", "g.v", "fd", "rel_err");
    for (size_t i = 0; i < model.params().size(); ++i) {
      const Tensor p = model.params()[i];
      OwnedTensor original = OwnedTensor::of_shape(dtype, std::vector<int64_t>{p.numel()});
      copy_convert(original, p.view({p.numel()}));
      OwnedTensor dir = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
      double worst = 0, worst_gv = 0, worst_fd = 0;
      for (int d = 0; d < o.directions; ++d) {
        fill_normal(dir, o.seed ^ 0xd1ec7, i * 1000 + static_cast<uint64_t>(d));
        double norm = 0;
        for (int64_t k = 0; k < p.numel(); ++k) norm += dir.tensor.ptr<double>()[k] * dir.tensor.ptr<double>()[k];
        scale_inplace(dir, 1.0 / std::sqrt(norm));
        auto loss_at = [&](double t) {
          // p = original + t * dir, computed in f64 and stored in the model's dtype
          OwnedTensor moved = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
          copy_convert(moved, original);
          for (int64_t k = 0; k < p.numel(); ++k) moved.tensor.ptr<double>()[k] += t * dir.tensor.ptr<double>()[k];
          copy_convert(p.view({p.numel()}), moved);
          return batch_loss(model, batch, 0, arena);
        };
        const double h = o.step;
        const double fd = (-loss_at(2 * h) + 8 * loss_at(h) - 8 * loss_at(-h) + loss_at(-2 * h)) / (12 * h);
        copy_convert(p.view({p.numel()}), original);
        const double gv = dot(grads[i], dir);
        const double denom = std::max(std::abs(gv), std::abs(fd));
        const double rel = denom > 0 ? std::abs(gv - fd) / denom : 0.0;
        if (rel >= worst) {
          worst = rel;
          worst_gv = gv;
          worst_fd = fd;
        }
      }
      max_rel = std::max(max_rel, worst);
      out << fmt::format("{:<48} {:<14} {:>13.6e} {:>13.6e} {:>10.3e}\n", model.params().specs()[i].name,
                         shape_str(model.params().specs()[i].shape), worst_gv, worst_fd, worst);
    }
    out << fmt::format("loss={:.17g}\n", st.loss);
  } else {
    ScheduleOptions ref;
    ref.name = "full";
    ParamSet ref_grads(config, dtype);
    const StepStats ref_st = gradients(ref, model, batch, ref_grads);
    max_rel = compare_gradients(out, grads, st.loss, ref_grads, ref_st.loss, "full");
  }
  if (!o.save_grads.empty()) {
    std::vector<OwnedTensor> keep;
    std::vector<std::pair<std::string, Tensor>> tensors;
    keep.emplace_back(DType::f64, std::initializer_list<int64_t>{1});
    keep.back().tensor.ptr<double>()[0] = st.loss;
    tensors.emplace_back("loss", keep.back().tensor);
    for (size_t i = 0; i < grads.size(); ++i) {
      keep.push_back(OwnedTensor::of_shape(DType::f64, grads.specs()[i].shape));
      copy_convert(keep.back(), grads[i]);
      tensors.emplace_back(grads.specs()[i].name, keep.back().tensor);
    }
    write_safetensors(o.save_grads, tensors, {{"format", "pt"}, {"content", "chunkwise gradcheck gradients"}});
    out << fmt::format("wrote loss and {} gradients to {}\n", grads.size(), o.save_grads);
  }
  out << fmt::format("max_rel_err={:.3e}\n", max_rel);
  if (max_rel > tol) {
    out << fmt::format("FAIL: max_rel_err {:.3e} exceeds --tol {:.1e}\n", max_rel, tol);
    return 1;
  }
  return 0;
}

}  // namespace cw
