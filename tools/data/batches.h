// Training batches from token windows, with the data's documents and loss mask (data.documents,
// data.positions, data.loss).
//
// A batch row is one window of T+1 tokens (tools/data/tokens.h): inputs its first T, labels its last
// T (optim/schedule.h's window_batch). The flags of the window, looked up at its offset in the token
// stream, add what the options ask for:
//   assistant_loss  label t (which predicts token t+1) stays only where token t+1 carries the loss
//                   bit; every other label becomes -100.
//   documents       the batch's doc_starts: 0 and every t in [1, T) where a document starts
//                   (set_documents, which also sets label t-1 to -100 there, so that no token is
//                   trained to predict the first token of the next document); and label T-1 is -100
//                   too when the window's last target, token T, opens a document. RoPE positions
//                   restart at each start, or count from the window's start (document_positions).
// Windows are cut as before, across documents: the sampler and its saved state do not change.
//
// Where the document starts come from: a token file's flags file (chunkwise tokenize writes one),
// else the tokenizer's BOS at every occurrence (open_training_data's marker). The loss mask comes
// only from flags files (chunkwise tokenize --chat-jsonl).
// Tests: tests/tools/test_data.cpp.
#pragma once

#include "optim/schedule.h"
#include "tools/data/tokens.h"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cw {

struct BatchOptions {
  bool documents = false;           // doc_starts from the data (data.documents)
  bool document_positions = true;   // RoPE positions restart at each document (data.positions = document)
  bool assistant_loss = false;      // labels only where the loss mask marks the target (data.loss = assistant)
  bool needs_flags() const { return documents || assistant_loss; }
  bool operator==(const BatchOptions&) const = default;
};

// Opens token data (train or eval) as batches with `options` need it: with the flags, document
// starts where a file's flags have none from `marker` (the BOS of data.tokenizer, named by
// `marker_source` in errors). Fails naming the file when one lacks what the options ask: a loss
// mask (assistant_loss), or document starts when there is no marker either.
TokenDataset open_training_data(const std::vector<std::string>& specs, const TokenDatasetOptions& format,
                                const BatchOptions& options, std::optional<uint32_t> marker,
                                const std::string& marker_source);

// The batch of the given windows of `set` (one row each, in order). Needs `set`'s flags when the
// options need them (open_training_data).
Batch batch_of_windows(const WindowSet& set, std::span<const int64_t> windows, const BatchOptions& options);

}  // namespace cw
