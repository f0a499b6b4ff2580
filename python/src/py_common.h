// Shared by the translation units of ddo._C: the JSON bridge and the error table.
//
// The binding is thin: values cross as JSON (nlohmann::json <-> plain Python objects), tensors
// cross as at::Tensor through torch's own type caster (offload_bindings.cpp), and every
// ddo::Error and c10::Error becomes the Python exception of one table, applied by one translator
// (errors.cpp):
//
//   kInvalidArgument, kDataLoss                  -> ValueError
//   kFailedPrecondition, kUnavailable, kInternal -> RuntimeError
//   kNotFound                                    -> ddo.NotFoundError (a FileNotFoundError and a
//                                                   KeyError)
//   kResourceExhausted, c10::OutOfMemoryError    -> torch.OutOfMemoryError (Note [A full device
//                                                   is torch.OutOfMemoryError] in errors.cpp)
//   c10::ValueError, TypeError, IndexError,
//   NotImplementedError                          -> the Python class of that name, as torch does
//   other c10::Error (a failed TORCH_CHECK)      -> RuntimeError, without the C++ backtrace
//
// Unknown keyword overrides are a TypeError (the C++ message lists them): see
// check_override_names.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>

#include "ddo/core/config.h"
#include "ddo/core/status.h"

namespace ddo::python {

namespace py = pybind11;

// A plain Python value (None, bool, int, float, str, list/tuple, dict with str keys, and
// os.PathLike as its string) as JSON. Anything else is a TypeError naming its type and where it
// sits ("context['size'][1]").
nlohmann::json to_json(py::handle value, const std::string& where = "value");

// JSON as plain Python objects (dict, list, str, int, float, bool, None).
py::object from_json(const nlohmann::json& value);

// A DynamicOffloadConfig from a (possibly partial) field dict over the defaults (null: the
// defaults); unknown names are a TypeError (check_override_names), bad values a ValueError.
core::DynamicOffloadConfig config_from(const nlohmann::json& fields);

// A store directory argument: the given one, else DDO_PROFILE_DIR, else ~/.ddo/profiles
// (profile_bindings.cpp).
std::filesystem::path profile_dir_from(const std::optional<std::string>& directory);

// Throws `status` as a ddo::Error, which the translator raises as the Python exception of the
// error table (no-op when ok).
void raise_status(const Status& status);

// The Python exception class of `code` in the error table (errors.cpp); valid once bind_errors
// ran.
PyObject* exception_for(Code code);

// Registers ddo.NotFoundError, the module's one exception translator and its test hooks
// (errors.cpp); first, before any binding can throw.
void bind_errors(py::module_& m);

// TypeError when `overrides` (a JSON object) names fields DynamicOffloadConfig does not have;
// the message is core's apply_overrides message, which lists them with suggestions.
void check_override_names(const nlohmann::json& overrides);

// The bound areas of ddo._C, one file each (bindings.cpp puts them together).
void bind_config(py::module_& m);    // config_bindings.cpp: config fields, presets, settings
void bind_profiles(py::module_& m);  // profile_bindings.cpp: the named-profile store
void bind_legacy(py::module_& m);    // legacy_bindings.cpp: the legacy host-context store

// Registers the offload part of the module (offload_bindings.cpp).
void bind_offload(py::module_& m);

// Registers enable_offload for TorchScript modules (jit_bindings.cpp); after bind_offload, whose
// Offload class it returns.
void bind_jit(py::module_& m);

// Registers the pipeline router and loop (pipeline_bindings.cpp); after bind_offload, whose
// Offload and ProfileRun classes it returns.
void bind_pipeline(py::module_& m);

// Registers the SDNQ metadata functions (sdnq_bindings.cpp: Note [Metadata through _C]).
void bind_sdnq(py::module_& m);

}  // namespace ddo::python
