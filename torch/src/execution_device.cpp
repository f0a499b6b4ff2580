// The execution device an attach runs on: its name's one parsing rule, the emulated VRAM cap,
// and the engine device (the host simulation or a CUDA GPU through LibTorch's allocator).
#include <algorithm>
#include <map>
#include <mutex>

#include <ATen/Context.h>
#ifdef DDO_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "ddo/core/device_name.h"
#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"
#include "attach_common.h"
#include "offload_state.h"

namespace ddo::adapter {
namespace internal {

std::int64_t capped_vram_bytes(std::int64_t total_bytes, const core::DynamicOffloadConfig& config) {
  if (config.vram_cap_gb <= 0) return total_bytes;
  const auto cap = static_cast<std::int64_t>(config.vram_cap_gb * core::kGiB);
  return total_bytes > 0 ? std::min(total_bytes, cap) : cap;
}

double gib(std::int64_t bytes) {
  return static_cast<double>(bytes) / core::kGiB;
}

std::string normalize_device_name(const std::string& device) {
  core::DeviceName name;
  throw_if_error(core::parse_device_name("execution_device", device, &name));
  return name.str();
}

}  // namespace internal

std::shared_ptr<engine::Device> open_execution_device(const std::string& execution_device,
                                                      const core::DynamicOffloadConfig& config) {
  core::DeviceName device;
  throw_if_error(core::parse_device_name("execution_device", execution_device, &device));
  const std::string name = device.str();
  const int index = device.index;
  if (device.type == core::DeviceType::kSim) {
    engine::SimDeviceOptions o;
    o.index = index;
    if (config.sim_device_capacity_gb > 0) {
      o.capacity_bytes = static_cast<std::int64_t>(config.sim_device_capacity_gb * core::kGiB);
    }
    if (config.vram_cap_gb > 0) {
      o.capacity_bytes =
          std::min(o.capacity_bytes, static_cast<std::int64_t>(config.vram_cap_gb * core::kGiB));
    }
    o.pinnable_bytes = config.sim_pinnable_gb < 0
                           ? -1
                           : static_cast<std::int64_t>(config.sim_pinnable_gb * core::kGiB);
    o.copy_bytes_per_second = config.sim_copy_gbps * 1e9;
    return std::shared_ptr<engine::Device>(engine::make_sim_device(o));
  }
  DDO_CHECK(device.type == core::DeviceType::kCuda, Code::kInvalidArgument, "execution_device \"",
            execution_device,
            "\" cannot execute an offload; \"cpu\" is for plan mode only "
            "(execution_mode=plan); use \"cuda:N\" or \"sim\"");
#ifdef DDO_HAVE_CUDA
  DDO_CHECK(engine::cuda_available(), Code::kUnavailable, "execution_device \"", name,
            "\" needs a GPU, but CUDA reports none; use execution_device=\"sim\" to run on the "
            "host simulation");
  // raw_alloc asserts unless LibTorch's CUDA state exists; a host that has not touched CUDA
  // yet (no CUDA tensor made) would otherwise fail at the first staging allocation.
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  const std::int64_t cap = static_cast<std::int64_t>(config.vram_cap_gb * core::kGiB);
  const std::int64_t cap_before = vram_cap_bytes(index);
  if (cap > 0) throw_if_error(apply_vram_cap(index, cap));
  engine::CudaDeviceOptions o;
  o.index = index;
  o.cap_bytes = cap;
  // The pin-failure knob works on a real card too, so fallback is testable there.
  o.pinnable_bytes = config.sim_pinnable_gb < 0
                         ? -1
                         : static_cast<std::int64_t>(config.sim_pinnable_gb * core::kGiB);
  // Through LibTorch's caching allocator, so its statistics and the emulated cap see ddo's
  // staging and residents.
  o.alloc = [index](std::size_t bytes) -> void* {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
  };
  o.free = [index](void* ptr) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    c10::cuda::CUDACachingAllocator::raw_delete(ptr);
  };
  std::unique_ptr<engine::Device> dev;
  throw_if_error(engine::make_cuda_device(o, &dev));
  if (cap <= 0) return std::shared_ptr<engine::Device>(std::move(dev));
  // The emulated card lasts as long as the devices that asked for it: when the last one goes
  // (the offload, every component of a pipeline), the process gets back the cap it had before
  // the first. Counted per GPU, since setup may open a device more than once.
  struct CapHolders {
    std::mutex mu;
    std::map<int, std::pair<int, std::int64_t>> by_index;  // index -> (holders, cap before)
  };
  static CapHolders* holders = new CapHolders();  // never destroyed: devices may outlive statics
  {
    std::lock_guard<std::mutex> lock(holders->mu);
    auto& [count, before] = holders->by_index[index];
    if (count++ == 0) before = cap_before;
  }
  return std::shared_ptr<engine::Device>(dev.release(), [index](engine::Device* d) {
    delete d;
    std::lock_guard<std::mutex> lock(holders->mu);
    auto& [count, before] = holders->by_index[index];
    if (--count > 0) return;
    try {
      (void)apply_vram_cap(index, before);
    } catch (...) {  // at process exit CUDA may already be gone; nothing is left to restore
    }
  });
#else
  throw Error(
      Code::kUnavailable,
      ddo::internal::str_cat("execution_device \"", name,
                             "\" needs a CUDA build of ddo; this build has no CUDA backend. "
                             "Use execution_device=\"sim\""));
#endif
}

}  // namespace ddo::adapter
