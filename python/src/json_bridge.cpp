// ddo._C's JSON bridge (py_common.h): plain Python values <-> nlohmann::json, the check that
// names unknown config fields, and a config from a field dict. Every binding crosses values
// through these, so the rules for what is JSON-safe and how overrides are checked live here once.
#include <cstdint>
#include <set>
#include <string>

#include <pybind11/pybind11.h>

#include "ddo/core/config.h"
#include "py_common.h"

namespace ddo::python {

using nlohmann::json;

namespace {

std::string type_name(py::handle value) {
  return py::str(py::type::handle_of(value).attr("__qualname__")).cast<std::string>();
}

}  // namespace

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

core::DynamicOffloadConfig config_from(const json& fields) {
  core::DynamicOffloadConfig config;
  if (!fields.is_null()) {
    check_override_names(fields);
    raise_status(core::apply_overrides(&config, fields));
  }
  return config;
}

}  // namespace ddo::python
