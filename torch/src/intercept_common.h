// The staging step shared by every interception kernel (internal).
//
// A kernel first asks `any_managed(...)`: when no argument is managed it calls the original
// kernel directly and does nothing else. Otherwise a StageScope replaces each managed argument
// by the same view (sizes, strides, storage offset) over its staged copy on the execution
// device, the kernel calls the original with those views, and the scope releases the units when
// the op has been issued (the dynamic route) or keeps the group unit held until another one is
// needed (the classic group routes).
//
//   at::Tensor mm_cpu(const at::Tensor& self, const at::Tensor& mat2) {
//     if (!any_managed(self, mat2)) return at::cpu::mm(self, mat2);
//     StageScope scope(engine::DeviceKind::kSim, "mm");
//     return at::cpu::mm(scope.stage(self), scope.stage(mat2));
//   }
#pragma once

#include <array>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/SymIntArrayRef.h>

#include "managed_weight.h"

namespace ddo::adapter::internal {

template <typename... Ts>
inline bool any_managed(const Ts&... tensors) {
  return ((managed_of(tensors) != nullptr) || ...);
}
inline bool any_managed_opt(const std::optional<at::Tensor>& t) {
  return t.has_value() && managed_of(*t) != nullptr;
}

// The compute stream of a CUDA execution device; set by the CUDA-enabled part of the adapter.
// The simulation's compute stream is the calling thread (kDefaultStream).
using CurrentStreamFn = engine::Stream (*)(c10::DeviceIndex index);
void set_current_stream_fn(CurrentStreamFn fn);
CurrentStreamFn current_stream_fn();

class StageScope {
 public:
  // `kind`: the device kind whose dispatch key runs this kernel (CPU key: the simulation; CUDA
  // key: a GPU). `op` names the op in errors.
  StageScope(engine::DeviceKind kind, const char* op) : kind_(kind), op_(op) {}
  ~StageScope();
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

  // `t` itself when unmanaged; else the same view over the staged copy of its unit.
  at::Tensor stage(const at::Tensor& t);
  std::optional<at::Tensor> stage(const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return t;
    return stage(*t);
  }

 private:
  struct Held {
    StreamRuntime* runtime;
    int unit;
    engine::Stream stream;
    void* base;
  };
  void* acquire(ManagedWeight* m, engine::Stream stream);

  engine::DeviceKind kind_;
  const char* op_;
  void claim(StreamRuntime* rt);

  std::array<Held, 4> held_{};
  int held_count_ = 0;
  std::array<StreamRuntime*, 2> claimed_{};  // runtimes whose in_op this scope set
  int claimed_count_ = 0;
  bool counted_ = false;
};

}  // namespace ddo::adapter::internal
