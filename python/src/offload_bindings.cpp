// ddo._C: enable_offload over a Python module tree, the Offload handle and its reports, its
// measured region. Python (ddo/api.py) walks nn.Module.named_modules() once and passes plain tuples
// plus the model's own tensors; torch's type caster hands those tensors over as at::Tensor without
// copies, and ddo_torch re-points them in place (set_data), so the Python Parameters stay the same
// objects and no Python code runs per op.
//
// Note [GIL and interrupts during setup]
// Setup can take minutes (pinning tens of GiB), so it runs with the GIL released. ddo_torch
// reports each setup phase through OffloadOptions::record_event; the binding's callback takes the
// GIL, checks for signals (Ctrl-C) and forwards the event to the host's record_event. A pending
// KeyboardInterrupt (or an exception from the host's callback) is raised from inside the
// callback while a phase can still be undone: ddo_torch restores every tensor it replaced when a
// phase throws, so the model is usable afterwards. The final "setup" event comes after placement,
// where ddo_torch no longer rolls back; an interrupt seen there is held, the finished offload is
// removed (restoring the model), and then the interrupt is raised.
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "ddo/core/inventory.h"
#include "ddo/core/settings.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/generation.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/loader.h"
#include "ddo/torch/module_tree.h"
#include "ddo/torch/profile_run.h"
#include "ddo/torch/weight_cache.h"
#include "offload_setup.h"
#include "py_common.h"

namespace ddo::python {
namespace {

using nlohmann::json;

// The setup-event callback of Note [GIL and interrupts during setup]. Shared with the callback
// that ddo_torch keeps inside the Offload; the Python callable is dropped under the GIL.
struct SetupEvents {
  py::object host_callback;     // None or callable(name, seconds, payload)
  std::exception_ptr deferred;  // an interrupt or host error seen at the final event
  bool check_signals = true;

  ~SetupEvents() {
    if (!Py_IsInitialized()) {
      host_callback.release();  // the interpreter is gone: leak rather than crash
      return;
    }
    py::gil_scoped_acquire gil;
    host_callback = py::object();
    deferred = nullptr;
  }

  static adapter::RecordEvent callback(const std::shared_ptr<SetupEvents>& events) {
    return [events](const std::string& name, double seconds, const json& payload) {
      py::gil_scoped_acquire gil;
      const bool final_event = name == "setup";
      try {
        if (events->check_signals && PyErr_CheckSignals() != 0) throw py::error_already_set();
        if (events->host_callback && !events->host_callback.is_none()) {
          events->host_callback(name, seconds, from_json(payload));
        }
      } catch (py::error_already_set&) {
        if (!final_event) throw;
        if (!events->deferred) events->deferred = std::current_exception();
      }
    };
  }
};

// LoadOptions from the Python loader's dict.
adapter::LoadOptions load_options(const py::handle& load) {
  auto d = load.cast<py::dict>();
  adapter::LoadOptions options;
  options.path = d["path"].cast<std::string>();
  if (d.contains("read_workers")) options.read_workers = d["read_workers"].cast<int>();
  if (d.contains("allow_unexpected_keys")) {
    options.allow_unexpected_keys = d["allow_unexpected_keys"].cast<bool>();
  }
  return options;
}

// A Python nn.Module's tree (and, with `load`, its checkpoint) attached through the shared path.
std::unique_ptr<adapter::Offload> enable(const OffloadArgs& args) {
  adapter::OffloadOptions options = offload_options(args);
  adapter::ModuleTree tree = tree_from(args.model_class, args.entries);
  if (!args.load.is_none()) {
    // The C++ loader's own entry: it opens the files (headers, keys) and attaches, and checks
    // what the attach holds against host_ram_cap_gb (Note [Dense weights under the host cap]).
    const adapter::LoadOptions load = load_options(args.load);
    return attach_with_events(std::move(options), args, [&](const adapter::OffloadOptions& o) {
      return adapter::load_with_offload(std::move(tree), load, o);
    });
  }
  return attach_with_events(std::move(options), args, [&](const adapter::OffloadOptions& o) {
    return adapter::enable_offload_tree(std::move(tree), o);
  });
}

}  // namespace

// The tree from Python's tuples (offload_setup.h): (name, class_name, kind, is_leaf, training,
// [(tensor_name, tensor, is_parameter), ...], stock_class, sdnq_layout) in named_modules() order
// (ModuleEntry: stock_class is `type(m) is nn.Linear` for a Linear, sdnq_layout an SDNQ layer's
// layout code or None).
adapter::ModuleTree tree_from(const std::string& model_class, const py::list& entries) {
  adapter::ModuleTree tree;
  tree.model_class = model_class;
  tree.entries.reserve(entries.size());
  for (py::handle item : entries) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 8) throw py::type_error("module entries are 8-tuples (ddo.api._gather)");
    adapter::ModuleEntry entry;
    entry.name = t[0].cast<std::string>();
    entry.class_name = t[1].cast<std::string>();
    raise_status(core::parse_module_kind(t[2].cast<std::string>(), &entry.kind));
    entry.is_leaf = t[3].cast<bool>();
    entry.training = t[4].cast<bool>();
    entry.stock_class = t[6].cast<bool>();
    if (!t[7].is_none()) entry.sdnq_layout = t[7].cast<std::vector<std::int64_t>>();
    for (py::handle slot_item : t[5].cast<py::list>()) {
      auto slot = slot_item.cast<py::tuple>();
      adapter::TensorSlot tensor_slot;
      tensor_slot.name = slot[0].cast<std::string>();
      tensor_slot.tensor = slot[1].cast<at::Tensor>();  // shares the TensorImpl: no copy
      tensor_slot.is_parameter = slot[2].cast<bool>();
      if (tensor_slot.tensor.defined()) entry.tensors.push_back(std::move(tensor_slot));
    }
    tree.entries.push_back(std::move(entry));
  }
  return tree;
}

adapter::OffloadOptions offload_options(const OffloadArgs& args) {
  adapter::OffloadOptions options;
  options.preset = args.preset;
  options.profile_name = args.profile_name;
  options.build_profile = args.build_profile;
  if (args.settings != nullptr) options.settings = *args.settings;
  if (!args.config.is_none()) options.config = config_from(to_json(args.config, "config"));
  if (!args.overrides.is_none()) {
    options.overrides = to_json(args.overrides, "overrides");
    check_override_names(options.overrides);
  }
  options.execution_device = args.execution_device;
  options.extra_skip_patterns = args.extra_skip_patterns;
  options.model_class = args.model_class;
  if (!args.env.is_none()) {
    auto env = args.env.cast<std::map<std::string, std::string>>();
    options.env = core::EnvMap(env.begin(), env.end());
  }
  options.device = args.device;
  options.quantize = args.quantize;
  options.keep_dense_modules = args.keep_dense_modules;
  return options;
}

std::unique_ptr<adapter::Offload> attach_with_events(
    adapter::OffloadOptions options, const OffloadArgs& args,
    const std::function<std::unique_ptr<adapter::Offload>(const adapter::OffloadOptions&)>&
        attach) {
  auto events = std::make_shared<SetupEvents>();
  events->host_callback = args.record_event;
  events->check_signals = args.check_signals;
  options.record_event = SetupEvents::callback(events);
  std::unique_ptr<adapter::Offload> offload;
  // The attach's warnings (TORCH_WARN: e.g. a preset's budget that disables a named profile)
  // become Python UserWarnings when this returns, as torch's own bindings do.
  torch::PyWarningHandler warnings;
  try {
    py::gil_scoped_release release;
    offload = attach(options);
  } catch (...) {
    warnings.set_in_exception();
    throw;
  }
  if (events->deferred) {
    std::exception_ptr deferred = std::exchange(events->deferred, nullptr);
    {
      py::gil_scoped_release release;
      offload->remove();
    }
    offload.reset();
    std::rethrow_exception(deferred);
  }
  return offload;
}

namespace {

// The execution device a pipeline's components share.
void bind_device(py::module_& m) {
  py::class_<engine::Device, std::shared_ptr<engine::Device>>(
      m, "Device", "An execution device shared by the components of a pipeline (opaque).");

  m.def(
      "open_execution_device",
      [](const std::string& execution_device, py::handle config) {
        return adapter::open_execution_device(execution_device,
                                              config_from(to_json(config, "config")));
      },
      py::arg("execution_device"), py::arg("config") = py::none());
}

void bind_caches(py::module_& m) {
  // The process-lifetime caches (ddo/torch/weight_cache.h).
  m.def("pinned_weight_cache_stats",
        [] { return from_json(adapter::pinned_weight_cache_stats().to_json()); });
  m.def(
      "clear_pinned_weight_cache",
      [](const std::optional<std::string>& ns) {
        py::gil_scoped_release release;
        return adapter::clear_pinned_weight_cache(ns);
      },
      py::arg("namespace") = py::none());
  m.def("plan_cache_stats", [] { return from_json(adapter::plan_cache_stats().to_json()); });
  m.def("clear_plan_cache", &adapter::clear_plan_cache);
}

// The measured region (ddo/torch/profile_run.h).
void bind_profile_run(py::module_& m) {
  py::class_<adapter::ProfileRun, std::unique_ptr<adapter::ProfileRun>>(m, "ProfileRun")
      .def(
          "finish",
          [](adapter::ProfileRun& run) {
            json report;
            {
              py::gil_scoped_release release;
              report = run.finish();
            }
            return from_json(report);
          },
          "Ends the region normally: measures and saves (calibration, probe). Returns the report.")
      .def(
          "abort",
          [](adapter::ProfileRun& run) {
            json report;
            {
              py::gil_scoped_release release;
              report = run.abort();
            }
            return from_json(report);
          },
          "Ends the region without saving; the stored profile is untouched.")
      .def(
          "abort_out_of_memory",
          [](adapter::ProfileRun& run) {
            json report;
            {
              py::gil_scoped_release release;
              report = run.abort_out_of_memory();
            }
            return from_json(report);
          },
          "abort() after the device ran out of memory inside the region; a reused profile's "
          "report then has an 'error' saying to calibrate this workload.")
      .def("report", [](const adapter::ProfileRun& run) { return from_json(run.report()); })
      .def_property_readonly("active", &adapter::ProfileRun::active);
}

void bind_generation_meter(py::module_& m) {
  // One generation's report (ddo/torch/generation.h); ddo/diffusers.py times each component's
  // forward as a stage.
  py::class_<adapter::GenerationMeter>(m, "GenerationMeter")
      .def(py::init([](const py::list& offloads, const std::string& cuda_device) {
             std::vector<std::pair<std::string, const adapter::Offload*>> items;
             for (const py::handle& item : offloads) {
               const auto pair = item.cast<py::tuple>();
               const py::object offload = pair[1];
               items.emplace_back(pair[0].cast<std::string>(),
                                  offload.is_none() ? nullptr : offload.cast<adapter::Offload*>());
             }
             return std::make_unique<adapter::GenerationMeter>(items, cuda_device);
           }),
           py::arg("offloads"), py::arg("cuda_device") = "", py::keep_alive<1, 2>(),
           "Starts metering a generation over [(component name, Offload or None)]; "
           "cuda_device ('cuda:N') measures VRAM there when ddo places no component.")
      .def(
          "add_offload",
          [](adapter::GenerationMeter& g, const std::string& name, adapter::Offload* offload) {
            g.add_offload(name, offload);
          },
          py::arg("name"), py::arg("offload"), py::keep_alive<1, 3>(),
          "Meters this Offload too, as component `name` (a staged flow's next stage).")
      .def("drop_offload", &adapter::GenerationMeter::drop_offload, py::arg("name"),
           "Keeps what component `name` streamed so far and stops reading it (before remove()).")
      .def(
          "begin_stage",
          [](adapter::GenerationMeter& g, const std::string& name) {
            py::gil_scoped_release release;
            g.begin_stage(name);
          },
          py::arg("name"))
      .def(
          "end_stage",
          [](adapter::GenerationMeter& g, const std::string& name) {
            py::gil_scoped_release release;
            g.end_stage(name);
          },
          py::arg("name"))
      .def(
          "finish",
          [](adapter::GenerationMeter& g) {
            nlohmann::json report;
            {
              py::gil_scoped_release release;
              report = g.finish();
            }
            return from_json(report);
          },
          "Ends the generation; returns its report (dict).");
}

// The handle of one model's offload, and the attach that makes it.
void bind_offload_handle(py::module_& m) {
  py::class_<adapter::Offload, std::unique_ptr<adapter::Offload>>(m, "Offload")
      .def(
          "remove",
          [](adapter::Offload& o, bool clear_weight_cache, bool keep_residents) {
            py::gil_scoped_release release;
            o.remove({.clear_weight_cache = clear_weight_cache,
                      .keep_residents_on_device = keep_residents});
          },
          py::arg("clear_weight_cache") = false, py::arg("keep_residents") = false,
          "Restores the model: ordinary tensors on their original devices. Idempotent. With "
          "cache_pinned_weights the streamed weights stay in the pinned-weight cache (and the "
          "model points at them) unless clear_weight_cache is true.")
      .def_property_readonly("active", &adapter::Offload::active)
      .def("profile_run",
           [](adapter::Offload& o) {
             std::unique_ptr<adapter::ProfileRun> run;
             {
               py::gil_scoped_release release;
               run = std::make_unique<adapter::ProfileRun>(o.profile_run());
             }
             return run;
           })
      .def("profile_report",
           [](const adapter::Offload& o) { return from_json(o.profile_report()); })
      .def("report", [](const adapter::Offload& o) { return from_json(o.report()); })
      .def("summary", &adapter::Offload::summary)
      .def("plan", [](const adapter::Offload& o) { return from_json(o.plan().to_json()); })
      .def("settings", [](const adapter::Offload& o) { return o.settings(); })
      .def("device", &adapter::Offload::device)
      .def("reset_run_stats", &adapter::Offload::reset_run_stats)
      .def(
          "counters",
          [](const adapter::Offload& o) {
            const adapter::Offload::Counters c = o.counters();
            py::dict out;
            out["bytes_streamed"] = c.bytes_streamed;
            out["disk_bytes_read"] = c.disk_bytes_read;
            out["file_bytes_read"] = c.file_bytes_read;
            return out;
          },
          "The running totals (Offload::counters): bytes_streamed, disk_bytes_read, "
          "file_bytes_read; after remove(), the totals the run ended with.");

  m.def(
      "enable_offload_tree",
      [](const std::string& model_class, const py::list& entries,
         const std::optional<std::string>& preset, const std::string& profile_name,
         bool build_profile, const core::DynamicOffloadSettings* settings, py::object config,
         py::object overrides, const std::string& execution_device, py::object record_event,
         py::object env, std::shared_ptr<engine::Device> device, bool check_signals,
         py::object load, std::vector<std::string> extra_skip_patterns, const std::string& quantize,
         std::vector<std::string> keep_dense_modules) {
        OffloadArgs args;
        args.quantize = quantize;
        args.keep_dense_modules = std::move(keep_dense_modules);
        args.extra_skip_patterns = std::move(extra_skip_patterns);
        args.model_class = model_class;
        args.entries = entries;
        args.preset = preset;
        args.profile_name = profile_name;
        args.build_profile = build_profile;
        args.settings = settings;
        args.config = std::move(config);
        args.overrides = std::move(overrides);
        args.execution_device = execution_device;
        args.record_event = std::move(record_event);
        args.env = std::move(env);
        args.device = std::move(device);
        args.check_signals = check_signals;
        args.load = std::move(load);
        return enable(args);
      },
      py::arg("model_class"), py::arg("entries"), py::arg("preset") = py::none(),
      py::arg("profile_name") = "", py::arg("build_profile") = false, py::arg("settings") = nullptr,
      py::arg("config") = py::none(), py::arg("overrides") = py::none(),
      py::arg("execution_device") = "", py::arg("record_event") = py::none(),
      py::arg("env") = py::none(), py::arg("device") = nullptr, py::arg("check_signals") = true,
      py::arg("load") = py::none(), py::arg("extra_skip_patterns") = std::vector<std::string>{},
      py::arg("quantize") = "", py::arg("keep_dense_modules") = std::vector<std::string>{},
      "enable_offload over a Python module tree (ddo.api._gather); quantize= is "
      "OffloadOptions::quantize (its stock Linears served from quantized copies, the modules "
      "unchanged), keep_dense_modules its OffloadOptions::keep_dense_modules "
      "(_keep_in_fp32_modules).");
}

void bind_loader(py::module_& m) {
  // The loader (ddo/torch/loader.h).
  m.def(
      "placeholder_like",
      [](const at::Tensor& like) {
        return adapter::make_placeholder(like.sizes(), like.scalar_type());
      },
      py::arg("like"),
      "A CPU tensor of like's shape and dtype that takes no memory (Note [Placeholders]).");
  m.def("is_placeholder", &adapter::is_placeholder, py::arg("tensor"));
  m.def(
      "checkpoint_meta",
      [](const std::string& path) {
        std::map<std::string, at::Tensor> tensors;
        {
          py::gil_scoped_release release;
          tensors = adapter::checkpoint_meta_tensors(path);
        }
        return tensors;
      },
      py::arg("path"),
      "The checkpoint's tensors as meta tensors of their stored shapes and dtypes, by name "
      "(headers only, validated as the loader validates them).");
  m.def(
      "load_weights_for_offload",
      [](const std::string& model_class, const py::list& entries, py::dict load,
         std::optional<std::string> preset, const core::DynamicOffloadSettings* settings,
         py::object config, const std::string& execution_device, py::object record_event) {
        OffloadArgs args;
        args.model_class = model_class;
        args.preset = preset;
        args.settings = settings;
        args.config = std::move(config);
        args.execution_device = execution_device;
        args.overrides = py::none();
        args.env = py::none();
        const adapter::OffloadOptions options = offload_options(args);
        adapter::ModuleTree tree = tree_from(model_class, entries);
        const adapter::LoadOptions load_opts = load_options(load);
        auto events = std::make_shared<SetupEvents>();
        events->host_callback = std::move(record_event);
        const adapter::RecordEvent callback = SetupEvents::callback(events);
        nlohmann::json report;
        {
          py::gil_scoped_release release;
          report = adapter::load_weights_for_offload(tree, load_opts, options, callback);
        }
        return from_json(report);
      },
      py::arg("model_class"), py::arg("entries"), py::arg("load"), py::arg("preset") = py::none(),
      py::arg("settings") = nullptr, py::arg("config") = py::none(),
      py::arg("execution_device") = "", py::arg("record_event") = py::none(),
      "The deferred load: every tensor the files hold into pinned host memory for the execution "
      "device the settings name (Note [Loader pins]); returns what was pinned.");

  m.def("is_managed", &adapter::is_managed, py::arg("tensor"),
        "True when the tensor is a streamed weight of an active offload.");
  m.def("interception_active", &adapter::interception_active);
}

}  // namespace

void bind_offload(py::module_& m) {
  bind_device(m);
  bind_caches(m);
  bind_profile_run(m);
  bind_generation_meter(m);
  bind_offload_handle(m);
  bind_loader(m);
}

}  // namespace ddo::python
