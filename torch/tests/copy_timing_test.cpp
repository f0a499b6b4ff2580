// The adapter's copy timing policy (Note [Copy timing] in engine/src/copy_scheduler.cpp): the
// steady state times a sample of the copies, mark_step() and calibration time every one, and the
// report scales the sampled sums to totals.
#include <gtest/gtest.h>

#include <ATen/ops/randn.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/torch/enable_offload.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

constexpr int kLayers = 32;
constexpr std::int64_t kWeightBytes = 256 * 256 * sizeof(float);  // one streamed unit

void forward(torch::nn::Sequential& net, const at::Tensor& x, int steps) {
  torch::NoGradGuard no_grad;
  for (int i = 0; i < steps; ++i) net->forward(x);
}

TEST(CopyTiming, SteadyStateSamplesAndMarkStepTimesEveryCopy) {
  torch::manual_seed(3);
  torch::nn::Sequential net;
  // 256 KiB per layer against a 1 MiB window and 2 MiB of staging: every step copies again.
  for (int i = 0; i < kLayers; ++i) net->push_back(torch::nn::Linear(256, 256));
  const at::Tensor x = at::randn({2, 256});
  test::TempDir dir;
  auto offload = enable_offload(
      *net, test::sim_options(
                dir, {{"pin_cpu_memory", false}, {"prefetch_window_mb", 1}, {"staging_mb", 2}}));
  forward(net, x, 3);  // learns the trace
  offload->reset_run_stats();
  forward(net, x, 8);
  nlohmann::json run = offload->report()["run"];
  EXPECT_EQ(run["timing"], "sampled");
  const auto acquires = run["acquires"].get<std::int64_t>();
  ASSERT_EQ(acquires, std::int64_t{kLayers} * 8);
  ASSERT_GE(run["bytes_streamed"].get<std::int64_t>(), std::int64_t{kLayers} * 8 * kWeightBytes);
  const auto timed = run["timed_copies"].get<std::int64_t>();
  EXPECT_GT(timed, 0);
  EXPECT_LE(timed, acquires / 16 + 1);
  EXPECT_GT(run["achieved_gbps"].get<double>(), 0.0);

  offload->mark_step();
  offload->reset_run_stats();
  forward(net, x, 2);
  run = offload->report()["run"];
  EXPECT_EQ(run["timing"], "full");
  // Every copy issued since is timed; a sample still running when its unit is copied again is
  // dropped (the simulated link is throttled), so nearly all are counted, never more.
  const auto streamed = run["bytes_streamed"].get<std::int64_t>();
  const auto timed_bytes = run["timed_copies"].get<std::int64_t>() * kWeightBytes;
  EXPECT_GT(streamed, 0);
  EXPECT_LE(timed_bytes, streamed);
  EXPECT_GE(timed_bytes * 10, streamed * 9);
}

}  // namespace
}  // namespace ddo::adapter
