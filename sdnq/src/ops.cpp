// The ddo::sdnq_* op schemas and their plain kernels. A static registration (TORCH_LIBRARY): the
// ops must exist for as long as a model holding SDNQ layers does, offload or not. ddo_torch
// overrides the CPU and CUDA kernels while an offload is active (register_ops.cpp).
#include "ddo/sdnq/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ddo/sdnq/acceptance.h"
#include "ddo/sdnq/dequantize.h"
#include "ddo/sdnq/quantize.h"
#include "ddo/sdnq/quantize_model.h"
#include "ddo/sdnq/quantized_matmul.h"

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

// The layout code for a layer described by name, checked as Layout::decode checks it: Python
// builds its codes here, so the type and dtype numbering lives in layout.cpp only.
std::vector<std::int64_t> layout_code_kernel(c10::string_view weights_dtype,
                                             c10::ScalarType result_dtype, std::int64_t out,
                                             std::int64_t in, std::int64_t group_size,
                                             bool transposed,
                                             std::optional<bool> quantized_matmul) {
  const Layout layout{
      parse_quant_type(std::string_view(weights_dtype.data(), weights_dtype.size())),
      result_dtype,
      out,
      in,
      group_size,
      transposed,
      quantized_matmul.value_or(transposed)};
  return Layout::decode(layout.encode()).encode();
}

// ddo::sdnq_accept_layer: accept_layer (acceptance.h) over the facts Python read from a module
// the sdnq package quantized or from a checkpoint layer: (layout code, "") or ([], why).
std::tuple<std::vector<std::int64_t>, std::string> accept_layer_kernel(
    c10::string_view module_type, bool is_linear, c10::string_view weights_dtype,
    std::optional<c10::ScalarType> result_dtype, std::vector<std::int64_t> original_shape,
    std::int64_t group_size, bool transposed, bool has_svd, std::vector<std::string> features) {
  LayerFacts f;
  f.module_type = std::string(module_type.data(), module_type.size());
  f.is_linear = is_linear;
  f.weights_dtype = std::string(weights_dtype.data(), weights_dtype.size());
  f.result_dtype = result_dtype;
  if (original_shape.size() == 2) {
    f.out_features = original_shape[0];
    f.in_features = original_shape[1];
  }
  f.group_size = group_size;
  f.transposed = transposed;
  f.has_svd = has_svd;
  f.features = std::move(features);
  Acceptance a = accept_layer(f);
  return {std::move(a.layout), std::move(a.why)};
}

// ddo::sdnq_stored_layout: stored_layout (acceptance.h) for the loader.
std::tuple<std::int64_t, bool> stored_layout_kernel(bool matmul, std::int64_t out_features,
                                                    std::int64_t in_features,
                                                    std::vector<std::int64_t> weight_shape,
                                                    std::vector<std::int64_t> scale_shape) {
  const StoredLayout s =
      stored_layout(matmul, out_features, in_features, weight_shape, scale_shape);
  return {s.group_size, s.transposed};
}

// ddo::sdnq_quantize_skip: why `quantize=` keeps a dense Linear as it is ("" when it quantizes
// it); throws for a bad option.
std::string quantize_skip_kernel(c10::string_view quantize, std::int64_t out_features,
                                 std::int64_t in_features, c10::ScalarType dtype) {
  if (!parse_quantize_option(std::string_view(quantize.data(), quantize.size()))) {
    return "quantize is none";
  }
  const char* reason = quantize_skip_reason(out_features, in_features, dtype);
  return reason == nullptr ? std::string() : std::string(reason);
}

// ddo::sdnq_quantize_type: the package's name of the type `quantize=` asks for ("" for none).
std::string quantize_type_kernel(c10::string_view quantize) {
  const auto type = parse_quantize_option(std::string_view(quantize.data(), quantize.size()));
  return type ? std::string(to_string(*type)) : std::string();
}

// ddo::sdnq_linear_path: the path a layer takes on `device` for inputs of `rows` rows of its
// result dtype, and why (the report's per-layer entry).
std::tuple<std::string, std::string> linear_path_kernel(c10::IntArrayRef layout_code,
                                                        c10::ScalarType scale_dtype,
                                                        c10::Device device, std::int64_t rows) {
  const Layout layout = Layout::decode(layout_code);
  const LinearPathChoice choice =
      choose_linear_path(layout, scale_dtype, layout.result_dtype, rows, gemm_target(device));
  return {to_string(choice.path), std::string(choice.why)};
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
  m.def(
      "sdnq_layout_code(str weights_dtype, ScalarType result_dtype, int out_features, "
      "int in_features, int group_size, bool transposed, bool? quantized_matmul=None) -> int[]",
      TORCH_FN(layout_code_kernel));
  m.def(
      "sdnq_quantize_skip(str quantize, int out_features, int in_features, ScalarType dtype) "
      "-> str",
      TORCH_FN(quantize_skip_kernel));
  m.def("sdnq_quantize_type(str quantize) -> str", TORCH_FN(quantize_type_kernel));
  m.def(
      "sdnq_accept_layer(str module_type, bool is_linear, str weights_dtype, "
      "ScalarType? result_dtype, int[] original_shape, int group_size, bool transposed, "
      "bool has_svd, str[] features) -> (int[] layout, str why)",
      TORCH_FN(accept_layer_kernel));
  m.def(
      "sdnq_stored_layout(bool matmul, int out_features, int in_features, int[] weight_shape, "
      "int[] scale_shape) -> (int group_size, bool transposed)",
      TORCH_FN(stored_layout_kernel));
  m.def(
      "sdnq_linear_path(int[] layout, ScalarType scale_dtype, Device device, int rows=4096) "
      "-> (str path, str why)",
      TORCH_FN(linear_path_kernel));
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
