// accept_layer and stored_layout (ddo/sdnq/acceptance.h): the one rule for which SDNQ layers
// ddo runs, fed by Python's module reader and the loader's checkpoint reader alike.
#include "ddo/sdnq/acceptance.h"

#include <algorithm>
#include <array>
#include <string_view>

#include "ddo/core/status.h"
#include "ddo/sdnq/layout.h"

namespace ddo::sdnq {
namespace {

struct Unsupported {
  std::string_view feature;
  std::string_view why;
};

// What ddo's dequantize lacks, in the order the reasons are given.
constexpr std::array<Unsupported, 7> kUnsupported{{
    {"use_hadamard", "sdnq_use_hadamard: not supported by ddo's dequantize"},
    {"use_codebook", "sdnq_use_codebook: not supported by ddo's dequantize"},
    {"use_codebook_scale", "sdnq_use_codebook_scale: not supported by ddo's dequantize"},
    {"scale_2", "sdnq_scale_2: double-quantized scales are not supported by ddo's dequantize"},
    {"scale_zero_point",
     "sdnq_scale_zero_point: double-quantized scales are not supported by ddo's dequantize"},
    {"zero_point_scale",
     "sdnq_zero_point_scale: double-quantized scales are not supported by ddo's dequantize"},
    {"zero_point_2",
     "sdnq_zero_point_2: double-quantized scales are not supported by ddo's dequantize"},
}};

Acceptance refuse(std::string why) {
  return {{}, std::move(why)};
}

}  // namespace

Acceptance accept_layer(const LayerFacts& f) {
  if (!f.is_linear) {
    return refuse("sdnq_" + f.module_type + ": only quantized Linear layers are streamed");
  }
  for (const Unsupported& u : kUnsupported) {
    if (std::find(f.features.begin(), f.features.end(), u.feature) != f.features.end()) {
      return refuse(std::string(u.why));
    }
  }
  if (f.weights_dtype.empty() || !f.result_dtype) {
    return refuse("sdnq_dequantizer: weights_dtype '" + f.weights_dtype + "' / result_dtype " +
                  (f.result_dtype ? std::string(c10::toString(*f.result_dtype)) : "unread") +
                  " unreadable");
  }
  if (f.out_features < 0 || f.in_features < 0) {
    return refuse("sdnq_original_shape: a Linear weight is 2-D");
  }
  if (f.transposed && f.has_svd) {
    // The matmul layout stores svd_up [r, out] and svd_down [in, r] (transposed).
    return refuse("sdnq_quantized_matmul_svd: SVD factors of the matmul layout are not supported");
  }
  try {
    const Layout layout{
        parse_quant_type(f.weights_dtype),       *f.result_dtype, f.out_features, f.in_features,
        std::max<std::int64_t>(f.group_size, 0), f.transposed,    f.transposed};
    return {Layout::decode(layout.encode()).encode(), ""};
  } catch (const std::exception& e) {
    return refuse(std::string("sdnq_layout: ") + e.what());
  }
}

StoredLayout stored_layout(bool matmul_config, std::int64_t out_features, std::int64_t in_features,
                           const std::vector<std::int64_t>& weight_shape,
                           const std::vector<std::int64_t>& scale_shape) {
  StoredLayout s;
  if (scale_shape.size() > 2) {
    const std::int64_t groups = std::max<std::int64_t>(1, scale_shape[scale_shape.size() - 2]);
    s.group_size = in_features / groups;
  }
  s.transposed = matmul_config && out_features > 1 &&
                 weight_shape == std::vector<std::int64_t>{in_features, out_features} &&
                 scale_shape == std::vector<std::int64_t>{1, out_features};
  return s;
}

}  // namespace ddo::sdnq
