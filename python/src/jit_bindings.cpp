// ddo._C: enable_offload for TorchScript modules (torch.jit.trace / torch.jit.script
// / torch.jit.load in Python). Python's ddo.enable_offload routes a torch.jit.ScriptModule here
// instead of walking it as an nn.Module: its children are RecursiveScriptModules, not nn.Linear,
// so the Python walk would classify every module as "other" and stream nothing. The C++ path
// (ddo::adapter::enable_offload(const torch::jit::Module&), Note [TorchScript modules] in
// torch/src/jit_module.cpp) reads the TorchScript types instead, refuses frozen modules, and
// names the profile after the root's qualified type, exactly as a C++ program gets it:
//
//   traced = torch.jit.trace(model, example_kwarg_inputs=inputs)
//   offload = ddo._C.enable_offload_jit(traced, execution_device="sim", profile_name="flux")
//   ddo._C.jit_module_class_name(traced)  # "__torch__.diffusers.models...FluxTransformer2DModel"
//
// The Python object becomes a torch::jit::Module through torch's own pybind11 registration of
// torch._C.ScriptModule (torch/csrc/jit/python/module_python.h); ddo._C uses the pybind11 that
// torch bundles, so the two share pybind11's type registry. The Module shares its object with
// the Python one: ddo re-points the same parameter slots the interpreter reads.
#include <optional>
#include <string>

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/python/module_python.h>
#include <torch/csrc/utils/pybind.h>

#include "ddo/core/settings.h"
#include "ddo/engine/device.h"  // the Device holder type of the device= argument
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/module_tree.h"
#include "offload_setup.h"
#include "py_common.h"

namespace ddo::python {
namespace {

// A torch.jit.ScriptModule (the Python wrapper) or a torch._C.ScriptModule (its ._c).
torch::jit::Module jit_module_of(py::handle module) {
  if (std::optional<torch::jit::Module> m = torch::jit::as_module(module)) return *m;
  if (py::isinstance<torch::jit::Module>(module)) return module.cast<torch::jit::Module>();
  throw py::type_error(
      "expected a TorchScript module (torch.jit.ScriptModule from "
      "torch.jit.trace, torch.jit.script or torch.jit.load), not " +
      std::string(py::str(py::type::handle_of(module).attr("__qualname__"))) +
      "; pass an nn.Module to ddo.enable_offload instead");
}

}  // namespace

std::function<std::unique_ptr<adapter::Offload>(const adapter::OffloadOptions&)> jit_attach(
    py::handle module) {
  const torch::jit::Module jit = jit_module_of(module);
  return [jit](const adapter::OffloadOptions& o) { return adapter::enable_offload(jit, o); };
}

void bind_jit(py::module_& m) {
  m.def(
      "jit_module_class_name",
      [](py::handle module) { return adapter::module_class_name(jit_module_of(module)); },
      py::arg("module"),
      "The profile identity of a TorchScript module: its root's qualified type name without "
      "torch's ___torch_mangle_N atoms, as C++ reports it.");

  m.def(
      "enable_offload_jit",
      [](py::handle module, const std::optional<std::string>& preset,
         const std::string& profile_name, bool build_profile,
         const core::DynamicOffloadSettings* settings, py::object config, py::object overrides,
         const std::string& execution_device, py::object record_event, py::object env,
         std::shared_ptr<engine::Device> device, bool check_signals, const std::string& quantize) {
        const torch::jit::Module jit = jit_module_of(module);
        OffloadArgs args;
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
        args.quantize = quantize;
        // model_class stays "": the C++ path names the profile after the root's TorchScript type.
        adapter::OffloadOptions options = offload_options(args);
        return attach_with_events(options, args, [&](const adapter::OffloadOptions& o) {
          return adapter::enable_offload(jit, o);
        });
      },
      py::arg("module"), py::arg("preset") = py::none(), py::arg("profile_name") = "",
      py::arg("build_profile") = false, py::arg("settings") = nullptr,
      py::arg("config") = py::none(), py::arg("overrides") = py::none(),
      py::arg("execution_device") = "", py::arg("record_event") = py::none(),
      py::arg("env") = py::none(), py::arg("device") = nullptr, py::arg("check_signals") = true,
      py::arg("quantize") = "",
      "enable_offload_tree for a TorchScript module: the tree, kinds and class identity come from "
      "its TorchScript types (ddo::adapter::enable_offload(const torch::jit::Module&)); "
      "quantize= is OffloadOptions::quantize (its Linears served from quantized copies).");
}

}  // namespace ddo::python
