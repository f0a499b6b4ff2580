#include "ddo/core/presets.h"

#include <array>
#include <cctype>

#include "text.h"

namespace ddo::core {
namespace {

void one_shot_fast(DynamicOffloadConfig& c) {
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.pin_cpu_memory = true;
  c.pin_cpu_workers = 4;
  c.auto_budget_policy = AutoBudgetPolicy::kBalanced;
  c.resident_module_budget_gb = 0.0;      // the balanced policy (or a profile) chooses
  c.max_resident_module_budget_gb = 0.0;  // uncapped
  // Every repeated block list is a candidate (FLUX has two): with only the largest, a 24 GiB card
  // holds no more than a 16 GiB one (docs/design/0009-benchmarks.md, section 4). See the planner's
  // Note on auto_all.
  c.resident_module_patterns = {"auto_all"};
  c.resident_module_selection = Selection::kSpread;
  c.system_ram_headroom_gb = 8.0;
  c.small_tensor_threshold_bytes = static_cast<std::int64_t>(kMiB);
}

void low_ram_safe(DynamicOffloadConfig& c) {
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.pin_cpu_memory = false;
  c.auto_budget_policy = AutoBudgetPolicy::kOff;
  c.resident_module_budget_gb = 3.0;
  c.resident_module_patterns = {"auto"};
  c.resident_module_selection = Selection::kSpread;
  c.small_tensor_threshold_bytes = static_cast<std::int64_t>(kMiB);
}

void wsl_compat(DynamicOffloadConfig& c) {
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.pin_cpu_memory = false;
  c.auto_budget_policy = AutoBudgetPolicy::kOff;
  c.resident_module_budget_gb = 6.0;
  c.resident_module_patterns = {"auto"};
  c.resident_module_selection = Selection::kSpread;
  c.use_side_streams = false;
}

void warm_process(DynamicOffloadConfig& c) {
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.pin_cpu_memory = true;
  c.pin_cpu_workers = 4;
  c.cache_plan = true;
  c.cache_pinned_weights = true;  // pinned copies outlive one enable_offload in this process
  c.auto_budget_policy = AutoBudgetPolicy::kOff;
  c.resident_module_budget_gb = 6.0;
  c.resident_module_patterns = {"auto"};
  c.resident_module_selection = Selection::kSpread;
}

// The classic routes stream whole groups and keep nothing resident. The execution mode is
// linear_runtime (not plan) because these routes do move weights; the route decides how.
void group_compat(DynamicOffloadConfig& c, Route route) {
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.route = route;
  c.pin_cpu_memory = true;
  c.auto_budget_policy = AutoBudgetPolicy::kOff;
  c.resident_module_budget_gb = 0.0;
  c.resident_module_patterns.clear();
}

void diffusers_offload_compat(DynamicOffloadConfig& c) {
  group_compat(c, Route::kGroupBlock);
}
void diffusers_leaf_offload_compat(DynamicOffloadConfig& c) {
  group_compat(c, Route::kGroupLeaf);
}

void off(DynamicOffloadConfig& c) {
  c.execution_mode = ExecutionMode::kPlan;
}

struct Preset {
  const char* name;
  const char* description;
  bool enabled;
  void (*apply)(DynamicOffloadConfig&);
};

constexpr std::array<Preset, 7> kPresets = {{
    {"one_shot_fast",
     "fastest single run: dynamic linear runtime, 4-worker pinning, balanced auto resident budget "
     "(uncapped), 8 GiB RAM headroom",
     true, one_shot_fast},
    {"low_ram_safe",
     "little host RAM: no pinning, fixed 3 GiB resident budget, 1 MiB small-tensor threshold", true,
     low_ram_safe},
    {"wsl_compat", "WSL: no pinning, no side streams, fixed 6 GiB resident budget", true,
     wsl_compat},
    {"warm_process",
     "long-lived process: 4-worker pinning with a process-lifetime pinned-weight cache, fixed "
     "6 GiB resident budget",
     true, warm_process},
    {"diffusers_offload_compat",
     "baseline: classic block-group streaming (one block per group), pinned, nothing resident",
     true, diffusers_offload_compat},
    {"diffusers_leaf_offload_compat",
     "baseline: classic leaf-level streaming, pinned, nothing resident", true,
     diffusers_leaf_offload_compat},
    {"off", "disabled: plan mode only; the host moves modules itself", false, off},
}};

const Preset* find_preset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names = {"auto"};
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

Status resolve_preset(std::string_view name, PresetInfo* info) {
  std::string key = text::normalize_token(name);
  if (key == "auto") key = std::string(kAutoPresetTarget);
  const Preset* preset = find_preset(key);
  if (preset == nullptr) {
    std::string valid;
    for (const std::string& n : preset_names()) {
      if (!valid.empty()) valid += ", ";
      valid += n;
    }
    return Status(Code::kInvalidArgument,
                  internal::str_cat("unknown preset \"", name, "\"; valid presets: ", valid));
  }
  if (info != nullptr) {
    info->requested = std::string(name);
    info->name = preset->name;
    info->description = preset->description;
    info->enabled = preset->enabled;
  }
  return Status::ok_status();
}

Status apply_preset(std::string_view name, DynamicOffloadConfig* config, PresetInfo* info) {
  DDO_ASSERT(config != nullptr);
  PresetInfo resolved;
  DDO_RETURN_IF_ERROR(resolve_preset(name, &resolved));
  find_preset(resolved.name)->apply(*config);
  if (info != nullptr) *info = std::move(resolved);
  return Status::ok_status();
}

}  // namespace ddo::core
