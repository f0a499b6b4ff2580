// OffloadOptions::quantize on a CUDA card (label "gpu"; skips, saying so, without a GPU): a
// stock bf16 torch::nn model's Linears, streamed as quantized copies, give the outputs of the
// same layers built from ddo's SDNQ layers and run resident (the same kernels: the card's fp8 or
// int8 GEMM where it has one), and report the path the card takes.
#include <gtest/gtest.h>

#include <cstdio>

#include <ATen/ops/allclose.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "../test_util.h"
#include "ddo/sdnq/linear.h"
#include "ddo/sdnq/ops.h"
#include "ddo/sdnq/quantize_model.h"
#include "ddo/sdnq/quantized_matmul.h"
#include "ddo/torch/enable_offload.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

const c10::Device kCuda(c10::kCUDA, 0);

// Blocks of two dense Linears (the residency candidates).
struct DenseBlockImpl : torch::nn::Module {
  explicit DenseBlockImpl(std::int64_t h) {
    up = register_module("up", torch::nn::Linear(h, 4 * h));
    down = register_module("down", torch::nn::Linear(4 * h, h));
  }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(DenseBlock);

struct DenseStackImpl : torch::nn::Module {
  DenseStackImpl(int n, std::int64_t h) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < n; ++i) blocks->push_back(DenseBlock(h));
    to(at::kBFloat16);
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& b : *blocks) {
      auto* block = b->as<DenseBlockImpl>();
      x = x + block->down(at::gelu(block->up(x)));
    }
    return x;
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(DenseStack);

TEST(QuantizeOptionGpu, StreamedQuantizedCopiesGiveTheResidentQuantizedLayersOutputs) {
  DDO_SKIP_WITHOUT_GPU();
  for (sdnq::QuantType type : {sdnq::QuantType::kInt8, sdnq::QuantType::kFloat8E4M3}) {
    at::manual_seed(7);
    DenseStack model(4, 512);
    const at::Tensor x = at::randn({2, 128, 512}).to(at::kBFloat16).to(kCuda);
    // The reference: the same quantization through ddo's SDNQ layers, resident on the card.
    at::Tensor ref, ref_first, ref_first_bias_after;
    {
      const sdnq::QuantizeOptions opt = sdnq::quantize_model_options(type);
      torch::NoGradGuard ng;
      at::Tensor h = x;
      for (const auto& b : *model->blocks) {
        auto* block = b->as<DenseBlockImpl>();
        sdnq::SdnqLinear up(*block->up, opt), down(*block->down, opt);
        up->to(kCuda);
        down->to(kCuda);
        if (!ref_first.defined()) {
          ref_first = up(h).cpu();
          // The same layer with its bias added after the GEMM, in bf16: what the output is
          // when the bias does not reach the GEMM's epilogue.
          ref_first_bias_after =
              (sdnq::call_linear(h, up->weights(), at::Tensor(), up->layout().encode()) +
               up->named_parameters()["bias"])
                  .cpu();
        }
        h = h + down(at::gelu(up(h)));
      }
      ref = h.cpu();
    }
    TempDir dir;
    OffloadOptions o;
    o.preset = "one_shot_fast";
    o.execution_device = "cuda:0";
    o.env = test::test_env(dir);
    o.overrides = {{"small_tensor_threshold_bytes", 0},
                   {"always_resident_modules_pattern", nlohmann::json::array()},
                   {"resident_module_budget_gb", 0.0},
                   {"auto_budget_policy", "off"}};
    o.quantize = type == sdnq::QuantType::kInt8 ? "int8" : "fp8";
    auto offload = enable_offload(*model, o);
    const nlohmann::json q = offload->report().at("quantized_compute");
    EXPECT_EQ(q.at("layers").size(), 8U) << q.dump();
    const sdnq::GemmTarget target = sdnq::gemm_target(kCuda);
    const bool gemm =
        type == sdnq::QuantType::kInt8 ? target.capability >= 80 : target.capability >= 89;
    EXPECT_EQ(q.at("layers").at("blocks.0.up").at("path"),
              gemm ? (type == sdnq::QuantType::kInt8 ? "int8_gemm" : "fp8_gemm") : "dequantize")
        << q.dump();
    const auto rel = [](const at::Tensor& a, const at::Tensor& b) {
      const at::Tensor bf = b.to(at::kFloat);
      return ((a.to(at::kFloat) - bf).norm() / bf.norm()).item<double>();
    };
    {
      // One layer on the same input: the same quantized tensors and kernels, so at most the
      // result's last rounding differs: one bf16 ulp, 2^-7 of a value at most (measured on an
      // H100: relative L2 0.0029; on the CPU the two are bit-equal). The diagnostic line says
      // whether the difference is the bias added after the GEMM.
      torch::NoGradGuard ng;
      const at::Tensor first = model->blocks[0]->as<DenseBlockImpl>()->up(x).cpu();
      const double r = rel(first, ref_first);
      EXPECT_LT(r, 0.008) << o.quantize << " first layer";
      std::printf(
          "[ diagnostic ] %s first layer: relative L2 %.6f%s; against the bias added "
          "after the GEMM: %s\n",
          o.quantize.c_str(), r, at::equal(first, ref_first) ? " (bit-equal)" : "",
          at::equal(first, ref_first_bias_after) ? "bit-equal" : "differs");
    }
    for (int step = 0; step < 3; ++step) {
      torch::NoGradGuard ng;
      const at::Tensor y = model->forward(x).cpu();
      // Four blocks deep, a last-bit difference of one layer moves the next layer's activation
      // rounding (int8: steps of absmax / 127; fp8: 3 mantissa bits) for the values near a
      // rounding boundary, so the outputs differ by a part of the quantization's own error, not by
      // bf16 rounding: an elementwise tolerance of 2e-2 on values up to ~8 cannot hold. The bound
      // is the per-layer activation rounding of Note [Quantized matmul accuracy] (int8 0.01,
      // fp8 0.03), which the quantization's error against the dense model exceeds.
      const double bound = type == sdnq::QuantType::kInt8 ? 0.01 : 0.03;
      EXPECT_LT(rel(y, ref), bound) << o.quantize << " step " << step;
    }
    EXPECT_GT(offload->report().at("run").at("bytes_streamed").get<std::int64_t>(), 0);
    offload->remove();
    EXPECT_TRUE(model->blocks[0]->as<DenseBlockImpl>()->up->weight.device().is_cpu());
  }
}

}  // namespace
}  // namespace ddo::adapter
