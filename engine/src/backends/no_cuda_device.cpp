// Built when ddo is configured without CUDA (-DDDO_WITH_CUDA=OFF): the CUDA backend is absent and
// says so, and callers fall back to the simulation or report the missing GPU support.
#include "ddo/engine/device.h"

namespace ddo::engine {

bool cuda_available() {
  return false;
}

Status make_cuda_device(const CudaDeviceOptions& options, std::unique_ptr<Device>* out) {
  out->reset();
  return Status(Code::kUnavailable,
                internal::str_cat("cuda:", options.index,
                                  " requested, but this ddo build has no "
                                  "CUDA backend; rebuild with -DDDO_WITH_CUDA=ON and the CUDA "
                                  "toolkit installed"));
}

}  // namespace ddo::engine
