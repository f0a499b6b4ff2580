// The report's "kernels" entry: for each op kind ddo has a CUDA kernel for, the path it takes on
// the execution device (Note [Kernel images] in sdnq/src/kernel_status.cpp).
#include <string>

#include "ddo/sdnq/kernel_status.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

nlohmann::json kernels_report(const std::string& device_name) {
  nlohmann::json out = nlohmann::json::object();
  sdnq::KernelStatus dequantize;
  if (device_name.rfind("cuda:", 0) == 0) {
    // normalize_device_name checked the index (core::check_device_index).
    dequantize = sdnq::dequantize_kernel_status(std::stoi(device_name.substr(5)));
  } else {
    dequantize = {sdnq::KernelPath::kReference,
                  "the " + device_name + " device computes on the CPU with ATen ops"};
  }
  out["sdnq_dequantize"] = {{"path", sdnq::to_string(dequantize.path)},
                            {"reason", dequantize.reason}};
  return out;
}

}  // namespace ddo::adapter::internal
