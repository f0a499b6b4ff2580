// ddo._C: the named-profile store (ddo/core/profile_store.h) and its keys, as ddo/profiles.py
// and `ddo profiles` use them: one store implementation, in ddo_core.
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ddo/core/calibration.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/settings.h"
#include "py_common.h"

namespace ddo::python {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

core::ProfileIdentity identity_of(const std::string& name, const std::string& model_class,
                                  const std::string& execution_mode) {
  return core::ProfileIdentity{name, model_class, execution_mode};
}

py::object record_or_none(const std::optional<core::ProfileRecord>& record) {
  if (!record) return py::none();
  return from_json(record->to_json());
}

}  // namespace

fs::path profile_dir_from(const std::optional<std::string>& directory) {
  if (directory && !directory->empty()) return fs::path(*directory);
  return core::resolve_profile_dir(core::process_env());
}

void bind_profiles(py::module_& m) {
  // --- named profiles --------------------------------------------------------------------------
  m.def(
      "profile_dir",
      [](py::handle env) {
        core::EnvMap e =
            env.is_none() ? core::process_env() : env.cast<std::map<std::string, std::string>>();
        return core::resolve_profile_dir(e).string();
      },
      py::arg("env") = py::none(),
      "DDO_PROFILE_DIR when set, else ~/.ddo/profiles (the C++ store's rule).");
  m.def(
      "profile_key",
      [](const std::string& name, const std::string& model_class,
         const std::string& execution_mode) {
        return core::profile_key(identity_of(name, model_class, execution_mode));
      },
      py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime",
      "The capacity-file key of a named profile (diffusers-dynamic-offloader's rule, in "
      "ddo_core).");
  m.def("profile_file_name", [](const std::string& key) { return core::profile_file_name(key); });
  m.def("recommend_resident_budget_gb", &core::recommend_resident_budget_gb, py::arg("total_gb"),
        py::arg("peak_gb"), py::arg("headroom_gb"));

  using core::ProfileStore;
  py::class_<ProfileStore>(m, "ProfileStore")
      .def(py::init([](const std::optional<std::string>& directory) {
             core::ProfileStoreOptions options;
             options.directory = profile_dir_from(directory);
             return ProfileStore(std::move(options));
           }),
           py::arg("directory") = py::none())
      .def_property_readonly("directory",
                             [](const ProfileStore& s) { return s.directory().string(); })
      .def(
          "path_for",
          [](const ProfileStore& s, const std::string& name, const std::string& model_class,
             const std::string& mode) {
            return s.path_for(identity_of(name, model_class, mode)).string();
          },
          py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime")
      .def(
          "load",
          [](const ProfileStore& s, const std::string& name, const std::string& model_class,
             const std::string& mode) {
            return record_or_none(s.load(identity_of(name, model_class, mode)));
          },
          py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime")
      .def("load_by_key", [](const ProfileStore& s,
                             const std::string& key) { return record_or_none(s.load_by_key(key)); })
      .def(
          "save",
          [](ProfileStore& s, const std::string& name, const std::string& model_class,
             py::handle observation, py::handle recommendation, const std::string& mode) {
            core::ProfileObservation obs;
            core::ProfileRecommendation rec;
            raise_status(
                core::ProfileObservation::from_json(to_json(observation, "observation"), &obs));
            raise_status(core::ProfileRecommendation::from_json(
                to_json(recommendation, "recommendation"), &rec));
            py::gil_scoped_release release;
            raise_status(s.save(identity_of(name, model_class, mode), obs, rec));
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
            raise_status(s.remove(identity_of(name, model_class, mode)));
          },
          py::arg("name"), py::arg("model_class"), py::arg("execution_mode") = "linear_runtime")
      .def("remove_by_key",
           [](ProfileStore& s, const std::string& key) { raise_status(s.remove_by_key(key)); });
}

}  // namespace ddo::python
