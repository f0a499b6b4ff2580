// Interception of ddo::sdnq_linear and ddo::sdnq_dequantize: an SDNQ layer's packed weight,
// scales, zero points and SVD factors stream as one unit (Note [SDNQ layer units] in the
// planner); the kernel stages whichever of them are managed and runs libddo_sdnq's plain kernel
// (dequantize on the device, then linear) over the staged views. Unmanaged calls go straight to
// the plain kernel, as the aten kernels do.
#include "intercept_common.h"
#include "kernels.h"

#include "ddo/sdnq/ops.h"

namespace ddo::adapter::internal::kernels {
namespace {

at::Tensor sdnq_linear_staged(engine::DeviceKind kind, const at::Tensor& input,
                              const at::Tensor& weight, const at::Tensor& scale,
                              const std::optional<at::Tensor>& zero_point,
                              const std::optional<at::Tensor>& svd_up,
                              const std::optional<at::Tensor>& svd_down,
                              const std::optional<at::Tensor>& bias, at::IntArrayRef layout) {
  if (C10_LIKELY(!any_managed(weight, scale, zero_point, svd_up, svd_down, bias))) {
    return sdnq::linear_kernel(input, weight, scale, zero_point, svd_up, svd_down, bias, layout);
  }
  StageScope scope(kind, "sdnq_linear");
  return sdnq::linear_kernel(input, scope.stage(weight), scope.stage(scale),
                             scope.stage(zero_point), scope.stage(svd_up), scope.stage(svd_down),
                             scope.stage(bias), layout);
}

at::Tensor sdnq_dequantize_staged(engine::DeviceKind kind, const at::Tensor& weight,
                                  const at::Tensor& scale,
                                  const std::optional<at::Tensor>& zero_point,
                                  const std::optional<at::Tensor>& svd_up,
                                  const std::optional<at::Tensor>& svd_down,
                                  at::IntArrayRef layout) {
  if (C10_LIKELY(!any_managed(weight, scale, zero_point, svd_up, svd_down))) {
    return sdnq::dequantize_kernel(weight, scale, zero_point, svd_up, svd_down, layout);
  }
  StageScope scope(kind, "sdnq_dequantize");
  return sdnq::dequantize_kernel(scope.stage(weight), scope.stage(scale), scope.stage(zero_point),
                                 scope.stage(svd_up), scope.stage(svd_down), layout);
}

}  // namespace

at::Tensor sdnq_linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& scale, const std::optional<at::Tensor>& zero_point,
                           const std::optional<at::Tensor>& svd_up,
                           const std::optional<at::Tensor>& svd_down,
                           const std::optional<at::Tensor>& bias, at::IntArrayRef layout) {
  return sdnq_linear_staged(engine::DeviceKind::kSim, input, weight, scale, zero_point, svd_up,
                            svd_down, bias, layout);
}

at::Tensor sdnq_dequantize_cpu(const at::Tensor& weight, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero_point,
                               const std::optional<at::Tensor>& svd_up,
                               const std::optional<at::Tensor>& svd_down, at::IntArrayRef layout) {
  return sdnq_dequantize_staged(engine::DeviceKind::kSim, weight, scale, zero_point, svd_up,
                                svd_down, layout);
}

#ifdef DDO_HAVE_CUDA
at::Tensor sdnq_linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& scale, const std::optional<at::Tensor>& zero_point,
                            const std::optional<at::Tensor>& svd_up,
                            const std::optional<at::Tensor>& svd_down,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef layout) {
  return sdnq_linear_staged(engine::DeviceKind::kCuda, input, weight, scale, zero_point, svd_up,
                            svd_down, bias, layout);
}

at::Tensor sdnq_dequantize_cuda(const at::Tensor& weight, const at::Tensor& scale,
                                const std::optional<at::Tensor>& zero_point,
                                const std::optional<at::Tensor>& svd_up,
                                const std::optional<at::Tensor>& svd_down, at::IntArrayRef layout) {
  return sdnq_dequantize_staged(engine::DeviceKind::kCuda, weight, scale, zero_point, svd_up,
                                svd_down, layout);
}
#endif

}  // namespace ddo::adapter::internal::kernels
