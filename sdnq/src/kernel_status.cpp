#include "ddo/sdnq/kernel_status.h"

#include <array>
#include <atomic>
#include <mutex>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "ddo/core/status.h"
#ifdef DDO_HAVE_CUDA
#include "../kernels/dequantize_params.h"
#endif

#ifndef DDO_CUDA_ARCHITECTURES_BUILT
#define DDO_CUDA_ARCHITECTURES_BUILT ""
#endif

namespace ddo::sdnq {

// Note [Kernel images]
// ~~~~~~~~~~~~~~~~~~~~
// A fatbinary holds cubins for some architectures and PTX for some; the CUDA runtime loads what
// fits the device when a kernel is first used, and a launch on a device it has nothing for fails
// with "no kernel image is available". Instead of learning that from a failed launch in the
// middle of a forward, the ops ask once per device, before their first launch:
// cudaFuncGetAttributes on one of the module's kernels succeeds exactly when a cubin runs on the
// device or the driver could compile the PTX for it (binaryVersion then says for which
// architecture the running code is). The answer is cached in one atomic per device, so the hot
// path pays a relaxed load; the first reference answer for a device warns once (TORCH_WARN: a
// Python UserWarning), and Offload::report() gives each op kind's status.
//
// DDO_KERNELS=reference (or set_kernel_mode) sends every device to the reference path; the GPU
// tests compare the two bit for bit, which is what makes the fallback safe to take silently
// after its one warning.

namespace {

constexpr int kMaxDevices = 64;
enum : int { kUnknown = 0, kRunsKernel = 1, kRunsReference = 2 };

std::array<std::atomic<int>, kMaxDevices> g_path{};  // per device: kUnknown until queried
std::mutex g_mu;                                     // guards g_status and the first query
std::array<KernelStatus, kMaxDevices> g_status;

std::atomic<int> g_mode{-1};                   // -1: not read yet; else a core::KernelMode
std::atomic<int> g_quantized_matmul_mode{-1};  // likewise, a core::QuantizedMatmulMode

// A mode read from the process environment at its first use and cached in `slot` (one acquire
// load afterwards); a value the parser refuses throws, and is read again at the next call.
template <typename Mode>
Mode cached_mode(std::atomic<int>& slot, Status (*from_env)(const core::EnvMap&, Mode*)) {
  const int mode = slot.load(std::memory_order_acquire);
  if (C10_LIKELY(mode >= 0)) return static_cast<Mode>(mode);
  Mode read{};
  throw_if_error(from_env(core::process_env(), &read));
  int expected = -1;
  slot.compare_exchange_strong(expected, static_cast<int>(read), std::memory_order_acq_rel);
  return static_cast<Mode>(slot.load(std::memory_order_acquire));
}

std::string arch_name(int version) {
  return fmt::format("sm_{}", version);
}

// True when the built list (CMake's form, comma-separated) names `arch` (e.g. 86) with real code:
// "86" or "86-real".
bool built_with_cubin(int arch) {
  const std::string_view list = DDO_CUDA_ARCHITECTURES_BUILT;
  const std::string want = std::to_string(arch);
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t end = list.find(',', start);
    if (end == std::string_view::npos) end = list.size();
    const std::string_view item = list.substr(start, end - start);
    if (item == want || item == want + "-real") return true;
    start = end + 1;
  }
  return false;
}

#ifdef DDO_HAVE_CUDA
KernelStatus query(int device) {
  const kernels::KernelImage image = kernels::query_sdnq_kernel_image(device);
  KernelStatus status = kernel_status_from_query(
      image.error, image.error_text, image.binary_version, image.device_major, image.device_minor);
  if (status.path == KernelPath::kReference && image.device_major > 0) {
    TORCH_WARN(
        missing_image_warning(device, image.device_major, image.device_minor, image.error_text));
  }
  return status;
}
#endif

}  // namespace

const char* to_string(KernelPath path) {
  return path == KernelPath::kKernel ? "kernel" : "reference";
}

const char* built_cuda_architectures() {
  return DDO_CUDA_ARCHITECTURES_BUILT;
}

KernelStatus kernel_status_from_query(int error, const std::string& error_text, int binary_version,
                                      int device_major, int device_minor) {
  const int device_arch = device_major * 10 + device_minor;
  if (error != 0) {
    return {KernelPath::kReference,
            fmt::format("no code for {} in libddo_sdnq (built for {}): {}", arch_name(device_arch),
                        DDO_CUDA_ARCHITECTURES_BUILT, error_text)};
  }
  if (built_with_cubin(binary_version)) {
    return {KernelPath::kKernel, fmt::format("{} code in libddo_sdnq", arch_name(binary_version))};
  }
  return {KernelPath::kKernel, fmt::format("PTX in libddo_sdnq compiled by the driver for {}",
                                           arch_name(binary_version))};
}

std::string missing_image_warning(int device, int device_major, int device_minor,
                                  const std::string& error_text) {
  const int arch = device_major * 10 + device_minor;
  // CUDA 13's nvcc compiles for sm_75 and newer: older cards have no rebuild that helps.
  const std::string fix =
      arch >= 75 ? fmt::format(
                       "rebuild ddo with the default architecture list (or add {}-real to "
                       "-DDDO_CUDA_ARCHITECTURES) to run the kernel",
                       arch)
                 : "CUDA 13 compiles for sm_75 and newer, so this card keeps the reference path";
  return fmt::format(
      "ddo: libddo_sdnq has no code for cuda:{} ({}, compute capability {}.{}; built for {}): "
      "the SDNQ dequantize op runs its reference path (ATen ops, the same results, slower); {}. "
      "({})",
      device, arch_name(arch), device_major, device_minor, DDO_CUDA_ARCHITECTURES_BUILT, fix,
      error_text);
}

core::KernelMode kernel_mode() {
  return cached_mode(g_mode, core::kernel_mode_from_env);
}

core::QuantizedMatmulMode quantized_matmul_mode() {
  return cached_mode(g_quantized_matmul_mode, core::quantized_matmul_mode_from_env);
}

void set_kernel_mode(core::KernelMode mode) {
  g_mode.store(static_cast<int>(mode), std::memory_order_release);
}

KernelStatus dequantize_kernel_status(int device) {
  if (kernel_mode() == core::KernelMode::kReference) {
    return {KernelPath::kReference, "DDO_KERNELS=reference (or set_kernel_mode)"};
  }
#ifdef DDO_HAVE_CUDA
  DDO_CHECK(device >= 0 && device < kMaxDevices, Code::kInvalidArgument, "CUDA device index ",
            device, " is out of range [0, ", kMaxDevices, ")");
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_path[device].load(std::memory_order_acquire) == kUnknown) {
    g_status[device] = query(device);
    g_path[device].store(
        g_status[device].path == KernelPath::kKernel ? kRunsKernel : kRunsReference,
        std::memory_order_release);
  }
  return g_status[device];
#else
  (void)device;
  return {KernelPath::kReference, "libddo_sdnq was built without CUDA"};
#endif
}

bool use_dequantize_kernel(int device) {
  if (kernel_mode() == core::KernelMode::kReference) return false;
  if (C10_LIKELY(device >= 0 && device < kMaxDevices)) {
    const int path = g_path[device].load(std::memory_order_relaxed);
    if (C10_LIKELY(path != kUnknown)) return path == kRunsKernel;
  }
  return dequantize_kernel_status(device).path == KernelPath::kKernel;
}

}  // namespace ddo::sdnq
