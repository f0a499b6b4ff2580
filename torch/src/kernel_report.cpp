// The report's "kernels" entry: for each op kind ddo has a CUDA kernel for, the path it takes on
// the execution device (Note [Kernel images] in sdnq/src/kernel_status.cpp), and the GEMM each
// quantized-matmul type runs there (quantized_matmul.h) for a full-size bfloat16 layer.
#include <string>

#include "backend.h"
#include "ddo/core/device_name.h"
#include "ddo/sdnq/kernel_status.h"
#include "ddo/sdnq/quantized_matmul.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

nlohmann::json kernels_report(const std::string& device_name) {
  nlohmann::json out = nlohmann::json::object();
  // normalize_device_name gave the canonical name (core::DeviceName).
  core::DeviceName name;
  throw_if_error(core::parse_device_name("device", device_name, &name));
  const Backend& backend = backend_named(device_name);
  const c10::Device device = backend.torch_device(name.index);
  sdnq::KernelStatus dequantize;
  if (backend.sdnq_kernels) {
    dequantize = sdnq::dequantize_kernel_status(device.index());
  } else {
    dequantize = {sdnq::KernelPath::kReference,
                  "the " + device_name + " device computes on the CPU with ATen ops"};
  }
  const nlohmann::json status = {{"path", sdnq::to_string(dequantize.path)},
                                 {"reason", dequantize.reason}};
  // One library, one architecture list: the quantizer and the epilogue share the status.
  out["sdnq_dequantize"] = status;
  out["sdnq_quantize_rows"] = status;
  out["sdnq_int8_epilogue"] = status;
  // The simulation computes on the CPU: the CPU's rules.
  const sdnq::GemmTarget target = sdnq::gemm_target(device);
  for (const sdnq::QuantType type : {sdnq::QuantType::kInt8, sdnq::QuantType::kFloat8E4M3}) {
    sdnq::Layout layout;
    layout.type = type;
    layout.out = 3072;
    layout.in = 3072;
    layout.quantized_matmul = true;
    const sdnq::LinearPathChoice c =
        sdnq::choose_linear_path(layout, c10::kFloat, c10::kBFloat16, 4096, target);
    out[std::string("quantized_matmul_") + sdnq::to_string(type)] = {
        {"path", sdnq::to_string(c.path)}, {"reason", std::string(c.why)}};
  }
  return out;
}

}  // namespace ddo::adapter::internal
