#include "model/file.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cw {

FileDescriptor::FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileDescriptor::~FileDescriptor() { close(); }

int FileDescriptor::close() {
  if (fd_ < 0) return 0;
  const int rc = ::close(std::exchange(fd_, -1));
  return rc == 0 ? 0 : errno;
}

FileReader::FileReader(const std::string& path, const char* kind, const char* hint) : path_(path), kind_(kind) {
  fd_ = FileDescriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd_.is_open()) fail(fmt::format("cannot open {} '{}': {}", kind, path, std::strerror(errno)), "check the path");
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0 || !S_ISREG(st.st_mode))
    fail(fmt::format("{} '{}' is not a regular file", kind, path), hint);
  size_ = static_cast<uint64_t>(st.st_size);
}

void FileReader::read_at(uint64_t offset, void* dst, size_t bytes) const {
  CW_CHECK(fd_.is_open(), "reading {} '{}' through a closed or moved-from reader", kind_, path_);
  auto* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t got = ::pread(fd_.get(), p, bytes, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      fail(fmt::format("{} '{}': read failed at offset {}: {}", kind_, path_, offset, std::strerror(errno)),
           "check the disk and the file");
    if (got == 0)
      fail(fmt::format("{} '{}': truncated: ends before offset {} though its header said otherwise", kind_, path_,
                       offset),
           "the file was cut or rewritten while open: download or export it again");
    p += got;
    bytes -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

void write_all(int fd, const std::string& path, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t put = ::write(fd, p, bytes);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail(fmt::format("cannot write '{}': {}", path, std::strerror(errno)), "check free disk space and permissions");
    p += put;
    bytes -= static_cast<size_t>(put);
  }
}

void fsync_directory(const std::string& dir) {
  const FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.is_open())
    fail(fmt::format("cannot open directory '{}' to fsync it: {}", dir, std::strerror(errno)), "check the directory");
  if (::fsync(fd.get()) != 0)
    fail(fmt::format("cannot fsync directory '{}': {}", dir, std::strerror(errno)), "check the disk");
}

}  // namespace cw
