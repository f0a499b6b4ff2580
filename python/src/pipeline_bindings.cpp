// ddo._C: the pipeline router and the pipeline loop (ddo/torch/pipeline_offload.h,
// enable_pipeline_components in ddo/torch/enable_offload.h). ddo/diffusers.py gathers each
// component once, as ddo.api._enable does for one model (its module tree or TorchScript module,
// its kept modules, its progress callback), and makes one call: C++ resolves the settings with
// the overrides, routes, opens the shared device, attaches each component, restores those done
// when one fails, and returns the PipelineOffload that the Python PipelineOffloadResult views.
//
//   native = ddo._C.enable_pipeline_offload(
//       [{"name": "transformer", "model_class": "WanTransformer3DModel", "entries": [...],
//         "extra_skip_patterns": [], "keep_dense_modules": [], "record_event": progress}, ...],
//       profile_name="wan", build_profile=True, execution_device="sim")
//   native.component("transformer")  # its Offload, alive as long as the pipeline
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/utils/pybind.h>

#include "ddo/core/settings.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/pipeline_offload.h"
#include "ddo/torch/profile_run.h"
#include "offload_setup.h"
#include "py_common.h"

namespace ddo::python {
namespace {

using nlohmann::json;

// profile_component= as Python passes it: None or "" (the router's rule), a name, or a list.
std::vector<std::string> profile_components_from(py::handle value) {
  if (value.is_none()) return {};
  if (py::isinstance<py::str>(value)) {
    std::string name = value.cast<std::string>();
    return name.empty() ? std::vector<std::string>{} : std::vector<std::string>{std::move(name)};
  }
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    std::vector<std::string> names;
    for (py::handle item : value) {
      if (!py::isinstance<py::str>(item)) {
        throw py::type_error(
            "profile_component must be a component name or a list of names, "
            "not a list holding " +
            std::string(py::str(py::type::handle_of(item).attr("__name__"))));
      }
      names.push_back(item.cast<std::string>());
    }
    return names;
  }
  throw py::type_error("profile_component must be a component name or a list of names, not " +
                       std::string(py::str(py::type::handle_of(value).attr("__name__"))));
}

// One component as Python gathered it. Shared by its attach, which the loop runs with the GIL
// released, so the last reference (and the Python objects) goes in the binding, under the GIL.
struct ComponentSpec {
  std::string name;
  std::string model_class;  // "" for a TorchScript module: C++ names it after its type
  py::list entries;         // the module tree (ddo.api._gather), or empty for TorchScript
  py::object jit;           // None, or the TorchScript module
  std::vector<std::string> extra_skip_patterns;
  std::vector<std::string> keep_dense_modules;
  py::object record_event;  // its SetupProgress: start() before, close(failed) after
  bool check_signals = true;

  ~ComponentSpec() {
    if (!Py_IsInitialized()) {  // the interpreter is gone: leak rather than crash
      entries.release();
      jit.release();
      record_event.release();
      return;
    }
    py::gil_scoped_acquire gil;
    entries = py::list();
    jit = py::object();
    record_event = py::object();
  }

  // The component's attach (PipelineComponent::attach): what belongs to this component alone
  // (its kept modules, its model class) on top of the options the pipeline decided.
  std::unique_ptr<adapter::Offload> attach(const adapter::OffloadOptions& decided) {
    py::gil_scoped_acquire gil;
    adapter::OffloadOptions options = decided;
    options.extra_skip_patterns = extra_skip_patterns;
    options.keep_dense_modules = keep_dense_modules;
    if (!model_class.empty()) options.model_class = model_class;
    OffloadArgs args;
    args.record_event = record_event;
    args.check_signals = check_signals;
    if (py::hasattr(record_event, "start")) record_event.attr("start")();
    try {
      std::unique_ptr<adapter::Offload> offload;
      if (!jit.is_none()) {
        offload = attach_with_events(std::move(options), args, jit_attach(jit));
      } else {
        adapter::ModuleTree tree = tree_from(model_class, entries);
        offload =
            attach_with_events(std::move(options), args, [&](const adapter::OffloadOptions& o) {
              return adapter::enable_offload_tree(std::move(tree), o);
            });
      }
      if (py::hasattr(record_event, "close")) record_event.attr("close")();
      return offload;
    } catch (...) {
      if (py::hasattr(record_event, "close")) record_event.attr("close")(py::arg("failed") = true);
      throw;
    }
  }
};

std::shared_ptr<ComponentSpec> spec_from(py::handle item, bool check_signals) {
  auto d = item.cast<py::dict>();
  auto spec = std::make_shared<ComponentSpec>();
  spec->name = d["name"].cast<std::string>();
  spec->model_class = d.contains("model_class") ? d["model_class"].cast<std::string>() : "";
  if (d.contains("entries")) spec->entries = d["entries"].cast<py::list>();
  spec->jit = d.contains("jit") ? py::reinterpret_borrow<py::object>(d["jit"]) : py::none();
  if (d.contains("extra_skip_patterns")) {
    spec->extra_skip_patterns = d["extra_skip_patterns"].cast<std::vector<std::string>>();
  }
  if (d.contains("keep_dense_modules")) {
    spec->keep_dense_modules = d["keep_dense_modules"].cast<std::vector<std::string>>();
  }
  spec->record_event = d.contains("record_event")
                           ? py::reinterpret_borrow<py::object>(d["record_event"])
                           : py::none();
  spec->check_signals = check_signals;
  return spec;
}

void bind_router(py::module_& m) {
  m.def(
      "route_pipeline",
      [](const core::DynamicOffloadSettings& settings, const std::vector<std::string>& names,
         py::object profile_component, const std::string& execution_device) {
        const adapter::PipelineRouting routing = adapter::route_pipeline(
            settings, names, profile_components_from(profile_component), execution_device);
        json components = json::array();
        json profile_names = json::object();
        for (const adapter::PipelineRouting::Component& c : routing.components) {
          components.push_back({{"name", c.name}, {"route", core::to_string(c.route)}});
          if (c.profiled) profile_names[c.name] = c.profile_name;
        }
        py::dict out = from_json(
            {{"components", std::move(components)},
             {"profiled", routing.profiled.empty() ? std::string() : routing.profiled.front()},
             {"profiled_components", routing.profiled},
             {"profile_names", std::move(profile_names)},
             {"execution_device", routing.execution_device},
             {"open_device", routing.open_device}});
        py::list each;
        for (std::size_t i = 0; i < routing.components.size(); ++i) {
          each.append(py::cast(routing.settings_for(settings, i)));
        }
        out["settings"] = each;
        return out;
      },
      py::arg("settings"), py::arg("names"), py::arg("profile_component") = py::none(),
      py::arg("execution_device") = "",
      "{components: [{name, route}], profiled (the first profiled component, or ''), "
      "profiled_components, profile_names: {component: profile name}, execution_device, "
      "open_device, settings: [the Settings each component is attached with]} for a pipeline's "
      "components under `settings` (route_pipeline and PipelineRouting::settings_for in "
      "ddo/torch/pipeline_offload.h). profile_component: None, a name or a list of names.");
}

void bind_pipeline_offload(py::module_& m) {
  py::class_<adapter::PipelineOffload, std::unique_ptr<adapter::PipelineOffload>>(
      m, "PipelineOffload", "The offloads of a pipeline's components (PipelineOffload).")
      .def("component", &adapter::PipelineOffload::component, py::arg("name"),
           py::return_value_policy::reference_internal,
           "The component's Offload (alive as long as the pipeline), or None on the none route.")
      .def("component_names", &adapter::PipelineOffload::component_names)
      .def(
          "route_of",
          [](const adapter::PipelineOffload& p, const std::string& name) {
            return std::string(core::to_string(p.route_of(name)));
          },
          py::arg("name"))
      .def_property_readonly("profiled_components", &adapter::PipelineOffload::profiled_components)
      .def("profile_name_of", &adapter::PipelineOffload::profile_name_of, py::arg("name"))
      .def("remove",
           [](adapter::PipelineOffload& p) {
             py::gil_scoped_release release;
             p.remove();
           })
      .def(
          "profile_run",
          [](adapter::PipelineOffload& p) {
            std::unique_ptr<adapter::ProfileRun> run;
            {
              py::gil_scoped_release release;
              run = std::make_unique<adapter::ProfileRun>(p.profile_run());
            }
            return run;
          },
          py::keep_alive<0, 1>(),
          "One measured region over every profiled component (PipelineOffload::profile_run).")
      .def("report", [](const adapter::PipelineOffload& p) { return from_json(p.report()); })
      .def("summary", &adapter::PipelineOffload::summary);

  m.def(
      "enable_pipeline_offload",
      [](const py::list& components, const std::optional<std::string>& preset,
         const core::DynamicOffloadSettings* settings, py::object config, py::object overrides,
         const std::string& execution_device, py::object env, const std::string& profile_name,
         bool build_profile, py::object profile_component, bool check_signals) {
        OffloadArgs args;
        args.preset = preset;
        args.settings = settings;
        args.config = std::move(config);
        args.overrides = std::move(overrides);
        args.execution_device = execution_device;
        args.env = std::move(env);
        args.profile_name = profile_name;
        args.build_profile = build_profile;
        const adapter::OffloadOptions options = offload_options(args);
        const std::vector<std::string> profiled = profile_components_from(profile_component);
        // The specs outlive the loop here, so their Python objects go under the GIL.
        std::vector<std::shared_ptr<ComponentSpec>> specs;
        std::vector<adapter::PipelineComponent> native;
        for (py::handle item : components) {
          specs.push_back(spec_from(item, check_signals));
          std::shared_ptr<ComponentSpec> spec = specs.back();
          native.push_back({spec->name,
                            [spec](const adapter::OffloadOptions& o) { return spec->attach(o); },
                            nullptr});
        }
        std::unique_ptr<adapter::PipelineOffload> pipe;
        {
          py::gil_scoped_release release;
          pipe = adapter::enable_pipeline_components(std::move(native), options, profiled);
        }
        return pipe;
      },
      py::arg("components"), py::arg("preset") = py::none(), py::arg("settings") = nullptr,
      py::arg("config") = py::none(), py::arg("overrides") = py::none(),
      py::arg("execution_device") = "", py::arg("env") = py::none(), py::arg("profile_name") = "",
      py::arg("build_profile") = false, py::arg("profile_component") = py::none(),
      py::arg("check_signals") = true,
      "enable_pipeline_components over Python components: a list of dicts {name, model_class, "
      "entries (ddo.api._gather) or jit (a TorchScript module), extra_skip_patterns, "
      "keep_dense_modules, record_event}; the settings arguments as enable_offload_tree's.");
}

}  // namespace

void bind_pipeline(py::module_& m) {
  bind_router(m);
  bind_pipeline_offload(m);
}

}  // namespace ddo::python
