// OffloadOptions::quantize on a CUDA card (label "gpu"; skips, saying so, without a GPU): a
// stock bf16 torch::nn model's Linears, streamed as quantized copies, give the outputs of the
// same layers built from ddo's SDNQ layers and run resident (the same kernels: the card's fp8 or
// int8 GEMM where it has one), and report the path the card takes.
#include <gtest/gtest.h>

#include <ATen/ops/allclose.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "../test_util.h"
#include "ddo/sdnq/linear.h"
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
    at::Tensor ref, ref_first;
    {
      const sdnq::QuantizeOptions opt = sdnq::quantize_model_options(type);
      torch::NoGradGuard ng;
      at::Tensor h = x;
      for (const auto& b : *model->blocks) {
        auto* block = b->as<DenseBlockImpl>();
        sdnq::SdnqLinear up(*block->up, opt), down(*block->down, opt);
        up->to(kCuda);
        down->to(kCuda);
        if (!ref_first.defined()) ref_first = up(h).cpu();
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
    {
      // One layer on the same input: the same quantized tensors and kernels.
      torch::NoGradGuard ng;
      const at::Tensor first = model->blocks[0]->as<DenseBlockImpl>()->up(x).cpu();
      EXPECT_TRUE(at::equal(first, ref_first))
          << o.quantize << " first layer: max " << (first - ref_first).abs().max().item<float>()
          << ", relative L2 "
          << ((first.to(at::kFloat) - ref_first.to(at::kFloat)).norm() /
              ref_first.to(at::kFloat).norm())
                 .item<float>();
    }
    for (int step = 0; step < 3; ++step) {
      torch::NoGradGuard ng;
      const at::Tensor y = model->forward(x).cpu();
      // The same quantized tensors and kernels; torch's linear may add the bias after the GEMM
      // instead of in its epilogue, so equal up to bf16 rounding.
      EXPECT_TRUE(at::allclose(y, ref, 2e-2, 2e-2))
          << o.quantize << " step " << step << " " << (y - ref).abs().max() << " relative L2 "
          << ((y.to(at::kFloat) - ref.to(at::kFloat)).norm() / ref.to(at::kFloat).norm())
                 .item<float>();
    }
    EXPECT_GT(offload->report().at("run").at("bytes_streamed").get<std::int64_t>(), 0);
    offload->remove();
    EXPECT_TRUE(model->blocks[0]->as<DenseBlockImpl>()->up->weight.device().is_cpu());
  }
}

}  // namespace
}  // namespace ddo::adapter
