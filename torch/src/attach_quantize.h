// quantize= at attach (internal): the Linears it quantizes, their placeholders, their way back,
// and the report section (Note [Quantized dense weights] in attach_quantize.cpp).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "ddo/torch/enable_offload.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

// Before the inventory: each dense Linear that qualifies gets a quantized copy in its tree entry
// (kind kPacked, format SDNQ: the quantized weight and its scales where the dense weight was), so
// the planner sizes, places and streams the copy. The model is not changed yet (a placeholder of
// the loader's gets its dense weight read from the checkpoint). Throws kInvalidArgument for an
// unknown option.
void quantize_linears(OffloadState& s, const OffloadOptions& options);

// After placement: each quantized Linear's weight becomes its placeholder (the dense bytes, a
// record that points at the placed quantized tensors). A Linear whose copy the plan kept where
// it was stays dense, with why.
void install_quantized_weights(OffloadState& s);

// remove(), phase 1: the dense weight each quantized Linear gets back (may throw: a copy to the
// weight's original device); phase 2: puts them back (cannot fail).
std::vector<at::Tensor> quantized_weights_back(const OffloadState& s);
void put_back_quantized_weights(OffloadState& s, const std::vector<at::Tensor>& back);

// report()["quantized_compute"]: {"quantize", "counts": {path: n}, "layers": {name: {"path",
// "why"}}, "kept_dense": {name: why}}, the path for a full-size input on the execution device.
nlohmann::json quantized_compute_report(const OffloadState& s);

}  // namespace ddo::adapter::internal
