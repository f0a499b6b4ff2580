// The interception kernels (internal): one set per op family, registered by register_ops.cpp.
//
// `*_cpu` run on the CPU dispatch key (execution on the "sim" device: every tensor is a CPU
// tensor), `*_cuda` on the CUDA key (execution on a GPU: the input is a CUDA tensor and the
// managed weight a CPU tensor, so the union of their keys dispatches to CUDA). Each one calls the
// original kernel directly when no argument is managed. See docs/design/0001-interception.md.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

namespace ddo::adapter::internal::kernels {

// intercept_matmul.cpp
at::Tensor addmm_cpu(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                     const c10::Scalar& beta, const c10::Scalar& alpha);
at::Tensor mm_cpu(const at::Tensor& self, const at::Tensor& mat2);
at::Tensor bmm_cpu(const at::Tensor& self, const at::Tensor& mat2);

// intercept_conv.cpp
at::Tensor convolution_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                           at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                           at::IntArrayRef output_padding, int64_t groups);
// aten::_convolution, which traced TorchScript models call directly.
at::Tensor underscore_convolution_cpu(const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                      at::IntArrayRef padding, at::IntArrayRef dilation,
                                      bool transposed, at::IntArrayRef output_padding,
                                      int64_t groups, bool benchmark, bool deterministic,
                                      bool cudnn_enabled, bool allow_tf32);

// intercept_embedding.cpp
at::Tensor embedding_cpu(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                         bool scale_grad_by_freq, bool sparse);

// ddo::sdnq_linear / ddo::sdnq_dequantize (intercept_sdnq.cpp).
at::Tensor sdnq_linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& scale, const std::optional<at::Tensor>& zero_point,
                           const std::optional<at::Tensor>& svd_up,
                           const std::optional<at::Tensor>& svd_down,
                           const std::optional<at::Tensor>& bias, at::IntArrayRef layout);
at::Tensor sdnq_dequantize_cpu(const at::Tensor& weight, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero_point,
                               const std::optional<at::Tensor>& svd_up,
                               const std::optional<at::Tensor>& svd_down, at::IntArrayRef layout);

#ifdef DDO_HAVE_CUDA
at::Tensor addmm_cuda(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                      const c10::Scalar& beta, const c10::Scalar& alpha);
at::Tensor mm_cuda(const at::Tensor& self, const at::Tensor& mat2);
at::Tensor bmm_cuda(const at::Tensor& self, const at::Tensor& mat2);
at::Tensor convolution_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups);
at::Tensor underscore_convolution_cuda(const at::Tensor& input, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias,
                                       at::IntArrayRef stride, at::IntArrayRef padding,
                                       at::IntArrayRef dilation, bool transposed,
                                       at::IntArrayRef output_padding, int64_t groups,
                                       bool benchmark, bool deterministic, bool cudnn_enabled,
                                       bool allow_tf32);
at::Tensor embedding_cuda(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                          bool scale_grad_by_freq, bool sparse);
at::Tensor sdnq_linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& scale, const std::optional<at::Tensor>& zero_point,
                            const std::optional<at::Tensor>& svd_up,
                            const std::optional<at::Tensor>& svd_down,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef layout);
at::Tensor sdnq_dequantize_cuda(const at::Tensor& weight, const at::Tensor& scale,
                                const std::optional<at::Tensor>& zero_point,
                                const std::optional<at::Tensor>& svd_up,
                                const std::optional<at::Tensor>& svd_down, at::IntArrayRef layout);
#endif

}  // namespace ddo::adapter::internal::kernels
