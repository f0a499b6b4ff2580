// Helpers shared by the GPU tests (label "gpu"): the card, what the process holds on it now, and
// a guard that lifts an emulated VRAM cap however a test ends.
#pragma once

#include <cstdint>
#include <memory>

#include <c10/core/Device.h>

#include "ddo/core/status.h"
#include "ddo/torch/memory_probe.h"

namespace ddo::adapter::test {

inline constexpr std::int64_t kMiB = std::int64_t{1} << 20;
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
inline const c10::Device kCuda(c10::kCUDA, 0);

// Driver-view bytes in use on cuda:0 (this process's context and allocations included).
inline std::int64_t driver_used_now() {
  std::unique_ptr<MemoryProbe> probe;
  throw_if_error(make_cuda_memory_probe(0, &probe));
  probe->synchronize();
  return probe->snapshot().driver_used_bytes;
}

// Removes the emulated cap however a test ends.
struct CapReset {
  ~CapReset() { (void)apply_vram_cap(0, 0); }
};

}  // namespace ddo::adapter::test
