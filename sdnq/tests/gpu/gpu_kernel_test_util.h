// What the SDNQ GPU tests ask of the card and of the build they run in.
//
// A library built without this card's image (an architecture list such as "80-real" on an sm_90
// card) runs every op's reference path: correct, and warned about once (Note [Kernel images]).
// Tests that compare a kernel with its reference then have no kernel to compare: they skip and
// say so, while DequantizeKernelStatus.ThePathFollowsTheBuiltArchitectures checks that the path
// is the one the built list implies.
#pragma once

#include <sstream>
#include <string>

#include <ATen/ATen.h>
#if DDO_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "ddo/sdnq/kernel_status.h"

namespace ddo::sdnq::testing {

inline bool have_gpu() {
#if DDO_HAVE_CUDA
  return at::cuda::is_available();
#else
  return false;
#endif
}

// True when the built list ("75-real,...,120-virtual"; ';' separates too) holds code the driver
// runs on a card of capability `capability` (major * 10 + minor): a cubin of that architecture, or
// PTX of one not newer than the card, which the driver compiles.
inline bool built_list_runs_on(const std::string& list, int capability) {
  std::string commas = list;
  for (char& c : commas) {
    if (c == ';') c = ',';
  }
  std::stringstream items(commas);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const std::size_t dash = item.find('-');
    const int arch = std::stoi(item.substr(0, dash));
    const std::string kind = dash == std::string::npos ? "" : item.substr(dash + 1);
    // A bare number is CMake's "both real and virtual".
    const bool real = kind.empty() || kind == "real";
    const bool ptx = kind.empty() || kind == "virtual";
    if ((real && arch == capability) || (ptx && arch <= capability)) return true;
  }
  return false;
}

inline int current_capability() {
#if DDO_HAVE_CUDA
  const cudaDeviceProp* p = at::cuda::getCurrentDeviceProperties();
  return p->major * 10 + p->minor;
#else
  return 0;
#endif
}

}  // namespace ddo::sdnq::testing

// Skips a test that needs a GPU, or that needs ddo's kernel on it, saying which is missing.
#define DDO_REQUIRE_GPU()                                                                   \
  do {                                                                                      \
    if (!::ddo::sdnq::testing::have_gpu()) GTEST_SKIP() << "no CUDA GPU: GPU test skipped"; \
  } while (0)

#define DDO_REQUIRE_KERNEL_IMAGE()                                                      \
  do {                                                                                  \
    DDO_REQUIRE_GPU();                                                                  \
    const ::ddo::sdnq::KernelStatus ddo_status_ =                                       \
        ::ddo::sdnq::dequantize_kernel_status(at::cuda::current_device());              \
    if (ddo_status_.path != ::ddo::sdnq::KernelPath::kKernel) {                         \
      GTEST_SKIP() << "this build (" << ::ddo::sdnq::built_cuda_architectures()         \
                   << ") runs the reference path on this card: " << ddo_status_.reason; \
    }                                                                                   \
  } while (0)
