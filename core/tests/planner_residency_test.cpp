// Planner tests: resident selection orders and the resident budget (planner_residency.cpp).
#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddo/core/inventory.h"
#include "ddo/core/planner.h"
#include "ddo/core/working_set.h"
#include "planner_test_util.h"

namespace ddo::core {
namespace {

using namespace planner_test;  // the shared helpers (planner_test_util.h)

TEST(PlannerSelection, FirstLargestSpreadOrders) {
  const std::vector<std::int64_t> bytes = {1, 5, 3, 5, 2};
  EXPECT_EQ(selection_order(bytes, Selection::kFirst, 100),
            (std::vector<std::size_t>{0, 1, 2, 3, 4}));
  // Largest: size descending, ties in model order.
  EXPECT_EQ(selection_order(bytes, Selection::kLargest, 100),
            (std::vector<std::size_t>{1, 3, 2, 4, 0}));
  // Spread, n = 19 equal items, budget for 5: centres of 5 strides, then the rest in order.
  const std::vector<std::int64_t> equal(19, 10);
  const std::vector<std::size_t> spread = selection_order(equal, Selection::kSpread, 50);
  ASSERT_EQ(spread.size(), 19u);
  EXPECT_EQ(std::vector<std::size_t>(spread.begin(), spread.begin() + 6),
            (std::vector<std::size_t>{1, 5, 9, 13, 17, 0}));
  // Nothing fits by average: model order.
  EXPECT_EQ(selection_order(equal, Selection::kSpread, 5)[0], 0u);
  // Everything fits: every index once.
  std::vector<std::size_t> all = selection_order(equal, Selection::kSpread, 1000);
  std::sort(all.begin(), all.end());
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], i);
}

TEST(PlannerSelection, BalancedOrderStreamsWhereComputeIs) {
  // Four "double" items of 100 bytes and eight "single" items of 50, one ms each: the singles do
  // twice the compute per byte. Budget 400 of 800: stream 400 along compute (Note [Balanced
  // order]): targets 400 * k / 12 after item k.
  std::vector<std::int64_t> bytes = {100, 100, 100, 100, 50, 50, 50, 50, 50, 50, 50, 50};
  const std::vector<double> ms(12, 1.0);
  const std::vector<std::size_t> order = balanced_order(bytes, ms, 400);
  ASSERT_EQ(order.size(), 12u);
  EXPECT_EQ(std::vector<std::size_t>(order.begin(), order.begin() + 5),
            (std::vector<std::size_t>{0, 2, 3, 7, 10}));
  const std::vector<std::size_t> chosen = greedy_fill(order, bytes, 400);
  EXPECT_EQ(chosen, (std::vector<std::size_t>{0, 2, 3, 7, 10}));
  // Three of four doubles stay resident (index-even spreading keeps two): they do the least
  // work per streamed byte.
  const std::vector<std::size_t> spread =
      greedy_fill(selection_order(bytes, Selection::kSpread, 400), bytes, 400);
  EXPECT_EQ(std::count_if(spread.begin(), spread.end(), [](std::size_t i) { return i < 4; }), 2);
  // Equal compute per byte: residents and streamed items alternate (ties stream).
  const std::vector<std::int64_t> equal(8, 10);
  const std::vector<std::size_t> even = balanced_order(equal, std::vector<double>(8, 2.0), 40);
  EXPECT_EQ(std::vector<std::size_t>(even.begin(), even.begin() + 4),
            (std::vector<std::size_t>{1, 3, 5, 7}));
  // Nothing to stream: all resident in model order; a mismatch in sizes is an error.
  EXPECT_EQ(balanced_order(equal, std::vector<double>(8, 1.0), 1000)[7], 7u);
  EXPECT_THROW(balanced_order(equal, {1.0}, 10), Error);
}

TEST(PlannerSelection, MeasuredComputePlacesResidentsInAPlan) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns = {"auto_all"};
  config.resident_module_selection = Selection::kSpread;
  config.resident_module_budget_gb = bytes_to_gib(8 * double_block_bytes(128));
  PlanContext ctx;
  // Every double block 1 ms, every single block 3 ms: the singles carry most of the compute.
  for (int i = 0; i < 19; ++i)
    ctx.candidate_compute_ms["transformer_blocks." + std::to_string(i)] = 1.0;
  for (int i = 0; i < 38; ++i) {
    ctx.candidate_compute_ms["single_transformer_blocks." + std::to_string(i)] = 3.0;
  }
  Plan plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(decision(plan, "balanced_order").inputs["used"], true);
  const std::size_t doubles = resident_blocks(plan, "transformer_blocks").size();
  const std::size_t singles = resident_blocks(plan, "single_transformer_blocks").size();
  EXPECT_EQ(decision(plan, "balanced_order").inputs["source"], "measured");
  // Without a profile: the estimate (the same work per candidate, Note [Estimated compute]).
  Plan estimated = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(decision(estimated, "balanced_order").inputs["source"], "estimate");
  EXPECT_GE(doubles, resident_blocks(estimated, "transformer_blocks").size());
  EXPECT_GT(doubles + singles, 0u);
  // Measured figures that invert the estimate (a double block ten times a single block's work)
  // stream the double blocks: the measurement, not the estimate, places the residents.
  PlanContext inverted_ctx;
  for (int i = 0; i < 19; ++i)
    inverted_ctx.candidate_compute_ms["transformer_blocks." + std::to_string(i)] = 10.0;
  for (int i = 0; i < 38; ++i)
    inverted_ctx.candidate_compute_ms["single_transformer_blocks." + std::to_string(i)] = 1.0;
  const Plan inverted = make_plan(flux_inventory(), config, inverted_ctx);
  EXPECT_LT(resident_blocks(inverted, "transformer_blocks").size(),
            resident_blocks(estimated, "transformer_blocks").size());
  EXPECT_GT(resident_blocks(inverted, "single_transformer_blocks").size(),
            resident_blocks(estimated, "single_transformer_blocks").size());
  EXPECT_LE(plan.resident_used_bytes, 8 * double_block_bytes(128));
  // A candidate without a figure: the estimate, and the decision says which one was missing.
  ctx.candidate_compute_ms.erase("single_transformer_blocks.7");
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(decision(plan, "balanced_order").inputs["source"], "estimate");
  EXPECT_EQ(decision(plan, "balanced_order").inputs["missing"], "single_transformer_blocks.7");
  EXPECT_NE(decision(plan, "balanced_order").detail.find("single_transformer_blocks.7"),
            std::string::npos);
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks"),
            resident_blocks(estimated, "transformer_blocks"));
}

TEST(PlannerSelection, FirstRunEstimateKeepsLargeBlocksWithLittleWorkPerByteResident) {
  // FLUX's shape (Note [Estimated compute]): double blocks are 3.6x the streamable bytes of a
  // single block (whose proj_out is always resident) for about the same work. Index-even
  // spreading over both lists keeps candidates by count, about every other one, so half the
  // double blocks stream; the estimate streams the small single blocks first and keeps most
  // double blocks, and streams about as many bytes as the budget leaves.
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns = {"auto_all"};
  config.resident_module_selection = Selection::kSpread;
  const std::int64_t budget = 12 * double_block_bytes(128);
  config.resident_module_budget_gb = bytes_to_gib(budget);
  const Plan plan = make_plan(flux_inventory(), config, {});
  const Decision& order = decision(plan, "balanced_order");
  EXPECT_EQ(order.inputs["source"], "estimate");
  EXPECT_NE(order.detail.find("no profile"), std::string::npos) << order.detail;
  const std::size_t doubles = resident_blocks(plan, "transformer_blocks").size();
  const std::size_t singles = resident_blocks(plan, "single_transformer_blocks").size();

  // The same candidates in index-even order (Note [Spread order]), through the public helpers.
  std::vector<std::int64_t> costs;
  const Decision& selection = decision(plan, "resident_selection");
  const std::int64_t candidate_bytes = selection.inputs["candidate_bytes"].get<std::int64_t>();
  ASSERT_EQ(selection.inputs["candidates"], 57);
  const std::int64_t single_cost = (candidate_bytes - 19 * double_block_bytes(128)) / 38;
  costs.assign(19, double_block_bytes(128));
  costs.insert(costs.end(), 38, single_cost);
  const std::vector<std::size_t> even =
      greedy_fill(selection_order(costs, Selection::kSpread, budget), costs, budget);
  const auto even_doubles = static_cast<std::size_t>(
      std::count_if(even.begin(), even.end(), [](std::size_t i) { return i < 19; }));
  EXPECT_GT(doubles, even_doubles);
  EXPECT_LT(singles, even.size() - even_doubles);
  // The streamed double blocks are spread through the list, not bunched at its end.
  std::vector<std::string> streamed;
  const std::vector<std::string> kept = resident_blocks(plan, "transformer_blocks");
  for (int i = 0; i < 19; ++i) {
    const std::string name = "transformer_blocks." + std::to_string(i);
    if (std::find(kept.begin(), kept.end(), name) == kept.end()) streamed.push_back(name);
  }
  ASSERT_GE(streamed.size(), 2u);
  EXPECT_NE(streamed.front(), "transformer_blocks.17");
  EXPECT_LE(plan.resident_used_bytes, budget);
  EXPECT_GT(plan.resident_used_bytes, budget - double_block_bytes(128));
}

TEST(PlannerSelection, GreedyFillSkipsWhatDoesNotFitAndKeepsGoing) {
  const std::vector<std::int64_t> bytes = {5, 10, 3, 2};
  EXPECT_EQ(greedy_fill({0, 1, 2, 3}, bytes, 8), (std::vector<std::size_t>{0, 2}));
  EXPECT_EQ(greedy_fill({1, 0, 2, 3}, bytes, 12), (std::vector<std::size_t>{1, 3}));
  EXPECT_TRUE(greedy_fill({0, 1, 2, 3}, bytes, 1).empty());
}

TEST(PlannerSelection, ResidentFirstLargestSpreadInAPlan) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_budget_gb = bytes_to_gib(3 * double_block_bytes(128));
  config.resident_module_selection = Selection::kFirst;
  Plan plan = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks"),
            (std::vector<std::string>{"transformer_blocks.0", "transformer_blocks.1",
                                      "transformer_blocks.2"}));
  EXPECT_EQ(plan.resident_used_bytes, 3 * double_block_bytes(128));
  EXPECT_EQ(module(plan, "transformer_blocks.1.attn.norm_q").placement, Placement::kResident);
  EXPECT_EQ(module(plan, "transformer_blocks.1.ff.net.2").tensors[1].action,
            TensorAction::kResident);  // small bias goes with its resident module
  EXPECT_EQ(module(plan, "transformer_blocks.3.ff.net.2").tensors[0].action, TensorAction::kStream);

  config.resident_module_selection = Selection::kSpread;
  plan = make_plan(flux_inventory(), config, {});
  // n = 19, k = 3: floor((2i + 1) * 19 / 6) = 3, 9, 15.
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks"),
            (std::vector<std::string>{"transformer_blocks.3", "transformer_blocks.9",
                                      "transformer_blocks.15"}));
  const Decision& d = decision(plan, "resident_selection");
  EXPECT_EQ(d.inputs["selection"], "spread");
  EXPECT_EQ(d.inputs["chosen"], 3);
  EXPECT_EQ(d.inputs["candidates"], 19);

  // Largest over lists of different sizes (auto_all): double blocks (36 h^2) come first.
  config.resident_module_patterns = {"auto_all"};
  config.resident_module_selection = Selection::kLargest;
  config.resident_module_budget_gb = bytes_to_gib(2 * double_block_bytes(128));
  plan = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks").size(), 2u);
  EXPECT_TRUE(resident_blocks(plan, "single_transformer_blocks").empty());
}

TEST(PlannerSelection, GreedyFillInAPlanUsesSmallerBlocksAfterALargeOneDoesNotFit) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns = {"auto_all"};
  config.resident_module_selection = Selection::kLargest;
  // One double block (36 h^2) plus half a double block: a second double block does not fit, but
  // single blocks (10 h^2 streamable: proj_out is always resident) do.
  const std::int64_t single = 10 * 128 * 128 * 2;
  config.resident_module_budget_gb = bytes_to_gib(double_block_bytes(128) + 2 * single);
  const Plan plan = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks"),
            std::vector<std::string>{"transformer_blocks.0"});
  EXPECT_EQ(
      resident_blocks(plan, "single_transformer_blocks"),
      (std::vector<std::string>{"single_transformer_blocks.0", "single_transformer_blocks.1"}));
  EXPECT_EQ(plan.resident_used_bytes, double_block_bytes(128) + 2 * single);
  // 18 double blocks and 36 single blocks would each fit alone, not after the others.
  EXPECT_EQ(decision(plan, "resident_selection").inputs["skipped_for_size"], 18 + 36);
}

TEST(PlannerBudget, ManualWinsOverProfileCalibrationAndPolicy) {
  DynamicOffloadConfig config = linear_config();
  config.auto_budget_policy = AutoBudgetPolicy::kBalanced;
  config.resident_module_budget_gb = 0.5;
  PlanContext ctx;
  ctx.total_vram_bytes = 24 * kGB;
  ctx.profile_budget_bytes = 2 * kGB;
  // Calibration forces zero even over a manual budget (the seed), and records what it ignored.
  ctx.calibrating = true;
  Plan plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 0);
  EXPECT_EQ(decision(plan, "profile_calibration").inputs["ignored_resident_module_budget_gb"], 0.5);
  EXPECT_FALSE(plan.has_decision("resident_budget_manual"));

  ctx.calibrating = false;
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, kGB / 2);
  EXPECT_TRUE(plan.has_decision("resident_budget_manual"));
  EXPECT_FALSE(plan.has_decision("resident_budget_profile"));
  EXPECT_FALSE(plan.has_decision("balanced_policy"));

  config.resident_module_budget_gb = 0;
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 2 * kGB);
  EXPECT_EQ(decision(plan, "resident_budget_profile").inputs["profile_budget_bytes"], 2 * kGB);
  EXPECT_FALSE(plan.has_decision("profile_calibration"));

  ctx.calibrating = true;
  ctx.profile_budget_bytes.reset();
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 0);
  EXPECT_TRUE(plan.has_decision("profile_calibration"));
  EXPECT_FALSE(plan.has_decision("balanced_policy"));
  EXPECT_TRUE(resident_blocks(plan, "transformer_blocks").empty());

  ctx.calibrating = false;
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_TRUE(plan.has_decision("balanced_policy"));
  EXPECT_EQ(plan.resident_budget_bytes, plan.resident_candidate_bytes);  // small model: all fit

  config.auto_budget_policy = AutoBudgetPolicy::kOff;
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 0);
  EXPECT_TRUE(plan.has_decision("resident_budget_none"));
}

TEST(PlannerBudget, BalancedHeadroomTiers) {
  EXPECT_EQ(balanced_headroom_bytes(8 * kGB), 5 * kGB / 2);
  EXPECT_EQ(balanced_headroom_bytes(12 * kGB), 5 * kGB / 2);
  EXPECT_EQ(balanced_headroom_bytes(16 * kGB), 3 * kGB);  // 15% = 2.4 GiB < 3
  EXPECT_EQ(balanced_headroom_bytes(24 * kGB), static_cast<std::int64_t>(0.15 * 24 * kGB));
  EXPECT_EQ(balanced_headroom_bytes(80 * kGB), 12 * kGB);
}

TEST(PlannerBudget, BalancedPolicyAtFluxScale) {
  const ModelInventory inv = flux_inventory({.h = 3072});
  DynamicOffloadConfig config = linear_config();
  config.auto_budget_policy = AutoBudgetPolicy::kBalanced;
  config.max_resident_module_budget_gb = 0;  // uncapped
  for (std::int64_t card_gb : {8, 12, 24}) {
    PlanContext ctx;
    ctx.total_vram_bytes = card_gb * kGB;
    const Plan plan = make_plan(inv, config, ctx);
    const Decision& d = decision(plan, "balanced_policy");
    const std::int64_t headroom = d.inputs["headroom_bytes"];
    EXPECT_EQ(headroom, balanced_headroom_bytes(card_gb * kGB)) << card_gb;
    // Always-resident modules (proj_in, time_embed, norm_out, proj_out and the 38 single-block
    // proj_out Linears) and move-once bytes count against the card.
    EXPECT_GT(plan.always_resident_bytes, 3 * kGB);
    EXPECT_EQ(d.inputs["always_resident_bytes"], plan.always_resident_bytes);
    // Note [Working set]: the default window plus two of the largest unit, a double block's
    // norm1.linear weight (6 h x h).
    EXPECT_EQ(plan.staging_estimate_bytes, kDefaultPrefetchWindowBytes + 2 * (6 * 3072 * 3072 * 2));
    const std::int64_t room = card_gb * kGB - headroom - plan.always_resident_bytes -
                              plan.move_once_bytes - plan.staging_estimate_bytes;
    const std::int64_t expected = std::clamp<std::int64_t>(room, 0, plan.resident_candidate_bytes);
    EXPECT_EQ(plan.resident_budget_bytes, expected) << card_gb;
    EXPECT_LE(plan.resident_used_bytes, plan.resident_budget_bytes);
    // What the card holds stays under its size minus the headroom.
    EXPECT_LE(plan.resident_used_bytes + plan.always_resident_bytes + plan.move_once_bytes +
                  plan.staging_estimate_bytes,
              card_gb * kGB - headroom);
  }
  // An 8 GiB card has about 1.4 GiB left after the headroom, the always-resident modules
  // (3.5 GiB) and the staging ring (0.7 GiB).
  PlanContext small;
  small.total_vram_bytes = 8 * kGB;
  EXPECT_LT(make_plan(inv, config, small).resident_budget_bytes, 3 * kGB / 2);

  // A manual headroom replaces the table.
  config.auto_vram_headroom_gb = 1.0;
  PlanContext ctx;
  ctx.total_vram_bytes = 24 * kGB;
  const Plan plan = make_plan(inv, config, ctx);
  EXPECT_EQ(decision(plan, "balanced_policy").inputs["headroom_bytes"], kGB);
  EXPECT_EQ(decision(plan, "balanced_policy").inputs["headroom_source"], "auto_vram_headroom_gb");

  // An emulated cap shrinks the card.
  config.auto_vram_headroom_gb = 0;
  config.vram_cap_gb = 12;
  ctx.total_vram_bytes = 140 * kGB;
  EXPECT_EQ(decision(make_plan(inv, config, ctx), "balanced_policy").inputs["total_vram_bytes"],
            12 * kGB);
}

TEST(PlannerBudget, MaxCapBoundsTheBalancedBudgetOnly) {
  const ModelInventory inv = flux_inventory({.h = 3072});
  DynamicOffloadConfig config = linear_config();
  config.auto_budget_policy = AutoBudgetPolicy::kBalanced;
  config.max_resident_module_budget_gb = 6.0;
  PlanContext ctx;
  ctx.total_vram_bytes = 80 * kGB;
  Plan plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 6 * kGB);
  const Decision& d = decision(plan, "max_budget_cap");
  EXPECT_EQ(d.inputs["budget_bytes"], 6 * kGB);
  EXPECT_GT(d.inputs["uncapped_bytes"].get<std::int64_t>(), 6 * kGB);

  // A manual budget is not capped; a profile budget arrives already capped and is used as given.
  config.resident_module_budget_gb = 9.0;
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 9 * kGB);
  EXPECT_FALSE(plan.has_decision("max_budget_cap"));
}

// A GiB figure set by code goes through the same checked conversion (bytes typed as GiB).
TEST(PlannerBudget, GiBFiguresBeyondBytesAreErrorsNamingTheField) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_budget_gb = 16e9;
  try {
    (void)make_plan(flux_inventory(), config, {});
    FAIL() << "expected ddo::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("resident_module_budget_gb"), std::string::npos)
        << e.what();
  }
}

// Note [Adapters under a saved profile]: this run's adapter bytes come out of the recommendation,
// so a larger adapter loaded since the calibration stays within the card.
TEST(PlannerBudget, AProfileBudgetLeavesRoomForTheAdaptersOnTopOfIt) {
  InventoryBuilder b("M");
  b.container("");
  for (int i = 0; i < 4; ++i) b.linear(fmt::format("blocks.{}", i), 256, 256);
  b.container("blocks.0.lora_A");
  b.linear("blocks.0.lora_A.b", 16, 256, false);
  b.container("blocks.0.lora_B");
  b.linear("blocks.0.lora_B.b", 256, 16, false);
  const ModelInventory inventory = b.take();
  const std::int64_t adapters = 2 * 16 * 256 * 2;
  PlanContext ctx;
  ctx.total_vram_bytes = 24 * kGB;
  ctx.profile_budget_bytes = 2 * (256 * 256 + 256) * 2;  // two blocks' bytes
  const Plan plan = make_plan(inventory, linear_config(), ctx);
  const Decision& d = decision(plan, "resident_budget_profile");
  EXPECT_EQ(d.inputs["adapter_bytes"], adapters);
  EXPECT_EQ(plan.resident_budget_bytes, *ctx.profile_budget_bytes - adapters);
  EXPECT_EQ(d.inputs["budget_bytes"], plan.resident_budget_bytes);
  // A budget smaller than the adapters leaves none for residents, never a negative one.
  ctx.profile_budget_bytes = adapters / 2;
  EXPECT_EQ(make_plan(inventory, linear_config(), ctx).resident_budget_bytes, 0);
}

}  // namespace
}  // namespace ddo::core
