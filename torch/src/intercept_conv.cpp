// Interception of aten::convolution: every stock Conv1d/2d/3d (C++ and Python, any padding
// mode) reaches it through conv{1,2,3}d. The original is the CompositeExplicitAutograd kernel,
// which dispatches to the backend's _convolution with the staged weight.
#include "intercept_common.h"
#include "kernels.h"

#include <ATen/ops/convolution_compositeexplicitautograd_dispatch.h>

namespace ddo::adapter::internal::kernels {
namespace {

at::Tensor convolution_staged(engine::DeviceKind kind, const at::Tensor& input,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              at::IntArrayRef stride, at::IntArrayRef padding,
                              at::IntArrayRef dilation, bool transposed,
                              at::IntArrayRef output_padding, int64_t groups) {
  if (C10_LIKELY(!any_managed(input, weight) && !any_managed_opt(bias))) {
    return at::compositeexplicitautograd::convolution(input, weight, bias, stride, padding,
                                                      dilation, transposed, output_padding, groups);
  }
  StageScope scope(kind, "convolution");
  return at::compositeexplicitautograd::convolution(scope.stage(input), scope.stage(weight),
                                                    scope.stage(bias), stride, padding, dilation,
                                                    transposed, output_padding, groups);
}

}  // namespace

at::Tensor convolution_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                           at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                           at::IntArrayRef output_padding, int64_t groups) {
  return convolution_staged(engine::DeviceKind::kSim, input, weight, bias, stride, padding,
                            dilation, transposed, output_padding, groups);
}

#ifdef DDO_HAVE_CUDA
at::Tensor convolution_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups) {
  return convolution_staged(engine::DeviceKind::kCuda, input, weight, bias, stride, padding,
                            dilation, transposed, output_padding, groups);
}
#endif

}  // namespace ddo::adapter::internal::kernels
