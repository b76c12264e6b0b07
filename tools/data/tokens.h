// Token data: files of token ids, the train/eval split into fixed-length windows, and the seeded
// window sampler whose state a checkpoint records.
//
// File formats (every integer little-endian):
//   shard     llm.c's format: a header of 256 int32, then the ids. header[0] is the magic: 20240520
//             means uint16 ids, 20240801 means uint32 ids; header[1] is a version (any is accepted
//             and reported); header[2] is the token count. The file size must be exactly
//             1024 + count * token_bytes.
//   u16, u32  headerless ids (a raw `.bin`); the size must be a multiple of the token size.
//   flags     a sidecar `<token file>.flags` beside any token file (chunkwise tokenize writes one with
//             every shard): what each token is, one byte per token, after a header of 256 int32.
//             header[0] is the magic 1179932483 (the bytes "CWTF"), header[1] the version (1, the only
//             one read), header[2] the token count (equal to the token file's), header[3] the bits the
//             file carries: 1 a loss mask, 2 document starts. Byte i of the body holds token i's bits:
//             bit 0 (1) the token is a target the loss trains on (chat data: the assistant's tokens),
//             bit 1 (2) a document starts at the token. A bit the header does not carry is 0 in every
//             byte, and with document starts the first token starts one (files hold whole documents).
//             The file size must be exactly 1024 + count. In numpy:
//                 h = np.fromfile(p, np.int32, 256); f = np.fromfile(p, np.uint8, offset=1024)
//                 loss = (f & 1) != 0; starts = np.flatnonzero(f & 2)
// Ids are held in memory as uint32 whatever the file stores, and every id is checked against the
// vocabulary size when it is loaded, so a tokenizer/model mismatch fails at startup, not as an
// out-of-range embedding lookup mid-run. A flags file is checked when its token file is opened (magic,
// version, count against the token file, size) and its bytes when they are read (no bit the header does
// not carry, the first token a document start), every failure naming the file.
//
// A dataset is a list of paths and glob(3) patterns; each pattern's matches are taken in sorted
// order, and the files are concatenated in that order into one token stream.
//
// Windows. With sequence length T, window w of a stream is the T+1 tokens starting at w*T: the
// inputs are its first T tokens and the targets its last T (the caller shifts). Consecutive windows
// share one token (a window's last target is the next one's first input), so every token is an
// input exactly once. A stream of N tokens holds floor((N-1)/T) windows; the tail after the last
// whole window is not used. Windows do span file boundaries: files hold whole documents that each
// start with BOS, so a file boundary is no different from a document boundary inside one shard
// (llm.c's loader does the same), and no tokens are dropped at each file's end. A window's flags
// (when the data has them) are the T+1 bytes at the same stream offset: the loss bit of target t is
// flags[t+1], the document starts inside the window are its bytes with bit 1 set.
//
// Split. By fraction: E = round(fraction * W) windows (at least one when fraction > 0) taken from
// the end of the stream: the eval stream is the last E*T+1 tokens and the train windows are cut
// from the tokens before it, so no eval token is ever a training input or target. Or by a separate
// list of eval files (which must not repeat a training file).
//
// Sampling. Each epoch visits every training window exactly once, in an order that is a
// Fisher-Yates shuffle driven by a cw::Rng seeded from (seed, epoch). The order is therefore a pure
// function of (seed, epoch), and the sampler's whole state is {seed, epoch, position in epoch}: a
// run restored from it draws exactly the batches the uninterrupted run would have. A batch that
// reaches the end of an epoch continues with the start of the next one (no window is dropped and
// no batch is short). Eval batches go through the eval windows in stream order.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cw {

// llm.c shard constants.
constexpr int32_t kShardMagicU16 = 20240520;
constexpr int32_t kShardMagicU32 = 20240801;
constexpr int64_t kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
// A vocabulary size that accepts every uint32 id: for tools that only inspect files.
constexpr int64_t kAnyVocab = int64_t{1} << 32;

enum class TokenFormat : uint8_t { shard, u16, u32 };

// Token flags file constants (the header comment).
constexpr int32_t kFlagsMagic = 1179932483;  // "CWTF" read as a little-endian int32
constexpr int32_t kFlagsVersion = 1;
constexpr uint8_t kFlagLoss = 1;      // the token is a target the loss trains on
constexpr uint8_t kFlagDocStart = 2;  // a document starts at the token
// "a.bin" -> "a.bin.flags".
std::string token_flags_path(const std::string& token_file);

// A token file's flags: which bits it carries (kFlagLoss | kFlagDocStart) and one byte per token.
struct TokenFlags {
  uint8_t carried = 0;
  std::vector<uint8_t> bits;
  bool operator==(const TokenFlags&) const = default;
};

// What a flags file's header says, checked against its size; `expected_count` (>= 0) is the token
// file's count, which it must equal. Fails naming the file.
struct TokenFlagsInfo {
  std::string path;
  int64_t count = 0;
  uint8_t carried = 0;
};
TokenFlagsInfo inspect_token_flags(const std::string& path, int64_t expected_count = -1);
// The whole file, header and every byte checked.
TokenFlags read_token_flags(const std::string& path, int64_t expected_count = -1);

// "shard", "u16", "u32"; anything else fails naming `what` (the flag or config key it came from).
TokenFormat parse_token_format(const std::string& name, const std::string& what = "token format");
const char* token_format_name(TokenFormat f);

// What a file's header (or size) says, checked against its size; no ids are read.
struct TokenFileInfo {
  std::string path;
  TokenFormat format = TokenFormat::shard;
  int token_bytes = 2;       // 2 or 4, as stored in the file
  int32_t version = 0;       // the shard's header[1]; 0 for headerless files
  int64_t count = 0;         // tokens in the file
  int64_t data_offset = 0;   // byte offset of the first id (1024 for shards, 0 otherwise)
  int64_t stream_offset = 0; // index of the file's first token in its dataset's stream
  uint8_t flags_carried = 0; // the bits of its flags file (TokenDataset::open looks for one); 0: none
};

// Reads and checks the header/size of one file. `format` shard accepts both magics.
TokenFileInfo inspect_token_file(const std::string& path, TokenFormat format);
// Reads all ids of one file, each checked to be below vocab_size.
std::vector<uint32_t> read_token_file(const std::string& path, TokenFormat format, int64_t vocab_size,
                                      TokenFileInfo* info = nullptr);

// Writes an llm.c shard: uint16 ids (magic 20240520, version 1) when every id is below 65536 and
// the vocabulary (if given) has at most 65536 tokens, else uint32 ids (magic 20240801, version 7);
// those are the values llm.c's own writer uses, so its loaders accept our shards. Atomic: written to
// a temporary file beside `path`, fsynced, then renamed over it, so a crash never leaves a
// half-written shard under the final name. With `flags` (one byte per token) the flags file is
// written the same way beside it; without, a flags file left there from an earlier shard is
// removed, since it no longer describes the tokens. Both files are complete before either is put in
// place: the old flags file goes first, then the shard, then the new flags file, so an interrupted
// write leaves at worst a shard without flags, never flags that belong to other tokens.
TokenFileInfo write_token_shard(const std::string& path, std::span<const uint32_t> tokens, int64_t vocab_size = 0,
                                const TokenFlags* flags = nullptr);

// Expands paths and glob(3) patterns (an entry with * ? or [ is a pattern) into a file list: each
// pattern's matches sorted bytewise, entries kept in the order given; a match that is a flags file
// beside its token file (a.bin.flags beside a.bin) is left out. A pattern matching nothing
// fails naming it; a file listed twice fails (it would silently double that file's weight).
// Literal paths are not checked here: opening them reports a missing file. `what` names the kind of
// input in messages ("token data", "text").
std::vector<std::string> expand_token_paths(const std::vector<std::string>& specs,
                                            const std::string& what = "token data");

struct TokenDatasetOptions {
  TokenFormat format = TokenFormat::shard;
  int64_t vocab_size = 0;  // required: every id must lie in [0, vocab_size)
  // Read the flags files into one flags stream beside the tokens (TokenDataset::shared_flags): a file
  // without one contributes zeros. Flags files are checked against their token files either way.
  bool read_flags = false;
  // With read_flags: a file whose flags carry no document starts gets one at every token equal to
  // this (the BOS its tokenizer writes before each document).
  std::optional<uint32_t> document_marker = std::nullopt;
};

class WindowSet;

// The token stream of a list of files, loaded into memory.
class TokenDataset {
 public:
  TokenDataset() = default;
  static TokenDataset open(const std::vector<std::string>& specs, const TokenDatasetOptions& options);
  // An in-memory stream (tests, or ids produced in-process); `name` stands for the file in errors.
  static TokenDataset from_tokens(std::vector<uint32_t> tokens, int64_t vocab_size,
                                  const std::string& name = "<memory>", std::optional<TokenFlags> flags = std::nullopt);

  const std::vector<uint32_t>& tokens() const { return *tokens_; }
  // The stream as shared with the WindowSets cut from it.
  const std::shared_ptr<const std::vector<uint32_t>>& shared_tokens() const { return tokens_; }
  // The flags stream, one byte per token (read_flags); null when the flags were not read.
  const std::shared_ptr<const std::vector<uint8_t>>& shared_flags() const { return flags_; }
  int64_t size() const { return static_cast<int64_t>(tokens_->size()); }
  int64_t vocab_size() const { return vocab_size_; }
  const std::vector<TokenFileInfo>& files() const { return files_; }
  // "'a.bin'", "'a.bin' and 2 more files": how errors name the dataset.
  std::string describe() const;

  // All windows of sequence length T; fails when the stream is shorter than one window.
  WindowSet windows(int64_t seq_len) const;

 private:
  std::shared_ptr<const std::vector<uint32_t>> tokens_ = std::make_shared<const std::vector<uint32_t>>();
  std::shared_ptr<const std::vector<uint8_t>> flags_;
  std::vector<TokenFileInfo> files_;
  int64_t vocab_size_ = 0;
};

// A run of consecutive windows over a shared token stream: window w is the tokens
// [first_token + w*T, first_token + w*T + T]. Cheap to copy; keeps the stream (and its flags) alive.
class WindowSet {
 public:
  WindowSet() = default;
  WindowSet(std::shared_ptr<const std::vector<uint32_t>> tokens, int64_t first_token, int64_t count,
            int64_t seq_len, std::shared_ptr<const std::vector<uint8_t>> flags = nullptr);

  int64_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  int64_t seq_len() const { return seq_len_; }
  int64_t first_token() const { return first_token_; }
  // The T+1 ids of window w.
  std::span<const uint32_t> window(int64_t w) const;
  // The ids of the given windows, one row of T+1 each.
  std::vector<uint32_t> ids(std::span<const int64_t> windows) const;
  // Its first token's offset in the stream.
  int64_t window_start(int64_t w) const;
  bool has_flags() const { return flags_ != nullptr; }
  // The T+1 flag bytes of window w (has_flags()).
  std::span<const uint8_t> window_flags(int64_t w) const;
  // Fixed-order batches (eval): batch i holds windows [i*B, min((i+1)*B, size())), row-major, so
  // the last batch may have fewer rows: rows = result.size() / (T+1).
  int64_t num_batches(int64_t batch) const;
  std::vector<uint32_t> batch_in_order(int64_t index, int64_t batch) const;
  // The indices of batch `index`'s windows.
  std::vector<int64_t> batch_windows(int64_t index, int64_t batch) const;

 private:
  std::shared_ptr<const std::vector<uint32_t>> tokens_;
  std::shared_ptr<const std::vector<uint8_t>> flags_;
  int64_t first_token_ = 0, count_ = 0, seq_len_ = 0;
};

struct WindowSplit {
  WindowSet train, eval;
};
// The last windows of `data` for eval (see the header comment); fraction in [0, 1). Fails, naming
// the data, when fewer than one training window would remain.
WindowSplit split_by_fraction(const TokenDataset& data, int64_t seq_len, double eval_fraction);
// Train and eval from separate datasets; fails if they share a file.
WindowSplit split_by_files(const TokenDataset& train, const TokenDataset& eval, int64_t seq_len);

// Everything needed to resume sampling exactly. num_windows is not state but a guard: restoring
// over data with a different window count would silently change every later batch.
struct SamplerState {
  uint64_t seed = 0;
  int64_t epoch = 0;        // epochs completed
  int64_t position = 0;     // windows drawn in the current epoch, in [0, num_windows)
  int64_t num_windows = 0;

  bool operator==(const SamplerState&) const = default;
  nlohmann::json to_json() const;
  // Fails naming `source` and the key when one is missing or of the wrong type.
  static SamplerState from_json(const nlohmann::json& j, const std::string& source);
};

class WindowSampler {
 public:
  WindowSampler(WindowSet windows, uint64_t seed);

  // B windows in this epoch's shuffled order, B*(T+1) ids row-major.
  std::vector<uint32_t> next_batch(int64_t batch);
  // Data parallel: rank `rank` of `ranks`' own B windows of the global batch. Every rank keeps the
  // same sampler (same seed, same state) and each call draws the whole global batch of ranks x B
  // windows, returning windows [rank B, (rank+1) B) of it: the ranks' batches are disjoint, their
  // concatenation is next_batch(ranks x B), and the state after the call is the same on every rank
  // (and as one process with batch ranks x B), so resuming needs nothing per rank.
  std::vector<uint32_t> next_rank_batch(int64_t batch, int64_t rank, int64_t ranks);
  // The same two as window indices (into windows()), drawn alike: a batch's flags are looked up
  // from them (tools/data/batches.h).
  std::vector<int64_t> next_batch_windows(int64_t batch);
  std::vector<int64_t> next_rank_batch_windows(int64_t batch, int64_t rank, int64_t ranks);
  // The index (into windows()) of the next window, advancing past it.
  int64_t next_window();

  SamplerState state() const;
  // Continues from a saved state; fails if it was saved over a different number of windows.
  void restore(const SamplerState& state);

  const WindowSet& windows() const { return windows_; }
  // This epoch's visiting order (tests, diagnostics).
  const std::vector<int64_t>& order() const { return order_; }

 private:
  void shuffle_for_epoch();

  WindowSet windows_;
  uint64_t seed_ = 0;
  int64_t epoch_ = 0, position_ = 0;
  std::vector<int64_t> order_;
};

}  // namespace cw
