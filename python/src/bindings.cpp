// ddo._C: the private extension behind the ddo package (python/ddo is the user API). The module is
// the sum of one file per bound area; this file only puts them together, errors first so every
// later binding's exceptions go through the one translator. See docs/design/0003-python.md.
//
//   errors.cpp           the error table and its translator (py_common.h lists the table)
//   json_bridge.cpp      plain Python values <-> JSON, override-name checks
//   config_bindings.cpp  config fields, presets, the settings loader
//   profile_bindings.cpp the named-profile store
//   legacy_bindings.cpp  diffusers-dynamic-offloader's host-context store (ddo/legacy.py)
//   offload_bindings.cpp enable_offload over a Python module tree, reports
//   jit_bindings.cpp     enable_offload over a TorchScript module
//   pipeline_bindings.cpp the pipeline router and the pipeline loop
//   sdnq_bindings.cpp    SDNQ metadata: layer acceptance, stored layouts, quantize='s rules
#include <pybind11/pybind11.h>

#include "py_common.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddo's private extension; use the ddo package.";
  ddo::python::bind_errors(m);  // first: every binding below may throw
  ddo::python::bind_config(m);
  ddo::python::bind_profiles(m);
  ddo::python::bind_legacy(m);
  ddo::python::bind_offload(m);
  ddo::python::bind_jit(m);
  ddo::python::bind_pipeline(m);
  ddo::python::bind_sdnq(m);
}
