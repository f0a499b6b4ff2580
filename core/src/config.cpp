#include "ddo/core/config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>
#include <regex>
#include <type_traits>
#include <variant>

#include <nlohmann/json.hpp>

#include "text.h"

namespace ddo::core {
namespace {

using nlohmann::json;

using text::normalize_token;

// The only spellings ddo writes or reads for its enums (config.h: Spelling).
constexpr std::array<Spelling<ExecutionMode>, 3> kModeSpellings = {{
    {"plan", ExecutionMode::kPlan},
    {"linear_runtime", ExecutionMode::kLinearRuntime},
    {"sdnq_runtime", ExecutionMode::kSdnqRuntime},
}};
constexpr std::array<Spelling<Route>, 5> kRouteSpellings = {{
    {"dynamic", Route::kDynamic},
    {"group_block", Route::kGroupBlock},
    {"group_leaf", Route::kGroupLeaf},
    {"device", Route::kDeviceMove},
    {"none", Route::kNone},
}};
constexpr std::array<Spelling<AutoBudgetPolicy>, 2> kPolicySpellings = {{
    {"off", AutoBudgetPolicy::kOff},
    {"balanced", AutoBudgetPolicy::kBalanced},
}};
constexpr std::array<Spelling<Selection>, 3> kSelectionSpellings = {{
    {"first", Selection::kFirst},
    {"spread", Selection::kSpread},
    {"largest", Selection::kLargest},
}};

template <typename E>
const char* spelling_of(std::span<const Spelling<E>> table, E value) {
  for (const auto& s : table) {
    if (s.value == value) return s.name;
  }
  return "unknown";
}

template <typename E>
Status parse_spelling(std::span<const Spelling<E>> table, const char* what, std::string_view text,
                      E* out) {
  const std::string token = normalize_token(text);
  for (const auto& s : table) {
    if (token == s.name) {
      *out = s.value;
      return Status::ok_status();
    }
  }
  std::string valid;
  for (const auto& s : table) {
    if (!valid.empty()) valid += ", ";
    valid += s.name;
  }
  return Status(Code::kInvalidArgument, internal::str_cat(what, " \"", text, "\" is not one of ",
                                                          valid, "; use one of those spellings"));
}

// Note [Config field table]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// One table drives `config_field_names`, `config_to_json` and `apply_overrides`, so a field added
// to the struct and to this table is named, serialised and overridable consistently. The table is
// a function-local constexpr array (no static constructors); member pointers carry the type, so
// each field's JSON type check follows from its C++ type.
using FieldRef =
    std::variant<bool DynamicOffloadConfig::*, int DynamicOffloadConfig::*,
                 std::int64_t DynamicOffloadConfig::*, double DynamicOffloadConfig::*,
                 std::optional<double> DynamicOffloadConfig::*, std::string DynamicOffloadConfig::*,
                 std::vector<std::string> DynamicOffloadConfig::*,
                 ExecutionMode DynamicOffloadConfig::*, Route DynamicOffloadConfig::*,
                 AutoBudgetPolicy DynamicOffloadConfig::*, Selection DynamicOffloadConfig::*>;

struct Field {
  const char* name;
  FieldRef ref;
};

using C = DynamicOffloadConfig;
constexpr auto kFields = std::to_array<Field>({
    {"execution_device", &C::execution_device},
    {"offload_device", &C::offload_device},
    {"skip_modules_pattern", &C::skip_modules_pattern},
    {"always_resident_modules_pattern", &C::always_resident_modules_pattern},
    {"small_tensor_threshold_bytes", &C::small_tensor_threshold_bytes},
    {"execution_mode", &C::execution_mode},
    {"route", &C::route},
    {"pin_cpu_memory", &C::pin_cpu_memory},
    {"allow_pin_memory_fallback", &C::allow_pin_memory_fallback},
    {"pin_cpu_workers", &C::pin_cpu_workers},
    {"cache_plan", &C::cache_plan},
    {"cache_pinned_weights", &C::cache_pinned_weights},
    {"pinned_weight_cache_namespace", &C::pinned_weight_cache_namespace},
    {"auto_budget_policy", &C::auto_budget_policy},
    {"max_resident_module_budget_gb", &C::max_resident_module_budget_gb},
    {"auto_vram_headroom_gb", &C::auto_vram_headroom_gb},
    {"profile_vram_headroom_gb", &C::profile_vram_headroom_gb},
    {"max_pin_weight_budget_gb", &C::max_pin_weight_budget_gb},
    {"available_system_ram_gb", &C::available_system_ram_gb},
    {"system_ram_headroom_gb", &C::system_ram_headroom_gb},
    {"pin_weight_budget_gb", &C::pin_weight_budget_gb},
    {"pin_weight_budget_ratio", &C::pin_weight_budget_ratio},
    {"pin_weight_selection", &C::pin_weight_selection},
    {"resident_module_selection", &C::resident_module_selection},
    {"resident_module_budget_gb", &C::resident_module_budget_gb},
    {"resident_module_patterns", &C::resident_module_patterns},
    {"profile_name", &C::profile_name},
    {"build_profile", &C::build_profile},
    {"load_safetensors_backend", &C::load_safetensors_backend},
    {"verbose", &C::verbose},
    {"show_profile", &C::show_profile},
    {"disable_pin_on_wsl", &C::disable_pin_on_wsl},
    {"use_side_streams", &C::use_side_streams},
    {"staging_mb", &C::staging_mb},
    {"prefetch_window_mb", &C::prefetch_window_mb},
    {"vram_cap_gb", &C::vram_cap_gb},
    {"sim_device_capacity_gb", &C::sim_device_capacity_gb},
    {"sim_copy_gbps", &C::sim_copy_gbps},
    {"sim_pinnable_gb", &C::sim_pinnable_gb},
});

template <typename E>
json enum_json(E value) {
  return to_string(value);
}

Status parse_enum(std::string_view text, ExecutionMode* out) {
  return parse_execution_mode(text, out);
}
Status parse_enum(std::string_view text, Route* out) {
  return parse_route(text, out);
}
Status parse_enum(std::string_view text, AutoBudgetPolicy* out) {
  return parse_auto_budget_policy(text, out);
}
Status parse_enum(std::string_view text, Selection* out) {
  return parse_selection(text, out);
}

Status type_error(const char* field, const char* expected, const json& value) {
  return Status(Code::kInvalidArgument,
                internal::str_cat("config field ", field, " takes ", expected, ", got ",
                                  value.type_name(), " ", value.dump()));
}

// Sets one field from a JSON value, checking its type. Range checks happen in validate_config.
Status set_field(DynamicOffloadConfig* config, const Field& field, const json& value) {
  return std::visit(
      [&](auto member) -> Status {
        using T = std::remove_reference_t<decltype(config->*member)>;
        T& slot = config->*member;
        if constexpr (std::is_same_v<T, bool>) {
          if (!value.is_boolean()) return type_error(field.name, "true or false", value);
          slot = value.get<bool>();
        } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, std::int64_t>) {
          if (!value.is_number()) return type_error(field.name, "an integer", value);
          constexpr auto kMin = std::numeric_limits<T>::min();
          constexpr auto kMax = std::numeric_limits<T>::max();
          if (value.is_number_float()) {
            const double d = value.get<double>();
            // kMax + 1 is a power of two, exact in a double, so the bound is exact for int64.
            if (!std::isfinite(d) || d != std::trunc(d) || d < static_cast<double>(kMin) ||
                d >= static_cast<double>(kMax) + 1.0) {
              return type_error(field.name, "a whole number in range", value);
            }
            slot = static_cast<T>(d);
          } else if (value.is_number_unsigned()) {
            if (value.get<std::uint64_t>() > static_cast<std::uint64_t>(kMax)) {
              return type_error(field.name, "a whole number in range", value);
            }
            slot = static_cast<T>(value.get<std::uint64_t>());
          } else {
            const std::int64_t i = value.get<std::int64_t>();
            if (i < kMin || i > kMax) {
              return type_error(field.name, "a whole number in range", value);
            }
            slot = static_cast<T>(i);
          }
        } else if constexpr (std::is_same_v<T, double>) {
          if (!value.is_number()) return type_error(field.name, "a number", value);
          slot = value.get<double>();
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (value.is_null()) {
            slot.reset();
          } else if (value.is_number()) {
            slot = value.get<double>();
          } else {
            return type_error(field.name, "a number or null (detect)", value);
          }
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!value.is_string()) return type_error(field.name, "a string", value);
          slot = value.get<std::string>();
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (value.is_string()) {
            slot = {value.get<std::string>()};
          } else if (value.is_array() &&
                     std::all_of(value.begin(), value.end(),
                                 [](const json& item) { return item.is_string(); })) {
            slot = value.get<std::vector<std::string>>();
          } else {
            return type_error(field.name, "a list of strings", value);
          }
        } else {
          if (!value.is_string()) return type_error(field.name, "a string naming a value", value);
          T parsed{};
          Status s = parse_enum(value.get_ref<const std::string&>(), &parsed);
          if (!s.ok()) {
            return Status(Code::kInvalidArgument,
                          internal::str_cat("config field ", field.name, ": ", s.message()));
          }
          slot = parsed;
        }
        return Status::ok_status();
      },
      field.ref);
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::vector<std::string_view> split_words(std::string_view name) {
  std::vector<std::string_view> words;
  while (!name.empty()) {
    const std::size_t cut = name.find('_');
    if (cut != 0) words.push_back(name.substr(0, cut));
    if (cut == std::string_view::npos) break;
    name.remove_prefix(cut + 1);
  }
  return words;
}

// The field a user most likely meant: a close spelling ("verbos"), else the shortest field that
// has every word of the name ("pin_memory" -> pin_cpu_memory), else one containing it
// ("headroom").
std::optional<std::string> suggest_field(std::string_view unknown) {
  const std::string key = normalize_token(unknown);
  std::optional<std::string> best;
  std::size_t best_distance = std::max<std::size_t>(2, key.size() / 3) + 1;
  for (const Field& field : kFields) {
    const std::size_t d = edit_distance(key, field.name);
    if (d < best_distance) {
      best_distance = d;
      best = field.name;
    }
  }
  if (best) return best;
  const std::vector<std::string_view> words = split_words(key);
  for (const Field& field : kFields) {
    const std::vector<std::string_view> field_words = split_words(field.name);
    const bool has_all = !words.empty() && std::all_of(words.begin(), words.end(), [&](auto w) {
      return std::find(field_words.begin(), field_words.end(), w) != field_words.end();
    });
    if (has_all && (!best || best->size() > std::string_view(field.name).size())) {
      best = field.name;
    }
  }
  if (best || key.size() < 4) return best;
  for (const Field& field : kFields) {
    if (std::string_view(field.name).find(key) != std::string_view::npos) return field.name;
  }
  return std::nullopt;
}

const Field* find_field(std::string_view name) {
  for (const Field& field : kFields) {
    if (name == field.name) return &field;
  }
  return nullptr;
}

bool is_valid_regex(const std::string& pattern) {
  try {
    std::regex compiled(pattern, std::regex::ECMAScript);
    (void)compiled;
    return true;
  } catch (const std::regex_error&) {
    return false;
  }
}

Status check_patterns(const char* field, const std::vector<std::string>& patterns,
                      bool allow_auto) {
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    if (allow_auto && patterns[i] == "auto") continue;
    if (!is_valid_regex(patterns[i])) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(field, "[", i, "]=\"", patterns[i],
                                      "\" is not a valid regular expression (ECMAScript "
                                      "syntax); fix or escape it"));
    }
  }
  return Status::ok_status();
}

}  // namespace

std::span<const Spelling<ExecutionMode>> execution_mode_spellings() {
  return kModeSpellings;
}
std::span<const Spelling<Route>> route_spellings() {
  return kRouteSpellings;
}
std::span<const Spelling<AutoBudgetPolicy>> auto_budget_policy_spellings() {
  return kPolicySpellings;
}
std::span<const Spelling<Selection>> selection_spellings() {
  return kSelectionSpellings;
}

const char* to_string(ExecutionMode mode) {
  return spelling_of(execution_mode_spellings(), mode);
}
const char* to_string(Route route) {
  return spelling_of(route_spellings(), route);
}
const char* to_string(AutoBudgetPolicy policy) {
  return spelling_of(auto_budget_policy_spellings(), policy);
}
const char* to_string(Selection selection) {
  return spelling_of(selection_spellings(), selection);
}

Status parse_execution_mode(std::string_view text, ExecutionMode* out) {
  return parse_spelling(execution_mode_spellings(), "execution mode", text, out);
}
Status parse_route(std::string_view text, Route* out) {
  return parse_spelling(route_spellings(), "route", text, out);
}
Status parse_auto_budget_policy(std::string_view text, AutoBudgetPolicy* out) {
  return parse_spelling(auto_budget_policy_spellings(), "auto budget policy", text, out);
}
Status parse_selection(std::string_view text, Selection* out) {
  return parse_spelling(selection_spellings(), "selection", text, out);
}

bool is_valid_safetensors_backend(std::string_view backend) {
  return backend.empty() || backend == "mmap" || backend == "pread";
}

std::vector<std::string> config_field_names() {
  std::vector<std::string> names;
  names.reserve(kFields.size());
  for (const Field& field : kFields) names.emplace_back(field.name);
  return names;
}

nlohmann::json config_to_json(const DynamicOffloadConfig& config) {
  json out = json::object();
  for (const Field& field : kFields) {
    out[field.name] = std::visit(
        [&](auto member) -> json {
          using T = std::remove_cv_t<std::remove_reference_t<decltype(config.*member)>>;
          const T& slot = config.*member;
          if constexpr (std::is_enum_v<T>) {
            return enum_json(slot);
          } else if constexpr (std::is_same_v<T, std::optional<double>>) {
            return slot ? json(*slot) : json(nullptr);
          } else {
            return json(slot);
          }
        },
        field.ref);
  }
  return out;
}

Status apply_overrides(DynamicOffloadConfig* config, const nlohmann::json& object) {
  DDO_ASSERT(config != nullptr);
  if (object.is_null()) return Status::ok_status();
  if (!object.is_object()) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("config overrides must be an object of field names to values, "
                                    "got ",
                                    object.type_name(), " ", object.dump()));
  }
  // Collect every unknown name before failing, so one run shows all typos.
  std::vector<std::string> unknown;
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (find_field(it.key()) == nullptr) unknown.push_back(it.key());
  }
  if (!unknown.empty()) {
    std::string message = unknown.size() == 1 ? "unknown config field " : "unknown config fields ";
    for (std::size_t i = 0; i < unknown.size(); ++i) {
      if (i > 0) message += ", ";
      message += "\"" + unknown[i] + "\"";
      if (auto suggestion = suggest_field(unknown[i])) {
        message += " (did you mean \"" + *suggestion + "\"?)";
      }
    }
    message += "; valid fields: ";
    for (std::size_t i = 0; i < kFields.size(); ++i) {
      if (i > 0) message += ", ";
      message += kFields[i].name;
    }
    return Status(Code::kInvalidArgument, std::move(message));
  }

  DynamicOffloadConfig updated = *config;
  for (auto it = object.begin(); it != object.end(); ++it) {
    DDO_RETURN_IF_ERROR(set_field(&updated, *find_field(it.key()), it.value()));
  }
  if (!std::isnan(updated.pin_weight_budget_ratio)) {
    updated.pin_weight_budget_ratio = std::clamp(updated.pin_weight_budget_ratio, 0.0, 1.0);
  }
  DDO_RETURN_IF_ERROR(validate_config(updated));
  *config = std::move(updated);
  return Status::ok_status();
}

Status validate_config(const DynamicOffloadConfig& config) {
  if (config.pin_cpu_workers < 1) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("pin_cpu_workers=", config.pin_cpu_workers,
                                    " must be at least 1; use 1 for a single pinning thread"));
  }
  if (config.small_tensor_threshold_bytes < 0) {
    return Status(
        Code::kInvalidArgument,
        internal::str_cat("small_tensor_threshold_bytes=", config.small_tensor_threshold_bytes,
                          " is negative; use 0 or a positive byte count"));
  }
  struct Amount {
    const char* name;
    double value;
    bool may_be_negative;
  };
  std::vector<Amount> amounts = {
      {"max_resident_module_budget_gb", config.max_resident_module_budget_gb, false},
      {"auto_vram_headroom_gb", config.auto_vram_headroom_gb, false},
      {"profile_vram_headroom_gb", config.profile_vram_headroom_gb, false},
      {"max_pin_weight_budget_gb", config.max_pin_weight_budget_gb, false},
      {"system_ram_headroom_gb", config.system_ram_headroom_gb, false},
      {"pin_weight_budget_gb", config.pin_weight_budget_gb, false},
      {"resident_module_budget_gb", config.resident_module_budget_gb, false},
      {"staging_mb", config.staging_mb, false},
      {"prefetch_window_mb", config.prefetch_window_mb, false},
      {"vram_cap_gb", config.vram_cap_gb, false},
      {"sim_device_capacity_gb", config.sim_device_capacity_gb, false},
      {"sim_copy_gbps", config.sim_copy_gbps, false},
      {"sim_pinnable_gb", config.sim_pinnable_gb, true},
  };
  if (config.available_system_ram_gb) {
    amounts.push_back({"available_system_ram_gb", *config.available_system_ram_gb, false});
  }
  for (const Amount& a : amounts) {
    if (!std::isfinite(a.value)) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(a.name, "=", a.value, " is not a finite number; use a value",
                                      a.may_be_negative ? "" : " >= 0"));
    }
    if (!a.may_be_negative && a.value < 0) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat(a.name, "=", a.value, " is negative; use a value >= 0"));
    }
  }
  // The spec clamps the ratio to [0, 1] where it is used; only a value with no place on the line
  // is an error.
  if (std::isnan(config.pin_weight_budget_ratio)) {
    return Status(Code::kInvalidArgument,
                  "pin_weight_budget_ratio is not a number; use a fraction in [0, 1]");
  }
  if (!is_valid_safetensors_backend(config.load_safetensors_backend)) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("load_safetensors_backend=\"", config.load_safetensors_backend,
                                    "\" is not one of \"\" (auto), mmap, pread"));
  }
  DDO_RETURN_IF_ERROR(check_patterns("skip_modules_pattern", config.skip_modules_pattern, false));
  DDO_RETURN_IF_ERROR(check_patterns("always_resident_modules_pattern",
                                     config.always_resident_modules_pattern, false));
  DDO_RETURN_IF_ERROR(
      check_patterns("resident_module_patterns", config.resident_module_patterns, true));
  return Status::ok_status();
}

}  // namespace ddo::core
