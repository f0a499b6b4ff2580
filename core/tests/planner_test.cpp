#include "ddo/core/planner.h"

#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddo/core/inventory.h"

namespace ddo::core {
namespace {

constexpr std::int64_t kGB = std::int64_t{1} << 30;

double gb(std::int64_t bytes) {
  return static_cast<double>(bytes) / kGiB;
}

// Builds a FLUX-like inventory (diffusers module names) with hidden size `h`, bf16.
class InventoryBuilder {
 public:
  explicit InventoryBuilder(std::string model_class) { inv_.model_class = std::move(model_class); }

  void container(const std::string& name) {
    inv_.modules.push_back({name, "Container", ModuleKind::kOther, false, {}});
  }
  void linear(const std::string& name, std::int64_t out, std::int64_t in, bool bias = true) {
    ModuleInfo m{name, "Linear", ModuleKind::kLinear, true, {}};
    m.tensors.push_back({"weight", {out, in}, "bfloat16", out * in * 2});
    if (bias) m.tensors.push_back({"bias", {out}, "bfloat16", out * 2});
    inv_.modules.push_back(std::move(m));
  }
  void norm(const std::string& name, std::int64_t dim) {
    ModuleInfo m{name, "RMSNorm", ModuleKind::kOther, true, {}};
    m.tensors.push_back({"weight", {dim}, "bfloat16", dim * 2});
    inv_.modules.push_back(std::move(m));
  }
  // An SDNQ uint4 Linear, group 64: packed [out, in/2] bytes, scales and zero points [out, g, 1].
  void sdnq(const std::string& name, std::int64_t out, std::int64_t in, bool svd = false) {
    const std::int64_t groups = in / 64;
    ModuleInfo m{name, "SDNQLinear", ModuleKind::kSdnq, true, {}};
    TensorInfo packed{"weight", {out, in / 2}, "uint8", out * in / 2};
    packed.sdnq_role = SdnqRole::kPackedWeight;
    TensorInfo scale{"scale", {out, groups, 1}, "bfloat16", out * groups * 2};
    scale.sdnq_role = SdnqRole::kScale;
    TensorInfo zero{"zero_point", {out, groups, 1}, "bfloat16", out * groups * 2};
    zero.sdnq_role = SdnqRole::kZeroPoint;
    m.tensors = {packed, scale, zero};
    if (svd) {
      TensorInfo up{"svd_up", {out, 32}, "bfloat16", out * 32 * 2};
      up.sdnq_role = SdnqRole::kSvdUp;
      TensorInfo down{"svd_down", {32, in}, "bfloat16", 32 * in * 2};
      down.sdnq_role = SdnqRole::kSvdDown;
      m.tensors.push_back(up);
      m.tensors.push_back(down);
    }
    m.tensors.push_back({"bias", {out}, "bfloat16", out * 2});
    inv_.modules.push_back(std::move(m));
  }
  ModelInventory take() { return std::move(inv_); }

 private:
  ModelInventory inv_;
};

struct FluxShape {
  std::int64_t h = 128;  // 128: a h*h bf16 weight is 32 KiB, above the 16 KiB default threshold
  int double_blocks = 19;
  int single_blocks = 38;
  bool sdnq = false;  // block Linears SDNQ-quantized; norm1 modulation stays a dense fallback
};

ModelInventory flux_inventory(FluxShape s = {}) {
  InventoryBuilder b("FluxTransformer2DModel");
  const std::int64_t h = s.h;
  auto block_linear = [&](const std::string& name, std::int64_t out, std::int64_t in) {
    if (s.sdnq) {
      b.sdnq(name, out, in);
    } else {
      b.linear(name, out, in);
    }
  };
  b.container("");
  b.linear("proj_in", h, 64);
  b.container("time_embed");
  b.linear("time_embed.linear_1", h, 256);
  b.linear("time_embed.linear_2", h, h);
  b.container("transformer_blocks");
  for (int i = 0; i < s.double_blocks; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i);
    b.container(p);
    b.linear(p + ".norm1.linear", 6 * h, h);  // dense even under SDNQ: a fallback Linear
    b.linear(p + ".norm1_context.linear", 6 * h, h);
    b.container(p + ".attn");
    for (const char* n : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}) {
      block_linear(p + ".attn." + n, h, h);
    }
    b.norm(p + ".attn.norm_q", 128);
    block_linear(p + ".attn.to_out.0", h, h);
    block_linear(p + ".attn.to_add_out", h, h);
    for (const char* ff : {".ff", ".ff_context"}) {
      b.container(p + ff);
      b.container(p + ff + ".net");
      b.container(p + ff + ".net.0");
      block_linear(p + ff + ".net.0.proj", 4 * h, h);
      block_linear(p + ff + ".net.2", h, 4 * h);
    }
  }
  b.container("single_transformer_blocks");
  for (int i = 0; i < s.single_blocks; ++i) {
    const std::string p = "single_transformer_blocks." + std::to_string(i);
    b.container(p);
    b.linear(p + ".norm.linear", 3 * h, h);
    block_linear(p + ".proj_mlp", 4 * h, h);
    b.container(p + ".attn");
    for (const char* n : {"to_q", "to_k", "to_v"}) block_linear(p + ".attn." + n, h, h);
    block_linear(p + ".proj_out", h, 5 * h);  // matched by the default always-resident pattern
  }
  b.container("norm_out");
  b.linear("norm_out.linear", 2 * h, h);
  b.linear("proj_out", 64, h);
  return b.take();
}

// Streamable bytes of one FLUX double block (linear runtime): 36 h*h bf16 weights.
std::int64_t double_block_bytes(std::int64_t h) {
  return 36 * h * h * 2;
}

DynamicOffloadConfig linear_config() {
  DynamicOffloadConfig c;
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.resident_module_patterns = {"auto"};
  return c;
}

const ModulePlan& module(const Plan& plan, const std::string& name) {
  for (const ModulePlan& m : plan.modules) {
    if (m.name == name) return m;
  }
  ADD_FAILURE() << "no module " << name;
  return plan.modules.front();
}

std::vector<std::string> resident_blocks(const Plan& plan, const std::string& prefix) {
  std::vector<std::string> out;
  const std::regex block("^" + prefix + R"(\.[0-9]+$)");
  for (const ModulePlan& m : plan.modules) {
    if (m.placement == Placement::kResident && std::regex_search(m.name, block)) {
      out.push_back(m.name);
    }
  }
  return out;
}

const Decision& decision(const Plan& plan, const std::string& name) {
  const Decision* d = plan.find_decision(name);
  if (d == nullptr) {
    ADD_FAILURE() << "decision " << name << " not recorded; plan:\n" << plan.summary();
    static const Decision kEmpty;
    return kEmpty;
  }
  return *d;
}

// --- auto block pattern --------------------------------------------------------------------

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

// --- selection --------------------------------------------------------------------------------

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
  config.resident_module_budget_gb = gb(8 * double_block_bytes(128));
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
  Plan even = make_plan(flux_inventory(), config, {});
  EXPECT_GT(doubles, resident_blocks(even, "transformer_blocks").size());
  EXPECT_GT(doubles + singles, 0u);
  EXPECT_LE(plan.resident_used_bytes, 8 * double_block_bytes(128));
  // A candidate without a figure: spread by index, and the decision says which one.
  ctx.candidate_compute_ms.erase("single_transformer_blocks.7");
  plan = make_plan(flux_inventory(), config, ctx);
  EXPECT_EQ(decision(plan, "balanced_order").inputs["used"], false);
  EXPECT_NE(decision(plan, "balanced_order").detail.find("single_transformer_blocks.7"),
            std::string::npos);
  EXPECT_EQ(resident_blocks(plan, "transformer_blocks"),
            resident_blocks(even, "transformer_blocks"));
}

TEST(PlannerSelection, GreedyFillSkipsWhatDoesNotFitAndKeepsGoing) {
  const std::vector<std::int64_t> bytes = {5, 10, 3, 2};
  EXPECT_EQ(greedy_fill({0, 1, 2, 3}, bytes, 8), (std::vector<std::size_t>{0, 2}));
  EXPECT_EQ(greedy_fill({1, 0, 2, 3}, bytes, 12), (std::vector<std::size_t>{1, 3}));
  EXPECT_TRUE(greedy_fill({0, 1, 2, 3}, bytes, 1).empty());
}

TEST(PlannerSelection, ResidentFirstLargestSpreadInAPlan) {
  DynamicOffloadConfig config = linear_config();
  config.resident_module_budget_gb = gb(3 * double_block_bytes(128));
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
  config.resident_module_budget_gb = gb(2 * double_block_bytes(128));
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
  config.resident_module_budget_gb = gb(double_block_bytes(128) + 2 * single);
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

// --- resident budget --------------------------------------------------------------------------

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
    EXPECT_EQ(plan.staging_estimate_bytes, 2 * double_block_bytes(3072));
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
  // An 8 GiB card has less than one GiB left after the always-resident modules and staging.
  PlanContext small;
  small.total_vram_bytes = 8 * kGB;
  EXPECT_LT(make_plan(inv, config, small).resident_budget_bytes, kGB);

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

// --- always resident, skip, small ---------------------------------------------------------------

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

// Issue 18: the planner compiles patterns too, including block patterns inferred from module
// names it never validated; a crash there killed the host. Both are errors now.
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

// --- pinning ------------------------------------------------------------------------------------

DynamicOffloadConfig pin_config() {
  DynamicOffloadConfig c = linear_config();
  c.pin_cpu_memory = true;
  c.system_ram_headroom_gb = 6.0;
  return c;
}

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
  config.max_pin_weight_budget_gb = gb(plan.pin_candidate_bytes * 97 / 100);
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
  config.pin_weight_budget_gb = gb(5 * unit);
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

// --- SDNQ -------------------------------------------------------------------------------------

TEST(PlannerSdnq, AdmissionCountsPackedScalesAuxiliariesAndReportsLoaderExcess) {
  ModelInventory inv = flux_inventory({.h = 1024, .sdnq = true});
  // The loader pinned every packed weight of the first four double blocks.
  std::int64_t loader_bytes = 0;
  for (ModuleInfo& m : inv.modules) {
    if (m.kind != ModuleKind::kSdnq) continue;
    for (int b = 0; b < 4; ++b) {
      if (m.name.rfind("transformer_blocks." + std::to_string(b) + ".", 0) != 0) continue;
      m.tensors[0].already_pinned = true;
      loader_bytes += m.tensors[0].bytes;
    }
  }
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kSdnqRuntime;
  config.pin_cpu_memory = true;
  config.resident_module_patterns.clear();
  config.pin_weight_budget_gb = gb(loader_bytes / 2);  // ceiling below the loader's pins
  PlanContext ctx;
  ctx.available_ram_bytes = 512 * kGB;
  const Plan plan = make_plan(inv, config, ctx);
  EXPECT_TRUE(plan.sdnq);

  // Dense fallback Linears (the norm modulations) stay on the device and are not candidates.
  const ModulePlan& fallback = module(plan, "transformer_blocks.2.norm1.linear");
  EXPECT_EQ(fallback.placement, Placement::kDeviceOnce);
  EXPECT_EQ(fallback.tensors[0].action, TensorAction::kMoveOnce);
  // Weight and bias of 2 modulation Linears per double block, 1 per single block, and the 5
  // dense top-level Linears.
  EXPECT_EQ(decision(plan, "sdnq_dense_fallback_resident").inputs["tensors"],
            2 * (19 * 2 + 38 * 1 + 5));
  // Packed weights, scales and zero points of SDNQ layers stream; biases move once.
  const ModulePlan& q = module(plan, "transformer_blocks.9.attn.to_q");
  EXPECT_EQ(q.tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[1].action, TensorAction::kStream);  // scale: 1024*16*2 = 32 KiB
  EXPECT_EQ(q.tensors[2].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[3].action, TensorAction::kMoveOnce);

  const Decision& d = decision(plan, "sdnq_pin_admission");
  EXPECT_EQ(d.inputs["candidate_bytes"], plan.streamed_bytes);
  EXPECT_GT(d.inputs["candidate_bytes_by_role"]["packed_weight"].get<std::int64_t>(), 0);
  EXPECT_GT(d.inputs["candidate_bytes_by_role"]["scale"].get<std::int64_t>(), 0);
  EXPECT_EQ(d.inputs["ceiling_bytes"], loader_bytes / 2);
  EXPECT_EQ(plan.pin_budget_bytes, 0);  // the loader already holds more than the ceiling
  EXPECT_EQ(plan.pinned_bytes, 0);
  EXPECT_EQ(plan.loader_pinned_bytes, loader_bytes);
  EXPECT_EQ(plan.pin_excess_bytes, loader_bytes - loader_bytes / 2);
  EXPECT_EQ(decision(plan, "sdnq_pin_excess").inputs["excess_bytes"], plan.pin_excess_bytes);
  EXPECT_TRUE(plan.has_decision("loader_pins_preserved"));
  EXPECT_TRUE(module(plan, "transformer_blocks.0.attn.to_q").tensors[0].loader_pinned);
}

TEST(PlannerSdnq, NewPinsBoundedByCeilingRatioMaximumAndRam) {
  const ModelInventory inv = flux_inventory({.h = 1024, .sdnq = true});
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kSdnqRuntime;
  config.pin_cpu_memory = true;
  config.system_ram_headroom_gb = 1.0;
  PlanContext ctx;
  ctx.available_ram_bytes = 512 * kGB;
  Plan plan = make_plan(inv, config, ctx);
  const std::int64_t all = plan.streamed_bytes;
  EXPECT_EQ(plan.pinned_bytes, all);
  EXPECT_FALSE(plan.has_decision("sdnq_pin_excess"));
  EXPECT_TRUE(plan.has_decision("full_pin_zero_resident"));
  EXPECT_FALSE(plan.has_decision("pin_all"));  // the SDNQ rule replaces the dense admission

  config.pin_weight_budget_ratio = 0.5;
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_budget_bytes, all / 2);
  EXPECT_LE(plan.pinned_bytes, all / 2);

  config.max_pin_weight_budget_gb = gb(all / 4);
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_budget_bytes, all / 4);

  ctx.available_ram_bytes = kGB + all / 8;  // usable = all / 8
  plan = make_plan(inv, config, ctx);
  EXPECT_EQ(plan.pin_budget_bytes, all / 8);
  EXPECT_EQ(decision(plan, "sdnq_pin_admission").inputs["usable_ram_bytes"], all / 8);
}

TEST(PlannerSdnq, OneUnitPerLayerAndSmallAuxiliariesTravelWithTheirWeight) {
  // h = 128, uint4 group 64: each scale is 128*2*2 = 512 bytes, far under the threshold, yet it
  // streams with its packed weight in one unit (Note [SDNQ layer units]).
  const ModelInventory inv = flux_inventory({.double_blocks = 2, .single_blocks = 2, .sdnq = true});
  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kSdnqRuntime;
  config.small_tensor_threshold_bytes = 4096;
  config.resident_module_patterns.clear();
  const Plan plan = make_plan(inv, config, {});
  const ModulePlan& q = module(plan, "transformer_blocks.1.attn.to_q");
  EXPECT_EQ(q.tensors[0].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[1].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[2].action, TensorAction::kStream);
  EXPECT_EQ(q.tensors[3].action, TensorAction::kMoveOnce);  // bias: not an SDNQ role
  const auto unit =
      std::find_if(plan.stream_units.begin(), plan.stream_units.end(),
                   [](const StreamUnit& u) { return u.name == "transformer_blocks.1.attn.to_q"; });
  ASSERT_NE(unit, plan.stream_units.end());
  ASSERT_EQ(unit->tensors.size(), 3u);
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

TEST(PlannerSdnq, RuntimeFollowsTheModel) {
  const ModelInventory quantized =
      flux_inventory({.double_blocks = 2, .single_blocks = 2, .sdnq = true});
  const ModelInventory dense = flux_inventory({.double_blocks = 2, .single_blocks = 2});
  EXPECT_EQ(resolve_execution_mode(ExecutionMode::kLinearRuntime, quantized),
            ExecutionMode::kSdnqRuntime);
  EXPECT_EQ(resolve_execution_mode(ExecutionMode::kLinearRuntime, dense),
            ExecutionMode::kLinearRuntime);
  EXPECT_EQ(resolve_execution_mode(ExecutionMode::kPlan, quantized), ExecutionMode::kPlan);

  DynamicOffloadConfig config;
  config.execution_mode = ExecutionMode::kLinearRuntime;
  const Plan plan = make_plan(quantized, config, {});
  EXPECT_TRUE(plan.sdnq);
  EXPECT_EQ(plan.mode, ExecutionMode::kSdnqRuntime);
  EXPECT_EQ(decision(plan, "sdnq_runtime_auto").inputs["requested"], "linear_runtime");

  config.execution_mode = ExecutionMode::kSdnqRuntime;
  try {
    make_plan(dense, config, {});
    FAIL() << "sdnq_runtime on a dense model must be an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("has none; use linear_runtime"), std::string::npos)
        << e.what();
  }
}

TEST(InventorySdnq, RolesFromTheFormatsNames) {
  EXPECT_EQ(sdnq_role_for_name("weight"), SdnqRole::kPackedWeight);
  EXPECT_EQ(sdnq_role_for_name("scale"), SdnqRole::kScale);
  EXPECT_EQ(sdnq_role_for_name("zero_point"), SdnqRole::kZeroPoint);
  EXPECT_EQ(sdnq_role_for_name("svd_up"), SdnqRole::kSvdUp);
  EXPECT_EQ(sdnq_role_for_name("svd_down"), SdnqRole::kSvdDown);
  EXPECT_EQ(sdnq_role_for_name("scale_2"), SdnqRole::kAuxiliary);
  EXPECT_EQ(sdnq_role_for_name("bias"), SdnqRole::kNone);
}

// --- stream units, modes, routes -------------------------------------------------------------

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
  EXPECT_TRUE(plan.sdnq);
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

// --- decisions, determinism, reports ------------------------------------------------------------

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
          ctx.candidate_compute_ms = {{"transformer_blocks.0", 1.0}};  // incomplete: by index
          const ModelInventory& inv = mode.value == ExecutionMode::kSdnqRuntime ? quantized : dense;
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
