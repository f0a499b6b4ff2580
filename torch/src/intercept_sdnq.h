// Interception of ddo::sdnq_linear and ddo::sdnq_dequantize: an SDNQ layer's packed weight,
// scales, zero points and SVD factors stream as one unit (Note [SDNQ layer units] in the
// planner); the kernel stages whichever of them are managed and runs libddo_sdnq's plain kernel
// (dequantize on the device, then linear) over the staged views. Unmanaged calls go straight to
// the plain kernel, as the aten kernels do.
#pragma once

#include "ddo/sdnq/ops.h"
#include "intercept_common.h"

namespace ddo::adapter::internal::kernels {

template <class K>
at::Tensor sdnq_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& zero_point,
                       const std::optional<at::Tensor>& svd_up,
                       const std::optional<at::Tensor>& svd_down,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef layout) {
  if (C10_LIKELY(!any_managed(weight, scale, zero_point, svd_up, svd_down, bias))) {
    return sdnq::linear_kernel(input, weight, scale, zero_point, svd_up, svd_down, bias, layout);
  }
  StageScope scope(K::backend(), "sdnq_linear");
  return sdnq::linear_kernel(input, scope.stage(weight), scope.stage(scale),
                             scope.stage(zero_point), scope.stage(svd_up), scope.stage(svd_down),
                             scope.stage(bias), layout);
}

template <class K>
at::Tensor sdnq_dequantize(const at::Tensor& weight, const at::Tensor& scale,
                           const std::optional<at::Tensor>& zero_point,
                           const std::optional<at::Tensor>& svd_up,
                           const std::optional<at::Tensor>& svd_down, at::IntArrayRef layout) {
  if (C10_LIKELY(!any_managed(weight, scale, zero_point, svd_up, svd_down))) {
    return sdnq::dequantize_kernel(weight, scale, zero_point, svd_up, svd_down, layout);
  }
  StageScope scope(K::backend(), "sdnq_dequantize");
  return sdnq::dequantize_kernel(scope.stage(weight), scope.stage(scale), scope.stage(zero_point),
                                 scope.stage(svd_up), scope.stage(svd_down), layout);
}

}  // namespace ddo::adapter::internal::kernels
