/// \file
/// Which path a ddo CUDA op takes on a device: its kernel, or its ATen reference.
///
/// ddo's kernels are built for a list of architectures (cmake/DdoCudaArchs.cmake). A device the
/// library has no code for (an architecture left out of a developer build, a card older than the
/// list) runs the op's reference path instead, with the same results, and the first use warns
/// once, naming the architecture and the rebuild that adds it. Nothing fails for want of a
/// kernel image.
///
/// ```
/// ddo::sdnq::KernelStatus s = ddo::sdnq::dequantize_kernel_status(0);
/// // s.path == KernelPath::kKernel, s.reason == "sm_86 code in libddo_sdnq"
/// ddo::sdnq::set_kernel_mode(ddo::core::KernelMode::kReference);   // tests: reference everywhere
/// ```
#pragma once

#include <string>

#include "ddo/core/settings.h"

namespace ddo::sdnq {

/// The implementation an op runs.
enum class KernelPath { kKernel, kReference };

/// "kernel" or "reference".
const char* to_string(KernelPath path);

/// One op kind's path on one device, and why.
struct KernelStatus {
  KernelPath path = KernelPath::kReference;  ///< the implementation that runs
  std::string reason;  ///< e.g. "sm_86 code in libddo_sdnq", "DDO_KERNELS=reference"
};

/// The SDNQ dequantize kernel's path on CUDA device `device`. The library's image is queried
/// once per device (Note [Kernel images]); later calls read the cached answer. A library built
/// without CUDA answers kReference.
KernelStatus dequantize_kernel_status(int device);

/// True when dequantize() runs the kernel on `device`: the hot-path form of the status above
/// (one atomic load once the device is known); warns once per device when it is false because
/// the library has no code for the device.
bool use_dequantize_kernel(int device);

/// The process-wide mode: DDO_KERNELS at the first call (throws ddo::Error on a bad value), or
/// what set_kernel_mode() set.
core::KernelMode kernel_mode();

/// Sets the mode for every device from now on (tests compare the two paths with it).
void set_kernel_mode(core::KernelMode mode);

/// The process-wide quantized-matmul mode: DDO_QUANTIZED_MATMUL at the first call (throws
/// ddo::Error on a bad value), read and cached as kernel_mode() is.
core::QuantizedMatmulMode quantized_matmul_mode();

/// The status for what the CUDA runtime reported about one device (what dequantize_kernel_status
/// caches; public so that tests can give it the answers of devices they do not have): `error` 0
/// with the running code's architecture (`binary_version`, 86 for sm_86), or the runtime's
/// error and its text.
KernelStatus kernel_status_from_query(int error, const std::string& error_text, int binary_version,
                                      int device_major, int device_minor);

/// The warning a device without code gets once: names its architecture and the rebuild.
std::string missing_image_warning(int device, int device_major, int device_minor,
                                  const std::string& error_text);

/// The architectures the library's kernels were built for, in CMake's form ("75-real;...").
const char* built_cuda_architectures();

}  // namespace ddo::sdnq
