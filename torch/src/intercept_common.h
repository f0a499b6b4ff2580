// The staging step shared by every interception kernel (internal).
//
// A kernel first asks `any_managed(...)`: when no argument is managed it calls the original
// kernel directly and does nothing else. Otherwise a StageScope replaces each managed argument
// by the same view (sizes, strides, storage offset) over its staged copy on the execution
// device, the kernel calls the original with those views, and the scope releases the units when
// the op has been issued (the dynamic route) or keeps the group unit held until another one is
// needed (the classic group routes).
//
//   template <class K>  // a backend's kernels (kernels.h)
//   at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
//     if (!any_managed(self, mat2)) return K::mm(self, mat2);
//     StageScope scope(K::backend(), "mm");
//     return K::mm(scope.stage(self), scope.stage(mat2));
//   }
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/SymIntArrayRef.h>

#include "backend.h"
#include "managed_weight.h"

namespace ddo::adapter::internal {

struct QuantizedDense;  // quantized_dense.h

// Note [Weights changed in place]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A managed weight's storage is its host copy, so an in-place write (weight.mul_(2),
// load_state_dict's copy_, a LoRA fuse through the parameter) lands where the next host-to-device
// copy reads. What can still be stale is a copy made before the write: a unit prefetched for the
// next step, or a released region the scheduler serves again. Every in-place op bumps the
// tensor's version counter (shared by its views and by detach()), so each record keeps the
// version its parameter had when last served, and the gate of every interception kernel compares
// it for each managed argument before the op stages anything: one load and one compare per
// managed argument. On a change the staged copies are dropped (the next acquire copies the new
// bytes) and the version is taken; a weight of the disk tier cannot be served from its host
// copy (the scheduler reads the checkpoint), so its change is an error that says what to do.
// torch gives `.data` a fresh version counter, so a write through it would not be seen: while
// attached, Python's streamed Parameters are ddo.adapters.StreamedParameter, whose `.data` is a
// detach() (the parameter's counter) and whose `.data = t` copies into the host copy (PEFT's
// merges; python/ddo/adapters.py). From C++, write through the parameter (docs/guide.md).
void note_changed_in_place(ManagedWeight* m, std::uint32_t version);

inline ManagedWeight* managed_checked(const at::Tensor& t) {
  ManagedWeight* m = managed_of(t);
  if (m != nullptr) {
    if (C10_LIKELY(!t.unsafeGetTensorImpl()->is_inference())) {
      const auto version = static_cast<std::uint32_t>(t._version());
      if (C10_UNLIKELY(version != m->version)) note_changed_in_place(m, version);
    }
  }
  return m;
}
inline ManagedWeight* managed_checked(const std::optional<at::Tensor>& t) {
  return t.has_value() ? managed_checked(*t) : nullptr;
}

// True when any argument is managed. Every argument is looked at (no short circuit), so that the
// version check of Note [Weights changed in place] runs for all of them before anything is staged.
template <typename... Ts>
inline bool any_managed(const Ts&... tensors) {
  return ((managed_checked(tensors) != nullptr) | ...);
}

class StageScope {
 public:
  // `backend`: the record whose dispatch key runs this kernel (CPU key: the simulation; CUDA
  // key: a GPU); its compute stream orders the copies. `op` names the op in errors.
  StageScope(const Backend& backend, const char* op) : backend_(&backend), op_(op) {}
  ~StageScope();
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

  // `t` itself when unmanaged; else the same view over the staged copy of its unit.
  at::Tensor stage(const at::Tensor& t);
  std::optional<at::Tensor> stage(const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return t;
    return stage(*t);
  }
  // The quantized weight and scales a placeholder of a quantized Linear weight computes from,
  // staged on the device (intercept_quantized.cpp).
  std::pair<at::Tensor, at::Tensor> stage_quantized(const QuantizedDense& q);

 private:
  struct Held {
    StreamRuntime* runtime;
    int unit;
    engine::Stream stream;
    void* base;
  };
  void* acquire(ManagedWeight* m, engine::Stream stream);
  // Throws: `m` may be trained, and this op runs with autograd enabled.
  void refuse_grad(const ManagedWeight& m) const;
  // Throws unless this kernel's backend is the offload's (`device` names it in the error).
  void check_backend(const Backend* offload_backend, const c10::Device& device) const;
  // A placeholder of a quantized Linear weight read by an op other than a Linear's: its
  // quantized tensors staged and dequantized on the device, viewed as `t`.
  at::Tensor stage_dequantized(const at::Tensor& t, const QuantizedDense& q);

  const Backend* backend_;
  const char* op_;
  void claim(StreamRuntime* rt);

  std::array<Held, 4> held_{};
  int held_count_ = 0;
  std::array<StreamRuntime*, 2> claimed_{};  // runtimes whose in_op this scope set
  int claimed_count_ = 0;
  bool counted_ = false;
};

}  // namespace ddo::adapter::internal
