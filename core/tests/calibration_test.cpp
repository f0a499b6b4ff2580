#include "ddo/core/calibration.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "child_process.h"
#include "test_files.h"

namespace ddo::core {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::int64_t bytes(double gib) {
  return static_cast<std::int64_t>(std::llround(gib * kGiB));
}

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A region whose peak is `peak_gb`, reached through the allocator term: 0.5 GiB of context at the
// start plus an allocator peak of peak - 0.5, with driver samples below it.
RegionResult region_peaking_at(double peak_gb) {
  RegionResult r;
  r.exited_normally = true;
  r.inputs.driver_used_start_bytes = bytes(0.5);
  r.inputs.allocator_reserved_start_bytes = 0;
  r.inputs.allocator_peak_reserved_bytes = bytes(peak_gb - 0.5);
  r.inputs.driver_used_end_bytes = bytes(0.6);
  r.inputs.driver_used_samples_bytes = {bytes(1.0), bytes(peak_gb - 0.25)};
  return r;
}

constexpr DeviceFacts kCard8{.is_cuda_like = true, .total_vram_bytes = 8LL << 30};

class CalibrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("ddo-calibration-") + info->name() + "-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    config_.execution_device = "cuda:0";
    config_.execution_mode = ExecutionMode::kLinearRuntime;
    config_.profile_name = "my-workload";
    config_.profile_vram_headroom_gb = 1.0;
    config_.max_resident_module_budget_gb = 6.0;
  }
  void TearDown() override { fs::remove_all(dir_); }

  ProfileStore store() {
    ProfileStoreOptions options;
    options.directory = dir_;
    options.warn = [this](const std::string& m) { warnings_.push_back(m); };
    return ProfileStore(std::move(options));
  }

  // Calibrates with the current config and a region peaking at `peak_gb`; returns the report.
  ProfileReport calibrate(double peak_gb, const DeviceFacts& device = kCard8) {
    ProfileStore s = store();
    DynamicOffloadConfig config = config_;
    config.build_profile = true;
    PreparedProfile prepared = prepare_profile(config, kClass, s, device);
    EXPECT_EQ(prepared.status, ProfileStatus::kCalibrating);
    EXPECT_EQ(prepared.region, RegionAction::kCalibrate);
    EXPECT_EQ(prepared.resident_budget_gb, 0.0);
    ProfileReport report;
    EXPECT_TRUE(finish_region(prepared, region_peaking_at(peak_gb), s, &report).ok());
    return report;
  }

  static constexpr std::string_view kClass = "demo::Transformer";
  fs::path dir_;
  DynamicOffloadConfig config_;
  std::vector<std::string> warnings_;
};

// ---- Peak rule and recommendation math ----------------------------------------------------

TEST(MeasurePeakTest, DriverSamplesWinWhenHigher) {
  MeasurementInputs in;
  in.driver_used_start_bytes = bytes(1.0);
  in.allocator_reserved_start_bytes = bytes(0.2);
  in.allocator_peak_reserved_bytes = bytes(4.0);
  in.driver_used_end_bytes = bytes(1.5);
  in.driver_used_samples_bytes = {bytes(3.0), bytes(5.0), bytes(2.0)};
  Measurement m = measure_peak(in);
  EXPECT_EQ(m.driver_peak_bytes, bytes(5.0));
  EXPECT_EQ(m.initial_non_allocator_bytes, bytes(0.8));
  EXPECT_EQ(m.peak_bytes, bytes(5.0));  // 5.0 > 4.0 + 0.8
  EXPECT_EQ(m.samples, 5);
}

TEST(MeasurePeakTest, AllocatorPeakPlusInitialNonAllocatorWinsWhenHigher) {
  MeasurementInputs in;
  in.driver_used_start_bytes = bytes(1.0);
  in.allocator_reserved_start_bytes = bytes(0.2);
  in.allocator_peak_reserved_bytes = bytes(4.5);
  in.driver_used_end_bytes = bytes(1.0);
  Measurement m = measure_peak(in);
  EXPECT_EQ(m.peak_bytes, bytes(5.3));
  json j = m.to_json();
  EXPECT_NEAR(j["driver_peak_gb"].get<double>(), 1.0, 1e-9);
  EXPECT_NEAR(j["allocator_peak_reserved_gb"].get<double>(), 4.5, 1e-9);
  EXPECT_NEAR(j["initial_non_allocator_gb"].get<double>(), 0.8, 1e-9);
  EXPECT_EQ(j["samples"], 2);
}

TEST(MeasurePeakTest, InitialNonAllocatorUsageIsClampedAtZero) {
  MeasurementInputs in;
  in.driver_used_start_bytes = bytes(0.5);
  in.allocator_reserved_start_bytes = bytes(1.0);  // readings raced: reserved > used
  in.allocator_peak_reserved_bytes = bytes(2.0);
  EXPECT_EQ(measure_peak(in).initial_non_allocator_bytes, 0);
  EXPECT_EQ(measure_peak(in).peak_bytes, bytes(2.0));
}

// The adapter's probe once kept its own copy of the rule, with the allocator term bounded below
// by the reserved bytes at the start and core's without; these inputs tell the two apart.

TEST(MeasurePeakTest, AllocatorPeakIsNeverBelowWhatWasReservedAtTheStart) {
  // A source whose peak counter restarts at zero, then the region frees most of its cache: the
  // reported peak (0.25 GiB) is below the 3 GiB the region held at its first instant.
  MeasurementInputs in;
  in.driver_used_start_bytes = bytes(3.5);
  in.allocator_reserved_start_bytes = bytes(3.0);
  in.allocator_peak_reserved_bytes = bytes(0.25);
  in.driver_used_end_bytes = bytes(0.75);
  Measurement m = measure_peak(in);
  EXPECT_EQ(m.allocator_peak_reserved_bytes, bytes(3.0));  // not the 0.25 the counter said
  EXPECT_EQ(m.initial_non_allocator_bytes, bytes(0.5));
  EXPECT_EQ(m.peak_bytes, bytes(3.5));
  EXPECT_NEAR(m.to_json()["allocator_peak_reserved_gb"].get<double>(), 3.0, 1e-9);
}

TEST(MeasurePeakTest, ReservedAtTheStartCountsWhenTheDriverReadingLagsBehindIt) {
  // The driver was read before the allocator grew (readings a moment apart): driver 1 GiB,
  // reserved 2 GiB, so no memory outside the allocator is assumed. The peak counter restarted at
  // zero and saw 0.5 GiB; without the lower bound the peak would be the driver's 1.25 GiB,
  // below the 2 GiB the allocator held when the region began.
  MeasurementInputs in;
  in.driver_used_start_bytes = bytes(1.0);
  in.allocator_reserved_start_bytes = bytes(2.0);
  in.allocator_peak_reserved_bytes = bytes(0.5);
  in.driver_used_end_bytes = bytes(1.25);
  in.driver_used_samples_bytes = {bytes(1.125)};
  Measurement m = measure_peak(in);
  EXPECT_EQ(m.driver_peak_bytes, bytes(1.25));
  EXPECT_EQ(m.initial_non_allocator_bytes, 0);
  EXPECT_EQ(m.peak_bytes, bytes(2.0));
  EXPECT_EQ(m.samples, 3);
}

TEST_F(CalibrationTest, TheSavedRecommendationUsesTheReservedStartAsThePeakFloor) {
  // 8 GiB card, 1 GiB headroom; a region that began with 5 GiB reserved (the driver read a
  // moment earlier at 4.5 GiB) and whose peak counter reported 0.5 GiB.
  ProfileStore s = store();
  DynamicOffloadConfig config = config_;
  config.build_profile = true;
  PreparedProfile prepared = prepare_profile(config, kClass, s, kCard8);
  ASSERT_EQ(prepared.region, RegionAction::kCalibrate);
  RegionResult result;
  result.exited_normally = true;
  result.inputs.driver_used_start_bytes = bytes(4.5);
  result.inputs.allocator_reserved_start_bytes = bytes(5.0);
  result.inputs.allocator_peak_reserved_bytes = bytes(0.5);
  result.inputs.driver_used_end_bytes = bytes(4.5);
  ProfileReport report;
  ASSERT_TRUE(finish_region(prepared, result, s, &report).ok());
  ASSERT_TRUE(report.peak_vram_gb.has_value());
  EXPECT_DOUBLE_EQ(*report.peak_vram_gb, 5.0);
  ASSERT_TRUE(report.resident_budget_gb.has_value());
  EXPECT_DOUBLE_EQ(*report.resident_budget_gb, 2.0);  // 8 - 5 - 1; without the floor 2.5
  ASSERT_TRUE(report.measurement.has_value());
  EXPECT_EQ(report.measurement->allocator_peak_reserved_bytes, bytes(5.0));
  bool noted = false;
  for (const std::string& note : report.notes) {
    noted = noted || note == "measured with a resident budget of 0.00 GiB";
  }
  EXPECT_TRUE(noted) << report.to_json().dump();
}

TEST(RecommendationMathTest, BudgetIsTotalMinusPeakMinusHeadroomNeverNegative) {
  EXPECT_DOUBLE_EQ(recommend_resident_budget_gb(8, 6, 1), 1.0);
  EXPECT_DOUBLE_EQ(recommend_resident_budget_gb(8, 7.5, 1), 0.0);
  EXPECT_DOUBLE_EQ(packed_probe_ceiling_gb(6, 8, 1), 6.0);
  EXPECT_DOUBLE_EQ(packed_probe_ceiling_gb(0, 24, 1), kPackedDefaultProbeCeilingGb);
  EXPECT_DOUBLE_EQ(packed_probe_ceiling_gb(10, 8, 1), 7.0);  // never above total - headroom
  EXPECT_DOUBLE_EQ(packed_probe_ceiling_gb(6, 4, 1), 3.0);
}

TEST(RecommendationMathTest, PackedSafeBelowTwoGibDoesNotProbe) {
  ProfileRecommendation r = recommend_after_calibration(true, 8, 5.1, 1, 6);  // safe 1.9
  EXPECT_EQ(r.profile_measurement_kind, kKindPackedBaselineSafe);
  // The packed kinds keep diffusers-dynamic-offloader's file spellings for every format.
  EXPECT_EQ(r.profile_measurement_kind, "sdnq_baseline_safe");
  EXPECT_NEAR(r.resident_budget_gb, 1.9, 1e-9);
}

TEST(RecommendationMathTest, PackedSafeAtOrAboveCeilingDoesNotProbe) {
  // 24 GiB card, peak 4: safe 19 >= ceiling 6.
  ProfileRecommendation r = recommend_after_calibration(true, 24, 4, 1, 6);
  EXPECT_EQ(r.profile_measurement_kind, kKindPackedBaselineSafe);
  EXPECT_DOUBLE_EQ(r.resident_budget_gb, 19.0);
  EXPECT_FALSE(r.probe_pending);
}

TEST(RecommendationMathTest, ProbeResultIsClampedAtZero) {
  ProfileRecommendation r = recommend_after_probe(6, 8, 20, 1);
  EXPECT_EQ(r.profile_measurement_kind, kKindPackedProbe);
  EXPECT_DOUBLE_EQ(r.resident_budget_gb, 0.0);
  EXPECT_DOUBLE_EQ(recommend_after_probe(6, 8, 6.5, 1).resident_budget_gb, 6.0);  // it fit
}

// ---- Worked cases (8 GiB card, 1 GiB headroom) --------------------------------------------

TEST_F(CalibrationTest, DensePeakSixGivesOneGib) {
  ProfileReport report = calibrate(6.0);
  EXPECT_EQ(report.status, ProfileStatus::kSaved);
  EXPECT_NEAR(*report.resident_budget_gb, 1.0, 1e-9);
  EXPECT_EQ(report.profile_measurement_kind, "baseline");
  EXPECT_NEAR(*report.peak_vram_gb, 6.0, 1e-9);
  EXPECT_NEAR(*report.total_vram_gb, 8.0, 1e-9);
  EXPECT_NEAR(*report.headroom_gb, 1.0, 1e-9);

  json j = report.to_json();
  EXPECT_EQ(j["name"], "my-workload");
  EXPECT_EQ(j["status"], "saved");
  EXPECT_EQ(j["profile_measurement_kind"], "baseline");
  EXPECT_TRUE(j["path"].get<std::string>().ends_with(".json"));
  EXPECT_TRUE(j["measurement"].contains("driver_peak_gb"));
  EXPECT_TRUE(j["measurement"].contains("allocator_peak_reserved_gb"));
  EXPECT_TRUE(j["measurement"].contains("initial_non_allocator_gb"));
  EXPECT_EQ(j["measurement"]["samples"], 4);
  EXPECT_NO_THROW((void)j.dump());  // JSON-safe

  // The next normal run applies it during setup; its region is a no-op.
  ProfileStore s = store();
  PreparedProfile next = prepare_profile(config_, kClass, s, kCard8);
  EXPECT_EQ(next.status, ProfileStatus::kApplied);
  EXPECT_EQ(next.region, RegionAction::kNone);
  EXPECT_NEAR(*next.resident_budget_gb, 1.0, 1e-9);
  EXPECT_EQ(next.report.to_json()["status"], "applied");
}

// Note [A reused profile is checked]: a reuse region is measured, nothing is saved, and a peak
// above the card fails naming the profile and what to do.
TEST_F(CalibrationTest, AReusedProfileThatOutgrewItsCardFails) {
  calibrate(6.0);  // 1 GiB recommended on the 8 GiB card with 1 GiB headroom
  ProfileStore s = store();
  const std::string before = [&] {
    std::ifstream in(prepare_profile(config_, kClass, s, kCard8).record_path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  PreparedProfile reuse = prepare_profile(config_, kClass, s, kCard8);
  ASSERT_EQ(reuse.status, ProfileStatus::kApplied);
  ASSERT_TRUE(reuse.check_peak);
  EXPECT_EQ(reuse.region, RegionAction::kNone);
  ProfileReport report;
  // The same workload ends near card - headroom: no note, no error.
  EXPECT_TRUE(check_reused_peak(reuse, region_peaking_at(6.9), &report).ok());
  EXPECT_NEAR(*report.run_peak_vram_gb, 6.9, 1e-9);
  EXPECT_TRUE(report.notes.empty());
  // Inside the headroom: a note.
  EXPECT_TRUE(check_reused_peak(reuse, region_peaking_at(7.5), &report).ok());
  ASSERT_EQ(report.notes.size(), 1u);
  EXPECT_NE(report.notes[0].find("headroom"), std::string::npos) << report.notes[0];
  // Above the card: the error says to calibrate this workload, and the report says failed.
  const Status outgrown = check_reused_peak(reuse, region_peaking_at(9.0), &report);
  EXPECT_EQ(outgrown.code(), Code::kResourceExhausted);
  EXPECT_NE(outgrown.message().find("this run peaked at 9.00 GiB"), std::string::npos)
      << outgrown.message();
  EXPECT_NE(outgrown.message().find("Calibrate this workload under its own name"),
            std::string::npos);
  EXPECT_EQ(report.to_json()["status"], "failed");
  // An aborted region is not judged; out of memory inside it gives the same advice.
  RegionResult aborted = region_peaking_at(9.0);
  aborted.exited_normally = false;
  EXPECT_TRUE(check_reused_peak(reuse, aborted, &report).ok());
  EXPECT_EQ(reused_profile_out_of_memory(reuse).code(), Code::kResourceExhausted);
  // Calibration regions are not reuse regions.
  DynamicOffloadConfig calibrating = config_;
  calibrating.build_profile = true;
  EXPECT_TRUE(reused_profile_out_of_memory(prepare_profile(calibrating, kClass, s, kCard8)).ok());
  // Nothing was written by any of it.
  std::ifstream in(reuse.record_path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), before);
}

// Note [Profiles and quantization]: the weights are not part of the identity; the saved budget
// records what it was measured with and a reuse with other weights says so.
TEST_F(CalibrationTest, TheSavedBudgetNamesTheWeightsItWasMeasuredWith) {
  ProfileStore s = store();
  DynamicOffloadConfig calibrating = config_;
  calibrating.build_profile = true;
  PreparedProfile prepared = prepare_profile(calibrating, kClass, s, kCard8, "bfloat16");
  ProfileReport saved;
  ASSERT_TRUE(finish_region(prepared, region_peaking_at(6.0), s, &saved).ok());
  EXPECT_EQ(saved.to_json()["measured_weights"], "bfloat16");
  std::optional<ProfileRecord> record = s.load({"my-workload", std::string(kClass)});
  ASSERT_TRUE(record && record->recommendation);
  EXPECT_EQ(record->recommendation->weights, "bfloat16");
  EXPECT_EQ(record->to_json()["recommendation"]["weights"], "bfloat16");

  // The same weights: applied, no note.
  PreparedProfile same = prepare_profile(config_, kClass, s, kCard8, "bfloat16");
  EXPECT_EQ(same.status, ProfileStatus::kApplied);
  EXPECT_TRUE(same.report.notes.empty());
  // Quantized weights under the same name: the same profile, applied, and a note naming both.
  PreparedProfile fp8 =
      prepare_profile(config_, kClass, s, kCard8, "sdnq float8_e4m3fn + bfloat16");
  EXPECT_EQ(fp8.status, ProfileStatus::kApplied);
  EXPECT_NEAR(*fp8.resident_budget_gb, 1.0, 1e-9);
  const json j = fp8.report.to_json();
  EXPECT_EQ(j["weights"], "sdnq float8_e4m3fn + bfloat16");
  EXPECT_EQ(j["measured_weights"], "bfloat16");
  ASSERT_EQ(fp8.report.notes.size(), 1u);
  EXPECT_NE(fp8.report.notes[0].find("calibrate this name again"), std::string::npos)
      << fp8.report.notes[0];
  // A recommendation without the field (the library's, or an older ddo's) names nothing.
  json file = record->to_json();
  file["recommendation"].erase("weights");
  ProfileRecord without;
  ASSERT_TRUE(ProfileRecord::from_json(file, &without).ok());
  EXPECT_TRUE(without.recommendation->weights.empty());
  file["recommendation"]["weights"] = 5;
  EXPECT_EQ(ProfileRecord::from_json(file, &without).code(), Code::kDataLoss);
}

TEST_F(CalibrationTest, PackedBaselineWithRoomSavesAPendingProbeThenTheProbeReplacesIt) {
  config_.execution_mode = ExecutionMode::kPackedRuntime;
  ProfileReport baseline = calibrate(4.5);  // safe 2.5 GiB: >= 2 and < ceiling 6
  EXPECT_EQ(baseline.status, ProfileStatus::kSaved);
  EXPECT_EQ(baseline.profile_measurement_kind, "sdnq_baseline_probe_pending");
  EXPECT_NEAR(*baseline.resident_budget_gb, 6.0, 1e-9);
  bool says_not_validated = false;
  for (const std::string& note : baseline.notes) {
    says_not_validated |= note.find("not a validated resident run") != std::string::npos;
  }
  EXPECT_TRUE(says_not_validated);
  {
    std::optional<ProfileRecord> record =
        store().load({"my-workload", std::string(kClass), "sdnq_runtime"});
    ASSERT_TRUE(record && record->recommendation);
    EXPECT_TRUE(record->recommendation->probe_pending);
    EXPECT_NEAR(*record->recommendation->safe_budget_gb, 2.5, 1e-9);
  }

  // The next normal run probes: the ceiling of 6, applied up to the room the calibrated peak
  // left on the card less half the headroom, 8 - 4.5 - 0.5 = 3 (Note [Probe within the card]).
  ProfileStore s = store();
  PreparedProfile probing = prepare_profile(config_, kClass, s, kCard8);
  EXPECT_EQ(probing.status, ProfileStatus::kProbing);
  EXPECT_EQ(probing.region, RegionAction::kProbe);
  EXPECT_NEAR(*probing.resident_budget_gb, 3.0, 1e-9);
  EXPECT_EQ(probing.report.to_json()["status"], "probing");

  ProfileReport probed;
  ASSERT_TRUE(finish_region(probing, region_peaking_at(7.4), s, &probed).ok());
  EXPECT_EQ(probed.status, ProfileStatus::kSaved);
  EXPECT_EQ(probed.profile_measurement_kind, "sdnq_probe");
  EXPECT_NEAR(*probed.resident_budget_gb, 2.6, 1e-9);  // 3 - (7.4 - 7)

  PreparedProfile after = prepare_profile(config_, kClass, s, kCard8);
  EXPECT_EQ(after.status, ProfileStatus::kApplied);
  EXPECT_EQ(after.region, RegionAction::kNone);
  EXPECT_NEAR(*after.resident_budget_gb, 2.6, 1e-9);
  std::optional<ProfileRecord> record =
      s.load({"my-workload", std::string(kClass), "sdnq_runtime"});
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(record->observations.size(), 2u);
  EXPECT_FALSE(record->recommendation->probe_pending);
  // The probe at 3 GiB overshot total - headroom: recorded as a capacity failure.
  EXPECT_EQ(record->capacity.at("resident_budget_gb").min_failure, 3.0);
}

TEST_F(CalibrationTest, PackedBaselineWithLittleRoomIsSafe) {
  config_.execution_mode = ExecutionMode::kPackedRuntime;
  ProfileReport report = calibrate(6.17);
  EXPECT_EQ(report.profile_measurement_kind, "sdnq_baseline_safe");
  EXPECT_NEAR(*report.resident_budget_gb, 0.83, 1e-6);
}

// diffusers-dynamic-offloader, run: a positive manual budget with a saved profile reports
// {"name": ..., "status": "disabled"} and does not load the profile. ddo says the same and adds
// why (not "applied" with budget_source "manual").
TEST_F(CalibrationTest, ManualBudgetDisablesProfileReuse) {
  calibrate(6.0);  // saves 1 GiB
  config_.resident_module_budget_gb = 2.0;
  ProfileStore s = store();
  PreparedProfile prepared = prepare_profile(config_, kClass, s, kCard8);
  EXPECT_EQ(prepared.status, ProfileStatus::kDisabled);
  EXPECT_NEAR(*prepared.resident_budget_gb, 2.0, 1e-9);
  EXPECT_EQ(prepared.region, RegionAction::kNone);
  json j = prepared.report.to_json();
  EXPECT_EQ(j["name"], "my-workload");
  EXPECT_EQ(j["status"], "disabled");
  EXPECT_EQ(j["budget_source"], "manual");
  EXPECT_FALSE(j.contains("recommended_budget_gb"));  // not read
  ASSERT_EQ(j["notes"].size(), 1u);
  EXPECT_NE(j["notes"][0].get<std::string>().find("overrides profile reuse"), std::string::npos);

  // Not read at all: an unreadable file gives no warning either.
  fs::path path = s.path_for(prepared.identity);
  std::ofstream(path, std::ios::trunc) << "{broken";
  warnings_.clear();
  EXPECT_EQ(prepare_profile(config_, kClass, s, kCard8).status, ProfileStatus::kDisabled);
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(CalibrationTest, ManualBudgetIsIgnoredWhileCalibrating) {
  config_.resident_module_budget_gb = 2.0;
  ProfileReport report = calibrate(6.0);
  EXPECT_NEAR(*report.resident_budget_gb, 1.0, 1e-9);
}

TEST_F(CalibrationTest, MaxBudgetCapsAReusedRecommendation) {
  const DeviceFacts card24{.is_cuda_like = true, .total_vram_bytes = 24LL << 30};
  calibrate(4.0, card24);  // saves 19 GiB
  ProfileStore s = store();
  PreparedProfile capped = prepare_profile(config_, kClass, s, card24);
  EXPECT_NEAR(*capped.resident_budget_gb, 6.0, 1e-9);
  EXPECT_NEAR(*capped.report.recommended_budget_gb, 19.0, 1e-9);
  config_.max_resident_module_budget_gb = 0.0;  // uncapped
  EXPECT_NEAR(*prepare_profile(config_, kClass, s, card24).resident_budget_gb, 19.0, 1e-9);
}

TEST_F(CalibrationTest, ExceptionInsideTheRegionLeavesTheProfileByteForByte) {
  calibrate(6.0);
  ProfileStore s = store();
  const fs::path path = s.path_for({"my-workload", std::string(kClass)});
  const std::string before = read_all(path);
  ASSERT_FALSE(before.empty());

  DynamicOffloadConfig config = config_;
  config.build_profile = true;
  PreparedProfile prepared = prepare_profile(config, kClass, s, kCard8);
  RegionResult aborted = region_peaking_at(3.0);
  aborted.exited_normally = false;
  ProfileReport report;
  EXPECT_TRUE(finish_region(prepared, aborted, s, &report).ok());
  EXPECT_EQ(report.status, ProfileStatus::kFailed);
  EXPECT_EQ(report.to_json()["status"], "failed");
  EXPECT_EQ(read_all(path), before);
}

TEST_F(CalibrationTest, AbortedProbeKeepsThePendingProbe) {
  config_.execution_mode = ExecutionMode::kPackedRuntime;
  calibrate(4.5);
  ProfileStore s = store();
  const std::string before = read_all(s.path_for({"my-workload", std::string(kClass)}));
  PreparedProfile probing = prepare_profile(config_, kClass, s, kCard8);
  ASSERT_EQ(probing.status, ProfileStatus::kProbing);
  ProfileReport report;
  EXPECT_TRUE(finish_region(probing, RegionResult{}, s, &report).ok());
  EXPECT_EQ(read_all(s.path_for({"my-workload", std::string(kClass)})), before);
  EXPECT_EQ(prepare_profile(config_, kClass, s, kCard8).status, ProfileStatus::kProbing);
}

// The execution mode is part of the identity (diffusers-dynamic-offloader's identity version 2): a
// packed (SDNQ) profile is not found by a dense run of the same name.
TEST_F(CalibrationTest, TheExecutionModeIsPartOfTheIdentity) {
  config_.execution_mode = ExecutionMode::kPackedRuntime;
  calibrate(4.5);
  config_.execution_mode = ExecutionMode::kLinearRuntime;
  ProfileStore s = store();
  EXPECT_EQ(prepare_profile(config_, kClass, s, kCard8).status, ProfileStatus::kMissing);
}

TEST_F(CalibrationTest, PendingProbeARunCannotProbeAppliesTheSafeBudget) {
  config_.execution_mode = ExecutionMode::kPackedRuntime;
  calibrate(4.5);
  ProfileStore s = store();
  const DeviceFacts host{.is_cuda_like = false, .total_vram_bytes = 0};
  config_.execution_device = "cpu";
  PreparedProfile prepared = prepare_profile(config_, kClass, s, host);
  EXPECT_EQ(prepared.status, ProfileStatus::kApplied);
  EXPECT_EQ(prepared.region, RegionAction::kNone);
  EXPECT_NEAR(*prepared.resident_budget_gb, 2.5, 1e-9);
}

// ---- Statuses ----------------------------------------------------------------------------

TEST_F(CalibrationTest, NoNameIsDisabledAndNoRecordIsMissing) {
  ProfileStore s = store();
  DynamicOffloadConfig config = config_;
  config.profile_name.clear();
  PreparedProfile disabled = prepare_profile(config, kClass, s, kCard8);
  EXPECT_EQ(disabled.status, ProfileStatus::kDisabled);
  EXPECT_FALSE(disabled.resident_budget_gb.has_value());
  EXPECT_EQ(disabled.report.to_json()["status"], "disabled");

  PreparedProfile missing = prepare_profile(config_, kClass, s, kCard8);
  EXPECT_EQ(missing.status, ProfileStatus::kMissing);
  EXPECT_EQ(missing.region, RegionAction::kNone);
  EXPECT_FALSE(missing.resident_budget_gb.has_value());
  EXPECT_EQ(missing.report.to_json()["status"], "missing");
  ProfileReport report;
  EXPECT_TRUE(finish_region(missing, region_peaking_at(5), s, &report).ok());
  EXPECT_EQ(report.status, ProfileStatus::kMissing);
  EXPECT_FALSE(fs::exists(missing.record_path));
}

TEST_F(CalibrationTest, ACorruptProfileIsMissingWithAWarning) {
  fs::create_directories(dir_);
  ProfileStore s = store();
  std::ofstream(s.path_for({"my-workload", std::string(kClass)})) << "{\"schema_version\": 1";
  PreparedProfile prepared;
  EXPECT_NO_THROW(prepared = prepare_profile(config_, kClass, s, kCard8));
  EXPECT_EQ(prepared.status, ProfileStatus::kMissing);
  EXPECT_EQ(warnings_.size(), 1u);
}

TEST_F(CalibrationTest, SaveFailureIsReportedAndReturned) {
  ProfileStore s = store();
  DynamicOffloadConfig config = config_;
  config.build_profile = true;
  PreparedProfile prepared = prepare_profile(config, kClass, s, kCard8);
  // The directory turns into a file during the run.
  fs::remove_all(dir_);
  std::ofstream(dir_) << "not a directory";
  ProfileReport report;
  Status status = finish_region(prepared, region_peaking_at(6), s, &report);
  EXPECT_EQ(status.code(), Code::kUnavailable);
  EXPECT_EQ(report.status, ProfileStatus::kFailed);
  ASSERT_TRUE(report.error.has_value());
  EXPECT_NE(report.error->find("DDO_PROFILE_DIR"), std::string::npos);
}

// A profile directory that cannot be written is an error at setup, before the measured run.
TEST_F(CalibrationTest, AnUnwritableProfileDirectoryFailsBeforeTheRun) {
  fs::create_directories(dir_.parent_path());
  std::ofstream(dir_) << "not a directory";
  ProfileStore s = store();
  DynamicOffloadConfig config = config_;
  config.build_profile = true;
  try {
    (void)prepare_profile(config, kClass, s, kCard8);
    FAIL() << "calibration prepared with a profile directory that is a file";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
    const std::string message = e.what();
    EXPECT_NE(message.find("'my-workload' cannot be saved"), std::string::npos) << message;
    EXPECT_NE(message.find(dir_.string()), std::string::npos) << message;
    EXPECT_NE(message.find("DDO_PROFILE_DIR"), std::string::npos) << message;
  }
  // A normal run only reads: it still runs (the profile is missing).
  EXPECT_EQ(prepare_profile(config_, kClass, s, kCard8).status, ProfileStatus::kMissing);
}

// ---- Bad input ---------------------------------------------------------------------------

Code prepare_error(const DynamicOffloadConfig& config, std::string_view model_class,
                   const ProfileStore& store, const DeviceFacts& device, std::string* message) {
  try {
    (void)prepare_profile(config, model_class, store, device);
  } catch (const Error& e) {
    *message = e.what();
    return e.code();
  }
  return Code::kOk;
}

TEST_F(CalibrationTest, CalibrationErrorsSayWhatToChange) {
  ProfileStore s = store();
  DynamicOffloadConfig base = config_;
  base.build_profile = true;
  std::string message;

  DynamicOffloadConfig c = base;
  c.profile_name = "";
  EXPECT_EQ(prepare_error(c, kClass, s, kCard8, &message), Code::kInvalidArgument);
  EXPECT_NE(message.find("profile_name"), std::string::npos) << message;

  c = base;
  c.profile_name = " \t\n";
  EXPECT_EQ(prepare_error(c, kClass, s, kCard8, &message), Code::kInvalidArgument);
  EXPECT_NE(message.find("whitespace"), std::string::npos) << message;

  c = base;
  c.execution_device = "cpu";
  EXPECT_EQ(prepare_error(c, kClass, s, {.is_cuda_like = false, .total_vram_bytes = 0}, &message),
            Code::kFailedPrecondition);
  EXPECT_NE(message.find("'cpu'"), std::string::npos) << message;

  c = base;
  c.execution_mode = ExecutionMode::kPlan;
  EXPECT_EQ(prepare_error(c, kClass, s, kCard8, &message), Code::kFailedPrecondition);
  EXPECT_NE(message.find("plan"), std::string::npos) << message;

  c = base;
  c.route = Route::kGroupBlock;
  EXPECT_EQ(prepare_error(c, kClass, s, kCard8, &message), Code::kFailedPrecondition);
  EXPECT_NE(message.find("dynamic"), std::string::npos) << message;

  for (double headroom :
       {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    c = base;
    c.profile_vram_headroom_gb = headroom;
    EXPECT_EQ(prepare_error(c, kClass, s, kCard8, &message), Code::kInvalidArgument) << headroom;
    EXPECT_NE(message.find("profile_vram_headroom_gb"), std::string::npos) << message;
  }

  EXPECT_EQ(prepare_error(base, "  ", s, kCard8, &message), Code::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir_)) << "a refused calibration must not create files";
}

TEST_F(CalibrationTest, SimAndCudaDevicesMayCalibrate) {
  ProfileStore s = store();
  DynamicOffloadConfig c = config_;
  c.build_profile = true;
  for (const char* device : {"cuda", "cuda:1", "sim", "sim:0"}) {
    c.execution_device = device;
    EXPECT_EQ(prepare_profile(c, kClass, s, kCard8).status, ProfileStatus::kCalibrating) << device;
  }
  c.execution_device = "cuda:x";
  EXPECT_THROW((void)prepare_profile(c, kClass, s, kCard8), Error);
  c.execution_device = "cuda:0";
  EXPECT_THROW((void)prepare_profile(c, kClass, s, {.is_cuda_like = false}), Error);
}

TEST(NormalizeDeviceTest, Spellings) {
  EXPECT_EQ(normalize_calibration_device("cuda"), "cuda:0");
  EXPECT_EQ(normalize_calibration_device("cuda:00"), "cuda:0");
  EXPECT_EQ(normalize_calibration_device("cuda:12"), "cuda:12");
  EXPECT_EQ(normalize_calibration_device("sim"), "sim:0");
  EXPECT_EQ(normalize_calibration_device("sim:3"), "sim:3");
  EXPECT_FALSE(normalize_calibration_device("cpu").has_value());
  EXPECT_FALSE(normalize_calibration_device("cuda:").has_value());
  EXPECT_FALSE(normalize_calibration_device("cudax").has_value());
  EXPECT_FALSE(normalize_calibration_device("mps").has_value());
}

TEST(CalibrationRegionLockTest, NestedRegionsOnOneDeviceAreRefused) {
  CalibrationRegionLock outer = CalibrationRegionLock::acquire("cuda:0");
  try {
    (void)CalibrationRegionLock::acquire("cuda");  // same device, other spelling
    FAIL() << "a nested region was allowed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos);
  }
  CalibrationRegionLock other = CalibrationRegionLock::acquire("cuda:1");  // another device
  CalibrationRegionLock moved = std::move(outer);
  EXPECT_THROW((void)CalibrationRegionLock::acquire("cuda:0"), Error);
  { CalibrationRegionLock released = std::move(moved); }
  EXPECT_NO_THROW((void)CalibrationRegionLock::acquire("cuda:0"));
}

using ddo::testing::ChildProcess;
using ddo::testing::start_child;

// Note [Calibration across processes]. The device index is this test process's own (derived
// from its id), so concurrent test runs on one machine do not meet on one lock file.
std::string unique_cuda_device() {
  return "cuda:" + std::to_string(200 + ddo::testing::process_id() % 800);
}

// Waits (polling, bounded) until `path` exists; false when the bound passes first.
bool wait_for_file(const fs::path& path) {
  for (int i = 0; i < 600; ++i) {
    if (fs::exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// args: device, folder. Holds a region on the device until <folder>/release appears.
DDO_TEST_CHILD(hold_calibration_region) {
  CalibrationRegionLock lock = CalibrationRegionLock::acquire(args.at(0));
  std::ofstream(fs::path(args.at(1)) / "held") << "held";
  return wait_for_file(fs::path(args.at(1)) / "release") ? 0 : 3;
}

TEST(CalibrationRegionLockTest, ARegionInAnotherProcessOnTheSameGpuIsRefused) {
  const std::string device = unique_cuda_device();
  const fs::path lock = CalibrationRegionLock::lock_file_for(device);
  ASSERT_FALSE(lock.empty());
  EXPECT_NE(lock.filename().string().find("ddo-calibrating-cuda-"), std::string::npos) << lock;
#ifndef _WIN32
  EXPECT_NE(lock.filename().string().find("-user-" + std::to_string(::geteuid()) + ".lock"),
            std::string::npos)
      << lock;  // per user: Note [Calibration across processes]
#endif
  EXPECT_TRUE(CalibrationRegionLock::lock_file_for("sim:0").empty());  // per process
  const fs::path dir =
      fs::temp_directory_path() / ("ddo-region-lock-" + std::to_string(ddo::testing::process_id()));
  fs::create_directories(dir);
  ChildProcess child = start_child("hold_calibration_region", {device, dir.string()});
  ASSERT_GT(child.pid(), 0);
  ASSERT_TRUE(wait_for_file(dir / "held")) << "the child never took the region";
  try {
    (void)CalibrationRegionLock::acquire(device);
    ADD_FAILURE() << "a region held by another process was allowed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("another process is calibrating on " + device),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("process " + std::to_string(child.pid()) + " holds"),
              std::string::npos)
        << e.what();
  }
  // Another GPU is free, and so is this one once the other process's region ends.
  EXPECT_NO_THROW((void)CalibrationRegionLock::acquire(
      "cuda:" + std::to_string(1 + 200 + ddo::testing::process_id() % 800)));
  std::ofstream(dir / "release") << "go";
  EXPECT_EQ(child.wait(), 0);
  EXPECT_NO_THROW((void)CalibrationRegionLock::acquire(device));
  ddo::testing::remove_tree(dir);
}

#ifndef _WIN32
// The calibration lock's name is fixed, in a folder every user can write: what another user can
// leave there must never be followed, used or block silently. POSIX only:
// links, FIFOs and owners as tested here (scripts/windows-test.sh lists the exclusions).

// Expects acquire() to refuse `device` with a message holding `words`.
void expect_refused(const std::string& device, const std::string& words) {
  try {
    (void)CalibrationRegionLock::acquire(device);
    ADD_FAILURE() << "a hostile lock file was used";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot take the calibration lock for " + device),
              std::string::npos)
        << e.what();
  }
}

// A symbolic link at the lock's name is refused, and its target is never created or locked, even
// by a root process.
TEST(CalibrationRegionLockTest, ALinkAtTheLockNameIsRefusedAndItsTargetIsNeverCreated) {
  const std::string device = unique_cuda_device();
  const fs::path lock = CalibrationRegionLock::lock_file_for(device);
  const fs::path dir =
      fs::temp_directory_path() / ("ddo-lock-link-" + std::to_string(ddo::testing::process_id()));
  fs::create_directories(dir);
  const fs::path target = dir / "victim";
  fs::remove(lock);
  fs::create_symlink(target, lock);
  expect_refused(device, "is a symbolic link");
  EXPECT_FALSE(fs::exists(target)) << "the link's target was created";
  fs::remove(lock);
  ddo::testing::remove_tree(dir);
}

// Only a regular file of this user's is taken as the lock: another user's file, a FIFO or a
// directory at the lock's name is refused.
TEST(CalibrationRegionLockTest, AnotherUsersFileOrANonRegularFileIsRefused) {
  const std::string device = unique_cuda_device();
  const fs::path lock = CalibrationRegionLock::lock_file_for(device);
  fs::remove(lock);
  ASSERT_EQ(::mkfifo(lock.c_str(), 0600), 0);
  expect_refused(device, "is a FIFO, not a lock file");
  fs::remove(lock);
  fs::create_directory(lock);
  expect_refused(device, "is a directory, not a lock file");
  fs::remove(lock);
  if (::geteuid() == 0) {  // only root can give a file away
    std::ofstream(lock) << "1\n";
    ASSERT_EQ(::chown(lock.c_str(), 65534, 65534), 0);  // nobody
    expect_refused(device, "belongs to user id 65534, not to this user");
    fs::remove(lock);
  }
  // A file of this user's is taken, and holds this process's id while held.
  {
    CalibrationRegionLock held = CalibrationRegionLock::acquire(device);
    EXPECT_EQ(read_all(lock), std::to_string(::getpid()) + "\n");
  }
  fs::remove(lock);
}
#endif  // !_WIN32

}  // namespace
}  // namespace ddo::core
