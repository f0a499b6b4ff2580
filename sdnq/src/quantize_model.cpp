#include "ddo/sdnq/quantize_model.h"

#include "ddo/core/status.h"

namespace ddo::sdnq {

std::optional<QuantType> parse_quantize_option(std::string_view text) {
  if (text.empty() || text == "none") return std::nullopt;
  if (text == "fp8" || text == "float8_e4m3fn") return QuantType::kFloat8E4M3;
  if (text == "int8") return QuantType::kInt8;
  throw Error(Code::kInvalidArgument,
              ddo::internal::str_cat("quantize=\"", text,
                                     "\" is not a choice; use \"fp8\" (float8 e4m3, sm_89+ GEMMs), "
                                     "\"int8\" (sm_80+ GEMMs) or none"));
}

const char* quantize_skip_reason(std::int64_t out_features, std::int64_t in_features,
                                 c10::ScalarType dtype) {
  if (!c10::isFloatingType(dtype)) return "the weight is not floating point";
  // The layout's result dtypes (Layout::decode): a float64 Linear computes in float64.
  if (dtype != c10::kBFloat16 && dtype != c10::kHalf && dtype != c10::kFloat) {
    return "the weight is neither bfloat16, float16 nor float32 (a quantized layer computes in "
           "one of those)";
  }
  if (out_features % 16 != 0 || in_features % 16 != 0) {
    return "a dimension is not a multiple of 16 (the GEMMs' alignment)";
  }
  if (out_features * in_features < kMinQuantizedWeights) return "fewer than 16384 weights";
  return nullptr;
}

QuantizeOptions quantize_model_options(QuantType type) {
  QuantizeOptions options;
  options.type = type;
  options.group_size = 0;
  options.quantized_matmul = true;
  return options;
}

}  // namespace ddo::sdnq
