/// \file
/// ProfileRun: the measured region of a named workload profile (`profile_run()` of
/// docs/design/0007-named-profiles.md).
///
/// Calibration run (build_profile = true): the region synchronizes the device at its boundaries,
/// takes the process-wide calibration lock for the device (a nested or concurrent region on the
/// same device is refused with ddo::Error kFailedPrecondition), resets the peak counters, samples
/// device memory while the host's code runs, and saves the recommendation only when the region
/// ends normally. A pending SDNQ probe is measured the same way. Normal run: the stored
/// recommendation was already applied by enable_offload; the region does nothing and its report
/// says "applied" (or "missing", "disabled").
///
/// Two forms with the same meaning:
///
/// ```
/// // RAII scope: finish() ends the region normally (and saves); it returns the report.
/// {
///   ddo::adapter::ProfileRun run = offload->profile_run();
///   latents = denoise(latents);
///   nlohmann::json report = run.finish();
/// }
/// // A ProfileRun destroyed without finish() -- during stack unwinding
/// // (std::uncaught_exceptions() > 0) or because the code forgot it -- aborts: nothing is saved
/// // and the stored profile stays byte-for-byte as it was.
/// ```
///
/// ```
/// // Callable: runs `region` inside; rethrows its exception after aborting the region.
/// nlohmann::json report = offload->profile_run([&] { latents = denoise(latents); });
/// ```
///
/// A pipeline's profile_run() (PipelineOffload, enable_offload.h) is one region over all its
/// profiled denoisers: one lock, one measurement, each denoiser saving its share of the room
/// (Note [One region over several offloads] in profile_run.cpp).
///
/// The report is JSON-safe (docs/design/0007-named-profiles.md, section 5: name, status,
/// resident_budget_gb, path, peak_vram_gb, total_vram_gb, headroom_gb, profile_measurement_kind,
/// measurement) and is also kept by the offload (`Offload::profile_report()`), so it stays readable
/// after the region.
#pragma once

#include <memory>

#include <nlohmann/json.hpp>

namespace ddo::adapter {

namespace internal {
struct OffloadState;
struct RegionState;
}  // namespace internal

/// The measured region of an offload (Offload::profile_run()): alive from the start of the host's
/// region to its end; finish() saves, destruction without it aborts.
class ProfileRun {
 public:
  ProfileRun(ProfileRun&& other) noexcept;  ///< `other` becomes inactive
  ProfileRun& operator=(ProfileRun&& other) = delete;
  ProfileRun(const ProfileRun&) = delete;
  ProfileRun& operator=(const ProfileRun&) = delete;
  /// Aborts the region unless finish() ran: nothing is saved. Never throws.
  ~ProfileRun();

  /// Ends the region normally: synchronizes, measures, saves (calibration or probe) and returns
  /// the report. Throws ddo::Error when saving fails (the report then says "failed"). Calling it
  /// twice is an error.
  nlohmann::json finish();
  /// Ends the region without saving (what the destructor does); returns the report.
  nlohmann::json abort();
  /// abort() after the device ran out of memory inside the region. When the region reused a
  /// saved recommendation, the report's "error" says the workload outgrew it and to calibrate
  /// this workload under its own name (Note [A reused profile is checked] in
  /// core/src/calibration.cpp); the host raises it in place of the bare out-of-memory error.
  nlohmann::json abort_out_of_memory();

  /// The report as it stands (updated by finish/abort).
  const nlohmann::json& report() const;
  bool active() const;  ///< true until finish() or abort()

 private:
  friend class Offload;
  friend class PipelineOffload;  // one region over its profiled components
  explicit ProfileRun(std::unique_ptr<internal::RegionState> state);
  std::unique_ptr<internal::RegionState> state_;
};

}  // namespace ddo::adapter
