// ddo._C's errors: the one table from ddo::Code (and torch's c10 errors) to Python exceptions, and
// the one translator that applies it to every binding of the module. See py_common.h for the
// table in words and docs/design/0003-python.md.
//
// Note [A full device is torch.OutOfMemoryError]
// A device that runs out of memory can fail in two places: in setup (ddo's own allocation of
// resident tensors, slabs or the staging ring: a ddo::Error with kResourceExhausted) and in a step
// (torch's caching allocator inside an op: c10::OutOfMemoryError). A step's exception crosses
// into Python through torch's own op bindings, never through this translator, so torch decides
// it: torch.OutOfMemoryError. Setup takes the same class, so `except torch.OutOfMemoryError` (the
// handler diffusers hosts already have around a pipeline call) catches a full device wherever it
// happens. kResourceExhausted also covers pinned and host memory (a pin refused, host_ram_cap_gb
// too small); one code is one exception, and the message names the memory that ran out.
// torch.OutOfMemoryError is a RuntimeError, not a MemoryError.
#include <exception>
#include <string>

#include <pybind11/pybind11.h>

#include <c10/util/Exception.h>

#include "py_common.h"

namespace ddo::python {
namespace {

// Created (NotFoundError) or looked up (torch.OutOfMemoryError) once at import and never freed:
// Python owns them through module attributes, and a static py::object would be destroyed after
// the interpreter at exit.
PyObject* g_not_found_error = nullptr;
PyObject* g_out_of_memory_error = nullptr;

// Every code, by the name the test hooks use.
struct CodeName {
  Code code;
  const char* name;
};
constexpr CodeName kCodeNames[] = {
    {Code::kInvalidArgument, "invalid_argument"},
    {Code::kFailedPrecondition, "failed_precondition"},
    {Code::kNotFound, "not_found"},
    {Code::kResourceExhausted, "resource_exhausted"},
    {Code::kUnavailable, "unavailable"},
    {Code::kDataLoss, "data_loss"},
    {Code::kInternal, "internal"},
};

Code code_named(const std::string& name) {
  for (const CodeName& row : kCodeNames) {
    if (name == row.name) return row.code;
  }
  std::string names;
  for (const CodeName& row : kCodeNames) names += std::string(names.empty() ? "" : ", ") + row.name;
  throw py::value_error("unknown code '" + name + "'; codes: " + names);
}

// The c10 errors torch gives a Python class of its own, as torch's bindings raise them; other
// c10::Error (a failed TORCH_CHECK) is a RuntimeError.
PyObject* exception_for_c10(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return g_out_of_memory_error;
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) return PyExc_ValueError;
  if (dynamic_cast<const c10::TypeError*>(&e) != nullptr) return PyExc_TypeError;
  if (dynamic_cast<const c10::IndexError*>(&e) != nullptr) return PyExc_IndexError;
  if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr) {
    return PyExc_NotImplementedError;
  }
  return PyExc_RuntimeError;
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    PyErr_SetString(exception_for(e.code()), e.what());
  } catch (const c10::Error& e) {
    PyErr_SetString(exception_for_c10(e), e.what_without_backtrace());
  }
}

}  // namespace

PyObject* exception_for(Code code) {
  switch (code) {
    case Code::kInvalidArgument:
    case Code::kDataLoss:
      return PyExc_ValueError;
    case Code::kNotFound:
      return g_not_found_error;
    case Code::kResourceExhausted:  // Note [A full device is torch.OutOfMemoryError]
      return g_out_of_memory_error;
    case Code::kFailedPrecondition:
    case Code::kUnavailable:
    case Code::kInternal:
    case Code::kOk:
      break;
  }
  return PyExc_RuntimeError;
}

void raise_status(const Status& status) {
  if (status.ok()) return;
  throw Error(status);
}

void bind_errors(py::module_& m) {
  // ddo.NotFoundError: both FileNotFoundError (a missing profile file) and KeyError (a missing
  // named thing), so either `except` catches it.
  py::tuple bases = py::make_tuple(py::reinterpret_borrow<py::object>(PyExc_FileNotFoundError),
                                   py::reinterpret_borrow<py::object>(PyExc_KeyError));
  g_not_found_error = PyErr_NewExceptionWithDoc(
      "ddo.NotFoundError", "A named ddo thing (a profile, a component, a file) does not exist.",
      bases.ptr(), nullptr);
  if (g_not_found_error == nullptr) throw py::error_already_set();
  m.attr("NotFoundError") = py::reinterpret_borrow<py::object>(g_not_found_error);
  // _C links libtorch_python, so torch is importable (ddo/__init__.py has imported it already).
  g_out_of_memory_error =
      py::object(py::module_::import("torch").attr("OutOfMemoryError")).release().ptr();

  // The only translator of the module: every binding's ddo::Error and c10::Error goes through it.
  py::register_exception_translator(&translate);

  // Test hooks: the table seen from Python, and errors thrown through the translator.
  m.def(
      "code_of_exception",
      [](const std::string& code) {
        return py::reinterpret_borrow<py::object>(exception_for(code_named(code)));
      },
      py::arg("code"), "For tests: the Python class of a ddo::Code ('invalid_argument', ...).");
  m.def(
      "raise_error",
      [](const std::string& code, const std::string& message) {
        throw Error(code_named(code), message);
      },
      py::arg("code"), py::arg("message"),
      "For tests: throws ddo::Error(code, message) through the translator.");
  m.def(
      "raise_c10_error",
      [](const std::string& kind, const std::string& message) {
        if (kind == "out_of_memory") TORCH_CHECK_WITH(OutOfMemoryError, false, message);
        if (kind == "value") TORCH_CHECK_VALUE(false, message);
        if (kind == "type") TORCH_CHECK_TYPE(false, message);
        if (kind == "index") TORCH_CHECK_INDEX(false, message);
        if (kind == "not_implemented") TORCH_CHECK_NOT_IMPLEMENTED(false, message);
        if (kind == "error") TORCH_CHECK(false, message);
        throw py::value_error("unknown kind '" + kind +
                              "'; kinds: out_of_memory, value, type, index, not_implemented, "
                              "error");
      },
      py::arg("kind"), py::arg("message"),
      "For tests: throws a c10 error (a failed TORCH_CHECK*) through the translator.");
}

}  // namespace ddo::python
