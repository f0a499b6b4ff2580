// ddo._C: diffusers-dynamic-offloader's legacy host-context store (ddo/core/host_context.h), behind
// ddo/legacy.py. Named profiles (profile_bindings.cpp) do not need any of this.
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ddo/core/host_context.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/settings.h"
#include "py_common.h"

namespace ddo::python {

using nlohmann::json;

namespace {

py::object context_record_or_none(const std::optional<core::ContextRecord>& record) {
  if (!record) return py::none();
  return from_json(record->to_json());
}

}  // namespace

void bind_legacy(py::module_& m) {
  // --- legacy host contexts --------------------------------------------------------------------
  m.def(
      "normalize_context",
      [](py::handle context) {
        return from_json(core::normalize_context(to_json(context, "context")));
      },
      py::arg("context"));
  m.def(
      "context_key",
      [](py::handle context) { return core::context_key(to_json(context, "context")); },
      py::arg("context"));
  m.def(
      "context_path",
      [](const std::optional<std::string>& directory, py::handle context) {
        return core::context_path(profile_dir_from(directory), to_json(context, "context"))
            .string();
      },
      py::arg("directory"), py::arg("context"));

  using core::HostContextStore;
  py::class_<HostContextStore>(m, "HostContextStore")
      .def(py::init([](const std::optional<std::string>& directory) {
             core::HostContextStoreOptions options;
             options.directory = profile_dir_from(directory);
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
             return context_record_or_none(s.load(to_json(context, "context")));
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
            raise_status(s.record_observation(ctx, obs, rec));
          },
          py::arg("context"), py::arg("observation"), py::arg("recommendation") = py::none())
      .def("read_capacity", [](const HostContextStore& s, py::handle context) {
        return from_json(core::limits_to_json(s.read_capacity(to_json(context, "context"))));
      });

  using core::DynamicOffloadProfileSession;
  py::class_<DynamicOffloadProfileSession>(m, "ProfileSession")
      .def(py::init([](const std::optional<std::string>& directory, py::handle execution_context,
                       py::handle capacity_context) {
             core::HostContextStoreOptions options;
             options.directory = profile_dir_from(directory);
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
            raise_status(s.record_success(obs, rec));
          },
          py::arg("observation"), py::arg("recommendation") = py::none())
      .def(
          "apply_settings",
          [](const DynamicOffloadProfileSession& s, const core::DynamicOffloadSettings& settings,
             bool allow_recommendation) {
            DynamicOffloadProfileSession::AppliedSettings applied =
                s.apply_settings(settings, allow_recommendation);
            return py::make_tuple(
                std::move(applied.settings),
                applied.recommendation ? from_json(*applied.recommendation) : py::none());
          },
          py::arg("settings"), py::arg("allow_recommendation"))
      .def("execution_record",
           [](const DynamicOffloadProfileSession& s) {
             return context_record_or_none(s.execution_record());
           })
      .def("capacity_record", [](const DynamicOffloadProfileSession& s) {
        return context_record_or_none(s.capacity_record());
      });
}

}  // namespace ddo::python
