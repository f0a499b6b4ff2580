// Interception of aten::embedding: stock Embedding modules (C++ and Python) reach it directly.
// The original is the CompositeExplicitAutograd kernel (an index_select of the staged table).
// An Embedding with max_norm renormalises its weight in place (embedding_renorm_) before the
// lookup; ddo does not stream such weights' in-place updates (managed weights are read-only).
#pragma once

#include <ATen/ops/embedding_compositeexplicitautograd_dispatch.h>

#include "intercept_common.h"

namespace ddo::adapter::internal::kernels {

template <class K>
at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                     bool scale_grad_by_freq, bool sparse) {
  if (C10_LIKELY(!any_managed(weight, indices))) {
    return at::compositeexplicitautograd::embedding(weight, indices, padding_idx,
                                                    scale_grad_by_freq, sparse);
  }
  StageScope scope(K::backend(), "embedding");
  return at::compositeexplicitautograd::embedding(scope.stage(weight), scope.stage(indices),
                                                  padding_idx, scale_grad_by_freq, sparse);
}

}  // namespace ddo::adapter::internal::kernels
