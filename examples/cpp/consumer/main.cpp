// An out-of-tree user of the installed ddo package: builds a small torch::nn model, runs it once
// as it is, then again under ddo::adapter::enable_offload on the host-simulation device ("sim":
// a capacity-limited arena of host memory stands in for VRAM, so no GPU is needed) with every
// weight streamed, and checks that both outputs are equal and that remove() restores the model.
//
//   ddo_consumer          # prints the offload summary and "ddo_consumer: ok"; exit status 0
//
// The C++ a user writes is the three marked lines; the rest is the check.
#include <cstdio>
#include <exception>
#include <memory>

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include "ddo/torch/enable_offload.h"  // (1) the include

namespace {

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::GELU(),
                               torch::nn::Linear(256, 256), torch::nn::GELU(),
                               torch::nn::Linear(256, 32));
}

bool check(bool ok, const char* what) {
  std::printf("  %-48s %s\n", what, ok ? "yes" : "NO");
  return ok;
}

}  // namespace

int main() {
  try {
    torch::manual_seed(0);
    torch::NoGradGuard no_grad;
    torch::nn::Sequential model = make_model();
    const at::Tensor x = at::randn({4, 64});
    const at::Tensor expected = model->forward(x);

    ddo::adapter::OffloadOptions options;
    options.preset = "one_shot_fast";
    options.execution_device = "sim";
    // Nothing resident, every weight streamed: the smallest model still exercises the path a
    // large one takes. A real deployment leaves these to the preset and its profile.
    options.overrides = {{"small_tensor_threshold_bytes", 0},
                         {"auto_budget_policy", "off"},
                         {"always_resident_modules_pattern", nlohmann::json::array()},
                         {"sim_device_capacity_gb", 0.25}};
    // (2) attach offload; the returned handle restores the model when destroyed
    std::unique_ptr<ddo::adapter::Offload> offload = ddo::adapter::enable_offload(*model, options);
    const at::Tensor offloaded = model->forward(x);  // (3) the model's own forward, unchanged
    const nlohmann::json report = offload->report();
    std::printf("%s", offload->summary().c_str());
    offload.reset();
    const at::Tensor restored = model->forward(x);

    const nlohmann::json& run = report["run"];
    const long long streamed = run.value("bytes_streamed", 0LL);
    std::printf("ddo_consumer: on %s, %lld bytes streamed in %lld intercepted ops\n",
                report.value("execution_device", std::string("?")).c_str(), streamed,
                run.value("intercepted_ops", 0LL));
    bool ok = true;
    ok &= check(streamed > 0, "weights were streamed through ddo");
    ok &= check(at::equal(offloaded, expected), "offloaded output equals the plain forward");
    ok &= check(at::equal(restored, expected), "output after remove() equals it too");
    std::printf("ddo_consumer: %s\n", ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddo_consumer: %s\n", e.what());
    return 1;
  }
}
