// Planner tests: skip and always-resident patterns, the auto block pattern (planner_patterns.cpp).
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

TEST(PlannerAutoPattern, PicksTheLargestRepeatedListAndMatchesExactly) {
  const Plan plan = make_plan(flux_inventory(), linear_config(), {});
  EXPECT_EQ(plan.block_pattern, R"(^transformer_blocks\.[0-9]+$)");
  const std::regex re(plan.block_pattern);
  EXPECT_TRUE(std::regex_search("transformer_blocks.7", re));
  EXPECT_TRUE(std::regex_search("transformer_blocks.18", re));
  EXPECT_FALSE(std::regex_search("transformer_blocks.7.attn", re));
  EXPECT_FALSE(std::regex_search("single_transformer_blocks.7", re));
  EXPECT_FALSE(std::regex_search("transformer_blocks.x", re));

  std::size_t candidates = 0;
  for (const ModulePlan& m : plan.modules) candidates += m.resident_candidate;
  EXPECT_EQ(candidates, 19u);
  EXPECT_EQ(plan.resident_candidate_bytes, 19 * double_block_bytes(128));
  const Decision& d = decision(plan, "auto_block_pattern");
  EXPECT_EQ(d.inputs["mode"], "auto");
  ASSERT_EQ(d.inputs["chosen"].size(), 1u);
  EXPECT_EQ(d.inputs["chosen"][0]["prefix"], "transformer_blocks");
  EXPECT_EQ(d.inputs["chosen"][0]["members"], 19);
}

TEST(PlannerAutoPattern, PrefixIsRegexEscaped) {
  InventoryBuilder b("M");
  b.container("");
  b.linear("a+b.0", 128, 128);
  b.linear("a+b.1", 128, 128);
  b.linear("a+b.2.small", 4, 4);
  const Plan plan = make_plan(b.take(), linear_config(), {});
  EXPECT_EQ(plan.block_pattern, R"(^a\+b\.[0-9]+$)");
}

TEST(PlannerAutoPattern, OneMemberOrNoStreamableWeightsDoesNotQualify) {
  InventoryBuilder b("M");
  b.container("");
  b.linear("solo.0", 128, 128);
  b.norm("norms.0", 8);  // no streamable weight
  b.norm("norms.1", 8);
  const Plan plan = make_plan(b.take(), linear_config(), {});
  EXPECT_EQ(plan.block_pattern, "");
  EXPECT_EQ(decision(plan, "auto_block_pattern").inputs["chosen"].size(), 0u);
  EXPECT_EQ(plan.resident_candidate_bytes, 0);
}

TEST(PlannerAutoPattern, AutoAllTakesEveryListAndDropsNestedOnes) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns = {"auto_all"};
  const Plan plan = make_plan(flux_inventory(), config, {});
  ASSERT_EQ(plan.block_patterns.size(), 2u);
  EXPECT_EQ(plan.block_patterns[0], R"(^transformer_blocks\.[0-9]+$)");
  EXPECT_EQ(plan.block_patterns[1], R"(^single_transformer_blocks\.[0-9]+$)");
  EXPECT_EQ(decision(plan, "auto_block_pattern").inputs["mode"], "auto_all");
  std::size_t candidates = 0;
  for (const ModulePlan& m : plan.modules) candidates += m.resident_candidate;
  EXPECT_EQ(candidates, 19u + 38u);  // ff.net lists inside blocks are not separate candidates

  // The context flag does the same as the token.
  PlanContext ctx;
  ctx.all_block_lists = true;
  const Plan flagged = make_plan(flux_inventory(), linear_config(), ctx);
  EXPECT_EQ(flagged.block_patterns, plan.block_patterns);
  EXPECT_EQ(decision(flagged, "auto_block_pattern").inputs["mode"], "auto_all");
}

TEST(PlannerAutoPattern, ExplicitPatternsAreSearched) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns = {R"(single_transformer_blocks\.1$)"};
  config.resident_module_budget_gb = 1.0;
  const Plan plan = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(plan.block_pattern, "");
  // Searched, not fully matched: the pattern finds blocks 1 only ("...blocks.1" ends there).
  EXPECT_EQ(resident_blocks(plan, "single_transformer_blocks"),
            std::vector<std::string>{"single_transformer_blocks.1"});
  EXPECT_EQ(module(plan, "single_transformer_blocks.1.attn.to_q").placement, Placement::kResident);
}

TEST(PlannerPatterns, AlwaysResidentModulesAndDescendantsOnTopOfTheBudget) {
  const Plan plan = make_plan(flux_inventory(), linear_config(), {});
  EXPECT_EQ(plan.resident_budget_bytes, 0);
  for (const char* name :
       {"proj_in", "time_embed", "time_embed.linear_1", "time_embed.linear_2", "norm_out",
        "norm_out.linear", "proj_out", "single_transformer_blocks.5.proj_out"}) {
    EXPECT_EQ(module(plan, name).placement, Placement::kResident) << name;
    EXPECT_TRUE(module(plan, name).always_resident) << name;
  }
  EXPECT_EQ(module(plan, "single_transformer_blocks.5.proj_mlp").placement, Placement::kStreamed);
  const std::int64_t h = 128;
  const std::int64_t expected = (h * 64 + h) * 2 + (h * 256 + h) * 2 + (h * h + h) * 2 +
                                (2 * h * h + 2 * h) * 2 + (64 * h + 64) * 2 +
                                38 * (5 * h * h + h) * 2;
  EXPECT_EQ(plan.always_resident_bytes, expected);
  const Decision& d = decision(plan, "always_resident");
  EXPECT_EQ(d.inputs["bytes"], expected);
  // Direct matches: 4 top-level modules, their 3 matching children and 38 single-block proj_out.
  EXPECT_EQ(d.inputs["modules_matched"], 4 + 3 + 38);
  // A block's cost excludes its always-resident part (Note [Resident cost]).
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns = {"auto_all"};
  const Plan all = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(all.resident_candidate_bytes, 19 * double_block_bytes(h) + 38 * 10 * h * h * 2);
}

TEST(PlannerPatterns, SkipLeavesModulesAndDescendantsAloneAndWinsOverAlwaysResident) {
  DynamicOffloadConfig config = linear_config();
  config.skip_modules_pattern = {R"(^transformer_blocks\.0$)", "^time_embed$"};
  config.resident_module_budget_gb = 1.0;  // room for everything else
  const Plan plan = make_plan(flux_inventory(), config, {});
  for (const char* name :
       {"transformer_blocks.0", "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.ff.net.0.proj", "time_embed", "time_embed.linear_1"}) {
    EXPECT_EQ(module(plan, name).placement, Placement::kSkipped) << name;
    for (const TensorPlan& t : module(plan, name).tensors) {
      EXPECT_EQ(t.action, TensorAction::kKeep);
    }
  }
  EXPECT_FALSE(module(plan, "time_embed.linear_1").always_resident);
  EXPECT_FALSE(module(plan, "transformer_blocks.0").resident_candidate);
  EXPECT_EQ(module(plan, "transformer_blocks.1").placement, Placement::kResident);
  const Decision& d = decision(plan, "skip_pattern");
  EXPECT_EQ(d.inputs["matched"].size(), 2u);
  EXPECT_GT(d.inputs["modules"].get<int>(), 2);
  EXPECT_EQ(plan.skipped_bytes, d.inputs["bytes"].get<std::int64_t>());
}

TEST(PlannerPatterns, InvalidRegexIsAnErrorNamingThePattern) {
  DynamicOffloadConfig config = linear_config();
  config.skip_modules_pattern = {"blocks.(["};
  try {
    (void)make_plan(flux_inventory(), config, {});
    FAIL() << "expected ddo::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("blocks.(["), std::string::npos);
  }
}

// The planner compiles patterns too, including block patterns inferred from module names that
// were never validated; a nested or huge pattern of either kind is an error, never a crash that
// kills the host.
TEST(PlannerPatterns, NestedOrHugePatternsAreErrorsNotCrashes) {
  DynamicOffloadConfig config = linear_config();
  config.skip_modules_pattern = {std::string(20000, '(') + std::string(20000, ')')};
  EXPECT_THROW((void)make_plan(flux_inventory(), config, {}), Error);

  InventoryBuilder b("Hostile");
  const std::string prefix(30000, 'x');
  b.container("");
  b.container(prefix);
  b.linear(prefix + ".0", 128, 128);
  b.linear(prefix + ".1", 128, 128);
  try {
    (void)make_plan(b.take(), linear_config(), {});
    FAIL() << "expected ddo::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("characters long"), std::string::npos) << e.what();
  }
}

// Note [Adapter modules]: PEFT's exact names and diffusers' lora_layer, in any component of the
// name, so a module inside an adapter container is one too.
TEST(AdapterModules, PeftAndDiffusersNamesInAnyComponent) {
  for (const char* name :
       {"lora_A", "to_q.lora_A", "to_q.lora_A.style", "blocks.0.attn.to_q.lora_B.default",
        "emb.lora_embedding_A", "emb.lora_embedding_B.x", "to_q.lora_magnitude_vector.a",
        "to_k.lora_layer", "to_k.lora_layer.up"}) {
    EXPECT_TRUE(is_adapter_module(name)) << name;
  }
  for (const char* name :
       {"", "to_q", "to_q.base_layer", "lora", "lora_up", "lora_down", "to_q.lora_a",
        "to_q.lora_A_extra", "my_lora_A", "to_q.lora_Ax.b", "loras.0"}) {
    EXPECT_FALSE(is_adapter_module(name)) << name;
  }
  EXPECT_EQ(adapter_component("blocks.0.to_q.lora_B.style"), "lora_B");
  EXPECT_EQ(adapter_component("to_q.base_layer"), "");
  for (const std::string& n : adapter_module_names()) EXPECT_TRUE(is_adapter_module(n)) << n;
}

TEST(AdapterModules, ResidentOnTopOfTheBudgetListingEachAdapterOnce) {
  InventoryBuilder b("M");
  b.container("");
  b.linear("blocks.0", 128, 128);
  b.linear("blocks.1", 128, 128);
  b.container("blocks.0.lora_A");
  b.linear("blocks.0.lora_A.style", 4, 128, false);
  b.container("blocks.0.lora_B");
  b.linear("blocks.0.lora_B.style", 128, 4, false);
  b.linear("lora_up", 128, 128);  // not an adapter module: streamed as any Linear
  const Plan plan = make_plan(b.take(), linear_config(), {});
  for (const char* name :
       {"blocks.0.lora_A", "blocks.0.lora_A.style", "blocks.0.lora_B", "blocks.0.lora_B.style"}) {
    EXPECT_TRUE(module(plan, name).always_resident) << name;
    EXPECT_EQ(module(plan, name).placement, Placement::kResident) << name;
  }
  EXPECT_FALSE(module(plan, "lora_up").always_resident);
  const Decision& d = decision(plan, "adapters_resident");
  EXPECT_EQ(d.inputs["matched"], (nlohmann::json{"blocks.0.lora_A", "blocks.0.lora_B"}));
  EXPECT_EQ(d.inputs["modules_matched"], 2);
  EXPECT_EQ(d.inputs["bytes"], 2 * 4 * 128 * 2);
  EXPECT_EQ(d.inputs["names"].size(), adapter_module_names().size());
}

}  // namespace
}  // namespace ddo::core
