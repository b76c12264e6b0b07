// The run directory of `chunkwise train`: config, metrics log and checkpoints, written so that a crash
// (killed process, power loss) at any moment leaves a directory a later `--resume` can use.
//
// Layout of a run directory DIR:
//   DIR/config.toml          the resolved config, written by the trainer through write_text_atomic
//   DIR/metrics.jsonl        one JSON object per line, each line appended with a single write()
//   DIR/step-000040/         a complete checkpoint: the trainer's files plus manifest.json, which is
//                            written last and lists every file with its byte size and 64-bit FNV-1a
//   DIR/latest               "step-000040\n": the newest complete checkpoint, replaced atomically
//   DIR/.step-000060.tmp-PID a checkpoint being written (or being deleted); never read
//
// A checkpoint is written into DIR/.step-N.tmp-PID; every file in it is fsynced, then manifest.json
// is written and fsynced, then the temporary directory is fsynced and renamed to DIR/step-N, then
// DIR is fsynced and `latest` replaced. What a crash at each point leaves behind:
//   - while the trainer's files or the manifest are being written: only the .tmp directory, whose
//     name never matches step-*; the previous checkpoints and `latest` are untouched. The .tmp
//     directory is reported by latest_complete and deleted by remove_stale_temporaries.
//   - after the rename but before DIR is fsynced: after a power loss the rename may or may not have
//     reached the disk, so DIR holds either the .tmp directory (as above) or a complete step-N.
//     Its contents are on disk either way: they were fsynced before the rename, so a renamed
//     directory can never hold files the manifest describes but the disk lost.
//   - after the rename but before `latest` is replaced: `latest` names the previous checkpoint.
//     That is why `latest` is only a hint: latest_complete scans every step-* directory and takes
//     the newest one whose manifest verifies.
//   - while old checkpoints are pruned: each doomed directory is first renamed to a .tmp name (one
//     atomic step), then deleted, so a half-deleted checkpoint never appears as step-*.
// A step-N that fails verification anyway (a checkpoint copied by hand and cut short, a disk that
// lost or flipped bytes) is skipped with a one-line reason and the next older one is used.
//
// Saving a step that already exists (typically a corrupt step-N left behind when training resumed
// from an older checkpoint) swaps the new directory in with renameat2(RENAME_EXCHANGE), atomically;
// where the filesystem lacks it, the old directory is moved aside first, and a crash between the
// two renames loses step N but keeps every older checkpoint.
//
// One writer per run directory: two trainers sharing DIR would delete each other's temporaries.
#pragma once

#include "model/file.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace cw {

// Replaces `path` with `text`: writes "<path>.tmp-<pid>", fsyncs it, renames it over `path` and
// fsyncs the directory, so a crash leaves the old content or the new, never a torn file. Throws
// cw::Error naming the path on failure, leaving no temporary behind.
void write_text_atomic(const std::string& path, const std::string& text);

// Rewrites the metrics log at `path` (atomically) keeping only the records whose "step" is <= `step`;
// records without "step" are kept, as are the bytes of every kept line. A last line without its
// newline is a write torn by a crash and is dropped. Used on resume, so that the records of the steps
// about to be trained again do not appear twice. Returns the number of records dropped; a missing
// file is not an error (0). Throws naming the file and line for a complete line that is not valid
// JSON or whose "step" is not an integer.
size_t truncate_metrics_after(const std::string& path, int64_t step);

// The append-only metrics log. Each record becomes one line written with a single write() on an
// O_APPEND descriptor: once append returns, the line is in the kernel and survives the process being
// killed (a power loss can still lose the last lines; the log is not worth an fsync per step).
class MetricsLog {
 public:
  // Opens (creating if needed) `path` for appending. With `resume_step`, first drops the records of
  // later steps (truncate_metrics_after). A last line torn by a crash is cut off, so the next record
  // starts on a line of its own.
  explicit MetricsLog(const std::string& path, std::optional<int64_t> resume_step = std::nullopt);
  MetricsLog(MetricsLog&& other) noexcept = default;
  MetricsLog& operator=(MetricsLog&& other) noexcept = default;

  // Appends `record`, which must be a JSON object, as one line. Strings that are not valid UTF-8 are
  // written with U+FFFD in place of the bad bytes rather than failing the step; NaN becomes null.
  void append(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FileDescriptor fd_;
};

struct CheckpointRef {
  int64_t step = 0;
  std::string path;  // DIR/step-000040
};

// "step-000040": six digits at least, more when the step needs them.
std::string checkpoint_dir_name(int64_t step);

class RunDirectory {
 public:
  // Uses `dir` as the run directory, creating it (and its parents) if missing.
  explicit RunDirectory(const std::string& dir);

  const std::string& path() const { return dir_; }

  // Writes checkpoint `step` (>= 0): creates DIR/.step-N.tmp-PID, calls write_files with it, which
  // must write plain files directly in it (no subdirectories, no "manifest.json"), then completes the
  // checkpoint as the header comment describes and replaces `latest`. Finally prunes: keeps the
  // checkpoint just written and the newest keep_last - 1 complete ones before it (keep_last >= 1),
  // and deletes every other step-* directory: incomplete ones, and ones with a LARGER step, which
  // belong to a timeline abandoned when training resumed from an earlier checkpoint (left in place,
  // the next resume would jump back onto it). If write_files throws, or any step before the rename
  // fails, the temporary directory is deleted and the exception propagates: no step-N appears and
  // `latest` is unchanged.
  CheckpointRef save_checkpoint(int64_t step, const std::function<void(const std::string& tmp_dir)>& write_files,
                                int keep_last);

  // The newest complete checkpoint: its manifest parses, names the directory's step, and every file
  // it lists exists with its size and hash (reading each file once: seconds for large checkpoints).
  // Newer step-* directories that fail, leftover temporaries, and a `latest` naming a checkpoint
  // that does not exist each add one line to `skipped`, e.g.
  //   "runs/x/step-000060: manifest.json missing (interrupted write?); using step-000040".
  std::optional<CheckpointRef> latest_complete(std::vector<std::string>* skipped = nullptr) const;

  // Checkpoint `step` if it exists and is complete; otherwise nullopt, with the reason in `why`.
  std::optional<CheckpointRef> find(int64_t step, std::string* why = nullptr) const;

  // Every complete checkpoint, ascending by step (verifies all of them: reads every file).
  std::vector<CheckpointRef> complete_checkpoints() const;

  // Deletes the .step-*.tmp-* directories of writes and deletions a crash interrupted. Returns how
  // many were removed. Call it only while no other process writes checkpoints into DIR.
  size_t remove_stale_temporaries() const;

 private:
  std::string dir_;
};

// "<base>/<YYYYmmdd-HHMMSS>" in local time: the default run directory of `chunkwise train`.
std::string default_run_dir(const std::string& base = "runs");

}  // namespace cw
