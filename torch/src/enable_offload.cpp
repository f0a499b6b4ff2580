// enable_offload: settings -> device -> profile -> inventory -> plan, then placement
// (attach_plan.cpp); the Offload handle. The execution device: execution_device.cpp; the
// report: offload_report.cpp.
#include "ddo/torch/enable_offload.h"

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "ddo/core/config.h"
#include "ddo/core/presets.h"
#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/torch/weight_cache.h"
#include "attach_common.h"
#include "intercept_common.h"
#include "offload_state.h"
#include "registration.h"
#include "weight_cache_internal.h"
#include "weight_source.h"

namespace ddo::adapter {
namespace internal {

core::DynamicOffloadSettings resolve_settings(const OffloadOptions& options,
                                              const core::EnvMap& env) {
  core::DynamicOffloadSettings settings;
  if (options.settings) {
    throw_if_error(options.settings->with_overrides(options.overrides, &settings));
  } else {
    core::SettingsRequest request;
    request.preset = options.preset;
    request.config = options.config;
    request.overrides = options.overrides.is_null() ? nlohmann::json::object() : options.overrides;
    settings = core::DynamicOffloadSettings::from_env(request, env);
  }
  core::DynamicOffloadConfig& c = settings.config;
  if (!options.execution_device.empty()) c.execution_device = options.execution_device;
  if (!options.profile_name.empty()) c.profile_name = options.profile_name;
  if (options.build_profile) c.build_profile = true;
  c.skip_modules_pattern.insert(c.skip_modules_pattern.end(), options.extra_skip_patterns.begin(),
                                options.extra_skip_patterns.end());
  throw_if_error(core::validate_config(c));
  return settings;
}

// Note [Preset budgets and named profiles]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// low_ram_safe, wsl_compat and warm_process carry fixed resident budgets (3 or 6 GiB). A fixed
// budget overrides profile reuse (the override order of docs/design/0006-configuration.md, and
// diffusers-dynamic-offloader, whose presets set the same budget variable): the profile is not
// read and its status is "disabled". That stays, so the two libraries agree on which budget a
// run uses; but a user who names a profile and picks one of these presets did not ask for a
// fixed budget, so the attach says so: a warning (a Python UserWarning) and a note in the
// profile report, naming the preset, its budget and the way to use the profile.
void warn_if_the_preset_disables_the_profile(const core::DynamicOffloadConfig& config,
                                             const std::string& budget_origin,
                                             core::PreparedProfile* prepared) {
  if (prepared->status != core::ProfileStatus::kDisabled || config.profile_name.empty() ||
      budget_origin.rfind("preset ", 0) != 0) {
    return;
  }
  const std::string text = fmt::format(
      "ddo: profile '{}' is not used: {} sets a fixed resident budget of {:g} GiB, which "
      "overrides profile reuse; pass resident_module_budget_gb=0 to use the profile (or choose a "
      "preset without a fixed budget, e.g. auto)",
      config.profile_name, budget_origin, config.resident_module_budget_gb);
  prepared->report.notes.push_back(text);
  TORCH_WARN(text);
}

}  // namespace internal

using internal::OffloadState;

// --- enable_offload ------------------------------------------------------------------------------

std::unique_ptr<Offload> enable_offload(torch::nn::Module& model, const OffloadOptions& options) {
  return enable_offload_tree(module_tree_from(model), options);
}

std::unique_ptr<Offload> enable_offload(const std::shared_ptr<torch::nn::Module>& model,
                                        const OffloadOptions& options) {
  DDO_CHECK(model != nullptr, Code::kInvalidArgument, "enable_offload got a null module");
  return enable_offload(*model, options);
}

std::unique_ptr<Offload> enable_offload_tree(ModuleTree tree, const OffloadOptions& options) {
  const auto start = internal::Clock::now();
  auto s = std::make_unique<OffloadState>();
  s->tree = std::move(tree);
  s->model_class = options.model_class.empty() ? s->tree.model_class : options.model_class;
  s->tree.model_class = s->model_class;
  s->record_event = options.record_event;
  s->weights = options.weights;
  if (s->weights) s->setup.load_path = s->weights->checkpoint().root;
  const core::EnvMap env = options.env ? *options.env : core::process_env();

  // Settings.
  auto t0 = internal::Clock::now();
  s->settings = internal::resolve_settings(options, env);
  // What resolving accepted with a change the user may not expect (a clamped ratio, a variable
  // that looks like one of ddo's but is not read): a warning each (a Python UserWarning).
  for (const std::string& warning : s->settings.warnings) TORCH_WARN("ddo: ", warning);
  core::DynamicOffloadConfig& config = s->settings.config;
  core::DeviceName device;
  throw_if_error(core::parse_device_name("execution_device", config.execution_device, &device));
  s->device_name = device.str();
  config.execution_device = s->device_name;
  const bool plan_only =
      config.execution_mode == core::ExecutionMode::kPlan || !s->settings.enabled;
  s->executing = !plan_only;
  if (device.type == core::DeviceType::kCuda) {
    s->kind = engine::DeviceKind::kCuda;
    s->torch_device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index));
  } else {
    s->kind = engine::DeviceKind::kSim;
    s->torch_device = c10::Device(c10::kCPU);
  }
  DDO_CHECK(!(s->executing && s->device_name == "cpu"), Code::kInvalidArgument,
            "execution_device \"cpu\" is valid only in plan mode (execution_mode=plan); use "
            "\"cuda:N\" for a GPU or \"sim\" for the host simulation");

  // The runtime follows the model (core::resolve_execution_mode): SDNQ layers take sdnq_runtime.
  s->inventory = to_inventory(s->tree, s->torch_device);
  internal::unmark_cached_views(s->tree, &s->inventory);
  s->weight_cache_key = internal::weight_cache_key(config.pinned_weight_cache_namespace,
                                                   s->model_class, s->device_name);
  const core::ExecutionMode requested_mode = config.execution_mode;
  if (const core::ExecutionMode mode =
          core::resolve_execution_mode(config.execution_mode, s->inventory);
      mode != config.execution_mode) {
    internal::emit(*s, "execution_mode", 0.0,
                   {{"requested", core::to_string(config.execution_mode)},
                    {"effective", core::to_string(mode)},
                    {"reason", "the model has SDNQ layers"}});
    config.execution_mode = mode;
  }

  // The device and its memory facts.
  std::int64_t total_vram = 0;
  if (s->executing) {
    s->device = options.device ? options.device : open_execution_device(s->device_name, config);
    total_vram = s->device->memory().total_bytes;
    if (s->kind == engine::DeviceKind::kSim) {
      s->probe = make_sim_memory_probe(*s->device);
      s->counting = std::make_unique<ScopedCountingCpuAllocator>(
          CountingCpuAllocatorOptions{.device = s->device.get()});
    } else {
      throw_if_error(make_cuda_memory_probe(s->torch_device.index(), &s->probe));
      total_vram = s->probe->snapshot().total_bytes;
    }
  } else if (s->kind == engine::DeviceKind::kSim) {
    total_vram = static_cast<std::int64_t>(
        (config.sim_device_capacity_gb > 0 ? config.sim_device_capacity_gb : 8.0) * core::kGiB);
  }
  total_vram = internal::capped_vram_bytes(total_vram, config);
  s->setup.resolve_seconds = internal::seconds_since(t0);

  // Who set a fixed resident budget, for the planner's resident_budget_fit decision (Note
  // [Resident budget fits the card] in core/src/planner_residency.cpp) and the profile's warning.
  std::string budget_origin;
  if (config.resident_module_budget_gb > 0) {
    // Settings resolved by the caller (the Python package resolves DDO_PRESET itself) still name
    // their preset: its own value, with no variable setting the field, came from the preset.
    core::DynamicOffloadConfig preset_config;
    core::PresetInfo preset_info;
    const bool preset_value =
        !options.config && options.settings &&
        s->settings.effective_preset != core::kCustomPreset &&
        core::apply_preset(s->settings.effective_preset, &preset_config, &preset_info).ok() &&
        preset_config.resident_module_budget_gb == config.resident_module_budget_gb &&
        env.count("DDO_RESIDENT_MODULE_BUDGET_GB") == 0;
    if (options.overrides.contains("resident_module_budget_gb")) {
      budget_origin = "an enable_offload override";
    } else if (preset_value) {
      budget_origin = "preset " + s->settings.effective_preset;
    } else if (options.config || options.settings) {
      budget_origin = "the config passed by code";
    } else if (env.count("DDO_RESIDENT_MODULE_BUDGET_GB") > 0) {
      budget_origin = "DDO_RESIDENT_MODULE_BUDGET_GB";
    } else {
      budget_origin = "preset " + s->settings.effective_preset;
    }
  }

  // Profile.
  {
    core::ProfileStoreOptions so;
    if (!config.profile_name.empty()) so.directory = core::resolve_profile_dir(env);
    s->store = std::make_unique<core::ProfileStore>(std::move(so));
    core::DeviceFacts facts;
    facts.is_cuda_like = s->device_name != "cpu";
    facts.total_vram_bytes = total_vram;
    s->prepared = core::prepare_profile(config, s->model_class, *s->store, facts,
                                        s->inventory.weights_summary());
    internal::warn_if_the_preset_disables_the_profile(config, budget_origin, &s->prepared);
    s->profile_report = s->prepared.report.to_json();
  }

  // Inventory and plan.
  t0 = internal::Clock::now();
  core::PlanContext ctx;
  ctx.total_vram_bytes = total_vram;
  ctx.available_ram_bytes = s->settings.available_ram_bytes();
  ctx.calibrating = s->prepared.region == core::RegionAction::kCalibrate;
  ctx.pin_allowed = !(s->settings.wsl && config.disable_pin_on_wsl);
  // The loader's weights can be read again each step: the planner may leave some in the file.
  ctx.weights_in_file = s->weights != nullptr;
  if (s->prepared.resident_budget_gb && !ctx.calibrating &&
      s->prepared.report.budget_source.value_or("") != "manual") {
    ctx.profile_budget_bytes =
        static_cast<std::int64_t>(*s->prepared.resident_budget_gb * core::kGiB);
  }
  if (!ctx.calibrating) ctx.candidate_compute_ms = s->prepared.candidate_compute_ms;
  ctx.resident_budget_origin = budget_origin;
  {
    // The planner gets the mode the user asked for: it resolves it by the same rule and records
    // the decision that did (sdnq_runtime_auto), so the report explains the runtime.
    core::DynamicOffloadConfig as_requested = config;
    as_requested.execution_mode = requested_mode;
    // cache_plan: the same inventory, settings and card plan the same; reuse it.
    std::string plan_key;
    std::optional<core::Plan> cached;
    if (config.cache_plan) {
      plan_key = internal::plan_cache_key(s->inventory, as_requested, ctx);
      cached = internal::find_cached_plan(plan_key);
    }
    if (cached) {
      s->plan = std::move(*cached);
      s->setup.plan_cached = true;
    } else {
      s->plan = core::make_plan(s->inventory, as_requested, ctx);
      if (config.cache_plan) internal::store_cached_plan(plan_key, s->plan);
    }
  }
  s->setup.plan_seconds = internal::seconds_since(t0);
  internal::emit(*s, "plan", s->setup.plan_seconds,
                 {{"modules", s->inventory.modules.size()},
                  {"resident_budget_bytes", s->plan.resident_budget_bytes},
                  {"streamed_bytes", s->plan.streamed_bytes},
                  {"stream_units", s->plan.stream_units.size()},
                  {"execute", s->executing},
                  {"plan_cached", s->setup.plan_cached}});
  internal::print_decisions(*s);

  // Placement.
  if (s->executing) {
    ScopedUncountedCpuAllocations uncounted;
    try {
      internal::apply_plan(*s, config.pin_cpu_workers);
    } catch (...) {
      s->restore(/*keep_weight_cache=*/true, /*setup_failed=*/true);  // the model as it was
      throw;
    }
  } else {
    s->active = false;
    if (s->weights) {  // plan mode: the loaded model is an ordinary CPU model
      ScopedUncountedCpuAllocations uncounted;
      materialize(s->tree, *s->weights, s->record_event);
      s->weights->finish(s->record_event);
      s->setup.load_bytes = static_cast<std::int64_t>(s->weights->bytes_read());
      s->setup.load_seconds = s->weights->seconds();
    }
  }
  // Closes the files, unless the disk tier reads from them every step (and remove() reads its
  // weights back from them).
  if (s->setup.disk_bytes == 0 || !s->active) s->weights.reset();
  s->setup.total_seconds = internal::seconds_since(start);
  internal::emit(*s, "setup", s->setup.total_seconds,
                 {{"device", s->device_name}, {"preset", s->settings.effective_preset}});
  auto offload = std::unique_ptr<Offload>(new Offload(std::move(s)));
  return offload;
}

namespace internal {

void mark_compute_stream(const OffloadState& s) {
  if (!s.runtime) return;
  time_all_copies(s, true);  // timeline() and calibration read every unit's copy and wait
  engine::Stream stream = engine::kDefaultStream;
  if (s.kind == engine::DeviceKind::kCuda) {
    if (CurrentStreamFn fn = current_stream_fn(); fn != nullptr) {
      stream = fn(s.runtime->execution_device.index());
    }
  }
  s.runtime->scheduler->mark(stream);
}

void time_all_copies(const OffloadState& s, bool on) {
  if (s.runtime) {
    s.runtime->scheduler->set_timing(on ? engine::Timing::kFull : engine::Timing::kSampled);
  }
}

std::map<std::string, double> measured_candidate_compute(const OffloadState& s) {
  std::map<std::string, double> out;
  if (!s.runtime) return out;
  const std::vector<engine::UnitTiming> t = s.runtime->scheduler->timeline();
  const std::vector<std::string>& candidate = s.runtime->unit_candidate;
  for (std::size_t j = 0; j + 1 < t.size(); ++j) {
    const std::size_t unit = static_cast<std::size_t>(t[j].unit);
    if (unit >= candidate.size() || candidate[unit].empty()) continue;
    // From this unit's op being able to run to the next acquire: its op and whatever unmanaged
    // work (attention, norms) follows it on the compute stream.
    const double dt = t[j + 1].wait_start_ms - t[j].wait_end_ms;
    if (std::isfinite(dt) && dt >= 0.0) out[candidate[unit]] += dt;
  }
  return out;
}

}  // namespace internal

// --- Offload -------------------------------------------------------------------------------------

Offload::Offload(std::unique_ptr<internal::OffloadState> state) : state_(std::move(state)) {}

Offload::~Offload() {
  try {
    remove();
  } catch (const std::exception& e) {
    // A destructor must not throw; the model may be left partly restored.
    std::fprintf(stderr, "ddo: warning: restoring the model failed: %s\n", e.what());
  }
}

void Offload::remove() {
  state_->restore();
}
void Offload::remove(const RemoveOptions& options) {
  state_->restore(/*keep_weight_cache=*/!options.clear_weight_cache, /*setup_failed=*/false,
                  options.keep_residents_on_device);
}
bool Offload::active() const {
  return state_->active;
}
const core::Plan& Offload::plan() const {
  return state_->plan;
}
const core::DynamicOffloadSettings& Offload::settings() const {
  return state_->settings;
}
std::shared_ptr<engine::Device> Offload::device() const {
  return state_->device;
}
nlohmann::json Offload::profile_report() const {
  return state_->profile_report;
}

void Offload::reset_run_stats() {
  if (state_->runtime) state_->runtime->scheduler->reset_stats();
  if (state_->probe) state_->probe->reset_peak();
}

void Offload::mark_step() {
  internal::mark_compute_stream(*state_);
}

void Offload::time_all_copies(bool on) {
  internal::time_all_copies(*state_, on);
}

nlohmann::json Offload::timeline() const {
  nlohmann::json out = nlohmann::json::array();
  if (!state_->runtime) return out;
  auto ms = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
  for (const engine::UnitTiming& t : state_->runtime->scheduler->timeline()) {
    out.push_back({{"unit", t.unit},
                   {"bytes", t.bytes},
                   {"copy_start_ms", ms(t.copy_start_ms)},
                   {"copy_end_ms", ms(t.copy_end_ms)},
                   {"wait_start_ms", ms(t.wait_start_ms)},
                   {"wait_end_ms", ms(t.wait_end_ms)}});
  }
  return out;
}

}  // namespace ddo::adapter
