// CPU tensors over memory ddo owns (internal). One constructor for every kind of such storage:
// streamed weights in their slab (managed_weight.h), cached slab views (weight_cache_internal.h)
// and the loader's placeholders (loader.cpp). The deleter both frees the context and names the
// kind: has_deleter() recognises a storage by it.
#pragma once

#include <cstddef>

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

namespace ddo::adapter::internal {

// A CPU tensor with `sizes` and `strides` over `bytes` at `data`; `deleter(context)` runs when
// the last view of its storage goes.
at::Tensor cpu_tensor_over(void* data, std::size_t bytes, at::IntArrayRef sizes,
                           at::IntArrayRef strides, c10::ScalarType dtype, void* context,
                           c10::DeleterFnPtr deleter);

// True when `t`'s storage was made by cpu_tensor_over with `deleter`.
bool has_deleter(const at::Tensor& t, c10::DeleterFnPtr deleter);

}  // namespace ddo::adapter::internal
