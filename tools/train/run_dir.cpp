#include "tools/train/run_dir.h"

#include "model/file.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cw {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kManifestName = "manifest.json";
constexpr const char* kManifestFormat = "chunkwise-checkpoint";
constexpr int kManifestVersion = 1;
// No real manifest comes near this (it lists a handful of files): anything bigger is garbage, and
// reading it whole could exhaust memory.
constexpr uintmax_t kMaxManifestBytes = 16u << 20;

std::string errno_text(int err) { return std::strerror(err); }

long pid() { return static_cast<long>(::getpid()); }

std::string parent_of(const std::string& path) {
  const std::string dir = fs::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

// Creates `path` (which must not exist), writes `text`, fsyncs and closes it.
void write_new_file_synced(const std::string& path, const std::string& text) {
  FileDescriptor fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (!fd.is_open()) {
    fail(fmt::format("cannot create '{}': {}", path, errno_text(errno)), "check that the directory is writable");
  }
  write_all(fd.get(), path, text.data(), text.size());
  if (::fsync(fd.get()) != 0) fail(fmt::format("cannot fsync '{}': {}", path, errno_text(errno)), "check the disk");
  // close reports write-back errors some filesystems (NFS) only detect here.
  if (const int err = fd.close(); err != 0)
    fail(fmt::format("cannot close '{}': {}", path, errno_text(err)), "check free disk space");
}

constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

struct FileDigest {
  uint64_t bytes = 0;
  uint64_t fnv1a = kFnvOffset;
};

// Reads `path` once, counting and hashing its bytes; with `sync`, also fsyncs it (Linux flushes a
// file's dirty pages whatever mode the descriptor was opened in). Returns the error text instead of
// throwing so verification can turn it into a skip reason.
std::optional<FileDigest> digest_file(const std::string& path, bool sync, std::string* error) {
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.is_open()) {
    *error = fmt::format("cannot open: {}", errno_text(errno));
    return std::nullopt;
  }
  FileDigest d;
  std::vector<unsigned char> buf(1 << 20);
  for (;;) {
    const ssize_t got = ::read(fd.get(), buf.data(), buf.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      *error = fmt::format("cannot read: {}", errno_text(errno));
      return std::nullopt;
    }
    if (got == 0) break;
    uint64_t h = d.fnv1a;
    for (ssize_t i = 0; i < got; ++i) h = (h ^ buf[static_cast<size_t>(i)]) * kFnvPrime;
    d.fnv1a = h;
    d.bytes += static_cast<uint64_t>(got);
  }
  if (sync && ::fsync(fd.get()) != 0) {
    *error = fmt::format("cannot fsync: {}", errno_text(errno));
    return std::nullopt;
  }
  return d;
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

std::string utc_now_iso8601() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The step of a directory named exactly checkpoint_dir_name(step). Other spellings ("step-40",
// "step-+40") are not ours and are ignored, so no two names can denote one step.
std::optional<int64_t> parse_step_name(const std::string& name) {
  constexpr std::string_view prefix = "step-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  if (name.size() - prefix.size() > 18) return std::nullopt;  // 18 digits cannot overflow int64
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  if (checkpoint_dir_name(step) != name) return std::nullopt;
  return step;
}

bool is_temporary_name(const std::string& name) {
  return name.rfind(".step-", 0) == 0 && name.find(".tmp-") != std::string::npos;
}

struct Listing {
  std::vector<std::pair<int64_t, fs::path>> steps;  // descending by step
  std::vector<fs::path> temporaries;                // sorted by name
};

Listing list_run_directory(const std::string& dir) {
  Listing listing;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  if (ec) fail(fmt::format("cannot list run directory '{}': {}", dir, ec.message()), "check that it exists and is readable");
  for (; it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (const auto step = parse_step_name(name)) {
      listing.steps.emplace_back(*step, it->path());
    } else if (is_temporary_name(name)) {
      listing.temporaries.push_back(it->path());
    }
  }
  if (ec) fail(fmt::format("cannot list run directory '{}': {}", dir, ec.message()), "check that it is readable");
  std::sort(listing.steps.begin(), listing.steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::sort(listing.temporaries.begin(), listing.temporaries.end());
  return listing;
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// Why checkpoint directory `dir` of step `step` is not complete, or "" when it is. Without
// `check_hashes` only the manifest and file sizes are checked (cheap: no file is read).
std::string checkpoint_problem(const fs::path& dir, int64_t step, bool check_hashes) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec || !fs::is_directory(st)) return "not a directory";

  const fs::path manifest_path = dir / kManifestName;
  const fs::file_status mst = fs::symlink_status(manifest_path, ec);
  if (ec || !fs::exists(mst)) return "manifest.json missing (interrupted write?)";
  if (!fs::is_regular_file(mst)) return "manifest.json is not a plain file";
  const uintmax_t manifest_bytes = fs::file_size(manifest_path, ec);
  if (ec) return fmt::format("cannot read manifest.json: {}", ec.message());
  if (manifest_bytes > kMaxManifestBytes) return fmt::format("manifest.json is implausibly large ({} bytes)", manifest_bytes);
  std::ifstream in(manifest_path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return "cannot read manifest.json";

  const json m = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded()) return "manifest.json is not valid JSON (torn or edited?)";
  if (!m.is_object() || !m.contains("format") || m["format"] != kManifestFormat) {
    return "manifest.json is not a chunkwise checkpoint manifest";
  }
  if (!m.contains("version") || !m["version"].is_number_integer() || m["version"].get<int64_t>() != kManifestVersion) {
    return fmt::format("manifest.json has version {}, this build reads version {} (written by another chunkwise?)",
                       m.contains("version") ? m["version"].dump() : "none", kManifestVersion);
  }
  if (!m.contains("step") || !m["step"].is_number_integer() || m["step"].get<int64_t>() != step) {
    return fmt::format("manifest.json says step {}, the directory name says {} (renamed by hand?)",
                       m.contains("step") ? m["step"].dump() : "none", step);
  }
  if (!m.contains("files") || !m["files"].is_array()) return "manifest.json has no \"files\" list";

  std::set<std::string> seen;
  for (const json& f : m["files"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned() || !f.contains("fnv1a64") || !f["fnv1a64"].is_string()) {
      return "manifest.json has a malformed \"files\" entry (needs name, bytes, fnv1a64)";
    }
    const std::string name = f["name"].get<std::string>();
    // A name with a slash could point outside the checkpoint; "manifest.json" cannot describe itself.
    if (!is_plain_file_name(name) || name == kManifestName || !seen.insert(name).second) {
      return fmt::format("manifest.json lists an invalid or repeated file name '{}'", name);
    }
    const uint64_t want_bytes = f["bytes"].get<uint64_t>();
    const fs::path file = dir / name;
    const fs::file_status fst = fs::symlink_status(file, ec);
    if (ec || !fs::exists(fst)) return fmt::format("'{}' listed in manifest.json is missing", name);
    if (!fs::is_regular_file(fst)) return fmt::format("'{}' listed in manifest.json is not a plain file", name);
    const uintmax_t have_bytes = fs::file_size(file, ec);
    if (ec) return fmt::format("cannot stat '{}': {}", name, ec.message());
    if (have_bytes != want_bytes) {
      return fmt::format("'{}' is {} bytes but manifest.json says {} (truncated or overwritten?)", name, have_bytes,
                         want_bytes);
    }
    if (check_hashes) {
      std::string error;
      const auto digest = digest_file(file.string(), /*sync=*/false, &error);
      if (!digest) return fmt::format("'{}': {}", name, error);
      // The size is compared again: the file may have changed since it was stat'ed.
      if (digest->bytes != want_bytes || hex64(digest->fnv1a) != f["fnv1a64"].get<std::string>()) {
        return fmt::format("'{}' does not match its FNV-1a hash in manifest.json (corrupted on disk?)", name);
      }
    }
  }
  return "";
}

// Deletes a step directory so that it never appears half-deleted under its step-* name: renamed to a
// temporary name first (atomic, made durable), then removed.
void discard_checkpoint_dir(const std::string& run_dir, const fs::path& victim) {
  const fs::path doomed =
      fs::path(run_dir) / fmt::format(".{}.tmp-{}.del", victim.filename().string(), pid());
  std::error_code ec;
  fs::remove_all(doomed, ec);
  if (::rename(victim.c_str(), doomed.c_str()) != 0) {
    fail(fmt::format("cannot move '{}' aside to delete it: {}", victim.string(), errno_text(errno)),
         "check the run directory's permissions");
  }
  fsync_directory(run_dir);
  fs::remove_all(doomed, ec);
  if (ec) {
    fail(fmt::format("cannot delete '{}': {}", doomed.string(), ec.message()),
         "check the run directory's permissions; the leftover is harmless and removed on the next resume");
  }
}

// Removes the temporary directory of a checkpoint write on every exit path; after a successful
// exchange it holds the replaced checkpoint, which is then garbage too.
struct TemporaryDir {
  fs::path path;
  ~TemporaryDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = fmt::format("{}.tmp-{}", path, pid());
  ::unlink(tmp.c_str());  // left by an earlier crashed process that had our pid
  try {
    write_new_file_synced(tmp, text);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, errno_text(err)),
         "check that the destination is writable and not a directory");
  }
  fsync_directory(parent_of(path));
}

size_t truncate_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!fs::exists(path, ec)) return 0;
    fail(fmt::format("cannot read metrics log '{}'", path), "check its permissions");
  }
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();

  std::string kept;
  kept.reserve(text.size());
  size_t dropped = 0, line_no = 0, pos = 0;
  bool changed = false;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    ++line_no;
    if (nl == std::string::npos) {
      changed = true;  // a torn last line: the crash interrupted its write
      break;
    }
    const std::string_view line(text.data() + pos, nl - pos);
    pos = nl + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) {
      kept.append(line).push_back('\n');
      continue;
    }
    const json record = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) {
      fail(fmt::format("metrics log '{}' line {}: not valid JSON", path, line_no),
           "fix or delete that line, then resume again");
    }
    if (record.is_object() && record.contains("step")) {
      const json& s = record["step"];
      if (!s.is_number_integer()) {
        fail(fmt::format("metrics log '{}' line {}: \"step\" is {}, not an integer", path, line_no, s.dump()),
             "fix or delete that line, then resume again");
      }
      // Non-negative integers parse as unsigned and may exceed int64: compare them as unsigned.
      const bool after = s.is_number_unsigned() ? step < 0 || s.get<uint64_t>() > static_cast<uint64_t>(step)
                                                 : s.get<int64_t>() > step;
      if (after) {
        ++dropped;
        changed = true;
        continue;
      }
    }
    kept.append(line).push_back('\n');
  }
  if (changed) write_text_atomic(path, kept);
  return dropped;
}

MetricsLog::MetricsLog(const std::string& path, std::optional<int64_t> resume_step) : path_(path) {
  if (resume_step) truncate_metrics_after(path, *resume_step);
  fd_ = FileDescriptor(::open(path.c_str(), O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC, 0644));
  if (!fd_.is_open()) {
    fail(fmt::format("cannot open metrics log '{}': {}", path, errno_text(errno)),
         "check that the run directory is writable");
  }
  // Cut a last line torn by a crash back to the previous newline; appending to it would glue the next
  // record onto garbage and make that line unparseable too.
  struct stat st{};
  if (::fstat(fd_.get(), &st) != 0) {
    const int err = errno;
    fd_.close();
    fail(fmt::format("cannot stat metrics log '{}': {}", path, errno_text(err)), "check the disk");
  }
  off_t end = st.st_size, cut = end;
  char chunk[4096];
  while (cut > 0) {
    const off_t begin = std::max<off_t>(0, cut - static_cast<off_t>(sizeof chunk));
    const ssize_t got = ::pread(fd_.get(), chunk, static_cast<size_t>(cut - begin), begin);
    if (got != cut - begin) break;  // unreadable: leave the file as it is
    const void* nl = ::memrchr(chunk, '\n', static_cast<size_t>(got));
    if (nl != nullptr) {
      cut = begin + (static_cast<const char*>(nl) - chunk) + 1;
      break;
    }
    cut = begin;
  }
  if (cut != end && ::ftruncate(fd_.get(), cut) != 0) {
    const int err = errno;
    fd_.close();
    fail(fmt::format("cannot cut the torn last line of metrics log '{}': {}", path, errno_text(err)),
         "delete the last line by hand");
  }
}

void MetricsLog::append(const json& record) {
  CW_CHECK(fd_.is_open(), "metrics log '{}' was moved from", path_);
  CW_CHECK(record.is_object(), "metrics record for '{}' must be a JSON object, got {}", path_, record.type_name());
  std::string line = record.dump(-1, ' ', false, json::error_handler_t::replace);
  line.push_back('\n');
  // One write() for the whole line: with O_APPEND it lands whole at the end, or (disk full) partly,
  // in which case the next open cuts it off.
  write_all(fd_.get(), path_, line.data(), line.size());
}

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step-{:06d}", step); }

RunDirectory::RunDirectory(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_, ec)) {
    fail(fmt::format("cannot create run directory '{}': {}", dir_, ec ? ec.message() : "exists and is not a directory"),
         "choose another --run-dir or fix its permissions");
  }
}

CheckpointRef RunDirectory::save_checkpoint(int64_t step,
                                            const std::function<void(const std::string& tmp_dir)>& write_files,
                                            int keep_last) {
  CW_CHECK(step >= 0, "checkpoint step must be >= 0, got {}", step);
  CW_CHECK(keep_last >= 1, "keep_last must be >= 1 (the checkpoint just written is always kept), got {}", keep_last);
  const std::string name = checkpoint_dir_name(step);
  const fs::path final_dir = fs::path(dir_) / name;
  TemporaryDir tmp{fs::path(dir_) / fmt::format(".{}.tmp-{}", name, pid())};

  std::error_code ec;
  fs::remove_all(tmp.path, ec);  // left by an earlier crashed process that had our pid
  if (!fs::create_directory(tmp.path, ec)) {
    fail(fmt::format("cannot create checkpoint directory '{}': {}", tmp.path.string(), ec.message()),
         "check that the run directory is writable");
  }
  write_files(tmp.path.string());

  // Every file is read back once to hash it; fsyncing it in the same pass makes its bytes durable
  // before the manifest that vouches for them exists.
  json files = json::array();
  std::vector<std::pair<std::string, fs::path>> written;
  for (fs::directory_iterator it(tmp.path, ec), end; !ec && it != end; it.increment(ec)) {
    written.emplace_back(it->path().filename().string(), it->path());
  }
  if (ec) fail(fmt::format("cannot list '{}': {}", tmp.path.string(), ec.message()), "check the disk");
  std::sort(written.begin(), written.end());
  for (const auto& [file_name, file_path] : written) {
    if (file_name == kManifestName) {
      fail(fmt::format("checkpoint writer created '{}': that name is reserved for the manifest", file_path.string()),
           "give the file another name");
    }
    if (!fs::is_regular_file(fs::symlink_status(file_path, ec))) {
      fail(fmt::format("checkpoint writer created '{}', which is not a plain file", file_path.string()),
           "write only plain files directly into the checkpoint directory");
    }
    std::string error;
    const auto digest = digest_file(file_path.string(), /*sync=*/true, &error);
    if (!digest) fail(fmt::format("checkpoint file '{}': {}", file_path.string(), error), "check the disk");
    files.push_back({{"name", file_name}, {"bytes", digest->bytes}, {"fnv1a64", hex64(digest->fnv1a)}});
  }
  const json manifest = {{"format", kManifestFormat}, {"version", kManifestVersion}, {"step", step},
                         {"created", utc_now_iso8601()}, {"files", files}};
  write_new_file_synced((tmp.path / kManifestName).string(), manifest.dump(2) + "\n");
  fsync_directory(tmp.path.string());

  // Install it under its step-* name. An existing directory of that step (corrupt or not) is swapped
  // out atomically where the filesystem can; otherwise moved aside first (see the header).
  const fs::file_status existing = fs::symlink_status(final_dir, ec);
  if (fs::exists(existing)) {
    if (::renameat2(AT_FDCWD, tmp.path.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS && err != ENOTSUP) {
        fail(fmt::format("cannot swap '{}' into '{}': {}", tmp.path.string(), final_dir.string(), errno_text(err)),
             "check the run directory's permissions");
      }
      // The aside name is a temporary one, so a crash before the next rename leaves no step-N at all
      // (older checkpoints still stand) and the aside directory is cleaned up as stale.
      const fs::path aside = fs::path(dir_) / fmt::format(".{}.tmp-{}.old", name, pid());
      fs::remove_all(aside, ec);
      if (::rename(final_dir.c_str(), aside.c_str()) != 0) {
        fail(fmt::format("cannot move '{}' aside to replace it: {}", final_dir.string(), errno_text(errno)),
             "check the run directory's permissions");
      }
      if (::rename(tmp.path.c_str(), final_dir.c_str()) != 0) {
        const int err = errno;
        ::rename(aside.c_str(), final_dir.c_str());  // put the old one back: better than nothing
        fail(fmt::format("cannot rename '{}' to '{}': {}", tmp.path.string(), final_dir.string(), errno_text(err)),
             "check the run directory's permissions");
      }
      tmp.path = aside;  // deleted below, after the new directory is durable
    }
  } else if (::rename(tmp.path.c_str(), final_dir.c_str()) != 0) {
    fail(fmt::format("cannot rename '{}' to '{}': {}", tmp.path.string(), final_dir.string(), errno_text(errno)),
         "check the run directory's permissions");
  }
  fsync_directory(dir_);
  fs::remove_all(tmp.path, ec);  // the swapped-out checkpoint, if any; a leftover is only stale

  write_text_atomic((fs::path(dir_) / "latest").string(), name + "\n");

  // Prune. Sizes, not hashes, decide which older checkpoints count as complete: hashing every kept
  // checkpoint at every save would read gigabytes, and the one just written is complete regardless.
  int older_kept = 0;
  for (const auto& [s, p] : list_run_directory(dir_).steps) {
    if (s == step) continue;
    if (s < step && older_kept < keep_last - 1 && checkpoint_problem(p, s, /*check_hashes=*/false).empty()) {
      ++older_kept;
      continue;
    }
    try {
      discard_checkpoint_dir(dir_, p);
    } catch (const Error& e) {
      fail(fmt::format("saved {} but could not prune an old checkpoint: {}", final_dir.string(), e.message()), e.hint());
    }
  }
  return CheckpointRef{step, final_dir.string()};
}

std::optional<CheckpointRef> RunDirectory::latest_complete(std::vector<std::string>* skipped) const {
  const Listing listing = list_run_directory(dir_);
  std::vector<std::string> reasons;
  std::optional<CheckpointRef> found;
  for (const auto& [s, p] : listing.steps) {
    const std::string problem = checkpoint_problem(p, s, /*check_hashes=*/true);
    if (problem.empty()) {
      found = CheckpointRef{s, p.string()};
      break;
    }
    reasons.push_back(fmt::format("{}: {}", p.string(), problem));
  }
  for (const fs::path& t : listing.temporaries) {
    reasons.push_back(fmt::format("{}: leftover of an interrupted checkpoint write or delete", t.string()));
  }
  // `latest` is only cross-checked: a name that does not exist means checkpoints were deleted or
  // moved by hand, which the user should hear about.
  const fs::path latest_path = fs::path(dir_) / "latest";
  std::ifstream in(latest_path);
  std::string named;
  if (in && std::getline(in, named)) {
    while (!named.empty() && (named.back() == '\r' || named.back() == ' ')) named.pop_back();
    const auto named_step = parse_step_name(named);
    if (!named_step) {
      reasons.push_back(fmt::format("{}: does not name a checkpoint ('{}')", latest_path.string(), named));
    } else if (std::none_of(listing.steps.begin(), listing.steps.end(),
                            [&](const auto& e) { return e.first == *named_step; })) {
      reasons.push_back(fmt::format("{}: names {}, which does not exist", latest_path.string(), named));
    }
  }
  if (skipped != nullptr) {
    const std::string outcome =
        found ? fmt::format("; using {}", checkpoint_dir_name(found->step)) : std::string("; no complete checkpoint left");
    for (std::string& r : reasons) skipped->push_back(r + outcome);
  }
  return found;
}

std::optional<CheckpointRef> RunDirectory::find(int64_t step, std::string* why) const {
  const fs::path dir = fs::path(dir_) / checkpoint_dir_name(step);
  std::error_code ec;
  std::string problem;
  if (step < 0) {
    problem = "a checkpoint step is never negative";
  } else if (!fs::exists(fs::symlink_status(dir, ec))) {
    problem = "no such checkpoint";
  } else {
    problem = checkpoint_problem(dir, step, /*check_hashes=*/true);
  }
  if (!problem.empty()) {
    if (why != nullptr) *why = fmt::format("{}: {}", dir.string(), problem);
    return std::nullopt;
  }
  return CheckpointRef{step, dir.string()};
}

std::vector<CheckpointRef> RunDirectory::complete_checkpoints() const {
  std::vector<CheckpointRef> out;
  for (const auto& [s, p] : list_run_directory(dir_).steps) {
    if (checkpoint_problem(p, s, /*check_hashes=*/true).empty()) out.push_back({s, p.string()});
  }
  std::reverse(out.begin(), out.end());
  return out;
}

size_t RunDirectory::remove_stale_temporaries() const {
  size_t removed = 0;
  for (const fs::path& t : list_run_directory(dir_).temporaries) {
    std::error_code ec;
    fs::remove_all(t, ec);
    if (ec) fail(fmt::format("cannot delete stale temporary '{}': {}", t.string(), ec.message()), "delete it by hand");
    ++removed;
  }
  return removed;
}

std::string default_run_dir(const std::string& base) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  return (fs::path(base) / stamp).string();
}

}  // namespace cw
