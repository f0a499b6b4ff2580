// `ddo presets [--json]`: each preset with the values it changes from the built-in defaults.
#include <memory>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "ddo/core/config.h"
#include "ddo/core/presets.h"

namespace ddo::cli {
namespace {

// What users compare presets by (docs/design/0006-configuration.md, section 4), shown for every
// preset.
constexpr const char* kKeyFields[] = {
    "execution_mode",
    "route",
    "pin_cpu_memory",
    "pin_cpu_workers",
    "auto_budget_policy",
    "resident_module_budget_gb",
    "max_resident_module_budget_gb",
    "resident_module_patterns",
    "resident_module_selection",
};

// The key fields plus every other field the preset moves off the built-in defaults.
nlohmann::json preset_values(const core::DynamicOffloadConfig& config) {
  const nlohmann::json defaults = core::config_to_json(core::DynamicOffloadConfig{});
  const nlohmann::json values = core::config_to_json(config);
  nlohmann::json shown = nlohmann::json::object();
  for (const char* key : kKeyFields) shown[key] = values.at(key);
  for (auto it = values.begin(); it != values.end(); ++it) {
    if (defaults.at(it.key()) != it.value()) shown[it.key()] = it.value();
  }
  return shown;
}

nlohmann::json presets_json() {
  nlohmann::json presets = nlohmann::json::array();
  for (const std::string& name : core::preset_names()) {
    if (name == "auto") continue;
    core::DynamicOffloadConfig config;
    core::PresetInfo info;
    throw_if_error(core::apply_preset(name, &config, &info));
    presets.push_back({{"name", info.name},
                       {"description", info.description},
                       {"enabled", info.enabled},
                       {"values", preset_values(config)}});
  }
  return {{"auto", std::string(core::kAutoPresetTarget)}, {"presets", std::move(presets)}};
}

void print_text(const nlohmann::json& listing) {
  fmt::print("presets (auto resolves to {}; choose with DDO_PRESET or preset=...):\n",
             listing.at("auto").get<std::string>());
  for (const nlohmann::json& preset : listing.at("presets")) {
    fmt::print("\n{}{}\n  {}\n", preset.at("name").get<std::string>(),
               preset.at("enabled").get<bool>() ? "" : " (disabled)",
               preset.at("description").get<std::string>());
    const nlohmann::json& values = preset.at("values");
    for (auto it = values.begin(); it != values.end(); ++it) {
      const std::string value =
          it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
      fmt::print("    {} = {}\n", it.key(), value);
    }
  }
}

}  // namespace

void add_presets_command(CLI::App& app, int& exit_code) {
  CLI::App* command = app.add_subcommand(
      "presets", "list the presets and the values each one sets (auto = one_shot_fast)");
  // Shared with the callback, which the subcommand owns, so the flag outlives this function.
  auto json_output = std::make_shared<bool>(false);
  command->add_flag("--json", *json_output, "print the listing as JSON");
  command->callback([json_output, &exit_code] {
    const nlohmann::json listing = presets_json();
    if (*json_output) {
      fmt::print("{}\n", listing.dump(2));
    } else {
      print_text(listing);
    }
    exit_code = 0;
  });
}

}  // namespace ddo::cli
