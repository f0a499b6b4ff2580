// The ddo::sdnq_* op schemas and their plain kernels. A static registration (TORCH_LIBRARY): the
// ops must exist for as long as a model holding SDNQ layers does, offload or not. ddo_torch
// overrides the CPU and CUDA kernels while an offload is active (register_ops.cpp). Only what
// computes on tensors is an op; the rules Python asks about (acceptance, layout codes, quantize='s
// skip reasons) are functions of ddo._C (Note [Metadata through _C] in
// python/src/sdnq_bindings.cpp).
#include "ddo/sdnq/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ddo/sdnq/dequantize.h"
#include "ddo/sdnq/quantize.h"

namespace ddo::sdnq {
namespace {

at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}
std::optional<at::Tensor> or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

using QuantizeResult =
    std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
               std::optional<at::Tensor>, std::vector<std::int64_t>>;

// ddo::sdnq_quantize: the quantizer for Python (ddo.sdnq.quantize_linear) and the tests, which
// compare it with the `sdnq` package. Returns the tensors under the package's names, then the
// layout code for the other ops (it says which group size and layout the options resolved to).
QuantizeResult quantize_kernel(const at::Tensor& weight, c10::string_view weights_dtype,
                               std::int64_t group_size, bool use_svd, std::int64_t svd_rank,
                               bool transposed, std::int64_t svd_steps,
                               std::optional<c10::ScalarType> result_dtype, bool quantized_matmul) {
  QuantizeOptions options;
  options.type = parse_quant_type(weights_dtype);
  options.group_size = group_size;
  options.use_svd = use_svd;
  options.svd_rank = svd_rank;
  options.svd_steps = svd_steps;
  options.transposed = transposed;
  options.result_dtype = result_dtype;
  options.quantized_matmul = quantized_matmul;
  auto [w, layout] = quantize(weight, options);
  return {w.weight,       w.scale, or_none(w.zero_point), or_none(w.svd_up), or_none(w.svd_down),
          layout.encode()};
}

}  // namespace

at::Tensor linear_kernel(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zero_point,
                         const std::optional<at::Tensor>& svd_up,
                         const std::optional<at::Tensor>& svd_down,
                         const std::optional<at::Tensor>& bias, c10::IntArrayRef layout_code) {
  const QuantizedWeight w{weight, scale, or_undefined(zero_point), or_undefined(svd_up),
                          or_undefined(svd_down)};
  return linear(input, w, or_undefined(bias), Layout::decode(layout_code));
}

at::Tensor dequantize_kernel(const at::Tensor& weight, const at::Tensor& scale,
                             const std::optional<at::Tensor>& zero_point,
                             const std::optional<at::Tensor>& svd_up,
                             const std::optional<at::Tensor>& svd_down,
                             c10::IntArrayRef layout_code) {
  const QuantizedWeight w{weight, scale, or_undefined(zero_point), or_undefined(svd_up),
                          or_undefined(svd_down)};
  return dequantize(w, Layout::decode(layout_code));
}

at::Tensor call_linear(const at::Tensor& input, const QuantizedWeight& w, const at::Tensor& bias,
                       c10::IntArrayRef layout_code) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddo::sdnq_linear", "")
                       .typed<decltype(linear_kernel)>();
  return op.call(input, w.weight, w.scale, or_none(w.zero_point), or_none(w.svd_up),
                 or_none(w.svd_down), or_none(bias), layout_code);
}

at::Tensor call_dequantize(const QuantizedWeight& w, c10::IntArrayRef layout_code) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddo::sdnq_dequantize", "")
                       .typed<decltype(dequantize_kernel)>();
  return op.call(w.weight, w.scale, or_none(w.zero_point), or_none(w.svd_up), or_none(w.svd_down),
                 layout_code);
}

TORCH_LIBRARY(ddo, m) {
  m.def(
      "sdnq_linear(Tensor input, Tensor weight, Tensor scale, Tensor? zero_point, Tensor? svd_up, "
      "Tensor? svd_down, Tensor? bias, int[] layout) -> Tensor");
  m.def(
      "sdnq_dequantize(Tensor weight, Tensor scale, Tensor? zero_point, Tensor? svd_up, "
      "Tensor? svd_down, int[] layout) -> Tensor");
  m.def(
      "sdnq_quantize(Tensor weight, str weights_dtype, int group_size=-1, bool use_svd=False, "
      "int svd_rank=32, bool transposed=False, int svd_steps=8, ScalarType? result_dtype=None, "
      "bool quantized_matmul=False) -> (Tensor weight, Tensor scale, Tensor? zero_point, Tensor? "
      "svd_up, Tensor? svd_down, "
      "int[] layout)");
}

// Quantizing is ATen ops on whatever device the weight is on: one kernel for every backend.
TORCH_LIBRARY_IMPL(ddo, CompositeExplicitAutograd, m) {
  m.impl("sdnq_quantize", TORCH_FN(quantize_kernel));
}

TORCH_LIBRARY_IMPL(ddo, CPU, m) {
  m.impl("sdnq_linear", TORCH_FN(linear_kernel));
  m.impl("sdnq_dequantize", TORCH_FN(dequantize_kernel));
}

#ifdef DDO_HAVE_CUDA
TORCH_LIBRARY_IMPL(ddo, CUDA, m) {
  m.impl("sdnq_linear", TORCH_FN(linear_kernel));
  m.impl("sdnq_dequantize", TORCH_FN(dequantize_kernel));
}
#endif

}  // namespace ddo::sdnq
