// ddo._C, part one: the module definition, the error table, the JSON bridge, and the core
// bindings (config fields, presets, the settings loader, the named-profile store and the legacy
// host-context API). Everything here forwards to ddo_core; Python adds names and defaults only.
// See docs/design/0003-python.md.
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ddo/core/calibration.h"
#include "ddo/core/config.h"
#include "ddo/core/host_context.h"
#include "ddo/core/presets.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/settings.h"
#include "py_common.h"

namespace ddo::python {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// ddo.NotFoundError: both FileNotFoundError (a missing profile file) and KeyError (a missing
// named thing), so either `except` catches it. Created once at import; never freed (Python owns
// it through the module attribute, and a static py::object would be destroyed after the
// interpreter at exit).
PyObject* g_not_found_error = nullptr;

PyObject* exception_for(Code code) {
  switch (code) {
    case Code::kInvalidArgument:
    case Code::kDataLoss:
      return PyExc_ValueError;
    case Code::kNotFound:
      return g_not_found_error != nullptr ? g_not_found_error : PyExc_KeyError;
    case Code::kResourceExhausted:
      return PyExc_MemoryError;
    case Code::kFailedPrecondition:
    case Code::kUnavailable:
    case Code::kInternal:
    case Code::kOk:
      break;
  }
  return PyExc_RuntimeError;
}

std::string type_name(py::handle value) {
  return py::str(py::type::handle_of(value).attr("__qualname__")).cast<std::string>();
}

// -------------------------------------------------------------------------------------------
// Core: config, presets, settings.
// -------------------------------------------------------------------------------------------

json config_defaults() {
  return core::config_to_json(core::DynamicOffloadConfig{});
}

// A config from a (possibly partial) JSON object of fields over the defaults.
core::DynamicOffloadConfig config_from(const json& fields) {
  core::DynamicOffloadConfig config;
  if (!fields.is_null()) {
    check_override_names(fields);
    raise_status(core::apply_overrides(&config, fields));
  }
  return config;
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

// -------------------------------------------------------------------------------------------
// Named profiles.
// -------------------------------------------------------------------------------------------

fs::path profile_dir_from(const std::optional<std::string>& directory) {
  if (directory && !directory->empty()) return fs::path(*directory);
  return core::resolve_profile_dir(core::process_env());
}

core::ProfileIdentity identity_of(const std::string& name, const std::string& model_class,
                                  const std::string& execution_mode) {
  return core::ProfileIdentity{name, model_class, execution_mode};
}

py::object record_or_none(const std::optional<core::ProfileRecord>& record) {
  if (!record) return py::none();
  return from_json(record->to_json());
}

// -------------------------------------------------------------------------------------------
// Legacy host contexts.
// -------------------------------------------------------------------------------------------

py::object context_record_or_none(const std::optional<core::ContextRecord>& record) {
  if (!record) return py::none();
  return from_json(record->to_json());
}

}  // namespace

// -------------------------------------------------------------------------------------------
// The JSON bridge and the error table (py_common.h).
// -------------------------------------------------------------------------------------------

json to_json(py::handle value, const std::string& where) {
  if (value.is_none()) return nullptr;
  if (PyBool_Check(value.ptr())) return value.ptr() == Py_True;
  if (PyLong_Check(value.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow == 0) {
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      return static_cast<std::int64_t>(v);
    }
    if (overflow > 0) {
      unsigned long long u = PyLong_AsUnsignedLongLong(value.ptr());
      if (!PyErr_Occurred()) return static_cast<std::uint64_t>(u);
      PyErr_Clear();
    }
    throw py::value_error(where + " is an integer too large for JSON (64 bits)");
  }
  if (PyFloat_Check(value.ptr())) return PyFloat_AsDouble(value.ptr());
  if (PyUnicode_Check(value.ptr())) return value.cast<std::string>();
  if (PyIndex_Check(value.ptr())) {  // numpy integers and other int-like scalars
    PyObject* index = PyNumber_Index(value.ptr());
    if (index == nullptr) throw py::error_already_set();
    return to_json(py::reinterpret_steal<py::object>(index), where);
  }
  if (PyList_Check(value.ptr()) || PyTuple_Check(value.ptr())) {
    json out = json::array();
    std::size_t i = 0;
    for (py::handle item : value) {
      out.push_back(to_json(item, where + "[" + std::to_string(i++) + "]"));
    }
    return out;
  }
  if (PyDict_Check(value.ptr())) {
    json out = json::object();
    for (auto [key, item] : py::reinterpret_borrow<py::dict>(value)) {
      if (!PyUnicode_Check(key.ptr())) {
        throw py::type_error(where + " has a key of type " + type_name(key) +
                             "; JSON object keys must be str");
      }
      std::string k = key.cast<std::string>();
      out[k] = to_json(item, where + "['" + k + "']");
    }
    return out;
  }
  if (py::hasattr(value, "__fspath__")) {
    return py::str(value.attr("__fspath__")()).cast<std::string>();
  }
  throw py::type_error(where + " is a " + type_name(value) +
                       "; only None, bool, int, float, str, list, tuple and dict with str keys "
                       "are JSON-safe");
}

py::object from_json(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return py::none();
    case json::value_t::boolean:
      return py::bool_(value.get<bool>());
    case json::value_t::number_integer:
      return py::int_(value.get<std::int64_t>());
    case json::value_t::number_unsigned:
      return py::int_(value.get<std::uint64_t>());
    case json::value_t::number_float:
      return py::float_(value.get<double>());
    case json::value_t::string:
      return py::str(value.get_ref<const std::string&>());
    case json::value_t::array: {
      py::list out;
      for (const auto& item : value) out.append(from_json(item));
      return out;
    }
    case json::value_t::object: {
      py::dict out;
      for (const auto& [key, item] : value.items()) out[py::str(key)] = from_json(item);
      return out;
    }
    case json::value_t::binary:
    case json::value_t::discarded:
      break;
  }
  return py::none();
}

void raise_status(const Status& status) {
  if (status.ok()) return;
  throw Error(status);
}

void check_override_names(const json& overrides) {
  if (!overrides.is_object()) {
    throw py::type_error("overrides must be a dict of DynamicOffloadConfig field names");
  }
  static const std::set<std::string> known = [] {
    auto names = core::config_field_names();
    return std::set<std::string>(names.begin(), names.end());
  }();
  json unknown = json::object();
  for (const auto& [key, value] : overrides.items()) {
    if (known.count(key) == 0) unknown[key] = value;
  }
  if (unknown.empty()) return;
  core::DynamicOffloadConfig scratch;
  Status status = core::apply_overrides(&scratch, unknown);
  throw py::type_error(status.ok() ? "unknown DynamicOffloadConfig fields" : status.message());
}

}  // namespace ddo::python

namespace py = pybind11;
using ddo::python::from_json;
using ddo::python::to_json;
using nlohmann::json;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddo's private extension; use the ddo package.";

  // --- errors ----------------------------------------------------------------------------------
  {
    py::tuple bases = py::make_tuple(py::reinterpret_borrow<py::object>(PyExc_FileNotFoundError),
                                     py::reinterpret_borrow<py::object>(PyExc_KeyError));
    ddo::python::g_not_found_error = PyErr_NewExceptionWithDoc(
        "ddo.NotFoundError", "A named ddo thing (a profile, a component, a file) does not exist.",
        bases.ptr(), nullptr);
    if (ddo::python::g_not_found_error == nullptr) throw py::error_already_set();
    m.attr("NotFoundError") = py::reinterpret_borrow<py::object>(ddo::python::g_not_found_error);
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ddo::Error& e) {
      PyErr_SetString(ddo::python::exception_for(e.code()), e.what());
    }
  });
  m.def("code_of_exception", [](const std::string& code) {
    // For tests: the Python type of each code.
    static const std::map<std::string, ddo::Code> codes = {
        {"invalid_argument", ddo::Code::kInvalidArgument},
        {"failed_precondition", ddo::Code::kFailedPrecondition},
        {"not_found", ddo::Code::kNotFound},
        {"resource_exhausted", ddo::Code::kResourceExhausted},
        {"unavailable", ddo::Code::kUnavailable},
        {"data_loss", ddo::Code::kDataLoss},
        {"internal", ddo::Code::kInternal}};
    auto it = codes.find(code);
    if (it == codes.end()) throw py::value_error("unknown code " + code);
    return py::reinterpret_borrow<py::object>(ddo::python::exception_for(it->second));
  });
  m.def("raise_error", [](const std::string& code, const std::string& message) {
    // For tests: throws a ddo::Error through the translator.
    static const std::map<std::string, ddo::Code> codes = {
        {"invalid_argument", ddo::Code::kInvalidArgument},
        {"failed_precondition", ddo::Code::kFailedPrecondition},
        {"not_found", ddo::Code::kNotFound},
        {"resource_exhausted", ddo::Code::kResourceExhausted},
        {"unavailable", ddo::Code::kUnavailable},
        {"data_loss", ddo::Code::kDataLoss},
        {"internal", ddo::Code::kInternal}};
    auto it = codes.find(code);
    if (it == codes.end()) throw py::value_error("unknown code " + code);
    throw ddo::Error(it->second, message);
  });

  // --- config ----------------------------------------------------------------------------------
  m.def("config_field_names", &ddo::core::config_field_names,
        "Every DynamicOffloadConfig field, in declaration order.");
  m.def("config_defaults", [] { return from_json(ddo::python::config_defaults()); });
  m.def(
      "config_apply",
      [](py::handle base, py::handle overrides) {
        ddo::core::DynamicOffloadConfig config =
            ddo::python::config_from(base.is_none() ? json(nullptr) : to_json(base, "config"));
        if (!overrides.is_none()) {
          json o = to_json(overrides, "overrides");
          ddo::python::check_override_names(o);
          ddo::python::raise_status(ddo::core::apply_overrides(&config, o));
        }
        return from_json(ddo::core::config_to_json(config));
      },
      py::arg("base"), py::arg("overrides"),
      "The full field dict of `base` (a field dict, None = defaults) with `overrides` applied "
      "and validated by ddo_core. Unknown names raise TypeError, bad values ValueError.");
  m.def(
      "config_validate",
      [](py::handle fields) {
        ddo::core::DynamicOffloadConfig config =
            ddo::python::config_from(to_json(fields, "config"));
        ddo::python::raise_status(ddo::core::validate_config(config));
      },
      py::arg("fields"));

  // --- presets ---------------------------------------------------------------------------------
  m.def("preset_names", &ddo::core::preset_names);
  m.def(
      "resolve_preset",
      [](const std::string& name) {
        ddo::core::PresetInfo info;
        ddo::python::raise_status(ddo::core::resolve_preset(name, &info));
        return from_json(ddo::python::preset_info_json(info));
      },
      py::arg("name"));
  m.def(
      "apply_preset",
      [](const std::string& name, py::handle base) {
        ddo::core::DynamicOffloadConfig config =
            ddo::python::config_from(base.is_none() ? json(nullptr) : to_json(base, "config"));
        ddo::core::PresetInfo info;
        ddo::python::raise_status(ddo::core::apply_preset(name, &config, &info));
        return py::make_tuple(from_json(ddo::core::config_to_json(config)),
                              from_json(ddo::python::preset_info_json(info)));
      },
      py::arg("name"), py::arg("base") = py::none());

  // --- settings --------------------------------------------------------------------------------
  py::class_<ddo::core::DynamicOffloadSettings>(m, "Settings")
      .def_static("from_env", &ddo::python::settings_from_env, py::arg("preset") = py::none(),
                  py::arg("config") = py::none(), py::arg("overrides") = py::none(),
                  py::arg("env") = py::none(), py::arg("wsl") = py::none())
      .def("to_json",
           [](const ddo::core::DynamicOffloadSettings& s) { return from_json(s.to_json()); })
      .def("config_json",
           [](const ddo::core::DynamicOffloadSettings& s) {
             return from_json(ddo::core::config_to_json(s.config));
           })
      .def("policy_for",
           [](const ddo::core::DynamicOffloadSettings& s, const std::string& component) {
             return from_json(ddo::python::policy_json(s.policy_for(component)));
           })
      .def("available_ram_bytes", &ddo::core::DynamicOffloadSettings::available_ram_bytes)
      .def("total_ram_bytes", &ddo::core::DynamicOffloadSettings::total_ram_bytes);
  m.def("component_env_key", [](const std::string& c) { return ddo::core::component_env_key(c); });

  // --- named profiles --------------------------------------------------------------------------
  m.def(
      "profile_dir",
      [](py::handle env) {
        ddo::core::EnvMap e = env.is_none() ? ddo::core::process_env()
                                            : env.cast<std::map<std::string, std::string>>();
        return ddo::core::resolve_profile_dir(e).string();
      },
      py::arg("env") = py::none(),
      "DDO_PROFILE_DIR when set, else ~/.ddo/profiles (the C++ store's rule).");
  m.def(
      "profile_key",
      [](const std::string& name, const std::string& model_class,
         const std::string& execution_mode) {
        return ddo::core::profile_key(ddo::python::identity_of(name, model_class, execution_mode));
      },
      py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime",
      "The capacity-file key of a named profile (the seed library's rule, in ddo_core).");
  m.def("profile_file_name",
        [](const std::string& key) { return ddo::core::profile_file_name(key); });
  m.def("recommend_resident_budget_gb", &ddo::core::recommend_resident_budget_gb,
        py::arg("total_gb"), py::arg("peak_gb"), py::arg("headroom_gb"));

  using ddo::core::ProfileStore;
  py::class_<ProfileStore>(m, "ProfileStore")
      .def(py::init([](const std::optional<std::string>& directory) {
             ddo::core::ProfileStoreOptions options;
             options.directory = ddo::python::profile_dir_from(directory);
             return ProfileStore(std::move(options));
           }),
           py::arg("directory") = py::none())
      .def_property_readonly("directory",
                             [](const ProfileStore& s) { return s.directory().string(); })
      .def(
          "path_for",
          [](const ProfileStore& s, const std::string& name, const std::string& model_class,
             const std::string& mode) {
            return s.path_for(ddo::python::identity_of(name, model_class, mode)).string();
          },
          py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime")
      .def(
          "load",
          [](const ProfileStore& s, const std::string& name, const std::string& model_class,
             const std::string& mode) {
            return ddo::python::record_or_none(
                s.load(ddo::python::identity_of(name, model_class, mode)));
          },
          py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime")
      .def("load_by_key",
           [](const ProfileStore& s, const std::string& key) {
             return ddo::python::record_or_none(s.load_by_key(key));
           })
      .def(
          "save",
          [](ProfileStore& s, const std::string& name, const std::string& model_class,
             py::handle observation, py::handle recommendation, const std::string& mode) {
            ddo::core::ProfileObservation obs;
            ddo::core::ProfileRecommendation rec;
            ddo::python::raise_status(ddo::core::ProfileObservation::from_json(
                to_json(observation, "observation"), &obs));
            ddo::python::raise_status(ddo::core::ProfileRecommendation::from_json(
                to_json(recommendation, "recommendation"), &rec));
            py::gil_scoped_release release;
            ddo::python::raise_status(
                s.save(ddo::python::identity_of(name, model_class, mode), obs, rec));
          },
          py::arg("name"), py::arg("model_class"), py::arg("observation"),
          py::arg("recommendation"), py::arg("execution_mode") = "linear_runtime")
      .def("list",
           [](const ProfileStore& s) {
             py::list out;
             for (const auto& listing : s.list()) out.append(from_json(listing.to_json()));
             return out;
           })
      .def(
          "remove",
          [](ProfileStore& s, const std::string& name, const std::string& model_class,
             const std::string& mode) {
            ddo::python::raise_status(s.remove(ddo::python::identity_of(name, model_class, mode)));
          },
          py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime")
      .def("remove_by_key", [](ProfileStore& s, const std::string& key) {
        ddo::python::raise_status(s.remove_by_key(key));
      });

  // --- legacy host contexts --------------------------------------------------------------------
  m.def(
      "normalize_context",
      [](py::handle context) {
        return from_json(ddo::core::normalize_context(to_json(context, "context")));
      },
      py::arg("context"));
  m.def(
      "context_key",
      [](py::handle context) { return ddo::core::context_key(to_json(context, "context")); },
      py::arg("context"));
  m.def(
      "context_path",
      [](const std::optional<std::string>& directory, py::handle context) {
        return ddo::core::context_path(ddo::python::profile_dir_from(directory),
                                       to_json(context, "context"))
            .string();
      },
      py::arg("directory"), py::arg("context"));

  using ddo::core::HostContextStore;
  py::class_<HostContextStore>(m, "HostContextStore")
      .def(py::init([](const std::optional<std::string>& directory) {
             ddo::core::HostContextStoreOptions options;
             options.directory = ddo::python::profile_dir_from(directory);
             return HostContextStore(std::move(options));
           }),
           py::arg("directory") = py::none())
      .def_property_readonly("directory",
                             [](const HostContextStore& s) { return s.directory().string(); })
      .def("path_for",
           [](const HostContextStore& s, py::handle context) {
             return s.path_for(to_json(context, "context")).string();
           })
      .def("load",
           [](const HostContextStore& s, py::handle context) {
             return ddo::python::context_record_or_none(s.load(to_json(context, "context")));
           })
      .def(
          "record_observation",
          [](HostContextStore& s, py::handle context, py::handle observation,
             py::handle recommendation) {
            json ctx = to_json(context, "context");
            json obs = to_json(observation, "observation");
            std::optional<json> rec;
            if (!recommendation.is_none()) rec = to_json(recommendation, "recommendation");
            py::gil_scoped_release release;
            ddo::python::raise_status(s.record_observation(ctx, obs, rec));
          },
          py::arg("context"), py::arg("observation"), py::arg("recommendation") = py::none())
      .def("read_capacity", [](const HostContextStore& s, py::handle context) {
        return from_json(ddo::core::limits_to_json(s.read_capacity(to_json(context, "context"))));
      });

  using ddo::core::DynamicOffloadProfileSession;
  py::class_<DynamicOffloadProfileSession>(m, "ProfileSession")
      .def(py::init([](const std::optional<std::string>& directory, py::handle execution_context,
                       py::handle capacity_context) {
             ddo::core::HostContextStoreOptions options;
             options.directory = ddo::python::profile_dir_from(directory);
             return DynamicOffloadProfileSession(HostContextStore(std::move(options)),
                                                 to_json(execution_context, "execution_context"),
                                                 to_json(capacity_context, "capacity_context"));
           }),
           py::arg("directory"), py::arg("execution_context"), py::arg("capacity_context"))
      .def_property_readonly(
          "execution_context",
          [](const DynamicOffloadProfileSession& s) { return from_json(s.execution_context()); })
      .def_property_readonly(
          "capacity_context",
          [](const DynamicOffloadProfileSession& s) { return from_json(s.capacity_context()); })
      .def_property_readonly("execution_key", &DynamicOffloadProfileSession::execution_key)
      .def_property_readonly("capacity_key", &DynamicOffloadProfileSession::capacity_key)
      .def_property_readonly(
          "execution_path",
          [](const DynamicOffloadProfileSession& s) { return s.execution_path().string(); })
      .def_property_readonly(
          "capacity_path",
          [](const DynamicOffloadProfileSession& s) { return s.capacity_path().string(); })
      .def(
          "record_success",
          [](DynamicOffloadProfileSession& s, py::handle observation, py::handle recommendation) {
            json obs = to_json(observation, "observation");
            std::optional<json> rec;
            if (!recommendation.is_none()) rec = to_json(recommendation, "recommendation");
            py::gil_scoped_release release;
            ddo::python::raise_status(s.record_success(obs, rec));
          },
          py::arg("observation"), py::arg("recommendation") = py::none())
      .def("execution_record",
           [](const DynamicOffloadProfileSession& s) {
             return ddo::python::context_record_or_none(s.execution_record());
           })
      .def("capacity_record", [](const DynamicOffloadProfileSession& s) {
        return ddo::python::context_record_or_none(s.capacity_record());
      });

  ddo::python::bind_offload(m);
  ddo::python::bind_jit(m);
}
