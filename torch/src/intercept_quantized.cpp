// Ops that read the placeholder of a quantized Linear weight (Note [Quantized dense weights] in
// attach_quantize.cpp).
//
// A Linear reads its weight as W.t(): addmm(bias, x, W.t()) for a 2-D input with a bias,
// mm(x, W.t()) when matmul folds the input, bmm(x, W.t() expanded) when it cannot. Those calls
// run the layer's quantized forward (sdnq::linear_kernel: the low-precision GEMM where the device
// has one, else dequantize and the dense GEMM). Any other read of the placeholder by an
// intercepted op (the backward's mm(grad, W), a host's own matmul with the weight) gets the
// dequantized weight under the same view and the original kernel, so it computes what the dense
// weight would, up to the quantization.
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "ddo/sdnq/ops.h"
#include "ddo/sdnq/quantize.h"
#include "ddo/sdnq/quantize_model.h"
#include "intercept_common.h"
#include "quantized_dense.h"

namespace ddo::adapter::internal {
namespace {

bool is_one(const c10::Scalar& s) {
  return !s.isComplex() && s.toDouble() == 1.0;
}

// `mat` is W.t() over the whole placeholder ([in, out], strides [1, in]); with `batched`, W.t()
// expanded over a leading batch dimension (stride 0), as matmul hands it to bmm.
bool reads_transposed_weight(const at::Tensor& mat, const QuantizedDense& q, bool batched) {
  const std::int64_t out = q.dense.size(0);
  const std::int64_t in = q.dense.size(1);
  if (mat.storage_offset() != 0 || mat.dim() != (batched ? 3 : 2)) return false;
  const std::int64_t d = batched ? 1 : 0;
  if (batched && mat.stride(0) != 0) return false;
  return mat.size(d) == in && mat.size(d + 1) == out && mat.stride(d) == 1 &&
         mat.stride(d + 1) == in;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> StageScope::stage_quantized(const QuantizedDense& q) {
  check_backend(q.backend, q.execution_device);
  return {stage(q.packed), stage(q.scale)};
}

at::Tensor StageScope::stage_dequantized(const at::Tensor& t, const QuantizedDense& q) {
  auto [weight, scale] = stage_quantized(q);
  const at::Tensor dense = sdnq::dequantize_kernel(weight, scale, std::nullopt, std::nullopt,
                                                   std::nullopt, q.layout_code);
  return dense.as_strided(t.sizes(), t.strides(), t.storage_offset());
}

at::Tensor quantized_linear(const Backend& backend, const char* op, const at::Tensor& input,
                            const QuantizedDense& q, const at::Tensor& bias) {
  StageScope scope(backend, op);
  auto [weight, scale] = scope.stage_quantized(q);
  std::optional<at::Tensor> staged_bias;
  if (bias.defined()) staged_bias = scope.stage(bias);
  return sdnq::linear_kernel(scope.stage(input), weight, scale, std::nullopt, std::nullopt,
                             std::nullopt, staged_bias, q.layout_code);
}

at::Tensor try_quantized_addmm(const Backend& backend, const at::Tensor& self,
                               const at::Tensor& mat1, const at::Tensor& mat2,
                               const c10::Scalar& beta, const c10::Scalar& alpha) {
  const QuantizedDense* q = quantized_of(mat2);
  if (q == nullptr || quantized_of(mat1) != nullptr || quantized_of(self) != nullptr) return {};
  const c10::ScalarType dtype = q->dense.scalar_type();
  if (!is_one(beta) || !is_one(alpha) || !reads_transposed_weight(mat2, *q, false) ||
      mat1.scalar_type() != dtype || self.scalar_type() != dtype || self.dim() != 1 ||
      self.size(0) != q->dense.size(0)) {
    return {};
  }
  return quantized_linear(backend, "addmm", mat1, *q, self);
}

at::Tensor try_quantized_matmul(const Backend& backend, bool batched, const at::Tensor& self,
                                const at::Tensor& mat2) {
  const QuantizedDense* q = quantized_of(mat2);
  if (q == nullptr || quantized_of(self) != nullptr ||
      !reads_transposed_weight(mat2, *q, batched) || self.scalar_type() != q->dense.scalar_type()) {
    return {};
  }
  return quantized_linear(backend, batched ? "bmm" : "mm", self, *q, at::Tensor());
}

void requantize(const QuantizedDense& q) {
  at::AutoGradMode no_grad(false);
  const sdnq::QuantType type = sdnq::Layout::decode(q.layout_code).type;
  auto [weights, layout] = sdnq::quantize(q.dense, sdnq::quantize_model_options(type));
  TORCH_CHECK(layout.encode() == q.layout_code, "ddo: ", q.name,
              " was changed in place and no longer quantizes to the layout it was placed with");
  q.packed.copy_(weights.weight);
  q.scale.copy_(weights.scale);
  // Copies of the old bytes staged before are dropped, as for any weight changed in place. The
  // writes above bumped no version counter (an interception kernel runs below the dispatcher's
  // in-place tracking), so the records are told here, at the gate of the op that saw the change,
  // before it stages anything.
  for (const at::Tensor* t : {&q.packed, &q.scale}) {
    if (ManagedWeight* m = managed_of(*t)) note_changed_in_place(m, m->version);
  }
}

}  // namespace ddo::adapter::internal
