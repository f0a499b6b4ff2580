/// \file
/// Quantized compute: an int8 or fp8 layer's forward as a low-precision GEMM.
///
/// A layer whose layout has `quantized_matmul` (per-row int8 or float8_e4m3fn) multiplies in
/// its own precision where the device can: the activations are quantized per token (absmax /
/// qmax, one fused kernel), the GEMM runs on the quantized operands (`at::_int_mm` for int8,
/// `at::_scaled_mm` with row and column scales for fp8), and the scales and the bias are applied
/// in one pass (the fp8 GEMM's epilogue; ddo's int8 epilogue kernel). Elsewhere the layer takes
/// the dequantize path (dequantize.h), which is also the reference the tests measure it against.
///
/// ```
/// // Per call: which path, and why (a static string, no allocation).
/// LinearPathChoice c = choose_linear_path(layout, w, input);
/// c.path;  // LinearPath::kFp8Gemm on an sm_89+ card, kDequantize on an sm_86 one
/// c.why;   // "fp8 e4m3 GEMM (sm_89+)" / "fp8 GEMM needs sm_89 or newer"
/// at::Tensor y = linear(input, w, bias, layout);   // dequantize.h: follows the choice
/// ```
///
/// Accuracy: against the dequantize path on the same weights a GEMM path adds the activations'
/// rounding only: a relative L2 error of about 0.005 (int8) and 0.015 (fp8) on Gaussian inputs,
/// bounded at 0.01 and 0.03 by the tests (Note [Quantized matmul accuracy] in
/// sdnq/src/quantized_matmul.cpp says why).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "ddo/sdnq/layout.h"

namespace ddo::sdnq {

/// How a quantized Linear computes.
enum class LinearPath {
  kDequantize,  ///< dequantize the weight to the result dtype, then the dense GEMM
  kInt8Gemm,    ///< int8 activations x int8 weight, int32 sums, scaled in the epilogue
  kFp8Gemm,     ///< fp8 e4m3 activations x fp8 e4m3 weight, scales in the GEMM's epilogue
};

/// "dequantize", "int8_gemm", "fp8_gemm".
const char* to_string(LinearPath path);

/// A path and why it was taken; `why` is a static string.
struct LinearPathChoice {
  LinearPath path = LinearPath::kDequantize;  ///< the path
  std::string_view why;                       ///< e.g. "int8 GEMM (sm_80+)"
};

/// The fewest rows (tokens) for which a quantized GEMM is taken: below it the activation pass
/// and the GEMM's fixed cost outweigh dequantizing (and cuBLASLt's int8 GEMM needs more than 16).
inline constexpr std::int64_t kMinGemmRows = 32;

/// What the choice knows of the device: its type and, for CUDA, its compute capability
/// (major * 10 + minor: 89 for sm_89).
struct GemmTarget {
  c10::DeviceType type = c10::DeviceType::CPU;  ///< CPU or CUDA
  int capability = 0;                           ///< CUDA only
};

/// The device facts for `device` (the CUDA capability is read once per device and cached).
GemmTarget gemm_target(c10::Device device);

/// The path for a layer with `layout` and scales of `scale_dtype`, for `rows` input rows of
/// `input_dtype` on `target`. The rules, in order: the layout asks for quantized_matmul;
/// DDO_QUANTIZED_MATMUL is not "off"; the scales are float32; both dimensions are multiples of
/// 16 (the GEMMs' alignment); at least kMinGemmRows rows; CUDA: int8 needs sm_80+, fp8 needs
/// sm_89+ and a bfloat16 result (the row-wise scaled GEMM's output). The CPU (and the host
/// simulation) takes both GEMM paths: int8 through at::_int_mm, fp8 through its reference.
LinearPathChoice choose_linear_path(const Layout& layout, c10::ScalarType scale_dtype,
                                    c10::ScalarType input_dtype, std::int64_t rows,
                                    const GemmTarget& target);

/// The same for a call: the target from the weight's device, rows from the input's shape.
LinearPathChoice choose_linear_path(const Layout& layout, const QuantizedWeight& w,
                                    const at::Tensor& input);

/// Per-row quantization of a 2-D float tensor [rows, cols] for `type` (int8 or fp8 e4m3):
/// {q [rows, cols] int8 / float8_e4m3fn, scale [rows] float32} with x ~ q * scale. The fused
/// kernel on CUDA where the library has code for the device, else quantize_rows_reference.
std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, QuantType type);

/// quantize_rows with ATen ops only (any device): what the kernel is tested against, bit for
/// bit (Note [Bit-equal quantized matmul steps] in sdnq/kernels/quantized_matmul.cu).
std::pair<at::Tensor, at::Tensor> quantize_rows_reference(const at::Tensor& x, QuantType type);

/// out = (float(acc) * row_scale[:, None] * col_scale[None, :] + bias) in `out_dtype`: the int8
/// GEMM's epilogue, one kernel on CUDA, ATen ops elsewhere (and as its reference).
at::Tensor int8_scale_epilogue(const at::Tensor& acc, const at::Tensor& row_scale,
                               const at::Tensor& col_scale, const at::Tensor& bias,
                               c10::ScalarType out_dtype);
/// quantize_rows for a Linear's input: a thread's last input, read again unchanged (same
/// storage, pointer, shape, strides, dtype, type, stream and version), gives the same tensors
/// without quantizing again (Note [One activation quantization per input] in
/// sdnq/src/quantized_matmul.cpp).
std::pair<at::Tensor, at::Tensor> quantize_activation_rows(const at::Tensor& x, QuantType type);

/// How many quantize_activation_rows calls in this process returned a thread's cached rows.
std::int64_t activation_quantization_reuses();

/// Drops this thread's cached activation rows (its quantized copy's memory).
void forget_activation_quantization();

/// int8_scale_epilogue with ATen ops only.
at::Tensor int8_scale_epilogue_reference(const at::Tensor& acc, const at::Tensor& row_scale,
                                         const at::Tensor& col_scale, const at::Tensor& bias,
                                         c10::ScalarType out_dtype);

/// A GEMM path that failed on a kind of card (torch raised from at::_int_mm / at::_scaled_mm:
/// a cuBLASLt without the kernel, a build without fp8) is not tried there again: the layer that
/// met the failure dequantizes instead, one warning says why, and choose_linear_path answers
/// kDequantize for that path and capability from then on ("... failed on this device once").
/// Errors of ddo's own checks (a bad layout, wrong tensors) are not caught: they are the caller's.
void disable_gemm_path(LinearPath path, const GemmTarget& target);
/// Whether disable_gemm_path was called for `path` on a card of `target`'s kind.
bool gemm_path_disabled(LinearPath path, const GemmTarget& target);
/// For tests: the next `count` GEMM calls of `path` raise c10::Error as an unsupported GEMM
/// would (0 clears). The check sits in the real path, as SimFaults does for the engine.
void fail_gemm_calls_for_testing(LinearPath path, int count);
/// For tests: forgets every disable_gemm_path (the flags are per process).
void reset_gemm_paths_for_testing();

/// The layer's forward on a GEMM path (`path` is kInt8Gemm or kFp8Gemm, as choose_linear_path
/// chose it): input [..., in] -> [..., out] in the layout's result dtype, plus the SVD factors'
/// low-rank term computed in the result dtype from the unquantized input.
at::Tensor quantized_linear(const at::Tensor& input, const QuantizedWeight& w,
                            const at::Tensor& bias, const Layout& layout, LinearPath path);

}  // namespace ddo::sdnq
