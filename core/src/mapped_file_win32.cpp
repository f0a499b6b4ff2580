// mapped_file.h on Windows: file mapping objects and views (Note [File mappings per platform]).
#ifdef _WIN32
#include "ddo/core/mapped_file.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "ddo/core/os_memory.h"
#include "win32.h"

namespace ddo::core {
namespace {

std::string error_text(DWORD error) {
  return std::system_category().message(static_cast<int>(error));
}

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
    file_handle_ = std::exchange(other.file_handle_, nullptr);
    section_handle_ = std::exchange(other.section_handle_, nullptr);
  }
  return *this;
}

void MappedFile::reset() {
  if (data_ != nullptr) ::UnmapViewOfFile(data_);
  if (section_handle_ != nullptr) ::CloseHandle(static_cast<HANDLE>(section_handle_));
  // Last: closing the file deletes a temporary one (FILE_FLAG_DELETE_ON_CLOSE).
  if (file_handle_ != nullptr) ::CloseHandle(static_cast<HANDLE>(file_handle_));
  data_ = nullptr;
  size_ = 0;
  file_handle_ = nullptr;
  section_handle_ = nullptr;
}

Status MappedFile::map_private(const std::string& path, MappedFile* out) {
  MappedFile m;
  const std::wstring wide = std::filesystem::u8path(path).wstring();
  const HANDLE file = ::CreateFileW(wide.c_str(), GENERIC_READ,
                                    FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                                    OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
  if (file == INVALID_HANDLE_VALUE) {
    return Status(Code::kNotFound, fmt::format("cannot open '{}' to map it: {}", path,
                                               error_text(::GetLastError())));
  }
  m.file_handle_ = file;
  LARGE_INTEGER size;
  if (!::GetFileSizeEx(file, &size) || ::GetFileType(file) != FILE_TYPE_DISK) {
    return Status(Code::kNotFound, fmt::format("'{}' is not a regular file to map", path));
  }
  if (size.QuadPart == 0) {
    return Status(Code::kInvalidArgument, fmt::format("'{}' is empty: nothing to map", path));
  }
  const HANDLE section = ::CreateFileMappingW(file, nullptr, PAGE_WRITECOPY, 0, 0, nullptr);
  if (section == nullptr) {
    return Status(Code::kResourceExhausted,
                  fmt::format("mapping '{}' failed: {}", path, error_text(::GetLastError())));
  }
  m.section_handle_ = section;
  void* view = ::MapViewOfFile(section, FILE_MAP_COPY, 0, 0, 0);
  if (view == nullptr) {
    return Status(Code::kResourceExhausted, fmt::format("mapping a view of '{}' failed: {}", path,
                                                        error_text(::GetLastError())));
  }
  m.data_ = static_cast<char*>(view);
  m.size_ = static_cast<std::uint64_t>(size.QuadPart);
  *out = std::move(m);
  return Status::ok_status();
}

Status MappedFile::create_temporary(const std::filesystem::path& dir, std::uint64_t bytes,
                                    MappedFile* out) {
  if (bytes == 0) return Status(Code::kInvalidArgument, "a temporary mapping needs bytes > 0");
  static std::atomic<unsigned> serial{0};
  MappedFile m;
  HANDLE file = INVALID_HANDLE_VALUE;
  DWORD error = 0;
  for (int attempt = 0; attempt < 100 && file == INVALID_HANDLE_VALUE; ++attempt) {
    const std::filesystem::path name =
        dir / fmt::format("ddo-spill-{}-{}.tmp", ::GetCurrentProcessId(), serial++);
    file = ::CreateFileW(name.wstring().c_str(), GENERIC_READ | GENERIC_WRITE,
                         FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                         CREATE_NEW, FILE_ATTRIBUTE_TEMPORARY | FILE_FLAG_DELETE_ON_CLOSE, nullptr);
    error = ::GetLastError();
    if (file == INVALID_HANDLE_VALUE && error != ERROR_FILE_EXISTS) break;
  }
  if (file == INVALID_HANDLE_VALUE) {
    return Status(Code::kUnavailable,
                  fmt::format("cannot create a temporary file in '{}': {}; set TMP to a writable "
                              "directory on a disk",
                              dir.string(), error_text(error)));
  }
  m.file_handle_ = file;
  m.temporary_ = true;
  const HANDLE section =
      ::CreateFileMappingW(file, nullptr, PAGE_READWRITE, static_cast<DWORD>(bytes >> 32),
                           static_cast<DWORD>(bytes & 0xffffffffu), nullptr);
  if (section == nullptr) {
    return Status(Code::kUnavailable,
                  fmt::format("cannot size a temporary file in '{}' to {} bytes: {}", dir.string(),
                              bytes, error_text(::GetLastError())));
  }
  m.section_handle_ = section;
  void* view = ::MapViewOfFile(section, FILE_MAP_READ | FILE_MAP_WRITE, 0, 0, 0);
  if (view == nullptr) {
    return Status(Code::kResourceExhausted,
                  fmt::format("mapping a temporary file of {} bytes in '{}' failed: {}", bytes,
                              dir.string(), error_text(::GetLastError())));
  }
  m.data_ = static_cast<char*>(view);
  m.size_ = bytes;
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
  // Unlocked pages leave the working set; the call reports ERROR_NOT_LOCKED, which is expected.
  ::VirtualUnlock(data_ + first, static_cast<SIZE_T>(last - first));
}

}  // namespace ddo::core
#endif  // _WIN32
