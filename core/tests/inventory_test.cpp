#include "ddo/core/inventory.h"

#include <gtest/gtest.h>

#include "ddo/core/packed_format.h"

namespace ddo::core {
namespace {

ModelInventory small_inventory() {
  ModelInventory inv;
  inv.model_class = "demo::TinyDiT";
  inv.modules.push_back({"", "TinyDiT", ModuleKind::kOther, false, {}});
  inv.modules.push_back({"blocks.0.proj",
                         "Linear",
                         ModuleKind::kLinear,
                         true,
                         {{"weight", {64, 32}, "bfloat16", 4096, true, true, false},
                          {"bias", {64}, "bfloat16", 128}}});
  ModuleInfo q{"blocks.0.q", "SDNQLinear", ModuleKind::kPacked, true, {}, "sdnq"};
  TensorInfo packed{"weight", {64, 16}, "uint8", 1024};
  packed.packed_role = PackedRole::kPackedWeight;
  TensorInfo scale{"scale", {64, 1, 1}, "bfloat16", 128, false};
  scale.packed_role = PackedRole::kScale;
  scale.on_device = true;
  q.tensors = {packed, scale};
  inv.modules.push_back(q);
  return inv;
}

TEST(Inventory, TotalsAndLookup) {
  const ModelInventory inv = small_inventory();
  EXPECT_EQ(inv.total_bytes(), 4096 + 128 + 1024 + 128);
  ASSERT_NE(inv.find_module("blocks.0.q"), nullptr);
  EXPECT_EQ(inv.find_module("blocks.0.q")->kind, ModuleKind::kPacked);
  EXPECT_EQ(inv.find_module("blocks.0.q")->bytes(), 1152);
  EXPECT_EQ(inv.find_module("missing"), nullptr);
  EXPECT_EQ(inv.module_index(""), 0u);
}

TEST(Inventory, JsonRoundTrip) {
  const ModelInventory inv = small_inventory();
  const nlohmann::json j = inv.to_json();
  EXPECT_EQ(j["modules"][2]["tensors"][1]["packed_role"], "scale");
  EXPECT_EQ(j["modules"][2]["kind"], "packed");
  EXPECT_EQ(j["modules"][2]["packed_format"], "sdnq");
  EXPECT_EQ(j["modules"][1]["kind"], "linear");
  EXPECT_FALSE(j["modules"][1].contains("packed_format"));  // dense modules leave it out
  ModelInventory back;
  ASSERT_TRUE(ModelInventory::from_json(j, &back).ok());
  EXPECT_EQ(back, inv);
  // Through text as well.
  ModelInventory again;
  ASSERT_TRUE(ModelInventory::from_json(nlohmann::json::parse(j.dump()), &again).ok());
  EXPECT_EQ(again, inv);
}

TEST(Inventory, OptionalFieldsDefault) {
  const nlohmann::json j = nlohmann::json::parse(R"({
    "model_class": "M",
    "modules": [{"name": "", "is_leaf": false},
                {"name": "fc", "kind": "linear", "tensors": [{"name": "weight", "bytes": 8}]}]
  })");
  ModelInventory inv;
  ASSERT_TRUE(ModelInventory::from_json(j, &inv).ok());
  const TensorInfo& t = inv.modules[1].tensors[0];
  EXPECT_TRUE(t.is_parameter);
  EXPECT_FALSE(t.already_pinned);
  EXPECT_EQ(t.packed_role, PackedRole::kNone);
  EXPECT_EQ(inv.modules[0].kind, ModuleKind::kOther);
}

TEST(Inventory, BadJsonIsRejectedWithAReason) {
  ModelInventory out;
  Status s = ModelInventory::from_json(nlohmann::json::array(), &out);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  s = ModelInventory::from_json(
      nlohmann::json::parse(R"({"modules": [{"name": "a", "kind": "lstm"}]})"), &out);
  EXPECT_NE(s.message().find("lstm"), std::string::npos);
  EXPECT_NE(s.message().find("packed"), std::string::npos);  // lists the valid kinds
  s = ModelInventory::from_json(
      nlohmann::json::parse(R"({"modules": [{"name": "a"}, {"name": "a"}]})"), &out);
  EXPECT_NE(s.message().find("twice"), std::string::npos);
  s = ModelInventory::from_json(
      nlohmann::json::parse(
          R"({"modules": [{"name": "a", "tensors": [{"name": "w", "bytes": -1}]}]})"),
      &out);
  EXPECT_NE(s.message().find("bytes=-1"), std::string::npos);
  s = ModelInventory::from_json(
      nlohmann::json::parse(
          R"({"modules": [{"name": "a", "tensors": [{"name": "w", "bytes": "x"}]}]})"),
      &out);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(out.modules.empty());
}

TEST(Inventory, IsWithin) {
  EXPECT_TRUE(is_within("a.b.c", "a.b"));
  EXPECT_TRUE(is_within("a.b", "a.b"));
  EXPECT_TRUE(is_within("a.b", ""));
  EXPECT_FALSE(is_within("a.bc", "a.b"));
  EXPECT_FALSE(is_within("a", "a.b"));
}

}  // namespace
}  // namespace ddo::core

namespace ddo::core {
namespace {

// SDNQ's spellings of existing inventory files read as the packed kind: kind "sdnq" is a packed
// layer of format "sdnq", "sdnq_role" its roles, svd_up and svd_down the low-rank factors.
TEST(Inventory, SdnqSpellingsReadAsPackedLayers) {
  const nlohmann::json j = nlohmann::json::parse(R"({
    "modules": [{"name": "q", "kind": "sdnq", "tensors": [
        {"name": "weight", "bytes": 8, "sdnq_role": "packed_weight"},
        {"name": "svd_up", "bytes": 4, "sdnq_role": "svd_up"},
        {"name": "svd_down", "bytes": 4, "packed_role": "svd_down"}]}]
  })");
  ModelInventory inv;
  ASSERT_TRUE(ModelInventory::from_json(j, &inv).ok());
  const ModuleInfo& q = inv.modules[0];
  EXPECT_EQ(q.kind, ModuleKind::kPacked);
  EXPECT_EQ(q.packed_format, "sdnq");
  EXPECT_EQ(q.tensors[0].packed_role, PackedRole::kPackedWeight);
  EXPECT_EQ(q.tensors[1].packed_role, PackedRole::kLowRankUp);
  EXPECT_EQ(q.tensors[2].packed_role, PackedRole::kLowRankDown);
  EXPECT_TRUE(inv.has_packed_layers());
  // Written back in the format-neutral spelling, which reads back the same.
  EXPECT_EQ(inv.to_json()["modules"][0]["tensors"][1]["packed_role"], "low_rank_up");
  ModelInventory back;
  ASSERT_TRUE(ModelInventory::from_json(inv.to_json(), &back).ok());
  EXPECT_EQ(back, inv);
  ModuleKind kind{};
  ASSERT_TRUE(parse_module_kind("sdnq", &kind).ok());  // the Python gatherer's kind
  EXPECT_EQ(kind, ModuleKind::kPacked);
}

// Note [Dequantized temporaries]: out * in values from the packed weight (the values one element
// holds are the format's registered fact), at the caller's bytes per value; only packed layers
// count, and a format nobody registered counts one value per element.
TEST(InventoryTest, LargestPackedTemporaryBoundsTheDequantizedWeight) {
  PackedFormat two_per_byte;
  two_per_byte.name = "test_two_per_byte";
  two_per_byte.roles = {{"weight", PackedRole::kPackedWeight}, {"scale", PackedRole::kScale}};
  two_per_byte.values_per_element = {{"uint8", 2}};
  ASSERT_TRUE(register_packed_format(two_per_byte).ok());
  ModelInventory inv;
  ModuleInfo uint4;
  uint4.name = "a";
  uint4.kind = ModuleKind::kPacked;
  uint4.packed_format = two_per_byte.name;
  uint4.tensors = {{.name = "weight",
                    .shape = {2048, 256},
                    .dtype = "uint8",
                    .bytes = 2048 * 256,
                    .packed_role = PackedRole::kPackedWeight},
                   {.name = "scale",
                    .shape = {2048, 1},
                    .dtype = "float32",
                    .bytes = 2048 * 4,
                    .packed_role = PackedRole::kScale}};
  ModuleInfo fp8 = uint4;
  fp8.name = "b";
  fp8.tensors = {{.name = "weight",
                  .shape = {512, 512},
                  .dtype = "float8_e4m3fn",
                  .bytes = 512 * 512,
                  .packed_role = PackedRole::kPackedWeight}};
  ModuleInfo dense;
  dense.name = "c";
  dense.kind = ModuleKind::kLinear;
  dense.tensors = {
      {.name = "weight", .shape = {8192, 8192}, .dtype = "bfloat16", .bytes = 8192 * 8192 * 2}};
  inv.modules = {dense};
  EXPECT_EQ(inv.largest_packed_temporary_bytes(2), 0);
  inv.modules = {uint4, fp8, dense};
  EXPECT_EQ(inv.largest_packed_temporary_bytes(2), 2048 * 512 * 2);
  EXPECT_EQ(inv.largest_packed_temporary_bytes(10), 2048 * 512 * 10);
  inv.modules[0].packed_format = "test_unregistered";
  EXPECT_EQ(inv.largest_packed_temporary_bytes(2), 2048 * 256 * 2);  // uint4 layer: one per byte
}

TEST(InventoryTest, WeightsSummaryNamesTheStoredFormatsPackedFirst) {
  auto module = [](std::string name, ModuleKind kind, std::vector<TensorInfo> tensors) {
    ModuleInfo m;
    m.name = std::move(name);
    m.kind = kind;
    m.tensors = std::move(tensors);
    if (kind == ModuleKind::kPacked) m.packed_format = "sdnq";
    return m;
  };
  auto tensor = [](std::string name, std::string dtype, PackedRole role = PackedRole::kNone) {
    TensorInfo t;
    t.name = std::move(name);
    t.dtype = std::move(dtype);
    t.packed_role = role;
    return t;
  };
  ModelInventory inv;
  inv.modules.push_back(module("norm", ModuleKind::kOther, {tensor("weight", "float32")}));
  inv.modules.push_back(
      module("a", ModuleKind::kLinear, {tensor("weight", "bfloat16"), tensor("bias", "float32")}));
  EXPECT_EQ(inv.weights_summary(), "bfloat16");
  inv.modules.push_back(module("b", ModuleKind::kPacked,
                               {tensor("weight", "float8_e4m3fn", PackedRole::kPackedWeight),
                                tensor("scale", "float32", PackedRole::kScale)}));
  inv.modules.push_back(
      module("c", ModuleKind::kPacked, {tensor("weight", "int8", PackedRole::kPackedWeight)}));
  EXPECT_EQ(inv.weights_summary(), "sdnq float8_e4m3fn + sdnq int8 + bfloat16");
  EXPECT_EQ(ModelInventory().weights_summary(), "");
}

}  // namespace
}  // namespace ddo::core
