// The interception kernels (internal): one template per intercepted op over a backend's kernel
// traits K, and the one list that registers them.
//
// A backend (backend_sim.cpp, backend_cuda.cpp) supplies K: K::backend(), its record, and the
// ATen kernels of its dispatch key the interception replaces, which the matmul kernels call
// directly (K::addmm, K::mm, K::bmm; the other ops' originals are composite or libddo_sdnq
// kernels every key shares). The record's register_kernels is register_interception_kernels<K>,
// and register_ops.cpp calls it for every record, on libraries of the record's dispatch key. So
// each kernel is written once, the record it serves is a constant of its instantiation (no lookup
// per op), and a new kind of device writes K and its record and edits nothing here. Each kernel
// calls the original directly when no argument is managed. See docs/design/0001-interception.md.
//
//   struct SimKernels {
//     static const Backend& backend() { return kSimBackend; }
//     static at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1,
//                             const at::Tensor& mat2, const c10::Scalar& beta,
//                             const c10::Scalar& alpha) {
//       return at::cpu::addmm(self, mat1, mat2, beta, alpha);
//     }
//     // mm, bmm alike
//   };
//   // in kSimBackend: .register_kernels = &register_interception_kernels<SimKernels>
#pragma once

#include <torch/library.h>

#include "intercept_conv.h"
#include "intercept_embedding.h"
#include "intercept_matmul.h"
#include "intercept_sdnq.h"

namespace ddo::adapter::internal {

// Registers every interception kernel, instantiated for K: ATen's ops on `aten`, libddo_sdnq's
// (over its own plain kernels) on `ddo`.
template <class K>
void register_interception_kernels(torch::Library& aten, torch::Library& ddo) {
  aten.impl("addmm", TORCH_FN(kernels::addmm<K>));
  aten.impl("mm", TORCH_FN(kernels::mm<K>));
  aten.impl("bmm", TORCH_FN(kernels::bmm<K>));
  aten.impl("convolution", TORCH_FN(kernels::convolution<K>));
  aten.impl("_convolution", TORCH_FN(kernels::underscore_convolution<K>));
  aten.impl("embedding", TORCH_FN(kernels::embedding<K>));
  ddo.impl("sdnq_linear", TORCH_FN(kernels::sdnq_linear<K>));
  ddo.impl("sdnq_dequantize", TORCH_FN(kernels::sdnq_dequantize<K>));
}

}  // namespace ddo::adapter::internal
