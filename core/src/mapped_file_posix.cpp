// mapped_file.h on POSIX: mmap/munmap/madvise (Note [File mappings per platform]).
#ifndef _WIN32
#include "ddo/core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "ddo/core/os_memory.h"

namespace ddo::core {
namespace {

// Closes a descriptor at scope exit: the mapping keeps the file open by itself.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

MappedFile::~MappedFile() {
  reset();
}

MappedFile::MappedFile(MappedFile&& other) noexcept {
  *this = std::move(other);
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    temporary_ = other.temporary_;
  }
  return *this;
}

void MappedFile::reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

Status MappedFile::map_private(const std::string& path, MappedFile* out) {
  FdCloser fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) {
    return Status(Code::kNotFound,
                  fmt::format("cannot open '{}' to map it: {}", path, std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return Status(Code::kNotFound, fmt::format("'{}' is not a regular file to map", path));
  }
  if (st.st_size == 0) {
    return Status(Code::kInvalidArgument, fmt::format("'{}' is empty: nothing to map", path));
  }
  const auto bytes = static_cast<std::uint64_t>(st.st_size);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd.fd, 0);
  if (p == MAP_FAILED) {
    return Status(Code::kResourceExhausted, fmt::format("mapping {} bytes of '{}' failed: {}",
                                                        bytes, path, std::strerror(errno)));
  }
  MappedFile m;
  m.data_ = static_cast<char*>(p);
  m.size_ = bytes;
  *out = std::move(m);
  return Status::ok_status();
}

Status MappedFile::create_temporary(const std::filesystem::path& dir, std::uint64_t bytes,
                                    MappedFile* out) {
  if (bytes == 0) return Status(Code::kInvalidArgument, "a temporary mapping needs bytes > 0");
  std::string name = (dir / "ddo-spill-XXXXXX").string();
  FdCloser fd{::mkstemp(name.data())};
  if (fd.fd < 0) {
    return Status(Code::kUnavailable,
                  fmt::format("cannot create a temporary file in '{}': {}; set TMPDIR to a "
                              "writable directory on a disk",
                              dir.string(), std::strerror(errno)));
  }
  ::unlink(name.c_str());  // gone with the last mapping, even if the process dies
  // Note [A spill file is allocated first]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A file sized by ftruncate is sparse: the filesystem finds its blocks at the first write
  // through the mapping, and on a full disk that write is a SIGBUS, with no error to return.
  // posix_fallocate reserves every block here instead (glibc writes zeros where the filesystem
  // cannot reserve), so a full disk is a status naming the directory and the bytes.
  if (const int err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes)); err != 0) {
    const bool full = err == ENOSPC || err == EFBIG || err == EDQUOT;
    return Status(full ? Code::kResourceExhausted : Code::kUnavailable,
                  fmt::format("cannot allocate a temporary file of {} bytes in '{}': {}; set "
                              "TMPDIR to a directory on a disk with that much free space",
                              bytes, dir.string(), std::strerror(err)));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0);
  if (p == MAP_FAILED) {
    return Status(Code::kResourceExhausted,
                  fmt::format("mapping a temporary file of {} bytes in '{}' failed: {}", bytes,
                              dir.string(), std::strerror(errno)));
  }
  MappedFile m;
  m.data_ = static_cast<char*>(p);
  m.size_ = bytes;
  m.temporary_ = true;
  *out = std::move(m);
  return Status::ok_status();
}

void MappedFile::drop_pages(std::uint64_t offset, std::uint64_t bytes) {
  if (!temporary_ || data_ == nullptr || offset >= size_) return;
  const std::uint64_t page = os::page_size();
  const std::uint64_t end = std::min(size_, offset + bytes);
  const std::uint64_t first = (offset + page - 1) / page * page;
  const std::uint64_t last = end == size_ ? end : end / page * page;
  if (last <= first) return;
  ::madvise(data_ + first, last - first, MADV_DONTNEED);
}

}  // namespace ddo::core
#endif  // _WIN32
