#include "ddo/core/settings.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>

#include <unistd.h>  // environ

#include "ddo/core/presets.h"
#include "text.h"

namespace ddo::core {
namespace {

using text::lower;
using text::trim;

// Reads DDO_* variables into a config. Each reader leaves the field alone when the variable is
// absent, so presets stay in force underneath.
class EnvReader {
 public:
  explicit EnvReader(const EnvMap& env) : env_(env) {}

  const std::string* find(const char* name) const {
    auto it = env_.find(name);
    return it == env_.end() ? nullptr : &it->second;
  }

  Status read_bool(const char* name, bool* out) const {
    if (const std::string* v = find(name)) *out = parse_env_bool(*v);
    return Status::ok_status();
  }

  Status read_string(const char* name, std::string* out) const {
    if (const std::string* v = find(name)) *out = *v;
    return Status::ok_status();
  }

  Status read_list(const char* name, std::vector<std::string>* out) const {
    if (const std::string* v = find(name)) *out = split_pattern_list(*v);
    return Status::ok_status();
  }

  // A finite number of `unit` (GiB, MiB, ...); `allow_negative` only where a negative value
  // means something (sim_pinnable_gb: no limit).
  Status read_amount(const char* name, const char* unit, double* out,
                     bool allow_negative = false) const {
    const std::string* v = find(name);
    if (v == nullptr) return Status::ok_status();
    double value = 0;
    DDO_RETURN_IF_ERROR(parse_number(name, *v, unit, &value));
    if (!std::isfinite(value)) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(name, "=\"", *v, "\" is not a finite number; write ", unit,
                                      " as a plain number such as 1 or 0.5"));
    }
    if (!allow_negative && value < 0) {
      return Status(
          Code::kInvalidArgument,
          internal::str_cat(name, "=\"", *v, "\" is negative; use a value >= 0 (", unit, ")"));
    }
    *out = value;
    return Status::ok_status();
  }

  Status read_optional_amount(const char* name, const char* unit,
                              std::optional<double>* out) const {
    if (find(name) == nullptr) return Status::ok_status();
    double value = 0;
    DDO_RETURN_IF_ERROR(read_amount(name, unit, &value));
    *out = value;
    return Status::ok_status();
  }

  Status read_ratio(const char* name, double* out) const {
    if (find(name) == nullptr) return Status::ok_status();
    double value = 0;
    DDO_RETURN_IF_ERROR(read_amount(name, "a fraction", &value, /*allow_negative=*/true));
    *out = std::clamp(value, 0.0, 1.0);
    return Status::ok_status();
  }

  Status read_workers(const char* name, int* out) const {
    const std::string* v = find(name);
    if (v == nullptr) return Status::ok_status();
    const std::string_view text = trim(*v);
    int value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 1) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(name, "=\"", *v,
                                      "\" is not a whole number >= 1; write a thread count "
                                      "such as 4"));
    }
    *out = value;
    return Status::ok_status();
  }

  template <typename E>
  Status read_enum(const char* name, Status (*parse)(std::string_view, E*), E* out) const {
    const std::string* v = find(name);
    if (v == nullptr) return Status::ok_status();
    Status s = parse(*v, out);
    if (!s.ok()) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(name, "=\"", *v, "\": ", s.message()));
    }
    return Status::ok_status();
  }

  static Status parse_number(const char* name, const std::string& raw, const char* unit,
                             double* out) {
    std::string_view text = trim(raw);
    if (!text.empty() && text.front() == '+') text.remove_prefix(1);
    double value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(name, "=\"", raw, "\" is not a number; write ", unit,
                                      " as a plain number such as 6 or 5.5"));
    }
    *out = value;
    return Status::ok_status();
  }

 private:
  const EnvMap& env_;
};

Status read_config_env(const EnvMap& env, DynamicOffloadConfig* c) {
  const EnvReader r(env);
  DDO_RETURN_IF_ERROR(
      r.read_list("DDO_ALWAYS_RESIDENT_MODULE_PATTERNS", &c->always_resident_modules_pattern));
  if (r.find("DDO_SMALL_TENSOR_THRESHOLD_KB") != nullptr) {
    double kib = 0;
    DDO_RETURN_IF_ERROR(r.read_amount("DDO_SMALL_TENSOR_THRESHOLD_KB", "KiB", &kib));
    c->small_tensor_threshold_bytes = static_cast<std::int64_t>(std::llround(kib * kKiB));
  }
  DDO_RETURN_IF_ERROR(r.read_enum("DDO_EXECUTION_MODE", parse_execution_mode, &c->execution_mode));
  DDO_RETURN_IF_ERROR(r.read_bool("DDO_PIN_CPU_MEMORY", &c->pin_cpu_memory));
  DDO_RETURN_IF_ERROR(r.read_bool("DDO_ALLOW_PIN_MEMORY_FALLBACK", &c->allow_pin_memory_fallback));
  DDO_RETURN_IF_ERROR(r.read_workers("DDO_PIN_CPU_WORKERS", &c->pin_cpu_workers));
  DDO_RETURN_IF_ERROR(r.read_bool("DDO_CACHE_PLAN", &c->cache_plan));
  DDO_RETURN_IF_ERROR(r.read_bool("DDO_CACHE_PINNED_WEIGHTS", &c->cache_pinned_weights));
  DDO_RETURN_IF_ERROR(
      r.read_string("DDO_PINNED_WEIGHT_CACHE_NAMESPACE", &c->pinned_weight_cache_namespace));
  DDO_RETURN_IF_ERROR(
      r.read_enum("DDO_AUTO_BUDGET_POLICY", parse_auto_budget_policy, &c->auto_budget_policy));
  DDO_RETURN_IF_ERROR(
      r.read_amount("DDO_MAX_RESIDENT_MODULE_BUDGET_GB", "GiB", &c->max_resident_module_budget_gb));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_AUTO_VRAM_HEADROOM_GB", "GiB", &c->auto_vram_headroom_gb));
  DDO_RETURN_IF_ERROR(
      r.read_amount("DDO_PROFILE_VRAM_HEADROOM_GB", "GiB", &c->profile_vram_headroom_gb));
  DDO_RETURN_IF_ERROR(
      r.read_amount("DDO_MAX_PIN_WEIGHT_BUDGET_GB", "GiB", &c->max_pin_weight_budget_gb));
  DDO_RETURN_IF_ERROR(
      r.read_optional_amount("DDO_AVAILABLE_SYSTEM_RAM_GB", "GiB", &c->available_system_ram_gb));
  DDO_RETURN_IF_ERROR(
      r.read_amount("DDO_SYSTEM_RAM_HEADROOM_GB", "GiB", &c->system_ram_headroom_gb));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_PIN_WEIGHT_BUDGET_GB", "GiB", &c->pin_weight_budget_gb));
  DDO_RETURN_IF_ERROR(r.read_ratio("DDO_PIN_WEIGHT_BUDGET_RATIO", &c->pin_weight_budget_ratio));
  DDO_RETURN_IF_ERROR(
      r.read_enum("DDO_PIN_WEIGHT_SELECTION", parse_selection, &c->pin_weight_selection));
  DDO_RETURN_IF_ERROR(
      r.read_enum("DDO_RESIDENT_MODULE_SELECTION", parse_selection, &c->resident_module_selection));
  DDO_RETURN_IF_ERROR(
      r.read_amount("DDO_RESIDENT_MODULE_BUDGET_GB", "GiB", &c->resident_module_budget_gb));
  DDO_RETURN_IF_ERROR(r.read_list("DDO_RESIDENT_MODULE_PATTERNS", &c->resident_module_patterns));

  // The documented name wins over its alias when both are set.
  for (const char* name : {"DDO_SAFETENSORS_BACKEND", "DDO_LOAD_SAFETENSORS_BACKEND"}) {
    const std::string* v = r.find(name);
    if (v == nullptr) continue;
    std::string backend = lower(trim(*v));
    if (!is_valid_safetensors_backend(backend)) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(name, "=\"", *v,
                                      "\" is not a safetensors backend; use mmap, pread, or "
                                      "leave it empty for ddo's choice"));
    }
    c->load_safetensors_backend = std::move(backend);
  }

  DDO_RETURN_IF_ERROR(r.read_bool("DDO_VERBOSE", &c->verbose));
  DDO_RETURN_IF_ERROR(r.read_bool("DDO_SHOW_PROFILE", &c->show_profile));
  DDO_RETURN_IF_ERROR(r.read_bool("DDO_DISABLE_PIN_ON_WSL", &c->disable_pin_on_wsl));

  DDO_RETURN_IF_ERROR(r.read_amount("DDO_STAGING_MB", "MiB", &c->staging_mb));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_PREFETCH_WINDOW_MB", "MiB", &c->prefetch_window_mb));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_VRAM_CAP_GB", "GiB", &c->vram_cap_gb));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_SIM_DEVICE_GB", "GiB", &c->sim_device_capacity_gb));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_SIM_COPY_GBPS", "GB/s", &c->sim_copy_gbps));
  DDO_RETURN_IF_ERROR(r.read_amount("DDO_SIM_PINNABLE_GB", "GiB", &c->sim_pinnable_gb,
                                    /*allow_negative=*/true));
  return Status::ok_status();
}

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Route a preset implies for a component that names only a preset.
Route route_of_preset(std::string_view preset_name) {
  DynamicOffloadConfig probe;
  PresetInfo info;
  if (!apply_preset(preset_name, &probe, &info).ok()) return Route::kDynamic;
  return info.enabled ? probe.route : Route::kNone;
}

Status read_component_policies(const EnvMap& env, std::map<std::string, ComponentPolicy>* out) {
  constexpr std::string_view kPrefix = "DDO_";
  constexpr std::string_view kRouteSuffix = "_ROUTE";
  constexpr std::string_view kPresetSuffix = "_PRESET";
  struct Seen {
    std::optional<Route> route;
    std::optional<std::string> preset;
  };
  std::map<std::string, Seen> seen;
  for (const auto& [name, value] : env) {
    std::string_view key = name;
    if (key.substr(0, kPrefix.size()) != kPrefix) continue;
    // DDO_PRESET itself ends in "_PRESET" with an empty component: the size checks skip it.
    if (ends_with(key, kRouteSuffix) && key.size() > kPrefix.size() + kRouteSuffix.size()) {
      const std::string component(
          key.substr(kPrefix.size(), key.size() - kPrefix.size() - kRouteSuffix.size()));
      Route route = Route::kDynamic;
      Status s = parse_route(value, &route);
      if (!s.ok()) {
        return Status(Code::kInvalidArgument,
                      internal::str_cat(name, "=\"", value, "\": ", s.message()));
      }
      seen[component].route = route;
    } else if (ends_with(key, kPresetSuffix) &&
               key.size() > kPrefix.size() + kPresetSuffix.size()) {
      const std::string component(
          key.substr(kPrefix.size(), key.size() - kPrefix.size() - kPresetSuffix.size()));
      Status s = resolve_preset(value, nullptr);
      if (!s.ok()) {
        return Status(Code::kInvalidArgument,
                      internal::str_cat(name, "=\"", value, "\": ", s.message()));
      }
      seen[component].preset = std::string(trim(value));
    }
  }
  for (auto& [component, s] : seen) {
    ComponentPolicy policy;
    policy.preset = s.preset;
    policy.route = s.route ? *s.route : route_of_preset(*s.preset);
    (*out)[component] = policy;
  }
  return Status::ok_status();
}

}  // namespace

EnvMap process_env() {
  EnvMap env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    const std::size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
  }
  return env;
}

bool parse_env_bool(std::string_view text) {
  const std::string v = lower(trim(text));
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

std::vector<std::string> split_pattern_list(std::string_view text) {
  std::vector<std::string> items;
  while (true) {
    const std::size_t cut = text.find_first_of(",;");
    const std::string_view item = trim(text.substr(0, cut));
    if (!item.empty()) items.emplace_back(item);
    if (cut == std::string_view::npos) break;
    text.remove_prefix(cut + 1);
  }
  return items;
}

std::string component_env_key(std::string_view component) {
  std::string key(component);
  for (char& c : key) {
    const auto u = static_cast<unsigned char>(c);
    c = std::isalnum(u) ? static_cast<char>(std::toupper(u)) : '_';
  }
  return key;
}

Status DynamicOffloadSettings::resolve(const SettingsRequest& request, const EnvMap& env,
                                       DynamicOffloadSettings* out) {
  DDO_ASSERT(out != nullptr);
  DynamicOffloadSettings s;
  PresetInfo info;
  if (request.config) {
    // An explicit config replaces defaults, preset values and DDO_* config variables.
    s.config = *request.config;
    if (!std::isnan(s.config.pin_weight_budget_ratio)) {
      s.config.pin_weight_budget_ratio = std::clamp(s.config.pin_weight_budget_ratio, 0.0, 1.0);
    }
    if (request.preset) {
      DDO_RETURN_IF_ERROR(resolve_preset(*request.preset, &info));
    } else {
      info.requested = info.name = std::string(kCustomPreset);
      info.description = "config passed by code";
      info.enabled = true;
    }
  } else {
    std::string preset = "auto";
    const char* source = nullptr;
    if (request.preset) {
      preset = *request.preset;
    } else if (auto it = env.find("DDO_PRESET"); it != env.end() && !trim(it->second).empty()) {
      preset = std::string(trim(it->second));
      source = "DDO_PRESET";
    }
    Status status = apply_preset(preset, &s.config, &info);
    if (!status.ok()) {
      if (source == nullptr) return status;
      return Status(status.code(), internal::str_cat(source, ": ", status.message()));
    }
    DDO_RETURN_IF_ERROR(read_config_env(env, &s.config));
    if (auto it = env.find("DDO_PLAN"); it != env.end() && parse_env_bool(it->second)) {
      info.enabled = true;
      s.config.execution_mode = ExecutionMode::kPlan;
    }
  }
  DDO_RETURN_IF_ERROR(apply_overrides(&s.config, request.overrides));
  DDO_RETURN_IF_ERROR(validate_config(s.config));
  DDO_RETURN_IF_ERROR(read_component_policies(env, &s.component_policies));

  s.requested_preset = info.requested;
  s.effective_preset = info.name;
  s.preset_description = info.description;
  s.enabled = info.enabled;
  s.wsl = request.wsl ? *request.wsl : detect_wsl(env);
  // Pinned memory and extra streams are unreliable under WSL's GPU paravirtualisation.
  const bool platform_blocks = s.wsl && s.config.disable_pin_on_wsl;
  s.pin_requested = s.config.pin_cpu_memory;
  s.pin_effective = s.pin_requested && !platform_blocks;
  s.side_streams_effective = s.config.use_side_streams && !platform_blocks;
  *out = std::move(s);
  return Status::ok_status();
}

DynamicOffloadSettings DynamicOffloadSettings::from_env(const SettingsRequest& request,
                                                        const EnvMap& env) {
  DynamicOffloadSettings settings;
  throw_if_error(resolve(request, env, &settings));
  return settings;
}

ComponentPolicy DynamicOffloadSettings::policy_for(std::string_view component) const {
  auto it = component_policies.find(component_env_key(component));
  if (it != component_policies.end()) return it->second;
  ComponentPolicy policy;
  policy.route = config.route;
  return policy;
}

std::optional<std::int64_t> DynamicOffloadSettings::available_ram_bytes() const {
  if (config.available_system_ram_gb) {
    return static_cast<std::int64_t>(std::llround(*config.available_system_ram_gb * kGiB));
  }
  return detect_available_ram_bytes();
}

std::optional<std::int64_t> DynamicOffloadSettings::total_ram_bytes() const {
  return detect_total_ram_bytes();
}

nlohmann::json DynamicOffloadSettings::to_json() const {
  nlohmann::json policies = nlohmann::json::object();
  for (const auto& [component, policy] : component_policies) {
    policies[component] = {
        {"route", to_string(policy.route)},
        {"preset", policy.preset ? nlohmann::json(*policy.preset) : nlohmann::json(nullptr)},
    };
  }
  return {
      {"requested_preset", requested_preset},
      {"effective_preset", effective_preset},
      {"preset_description", preset_description},
      {"enabled", enabled},
      {"config", config_to_json(config)},
      {"pin_requested", pin_requested},
      {"pin_effective", pin_effective},
      {"wsl", wsl},
      {"side_streams_effective", side_streams_effective},
      {"component_policies", std::move(policies)},
  };
}

}  // namespace ddo::core
