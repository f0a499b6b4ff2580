/// \file
/// The named-profile lifecycle as pure logic (docs/design/0007-named-profiles.md, section 3).
///
/// The torch adapter owns the device; this file owns every decision: whether a run calibrates,
/// reuses a saved recommendation, applies a pending packed-layer probe or does nothing; which
/// resident budget it uses; how a region's memory readings become a peak; and what is saved.
/// Keeping it free of torch and CUDA lets every case of the lifecycle run as a unit test.
///
/// ```
/// ddo::core::PreparedProfile prepared = ddo::core::prepare_profile(
///     config, "my::Transformer", store, {.is_cuda_like = true, .total_vram_bytes = total});
/// // setup: when prepared.resident_budget_gb is set, plan with that budget.
/// {
///   std::optional<ddo::core::CalibrationRegionLock> lock;
///   if (prepared.region != ddo::core::RegionAction::kNone)
///     lock = ddo::core::CalibrationRegionLock::acquire(prepared.device);  // throws if nested
///   ...sync, reset peak counters, read start values, run the host's region, sync...
///   ddo::core::RegionResult result{.exited_normally = !threw, .inputs = readings};
///   ddo::core::ProfileReport report;
///   ddo::Status saved = ddo::core::finish_region(prepared, result, store, &report);
/// }
/// // 8 GiB card, 1 GiB headroom, dense peak 6 GiB: report.resident_budget_gb == 1.0
/// ```
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/config.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/status.h"

namespace ddo::core {

/// A packed-layer baseline probes only when its safe budget is at least this, so a probe is worth
/// a run.
inline constexpr double kPackedProbeMinSafeGb = 2.0;
/// The probe ceiling when max_resident_module_budget_gb is 0 (uncapped).
inline constexpr double kPackedDefaultProbeCeilingGb = 6.0;

/// Where a named profile stands in a run, as reports spell it: disabled (no name), calibrating
/// (this run measures), missing (nothing saved for this identity), probing (a packed probe run),
/// applied (a saved recommendation is used), saved (a region saved one), failed (the region threw
/// or saving failed).
enum class ProfileStatus { kDisabled, kCalibrating, kMissing, kProbing, kApplied, kSaved, kFailed };
/// "disabled", "calibrating", ...: the spelling reports use.
const char* to_string(ProfileStatus status);

/// What profile_run() does around the host's region.
enum class RegionAction {
  kNone,       ///< no-op: disabled, missing, or a saved recommendation applied during setup
  kCalibrate,  ///< measure a zero-resident run and save a recommendation
  kProbe,      ///< measure a run at a pending packed-layer probe budget and save the result
};

/// Facts about the execution device, read by the adapter.
struct DeviceFacts {
  bool is_cuda_like = false;          ///< a CUDA device or the "sim" simulated device
  std::int64_t total_vram_bytes = 0;  ///< the card, or the emulated cap; > 0 to calibrate
};

/// Readings at the region boundaries. Byte counts; "driver" is what the device reports as used
/// (cudaMemGetInfo total - free), "allocator" is PyTorch's caching allocator.
struct MeasurementInputs {
  std::int64_t driver_used_start_bytes = 0;             ///< when the region began
  std::int64_t driver_used_end_bytes = 0;               ///< when it ended
  std::vector<std::int64_t> driver_used_samples_bytes;  ///< optional samples taken inside
  std::int64_t allocator_reserved_start_bytes = 0;      ///< when the region began
  std::int64_t allocator_peak_reserved_bytes = 0;  ///< after resetting peak counters at the start
};

// Note [Peak rule]
// ~~~~~~~~~~~~~~~~
// The peak of a measured region is the larger of two estimates, each of which can fall short:
//
//   driver_peak    = max(driver used at the start, at the end, and every sample in between)
//   allocator_peak = max(allocator peak reserved, allocator reserved at the start)
//   non_allocator  = max(0, driver used at the start - allocator reserved at the start)
//   peak           = max(driver_peak, allocator_peak + non_allocator)
//
// The driver's figure (cudaMemGetInfo total - free; on the simulation the arena plus counted CPU
// tensors) sees everything on the device, the CUDA context, library workspaces, other processes,
// but only at the instants it is read: an activation that lives 3 ms between two 2 ms samples
// escapes it. The allocator's peak counter misses no allocation but sees only the allocator, so
// the memory outside it is added as it stood when the region began (assumed constant; what
// changes outside the allocator mid-region is caught by samples alone). Reserved bytes include
// the allocator's cache, which keeps the estimate conservative.
//
// The allocator peak is at least what was reserved at the start: the counters are reset to the
// current values, so the region's peak includes its first instant. A source whose reset goes to
// zero, or two readings taken a moment apart (driver below reserved at the start, so that
// non_allocator clamps to 0), would otherwise report a peak below memory the region held.
//
// This is the one copy of the rule: the torch adapter's MemoryProbe (combine_measurement)
// calls measure_peak with its readings. docs/design/0002-measurement.md gives the background.

/// The figures of a region and its conservative peak; see Note [Peak rule].
struct Measurement {
  std::int64_t driver_peak_bytes = 0;  ///< max of the driver readings
  /// The allocator's peak over the region, never below its reserved bytes at the start.
  std::int64_t allocator_peak_reserved_bytes = 0;
  /// Driver used - allocator reserved at start, >= 0.
  std::int64_t initial_non_allocator_bytes = 0;
  std::int64_t peak_bytes = 0;  ///< the conservative peak (Note [Peak rule])
  int samples = 0;              ///< driver readings taken (start, end and inside)

  nlohmann::json to_json() const;  ///< GiB fields plus the sample count
};

/// Combines a region's readings into the conservative peak (Note [Peak rule]).
///
/// ```
/// MeasurementInputs in{.driver_used_start_bytes = 1 * kGiBBytes,         // 0.8 GiB outside
///                      .allocator_reserved_start_bytes = kGiBBytes / 5,   //   the allocator
///                      .allocator_peak_reserved_bytes = 4 * kGiBBytes};   // no sample saw it
/// measure_peak(in).peak_bytes;  // 4.8 GiB: the allocator term beats the 1 GiB driver readings
/// ```
Measurement measure_peak(const MeasurementInputs& inputs);

/// max(0, total - peak - headroom), in GiB.
double recommend_resident_budget_gb(double total_gb, double peak_gb, double headroom_gb);

/// A saved resident budget as a run may apply it: at most max_resident_budget_gb when that is
/// positive (the cap on a saved recommendation, docs/design/0007-named-profiles.md, section 3).
double cap_saved_budget_gb(double budget_gb, double max_resident_budget_gb);

/// The packed-layer probe ceiling: max_resident_budget_gb when positive else 6 GiB, never above
/// total - headroom (and never below 0).
double packed_probe_ceiling_gb(double max_resident_budget_gb, double total_gb, double headroom_gb);

/// The recommendation after a zero-resident calibration (dense: "baseline"; packed layers: a
/// pending probe or "sdnq_baseline_safe", the kinds' file spellings in profile_store.h).
ProfileRecommendation recommend_after_calibration(bool packed, double total_gb, double peak_gb,
                                                  double headroom_gb,
                                                  double max_resident_budget_gb);

/// The recommendation after a probe run: probe - share * max(0, peak - (total - headroom)), >= 0.
/// `share`: this model's share of the overshoot when several denoisers probed in one region
/// (Note [Denoisers share one calibration] in pipeline_profiles.h); 1 for a single model.
ProfileRecommendation recommend_after_probe(double probe_gb, double total_gb, double peak_gb,
                                            double headroom_gb, double share = 1.0);

/// JSON-safe information for the host's metrics (docs/design/0007-named-profiles.md, section 5).
struct ProfileReport {
  std::string name;                                 ///< the profile name
  ProfileStatus status = ProfileStatus::kDisabled;  ///< where the profile stands
  /// The budget this run uses, when the profile decided it.
  std::optional<double> resident_budget_gb;
  std::optional<std::string> budget_source;     ///< "calibration", "profile", "probe", "manual"
  std::optional<double> recommended_budget_gb;  ///< the saved value when another one is used
  std::optional<std::string> path;              ///< the profile's file
  std::optional<double> peak_vram_gb;           ///< measured in the region
  std::optional<double> total_vram_gb;          ///< the card or cap the recommendation is for
  std::optional<double> headroom_gb;            ///< profile_vram_headroom_gb used
  /// This model's share of the region's measured room, when several denoisers shared the region
  /// (Note [Denoisers share one calibration] in pipeline_profiles.h).
  std::optional<double> budget_share;
  std::optional<std::string> profile_measurement_kind;  ///< what the saved recommendation came
                                                        ///< from, e.g. "baseline" or "sdnq_probe"
  std::optional<Measurement> measurement;               ///< the region's figures, when it measured
  /// A reuse region's measured peak (check_reused_peak), beside the saved one (peak_vram_gb).
  std::optional<double> run_peak_vram_gb;
  /// This run's weights (ModelInventory::weights_summary; Note [Profiles and quantization] in
  /// calibration.cpp).
  std::optional<std::string> weights;
  /// The weights the saved recommendation was measured with, when it says.
  std::optional<std::string> measured_weights;
  std::vector<std::string> notes;    ///< why: manual override, cap, pending probe, failure
  std::optional<std::string> error;  ///< why saving failed

  nlohmann::json to_json() const;  ///< the report as hosts receive it; absent fields are left out
};

/// The decision for one enable_offload call.
struct PreparedProfile {
  ProfileStatus status = ProfileStatus::kDisabled;  ///< the lifecycle state
  RegionAction region = RegionAction::kNone;        ///< what profile_run() will do
  /// The resident budget the run must use when the profile decides it (calibration 0, a reused
  /// or probed recommendation, or the manual budget that won over one); nullopt: not decided here.
  std::optional<double> resident_budget_gb;
  ProfileIdentity identity;           ///< name, model class and identity version
  std::filesystem::path record_path;  ///< where the profile is stored
  std::string device;   ///< normalized execution device ("cuda:0", "sim:0"); key of region locks
  bool packed = false;  ///< the model runs packed layers (calibration then plans a probe)
  double headroom_gb = 0.0;               ///< profile_vram_headroom_gb
  double total_vram_gb = 0.0;             ///< the device's total (or cap)
  double max_resident_budget_gb = 0.0;    ///< max_resident_module_budget_gb; 0 = uncapped
  std::optional<double> probe_budget_gb;  ///< kProbe only
  std::optional<double> safe_budget_gb;   ///< kProbe only: the baseline's safe budget, kept
  /// The saved profile's measured compute per candidate, when its recommendation is applied
  /// (PlanContext::candidate_compute_ms).
  std::map<std::string, double> candidate_compute_ms;
  std::string weights;  ///< this run's ModelInventory::weights_summary(), saved with the result
  /// A saved recommendation was applied on a device that can measure: profile_run() measures the
  /// region anyway and check_reused_peak() fails a run that outgrew it (Note [A reused profile is
  /// checked] in calibration.cpp).
  bool check_peak = false;
  ProfileReport report;  ///< the report as prepared; finish_region() completes it
};

/// Checks the config and decides the lifecycle. Throws ddo::Error: kInvalidArgument for a bad
/// name, class or headroom; kFailedPrecondition when calibration is asked on a non-CUDA device, in
/// plan mode, or through a route other than dynamic. Never throws for stored file content.
/// `weights`: the model's ModelInventory::weights_summary(), recorded with what a region saves and
/// compared with what a reused recommendation was measured with ("" when unknown).
PreparedProfile prepare_profile(const DynamicOffloadConfig& config, std::string_view model_class,
                                const ProfileStore& store, const DeviceFacts& device,
                                std::string_view weights = {});

/// How the host's region ended.
struct RegionResult {
  bool exited_normally = false;  ///< false: the region threw; nothing is saved
  MeasurementInputs inputs;      ///< the readings at the region's boundaries
  /// GPU ms per step of each residency candidate, measured by the host in a calibration region
  /// (every candidate streamed); saved with the recommendation for the next run's placement.
  std::map<std::string, double> candidate_compute_ms;
  /// This model's share of the measured room, in [0, 1]: below 1 when several denoisers of a
  /// pipeline were measured in the region (Note [Denoisers share one calibration] in
  /// pipeline_profiles.h); a saved recommendation is scaled by it.
  double budget_share = 1.0;
};

/// For a region that applied a saved recommendation (prepared.check_peak) and exited normally:
/// the run's peak against the card (or cap) the profile was made for. `report` is the prepared
/// report with run_peak_vram_gb; a peak above the card is kResourceExhausted saying to calibrate
/// this workload under its own name (report status failed), a peak inside the headroom a note.
/// Nothing is saved either way.
Status check_reused_peak(const PreparedProfile& prepared, const RegionResult& result,
                         ProfileReport* report);

/// For a region that applied a saved recommendation (prepared.check_peak) and in which the device
/// ran out of memory: kResourceExhausted saying to calibrate this workload under its own name;
/// ok for any other region.
Status reused_profile_out_of_memory(const PreparedProfile& prepared);

/// Completes the region: for kCalibrate and kProbe regions that exited normally, computes and
/// saves the recommendation. `report` is always filled (saved, failed, or the prepared report for
/// kNone). Returns the store's error when saving failed; an aborted region is not an error here
/// (the host's exception is the error) and leaves the file byte-for-byte unchanged.
Status finish_region(const PreparedProfile& prepared, const RegionResult& result,
                     ProfileStore& store, ProfileReport* report);

/// "cuda" -> "cuda:0", "sim:1" -> "sim:1"; nullopt for devices that cannot calibrate.
std::optional<std::string> normalize_calibration_device(std::string_view device);

/// Guard against nested or concurrent calibration regions on one device: the device's peak
/// counters are global, so two regions would reset and read each other's peaks. Within a process
/// for every device; across processes for CUDA devices, through a lock file in the system's
/// temporary folder (Note [Calibration across processes] in calibration.cpp).
class CalibrationRegionLock {
 public:
  /// Throws ddo::Error (kFailedPrecondition) when a region on `device` is already active in
  /// this process or, for a CUDA device, in another of this user's processes (the message names
  /// its process id), and when the lock file's name is taken by a symbolic link, a file that is
  /// not regular or another user's file (never followed or used).
  static CalibrationRegionLock acquire(std::string_view device);

  /// The lock file that guards regions on CUDA `device` across this user's processes ("cuda:0"
  /// -> "<temp>/ddo-calibrating-cuda-0-user-<uid>.lock"; on Windows, whose temporary folder is
  /// per user, "<temp>/ddo-calibrating-cuda-0.lock"); empty for devices that need none (the
  /// simulation is per process).
  static std::filesystem::path lock_file_for(std::string_view device);

  /// `other` no longer holds the lock.
  CalibrationRegionLock(CalibrationRegionLock&& other) noexcept;
  /// Releases the held lock first.
  CalibrationRegionLock& operator=(CalibrationRegionLock&& other) noexcept;
  CalibrationRegionLock(const CalibrationRegionLock&) = delete;
  CalibrationRegionLock& operator=(const CalibrationRegionLock&) = delete;
  ~CalibrationRegionLock();

  /// The device whose regions are locked; empty once moved from.
  const std::string& device() const { return device_; }

 private:
  explicit CalibrationRegionLock(std::string device, int fd)
      : device_(std::move(device)), fd_(fd) {}
  void release();

  std::string device_;  ///< empty once moved from
  int fd_ = -1;         ///< the held lock file (CUDA devices), or -1
};

}  // namespace ddo::core
