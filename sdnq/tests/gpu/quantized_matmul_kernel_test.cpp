// The quantized-matmul kernels against their ATen references on the same GPU, bit for bit
// (Note [Bit-equal quantized matmul steps]), and each GEMM path the card has against the CPU's
// references of the same path.
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <gtest/gtest.h>

#include "ddo/sdnq/dequantize.h"
#include "ddo/sdnq/kernel_status.h"
#include "gpu_kernel_test_util.h"
#include "ddo/sdnq/quantize.h"
#include "ddo/sdnq/quantized_matmul.h"

namespace ddo::sdnq {
namespace {

using testing::have_gpu;

double relative_l2(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor af = a.to(at::kCPU).to(at::kFloat);
  const at::Tensor bf = b.to(at::kCPU).to(at::kFloat);
  return ((af - bf).norm() / bf.norm()).item<double>();
}

TEST(QuantizeRowsKernel, EqualsTheReferenceBitForBit) {
  DDO_REQUIRE_KERNEL_IMAGE();
  at::manual_seed(11);
  for (const c10::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    // Rows read in one pass of 16-byte vectors (3072; 15360, the widest of FLUX's inputs: 8
    // vectors a thread for 2-byte values), and rows that take the scalar kernel (37: not a
    // multiple of the vector; 16392: wider than one pass holds).
    for (const std::int64_t cols :
         {std::int64_t{3072}, std::int64_t{37}, std::int64_t{15360}, std::int64_t{16392}}) {
      at::Tensor x = (at::randn({300, cols}) * 3).to(dtype).cuda();
      x[5].zero_();
      for (const QuantType type : {QuantType::kInt8, QuantType::kFloat8E4M3}) {
        auto [q, s] = quantize_rows(x, type);
        auto [rq, rs] = quantize_rows_reference(x, type);
        const std::string what = std::string(c10::toString(dtype)) + " " + to_string(type) +
                                 " cols " + std::to_string(cols);
        EXPECT_TRUE(at::equal(s, rs)) << what;
        EXPECT_TRUE(at::equal(q.view(at::kByte), rq.view(at::kByte))) << what;
      }
    }
  }
  // Rows that are not contiguous with each other (a column slice): the kernel reads the stride.
  const at::Tensor wide = at::randn({64, 512}).to(at::kBFloat16).cuda();
  const at::Tensor slice = wide.narrow(1, 0, 256);
  auto [q, s] = quantize_rows(slice, QuantType::kInt8);
  auto [rq, rs] = quantize_rows_reference(slice, QuantType::kInt8);
  EXPECT_TRUE(at::equal(q, rq));
  EXPECT_TRUE(at::equal(s, rs));
}

TEST(Int8EpilogueKernel, EqualsTheReferenceBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: GPU test skipped";
  at::manual_seed(12);
  const at::Tensor acc = at::randint(-2000000, 2000000, {257, 129}, at::kInt).cuda();
  const at::Tensor rows = at::rand({257}).cuda() * 0.01;
  const at::Tensor cols = at::rand({129}).cuda() * 0.01;
  for (const c10::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const at::Tensor bias = at::randn({129}).to(dtype).cuda();
    EXPECT_TRUE(at::equal(int8_scale_epilogue(acc, rows, cols, bias, dtype),
                          int8_scale_epilogue_reference(acc, rows, cols, bias, dtype)))
        << c10::toString(dtype);
    EXPECT_TRUE(at::equal(int8_scale_epilogue(acc, rows, cols, at::Tensor(), dtype),
                          int8_scale_epilogue_reference(acc, rows, cols, at::Tensor(), dtype)));
  }
}

// Each GEMM path this card has, against the same path computed on the CPU (int8: exact integer
// sums, so equal up to the epilogue's identical roundings; fp8: float32 sums in another order).
TEST(QuantizedGemmOnDevice, MatchesTheCpuPathAndIsChosenByCapability) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU: GPU test skipped";
  const GemmTarget target = gemm_target(at::Device(at::kCUDA, at::cuda::current_device()));
  at::manual_seed(13);
  const at::Tensor dense = (at::randn({512, 1024}) * 0.02).to(at::kBFloat16);
  const at::Tensor x = at::randn({4, 128, 1024}).to(at::kBFloat16);
  const at::Tensor bias = at::randn({512}).to(at::kBFloat16);
  for (const QuantType type : {QuantType::kInt8, QuantType::kFloat8E4M3}) {
    for (const bool transposed : {false, true}) {
      QuantizeOptions opt;
      opt.type = type;
      opt.quantized_matmul = !transposed;
      opt.transposed = transposed;
      auto [w, layout] = quantize(dense, opt);
      const QuantizedWeight g{w.weight.cuda(), w.scale.cuda(), {}, {}, {}};
      const LinearPathChoice choice = choose_linear_path(layout, g, x.cuda());
      const bool has = type == QuantType::kInt8 ? target.capability >= 80 : target.capability >= 89;
      EXPECT_EQ(choice.path != LinearPath::kDequantize, has) << choice.why;
      const at::Tensor on_device = linear(x.cuda(), g, bias.cuda(), layout);
      const at::Tensor on_cpu = linear(x, w, bias, layout);
      const std::string what = std::string(to_string(type)) + (transposed ? " transposed" : "");
      if (!has) {
        EXPECT_LT(relative_l2(on_device, at::linear(x, dequantize_reference(w, layout), bias)),
                  1e-2)
            << what;
        continue;
      }
      EXPECT_LT(relative_l2(on_device, on_cpu), type == QuantType::kInt8 ? 1e-6 : 5e-3) << what;
    }
  }
}

}  // namespace
}  // namespace ddo::sdnq
