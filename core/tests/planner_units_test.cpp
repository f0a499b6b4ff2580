// Planner tests: streamable tensors, stream units, modes and routes (planner_units.cpp).
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

TEST(PlannerPatterns, SmallTensorsMoveOnce) {
  DynamicOffloadConfig config = linear_config();
  Plan plan = make_plan(flux_inventory(), config, {});
  const ModulePlan& q = module(plan, "transformer_blocks.4.attn.to_q");
  EXPECT_EQ(q.placement, Placement::kStreamed);
  EXPECT_EQ(q.tensors[0].action, TensorAction::kStream);    // 32 KiB weight
  EXPECT_EQ(q.tensors[1].action, TensorAction::kMoveOnce);  // bias
  EXPECT_EQ(module(plan, "transformer_blocks.4.attn.norm_q").placement, Placement::kDeviceOnce);

  // At the threshold a weight is small: h*h*2 = 32 KiB.
  config.small_tensor_threshold_bytes = 128 * 128 * 2;
  plan = make_plan(flux_inventory(), config, {});
  EXPECT_EQ(module(plan, "transformer_blocks.4.attn.to_q").placement, Placement::kDeviceOnce);
  EXPECT_EQ(module(plan, "transformer_blocks.4.ff.net.2").tensors[0].action,
            TensorAction::kStream);  // 4 h^2 is above it
  const Decision& d = decision(plan, "small_tensor");
  EXPECT_EQ(d.inputs["threshold_bytes"], 128 * 128 * 2);
  // Attention h*h weights, time_embed.linear_2, and proj_in / proj_out (64 * h * 2 bytes).
  EXPECT_EQ(d.inputs["tensors"], 19 * 8 + 38 * 3 + 1 + 2);
}

TEST(PlannerPatterns, ConvAndEmbeddingWeightsStream) {
  ModelInventory inv;
  inv.model_class = "UNet";
  inv.modules.push_back({"", "UNet", ModuleKind::kOther, false, {}});
  inv.modules.push_back(
      {"conv", "Conv2d", ModuleKind::kConv, true, {{"weight", {64, 64, 3, 3}, "bfloat16", 73728}}});
  inv.modules.push_back({"emb",
                         "Embedding",
                         ModuleKind::kEmbedding,
                         true,
                         {{"weight", {1000, 64}, "bfloat16", 128000}}});
  inv.modules.push_back(
      {"flat", "Conv1d", ModuleKind::kConv, true, {{"weight", {64, 640}, "bfloat16", 81920}}});
  const Plan plan = make_plan(inv, linear_config(), {});
  EXPECT_EQ(module(plan, "conv").tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(module(plan, "emb").tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(module(plan, "flat").tensors[0].action, TensorAction::kMoveOnce);  // ndim 2 conv
}

TEST(PlannerPacked, OneUnitPerLayerAndSmallAuxiliariesTravelWithTheirWeight) {
  // h = 128, SDNQ uint4 group 64: each scale is 128*2*2 = 512 bytes, far under the threshold, yet
  // it streams with its packed weight in one unit (Note [Packed layer units]).
  const ModelInventory inv = flux_inventory({.double_blocks = 2, .single_blocks = 2, .sdnq = true});
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kPackedRuntime;
  config.small_tensor_threshold_bytes = 4096;
  config.resident_module_patterns.clear();
  const Plan plan = make_plan(inv, config, {});
  const ModulePlan& q = module(plan, "transformer_blocks.1.attn.to_q");
  EXPECT_EQ(q.tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[1].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[2].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[3].action, TensorAction::kMoveOnce);  // bias: no packed role
  const auto unit =
      std::find_if(plan.stream_units.begin(), plan.stream_units.end(),
                   [](const StreamUnit& u) { return u.name == "transformer_blocks.1.attn.to_q"; });
  ASSERT_NE(unit, plan.stream_units.end());
  ASSERT_EQ(unit->tensors.size(), 3u);
  EXPECT_EQ(unit->grain, "packed_layer");
  const ModuleInfo& info = *inv.find_module("transformer_blocks.1.attn.to_q");
  EXPECT_EQ(unit->bytes, info.tensors[0].bytes + info.tensors[1].bytes + info.tensors[2].bytes);
  std::int64_t total = 0;
  for (const StreamUnit& u : plan.stream_units) total += u.bytes;
  EXPECT_EQ(total, plan.streamed_bytes);

  // A layer whose role bytes are all at or under the threshold moves once, whole.
  config.small_tensor_threshold_bytes = 1 << 20;
  const Plan small = make_plan(inv, config, {});
  for (const TensorPlan& t : module(small, "transformer_blocks.1.attn.to_q").tensors) {
    EXPECT_EQ(t.action, TensorAction::kMoveOnce);
  }
}

TEST(PlannerPacked, RuntimeFollowsTheModel) {
  const ModelInventory quantized =
      flux_inventory({.double_blocks = 2, .single_blocks = 2, .sdnq = true});
  const ModelInventory dense = flux_inventory({.double_blocks = 2, .single_blocks = 2});
  EXPECT_EQ(resolve_execution_mode(ExecutionMode::kLinearRuntime, quantized),
            ExecutionMode::kPackedRuntime);
  EXPECT_EQ(resolve_execution_mode(ExecutionMode::kLinearRuntime, dense),
            ExecutionMode::kLinearRuntime);
  EXPECT_EQ(resolve_execution_mode(ExecutionMode::kPlan, quantized), ExecutionMode::kPlan);

  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kLinearRuntime;
  const Plan plan = make_plan(quantized, config, {});
  EXPECT_TRUE(plan.packed);
  EXPECT_EQ(plan.mode, ExecutionMode::kPackedRuntime);
  EXPECT_EQ(decision(plan, "sdnq_runtime_auto").inputs["requested"], "linear_runtime");

  config.execution_mode = ExecutionMode::kPackedRuntime;
  try {
    make_plan(dense, config, {});
    FAIL() << "sdnq_runtime on a dense model must be an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("has none; use linear_runtime"), std::string::npos)
        << e.what();
  }
}

TEST(PlannerUnits, DynamicBlockAndLeafUnits) {
  const ModelInventory inv = flux_inventory({.double_blocks = 3, .single_blocks = 4});
  DynamicOffloadConfig config = linear_config();
  config.resident_module_patterns.clear();
  Plan plan = make_plan(inv, config, {});
  std::size_t streamed_tensors = 0;
  for (const ModulePlan& m : plan.modules) {
    for (const TensorPlan& t : m.tensors) streamed_tensors += t.action == TensorAction::kStream;
  }
  EXPECT_EQ(plan.stream_units.size(), streamed_tensors);
  EXPECT_EQ(plan.stream_units.front().name, "transformer_blocks.0.norm1.linear.weight");

  config.route = Route::kGroupBlock;
  plan = make_plan(inv, config, {});
  // One unit per block of every repeated block list (classic block-level offload groups each
  // list's children), never a whole list as one unit.
  ASSERT_EQ(plan.stream_units.size(), 3u + 4u);
  EXPECT_EQ(plan.stream_units[0].name, "transformer_blocks.0");
  EXPECT_EQ(plan.stream_units[2].name, "transformer_blocks.2");
  EXPECT_EQ(plan.stream_units[3].name, "single_transformer_blocks.0");
  EXPECT_EQ(plan.stream_units[6].name, "single_transformer_blocks.3");
  EXPECT_EQ(plan.stream_units[0].bytes, double_block_bytes(128));
  std::int64_t total = 0;
  for (const StreamUnit& u : plan.stream_units) total += u.bytes;
  EXPECT_EQ(total, plan.streamed_bytes);

  config.route = Route::kGroupLeaf;
  plan = make_plan(inv, config, {});
  EXPECT_EQ(plan.stream_units.size(), streamed_tensors);  // one weight per streamed leaf here
  EXPECT_EQ(plan.stream_units[0].name, "transformer_blocks.0.norm1.linear");
  EXPECT_EQ(decision(plan, "stream_units").inputs["route"], "group_leaf");
}

TEST(PlannerModes, PlanModeReportsWithoutExecuting) {
  DynamicOffloadConfig config = linear_config();
  config.execution_mode = ExecutionMode::kPlan;
  config.resident_module_budget_gb = 1.0;
  Plan plan = make_plan(flux_inventory(), config, {});
  EXPECT_FALSE(plan.execute);
  EXPECT_EQ(decision(plan, "plan_mode").inputs["classified_as"], "linear_runtime");
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks").size(), 19u);
  plan = make_plan(flux_inventory({.sdnq = true}), config, {});
  EXPECT_TRUE(plan.packed);
  EXPECT_TRUE(make_plan(flux_inventory(), linear_config(), {}).execute);
}

TEST(PlannerModes, DeviceMoveAndNoneRoutes) {
  DynamicOffloadConfig config = linear_config();
  config.route = Route::kDeviceMove;
  const ModelInventory inv = flux_inventory({.double_blocks = 2, .single_blocks = 2});
  Plan plan = make_plan(inv, config, {});
  EXPECT_EQ(plan.move_once_bytes, inv.total_bytes());
  EXPECT_TRUE(plan.stream_units.empty());
  EXPECT_TRUE(plan.has_decision("route_device_move"));
  config.route = Route::kNone;
  plan = make_plan(inv, config, {});
  EXPECT_EQ(plan.skipped_bytes, inv.total_bytes());
}

}  // namespace
}  // namespace ddo::core
