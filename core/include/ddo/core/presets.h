/// \file
/// Presets: named bundles of config values (docs/design/0006-configuration.md, section 4), applied
/// above the built-in defaults and below `DDO_*` environment variables (settings.h has the whole
/// override order).
///
/// `auto` resolves to `one_shot_fast`; platform facts (WSL, detected RAM) act later, in the
/// settings loader, so a preset states intent and the platform may still turn pinning off.
/// `off` keeps plan mode and marks offload disabled: the host moves modules itself.
///
/// ```
/// ddo::core::DynamicOffloadConfig config;
/// ddo::core::PresetInfo info;
/// ddo::Status s = ddo::core::apply_preset("auto", &config, &info);
/// // s.ok(); info.name == "one_shot_fast"; info.enabled == true
/// // config.execution_mode == ExecutionMode::kLinearRuntime; config.pin_cpu_workers == 4
/// s = ddo::core::apply_preset("fast", &config, &info);
/// // s.code() == kInvalidArgument: "unknown preset "fast"; valid presets: auto, one_shot_fast,
/// ..."
/// ```
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ddo/core/config.h"
#include "ddo/core/status.h"

namespace ddo::core {

/// The preset `auto` stands for.
inline constexpr std::string_view kAutoPresetTarget = "one_shot_fast";

/// What applying a preset resolved to.
struct PresetInfo {
  std::string requested;    ///< the name as given, e.g. "auto"
  std::string name;         ///< the preset whose values were applied, e.g. "one_shot_fast"
  std::string description;  ///< one line for reports and `ddo presets`
  bool enabled = true;      ///< false only for `off`: the host moves modules itself
};

/// Every valid preset name: "auto" first, then the concrete presets in the order of
/// docs/design/0006-configuration.md, section 4.
std::vector<std::string> preset_names();

/// Resolves `name` (case-insensitive, blanks trimmed; "auto" -> one_shot_fast) without touching a
/// config. Unknown names fail with kInvalidArgument naming the valid ones.
Status resolve_preset(std::string_view name, PresetInfo* info);

/// Overwrites the fields the preset sets (and only those) in `config`, and fills `info` when it is
/// not null. On error `config` is unchanged.
Status apply_preset(std::string_view name, DynamicOffloadConfig* config, PresetInfo* info);

}  // namespace ddo::core
