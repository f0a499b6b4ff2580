// Files for tests, one shape on every platform: a process id for unique names, and a folder
// removed with everything in it. Every test program has this folder on its include path
// (ddo_add_test), so tests outside core name no POSIX or Win32 header themselves.
//
//   fs::path dir = fs::temp_directory_path() / ("t-" + std::to_string(ddo::testing::process_id()));
//   ddo::testing::remove_tree(dir);
#pragma once

#include <cstdio>
#include <filesystem>

#ifdef _WIN32
#include <process.h>
#else
#include <ftw.h>
#include <unistd.h>
#endif

namespace ddo::testing {

inline long process_id() {
#ifdef _WIN32
  return static_cast<long>(_getpid());
#else
  return static_cast<long>(::getpid());
#endif
}

// Removes `path` and what it holds. Not std::filesystem::remove_all: libtorch.so exports its own
// copy of some std::filesystem symbols, and its remove_all crashes when it interposes
// libstdc++'s (seen in the adapter's tests).
inline void remove_tree(const std::filesystem::path& path) {
#ifdef _WIN32
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
#else
  nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
      16, FTW_DEPTH | FTW_PHYS);
#endif
}

}  // namespace ddo::testing
