#include "ddo/core/presets.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace ddo::core {
namespace {

DynamicOffloadConfig preset_config(std::string_view name, PresetInfo* info = nullptr) {
  DynamicOffloadConfig config;
  const Status s = apply_preset(name, &config, info);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(validate_config(config).ok()) << name;
  return config;
}

const std::vector<std::string> kAuto = {"auto"};
constexpr std::int64_t kOneMiB = 1024 * 1024;

TEST(Presets, NamesInSpecOrder) {
  EXPECT_EQ(preset_names(),
            (std::vector<std::string>{"auto", "one_shot_fast", "low_ram_safe", "wsl_compat",
                                      "warm_process", "diffusers_offload_compat",
                                      "diffusers_leaf_offload_compat", "off"}));
}

TEST(Presets, OneShotFast) {
  PresetInfo info;
  const DynamicOffloadConfig c = preset_config("one_shot_fast", &info);
  EXPECT_EQ(info.name, "one_shot_fast");
  EXPECT_TRUE(info.enabled);
  EXPECT_FALSE(info.description.empty());
  EXPECT_EQ(c.execution_mode, ExecutionMode::kLinearRuntime);
  EXPECT_EQ(c.route, Route::kDynamic);
  EXPECT_TRUE(c.pin_cpu_memory);
  EXPECT_EQ(c.pin_cpu_workers, 4);
  EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kBalanced);
  EXPECT_EQ(c.resident_module_budget_gb, 0.0);
  EXPECT_EQ(c.max_resident_module_budget_gb, 0.0);
  EXPECT_EQ(c.resident_module_patterns, std::vector<std::string>{"auto_all"});
  EXPECT_EQ(c.resident_module_selection, Selection::kSpread);
  EXPECT_EQ(c.system_ram_headroom_gb, 8.0);
  EXPECT_EQ(c.small_tensor_threshold_bytes, kOneMiB);
  EXPECT_TRUE(c.use_side_streams);
}

TEST(Presets, LowRamSafe) {
  const DynamicOffloadConfig c = preset_config("low_ram_safe");
  EXPECT_EQ(c.execution_mode, ExecutionMode::kLinearRuntime);
  EXPECT_FALSE(c.pin_cpu_memory);
  EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kOff);
  EXPECT_EQ(c.resident_module_budget_gb, 3.0);
  EXPECT_EQ(c.resident_module_patterns, kAuto);
  EXPECT_EQ(c.resident_module_selection, Selection::kSpread);
  EXPECT_EQ(c.small_tensor_threshold_bytes, kOneMiB);
}

TEST(Presets, WslCompat) {
  const DynamicOffloadConfig c = preset_config("wsl_compat");
  EXPECT_EQ(c.execution_mode, ExecutionMode::kLinearRuntime);
  EXPECT_FALSE(c.pin_cpu_memory);
  EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kOff);
  EXPECT_EQ(c.resident_module_budget_gb, 6.0);
  EXPECT_EQ(c.resident_module_patterns, kAuto);
  EXPECT_EQ(c.resident_module_selection, Selection::kSpread);
  EXPECT_FALSE(c.use_side_streams);
}

TEST(Presets, WarmProcess) {
  const DynamicOffloadConfig c = preset_config("warm_process");
  EXPECT_EQ(c.execution_mode, ExecutionMode::kLinearRuntime);
  EXPECT_TRUE(c.pin_cpu_memory);
  EXPECT_EQ(c.pin_cpu_workers, 4);
  EXPECT_TRUE(c.cache_pinned_weights);
  EXPECT_TRUE(c.cache_plan);
  EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kOff);
  EXPECT_EQ(c.resident_module_budget_gb, 6.0);
  EXPECT_EQ(c.resident_module_patterns, kAuto);
  EXPECT_EQ(c.resident_module_selection, Selection::kSpread);
}

TEST(Presets, DiffusersCompatRoutes) {
  for (auto [name, route] : {std::pair{"diffusers_offload_compat", Route::kGroupBlock},
                             std::pair{"diffusers_leaf_offload_compat", Route::kGroupLeaf}}) {
    PresetInfo info;
    const DynamicOffloadConfig c = preset_config(name, &info);
    EXPECT_TRUE(info.enabled) << name;
    EXPECT_EQ(c.route, route) << name;
    EXPECT_TRUE(c.pin_cpu_memory) << name;
    EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kOff) << name;
    EXPECT_EQ(c.resident_module_budget_gb, 0.0) << name;
    EXPECT_TRUE(c.resident_module_patterns.empty()) << name;
    EXPECT_NE(c.execution_mode, ExecutionMode::kPlan) << name;
  }
}

TEST(Presets, OffIsPlanModeDisabled) {
  PresetInfo info;
  const DynamicOffloadConfig c = preset_config("off", &info);
  EXPECT_FALSE(info.enabled);
  EXPECT_EQ(c.execution_mode, ExecutionMode::kPlan);
}

TEST(Presets, AutoResolvesToOneShotFast) {
  PresetInfo info;
  const DynamicOffloadConfig c = preset_config("auto", &info);
  EXPECT_EQ(info.requested, "auto");
  EXPECT_EQ(info.name, "one_shot_fast");
  EXPECT_EQ(info.name, kAutoPresetTarget);
  EXPECT_EQ(config_to_json(c), config_to_json(preset_config("one_shot_fast")));
}

TEST(Presets, NamesAreCaseInsensitive) {
  PresetInfo info;
  preset_config(" Low_RAM_Safe ", &info);
  EXPECT_EQ(info.name, "low_ram_safe");
  EXPECT_EQ(info.requested, " Low_RAM_Safe ");
}

TEST(Presets, UnknownNameListsValidOnesAndLeavesConfig) {
  DynamicOffloadConfig c;
  PresetInfo info;
  info.name = "untouched";
  const Status s = apply_preset("fastest", &c, &info);
  ASSERT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("unknown preset \"fastest\""), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("auto, one_shot_fast, low_ram_safe, wsl_compat, warm_process, "
                             "diffusers_offload_compat, diffusers_leaf_offload_compat, off"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(info.name, "untouched");
  EXPECT_EQ(config_to_json(c), config_to_json(DynamicOffloadConfig{}));
}

TEST(Presets, OverlayKeepsFieldsThePresetDoesNotSet) {
  DynamicOffloadConfig c;
  c.profile_name = "video-5s";
  c.verbose = true;
  ASSERT_TRUE(apply_preset("low_ram_safe", &c, nullptr).ok());
  EXPECT_EQ(c.profile_name, "video-5s");
  EXPECT_TRUE(c.verbose);
}

TEST(Presets, ResolveWithoutConfig) {
  PresetInfo info;
  ASSERT_TRUE(resolve_preset("off", &info).ok());
  EXPECT_FALSE(info.enabled);
  EXPECT_TRUE(resolve_preset("warm_process", nullptr).ok());
  EXPECT_FALSE(resolve_preset("", nullptr).ok());
}

}  // namespace
}  // namespace ddo::core
