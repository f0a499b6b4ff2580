// A pipeline with two denoisers on the sim (Wan 2.2's transformer and transformer_2: two instances
// of one class): both are profiled under their own names, one profile_run() calibrates both and
// their saved budgets share the measured room, a second run applies both; the overrides decide
// the routes before any component attaches; a failed component leaves none attached.
#include <gtest/gtest.h>

#include <stdexcept>

#include <ATen/ops/equal.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/pipeline_profiles.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/pipeline_offload.h"
#include "ddo/torch/testing/flux_dit.h"
#include "test_util.h"
#include "tiny_dit.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

using Dit = test::TinyDit;

OffloadOptions pipe_options(const TempDir& dir, nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json ov = {{"sim_device_capacity_gb", 0.25}, {"profile_vram_headroom_gb", 0.01}};
  for (auto it = extra.begin(); it != extra.end(); ++it) ov[it.key()] = it.value();
  return test::sim_options(dir, ov);
}

TEST(PipelineRouter, EveryDenoiserOnTheDynamicRouteIsProfiledUnderItsOwnName) {
  core::SettingsRequest request;
  request.overrides = {{"profile_name", "wan"}};
  core::DynamicOffloadSettings s =
      core::DynamicOffloadSettings::from_env(request, {{"DDO_VAE_ROUTE", "device"}});
  PipelineRouting r =
      route_pipeline(s, {"text_encoder", "transformer", "transformer_2", "vae"}, {}, "sim");
  EXPECT_EQ(r.profiled, (std::vector<std::string>{"transformer", "transformer_2"}));
  EXPECT_EQ(r.components[0].profile_name, "");
  EXPECT_EQ(r.components[1].profile_name, "wan");
  EXPECT_EQ(r.components[2].profile_name, "wan.transformer_2");
  EXPECT_EQ(r.settings_for(s, 2).config.profile_name, "wan.transformer_2");
  EXPECT_EQ(r.settings_for(s, 3).config.profile_name, "");
  // No denoiser name: the first component on the dynamic route.
  r = route_pipeline(s, {"vae", "decoder", "refiner"}, {}, "sim");
  EXPECT_EQ(r.profiled, std::vector<std::string>{"decoder"});
  EXPECT_EQ(r.components[1].profile_name, "wan");
  // Named: exactly those, in the pipeline's order.
  r = route_pipeline(s, {"transformer", "transformer_2", "vae"}, {"transformer_2"}, "sim");
  EXPECT_EQ(r.profiled, std::vector<std::string>{"transformer_2"});
  EXPECT_EQ(r.components[1].profile_name, "wan");
  EXPECT_THROW(route_pipeline(s, {"transformer"}, {"unet"}, "sim"), ddo::Error);
}

// One region calibrates both; their saved budgets are shares of the one measured room; a second
// attach applies each under its own name.
TEST(PipelineProfiles, TwoDenoisersCalibrateInOneRegionAndShareTheRoom) {
  Dit high, low;
  auto vae = std::make_shared<torch::nn::LinearImpl>(16, 16);
  TempDir dir;
  OffloadOptions o = pipe_options(dir);
  o.profile_name = "wan";
  o.build_profile = true;
  auto pipe = enable_pipeline_offload(
      {{"transformer", high.model.ptr()}, {"transformer_2", low.model.ptr()}, {"vae", vae}}, o);
  EXPECT_EQ(pipe->profiled_components(),
            (std::vector<std::string>{"transformer", "transformer_2"}));
  EXPECT_EQ(pipe->profile_name_of("transformer_2"), "wan.transformer_2");
  const nlohmann::json r = pipe->profile_run([&] {
    EXPECT_TRUE(at::equal(high.run(), high.ref));
    EXPECT_TRUE(at::equal(low.run(), low.ref));
  });
  const nlohmann::json& a = r["components"]["transformer"];
  const nlohmann::json& b = r["components"]["transformer_2"];
  ASSERT_EQ(a["status"], "saved") << r.dump();
  ASSERT_EQ(b["status"], "saved") << r.dump();
  EXPECT_EQ(a["name"], "wan");
  EXPECT_EQ(b["name"], "wan.transformer_2");
  EXPECT_EQ(r["status"], "saved");  // the first's report at the top
  // One measurement, one room: total - peak - headroom, split between the two.
  EXPECT_EQ(a["peak_vram_gb"], b["peak_vram_gb"]);
  const double room = a["total_vram_gb"].get<double>() - a["peak_vram_gb"].get<double>() -
                      a["headroom_gb"].get<double>();
  ASSERT_GT(room, 0.0) << r.dump();
  const double saved =
      a["resident_budget_gb"].get<double>() + b["resident_budget_gb"].get<double>();
  EXPECT_LE(saved, room + 1e-12);
  EXPECT_NEAR(saved, room, 1e-9);
  EXPECT_DOUBLE_EQ(a["budget_share"].get<double>(), 0.5);  // two equal transformers
  EXPECT_DOUBLE_EQ(b["budget_share"].get<double>(), 0.5);
  EXPECT_EQ(pipe->report()["profile_names"]["transformer_2"], "wan.transformer_2");
  pipe->remove();
  EXPECT_FALSE(interception_active());

  o.build_profile = false;
  pipe = enable_pipeline_offload(
      {{"transformer", high.model.ptr()}, {"transformer_2", low.model.ptr()}, {"vae", vae}}, o);
  for (const char* name : {"transformer", "transformer_2"}) {
    const nlohmann::json p = pipe->component(name)->profile_report();
    EXPECT_EQ(p["status"], "applied") << name << p.dump();
    EXPECT_NEAR(p["resident_budget_gb"].get<double>(), room / 2, 1e-9) << name << p.dump();
  }
  const nlohmann::json reused = pipe->profile_run([&] {
    EXPECT_TRUE(at::equal(high.run(), high.ref));
    EXPECT_TRUE(at::equal(low.run(), low.ref));
  });
  EXPECT_EQ(reused["components"]["transformer_2"]["status"], "applied") << reused.dump();
  pipe->remove();
  EXPECT_FALSE(interception_active());
}

// The overrides are part of the settings the router reads, and no component applies them again:
// a route override does not undo a component's DDO_<COMPONENT>_ROUTE, a profile-name override
// names the denoisers only.
TEST(PipelineProfiles, OverridesAreAppliedOnceBeforeRouting) {
  Dit high, low;
  auto vae = std::make_shared<torch::nn::LinearImpl>(16, 16);
  TempDir dir;
  OffloadOptions o = pipe_options(dir, {{"route", "group_leaf"}, {"profile_name", "ov"}});
  core::EnvMap env = test::test_env(dir);
  env["DDO_VAE_ROUTE"] = "device";
  o.env = env;
  auto pipe = enable_pipeline_offload(
      {{"transformer", high.model.ptr()}, {"transformer_2", low.model.ptr()}, {"vae", vae}}, o);
  EXPECT_EQ(pipe->route_of("vae"), core::Route::kDeviceMove);
  EXPECT_EQ(pipe->route_of("transformer"), core::Route::kGroupLeaf);
  EXPECT_EQ(pipe->component("vae")->report()["route"], "device");
  EXPECT_EQ(pipe->component("vae")->settings().config.profile_name, "");
  // group_leaf is not the dynamic route: no denoiser there, none profiled.
  EXPECT_TRUE(pipe->profiled_components().empty());
  pipe->remove();

  o = pipe_options(dir, {{"profile_name", "ov"}});
  o.env = env;
  pipe = enable_pipeline_offload(
      {{"transformer", high.model.ptr()}, {"transformer_2", low.model.ptr()}, {"vae", vae}}, o);
  EXPECT_EQ(pipe->component("transformer")->settings().config.profile_name, "ov");
  EXPECT_EQ(pipe->component("transformer_2")->settings().config.profile_name, "ov.transformer_2");
  EXPECT_EQ(pipe->component("vae")->settings().config.profile_name, "");
  pipe->remove();
  EXPECT_FALSE(interception_active());
}

TEST(PipelineProfiles, AFailedComponentLeavesNoneAttached) {
  Dit high;
  TempDir dir;
  std::vector<PipelineComponent> components;
  components.push_back(
      {"transformer", [&](const OffloadOptions& o) { return enable_offload(high.model.ptr(), o); },
       high.model.ptr()});
  components.push_back({"transformer_2",
                        [](const OffloadOptions&) -> std::unique_ptr<Offload> {
                          throw std::runtime_error("transformer_2 failed to attach");
                        },
                        nullptr});
  try {
    enable_pipeline_components(std::move(components), pipe_options(dir));
    FAIL() << "the second component's error did not reach the caller";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "transformer_2 failed to attach");
  }
  EXPECT_FALSE(interception_active());
  for (const auto& p : high.model->parameters()) EXPECT_FALSE(is_managed(p));
  EXPECT_TRUE(at::equal(high.run(), high.ref));
}

}  // namespace
}  // namespace ddo::adapter
