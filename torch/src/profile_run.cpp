// profile_run(): the measured region of a named workload profile. See profile_run.h.
#include "ddo/torch/profile_run.h"

#include <cstdio>
#include <exception>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "ddo/core/calibration.h"
#include "ddo/core/pipeline_profiles.h"
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

// Note [One region over several offloads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pipeline's profiled denoisers (Wan 2.2's transformer and transformer_2) run one after the
// other inside one generation and stay attached together, so one region measures them all: the
// device's peak counters and its calibration lock are per device, and two regions side by side
// would reset and read each other's peaks (the lock refuses the second). The region takes the
// lock once, and the first offload that needs a measurement measures the device with its probe
// (every member shares the device, so any member's probe reads the same memory). At the end each
// member's lifecycle runs on that one measurement: a calibrating or probing member saves its
// share of the room (core::budget_shares over the saving members' resident-candidate bytes; Note
// [Denoisers share one calibration] in ddo/core/pipeline_profiles.h), a member that reused a
// recommendation is checked against the run's peak. remove() of any member inside the region
// fails the region for all (Note [remove() inside a measured region]): the measurement no
// longer covers the offloaded pipeline. A single offload is the case of one member, share 1.

namespace {

bool saves(const OffloadState& o) {
  return o.prepared.region != core::RegionAction::kNone;
}

bool checks_reuse(const OffloadState& o) {
  return o.prepared.region == core::RegionAction::kNone && o.prepared.check_peak && o.executing &&
         o.probe != nullptr && o.active;
}

// Takes the device's region lock: required when a member saves; for reuse checks only, a lock
// held elsewhere (a region that saves) leaves this run unchecked rather than disturbing it.
void lock_region(RegionState& region, bool saving, bool checking) {
  const std::string& device = region.offloads.front()->prepared.device;
  if (saving) {
    // Throws when another region on this device is open (nested or concurrent).
    region.lock.emplace(core::CalibrationRegionLock::acquire(device));
  } else if (checking) {
    // Note [A reused profile is checked]: measured, not saved.
    try {
      region.lock.emplace(core::CalibrationRegionLock::acquire(device));
    } catch (const Error&) {
      // Not checked: region.measuring stays false.
    }
  }
}

}  // namespace

std::unique_ptr<RegionState> open_region(std::vector<OffloadState*> offloads,
                                         std::vector<std::string> components) {
  DDO_ASSERT(!offloads.empty(), "a profile_run() region without an offload");
  bool saving = false;
  bool checking = false;
  for (const OffloadState* o : offloads) {
    DDO_CHECK(!o->region_open, Code::kFailedPrecondition,
              "a profile_run() region is already open on this offload; regions do not nest. End "
              "the outer region (finish() or leave its scope) before starting another");
    if (saves(*o)) {
      DDO_CHECK(o->executing && o->probe != nullptr, Code::kFailedPrecondition, "profile '",
                o->prepared.report.name,
                "' needs a measured run, but this offload does not execute (plan mode or "
                "disabled); use execution_mode=linear_runtime on a CUDA or sim device");
      DDO_CHECK(o->active, Code::kFailedPrecondition,
                "profile_run() on an offload that was removed; enable offload again");
    }
    saving = saving || saves(*o);
    checking = checking || checks_reuse(*o);
  }
  auto region = std::make_unique<RegionState>();
  region->offloads = std::move(offloads);
  region->components = std::move(components);
  lock_region(*region, saving, checking);
  if (region->lock) {
    for (std::size_t i = 0; i < region->offloads.size(); ++i) {
      OffloadState& o = *region->offloads[i];
      if (o.runtime) o.runtime->release_held();
      if (!region->measuring && (saves(o) || checks_reuse(o))) region->measurer = i;
      region->measuring = region->measuring || saves(o) || checks_reuse(o);
    }
    throw_if_error(region->offloads[region->measurer]->probe->start_sampling());
    for (OffloadState* o : region->offloads) {
      if (o->prepared.region == core::RegionAction::kCalibrate) mark_compute_stream(*o);
    }
  }
  for (OffloadState* o : region->offloads) o->region_open = true;
  nlohmann::json report = region->offloads.front()->profile_report;
  if (!region->components.empty()) {
    report["components"] = nlohmann::json::object();
    for (std::size_t i = 0; i < region->offloads.size(); ++i) {
      report["components"][region->components[i]] = region->offloads[i]->profile_report;
    }
  }
  region->report = std::move(report);
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

namespace {

// One member's end of the region on the shared measurement `inputs`: saves (its `share` of the
// room), checks a reused recommendation, or keeps its prepared report. Returns the report and
// sets `*status` to the saving or checking error.
core::ProfileReport close_member(OffloadState& offload, const RegionState& region,
                                 const core::MeasurementInputs& inputs, bool normally,
                                 bool removed_inside, bool out_of_memory, double share,
                                 Status* status) {
  core::RegionResult result;
  // See Note [remove() inside a measured region].
  result.exited_normally = normally && !removed_inside;
  result.budget_share = share;
  result.inputs = inputs;
  if (region.measuring) {
    // stop_sampling synchronized the device, so the last step's events are complete.
    if (result.exited_normally && offload.prepared.region == core::RegionAction::kCalibrate) {
      result.candidate_compute_ms = measured_candidate_compute(offload);
    }
    time_all_copies(offload, false);  // the region is measured; later steps pay the steady cost
  }
  core::ProfileReport report;
  Status saved = Status::ok_status();
  const bool saving = saves(offload);
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
  *status = saved;
  return report;
}

// Each saving member's share of the room: core::budget_shares over the saving members'
// resident-candidate bytes; 1 for a single offload (Note [One region over several offloads]).
std::vector<double> member_shares(const RegionState& region) {
  std::vector<std::int64_t> weights;
  for (const OffloadState* o : region.offloads) {
    if (saves(*o)) weights.push_back(o->plan.resident_candidate_bytes);
  }
  const std::vector<double> saving_shares = core::budget_shares(weights);
  std::vector<double> shares(region.offloads.size(), 1.0);
  for (std::size_t i = 0, k = 0; i < region.offloads.size(); ++i) {
    if (saves(*region.offloads[i])) shares[i] = saving_shares[k++];
  }
  return shares;
}

}  // namespace

nlohmann::json close_region(RegionState& region, bool normally, bool out_of_memory) {
  DDO_CHECK(!region.done, Code::kFailedPrecondition, "this profile_run() region has already ended");
  region.done = true;
  bool removed_inside = false;
  for (OffloadState* o : region.offloads) {
    o->region_open = false;
    removed_inside = removed_inside || (region.measuring && !o->active);
  }
  core::MeasurementInputs inputs;
  if (region.measuring) {
    for (OffloadState* o : region.offloads) {
      if (o->runtime) o->runtime->release_held();
    }
    // The probe's figures as core's peak rule reads them (Note [Peak rule]).
    inputs = to_measurement_inputs(region.offloads[region.measurer]->probe->stop_sampling());
  }
  const std::vector<double> shares = member_shares(region);
  Status first_error = Status::ok_status();
  std::vector<nlohmann::json> reports;
  for (std::size_t i = 0; i < region.offloads.size(); ++i) {
    OffloadState& o = *region.offloads[i];
    Status status = Status::ok_status();
    const core::ProfileReport report = close_member(o, region, inputs, normally, removed_inside,
                                                    out_of_memory, shares[i], &status);
    if (first_error.ok() && !status.ok()) first_error = status;
    o.profile_report = report.to_json();
    reports.push_back(o.profile_report);
  }
  region.report = reports.front();
  if (!region.components.empty()) {
    region.report["components"] = nlohmann::json::object();
    for (std::size_t i = 0; i < reports.size(); ++i) {
      region.report["components"][region.components[i]] = reports[i];
    }
  }
  region.lock.reset();
  if (normally) {
    for (std::size_t i = 0; i < reports.size(); ++i) {
      if (region.offloads[i]->settings.config.show_profile) print_profile_line(reports[i]);
    }
  }
  if (!first_error.ok()) throw Error(first_error);
  return region.report;
}

nlohmann::json run_region(ProfileRun run, const std::function<void()>& region) {
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
  return ProfileRun(internal::open_region({state_.get()}));
}

nlohmann::json Offload::profile_run(const std::function<void()>& region) {
  return internal::run_region(profile_run(), region);
}

}  // namespace ddo::adapter
