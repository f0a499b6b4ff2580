// ddo._C: DynamicOffloadConfig's fields, the presets, the settings loader and the planner's rule
// for adapter modules. Everything forwards to ddo_core (config.h, presets.h, settings.h,
// planner.h); ddo/config.py adds names and defaults only.
#include <map>
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ddo/core/config.h"
#include "ddo/core/planner.h"
#include "ddo/core/presets.h"
#include "ddo/core/settings.h"
#include "py_common.h"

namespace ddo::python {

using nlohmann::json;

namespace {

json config_defaults() {
  return core::config_to_json(core::DynamicOffloadConfig{});
}

json preset_info_json(const core::PresetInfo& info) {
  return {{"requested", info.requested},
          {"name", info.name},
          {"description", info.description},
          {"enabled", info.enabled}};
}

core::EnvMap env_from(const std::optional<std::map<std::string, std::string>>& env) {
  return env ? core::EnvMap(env->begin(), env->end()) : core::process_env();
}

core::DynamicOffloadSettings settings_from_env(
    const std::optional<std::string>& preset, py::handle config, py::handle overrides,
    const std::optional<std::map<std::string, std::string>>& env, std::optional<bool> wsl) {
  core::SettingsRequest request;
  request.preset = preset;
  if (!config.is_none()) request.config = config_from(to_json(config, "config"));
  if (!overrides.is_none()) {
    request.overrides = to_json(overrides, "overrides");
    check_override_names(request.overrides);
  }
  request.wsl = wsl;
  core::DynamicOffloadSettings settings;
  raise_status(core::DynamicOffloadSettings::resolve(request, env_from(env), &settings));
  return settings;
}

json policy_json(const core::ComponentPolicy& policy) {
  return {{"route", core::to_string(policy.route)},
          {"preset", policy.preset ? json(*policy.preset) : json(nullptr)}};
}

}  // namespace

void bind_config(py::module_& m) {
  // --- config ----------------------------------------------------------------------------------
  m.def("config_field_names", &core::config_field_names,
        "Every DynamicOffloadConfig field, in declaration order.");
  m.def("config_defaults", [] { return from_json(config_defaults()); });
  m.def(
      "config_apply",
      [](py::handle base, py::handle overrides) {
        core::DynamicOffloadConfig config =
            config_from(base.is_none() ? json(nullptr) : to_json(base, "config"));
        if (!overrides.is_none()) {
          json o = to_json(overrides, "overrides");
          check_override_names(o);
          raise_status(core::apply_overrides(&config, o));
        }
        return from_json(core::config_to_json(config));
      },
      py::arg("base"), py::arg("overrides"),
      "The full field dict of `base` (a field dict, None = defaults) with `overrides` applied "
      "and validated by ddo_core. Unknown names raise TypeError, bad values ValueError.");
  m.def(
      "config_validate",
      [](py::handle fields) {
        core::DynamicOffloadConfig config = config_from(to_json(fields, "config"));
        raise_status(core::validate_config(config));
      },
      py::arg("fields"));

  // --- presets ---------------------------------------------------------------------------------
  m.def("preset_names", &core::preset_names);
  m.def(
      "resolve_preset",
      [](const std::string& name) {
        core::PresetInfo info;
        raise_status(core::resolve_preset(name, &info));
        return from_json(preset_info_json(info));
      },
      py::arg("name"));
  m.def(
      "apply_preset",
      [](const std::string& name, py::handle base) {
        core::DynamicOffloadConfig config =
            config_from(base.is_none() ? json(nullptr) : to_json(base, "config"));
        core::PresetInfo info;
        raise_status(core::apply_preset(name, &config, &info));
        return py::make_tuple(from_json(core::config_to_json(config)),
                              from_json(preset_info_json(info)));
      },
      py::arg("name"), py::arg("base") = py::none());

  // --- settings --------------------------------------------------------------------------------
  py::class_<core::DynamicOffloadSettings>(m, "Settings")
      .def_static("from_env", &settings_from_env, py::arg("preset") = py::none(),
                  py::arg("config") = py::none(), py::arg("overrides") = py::none(),
                  py::arg("env") = py::none(), py::arg("wsl") = py::none())
      .def("to_json", [](const core::DynamicOffloadSettings& s) { return from_json(s.to_json()); })
      .def("config_json",
           [](const core::DynamicOffloadSettings& s) {
             return from_json(core::config_to_json(s.config));
           })
      .def(
          "with_overrides",
          [](const core::DynamicOffloadSettings& s, py::object overrides) {
            json fields = overrides.is_none() ? json::object() : to_json(overrides, "overrides");
            check_override_names(fields);
            core::DynamicOffloadSettings out;
            raise_status(s.with_overrides(fields, &out));
            return out;
          },
          py::arg("overrides"))
      .def("policy_for",
           [](const core::DynamicOffloadSettings& s, const std::string& component) {
             return from_json(policy_json(s.policy_for(component)));
           })
      .def("available_ram_bytes", &core::DynamicOffloadSettings::available_ram_bytes)
      .def("total_ram_bytes", &core::DynamicOffloadSettings::total_ram_bytes);
  m.def(
      "resolve_route_arguments",
      [](std::optional<std::string> route, std::optional<bool> group_offload,
         std::optional<bool> dynamic_offload,
         std::optional<std::string> offload_type) -> std::optional<std::string> {
        std::optional<core::Route> out;
        raise_status(core::resolve_route_arguments(
            {std::move(route), group_offload, dynamic_offload, std::move(offload_type)}, &out));
        if (!out) return std::nullopt;
        return std::string(core::to_string(*out));
      },
      py::arg("route"), py::arg("group_offload"), py::arg("dynamic_offload"),
      py::arg("offload_type"));
  m.def("component_env_key", [](const std::string& c) { return core::component_env_key(c); });
  // --- planner rules -----------------------------------------------------------------------------
  m.def(
      "is_adapter_module",
      [](const std::string& module_name) { return core::is_adapter_module(module_name); },
      py::arg("module_name"),
      "Whether a module of this name is a LoRA/PEFT adapter module (Note [Adapter modules]).");
  m.def("adapter_module_names", &core::adapter_module_names);
}

}  // namespace ddo::python
