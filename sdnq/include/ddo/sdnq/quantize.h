/// \file
/// The SDNQ quantizer for LibTorch users: a dense Linear weight to the `sdnq` package's layout.
///
/// The output holds the tensors the `sdnq` package (0.2.8) makes for the same weight and options
/// (`sdnq_post_load_quant(model, weights_dtype=..., group_size=..., use_svd=...,
/// use_quantized_matmul=...)`), bit for bit, so a model quantized here and one quantized in
/// Python are interchangeable (python/tests/test_sdnq.py checks both directions). The package's
/// defaults, observed (Note [The package's group sizes] in sdnq/src/quantize.cpp):
///
/// ```
/// type               default group (in_features 3072 / 12288)   with use_svd
/// int8, uint8, fp8   1024 (per row below 2048 inputs, at 2560)  2048
/// int4, uint4        64                                         128
/// int8, fp8 transposed, or quantized_matmul: per row
/// ```
///
/// The package also leaves small layers dense (under 16384 weights or 32 channels: its
/// minimum_allowed_numel and minimum_allowed_channel_size); ddo quantizes what it is given.
///
/// ```
/// ddo::sdnq::QuantizeOptions opt;
/// opt.type = ddo::sdnq::QuantType::kUint4;      // group_size -1: the package's default, 64
/// auto [weights, layout] = ddo::sdnq::quantize(linear->weight, opt);
/// layout.group_size;                            // 64 for in_features 3072; 100 for 200
/// ```
///
/// With use_svd the low-rank factors come from a randomized SVD (torch.svd_lowrank's algorithm,
/// `svd_steps` power iterations) seeded by the default generator of the weight's device: after
/// the same `manual_seed` ddo and the package draw the same numbers and produce the same bits.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>

#include "ddo/sdnq/layout.h"

namespace ddo::sdnq {

/// How quantize() turns a dense weight into an SDNQ layout; the defaults are the package's.
struct QuantizeOptions {
  QuantType type = QuantType::kInt8;  ///< the element type
  /// -1: the package's default for the type (the table above); 0: one scale per row; > 0: about
  /// that many inputs per scale. A size that does not divide in_features becomes the next one
  /// that does, as the package chooses it (200 inputs, 64 asked: 100), and one group is per row.
  /// (The package spells these 0 for its default and -1 for per row.)
  std::int64_t group_size = -1;
  /// Low-rank SVD correction of rank `svd_rank` (at most min(out, in)) found in `svd_steps`
  /// power iterations; the package's use_svd, svd_rank and svd_steps.
  bool use_svd = false;
  std::int64_t svd_rank = 32;  ///< see use_svd
  std::int64_t svd_steps = 8;  ///< see use_svd
  /// The package's matmul layout (weight stored [in, out], scale [1, out], computed with a
  /// quantized GEMM); int8 and float8_e4m3fn only. Like the package, the weight keeps the plain
  /// layout (and dequantizes) when a group size is asked for or when a dimension is below 32 or
  /// not a multiple of 16; the returned layout says which it got.
  bool transposed = false;
  /// ddo's quantized-matmul layout: one scale per row, the plain [out, in] storage, computed
  /// with a quantized GEMM where the device has one (what `quantize=` makes); int8 and
  /// float8_e4m3fn only, and no group size.
  bool quantized_matmul = false;
  /// Result dtype of the dequantized weight (the package's torch_dtype) and of the SVD factors;
  /// unset = the dense weight's dtype.
  std::optional<c10::ScalarType> result_dtype;
};

/// The group size the package uses for `options` on a weight with `in_features` inputs: 0 for
/// one scale per row, else a divisor of in_features. Follows Note [The package's group sizes].
std::int64_t resolve_group_size(const QuantizeOptions& options, std::int64_t in_features);

/// True when the package stores an [out, in] 8-bit weight in the transposed matmul layout
/// (both dimensions at least 32 and multiples of 16).
bool transposed_layout_fits(std::int64_t out_features, std::int64_t in_features);

/// Quantizes a dense [out, in] weight (any float dtype, any device). Throws
/// ddo::Error(kInvalidArgument) naming the option for shapes and options the layout cannot hold.
std::pair<QuantizedWeight, Layout> quantize(const at::Tensor& dense_weight,
                                            const QuantizeOptions& options);

}  // namespace ddo::sdnq
