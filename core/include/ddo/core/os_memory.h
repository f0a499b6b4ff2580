/// \file
/// The operating system's memory calls the LibTorch adapter needs, one function per step, so
/// that no file outside core names a POSIX or Win32 header (a ctest, posix_includes, fails when
/// one does). POSIX in core/src/os_memory_posix.cpp, Win32 in core/src/os_memory_win32.cpp.
///
/// ```
/// std::string why;
/// void* zeros = ddo::core::os::reserve_zero_pages(std::size_t{4} << 30, &why);  // reads as 0
/// if (zeros == nullptr) ... why ...
/// ddo::core::os::release_zero_pages(zeros, std::size_t{4} << 30);
/// ddo::core::os::trim_heap();   // after freeing many small tensors
/// ```
#pragma once

// Note [Zero pages per platform]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The loader's placeholders (Note [Placeholders] in torch/src/loader.cpp) need address space
// that reads as zeros, faults on a write, and costs no memory. POSIX gives exactly that:
// mmap(PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE), every page the one zero page.
// Windows has no uncommitted readable memory, so VirtualAlloc(MEM_RESERVE | MEM_COMMIT,
// PAGE_READONLY) commits it: still no physical memory until touched (and a read-only page is
// never written), but the size counts against the system's commit limit (RAM + page file).

#include <cstddef>
#include <cstdint>
#include <string>

namespace ddo::core::os {

/// Reserves `bytes` of read-only memory that reads as zeros (Note [Zero pages per platform]).
/// nullptr when the system refuses, with `*error` saying what failed and why.
void* reserve_zero_pages(std::size_t bytes, std::string* error);

/// Gives back what reserve_zero_pages returned (`bytes` as passed to it).
void release_zero_pages(void* base, std::size_t bytes);

/// Hands the C library's freed heap pages back to the system where it keeps them: malloc_trim(0)
/// with glibc, _heapmin() on Windows, nothing elsewhere.
void trim_heap();

/// The page size of the system (getpagesize / GetSystemInfo).
std::size_t page_size();

/// This process's physical memory: what it holds now and the most it held since it began (or
/// since the peak was last reset, on Linux by writing 5 to /proc/self/clear_refs). -1 where the
/// system cannot tell.
struct ProcessMemory {
  std::int64_t resident_bytes = -1;       ///< Linux VmRSS, Windows WorkingSetSize
  std::int64_t peak_resident_bytes = -1;  ///< Linux VmHWM, Windows PeakWorkingSetSize
};

/// Reads ProcessMemory: /proc/self/status on Linux (getrusage's peak elsewhere on POSIX),
/// GetProcessMemoryInfo on Windows. Cheap enough to sample every few milliseconds.
ProcessMemory process_memory();

}  // namespace ddo::core::os
