/// \file
/// DynamicOffloadSettings: the resolved view of a config ("the regular settings loader").
///
/// `from_env` is the only place ddo reads the environment; everything else takes settings or a
/// config as an argument. Override order, lowest first:
///
/// ```
/// 1. built-in defaults (config.h)
/// 2. preset values: request.preset, else DDO_PRESET, else "auto" (= one_shot_fast)
/// 3. DDO_* environment variables (docs/design/0006-configuration.md, section 2; e.g.
///    DDO_STAGING_MB)
/// 4. an explicit config passed by code. When `request.config` is set it REPLACES 1-3
///    wholesale: no preset values and no DDO_* config variables are read. `request.preset`
///    then only names the preset for reports and its enabled flag ("off" disables); without
///    it the preset is reported as "custom" and offload is enabled.
/// 5. keyword overrides (`request.overrides`, by field name; config.h: apply_overrides)
/// ```
///
/// Later layers (a saved named-profile recommendation, the runtime auto policy) act at
/// enable_offload time on top of these settings. Platform facts act below the preset's intent:
/// under WSL with disable_pin_on_wsl, pinning and side streams are off (`pin_effective`,
/// `side_streams_effective`), while `config` keeps what was asked for.
///
/// Per-component policies come from `DDO_<COMPONENT>_ROUTE` (dynamic, group_block, group_leaf,
/// device, none) and `DDO_<COMPONENT>_PRESET`, the component name upper-cased with every other
/// character than a letter or digit turned into '_': text_encoder -> DDO_TEXT_ENCODER_ROUTE.
///
/// ```
/// auto settings = ddo::core::DynamicOffloadSettings::from_env(
///     {.preset = "low_ram_safe", .overrides = {{"verbose", true}}},
///     {{"DDO_RESIDENT_MODULE_BUDGET_GB", "4"}, {"DDO_VAE_ROUTE", "device"}});
/// // settings.effective_preset == "low_ram_safe"; settings.config.resident_module_budget_gb == 4
/// // settings.policy_for("vae").route == Route::kDeviceMove
/// // settings.policy_for("transformer").route == Route::kDynamic (the settings' own route)
/// ```
///
/// Every DDO_ number has a range (config.cpp, Note [Config field table]): a value outside it is
/// an error naming the variable and the range. What the rules accept with a change
/// (docs/design/0006-configuration.md, section 2) is kept and recorded in `warnings`, e.g.
/// {{"DDO_VERBOSE", "maybe"}} gives config.verbose == false and warnings == {"DDO_VERBOSE=\"maybe\"
/// is not a boolean (1/true/yes/on or 0/false/no/off); read as false"}.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/config.h"
#include "ddo/core/platform.h"
#include "ddo/core/status.h"

namespace ddo::core {

/// The current process environment (EnvMap is declared in platform.h).
EnvMap process_env();

/// The reported preset name when code passes a config without naming a preset.
inline constexpr std::string_view kCustomPreset = "custom";

/// What code asks for; every member is optional.
struct SettingsRequest {
  std::optional<std::string> preset;           ///< a preset name; unset = DDO_PRESET, else "auto"
  std::optional<DynamicOffloadConfig> config;  ///< replaces defaults, preset and env (see above)
  nlohmann::json overrides = nlohmann::json::object();  ///< field name -> value
  std::optional<bool> wsl;  ///< platform fact override; unset = detect from env and /proc/version
};

/// How a pipeline treats one component.
struct ComponentPolicy {
  Route route = Route::kDynamic;      ///< how the component is offloaded
  std::optional<std::string> preset;  ///< `DDO_<COMPONENT>_PRESET`, as written (trimmed)
};

/// The resolved settings: the config after the override order above, the preset it came from and
/// the platform facts that act on it.
struct DynamicOffloadSettings {
  std::string requested_preset;    ///< as asked for, e.g. "auto"
  std::string effective_preset;    ///< what it resolved to, e.g. "one_shot_fast"
  std::string preset_description;  ///< one line, for reports
  bool enabled = true;          ///< false for the "off" preset (DDO_PLAN re-enables in plan mode)
  DynamicOffloadConfig config;  ///< the resolved config
  bool pin_requested = false;   ///< config.pin_cpu_memory
  bool pin_effective = false;   ///< after platform facts (WSL)
  bool wsl = false;             ///< running under WSL (detected or as requested)
  bool side_streams_effective = true;  ///< after platform facts (WSL)
  /// Keyed by the environment spelling of the component (e.g. "TEXT_ENCODER"); only components
  /// named by a `DDO_<COMPONENT>_ROUTE` / _PRESET variable appear. Use policy_for to look up.
  std::map<std::string, ComponentPolicy> component_policies;
  /// What resolving accepted with a change the user may not expect, one line each naming the source
  /// and the value: a clamped ratio (clamped to [0, 1]), a boolean variable whose text is none of
  /// 1/true/yes/on/0/false/no/off (read as false; docs/design/0006-configuration.md, section 2).
  /// Empty when none.
  std::vector<std::string> warnings;

  /// Resolves a request against `env`; throws ddo::Error (kInvalidArgument) on bad input, e.g.
  /// `DDO_RESIDENT_MODULE_BUDGET_GB="6GB" is not a number; write GiB as 6 or 5.5`.
  static DynamicOffloadSettings from_env(const SettingsRequest& request = {},
                                         const EnvMap& env = process_env());
  /// The same, returning a Status instead of throwing.
  static Status resolve(const SettingsRequest& request, const EnvMap& env,
                        DynamicOffloadSettings* out);

  /// These settings with keyword `overrides` applied to `config` (by field name, as
  /// request.overrides; config.h: apply_overrides), validated, and the platform facts that follow
  /// from the config (pin_requested, pin_effective, side_streams_effective) derived again. The
  /// preset, the component policies and the WSL fact are kept: no environment is read, so
  /// settings built from a config ("custom") or another process's environment keep what they
  /// were built with. `out` is unchanged on error.
  ///
  /// ```
  /// DynamicOffloadSettings s = DynamicOffloadSettings::from_env({.config =
  /// DynamicOffloadConfig{}}); DynamicOffloadSettings t; s.with_overrides({{"verbose", true}}, &t);
  /// // t.requested_preset == "custom", t.config.verbose
  /// ```
  Status with_overrides(const nlohmann::json& overrides, DynamicOffloadSettings* out) const;

  /// The component's policy: its `DDO_<COMPONENT>_ROUTE` when set; else the route its
  /// `DDO_<COMPONENT>_PRESET` implies (off -> none, diffusers_*_compat -> group routes, others ->
  /// dynamic); else this settings' own `config.route`.
  ComponentPolicy policy_for(std::string_view component) const;

  /// config.available_system_ram_gb when set (simulating a smaller machine), else detected
  /// MemAvailable; unset when unknown. Read at call time: free RAM changes while a host runs.
  std::optional<std::int64_t> available_ram_bytes() const;
  std::optional<std::int64_t> total_ram_bytes() const;  ///< detected MemTotal; unset when unknown

  nlohmann::json to_json() const;  ///< for reports: the config by field name, the presets, the
                                   ///< platform facts and warnings
};

/// The environment spelling of a component name: upper-cased, non-alphanumerics -> '_'.
std::string component_env_key(std::string_view component);

/// True for 1/true/yes/on (case-insensitive, blanks trimmed); everything else is false.
bool parse_env_bool(std::string_view text);

/// Which implementation ddo's CUDA ops run: their kernels where the library holds code for the
/// device (kAuto), or their ATen reference paths everywhere (kReference; the same results, for
/// tests and for ruling a kernel out).
enum class KernelMode { kAuto, kReference };

/// DDO_KERNELS in `env`: unset, empty or "auto" -> kAuto; "reference" -> kReference; any other
/// value is kInvalidArgument naming the two. Read once per process by the ops
/// (sdnq/kernel_status.h).
Status kernel_mode_from_env(const EnvMap& env, KernelMode* out);

/// Whether per-row int8 and fp8 layers marked quantized_matmul run a low-precision GEMM where the
/// card has one (kAuto: fp8 with the tensor cores' fast accumulation), the same GEMMs with fp8
/// sums promoted to float32 at every step (kExact: slower, for ruling the fast sums out), or
/// dequantize everywhere (kOff) (sdnq/quantized_matmul.h, Note [Fast fp8 accumulation]).
enum class QuantizedMatmulMode { kAuto, kOff, kExact };

/// DDO_QUANTIZED_MATMUL in `env`: unset, empty or "auto" -> kAuto; "off" -> kOff; "exact" ->
/// kExact; any other value is kInvalidArgument naming the three. Read once per process
/// (sdnq/kernel_status.h).
Status quantized_matmul_mode_from_env(const EnvMap& env, QuantizedMatmulMode* out);

/// Splits a DDO_*_PATTERNS value on ',' and ';', trimming blanks and dropping empty items.
std::vector<std::string> split_pattern_list(std::string_view text);

}  // namespace ddo::core
