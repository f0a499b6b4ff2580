// Planner tests: decisions, determinism and the plan's JSON (planner_report.cpp).
#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddo/core/inventory.h"
#include "ddo/core/planner.h"
#include "planner_test_util.h"

namespace ddo::core {
namespace {

using namespace planner_test;  // the shared helpers (planner_test_util.h)

TEST(PlannerReport, DecisionsCarryNamesAndInputs) {
  DynamicOffloadConfig config = pin_config();
  config.auto_budget_policy = AutoBudgetPolicy::kBalanced;
  PlanContext ctx;
  ctx.total_vram_bytes = 12 * kGB;
  ctx.available_ram_bytes = 64 * kGB;
  const Plan plan = make_plan(flux_inventory(), config, ctx);
  for (const char* name : {"auto_block_pattern", "always_resident", "small_tensor",
                           "balanced_policy", "resident_selection", "pin_all", "stream_units"}) {
    const Decision& d = decision(plan, name);
    EXPECT_TRUE(d.inputs.is_object()) << name;
    EXPECT_FALSE(d.inputs.empty()) << name;
    EXPECT_FALSE(d.detail.empty()) << name;
  }
  const nlohmann::json j = plan.to_json();
  EXPECT_EQ(j["decisions"].size(), plan.decisions.size());
  EXPECT_EQ(j["modules"].size(), plan.modules.size());
  EXPECT_EQ(j["resident_budget_bytes"], plan.resident_budget_bytes);
  const std::string summary = plan.summary();
  EXPECT_NE(summary.find("balanced_policy"), std::string::npos);
  EXPECT_NE(summary.find("resident: budget"), std::string::npos);
  EXPECT_LT(std::count(summary.begin(), summary.end(), '\n'), 25);
}

TEST(PlannerReport, SamePlanTwice) {
  DynamicOffloadConfig config = pin_config();
  config.auto_budget_policy = AutoBudgetPolicy::kBalanced;
  config.resident_module_patterns = {"auto_all"};
  config.max_resident_module_budget_gb = 0;
  config.pin_weight_budget_ratio = 0.6;
  PlanContext ctx;
  ctx.total_vram_bytes = 24 * kGB;
  ctx.available_ram_bytes = 40 * kGB;
  const ModelInventory inv = flux_inventory({.h = 3072});
  const Plan a = make_plan(inv, config, ctx);
  const Plan b = make_plan(inv, config, ctx);
  EXPECT_EQ(a.to_json().dump(), b.to_json().dump());
  EXPECT_EQ(a.summary(), b.summary());
  // A copy of the inventory (new addresses) plans the same.
  ModelInventory copy;
  ASSERT_TRUE(ModelInventory::from_json(inv.to_json(), &copy).ok());
  EXPECT_EQ(make_plan(copy, config, ctx).to_json().dump(), a.to_json().dump());
}

// Every enum the plan writes (its mode and route, and the enum-valued inputs of decisions) reads
// back with config.h's parsers, so a saved plan or report can be fed to ddo again.
TEST(PlannerReport, EveryEnumInThePlanJsonParsesBack) {
  const ModelInventory dense = flux_inventory({.double_blocks = 2, .single_blocks = 2});
  const ModelInventory quantized =
      flux_inventory({.double_blocks = 2, .single_blocks = 2, .sdnq = true});
  std::size_t checked = 0;
  for (const auto& mode : execution_mode_spellings()) {
    for (const auto& route : route_spellings()) {
      for (const auto& selection : selection_spellings()) {
        for (const auto& policy : auto_budget_policy_spellings()) {
          DynamicOffloadConfig config = linear_config();
          config.execution_mode = mode.value;
          config.route = route.value;
          config.resident_module_selection = selection.value;
          config.auto_budget_policy = policy.value;
          config.pin_cpu_memory = true;
          PlanContext ctx;
          ctx.total_vram_bytes = 8 * kGB;
          ctx.candidate_compute_ms = {{"transformer_blocks.0", 1.0}};  // incomplete: the estimate
          const ModelInventory& inv =
              mode.value == ExecutionMode::kPackedRuntime ? quantized : dense;
          const nlohmann::json j = make_plan(inv, config, ctx).to_json();
          ExecutionMode parsed_mode{};
          ASSERT_TRUE(parse_execution_mode(j.at("mode").get<std::string>(), &parsed_mode).ok())
              << j.at("mode");
          Route parsed_route{};
          ASSERT_TRUE(parse_route(j.at("route").get<std::string>(), &parsed_route).ok())
              << j.at("route");
          EXPECT_EQ(parsed_route, route.value);
          ++checked;
          for (const nlohmann::json& d : j.at("decisions")) {
            const nlohmann::json& in = d.at("inputs");
            auto parses = [&](const char* key, auto parse, auto* out) {
              if (!in.is_object() || !in.contains(key)) return;
              const Status s = parse(in.at(key).get<std::string>(), out);
              EXPECT_TRUE(s.ok()) << d.at("name") << "." << key << ": " << s.message();
              ++checked;
            };
            Route r{};
            ExecutionMode m{};
            Selection sel{};
            AutoBudgetPolicy p{};
            parses("route", parse_route, &r);
            parses("requested", parse_execution_mode, &m);
            parses("classified_as", parse_execution_mode, &m);
            parses("selection", parse_selection, &sel);
            parses("auto_budget_policy", parse_auto_budget_policy, &p);
          }
        }
      }
    }
  }
  // Plans, plus at least one enum-valued decision input in most of them.
  EXPECT_GT(checked, 2u * 3 * 5 * 3 * 2);
}

TEST(PlannerReport, NegativeManualBudgetIsAnError) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_budget_gb = -1;
  EXPECT_THROW((void)make_plan(flux_inventory(), config, {}), Error);
}

}  // namespace
}  // namespace ddo::core
