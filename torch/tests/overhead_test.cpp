// Host time per intercepted op (docs/design/0009-benchmarks.md, Micro (b)): a stack of tiny Linears
// on the sim device, measured against the same stack unmanaged. Prints the figures only: timings on
// a shared CPU are measurements, not test results (the GPU figure comes from bench/op_overhead).
// What is asserted is the work done: every managed op is intercepted exactly once, and ops on
// unmanaged tensors never reach the scheduler.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

double seconds_per_forward(torch::nn::Sequential& net, const at::Tensor& x, int reps) {
  torch::NoGradGuard ng;
  for (int i = 0; i < 20; ++i) net->forward(x);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) net->forward(x);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

TEST(Overhead, HostTimePerInterceptedOp) {
  constexpr int kLayers = 64;
  torch::manual_seed(5);
  torch::nn::Sequential net;
  for (int i = 0; i < kLayers; ++i) net->push_back(torch::nn::Linear(16, 16));
  at::Tensor x = at::randn({1, 16});
  const double plain = seconds_per_forward(net, x, 200);

  // Unmanaged ops while an offload of another model is active: the price of the check.
  test::TempDir dir;
  torch::nn::Linear other(16, 16);
  auto guard_offload = enable_offload(*other, test::sim_options(dir));
  guard_offload->reset_run_stats();
  const double plain_active = seconds_per_forward(net, x, 200);
  {
    // The counter counts: one forward of the offloaded Linear is exactly one intercepted op and
    // one acquire, and the 64 x 220 unmanaged ops above added none.
    torch::NoGradGuard ng;
    other->forward(at::randn({1, 16}));
  }
  const nlohmann::json guard_run = guard_offload->report()["run"];
  EXPECT_EQ(guard_run["intercepted_ops"].get<std::int64_t>(), 1);
  EXPECT_EQ(guard_run["acquires"].get<std::int64_t>(), 1);
  guard_offload.reset();

  auto offload = enable_offload(*net, test::sim_options(dir, {{"pin_cpu_memory", false}}));
  offload->reset_run_stats();
  const double managed = seconds_per_forward(net, x, 200);
  const nlohmann::json run = offload->report()["run"];
  EXPECT_EQ(run["intercepted_ops"].get<std::int64_t>(), std::int64_t{kLayers} * (20 + 200));
  EXPECT_EQ(run["acquires"].get<std::int64_t>(), std::int64_t{kLayers} * (20 + 200));
  const double per_op_us = (managed - plain) / kLayers * 1e6;
  const double check_us = (plain_active - plain) / kLayers * 1e6;
  std::printf(
      "[ overhead ] plain %.2f us/op, unmanaged-with-offload-active +%.3f us/op, "
      "managed (acquire + view + release, sim engine) +%.2f us/op\n",
      plain / kLayers * 1e6, check_us, per_op_us);
  std::printf("%s", offload->summary().c_str());
}

}  // namespace
}  // namespace ddo::adapter
