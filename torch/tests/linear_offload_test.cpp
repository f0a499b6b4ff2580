// Stock torch::nn::Linear models on the sim device: outputs equal to the unmanaged model (fp32
// exact), every streamed weight read goes through the scheduler and from device memory, remove
// restores the weights, plan mode moves nothing, and unmanaged tensors (and their autograd) are
// untouched.
#include <gtest/gtest.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/allclose.h>
#include <torch/autograd.h>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

torch::nn::Sequential make_mlp(bool bias, int64_t width = 64, int depth = 4) {
  torch::nn::Sequential net;
  for (int i = 0; i < depth; ++i) {
    net->push_back(torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(bias)));
    net->push_back(torch::nn::GELU());
  }
  return net;
}

std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

test::RecordingDevice* g_recording = nullptr;
std::atomic<int> g_staged{0};
std::atomic<int> g_outside{0};
void observe(const at::Tensor& staged, int /*unit*/) {
  ++g_staged;
  if (g_recording == nullptr || !g_recording->contains(staged.data_ptr())) ++g_outside;
}

class LinearOffloadTest : public ::testing::TestWithParam<bool> {};

TEST_P(LinearOffloadTest, OutputsEqualUnmanagedFor2dAnd3dInputs) {
  const bool bias = GetParam();
  torch::manual_seed(0);
  auto net = make_mlp(bias);
  at::Tensor x2 = at::randn({8, 64});
  at::Tensor x3 = at::randn({2, 5, 64});
  at::Tensor x3t = at::randn({5, 2, 64}).transpose(0, 1);  // non-contiguous: matmul -> bmm
  at::Tensor ref2, ref3, ref3t;
  {
    torch::NoGradGuard ng;
    ref2 = net->forward(x2);
    ref3 = net->forward(x3);
    // matmul folds a non-contiguous 3-D input into mm when the weight requires grad and expands
    // the weight into bmm otherwise; managed weights do not require grad, so the reference
    // takes the same (bmm) path.
    for (auto& p : net->parameters()) p.set_requires_grad(false);
    ref3t = net->forward(x3t);
    for (auto& p : net->parameters()) p.set_requires_grad(true);
  }
  const auto before = snapshot(*net);

  TempDir dir;
  auto inner = open_execution_device("sim", core::DynamicOffloadConfig{});
  auto recording = std::make_shared<test::RecordingDevice>(inner);
  OffloadOptions opts = test::sim_options(dir);
  opts.device = recording;
  EXPECT_FALSE(interception_active());
  auto offload = enable_offload(*net, opts);
  EXPECT_TRUE(interception_active());
  ASSERT_TRUE(offload->active());
  int managed = 0;
  for (const auto& p : net->parameters()) managed += is_managed(p) ? 1 : 0;
  // Weights are streamed; 1-D biases are moved once (docs/design/0006-configuration.md, section 1).
  EXPECT_EQ(managed, 4) << offload->summary();

  g_recording = recording.get();
  g_staged = 0;
  g_outside = 0;
  testing::set_stage_observer(&observe);
  test::ManagedReadGuard::clear();
  {
    test::ManagedReadGuard guard;
    torch::NoGradGuard ng;
    for (int step = 0; step < 3; ++step) {
      EXPECT_TRUE(at::equal(net->forward(x2), ref2));
      EXPECT_TRUE(at::equal(net->forward(x3), ref3));
      EXPECT_TRUE(at::equal(net->forward(x3t), ref3t));
    }
  }
  testing::set_stage_observer(nullptr);
  EXPECT_TRUE(test::ManagedReadGuard::violations().empty())
      << "un-intercepted ops read managed weights: "
      << *test::ManagedReadGuard::violations().begin();
  EXPECT_GT(g_staged.load(), 0);
  EXPECT_EQ(g_outside.load(), 0) << "a staged weight was not in device memory";
  const nlohmann::json report = offload->report();
  // Every Linear reads its weight once per forward (bias: moved with the weight's unit or
  // streamed as its own unit).
  EXPECT_GE(report["run"]["acquires"].get<int64_t>(), 9 * 4);
  EXPECT_GT(report["run"]["bytes_streamed"].get<int64_t>(), 0);
  EXPECT_LE(recording->memory().used_bytes, recording->memory().total_bytes);

  offload->remove();
  EXPECT_FALSE(offload->active());
  EXPECT_FALSE(interception_active());
  const auto after = snapshot(*net);
  ASSERT_EQ(before.size(), after.size());
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(at::equal(before[i], after[i]));
    EXPECT_FALSE(is_managed(net->parameters()[i]));
    EXPECT_TRUE(net->parameters()[i].requires_grad());
  }
  torch::NoGradGuard ng;
  EXPECT_TRUE(at::equal(net->forward(x2), ref2));
}

INSTANTIATE_TEST_SUITE_P(Bias, LinearOffloadTest, ::testing::Bool());

TEST(LinearOffload, PlanModeMovesNothing) {
  torch::manual_seed(1);
  auto net = make_mlp(true);
  std::vector<const void*> ptrs;
  for (const auto& p : net->parameters()) ptrs.push_back(p.data_ptr());
  TempDir dir;
  OffloadOptions opts = test::sim_options(dir, {{"execution_mode", "plan"}});
  auto offload = enable_offload(*net, opts);
  EXPECT_FALSE(offload->active());
  EXPECT_FALSE(offload->plan().execute);
  EXPECT_FALSE(interception_active());
  std::size_t i = 0;
  for (const auto& p : net->parameters()) {
    EXPECT_EQ(p.data_ptr(), ptrs[i++]);
    EXPECT_FALSE(is_managed(p));
  }
  EXPECT_GT(offload->plan().streamed_bytes, 0) << offload->summary();
  EXPECT_FALSE(offload->summary().empty());
}

TEST(LinearOffload, UnknownOverrideNamesError) {
  auto net = make_mlp(true);
  TempDir dir;
  OffloadOptions opts = test::sim_options(dir, {{"pin_memory", true}, {"bogus_field", 1}});
  try {
    enable_offload(*net, opts);
    FAIL() << "expected an error";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("pin_memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bogus_field"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(interception_active());
  for (const auto& p : net->parameters()) EXPECT_FALSE(is_managed(p));
}

TEST(LinearOffload, CpuExecutionDeviceIsPlanOnly) {
  auto net = make_mlp(true);
  TempDir dir;
  OffloadOptions opts = test::sim_options(dir);
  opts.execution_device = "cpu";
  EXPECT_THROW(enable_offload(*net, opts), ddo::Error);
}

TEST(LinearOffload, UnmanagedOpsAndAutogradKeepWorking) {
  torch::manual_seed(2);
  auto managed_net = make_mlp(true);
  auto plain = make_mlp(true);
  at::Tensor x = at::randn({4, 64});
  // Reference gradients of the unmanaged model, before any offload.
  plain->zero_grad();
  plain->forward(x).sum().backward();
  std::vector<at::Tensor> ref_grads;
  for (const auto& p : plain->parameters()) ref_grads.push_back(p.grad().clone());
  at::Tensor xi = at::randn({3, 64}).requires_grad_();
  at::Tensor ref_in_grad;
  {
    auto y = managed_net->forward(xi);
    ref_in_grad = torch::autograd::grad({y.sum()}, {xi})[0];
  }

  TempDir dir;
  auto offload = enable_offload(*managed_net, test::sim_options(dir));
  // Gradients of an unmanaged model in the same process, while the offload is active.
  plain->zero_grad();
  plain->forward(x).sum().backward();
  std::size_t i = 0;
  for (const auto& p : plain->parameters()) EXPECT_TRUE(at::equal(p.grad(), ref_grads[i++]));
  // Gradient w.r.t. an input that flows through managed Linears (their backward mm reads the
  // weight through the interception again).
  auto y = managed_net->forward(xi);
  at::Tensor in_grad = torch::autograd::grad({y.sum()}, {xi})[0];
  EXPECT_TRUE(at::equal(in_grad, ref_in_grad));
  for (const auto& p : managed_net->parameters()) {
    if (is_managed(p)) {
      EXPECT_FALSE(p.requires_grad());
    }
  }
  // Plain matmuls of unmanaged tensors.
  at::Tensor a = at::randn({5, 7}), b = at::randn({7, 3});
  EXPECT_TRUE(at::equal(a.mm(b), at::matmul(a, b)));
}

}  // namespace
}  // namespace ddo::adapter
