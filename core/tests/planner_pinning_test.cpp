// Planner tests: pin admission (linear and packed layers) (planner_pinning.cpp).
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

TEST(PlannerPin, PinAllWhenRamAdmitsIt) {
  const ModelInventory inv = flux_inventory({.h = 3072});
  PlanContext ctx;
  ctx.available_ram_bytes = 64 * kGB;
  const Plan plan = make_plan(inv, pin_config(), ctx);
  EXPECT_GT(plan.pin_candidate_bytes, 15 * kGB);
  EXPECT_EQ(plan.pinned_bytes, plan.pin_candidate_bytes);
  const Decision& d = decision(plan, "pin_all");
  EXPECT_EQ(d.inputs["usable_bytes"], 58 * kGB);
  EXPECT_TRUE(plan.has_decision("full_pin_zero_resident"));
  for (const ModulePlan& m : plan.modules) {
    for (const TensorPlan& t : m.tensors) EXPECT_EQ(t.pin, t.action == TensorAction::kStream);
  }
}

TEST(PlannerPin, TieredWhenRamIsShortAndSkipWhenItIsGone) {
  const ModelInventory inv = flux_inventory({.h = 3072});
  DynamicOffloadConfig config = pin_config();
  PlanContext ctx;
  ctx.available_ram_bytes = 6 * kGB + 10 * kGB;  // usable 10 GiB, candidates ~17 GiB: 75%
  Plan plan = make_plan(inv, config, ctx);
  const std::int64_t candidates = plan.pin_candidate_bytes;
  ASSERT_GT(candidates, 16 * kGB);
  const Decision& d = decision(plan, "pin_tiered");
  EXPECT_DOUBLE_EQ(d.inputs["tier_ratio"].get<double>(), 0.75);
  EXPECT_EQ(plan.pin_budget_bytes, 10 * kGB);  // min(75% of candidates, usable)
  EXPECT_LE(plan.pinned_bytes, plan.pin_budget_bytes);
  EXPECT_GT(plan.pinned_bytes, 9 * kGB);
  EXPECT_FALSE(plan.has_decision("full_pin_zero_resident"));

  ctx.available_ram_bytes = 5 * kGB;  // usable < 0
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pinned_bytes, 0);
  EXPECT_EQ(decision(plan, "skip_insufficient_ram").inputs["usable_bytes"], -kGB);

  ctx.available_ram_bytes = 6 * kGB + kGB / 2;  // 0.5 GiB usable: too small to be worth it
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pinned_bytes, 0);
  EXPECT_TRUE(plan.has_decision("skip_insufficient_ram"));

  // The configured RAM simulates a smaller machine and wins over the detected figure.
  config.available_system_ram_gb = 5.0;
  ctx.available_ram_bytes = 512 * kGB;
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(decision(plan, "skip_insufficient_ram").inputs["available_source"],
            "available_system_ram_gb");
}

TEST(PlannerPin, TiersBySizeOfCandidates) {
  // 12 GiB of candidates (85% tier) with usable RAM just short of candidates + resident.
  InventoryBuilder b("M");
  b.container("");
  for (int i = 0; i < 12; ++i) b.linear("blocks." + std::to_string(i), 16384, 32768, false);
  const ModelInventory inv = b.take();
  DynamicOffloadConfig config = pin_config();
  PlanContext ctx;
  ctx.available_ram_bytes = 6 * kGB + 11 * kGB;
  const Plan plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_candidate_bytes, 12 * kGB);
  EXPECT_DOUBLE_EQ(decision(plan, "pin_tiered").inputs["tier_ratio"].get<double>(), 0.85);
  EXPECT_EQ(plan.pin_budget_bytes, static_cast<std::int64_t>(0.85 * 12 * kGB));
  EXPECT_EQ(plan.pinned_bytes, 10 * kGB);  // whole 1 GiB weights under the 10.2 GiB budget
}

TEST(PlannerPin, SnapsToFullAt95PercentButNeverPastTheMaximum) {
  const ModelInventory inv = flux_inventory();
  DynamicOffloadConfig config = pin_config();
  PlanContext ctx;
  ctx.available_ram_bytes = 512 * kGB;
  config.pin_weight_budget_ratio = 0.96;
  Plan plan = make_plan(inv, config, ctx);
  EXPECT_TRUE(plan.has_decision("pin_budget_explicit"));
  EXPECT_TRUE(plan.has_decision("pin_snap_95"));
  EXPECT_EQ(plan.pinned_bytes, plan.pin_candidate_bytes);

  config.pin_weight_budget_ratio = 0.5;
  plan = make_plan(inv, config, ctx);
  EXPECT_FALSE(plan.has_decision("pin_snap_95"));
  EXPECT_LE(plan.pinned_bytes, plan.pin_candidate_bytes / 2);
  EXPECT_GT(plan.pinned_bytes, 0);

  // Ratio above 1 is clamped.
  config.pin_weight_budget_ratio = 3.0;
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(decision(plan, "pin_budget_explicit").inputs["ratio_clamped"], 1.0);
  EXPECT_EQ(plan.pinned_bytes, plan.pin_candidate_bytes);

  config.pin_weight_budget_ratio = 0;
  config.max_pin_weight_budget_gb = bytes_to_gib(plan.pin_candidate_bytes * 97 / 100);
  plan = make_plan(inv, config, ctx);
  EXPECT_FALSE(plan.has_decision("pin_snap_95"));
  EXPECT_LT(plan.pinned_bytes, plan.pin_candidate_bytes);
}

TEST(PlannerPin, PartialPinSelectionOrders) {
  // Four streamed weights of 2, 1, 4, 3 units (named by size); a budget of 5 units.
  InventoryBuilder b("M");
  b.container("");
  const std::int64_t unit = 64 * 1024;
  for (std::int64_t n : {2, 1, 4, 3}) b.linear("l" + std::to_string(n), n * unit / 256, 128, false);
  const ModelInventory inv = b.take();
  DynamicOffloadConfig config = pin_config();
  config.resident_module_patterns.clear();
  config.pin_weight_budget_gb = bytes_to_gib(5 * unit);
  auto pinned = [&](Selection s) {
    config.pin_weight_selection = s;
    const Plan plan = make_plan(inv, config, {});
    std::vector<std::string> out;
    for (const ModulePlan& m : plan.modules) {
      if (!m.tensors.empty() && m.tensors[0].pin) out.push_back(m.name);
    }
    return out;
  };
  // Results in model order. First: l2, l1 (l4, l3 no longer fit).
  EXPECT_EQ(pinned(Selection::kFirst), (std::vector<std::string>{"l2", "l1"}));
  // Largest: l4, then l3 and l2 do not fit, l1 does.
  EXPECT_EQ(pinned(Selection::kLargest), (std::vector<std::string>{"l1", "l4"}));
  // Spread: k = floor(5 * 4 / 10) = 2 -> indices 1, 3 (l1, l3), then l2 and l4 do not fit.
  EXPECT_EQ(pinned(Selection::kSpread), (std::vector<std::string>{"l1", "l3"}));
}

TEST(PlannerPin, DisabledByConfigOrPlatform) {
  DynamicOffloadConfig config = pin_config();
  PlanContext ctx;
  ctx.pin_allowed = false;
  Plan plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(plan.pinned_bytes, 0);
  EXPECT_EQ(decision(plan, "pin_disabled").inputs["pin_allowed"], false);
  config.pin_cpu_memory = false;
  plan = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(decision(plan, "pin_disabled").inputs["pin_cpu_memory"], false);
}

TEST(PlannerPin, LoaderPinsArePreservedAndDoNotCountAgainstNewPins) {
  ModelInventory inv = flux_inventory();
  std::int64_t loader_bytes = 0;
  for (ModuleInfo& m : inv.modules) {
    if (m.name.rfind("transformer_blocks.0.", 0) == 0 && m.kind == ModuleKind::kLinear) {
      m.tensors[0].already_pinned = true;
      loader_bytes += m.tensors[0].bytes;
    }
  }
  DynamicOffloadConfig config = pin_config();
  PlanContext ctx;
  ctx.available_ram_bytes = 512 * kGB;
  const Plan plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.loader_pinned_bytes, loader_bytes);
  EXPECT_EQ(plan.pin_candidate_bytes + loader_bytes, plan.streamed_bytes);
  EXPECT_EQ(plan.pinned_bytes, plan.pin_candidate_bytes);
  EXPECT_EQ(decision(plan, "loader_pins_preserved").inputs["bytes"], loader_bytes);
  const ModulePlan& q = module(plan, "transformer_blocks.0.attn.to_q");
  EXPECT_TRUE(q.tensors[0].loader_pinned);
  EXPECT_FALSE(q.tensors[0].pin);
}

TEST(PlannerPacked, AdmissionCountsPackedScalesAuxiliariesAndReportsLoaderExcess) {
  ModelInventory inv = flux_inventory({.h = 1024, .sdnq = true});
  // The loader pinned every packed weight of the first four double blocks.
  std::int64_t loader_bytes = 0;
  for (ModuleInfo& m : inv.modules) {
    if (m.kind != ModuleKind::kPacked) continue;
    for (int b = 0; b < 4; ++b) {
      if (m.name.rfind("transformer_blocks." + std::to_string(b) + ".", 0) != 0) continue;
      m.tensors[0].already_pinned = true;
      loader_bytes += m.tensors[0].bytes;
    }
  }
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kPackedRuntime;
  config.pin_cpu_memory = true;
  config.resident_module_patterns.clear();
  config.pin_weight_budget_gb = bytes_to_gib(loader_bytes / 2);  // ceiling below the loader's pins
  PlanContext ctx;
  ctx.available_ram_bytes = 512 * kGB;
  const Plan plan = make_plan(inv, config, ctx);
  EXPECT_TRUE(plan.packed);

  // Dense fallback Linears (the norm modulations) stay on the device and are not candidates.
  const ModulePlan& fallback = module(plan, "transformer_blocks.2.norm1.linear");
  EXPECT_EQ(fallback.placement, Placement::kDeviceOnce);
  EXPECT_EQ(fallback.tensors[0].action, TensorAction::kMoveOnce);
  // Weight and bias of 2 modulation Linears per double block, 1 per single block, and the 5
  // dense top-level Linears.
  EXPECT_EQ(decision(plan, "packed_dense_fallback_resident").inputs["tensors"],
            2 * (19 * 2 + 38 * 1 + 5));
  // Packed weights, scales and zero points of SDNQ layers stream; biases move once.
  const ModulePlan& q = module(plan, "transformer_blocks.9.attn.to_q");
  EXPECT_EQ(q.tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[1].action, TensorAction::kStream);  // scale: 1024*16*2 = 32 KiB
  EXPECT_EQ(q.tensors[2].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[3].action, TensorAction::kMoveOnce);

  const Decision& d = decision(plan, "packed_pin_admission");
  EXPECT_EQ(d.inputs["candidate_bytes"], plan.streamed_bytes);
  EXPECT_GT(d.inputs["candidate_bytes_by_role"]["packed_weight"].get<std::int64_t>(), 0);
  EXPECT_GT(d.inputs["candidate_bytes_by_role"]["scale"].get<std::int64_t>(), 0);
  EXPECT_EQ(d.inputs["ceiling_bytes"], loader_bytes / 2);
  EXPECT_EQ(plan.pin_budget_bytes, 0);  // the loader already holds more than the ceiling
  EXPECT_EQ(plan.pinned_bytes, 0);
  EXPECT_EQ(plan.loader_pinned_bytes, loader_bytes);
  EXPECT_EQ(plan.pin_excess_bytes, loader_bytes - loader_bytes / 2);
  EXPECT_EQ(decision(plan, "packed_pin_excess").inputs["excess_bytes"], plan.pin_excess_bytes);
  EXPECT_TRUE(plan.has_decision("loader_pins_preserved"));
  EXPECT_TRUE(module(plan, "transformer_blocks.0.attn.to_q").tensors[0].loader_pinned);
}

TEST(PlannerPacked, NewPinsBoundedByCeilingRatioMaximumAndRam) {
  const ModelInventory inv = flux_inventory({.h = 1024, .sdnq = true});
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kPackedRuntime;
  config.pin_cpu_memory = true;
  config.system_ram_headroom_gb = 1.0;
  PlanContext ctx;
  ctx.available_ram_bytes = 512 * kGB;
  Plan plan = make_plan(inv, config, ctx);
  const std::int64_t all = plan.streamed_bytes;
  EXPECT_EQ(plan.pinned_bytes, all);
  EXPECT_FALSE(plan.has_decision("packed_pin_excess"));
  EXPECT_TRUE(plan.has_decision("full_pin_zero_resident"));
  EXPECT_FALSE(plan.has_decision("pin_all"));  // the packed rule replaces the dense admission

  config.pin_weight_budget_ratio = 0.5;
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_budget_bytes, all / 2);
  EXPECT_LE(plan.pinned_bytes, all / 2);

  config.max_pin_weight_budget_gb = bytes_to_gib(all / 4);
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_budget_bytes, all / 4);

  ctx.available_ram_bytes = kGB + all / 8;  // usable = all / 8
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_budget_bytes, all / 8);
  EXPECT_EQ(decision(plan, "packed_pin_admission").inputs["usable_ram_bytes"], all / 8);
}

}  // namespace
}  // namespace ddo::core
