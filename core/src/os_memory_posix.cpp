// os_memory.h on POSIX: mmap/munmap, glibc's malloc_trim (Note [Zero pages per platform]).
#ifndef _WIN32
#include "ddo/core/os_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

namespace ddo::core::os {

void* reserve_zero_pages(std::size_t bytes, std::string* error) {
  void* p = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    *error = fmt::format("mmap of {} bytes of read-only address space failed: {}", bytes,
                         std::strerror(errno));
    return nullptr;
  }
  return p;
}

void release_zero_pages(void* base, std::size_t bytes) {
  if (base != nullptr) munmap(base, bytes);
}

void trim_heap() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

std::size_t page_size() {
  return static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

ProcessMemory process_memory() {
  ProcessMemory m;
  // /proc/self/status: "VmHWM:   123456 kB" and "VmRSS: ..." (Linux). One read of a small file;
  // no allocation beyond the FILE.
  if (std::FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      long long kib = 0;
      if (std::sscanf(line, "VmHWM: %lld kB", &kib) == 1) m.peak_resident_bytes = kib * 1024;
      if (std::sscanf(line, "VmRSS: %lld kB", &kib) == 1) m.resident_bytes = kib * 1024;
    }
    std::fclose(f);
  }
  if (m.peak_resident_bytes < 0) {
    rusage usage{};
    // ru_maxrss is in KiB on Linux and the BSDs, in bytes on macOS.
    if (getrusage(RUSAGE_SELF, &usage) == 0) {
#ifdef __APPLE__
      m.peak_resident_bytes = static_cast<std::int64_t>(usage.ru_maxrss);
#else
      m.peak_resident_bytes = static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
#endif
    }
  }
  return m;
}

}  // namespace ddo::core::os
#endif  // _WIN32
