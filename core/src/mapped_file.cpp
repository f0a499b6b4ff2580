// MappedFile's platform-neutral part: where temporary files go. The mappings themselves are
// mapped_file_posix.cpp and mapped_file_win32.cpp.
#include <cstdlib>
#include <system_error>

#include <fmt/format.h>

#include "ddo/core/mapped_file.h"

namespace ddo::core {

Status MappedFile::temporary_directory(std::filesystem::path* out) {
  std::error_code ec;
  std::filesystem::path dir = std::filesystem::temp_directory_path(ec);
  if (!ec && std::filesystem::is_directory(dir, ec)) {
    *out = std::move(dir);
    return Status::ok_status();
  }
  // Name the variable the system read, with its value, so the fix is obvious.
#ifdef _WIN32
  const char* const names[] = {"TMP", "TEMP", "USERPROFILE"};
#else
  const char* const names[] = {"TMPDIR"};
#endif
  for (const char* name : names) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      return Status(Code::kUnavailable,
                    fmt::format("no directory for temporary files: {}='{}' is not a directory "
                                "({}); set {} to a writable directory on a disk",
                                name, value, ec ? ec.message() : "not found", name));
    }
  }
  return Status(Code::kUnavailable,
                fmt::format("no directory for temporary files ({}); set {} to a writable "
                            "directory on a disk",
                            ec ? ec.message() : "not found", names[0]));
}

}  // namespace ddo::core
