// OffloadOptions::preset: a preset the code did not choose comes from DDO_PRESET, as the
// regular settings loader does (docs/design/0006-configuration.md, section 2); one the code chose
// wins over the environment.
#include <gtest/gtest.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/torch/enable_offload.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

OffloadOptions plan_options(const TempDir& dir, const char* env_preset) {
  OffloadOptions o;
  o.execution_device = "sim";
  o.env = test::test_env(dir);
  if (env_preset != nullptr) (*o.env)["DDO_PRESET"] = env_preset;
  return o;
}

TEST(OffloadOptionsPreset, UnsetTakesDdoPresetElseAuto) {
  torch::nn::Sequential net{torch::nn::Linear(64, 64)};
  TempDir dir;
  {
    auto offload = enable_offload(*net, plan_options(dir, "low_ram_safe"));
    EXPECT_EQ(offload->settings().effective_preset, "low_ram_safe");
    EXPECT_EQ(offload->settings().config.resident_module_budget_gb, 3.0);
  }
  {
    auto offload = enable_offload(*net, plan_options(dir, nullptr));
    EXPECT_EQ(offload->settings().effective_preset, "one_shot_fast");
  }
}

TEST(OffloadOptionsPreset, ThePresetTheCodeChoseWinsOverTheEnvironment) {
  torch::nn::Sequential net{torch::nn::Linear(64, 64)};
  TempDir dir;
  OffloadOptions o = plan_options(dir, "low_ram_safe");
  o.preset = "wsl_compat";
  auto offload = enable_offload(*net, o);
  EXPECT_EQ(offload->settings().effective_preset, "wsl_compat");
}

}  // namespace
}  // namespace ddo::adapter
