// LibTorch modules under offload, trained or written in place (Note [Training under offload] in
// torch/src/attach_plan.cpp, Note [Weights changed in place] in torch/src/intercept_common.h).
// A C++ module starts in training mode with every parameter requiring grad, like a Python one:
// that alone is served as inference; in a model whose host froze some parameters, a streamed one
// left trainable is refused by the first op that reads it with autograd enabled, naming it.
#include <string>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/status.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

torch::nn::Sequential make_net() {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < 3; ++i) {
    net->push_back(torch::nn::Linear(32, 32));
    net->push_back(torch::nn::Tanh());
  }
  return net;
}

at::Tensor forward(torch::nn::Sequential& net, const at::Tensor& x) {
  torch::NoGradGuard no_grad;
  return net->forward(x);
}

TEST(TrainingUnderOffload, AStreamedWeightLeftTrainableBesideFrozenOnesIsRefusedUnderAutograd) {
  torch::nn::Sequential net = make_net();
  torch::nn::Sequential reference = make_net();
  ASSERT_TRUE(net->is_training());
  net[0]->parameters()[0].set_requires_grad(false);  // the host froze a part of the model
  test::TempDir dir;
  // Attaching is not training: the module flag decides nothing (diffusers leaves LoRA modules
  // in training mode for inference).
  auto offload = enable_offload(*net, test::sim_options(dir));
  ASSERT_TRUE(is_managed(net[2]->parameters()[0]));
  // The weights of layers 2 and 4 (sim_options keeps the small biases resident; 0.weight is
  // frozen).
  EXPECT_EQ(offload->report()["run"]["weights_trainable"].get<int>(), 2);
  const at::Tensor x = at::randn({2, 32});
  EXPECT_TRUE(at::allclose(forward(net, x), forward(reference, x)));
  try {
    (void)net->forward(x);  // autograd enabled: a step that would train the streamed weights
    FAIL() << "the op should have been refused";
  } catch (const c10::Error& e) {
    const std::string text = e.what();
    EXPECT_NE(text.find("runs with autograd enabled and reads 2.weight"), std::string::npos)
        << text;
    EXPECT_NE(text.find("always_resident_modules_pattern"), std::string::npos) << text;
    EXPECT_NE(text.find("torch.no_grad()"), std::string::npos) << text;
  }
  offload->remove();
  for (const at::Tensor& p : net->parameters()) EXPECT_FALSE(is_managed(p));
  EXPECT_TRUE(net[2]->parameters()[0].requires_grad());
  EXPECT_FALSE(net[0]->parameters()[0].requires_grad());
}

TEST(TrainingUnderOffload, AnUntouchedModuleIsFrozenWhileAttachedAndRestoredAfter) {
  torch::nn::Sequential net = make_net();
  test::TempDir dir;
  auto offload = enable_offload(*net, test::sim_options(dir));
  int managed = 0;
  for (const at::Tensor& p : net->parameters()) {
    if (!is_managed(p)) continue;
    ++managed;
    EXPECT_FALSE(p.requires_grad());
  }
  ASSERT_GT(managed, 0);
  (void)forward(net, at::randn({2, 32}));
  EXPECT_EQ(offload->report()["run"]["weights_frozen"].get<int>(), managed);
  offload->remove();
  for (const at::Tensor& p : net->parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST(WritesUnderOffload, AnInPlaceWriteReachesTheNextForward) {
  torch::nn::Sequential net = make_net();
  torch::nn::Sequential reference = make_net();
  net->eval();
  reference->eval();
  test::TempDir dir;
  auto offload = enable_offload(*net, test::sim_options(dir));
  const at::Tensor x = at::randn({8, 32});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(at::equal(forward(net, x), forward(reference, x)));
  const at::Tensor before = forward(reference, x);
  {
    torch::NoGradGuard no_grad;
    net[4]->parameters()[0].mul_(-1.5);
    reference[4]->parameters()[0].mul_(-1.5);
  }
  ASSERT_FALSE(at::allclose(forward(reference, x), before));
  EXPECT_TRUE(at::equal(forward(net, x), forward(reference, x)));
  EXPECT_GT(offload->report()["run"]["weights_changed_in_place"].get<int>(), 0);
  offload->remove();
}

}  // namespace
}  // namespace ddo::adapter
