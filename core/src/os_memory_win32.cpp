// os_memory.h on Windows: VirtualAlloc/VirtualFree, the CRT's _heapmin (Note [Zero pages per
// platform]).
#ifdef _WIN32
#include "ddo/core/os_memory.h"

#include "win32.h"

#include <psapi.h>
// After windows.h:
#include <malloc.h>

#include <fmt/format.h>

namespace ddo::core::os {

void* reserve_zero_pages(std::size_t bytes, std::string* error) {
  void* p = VirtualAlloc(nullptr, bytes, MEM_RESERVE | MEM_COMMIT, PAGE_READONLY);
  if (p == nullptr) {
    *error = fmt::format(
        "VirtualAlloc of {} bytes of read-only memory failed (Windows error {}); the system's "
        "commit limit (RAM + page file) may be too small",
        bytes, static_cast<unsigned long>(GetLastError()));
  }
  return p;
}

void release_zero_pages(void* base, std::size_t bytes) {
  (void)bytes;  // MEM_RELEASE frees the whole reservation and requires size 0
  if (base != nullptr) VirtualFree(base, 0, MEM_RELEASE);
}

void trim_heap() {
  _heapmin();
}

std::size_t page_size() {
  SYSTEM_INFO info;
  GetSystemInfo(&info);
  return static_cast<std::size_t>(info.dwPageSize);
}

ProcessMemory process_memory() {
  ProcessMemory m;
  PROCESS_MEMORY_COUNTERS counters{};
  counters.cb = sizeof counters;
  if (GetProcessMemoryInfo(GetCurrentProcess(), &counters, sizeof counters)) {
    m.resident_bytes = static_cast<std::int64_t>(counters.WorkingSetSize);
    m.peak_resident_bytes = static_cast<std::int64_t>(counters.PeakWorkingSetSize);
  }
  return m;
}

}  // namespace ddo::core::os
#endif  // _WIN32
