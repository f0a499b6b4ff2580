// The field table of DynamicOffloadConfig (internal to ddo_core): every field's spec name, its
// DDO_ variable, and for numbers the unit and the accepted range. config.cpp derives the field
// names, the JSON view, the keyword overrides and `validate_config` from it; settings.cpp derives
// the environment reader. See Note [Config field table] in config.cpp.
//
//   const fields::Field* f = fields::find_field("vram_cap_gb");
//   // f->env == "DDO_VRAM_CAP_GB", f->unit == "GiB", [f->min, f->max] == [0, 65536]
//   fields::range_problem(*f, 16e9);
//   // "is out of range; use GiB in [0, 65536]"
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ddo/core/config.h"
#include "ddo/core/status.h"

namespace ddo::core::fields {

using FieldRef =
    std::variant<bool DynamicOffloadConfig::*, int DynamicOffloadConfig::*,
                 std::int64_t DynamicOffloadConfig::*, double DynamicOffloadConfig::*,
                 std::optional<double> DynamicOffloadConfig::*, std::string DynamicOffloadConfig::*,
                 std::vector<std::string> DynamicOffloadConfig::*,
                 ExecutionMode DynamicOffloadConfig::*, Route DynamicOffloadConfig::*,
                 AutoBudgetPolicy DynamicOffloadConfig::*, Selection DynamicOffloadConfig::*>;

// Checks beyond type and range.
enum class Check {
  kNone,
  kSafetensorsBackend,  // "", mmap or pread (read from the environment lower-cased)
  kPatterns,            // each item a bounded, compilable ECMAScript regex
  kPatternsOrAuto,      // the same, and the tokens auto / auto_all
  kDeviceIndex,         // "cuda:N" / "sim:N" with N in [0, kMaxDeviceIndex] (check_device_index)
};

struct Field {
  const char* name;
  FieldRef ref;
  const char* env = nullptr;        // its DDO_ variable; nullptr: code only
  const char* env_alias = nullptr;  // another name for it, read when `env` is unset
  // Numbers: what the figure counts ("GiB", "a thread count") and its range, inclusive.
  const char* unit = nullptr;
  double min = 0;
  double max = 0;
  bool zero_is_off = false;  // 0 is accepted below `min`: it means off
  bool clamp = false;        // outside the range is clamped (with a warning), not an error
  // The environment writes the figure in another unit: field value = figure * env_scale.
  double env_scale = 1;
  const char* env_unit = nullptr;
  Check check = Check::kNone;
};

std::span<const Field> config_fields();
const Field* find_field(std::string_view name);

// Why `figure` is not acceptable for `field`, and what to write; empty when it is. The figure
// and the message are in the environment's unit when `in_env_unit` (DDO_SMALL_TENSOR_THRESHOLD_KB
// is KiB, the field bytes). A clamp field's only problem is NaN.
std::string range_problem(const Field& field, double figure, bool in_env_unit = false);

// Whether `figure` lies outside a clamp field's range (the caller then clamps and warns).
bool needs_clamp(const Field& field, double figure);
double clamped(const Field& field, double figure);

// config.h's check_module_pattern.
Status check_module_pattern(std::string_view source, std::size_t index, const std::string& pattern);

// Checks one field of `config` (range, backend, patterns). The message starts with `source`
// ("override vram_cap_gb", "config field vram_cap_gb", "DDO_VRAM_CAP_GB") and the value.
Status check_field(const DynamicOffloadConfig& config, const Field& field, std::string_view source);

// Clamps a clamp field of `config` into its range. Returns the warning naming `source`, the value
// and the result, or nothing when the value was in range.
std::optional<std::string> clamp_field(DynamicOffloadConfig* config, const Field& field,
                                       std::string_view source);

}  // namespace ddo::core::fields
