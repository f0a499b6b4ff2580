// The execution device an attach runs on: its name's one parsing rule, the emulated VRAM cap,
// and the engine device, which the backend record of its kind opens (backend_sim.cpp: the host
// simulation; backend_cuda.cpp: a CUDA GPU through LibTorch's allocator).
#include <algorithm>

#include "backend.h"
#include "ddo/core/device_name.h"
#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"
#include "attach_common.h"
#include "offload_state.h"

namespace ddo::adapter {
namespace internal {

double gib(std::int64_t bytes) {
  return core::bytes_to_gib(bytes);
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
  DDO_CHECK(device.type != core::DeviceType::kCpu, Code::kInvalidArgument, "execution_device \"",
            execution_device,
            "\" cannot execute an offload; \"cpu\" is for plan mode only "
            "(execution_mode=plan); use \"cuda:N\" or \"sim\"");
  const std::string name = device.str();
  const internal::Backend& backend = internal::backend_named(name);
  if (backend.open == nullptr) {
    throw Error(Code::kUnavailable,
                ddo::internal::str_cat("execution_device \"", name, "\" needs a ", backend.title,
                                       " build of ddo; this build has no ", backend.title,
                                       " backend. Use execution_device=\"sim\""));
  }
  return backend.open(device.index, config);
}

}  // namespace ddo::adapter
