// Interception of aten::convolution: every stock Conv1d/2d/3d (C++ and Python, any padding
// mode) reaches it through conv{1,2,3}d. The original is the CompositeExplicitAutograd kernel,
// which dispatches to the backend's _convolution with the staged weight.
//
// And of aten::_convolution, which a model traced with torch.jit.trace calls directly (the
// tracer records Conv2d's call as _convolution; see Note [TorchScript modules] in
// jit_module.cpp). A call that came through aten::convolution above arrives here with the staged
// weight, which is not managed, and goes straight to the original.
#pragma once

#include <ATen/ops/_convolution_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/convolution_compositeexplicitautograd_dispatch.h>

#include "intercept_common.h"

namespace ddo::adapter::internal::kernels {

template <class K>
at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                       at::IntArrayRef output_padding, int64_t groups) {
  if (C10_LIKELY(!any_managed(input, weight, bias))) {
    return at::compositeexplicitautograd::convolution(input, weight, bias, stride, padding,
                                                      dilation, transposed, output_padding, groups);
  }
  StageScope scope(K::backend(), "convolution");
  return at::compositeexplicitautograd::convolution(scope.stage(input), scope.stage(weight),
                                                    scope.stage(bias), stride, padding, dilation,
                                                    transposed, output_padding, groups);
}

// aten::_convolution, which traced TorchScript models call directly.
template <class K>
at::Tensor underscore_convolution(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                  at::IntArrayRef padding, at::IntArrayRef dilation,
                                  bool transposed, at::IntArrayRef output_padding, int64_t groups,
                                  bool benchmark, bool deterministic, bool cudnn_enabled,
                                  bool allow_tf32) {
  if (C10_LIKELY(!any_managed(input, weight, bias))) {
    return at::compositeexplicitautograd::_convolution(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
        benchmark, deterministic, cudnn_enabled, allow_tf32);
  }
  StageScope scope(K::backend(), "_convolution");
  return at::compositeexplicitautograd::_convolution(
      scope.stage(input), scope.stage(weight), scope.stage(bias), stride, padding, dilation,
      transposed, output_padding, groups, benchmark, deterministic, cudnn_enabled, allow_tf32);
}

}  // namespace ddo::adapter::internal::kernels
