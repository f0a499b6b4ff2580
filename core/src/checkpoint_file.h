// File: positional reads of checkpoint files on POSIX and on Windows, and the UTF-8 path
// conversions (internal to ddo_core). Shared by the safetensors header reader, the component
// directory index and the threaded reader; separate because it is the loader's only file with
// system calls.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>

#include "ddo/core/status.h"

#ifdef _WIN32
#include "win32.h"
#endif

namespace ddo::core::internal {

// Paths travel as UTF-8 std::string (the header's API); std::filesystem converts them to the
// platform's form, so a non-ASCII directory name survives on Windows too.
std::filesystem::path to_path(const std::string& utf8);
std::string path_string(const std::filesystem::path& path);

// An open file for positional reads, shared by reader threads (pread and ReadFile with an offset
// carry no file position between calls).
class File {
 public:
  File() = default;
  File(File&& other) noexcept : handle_(std::exchange(other.handle_, kNoHandle)) {}
  File& operator=(File&& other) noexcept {
    if (this != &other) {
      close();
      handle_ = std::exchange(other.handle_, kNoHandle);
    }
    return *this;
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() { close(); }

  // kNotFound naming `path` when it cannot be opened; kInvalidArgument when it is not a regular
  // file (a FIFO would block a reader forever). Sets *size_bytes to its size.
  static Status open(const std::string& path, File* out, std::uint64_t* size_bytes);

  // Reads up to `bytes` at `offset` into `dst`: the count read, 0 at the end of the file, or -1
  // with *error set.
  std::int64_t read_at(void* dst, std::uint64_t bytes, std::uint64_t offset,
                       std::string* error) const;

  // Asks the OS to drop the page-cache pages wholly inside [offset, offset + bytes). A hint: no
  // error, and nothing on systems without posix_fadvise.
  void drop_cached(std::uint64_t offset, std::uint64_t bytes) const;

  // The file's size and last-write time now; false when the system cannot say.
  bool stamp(std::uint64_t* size, std::int64_t* modified) const;

 private:
#ifdef _WIN32
  using Handle = HANDLE;
  static inline const Handle kNoHandle = INVALID_HANDLE_VALUE;
#else
  using Handle = int;
  static constexpr Handle kNoHandle = -1;
#endif
  void close();

  Handle handle_ = kNoHandle;
};

// Reads exactly `bytes` at `offset`; `what` says what the bytes are, for the message. kDataLoss
// when the file ends first or the read fails.
Status read_exact(const File& file, const std::string& path, std::string_view what, void* dst,
                  std::uint64_t bytes, std::uint64_t offset);

}  // namespace ddo::core::internal
