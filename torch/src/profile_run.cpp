// profile_run(): the measured region of a named workload profile. See profile_run.h.
#include "ddo/torch/profile_run.h"

#include <cstdio>
#include <exception>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "ddo/core/calibration.h"
#include "ddo/core/profile_store.h"
#include "ddo/torch/enable_offload.h"
#include "offload_state.h"

namespace ddo::adapter {
namespace internal {

// Note [remove() inside a measured region]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A calibration or probe region that sees remove() measured part of a run on the offloaded model
// and part on an ordinary one (or none): saving it replaced a good recommendation with a
// number of no meaning. Two answers were possible: refuse remove() while a region is
// open, or let it happen and fail the region. The region fails, with nothing saved: remove() is
// also what Offload's destructor and error paths call (they must restore the model and cannot
// throw), and a host that removes the model mid-region, e.g. while handling its own error,
// needs the model restored more than it needs the measurement. A region that ends normally
// after remove() throws kFailedPrecondition saying so. An aborted one is already not saved and
// ends quietly: it is aborted because an exception is on its way to the host (the callable form
// rethrows it after abort()), and that exception says what failed. Throwing the remove()
// complaint from abort() replaced it, so a copy that failed on the device reached the host as
// "removed inside the region" (fault_injection_torch_test); the report notes both instead.
// Regions that do not measure (kNone) have nothing to protect and end as before.

std::unique_ptr<RegionState> open_region(OffloadState& offload) {
  DDO_CHECK(!offload.region_open, Code::kFailedPrecondition,
            "a profile_run() region is already open on this offload; regions do not nest. End "
            "the outer region (finish() or leave its scope) before starting another");
  auto region = std::make_unique<RegionState>();
  region->offload = &offload;
  const core::RegionAction action = offload.prepared.region;
  if (action == core::RegionAction::kNone && offload.prepared.check_peak && offload.executing &&
      offload.probe != nullptr && offload.active) {
    // Note [A reused profile is checked]: measured, not saved. The measurement resets the
    // device's peak counters, so it takes the device's region lock like a calibration; when
    // another region holds it (one that saves), this run is not checked rather than disturbing
    // that one's measurement.
    try {
      region->lock.emplace(core::CalibrationRegionLock::acquire(offload.prepared.device));
    } catch (const Error&) {
      // Not checked: region->measuring stays false.
    }
    if (region->lock) {
      if (offload.runtime) offload.runtime->release_held();
      throw_if_error(offload.probe->start_sampling());
      region->measuring = true;
    }
  } else if (action != core::RegionAction::kNone) {
    DDO_CHECK(offload.executing && offload.probe != nullptr, Code::kFailedPrecondition, "profile '",
              offload.prepared.report.name,
              "' needs a measured run, but this offload does not execute (plan mode or "
              "disabled); use execution_mode=linear_runtime on a CUDA or sim device");
    DDO_CHECK(offload.active, Code::kFailedPrecondition,
              "profile_run() on an offload that was removed; enable offload again");
    // Throws when another region on this device is open (nested or concurrent).
    region->lock.emplace(core::CalibrationRegionLock::acquire(offload.prepared.device));
    if (offload.runtime) offload.runtime->release_held();
    throw_if_error(offload.probe->start_sampling());
    region->measuring = true;
    if (action == core::RegionAction::kCalibrate) mark_compute_stream(offload);
  }
  offload.region_open = true;
  region->report = offload.profile_report;
  return region;
}

namespace {
// show_profile: the profile report in one line on stderr at the end of profile_run(), as
// diffusers-dynamic-offloader prints it (no iostreams: Note [No iostreams] in ddo/core/status.h).
void print_profile_line(const nlohmann::json& report) {
  std::string line = "ddo profile:";
  for (const char* key : {"name", "status", "resident_budget_gb", "budget_source",
                          "recommended_budget_gb", "peak_vram_gb", "run_peak_vram_gb", "error"}) {
    if (!report.contains(key) || report[key].is_null()) continue;
    const nlohmann::json& v = report[key];
    // GiB figures to the MiB (3 decimals): the report keeps full precision, the line is read.
    const std::string text = v.is_string()         ? core::printable_text(v.get<std::string>())
                             : v.is_number_float() ? fmt::format("{:.3f}", v.get<double>())
                                                   : v.dump();
    line += fmt::format(" {}={}", key, text);
  }
  line += "\n";
  std::fputs(line.c_str(), stderr);
}
}  // namespace

nlohmann::json close_region(RegionState& region, bool normally, bool out_of_memory) {
  DDO_CHECK(!region.done, Code::kFailedPrecondition, "this profile_run() region has already ended");
  region.done = true;
  OffloadState& offload = *region.offload;
  offload.region_open = false;
  core::RegionResult result;
  // See Note [remove() inside a measured region].
  const bool removed_inside = region.measuring && !offload.active;
  result.exited_normally = normally && !removed_inside;
  // Only a region that saves has a measurement to protect; a checked reuse region is skipped.
  const bool saving = offload.prepared.region != core::RegionAction::kNone;
  if (region.measuring) {
    if (offload.runtime) offload.runtime->release_held();
    // The probe's figures as core's peak rule reads them (Note [Peak rule]).
    result.inputs = to_measurement_inputs(offload.probe->stop_sampling());
    // stop_sampling synchronized the device, so the last step's events are complete.
    if (result.exited_normally && offload.prepared.region == core::RegionAction::kCalibrate) {
      result.candidate_compute_ms = measured_candidate_compute(offload);
    }
    time_all_copies(offload, false);  // the region is measured; later steps pay the steady cost
  }
  core::ProfileReport report;
  Status saved = Status::ok_status();
  if (saving) {
    saved = core::finish_region(offload.prepared, result, *offload.store, &report);
  } else if (region.measuring) {
    saved = core::check_reused_peak(offload.prepared, result, &report);
  } else {
    report = offload.prepared.report;
  }
  if (saving && removed_inside && !normally) {
    report.notes.push_back("remove() was called inside the region");
  } else if (saving && saved.ok() && removed_inside) {
    saved = Status(Code::kFailedPrecondition,
                   fmt::format("the offload was removed (remove()) inside the profile_run() region "
                               "of profile '{}', so the region did not measure the offloaded "
                               "model; nothing was saved and the stored profile is unchanged. "
                               "Call remove() after the region ends",
                               offload.prepared.report.name));
  }
  if (!saved.ok()) {
    report.status = core::ProfileStatus::kFailed;
    report.error = saved.message();
  }
  if (const Status outgrown = core::reused_profile_out_of_memory(offload.prepared);
      out_of_memory && !normally && !outgrown.ok()) {
    report.status = core::ProfileStatus::kFailed;
    report.error = outgrown.message();
  }
  region.report = report.to_json();
  offload.profile_report = region.report;
  region.lock.reset();
  if (normally && offload.settings.config.show_profile) print_profile_line(region.report);
  if (!saved.ok()) throw Error(saved);
  return region.report;
}

}  // namespace internal

ProfileRun::ProfileRun(std::unique_ptr<internal::RegionState> state) : state_(std::move(state)) {}
ProfileRun::ProfileRun(ProfileRun&& other) noexcept = default;

ProfileRun::~ProfileRun() {
  if (!state_ || state_->done) return;
  try {
    internal::close_region(*state_, /*normally=*/false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddo: warning: ending an aborted profile_run() region: %s\n", e.what());
  }
}

nlohmann::json ProfileRun::finish() {
  DDO_CHECK(state_ != nullptr, Code::kFailedPrecondition, "finish() on a moved-from ProfileRun");
  return internal::close_region(*state_, /*normally=*/true);
}

nlohmann::json ProfileRun::abort() {
  DDO_CHECK(state_ != nullptr, Code::kFailedPrecondition, "abort() on a moved-from ProfileRun");
  return internal::close_region(*state_, /*normally=*/false);
}

nlohmann::json ProfileRun::abort_out_of_memory() {
  DDO_CHECK(state_ != nullptr, Code::kFailedPrecondition,
            "abort_out_of_memory() on a moved-from ProfileRun");
  return internal::close_region(*state_, /*normally=*/false, /*out_of_memory=*/true);
}

const nlohmann::json& ProfileRun::report() const {
  return state_->report;
}
bool ProfileRun::active() const {
  return state_ && !state_->done;
}

ProfileRun Offload::profile_run() {
  return ProfileRun(internal::open_region(*state_));
}

nlohmann::json Offload::profile_run(const std::function<void()>& region) {
  ProfileRun run = profile_run();
  try {
    region();
  } catch (const c10::OutOfMemoryError& e) {
    const nlohmann::json report = run.abort_out_of_memory();
    if (report.contains("error")) {
      throw Error(
          Code::kResourceExhausted,
          fmt::format("{} ({})", report["error"].get<std::string>(), e.what_without_backtrace()));
    }
    throw;
  } catch (...) {
    run.abort();
    throw;
  }
  return run.finish();
}

}  // namespace ddo::adapter
