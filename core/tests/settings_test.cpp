#include "ddo/core/settings.h"

#include <cstdlib>

#include <gtest/gtest.h>

#include "ddo/core/presets.h"

namespace ddo::core {
namespace {

using nlohmann::json;

// Tests pin the platform fact so the build machine's /proc/version does not matter.
SettingsRequest request(std::optional<std::string> preset = std::nullopt) {
  SettingsRequest r;
  r.preset = std::move(preset);
  r.wsl = false;
  return r;
}

DynamicOffloadSettings load(const EnvMap& env, SettingsRequest r = request()) {
  return DynamicOffloadSettings::from_env(r, env);
}

Status load_error(const EnvMap& env, SettingsRequest r = request()) {
  DynamicOffloadSettings out;
  return DynamicOffloadSettings::resolve(r, env, &out);
}

void expect_env_error(const EnvMap& env, const std::string& fragment) {
  const Status s = load_error(env);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << fragment;
  EXPECT_NE(s.message().find(fragment), std::string::npos)
      << "message: " << s.message() << "\nexpected: " << fragment;
}

TEST(Settings, EmptyEnvIsAutoPreset) {
  const DynamicOffloadSettings s = load({});
  EXPECT_EQ(s.requested_preset, "auto");
  EXPECT_EQ(s.effective_preset, "one_shot_fast");
  EXPECT_TRUE(s.enabled);
  DynamicOffloadConfig expected;
  ASSERT_TRUE(apply_preset("one_shot_fast", &expected, nullptr).ok());
  EXPECT_EQ(config_to_json(s.config), config_to_json(expected));
  EXPECT_TRUE(s.pin_requested);
  EXPECT_TRUE(s.pin_effective);
  EXPECT_TRUE(s.side_streams_effective);
  EXPECT_FALSE(s.wsl);
}

TEST(Settings, PresetFromEnvAndFromRequest) {
  EXPECT_EQ(load({{"DDO_PRESET", "low_ram_safe"}}).effective_preset, "low_ram_safe");
  EXPECT_EQ(load({{"DDO_PRESET", "  "}}).effective_preset, "one_shot_fast");
  // The request names the preset: DDO_PRESET is below it.
  const DynamicOffloadSettings s = load({{"DDO_PRESET", "low_ram_safe"}}, request("warm_process"));
  EXPECT_EQ(s.requested_preset, "warm_process");
  EXPECT_TRUE(s.config.cache_pinned_weights);
}

TEST(Settings, UnknownPresetErrorsListValidNames) {
  Status s = load_error({{"DDO_PRESET", "turbo"}});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("DDO_PRESET"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("one_shot_fast"), std::string::npos) << s.message();
  s = load_error({}, request("turbo"));
  EXPECT_NE(s.message().find("unknown preset \"turbo\""), std::string::npos) << s.message();
  EXPECT_THROW(load({}, request("turbo")), Error);
}

TEST(Settings, OffPresetDisablesAndDdoPlanReenablesInPlanMode) {
  DynamicOffloadSettings s = load({}, request("off"));
  EXPECT_FALSE(s.enabled);
  EXPECT_EQ(s.config.execution_mode, ExecutionMode::kPlan);
  s = load({{"DDO_PLAN", "1"}}, request("off"));
  EXPECT_TRUE(s.enabled);
  EXPECT_EQ(s.config.execution_mode, ExecutionMode::kPlan);
  s = load({{"DDO_PLAN", "yes"}});
  EXPECT_EQ(s.config.execution_mode, ExecutionMode::kPlan);
  s = load({{"DDO_PLAN", "0"}});
  EXPECT_EQ(s.config.execution_mode, ExecutionMode::kLinearRuntime);
}

TEST(Settings, BoolSpellings) {
  for (const char* yes : {"1", "true", "TRUE", "Yes", "on", " ON "}) {
    EXPECT_TRUE(parse_env_bool(yes)) << yes;
    EXPECT_TRUE(load({{"DDO_VERBOSE", yes}}).config.verbose) << yes;
  }
  for (const char* no : {"0", "false", "no", "off", "", "2", "enabled", "y"}) {
    EXPECT_FALSE(parse_env_bool(no)) << no;
    EXPECT_FALSE(load({{"DDO_SHOW_PROFILE", no}}).config.show_profile) << no;
  }
}

TEST(Settings, EveryBoolVariable) {
  const DynamicOffloadSettings on = load({{"DDO_PIN_CPU_MEMORY", "1"},
                                          {"DDO_ALLOW_PIN_MEMORY_FALLBACK", "1"},
                                          {"DDO_CACHE_PLAN", "1"},
                                          {"DDO_CACHE_PINNED_WEIGHTS", "1"},
                                          {"DDO_VERBOSE", "1"},
                                          {"DDO_SHOW_PROFILE", "1"},
                                          {"DDO_DISABLE_PIN_ON_WSL", "1"}},
                                         request("low_ram_safe"));
  EXPECT_TRUE(on.config.pin_cpu_memory);
  EXPECT_TRUE(on.config.allow_pin_memory_fallback);
  EXPECT_TRUE(on.config.cache_plan);
  EXPECT_TRUE(on.config.cache_pinned_weights);
  EXPECT_TRUE(on.config.verbose);
  EXPECT_TRUE(on.config.show_profile);
  EXPECT_TRUE(on.config.disable_pin_on_wsl);
  const DynamicOffloadSettings off = load({{"DDO_PIN_CPU_MEMORY", "0"},
                                           {"DDO_ALLOW_PIN_MEMORY_FALLBACK", "0"},
                                           {"DDO_CACHE_PLAN", "0"},
                                           {"DDO_CACHE_PINNED_WEIGHTS", "0"},
                                           {"DDO_VERBOSE", "0"},
                                           {"DDO_SHOW_PROFILE", "0"},
                                           {"DDO_DISABLE_PIN_ON_WSL", "0"}});
  EXPECT_FALSE(off.config.pin_cpu_memory);
  EXPECT_FALSE(off.pin_effective);
  EXPECT_FALSE(off.config.allow_pin_memory_fallback);
  EXPECT_FALSE(off.config.cache_plan);
  EXPECT_FALSE(off.config.cache_pinned_weights);
  EXPECT_FALSE(off.config.verbose);
  EXPECT_FALSE(off.config.show_profile);
  EXPECT_FALSE(off.config.disable_pin_on_wsl);
}

TEST(Settings, EveryNumberVariable) {
  const DynamicOffloadSettings s = load({
      {"DDO_SMALL_TENSOR_THRESHOLD_KB", "64"},
      {"DDO_PIN_CPU_WORKERS", "8"},
      {"DDO_MAX_RESIDENT_MODULE_BUDGET_GB", "10"},
      {"DDO_AUTO_VRAM_HEADROOM_GB", "2.5"},
      {"DDO_PROFILE_VRAM_HEADROOM_GB", "0.75"},
      {"DDO_MAX_PIN_WEIGHT_BUDGET_GB", "20"},
      {"DDO_AVAILABLE_SYSTEM_RAM_GB", "16"},
      {"DDO_SYSTEM_RAM_HEADROOM_GB", "4"},
      {"DDO_PIN_WEIGHT_BUDGET_GB", "12"},
      {"DDO_PIN_WEIGHT_BUDGET_RATIO", "0.5"},
      {"DDO_RESIDENT_MODULE_BUDGET_GB", " 5.5 "},
      {"DDO_STAGING_MB", "256"},
      {"DDO_PREFETCH_WINDOW_MB", "512"},
      {"DDO_VRAM_CAP_GB", "8"},
      {"DDO_SIM_DEVICE_GB", "4"},
      {"DDO_SIM_COPY_GBPS", "12.5"},
      {"DDO_SIM_PINNABLE_GB", "-1"},
  });
  const DynamicOffloadConfig& c = s.config;
  EXPECT_EQ(c.small_tensor_threshold_bytes, 64 * 1024);
  EXPECT_EQ(c.pin_cpu_workers, 8);
  EXPECT_EQ(c.max_resident_module_budget_gb, 10.0);
  EXPECT_EQ(c.auto_vram_headroom_gb, 2.5);
  EXPECT_EQ(c.profile_vram_headroom_gb, 0.75);
  EXPECT_EQ(c.max_pin_weight_budget_gb, 20.0);
  EXPECT_EQ(c.available_system_ram_gb, 16.0);
  EXPECT_EQ(c.system_ram_headroom_gb, 4.0);
  EXPECT_EQ(c.pin_weight_budget_gb, 12.0);
  EXPECT_EQ(c.pin_weight_budget_ratio, 0.5);
  EXPECT_EQ(c.resident_module_budget_gb, 5.5);
  EXPECT_EQ(c.staging_mb, 256.0);
  EXPECT_EQ(c.prefetch_window_mb, 512.0);
  EXPECT_EQ(c.vram_cap_gb, 8.0);
  EXPECT_EQ(c.sim_device_capacity_gb, 4.0);
  EXPECT_EQ(c.sim_copy_gbps, 12.5);
  EXPECT_EQ(c.sim_pinnable_gb, -1.0);
  EXPECT_EQ(s.available_ram_bytes(), static_cast<std::int64_t>(16 * kGiB));
}

TEST(Settings, MalformedNumbersNameTheVariable) {
  expect_env_error({{"DDO_RESIDENT_MODULE_BUDGET_GB", "6GB"}},
                   "DDO_RESIDENT_MODULE_BUDGET_GB=\"6GB\" is not a number");
  expect_env_error({{"DDO_RESIDENT_MODULE_BUDGET_GB", ""}},
                   "DDO_RESIDENT_MODULE_BUDGET_GB=\"\" is not a number");
  expect_env_error({{"DDO_PROFILE_VRAM_HEADROOM_GB", "nan"}},
                   "DDO_PROFILE_VRAM_HEADROOM_GB=\"nan\" is not a finite number");
  expect_env_error({{"DDO_PROFILE_VRAM_HEADROOM_GB", "inf"}},
                   "DDO_PROFILE_VRAM_HEADROOM_GB=\"inf\" is not a finite number");
  expect_env_error({{"DDO_PROFILE_VRAM_HEADROOM_GB", "-1"}},
                   "DDO_PROFILE_VRAM_HEADROOM_GB=\"-1\" is negative");
  expect_env_error({{"DDO_SMALL_TENSOR_THRESHOLD_KB", "16k"}}, "DDO_SMALL_TENSOR_THRESHOLD_KB");
  expect_env_error({{"DDO_AVAILABLE_SYSTEM_RAM_GB", "a lot"}}, "DDO_AVAILABLE_SYSTEM_RAM_GB");
  expect_env_error({{"DDO_SIM_COPY_GBPS", "1e999"}}, "DDO_SIM_COPY_GBPS");
  expect_env_error({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "half"}}, "DDO_PIN_WEIGHT_BUDGET_RATIO");
  expect_env_error({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "nan"}}, "DDO_PIN_WEIGHT_BUDGET_RATIO");
  for (const char* workers : {"0", "-2", "2.5", "four", ""}) {
    expect_env_error({{"DDO_PIN_CPU_WORKERS", workers}}, "DDO_PIN_CPU_WORKERS");
  }
  // The message says what to write.
  expect_env_error({{"DDO_RESIDENT_MODULE_BUDGET_GB", "6GB"}}, "6 or 5.5");
}

TEST(Settings, RatioIsClamped) {
  EXPECT_EQ(load({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "1.5"}}).config.pin_weight_budget_ratio, 1.0);
  EXPECT_EQ(load({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "-3"}}).config.pin_weight_budget_ratio, 0.0);
  EXPECT_EQ(load({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "0.25"}}).config.pin_weight_budget_ratio, 0.25);
}

// Every number from the environment has a range, and an error names the variable, the text and
// the range: bytes typed as GiB are an error, never -2^63 bytes through an undefined cast.
TEST(Settings, NumbersOutOfRangeNameTheVariableAndTheRange) {
  expect_env_error({{"DDO_VRAM_CAP_GB", "16000000000"}},
                   "DDO_VRAM_CAP_GB=\"16000000000\" is out of range; use GiB in [0, 65536]");
  for (const char* name : {"DDO_MAX_RESIDENT_MODULE_BUDGET_GB", "DDO_AUTO_VRAM_HEADROOM_GB",
                           "DDO_PROFILE_VRAM_HEADROOM_GB", "DDO_MAX_PIN_WEIGHT_BUDGET_GB",
                           "DDO_AVAILABLE_SYSTEM_RAM_GB", "DDO_SYSTEM_RAM_HEADROOM_GB",
                           "DDO_PIN_WEIGHT_BUDGET_GB", "DDO_RESIDENT_MODULE_BUDGET_GB",
                           "DDO_VRAM_CAP_GB", "DDO_SIM_DEVICE_GB", "DDO_SIM_PINNABLE_GB"}) {
    expect_env_error({{name, "1e12"}}, std::string(name) + "=\"1e12\" is out of range");
    expect_env_error({{name, "1e308"}},
                     std::string(name) + "=\"1e308\" is out of range; use GiB in [");
  }
  // An absurd amount of RAM would silently admit every pin.
  expect_env_error({{"DDO_AVAILABLE_SYSTEM_RAM_GB", "1e9"}}, "DDO_AVAILABLE_SYSTEM_RAM_GB");
  expect_env_error({{"DDO_STAGING_MB", "1e15"}}, "use MiB in [0, 67108864]");
  expect_env_error({{"DDO_PREFETCH_WINDOW_MB", "-1"}}, "DDO_PREFETCH_WINDOW_MB=\"-1\" is negative");
  expect_env_error({{"DDO_SMALL_TENSOR_THRESHOLD_KB", "1e30"}},
                   "DDO_SMALL_TENSOR_THRESHOLD_KB=\"1e30\" is out of range; use KiB in [0, ");
  expect_env_error(
      {{"DDO_PIN_CPU_WORKERS", "100000"}},
      "DDO_PIN_CPU_WORKERS=\"100000\" is out of range; use a thread count in [1, 1024]");
  EXPECT_EQ(load({{"DDO_SIM_PINNABLE_GB", "-0.5"}}).config.sim_pinnable_gb, -0.5);
  EXPECT_EQ(load({{"DDO_SMALL_TENSOR_THRESHOLD_KB", "0.5"}}).config.small_tensor_threshold_bytes,
            512);
}

// A simulated copy rate has a floor (1e-9 GB/s would hang the first copy); 0 means unthrottled.
TEST(Settings, SimulatedCopyRateHasAFloor) {
  expect_env_error({{"DDO_SIM_COPY_GBPS", "1e-9"}},
                   "DDO_SIM_COPY_GBPS=\"1e-9\" is out of range; use GB/s in [0.1, 10000] or 0 "
                   "(off)");
  expect_env_error({{"DDO_SIM_COPY_GBPS", "-1"}}, "DDO_SIM_COPY_GBPS");
  EXPECT_EQ(load({{"DDO_SIM_COPY_GBPS", "0"}}).config.sim_copy_gbps, 0.0);
  EXPECT_EQ(load({{"DDO_SIM_COPY_GBPS", "0.1"}}).config.sim_copy_gbps, 0.1);
}

TEST(Settings, ClampedRatioIsAWarningNamingTheSource) {
  DynamicOffloadSettings s = load({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "-3"}});
  EXPECT_EQ(s.config.pin_weight_budget_ratio, 0.0);  // clamped (docs/design/0006-configuration.md)
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_EQ(s.warnings[0], "DDO_PIN_WEIGHT_BUDGET_RATIO=\"-3\" is outside [0, 1]; clamped to 0");
  EXPECT_EQ(s.to_json().at("warnings"), json::array({s.warnings[0]}));
  EXPECT_TRUE(load({{"DDO_PIN_WEIGHT_BUDGET_RATIO", "0.25"}}).warnings.empty());

  SettingsRequest r = request();
  r.overrides = {{"pin_weight_budget_ratio", 1.7}};
  s = load({}, r);
  EXPECT_EQ(s.config.pin_weight_budget_ratio, 1.0);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find("override pin_weight_budget_ratio=1.7"), std::string::npos)
      << s.warnings[0];

  r = request();
  r.config = DynamicOffloadConfig{};
  r.config->pin_weight_budget_ratio = 3.0;
  s = load({}, r);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find("config field pin_weight_budget_ratio=3"), std::string::npos)
      << s.warnings[0];
}

TEST(Settings, UnknownBooleanTextIsFalseWithAWarning) {
  DynamicOffloadSettings s = load({{"DDO_VERBOSE", "maybe"}, {"DDO_PIN_CPU_MEMORY", "yes"}});
  EXPECT_FALSE(s.config.verbose);  // anything else is false (docs/design/0006-configuration.md)
  EXPECT_TRUE(s.config.pin_cpu_memory);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find("DDO_VERBOSE=\"maybe\" is not a boolean"), std::string::npos)
      << s.warnings[0];
  EXPECT_NE(s.warnings[0].find("read as false"), std::string::npos) << s.warnings[0];
  for (const char* quiet : {"0", "false", "No", " off ", "", "1", "TRUE", "on"}) {
    EXPECT_TRUE(load({{"DDO_VERBOSE", quiet}}).warnings.empty()) << quiet;
  }
  s = load({{"DDO_PLAN", "please"}});
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find("DDO_PLAN=\"please\""), std::string::npos) << s.warnings[0];
  EXPECT_TRUE(load({}).to_json().at("warnings").empty());
}

TEST(Settings, OverridesOutOfRangeNameTheKey) {
  SettingsRequest r = request();
  r.overrides = {{"vram_cap_gb", 16e9}};
  Status s = load_error({}, r);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("override vram_cap_gb=1.6e+10 is out of range; use GiB in [0, 65536]"),
            std::string::npos)
      << s.message();
}

TEST(Settings, AvailableRamOfAHandMadeConfigIsChecked) {
  DynamicOffloadSettings s;
  s.config.available_system_ram_gb = 1e300;  // skipped validation
  try {
    (void)s.available_ram_bytes();
    FAIL() << "expected ddo::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("available_system_ram_gb"), std::string::npos);
  }
}

TEST(Settings, EnumVariables) {
  const DynamicOffloadSettings s = load({{"DDO_EXECUTION_MODE", "sdnq_runtime"},
                                         {"DDO_AUTO_BUDGET_POLICY", "off"},
                                         {"DDO_PIN_WEIGHT_SELECTION", "largest"},
                                         {"DDO_RESIDENT_MODULE_SELECTION", "FIRST"}});
  EXPECT_EQ(s.config.execution_mode, ExecutionMode::kPackedRuntime);
  EXPECT_EQ(s.config.auto_budget_policy, AutoBudgetPolicy::kOff);
  EXPECT_EQ(s.config.pin_weight_selection, Selection::kLargest);
  EXPECT_EQ(s.config.resident_module_selection, Selection::kFirst);
  expect_env_error({{"DDO_EXECUTION_MODE", "fast"}}, "DDO_EXECUTION_MODE=\"fast\"");
  expect_env_error({{"DDO_AUTO_BUDGET_POLICY", "greedy"}}, "off, balanced");
  expect_env_error({{"DDO_RESIDENT_MODULE_SELECTION", "random"}}, "first, spread, largest");
}

TEST(Settings, StringVariablesAndBackendAlias) {
  DynamicOffloadSettings s = load(
      {{"DDO_PINNED_WEIGHT_CACHE_NAMESPACE", "flux-dev"}, {"DDO_SAFETENSORS_BACKEND", "pread"}});
  EXPECT_EQ(s.config.pinned_weight_cache_namespace, "flux-dev");
  EXPECT_EQ(s.config.load_safetensors_backend, "pread");
  s = load({{"DDO_LOAD_SAFETENSORS_BACKEND", "MMAP"}, {"DDO_SAFETENSORS_BACKEND", "pread"}});
  EXPECT_EQ(s.config.load_safetensors_backend, "mmap");  // the documented name wins
  s = load({{"DDO_LOAD_SAFETENSORS_BACKEND", ""}});
  EXPECT_EQ(s.config.load_safetensors_backend, "");
  expect_env_error({{"DDO_LOAD_SAFETENSORS_BACKEND", "uring"}},
                   "DDO_LOAD_SAFETENSORS_BACKEND=\"uring\"");
  expect_env_error({{"DDO_SAFETENSORS_BACKEND", "x"}}, "DDO_SAFETENSORS_BACKEND=\"x\"");
}

TEST(Settings, PatternListsSplitOnCommaAndSemicolon) {
  EXPECT_EQ(split_pattern_list("a, b;c ;; ,d"), (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_TRUE(split_pattern_list("").empty());
  const DynamicOffloadSettings s =
      load({{"DDO_ALWAYS_RESIDENT_MODULE_PATTERNS", R"(proj_in;norm_out, ^x_embedder$)"},
            {"DDO_RESIDENT_MODULE_PATTERNS", R"(auto;single_blocks\.\d+)"}});
  EXPECT_EQ(s.config.always_resident_modules_pattern,
            (std::vector<std::string>{"proj_in", "norm_out", "^x_embedder$"}));
  EXPECT_EQ(s.config.resident_module_patterns,
            (std::vector<std::string>{"auto", R"(single_blocks\.\d+)"}));
  // An empty value clears the list (no always-resident modules).
  EXPECT_TRUE(load({{"DDO_ALWAYS_RESIDENT_MODULE_PATTERNS", ""}})
                  .config.always_resident_modules_pattern.empty());
  // A broken regex is caught at load time, naming the field.
  expect_env_error({{"DDO_RESIDENT_MODULE_PATTERNS", "blocks.("}}, "resident_module_patterns[0]");
}

TEST(Settings, OverrideOrderPresetEnvConfigOverrides) {
  // preset < env
  EXPECT_EQ(load({}, request("low_ram_safe")).config.resident_module_budget_gb, 3.0);
  EXPECT_EQ(load({{"DDO_RESIDENT_MODULE_BUDGET_GB", "4"}}, request("low_ram_safe"))
                .config.resident_module_budget_gb,
            4.0);

  // env < explicit config: the config replaces defaults, preset and env wholesale.
  DynamicOffloadConfig explicit_config;
  explicit_config.resident_module_budget_gb = 2.0;
  SettingsRequest r = request("low_ram_safe");
  r.config = explicit_config;
  DynamicOffloadSettings s =
      load({{"DDO_RESIDENT_MODULE_BUDGET_GB", "4"}, {"DDO_VERBOSE", "1"}, {"DDO_PLAN", "1"}}, r);
  EXPECT_EQ(s.config.resident_module_budget_gb, 2.0);
  EXPECT_FALSE(s.config.verbose);
  EXPECT_EQ(s.config.small_tensor_threshold_bytes, 16 * 1024);  // not the preset's 1 MiB
  EXPECT_EQ(s.effective_preset, "low_ram_safe");
  EXPECT_TRUE(s.enabled);

  // explicit config < keyword overrides
  r.overrides = {{"resident_module_budget_gb", 1.5}};
  s = load({{"DDO_RESIDENT_MODULE_BUDGET_GB", "4"}}, r);
  EXPECT_EQ(s.config.resident_module_budget_gb, 1.5);

  // env < keyword overrides, without a config
  SettingsRequest r2 = request();
  r2.overrides = {{"resident_module_budget_gb", 7}, {"verbose", true}};
  s = load({{"DDO_RESIDENT_MODULE_BUDGET_GB", "4"}}, r2);
  EXPECT_EQ(s.config.resident_module_budget_gb, 7.0);
  EXPECT_TRUE(s.config.verbose);
}

TEST(Settings, ExplicitConfigWithoutPresetIsCustom) {
  SettingsRequest r = request();
  r.config = DynamicOffloadConfig{};
  r.config->pin_weight_budget_ratio = 3.0;  // clamped like the env variable
  const DynamicOffloadSettings s = load({{"DDO_PRESET", "off"}}, r);
  EXPECT_EQ(s.effective_preset, "custom");
  EXPECT_TRUE(s.enabled);  // DDO_PRESET is part of the replaced env layer
  EXPECT_EQ(s.config.execution_mode, ExecutionMode::kPlan);
  EXPECT_EQ(s.config.pin_weight_budget_ratio, 1.0);

  r.preset = "off";
  EXPECT_FALSE(load({}, r).enabled);

  r.preset.reset();
  r.config->profile_vram_headroom_gb = -1;
  const Status err = load_error({}, r);
  EXPECT_NE(err.message().find("profile_vram_headroom_gb=-1"), std::string::npos);
}

TEST(Settings, UnknownOverrideNamesAllListed) {
  SettingsRequest r = request();
  r.overrides = {{"resident_budget", 3}, {"pin", true}, {"verbose", true}};
  const Status s = load_error({}, r);
  ASSERT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("\"resident_budget\""), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("\"pin\""), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("valid fields:"), std::string::npos) << s.message();
}

TEST(Settings, WslDisablesPinningAndSideStreams) {
  SettingsRequest r = request();
  r.wsl.reset();  // detect from env
  DynamicOffloadSettings s = load({{"WSL_DISTRO_NAME", "Ubuntu"}}, r);
  EXPECT_TRUE(s.wsl);
  EXPECT_TRUE(s.pin_requested);
  EXPECT_FALSE(s.pin_effective);
  EXPECT_FALSE(s.side_streams_effective);
  EXPECT_TRUE(s.config.pin_cpu_memory);  // config keeps what was asked for

  s = load({{"WSL_INTEROP", "x"}, {"DDO_DISABLE_PIN_ON_WSL", "0"}}, r);
  EXPECT_TRUE(s.wsl);
  EXPECT_TRUE(s.pin_effective);
  EXPECT_TRUE(s.side_streams_effective);

  SettingsRequest forced = request();
  forced.wsl = true;
  EXPECT_FALSE(load({}, forced).pin_effective);
}

TEST(Settings, WslCompatTurnsSideStreamsOffEverywhere) {
  const DynamicOffloadSettings s = load({}, request("wsl_compat"));
  EXPECT_FALSE(s.side_streams_effective);
  EXPECT_FALSE(s.pin_effective);
}

TEST(Settings, ComponentPolicies) {
  EXPECT_EQ(component_env_key("text_encoder_2"), "TEXT_ENCODER_2");
  EXPECT_EQ(component_env_key("vae.decoder"), "VAE_DECODER");
  const DynamicOffloadSettings s = load({{"DDO_VAE_ROUTE", "device"},
                                         {"DDO_TEXT_ENCODER_ROUTE", "group_leaf"},
                                         {"DDO_TEXT_ENCODER_PRESET", "low_ram_safe"},
                                         {"DDO_TEXT_ENCODER_2_PRESET", "off"},
                                         {"DDO_UNET_PRESET", "diffusers_offload_compat"},
                                         {"DDO_PRESET", "warm_process"}});
  EXPECT_EQ(s.effective_preset, "warm_process");
  EXPECT_EQ(s.policy_for("vae").route, Route::kDeviceMove);
  EXPECT_FALSE(s.policy_for("vae").preset.has_value());
  EXPECT_EQ(s.policy_for("text_encoder").route, Route::kGroupLeaf);
  EXPECT_EQ(s.policy_for("Text-Encoder").preset, "low_ram_safe");
  EXPECT_EQ(s.policy_for("text_encoder_2").route, Route::kNone);
  EXPECT_EQ(s.policy_for("unet").route, Route::kGroupBlock);
  EXPECT_EQ(s.policy_for("transformer").route, Route::kDynamic);
  EXPECT_FALSE(s.policy_for("transformer").preset.has_value());

  // The default is the settings' own route.
  const DynamicOffloadSettings compat = load({}, request("diffusers_leaf_offload_compat"));
  EXPECT_EQ(compat.policy_for("transformer").route, Route::kGroupLeaf);

  expect_env_error({{"DDO_VAE_ROUTE", "gpu"}}, "DDO_VAE_ROUTE=\"gpu\"");
  expect_env_error({{"DDO_VAE_PRESET", "fast"}}, "DDO_VAE_PRESET=\"fast\"");
}

TEST(Settings, AvailableRamPrefersConfig) {
  SettingsRequest r = request();
  r.overrides = {{"available_system_ram_gb", 2}};
  EXPECT_EQ(load({}, r).available_ram_bytes(), static_cast<std::int64_t>(2 * kGiB));
  const DynamicOffloadSettings detected = load({});
  if (detected.total_ram_bytes()) {
    EXPECT_TRUE(detected.available_ram_bytes().has_value());
  }
}

TEST(Settings, ToJsonIsComplete) {
  const json j = load({{"DDO_VAE_ROUTE", "none"}}).to_json();
  for (const char* key :
       {"requested_preset", "effective_preset", "preset_description", "enabled", "config",
        "pin_requested", "pin_effective", "wsl", "side_streams_effective", "component_policies"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j.at("component_policies").at("VAE").at("route"), "none");
  EXPECT_EQ(j.at("config").at("execution_mode"), "linear_runtime");
}

// Found by fuzz/settings_fuzz.cpp: a DDO_ value with bytes that are not UTF-8 reached the
// warnings, and to_json().dump() threw nlohmann's type_error, ending the process. Such text is
// refused up front, and the message shows the bad bytes escaped (Note [Settings text is UTF-8]).
TEST(Settings, TextThatIsNotUtf8IsAnErrorThatCanBePrinted) {
  for (const EnvMap& env : std::vector<EnvMap>{
           {{"DDO_VERBOSE", "ma\x97ybe"}},
           {{"DDO_PINNED_WEIGHT_CACHE_NAMESPACE", "ns\xed\xa0\x80"}},  // a surrogate
           {{"DDO_VAE\xff_ROUTE", "device"}},
           {{"DDO_SKIP_MODULES_PATTERNS", "vae\xc0\xaf"}}}) {  // an overlong '/'
    const Status s = load_error(env);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("is not UTF-8 text"), std::string::npos) << s.message();
    EXPECT_NO_THROW((void)json(s.message()).dump()) << s.message();
  }
  EXPECT_NE(load_error({{"DDO_VERBOSE", "ma\x97ybe"}}).message().find("ma\\x97ybe"),
            std::string::npos);
  EXPECT_EQ(load_error({}, request("auto\x80")).code(), Code::kInvalidArgument);
  // Variables outside ddo's prefix are not ddo's business; UTF-8 text of any script is fine.
  const DynamicOffloadSettings s = load(
      {{"LANG_X", "\xff"}, {"DDO_PINNED_WEIGHT_CACHE_NAMESPACE", "caf\xc3\xa9-\xf0\x9f\x98\x80"}});
  EXPECT_EQ(s.config.pinned_weight_cache_namespace, "caf\xc3\xa9-\xf0\x9f\x98\x80");
  EXPECT_NO_THROW((void)s.to_json().dump());
}

TEST(Settings, ProcessEnvSeesTheEnvironment) {
#ifdef _WIN32
  _putenv_s("DDO_SETTINGS_TEST_MARKER", "a=b");
  const EnvMap env = process_env();
  _putenv_s("DDO_SETTINGS_TEST_MARKER", "");  // "" removes it
#else
  ::setenv("DDO_SETTINGS_TEST_MARKER", "a=b", 1);
  const EnvMap env = process_env();
  ::unsetenv("DDO_SETTINGS_TEST_MARKER");
#endif
  ASSERT_EQ(env.count("DDO_SETTINGS_TEST_MARKER"), 1u);
  EXPECT_EQ(env.at("DDO_SETTINGS_TEST_MARKER"), "a=b");
}

// Note [Misspelled variables].
TEST(Settings, AFieldNameOrATypoAsAVariableIsAWarningOthersAreLeftAlone) {
  const DynamicOffloadSettings s = DynamicOffloadSettings::from_env(
      {}, {{"DDO_SMALL_TENSOR_THRESHOLD_BYTES", "0"},
           {"DDO_VRAM_CAP_GBB", "8"},
           {"DDO_JOBS", "4"},  // another program's variable: not ours to judge
           {"DDO_TEXT_ENCODER_ROUTE", "none"}});
  std::string all;
  for (const std::string& w : s.warnings) all += w + "\n";
  EXPECT_NE(
      all.find("DDO_SMALL_TENSOR_THRESHOLD_BYTES is not read: the field "
               "small_tensor_threshold_bytes is set by DDO_SMALL_TENSOR_THRESHOLD_KB (in KiB)"),
      std::string::npos)
      << all;
  EXPECT_NE(all.find("DDO_VRAM_CAP_GBB is not a variable ddo reads; did you mean DDO_VRAM_CAP_GB?"),
            std::string::npos)
      << all;
  EXPECT_EQ(all.find("DDO_JOBS"), std::string::npos) << all;
  EXPECT_EQ(all.find("ROUTE"), std::string::npos) << all;
  EXPECT_EQ(s.warnings.size(), 2u) << all;
}

TEST(Settings, KernelModeFromEnv) {
  KernelMode mode = KernelMode::kReference;
  ASSERT_TRUE(kernel_mode_from_env({}, &mode).ok());
  EXPECT_EQ(mode, KernelMode::kAuto);
  ASSERT_TRUE(kernel_mode_from_env({{"DDO_KERNELS", " Reference "}}, &mode).ok());
  EXPECT_EQ(mode, KernelMode::kReference);
  ASSERT_TRUE(kernel_mode_from_env({{"DDO_KERNELS", "auto"}}, &mode).ok());
  EXPECT_EQ(mode, KernelMode::kAuto);
  const Status bad = kernel_mode_from_env({{"DDO_KERNELS", "fast"}}, &mode);
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("DDO_KERNELS=\"fast\""), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("auto"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("reference"), std::string::npos) << bad.message();
}

TEST(Settings, QuantizedMatmulModeFromEnv) {
  QuantizedMatmulMode mode = QuantizedMatmulMode::kOff;
  ASSERT_TRUE(quantized_matmul_mode_from_env({}, &mode).ok());
  EXPECT_EQ(mode, QuantizedMatmulMode::kAuto);
  ASSERT_TRUE(quantized_matmul_mode_from_env({{"DDO_QUANTIZED_MATMUL", " OFF "}}, &mode).ok());
  EXPECT_EQ(mode, QuantizedMatmulMode::kOff);
  ASSERT_TRUE(quantized_matmul_mode_from_env({{"DDO_QUANTIZED_MATMUL", "Exact"}}, &mode).ok());
  EXPECT_EQ(mode, QuantizedMatmulMode::kExact);
  const Status bad = quantized_matmul_mode_from_env({{"DDO_QUANTIZED_MATMUL", "on"}}, &mode);
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("DDO_QUANTIZED_MATMUL=\"on\""), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("exact"), std::string::npos) << bad.message();
}

TEST(Settings, OverridesKeepWhatTheSettingsWereBuiltWithAndDeriveThePlatformFactsAgain) {
  // Settings from a config ("custom") under WSL, with a component policy from their environment.
  SettingsRequest r = request();
  r.config = DynamicOffloadConfig{};
  r.wsl = true;
  const DynamicOffloadSettings s = load({{"DDO_VAE_ROUTE", "device"}}, r);
  ASSERT_EQ(s.requested_preset, "custom");
  ASSERT_FALSE(s.pin_effective);  // disable_pin_on_wsl

  DynamicOffloadSettings t;
  ASSERT_TRUE(s.with_overrides({{"verbose", true}, {"disable_pin_on_wsl", false}}, &t).ok());
  EXPECT_EQ(t.requested_preset, "custom");
  EXPECT_EQ(t.effective_preset, "custom");
  EXPECT_TRUE(t.config.verbose);
  EXPECT_TRUE(t.wsl);
  EXPECT_EQ(t.pin_effective, t.config.pin_cpu_memory);  // derived again from the new config
  EXPECT_EQ(t.policy_for("vae").route, Route::kDeviceMove);

  // Bad overrides leave `out` as it was and name the field.
  DynamicOffloadSettings kept = t;
  const Status bad = s.with_overrides({{"resident_module_budget_gb", -1}}, &t);
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("resident_module_budget_gb"), std::string::npos) << bad.message();
  EXPECT_EQ(t.config.verbose, kept.config.verbose);
  EXPECT_FALSE(s.with_overrides({{"no_such_field", 1}}, &t).ok());
}

TEST(Settings, ComponentRoutesAcceptTheRouteAliases) {
  const DynamicOffloadSettings s = load({{"DDO_TRANSFORMER_ROUTE", "linear_convolution"},
                                         {"DDO_TEXT_ENCODER_ROUTE", "diffusers_group_offload"}});
  EXPECT_EQ(s.policy_for("transformer").route, Route::kDynamic);
  EXPECT_EQ(s.policy_for("text_encoder").route, Route::kGroupLeaf);
}

}  // namespace
}  // namespace ddo::core
