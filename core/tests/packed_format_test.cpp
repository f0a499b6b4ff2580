// Packed formats (packed_format.cpp): the registry, and a second format, defined only here, whose
// layers go through the inventory and the planner as SDNQ's do (Note [Packed formats]).
#include "ddo/core/packed_format.h"

#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddo/core/inventory.h"
#include "ddo/core/planner.h"
#include "ddo/core/units.h"
#include "planner_test_util.h"

namespace ddo::core {
namespace {

using namespace planner_test;  // module(), decision()

// An NF4-like format with names of its own: 4-bit codes two per byte, a float32 absmax per block
// of 64, a 16-entry code book, and a bias that is no part of the packed layer.
PackedFormat test_nf4() {
  PackedFormat f;
  f.name = "test_nf4";
  f.roles = {{"weight", PackedRole::kPackedWeight},
             {"absmax", PackedRole::kScale},
             {"quant_map", PackedRole::kAuxiliary}};
  f.values_per_element = {{"uint8", 2}};
  return f;
}

// The adapter's part for a format: kind kPacked, the format's name, and each tensor's role from
// the registered facts. Nothing below names SDNQ.
void add_nf4_linear(ModelInventory& inv, const std::string& name, std::int64_t out,
                    std::int64_t in) {
  const PackedFormat* format = find_packed_format("test_nf4");
  ASSERT_NE(format, nullptr);
  ModuleInfo m{name, "Linear4bit", ModuleKind::kPacked, true, {}, format->name};
  m.tensors = {{"weight", {out * in / 2, 1}, "uint8", out * in / 2},
               {"absmax", {out * in / 64}, "float32", out * in / 64 * 4},
               {"quant_map", {16}, "float32", 64},
               {"bias", {out}, "bfloat16", out * 2}};
  for (TensorInfo& t : m.tensors) t.packed_role = format->role_for(t.name);
  inv.modules.push_back(std::move(m));
}

ModelInventory nf4_model() {
  ModelInventory inv;
  inv.model_class = "demo::Nf4Model";
  inv.modules.push_back({"", "Nf4Model", ModuleKind::kOther, false, {}});
  inv.modules.push_back({"blocks", "ModuleList", ModuleKind::kOther, false, {}});
  for (int b = 0; b < 3; ++b) {
    const std::string p = "blocks." + std::to_string(b);
    inv.modules.push_back({p, "Block", ModuleKind::kOther, false, {}});
    add_nf4_linear(inv, p + ".to_q", 512, 512);
    add_nf4_linear(inv, p + ".to_out", 512, 512);
  }
  // A dense Linear the quantizer left alone: a fallback under the packed runtime.
  inv.modules.push_back({"proj_out",
                         "Linear",
                         ModuleKind::kLinear,
                         true,
                         {{"weight", {64, 512}, "bfloat16", 64 * 512 * 2}}});
  return inv;
}

TEST(PackedFormatRegistry, RegistersOnceAndRefusesOtherFactsUnderTheSameName) {
  ASSERT_TRUE(register_packed_format(test_nf4()).ok());
  ASSERT_TRUE(register_packed_format(test_nf4()).ok());  // the same facts again: a no-op
  const PackedFormat* found = find_packed_format("test_nf4");
  ASSERT_NE(found, nullptr);
  EXPECT_EQ(*found, test_nf4());
  EXPECT_EQ(found->role_for("absmax"), PackedRole::kScale);
  EXPECT_EQ(found->role_for("bias"), PackedRole::kNone);
  EXPECT_EQ(found->values_in("uint8", 10), 20);
  EXPECT_EQ(found->values_in("float8_e4m3fn", 10), 10);
  EXPECT_EQ(find_packed_format("test_missing"), nullptr);

  PackedFormat other = test_nf4();
  other.values_per_element = {{"uint8", 4}};
  const Status s = register_packed_format(other);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("test_nf4"), std::string::npos) << s.message();
  EXPECT_EQ(find_packed_format("test_nf4")->values_in("uint8", 1), 2);  // the first facts hold

  EXPECT_EQ(register_packed_format(PackedFormat{}).code(), Code::kInvalidArgument);
  PackedFormat none_role{"test_none_role", {{"bias", PackedRole::kNone}}, {}};
  EXPECT_EQ(register_packed_format(none_role).code(), Code::kInvalidArgument);
  PackedFormat zero_values{"test_zero_values", {}, {{"uint8", 0}}};
  EXPECT_EQ(register_packed_format(zero_values).code(), Code::kInvalidArgument);
}

// A second format's layers stream, pin and size their temporaries through core as SDNQ's do:
// registering its facts is all core needs.
TEST(PackedFormatRegistry, ASecondFormatGoesThroughTheInventoryAndThePlanner) {
  ASSERT_TRUE(register_packed_format(test_nf4()).ok());
  const ModelInventory inv = nf4_model();

  // The inventory: JSON round trip, the weights summary, the dequantized temporary.
  ModelInventory back;
  ASSERT_TRUE(ModelInventory::from_json(inv.to_json(), &back).ok());
  EXPECT_EQ(back, inv);
  EXPECT_TRUE(inv.has_packed_layers());
  EXPECT_EQ(inv.weights_summary(), "test_nf4 uint8 + bfloat16");
  EXPECT_EQ(inv.largest_packed_temporary_bytes(2), 512 * 512 * 2);

  // The planner: linear_runtime on a packed model takes the packed runtime.
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kLinearRuntime;
  config.resident_module_patterns.clear();
  config.pin_cpu_memory = true;
  PlanContext ctx;
  ctx.available_ram_bytes = 64 * kGB;
  const Plan plan = make_plan(inv, config, ctx);
  EXPECT_TRUE(plan.packed);
  EXPECT_EQ(plan.mode, ExecutionMode::kPackedRuntime);
  EXPECT_TRUE(plan.has_decision("sdnq_runtime_auto"));

  // Each layer is one unit of its role tensors (the 64-byte code book rides with its weight);
  // the bias moves once.
  const ModulePlan& q = module(plan, "blocks.1.to_q");
  EXPECT_EQ(q.placement, Placement::kStreamed);
  EXPECT_EQ(q.tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[1].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[2].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[3].action, TensorAction::kMoveOnce);
  const auto unit = std::find_if(plan.stream_units.begin(), plan.stream_units.end(),
                                 [](const StreamUnit& u) { return u.name == "blocks.1.to_q"; });
  ASSERT_NE(unit, plan.stream_units.end());
  EXPECT_EQ(unit->grain, "packed_layer");
  EXPECT_EQ(unit->tensors.size(), 3u);
  EXPECT_EQ(unit->bytes, 512 * 512 / 2 + 512 * 512 / 64 * 4 + 64);
  EXPECT_EQ(plan.stream_units.size(), 6u);

  // The dense fallback stays on the device; the packed admission counts by role.
  EXPECT_NE(module(plan, "proj_out").placement, Placement::kStreamed);
  EXPECT_NE(module(plan, "proj_out").tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(decision(plan, "packed_dense_fallback_resident").inputs["tensors"], 1);
  const Decision& d = decision(plan, "packed_pin_admission");
  EXPECT_EQ(d.inputs["candidate_bytes"], plan.streamed_bytes);
  EXPECT_EQ(d.inputs["candidate_bytes_by_role"]["packed_weight"], 6 * 512 * 512 / 2);
  EXPECT_EQ(d.inputs["candidate_bytes_by_role"]["scale"], 6 * 512 * 512 / 64 * 4);
  EXPECT_EQ(d.inputs["candidate_bytes_by_role"]["auxiliary"], 6 * 64);
}

}  // namespace
}  // namespace ddo::core
