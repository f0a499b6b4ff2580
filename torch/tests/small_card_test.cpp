// Small cards on the host simulation (issue: every cap down to 3 GiB). A FLUX-shaped model whose
// always-resident modules (the default pattern matches each single block's proj_out) do not fit
// next to the staging ring: the planner streams the largest of them (Note [Always-resident fits
// the card]), the adapter sizes the ring from the room it finds (Note [Working set]), and the
// output is the model's own. A card too small for even the smallest plan fails before anything
// moves, saying how much that plan needs.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ops/equal.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "ddo/core/config.h"
#include "ddo/core/status.h"
#include "ddo/core/working_set.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/testing/flux_dit.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;
using testing::FluxDiT;
using testing::FluxDiTOptions;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The default always-resident pattern (the test helper clears it), a tiny headroom so that the
// card's size alone decides, and the sim capacity.
OffloadOptions small_card(const TempDir& dir, double capacity_gb) {
  return test::sim_options(dir, {{"always_resident_modules_pattern",
                                  core::DynamicOffloadConfig{}.always_resident_modules_pattern},
                                 {"auto_vram_headroom_gb", 1e-3},
                                 {"sim_device_capacity_gb", capacity_gb}});
}

struct Facts {
  std::int64_t always_resident_stream = 0;  // streamable bytes of always-resident modules
  std::int64_t always_resident_fixed = 0;   // their other tensors
  std::int64_t move_once = 0;
  std::int64_t staging = 0;
  std::int64_t largest_weight = 0;
};

// What the plan of a roomy card says about the model.
Facts facts_of(FluxDiT& model, const TempDir& dir) {
  auto offload = enable_offload(*model, small_card(dir, 4.0));
  const core::Plan& plan = offload->plan();
  EXPECT_FALSE(plan.has_decision("always_resident_fit")) << plan.summary();
  Facts f;
  f.move_once = plan.move_once_bytes;
  f.staging = plan.staging_estimate_bytes;
  std::map<std::string, std::shared_ptr<torch::nn::Module>> by_name;
  for (const auto& item : model->named_modules()) by_name[item.key()] = item.value();
  for (const core::ModulePlan& mp : plan.modules) {
    if (!mp.always_resident || by_name.count(mp.name) == 0) continue;
    for (const auto& p : by_name[mp.name]->named_parameters(/*recurse=*/false)) {
      const std::int64_t bytes = p.value().numel() * p.value().element_size();
      (p.value().dim() == 2 ? f.always_resident_stream : f.always_resident_fixed) += bytes;
    }
  }
  for (const auto& p : model->parameters()) {
    if (p.dim() == 2) f.largest_weight = std::max(f.largest_weight, p.numel() * p.element_size());
  }
  EXPECT_EQ(f.always_resident_stream + f.always_resident_fixed, plan.always_resident_bytes);
  return f;
}

FluxDiTOptions small_flux() {
  FluxDiTOptions o = FluxDiTOptions::preset("small");
  o.double_blocks = 2;
  o.single_blocks = 6;
  return o;
}

TEST(SmallCard, AlwaysResidentModulesStreamWhenTheCardCannotHoldThem) {
  const FluxDiTOptions o = small_flux();
  FluxDiT model(o);
  const testing::FluxDiTInputs in = testing::make_inputs(o, c10::kCPU);
  torch::NoGradGuard no_grad;
  const at::Tensor reference = model->forward(in.img, in.txt, in.timestep);
  TempDir dir;
  const Facts f = facts_of(model, dir);
  ASSERT_GT(f.always_resident_stream, 0);

  // Room for half of the always-resident weights next to the move-once tensors and the ring.
  const std::int64_t card = f.move_once + f.staging + f.always_resident_fixed +
                            f.always_resident_stream / 2 + (std::int64_t{1} << 20);
  auto offload = enable_offload(*model, small_card(dir, static_cast<double>(card) / kGiB));
  const core::Plan& plan = offload->plan();
  const core::Decision* fit = plan.find_decision("always_resident_fit");
  ASSERT_NE(fit, nullptr) << plan.summary();
  const std::int64_t demoted = fit->inputs["demoted_bytes"];
  EXPECT_GE(demoted, f.always_resident_stream / 2);
  EXPECT_LT(demoted, f.always_resident_stream);
  // The last single block's proj_out gives its weight up first and now streams.
  const std::string last = "single_transformer_blocks." + std::to_string(o.single_blocks - 1);
  bool last_streams = false;
  for (const core::StreamUnit& u : plan.stream_units) {
    last_streams = last_streams || u.name == last + ".proj_out.weight";
    EXPECT_EQ(u.grain, "tensor");
  }
  EXPECT_TRUE(last_streams) << plan.summary();

  // Two steps (the second one prefetches along the trace) give the model's own output.
  for (int step = 0; step < 2; ++step) {
    const at::Tensor out = model->forward(in.img, in.txt, in.timestep);
    EXPECT_TRUE(at::equal(out, reference)) << "step " << step;
  }
  const nlohmann::json report = offload->report();
  EXPECT_LE(report["setup"]["staging_bytes"].get<std::int64_t>(), card);
  EXPECT_LE(report["run"]["peak_vram_gb"].get<double>() * kGiB, static_cast<double>(card) + 1.0);
}

TEST(SmallCard, TooSmallForTheSmallestPlanSaysWhatItNeedsAndMovesNothing) {
  const FluxDiTOptions o = small_flux();
  FluxDiT model(o);
  TempDir dir;
  const Facts f = facts_of(model, dir);
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& item : model->named_parameters()) {
    before.emplace_back(item.key(), item.value().clone());
  }

  const std::int64_t smallest = f.move_once + core::min_staging_bytes(f.largest_weight);
  const double card_gb = static_cast<double>(smallest) / 2 / kGiB;
  try {
    auto offload = enable_offload(*model, small_card(dir, card_gb));
    FAIL() << "a card half the size of the smallest plan was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted) << e.what();
    const std::string message = e.what();
    EXPECT_NE(message.find("smallest plan needs"), std::string::npos) << message;
    EXPECT_NE(message.find("Nothing was moved"), std::string::npos) << message;
    EXPECT_NE(message.find("vram_cap_gb"), std::string::npos) << message;
  }
  // The model is as it was: same values, on the host, ordinary tensors.
  std::size_t i = 0;
  for (const auto& item : model->named_parameters()) {
    ASSERT_EQ(before[i].first, item.key());
    EXPECT_TRUE(item.value().device().is_cpu()) << item.key();
    EXPECT_TRUE(at::equal(item.value(), before[i].second)) << item.key();
    ++i;
  }
}

}  // namespace
}  // namespace ddo::adapter
