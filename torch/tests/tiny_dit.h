// The tiny FluxDiT with its inputs and its resident output: what the profile and pipeline tests
// attach, run and compare against.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "ddo/torch/testing/flux_dit.h"

namespace ddo::adapter::test {

struct TinyDit {
  testing::FluxDiTOptions opts = testing::FluxDiTOptions::preset("tiny");
  testing::FluxDiT model{opts};
  testing::FluxDiTInputs in = testing::make_inputs(opts, c10::kCPU);
  at::Tensor ref;  // the output before any offload
  TinyDit() { ref = run(); }
  at::Tensor run() {
    torch::NoGradGuard no_grad;
    return model->forward(in.img, in.txt, in.timestep);
  }
};

}  // namespace ddo::adapter::test
