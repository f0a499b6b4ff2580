/// \file
/// PackedFormat: the facts core needs about one packed (quantized) layer format, registered by
/// the format and looked up by the name an inventory's packed module carries.
///
/// Core plans packed layers by their tensors' roles (PackedRole in inventory.h): a layer's packed
/// weight, scales, zero points and low-rank factors stream as one unit, whatever wrote them. What
/// differs between formats is data: which tensor name plays which role, and how many weight values
/// one element of the packed weight holds (what the layer dequantizes to). A format registers
/// those facts once; the adapter reads the roles when it writes the inventory, and the inventory
/// reads the values when it bounds the dequantized temporaries (Note [Packed formats] in
/// packed_format.cpp). SDNQ registers itself from sdnq/ (ddo/sdnq/packed_format.h).
///
/// ```
/// ddo::core::PackedFormat nf4;
/// nf4.name = "nf4";
/// nf4.roles = {{"weight", ddo::core::PackedRole::kPackedWeight},
///              {"absmax", ddo::core::PackedRole::kScale}};
/// nf4.values_per_element = {{"uint8", 2}};
/// ddo::throw_if_error(ddo::core::register_packed_format(nf4));
/// ddo::core::find_packed_format("nf4")->role_for("absmax");  // PackedRole::kScale
/// ```
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddo/core/inventory.h"
#include "ddo/core/status.h"

namespace ddo::core {

/// One packed format's facts: plain data, so registering a format changes no code in core.
struct PackedFormat {
  /// The format's name: ModuleInfo::packed_format and the weights summary's prefix ("sdnq").
  std::string name;
  /// A packed layer's direct tensor names and their roles; a name not listed (bias) is kNone.
  std::vector<std::pair<std::string, PackedRole>> roles;
  /// Weight values one element of the packed weight holds, by the packed weight's dtype (SDNQ:
  /// "uint8" holds two uint4 values); a dtype not listed holds one.
  std::vector<std::pair<std::string, std::int64_t>> values_per_element;

  /// The role of a direct tensor of this format's layer, from its local name.
  PackedRole role_for(std::string_view tensor_name) const;
  /// The number of weight values a packed weight of `dtype` with `numel` elements holds.
  std::int64_t values_in(std::string_view dtype, std::int64_t numel) const;
  bool operator==(const PackedFormat&) const = default;  ///< field by field
};

/// Adds `format` to the process's registry. Registering the same facts again is a no-op (each
/// caller may register before use); other facts under a registered name, an empty name, a role
/// of kNone or a count below 1 are kInvalidArgument.
Status register_packed_format(const PackedFormat& format);

/// The registered format of that name, or nullptr. The pointer stays valid for the process.
const PackedFormat* find_packed_format(std::string_view name);

}  // namespace ddo::core
