// The refcounted registration of ddo's interception kernels (internal; register_ops.cpp).
#pragma once

#include <memory>

namespace ddo::adapter::internal {

// Alive while ddo's kernels are registered; the last handle destroyed removes them.
class InterceptionHandle {
 public:
  ~InterceptionHandle();
  InterceptionHandle(const InterceptionHandle&) = delete;
  InterceptionHandle& operator=(const InterceptionHandle&) = delete;

 private:
  friend std::shared_ptr<InterceptionHandle> acquire_interception();
  InterceptionHandle() = default;
};

// Registers the kernels on first use (CPU key; CUDA key in CUDA builds) and returns a handle.
std::shared_ptr<InterceptionHandle> acquire_interception();

}  // namespace ddo::adapter::internal
