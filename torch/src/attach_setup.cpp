// The phases of an attach (enable_offload_tree in enable_offload.cpp calls them in order):
// settings and the device they name, the inventory, the device and its capacity, the profile,
// the plan, the placement. Placement itself and restore are attach_plan.cpp; the report is
// offload_report.cpp.
#include "attach_setup.h"

#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "ddo/core/config.h"
#include "ddo/core/device_name.h"
#include "ddo/core/presets.h"
#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/torch/memory_probe.h"
#include "attach_common.h"
#include "backend.h"
#include "offload_state.h"
#include "weight_cache_internal.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

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

namespace {

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

}  // namespace

AttachSettings resolve_attach_settings(const OffloadOptions& options, const core::EnvMap& env) {
  AttachSettings out;
  out.settings = resolve_settings(options, env);
  // What resolving accepted with a change the user may not expect (a clamped ratio, a variable
  // that looks like one of ddo's but is not read): a warning each (a Python UserWarning).
  for (const std::string& warning : out.settings.warnings) TORCH_WARN("ddo: ", warning);
  core::DynamicOffloadConfig& config = out.settings.config;
  throw_if_error(core::parse_device_name("execution_device", config.execution_device, &out.device));
  config.execution_device = out.device.str();
  out.executing = config.execution_mode != core::ExecutionMode::kPlan && out.settings.enabled;
  out.backend = &backend_named(config.execution_device);
  out.torch_device = out.backend->torch_device(out.device.index);
  DDO_CHECK(!(out.executing && out.device.type == core::DeviceType::kCpu), Code::kInvalidArgument,
            "execution_device \"cpu\" is valid only in plan mode (execution_mode=plan); use "
            "\"cuda:N\" for a GPU or \"sim\" for the host simulation");
  return out;
}

AttachInventory take_inventory(const OffloadState& s) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  AttachInventory out;
  out.inventory = to_inventory(s.tree, s.torch_device);
  unmark_cached_views(s.tree, &out.inventory);
  out.weight_cache_key =
      weight_cache_key(config.pinned_weight_cache_namespace, s.model_class, s.device_name);
  // The runtime follows the model (core::resolve_execution_mode): SDNQ layers take sdnq_runtime.
  out.requested_mode = config.execution_mode;
  out.mode = core::resolve_execution_mode(config.execution_mode, out.inventory);
  if (out.mode != out.requested_mode) {
    emit(s, "execution_mode", 0.0,
         {{"requested", core::to_string(out.requested_mode)},
          {"effective", core::to_string(out.mode)},
          {"reason", "the model has SDNQ layers"}});
  }
  return out;
}

DeviceContext open_attach_device(const OffloadState& s, const OffloadOptions& options) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  DeviceContext out;
  std::int64_t total_vram = 0;
  if (s.executing) {
    out.device = options.device ? options.device : open_execution_device(s.device_name, config);
    throw_if_error(s.backend->make_probe(*out.device, s.torch_device.index(), &out.probe));
    total_vram = out.probe->snapshot().total_bytes;
    if (s.backend->memory_is_host) {
      out.counting = std::make_unique<ScopedCountingCpuAllocator>(
          CountingCpuAllocatorOptions{.device = out.device.get()});
    }
  } else if (s.backend->plan_total_bytes != nullptr) {
    total_vram = s.backend->plan_total_bytes(config);
  }
  out.total_vram = core::effective_card_bytes(total_vram, config);
  return out;
}

std::string resident_budget_origin(const OffloadState& s, const OffloadOptions& options,
                                   const core::EnvMap& env) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  // Who set a fixed resident budget, for the planner's resident_budget_fit decision (Note
  // [Resident budget fits the card] in core/src/planner_residency.cpp) and the profile's warning.
  std::string budget_origin;
  if (config.resident_module_budget_gb > 0) {
    // Settings resolved by the caller (the Python package resolves DDO_PRESET itself) still name
    // their preset: its own value, with no variable setting the field, came from the preset.
    core::DynamicOffloadConfig preset_config;
    core::PresetInfo preset_info;
    const bool preset_value =
        !options.config && options.settings && s.settings.effective_preset != core::kCustomPreset &&
        core::apply_preset(s.settings.effective_preset, &preset_config, &preset_info).ok() &&
        preset_config.resident_module_budget_gb == config.resident_module_budget_gb &&
        env.count("DDO_RESIDENT_MODULE_BUDGET_GB") == 0;
    if (options.overrides.contains("resident_module_budget_gb")) {
      budget_origin = "an enable_offload override";
    } else if (preset_value) {
      budget_origin = "preset " + s.settings.effective_preset;
    } else if (options.config || options.settings) {
      budget_origin = "the config passed by code";
    } else if (env.count("DDO_RESIDENT_MODULE_BUDGET_GB") > 0) {
      budget_origin = "DDO_RESIDENT_MODULE_BUDGET_GB";
    } else {
      budget_origin = "preset " + s.settings.effective_preset;
    }
  }
  return budget_origin;
}

AttachProfile prepare_attach_profile(const OffloadState& s, const core::DeviceName& device,
                                     const core::EnvMap& env, std::int64_t total_vram,
                                     const std::string& budget_origin) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  core::ProfileStoreOptions so;
  if (!config.profile_name.empty()) so.directory = core::resolve_profile_dir(env);
  AttachProfile out;
  out.store = std::make_unique<core::ProfileStore>(std::move(so));
  core::DeviceFacts facts;
  facts.is_cuda_like = device.type != core::DeviceType::kCpu;
  facts.total_vram_bytes = total_vram;
  out.prepared = core::prepare_profile(config, s.model_class, *out.store, facts,
                                       s.inventory.weights_summary());
  warn_if_the_preset_disables_the_profile(config, budget_origin, &out.prepared);
  out.report = out.prepared.report.to_json();
  return out;
}

PlannedAttach plan_attach(const OffloadState& s, std::int64_t total_vram,
                          const std::string& budget_origin, core::ExecutionMode requested_mode) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  const auto t0 = Clock::now();
  core::PlanContext ctx;
  ctx.total_vram_bytes = total_vram;
  ctx.available_ram_bytes = s.settings.available_ram_bytes();
  ctx.calibrating = s.prepared.region == core::RegionAction::kCalibrate;
  ctx.pin_allowed = !(s.settings.wsl && config.disable_pin_on_wsl);
  // The loader's weights can be read again each step: the planner may leave some in the file.
  ctx.weights_in_file = s.weights != nullptr;
  if (s.prepared.resident_budget_gb && !ctx.calibrating &&
      s.prepared.report.budget_source.value_or("") != "manual") {
    ctx.profile_budget_bytes = core::to_bytes_or_throw(*s.prepared.resident_budget_gb,
                                                       core::ByteUnit::kGiB, "resident_budget_gb");
  }
  if (!ctx.calibrating) ctx.candidate_compute_ms = s.prepared.candidate_compute_ms;
  ctx.resident_budget_origin = budget_origin;
  // The planner gets the mode the user asked for: it resolves it by the same rule and records
  // the decision that did (sdnq_runtime_auto), so the report explains the runtime.
  core::DynamicOffloadConfig as_requested = config;
  as_requested.execution_mode = requested_mode;
  // cache_plan: the same inventory, settings and card plan the same; reuse it.
  PlannedAttach out;
  std::string plan_key;
  std::optional<core::Plan> cached;
  if (config.cache_plan) {
    plan_key = plan_cache_key(s.inventory, as_requested, ctx);
    cached = find_cached_plan(plan_key);
  }
  if (cached) {
    out.plan = std::move(*cached);
    out.cached = true;
  } else {
    out.plan = core::make_plan(s.inventory, as_requested, ctx);
    if (config.cache_plan) store_cached_plan(plan_key, out.plan);
  }
  out.seconds = seconds_since(t0);
  emit(s, "plan", out.seconds,
       {{"modules", s.inventory.modules.size()},
        {"resident_budget_bytes", out.plan.resident_budget_bytes},
        {"streamed_bytes", out.plan.streamed_bytes},
        {"stream_units", out.plan.stream_units.size()},
        {"execute", s.executing},
        {"plan_cached", out.cached}});
  return out;
}

void place_attach(OffloadState& s) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  if (s.executing) {
    ScopedUncountedCpuAllocations uncounted;
    try {
      apply_plan(s, config.pin_cpu_workers);
    } catch (...) {
      s.restore(/*keep_weight_cache=*/true, /*setup_failed=*/true);  // the model as it was
      throw;
    }
  } else {
    s.active = false;
    if (s.weights) {  // plan mode: the loaded model is an ordinary CPU model
      ScopedUncountedCpuAllocations uncounted;
      materialize(s.tree, *s.weights, s.record_event);
      s.weights->finish(s.record_event);
      s.setup.load_bytes = static_cast<std::int64_t>(s.weights->bytes_read());
      s.setup.load_seconds = s.weights->seconds();
    }
  }
}

}  // namespace ddo::adapter::internal
