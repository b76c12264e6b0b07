#include "tools/data/batches.h"

#include "engine/error.h"
#include "engine/ops/lm_head_loss.h"

#include <fmt/format.h>

namespace cw {

TokenDataset open_training_data(const std::vector<std::string>& specs, const TokenDatasetOptions& format,
                                const BatchOptions& options, std::optional<uint32_t> marker,
                                const std::string& marker_source) {
  TokenDatasetOptions o = format;
  o.read_flags = options.needs_flags();
  o.document_marker = options.documents ? marker : std::nullopt;
  TokenDataset data = TokenDataset::open(specs, o);
  for (const TokenFileInfo& f : data.files()) {
    const std::string flags = token_flags_path(f.path);
    if (options.assistant_loss && !(f.flags_carried & kFlagLoss))
      fail(fmt::format("data.loss = assistant, but token file '{}' has no loss mask ({})", f.path,
                       f.flags_carried ? fmt::format("its flags file '{}' holds document starts only", flags)
                                       : fmt::format("no flags file '{}' beside it", flags)),
           "make chat data with chunkwise tokenize --chat-jsonl (it writes the mask of the assistant's tokens), or "
           "set data.loss = all");
    if (options.documents && !(f.flags_carried & kFlagDocStart) && !marker)
      fail(fmt::format("data.documents = true, but token file '{}' stores no document starts (no flags file '{}' "
                       "beside it) and the tokenizer {} has no BOS token to find them by",
                       f.path, flags, marker_source),
           "re-tokenize the data with chunkwise tokenize (it writes the flags file), set data.tokenizer to the "
           "tokenizer that made it, or set data.documents = false");
  }
  return data;
}

Batch batch_of_windows(const WindowSet& set, std::span<const int64_t> windows, const BatchOptions& options) {
  const int64_t B = static_cast<int64_t>(windows.size()), T = set.seq_len();
  CW_CHECK(B > 0, "a batch of no windows");
  Batch batch = window_batch(set.ids(windows), B, T);
  if (!options.needs_flags()) return batch;
  CW_CHECK(set.has_flags(), "batch with documents or a loss mask from token data opened without its flags");
  int32_t* labels = batch.labels.tensor.ptr<int32_t>();
  std::vector<std::vector<int64_t>> starts(static_cast<size_t>(B));
  for (int64_t r = 0; r < B; ++r) {
    const std::span<const uint8_t> flags = set.window_flags(windows[static_cast<size_t>(r)]);
    int32_t* row = labels + r * T;
    if (options.assistant_loss)
      for (int64_t t = 0; t < T; ++t)
        if (!(flags[static_cast<size_t>(t + 1)] & kFlagLoss)) row[t] = kIgnoreLabel;
    if (options.documents) {
      std::vector<int64_t>& s = starts[static_cast<size_t>(r)];
      s.push_back(0);  // the window's first token opens a document, wherever its text began
      for (int64_t t = 1; t < T; ++t)
        if (flags[static_cast<size_t>(t)] & kFlagDocStart) s.push_back(t);
      // The one start set_documents cannot see: the last target's, just past the inputs.
      if (flags[static_cast<size_t>(T)] & kFlagDocStart) row[T - 1] = kIgnoreLabel;
    }
  }
  if (options.documents) set_documents(batch, std::move(starts), options.document_positions);
  return batch;
}

}  // namespace cw
