#include "ddo/core/config.h"

#include <cmath>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace ddo::core {
namespace {

using nlohmann::json;

TEST(ConfigDefaults, MatchSpecTable) {
  const DynamicOffloadConfig c;
  EXPECT_EQ(c.execution_device, "cuda:0");
  EXPECT_EQ(c.offload_device, "cpu");
  EXPECT_TRUE(c.skip_modules_pattern.empty());
  ASSERT_EQ(c.always_resident_modules_pattern.size(), 1u);
  EXPECT_EQ(c.small_tensor_threshold_bytes, 16 * 1024);
  EXPECT_EQ(c.execution_mode, ExecutionMode::kPlan);
  EXPECT_EQ(c.route, Route::kDynamic);
  EXPECT_FALSE(c.pin_cpu_memory);
  EXPECT_TRUE(c.allow_pin_memory_fallback);
  EXPECT_EQ(c.pin_cpu_workers, 1);
  EXPECT_TRUE(c.cache_plan);
  EXPECT_FALSE(c.cache_pinned_weights);
  EXPECT_EQ(c.pinned_weight_cache_namespace, "");
  EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kOff);
  EXPECT_EQ(c.max_resident_module_budget_gb, 6.0);
  EXPECT_EQ(c.auto_vram_headroom_gb, 0.0);
  EXPECT_EQ(c.profile_vram_headroom_gb, 1.0);
  EXPECT_EQ(c.max_pin_weight_budget_gb, 0.0);
  EXPECT_FALSE(c.available_system_ram_gb.has_value());
  EXPECT_EQ(c.system_ram_headroom_gb, 6.0);
  EXPECT_EQ(c.pin_weight_budget_gb, 0.0);
  EXPECT_EQ(c.pin_weight_budget_ratio, 0.0);
  EXPECT_EQ(c.pin_weight_selection, Selection::kSpread);
  EXPECT_EQ(c.resident_module_selection, Selection::kSpread);
  EXPECT_EQ(c.resident_module_budget_gb, 0.0);
  EXPECT_TRUE(c.resident_module_patterns.empty());
  EXPECT_EQ(c.profile_name, "");
  EXPECT_FALSE(c.build_profile);
  EXPECT_EQ(c.load_safetensors_backend, "");
  EXPECT_FALSE(c.verbose);
  EXPECT_TRUE(c.show_profile);
  EXPECT_TRUE(c.disable_pin_on_wsl);
  EXPECT_TRUE(c.use_side_streams);
  EXPECT_TRUE(validate_config(c).ok());
}

TEST(ConfigDefaults, AlwaysResidentPatternMatchesDottedComponents) {
  const std::regex re(DynamicOffloadConfig{}.always_resident_modules_pattern.front());
  for (const char* name : {"proj_in", "time_embed", "prompt_adaln", "norm_out", "proj_out",
                           "transformer.proj_out", "blocks.3.norm_out.linear"}) {
    EXPECT_TRUE(std::regex_search(name, re)) << name;
  }
  for (const char* name : {"proj_input", "my_proj_in", "blocks.0.attn.to_q"}) {
    EXPECT_FALSE(std::regex_search(name, re)) << name;
  }
}

TEST(ConfigEnums, RoundTripEverySpelling) {
  for (auto mode :
       {ExecutionMode::kPlan, ExecutionMode::kLinearRuntime, ExecutionMode::kPackedRuntime}) {
    ExecutionMode parsed{};
    ASSERT_TRUE(parse_execution_mode(to_string(mode), &parsed).ok());
    EXPECT_EQ(parsed, mode);
  }
  for (auto route :
       {Route::kDynamic, Route::kGroupBlock, Route::kGroupLeaf, Route::kDeviceMove, Route::kNone}) {
    Route parsed{};
    ASSERT_TRUE(parse_route(to_string(route), &parsed).ok());
    EXPECT_EQ(parsed, route);
  }
  for (auto policy : {AutoBudgetPolicy::kOff, AutoBudgetPolicy::kBalanced}) {
    AutoBudgetPolicy parsed{};
    ASSERT_TRUE(parse_auto_budget_policy(to_string(policy), &parsed).ok());
    EXPECT_EQ(parsed, policy);
  }
  for (auto selection : {Selection::kFirst, Selection::kSpread, Selection::kLargest}) {
    Selection parsed{};
    ASSERT_TRUE(parse_selection(to_string(selection), &parsed).ok());
    EXPECT_EQ(parsed, selection);
  }
}

TEST(ConfigEnums, SpecSpellings) {
  EXPECT_STREQ(to_string(ExecutionMode::kPlan), "plan");
  EXPECT_STREQ(to_string(ExecutionMode::kLinearRuntime), "linear_runtime");
  EXPECT_STREQ(to_string(ExecutionMode::kPackedRuntime), "sdnq_runtime");
  EXPECT_STREQ(to_string(Route::kDynamic), "dynamic");
  EXPECT_STREQ(to_string(Route::kGroupBlock), "group_block");
  EXPECT_STREQ(to_string(Route::kGroupLeaf), "group_leaf");
  EXPECT_STREQ(to_string(Route::kDeviceMove), "device");
  EXPECT_STREQ(to_string(Route::kNone), "none");
  EXPECT_STREQ(to_string(AutoBudgetPolicy::kOff), "off");
  EXPECT_STREQ(to_string(AutoBudgetPolicy::kBalanced), "balanced");
  EXPECT_STREQ(to_string(Selection::kFirst), "first");
  EXPECT_STREQ(to_string(Selection::kSpread), "spread");
  EXPECT_STREQ(to_string(Selection::kLargest), "largest");
}

// The packed runtime keeps "sdnq_runtime" as its written spelling (config files, profile keys)
// and also reads the format-neutral "packed_runtime", in a config file as in parse_*.
TEST(ConfigEnums, ThePackedRuntimeReadsBothSpellingsAndWritesSdnqRuntime) {
  for (const char* text : {"sdnq_runtime", "packed_runtime", " Packed_Runtime "}) {
    ExecutionMode mode = ExecutionMode::kPlan;
    ASSERT_TRUE(parse_execution_mode(text, &mode).ok()) << text;
    EXPECT_EQ(mode, ExecutionMode::kPackedRuntime) << text;
  }
  for (const char* text : {"sdnq_runtime", "packed_runtime"}) {
    DynamicOffloadConfig c;
    const Status s = apply_overrides(&c, {{"execution_mode", text}});
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(c.execution_mode, ExecutionMode::kPackedRuntime) << text;
    EXPECT_EQ(config_to_json(c).at("execution_mode"), "sdnq_runtime");
  }
}

TEST(ConfigEnums, ParseIsCaseInsensitiveAndTrims) {
  ExecutionMode mode{};
  ASSERT_TRUE(parse_execution_mode("  Linear_Runtime ", &mode).ok());
  EXPECT_EQ(mode, ExecutionMode::kLinearRuntime);
}

TEST(ConfigEnums, UnknownSpellingListsValidOnesAndLeavesOutput) {
  Selection selection = Selection::kFirst;
  Status s = parse_selection("biggest", &selection);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("\"biggest\""), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("first, spread, largest"), std::string::npos) << s.message();
  EXPECT_EQ(selection, Selection::kFirst);

  Route route = Route::kDynamic;
  s = parse_route("group", &route);
  EXPECT_NE(s.message().find("dynamic, group_block, group_leaf, device, none"), std::string::npos)
      << s.message();
  ExecutionMode mode{};
  s = parse_execution_mode("linear", &mode);
  EXPECT_NE(s.message().find("plan, linear_runtime, sdnq_runtime"), std::string::npos);
  AutoBudgetPolicy policy{};
  s = parse_auto_budget_policy("on", &policy);
  EXPECT_NE(s.message().find("off, balanced"), std::string::npos);
}

TEST(ConfigEnums, RouteAliasesAreReadAndNeverWritten) {
  Route route = Route::kNone;
  ASSERT_TRUE(parse_route(" Dynamic_Offload", &route).ok());
  EXPECT_EQ(route, Route::kDynamic);
  ASSERT_TRUE(parse_route("linear_convolution", &route).ok());
  EXPECT_EQ(route, Route::kDynamic);
  ASSERT_TRUE(parse_route("diffusers_group_offload", &route).ok());
  EXPECT_EQ(route, Route::kGroupLeaf);
  EXPECT_STREQ(to_string(route), "group_leaf");
  const Status bad = parse_route("group_offload", &route);
  EXPECT_NE(bad.message().find("dynamic_offload, linear_convolution, diffusers_group_offload"),
            std::string::npos)
      << bad.message();
  EXPECT_EQ(route, Route::kGroupLeaf);
}

TEST(ConfigEnums, RouteArgumentsGiveOneRoute) {
  struct Case {
    RouteArguments args;
    std::optional<Route> expected;
  };
  const Case cases[] = {
      {{}, std::nullopt},
      {{.route = "auto", .group_offload = true}, Route::kGroupLeaf},
      {{.route = "AUTO"}, std::nullopt},
      {{.route = "dynamic_offload", .group_offload = true}, Route::kDynamic},
      {{.route = "diffusers_group_offload", .offload_type = "block_level"}, Route::kGroupBlock},
      {{.route = "diffusers_group_offload"}, Route::kGroupLeaf},
      {{.route = "device"}, Route::kDeviceMove},
      {{.group_offload = true, .offload_type = "block_level"}, Route::kGroupBlock},
      {{.group_offload = true, .dynamic_offload = true}, Route::kGroupLeaf},
      {{.group_offload = false, .dynamic_offload = true}, Route::kDynamic},
      {{.group_offload = false, .dynamic_offload = false}, Route::kNone},
      {{.dynamic_offload = false}, std::nullopt},
  };
  for (const Case& c : cases) {
    std::optional<Route> out = Route::kDeviceMove;
    ASSERT_TRUE(resolve_route_arguments(c.args, &out).ok());
    EXPECT_EQ(out, c.expected) << c.args.route.value_or("-") << " "
                               << c.args.offload_type.value_or("-");
  }
  std::optional<Route> kept = Route::kDeviceMove;
  Status s = resolve_route_arguments({.offload_type = "block"}, &kept);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("offload_type=\"block\" is not valid; use \"block_level\" or "
                             "\"leaf_level\""),
            std::string::npos)
      << s.message();
  s = resolve_route_arguments({.route = "fast"}, &kept);
  EXPECT_NE(s.message().find("route \"fast\""), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("or auto"), std::string::npos) << s.message();
  EXPECT_EQ(kept, Route::kDeviceMove);
}

TEST(ConfigJson, HasEveryFieldWithTypedValues) {
  DynamicOffloadConfig c;
  const json j = config_to_json(c);
  const std::vector<std::string> names = config_field_names();
  EXPECT_EQ(j.size(), names.size());
  EXPECT_EQ(names.size(), 40u);  // update when a field is added to the struct and the table
  for (const std::string& name : names) EXPECT_TRUE(j.contains(name)) << name;
  EXPECT_EQ(j.at("execution_mode"), "plan");
  EXPECT_EQ(j.at("route"), "dynamic");
  EXPECT_EQ(j.at("auto_budget_policy"), "off");
  EXPECT_EQ(j.at("pin_weight_selection"), "spread");
  EXPECT_TRUE(j.at("available_system_ram_gb").is_null());
  EXPECT_EQ(j.at("small_tensor_threshold_bytes"), 16384);
  EXPECT_EQ(j.at("show_profile"), true);
  EXPECT_TRUE(j.at("skip_modules_pattern").is_array());
  c.available_system_ram_gb = 12.5;
  EXPECT_EQ(config_to_json(c).at("available_system_ram_gb"), 12.5);
}

TEST(ConfigJson, RoundTripsThroughOverrides) {
  DynamicOffloadConfig a;
  a.execution_mode = ExecutionMode::kPackedRuntime;
  a.route = Route::kGroupLeaf;
  a.pin_cpu_workers = 3;
  a.available_system_ram_gb = 20;
  a.resident_module_patterns = {"auto", R"(blocks\.\d+)"};
  a.load_safetensors_backend = "pread";
  a.sim_pinnable_gb = 2.0;
  DynamicOffloadConfig b;
  ASSERT_TRUE(apply_overrides(&b, config_to_json(a)).ok());
  EXPECT_EQ(config_to_json(a), config_to_json(b));
}

TEST(ConfigOverrides, SetsEveryKind) {
  DynamicOffloadConfig c;
  const Status s = apply_overrides(&c, {{"pin_cpu_memory", true},
                                        {"pin_cpu_workers", 4},
                                        {"small_tensor_threshold_bytes", 1048576.0},
                                        {"resident_module_budget_gb", 3},
                                        {"profile_vram_headroom_gb", 0.5},
                                        {"available_system_ram_gb", 24},
                                        {"pinned_weight_cache_namespace", "ns"},
                                        {"skip_modules_pattern", {"vae", "lora"}},
                                        {"resident_module_patterns", "auto"},
                                        {"execution_mode", "linear_runtime"},
                                        {"route", "group_block"},
                                        {"auto_budget_policy", "balanced"},
                                        {"resident_module_selection", "largest"},
                                        {"pin_weight_selection", "first"}});
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(c.pin_cpu_memory);
  EXPECT_EQ(c.pin_cpu_workers, 4);
  EXPECT_EQ(c.small_tensor_threshold_bytes, 1048576);
  EXPECT_EQ(c.resident_module_budget_gb, 3.0);
  EXPECT_EQ(c.profile_vram_headroom_gb, 0.5);
  EXPECT_EQ(c.available_system_ram_gb, 24.0);
  EXPECT_EQ(c.pinned_weight_cache_namespace, "ns");
  EXPECT_EQ(c.skip_modules_pattern, (std::vector<std::string>{"vae", "lora"}));
  EXPECT_EQ(c.resident_module_patterns, (std::vector<std::string>{"auto"}));
  EXPECT_EQ(c.execution_mode, ExecutionMode::kLinearRuntime);
  EXPECT_EQ(c.route, Route::kGroupBlock);
  EXPECT_EQ(c.auto_budget_policy, AutoBudgetPolicy::kBalanced);
  EXPECT_EQ(c.resident_module_selection, Selection::kLargest);
  EXPECT_EQ(c.pin_weight_selection, Selection::kFirst);

  ASSERT_TRUE(apply_overrides(&c, {{"available_system_ram_gb", nullptr}}).ok());
  EXPECT_FALSE(c.available_system_ram_gb.has_value());
}

TEST(ConfigOverrides, NullAndEmptyObjectChangeNothing) {
  DynamicOffloadConfig c;
  EXPECT_TRUE(apply_overrides(&c, json(nullptr)).ok());
  EXPECT_TRUE(apply_overrides(&c, json::object()).ok());
  EXPECT_EQ(config_to_json(c), config_to_json(DynamicOffloadConfig{}));
}

TEST(ConfigOverrides, RejectsNonObject) {
  DynamicOffloadConfig c;
  const Status s = apply_overrides(&c, json::array({1, 2}));
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("object"), std::string::npos);
}

TEST(ConfigOverrides, UnknownNamesAreAllListedWithSuggestions) {
  DynamicOffloadConfig c;
  const Status s = apply_overrides(
      &c, {{"pin_memory", true}, {"verbos", true}, {"zzzz_qqqq_xxxx", 1}, {"verbose", true}});
  ASSERT_EQ(s.code(), Code::kInvalidArgument);
  const std::string& m = s.message();
  EXPECT_NE(m.find("\"pin_memory\""), std::string::npos) << m;
  EXPECT_NE(m.find("\"verbos\" (did you mean \"verbose\"?)"), std::string::npos) << m;
  EXPECT_NE(m.find("\"zzzz_qqqq_xxxx\""), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean \"pin_cpu_memory\""), std::string::npos) << m;
  EXPECT_NE(m.find("valid fields: execution_device"), std::string::npos) << m;
  EXPECT_NE(m.find("sim_pinnable_gb"), std::string::npos) << m;
  EXPECT_FALSE(c.verbose);  // all or nothing
}

TEST(ConfigOverrides, TypeErrorsNameTheFieldAndLeaveConfig) {
  struct Case {
    const char* field;
    json value;
  };
  const Case cases[] = {
      {"pin_cpu_memory", "yes"},
      {"pin_cpu_memory", 1},
      {"pin_cpu_workers", 2.5},
      {"pin_cpu_workers", "4"},
      {"pin_cpu_workers", 1e12},
      {"small_tensor_threshold_bytes", 1e30},
      {"resident_module_budget_gb", "6GB"},
      {"available_system_ram_gb", "lots"},
      {"profile_name", 3},
      {"skip_modules_pattern", json::array({"a", 1})},
      {"execution_mode", "fast"},
      {"route", 2},
  };
  for (const Case& c : cases) {
    DynamicOffloadConfig config;
    const Status s = apply_overrides(&config, {{"verbose", true}, {c.field, c.value}});
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << c.field << " " << c.value.dump();
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s.message();
    EXPECT_FALSE(config.verbose) << c.field;
  }
}

TEST(ConfigOverrides, RangeChecksAndRatioClamp) {
  DynamicOffloadConfig c;
  EXPECT_TRUE(apply_overrides(&c, {{"pin_weight_budget_ratio", 1.7}}).ok());
  EXPECT_EQ(c.pin_weight_budget_ratio, 1.0);
  EXPECT_TRUE(apply_overrides(&c, {{"pin_weight_budget_ratio", -0.2}}).ok());
  EXPECT_EQ(c.pin_weight_budget_ratio, 0.0);

  Status s = apply_overrides(&c, {{"profile_vram_headroom_gb", -1}});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("profile_vram_headroom_gb=-1 is negative"), std::string::npos)
      << s.message();
  s = apply_overrides(&c, {{"pin_cpu_workers", 0}});
  EXPECT_NE(s.message().find("pin_cpu_workers=0"), std::string::npos) << s.message();
  s = apply_overrides(&c, {{"load_safetensors_backend", "mmapp"}});
  EXPECT_NE(s.message().find("load_safetensors_backend=\"mmapp\""), std::string::npos);
  s = apply_overrides(&c, {{"skip_modules_pattern", {"blocks.("}}});
  EXPECT_NE(s.message().find("skip_modules_pattern[0]"), std::string::npos) << s.message();
  EXPECT_TRUE(apply_overrides(&c, {{"sim_pinnable_gb", -1}}).ok());
  EXPECT_EQ(c.profile_vram_headroom_gb, 1.0);
}

TEST(ConfigValidate, RangesNameTheFieldAndTheRange) {
  DynamicOffloadConfig c;
  c.vram_cap_gb = 16e9;  // bytes typed as GiB
  Status s = validate_config(c);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("config field vram_cap_gb=1.6e+10 is out of range; use GiB in [0, "
                             "65536]"),
            std::string::npos)
      << s.message();
  c = {};
  c.available_system_ram_gb = 1e9;
  EXPECT_NE(validate_config(c).message().find("available_system_ram_gb"), std::string::npos);
  c = {};
  c.sim_copy_gbps = 1e-9;
  EXPECT_NE(validate_config(c).message().find("sim_copy_gbps=1e-09 is out of range"),
            std::string::npos)
      << validate_config(c).message();
  c.sim_copy_gbps = 0;  // unthrottled
  EXPECT_TRUE(validate_config(c).ok());
  c = {};
  c.pin_cpu_workers = 5000;
  EXPECT_NE(validate_config(c).message().find("pin_cpu_workers=5000"), std::string::npos);
  c = {};
  c.small_tensor_threshold_bytes = std::numeric_limits<std::int64_t>::max();
  EXPECT_FALSE(validate_config(c).ok());
  c = {};
  c.pin_weight_budget_ratio = 3;  // clamped where used (docs/design/0006-configuration.md)
  EXPECT_TRUE(validate_config(c).ok());
}

TEST(ConfigOverrides, RangeErrorsNameTheOverrideKeyAndClampsWarn) {
  DynamicOffloadConfig c;
  std::vector<std::string> warnings;
  Status s =
      apply_overrides(&c, {{"verbose", true}, {"max_pin_weight_budget_gb", 1e12}}, &warnings);
  EXPECT_NE(s.message().find("override max_pin_weight_budget_gb=1e+12 is out of range; use GiB"),
            std::string::npos)
      << s.message();
  EXPECT_FALSE(c.verbose);
  EXPECT_TRUE(warnings.empty());
  ASSERT_TRUE(apply_overrides(&c, {{"pin_weight_budget_ratio", -3}}, &warnings).ok());
  EXPECT_EQ(c.pin_weight_budget_ratio, 0.0);
  EXPECT_EQ(warnings, std::vector<std::string>{
                          "override pin_weight_budget_ratio=-3 is outside [0, 1]; clamped to 0"});
}

// A device index is checked by core at every entry point (`--device sim:99999999999`,
// execution_device="sim:99999999999" from Python), and the error names the source, the text and
// the range, never only "stoi".
TEST(ConfigValidate, DeviceIndexIsCheckedNamingTheSourceAndTheRange) {
  for (const char* good : {"cuda", "cuda:0", "cuda:1023", "sim", "sim:00", "sim:7", "cpu"}) {
    EXPECT_TRUE(check_device_index("--device", good).ok()) << good;
  }
  for (const char* bad : {"sim:99999999999", "sim:1024", "cuda:-1", "cuda:", "sim:1x", "sim:+1",
                          "cuda: 1", "sim:0x10"}) {
    const Status s = check_device_index("--device", bad);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(std::string("--device '") + bad + "'"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("from 0 to 1023"), std::string::npos) << s.message();
  }
  DynamicOffloadConfig c;
  c.execution_device = "sim:99999999999";
  EXPECT_NE(validate_config(c).message().find(
                "config field execution_device 'sim:99999999999': the index '99999999999'"),
            std::string::npos)
      << validate_config(c).message();
  c = {};
  const Status s = apply_overrides(&c, {{"execution_device", "cuda:4294967296"}});
  EXPECT_NE(s.message().find("override execution_device 'cuda:4294967296'"), std::string::npos)
      << s.message();
  EXPECT_EQ(c.execution_device, "cuda:0");  // unchanged
}

// A deep or long pattern is an error, never a crash: about 20,000 nested parentheses overflow
// the stack inside std::regex and kill the process, and each of these would crash without the
// limits (Note [Pattern limits]).
TEST(ConfigPatterns, DeepOrLongPatternsAreErrorsNotCrashes) {
  const std::string deep = std::string(20000, '(') + "a" + std::string(20000, ')');
  Status s = check_module_pattern("skip_modules_pattern", 0, deep);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("skip_modules_pattern[0] is 40001 characters long"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("at most 1000"), std::string::npos) << s.message();

  const std::string nested = std::string(200, '(') + "a" + std::string(200, ')');
  s = check_module_pattern("always_resident_modules_pattern", 2, nested);
  EXPECT_NE(s.message().find("always_resident_modules_pattern[2] nests groups 200 deep"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("at most 32"), std::string::npos) << s.message();

  DynamicOffloadConfig c;
  c.resident_module_patterns = {"auto", std::string(50000, 'a')};
  EXPECT_NE(validate_config(c).message().find("config field resident_module_patterns[1]"),
            std::string::npos)
      << validate_config(c).message();
  c = {};
  c.skip_modules_pattern = {deep};
  EXPECT_FALSE(apply_overrides(&c, {{"skip_modules_pattern", {deep}}}).ok());

  // At the limits a pattern compiles; escaped and bracketed parentheses do not nest.
  const std::string at_limit = std::string(32, '(') + "a" + std::string(32, ')');
  EXPECT_TRUE(check_module_pattern("p", 0, at_limit).ok());
  EXPECT_TRUE(check_module_pattern("p", 0, std::string(33, '(') + std::string(33, ')'))
                  .message()
                  .find("33 deep") != std::string::npos);
  EXPECT_TRUE(
      check_module_pattern("p", 0,
                           R"(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\(\()"
                           R"(x)")
          .ok());
  EXPECT_TRUE(check_module_pattern("p", 0, std::string(1000, 'a')).ok());
  EXPECT_FALSE(check_module_pattern("p", 0, std::string(1001, 'a')).ok());
}

// Found by fuzz/patterns_fuzz.cpp: a back-reference or count with more digits than a long holds
// overflowed inside libstdc++'s regex compiler (undefined behaviour), and nested counts multiply
// the states it builds (Note [Pattern repetition] in config.cpp).
TEST(ConfigValidate, PatternRepetitionIsBounded) {
  for (const char* pattern :
       {R"(\777777777000001048532141)", "a{99999999999}", "a{1,99999}", "((a{100}){100}){100}",
        "(x{99}){99}(y{99}){99}", "(((((((((((((((a+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)",
        "(a*********@|net)", "a+*", "a{2}{3}", "a*?*", "((((a*)*)....*)*)", "(a+){2}",
        "(x(y{1,})?z)*", R"((blocks\.\d+\.)+)"}) {
    const Status s = check_module_pattern("skip_modules_pattern", 1, pattern);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << pattern;
    EXPECT_NE(s.message().find("skip_modules_pattern[1]"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("Note [Pattern repetition]"), std::string::npos) << s.message();
  }
  // Real module patterns repeat little and stay accepted.
  for (const char* pattern :
       {R"(^transformer_blocks\.[0-9]+$)", R"(^(single_)?transformer_blocks\.(1[0-9]|2[0-7])\.)",
        R"(\d{1,3}\.attn)", "a{2,3}b{4,}", "a*?b+?c{2}?", R"((\.blocks\.[0-9]{1,3})*$)", "(a*)?",
        R"((\w+)\.\1)", "(a{100}){99}", R"([{}()*+]{9})"}) {
    EXPECT_TRUE(check_module_pattern("p", 0, pattern).ok())
        << pattern << ": " << check_module_pattern("p", 0, pattern).message();
  }
}

TEST(ConfigValidate, RejectsNonFinite) {
  DynamicOffloadConfig c;
  c.profile_vram_headroom_gb = std::numeric_limits<double>::quiet_NaN();
  Status s = validate_config(c);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("profile_vram_headroom_gb"), std::string::npos);
  c = {};
  c.available_system_ram_gb = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(validate_config(c).ok());
  c = {};
  c.pin_weight_budget_ratio = std::nan("");
  EXPECT_FALSE(validate_config(c).ok());
  c = {};
  c.resident_module_patterns = {"auto"};
  EXPECT_TRUE(validate_config(c).ok());
}

TEST(EffectiveCard, TheCapBoundsTheDeviceAndStandsAloneWithoutOne) {
  DynamicOffloadConfig config;
  const std::int64_t card = std::int64_t{80} << 30;
  EXPECT_EQ(effective_card_bytes(card, config), card);  // no cap
  EXPECT_EQ(effective_card_bytes(0, config), 0);
  config.vram_cap_gb = 8;
  EXPECT_EQ(effective_card_bytes(card, config), std::int64_t{8} << 30);
  EXPECT_EQ(effective_card_bytes(0, config), std::int64_t{8} << 30);  // no total known
  EXPECT_EQ(effective_card_bytes(std::int64_t{4} << 30, config), std::int64_t{4} << 30);
  config.vram_cap_gb = 0.1;  // rounded to the nearest byte, as every GiB figure
  EXPECT_EQ(effective_card_bytes(card, config), 107374182);
}

}  // namespace
}  // namespace ddo::core
