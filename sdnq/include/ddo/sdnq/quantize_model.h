/// \file
/// `quantize=`: a bf16 model's Linears computed by quantized-matmul layers as ddo places them.
///
/// enable_offload(..., quantize="fp8" | "int8") (OffloadOptions::quantize, from C++ and Python)
/// serves each dense Linear that qualifies from a copy quantized to one scale per output row in
/// the plain SDNQ layout with quantized_matmul set (quantize.h), so it computes with the card's
/// low-precision GEMM (quantized_matmul.h) and streams half the bytes, while the model keeps its
/// modules and dense weights (Note [Quantized dense weights] in torch/src/attach_quantize.cpp).
/// The weight rules live here, once: the attach asks them, and so does Python's explicit offline
/// tool ddo.sdnq.quantize_model (through ddo._C.sdnq_quantize_skip). A model that should
/// stay quantized is built from `SdnqLinear(dense, quantize_model_options(type))` layers
/// (linear.h).
///
/// ```
/// std::optional<QuantType> t = parse_quantize_option("fp8");    // kFloat8E4M3
/// quantize_skip_reason(3072, 3072, at::kBFloat16);               // nullptr: quantized
/// quantize_skip_reason(3072, 3080, at::kBFloat16);               // "a dimension is not ..."
/// SdnqLinear q(*dense, quantize_model_options(*t));              // a LibTorch model's layer
/// ```
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <c10/core/ScalarType.h>

#include "ddo/sdnq/layout.h"
#include "ddo/sdnq/quantize.h"

namespace ddo::sdnq {

/// "fp8" or "float8_e4m3fn" -> kFloat8E4M3, "int8" -> kInt8, "" or "none" -> nullopt (no
/// quantization); anything else throws ddo::Error(kInvalidArgument) naming the choices.
std::optional<QuantType> parse_quantize_option(std::string_view text);

/// Layers below this many weights stay dense: quantizing them saves little and costs accuracy.
inline constexpr std::int64_t kMinQuantizedWeights = 16384;

/// Why a dense Linear [out, in] of `dtype` stays dense under `quantize=`, or nullptr when it is
/// quantized: a bfloat16, float16 or float32 weight (the layout's result dtypes), both
/// dimensions multiples of 16 (the GEMMs' alignment), at least kMinQuantizedWeights weights.
const char* quantize_skip_reason(std::int64_t out_features, std::int64_t in_features,
                                 c10::ScalarType dtype);

/// The options `quantize=` uses: `type`, one scale per row, quantized_matmul.
QuantizeOptions quantize_model_options(QuantType type);

}  // namespace ddo::sdnq
