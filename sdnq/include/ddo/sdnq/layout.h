/// \file
/// SDNQ layouts: how a quantized Linear's tensors are laid out and how they dequantize.
///
/// SDNQ (SD.Next's quantizer, the `sdnq` package) stores a Linear as a packed integer or fp8
/// weight, per-row or per-group scales, zero points for unsigned types, optional low-rank SVD
/// factors and a bias. ddo reads and writes the same tensors, with the same names, so a layer
/// quantized by `sdnq` in Python and one quantized by ddo in C++ are interchangeable. The facts
/// (docs/design/0004-sdnq.md has the whole table):
///
/// ```
/// type      weight tensor                         scale          zero_point      value
/// int8      int8  [out, in] (grouped [out, g, gs]) f32 [out,(g,)1] -               q * s
/// uint8     uint8 [out, in]                       f32            f32 like scale  zp + q * s
/// int4      uint8 [out*in/2], low nibble first    f32 [out, g, 1] -              (n - 8) * s
/// uint4     uint8 [out*in/2], low nibble first    f32 [out, g, 1] f32 [out,g,1]  zp + n * s
/// fp8 e4m3  float8_e4m3fn [out, in]               f32 [out, 1]   -               q * s
/// transposed (the package's matmul layout, int8 and fp8 e4m3): weight [in, out], scale [1, out]
/// ```
///
/// `quantized_matmul` says how the layer computes, apart from how it is stored: per-row int8 and
/// fp8 e4m3 layers with it run a low-precision GEMM where the device has one
/// (quantized_matmul.h), and dequantize otherwise. The package's use_quantized_matmul layers are
/// transposed and quantized_matmul; ddo's own `quantize=` layers keep the plain [out, in] storage
/// (the operand layout the GEMMs read without a copy) and are quantized_matmul.
///
/// Dequantizing: q to the scale's dtype, times the scale (plus the zero point: addcmul), the
/// transpose undone, reshaped to [out, in], cast to the result dtype, then `addmm(w, svd_up,
/// svd_down)` in the result dtype when SVD factors exist. This is the `sdnq` package's own
/// dequantize path, reproduced bit for bit (sdnq/tests check it against the package).
///
/// ```
/// ddo::sdnq::Layout layout{QuantType::kUint4, at::kBFloat16, /*out=*/3072, /*in=*/3072,
///                          /*group_size=*/64, /*transposed=*/false};
/// std::vector<int64_t> code = layout.encode();       // what the ddo::sdnq_* ops take
/// ddo::sdnq::Layout back = ddo::sdnq::Layout::decode(code);
/// layout.check(weights);                             // shapes and dtypes, or a clear error
/// ```
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace ddo::sdnq {

/// The quantized element types of the `sdnq` package that ddo runs; the numbers are part of the
/// ops' layout code and must not change.
enum class QuantType : std::int64_t {
  kInt8 = 0,        ///< signed bytes
  kUint8 = 1,       ///< unsigned bytes with a zero point
  kInt4 = 2,        ///< packed two per byte, stored unsigned with an offset of 8
  kUint4 = 3,       ///< packed two per byte, low nibble first
  kFloat8E4M3 = 4,  ///< float8 e4m3fn
  kFloat8E5M2 = 5,  ///< float8 e5m2
};

/// "int8", "uint8", "int4", "uint4", "float8_e4m3fn", "float8_e5m2" (the package's names).
const char* to_string(QuantType type);
/// Throws ddo::Error(kInvalidArgument) naming the supported types for anything else.
QuantType parse_quant_type(std::string_view text);

/// True for the 4-bit types, stored two per byte.
inline bool is_packed(QuantType t) {
  return t == QuantType::kInt4 || t == QuantType::kUint4;
}
/// True for the types that carry a zero point.
inline bool is_unsigned(QuantType t) {
  return t == QuantType::kUint8 || t == QuantType::kUint4;
}
/// True for the types a quantized GEMM multiplies: int8 and float8_e4m3fn (quantized_matmul.h).
inline bool is_matmul_type(QuantType t) {
  return t == QuantType::kInt8 || t == QuantType::kFloat8E4M3;
}
/// Bits per quantized element.
inline int num_bits(QuantType t) {
  return is_packed(t) ? 4 : 8;
}
/// The dtype the (packed) weight tensor is stored in.
c10::ScalarType storage_dtype(QuantType t);

/// A quantized layer's tensors; undefined tensors are absent (bias, zero point, SVD).
struct QuantizedWeight {
  at::Tensor weight;      ///< the quantized (packed for 4-bit types) weight
  at::Tensor scale;       ///< per row or per group
  at::Tensor zero_point;  ///< unsigned types only
  at::Tensor svd_up;      ///< [out, rank]: with svd_down, the low-rank correction added back
  at::Tensor svd_down;    ///< [rank, in]
};

/// How one layer's quantized weight is stored: enough to check its tensors and dequantize them.
struct Layout {
  QuantType type = QuantType::kInt8;  ///< element type of the weight
  /// Dtype of the dequantized weight and of the SVD factors.
  c10::ScalarType result_dtype = c10::kBFloat16;
  std::int64_t out = 0;         ///< rows of the dequantized weight ([out, in], the Linear's weight)
  std::int64_t in = 0;          ///< columns of the dequantized weight (the Linear's in_features)
  std::int64_t group_size = 0;  ///< 0: one scale per row; else scales per `group_size` inputs
  bool transposed = false;      ///< weight stored [in, out], scale [1, out] (the matmul layout)
  /// Computes with a quantized GEMM where the device has one (per-row int8 or fp8 e4m3 only).
  bool quantized_matmul = false;

  /// Scales per row: in / group_size, or 1 without groups.
  std::int64_t groups() const { return group_size > 0 ? in / group_size : 1; }
  /// The shape the weight takes before scaling: [out, groups, group_size], [out, in] or [in, out].
  std::vector<std::int64_t> quantized_shape() const;
  /// The scale's (and zero point's) shape: [out, groups, 1], [out, 1] or [1, out].
  std::vector<std::int64_t> scale_shape() const;
  /// The packed weight's shape as stored: [out*in/2] for 4-bit types, else quantized_shape().
  std::vector<std::int64_t> stored_shape() const;

  /// The integer list the ddo::sdnq_* ops carry: {2, type, result dtype, out, in, group_size,
  /// transposed, quantized_matmul}. decode() also reads version 1 (the first seven, with
  /// quantized_matmul = transposed: what TorchScript models saved with it hold) and throws
  /// kInvalidArgument for a list it does not know.
  std::vector<std::int64_t> encode() const;
  static Layout decode(c10::IntArrayRef code);  ///< the inverse of encode()

  /// Throws ddo::Error(kInvalidArgument) naming the tensor, what it is and what the layout
  /// expects: dtypes, shapes (numel for the packed weight), the zero point present exactly for
  /// unsigned types, SVD factors both or neither with matching rank, group size dividing `in`.
  void check(const QuantizedWeight& w) const;

  bool operator==(const Layout&) const = default;  ///< field by field
};

}  // namespace ddo::sdnq
