#include "ddo/core/settings.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <type_traits>
#include <variant>
#include <vector>

#ifdef _WIN32
#include <stdlib.h>  // environ (the C runtime's narrow copy of the environment)
#else
#include <unistd.h>  // environ
#endif

#include "config_fields.h"
#include "ddo/core/presets.h"
#include "text.h"

namespace ddo::core {
namespace {

using text::lower;
using text::trim;

using fields::Field;

const std::string* find_env(const EnvMap& env, const char* name) {
  if (name == nullptr) return nullptr;
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// A plain decimal or exponent number, blanks and one leading '+' allowed.
bool parse_figure(const std::string& raw, double* out) {
  std::string_view text = trim(raw);
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return !text.empty() && ec == std::errc() && end == text.data() + text.size();
}

bool is_known_bool(std::string_view text) {
  const std::string v = lower(trim(text));
  return v.empty() || v == "1" || v == "true" || v == "yes" || v == "on" || v == "0" ||
         v == "false" || v == "no" || v == "off";
}

// Sets one field from its DDO_ variable, checked by the field table's rule for it; a variable
// that is absent leaves the field alone, so preset values stay in force underneath. Errors and
// warnings name the variable and the text it holds.
Status read_env_field(const Field& field, const char* name, const std::string& raw,
                      DynamicOffloadConfig* c, std::vector<std::string>* warnings) {
  return std::visit(
      [&](auto member) -> Status {
        using T = std::remove_reference_t<decltype(c->*member)>;
        T& slot = c->*member;
        auto error = [&](std::string_view problem) {
          return Status(Code::kInvalidArgument,
                        internal::str_cat(name, "=\"", raw, "\" ", problem));
        };
        if constexpr (std::is_same_v<T, bool>) {
          // 1/true/yes/on are true, anything else false. Kept, but not silently
          // (docs/design/0006-configuration.md, section 2).
          slot = parse_env_bool(raw);
          if (!is_known_bool(raw)) {
            warnings->push_back(internal::str_cat(
                name, "=\"", raw,
                "\" is not a boolean (1/true/yes/on or 0/false/no/off); read as false"));
          }
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (field.check == fields::Check::kSafetensorsBackend) {
            slot = lower(trim(raw));
            DDO_RETURN_IF_ERROR(fields::check_field(*c, field, name));
          } else {
            slot = raw;
          }
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          slot = split_pattern_list(raw);
          // Names the variable and the field, whose items the message indexes.
          DDO_RETURN_IF_ERROR(
              fields::check_field(*c, field, internal::str_cat(name, ": ", field.name)));
        } else if constexpr (std::is_enum_v<T>) {
          T parsed{};
          Status s = [&] {
            if constexpr (std::is_same_v<T, ExecutionMode>)
              return parse_execution_mode(raw, &parsed);
            if constexpr (std::is_same_v<T, Route>) return parse_route(raw, &parsed);
            if constexpr (std::is_same_v<T, AutoBudgetPolicy>) {
              return parse_auto_budget_policy(raw, &parsed);
            }
            if constexpr (std::is_same_v<T, Selection>) return parse_selection(raw, &parsed);
          }();
          if (!s.ok()) {
            return Status(Code::kInvalidArgument,
                          internal::str_cat(name, "=\"", raw, "\": ", s.message()));
          }
          slot = parsed;
        } else {
          // A number: int, int64 (KiB in the environment for the byte threshold), double,
          // optional<double>.
          const bool whole = std::is_same_v<T, int> || std::is_same_v<T, std::int64_t>;
          const char* unit = field.env_unit != nullptr ? field.env_unit : field.unit;
          double figure = 0;
          if (!parse_figure(raw, &figure)) {
            return error(
                whole && field.env_unit == nullptr
                    ? internal::str_cat("is not a whole number; write ", unit, " such as 4")
                    : internal::str_cat("is not a number; write ", unit,
                                        " as a plain number such as 6 or 5.5"));
          }
          const std::string problem = fields::range_problem(field, figure, true);
          if (!problem.empty()) return error(problem);
          const double value = figure * field.env_scale;
          if (fields::needs_clamp(field, value)) {
            const double result = fields::clamped(field, value);
            warnings->push_back(internal::str_cat(name, "=\"", raw, "\" is outside [", field.min,
                                                  ", ", field.max, "]; clamped to ", result));
            slot = result;
          } else if constexpr (std::is_same_v<T, int>) {
            if (value != std::trunc(value)) {
              return error(internal::str_cat("is not a whole number; write ", unit, " such as 4"));
            }
            slot = static_cast<int>(value);  // in range: checked above
          } else if constexpr (std::is_same_v<T, std::int64_t>) {
            slot = to_bytes_or_throw(value, ByteUnit::kBytes, name);  // rounds KiB * 1024
          } else {
            slot = value;
          }
        }
        return Status::ok_status();
      },
      field.ref);
}

// Reads every DDO_ variable of the field table (Note [Config field table] in config.cpp).
Status read_config_env(const EnvMap& env, DynamicOffloadConfig* c,
                       std::vector<std::string>* warnings) {
  for (const Field& field : fields::config_fields()) {
    // The documented name wins over its alias when both are set.
    const char* name = field.env;
    const std::string* raw = find_env(env, name);
    if (raw == nullptr && field.env_alias != nullptr) {
      name = field.env_alias;
      raw = find_env(env, name);
    }
    if (raw == nullptr) continue;
    DDO_RETURN_IF_ERROR(read_env_field(field, name, *raw, c, warnings));
  }
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

// Note [Settings text is UTF-8]
// Settings carry text from the environment into warnings, errors, reports (to_json) and Python
// strings; nlohmann::json refuses to dump malformed UTF-8 (type_error 316, which escaped from
// to_json().dump() and ended the process; found by fuzz/settings_fuzz.cpp) and Python refuses to
// decode it. Every DDO_ variable and the preset name must therefore be UTF-8; the error names
// the variable with its bad bytes written as \xNN.
Status check_text_is_utf8(const SettingsRequest& request, const EnvMap& env) {
  if (request.preset && !text::is_utf8(*request.preset)) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("preset \"", text::printable(*request.preset),
                                    "\" is not UTF-8 text; name a preset from `ddo presets`"));
  }
  for (const auto& [name, value] : env) {
    if (name.rfind("DDO_", 0) != 0) continue;
    if (!text::is_utf8(name) || !text::is_utf8(value)) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat("environment variable ", text::printable(name), "=\"",
                                      text::printable(value),
                                      "\" is not UTF-8 text; set it to UTF-8 text or unset it"));
    }
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

namespace {

// A DDO_ variable that chooses between "auto" (also: unset or empty) and one other mode; case and
// surrounding blanks are ignored. A third value is an error quoting it, followed by `help`.
template <typename Mode>
Status two_mode_from_env(const EnvMap& env, const char* name, std::string_view other,
                         Mode other_mode, std::string_view help, Mode* out) {
  const auto it = env.find(name);
  if (it == env.end()) return Status::ok_status();
  const std::string v = lower(trim(it->second));
  if (v.empty() || v == "auto") return Status::ok_status();
  if (v == other) {
    *out = other_mode;
    return Status::ok_status();
  }
  return Status(Code::kInvalidArgument,
                internal::str_cat(name, "=\"", text::printable(it->second), "\" ", help));
}

}  // namespace

Status kernel_mode_from_env(const EnvMap& env, KernelMode* out) {
  *out = KernelMode::kAuto;
  return two_mode_from_env(env, "DDO_KERNELS", "reference", KernelMode::kReference,
                           "is not a kernel mode; set it to auto (ddo's CUDA kernels where the "
                           "library has code for the GPU) or reference (the ATen reference "
                           "paths), or unset it",
                           out);
}

Status quantized_matmul_mode_from_env(const EnvMap& env, QuantizedMatmulMode* out) {
  *out = QuantizedMatmulMode::kAuto;
  const auto it = env.find("DDO_QUANTIZED_MATMUL");
  if (it != env.end() && lower(trim(it->second)) == "exact") {
    *out = QuantizedMatmulMode::kExact;
    return Status::ok_status();
  }
  return two_mode_from_env(env, "DDO_QUANTIZED_MATMUL", "off", QuantizedMatmulMode::kOff,
                           "is not a mode; set it to auto (quantized GEMMs where the card has "
                           "them), exact (the same GEMMs with float32 sums at every step) or "
                           "off (every quantized layer dequantizes), or unset it",
                           out);
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

// Note [Misspelled variables]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A DDO_ variable ddo does not read changes nothing, which is what a typo or a guessed name
// (DDO_SMALL_TENSOR_THRESHOLD_BYTES, the field's own name, where the variable is ..._KB) should
// not do silently. The environment also holds DDO_ variables of other programs (build scripts,
// runners), so not every unknown name is a mistake: a warning names an unknown variable only when
// it is a config field's name (then: which variable sets that field) or within two edits of a
// variable ddo reads (then: did you mean). DDO_<COMPONENT>_ROUTE / _PRESET are read.
namespace {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

void warn_misspelled_variables(const EnvMap& env, std::vector<std::string>* warnings) {
  std::vector<std::string> known = {"DDO_PRESET", "DDO_PLAN", "DDO_PROFILE_DIR", "DDO_KERNELS",
                                    "DDO_QUANTIZED_MATMUL"};
  for (const fields::Field& f : fields::config_fields()) {
    if (f.env != nullptr) known.emplace_back(f.env);
    if (f.env_alias != nullptr) known.emplace_back(f.env_alias);
  }
  for (const auto& [name, value] : env) {
    if (name.rfind("DDO_", 0) != 0) continue;
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    if (ends_with(name, "_ROUTE") || ends_with(name, "_PRESET")) continue;
    const std::string field = lower(std::string_view(name).substr(4));
    if (const fields::Field* f = fields::find_field(field); f != nullptr) {
      warnings->push_back(internal::str_cat(
          name, " is not read: ",
          f->env != nullptr ? internal::str_cat("the field ", f->name, " is set by ", f->env,
                                                f->env_unit != nullptr
                                                    ? internal::str_cat(" (in ", f->env_unit, ")")
                                                    : std::string())
                            : internal::str_cat("the field ", f->name, " is set from code only")));
      continue;
    }
    std::string nearest;
    std::size_t best = 3;
    for (const std::string& k : known) {
      const std::size_t d = edit_distance(name, k);
      if (d < best) {
        best = d;
        nearest = k;
      }
    }
    if (!nearest.empty()) {
      warnings->push_back(
          internal::str_cat(name, " is not a variable ddo reads; did you mean ", nearest, "?"));
    }
  }
}

// What the platform allows of the config: pinned memory and extra streams are unreliable under
// WSL's GPU paravirtualisation.
void derive_platform_facts(DynamicOffloadSettings* s) {
  const bool platform_blocks = s->wsl && s->config.disable_pin_on_wsl;
  s->pin_requested = s->config.pin_cpu_memory;
  s->pin_effective = s->pin_requested && !platform_blocks;
  s->side_streams_effective = s->config.use_side_streams && !platform_blocks;
}

}  // namespace

Status DynamicOffloadSettings::resolve(const SettingsRequest& request, const EnvMap& env,
                                       DynamicOffloadSettings* out) {
  DDO_ASSERT(out != nullptr);
  DDO_RETURN_IF_ERROR(check_text_is_utf8(request, env));
  DynamicOffloadSettings s;
  PresetInfo info;
  if (request.config) {
    // An explicit config replaces defaults, preset values and DDO_* config variables.
    s.config = *request.config;
    for (const fields::Field& field : fields::config_fields()) {
      const std::string source = internal::str_cat("config field ", field.name);
      if (auto warning = fields::clamp_field(&s.config, field, source)) {
        s.warnings.push_back(std::move(*warning));
      }
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
    DDO_RETURN_IF_ERROR(read_config_env(env, &s.config, &s.warnings));
    if (auto it = env.find("DDO_PLAN"); it != env.end()) {
      if (!is_known_bool(it->second)) {
        s.warnings.push_back(internal::str_cat(
            "DDO_PLAN=\"", it->second,
            "\" is not a boolean (1/true/yes/on or 0/false/no/off); read as false"));
      }
      if (parse_env_bool(it->second)) {
        info.enabled = true;
        s.config.execution_mode = ExecutionMode::kPlan;
      }
    }
  }
  DDO_RETURN_IF_ERROR(apply_overrides(&s.config, request.overrides, &s.warnings));
  DDO_RETURN_IF_ERROR(validate_config(s.config));
  DDO_RETURN_IF_ERROR(read_component_policies(env, &s.component_policies));
  warn_misspelled_variables(env, &s.warnings);

  s.requested_preset = info.requested;
  s.effective_preset = info.name;
  s.preset_description = info.description;
  s.enabled = info.enabled;
  s.wsl = request.wsl ? *request.wsl : detect_wsl(env);
  derive_platform_facts(&s);
  *out = std::move(s);
  return Status::ok_status();
}

Status DynamicOffloadSettings::with_overrides(const nlohmann::json& overrides,
                                              DynamicOffloadSettings* out) const {
  DDO_ASSERT(out != nullptr);
  DynamicOffloadSettings s = *this;
  DDO_RETURN_IF_ERROR(apply_overrides(&s.config, overrides, &s.warnings));
  DDO_RETURN_IF_ERROR(validate_config(s.config));
  derive_platform_facts(&s);
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
    return to_bytes_or_throw(*config.available_system_ram_gb, ByteUnit::kGiB,
                             "available_system_ram_gb");
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
      {"warnings", warnings},
  };
}

}  // namespace ddo::core
