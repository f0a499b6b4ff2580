// Loader pins (internal): the deferred flow's weights in pinned host slabs, and how an offload
// recognises them. Note [Loader pins] in loader_pins.cpp.
//
//   load_weights_for_offload(tree, load, options);  // loader.h: reads into pinned slabs
//   ...
//   const LoaderPin* pin = loader_pin_of(t);        // enable_offload: stream it where it is
//   if (pin != nullptr && pin->streamable(t, unit_bytes)) { ... }
#pragma once

#include <cstddef>
#include <memory>

#include <ATen/core/Tensor.h>

#include "ddo/engine/host_slab.h"

namespace ddo::adapter::internal {

// The record behind one loader-pinned storage: the slabs that hold it (kept alive by every view)
// and its entry there.
struct LoaderPin {
  std::shared_ptr<engine::HostSlabs> slabs;
  std::size_t index = 0;  // the tensor's entry in `slabs`
  std::size_t room = 0;   // bytes readable from the entry's start: the tensor rounded up to 256

  // True when the memory is pinned (a slab can fall back to ordinary memory) and `t` starts at
  // the entry, so a copy of `unit_bytes` from t's data stays inside the entry.
  bool streamable(const at::Tensor& t, std::size_t unit_bytes) const;
};

// The deleter of every loader-pinned storage: frees the record (and, with the last one, the slabs).
void loader_pin_deleter(void* context);

// The record of a loader-pinned CPU tensor; null for any other tensor. One comparison on the
// storage's deleter, as for managed weights (Note [Recognising managed storage]).
const LoaderPin* loader_pin_of(const at::Tensor& t);

// True when `t` is loader-pinned and its memory really is pinned.
bool is_pinned_loader_tensor(const at::Tensor& t);

}  // namespace ddo::adapter::internal
