// The CPU's own matrix kernels, as a backend's kernel traits name them (kernels.h): a backend
// whose tensors are CPU tensors (the simulation) computes with these, called below the
// dispatcher so that ddo's interception on the CPU key does not see them again.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>

namespace ddo::adapter::internal {

struct CpuMath {
  static at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                          const c10::Scalar& beta, const c10::Scalar& alpha) {
    return at::cpu::addmm(self, mat1, mat2, beta, alpha);
  }
  static at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
    return at::cpu::mm(self, mat2);
  }
  static at::Tensor bmm(const at::Tensor& self, const at::Tensor& mat2) {
    return at::cpu::bmm(self, mat2);
  }
};

}  // namespace ddo::adapter::internal
