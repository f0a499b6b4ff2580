/// \file
/// Which SDNQ layers ddo runs, decided once from the layer's facts: the same rule for a module
/// the sdnq package quantized (Python reads its dequantizer) and for a layer of an SDNQ
/// checkpoint (the loader reads its stored shapes).
///
/// ```
/// ddo::sdnq::LayerFacts f;
/// f.weights_dtype = "int8";
/// f.result_dtype = c10::kBFloat16;
/// f.out_features = 3072;
/// f.in_features = 3072;
/// ddo::sdnq::Acceptance a = ddo::sdnq::accept_layer(f);
/// // a.ok(): a.layout is the code ddo::sdnq_linear takes; else a.why says what ddo lacks
/// ```
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

namespace ddo::sdnq {

/// What is known of one quantized layer.
struct LayerFacts {
  /// The module's type name ("Linear" for a Linear or a subclass of it).
  std::string module_type = "Linear";
  bool is_linear = true;
  std::string weights_dtype;  ///< the package's name ("int8", "uint4", ...); "" unread
  std::optional<c10::ScalarType> result_dtype;  ///< nullopt: unread
  std::int64_t out_features = -1;               ///< -1: the original shape is not 2-D
  std::int64_t in_features = -1;
  std::int64_t group_size = 0;  ///< 0 (or negative): one scale per row
  /// The package's matmul layout: the weight stored [in, out], computed by a quantized GEMM.
  bool transposed = false;
  bool has_svd = false;  ///< svd_up / svd_down present
  /// Package options set and tensors present that ddo's dequantize lacks: "use_hadamard",
  /// "use_codebook", "use_codebook_scale", "scale_2", "scale_zero_point", "zero_point_scale",
  /// "zero_point_2". Any other name is ignored.
  std::vector<std::string> features;
};

/// The decision: the layout code, or why ddo cannot run the layer.
struct Acceptance {
  std::vector<std::int64_t> layout;  ///< Layout::encode() when accepted
  std::string why;                   ///< "" when accepted
  bool ok() const { return why.empty(); }
};

/// The rule. Never throws for facts it cannot accept: it says why in Acceptance::why.
Acceptance accept_layer(const LayerFacts& facts);

/// How a layer of an SDNQ checkpoint is stored, from its tensors' shapes: the group size (the
/// scale's second-to-last dimension divides in_features into groups, 0 for one scale per row)
/// and whether it is in the matmul layout (the config asks for it, and this layer's weight is
/// [in, out] with a [1, out] scale: the package keeps the plain layout for layers it does not
/// run that way).
struct StoredLayout {
  std::int64_t group_size = 0;
  bool transposed = false;
};
StoredLayout stored_layout(bool matmul_config, std::int64_t out_features, std::int64_t in_features,
                           const std::vector<std::int64_t>& weight_shape,
                           const std::vector<std::int64_t>& scale_shape);

}  // namespace ddo::sdnq
