// Which path the dequantize op takes on a device (Note [Kernel images]), from the answers the CUDA
// runtime gives for devices this machine does not have: a device without code runs the reference
// and the warning names its architecture and the rebuild; a device with code runs the kernel.
#include "ddo/sdnq/kernel_status.h"

#include <string>
#include <string_view>

#include <gtest/gtest.h>

namespace ddo::sdnq {
namespace {

bool built_list_names(std::string_view item) {
  const std::string list = std::string(",") + built_cuda_architectures() + ",";
  return list.find("," + std::string(item) + ",") != std::string::npos;
}

TEST(KernelStatus, NoImageForTheDeviceRunsTheReferenceAndSaysWhy) {
  const KernelStatus s = kernel_status_from_query(
      209, "no kernel image is available for execution on the device", 0, 6, 1);
  EXPECT_EQ(s.path, KernelPath::kReference);
  EXPECT_NE(s.reason.find("no code for sm_61"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("no kernel image"), std::string::npos) << s.reason;
}

TEST(KernelStatus, TheWarningNamesTheArchitectureAndTheRebuild) {
  const std::string ada = missing_image_warning(1, 8, 9, "no kernel image is available");
  EXPECT_NE(ada.find("cuda:1"), std::string::npos) << ada;
  EXPECT_NE(ada.find("sm_89"), std::string::npos) << ada;
  EXPECT_NE(ada.find("compute capability 8.9"), std::string::npos) << ada;
  EXPECT_NE(ada.find("89-real"), std::string::npos) << ada;
  EXPECT_NE(ada.find("reference path"), std::string::npos) << ada;
  // CUDA 13 has no compiler for a Pascal card: the message says so instead of a rebuild.
  const std::string pascal = missing_image_warning(0, 6, 1, "no kernel image is available");
  EXPECT_NE(pascal.find("sm_75 and newer"), std::string::npos) << pascal;
  EXPECT_EQ(pascal.find("rebuild"), std::string::npos) << pascal;
}

TEST(KernelStatus, CodeForTheDeviceRunsTheKernelAndSaysWhichCode) {
  const KernelStatus s = kernel_status_from_query(0, "no error", 86, 8, 9);
  EXPECT_EQ(s.path, KernelPath::kKernel);
  if (built_list_names("86-real") || built_list_names("86")) {
    EXPECT_EQ(s.reason, "sm_86 code in libddo_sdnq");
  } else {
    EXPECT_NE(s.reason.find("PTX"), std::string::npos) << s.reason;
  }
  // A card newer than the list runs the driver's compile of the newest PTX.
  const KernelStatus future = kernel_status_from_query(0, "no error", 130, 13, 0);
  EXPECT_EQ(future.path, KernelPath::kKernel);
  EXPECT_NE(future.reason.find("PTX"), std::string::npos) << future.reason;
  EXPECT_NE(future.reason.find("sm_130"), std::string::npos) << future.reason;
}

TEST(KernelStatus, ReferenceModeSendsEveryDeviceToTheReference) {
  set_kernel_mode(core::KernelMode::kReference);
  EXPECT_EQ(kernel_mode(), core::KernelMode::kReference);
  const KernelStatus s = dequantize_kernel_status(0);
  EXPECT_FALSE(use_dequantize_kernel(0));
  set_kernel_mode(core::KernelMode::kAuto);
  EXPECT_EQ(s.path, KernelPath::kReference);
  EXPECT_NE(s.reason.find("DDO_KERNELS=reference"), std::string::npos) << s.reason;
}

#if DDO_HAVE_CUDA
TEST(KernelStatus, TheDefaultListHasCodeForEveryCardTorchSupports) {
  // Only for a build with the default list (a developer build may name one architecture).
  if (std::string_view(built_cuda_architectures()) !=
      "75-real,80-real,86-real,90-real,100-real,120-real,120-virtual") {
    GTEST_SKIP() << "built for " << built_cuda_architectures() << ", not the default list";
  }
  for (const int arch : {75, 80, 86, 90, 100, 120}) {
    const KernelStatus s = kernel_status_from_query(0, "no error", arch, arch / 10, arch % 10);
    EXPECT_EQ(s.reason, "sm_" + std::to_string(arch) + " code in libddo_sdnq");
  }
}
#endif

}  // namespace
}  // namespace ddo::sdnq
