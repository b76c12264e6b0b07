#include "optim/adamw.h"

#include "engine/ops/adamw_update.h"

#include "model/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <utility>
#include <vector>

namespace cw {
namespace {

void check_same_table(const ParamSet& a, const ParamSet& b, const char* what_a, const char* what_b) {
  CW_CHECK(a.size() == b.size() && a.numel() == b.numel(), "AdamW: {} ({} tensors, {} elements) and {} ({} tensors, {} elements) differ",
           what_a, a.size(), a.numel(), what_b, b.size(), b.numel());
  for (size_t i = 0; i < a.size(); ++i)
    CW_CHECK(a.specs()[i].name == b.specs()[i].name && a.specs()[i].shape == b.specs()[i].shape,
             "AdamW: tensor #{} is {} in {} but {} in {}", i, a[i].describe(), what_a, b[i].describe(), what_b);
}

void check_float_dtype(DType t, const char* what) {
  CW_CHECK(t == DType::f32 || t == DType::f64, "AdamW: {} must be f32 or f64, got {}", what, dtype_name(t));
}

std::string bool_text(bool b) { return b ? "true" : "false"; }

}  // namespace

void AdamWOptions::validate() const {
  const auto in_unit = [](double b) { return std::isfinite(b) && b >= 0.0 && b < 1.0; };
  if (!in_unit(beta1)) fail(fmt::format("optimizer.beta1 = {} is not in [0, 1)", beta1), "the usual value is 0.9");
  if (!in_unit(beta2)) fail(fmt::format("optimizer.beta2 = {} is not in [0, 1)", beta2), "the usual values are 0.95 to 0.999");
  if (!(std::isfinite(eps) && eps > 0.0)) fail(fmt::format("optimizer.eps = {} must be positive", eps), "the usual value is 1e-8");
  if (!(std::isfinite(weight_decay) && weight_decay >= 0.0))
    fail(fmt::format("optimizer.weight_decay = {} must be >= 0", weight_decay), "use 0 for no decay; the usual value is 0.1");
}

AdamW::AdamW(const ParamSet& like, const AdamWOptions& options) : options_(options) {
  options_.validate();
  check_float_dtype(like.dtype(), "the master weights");
  exp_avg_ = ParamSet::like(like, like.dtype());  // zero-filled by Buffer
  exp_avg_sq_ = ParamSet::like(like, like.dtype());
}

AdamW::AdamW(const LlamaConfig& config, DType dtype, const AdamWOptions& options, Device device)
    : AdamW(ParamSet(config, dtype, device), options) {}

bool adamw_decays(const AdamWOptions& options, const ParamSpec& spec) {
  if (spec.is_norm() || spec.is_bias()) return options.decay_norms;
  if (spec.role == ParamRole::embedding) return options.decay_embeddings;
  return true;  // linear weights and an untied lm_head
}

bool AdamW::decays(const ParamSpec& spec) const { return adamw_decays(options_, spec); }

std::vector<DecayRun> decay_runs(const ParamSet& like, const AdamWOptions& options, int64_t begin, int64_t end) {
  std::vector<DecayRun> runs;
  int64_t offset = 0;
  for (size_t i = 0; i < like.size(); ++i) {
    const int64_t n = like[i].numel();
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + n);
    if (lo < hi) runs.push_back({lo, hi - lo, adamw_decays(options, like.specs()[i]) ? options.weight_decay : 0.0});
    offset += n;
  }
  return runs;
}

void AdamW::step(const ParamSet& params, const ParamSet& grads, double lr, const ParamSet* compute_copy) {
  CW_CHECK(std::isfinite(lr) && lr >= 0.0, "AdamW: learning rate {} must be finite and >= 0", lr);
  check_same_table(params, exp_avg_, "the parameters", "the optimizer state");
  check_same_table(grads, exp_avg_, "the gradients", "the optimizer state");
  CW_CHECK(params.dtype() == exp_avg_.dtype(), "AdamW: parameters are {} but the optimizer state is {}",
           dtype_name(params.dtype()), dtype_name(exp_avg_.dtype()));
  check_float_dtype(grads.dtype(), "the gradients");

  ++step_;
  // One formula, in engine/ops/adamw_update.h: the same op updates CPU and GPU parameter sets.
  for (size_t i = 0; i < params.size(); ++i) {
    const double wd = decays(params.specs()[i]) ? options_.weight_decay : 0.0;
    adamw_update(params[i], exp_avg_[i], exp_avg_sq_[i], grads[i], compute_copy ? (*compute_copy)[i] : Tensor{},
                 AdamWHyper{lr, options_.beta1, options_.beta2, options_.eps, wd, step_});
  }
}

void AdamW::save(const std::string& path) const {
  // Device state is staged through host copies (the writer reads host memory).
  ParamSet m_host, v_host;
  const ParamSet* m = &exp_avg_;
  const ParamSet* v = &exp_avg_sq_;
  if (!exp_avg_.device().is_cpu()) {
    m_host = ParamSet::like(exp_avg_, exp_avg_.dtype(), Device::host());
    v_host = ParamSet::like(exp_avg_sq_, exp_avg_sq_.dtype(), Device::host());
    copy_params(m_host, exp_avg_);
    copy_params(v_host, exp_avg_sq_);
    m = &m_host;
    v = &v_host;
  }
  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.reserve(2 * exp_avg_.size());
  for (size_t i = 0; i < m->size(); ++i) tensors.emplace_back("exp_avg/" + m->specs()[i].name, (*m)[i]);
  for (size_t i = 0; i < v->size(); ++i) tensors.emplace_back("exp_avg_sq/" + v->specs()[i].name, (*v)[i]);
  // "{}" prints the shortest text that reads back to the same double.
  const std::map<std::string, std::string> metadata = {
      {"step", fmt::format("{}", step_)},
      {"beta1", fmt::format("{}", options_.beta1)},
      {"beta2", fmt::format("{}", options_.beta2)},
      {"eps", fmt::format("{}", options_.eps)},
      {"weight_decay", fmt::format("{}", options_.weight_decay)},
      {"decay_norms", bool_text(options_.decay_norms)},
      {"decay_embeddings", bool_text(options_.decay_embeddings)},
  };
  write_safetensors(path, tensors, metadata);
}

void AdamW::load(const std::string& path) {
  const SafetensorsReader reader(path);
  const char* stored_dtype = exp_avg_.dtype() == DType::f64 ? "F64" : "F32";
  const std::string hint = "the optimizer state must come from a run of the same model and master-weight dtype";

  const auto meta = reader.metadata().find("step");
  if (meta == reader.metadata().end()) fail(fmt::format("{}: optimizer state has no \"step\" metadata", path), hint);
  char* end = nullptr;
  const long long step = std::strtoll(meta->second.c_str(), &end, 10);
  if (meta->second.empty() || *end != '\0' || step < 0)
    fail(fmt::format("{}: optimizer state metadata \"step\" = \"{}\" is not a non-negative integer", path, meta->second));

  // Every expected tensor, checked before anything is read so a bad file leaves the state intact.
  std::map<std::string, bool> expected;
  for (const char* prefix : {"exp_avg/", "exp_avg_sq/"}) {
    for (size_t i = 0; i < exp_avg_.size(); ++i) {
      const ParamSpec& s = exp_avg_.specs()[i];
      const std::string name = prefix + s.name;
      expected[name] = true;
      const SafetensorsEntry* e = reader.find(name);
      if (!e) fail(fmt::format("{}: optimizer state lacks tensor '{}'", path, name), hint);
      if (e->shape != s.shape)
        fail(fmt::format("{}: optimizer state tensor '{}' has shape [{}], expected [{}]", path, name,
                         fmt::join(e->shape, ", "), fmt::join(s.shape, ", ")),
             hint);
      // Restoring bit-exactly needs the stored precision to be the state's.
      if (e->dtype != stored_dtype)
        fail(fmt::format("{}: optimizer state tensor '{}' is {}, expected {}", path, name, e->dtype, stored_dtype), hint);
    }
  }
  for (const SafetensorsEntry& e : reader.entries())
    if (!expected.count(e.name)) fail(fmt::format("{}: unexpected tensor '{}' in optimizer state", path, e.name), hint);

  ParamSet m = ParamSet::like(exp_avg_, exp_avg_.dtype(), Device::host());
  ParamSet v = ParamSet::like(exp_avg_sq_, exp_avg_sq_.dtype(), Device::host());
  for (size_t i = 0; i < m.size(); ++i) {
    reader.read_into("exp_avg/" + m.specs()[i].name, m[i]);
    reader.read_into("exp_avg_sq/" + v.specs()[i].name, v[i]);
  }
  if (!exp_avg_.device().is_cpu()) {  // read on the host, then into the device state
    copy_params(exp_avg_, m);
    copy_params(exp_avg_sq_, v);
  } else {
    exp_avg_ = std::move(m);
    exp_avg_sq_ = std::move(v);
  }
  step_ = step;
}

// ---- AdamWShard ----

namespace {
std::map<std::string, std::string> hyper_metadata(const AdamWOptions& o) {
  return {{"beta1", fmt::format("{}", o.beta1)},
          {"beta2", fmt::format("{}", o.beta2)},
          {"eps", fmt::format("{}", o.eps)},
          {"weight_decay", fmt::format("{}", o.weight_decay)},
          {"decay_norms", bool_text(o.decay_norms)},
          {"decay_embeddings", bool_text(o.decay_embeddings)}};
}

// A metadata value that must be a non-negative integer.
int64_t metadata_integer(const SafetensorsReader& reader, const std::string& path, const std::string& key,
                         const std::string& hint) {
  const auto it = reader.metadata().find(key);
  if (it == reader.metadata().end()) fail(fmt::format("{}: optimizer shard has no \"{}\" metadata", path, key), hint);
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || v < 0)
    fail(fmt::format("{}: optimizer shard metadata \"{}\" = \"{}\" is not a non-negative integer", path, key, it->second),
         hint);
  return v;
}
}  // namespace

AdamWShard::AdamWShard(const ParamSet& like, int64_t begin, int64_t end, const AdamWOptions& options)
    : options_(options), begin_(begin), end_(end), numel_(like.numel()) {
  options_.validate();
  check_float_dtype(like.dtype(), "the master weights");
  CW_CHECK(0 <= begin && begin <= end && end <= like.numel(), "AdamWShard: range [{}, {}) is not inside [0, {})", begin,
           end, like.numel());
  pieces_ = decay_runs(like, options_, begin, end);
  exp_avg_ = OwnedTensor::on(like.device(), like.dtype(), {end - begin});  // zero-filled
  exp_avg_sq_ = OwnedTensor::on(like.device(), like.dtype(), {end - begin});
}

void AdamWShard::step(const ParamSet& params, const ParamSet& grads, double lr, const ParamSet* compute_copy) {
  CW_CHECK(std::isfinite(lr) && lr >= 0.0, "AdamW: learning rate {} must be finite and >= 0", lr);
  CW_CHECK(params.numel() == numel_ && grads.numel() == numel_,
           "AdamWShard: the shard is of a vector of {} elements; parameters have {}, gradients {}", numel_,
           params.numel(), grads.numel());
  CW_CHECK(params.dtype() == exp_avg_.tensor.dtype, "AdamWShard: parameters are {} but the optimizer state is {}",
           dtype_name(params.dtype()), dtype_name(exp_avg_.tensor.dtype));
  check_float_dtype(grads.dtype(), "the gradients");
  ++step_;
  const Tensor p = params.flat(), g = grads.flat(), c = compute_copy ? compute_copy->flat() : Tensor{};
  for (const DecayRun& piece : pieces_) {
    const int64_t local = piece.begin - begin_;
    adamw_update(p.slice(0, piece.begin, piece.length), exp_avg_.tensor.slice(0, local, piece.length),
                 exp_avg_sq_.tensor.slice(0, local, piece.length), g.slice(0, piece.begin, piece.length),
                 compute_copy ? c.slice(0, piece.begin, piece.length) : Tensor{},
                 AdamWHyper{lr, options_.beta1, options_.beta2, options_.eps, piece.weight_decay, step_});
  }
}

void AdamWShard::save(const std::string& path) const {
  const DType dt = exp_avg_.tensor.dtype;
  OwnedTensor m = OwnedTensor::of_shape(dt, std::vector<int64_t>{end_ - begin_});
  OwnedTensor v = OwnedTensor::of_shape(dt, std::vector<int64_t>{end_ - begin_});
  copy_convert(m, exp_avg_.tensor);  // from the device where the state lives there
  copy_convert(v, exp_avg_sq_.tensor);
  std::map<std::string, std::string> metadata = hyper_metadata(options_);
  metadata["step"] = fmt::format("{}", step_);
  metadata["begin"] = fmt::format("{}", begin_);
  metadata["end"] = fmt::format("{}", end_);
  metadata["numel"] = fmt::format("{}", numel_);
  write_safetensors(path, {{"exp_avg", m.tensor}, {"exp_avg_sq", v.tensor}}, metadata);
}

void AdamWShard::load(const std::string& path) {
  const SafetensorsReader reader(path);
  const std::string hint =
      "a sharded optimizer state resumes on the same parallel.dp and parallel.zero, with the same model and "
      "master-weight dtype";
  const int64_t step = metadata_integer(reader, path, "step", hint);
  const int64_t begin = metadata_integer(reader, path, "begin", hint), end = metadata_integer(reader, path, "end", hint);
  const int64_t numel = metadata_integer(reader, path, "numel", hint);
  if (begin != begin_ || end != end_ || numel != numel_)
    fail(fmt::format("{}: optimizer shard covers [{}, {}) of {} parameters; this rank's shard is [{}, {}) of {}", path,
                     begin, end, numel, begin_, end_, numel_),
         hint);
  const char* stored_dtype = exp_avg_.tensor.dtype == DType::f64 ? "F64" : "F32";
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    const SafetensorsEntry* e = reader.find(name);
    if (!e) fail(fmt::format("{}: optimizer shard lacks tensor '{}'", path, name), hint);
    if (e->shape != std::vector<int64_t>{end_ - begin_} || e->dtype != stored_dtype)
      fail(fmt::format("{}: optimizer shard tensor '{}' is {} [{}], expected {} [{}]", path, name, e->dtype,
                       fmt::join(e->shape, ", "), stored_dtype, end_ - begin_),
           hint);
  }
  if (reader.entries().size() != 2) fail(fmt::format("{}: optimizer shard holds tensors besides exp_avg and exp_avg_sq", path), hint);
  OwnedTensor m = OwnedTensor::of_shape(exp_avg_.tensor.dtype, std::vector<int64_t>{end_ - begin_});
  OwnedTensor v = OwnedTensor::of_shape(exp_avg_.tensor.dtype, std::vector<int64_t>{end_ - begin_});
  reader.read_into("exp_avg", m.tensor);
  reader.read_into("exp_avg_sq", v.tensor);
  copy_convert(exp_avg_.tensor, m);
  copy_convert(exp_avg_sq_.tensor, v);
  step_ = step;
}

double grad_global_norm(const ParamSet& grads) {
  const Tensor f = grads.flat();
  check_float_dtype(f.dtype, "the gradients");
  return std::sqrt(sum_squares(f));
}

double clip_grad_norm(const ParamSet& grads, double max_norm) {
  const double norm = grad_global_norm(grads);
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) scale_inplace(grads.flat(), max_norm / norm);
  return norm;
}

namespace {
template <class T> bool finite_all(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}
}  // namespace

bool all_finite(const ParamSet& set) {
  const Tensor f = set.flat();
  if (!f.device.is_cpu()) return f.dtype == DType::i32 || std::isfinite(sum_squares(f));
  switch (f.dtype) {
    case DType::f64: return finite_all(f.ptr<double>(), f.numel());
    case DType::f32: return finite_all(f.ptr<float>(), f.numel());
    case DType::bf16: {
      // Inf and NaN are the values whose exponent bits are all ones.
      const uint16_t* bits = static_cast<const uint16_t*>(f.data);
      for (int64_t i = 0; i < f.numel(); ++i)
        if ((bits[i] & 0x7f80u) == 0x7f80u) return false;
      return true;
    }
    case DType::i32: return true;
  }
  return true;
}

}  // namespace cw
