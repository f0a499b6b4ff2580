// The named-profile rules of a pipeline with several denoisers (ddo/core/pipeline_profiles.h):
// which components are denoisers, their profile names, and the split of one region's room.
#include "ddo/core/pipeline_profiles.h"

#include <cmath>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "ddo/core/calibration.h"
#include "ddo/core/units.h"
#include "test_files.h"

namespace ddo::core {
namespace {
namespace fs = std::filesystem;

TEST(DenoiserComponents, DiffusersDenoiserNamesAndNothingElse) {
  for (const char* name :
       {"transformer", "transformer_2", "transformer_10", "unet", "unet_2", "prior"}) {
    EXPECT_TRUE(is_denoiser_component(name)) << name;
  }
  for (const char* name :
       {"vae", "text_encoder", "text_encoder_2", "prior_text_encoder", "prior_tokenizer",
        "transformer_", "transformer_x", "transformer2", "unets", "", "Transformer"}) {
    EXPECT_FALSE(is_denoiser_component(name)) << name;
  }
}

TEST(DenoiserComponents, TheFirstKeepsTheNameTheOthersDeriveOne) {
  EXPECT_EQ(denoiser_profile_name("wan-5s", "transformer", 0), "wan-5s");
  EXPECT_EQ(denoiser_profile_name("wan-5s", "transformer_2", 1), "wan-5s.transformer_2");
  EXPECT_EQ(denoiser_profile_name("", "transformer_2", 1), "");
}

TEST(BudgetShares, ProportionalToTheCandidateBytesAndNeverAboveOne) {
  std::vector<double> s = budget_shares({6 * kGiBBytes, 2 * kGiBBytes});
  ASSERT_EQ(s.size(), 2u);
  EXPECT_DOUBLE_EQ(s[0], 0.75);
  EXPECT_DOUBLE_EQ(s[1], 0.25);
  s = budget_shares({kGiBBytes, kGiBBytes});
  EXPECT_DOUBLE_EQ(s[0], 0.5);
  EXPECT_DOUBLE_EQ(s[1], 0.5);
  s = budget_shares({0, 0, 0});  // no candidates anywhere: even
  for (double v : s) EXPECT_DOUBLE_EQ(v, 1.0 / 3.0);
  s = budget_shares({5, 0, -3});  // none for a denoiser without candidates
  EXPECT_DOUBLE_EQ(s[0], 1.0);
  EXPECT_DOUBLE_EQ(s[1], 0.0);
  EXPECT_DOUBLE_EQ(s[2], 0.0);
  EXPECT_TRUE(budget_shares({}).empty());
  EXPECT_EQ(budget_shares({7}), std::vector<double>{1.0});
  // Awkward ratios: the sum never exceeds 1.
  for (std::int64_t a : {1, 3, 7, 1000003}) {
    s = budget_shares({a, 3 * a + 1, 11, 13 * a});
    double sum = 0;
    for (double v : s) sum += v;
    EXPECT_LE(sum, 1.0) << a;
    EXPECT_NEAR(sum, 1.0, 1e-12) << a;
  }
}

// Two denoisers calibrated in one region save recommendations that sum to the measured room:
// 8 GiB card, 1 GiB headroom, 4 GiB peak leave 3 GiB, split 0.75 / 0.25.
TEST(BudgetShares, TwoDenoisersSaveTheirSharesOfOneRoom) {
  const fs::path dir = fs::temp_directory_path() /
                       ("ddo-pipeline-profiles-" + std::to_string(ddo::testing::process_id()));
  ddo::testing::remove_tree(dir);
  ProfileStoreOptions options;
  options.directory = dir;
  ProfileStore store(std::move(options));
  DynamicOffloadConfig config;
  config.execution_device = "cuda:0";
  config.execution_mode = ExecutionMode::kLinearRuntime;
  config.profile_vram_headroom_gb = 1.0;
  config.build_profile = true;
  const DeviceFacts card{.is_cuda_like = true, .total_vram_bytes = 8LL << 30};
  RegionResult region;
  region.exited_normally = true;
  region.inputs.driver_used_start_bytes = kGiBBytes;
  region.inputs.driver_used_samples_bytes = {4 * kGiBBytes};
  const std::vector<double> shares = budget_shares({3 * kGiBBytes, kGiBBytes});
  double saved_sum = 0;
  for (std::size_t i = 0; i < 2; ++i) {
    config.profile_name = denoiser_profile_name("wan", i == 0 ? "transformer" : "transformer_2", i);
    PreparedProfile prepared = prepare_profile(config, "demo::Wan", store, card);
    region.budget_share = shares[i];
    ProfileReport report;
    ASSERT_TRUE(finish_region(prepared, region, store, &report).ok());
    EXPECT_EQ(report.status, ProfileStatus::kSaved);
    EXPECT_EQ(report.budget_share, shares[i]);
    EXPECT_NEAR(*report.resident_budget_gb, 3.0 * shares[i], 1e-9);
    saved_sum += *report.resident_budget_gb;
  }
  EXPECT_LE(saved_sum, 3.0);
  EXPECT_NEAR(saved_sum, 3.0, 1e-9);
  // Each is reused under its own name.
  config.build_profile = false;
  config.profile_name = "wan.transformer_2";
  PreparedProfile reuse = prepare_profile(config, "demo::Wan", store, card);
  EXPECT_EQ(reuse.status, ProfileStatus::kApplied);
  EXPECT_NEAR(*reuse.resident_budget_gb, 0.75, 1e-9);
  ddo::testing::remove_tree(dir);
}

TEST(BudgetShares, AProbeTakesItsShareOfTheOvershoot) {
  // Probed at 2 GiB on an 8 GiB card, 1 GiB headroom, peak 7.4: overshoot 0.4, a quarter of it.
  const ProfileRecommendation r = recommend_after_probe(2.0, 8.0, 7.4, 1.0, 0.25);
  EXPECT_NEAR(r.resident_budget_gb, 1.9, 1e-9);
  EXPECT_NEAR(recommend_after_probe(2.0, 8.0, 7.4, 1.0).resident_budget_gb, 1.6, 1e-9);
}

}  // namespace
}  // namespace ddo::core
