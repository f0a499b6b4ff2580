// Shared by offload_bindings.cpp (a Python nn.Module's tree) and jit_bindings.cpp (a TorchScript
// module): the binding's arguments as OffloadOptions, and the attach itself with the GIL released
// and the setup-event callback of Note [GIL and interrupts during setup]. The two entry points
// differ only in where the module tree comes from, so everything else is written once here:
//
//   OffloadArgs args = ...;                        // from the binding's keyword arguments
//   adapter::OffloadOptions options = offload_options(args);
//   std::unique_ptr<adapter::Offload> offload = attach_with_events(
//       std::move(options), args,
//       [&](const adapter::OffloadOptions& o) { return adapter::enable_offload(module, o); });
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "ddo/core/settings.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/module_tree.h"

namespace ddo::python {

namespace py = pybind11;

// What both enable bindings take from Python besides the module.
struct OffloadArgs {
  std::vector<std::string> extra_skip_patterns;  ///< OffloadOptions::extra_skip_patterns
  std::string model_class;            // "" = the tree's own (the C++ class name of the root)
  py::list entries;                   // the Python tree (offload_bindings.cpp only)
  std::optional<std::string> preset;  // None: DDO_PRESET, else auto
  std::string profile_name;
  bool build_profile = false;
  const core::DynamicOffloadSettings* settings = nullptr;
  py::object config;  // None or a field dict
  py::object overrides;
  std::string execution_device;
  py::object record_event;
  py::object env;  // None or dict[str, str]
  std::shared_ptr<engine::Device> device;
  bool check_signals = true;
  py::object load;       // None or {"path", "read_workers", "allow_unexpected_keys"} (loader.h)
  std::string quantize;  ///< OffloadOptions::quantize
  std::vector<std::string> keep_dense_modules;  ///< OffloadOptions::keep_dense_modules
};

// The options of `args` (settings, config, overrides, environment, device); needs the GIL.
// Unknown field names are a TypeError (check_override_names).
adapter::OffloadOptions offload_options(const OffloadArgs& args);

// Builds an Offload with `attach`, which runs with the GIL released and receives `options` with
// the setup-event callback installed; a Ctrl-C or an error of the host's record_event raised at
// the final event removes the finished offload and is rethrown (Note [GIL and interrupts during
// setup], offload_bindings.cpp).
std::unique_ptr<adapter::Offload> attach_with_events(
    adapter::OffloadOptions options, const OffloadArgs& args,
    const std::function<std::unique_ptr<adapter::Offload>(const adapter::OffloadOptions&)>& attach);

// The module tree from Python's 8-tuples (ddo.api._gather), sharing the model's tensors;
// needs the GIL (offload_bindings.cpp).
adapter::ModuleTree tree_from(const std::string& model_class, const py::list& entries);

// The attach of a TorchScript module (a torch.jit.ScriptModule or its ._c; jit_bindings.cpp):
// enable_offload over its torch::jit::Module, which shares the Python object's slots. Resolving
// the object needs the GIL; the returned attach does not.
std::function<std::unique_ptr<adapter::Offload>(const adapter::OffloadOptions&)> jit_attach(
    py::handle module);

}  // namespace ddo::python
