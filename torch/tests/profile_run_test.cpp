// The small DiT (W1 at its "tiny" size) on the sim device: exact outputs on every route, the
// named-profile lifecycle (calibrate -> save -> reuse, manual budget, max cap, aborted regions,
// nested and concurrent regions), changed execution order, pin fallback, device capacity.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <stdexcept>

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/calibration.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/testing/flux_dit.h"
#include "test_util.h"
#include "tiny_dit.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

using Dit = test::TinyDit;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

OffloadOptions dit_options(const TempDir& dir, nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json ov = {{"sim_device_capacity_gb", 0.25}, {"profile_vram_headroom_gb", 0.01}};
  for (auto it = extra.begin(); it != extra.end(); ++it) ov[it.key()] = it.value();
  return test::sim_options(dir, ov);
}

TEST(DitOffload, OutputsEqualOnEveryRoute) {
  Dit dit;
  for (const char* preset : {"one_shot_fast", "low_ram_safe", "diffusers_offload_compat",
                             "diffusers_leaf_offload_compat"}) {
    TempDir dir;
    OffloadOptions o = dit_options(dir);
    o.preset = preset;
    auto offload = enable_offload(*dit.model, o);
    ASSERT_TRUE(offload->active()) << preset;
    test::ManagedReadGuard::clear();
    {
      test::ManagedReadGuard guard;
      for (int step = 0; step < 3; ++step) {
        EXPECT_TRUE(at::equal(dit.run(), dit.ref)) << preset << " step " << step;
      }
    }
    EXPECT_TRUE(test::ManagedReadGuard::violations().empty()) << preset;
    const nlohmann::json r = offload->report();
    EXPECT_GT(r["run"].value("acquires", 0), 0) << preset << "\n" << offload->summary();
    auto dev = offload->device();
    EXPECT_LE(dev->memory().used_bytes, dev->memory().total_bytes);
    offload->remove();
    EXPECT_TRUE(at::equal(dit.run(), dit.ref)) << preset;
  }
}

TEST(DitOffload, ChangedExecutionOrderStaysCorrect) {
  torch::manual_seed(7);
  torch::nn::ModuleList layers;
  for (int i = 0; i < 6; ++i) layers->push_back(torch::nn::Linear(32, 32));
  at::Tensor x = at::randn({4, 32});
  auto run = [&](bool reversed) {
    torch::NoGradGuard ng;
    at::Tensor h = x;
    for (int i = 0; i < 6; ++i) {
      const int k = reversed ? 5 - i : i;
      h = layers[k]->as<torch::nn::Linear>()->forward(h);
    }
    return h;
  };
  const at::Tensor fwd = run(false), rev = run(true);
  TempDir dir;
  auto offload = enable_offload(*layers, test::sim_options(dir));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(run(false), fwd));
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(at::equal(run(true), rev));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(run(i % 2 == 1), i % 2 ? rev : fwd));
  EXPECT_GT(offload->report()["run"]["order_misses"].get<int64_t>(), 0);
}

TEST(DitOffload, PinFailureFallsBackOrErrors) {
  Dit dit;
  {
    TempDir dir;
    auto offload = enable_offload(
        *dit.model, dit_options(dir, {{"pin_cpu_memory", true}, {"sim_pinnable_gb", 0.0}}));
    const nlohmann::json r = offload->report();
    EXPECT_GT(r["setup"]["pin_fallback_bytes"].get<int64_t>(), 0) << offload->summary();
    EXPECT_TRUE(at::equal(dit.run(), dit.ref));
  }
  TempDir dir;
  test::expect_pin_refusal_leaves_model_alone(
      *dit.model, dit_options(dir, {{"pin_cpu_memory", true},
                                    {"sim_pinnable_gb", 0.0},
                                    {"allow_pin_memory_fallback", false}}));
  EXPECT_TRUE(at::equal(dit.run(), dit.ref));
}

TEST(ProfileRun, CalibrateSaveReuseAppliesRecommendation) {
  Dit dit;
  TempDir dir;
  double recommended = 0.0;
  std::string path;
  {
    OffloadOptions o = dit_options(dir);
    o.profile_name = "tiny-workload";
    o.build_profile = true;
    auto offload = enable_offload(*dit.model, o);
    EXPECT_EQ(offload->profile_report()["status"], "calibrating");
    EXPECT_EQ(offload->plan().resident_budget_bytes, 0);
    nlohmann::json report = offload->profile_run([&] {
      for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(dit.run(), dit.ref));
    });
    EXPECT_EQ(report["status"], "saved") << report.dump(2);
    ASSERT_TRUE(report.contains("resident_budget_gb")) << report.dump(2);
    recommended = report["resident_budget_gb"].get<double>();
    EXPECT_GT(recommended, 0.0);
    EXPECT_LE(report["peak_vram_gb"].get<double>(), 0.25);
    path = report["path"].get<std::string>();
    EXPECT_TRUE(std::filesystem::exists(path));
    // The calibration timed every candidate block (all streamed) for the next run's placement.
    const nlohmann::json saved = nlohmann::json::parse(read_file(path));
    const nlohmann::json& compute = saved["recommendation"]["candidate_compute_ms"];
    std::size_t candidates = 0;
    for (const core::ModulePlan& m : offload->plan().modules) candidates += m.resident_candidate;
    ASSERT_TRUE(compute.is_object()) << saved.dump(2);
    EXPECT_EQ(compute.size(), candidates) << compute.dump();
    for (const auto& [name, ms] : compute.items()) EXPECT_GT(ms.get<double>(), 0.0) << name;
    EXPECT_EQ(offload->profile_report(), report);
  }
  {
    OffloadOptions o = dit_options(dir);
    o.profile_name = "tiny-workload";
    auto offload = enable_offload(*dit.model, o);
    const nlohmann::json p = offload->profile_report();
    EXPECT_EQ(p["status"], "applied") << p.dump(2);
    EXPECT_NEAR(p["resident_budget_gb"].get<double>(), recommended, 1e-9);
    // GiB to bytes by the one rule, rounded to the nearest byte (core::to_bytes).
    EXPECT_EQ(offload->plan().resident_budget_bytes,
              core::to_bytes_or_throw(recommended, core::ByteUnit::kGiB, "resident_budget_gb"));
    EXPECT_FALSE(offload->plan().resident_module_names().empty()) << offload->summary();
    const core::Decision* balanced = offload->plan().find_decision("balanced_order");
    ASSERT_NE(balanced, nullptr) << offload->summary();
    EXPECT_EQ(balanced->inputs["used"], true) << offload->summary();
    const std::string before = read_file(path);
    ProfileRun run = offload->profile_run();  // a no-op region
    EXPECT_TRUE(at::equal(dit.run(), dit.ref));
    nlohmann::json r = run.finish();
    EXPECT_EQ(r["status"], "applied");
    EXPECT_EQ(read_file(path), before);
  }
  {  // A manual budget beats the profile.
    OffloadOptions o = dit_options(dir, {{"resident_module_budget_gb", 0.0001}});
    o.profile_name = "tiny-workload";
    auto offload = enable_offload(*dit.model, o);
    EXPECT_EQ(offload->profile_report()["budget_source"], "manual");
    EXPECT_EQ(offload->plan().resident_budget_bytes, static_cast<int64_t>(0.0001 * core::kGiB));
  }
  {  // The max cap caps the recommendation.
    OffloadOptions o = dit_options(dir, {{"max_resident_module_budget_gb", 0.00005}});
    o.profile_name = "tiny-workload";
    auto offload = enable_offload(*dit.model, o);
    EXPECT_NEAR(offload->profile_report()["resident_budget_gb"].get<double>(), 0.00005, 1e-12);
    EXPECT_LE(offload->plan().resident_budget_bytes,
              static_cast<int64_t>(0.00005 * core::kGiB) + 1);
    EXPECT_TRUE(at::equal(dit.run(), dit.ref));
  }
}

TEST(ProfileRun, ExceptionLeavesProfileUntouched) {
  Dit dit;
  TempDir dir;
  OffloadOptions o = dit_options(dir);
  o.profile_name = "abort-workload";
  o.build_profile = true;
  std::string path;
  {
    auto offload = enable_offload(*dit.model, o);
    path = offload->profile_run([&] { dit.run(); })["path"].get<std::string>();
  }
  const std::string before = read_file(path);
  ASSERT_FALSE(before.empty());
  {
    auto offload = enable_offload(*dit.model, o);
    EXPECT_THROW(offload->profile_run([&] {
      dit.run();
      throw std::runtime_error("host failure");
    }),
                 std::runtime_error);
    EXPECT_EQ(offload->profile_report()["status"], "failed");
    EXPECT_EQ(read_file(path), before);
    // RAII form: a scope left by an exception aborts.
    try {
      ProfileRun run = offload->profile_run();
      dit.run();
      throw std::runtime_error("again");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(read_file(path), before);
    // A scope that forgets finish() also saves nothing.
    { ProfileRun run = offload->profile_run(); }
    EXPECT_EQ(read_file(path), before);
  }
}

TEST(ProfileRun, NestedAndConcurrentRegionsAreRefused) {
  Dit dit;
  TempDir dir;
  OffloadOptions o = dit_options(dir);
  o.profile_name = "nested";
  o.build_profile = true;
  auto a = enable_offload(*dit.model, o);
  torch::manual_seed(9);
  torch::nn::Linear other(32, 32);
  OffloadOptions o2 = test::sim_options(dir);
  o2.profile_name = "other";
  o2.build_profile = true;
  o2.device = a->device();  // the same simulated card
  auto b = enable_offload(*other, o2);
  ProfileRun outer = a->profile_run();
  try {
    a->profile_run();
    FAIL() << "nested region on one offload";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
  }
  try {
    b->profile_run();
    FAIL() << "concurrent region on the same device";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition) << e.what();
  }
  dit.run();
  EXPECT_EQ(outer.finish()["status"], "saved");
  EXPECT_EQ(b->profile_run([] {})["status"], "saved");
}

// Note [One core per process] (core/CMakeLists.txt): this program and libddo_torch.so load one
// libddo_core.so, so a region held through core's own API is the adapter's region too.
TEST(ProfileRun, ARegionHeldThroughCoreIsSeenByTheAdapter) {
  Dit dit;
  TempDir dir;
  OffloadOptions o = dit_options(dir);
  o.profile_name = "one-core";
  o.build_profile = true;
  auto a = enable_offload(*dit.model, o);
  {
    core::CalibrationRegionLock held = core::CalibrationRegionLock::acquire("sim");
    try {
      a->profile_run();
      FAIL() << "a region on sim:0 while core holds one there";
    } catch (const ddo::Error& e) {
      EXPECT_EQ(e.code(), Code::kFailedPrecondition) << e.what();
      EXPECT_NE(std::string(e.what()).find("sim:0"), std::string::npos) << e.what();
    }
  }
  ProfileRun run = a->profile_run();
  EXPECT_THROW((void)core::CalibrationRegionLock::acquire("sim:0"), ddo::Error);
  dit.run();
  EXPECT_EQ(run.finish()["status"], "saved");
  EXPECT_NO_THROW((void)core::CalibrationRegionLock::acquire("sim:0"));
}

TEST(ProfileRun, CalibrationNeedsAName) {
  Dit dit;
  TempDir dir;
  OffloadOptions o = dit_options(dir);
  o.build_profile = true;
  EXPECT_THROW(enable_offload(*dit.model, o), ddo::Error);
  EXPECT_FALSE(interception_active());
}

TEST(PipelineOffload, RoutesPerComponent) {
  Dit dit;
  torch::manual_seed(11);
  auto encoder = std::make_shared<torch::nn::LinearImpl>(32, 32);
  auto vae = std::make_shared<torch::nn::LinearImpl>(16, 16);
  at::Tensor e_in = at::randn({2, 32}), v_in = at::randn({2, 16});
  at::Tensor e_ref, v_ref;
  {
    torch::NoGradGuard ng;
    e_ref = encoder->forward(e_in);
    v_ref = vae->forward(v_in);
  }
  TempDir dir;
  OffloadOptions o = dit_options(dir);
  core::EnvMap env = test::test_env(dir);
  env["DDO_VAE_ROUTE"] = "device";
  env["DDO_TEXT_ENCODER_ROUTE"] = "group_leaf";
  o.env = env;
  o.profile_name = "pipe";
  o.build_profile = true;
  auto pipe = enable_pipeline_offload(
      {{"text_encoder", encoder}, {"transformer", dit.model.ptr()}, {"vae", vae}}, o);
  EXPECT_EQ(pipe->route_of("vae"), core::Route::kDeviceMove);
  EXPECT_EQ(pipe->route_of("text_encoder"), core::Route::kGroupLeaf);
  EXPECT_EQ(pipe->route_of("transformer"), core::Route::kDynamic);
  torch::NoGradGuard ng;
  EXPECT_TRUE(at::equal(encoder->forward(e_in), e_ref));
  nlohmann::json r = pipe->profile_run([&] { EXPECT_TRUE(at::equal(dit.run(), dit.ref)); });
  EXPECT_EQ(r["status"], "saved");
  EXPECT_TRUE(at::equal(vae->forward(v_in), v_ref));
  EXPECT_TRUE(pipe->report()["components"].contains("vae"));
  pipe->remove();
  EXPECT_FALSE(interception_active());
  EXPECT_TRUE(at::equal(dit.run(), dit.ref));
}

// The shared device is opened from the settings with the overrides applied: a
// sim_device_capacity_gb or vram_cap_gb override reaches it, and execution_mode=plan opens none.
TEST(PipelineOffload, OverridesDecideTheSharedDevice) {
  Dit dit;
  auto vae = std::make_shared<torch::nn::LinearImpl>(16, 16);
  {
    TempDir dir;
    OffloadOptions o = dit_options(dir);  // sim_device_capacity_gb = 0.25
    auto pipe = enable_pipeline_offload({{"transformer", dit.model.ptr()}, {"vae", vae}}, o);
    const nlohmann::json run = pipe->component("transformer")->report()["run"];
    ASSERT_TRUE(run.contains("total_vram_bytes")) << run.dump();
    EXPECT_EQ(run["total_vram_bytes"].get<std::int64_t>(), core::kGiB / 4) << run.dump();
    pipe->remove();
  }
  {
    TempDir dir;
    OffloadOptions o = dit_options(dir, {{"vram_cap_gb", 0.125}});
    auto pipe = enable_pipeline_offload({{"transformer", dit.model.ptr()}, {"vae", vae}}, o);
    EXPECT_EQ(pipe->component("transformer")->report()["run"]["total_vram_bytes"], core::kGiB / 8);
    pipe->remove();
  }
  {
    // Plan mode opens no device: a CUDA device, which this machine may lack, is never asked for.
    TempDir dir;
    OffloadOptions o = dit_options(dir, {{"execution_mode", "plan"}});
    o.execution_device = "cuda:0";
    std::unique_ptr<PipelineOffload> pipe;
    ASSERT_NO_THROW(
        pipe = enable_pipeline_offload({{"transformer", dit.model.ptr()}, {"vae", vae}}, o));
    EXPECT_EQ(pipe->route_of("transformer"), core::Route::kDynamic);
    pipe->remove();
  }
  EXPECT_FALSE(interception_active());
  EXPECT_TRUE(at::equal(dit.run(), dit.ref));
}

}  // namespace
}  // namespace ddo::adapter
