/// \file
/// The ddo::sdnq_* dispatcher ops: how an SDNQ layer's forward reaches ddo.
///
/// The schema lives in libddo_sdnq (TORCH_LIBRARY(ddo)); its CPU and CUDA kernels compute on the
/// tensors they are given (dequantize, then linear). While an offload is active, ddo_torch
/// registers kernels over them that first stage managed (streamed) tensors on the execution
/// device, exactly as it does for aten::addmm (docs/design/0001-interception.md). So a layer
/// calls the op through the dispatcher and never knows whether its weight is resident.
///
/// ```
/// Python:  torch.ops.ddo.sdnq_linear(x, weight, scale, zero_point, svd_up, svd_down, bias,
///                                    layout_code)
/// C++:     at::Tensor y = ddo::sdnq::call_linear(x, weights, bias, layout.encode());
/// ```
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "ddo/sdnq/layout.h"

namespace ddo::sdnq {

/// Through the dispatcher (so the active offload's kernels run); optional tensors may be
/// undefined.
at::Tensor call_linear(const at::Tensor& input, const QuantizedWeight& w, const at::Tensor& bias,
                       c10::IntArrayRef layout_code);
/// The dequantized weight through the dispatcher (ddo::sdnq_dequantize).
at::Tensor call_dequantize(const QuantizedWeight& w, c10::IntArrayRef layout_code);

/// The plain kernels (no staging): what the ops compute on resident tensors, and what ddo_torch's
/// staging kernels call once the tensors are on the device.
at::Tensor linear_kernel(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zero_point,
                         const std::optional<at::Tensor>& svd_up,
                         const std::optional<at::Tensor>& svd_down,
                         const std::optional<at::Tensor>& bias, c10::IntArrayRef layout_code);
/// The plain dequantize kernel; see linear_kernel.
at::Tensor dequantize_kernel(const at::Tensor& weight, const at::Tensor& scale,
                             const std::optional<at::Tensor>& zero_point,
                             const std::optional<at::Tensor>& svd_up,
                             const std::optional<at::Tensor>& svd_down,
                             c10::IntArrayRef layout_code);

}  // namespace ddo::sdnq
