// Shared by the translation units of ddo._C: the JSON bridge and the error table.
//
// The binding is thin: values cross as JSON (nlohmann::json <-> plain Python objects), tensors
// cross as at::Tensor through torch's own type caster (offload_bindings.cpp), and every
// ddo::Error becomes the Python exception its code names (one table, in bindings.cpp):
//
//   kInvalidArgument, kDataLoss              -> ValueError
//   kFailedPrecondition, kUnavailable,
//   kInternal                                -> RuntimeError
//   kNotFound                                -> ddo.NotFoundError (a FileNotFoundError and
//   KeyError) kResourceExhausted                       -> MemoryError
//
// Unknown keyword overrides are a TypeError (the C++ message lists them): see
// check_override_names.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>

#include "ddo/core/status.h"

namespace ddo::python {

namespace py = pybind11;

// A plain Python value (None, bool, int, float, str, list/tuple, dict with str keys, and
// os.PathLike as its string) as JSON. Anything else is a TypeError naming its type and where it
// sits ("context['size'][1]").
nlohmann::json to_json(py::handle value, const std::string& where = "value");

// JSON as plain Python objects (dict, list, str, int, float, bool, None).
py::object from_json(const nlohmann::json& value);

// Raises the Python exception of the error table for `status` (no-op when ok).
void raise_status(const Status& status);

// TypeError when `overrides` (a JSON object) names fields DynamicOffloadConfig does not have;
// the message is core's apply_overrides message, which lists them with suggestions.
void check_override_names(const nlohmann::json& overrides);

// Registers the offload part of the module (offload_bindings.cpp).
void bind_offload(py::module_& m);

// Registers enable_offload for TorchScript modules (jit_bindings.cpp); after bind_offload, whose
// Offload class it returns.
void bind_jit(py::module_& m);

}  // namespace ddo::python
