// The CUDA half of MemoryProbe: the driver view (through the engine's device seam,
// engine::Device::memory), LibTorch's caching allocator figures, and the emulated VRAM cap. Built
// without CUDA, every entry point reports kUnavailable.
#include "ddo/torch/memory_probe.h"

#include <algorithm>
#include <array>

#if DDO_HAVE_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "ddo/engine/device.h"
#endif

namespace ddo::adapter {

namespace {

constexpr int kMaxDevices = 64;
// The cap per device, 0 when none. Atomic: probes' sampling threads read it.
std::array<std::atomic<std::int64_t>, kMaxDevices> g_caps{};

}  // namespace

std::int64_t vram_cap_bytes(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  return g_caps[device].load();
}

#if DDO_HAVE_CUDA

namespace {

using c10::CachingDeviceAllocator::StatType;

constexpr auto kAggregate = static_cast<std::size_t>(StatType::AGGREGATE);

Status check_device(int device) {
  if (!cuda_memory_probe_available()) {
    return Status(Code::kUnavailable, "no CUDA GPU is visible to LibTorch in this process");
  }
  const int count = c10::cuda::device_count();
  if (device < 0 || device >= count || device >= kMaxDevices) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("CUDA device ", device, " does not exist; this machine has ",
                                    count, " (cuda:0 .. cuda:", count - 1, ")"));
  }
  // The caching allocator is created by LibTorch's lazy CUDA initialisation; its statistics and
  // memory fraction assert that it exists.
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return Status();
}

// The driver's figures for the card (no cap: the probe applies the emulated cap itself).
Status driver_memory(engine::Device& device, engine::DeviceMemory* out) {
  try {
    *out = device.memory();
  } catch (const Error& e) {
    return Status(Code::kUnavailable,
                  internal::str_cat("reading the CUDA device's memory failed: ", e.what()));
  }
  return Status();
}

// The driver view of the card `device`, through a device of the seam opened for the query.
Status open_driver(int device, std::unique_ptr<engine::Device>* out) {
  engine::CudaDeviceOptions options;
  options.index = device;
  return engine::make_cuda_device(options, out);
}

Status driver_memory(int device, engine::DeviceMemory* out) {
  std::unique_ptr<engine::Device> driver;
  DDO_RETURN_IF_ERROR(open_driver(device, &driver));
  return driver_memory(*driver, out);
}

class CudaMemoryProbe final : public MemoryProbe {
 public:
  CudaMemoryProbe(int device, std::unique_ptr<engine::Device> driver)
      : device_(device), driver_(std::move(driver)) {}
  ~CudaMemoryProbe() override { abandon_sampling(); }

  MemorySnapshot snapshot() override {
    engine::DeviceMemory driver;
    throw_if_error(driver_memory(*driver_, &driver));
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_));
    MemorySnapshot s;
    const std::int64_t cap = vram_cap_bytes(device_);
    s.total_bytes = cap > 0 ? cap : driver.total_bytes;
    s.driver_used_bytes = driver.used_bytes;
    s.allocator_allocated_bytes = stats.allocated_bytes[kAggregate].current;
    s.allocator_reserved_bytes = stats.reserved_bytes[kAggregate].current;
    s.allocator_peak_reserved_bytes = stats.reserved_bytes[kAggregate].peak;
    return s;
  }

  std::int64_t driver_used_bytes() override {
    engine::DeviceMemory driver;
    if (!driver_memory(*driver_, &driver).ok()) return 0;  // a sample lost, not a failed region
    return driver.used_bytes;
  }

  // Region boundaries only: every stream of the device, not just the current one, because ddo's
  // copy stream and the host's streams all hold memory the region must account for.
  void synchronize() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    c10::cuda::device_synchronize();
  }

  void reset_peak() override {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device_));
  }

  std::string device_name() const override { return internal::str_cat("cuda:", device_); }

 private:
  int device_;
  std::unique_ptr<engine::Device> driver_;  // queried only, never allocates
};

}  // namespace

bool cuda_memory_probe_available() {
  return c10::cuda::device_count() > 0;
}

Status make_cuda_memory_probe(int device, std::unique_ptr<MemoryProbe>* out) {
  DDO_RETURN_IF_ERROR(check_device(device));
  std::unique_ptr<engine::Device> driver;
  DDO_RETURN_IF_ERROR(open_driver(device, &driver));
  *out = std::make_unique<CudaMemoryProbe>(device, std::move(driver));
  return Status();
}

// Note [Emulated VRAM cap]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A large GPU must be able to run the plan of an 8 GiB card and fail where that card would.
// LibTorch's caching allocator can refuse memory above a fraction of the card
// (setMemoryFraction): it then frees its cache and, if still over, throws
// c10::OutOfMemoryError, exactly as on a full card. The fraction bounds only the allocator's
// reserved bytes, while a real card also holds the CUDA context, cuBLAS/cuDNN handles and other
// libraries' memory. So the allocator's limit is the cap minus what is in use outside the
// allocator when the cap is applied:
//     fraction = (cap - (driver used - allocator reserved)) / card total
// and the driver view (what calibration and the benchmark report) stays at or under the cap as
// long as non-allocator usage does not grow later (a cuBLAS workspace created after the cap is
// the usual culprit: run one matmul before applying it). Probes report the cap as the total, so
// calibration's recommendation (total - peak - headroom) is the small card's. Memory ddo allocates
// for staging goes through the caching allocator (CudaDeviceOptions::alloc), so the cap covers it.
Status apply_vram_cap(int device, std::int64_t cap_bytes) {
  if (cap_bytes < 0) {
    return Status(Code::kInvalidArgument, internal::str_cat("VRAM cap of ", cap_bytes,
                                                            " bytes is negative; use 0 for none"));
  }
  DDO_RETURN_IF_ERROR(check_device(device));
  const auto index = static_cast<c10::DeviceIndex>(device);
  // Cached blocks above the new limit would otherwise stay reserved.
  c10::cuda::CUDACachingAllocator::emptyCache();
  if (cap_bytes == 0) {
    c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, index);
    g_caps[device].store(0);
    return Status();
  }
  engine::DeviceMemory driver;
  DDO_RETURN_IF_ERROR(driver_memory(device, &driver));
  if (cap_bytes > driver.total_bytes) {
    return Status(
        Code::kInvalidArgument,
        internal::str_cat("VRAM cap of ", cap_bytes, " bytes exceeds cuda:", device, "'s ",
                          driver.total_bytes, " bytes; use a smaller cap or 0 for none"));
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const std::int64_t non_allocator =
      std::max<std::int64_t>(0, driver.used_bytes - stats.reserved_bytes[kAggregate].current);
  if (cap_bytes <= non_allocator) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("VRAM cap of ", cap_bytes, " bytes on cuda:", device,
                                    " leaves nothing for tensors: ", non_allocator,
                                    " bytes are already used outside LibTorch's allocator"));
  }
  const double fraction =
      static_cast<double>(cap_bytes - non_allocator) / static_cast<double>(driver.total_bytes);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, index);
  g_caps[device].store(cap_bytes);
  return Status();
}

AllocatorCounters allocator_counters(int device) {
  AllocatorCounters c;
  if (!check_device(device).ok()) return c;
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  c.alloc_retries = stats.num_alloc_retries;
  c.ooms = stats.num_ooms;
  c.device_allocs = stats.num_device_alloc;
  c.device_frees = stats.num_device_free;
  c.sync_all_streams = stats.num_sync_all_streams;
  return c;
}

void release_cached_device_memory() {
  if (cuda_memory_probe_available()) c10::cuda::CUDACachingAllocator::emptyCache();
}

#else  // !DDO_HAVE_CUDA

AllocatorCounters allocator_counters(int device) {
  return {};
}

void release_cached_device_memory() {}

bool cuda_memory_probe_available() {
  return false;
}

Status make_cuda_memory_probe(int device, std::unique_ptr<MemoryProbe>* out) {
  return Status(Code::kUnavailable, "ddo was built without CUDA; no CUDA memory probe");
}

Status apply_vram_cap(int device, std::int64_t cap_bytes) {
  return Status(Code::kUnavailable, "ddo was built without CUDA; no VRAM cap to apply");
}

#endif  // DDO_HAVE_CUDA

}  // namespace ddo::adapter
