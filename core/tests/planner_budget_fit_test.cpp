// A fixed resident budget fits the card (Note [Resident budget fits the card] in
// planner_residency.cpp): a manual, preset or profile budget whose residents the card cannot hold
// next to the always-resident modules, the move-once tensors, the headroom and the staging ring is
// clamped to what is left, and the decision resident_budget_fit says so; a budget that fits, or a
// card of unknown size, keeps the budget as given.
//
// Each test also checks a clamp, so each fails without the rule (without it, a 4 GiB budget on an
// 8 GiB card with a FLUX-sized model is planned as 4 GiB and setup fails moving residents).
#include <cmath>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddo/core/planner.h"
#include "ddo/core/presets.h"
#include "planner_test_util.h"

namespace ddo::core {
namespace {

using planner_test::decision;
using planner_test::flux_inventory;
using planner_test::kGB;
using planner_test::linear_config;

constexpr std::int64_t kH = 3072;  // FLUX.1 hidden size: 22.6 GiB of bf16 weights

// A FLUX-sized plan on the H200 with an emulated card of `card_gb` (0: no cap).
Plan flux_plan(const DynamicOffloadConfig& config, double card_gb, PlanContext ctx = {}) {
  DynamicOffloadConfig c = config;
  c.vram_cap_gb = card_gb;
  if (ctx.total_vram_bytes == 0) ctx.total_vram_bytes = 140 * kGB;
  return make_plan(flux_inventory({.h = kH}), c, ctx);
}

DynamicOffloadConfig manual(double budget_gb) {
  DynamicOffloadConfig c = linear_config();
  c.resident_module_budget_gb = budget_gb;
  return c;
}

// What the card leaves for budget-chosen residents after `headroom`, as the rule computes it.
std::int64_t room(const Plan& plan, std::int64_t total, std::int64_t headroom) {
  return total - headroom - plan.always_resident_bytes - plan.move_once_bytes -
         plan.staging_estimate_bytes;
}

// What the plan puts on the card beside the activations.
std::int64_t device_bytes(const Plan& plan) {
  return plan.always_resident_bytes + plan.resident_used_bytes + plan.move_once_bytes +
         plan.staging_estimate_bytes;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(ResidentBudgetFit, ManualBudgetAboveTheRoomIsClampedAndNamed) {
  // The measured failure: an 8 GiB card, a FLUX-sized model, resident_module_budget_gb = 4.
  const std::int64_t total = 8 * kGB;
  const std::int64_t headroom = balanced_headroom_bytes(total);
  const Plan plan = flux_plan(manual(4.0), 8);
  const std::int64_t left = room(plan, total, headroom);
  ASSERT_GT(left, 0);
  ASSERT_LT(left, 4 * kGB);
  EXPECT_EQ(plan.resident_budget_bytes, left);
  EXPECT_LE(plan.resident_used_bytes, left);
  EXPECT_GT(plan.resident_used_bytes, 0) << "what fits is still used";
  EXPECT_LE(device_bytes(plan), total - headroom);
  // The manual decision still says what was asked; the fit decision says what fits and why.
  EXPECT_EQ(decision(plan, "resident_budget_manual").inputs["budget_bytes"], 4 * kGB);
  const Decision& d = decision(plan, "resident_budget_fit");
  EXPECT_EQ(d.inputs["requested_budget_bytes"], 4 * kGB);
  EXPECT_EQ(d.inputs["budget_bytes"], left);
  EXPECT_EQ(d.inputs["room_bytes"], left);
  EXPECT_EQ(d.inputs["source"], "resident_module_budget_gb");
  EXPECT_EQ(d.inputs["origin"], "config field resident_module_budget_gb");
  EXPECT_EQ(d.inputs["headroom_bytes"], headroom);
  EXPECT_EQ(d.inputs["headroom_source"], "table");
  EXPECT_EQ(d.inputs["total_vram_bytes"], total);
  EXPECT_TRUE(contains(d.detail, "4.00 GiB")) << d.detail;
  EXPECT_TRUE(contains(d.detail, "resident_module_budget_gb=4")) << d.detail;
  const std::string to_change = fmt::format("set resident_module_budget_gb to {:.2f} or less",
                                            std::floor(bytes_to_gib(left) * 100.0) / 100.0);
  EXPECT_TRUE(contains(d.detail, to_change)) << d.detail;
  // The selection places residents within the clamped budget.
  EXPECT_EQ(decision(plan, "resident_selection").inputs["budget_bytes"], left);
}

TEST(ResidentBudgetFit, PresetBudgetIsNamedByItsOrigin) {
  DynamicOffloadConfig config;
  PresetInfo info;
  ASSERT_TRUE(apply_preset("warm_process", &config, &info).ok());
  ASSERT_EQ(config.resident_module_budget_gb, 6.0);
  PlanContext ctx;
  ctx.resident_budget_origin = "preset warm_process";
  const Plan plan = flux_plan(config, 8, ctx);
  const Decision& d = decision(plan, "resident_budget_fit");
  EXPECT_EQ(d.inputs["origin"], "preset warm_process");
  EXPECT_EQ(d.inputs["requested_budget_bytes"], 6 * kGB);
  EXPECT_TRUE(contains(d.detail, "preset warm_process")) << d.detail;
  EXPECT_LT(plan.resident_budget_bytes, 2 * kGB);
}

TEST(ResidentBudgetFit, BudgetsThatFitAreUsedAsGiven) {
  // A budget under the room: unchanged, no decision.
  Plan plan = flux_plan(manual(1.0), 8);
  EXPECT_EQ(plan.resident_budget_bytes, kGB);
  EXPECT_FALSE(plan.has_decision("resident_budget_fit")) << plan.summary();
  plan = flux_plan(manual(6.0), 24);
  EXPECT_EQ(plan.resident_budget_bytes, 6 * kGB);
  EXPECT_FALSE(plan.has_decision("resident_budget_fit")) << plan.summary();
  // A budget above the room whose candidates all fit asks for no more than the card holds: the
  // small model's blocks take a few MiB of a 6 GiB budget on an 8 GiB card.
  DynamicOffloadConfig small = manual(6.0);
  small.vram_cap_gb = 8;
  PlanContext ctx;
  ctx.total_vram_bytes = 140 * kGB;
  plan = make_plan(flux_inventory(), small, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, 6 * kGB);
  EXPECT_EQ(plan.resident_used_bytes, plan.resident_candidate_bytes);
  EXPECT_FALSE(plan.has_decision("resident_budget_fit")) << plan.summary();
  // The same 6 GiB on the FLUX-sized model does not fit the 8 GiB card.
  plan = flux_plan(manual(6.0), 8);
  EXPECT_LT(plan.resident_budget_bytes, 6 * kGB);
  EXPECT_TRUE(plan.has_decision("resident_budget_fit"));
}

TEST(ResidentBudgetFit, ProfileMeasuredOnThisCardIsUsedUnchanged) {
  // Measured on the H200: at a 16 GiB cap the zero-resident calibration
  // peaked at 5.96 GiB and the profile recommends 16 - 5.96 - 1 = 9.04 GiB, above the 8.9 GiB the
  // balanced policy's table headroom leaves. The profile's measurement holds the activations,
  // so only profile_vram_headroom_gb stands between it and the card: it is used as saved.
  DynamicOffloadConfig config = linear_config();
  config.profile_name = "flux";
  PlanContext ctx;
  const auto recommended = static_cast<std::int64_t>(9.04412841796875 * kGB);
  ctx.profile_budget_bytes = recommended;
  Plan plan = flux_plan(config, 16, ctx);
  EXPECT_EQ(plan.resident_budget_bytes, recommended);
  EXPECT_FALSE(plan.has_decision("resident_budget_fit")) << plan.summary();
  EXPECT_LT(room(plan, 16 * kGB, balanced_headroom_bytes(16 * kGB)), recommended)
      << "the case where the table headroom would have cut a measured recommendation";

  // The same recommendation on an 8 GiB card (a profile calibrated on a larger one) is cut to
  // what the card holds after the profile headroom.
  plan = flux_plan(config, 8, ctx);
  const std::int64_t left = room(plan, 8 * kGB, kGB);
  EXPECT_EQ(plan.resident_budget_bytes, left);
  EXPECT_LE(device_bytes(plan), 8 * kGB - kGB);
  const Decision& d = decision(plan, "resident_budget_fit");
  EXPECT_EQ(d.inputs["source"], "profile");
  EXPECT_EQ(d.inputs["origin"], "saved profile 'flux'");
  EXPECT_EQ(d.inputs["requested_budget_bytes"], recommended);
  EXPECT_EQ(d.inputs["headroom_source"], "profile_vram_headroom_gb");
  EXPECT_TRUE(contains(d.detail, "saved profile 'flux'")) << d.detail;
  EXPECT_TRUE(contains(d.detail, "build_profile=true")) << d.detail;
}

TEST(ResidentBudgetFit, UnknownCardSizeKeepsTheBudget) {
  // Plan mode on a device the caller did not measure, and no cap.
  PlanContext unknown;
  Plan plan = make_plan(flux_inventory({.h = kH}), manual(4.0), unknown);
  EXPECT_EQ(plan.resident_budget_bytes, 4 * kGB);
  EXPECT_FALSE(plan.has_decision("resident_budget_fit")) << plan.summary();
  // The host simulation's arena is not a card (no CUDA context, sized by tests to tiny models)
  // unless a cap emulates one.
  DynamicOffloadConfig sim = manual(4.0);
  sim.execution_device = "sim";
  PlanContext arena;
  arena.total_vram_bytes = 8 * kGB;
  plan = make_plan(flux_inventory({.h = kH}), sim, arena);
  EXPECT_EQ(plan.resident_budget_bytes, 4 * kGB);
  EXPECT_FALSE(plan.has_decision("resident_budget_fit")) << plan.summary();
  sim.vram_cap_gb = 8;
  plan = make_plan(flux_inventory({.h = kH}), sim, arena);
  EXPECT_LT(plan.resident_budget_bytes, 2 * kGB);
  EXPECT_TRUE(plan.has_decision("resident_budget_fit")) << plan.summary();
  // A CUDA device's reported size is known without a cap.
  plan = make_plan(flux_inventory({.h = kH}), manual(4.0), arena);
  EXPECT_LT(plan.resident_budget_bytes, 2 * kGB);
}

TEST(ResidentBudgetFit, RoomIsWhatAlwaysResidentAndMoveOnceBytesLeave) {
  // Three plans of one 12 GiB budget (all 19 double blocks) on a 14 GiB card: the default
  // always-resident pattern, none, and a small-tensor threshold that moves every h x h weight
  // once (18 MiB, under 20 MiB).
  const std::int64_t total = 14 * kGB;
  const std::int64_t headroom = balanced_headroom_bytes(total);
  DynamicOffloadConfig with_always = manual(12.0);
  DynamicOffloadConfig without_always = manual(12.0);
  without_always.always_resident_modules_pattern.clear();
  DynamicOffloadConfig more_move_once = manual(12.0);
  more_move_once.small_tensor_threshold_bytes = std::int64_t{20} << 20;
  const Plan a = flux_plan(with_always, 14);
  const Plan b = flux_plan(without_always, 14);
  const Plan c = flux_plan(more_move_once, 14);
  for (const Plan* plan : {&a, &b, &c}) {
    EXPECT_EQ(plan->resident_budget_bytes, room(*plan, total, headroom)) << plan->summary();
    EXPECT_LE(device_bytes(*plan), total - headroom) << plan->summary();
    const Decision& d = decision(*plan, "resident_budget_fit");
    EXPECT_EQ(d.inputs["always_resident_bytes"], plan->always_resident_bytes);
    EXPECT_EQ(d.inputs["move_once_bytes"], plan->move_once_bytes);
    EXPECT_EQ(d.inputs["staging_bytes"], plan->staging_estimate_bytes);
  }
  // One staging ring in all three (the largest unit is a double block's norm1.linear weight), so
  // the rooms differ by what is always resident and what moves once.
  ASSERT_EQ(b.staging_estimate_bytes, a.staging_estimate_bytes);
  ASSERT_EQ(c.staging_estimate_bytes, a.staging_estimate_bytes);
  // Without the always-resident modules (3.4 GiB) the room grows by their bytes less their
  // small tensors, which now move once.
  ASSERT_GT(a.always_resident_bytes, 3 * kGB);
  EXPECT_EQ(b.always_resident_bytes, 0);
  EXPECT_EQ(b.resident_budget_bytes - a.resident_budget_bytes,
            a.always_resident_bytes - (b.move_once_bytes - a.move_once_bytes));
  // More move-once bytes (4.7 GiB) leave less room.
  ASSERT_GT(c.move_once_bytes, a.move_once_bytes + kGB);
  EXPECT_EQ(c.always_resident_bytes, a.always_resident_bytes);
  EXPECT_EQ(a.resident_budget_bytes - c.resident_budget_bytes,
            c.move_once_bytes - a.move_once_bytes);
}

}  // namespace
}  // namespace ddo::core
