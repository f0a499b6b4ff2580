// SDNQ metadata for the ddo package: which layers ddo runs, how a checkpoint stores them, which
// Linears quantize= serves quantized, the layout codes and a layer's compute path. Plain functions
// of ddo._C, not dispatcher ops: they take and give names, shapes and codes, never tensors, so
// nothing dispatches on them and no TorchScript graph calls them.
//
// Note [Metadata through _C]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Python reaches ddo's C++ through ddo._C, and through torch.ops.ddo only where a tensor is
// computed: sdnq_linear, sdnq_dequantize and sdnq_quantize (sdnq/src/ops.cpp), which a model's
// forward or a TorchScript graph calls and whose kernels ddo_torch overrides while an offload is
// active (torch/src/kernels.h). A rule Python asks about (layer acceptance, quantize='s skip
// reasons, the layout codes) is a function here, over the one C++ implementation of the rule.
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/csrc/utils/pybind.h>

#include "ddo/sdnq/acceptance.h"
#include "ddo/sdnq/layout.h"
#include "ddo/sdnq/quantize_model.h"
#include "ddo/sdnq/quantized_matmul.h"
#include "py_common.h"

namespace ddo::python {

void bind_sdnq(py::module_& m) {
  m.def(
      "sdnq_quantize_type",
      [](const std::string& quantize) {
        const auto type = sdnq::parse_quantize_option(quantize);
        return type ? std::string(sdnq::to_string(*type)) : std::string();
      },
      py::arg("quantize"),
      "The sdnq package's name of the type quantize= asks for (\"fp8\" -> \"float8_e4m3fn\"), "
      "\"\" for none; a ValueError naming the choices otherwise (quantize_model.h).");
  m.def(
      "sdnq_quantize_skip",
      [](const std::string& quantize, std::int64_t out_features, std::int64_t in_features,
         c10::ScalarType dtype) {
        if (!sdnq::parse_quantize_option(quantize)) return std::string("quantize is none");
        const char* reason = sdnq::quantize_skip_reason(out_features, in_features, dtype);
        return reason == nullptr ? std::string() : std::string(reason);
      },
      py::arg("quantize"), py::arg("out_features"), py::arg("in_features"), py::arg("dtype"),
      "Why quantize= keeps a dense Linear of this shape and dtype as it is; \"\" when it "
      "quantizes it (sdnq::quantize_skip_reason).");
  m.def(
      "sdnq_accept_layer",
      [](const std::string& module_type, bool is_linear, const std::string& weights_dtype,
         std::optional<c10::ScalarType> result_dtype, const std::vector<std::int64_t>& shape,
         std::int64_t group_size, bool transposed, bool has_svd,
         std::vector<std::string> features) {
        sdnq::LayerFacts f;
        f.module_type = module_type;
        f.is_linear = is_linear;
        f.weights_dtype = weights_dtype;
        f.result_dtype = result_dtype;
        if (shape.size() == 2) {
          f.out_features = shape[0];
          f.in_features = shape[1];
        }
        f.group_size = group_size;
        f.transposed = transposed;
        f.has_svd = has_svd;
        f.features = std::move(features);
        sdnq::Acceptance a = sdnq::accept_layer(f);
        return std::make_tuple(std::move(a.layout), std::move(a.why));
      },
      py::arg("module_type"), py::arg("is_linear"), py::arg("weights_dtype"),
      py::arg("result_dtype"), py::arg("original_shape"), py::arg("group_size"),
      py::arg("transposed"), py::arg("has_svd"), py::arg("features"),
      "Whether ddo runs an SDNQ layer with these facts (sdnq::accept_layer): (layout code, \"\") "
      "or ([], why).");
  m.def(
      "sdnq_stored_layout",
      [](bool matmul, std::int64_t out_features, std::int64_t in_features,
         const std::vector<std::int64_t>& weight_shape,
         const std::vector<std::int64_t>& scale_shape) {
        const sdnq::StoredLayout s =
            sdnq::stored_layout(matmul, out_features, in_features, weight_shape, scale_shape);
        return std::make_tuple(s.group_size, s.transposed);
      },
      py::arg("matmul"), py::arg("out_features"), py::arg("in_features"), py::arg("weight_shape"),
      py::arg("scale_shape"),
      "How a checkpoint stores an SDNQ Linear, from its tensors' shapes (sdnq::stored_layout): "
      "(group_size, transposed).");
  m.def(
      "sdnq_layout_code",
      [](const std::string& weights_dtype, c10::ScalarType result_dtype, std::int64_t out,
         std::int64_t in, std::int64_t group_size, bool transposed,
         std::optional<bool> quantized_matmul) {
        const sdnq::Layout layout{
            sdnq::parse_quant_type(weights_dtype), result_dtype, out, in, group_size, transposed,
            quantized_matmul.value_or(transposed)};
        // Decoded again: the code is checked as the ops check it (Layout::decode).
        return sdnq::Layout::decode(layout.encode()).encode();
      },
      py::arg("weights_dtype"), py::arg("result_dtype"), py::arg("out_features"),
      py::arg("in_features"), py::arg("group_size"), py::arg("transposed"),
      py::arg("quantized_matmul") = py::none(),
      "The layout code of a layer described by name (sdnq::Layout), checked as the ops check it.");
  m.def(
      "sdnq_linear_path",
      [](const std::vector<std::int64_t>& layout_code, c10::ScalarType scale_dtype,
         const py::object& device_arg, std::int64_t rows) {
        // A torch.device or its name ("cuda:0"), as torch.ops take a Device.
        const c10::Device device = py::isinstance<py::str>(device_arg)
                                       ? c10::Device(device_arg.cast<std::string>())
                                       : device_arg.cast<c10::Device>();
        const sdnq::Layout layout = sdnq::Layout::decode(layout_code);
        const sdnq::LinearPathChoice choice = sdnq::choose_linear_path(
            layout, scale_dtype, layout.result_dtype, rows, sdnq::gemm_target(device));
        return std::make_tuple(std::string(sdnq::to_string(choice.path)), std::string(choice.why));
      },
      py::arg("layout"), py::arg("scale_dtype"), py::arg("device"), py::arg("rows") = 4096,
      "The path a layer takes on `device` for inputs of `rows` rows, and why "
      "(sdnq::choose_linear_path): (path, why), as the report's per-layer entry.");
}

}  // namespace ddo::python
