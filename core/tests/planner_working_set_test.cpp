// The working set on small cards (issue: every cap down to 3 GiB): the one staging rule
// (Note [Working set]), always-resident modules that yield when the card cannot hold them
// (Note [Always-resident fits the card]), and the grain each unit streams at.
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddo/core/planner.h"
#include "ddo/core/presets.h"
#include "ddo/core/working_set.h"
#include "planner_test_util.h"

namespace ddo::core {
namespace {

using planner_test::decision;
using planner_test::flux_inventory;
using planner_test::kGB;
using planner_test::linear_config;
using planner_test::module;

constexpr std::int64_t kMB = std::int64_t{1} << 20;
constexpr std::int64_t kH = 3072;                        // FLUX.1 hidden size
constexpr std::int64_t kProjOut = 5 * kH * kH * 2;       // a single block's proj_out weight
constexpr std::int64_t kDoubleBlock = 36 * kH * kH * 2;  // planner_test::double_block_bytes
constexpr std::int64_t kLargest = 6 * kH * kH * 2;       // a double block's norm1.linear weight

TEST(WorkingSet, DefaultWindowPlusTwoUnits) {
  StagingRequest r;
  r.largest_unit_bytes = 100 * kMB;
  r.streamed_bytes = 20 * kGB;
  StagingSize s = size_staging(r);
  EXPECT_EQ(s.window_bytes, kDefaultPrefetchWindowBytes);
  EXPECT_EQ(s.staging_bytes, kDefaultPrefetchWindowBytes + 200 * kMB);
}

TEST(WorkingSet, WindowNeverAboveWhatIsStreamedNorBelowOneUnit) {
  StagingRequest r;
  r.largest_unit_bytes = 10 * kMB;
  r.streamed_bytes = 50 * kMB;
  EXPECT_EQ(size_staging(r).window_bytes, 50 * kMB);
  r.streamed_bytes = 4 * kMB;  // inconsistent input still gives a window of one unit
  EXPECT_EQ(size_staging(r).window_bytes, 10 * kMB);
}

TEST(WorkingSet, RoomBoundsTheWindowToHalfOfWhatTheTwoUnitsLeave) {
  StagingRequest r;
  r.largest_unit_bytes = 100 * kMB;
  r.streamed_bytes = 20 * kGB;
  r.room_bytes = 600 * kMB;
  StagingSize s = size_staging(r);
  EXPECT_EQ(s.window_bytes, 200 * kMB);  // (600 - 2 x 100) / 2
  EXPECT_EQ(s.staging_bytes, 400 * kMB);
  r.room_bytes = 150 * kMB;  // not even two units: the smallest working set, one unit ahead
  s = size_staging(r);
  EXPECT_EQ(s.window_bytes, 100 * kMB);
  EXPECT_EQ(s.staging_bytes, min_staging_bytes(100 * kMB));
}

TEST(WorkingSet, RequestsWinAndGroupRoutesPrefetchOneUnit) {
  StagingRequest r;
  r.largest_unit_bytes = 100 * kMB;
  r.streamed_bytes = 20 * kGB;
  r.one_unit_ahead = true;
  EXPECT_EQ(size_staging(r).window_bytes, 100 * kMB);
  EXPECT_EQ(size_staging(r).staging_bytes, 300 * kMB);
  r.window_bytes = 64 * kMB;
  r.staging_bytes = 1 * kGB;
  EXPECT_EQ(size_staging(r).window_bytes, 64 * kMB);
  EXPECT_EQ(size_staging(r).staging_bytes, 1 * kGB);
}

DynamicOffloadConfig auto_config() {
  DynamicOffloadConfig c;
  PresetInfo info;
  EXPECT_TRUE(apply_preset("auto", &c, &info).ok());
  return c;
}

Plan flux_plan(double card_gb, DynamicOffloadConfig config = auto_config()) {
  PlanContext ctx;
  ctx.total_vram_bytes = 140 * kGB;  // the H200, capped
  config.vram_cap_gb = card_gb;
  return make_plan(flux_inventory({.h = kH}), config, ctx);
}

// What the plan puts on the card beside the activations.
std::int64_t device_bytes(const Plan& plan) {
  return plan.always_resident_bytes + plan.resident_used_bytes + plan.move_once_bytes +
         plan.staging_estimate_bytes;
}

TEST(AlwaysResidentFit, LargeCardsKeepEveryAlwaysResidentModule) {
  const Plan plan = flux_plan(24);
  EXPECT_FALSE(plan.has_decision("always_resident_fit"));
  EXPECT_TRUE(module(plan, "single_transformer_blocks.37.proj_out").always_resident);
  EXPECT_GT(plan.always_resident_bytes, 38 * kProjOut);
}

TEST(AlwaysResidentFit, SmallCardsStreamTheLargestAlwaysResidentModules) {
  for (double card : {4.0, 6.0}) {
    SCOPED_TRACE(card);
    const Plan plan = flux_plan(card);
    const std::int64_t total = static_cast<std::int64_t>(card * kGB);
    const Decision& d = decision(plan, "always_resident_fit");
    const std::int64_t demoted = d.inputs["demoted_bytes"];
    EXPECT_GT(demoted, 0);
    EXPECT_EQ(demoted % kProjOut, 0) << "the single-block proj_out weights go first";
    // What stays fits the card after the headroom, with the staging the engine will hold.
    EXPECT_LE(device_bytes(plan), total - balanced_headroom_bytes(total));
    // The demoted modules stream, one unit per weight; small tensors stay on the device.
    const ModulePlan& last = module(plan, "single_transformer_blocks.37.proj_out");
    EXPECT_FALSE(last.always_resident);
    EXPECT_EQ(last.tensors[0].action, TensorAction::kStream);
    EXPECT_EQ(last.tensors[1].action, TensorAction::kMoveOnce);
    // The top-level always-resident modules are smaller than any proj_out and stay.
    EXPECT_TRUE(module(plan, "norm_out.linear").always_resident);
    EXPECT_TRUE(module(plan, "proj_in").always_resident);
  }
  // The later blocks give theirs up first; a 6 GiB card keeps some.
  const Plan six = flux_plan(6);
  EXPECT_TRUE(module(six, "single_transformer_blocks.0.proj_out").always_resident);

  // 3 GiB: the table's 2.5 GiB headroom leaves less than the staging ring itself, so every
  // always-resident weight streams and nothing else is resident. Whether the ring fits is the
  // adapter's call, against the device as it is (its window shrinks to the room it finds).
  const Plan three = flux_plan(3);
  for (const ModulePlan& m : three.modules) {
    if (!m.always_resident) continue;
    for (const TensorPlan& t : m.tensors) EXPECT_NE(t.action, TensorAction::kStream) << m.name;
  }
  EXPECT_FALSE(module(three, "single_transformer_blocks.0.proj_out").always_resident);
  EXPECT_FALSE(module(three, "norm_out.linear").always_resident);
  EXPECT_EQ(three.resident_used_bytes, 0);
  EXPECT_LT(three.always_resident_bytes, kGB / 64) << "only tensors that cannot stream stay";
}

TEST(AlwaysResidentFit, DemotedWeightsCountInTheirBlocksForResidency) {
  // At 6 GiB some proj_out weights stream: a single block that keeps no always-resident part
  // costs its proj_out too when it is a resident candidate.
  const Plan plan = flux_plan(6);
  const Decision& units = decision(plan, "stream_units");
  EXPECT_EQ(units.inputs["largest_unit_bytes"], kLargest);
  std::int64_t streamed_proj_out = 0;
  for (const StreamUnit& u : plan.stream_units) {
    if (u.name.find(".proj_out.weight") != std::string::npos) streamed_proj_out += u.bytes;
  }
  EXPECT_EQ(streamed_proj_out, decision(plan, "always_resident_fit").inputs["demoted_bytes"]);
}

TEST(AlwaysResidentFit, UnknownCardSizeKeepsThePatternAsWritten) {
  DynamicOffloadConfig config = auto_config();
  const Plan plan = make_plan(flux_inventory({.h = kH}), config, PlanContext{});
  EXPECT_FALSE(plan.has_decision("always_resident_fit"));
}

TEST(StreamGrain, DynamicRouteStreamsTensors) {
  const Plan plan = flux_plan(8);
  for (const StreamUnit& u : plan.stream_units) EXPECT_EQ(u.grain, "tensor") << u.name;
  const Decision& d = decision(plan, "stream_grain");
  EXPECT_EQ(d.inputs["units_by_grain"]["tensor"], plan.stream_units.size());
  EXPECT_EQ(plan.to_json()["stream_units"][0]["grain"], "tensor");
  const Decision& ws = decision(plan, "working_set");
  EXPECT_EQ(ws.inputs["unit"], "tensor");
  EXPECT_EQ(ws.inputs["staging_bytes"], kDefaultPrefetchWindowBytes + 2 * kLargest);
}

TEST(StreamGrain, BlockRouteSplitsBlocksTheCardCannotStage) {
  DynamicOffloadConfig config;
  PresetInfo info;
  ASSERT_TRUE(apply_preset("diffusers_offload_compat", &config, &info).ok());
  const Plan large = flux_plan(24, config);
  EXPECT_EQ(decision(large, "working_set").inputs["unit"], "block");
  EXPECT_EQ(decision(large, "working_set").inputs["staging_bytes"], 3 * kDoubleBlock);
  EXPECT_GT(decision(large, "stream_grain").inputs["units_by_grain"]["block"], 0);
  EXPECT_FALSE(decision(large, "stream_grain").inputs["units_by_grain"].contains("leaf") &&
               decision(large, "stream_grain").inputs["units_by_grain"]["leaf"] > 10);

  const Plan small = flux_plan(3, config);
  const Decision& d = decision(small, "stream_grain");
  EXPECT_FALSE(d.inputs["units_by_grain"].contains("block"));
  EXPECT_NE(d.detail.find("split into modules"), std::string::npos) << d.detail;
  std::int64_t largest = 0;
  for (const StreamUnit& u : small.stream_units) largest = std::max(largest, u.bytes);
  EXPECT_EQ(largest, kLargest) << "one module: norm1.linear's weight (its bias is moved once)";
}

}  // namespace
}  // namespace ddo::core
