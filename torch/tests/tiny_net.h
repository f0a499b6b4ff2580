// A three-Linear model and its input: the tests that attach, remove and re-attach a model share
// it (weight_cache_test, loader_test).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace ddo::adapter::test {

struct TinyLinearNet {
  torch::nn::Sequential net{torch::nn::Linear(64, 64), torch::nn::Linear(64, 64),
                            torch::nn::Linear(64, 32)};
  at::Tensor input = at::randn({4, 64});
  // One forward pass without autograd; a copy, so later passes cannot alias it.
  at::Tensor run() {
    torch::NoGradGuard no_grad;
    return net->forward(input).clone();
  }
};

}  // namespace ddo::adapter::test
