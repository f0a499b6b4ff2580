#include "ddo/core/calibration.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "os_file.h"

namespace ddo::core {
using nlohmann::json;

namespace {

bool is_blank(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](unsigned char c) { return std::isspace(c) != 0; });
}

// Registry of devices with an active calibration or probe region. A function-local static, so
// there is no static constructor and the first use initializes it thread-safely.
struct RegionRegistry {
  std::mutex mu;
  std::set<std::string> active;  // guarded by mu
};

RegionRegistry& region_registry() {
  static RegionRegistry registry;
  return registry;
}

}  // namespace

const char* to_string(ProfileStatus status) {
  switch (status) {
    case ProfileStatus::kDisabled:
      return "disabled";
    case ProfileStatus::kCalibrating:
      return "calibrating";
    case ProfileStatus::kMissing:
      return "missing";
    case ProfileStatus::kProbing:
      return "probing";
    case ProfileStatus::kApplied:
      return "applied";
    case ProfileStatus::kSaved:
      return "saved";
    case ProfileStatus::kFailed:
      return "failed";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// Measurement and recommendation math.
// ---------------------------------------------------------------------------------------------

json Measurement::to_json() const {
  return json{{"driver_peak_gb", bytes_to_gib(driver_peak_bytes)},
              {"allocator_peak_reserved_gb", bytes_to_gib(allocator_peak_reserved_bytes)},
              {"initial_non_allocator_gb", bytes_to_gib(initial_non_allocator_bytes)},
              {"peak_gb", bytes_to_gib(peak_bytes)},
              {"samples", samples}};
}

Measurement measure_peak(const MeasurementInputs& in) {
  Measurement m;
  m.driver_peak_bytes = std::max(in.driver_used_start_bytes, in.driver_used_end_bytes);
  for (std::int64_t sample : in.driver_used_samples_bytes) {
    m.driver_peak_bytes = std::max(m.driver_peak_bytes, sample);
  }
  m.samples = 2 + static_cast<int>(in.driver_used_samples_bytes.size());
  // See Note [Peak rule] in calibration.h for each term.
  m.allocator_peak_reserved_bytes =
      std::max(in.allocator_peak_reserved_bytes, in.allocator_reserved_start_bytes);
  m.initial_non_allocator_bytes =
      std::max<std::int64_t>(0, in.driver_used_start_bytes - in.allocator_reserved_start_bytes);
  m.peak_bytes = std::max(m.driver_peak_bytes,
                          m.allocator_peak_reserved_bytes + m.initial_non_allocator_bytes);
  return m;
}

double recommend_resident_budget_gb(double total_gb, double peak_gb, double headroom_gb) {
  return std::max(0.0, total_gb - peak_gb - headroom_gb);
}

double cap_saved_budget_gb(double budget_gb, double max_resident_budget_gb) {
  return max_resident_budget_gb > 0 ? std::min(budget_gb, max_resident_budget_gb) : budget_gb;
}

double packed_probe_ceiling_gb(double max_resident_budget_gb, double total_gb, double headroom_gb) {
  const double ceiling =
      max_resident_budget_gb > 0 ? max_resident_budget_gb : kPackedDefaultProbeCeilingGb;
  return std::max(0.0, std::min(ceiling, total_gb - headroom_gb));
}

ProfileRecommendation recommend_after_calibration(bool packed, double total_gb, double peak_gb,
                                                  double headroom_gb,
                                                  double max_resident_budget_gb) {
  ProfileRecommendation r;
  r.peak_vram_gb = peak_gb;
  r.total_vram_gb = total_gb;
  r.headroom_gb = headroom_gb;
  const double safe = recommend_resident_budget_gb(total_gb, peak_gb, headroom_gb);
  r.resident_budget_gb = safe;
  if (!packed) {
    r.profile_measurement_kind = std::string(kKindBaseline);
    return r;
  }
  r.safe_budget_gb = safe;
  const double ceiling = packed_probe_ceiling_gb(max_resident_budget_gb, total_gb, headroom_gb);
  // Packed layers dequantize into temporaries, so a zero-resident peak underestimates what a
  // resident run needs; rather than trusting the safe value, probe the ceiling once and measure.
  if (safe >= kPackedProbeMinSafeGb && safe < ceiling) {
    r.profile_measurement_kind = std::string(kKindPackedProbePending);
    r.resident_budget_gb = ceiling;
    r.probe_budget_gb = ceiling;
    r.probe_pending = true;
  } else {
    r.profile_measurement_kind = std::string(kKindPackedBaselineSafe);
  }
  return r;
}

ProfileRecommendation recommend_after_probe(double probe_gb, double total_gb, double peak_gb,
                                            double headroom_gb, double share) {
  ProfileRecommendation r;
  r.profile_measurement_kind = std::string(kKindPackedProbe);
  r.peak_vram_gb = peak_gb;
  r.total_vram_gb = total_gb;
  r.headroom_gb = headroom_gb;
  r.probe_budget_gb = probe_gb;
  const double overshoot = share * std::max(0.0, peak_gb - (total_gb - headroom_gb));
  r.resident_budget_gb = std::max(0.0, probe_gb - overshoot);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Report.
// ---------------------------------------------------------------------------------------------

json ProfileReport::to_json() const {
  json out{{"name", name}, {"status", core::to_string(status)}};
  if (resident_budget_gb) out["resident_budget_gb"] = *resident_budget_gb;
  if (budget_source) out["budget_source"] = *budget_source;
  if (recommended_budget_gb) out["recommended_budget_gb"] = *recommended_budget_gb;
  if (path) out["path"] = *path;
  if (peak_vram_gb) out["peak_vram_gb"] = *peak_vram_gb;
  if (total_vram_gb) out["total_vram_gb"] = *total_vram_gb;
  if (headroom_gb) out["headroom_gb"] = *headroom_gb;
  if (budget_share) out["budget_share"] = *budget_share;
  if (profile_measurement_kind) out["profile_measurement_kind"] = *profile_measurement_kind;
  if (measurement) out["measurement"] = measurement->to_json();
  if (weights) out["weights"] = *weights;
  if (measured_weights) out["measured_weights"] = *measured_weights;
  if (run_peak_vram_gb) out["run_peak_vram_gb"] = *run_peak_vram_gb;
  if (!notes.empty()) out["notes"] = notes;
  if (error) out["error"] = *error;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Lifecycle.
// ---------------------------------------------------------------------------------------------

std::optional<std::string> normalize_calibration_device(std::string_view device) {
  DeviceName name;
  if (!parse_device_name("execution_device", device, &name).ok()) return std::nullopt;
  if (name.type == DeviceType::kCpu) return std::nullopt;
  return name.str();  // "cuda:00" and "cuda:0" share one region lock
}

namespace {

void check_can_calibrate(const DynamicOffloadConfig& config, const DeviceFacts& device,
                         const std::optional<std::string>& normalized) {
  DDO_CHECK(
      config.route == Route::kDynamic, Code::kFailedPrecondition,
      "build_profile=true needs the dynamic route, but the route is ",
      core::to_string(config.route),
      "; calibrate with the dynamic route (not a diffusers_*_compat preset or a per-component "
      "device move)");
  DDO_CHECK(config.execution_mode != ExecutionMode::kPlan, Code::kFailedPrecondition,
            "build_profile=true needs execution_mode linear_runtime or sdnq_runtime, but it is "
            "plan (plan mode moves nothing, so there is nothing to measure); set "
            "DDO_EXECUTION_MODE=linear_runtime or choose a runtime preset");
  DDO_CHECK(normalized.has_value() && device.is_cuda_like, Code::kFailedPrecondition,
            "build_profile=true needs a CUDA execution device (cuda, cuda:N) or the simulated "
            "device (sim, sim:N), but execution_device is '",
            config.execution_device, "'; calibrate on the GPU the workload runs on");
  DDO_CHECK(device.total_vram_bytes > 0, Code::kFailedPrecondition,
            "build_profile=true needs the device's total memory, but it reports ",
            device.total_vram_bytes, " bytes on '", config.execution_device, "'");
}

// The run is a calibration: it measures a zero-resident run and saves what it found.
void prepare_calibration(const DynamicOffloadConfig& config, const ProfileStore& store,
                         const DeviceFacts& device, const std::optional<std::string>& normalized,
                         PreparedProfile& p) {
  ProfileReport& report = p.report;
  const std::string& name = config.profile_name;
  const double manual = config.resident_module_budget_gb;
  check_can_calibrate(config, device, normalized);
  // The save comes after the whole measured run: an unwritable directory found only then
  // wastes the run, so it is checked before it.
  if (Status writable = store.check_writable(p.identity); !writable.ok()) {
    throw Error(writable.code(),
                fmt::format("build_profile=true would measure a run whose profile '{}' cannot "
                            "be saved: {}",
                            name, writable.message()));
  }
  p.status = report.status = ProfileStatus::kCalibrating;
  p.region = RegionAction::kCalibrate;
  p.resident_budget_gb = report.resident_budget_gb = 0.0;
  report.budget_source = "calibration";
  if (manual > 0) {
    report.notes.push_back(fmt::format(
        "resident_module_budget_gb={} is ignored while calibrating: calibration measures a "
        "zero-resident run",
        manual));
  }
}

// A positive manual budget: the profile is not read.
void prepare_manual_budget(double manual, const std::string& name, PreparedProfile& p) {
  ProfileReport& report = p.report;
  // The override order (docs/design/0006-configuration.md, section 3) and
  // diffusers-dynamic-offloader: a positive manual budget overrides profile reuse, so the profile
  // is not even read and the report says "disabled", as the library's does. The fields after name
  // and status are ddo's, saying why.
  p.status = report.status = ProfileStatus::kDisabled;
  p.resident_budget_gb = report.resident_budget_gb = manual;
  report.budget_source = "manual";
  report.notes.push_back(fmt::format(
      "manual resident_module_budget_gb={} overrides profile reuse; profile '{}' was not read "
      "(set the manual budget to 0 to use it)",
      manual, name));
}

// A saved packed-layer probe is pending and this run can run it: the region applies the probe
// budget, within the cap and within the room the calibrated peak left on this card.
void prepare_probe(const ProfileRecommendation& rec, const DeviceFacts& device,
                   PreparedProfile& p) {
  ProfileReport& report = p.report;
  double probe = rec.probe_budget_gb.value_or(rec.resident_budget_gb);
  if (const double capped = cap_saved_budget_gb(probe, p.max_resident_budget_gb); capped < probe) {
    report.notes.push_back(
        fmt::format("pending probe of {} capped by "
                    "max_resident_module_budget_gb={}",
                    format_gib(probe), p.max_resident_budget_gb));
    probe = capped;
  }
  // Note [Probe within the card]
  // diffusers-dynamic-offloader saves the probe at the ceiling. On a real card a resident
  // budget above the room the zero-resident calibration left free (total - its measured peak)
  // cannot be placed at all: ddo's peak is the driver's view with no slack to hide in, so the
  // probing run would fail in setup instead of measuring. On the H200 (W2, FLUX int8 and uint4
  // at an 8 GiB cap) the 6 GiB probe failed in setup, and a probe of the whole room (total -
  // peak) ran out of memory in the first step. The run therefore applies the probe up to the
  // room minus half the headroom: it spends half the measured headroom and no more; the saved
  // result (applied probe minus overshoot) follows from what was placed.
  const double total_now = bytes_to_gib(device.total_vram_bytes);
  if (rec.peak_vram_gb > 0 && total_now > 0) {
    const double room = std::max(0.0, total_now - rec.peak_vram_gb - 0.5 * rec.headroom_gb);
    if (probe > room) {
      report.notes.push_back(fmt::format(
          "pending probe of {} applied as {}: the room the calibrated peak of {} left on "
          "this {} card",
          format_gib(probe), format_gib(room), format_gib(rec.peak_vram_gb),
          format_gib(total_now)));
      probe = room;
    }
  }
  p.status = report.status = ProfileStatus::kProbing;
  p.region = RegionAction::kProbe;
  p.probe_budget_gb = probe;
  p.safe_budget_gb = rec.safe_budget_gb;
  p.resident_budget_gb = report.resident_budget_gb = probe;
  report.budget_source = "probe";
  report.notes.push_back(fmt::format(
      "probing a pending packed-layer resident budget of {}; it is not a validated resident run "
      "until this profile_run() region finishes",
      format_gib(probe)));
}

// A saved recommendation is reused: its budget (or a pending probe's) within the cap.
void prepare_reuse(const ProfileRecommendation& rec, const DynamicOffloadConfig& config,
                   const DeviceFacts& device, const std::optional<std::string>& normalized,
                   std::string_view weights, PreparedProfile& p) {
  ProfileReport& report = p.report;
  report.recommended_budget_gb = rec.resident_budget_gb;
  report.profile_measurement_kind = rec.profile_measurement_kind;
  report.peak_vram_gb = rec.peak_vram_gb;
  p.status = report.status = ProfileStatus::kApplied;
  p.check_peak = device.is_cuda_like && device.total_vram_bytes > 0 &&
                 config.execution_mode != ExecutionMode::kPlan;
  // Note [Profiles and quantization]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A profile's identity is its name, the model class and the execution mode (note 0007, section
  // 2); the weights' dtype and quantization are deliberately not part of it, so an int8 run and an
  // fp8 run under one name share one profile (a bf16 run has another execution mode). Their peaks
  // differ (packed weights, dequantized or quantized temporaries), so the saved recommendation
  // records the weights it was measured with and the report names them; when they differ from
  // this run's, the budget is still applied (reuse is by name) and a note says to calibrate again
  // or choose another name.
  if (!rec.weights.empty()) report.measured_weights = rec.weights;
  if (!rec.weights.empty() && !weights.empty() && rec.weights != weights) {
    report.notes.push_back(fmt::format(
        "the saved budget was measured with weights '{}', this run's are '{}': calibrate this "
        "name again (build_profile=true) or use another profile name for this quantization",
        rec.weights, weights));
  }

  double budget = rec.resident_budget_gb;
  report.budget_source = "profile";
  p.candidate_compute_ms = rec.candidate_compute_ms;
  if (rec.probe_pending) {
    const bool can_probe = p.packed && normalized.has_value() && device.is_cuda_like &&
                           config.execution_mode != ExecutionMode::kPlan &&
                           config.route == Route::kDynamic;
    if (can_probe) {
      prepare_probe(rec, device, p);
      return;
    }
    budget = rec.safe_budget_gb.value_or(0.0);
    report.notes.push_back(
        fmt::format("the saved packed-layer probe is pending but this run cannot probe it (it "
                    "needs sdnq_runtime on "
                    "a CUDA device); applying the measured safe budget of {}",
                    format_gib(budget)));
  }
  if (const double capped = cap_saved_budget_gb(budget, p.max_resident_budget_gb);
      capped < budget) {
    report.notes.push_back(
        fmt::format("saved recommendation of {} capped by "
                    "max_resident_module_budget_gb={}",
                    format_gib(budget), p.max_resident_budget_gb));
    budget = capped;
  }
  p.resident_budget_gb = report.resident_budget_gb = budget;
}

}  // namespace

PreparedProfile prepare_profile(const DynamicOffloadConfig& config, std::string_view model_class,
                                const ProfileStore& store, const DeviceFacts& device,
                                std::string_view weights) {
  PreparedProfile p;
  const std::string& name = config.profile_name;
  if (name.empty()) {
    DDO_CHECK(!config.build_profile, Code::kInvalidArgument,
              "build_profile=true needs a profile name; pass profile_name=\"my-workload\" (one "
              "name per workload, e.g. video-5s)");
    return p;  // disabled
  }
  DDO_CHECK(!is_blank(name), Code::kInvalidArgument, "profile_name '", name,
            "' is only whitespace; pass a readable name such as \"my-workload\", or omit it to "
            "disable profiles");
  DDO_CHECK(!is_blank(model_class), Code::kInvalidArgument,
            "a named profile needs the model class qualified name, but it is empty");
  const double headroom = config.profile_vram_headroom_gb;
  DDO_CHECK(std::isfinite(headroom) && headroom >= 0, Code::kInvalidArgument,
            "profile_vram_headroom_gb=", headroom,
            " must be a finite number >= 0; set DDO_PROFILE_VRAM_HEADROOM_GB to e.g. 1");

  const std::optional<std::string> normalized =
      normalize_calibration_device(config.execution_device);
  // diffusers-dynamic-offloader keys a profile by its execution mode too: a dense calibration says
  // nothing about a packed (SDNQ) run of the same name (Note [diffusers-dynamic-offloader's files]
  // in profile_schema.cpp).
  p.identity = ProfileIdentity{name, std::string(model_class), to_string(config.execution_mode)};
  p.record_path = store.path_for(p.identity);
  p.device = normalized.value_or(config.execution_device);
  p.packed = config.execution_mode == ExecutionMode::kPackedRuntime;
  p.headroom_gb = headroom;
  p.total_vram_gb = bytes_to_gib(device.total_vram_bytes);
  p.max_resident_budget_gb = config.max_resident_module_budget_gb;

  ProfileReport& report = p.report;
  report.name = name;
  report.path = p.record_path.string();
  p.weights = std::string(weights);
  if (!weights.empty()) report.weights = p.weights;
  report.headroom_gb = headroom;
  if (device.total_vram_bytes > 0) report.total_vram_gb = p.total_vram_gb;

  const double manual = config.resident_module_budget_gb;
  if (config.build_profile) {
    prepare_calibration(config, store, device, normalized, p);
    return p;
  }

  if (manual > 0) {
    prepare_manual_budget(manual, name, p);
    return p;
  }

  const std::optional<ProfileRecord> record = store.load(p.identity);
  if (!record || !record->recommendation) {
    p.status = report.status = ProfileStatus::kMissing;
    report.notes.push_back(
        fmt::format("no saved profile '{}' for {}; run once with build_profile=true to calibrate",
                    name, model_class));
    return p;
  }
  prepare_reuse(*record->recommendation, config, device, normalized, weights, p);
  return p;
}

// Note [A reused profile is checked]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Video capacity is never inferred from an image profile (note 0007, section 3). A name
// stands for one workload, but nothing stops a host from reusing an image profile for a 33-frame
// video: the saved budget leaves room for the image's activations, and the video's outgrow it. So a
// region that applies a saved recommendation is measured like a calibration (the same probe and
// peak rule, nothing saved) and its peak is compared with the card, or the emulated cap, the
// profile was made for. Above it the run fails with an error that says to calibrate this workload
// under its own name: on a card of that size it would have run out of memory (on the real card it
// usually does, first). Within the card but inside the headroom is a note: the workload grew,
// and the headroom absorbed it. The bound is the card and not card - headroom because a reuse of
// the same workload is expected to end near card - headroom (that is what the budget is for),
// and timing noise must not fail it.
namespace {
// Why a reused profile does not hold: `what` says how the run showed it.
Status outgrown(const PreparedProfile& prepared, const std::string& what) {
  return Status(
      Code::kResourceExhausted,
      fmt::format("profile '{}' was measured on a smaller workload: {} (the {} card it "
                  "was made for; its saved peak was {}). Calibrate this workload under "
                  "its own name (profile_name=\"{}-...\", build_profile=True): an "
                  "image profile does not hold for a longer video",
                  prepared.report.name, what, format_gib(prepared.total_vram_gb),
                  format_gib(prepared.report.peak_vram_gb.value_or(0.0)), prepared.report.name));
}
}  // namespace

Status check_reused_peak(const PreparedProfile& prepared, const RegionResult& result,
                         ProfileReport* report) {
  *report = prepared.report;
  if (!prepared.check_peak || !result.exited_normally) return Status::ok_status();
  const double peak_gb = bytes_to_gib(measure_peak(result.inputs).peak_bytes);
  const double total_gb = prepared.total_vram_gb;
  report->run_peak_vram_gb = peak_gb;
  if (peak_gb > total_gb) {
    report->status = ProfileStatus::kFailed;
    return outgrown(prepared, fmt::format("this run peaked at {}, above the card; a card of that "
                                          "size runs out of memory here",
                                          format_gib(peak_gb)));
  }
  if (peak_gb > total_gb - prepared.headroom_gb) {
    report->notes.push_back(fmt::format(
        "this run peaked at {}, inside the {} headroom of the {} card: the workload may be "
        "larger than the one profile '{}' was measured on",
        format_gib(peak_gb), format_gib(prepared.headroom_gb), format_gib(total_gb),
        prepared.report.name));
  }
  return Status::ok_status();
}

Status reused_profile_out_of_memory(const PreparedProfile& prepared) {
  if (!prepared.check_peak) return Status::ok_status();
  return outgrown(prepared, "the device ran out of memory inside its profile_run() region");
}

namespace {
// A calibration's budgets as one denoiser's share of the region's room (Note [Denoisers share
// one calibration] in pipeline_profiles.h); a single model's share is 1.
void scale_to_share(double share, ProfileRecommendation* rec) {
  DDO_ASSERT(share >= 0.0 && share <= 1.0, "a budget share outside [0, 1]: ", share);
  if (share == 1.0) return;
  rec->resident_budget_gb *= share;
  if (rec->safe_budget_gb) *rec->safe_budget_gb *= share;
  if (rec->probe_budget_gb) *rec->probe_budget_gb *= share;
}
}  // namespace

Status finish_region(const PreparedProfile& prepared, const RegionResult& result,
                     ProfileStore& store, ProfileReport* report) {
  *report = prepared.report;
  if (prepared.region == RegionAction::kNone) return Status::ok_status();
  if (!result.exited_normally) {
    report->status = ProfileStatus::kFailed;
    report->notes.push_back(
        "the profile_run() region exited by an exception; nothing was saved and any existing "
        "recommendation is unchanged");
    return Status::ok_status();
  }

  const Measurement m = measure_peak(result.inputs);
  const double peak_gb = bytes_to_gib(m.peak_bytes);
  const double total_gb = prepared.total_vram_gb;
  const double headroom_gb = prepared.headroom_gb;
  ProfileRecommendation rec;
  double measured_with_gb = 0.0;
  if (prepared.region == RegionAction::kCalibrate) {
    rec = recommend_after_calibration(prepared.packed, total_gb, peak_gb, headroom_gb,
                                      prepared.max_resident_budget_gb);
    rec.candidate_compute_ms = result.candidate_compute_ms;
    scale_to_share(result.budget_share, &rec);
  } else {
    DDO_ASSERT(prepared.probe_budget_gb.has_value(), "a probe region without a probe budget");
    measured_with_gb = *prepared.probe_budget_gb;
    rec = recommend_after_probe(measured_with_gb, total_gb, peak_gb, headroom_gb,
                                result.budget_share);
    rec.safe_budget_gb = prepared.safe_budget_gb;
  }
  rec.measured_at = utc_now_iso8601();
  rec.weights = prepared.weights;

  ProfileObservation observation;
  observation.recorded_at = rec.measured_at;
  observation.profile_measurement_kind = rec.profile_measurement_kind;
  observation.success = peak_gb <= total_gb - headroom_gb;
  observation.resident_budget_gb = measured_with_gb;
  observation.peak_vram_gb = peak_gb;
  observation.total_vram_gb = total_gb;
  observation.headroom_gb = headroom_gb;
  observation.recommended_budget_gb = rec.resident_budget_gb;
  observation.measurement = m.to_json();

  report->resident_budget_gb = rec.resident_budget_gb;
  report->recommended_budget_gb = rec.resident_budget_gb;
  report->budget_source.reset();
  report->peak_vram_gb = peak_gb;
  report->total_vram_gb = total_gb;
  report->headroom_gb = headroom_gb;
  report->profile_measurement_kind = rec.profile_measurement_kind;
  report->measurement = m;
  if (!prepared.weights.empty()) report->measured_weights = prepared.weights;
  report->notes.push_back(
      fmt::format("measured with a resident budget of {}", format_gib(measured_with_gb)));
  if (result.budget_share < 1.0) {
    report->budget_share = result.budget_share;
    report->notes.push_back(fmt::format(
        "the pipeline's denoisers were measured in one region and share its room: this one "
        "takes {:.3f} of it, in proportion to its resident-candidate bytes",
        result.budget_share));
  }
  if (rec.probe_pending) {
    report->notes.push_back(fmt::format(
        "the saved {} is a pending probe, not a validated resident run; the next normal run "
        "probes it (safe budget {})",
        format_gib(rec.resident_budget_gb), format_gib(rec.safe_budget_gb.value_or(0.0))));
  }

  Status saved = store.save(prepared.identity, observation, rec);
  if (!saved.ok()) {
    report->status = ProfileStatus::kFailed;
    report->error = saved.message();
    return saved;
  }
  report->status = ProfileStatus::kSaved;
  return Status::ok_status();
}

// ---------------------------------------------------------------------------------------------
// CalibrationRegionLock.
// ---------------------------------------------------------------------------------------------

// Note [Calibration across processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A calibration reads the GPU's used memory (the driver's figure, which counts every process on
// the card) while its run goes. Two processes calibrating on one GPU would each measure the
// other's memory and save a budget that is too small, or too large for when the other process
// is gone. The in-process registry cannot see another process, so a region on a CUDA device also
// takes a lock file, without waiting: "ddo-calibrating-cuda-<N>-user-<uid>.lock" in the system's
// temporary folder (on Windows "ddo-calibrating-cuda-<N>.lock": its temporary folder is the
// user's own). A held lock is the other process's region: the attach fails naming it and the
// process id its holder wrote into the file. The lock is an OS lock (flock, LockFileEx), released
// when its process ends, so a killed process leaves nothing to clean.
//
// The lock is per user, although another user's calibration on the same GPU disturbs the
// measurement as much as one's own. A name every user shares, in a folder every user can write,
// lets any local user hold it (a loop that takes it blocks every calibration on the machine) or
// plant a link there (a root process would create or lock the link's target), and no owner can
// be required of a file the first user to calibrate creates. Another user's process on the card
// is the same case as any other program using the GPU meanwhile (a training job, a desktop): no
// lock of ddo's keeps it out, and the measurement counts it. So the lock guards what one user
// controls, their own processes, and it cannot be taken from them: the file is opened without
// following a link, and a name held by anything but a regular file of this user's with one name
// is refused with an error naming it (os::lock_owned_file), never used, and nothing is created at
// a link's target. Processes that number the GPUs differently (CUDA_VISIBLE_DEVICES) can see one
// card under two indices; the lock follows the index, so such a pair is not refused. A lock file
// that cannot be created (a read-only temporary folder) leaves the region guarded within the
// process only.
std::filesystem::path CalibrationRegionLock::lock_file_for(std::string_view device) {
  const std::string key = normalize_calibration_device(device).value_or(std::string(device));
  if (key.rfind("cuda", 0) != 0) return {};
  std::string name = "ddo-calibrating-" + key;
  if (const std::string user = os::user_id_text(); !user.empty()) name += "-user-" + user;
  name += ".lock";
  std::replace(name.begin(), name.end(), ':', '-');
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::temp_directory_path(ec);
  if (ec) return {};
  return dir / name;
}

CalibrationRegionLock CalibrationRegionLock::acquire(std::string_view device) {
  std::string key = normalize_calibration_device(device).value_or(std::string(device));
  RegionRegistry& registry = region_registry();
  std::lock_guard<std::mutex> guard(registry.mu);
  DDO_CHECK(registry.active.count(key) == 0, Code::kFailedPrecondition,
            "a profile_run() region is already active on ", key,
            "; nested or concurrent calibration regions on one device are not supported (they "
            "would reset each other's peak counters); finish the first region before starting "
            "another");
  int fd = -1;
  if (const std::filesystem::path lock = lock_file_for(key); !lock.empty()) {
    long holder = 0;
    const os::Result r = os::lock_owned_file(lock, &fd, &holder);
    DDO_CHECK(
        r.fail != os::Fail::kExists, Code::kFailedPrecondition,
        "another process is calibrating on ", key, " (",
        holder > 0 ? "process " + std::to_string(holder) : std::string("its process id is unknown"),
        " holds ", lock.string(),
        "); two calibrations on one GPU would each measure the other's memory and save a "
        "wrong budget: wait until that run ends, or calibrate on another GPU");
    DDO_CHECK(r.fail != os::Fail::kNotRegular, Code::kFailedPrecondition,
              "cannot take the calibration lock for ", key, ": ", r.text);
    if (!r.ok()) fd = -1;  // Note [Calibration across processes]: in-process guard only
  }
  registry.active.insert(key);
  return CalibrationRegionLock(std::move(key), fd);
}

CalibrationRegionLock::CalibrationRegionLock(CalibrationRegionLock&& other) noexcept
    : device_(std::exchange(other.device_, std::string())), fd_(std::exchange(other.fd_, -1)) {}

CalibrationRegionLock& CalibrationRegionLock::operator=(CalibrationRegionLock&& other) noexcept {
  if (this != &other) {
    release();
    device_ = std::exchange(other.device_, std::string());
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

CalibrationRegionLock::~CalibrationRegionLock() {
  release();
}

void CalibrationRegionLock::release() {
  if (fd_ >= 0) os::unlock_file(std::exchange(fd_, -1));
  if (device_.empty()) return;
  RegionRegistry& registry = region_registry();
  std::lock_guard<std::mutex> guard(registry.mu);
  registry.active.erase(device_);
  device_.clear();
}

}  // namespace ddo::core
