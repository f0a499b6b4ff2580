// Interception of aten::addmm, aten::mm and aten::bmm: the ops every stock Linear reaches.
//
// LibTorch's torch::nn::Linear calls addmm (2-D input with bias) or matmul on weight.t(), which
// folds a contiguous N-D input into mm and otherwise expands the weight into bmm. Python's
// nn.Linear goes aten::linear -> addmm / matmul the same way. So these three ops see every read
// of a Linear weight; aten::linear itself needs no kernel. A Linear weight that `quantize=` serves
// from its quantized copy takes the layer's quantized forward here (intercept_quantized.cpp).
#include "intercept_common.h"
#include "kernels.h"
#include "quantized_dense.h"

#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#ifdef DDO_HAVE_CUDA
#include <ATen/ops/addmm_cuda_dispatch.h>
#include <ATen/ops/bmm_cuda_dispatch.h>
#include <ATen/ops/mm_cuda_dispatch.h>
#endif

namespace ddo::adapter::internal::kernels {

using engine::DeviceKind;

at::Tensor addmm_cpu(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                     const c10::Scalar& beta, const c10::Scalar& alpha) {
  if (C10_LIKELY(!any_managed(self, mat1, mat2))) {
    return at::cpu::addmm(self, mat1, mat2, beta, alpha);
  }
  if (at::Tensor y = try_quantized_addmm(DeviceKind::kSim, self, mat1, mat2, beta, alpha);
      y.defined()) {
    return y;
  }
  StageScope scope(DeviceKind::kSim, "addmm");
  return at::cpu::addmm(scope.stage(self), scope.stage(mat1), scope.stage(mat2), beta, alpha);
}

at::Tensor mm_cpu(const at::Tensor& self, const at::Tensor& mat2) {
  if (C10_LIKELY(!any_managed(self, mat2))) return at::cpu::mm(self, mat2);
  if (at::Tensor y = try_quantized_matmul(DeviceKind::kSim, /*batched=*/false, self, mat2);
      y.defined())
    return y;
  StageScope scope(DeviceKind::kSim, "mm");
  return at::cpu::mm(scope.stage(self), scope.stage(mat2));
}

at::Tensor bmm_cpu(const at::Tensor& self, const at::Tensor& mat2) {
  if (C10_LIKELY(!any_managed(self, mat2))) return at::cpu::bmm(self, mat2);
  if (at::Tensor y = try_quantized_matmul(DeviceKind::kSim, /*batched=*/true, self, mat2);
      y.defined())
    return y;
  StageScope scope(DeviceKind::kSim, "bmm");
  return at::cpu::bmm(scope.stage(self), scope.stage(mat2));
}

#ifdef DDO_HAVE_CUDA
at::Tensor addmm_cuda(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                      const c10::Scalar& beta, const c10::Scalar& alpha) {
  if (C10_LIKELY(!any_managed(self, mat1, mat2))) {
    return at::cuda::addmm(self, mat1, mat2, beta, alpha);
  }
  if (at::Tensor y = try_quantized_addmm(DeviceKind::kCuda, self, mat1, mat2, beta, alpha);
      y.defined()) {
    return y;
  }
  StageScope scope(DeviceKind::kCuda, "addmm");
  return at::cuda::addmm(scope.stage(self), scope.stage(mat1), scope.stage(mat2), beta, alpha);
}

at::Tensor mm_cuda(const at::Tensor& self, const at::Tensor& mat2) {
  if (C10_LIKELY(!any_managed(self, mat2))) return at::cuda::mm(self, mat2);
  if (at::Tensor y = try_quantized_matmul(DeviceKind::kCuda, /*batched=*/false, self, mat2);
      y.defined())
    return y;
  StageScope scope(DeviceKind::kCuda, "mm");
  return at::cuda::mm(scope.stage(self), scope.stage(mat2));
}

at::Tensor bmm_cuda(const at::Tensor& self, const at::Tensor& mat2) {
  if (C10_LIKELY(!any_managed(self, mat2))) return at::cuda::bmm(self, mat2);
  if (at::Tensor y = try_quantized_matmul(DeviceKind::kCuda, /*batched=*/true, self, mat2);
      y.defined())
    return y;
  StageScope scope(DeviceKind::kCuda, "bmm");
  return at::cuda::bmm(scope.stage(self), scope.stage(mat2));
}
#endif

}  // namespace ddo::adapter::internal::kernels
