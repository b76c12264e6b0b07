#include "tools/data/tokens.h"

#include "model/file.h"

#include "engine/error.h"
#include "engine/random.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cw {

namespace {

// Ids are converted in chunks of this many, so a load never holds the file's raw bytes and its
// uint32 copy at once.
constexpr int64_t kChunkTokens = int64_t{1} << 20;
// Mixed into the sampler's seed so that the data order does not correlate with other streams a
// run derives from the same seed (weight init, SpaCO's chunk choice).
constexpr uint64_t kShuffleDomain = 0xda7a5a3b1e5eedull;

std::string errno_text() { return std::strerror(errno); }

// A token file opened for reading (model/file.h: errors name it as a token file).
FileReader open_for_reading(const std::string& path) {
  return FileReader(path, "token file", "give token files, not directories");
}

int32_t le_i32(const unsigned char* p) {
  return static_cast<int32_t>(uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24);
}

void put_le32(unsigned char* p, uint32_t v) {
  p[0] = static_cast<unsigned char>(v);
  p[1] = static_cast<unsigned char>(v >> 8);
  p[2] = static_cast<unsigned char>(v >> 16);
  p[3] = static_cast<unsigned char>(v >> 24);
}

void check_vocab_size(int64_t vocab_size) {
  CW_CHECK(vocab_size > 0 && vocab_size <= kAnyVocab, "vocabulary size {} for token data: must be in [1, 2^32]",
           vocab_size);
}

[[noreturn]] void fail_bad_id(const std::string& file, int64_t index, int64_t byte_offset, uint32_t id,
                              int64_t vocab_size) {
  const std::string where = byte_offset >= 0 ? fmt::format(" (byte offset {})", byte_offset) : "";
  fail(fmt::format("token file '{}': token #{}{} is id {}, not below the vocabulary size {}", file, index, where,
                   id, vocab_size),
       "tokenizer/vocab mismatch: re-tokenize the data with the model's tokenizer, or use the model config "
       "that matches this data");
}

// Appends the ids of a file already inspected, checking each against the vocabulary.
void load_ids(const TokenFileInfo& info, int64_t vocab_size, std::vector<uint32_t>& out) {
  const FileReader file = open_for_reading(info.path);
  const int64_t expected = info.data_offset + info.count * info.token_bytes;
  if (static_cast<int64_t>(file.size()) != expected)
    fail(fmt::format("token file '{}': size changed to {} bytes since it was inspected ({} expected)", info.path,
                     file.size(), expected),
         "do not rewrite data files during a run");
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(info.count));
  std::vector<unsigned char> raw(static_cast<size_t>(std::min(info.count, kChunkTokens) * info.token_bytes));
  for (int64_t start = 0; start < info.count; start += kChunkTokens) {
    const int64_t n = std::min(kChunkTokens, info.count - start);
    const int64_t offset = info.data_offset + start * info.token_bytes;
    file.read_at(static_cast<uint64_t>(offset), raw.data(), static_cast<size_t>(n * info.token_bytes));
    uint32_t* dst = out.data() + base + start;
    const unsigned char* p = raw.data();
    // Decoded byte by byte: correct on any host byte order, and the compiler turns it into loads.
    if (info.token_bytes == 2) {
      for (int64_t i = 0; i < n; ++i) dst[i] = uint32_t{p[2 * i]} | uint32_t{p[2 * i + 1]} << 8;
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint32_t>(le_i32(p + 4 * i));
    }
    if (vocab_size < kAnyVocab) {
      for (int64_t i = 0; i < n; ++i)
        if (dst[i] >= vocab_size)
          fail_bad_id(info.path, start + i, offset + i * info.token_bytes, dst[i], vocab_size);
    }
  }
}

std::string canonical_or_raw(const std::string& path) {
  std::error_code ec;
  const auto c = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : c.string();
}

// A file written under a temporary name beside its final one (same directory: rename() is atomic),
// fsynced by finish() and put in place by commit(). Destroyed before commit() it deletes the
// temporary, so a failure anywhere leaves nothing under the final name. `what` names the file in
// errors ("token shard", "token flags file").
class PendingFile {
 public:
  PendingFile(std::string path, const char* what)
      : path_(std::move(path)), tmp_(fmt::format("{}.tmp-{}", path_, static_cast<long>(::getpid()))), what_(what) {
    fd_ = FileDescriptor(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd_.is_open())
      fail(fmt::format("{} '{}': cannot create '{}': {}", what_, path_, tmp_, errno_text()),
           "check that the directory exists and is writable");
  }
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;
  ~PendingFile() {
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(const void* data, size_t bytes) { write_all(fd_.get(), tmp_, data, bytes); }
  // The bytes on disk: fsync, then close (whose error also means the write did not complete).
  void finish() {
    if (::fsync(fd_.get()) != 0) fail_write(errno);
    if (const int err = fd_.close(); err != 0) fail_write(err);
  }
  void commit() {
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail_write(errno);
    committed_ = true;
  }

 private:
  [[noreturn]] void fail_write(int err) const {
    fail(fmt::format("{} '{}': write failed: {}", what_, path_, std::strerror(err)),
         "check free disk space and permissions");
  }

  std::string path_, tmp_;
  const char* what_;
  FileDescriptor fd_;
  bool committed_ = false;
};

// The 256-int32 header of a shard or flags file: the given leading values, the rest zero.
std::array<unsigned char, kShardHeaderBytes> file_header(std::initializer_list<int64_t> values) {
  std::array<unsigned char, kShardHeaderBytes> header{};
  size_t at = 0;
  for (const int64_t v : values) put_le32(&header[4 * at++], static_cast<uint32_t>(v));
  return header;
}

void check_flags_bits(const std::string& path, uint8_t carried, std::span<const uint8_t> bits) {
  for (size_t i = 0; i < bits.size(); ++i)
    if (bits[i] & ~carried)
      fail(fmt::format("token flags file '{}': token #{} (byte offset {}) has flags 0x{:02x}, but the header carries "
                       "only 0x{:02x}",
                       path, i, kShardHeaderBytes + static_cast<int64_t>(i), bits[i], carried),
           "the file is corrupt or was not written by chunkwise; re-create it with chunkwise tokenize");
  if ((carried & kFlagDocStart) && !bits.empty() && !(bits[0] & kFlagDocStart))
    fail(fmt::format("token flags file '{}': the first token does not start a document", path),
         "a token file holds whole documents; re-create it with chunkwise tokenize");
}

}  // namespace

std::string token_flags_path(const std::string& token_file) { return token_file + ".flags"; }

TokenFlagsInfo inspect_token_flags(const std::string& path, int64_t expected_count) {
  const FileReader file(path, "token flags file", "give the flags file chunkwise tokenize wrote beside the shard");
  const int64_t size = static_cast<int64_t>(file.size());
  const char* remake = "re-create the shard and its flags with chunkwise tokenize";
  if (size < kShardHeaderBytes)
    fail(fmt::format("token flags file '{}': {} bytes, too small for the {}-byte header", path, size, kShardHeaderBytes),
         remake);
  std::array<unsigned char, kShardHeaderBytes> header{};
  file.read_at(0, header.data(), kShardHeaderBytes);
  if (const int32_t magic = le_i32(&header[0]); magic != kFlagsMagic)
    fail(fmt::format("token flags file '{}': bad magic {} at byte offset 0 (expected {})", path, magic, kFlagsMagic),
         "not a chunkwise flags file; move it away from beside the token file, or re-create it");
  if (const int32_t version = le_i32(&header[4]); version != kFlagsVersion)
    fail(fmt::format("token flags file '{}': version {}, this build reads version {}", path, version, kFlagsVersion),
         remake);
  TokenFlagsInfo info{path, le_i32(&header[8]), 0};
  const int32_t carried = le_i32(&header[12]);
  if (info.count < 0)
    fail(fmt::format("token flags file '{}': negative token count {} at byte offset 8", path, info.count), remake);
  if (carried < 0 || carried > (kFlagLoss | kFlagDocStart))
    fail(fmt::format("token flags file '{}': header[3] = {} names unknown flags (known: {} loss mask, {} document "
                     "starts)",
                     path, carried, kFlagLoss, kFlagDocStart),
         remake);
  info.carried = static_cast<uint8_t>(carried);
  if (expected_count >= 0 && info.count != expected_count)
    fail(fmt::format("token flags file '{}' is for {} tokens, its token file holds {}", path, info.count,
                     expected_count),
         "the flags belong to another version of the token file; " + std::string(remake));
  if (size != kShardHeaderBytes + info.count)
    fail(fmt::format("token flags file '{}': size is {} bytes, expected {} ({}-byte header + {} tokens x 1 byte)", path,
                     size, kShardHeaderBytes + info.count, kShardHeaderBytes, info.count),
         size < kShardHeaderBytes + info.count ? "the file is truncated; " + std::string(remake)
                                               : "the file has trailing bytes; " + std::string(remake));
  return info;
}

TokenFlags read_token_flags(const std::string& path, int64_t expected_count) {
  const TokenFlagsInfo info = inspect_token_flags(path, expected_count);
  const FileReader file(path, "token flags file", "give the flags file chunkwise tokenize wrote beside the shard");
  if (static_cast<int64_t>(file.size()) != kShardHeaderBytes + info.count)
    fail(fmt::format("token flags file '{}': size changed since it was inspected", path),
         "do not rewrite data files during a run");
  TokenFlags flags{info.carried, std::vector<uint8_t>(static_cast<size_t>(info.count))};
  if (info.count > 0) file.read_at(kShardHeaderBytes, flags.bits.data(), flags.bits.size());
  check_flags_bits(path, flags.carried, flags.bits);
  return flags;
}

TokenFormat parse_token_format(const std::string& name, const std::string& what) {
  if (name == "shard") return TokenFormat::shard;
  if (name == "u16") return TokenFormat::u16;
  if (name == "u32") return TokenFormat::u32;
  fail(fmt::format("{} '{}' is not one of shard, u16, u32", what, name),
       "shard for llm.c files with a 1024-byte header; u16 or u32 for headerless little-endian ids");
}

const char* token_format_name(TokenFormat f) {
  switch (f) {
    case TokenFormat::shard: return "shard";
    case TokenFormat::u16: return "u16";
    case TokenFormat::u32: return "u32";
  }
  return "?";
}

TokenFileInfo inspect_token_file(const std::string& path, TokenFormat format) {
  const FileReader file = open_for_reading(path);
  const int64_t size = static_cast<int64_t>(file.size());
  TokenFileInfo info;
  info.path = path;
  info.format = format;
  if (format == TokenFormat::shard) {
    if (size < kShardHeaderBytes)
      fail(fmt::format("token shard '{}': {} bytes, too small for the {}-byte llm.c header", path, size,
                       kShardHeaderBytes),
           "for a headerless id file pass format u16 or u32");
    std::array<unsigned char, kShardHeaderBytes> header{};
    file.read_at(0, header.data(), kShardHeaderBytes);
    const int32_t magic = le_i32(&header[0]);
    if (magic == kShardMagicU16) {
      info.token_bytes = 2;
    } else if (magic == kShardMagicU32) {
      info.token_bytes = 4;
    } else {
      fail(fmt::format("token shard '{}': bad magic {} at byte offset 0 (expected {} for uint16 or {} for uint32 "
                       "ids)",
                       path, magic, kShardMagicU16, kShardMagicU32),
           "not an llm.c shard; for a headerless id file pass format u16 or u32");
    }
    info.version = le_i32(&header[4]);
    info.count = le_i32(&header[8]);
    if (info.count < 0)
      fail(fmt::format("token shard '{}': negative token count {} at byte offset 8", path, info.count),
           "the header is corrupt; re-create the shard");
    info.data_offset = kShardHeaderBytes;
    const int64_t expected = kShardHeaderBytes + info.count * info.token_bytes;
    if (size != expected)
      fail(fmt::format("token shard '{}': size is {} bytes, expected {} ({}-byte header + {} tokens x {} bytes)",
                       path, size, expected, kShardHeaderBytes, info.count, info.token_bytes),
           size < expected ? "the file is truncated, perhaps by an interrupted copy or write; re-create it"
                           : "the file has trailing bytes; re-create it");
  } else {
    info.token_bytes = format == TokenFormat::u16 ? 2 : 4;
    if (size % info.token_bytes != 0)
      fail(fmt::format("token file '{}': size {} bytes is not a multiple of {} ({} ids)", path, size,
                       info.token_bytes, token_format_name(format)),
           "wrong format? headerless files hold u16 or u32 ids; llm.c files with a header need format shard");
    info.count = size / info.token_bytes;
  }
  return info;
}

std::vector<uint32_t> read_token_file(const std::string& path, TokenFormat format, int64_t vocab_size,
                                      TokenFileInfo* info) {
  check_vocab_size(vocab_size);
  const TokenFileInfo inspected = inspect_token_file(path, format);
  std::vector<uint32_t> ids;
  load_ids(inspected, vocab_size, ids);
  if (info) *info = inspected;
  return ids;
}

TokenFileInfo write_token_shard(const std::string& path, std::span<const uint32_t> tokens, int64_t vocab_size,
                                const TokenFlags* flags) {
  const int64_t count = static_cast<int64_t>(tokens.size());
  if (count > INT32_MAX)
    fail(fmt::format("token shard '{}': {} tokens do not fit one shard (the llm.c header counts in int32)", path,
                     count),
         "split the data over several shards");
  const std::string flags_path = token_flags_path(path);
  if (flags) {
    CW_CHECK(static_cast<int64_t>(flags->bits.size()) == count, "token shard '{}': {} flag bytes for {} tokens", path,
             flags->bits.size(), count);
    check_flags_bits(flags_path, flags->carried, flags->bits);
  }
  const bool wide = vocab_size > 0x10000 ||
                    std::any_of(tokens.begin(), tokens.end(), [](uint32_t id) { return id > 0xffffu; });
  TokenFileInfo info;
  info.path = path;
  info.format = TokenFormat::shard;
  info.token_bytes = wide ? 4 : 2;
  info.version = wide ? 7 : 1;
  info.count = count;
  info.data_offset = kShardHeaderBytes;
  info.flags_carried = flags ? flags->carried : 0;

  PendingFile shard(path, "token shard");
  const auto header = file_header({wide ? kShardMagicU32 : kShardMagicU16, info.version, count});
  shard.write(header.data(), header.size());
  std::vector<unsigned char> raw(static_cast<size_t>(std::min(count, kChunkTokens)) * info.token_bytes);
  for (int64_t start = 0; start < count; start += kChunkTokens) {
    const int64_t n = std::min(kChunkTokens, count - start);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t id = tokens[static_cast<size_t>(start + i)];
      if (wide) {
        put_le32(&raw[static_cast<size_t>(4 * i)], id);
      } else {
        raw[static_cast<size_t>(2 * i)] = static_cast<unsigned char>(id);
        raw[static_cast<size_t>(2 * i + 1)] = static_cast<unsigned char>(id >> 8);
      }
    }
    shard.write(raw.data(), static_cast<size_t>(n * info.token_bytes));
  }
  shard.finish();
  std::optional<PendingFile> flags_file;
  if (flags) {
    flags_file.emplace(flags_path, "token flags file");
    const auto flags_header = file_header({kFlagsMagic, kFlagsVersion, count, flags->carried});
    flags_file->write(flags_header.data(), flags_header.size());
    flags_file->write(flags->bits.data(), flags->bits.size());
    flags_file->finish();
  }
  // The order of the header comment: no moment shows flags beside tokens they do not describe.
  if (::unlink(flags_path.c_str()) != 0 && errno != ENOENT)
    fail(fmt::format("token shard '{}': cannot remove the old flags file '{}': {}", path, flags_path, errno_text()),
         "check the directory's permissions");
  shard.commit();
  if (flags_file) flags_file->commit();
  // Make the renames themselves durable. Some filesystems refuse fsync on a directory; the data is
  // already safe then, so that is not an error.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const FileDescriptor dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.is_open()) (void)::fsync(dfd.get());
  return info;
}

std::vector<std::string> expand_token_paths(const std::vector<std::string>& specs, const std::string& what) {
  if (specs.empty()) fail(fmt::format("no {} files given", what), "pass one or more file paths or glob patterns");
  std::vector<std::string> paths;
  for (const std::string& spec : specs) {
    if (spec.find_first_of("*?[") == std::string::npos) {
      paths.push_back(spec);  // a literal path: opening it reports a missing file by name
      continue;
    }
    glob_t g{};
    const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      ::globfree(&g);
      fail(fmt::format("{} pattern '{}' matches no file", what, spec),
           "check the directory and the pattern; quote the pattern so the shell passes it through");
    }
    if (rc != 0) {
      ::globfree(&g);
      fail(fmt::format("{} pattern '{}': glob failed (code {})", what, spec, rc), "check the directory exists");
    }
    std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    ::globfree(&g);
    // A flags file belongs to its token file, which the pattern may match too: it is never data itself.
    std::erase_if(matches, [](const std::string& m) {
      constexpr std::string_view suffix = ".flags";
      std::error_code ec;
      return m.ends_with(suffix) && std::filesystem::exists(m.substr(0, m.size() - suffix.size()), ec);
    });
    if (matches.empty())
      fail(fmt::format("{} pattern '{}' matches only flags files", what, spec),
           "the pattern must match the token or text files themselves");
    // glob sorts by the locale's collation; sorting again by bytes makes the order the same everywhere.
    std::sort(matches.begin(), matches.end());
    paths.insert(paths.end(), matches.begin(), matches.end());
  }
  std::set<std::string> seen;
  for (const std::string& p : paths)
    if (!seen.insert(canonical_or_raw(p)).second)
      fail(fmt::format("{} file '{}' is listed more than once", what, p),
           "list each file once (patterns may overlap: check them)");
  return paths;
}

// ---- TokenDataset --------------------------------------------------------------------------------

TokenDataset TokenDataset::open(const std::vector<std::string>& specs, const TokenDatasetOptions& options) {
  check_vocab_size(options.vocab_size);
  TokenDataset d;
  d.vocab_size_ = options.vocab_size;
  // Every header and size is checked before any ids are read, so a truncated last file fails at
  // once instead of after loading everything before it.
  int64_t total = 0;
  std::error_code ec;
  for (const std::string& path : expand_token_paths(specs)) {
    TokenFileInfo info = inspect_token_file(path, options.format);
    info.stream_offset = total;
    total += info.count;
    if (const std::string flags = token_flags_path(path); std::filesystem::exists(flags, ec))
      info.flags_carried = inspect_token_flags(flags, info.count).carried;
    d.files_.push_back(std::move(info));
  }
  auto tokens = std::make_shared<std::vector<uint32_t>>();
  tokens->reserve(static_cast<size_t>(total));
  for (const TokenFileInfo& info : d.files_) load_ids(info, options.vocab_size, *tokens);
  if (options.read_flags) {
    auto flags = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(total), uint8_t{0});
    for (const TokenFileInfo& info : d.files_) {
      uint8_t* dst = flags->data() + info.stream_offset;
      if (info.flags_carried) {
        const TokenFlags f = read_token_flags(token_flags_path(info.path), info.count);
        std::copy(f.bits.begin(), f.bits.end(), dst);
      }
      if (!(info.flags_carried & kFlagDocStart) && options.document_marker) {
        const uint32_t* ids = tokens->data() + info.stream_offset;
        for (int64_t i = 0; i < info.count; ++i)
          if (ids[i] == *options.document_marker) dst[i] |= kFlagDocStart;
      }
    }
    d.flags_ = std::move(flags);
  }
  d.tokens_ = std::move(tokens);
  return d;
}

TokenDataset TokenDataset::from_tokens(std::vector<uint32_t> tokens, int64_t vocab_size, const std::string& name,
                                       std::optional<TokenFlags> flags) {
  check_vocab_size(vocab_size);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= vocab_size) fail_bad_id(name, static_cast<int64_t>(i), -1, tokens[i], vocab_size);
  TokenDataset d;
  d.vocab_size_ = vocab_size;
  TokenFileInfo info;
  info.path = name;
  info.format = TokenFormat::u32;
  info.token_bytes = 4;
  info.count = static_cast<int64_t>(tokens.size());
  if (flags) {
    CW_CHECK(flags->bits.size() == tokens.size(), "'{}': {} flag bytes for {} tokens", name, flags->bits.size(),
             tokens.size());
    check_flags_bits(name, flags->carried, flags->bits);
    info.flags_carried = flags->carried;
    d.flags_ = std::make_shared<const std::vector<uint8_t>>(std::move(flags->bits));
  }
  d.files_.push_back(info);
  d.tokens_ = std::make_shared<const std::vector<uint32_t>>(std::move(tokens));
  return d;
}

std::string TokenDataset::describe() const {
  if (files_.empty()) return "(empty token data)";
  if (files_.size() == 1) return fmt::format("'{}'", files_[0].path);
  return fmt::format("'{}' and {} more file{}", files_[0].path, files_.size() - 1, files_.size() == 2 ? "" : "s");
}

WindowSet TokenDataset::windows(int64_t seq_len) const {
  CW_CHECK(seq_len > 0, "sequence length {} must be positive", seq_len);
  if (size() < seq_len + 1)
    fail(fmt::format("token data {} holds {} tokens, fewer than one window of {} (sequence length {} + 1)",
                     describe(), size(), seq_len + 1, seq_len),
         "use more data or a shorter sequence length");
  return WindowSet(tokens_, 0, (size() - 1) / seq_len, seq_len, flags_);
}

// ---- WindowSet -----------------------------------------------------------------------------------

WindowSet::WindowSet(std::shared_ptr<const std::vector<uint32_t>> tokens, int64_t first_token, int64_t count,
                     int64_t seq_len, std::shared_ptr<const std::vector<uint8_t>> flags)
    : tokens_(std::move(tokens)), flags_(std::move(flags)), first_token_(first_token), count_(count), seq_len_(seq_len) {
  CW_CHECK(tokens_ != nullptr, "window set over no token stream");
  CW_CHECK(flags_ == nullptr || flags_->size() == tokens_->size(), "{} flag bytes for a stream of {} tokens",
           flags_ ? flags_->size() : 0, tokens_->size());
  CW_CHECK(seq_len > 0 && first_token >= 0 && count >= 0, "window set: seq_len {}, first token {}, count {}",
           seq_len, first_token, count);
  CW_CHECK(count == 0 || first_token + count * seq_len + 1 <= static_cast<int64_t>(tokens_->size()),
           "{} windows of {} from token {} overrun a stream of {} tokens", count, seq_len + 1, first_token,
           tokens_->size());
}

std::span<const uint32_t> WindowSet::window(int64_t w) const {
  CW_CHECK(w >= 0 && w < count_, "window {} of a set of {}", w, count_);
  return {tokens_->data() + first_token_ + w * seq_len_, static_cast<size_t>(seq_len_ + 1)};
}

int64_t WindowSet::window_start(int64_t w) const {
  CW_CHECK(w >= 0 && w < count_, "window {} of a set of {}", w, count_);
  return first_token_ + w * seq_len_;
}

std::span<const uint8_t> WindowSet::window_flags(int64_t w) const {
  CW_CHECK(flags_ != nullptr, "window {}: the token data was opened without its flags", w);
  return {flags_->data() + window_start(w), static_cast<size_t>(seq_len_ + 1)};
}

int64_t WindowSet::num_batches(int64_t batch) const {
  CW_CHECK(batch > 0, "batch size {} must be positive", batch);
  return (count_ + batch - 1) / batch;
}

std::vector<int64_t> WindowSet::batch_windows(int64_t index, int64_t batch) const {
  CW_CHECK(index >= 0 && index < num_batches(batch), "batch {} of {} (batch size {}, {} windows)", index,
           num_batches(batch), batch, count_);
  const int64_t first = index * batch, rows = std::min(batch, count_ - first);
  std::vector<int64_t> windows(static_cast<size_t>(rows));
  std::iota(windows.begin(), windows.end(), first);
  return windows;
}

std::vector<uint32_t> WindowSet::ids(std::span<const int64_t> windows) const {
  const int64_t row = seq_len_ + 1;
  std::vector<uint32_t> out(windows.size() * static_cast<size_t>(row));
  for (size_t r = 0; r < windows.size(); ++r) {
    const auto w = window(windows[r]);
    std::copy(w.begin(), w.end(), out.begin() + static_cast<int64_t>(r) * row);
  }
  return out;
}

std::vector<uint32_t> WindowSet::batch_in_order(int64_t index, int64_t batch) const {
  return ids(batch_windows(index, batch));
}

// ---- splits --------------------------------------------------------------------------------------

WindowSplit split_by_fraction(const TokenDataset& data, int64_t seq_len, double eval_fraction) {
  if (!(eval_fraction >= 0.0 && eval_fraction < 1.0))
    fail(fmt::format("eval fraction {} is outside [0, 1)", eval_fraction),
         "use e.g. 0.05 to hold out the last 5% of the windows, or 0 for no eval");
  const WindowSet all = data.windows(seq_len);
  const int64_t n = data.size(), w = all.size();
  int64_t eval_windows = std::llround(eval_fraction * static_cast<double>(w));
  if (eval_fraction > 0 && eval_windows == 0) eval_windows = 1;
  if (eval_windows == 0) return {all, WindowSet(data.shared_tokens(), n, 0, seq_len, data.shared_flags())};

  const int64_t eval_first = n - (eval_windows * seq_len + 1);
  const int64_t train_windows = eval_first >= seq_len + 1 ? (eval_first - 1) / seq_len : 0;
  if (train_windows < 1)
    fail(fmt::format("token data {} holds {} tokens ({} windows of {}): holding out {} for eval (fraction {}) "
                     "leaves none for training",
                     data.describe(), n, w, seq_len + 1, eval_windows, eval_fraction),
         "use more data, a smaller eval fraction or a shorter sequence length");
  return {WindowSet(data.shared_tokens(), 0, train_windows, seq_len, data.shared_flags()),
          WindowSet(data.shared_tokens(), eval_first, eval_windows, seq_len, data.shared_flags())};
}

WindowSplit split_by_files(const TokenDataset& train, const TokenDataset& eval, int64_t seq_len) {
  std::set<std::string> train_files;
  for (const TokenFileInfo& f : train.files()) train_files.insert(canonical_or_raw(f.path));
  for (const TokenFileInfo& f : eval.files())
    if (train_files.count(canonical_or_raw(f.path)))
      fail(fmt::format("eval file '{}' is also a training file", f.path),
           "hold the eval data out: give train and eval file lists that do not share a file");
  return {train.windows(seq_len), eval.windows(seq_len)};
}

// ---- sampler -------------------------------------------------------------------------------------

nlohmann::json SamplerState::to_json() const {
  return {{"seed", seed}, {"epoch", epoch}, {"position", position}, {"num_windows", num_windows}};
}

SamplerState SamplerState::from_json(const nlohmann::json& j, const std::string& source) {
  const auto get = [&](const char* key) -> const nlohmann::json& {
    const bool ok = j.is_object() && j.contains(key) && j.at(key).is_number_integer() &&
                    (j.at(key).is_number_unsigned() || j.at(key).get<int64_t>() >= 0);
    if (!ok)
      fail(fmt::format("sampler state in '{}': key '{}' is missing or not a non-negative integer", source, key),
           "the checkpoint's data state is damaged; resume from another checkpoint");
    return j.at(key);
  };
  SamplerState s;
  s.seed = get("seed").get<uint64_t>();
  s.epoch = get("epoch").get<int64_t>();
  s.position = get("position").get<int64_t>();
  s.num_windows = get("num_windows").get<int64_t>();
  return s;
}

WindowSampler::WindowSampler(WindowSet windows, uint64_t seed) : windows_(std::move(windows)), seed_(seed) {
  CW_CHECK(!windows_.empty(), "a window sampler needs at least one window");
  shuffle_for_epoch();
}

void WindowSampler::shuffle_for_epoch() {
  order_.resize(static_cast<size_t>(windows_.size()));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  // A fresh generator per epoch, seeded from (seed, epoch): the order never depends on how many
  // draws earlier epochs made, so restoring needs no generator counter.
  Rng rng(mix64(mix64(seed_ ^ kShuffleDomain) + static_cast<uint64_t>(epoch_)));
  for (size_t i = order_.size() - 1; i > 0; --i) {
    const size_t j = static_cast<size_t>(rng.below(i + 1));
    std::swap(order_[i], order_[j]);
  }
}

int64_t WindowSampler::next_window() {
  const int64_t w = order_[static_cast<size_t>(position_)];
  // Roll over eagerly so that the saved position always lies inside an epoch.
  if (++position_ == windows_.size()) {
    ++epoch_;
    position_ = 0;
    shuffle_for_epoch();
  }
  return w;
}

std::vector<int64_t> WindowSampler::next_batch_windows(int64_t batch) { return next_rank_batch_windows(batch, 0, 1); }

std::vector<int64_t> WindowSampler::next_rank_batch_windows(int64_t batch, int64_t rank, int64_t ranks) {
  CW_CHECK(batch > 0, "batch size {} must be positive", batch);
  CW_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "rank {} of {} ranks", rank, ranks);
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(batch));
  for (int64_t r = 0; r < ranks * batch; ++r) {
    const int64_t w = next_window();  // every window of the global batch advances the sampler
    if (r / batch == rank) mine.push_back(w);
  }
  return mine;
}

std::vector<uint32_t> WindowSampler::next_batch(int64_t batch) { return windows_.ids(next_batch_windows(batch)); }

std::vector<uint32_t> WindowSampler::next_rank_batch(int64_t batch, int64_t rank, int64_t ranks) {
  return windows_.ids(next_rank_batch_windows(batch, rank, ranks));
}

SamplerState WindowSampler::state() const { return {seed_, epoch_, position_, windows_.size()}; }

void WindowSampler::restore(const SamplerState& state) {
  if (state.num_windows != windows_.size())
    fail(fmt::format("sampler state was saved over {} training windows; the data now gives {}", state.num_windows,
                     windows_.size()),
         "the data files, the split or the sequence length changed since the checkpoint; resume with the same "
         "data to get the same batches");
  if (state.epoch < 0 || state.position < 0 || state.position >= state.num_windows)
    fail(fmt::format("sampler state: position {} in epoch {} is outside [0, {})", state.position, state.epoch,
                     state.num_windows),
         "the checkpoint's data state is damaged; resume from another checkpoint");
  seed_ = state.seed;
  epoch_ = state.epoch;
  position_ = state.position;
  shuffle_for_epoch();
}

}  // namespace cw
