#include "host_tensor.h"

#include <utility>

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

namespace ddo::adapter::internal {

at::Tensor cpu_tensor_over(void* data, std::size_t bytes, at::IntArrayRef sizes,
                           at::IntArrayRef strides, c10::ScalarType dtype, void* context,
                           c10::DeleterFnPtr deleter) {
  c10::DataPtr ptr(data, context, deleter, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, /*storage_offset=*/0);
  return t;
}

bool has_deleter(const at::Tensor& t, c10::DeleterFnPtr deleter) {
  if (!t.defined()) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage()) return false;
  return impl->unsafe_storage().data_ptr().get_deleter() == deleter;
}

}  // namespace ddo::adapter::internal
