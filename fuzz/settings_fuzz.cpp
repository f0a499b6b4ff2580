// Fuzz target: the settings loader (DynamicOffloadSettings::resolve) over an environment, a
// preset and keyword overrides, as from_env sees them from the process and from code.
//
// Input: "KEY=VALUE" lines (the environment; a line "preset=NAME" names request.preset), then
// optionally "\n--\n" and a JSON object of overrides. Resolving either succeeds or returns a
// status with a message; a resolved config passes validate_config and survives config_to_json ->
// apply_overrides unchanged (the report a user sees can be fed back).
#include <cstddef>
#include <cstdint>
#include <string>

#include "ddo/core/config.h"
#include "ddo/core/settings.h"
#include "ddo/core/status.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ddo::core;
  auto [env_text, overrides_text] = ddo::fuzz::split_once(ddo::fuzz::as_text(data, size), "\n--\n");

  SettingsRequest request;
  request.wsl = false;  // platform facts from the input only, never from this machine
  EnvMap env;
  while (!env_text.empty()) {
    const std::size_t newline = env_text.find('\n');
    const std::string_view line = env_text.substr(0, newline);
    env_text.remove_prefix(newline == std::string_view::npos ? env_text.size() : newline + 1);
    const std::size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string key(line.substr(0, eq));
    const std::string value(line.substr(eq + 1));
    if (key == "preset") {
      request.preset = value;
    } else {
      env[key] = value;
    }
  }
  if (!overrides_text.empty() &&
      !ddo::fuzz::parse_json_for_harness(overrides_text, &request.overrides)) {
    return 0;
  }

  DynamicOffloadSettings settings;
  ddo::Status status;
  try {
    status = DynamicOffloadSettings::resolve(request, env, &settings);
  } catch (const ddo::Error& e) {
    // resolve returns its errors; a throw is a defect (from_env is the throwing variant).
    std::abort();
  }
  if (!status.ok()) {
    DDO_FUZZ_EXPECT(!status.message().empty());
    return 0;
  }
  DDO_FUZZ_EXPECT(validate_config(settings.config).ok());
  (void)settings.to_json().dump();
  for (const auto& [component, policy] : settings.component_policies) {
    (void)settings.policy_for(component);
  }

  DynamicOffloadConfig round_trip;
  DDO_FUZZ_EXPECT(apply_overrides(&round_trip, config_to_json(settings.config)).ok());
  DDO_FUZZ_EXPECT(config_to_json(round_trip) == config_to_json(settings.config));
  return 0;
}
