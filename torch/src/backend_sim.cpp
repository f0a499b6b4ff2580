// The simulation's backend record: "sim:N", a capacity-limited host arena (engine's
// sim_device.cpp) whose tensors are CPU tensors, so its interception kernels serve the CPU
// dispatch key and compute with the CPU's kernels on the calling thread.
#include <algorithm>

#include "backend.h"
#include "cpu_math.h"
#include "ddo/core/config.h"
#include "ddo/core/units.h"
#include "ddo/torch/memory_probe.h"
#include "kernels.h"

namespace ddo::adapter::internal {
namespace {

struct SimKernels : CpuMath {
  static const Backend& backend() { return kSimBackend; }
};

std::shared_ptr<engine::Device> open_sim(int index, const core::DynamicOffloadConfig& config) {
  engine::SimDeviceOptions o;
  o.index = index;
  if (config.sim_device_capacity_gb > 0) {
    o.capacity_bytes = core::to_bytes_or_throw(config.sim_device_capacity_gb, core::ByteUnit::kGiB,
                                               "sim_device_capacity_gb");
  }
  o.capacity_bytes = core::effective_card_bytes(o.capacity_bytes, config);
  o.pinnable_bytes = config.sim_pinnable_gb < 0
                         ? -1
                         : core::to_bytes_or_throw(config.sim_pinnable_gb, core::ByteUnit::kGiB,
                                                   "sim_pinnable_gb");
  o.copy_bytes_per_second = config.sim_copy_gbps * 1e9;
  return std::shared_ptr<engine::Device>(engine::make_sim_device(o));
}

Status make_sim_probe(engine::Device& device, int /*index*/, std::unique_ptr<MemoryProbe>* out) {
  *out = make_sim_memory_probe(device);
  return Status::ok_status();
}

// Plan mode opens nothing: the card is the one a run would simulate.
std::int64_t sim_plan_total_bytes(const core::DynamicOffloadConfig& config) {
  return core::to_bytes_or_throw(
      config.sim_device_capacity_gb > 0 ? config.sim_device_capacity_gb : 8.0, core::ByteUnit::kGiB,
      "sim_device_capacity_gb");
}

}  // namespace

const Backend kSimBackend{
    .kind = engine::DeviceKind::kSim,
    .name = "sim",
    .title = "simulation",
    .inputs_on = "the CPU",
    .torch_type = c10::DeviceType::CPU,
    .dispatch_key = c10::DispatchKey::CPU,
    .memory_is_host = true,
    .sdnq_kernels = false,
    .current_stream = nullptr,
    .open = &open_sim,
    .make_probe = &make_sim_probe,
    .plan_total_bytes = &sim_plan_total_bytes,
    .register_kernels = &register_interception_kernels<SimKernels>,
};

}  // namespace ddo::adapter::internal
