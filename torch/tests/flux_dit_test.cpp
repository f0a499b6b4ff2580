// Tests of the W1 model: shapes, finiteness, determinism, parameter count and module names.
#include "ddo/torch/testing/flux_dit.h"

#include <regex>
#include <set>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/isfinite.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "ddo/core/status.h"

namespace ddo::adapter::testing {
namespace {

TEST(FluxDiT, TinyForwardHasTheRightShapeAndIsFinite) {
  const FluxDiTOptions o = FluxDiTOptions::preset("tiny");
  FluxDiT model(o);
  const FluxDiTInputs in = make_inputs(o, c10::kCPU, /*batch=*/2);
  torch::NoGradGuard no_grad;
  const torch::Tensor out = model->forward(in.img, in.txt, in.timestep);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{2, o.img_tokens, o.in_channels}));
  EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  EXPECT_GT(out.abs().max().item<double>(), 1e-3) << "an all-zero output hides wiring mistakes";
  EXPECT_LT(out.abs().max().item<double>(), 1e3);
}

TEST(FluxDiT, DeterministicForASeedAndDifferentAcrossSeeds) {
  FluxDiTOptions o = FluxDiTOptions::preset("tiny");
  const FluxDiTInputs in = make_inputs(o, c10::kCPU);
  torch::NoGradGuard no_grad;
  const torch::Tensor a = FluxDiT(o)->forward(in.img, in.txt, in.timestep);
  const torch::Tensor b = FluxDiT(o)->forward(in.img, in.txt, in.timestep);
  EXPECT_TRUE(at::equal(a, b));
  o.seed = 7;
  const torch::Tensor c = FluxDiT(o)->forward(in.img, in.txt, in.timestep);
  EXPECT_FALSE(at::allclose(a, c));
}

TEST(FluxDiT, Bf16DeepVariantStaysFinite) {
  FluxDiTOptions o = FluxDiTOptions::preset("tiny");
  o.double_blocks = 19;
  o.single_blocks = 38;
  o.dtype = c10::ScalarType::BFloat16;
  FluxDiT model(o);
  const FluxDiTInputs in = make_inputs(o, c10::kCPU);
  torch::NoGradGuard no_grad;
  const torch::Tensor out = model->forward(in.img, in.txt, in.timestep);
  EXPECT_EQ(out.scalar_type(), c10::ScalarType::BFloat16);
  EXPECT_TRUE(at::isfinite(out).all().item<bool>());
}

TEST(FluxDiT, ParameterCountMatchesTheModelAndFluxAtFullSize) {
  for (const char* name : {"tiny", "small"}) {
    const FluxDiTOptions o = FluxDiTOptions::preset(name);
    FluxDiT model(o);
    int64_t counted = 0;
    for (const auto& p : model->parameters()) counted += p.numel();
    EXPECT_EQ(counted, FluxDiTImpl::parameter_count(o)) << name;
  }
  const FluxDiTOptions full = FluxDiTOptions::preset("full");
  const double params = static_cast<double>(FluxDiTImpl::parameter_count(full));
  EXPECT_NEAR(params / 11.9e9, 1.0, 0.03) << params;
  EXPECT_NEAR(static_cast<double>(FluxDiTImpl::parameter_bytes(full)) / 23.8e9, 1.0, 0.03);
}

TEST(FluxDiT, ModuleNamesFollowDiffusers) {
  FluxDiT model(FluxDiTOptions::preset("tiny"));
  std::set<std::string> names;
  for (const auto& item : model->named_modules()) names.insert(item.key());
  for (const char* want :
       {"x_embedder", "context_embedder", "time_embed.linear_1", "transformer_blocks.1",
        "transformer_blocks.0.norm1.linear", "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.ff.net.0.proj",
        "transformer_blocks.0.ff.net.2", "transformer_blocks.0.ff_context.net.2",
        "single_transformer_blocks.1", "single_transformer_blocks.0.proj_mlp",
        "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_out",
        "norm_out.linear", "proj_out"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  // Every weight-bearing 2-D parameter belongs to a stock Linear.
  for (const auto& item : model->named_modules()) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (p.value().dim() == 2) {
        EXPECT_NE(dynamic_cast<torch::nn::LinearImpl*>(item.value().get()), nullptr)
            << item.key() << "." << p.key();
      }
    }
  }
}

TEST(FluxDiT, UnknownPresetNamesTheValidOnes) {
  try {
    FluxDiTOptions::preset("huge");
    FAIL();
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("tiny, small, full"), std::string::npos);
  }
}

}  // namespace
}  // namespace ddo::adapter::testing
