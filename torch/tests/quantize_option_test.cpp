// OffloadOptions::quantize on the sim device (Note [Quantized dense weights] in
// attach_quantize.cpp): a stock torch::nn model's Linears compute from quantized copies that
// stream in place of their dense weights, with the outputs of ddo's own SDNQ layers quantized the
// same way; reads outside the intercepted ops see the dense weight; an in-place change is
// quantized again; remove() gives the model back unchanged.
#include <gtest/gtest.h>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/status.h"
#include "ddo/sdnq/linear.h"
#include "ddo/sdnq/quantize_model.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/loader.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

// Two Linears that qualify and one too small to quantize (16 x 64 < 16384 weights).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    up = register_module("up", torch::nn::Linear(64, 256));
    down = register_module("down", torch::nn::Linear(256, 64));
    head = register_module("head", torch::nn::Linear(64, 16));
    to(at::kBFloat16);
  }
  at::Tensor forward(const at::Tensor& x) { return head(down(at::gelu(up(x))) + x); }
  torch::nn::Linear up{nullptr}, down{nullptr}, head{nullptr};
};
TORCH_MODULE(Net);

// The same computation with ddo's SDNQ layers quantized as quantize= quantizes (no offload).
at::Tensor reference(Net& net, sdnq::QuantType type, const at::Tensor& x) {
  const sdnq::QuantizeOptions opt = sdnq::quantize_model_options(type);
  sdnq::SdnqLinear up(*net->up, opt), down(*net->down, opt);
  torch::NoGradGuard ng;
  return net->head(down(at::gelu(up(x))) + x);
}

OffloadOptions quantize_options(const TempDir& dir, const std::string& quantize) {
  OffloadOptions o = test::sim_options(dir);
  o.quantize = quantize;
  return o;
}

at::Tensor run(Net& net, const at::Tensor& x) {
  torch::NoGradGuard ng;
  return net->forward(x);
}

class QuantizeOptionTest : public ::testing::TestWithParam<sdnq::QuantType> {
 protected:
  std::string option() const { return GetParam() == sdnq::QuantType::kFloat8E4M3 ? "fp8" : "int8"; }
};

TEST_P(QuantizeOptionTest, LinearsComputeFromTheStreamedQuantizedCopy) {
  torch::manual_seed(0);
  Net net;
  const at::Tensor x2 = at::randn({48, 64}).to(at::kBFloat16);     // addmm
  const at::Tensor x3 = at::randn({2, 24, 64}).to(at::kBFloat16);  // folded into addmm / mm
  const at::Tensor x3t = at::randn({24, 2, 64}).to(at::kBFloat16).transpose(0, 1);  // bmm
  const at::Tensor ref2 = reference(net, GetParam(), x2);
  const at::Tensor ref3 = reference(net, GetParam(), x3);
  const at::Tensor ref3t = reference(net, GetParam(), x3t);
  const at::Tensor dense2 = run(net, x2);

  TempDir dir;
  auto offload = enable_offload(*net, quantize_options(dir, option()));
  const at::Tensor y2 = run(net, x2);
  const at::Tensor y3 = run(net, x3);
  const at::Tensor y3t = run(net, x3t);
  // The same quantized tensors and kernels as ddo's SDNQ layers: equal up to where torch's
  // linear adds the bias (inside the layer's epilogue here, after the GEMM for some inputs).
  EXPECT_TRUE(at::allclose(y2, ref2, 1e-2, 1e-2)) << (y2 - ref2).abs().max();
  EXPECT_TRUE(at::allclose(y3, ref3, 1e-2, 1e-2)) << (y3 - ref3).abs().max();
  EXPECT_TRUE(at::allclose(y3t, ref3t, 1e-2, 1e-2)) << (y3t - ref3t).abs().max();
  // And not the dense model: the quantization changed the outputs.
  EXPECT_FALSE(at::equal(y2, dense2));

  const nlohmann::json r = offload->report();
  const nlohmann::json& q = r.at("quantized_compute");
  EXPECT_EQ(q.at("quantize"), option());
  const std::string path = GetParam() == sdnq::QuantType::kFloat8E4M3 ? "fp8_gemm" : "int8_gemm";
  EXPECT_EQ(q.at("counts"), nlohmann::json({{path, 2}})) << q.dump();
  EXPECT_EQ(q.at("layers").at("up").at("path"), path);
  EXPECT_EQ(q.at("kept_dense"), nlohmann::json({{"head", "fewer than 16384 weights"}}));
  EXPECT_EQ(r.at("execution_mode"), "sdnq_runtime");
  EXPECT_NE(offload->summary().find("quantize " + option() + ": 2 Linears (2 " + path +
                                    "), 1 kept dense"),
            std::string::npos)
      << offload->summary();
  // What streams is the one-byte copy with its float32 scales, not the two-byte weight.
  const std::int64_t quantized_bytes = (64 * 256 + 256 * 64) + (256 + 64) * 4;
  EXPECT_GE(r.at("plan").at("streamed_bytes").get<std::int64_t>(), quantized_bytes);
  EXPECT_LT(r.at("plan").at("streamed_bytes").get<std::int64_t>(), 2 * 64 * 256 * 2);
  EXPECT_GT(r.at("run").at("bytes_streamed").get<std::int64_t>(), 0);
}

TEST_P(QuantizeOptionTest, ReadsOutsideTheOpsSeeTheDenseWeightAndRemoveGivesItBack) {
  torch::manual_seed(1);
  Net net;
  const at::Tensor before = net->up->weight.detach().clone();
  const void* memory = net->up->weight.data_ptr();
  TempDir dir;
  auto offload = enable_offload(*net, quantize_options(dir, option()));
  EXPECT_TRUE(is_managed(net->up->weight));
  // Not zeros, not the quantized values: the model's own bytes.
  EXPECT_TRUE(at::equal(net->up->weight, before));
  EXPECT_EQ(net->up->weight.data_ptr(), memory);
  EXPECT_FALSE(net->up->weight.requires_grad());  // inference-only while served
  offload->remove();
  EXPECT_FALSE(is_managed(net->up->weight));
  EXPECT_TRUE(at::equal(net->up->weight, before));
  EXPECT_EQ(net->up->weight.data_ptr(), memory);
  EXPECT_TRUE(net->up->weight.requires_grad());
  EXPECT_EQ(offload->report()
                .at("quantized_compute")
                .at("counts")
                .at(GetParam() == sdnq::QuantType::kFloat8E4M3 ? "fp8_gemm" : "int8_gemm"),
            2);
}

TEST_P(QuantizeOptionTest, AnInPlaceChangeIsQuantizedAgain) {
  torch::manual_seed(2);
  Net net;
  const at::Tensor x = at::randn({48, 64}).to(at::kBFloat16);
  TempDir dir;
  auto offload = enable_offload(*net, quantize_options(dir, option()));
  const at::Tensor first = run(net, x);
  {
    torch::NoGradGuard ng;
    net->up->weight.mul_(0.5);  // what a LoRA fuse does through the parameter
  }
  const at::Tensor changed = run(net, x);
  EXPECT_GE(offload->report().at("run").at("weights_changed_in_place").get<int>(), 1);
  offload->remove();
  const at::Tensor expected = reference(net, GetParam(), x);  // from the halved dense weight
  EXPECT_FALSE(at::allclose(changed, first, 1e-2, 1e-2));
  EXPECT_TRUE(at::allclose(changed, expected, 1e-2, 1e-2)) << (changed - expected).abs().max();
}

TEST_P(QuantizeOptionTest, OtherReadsOfTheWeightGetItDequantized) {
  torch::manual_seed(3);
  Net net;
  const at::Tensor g = at::randn({8, 256}).to(at::kBFloat16);
  sdnq::SdnqLinear q(*net->up, sdnq::quantize_model_options(GetParam()));
  const at::Tensor dequantized = q->dequantized_weight();
  TempDir dir;
  auto offload = enable_offload(*net, quantize_options(dir, option()));
  torch::NoGradGuard ng;
  // mm(g, W): what a backward computes for the input's gradient; not a Linear's read.
  const at::Tensor y = at::mm(g, net->up->weight);
  EXPECT_TRUE(at::equal(y, at::mm(g, dequantized)));
}

INSTANTIATE_TEST_SUITE_P(Types, QuantizeOptionTest,
                         ::testing::Values(sdnq::QuantType::kInt8, sdnq::QuantType::kFloat8E4M3),
                         [](const auto& param_info) {
                           return param_info.param == sdnq::QuantType::kInt8 ? std::string("Int8")
                                                                             : std::string("Fp8");
                         });

TEST(QuantizeOption, AnUnknownChoiceIsRefusedNamingTheChoices) {
  Net net;
  TempDir dir;
  try {
    (void)enable_offload(*net, quantize_options(dir, "int4"));
    FAIL() << "quantize=int4 was accepted";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("\"fp8\""), std::string::npos) << e.what();
  }
  EXPECT_FALSE(is_managed(net->up->weight));
}

TEST(QuantizeOption, ASecondAttachServesTheCopyFromThePinnedWeightCache) {
  torch::manual_seed(4);
  Net net;
  const at::Tensor x = at::randn({48, 64}).to(at::kBFloat16);
  TempDir dir;
  OffloadOptions o = test::sim_options(dir, {{"cache_pinned_weights", true},
                                             {"pinned_weight_cache_namespace", "quantize-test"},
                                             {"pin_cpu_memory", true}});
  o.quantize = "int8";
  auto first = enable_offload(*net, o);
  const at::Tensor y = run(net, x);
  first->remove();
  auto second = enable_offload(*net, o);
  // The copy is made again (quantize= runs at every attach) into the slabs pinned the first time.
  const nlohmann::json cache = second->report().at("setup").at("weight_cache");
  EXPECT_EQ(cache.at("status"), "hit") << cache.dump();
  EXPECT_EQ(cache.at("pinned_new_bytes"), 0) << cache.dump();
  EXPECT_TRUE(at::equal(run(net, x), y));
  second->remove(Offload::RemoveOptions{.clear_weight_cache = true});
}

TEST(QuantizeOption, TheLoaderReadsTheDenseWeightsThenTheCopyIsWhatStreams) {
  torch::manual_seed(5);
  Net net;
  const at::Tensor x = at::randn({48, 64}).to(at::kBFloat16);
  const at::Tensor expected = reference(net, sdnq::QuantType::kFloat8E4M3, x);
  std::vector<std::pair<std::string, at::Tensor>> state = test::state_of(*net);
  for (auto& [name, t] : state) t = t.to(at::kFloat);  // bf16 values, exact in float32
  TempDir dir;
  const std::string file = (dir.path() / "net.safetensors").string();
  test::write_safetensors(file, state);
  const at::Tensor up_weight = net->up->weight.detach().clone();
  release_weights(*net);
  LoadOptions load;
  load.path = file;
  load.dtype = at::kBFloat16;
  auto offload = load_with_offload(*net, load, quantize_options(dir, "fp8"));
  const nlohmann::json r = offload->report();
  EXPECT_EQ(r.at("quantized_compute").at("layers").size(), 2U) << r.at("quantized_compute");
  EXPECT_TRUE(at::equal(net->up->weight, up_weight));  // read from the file, not a placeholder
  const at::Tensor y = run(net, x);
  EXPECT_TRUE(at::allclose(y, expected, 1e-2, 1e-2)) << (y - expected).abs().max();
  offload->remove();
  EXPECT_FALSE(is_placeholder(net->up->weight));
  EXPECT_TRUE(at::equal(net->up->weight, up_weight));
}

TEST(QuantizeOption, DenseWeightsInTheCheckpointsDtypePointIntoTheFile) {
  torch::manual_seed(6);
  Net net;
  net->to(at::kFloat);  // the file's dtype: no conversion, so the placeholders map the file
  const at::Tensor x = at::randn({48, 64});
  const at::Tensor expected = reference(net, sdnq::QuantType::kInt8, x);
  const at::Tensor dense = run(net, x);
  TempDir dir;
  const std::string file = (dir.path() / "net.safetensors").string();
  test::write_safetensors(file, test::state_of(*net));
  std::int64_t file_bytes = 0;
  for (const at::Tensor& p : net->parameters()) file_bytes += p.numel() * p.element_size();
  const at::Tensor up_weight = net->up->weight.detach().clone();
  release_weights(*net);
  LoadOptions load;
  load.path = file;
  auto offload = load_with_offload(*net, load, quantize_options(dir, "int8"));
  // The two quantized dense weights were not read through the loader: they are the file's pages.
  const std::int64_t mapped = 2 * 64 * 256 * 4;
  EXPECT_EQ(offload->report().at("setup").at("load").at("bytes").get<std::int64_t>(),
            file_bytes - mapped);
  EXPECT_TRUE(at::equal(net->up->weight, up_weight));
  const at::Tensor y = run(net, x);
  EXPECT_TRUE(at::allclose(y, expected, 1e-4, 1e-4)) << (y - expected).abs().max();
  offload->remove();
  // Memory of its own again, with the same values, after the file is gone.
  std::filesystem::remove(file);
  EXPECT_TRUE(at::equal(net->up->weight, up_weight));
  EXPECT_TRUE(at::equal(run(net, x), dense));
}

TEST(QuantizeOption, TiedWeightsStayDense) {
  Net net;
  net->down->weight.set_data(net->up->weight.detach().t());  // shares up's memory
  TempDir dir;
  auto offload = enable_offload(*net, quantize_options(dir, "int8"));
  const nlohmann::json q = offload->report().at("quantized_compute");
  EXPECT_TRUE(q.at("layers").empty()) << q.dump();
  EXPECT_NE(q.at("kept_dense").at("up").get<std::string>().find("tied"), std::string::npos)
      << q.dump();
  EXPECT_TRUE(q.at("kept_dense").contains("down")) << q.dump();
}

// Kept dense whatever their weights: a module the options keep at full precision, a LoRA
// adapter, a Linear subclass (a Python builder's stock_class = false), a float64 weight.
TEST(QuantizeOption, LinearsKeptDenseByTheirRoleOrDtypeSayWhy) {
  torch::nn::Sequential seq;
  seq->push_back("time_embedder", torch::nn::Linear(256, 256));
  seq->push_back("lora_A", torch::nn::Linear(256, 256));
  seq->push_back("custom", torch::nn::Linear(256, 256));
  seq->push_back("plain", torch::nn::Linear(256, 256));
  seq->push_back("float64", torch::nn::Linear(256, 256));
  seq->to(at::kBFloat16);
  seq->ptr(4)->to(at::kDouble);
  ModuleTree tree = module_tree_from(*seq);
  for (ModuleEntry& e : tree.entries) e.stock_class = e.name != "custom";
  TempDir dir;
  OffloadOptions o = quantize_options(dir, "fp8");
  o.keep_dense_modules = {"time_embedder"};
  auto offload = enable_offload_tree(std::move(tree), o);
  const nlohmann::json q = offload->report().at("quantized_compute");
  EXPECT_EQ(q.at("layers").size(), 1U) << q.dump();
  EXPECT_TRUE(q.at("layers").contains("plain")) << q.dump();
  const nlohmann::json& kept = q.at("kept_dense");
  EXPECT_EQ(kept.at("time_embedder"),
            "the model keeps it at full precision (_keep_in_fp32_modules: time_embedder)");
  EXPECT_EQ(kept.at("lora_A"),
            "a LoRA adapter (lora_A in its name): adapters stay at the model's precision");
  EXPECT_NE(kept.at("custom").get<std::string>().find("a subclass of Linear"), std::string::npos)
      << q.dump();
  EXPECT_NE(kept.at("float64").get<std::string>().find("neither bfloat16"), std::string::npos)
      << q.dump();
}

}  // namespace
}  // namespace ddo::adapter
