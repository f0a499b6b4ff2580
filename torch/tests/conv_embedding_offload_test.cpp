// Conv2d and Embedding models on the sim device: outputs equal to the unmanaged model (fp32
// exact) and weights streamed through the interception.
#include <gtest/gtest.h>

#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).stride(2)));
    c3 = register_module(
        "c3", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 8, 1).bias(false).groups(2)));
  }
  at::Tensor forward(const at::Tensor& x) { return c3(torch::relu(c2(torch::relu(c1(x))))); }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr}, c3{nullptr};
};
TORCH_MODULE(ConvNet);

struct TokenNetImpl : torch::nn::Module {
  TokenNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(1000, 32));
    head = register_module("head", torch::nn::Linear(32, 1000));
  }
  at::Tensor forward(const at::Tensor& ids) { return head(emb(ids)); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TokenNet);

TEST(ConvOffload, OutputsEqualUnmanaged) {
  torch::manual_seed(3);
  ConvNet net;
  at::Tensor x = at::randn({2, 3, 17, 17});
  at::Tensor ref;
  {
    torch::NoGradGuard ng;
    ref = net->forward(x);
  }
  TempDir dir;
  auto offload = enable_offload(*net, test::sim_options(dir));
  EXPECT_TRUE(is_managed(net->c1->weight));
  EXPECT_TRUE(is_managed(net->c3->weight));
  test::ManagedReadGuard::clear();
  {
    test::ManagedReadGuard guard;
    torch::NoGradGuard ng;
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(net->forward(x), ref));
  }
  EXPECT_TRUE(test::ManagedReadGuard::violations().empty());
  EXPECT_GE(offload->report()["run"]["acquires"].get<int64_t>(), 9);
  offload.reset();
  torch::NoGradGuard ng;
  EXPECT_TRUE(at::equal(net->forward(x), ref));
  EXPECT_FALSE(is_managed(net->c1->weight));
}

TEST(EmbeddingOffload, OutputsEqualUnmanaged) {
  torch::manual_seed(4);
  TokenNet net;
  at::Tensor ids = at::randint(0, 1000, {3, 11});
  at::Tensor ref;
  {
    torch::NoGradGuard ng;
    ref = net->forward(ids);
  }
  TempDir dir;
  auto offload = enable_offload(*net, test::sim_options(dir));
  EXPECT_TRUE(is_managed(net->emb->weight));
  EXPECT_TRUE(is_managed(net->head->weight));
  test::ManagedReadGuard::clear();
  {
    test::ManagedReadGuard guard;
    torch::NoGradGuard ng;
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(net->forward(ids), ref));
  }
  EXPECT_TRUE(test::ManagedReadGuard::violations().empty());
  offload->remove();
  torch::NoGradGuard ng;
  EXPECT_TRUE(at::equal(net->forward(ids), ref));
}

}  // namespace
}  // namespace ddo::adapter
