#include "optim/schedule.h"

#include "engine/ops/lm_head_loss.h"
#include "engine/random.h"
#include "optim/chunks.h"
#include "optim/options.h"

namespace cw {

int64_t Batch::supervised() const {
  int64_t n = 0;
  const int32_t* l = labels.tensor.ptr<int32_t>();
  for (int64_t i = 0; i < labels.tensor.numel(); ++i) n += l[i] != kIgnoreLabel;
  return n;
}

Batch causal_lm_batch(const std::vector<int32_t>& ids, int64_t B, int64_t T) {
  CW_CHECK(static_cast<int64_t>(ids.size()) == B * T, "{} ids for a batch of {} x {}", ids.size(), B, T);
  Batch b{OwnedTensor(DType::i32, {B, T}), OwnedTensor(DType::i32, {B, T})};
  int32_t* x = b.ids.tensor.ptr<int32_t>();
  int32_t* y = b.labels.tensor.ptr<int32_t>();
  for (int64_t s = 0; s < B; ++s)
    for (int64_t t = 0; t < T; ++t) {
      x[s * T + t] = ids[static_cast<size_t>(s * T + t)];
      y[s * T + t] = t + 1 < T ? ids[static_cast<size_t>(s * T + t + 1)] : kIgnoreLabel;
    }
  return b;
}

Batch window_batch(const std::vector<uint32_t>& w, int64_t B, int64_t T) {
  CW_CHECK(static_cast<int64_t>(w.size()) == B * (T + 1), "{} ids for {} windows of {} + 1", w.size(), B, T);
  Batch b{OwnedTensor(DType::i32, {B, T}), OwnedTensor(DType::i32, {B, T})};
  for (int64_t s = 0; s < B; ++s)
    for (int64_t t = 0; t < T; ++t) {
      b.ids.tensor.ptr<int32_t>()[s * T + t] = static_cast<int32_t>(w[static_cast<size_t>(s * (T + 1) + t)]);
      b.labels.tensor.ptr<int32_t>()[s * T + t] = static_cast<int32_t>(w[static_cast<size_t>(s * (T + 1) + t + 1)]);
    }
  return b;
}

Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(B * T));
  for (auto& id : ids) id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return causal_lm_batch(ids, B, T);
}

void set_documents(Batch& batch, std::vector<std::vector<int64_t>> doc_starts, bool document_positions) {
  const int64_t B = batch.B(), T = batch.T();
  CW_CHECK(static_cast<int64_t>(doc_starts.size()) == B, "document starts for {} sequences, the batch has {}",
           doc_starts.size(), B);
  int32_t* labels = batch.labels.tensor.ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t>& starts = doc_starts[static_cast<size_t>(b)];
    CW_CHECK(!starts.empty() && starts.front() == 0, "sequence {}: its first document must start at 0", b);
    for (size_t i = 1; i < starts.size(); ++i) {
      CW_CHECK(starts[i] > starts[i - 1] && starts[i] < T,
               "sequence {}: document starts must ascend within [0, {}), got {} after {}", b, T, starts[i],
               starts[i - 1]);
      labels[b * T + starts[i] - 1] = kIgnoreLabel;  // the target there opens the next document
    }
  }
  batch.doc_starts = std::move(doc_starts);
  batch.document_positions = document_positions;
}

namespace {
// The index of `word` in `words` (an enum's words, in its order); any other word throws one line
// naming the option `key` and the words.
size_t word_index(std::string_view key, const std::vector<std::string_view>& words, std::string_view word) {
  for (size_t i = 0; i < words.size(); ++i)
    if (word == words[i]) return i;
  std::string listed;
  for (std::string_view w : words) listed += (listed.empty() ? "" : " | ") + std::string(w);
  fail(fmt::format("{} must be one of {}, got {}", key, listed, toml_string(word)));
}
}  // namespace

std::vector<std::string_view> schedule_names() { return {"full", "checkpointed", "seco", "spaco"}; }

std::string_view schedule_name(ScheduleKind kind) { return schedule_names()[static_cast<size_t>(kind)]; }

ScheduleKind parse_schedule_kind(std::string_view name) {
  return static_cast<ScheduleKind>(word_index("schedule.name", schedule_names(), name));
}

std::vector<std::string_view> recompute_names() { return {"auto", "full", "selective", "none"}; }

std::string_view recompute_name(RecomputeMode mode) { return recompute_names()[static_cast<size_t>(mode)]; }

RecomputeMode parse_recompute_mode(std::string_view word) {
  return static_cast<RecomputeMode>(word_index("schedule.recompute", recompute_names(), word));
}

// ScheduleOptions::validate(): optim/options.cpp, beside the table of the options.

Arena& Schedule::arena_on(Device device) {
  if (!(arena_.device() == device)) arena_ = Arena(device);
  return arena_;
}

std::unique_ptr<Schedule> Schedule::create(const ScheduleOptions& o) {
  o.validate();
  if (o.chunk == kAuto || o.offload_window == kAuto)
    fail(fmt::format("schedule.{} = auto is chosen by the planner before the run (train, bench and plan do it)",
                     o.chunk == kAuto ? "chunk" : "offload_window"),
         "give a number here, or resolve it with resolve_auto_schedule (tools/planner/planner.h)");
  switch (o.kind) {
    case ScheduleKind::seco: return make_seco_schedule(o);
    case ScheduleKind::spaco: return make_spaco_schedule(o);
    default: return make_full_schedule(o);  // full and checkpointed: one chunk of the whole sequence
  }
}

}  // namespace cw
