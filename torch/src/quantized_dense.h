// A dense Linear weight served from its quantized copy (internal; Note [Quantized dense weights]
// in attach_quantize.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "backend.h"
#include "ddo/sdnq/layout.h"
#include "intercept_common.h"

namespace ddo::adapter::internal {

// What an op that reads the placeholder of a quantized Linear weight computes from.
struct QuantizedDense {
  // The quantized weight and its per-row scales as the plan placed them: managed (streamed) or
  // on the execution device (resident, move-once).
  at::Tensor packed;
  at::Tensor scale;
  std::vector<std::int64_t> layout_code;  // sdnq::Layout::encode()
  // The model's dense weight in host memory, contiguous: the placeholder's bytes, what reads
  // outside the intercepted ops see, and what an in-place change is quantized from again.
  at::Tensor dense;
  const Backend* backend = &kSimBackend;  // the offload's
  c10::Device execution_device = c10::Device(c10::kCPU);
  std::string name;  // its module, "blocks.0.attn.to_q", for errors
};

// The quantized layer behind `t` when `t` is a placeholder, else null.
inline const QuantizedDense* quantized_of(const at::Tensor& t) {
  const ManagedWeight* m = managed_of(t);
  return m == nullptr ? nullptr : m->quant.get();
}

// Computes a Linear whose weight is `q` (input [..., in] -> [..., out], plus `bias` when
// defined) with the layer's quantized GEMM where the device has one (sdnq::linear_kernel).
at::Tensor quantized_linear(const Backend& backend, const char* op, const at::Tensor& input,
                            const QuantizedDense& q, const at::Tensor& bias);

// The fast paths of the matmul kernels (intercept_matmul.h): the result when the call is a
// Linear reading a placeholder the way torch's linear does (addmm(bias, x, W.t()), mm(x, W.t()),
// bmm(x, W.t() expanded over the batch)); an undefined tensor otherwise, and the caller stages
// its arguments (a placeholder then dequantizes: StageScope::stage).
at::Tensor try_quantized_addmm(const Backend& backend, const at::Tensor& self,
                               const at::Tensor& mat1, const at::Tensor& mat2,
                               const c10::Scalar& beta, const c10::Scalar& alpha);
// mm, or bmm when `batched`.
at::Tensor try_quantized_matmul(const Backend& backend, bool batched, const at::Tensor& self,
                                const at::Tensor& mat2);

// Quantizes the placeholder's host bytes again after an in-place change and writes the result
// into the placed quantized tensors (Note [Weights changed in place]).
void requantize(const QuantizedDense& q);

}  // namespace ddo::adapter::internal
