// Files as the readers and writers of model/ and tools/ use them: an owned descriptor, a file opened
// for reading at offsets (safetensors, GGUF), writes that finish or throw, and the fsync that makes a
// rename durable (atomic checkpoint writes). Every failure is a cw::Error naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cw {

// One open file descriptor, closed when its owner goes; moves keep one owner.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept;
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();

  int get() const { return fd_; }
  bool is_open() const { return fd_ >= 0; }
  // Closes now, returning close()'s errno (0 on success): a write is complete only when close says so.
  int close();

 private:
  int fd_ = -1;
};

// A regular file opened for reading. `kind` names it in errors ("safetensors file", "GGUF file").
class FileReader {
 public:
  FileReader() = default;
  // Throws when the file cannot be opened or is not a regular file (hint: what to point at).
  FileReader(const std::string& path, const char* kind, const char* hint);

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  bool is_open() const { return fd_.is_open(); }
  // Exactly `bytes` at `offset` (pread, retried on EINTR); running short means the file was cut after
  // it was opened: an error saying so.
  void read_at(uint64_t offset, void* dst, size_t bytes) const;

 private:
  FileDescriptor fd_;
  std::string path_;
  const char* kind_ = "file";
  uint64_t size_ = 0;
};

// write() until all `bytes` are written (retried on EINTR); throws naming `path` otherwise.
void write_all(int fd, const std::string& path, const void* data, size_t bytes);
// fsync of a directory: a rename or a new entry in it is durable only then.
void fsync_directory(const std::string& dir);

}  // namespace cw
