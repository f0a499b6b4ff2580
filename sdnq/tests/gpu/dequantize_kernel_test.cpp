// The CUDA dequantize kernel against the ATen reference on the same GPU, every layout, odd
// shapes (scalar path) and aligned ones (vector path): bit-equal (Note [Bit-equal dequantize]).
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <gtest/gtest.h>

#include "ddo/sdnq/dequantize.h"
#include "ddo/sdnq/kernel_status.h"
#include "gpu_kernel_test_util.h"
#include "ddo/sdnq/quantize.h"

namespace ddo::sdnq {
namespace {

using testing::have_gpu;

struct KCase {
  QuantType type;
  std::int64_t out, in, group_size;
  bool transposed;
  c10::ScalarType result;
};

std::string kname(const KCase& c) {
  return std::string(to_string(c.type)) + "_" + std::to_string(c.out) + "x" + std::to_string(c.in) +
         "_g" + std::to_string(c.group_size) + (c.transposed ? "_t" : "") + "_" +
         c10::toString(c.result);
}

const KCase kKernelCases[] = {
    {QuantType::kInt8, 3072, 3072, 0, false, at::kBFloat16},
    {QuantType::kInt8, 96, 256, 64, false, at::kBFloat16},
    {QuantType::kInt8, 37, 29, 0, false, at::kBFloat16},  // odd: scalar path
    {QuantType::kInt8, 40, 24, 0, true, at::kBFloat16},   // transposed
    {QuantType::kUint8, 64, 128, 0, false, at::kHalf},
    {QuantType::kInt4, 128, 256, 64, false, at::kBFloat16},
    {QuantType::kUint4, 3072, 12288, 64, false, at::kBFloat16},
    {QuantType::kUint4, 33, 96, 32, false, at::kBFloat16},
    {QuantType::kUint4, 10, 12, 4, false, at::kFloat},  // group 4: scalar path
    {QuantType::kFloat8E4M3, 256, 512, 0, false, at::kBFloat16},
    {QuantType::kFloat8E5M2, 31, 62, 0, false, at::kBFloat16},
};

class DequantizeKernel : public ::testing::TestWithParam<KCase> {};

TEST_P(DequantizeKernel, BitEqualToTheReferenceOnTheSameDevice) {
  DDO_REQUIRE_KERNEL_IMAGE();
  const KCase c = GetParam();
  at::manual_seed(3);
  const at::Tensor dense = at::randn({c.out, c.in}, at::kFloat).to(c.result);
  QuantizeOptions opt;
  opt.type = c.type;
  opt.group_size = c.group_size;
  opt.transposed = c.transposed;
  auto [w, layout] = quantize(dense, opt);
  QuantizedWeight g{w.weight.cuda(),
                    w.scale.cuda(),
                    w.zero_point.defined() ? w.zero_point.cuda() : at::Tensor(),
                    {},
                    {}};
  ASSERT_TRUE(kernel_supports(g, layout));
  const at::Tensor k = dequantize(g, layout);
  const at::Tensor r = dequantize_reference(g, layout);
  ASSERT_EQ(k.sizes(), r.sizes());
  ASSERT_EQ(k.scalar_type(), r.scalar_type());
  const at::Tensor diff = (k.to(at::kFloat) - r.to(at::kFloat)).abs();
  EXPECT_TRUE(at::equal(k, r)) << kname(c) << ": " << (k != r).sum().item<int64_t>()
                               << " elements differ, max " << diff.max().item<double>();
  // And the CPU reference agrees except for the fused multiply-add of unsigned types.
  const at::Tensor cpu = dequantize_reference(w, layout);
  const double cpu_diff = (cpu.to(at::kFloat) - k.cpu().to(at::kFloat)).abs().max().item<double>();
  EXPECT_LE(cpu_diff, is_unsigned(c.type) ? 1e-2 : 0.0) << kname(c);
}

INSTANTIATE_TEST_SUITE_P(All, DequantizeKernel, ::testing::ValuesIn(kKernelCases),
                         [](const auto& test) { return kname(test.param); });

TEST(DequantizeKernelSvd, SvdFactorsAddedInTheResultDtype) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: GPU test skipped";
  at::manual_seed(4);
  const at::Tensor dense = at::randn({256, 512}).to(at::kBFloat16);
  QuantizeOptions opt;
  opt.type = QuantType::kUint4;
  opt.use_svd = true;
  opt.svd_rank = 16;
  auto [w, layout] = quantize(dense, opt);
  QuantizedWeight g{w.weight.cuda(), w.scale.cuda(), w.zero_point.cuda(), w.svd_up.cuda(),
                    w.svd_down.cuda()};
  EXPECT_TRUE(at::equal(dequantize(g, layout), dequantize_reference(g, layout)));
}

// DDO_KERNELS=reference (set_kernel_mode here) gives what the kernel gives, bit for bit, through
// the one entry point: the fallback a device without code takes changes nothing but the speed.
TEST(DequantizeKernelStatus, ForcedReferenceEqualsTheKernelBitForBit) {
  DDO_REQUIRE_KERNEL_IMAGE();
  const int device = at::cuda::current_device();
  at::manual_seed(5);
  for (const QuantType type : {QuantType::kInt8, QuantType::kUint4, QuantType::kFloat8E4M3}) {
    QuantizeOptions opt;
    opt.type = type;
    auto [w, layout] = quantize(at::randn({192, 320}).to(at::kBFloat16), opt);
    QuantizedWeight g{w.weight.cuda(),
                      w.scale.cuda(),
                      w.zero_point.defined() ? w.zero_point.cuda() : at::Tensor(),
                      {},
                      {}};
    ASSERT_TRUE(kernel_supports(g, layout));
    const at::Tensor by_kernel = dequantize(g, layout);
    set_kernel_mode(core::KernelMode::kReference);
    EXPECT_FALSE(kernel_supports(g, layout));
    EXPECT_EQ(dequantize_kernel_status(device).path, KernelPath::kReference);
    const at::Tensor by_reference = dequantize(g, layout);
    set_kernel_mode(core::KernelMode::kAuto);
    EXPECT_TRUE(at::equal(by_kernel, by_reference)) << to_string(type);
  }
}

// The path on this card is the one the built architecture list implies: the kernel where the list
// has this card's cubin or PTX of an architecture not newer than it (the driver compiles it),
// else the reference with a reason that names the architecture. The other kernel tests skip in
// the second case; this one checks it.
TEST(DequantizeKernelStatus, ThePathFollowsTheBuiltArchitectures) {
  DDO_REQUIRE_GPU();
  const int capability = testing::current_capability();
  const KernelStatus status = dequantize_kernel_status(at::cuda::current_device());
  const bool expect_kernel = testing::built_list_runs_on(built_cuda_architectures(), capability);
  EXPECT_EQ(status.path == KernelPath::kKernel, expect_kernel)
      << "built for " << built_cuda_architectures() << ", card sm_" << capability << ": "
      << status.reason;
  if (!expect_kernel) {
    EXPECT_NE(status.reason.find("sm_" + std::to_string(capability)), std::string::npos)
        << status.reason;
    // The reference path gives the results: one layer through the public entry point.
    QuantizeOptions opt;
    opt.type = QuantType::kInt8;
    auto [w, layout] = quantize(at::randn({64, 128}).to(at::kBFloat16), opt);
    QuantizedWeight g{w.weight.cuda(), w.scale.cuda(), {}, {}, {}};
    EXPECT_TRUE(at::equal(dequantize(g, layout).cpu(), dequantize_reference(w, layout)));
  }
}

TEST(BuiltArchitectureList, NamesTheCodeACardRuns) {
  EXPECT_TRUE(testing::built_list_runs_on("80-real,90-real", 90));
  EXPECT_FALSE(testing::built_list_runs_on("80-real", 90));
  EXPECT_TRUE(testing::built_list_runs_on("90-virtual", 90));
  EXPECT_TRUE(testing::built_list_runs_on("80-virtual", 90));  // PTX JIT-compiled upward
  EXPECT_FALSE(testing::built_list_runs_on("100-virtual", 90));
  EXPECT_TRUE(testing::built_list_runs_on("75-real;120-real;120-virtual", 120));
  EXPECT_TRUE(testing::built_list_runs_on("86", 89));  // a bare number: real and virtual
  EXPECT_FALSE(testing::built_list_runs_on("", 90));
}

}  // namespace
}  // namespace ddo::sdnq
