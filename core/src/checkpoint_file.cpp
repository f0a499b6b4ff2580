#include "checkpoint_file.h"

#include <system_error>

#include <fmt/format.h>

#ifndef _WIN32
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace ddo::core::internal {
namespace fs = std::filesystem;

fs::path to_path(const std::string& utf8) {
  return fs::path(std::u8string(utf8.begin(), utf8.end()));
}

std::string path_string(const fs::path& path) {
  const std::u8string utf8 = path.u8string();
  return std::string(utf8.begin(), utf8.end());
}

namespace {

// One read call moves at most this much: Linux caps read() at 0x7ffff000 bytes, ReadFile takes a
// 32-bit count.
constexpr std::uint64_t kMaxReadCall = std::uint64_t{1} << 30;

Status cannot_open(const std::string& path, const std::string& reason) {
  return Status(
      Code::kNotFound,
      fmt::format("cannot open '{}': {}; check the path and its permissions", path, reason));
}

#ifdef _WIN32

std::string windows_error_text(DWORD error) {
  return std::system_category().message(static_cast<int>(error));
}

#else

std::string errno_text(int err) {
  return std::error_code(err, std::generic_category()).message();
}

#endif

}  // namespace

#ifdef _WIN32

Status File::open(const std::string& path, File* out, std::uint64_t* size_bytes) {
  const std::wstring wide = to_path(path).wstring();
  // Sharing write and delete as well: a reader must not stop the user from replacing a file; a
  // replaced file shows up as a size change or a short read, both errors.
  const HANDLE handle = ::CreateFileW(
      wide.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
      OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL | FILE_FLAG_SEQUENTIAL_SCAN, nullptr);
  if (handle == INVALID_HANDLE_VALUE)
    return cannot_open(path, windows_error_text(::GetLastError()));
  File file;
  file.handle_ = handle;
  if (::GetFileType(handle) != FILE_TYPE_DISK) {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' is not a regular file; pass a .safetensors file", path));
  }
  LARGE_INTEGER size;
  if (!::GetFileSizeEx(handle, &size)) {
    return cannot_open(path, windows_error_text(::GetLastError()));
  }
  *size_bytes = static_cast<std::uint64_t>(size.QuadPart);
  *out = std::move(file);
  return Status::ok_status();
}

std::int64_t File::read_at(void* dst, std::uint64_t bytes, std::uint64_t offset,
                           std::string* error) const {
  OVERLAPPED at = {};
  at.Offset = static_cast<DWORD>(offset & 0xffffffffu);
  at.OffsetHigh = static_cast<DWORD>(offset >> 32);
  DWORD got = 0;
  if (!::ReadFile(handle_, dst, static_cast<DWORD>(std::min(bytes, kMaxReadCall)), &got, &at)) {
    const DWORD code = ::GetLastError();
    if (code == ERROR_HANDLE_EOF) return 0;
    *error = windows_error_text(code);
    return -1;
  }
  return static_cast<std::int64_t>(got);
}

void File::drop_cached(std::uint64_t, std::uint64_t) const {}  // Windows: no such hint

bool File::stamp(std::uint64_t* size, std::int64_t* modified) const {
  BY_HANDLE_FILE_INFORMATION info;
  if (!::GetFileInformationByHandle(handle_, &info)) return false;
  *size = (static_cast<std::uint64_t>(info.nFileSizeHigh) << 32) | info.nFileSizeLow;
  *modified = static_cast<std::int64_t>(
      (static_cast<std::uint64_t>(info.ftLastWriteTime.dwHighDateTime) << 32) |
      info.ftLastWriteTime.dwLowDateTime);
  return true;
}

void File::close() {
  if (handle_ != kNoHandle) ::CloseHandle(handle_);
  handle_ = kNoHandle;
}

#else  // POSIX

Status File::open(const std::string& path, File* out, std::uint64_t* size_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it has no effect on regular files.
  int flags = O_RDONLY | O_NONBLOCK;
#ifdef O_CLOEXEC
  flags |= O_CLOEXEC;
#endif
  int fd = -1;
  do {
    fd = ::open(path.c_str(), flags);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return cannot_open(path, errno_text(errno));
  File file;
  file.handle_ = fd;
  struct stat st;
  if (::fstat(fd, &st) != 0) return cannot_open(path, errno_text(errno));
  if (!S_ISREG(st.st_mode)) {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' is not a regular file; pass a .safetensors file", path));
  }
#if defined(POSIX_FADV_SEQUENTIAL)
  // A hint only (larger read-ahead): each reader thread walks its pieces forwards.
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  *size_bytes = static_cast<std::uint64_t>(st.st_size);
  *out = std::move(file);
  return Status::ok_status();
}

std::int64_t File::read_at(void* dst, std::uint64_t bytes, std::uint64_t offset,
                           std::string* error) const {
  for (;;) {
    const ssize_t got =
        ::pread(handle_, dst, static_cast<std::size_t>(std::min(bytes, kMaxReadCall)),
                static_cast<off_t>(offset));
    if (got >= 0) return static_cast<std::int64_t>(got);
    if (errno == EINTR) continue;
    *error = errno_text(errno);
    return -1;
  }
}

bool File::stamp(std::uint64_t* size, std::int64_t* modified) const {
  struct stat st;
  if (::fstat(handle_, &st) != 0) return false;
  *size = static_cast<std::uint64_t>(st.st_size);
  *modified = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return true;
}

void File::drop_cached(std::uint64_t offset, std::uint64_t bytes) const {
#if defined(POSIX_FADV_DONTNEED)
  (void)::posix_fadvise(handle_, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                        POSIX_FADV_DONTNEED);
#else
  (void)offset;
  (void)bytes;
#endif
}

void File::close() {
  if (handle_ != kNoHandle) ::close(handle_);
  handle_ = kNoHandle;
}

#endif  // _WIN32

// Reads exactly `bytes` at `offset`; `what` says what the bytes are, for the message. kDataLoss
// when the file ends first or the read fails.
Status read_exact(const File& file, const std::string& path, std::string_view what, void* dst,
                  std::uint64_t bytes, std::uint64_t offset) {
  auto* out = static_cast<char*>(dst);
  std::uint64_t done = 0;
  while (done < bytes) {
    std::string error;
    const std::int64_t got = file.read_at(out + done, bytes - done, offset + done, &error);
    if (got < 0) {
      return Status(Code::kDataLoss,
                    fmt::format("{}: reading {} ({} bytes at offset {}) failed: {}", path, what,
                                bytes, offset, error));
    }
    if (got == 0) {
      return Status(Code::kDataLoss,
                    fmt::format("file truncated: {}: {} expected {} bytes at offset {} but the "
                                "file ended after {}; it changed on disk since it was opened or "
                                "the download is incomplete — re-download it and open it again",
                                path, what, bytes, offset, done));
    }
    done += static_cast<std::uint64_t>(got);
  }
  return Status::ok_status();
}

}  // namespace ddo::core::internal
