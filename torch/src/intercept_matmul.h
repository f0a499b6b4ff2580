// Interception of aten::addmm, aten::mm and aten::bmm: the ops every stock Linear reaches.
//
// LibTorch's torch::nn::Linear calls addmm (2-D input with bias) or matmul on weight.t(), which
// folds a contiguous N-D input into mm and otherwise expands the weight into bmm. Python's
// nn.Linear goes aten::linear -> addmm / matmul the same way. So these three ops see every read
// of a Linear weight; aten::linear itself needs no kernel. A Linear weight that `quantize=` serves
// from its quantized copy takes the layer's quantized forward here (intercept_quantized.cpp).
//
// The originals are the backend's own kernels of its dispatch key (K::addmm: at::cpu::addmm,
// at::cuda::addmm), called directly: through the dispatcher they would come back here.
#pragma once

#include "intercept_common.h"
#include "quantized_dense.h"

namespace ddo::adapter::internal::kernels {

template <class K>
at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                 const c10::Scalar& beta, const c10::Scalar& alpha) {
  if (C10_LIKELY(!any_managed(self, mat1, mat2))) return K::addmm(self, mat1, mat2, beta, alpha);
  if (at::Tensor y = try_quantized_addmm(K::backend(), self, mat1, mat2, beta, alpha);
      y.defined()) {
    return y;
  }
  StageScope scope(K::backend(), "addmm");
  return K::addmm(scope.stage(self), scope.stage(mat1), scope.stage(mat2), beta, alpha);
}

template <class K>
at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
  if (C10_LIKELY(!any_managed(self, mat2))) return K::mm(self, mat2);
  if (at::Tensor y = try_quantized_matmul(K::backend(), /*batched=*/false, self, mat2); y.defined())
    return y;
  StageScope scope(K::backend(), "mm");
  return K::mm(scope.stage(self), scope.stage(mat2));
}

template <class K>
at::Tensor bmm(const at::Tensor& self, const at::Tensor& mat2) {
  if (C10_LIKELY(!any_managed(self, mat2))) return K::bmm(self, mat2);
  if (at::Tensor y = try_quantized_matmul(K::backend(), /*batched=*/true, self, mat2); y.defined())
    return y;
  StageScope scope(K::backend(), "bmm");
  return K::bmm(scope.stage(self), scope.stage(mat2));
}

}  // namespace ddo::adapter::internal::kernels
