// os_memory.h on POSIX: mmap/munmap, glibc's malloc_trim (Note [Zero pages per platform]).
#ifndef _WIN32
#include "ddo/core/os_memory.h"

#include <sys/mman.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <cerrno>
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

}  // namespace ddo::core::os
#endif  // _WIN32
